"""The `Engine` protocol: start a server with a drafter, decode a workload, report token timings.

Timestamps are integers on the runner's `Clock` (ns), so the meter can line token arrivals up
with the energy counter's samples.

In-flight stepping (`dvfs.measure.inflight`) changes the knob while a fixed batch decodes:
`Engine.run(workload, timeline)` takes a `KnobTimeline`, steps timed from the decode's start
(the instant every request of the batch has its first token). The engine runs each step's
callback in order, at its instant or as soon after as it can (the twin at the next forward
pass boundary, in virtual time; SGLang on a stepping thread beside the streaming requests),
never before, and reports when each ran: `RoundResult.knob_begun_ns` the instant its callback
was called, `RoundResult.knob_ns` the instant it returned (a setter takes one NVML call or
more, so the knob is changing in between); steps due after the decode ended do not run. The
callbacks apply knobs through the sweep's `KnobController`, so the safety layer records and
restores every change. Without a timeline nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dvfs.campaign.model import DrafterSpec
from dvfs.corpora import Prompt


@dataclass(frozen=True)
class Workload:
    """What one measurement round asks of the engine."""

    batch: int
    prompts: tuple[Prompt, ...]
    corpus: str
    max_new_tokens: int
    temperature: float
    ignore_eos: bool
    mode: str = "fixed"
    seed: int = 0
    #: End the round where its steady window ends (`ROUND_END` below): the requests still
    #: running then are aborted, so no GPU time goes to draining a batch nobody measures.
    end_at_window: bool = False

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError("batch must be >= 1")
        if len(self.prompts) < self.batch:
            raise ValueError(f"{len(self.prompts)} prompts for a batch of {self.batch}")
        if self.mode == "fixed" and len(self.prompts) != self.batch:
            raise ValueError("fixed-batch mode sends exactly one prompt per slot")


#: How a round ends with `Workload.end_at_window`, as the cube's `round_end` says: a fixed
#: batch when its first request finishes (the steady window's end: the batch is no longer
#: full), a closed loop when concurrency drops below the batch after the pool's last request
#: was sent. The requests still running are aborted (finish_reason "abort") and keep the
#: tokens they received; latency and acceptance statistics use those tokens.
ROUND_END = "window"
#: The finish reason of a request the client aborted at the window's end.
ABORTED = "abort"


@dataclass(frozen=True)
class RequestTrace:
    """One request as the client saw it: when each chunk arrived and how many tokens it added."""

    sent_ns: int
    chunk_ns: np.ndarray
    chunk_tokens: np.ndarray
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    spec_verify_ct: int | None = None
    spec_accepted_drafts: int | None = None
    spec_proposed_drafts: int | None = None
    retractions: int = 0
    error: str | None = None
    #: The stream ended without its final chunk (the client disconnected it at the round's
    #: end, on a server without /abort_request): SGLang sends a request's speculative counters
    #: and retractions in that chunk only, so they are unknown, not zero.
    final_lost: bool = False

    def __post_init__(self) -> None:
        if np.asarray(self.chunk_ns).dtype.kind not in "iu":  # the meter casts them to int64
            raise ValueError("chunk_ns must be integer nanoseconds")
        if len(self.chunk_ns) != len(self.chunk_tokens):
            raise ValueError("chunk_ns and chunk_tokens differ in length")
        if self.error is None and int(np.sum(self.chunk_tokens)) != self.completion_tokens:
            raise ValueError(
                f"chunks carry {int(np.sum(self.chunk_tokens))} tokens, "
                f"completion_tokens says {self.completion_tokens}"
            )
        if len(self.chunk_ns) > 1 and np.any(np.diff(self.chunk_ns) < 0):
            raise ValueError("chunk timestamps go backwards")

    @classmethod
    def trusted(
        cls,
        sent_ns: int,
        chunk_ns: np.ndarray,
        chunk_tokens: np.ndarray,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str | None = None,
        spec_verify_ct: int | None = None,
        spec_accepted_drafts: int | None = None,
        spec_proposed_drafts: int | None = None,
    ) -> RequestTrace:
        """A trace whose round was checked as a whole (`check_chunks`), skipping the per-trace
        checks: the twin builds hundreds of thousands of traces, and checking each one alone
        cost more than simulating its round."""
        trace = object.__new__(cls)
        trace.__dict__.update(
            sent_ns=sent_ns,
            chunk_ns=chunk_ns,
            chunk_tokens=chunk_tokens,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=finish_reason,
            spec_verify_ct=spec_verify_ct,
            spec_accepted_drafts=spec_accepted_drafts,
            spec_proposed_drafts=spec_proposed_drafts,
            retractions=0,
            error=None,
            final_lost=False,
        )
        return trace

    @property
    def aborted(self) -> bool:
        """Whether the round's end aborted this request before it finished."""
        return self.finish_reason == ABORTED

    @property
    def first_token_ns(self) -> int | None:
        return int(self.chunk_ns[0]) if len(self.chunk_ns) else None

    @property
    def finished_ns(self) -> int | None:
        return int(self.chunk_ns[-1]) if len(self.chunk_ns) else None


def check_chunks(
    chunk_ns: np.ndarray, chunk_tokens: np.ndarray, counts: np.ndarray, completion: np.ndarray
) -> None:
    """`RequestTrace`'s checks for a whole round at once: row i holds request i's chunks in
    its first `counts[i]` columns, which must not go backwards in time and must carry
    `completion[i]` tokens."""
    if chunk_ns.shape != chunk_tokens.shape:
        raise ValueError("chunk_ns and chunk_tokens differ in shape")
    check_chunk_tokens(chunk_tokens, counts, completion)
    check_chunk_times(chunk_ns, counts)


def check_chunk_tokens(
    chunk_tokens: np.ndarray, counts: np.ndarray, completion: np.ndarray
) -> None:
    """The token half of `check_chunks` (a producer may check it once for many rounds)."""
    if len(counts) != len(chunk_tokens) or len(completion) != len(chunk_tokens):
        raise ValueError("chunk_tokens, counts and completion differ in shape")
    used = np.arange(chunk_tokens.shape[1]) < counts[:, None]
    if np.any(np.where(used, chunk_tokens, 0).sum(axis=1) != completion):
        raise ValueError("chunks carry a different token count than completion_tokens says")


def check_chunk_times(chunk_ns: np.ndarray, counts: np.ndarray) -> None:
    """The time half of `check_chunks`."""
    if chunk_ns.dtype.kind not in "iu":  # as `RequestTrace` requires of each trace
        raise ValueError("chunk_ns must be integer nanoseconds")
    if len(counts) != len(chunk_ns):
        raise ValueError("chunk_ns and counts differ in shape")
    used = np.arange(chunk_ns.shape[1]) < counts[:, None]
    if np.any((np.diff(chunk_ns, axis=1) < 0) & used[:, 1:]):
        raise ValueError("chunk timestamps go backwards")


@dataclass(frozen=True)
class KnobStep:
    """One knob change inside a round: `apply` runs `at_s` seconds after the decode starts."""

    at_s: float
    apply: Callable[[], None]


@dataclass(frozen=True)
class KnobTimeline:
    """Knob changes to make while a fixed batch decodes, in time order (see the module)."""

    steps: tuple[KnobStep, ...]

    def __post_init__(self) -> None:
        at = [s.at_s for s in self.steps]
        if any(not a >= 0 for a in at):
            raise ValueError("knob steps must come at or after the decode's start")
        if any(b < a for a, b in zip(at, at[1:], strict=False)):
            raise ValueError("knob steps must be in time order")


#: Where a round's GPU time and energy go, in this order: the prefill passes, the drafter's
#: passes (draft steps, the draft-extend pass, n-gram's host lookup), the target's decode passes
#: (the verify pass under speculation, every decode step without), and the host overhead and
#: idle time the passes leave (scheduling and launches, gaps between passes).
SPLIT_PARTS = ("prefill", "draft", "verify", "overhead")
_SUM = np.add.reduce
ROLE_PREFILL, ROLE_DRAFT, ROLE_VERIFY = 0, 1, 2


@dataclass(frozen=True)
class PassLedger:
    """A round's forward passes as an engine that simulates them knows them (the twin): when
    each ended (ns on the runner's clock), how long it ran and at what mean power (one GPU's),
    its role (`ROLE_*`) and the host overhead inside it (s, at idle power). A real server
    reports none: its `RoundResult.ledger` is None."""

    ends_ns: np.ndarray
    duration_s: np.ndarray
    power_w: np.ndarray
    role: np.ndarray
    host_s: np.ndarray
    idle_power_w: float

    def split(self, start_ns: int, end_ns: int) -> tuple[np.ndarray, np.ndarray]:
        """Energy (J, one GPU's) and time (s) over [start_ns, end_ns], one entry per
        `SPLIT_PARTS` entry: each pass's overlap with the interval (power is constant inside
        a pass) goes to its role, less its host overhead, which goes to "overhead" with the
        time no pass covers, both at idle power. The times add up to the interval's length."""
        ends = self.ends_ns
        dur_ns = np.rint(self.duration_s * 1e9)  # np.round's own step with no decimals
        # np.clip(x, 0, None) is np.maximum(x, 0) (NaN kept), without clip's argument handling
        overlap_ns = np.maximum(
            np.minimum(ends, end_ns) - np.maximum(ends - dur_ns, start_ns), 0
        ).astype(float, copy=False)
        share = overlap_ns / np.maximum(dur_ns, 1.0)
        host_s = self.host_s * share
        busy_s = overlap_ns * 1e-9 - host_s
        busy_j = self.duration_s * self.power_w * share - host_s * self.idle_power_w
        parts = len(SPLIT_PARTS)
        energy = np.bincount(self.role, weights=busy_j, minlength=parts)
        time = np.bincount(self.role, weights=busy_s, minlength=parts)
        # (np.add.reduce is what ndarray.sum calls, without its dispatch)
        gap_s = max(0.0, (end_ns - start_ns) * 1e-9 - float(_SUM(overlap_ns)) * 1e-9)
        time[-1] = float(_SUM(host_s)) + gap_s
        energy[-1] = time[-1] * self.idle_power_w
        return energy, time


#: SGLang's default --decode-log-interval (0.5.9 and 0.5.23), which dvfs leaves as it is: the
#: decode iterations per block of /server_info's accept length.
DECODE_LOG_INTERVAL = 40


def server_accept_covers(
    requests: Sequence[RequestTrace], concurrency: int, interval: int = DECODE_LOG_INTERVAL
) -> float:
    """At least the share of a round's decode iterations that the server's accept length
    covers. SGLang adds a block's counters to that average only once `interval` decode
    iterations have run since the flush (0.5.9 `log_decode_stats`, 0.5.23
    `report_decode_stats`), so a round of N iterations is covered for floor(N / interval)
    whole blocks, all but at most `interval` - 1 iterations. N is not reported; it is at
    least the most verify passes one request took, and the verify passes of all over the
    requests running at once (`concurrency`), which bounds the share from below."""
    verify = [r.spec_verify_ct for r in requests if r.spec_verify_ct is not None]
    if not verify or interval < 1:
        return 0.0
    iterations = max(max(verify), -(-sum(verify) // max(concurrency, 1)))
    return max(0.0, 1.0 - (interval - 1) / iterations) if iterations else 0.0


@dataclass(frozen=True)
class RoundArrays:
    """A fixed batch's requests as whole arrays, as the twin computes them: request i was sent
    at `sent_ns`, and its chunks are the first `counts[i]` columns of row i of `chunk_ns` and
    `chunk_tokens`, checked for the round as a whole (`check_chunks`); none failed. The meter
    reads a round's chunks from here at once, where gathering them back from one trace per
    request cost more than the arithmetic on them. Read-only arrays."""

    sent_ns: int
    chunk_ns: np.ndarray
    chunk_tokens: np.ndarray
    counts: np.ndarray
    completion: np.ndarray
    prompt_tokens: np.ndarray
    #: Which requests the round's end aborted (`ROUND_END`); None: none (all ran to length).
    aborted: np.ndarray | None
    #: Tokens each verify pass checks (`spec_proposed_drafts` is one less a pass); None: no
    #: speculation (the speculative counters are None).
    verify_tokens: int | None
    #: True: the engine built every request's chunks after its first at the same instants
    #: (row 0's), as the twin's fixed batch decodes, and the meter takes its word rather than
    #: comparing every row (`lockstep_holds` checks the claim, in the engine's tests).
    lockstep: bool = False

    def lockstep_holds(self) -> bool:
        """Whether the rows' chunks after the first share row 0's instants, as far as each
        row's chunks go: `lockstep` may claim it only then."""
        used = np.arange(1, self.chunk_ns.shape[1]) < self.counts[:, None]
        return bool((self.chunk_ns[:, 1:] == self.chunk_ns[0, 1:])[used].all())

    def traces(self) -> tuple[RequestTrace, ...]:
        """The round's `RequestTrace`s (`RequestTrace.trusted`'s, the arrays checked): row
        views of these arrays."""
        n = self.counts.tolist()
        width = self.chunk_ns.shape[1]
        ends = (
            ["length"] * len(n)
            if self.aborted is None
            else [ABORTED if a else "length" for a in self.aborted.tolist()]
        )
        none: list[int | None] = [None] * len(n)
        verify, accepted, proposed = none, none, none
        if self.verify_tokens is not None:
            verify = (self.counts - 1).tolist()
            accepted = (self.completion - self.counts).tolist()  # less the prefill's
            proposed = ((self.counts - 1) * (self.verify_tokens - 1)).tolist()
        return tuple(
            RequestTrace.trusted(
                self.sent_ns,
                self.chunk_ns[i] if k == width else self.chunk_ns[i, :k],
                self.chunk_tokens[i, :k],
                p,
                c,
                f,
                v,
                a,
                d,
            )
            for i, (k, p, c, f, v, a, d) in enumerate(
                zip(
                    n,
                    self.prompt_tokens.tolist(),
                    self.completion.tolist(),
                    ends,
                    verify,
                    accepted,
                    proposed,
                    strict=True,
                )
            )
        )


@dataclass(frozen=True)
class RoundResult:
    """The traces of one round, plus what the server says about acceptance.

    An engine that has the round as arrays (the twin's fixed batches) makes it with
    `of_arrays`: its `requests` are then built from `arrays` when first read."""

    requests: tuple[RequestTrace, ...]
    started_ns: int
    ended_ns: int
    #: /server_info's average accept length: over the round's whole blocks of decode
    #: iterations only (`server_accept_covers`), None when it has none.
    server_accept_length: float | None = None
    #: When each step of the round's `KnobTimeline` returned (ns), in order; empty without one.
    knob_ns: tuple[int, ...] = ()
    #: The round's passes by role, from an engine that knows them (the twin); None: no exact
    #: split (a real server).
    ledger: PassLedger | None = None
    #: The share of the round's decode iterations `server_accept_length` covers (at least;
    #: `server_accept_covers`): 0 without a figure.
    server_accept_covers: float = 0.0
    #: When each step was called (ns), in order: the knob changed between this and its
    #: `knob_ns`, a transition that belongs to neither level. Empty: as `knob_ns`.
    knob_begun_ns: tuple[int, ...] = ()
    #: The round's requests as arrays (`RoundArrays`), where the engine has them (`of_arrays`);
    #: None: only `requests`. Not compared (`requests` says the same), and not carried by
    #: `dataclasses.replace`, whose `requests` may differ.
    arrays: RoundArrays | None = field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def of_arrays(
        cls,
        arrays: RoundArrays,
        started_ns: int,
        ended_ns: int,
        server_accept_length: float | None = None,
        knob_ns: tuple[int, ...] = (),
        ledger: PassLedger | None = None,
        server_accept_covers: float = 0.0,
        knob_begun_ns: tuple[int, ...] = (),
    ) -> RoundResult:
        """A round whose `requests` are `arrays.traces()`, built when first read: a sweep's
        meter reads the arrays, and most rounds' traces are never asked for."""
        result = object.__new__(cls)
        result.__dict__.update(
            started_ns=started_ns,
            ended_ns=ended_ns,
            server_accept_length=server_accept_length,
            knob_ns=knob_ns,
            ledger=ledger,
            server_accept_covers=server_accept_covers,
            knob_begun_ns=knob_begun_ns,
            arrays=arrays,
        )
        return result

    def __getattr__(self, name: str) -> tuple[RequestTrace, ...]:
        # called only for an attribute not found: `requests` of a round made `of_arrays`
        arrays = self.__dict__.get("arrays")
        if name != "requests" or arrays is None:
            raise AttributeError(name)
        requests = arrays.traces()
        object.__setattr__(self, "requests", requests)
        return requests


@dataclass(frozen=True)
class ServerInfo:
    """What a started (or attached) server reports about itself, kept as provenance."""

    engine: str
    version: str
    drafter: str
    args: dict[str, Any] = field(default_factory=dict)
    log_path: str | None = None
    #: The attention kernels the server resolved ("fa3", or "prefill=X,decode=Y"); None: not
    #: applicable (the twin) or not reported.
    attention_backend: str | None = None
    #: Whether the server runs on the metered GPUs ("verified: ...", by PID, "verified by
    #: memory: ..." or "unverified: why", `dvfs.engines.sglang.pinning_outcome` and
    #: `dvfs.engines.server_memory.memory_outcome`); None: not applicable (simulated GPUs).
    gpu_pinning: str | None = None
    #: The server's process tree now (host PIDs), where dvfs knows it and NVML lists it on
    #: the metered GPUs (pinning verified by PID): any other compute process there is another
    #: tenant's (`dvfs.measure.tenants`). None: not known (an attached server, a container's
    #: PID namespace, NVML that cannot list processes, the twin).
    own_pids: Callable[[], frozenset[int]] | None = field(default=None, compare=False, repr=False)
    #: How prompts go out to it ("chat_template:<hash>" or "plain"); "" where the engine
    #: formats none (the twin). Known once a server has started: the server record keeps it.
    prompt_format: str = ""
    #: The block of ports dvfs started it on ({"http": --port, "nccl": --nccl-port}): a fleet
    #: worker's (`dvfs.fleet.ports`). None: a free --port, or a server dvfs did not start.
    ports: dict[str, int] | None = None
    #: The Hub commit of the model it loaded (`dvfs.engines.sglang.model_commit`); "" where
    #: dvfs cannot tell (the twin, a local model, an attached server, a cache it cannot read).
    model_commit: str = ""
    #: Its snapshot's files there, path to blob (`dvfs.engines.sglang.model_files`); empty
    #: where dvfs cannot tell.
    model_files: dict[str, str] | None = None
    #: Each DP rank's cap on running requests as its scheduler reported it at start (SGLang
    #: 0.5.23's `internal_states[i].effective_max_running_requests_per_dp`,
    #: `dvfs.engines.sglang_client.rank_caps_of`): what the arm really ran, the arg lowered to
    #: what each rank's KV pool holds, in the order /server_info lists them (that of the
    #: ranks' replies, not their DP rank). None: not reported (0.5.9, the twin).
    running_caps: tuple[int, ...] | None = None


class Engine(Protocol):
    """A serving engine that decodes fixed batches with a chosen drafter."""

    @property
    def name(self) -> str: ...

    def start(self, drafter: DrafterSpec) -> ServerInfo:
        """(Re)start serving with `drafter`; returns once the server answers requests."""
        ...

    def run(self, workload: Workload, timeline: KnobTimeline | None = None) -> RoundResult:
        """Decode `workload`; with a `timeline` (fixed batches), step the knobs as it says."""
        ...

    def stop(self) -> None: ...


@runtime_checkable
class Repeating(Protocol):
    """An engine that can ready a workload to run again and again with its results dropped (a
    thermal stabilisation's load): the twin then builds no traces nor ledger. A real server
    has no such shortcut: its load is `run`, its result dropped."""

    def repeater(self, workload: Workload) -> Callable[[], None]: ...


def load_of(engine: Engine, workload: Workload) -> Callable[[], None]:
    """`workload` as a load to run again and again, its result dropped: the engine's
    `repeater` where it has one (`Repeating`), else `run` with its result thrown away."""
    if isinstance(engine, Repeating):
        return engine.repeater(workload)
    return lambda: _dropped(engine.run(workload))


def _dropped(_: RoundResult) -> None:
    return None
