"""Talking to an SGLang server over HTTP: health, server info, cache flush, streaming generate.

Streaming chunks are cumulative (`meta_info.completion_tokens` is the running count), and with
speculation one chunk can carry several tokens: each chunk's arrival time is kept with the
number of new tokens it brought. Field names of both 0.5.9 and 0.5.23 are read.

Each request has a deadline, `request_timeout_s` from when it is sent to its last chunk
(streaming included); `stall_timeout_s` bounds the silence between two chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dvfs.clock import Clock
from dvfs.engines.base import ABORTED, RequestTrace
from dvfs.errors import EngineError
from dvfs.redact import redact_url

#: How long an aborted request's stream may go on before the client disconnects it (s): SGLang
#: drops an aborted request at its next scheduler step, so its final chunk comes at once.
ABORT_GRACE_S = 5.0
#: How long one /health request may wait for an answer: a server that loads answers at once
#: (503) or refuses the connection; a listener that answers nothing is not it.
HEALTH_PROBE_S = 5.0
#: SGLang's /health runs a one-token generate and answers once the scheduler outputs anything,
#: checking every 1 s for up to its health-check timeout (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s by
#: default), so a busy server that is not hung may take that long.
HEALTH_CHECK_TIMEOUT_S = 20.0
#: The most bytes of a /server_info (or /health) answer read: SGLang's is tens of KB; a page
#: without end (a wrong engine.sglang.url) was read whole, gigabytes, before its JSON failed.
MAX_ANSWER_BYTES = 16 << 20
#: What /health gets beyond that timeout before a server whose round failed is taken for hung.
HUNG_MARGIN_S = 5.0
#: The route that asks the scheduler whether it is alive: /health does so too unless the
#: server's SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false, when it answers 200 at once
#: even with the scheduler wedged; /health_generate always runs its one-token generate
#: (0.5.9 and 0.5.23 http_server.py `health_generate`).
SCHEDULER_PROBE = "/health_generate"


def hung_probe_s(env: Mapping[str, str]) -> float:
    """How long /health may take to answer a server whose round just failed before it is taken
    for hung: the server's own health-check timeout (from the environment it runs with) and a
    margin, so a busy server is never restarted for being slow to answer."""
    try:
        timeout = float(env.get("SGLANG_HEALTH_CHECK_TIMEOUT", HEALTH_CHECK_TIMEOUT_S))
    except ValueError:  # SGLang would not start with it either; the default is its own
        timeout = HEALTH_CHECK_TIMEOUT_S
    if not math.isfinite(timeout) or timeout < 0:
        timeout = HEALTH_CHECK_TIMEOUT_S
    return timeout + HUNG_MARGIN_S


#: Speculative counters: (0.5.23 name, 0.5.9 name).
ACCEPTED_DRAFTS = ("spec_num_correct_drafts", "spec_accept_token_num")
PROPOSED_DRAFTS = ("spec_num_proposed_drafts", "spec_draft_token_num")


class EngineConnectionError(EngineError):
    """The connection to the server broke (refused, reset, closed mid-stream)."""


class RequestDeadlineError(EngineError):
    """A request did not finish within its deadline (`request_timeout_s`)."""


class _RoundEnd:
    """Ends a round where its steady window ends (`dvfs.engines.base.ROUND_END`): a fixed
    batch at its first request's finish, a closed loop at the first finish once the pool's
    last request was sent. The requests still running are aborted the way SGLang supports:
    POST /abort_request {"rid": ...} (the scheduler drops the request at its next step and
    the stream ends with finish_reason "abort"); where the server refuses that, the client
    disconnects the stream at its next chunk, which SGLang's http_server turns into an abort
    of its own."""

    def __init__(self, total: int, *, closed_loop: bool) -> None:
        self.total = total
        self.closed_loop = closed_loop
        self.sent = 0
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.disconnect: set[str] = set()
        self.responses: dict[str, Any] = {}
        self.closed: set[str] = set()  # streams that ended, one way or another
        self.ended = False
        self.task: asyncio.Task[None] | None = None
        self.all_closed = asyncio.Event()

    def started(self, rid: str) -> None:
        self.sent += 1
        self.running.add(rid)

    def close(self, rid: str) -> None:
        """A stream ended (finished, aborted or disconnected)."""
        self.closed.add(rid)
        if self.ended and self.aborted <= self.closed:
            self.all_closed.set()

    async def settled(self) -> None:
        """Wait for the round end's aborts to be answered (its grace ends once every aborted
        stream has ended)."""
        if self.task is not None:
            await self.task

    def due(self) -> bool:
        """Whether a natural finish now ends the round: not once its end is under way, even
        before that task first runs (several streams may finish in one tick of the loop)."""
        return (
            self.task is None
            and not self.ended
            and (not self.closed_loop or self.sent >= self.total)
        )


#: The most a count in meta_info may be: every count SGLang reports (tokens, verify passes,
#: drafts, retractions) is far below it, and it stays exact in float64 and int64 arrays.
MOST_COUNT = 2**53


def _whole(meta: dict[str, Any], names: str | Sequence[str], rid: str) -> int | None:
    """The first of `names` that `meta` (a chunk's meta_info) holds, as an int (None: none);
    raises when it is not a whole number from 0 to MOST_COUNT (a malformed answer, failing
    the request: a negative or huge count would be recorded as it is, or overflow an array)."""
    names = (names,) if isinstance(names, str) else names
    for name in names:
        value = meta.get(name)
        if value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MOST_COUNT:
            return value
        if isinstance(value, float) and value.is_integer() and 0 <= value <= MOST_COUNT:
            return int(value)
        raise EngineError(
            f"malformed answer from the server: meta_info.{name} of request {rid} is "
            f"{json.dumps(value)[:60]}, not a whole number from 0 to 2**53"
        )
    return None


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float
    ignore_eos: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
        }


def _httpx() -> Any:
    import httpx

    return httpx


@functools.cache
def _tls_context() -> Any:
    """One TLS context for the process: httpx would load the CA bundle afresh for each client
    (~25 ms of CPU, for each health poll and each server started), though loopback is plain."""
    import ssl

    import certifi

    return ssl.create_default_context(cafile=certifi.where())


#: What to do when a server wants an API key dvfs was not given.
KEY_HINT = (
    "the server wants an API key: give dvfs the server's --api-key (and --admin-api-key) in "
    "engine.sglang.extra_args, which dvfs sends and never records"
)


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _ranks(info: dict[str, Any]) -> list[dict[str, Any]] | None:
    """/server_info's `internal_states`, one state per scheduler rank; None where it is not a
    list of objects (a rank that is no state reports nothing either)."""
    states = info.get("internal_states")
    if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
        return None
    return states


def accept_length_of(info: dict[str, Any]) -> float | None:
    """`SglangClient.accept_length` from a /server_info answer `info` already read: unknown
    (None) where any rank reports it as other than a finite number from 0 (a string, a bool,
    NaN, a negative), or the answer has no list of ranks, rather than a traceback or a mean
    that a malformed rank made up."""
    states = _ranks(info)
    if states is None:
        return None
    raw = [s.get("avg_spec_accept_length") for s in states]
    values = [v for v in raw if v is not None]
    if not all(
        isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < math.inf for v in values
    ):
        return None
    return float(np.mean(values)) if values and any(values) else None


def rank_caps_of(info: dict[str, Any]) -> list[int] | None:
    """Each DP rank's cap on running requests, from a /server_info answer `info`: SGLang
    0.5.23's `internal_states[i].effective_max_running_requests_per_dp`
    (scheduler_components/internal_state.py), which is --max-running-requests (split over
    the attention DP ranks) lowered to what the rank's KV pool or a hybrid model's Mamba
    state cache holds (mem_cache/kv_cache_configurator.py `resolve_max_num_reqs`), so it
    may be below the arg the server reports. None where not every rank reports it as a
    whole number (0.5.9 reports none), or the answer has no list of ranks."""
    states = _ranks(info)
    if states is None:
        return None
    caps: list[Any] = [s.get("effective_max_running_requests_per_dp") for s in states]
    # SGLang gives each rank max(1, ...): a cap below 1, or one written as a string, is
    # nothing it reports (a negative one would refuse the server for it)
    if not caps or not all(
        isinstance(c, int | float)
        and not isinstance(c, bool)
        and math.isfinite(c)
        and c == int(c)
        and c >= 1
        for c in caps
    ):
        return None
    return [int(c) for c in caps]


def running_cap_of(info: dict[str, Any]) -> int | None:
    """How many requests the server's scheduler runs at once, from a /server_info answer
    `info`: `rank_caps_of` summed over its DP ranks (None where that is unknown)."""
    caps = rank_caps_of(info)
    return None if caps is None else sum(caps)


class SglangClient:
    """One server's HTTP API. Proxies from the environment are ignored (loopback stays local).

    A server started with `--api-key` answers 401 to any request but /health and /metrics
    without `Authorization: Bearer KEY`; its admin routes may want `--admin-api-key`'s key
    instead: /flush_cache is tried with the API key, then with the admin key."""

    def __init__(
        self,
        base_url: str,
        *,
        clock: Clock,
        request_timeout_s: float = 120.0,
        stall_timeout_s: float = 60.0,
        api_key: str | None = None,
        admin_api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.clock = clock
        self.request_timeout_s = request_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.headers = _bearer(api_key)
        self.admin_headers = _bearer(admin_api_key)
        #: Whether the server serves POST /abort_request (None: not asked yet).
        self.abort_route: bool | None = None
        #: The key /abort_request is sent with: the API key until the server refuses it.
        self.abort_headers = self.headers
        self._tls: Any = None

    def _verify(self) -> Any:
        """The TLS context every client shares (`_tls_context`)."""
        if self._tls is None:
            self._tls = _tls_context()
        return self._tls

    @property
    def shown_url(self) -> str:
        """The server's URL as messages (and so the journal) show it: no credentials."""
        return redact_url(self.base_url)

    # -- simple endpoints ---------------------------------------------------------------------
    def _get(self, path: str, timeout_s: float = 10.0, *, body: bool = True) -> tuple[int, bytes]:
        """GET `path`: its status and (with `body`) its answer, of at most MAX_ANSWER_BYTES
        (past them, EngineError: no SGLang answers so much) and read within `timeout_s`."""
        httpx = _httpx()
        deadline = time.monotonic() + timeout_s
        with (
            httpx.Client(
                trust_env=False, verify=self._verify(), timeout=timeout_s, headers=self.headers
            ) as client,
            client.stream("GET", self.base_url + path) as response,
        ):
            if not body:
                return int(response.status_code), b""
            chunks: list[bytes] = []
            size = 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:  # else held in memory whole, then parsed
                    raise EngineError(
                        f"{self.shown_url}{path} answered more than {MAX_ANSWER_BYTES >> 20} "
                        "MiB, far more than SGLang's: is engine.sglang.url the server?"
                    )
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(f"its answer did not come within {timeout_s:g} s")
                chunks.append(chunk)
            return int(response.status_code), b"".join(chunks)

    def health_status(self, timeout_s: float | None = None, *, path: str = "/health") -> int | None:
        """HTTP status of /health (or `path`), or None while nothing listens (or nothing
        answers within `timeout_s`; HEALTH_PROBE_S, read as it is called, where not given)."""
        httpx = _httpx()
        timeout_s = HEALTH_PROBE_S if timeout_s is None else timeout_s
        try:
            return self._get(path, timeout_s=timeout_s, body=False)[0]
        except httpx.HTTPError:
            return None

    def wait_healthy(
        self,
        timeout_s: float,
        *,
        alive: Callable[[], bool] = lambda: True,
        poll_s: float = 0.1,
        hint: str = "",
    ) -> None:
        """Until /health answers 200; raises when the process dies or time runs out (its
        message ending with `hint`, what to do then). Polls every 10 ms at first, doubling to
        `poll_s`: a quick server is seen at once, a slow one (a real model loads for tens of
        seconds) costs a request every `poll_s`."""
        deadline = time.monotonic() + timeout_s
        last = None
        wait_s = min(0.01, poll_s)
        while time.monotonic() < deadline:
            if not alive():
                raise EngineError("the server process exited while starting")
            last = self.health_status()
            if last == 200:
                return
            time.sleep(wait_s)
            wait_s = min(2 * wait_s, poll_s)
        state = "nothing listening" if last is None else f"/health answered {last}"
        raise EngineError(
            f"the server at {self.shown_url} was not ready within {timeout_s:g} s ({state})"
            + (f": {hint}" if hint else "")
        )

    def server_info(self) -> dict[str, Any]:
        """/server_info (0.5.9 and 0.5.23 also serve it as /get_server_info, deprecated)."""
        httpx = _httpx()
        answered = []
        for path in ("/server_info", "/get_server_info"):
            try:
                status, answer = self._get(path)
            except httpx.HTTPError as exc:
                raise EngineConnectionError(f"cannot read {path}: {exc}") from exc
            if status == 200:
                try:
                    info = json.loads(answer)
                except ValueError as exc:  # UnicodeDecodeError too: bytes that are not UTF-8
                    raise EngineError(
                        f"{self.shown_url}{path} did not answer JSON: is engine.sglang.url "
                        "an SGLang server?"
                    ) from exc
                if not isinstance(info, dict):
                    raise EngineError(
                        f"{self.shown_url}{path} answered {json.dumps(info)[:40]}, not a "
                        "JSON object: is engine.sglang.url an SGLang server?"
                    )
                return info
            if status in (401, 403):
                raise EngineError(f"{self.shown_url} answered {status} to {path}: {KEY_HINT}")
            answered.append(f"{status} to {path}")
        if all(a.startswith("404 ") for a in answered):
            raise EngineError(f"{self.shown_url} serves neither /server_info nor /get_server_info")
        raise EngineError(  # a 503 of a server still starting, or of a proxy before it
            f"{self.shown_url} answered {' and '.join(answered)}: is the server up and "
            "engine.sglang.url its address?"
        )

    def accept_length(self) -> float | None:
        """The server's mean accept length since the last flush (0.5.9 and 0.5.23), over the
        whole blocks of decode_log_interval decode iterations run since then (SGLang adds a
        block to it once the block is complete); None before the first block."""
        return accept_length_of(self.server_info())

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        """POST /flush_cache, retrying while the server answers 400 (requests still running)."""
        httpx = _httpx()
        deadline = time.monotonic() + timeout_s
        headers = self.headers
        with httpx.Client(trust_env=False, verify=self._verify(), timeout=10.0) as client:
            while True:
                try:
                    response = client.post(self.base_url + "/flush_cache", headers=headers)
                except httpx.HTTPError as exc:
                    raise EngineConnectionError(f"cannot flush the cache: {exc}") from exc
                if response.status_code == 200:
                    return
                if response.status_code in (401, 403):
                    if self.admin_headers and headers is not self.admin_headers:
                        headers = self.admin_headers  # an admin route: the admin key
                        continue
                    raise EngineError(f"/flush_cache answered {response.status_code}: {KEY_HINT}")
                if response.status_code != 400 or time.monotonic() > deadline:
                    raise EngineError(
                        f"{self.shown_url}/flush_cache answered {response.status_code}: "
                        f"{one_line(response.text, 200)}"
                    )
                time.sleep(0.1)

    # -- streaming generate ---------------------------------------------------------------------
    async def _request(
        self,
        client: Any,
        text: str,
        params: SamplingParams,
        rid: str,
        on_first: Callable[[int], None] | None = None,
        end: _RoundEnd | None = None,
    ) -> RequestTrace:
        """One streamed request under its total deadline."""
        try:
            return await asyncio.wait_for(
                self._stream(client, text, params, rid, on_first, end),
                timeout=self.request_timeout_s,
            )
        except TimeoutError as exc:
            raise RequestDeadlineError(
                f"request {rid} missed its deadline: not finished within "
                f"request_timeout_s = {self.request_timeout_s:g} s"
            ) from exc

    async def _stream(
        self,
        client: Any,
        text: str,
        params: SamplingParams,
        rid: str,
        on_first: Callable[[int], None] | None = None,
        end: _RoundEnd | None = None,
    ) -> RequestTrace:
        httpx = _httpx()
        body = {"text": text, "sampling_params": params.as_json(), "stream": True, "rid": rid}
        chunk_ns: list[int] = []
        chunk_tokens: list[int] = []
        seen = 0
        final: dict[str, Any] = {}
        prompt_tokens = 0
        sent_ns = self.clock.now_ns()
        if end is not None:
            end.started(rid)
        try:
            async with client.stream("POST", self.base_url + "/generate", json=body) as response:
                if response.status_code != 200:
                    detail = one_line(await _head(response), 300)
                    if response.status_code in (401, 403):
                        detail = f"{detail} ({KEY_HINT})"
                    raise EngineError(f"/generate answered HTTP {response.status_code}: {detail}")
                if end is not None:
                    end.responses[rid] = response
                async for line in response.aiter_lines():
                    if end is not None and rid in end.disconnect:
                        break  # leaving the block closes the connection: the server aborts
                    if not line.startswith("data:"):
                        continue
                    now = self.clock.now_ns()
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    try:
                        chunk = json.loads(payload)
                    except ValueError as exc:
                        raise EngineError(
                            f"malformed stream chunk from the server: {payload[:120]!r}"
                        ) from exc
                    if not isinstance(chunk, dict):
                        raise EngineError(f"unexpected stream chunk: {payload[:120]!r}")
                    if "error" in chunk:
                        err = chunk["error"]
                        message = err.get("message") if isinstance(err, dict) else err
                        raise EngineError(f"the server reported an error: {message}")
                    meta = chunk.get("meta_info")
                    if meta is None:
                        meta = {}
                    elif not isinstance(meta, dict):
                        raise EngineError(
                            f"malformed stream chunk from the server (its meta_info is not "
                            f"an object): {payload[:120]!r}"
                        )
                    count = _whole(meta, "completion_tokens", rid)
                    if count is None:
                        ids = chunk.get("output_ids") or []
                        if not isinstance(ids, list):
                            raise EngineError(
                                f"malformed stream chunk from the server (its output_ids is "
                                f"not a list): {payload[:120]!r}"
                            )
                        count = len(ids)
                    # never more than asked, stop or not, but where the server aborted the
                    # request: SGLang 0.5.23 reads an abort (`to_finish`) before the length
                    # cap, after a speculative step appended its whole verified run, and
                    # reports every token (schedule_batch.py Req.update_finish_state,
                    # output_streamer.py), up to a run less one past max_new_tokens
                    if count > params.max_new_tokens and not (
                        meta.get("finish_reason") is not None and _kind(meta, rid) == "abort"
                    ):
                        said = (
                            "meta_info.completion_tokens"
                            if meta.get("completion_tokens") is not None
                            else "the length of output_ids"
                        )
                        raise EngineError(
                            f"malformed answer from the server: {said} of request {rid} is "
                            f"{count}, more than the max_new_tokens {params.max_new_tokens} it "
                            "asked"
                        )
                    prompt_tokens = _whole(meta, "prompt_tokens", rid) or prompt_tokens
                    new = count - seen
                    if new > 0:
                        if not chunk_ns and on_first is not None:
                            on_first(now)
                        chunk_ns.append(now)
                        chunk_tokens.append(new)
                        seen = count
                    if meta.get("finish_reason") is not None:
                        final = meta
                        if end is not None and _kind(meta, rid) != "abort":
                            end.running.discard(rid)
                            if end.due():
                                end.task = asyncio.create_task(self._end_round(client, end))
        except httpx.TimeoutException as exc:
            if end is None or rid not in end.aborted:  # an aborted request may stop talking
                raise EngineError(
                    f"stream stalled: no data from the server for "
                    f"{self.stall_timeout_s:g} s (request {rid})"
                ) from exc
        except (httpx.TransportError, httpx.StreamError) as exc:
            if end is None or rid not in end.disconnect:  # not the client's own disconnect
                raise EngineConnectionError(
                    f"connection to the server broke during request {rid}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        finally:
            if end is not None:
                end.close(rid)
        ours = end is not None and rid in end.aborted
        if not final and not ours:
            raise EngineError(f"the stream of request {rid} ended without a final chunk")
        kind = _kind(final, rid) if final else "abort"
        if kind == "abort" and not ours:
            finish = final.get("finish_reason")
            message = finish.get("message", "") if isinstance(finish, dict) else ""
            message = one_line(str(message), 300)
            raise EngineError(f"the server aborted request {rid} after {seen} tokens {message}")
        if kind == "abort":
            kind = ABORTED  # aborted at the window's end: it keeps the tokens it received
        elif params.ignore_eos and seen != params.max_new_tokens:
            raise EngineError(
                f"request {rid} finished after {seen} of {params.max_new_tokens} "
                f"tokens (finish_reason {kind}) although ignore_eos was set"
            )
        # SGLang puts the speculative counters (and retractions) in the final chunk only
        # (TokenizerManager._handle_batch_output adds them once the request finished), so a
        # stream the client disconnected never got them: the trace says they were lost
        # rather than that the request did not speculate (`dvfs.measure.meter.acceptance`).
        retractions = _whole(final, ("num_retractions", "total_retractions"), rid) or 0
        verify = _whole(final, ("spec_verify_ct",), rid)
        accepted = _whole(final, ACCEPTED_DRAFTS, rid)
        proposed = _whole(final, PROPOSED_DRAFTS, rid)
        _check_spec_counts(rid, seen, verify)
        return RequestTrace(
            sent_ns=sent_ns,
            chunk_ns=np.array(chunk_ns, dtype=np.int64),
            chunk_tokens=np.array(chunk_tokens, dtype=np.int64),
            prompt_tokens=prompt_tokens,
            completion_tokens=seen,
            finish_reason=kind,
            spec_verify_ct=verify,
            spec_accepted_drafts=accepted,
            spec_proposed_drafts=proposed,
            retractions=retractions,
            final_lost=not final,
        )

    async def _end_round(self, client: Any, end: _RoundEnd) -> None:
        """Abort the round's requests still running (`_RoundEnd`), all at once."""
        end.ended = True
        rids = sorted(end.running)
        end.aborted.update(rids)
        if end.aborted <= end.closed:
            end.all_closed.set()
        if self.abort_route is False:  # the server refused before: disconnect at once
            refused = [True] * len(rids)
        else:
            refused = await asyncio.gather(*(self._abort(client, rid) for rid in rids))
        for rid, no in zip(rids, refused, strict=True):
            if no:
                await self._disconnect(end, rid)
        if not all(refused):
            try:
                await asyncio.wait_for(end.all_closed.wait(), ABORT_GRACE_S)
            except TimeoutError:
                for rid in rids:  # a stream the server did not end after its abort
                    if rid not in end.closed:
                        await self._disconnect(end, rid)

    @staticmethod
    async def _disconnect(end: _RoundEnd, rid: str) -> None:
        """Close a request's connection now (SGLang's http_server then aborts it)."""
        response = end.responses.get(rid)
        end.disconnect.add(rid)
        if response is not None and rid not in end.closed:
            with contextlib.suppress(_httpx().HTTPError):
                await response.aclose()

    async def _abort(self, client: Any, rid: str) -> bool:
        """POST /abort_request for one request; whether the server refused it. An admin
        route, as /flush_cache (SGLang's ADMIN_OPTIONAL): a server with an admin key refuses
        the API key, so the admin key is tried on a 401 or 403 and kept from then on."""
        httpx = _httpx()
        while True:
            headers = self.abort_headers
            try:
                response = await client.post(
                    self.base_url + "/abort_request",
                    json={"rid": rid},
                    timeout=10.0,
                    headers=headers,
                )
            except httpx.HTTPError:
                return True
            admin = self.admin_headers
            if response.status_code not in (401, 403) or not admin or headers is admin:
                break
            self.abort_headers = admin
        if response.status_code in (404, 405):
            self.abort_route = False  # an SGLang without the route: disconnect from now on
        elif response.status_code == 200:
            self.abort_route = True
        return response.status_code != 200

    def _async_client(self, connections: int) -> Any:
        httpx = _httpx()
        timeout = httpx.Timeout(
            connect=10.0, read=self.stall_timeout_s, write=10.0, pool=self.request_timeout_s
        )
        limits = httpx.Limits(
            max_connections=connections + 4, max_keepalive_connections=connections + 4
        )
        return httpx.AsyncClient(
            trust_env=False,
            verify=self._verify(),
            timeout=timeout,
            limits=limits,
            headers=self.headers,
        )

    def run_batch(
        self,
        texts: Sequence[str],
        params: SamplingParams,
        tag: str,
        on_started: Callable[[int], None] | None = None,
        *,
        end_at_window: bool = False,
    ) -> list[RequestTrace]:
        """All requests at once (a fixed batch): the server decodes them together.
        `on_started(t_ns)` is called once every request has its first token (the decode's
        start), from the event loop: it must return at once. With `end_at_window` the first
        request to finish ends the round: the others are aborted (`_RoundEnd`)."""
        waiting = [len(texts)]
        end = _RoundEnd(len(texts), closed_loop=False) if end_at_window else None

        def first(t_ns: int) -> None:
            waiting[0] -= 1
            if waiting[0] == 0 and on_started is not None:
                on_started(t_ns)

        async def main() -> list[RequestTrace]:
            async with self._async_client(len(texts)) as client:
                traces = await _every_request(
                    self._request(client, t, params, rid, first, end)
                    for rid, t in zip(request_ids(tag, len(texts)), texts, strict=True)
                )
                if end is not None:
                    await end.settled()
                return traces

        return asyncio.run(main())

    def run_closed_loop(
        self,
        texts: Sequence[str],
        params: SamplingParams,
        concurrency: int,
        tag: str,
        *,
        end_at_window: bool = False,
    ) -> list[RequestTrace]:
        """Keep `concurrency` requests in flight until the pool is used up; with
        `end_at_window`, until the first finish once the last request was sent, the others
        then aborted (`_RoundEnd`)."""
        end = _RoundEnd(len(texts), closed_loop=True) if end_at_window else None

        async def main() -> list[RequestTrace]:
            gate = asyncio.Semaphore(concurrency)
            async with self._async_client(concurrency) as client:

                async def one(rid: str, text: str) -> RequestTrace:
                    async with gate:
                        return await self._request(client, text, params, rid, None, end)

                rids = request_ids(tag, len(texts))
                traces = await _every_request(map(one, rids, texts))
                if end is not None:
                    await end.settled()
                return traces

        return asyncio.run(main())


async def _every_request(requests: Iterable[Awaitable[RequestTrace]]) -> list[RequestTrace]:
    """Every request's trace, in order. When one fails, the others are cancelled (which closes
    their connections: the server aborts them) and waited for before its error is raised, so
    none is left running to fail unseen as the client closes (asyncio would log each such
    failure with its traceback as `asyncio.run` shuts down)."""
    tasks = [asyncio.ensure_future(r) for r in requests]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def request_ids(tag: str, count: int) -> list[str]:
    """The rids of a round's `count` requests: `tag`, then each index zero-padded to one
    width. SGLang's scheduler aborts every request whose rid starts with the rid it is
    given (`req.rid.startswith(recv_req.rid)`), so no rid may begin another: "tag-1" would
    take "tag-10".."tag-19" with it. One width makes a round's rids prefix-free, and the
    round in `tag` (ended by "-") keeps rounds apart."""
    width = len(str(max(count - 1, 0)))
    return [f"{tag}-{i:0{width}d}" for i in range(count)]


def _check_spec_counts(rid: str, tokens: int, verify: int | None) -> None:
    """Refuse speculative counters no server can report (they would be recorded as accept
    lengths below 1): more verify passes than the request's `tokens` (each pass yields one
    token at least, and the first comes from the prefill). More drafts accepted than
    proposed are no such thing: SGLang 0.5.23's TokenizerManager counts the drafts proposed
    as spec_verify_ct times its static speculative_num_draft_tokens - 1, which an adaptive
    server (--speculative-adaptive) outgrows as it raises its steps at run time."""
    if verify is not None and verify > tokens:
        raise EngineError(
            f"malformed answer from the server: meta_info.spec_verify_ct of request {rid} is "
            f"{verify}, more than its {tokens} tokens (each verify pass yields one at least)"
        )


#: The most bytes of an error answer's body read for its message (an HTML page may be long).
ERROR_BODY_BYTES = 4096


async def _head(response: Any) -> str:
    """The start of an error answer's body, as text: its first ERROR_BODY_BYTES bytes at most
    (the rest is not read; the connection is closed with the stream)."""
    head = b""
    async for chunk in response.aiter_bytes():
        head += chunk
        if len(head) >= ERROR_BODY_BYTES:
            break
    return head[:ERROR_BODY_BYTES].decode(errors="replace")


def one_line(text: str, limit: int) -> str:
    """`text` (a server's answer) as one printable line of at most `limit` characters: an
    HTML error page's lines joined, control characters escaped, so a refusal stays one line."""
    flat = " ".join(text.split())
    flat = "".join(c if c.isprintable() else repr(c)[1:-1] for c in flat)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


#: The most characters of a finish reason's type kept (SGLang's are "length", "stop",
#: "abort": schedule_batch.py `BaseFinishReason.to_json`).
KIND_CHARS = 40


def _kind(meta: dict[str, Any], rid: str) -> str:
    """A final chunk's finish reason: "length", "stop", "abort" (SGLang's `{"type": ...}`,
    or the type alone), as one short printable line. Any other value (a list, a null or
    non-string type, a number) is no SGLang's: refused (EngineError) rather than read as its
    string, which took a list that says abort for a request that finished."""
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if not isinstance(kind, str):
        raise EngineError(
            f"malformed answer from the server: request {rid} finished with finish_reason "
            f"{one_line(repr(finish), 120)}, which no SGLang sends (an object with a string "
            "type: length, stop or abort): measure with an SGLang server answering dvfs "
            "directly, not through something that rewrites its answers"
        )
    return one_line(kind, KIND_CHARS)


def probe_server(
    url: str,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    *,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[str, str]:
    """For `dvfs doctor`: is a server answering at `url`, and which SGLang is it? `check`
    refuses (EngineError) what its /server_info says it serves, as the sweep would."""
    from dvfs.clock import MonotonicClock

    client = SglangClient(url, clock=MonotonicClock(), api_key=api_key, admin_api_key=admin_api_key)
    status = client.health_status()
    shown = client.shown_url
    if status != 200:
        return "fail", f"no healthy server at {shown} (/health: {status or 'no answer'})"
    try:
        info = client.server_info()
        if check is not None:
            check(info)
    except EngineError as exc:
        return "fail", str(exc)
    model = info.get("model_path", "?")
    return "ok", f"SGLang {info.get('version', '?')} at {shown}, model {model}"
