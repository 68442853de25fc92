"""Reading the live numbers: the SGLang server's Prometheus page and the GPUs' meters, joined.

Parsing and the energy-per-token join are pure (text or readings in, numbers out);
`ServerReader` (`scrape`: one read) and `read_gpu` are the edges that talk to the outside.
SGLang's names (its metrics collector, `--enable-metrics`; read in 0.5.9's and 0.5.23's
metrics collectors): `sglang:num_running_reqs` (gauge, one series per scheduler, labelled with
its `tp_rank`, `moe_ep_rank`, `pp_rank` and, under data parallelism, `dp_rank`: summed over the
batches, each batch once: the ranks of one tensor-parallel group share theirs, which
`--enable-metrics-for-all-schedulers` has every one of them report; with
`--enable-priority-scheduling` the total under `priority=""` beside one series per priority,
which are its parts), `sglang:realtime_tokens_total{mode="decode"}` (counter, each scheduler's
tokens decoded, grown every decode iteration: the tokens of an interval; one per
tensor-parallel group, as the batches), `sglang:generation_tokens_total` (counter, summed; it
grows only as a request finishes, by its whole output: read where the decode counter is
missing) and `sglang:spec_accept_length` (gauge, averaged over the series above 0: SGLang
exports it at 0 without a speculative algorithm, and before a verify pass), and whether
`sglang:gen_throughput` is above 0 (set, as the accept length gauge, only at the scheduler's
periodic decode log: until then 0 says nothing of speculation).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dvfs.errors import DvfsError, GpuError, GpuNotSupportedError
from dvfs.gpu.base import Gpu
from dvfs.redact import redact_url

RUNNING = "sglang:num_running_reqs"
GENERATED = "sglang:generation_tokens_total"
DECODED = "sglang:realtime_tokens_total"
PRIORITY = "priority"
ACCEPT_LENGTH = "sglang:spec_accept_length"
#: A gauge SGLang's scheduler sets, with the accept length, only at its periodic decode log
#: (every `--decode-log-interval` decode iterations, 40 unless set): 0 until the first one.
GEN_THROUGHPUT = "sglang:gen_throughput"
#: The labels of a scheduler's rank within its tensor-parallel group (SGLang's
#: SchedulerMetricsMixin): its tensor-parallel rank, and its expert-parallel rank, which
#: SGLang derives from it (tp_rank // (tp_size // ep_size): every rank its own under --ep-size).
TP_RANK = "tp_rank"
MOE_EP_RANK = "moe_ep_rank"
IN_GROUP = frozenset({TP_RANK, MOE_EP_RANK})


#: The most bytes of a /metrics page read: SGLang's is tens of KB; a page without end (a wrong
#: --url, a broken server) read whole until the timeout took gigabytes within a second.
MAX_PAGE_BYTES = 16 << 20


#: The most requests a server's /metrics may say run at once: each running request holds a
#: row of SGLang's req_to_token pool (context-length int32s) and its KV cache, which no GPU
#: holds ten million of; more is a damaged page or another program at --url.
MAX_RUNNING = 10_000_000


class ScrapeError(DvfsError):
    """The server's /metrics could not be read or lacks what the governor needs."""


class ServerDownError(ScrapeError):
    """Nothing answered at the server's address (refused, unreachable, timed out): unlike a
    page without SGLang's metrics, the fix is to start the server or correct --url."""


@dataclass(frozen=True)
class ServerSample:
    """What one read of the server's /metrics says."""

    running: int
    generated_tokens: float | None
    accept_length: float | None
    #: tokens decoded so far (every decode iteration; None where the server has no such
    #: counter yet): what an interval's energy per token divides by
    decoded_tokens: float | None = None
    #: whether the scheduler has logged a decode interval (its gen_throughput gauge above 0),
    #: which sets the accept length gauge too; None where the page has no such gauge
    decode_logged: bool | None = None

    def token_count(self) -> tuple[str, float] | None:
        """The counter an interval's tokens are read from, and its value: the decode counter,
        else the generated-token counter (which moves only as requests finish). Two samples'
        counts compare only when they name the same counter."""
        if self.decoded_tokens is not None:
            return DECODED, self.decoded_tokens
        if self.generated_tokens is not None:
            return GENERATED, self.generated_tokens
        return None


def parse_server_metrics(text: str) -> ServerSample:
    """The running batch, token counters and accept length from a Prometheus page."""
    from prometheus_client.parser import text_string_to_metric_families

    generated: list[float] = []
    accept: list[float] = []
    throughput: list[float] = []
    batches: dict[tuple[tuple[str, str], ...], float] = {}
    decoded: dict[tuple[tuple[str, str], ...], float] = {}
    running_seen = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                value, labels = sample.value, sample.labels
                if not math.isfinite(value):
                    continue
                if sample.name == RUNNING:
                    running_seen = True
                    if labels.get(PRIORITY, ""):
                        continue  # one priority's share of the total under priority=""
                    _most_in_group(batches, labels, value)
                elif sample.name == DECODED and labels.get("mode") == "decode":
                    _most_in_group(decoded, labels, value)
                elif sample.name == GENERATED:
                    generated.append(value)
                elif sample.name == ACCEPT_LENGTH and value > 0:
                    accept.append(value)
                elif sample.name == GEN_THROUGHPUT:
                    throughput.append(value)
    except ValueError as exc:
        raise ScrapeError(f"the server's /metrics is not Prometheus text ({_quoted(exc)})") from exc
    if not running_seen:
        raise ScrapeError(
            f"the server's /metrics has no {RUNNING}: is it SGLang, started with --enable-metrics?"
        )
    # Finite values can add up to infinity (two series of 1e308): no batch (round() of it
    # raised OverflowError, which ended the governor) and no token count.
    if not all(
        math.isfinite(sum(values))
        for values in (batches.values(), decoded.values(), generated, accept)
    ):
        raise ScrapeError(
            "the server's /metrics holds values too large to add up: is --url an SGLang server?"
        )
    running = sum(batches.values())
    if running > MAX_RUNNING:
        # finite yet no server's: a 1e300 reached the governor's log line as 301 digits
        raise ScrapeError(
            f"the server's /metrics says {running:.3g} requests are running, more than any "
            f"server runs ({MAX_RUNNING:,} at most): is --url an SGLang server?"
        )
    return ServerSample(
        running=max(0, round(running)),
        generated_tokens=sum(generated) if generated else None,
        accept_length=sum(accept) / len(accept) if accept else None,
        decoded_tokens=sum(decoded.values()) if decoded else None,
        decode_logged=any(v > 0 for v in throughput) if throughput else None,
    )


#: The most characters of the parser's complaint said in a note (it quotes the page's line).
QUOTED_CHARS = 160


def _quoted(exc: ValueError) -> str:
    """The parser's complaint, which quotes the page's line it stopped at, as a short printable
    excerpt: a page of one line of megabytes (a JSON endpoint at --url) went into the journal
    whole, and a control character made journalctl show the note as blob data."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(exc)[: QUOTED_CHARS + 1])
    return text if len(text) <= QUOTED_CHARS else text[: QUOTED_CHARS - 3] + "..."


def _most_in_group(
    groups: dict[tuple[tuple[str, str], ...], float], labels: dict[str, str], value: float
) -> None:
    """One value per scheduler but for its rank in its tensor-parallel group (the ranks of a
    group report the same batch and the same tokens)."""
    group = tuple(sorted((k, v) for k, v in labels.items() if k not in IN_GROUP))
    groups[group] = max(groups.get(group, 0.0), value)


def metrics_url(url: str) -> str:
    """The /metrics address of a server given by its base URL (or by /metrics itself): the
    path ends in /metrics, a query is kept after it and a fragment (never sent) dropped."""
    import httpx

    parsed = httpx.URL(url)
    # The path as written (percent-encoded): decoded, an escaped "/" (%2F) would become a
    # separator and an escaped "?" or "#" a path httpx refuses.
    path, sep, query = parsed.raw_path.partition(b"?")
    path = path.rstrip(b"/")
    if not path.endswith(b"/metrics"):
        path += b"/metrics"
    return str(parsed.copy_with(raw_path=path + sep + query, fragment=None))


def check_url(url: str) -> str:
    """Why `url` cannot be a server's address, or "" when it can (http or https, a host, a
    port from 1 to 65535 if any)."""
    import httpx

    try:
        parsed = httpx.URL(url)
        if parsed.host:  # a punycode label that does not decode raises here
            # as the socket layer encodes the name: one it cannot (an empty label, "a..b")
            # would end the first read in a UnicodeError
            parsed.raw_host.decode("ascii").encode("idna")
    except (httpx.InvalidURL, TypeError, ValueError) as exc:  # UnicodeError is a ValueError
        return f"{redact_url(str(url))!r} is not a URL ({exc})"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return f"{redact_url(url)!r} is not an http(s)://HOST:PORT address"
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        # the socket layer would take it modulo 65536: another port's server, read silently
        return f"{redact_url(url)!r} has port {parsed.port}, not one from 1 to 65535"
    return ""


class ServerReader:
    """Reads one server's /metrics, every interval, through one HTTP client: its connection is
    kept alive and its TLS context built once (a client per read builds both again, tens of
    milliseconds of CPU each interval: most of a governor's work). A context manager; `close`
    ends the connection. `transport`: an httpx transport to read through (tests)."""

    def __init__(self, url: str, timeout_s: float, *, transport: Any = None) -> None:
        import httpx

        self.address = metrics_url(url)
        #: The address as messages (and the service's log) name it: no credentials.
        self.shown = redact_url(self.address)
        self.timeout_s = timeout_s
        self._client = httpx.Client(timeout=timeout_s, transport=transport)

    def __call__(self, timeout_s: float | None = None) -> ServerSample:
        """Read and parse the server's /metrics; every failure is one ScrapeError line. The
        whole page must come within the timeout (the reader's, or `timeout_s` for this read):
        httpx's bounds each wait for bytes alone, so a page trickling in a few bytes at a time
        would hold the loop (a governor at a cap the load has outgrown) for as long as it
        trickles."""
        import httpx

        address = self.shown
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            with self._client.stream("GET", self.address, timeout=timeout_s) as response:
                chunks = []
                size = 0
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > MAX_PAGE_BYTES:  # else held in memory whole, and parsed
                        raise ScrapeError(
                            f"{address}: its page holds more than {MAX_PAGE_BYTES >> 20} MiB, "
                            "far more than SGLang's /metrics: is --url the server?"
                        )
                    if time.monotonic() > deadline:
                        raise ServerDownError(
                            f"cannot read {address}: its page did not come within {timeout_s:g} s"
                        )
                text = _decoded(b"".join(chunks), response.encoding)
        except httpx.HTTPError as exc:
            raise ServerDownError(f"cannot read {address}: {exc or type(exc).__name__}") from exc
        if response.status_code == 404:
            raise ScrapeError(f"{address} answered 404: start SGLang with --enable-metrics")
        if response.status_code != 200:
            raise ScrapeError(f"{address} answered HTTP {response.status_code}")
        try:
            return parse_server_metrics(text)
        except ScrapeError as exc:
            raise ScrapeError(f"{address}: {exc}") from exc

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ServerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decoded(page: bytes, charset: str | None) -> str:
    """The page as text, in the charset its Content-Type names, else UTF-8 (Prometheus' own).
    A charset that cannot decode with replacement is no charset: a bytes codec (base64, rot13:
    LookupError) or one that refuses it or still fails (idna, punycode, undefined: a
    UnicodeError), each of which ended the governor."""
    try:
        return page.decode(charset or "utf-8", errors="replace")
    except (LookupError, ValueError):  # a UnicodeError is a ValueError
        return page.decode("utf-8", errors="replace")


def scrape(url: str, timeout_s: float) -> ServerSample:
    """One read of the server's /metrics (a loop reads through one `ServerReader`)."""
    with ServerReader(url, timeout_s) as read:
        return read()


@dataclass(frozen=True)
class GpuReading:
    """One GPU's meters at one moment (None: the GPU does not report it). `error`: why the GPU
    did not answer this read (an NVML error other than NotSupported, its meters then all None):
    a GPU fallen off the bus, one needing a reset, a driver error on it."""

    index: int
    uuid: str
    power_w: float | None
    energy_j: float | None
    sm_clock_mhz: int | None
    power_limit_w: float | None
    error: str | None = None


def read_gpu(gpu: Gpu) -> GpuReading:
    """Read a GPU's meters; a meter the GPU does not support is None rather than an error. A
    GPU that does not answer (any other NVML error) is read no further this time: its reading
    says why (`GpuReading.error`), its meters None."""
    ident = gpu.identity
    values: list[float | None] = []
    for read in (gpu.energy_mj, gpu.power_mw, gpu.sm_clock_mhz, gpu.enforced_power_limit_mw):
        try:
            values.append(float(read()))
        except GpuNotSupportedError:
            values.append(None)
        except GpuError as exc:
            why = str(exc).removeprefix(f"GPU {ident.index}: ")
            return GpuReading(ident.index, ident.uuid, None, None, None, None, error=why)
    energy, power, clock, limit = values
    return GpuReading(
        ident.index,
        ident.uuid,
        None if power is None else power / 1000,
        None if energy is None else energy / 1000,
        None if clock is None else int(clock),
        None if limit is None else limit / 1000,
    )


def energy_per_token(
    energy_before_j: float | None,
    energy_after_j: float | None,
    tokens_before: float | None,
    tokens_after: float | None,
) -> float:
    """Joules per generated token over an interval: energy delta / token delta.

    NaN when it cannot be known: a missing reading, no token generated, or a counter that went
    backwards (the server or the driver restarted).
    """
    if None in (energy_before_j, energy_after_j, tokens_before, tokens_after):
        return math.nan
    assert energy_before_j is not None and energy_after_j is not None
    assert tokens_before is not None and tokens_after is not None
    tokens = tokens_after - tokens_before
    energy = energy_after_j - energy_before_j
    if tokens <= 0 or energy < 0:
        return math.nan
    return energy / tokens


def server_energy_per_token(
    before: Sequence[GpuReading],
    after: Sequence[GpuReading],
    tokens_before: float | None,
    tokens_after: float | None,
) -> float:
    """Joules per token for the whole server: the summed energy of its GPUs over the tokens."""
    if len(before) != len(after) or any(r.energy_j is None for r in (*before, *after)):
        return math.nan
    total_before = sum(r.energy_j for r in before if r.energy_j is not None)
    total_after = sum(r.energy_j for r in after if r.energy_j is not None)
    return energy_per_token(total_before, total_after, tokens_before, tokens_after)
