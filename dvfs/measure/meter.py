"""Measuring a cell: energy over a steady-state window, latency statistics, quality checks.

Pure arithmetic on what `dvfs.measure.sampler` read (energy counters in mJ, power, SM clock,
temperature and clock-event reasons) and on the engine's token timestamps: a round's energy is
taken between the energy counter's first and last update inside its steady window, and its
tokens over the same interval (`dvfs.measure.counter`); the counter is interpolated at the
window's edges only when it updated less than twice in it. Latencies follow SGLang's own benchmark:
TTFT is the first chunk's arrival, ITL spreads each chunk gap over the tokens it carries, TPOT
is (last - first) / (tokens - 1).
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from dvfs.engines.base import RequestTrace, RoundArrays, RoundResult, Workload
from dvfs.gpu.base import (
    EVENT_APPLICATIONS_CLOCKS,
    EVENT_SW_POWER_CAP,
    EVENT_SYNC_BOOST,
    EVENT_THROTTLE_MASK,
)
from dvfs.measure.counter import (
    RoundEnergy,
    TokenCurve,
    length_uncertainty,
    relative_half_width,
    round_energy,
)

QUANTILES = (0.5, 0.9, 0.99)
#: A locked clock counts as reached when the observed mean is within this of the target.
CLOCK_TOLERANCE_MHZ = 30
#: Points kept per cell of the power/clock timeline stored in the cube.
TIMELINE_POINTS = 32

# Quality flags, stored as a bitmask in the cube (CF flag_masks / flag_meanings).
Q_CLOCK_NOT_REACHED = 1 << 0
Q_THROTTLED = 1 << 1
Q_COUNTER_STALLED = 1 << 2
Q_SHORT_WINDOW = 1 << 3
Q_FEW_SAMPLES = 1 << 4
Q_ACCEPT_MISMATCH = 1 << 5
Q_POWER_CAPPED = 1 << 6
Q_NO_WINDOW = 1 << 7
Q_RETRACTED = 1 << 8
Q_FEW_COUNTER_UPDATES = 1 << 9
Q_POWER_LIMIT_NOT_HELD = 1 << 10
Q_CLOCK_HELD_LOW = 1 << 11
Q_FOREIGN_PROCESS = 1 << 12
#: Another tenant's compute process was on a metered GPU around the idle baseline the cell's
#: above-idle energy subtracts (`dvfs.measure.tenants`): that energy is wrong, its total
#: energy is not (it does not use the idle), so the cell stays valid.
Q_IDLE_BASELINE_FOREIGN = 1 << 13
#: An in-flight level whose decodes all ended before the levels' second visits (a request
#: deadline too short for a decode's segments): each level sits at its own place along the
#: decode, so the order cancels no drift and no drift could be fitted to carry the levels to
#: a per-level cell's context (`dvfs.measure.inflight.fit_context_slope`).
Q_DRIFT_NOT_CANCELLED = 1 << 14
#: The idle baseline the cell's above-idle energy subtracts (the session's opening one, or its
#: setting's) is the mean of the instant power readings, not the energy counter's: a counter
#: updated less than twice while it was measured (`dvfs.measure.baseline.idle_baseline`), or
#: an opening one of `idle_s` = 0, one instant reading (`measure_idle_power_w`).
#: Its energy per token does not use the idle and stands, so the cell stays valid.
Q_IDLE_POWER_READINGS = 1 << 15

QUALITY_FLAGS = {
    Q_CLOCK_NOT_REACHED: "clock_not_reached",
    Q_THROTTLED: "throttled",
    Q_COUNTER_STALLED: "counter_stalled",
    Q_SHORT_WINDOW: "short_window",
    Q_FEW_SAMPLES: "few_samples",
    Q_ACCEPT_MISMATCH: "accept_length_mismatch",
    Q_POWER_CAPPED: "power_capped",
    Q_NO_WINDOW: "no_steady_window",
    Q_RETRACTED: "retracted",
    Q_FEW_COUNTER_UPDATES: "few_counter_updates",
    Q_POWER_LIMIT_NOT_HELD: "power_limit_not_held",
    Q_CLOCK_HELD_LOW: "clock_held_low",
    Q_FOREIGN_PROCESS: "foreign_process",
    Q_IDLE_BASELINE_FOREIGN: "idle_baseline_foreign",
    Q_DRIFT_NOT_CANCELLED: "drift_not_cancelled",
    Q_IDLE_POWER_READINGS: "idle_from_power_readings",
}
#: Flags that make a cell invalid: never chosen by an analysis.
INVALIDATING = (
    Q_CLOCK_NOT_REACHED
    | Q_THROTTLED
    | Q_COUNTER_STALLED
    | Q_NO_WINDOW
    | Q_FEW_SAMPLES
    | Q_FEW_COUNTER_UPDATES
    | Q_POWER_LIMIT_NOT_HELD
    | Q_CLOCK_HELD_LOW
    | Q_FOREIGN_PROCESS
    | Q_DRIFT_NOT_CANCELLED
)


def describe_quality(mask: int) -> list[str]:
    return [name for bit, name in QUALITY_FLAGS.items() if mask & bit]


@dataclass(frozen=True)
class PowerLimitRead:
    """One GPU's power limits (mW) as read at a cell's start and end, and the one the cell
    is labelled with (its own, or the stock limit for a stock cell). For an in-flight group
    (`group`): read after its first level is applied and after its last decode, against the
    lowest limit among its levels; the configured limit changes with the levels, so only the
    enforced one is checked."""

    target_mw: int
    configured_mw: tuple[int, ...]
    enforced_mw: tuple[int, ...]
    group: bool = False

    @property
    def held(self) -> bool:
        """Whether the GPU ran at the cell's limit: configured as the target at every read
        (not for a group), and no other limiter (an out-of-band BMC or rack cap) enforcing
        less."""
        configured = self.group or all(c == self.target_mw for c in self.configured_mw)
        return configured and all(e >= self.target_mw for e in self.enforced_mw)

    def to_json(self) -> dict[str, object]:
        return {
            "target_mw": self.target_mw,
            "configured_mw": list(self.configured_mw),
            "enforced_mw": list(self.enforced_mw),
            **({"group": True} if self.group else {}),
        }


def power_limit_quality(reads: Sequence[PowerLimitRead]) -> int:
    """power_limit_not_held when any GPU's limit read during the cell is not its label's."""
    return 0 if all(r.held for r in reads) else Q_POWER_LIMIT_NOT_HELD


def counter_at(samples: dict[str, np.ndarray], t_ns: float) -> float:
    """The energy counter (mJ, summed over GPUs) at an instant, linearly interpolated between
    each GPU's readings at the times they were taken."""
    times = samples.get("gpu_energy_t_ns")
    if times is not None and times.ndim == 2 and times.size:
        values = samples["gpu_energy_mj"]
        return float(sum(np.interp(t_ns, times[:, g], values[:, g]) for g in range(times.shape[1])))
    return float(np.interp(t_ns, samples["t_ns"], samples["energy_mj"]))


# -- windows and latency --------------------------------------------------------------------


def _first_ns(r: RequestTrace) -> int:
    """First chunk's arrival of a request known to have chunks."""
    return int(r.chunk_ns[0])


def _last_ns(r: RequestTrace) -> int:
    """Last chunk's arrival of a request known to have chunks."""
    return int(r.chunk_ns[-1])


def steady_window_ns(result: RoundResult, mode: str) -> tuple[int, int] | None:
    """The round's steady-state window, or None when it has none.

    fixed: from the last request's first token to the first request's finish.
    closed-loop: from when `batch` requests have their first token until concurrency drops
    below batch (the first finish after the last request was sent), as the ML.ENERGY
    benchmark defines steady state.
    """
    chunks = round_chunks(result)
    firsts, lasts = chunks.firsts, chunks.lasts
    if not firsts:
        return None
    if mode != "closed-loop":  # integers: plain max and min are numpy's, without the arrays
        start, end = max(firsts), min(lasts)
        return (start, end) if end > start else None
    finishes = np.array(lasts)
    batch = result_batch(result)
    start = int(np.sort(np.array(firsts))[min(batch, len(firsts)) - 1])
    last_sent = int(chunks.sent.max())
    later = finishes[finishes > last_sent]
    end = int(later.min()) if len(later) else int(finishes.max())
    return (start, end) if end > start else None


@dataclass(frozen=True)
class RoundChunks:
    """A round's requests that finished without error (with chunks, `_finished`) and their
    chunks end to end, request after request: worked out once a round (`round_chunks`) and
    read by its steady window, its token curve, its TPOT and the cell's latency quantiles,
    which would otherwise each gather the same chunks from every trace again. The arrays are
    shared: read-only."""

    #: Each request's first and last chunk's instant (ns, ints).
    firsts: list[int]
    lasts: list[int]
    #: Chunks per request (int64).
    counts: np.ndarray
    #: Every chunk's arrival (int64 ns) and tokens (as the traces hold them).
    ns: np.ndarray
    tokens: np.ndarray
    #: Each request's send instant (ns) and completion tokens (int64).
    sent: np.ndarray
    completion: np.ndarray
    #: A lockstep round's distinct chunk instants, ascending (every request's chunks after
    #: its first arrived at the same instants: a fixed batch decoding together, as the twin's
    #: rounds do), and the tokens that arrived at each, summed over the requests
    #: (`_lockstep`); None: not such a round.
    lockstep: tuple[np.ndarray, np.ndarray] | None = None
    #: A lockstep round's tokens as the engine gave them (requests x chunks, whole rows:
    #: `tokens` row after row), whose sums and ITL counts `_token_grid` remembers; None: not
    #: such a round.
    grid: np.ndarray | None = None

    def curve(self) -> TokenCurve:
        """The round's token curve (`TokenCurve.of` on these chunks: the same arrays, cast as
        it casts them); a lockstep round's through its instants once each
        (`TokenCurve.steps`: the same curve, read without passes over every chunk)."""
        if self.lockstep is not None:
            return TokenCurve.steps(*self.lockstep)
        return TokenCurve(self.ns, self.tokens)


def _chunks_of(requests: Sequence[RequestTrace]) -> RoundChunks:
    """`RoundChunks` of requests, computed."""
    done = _finished(requests)
    if not done:
        return _NO_CHUNKS
    # lists then arrays: a generator for np.fromiter costs more per request than a list,
    # and a map of an attrgetter less than a comprehension
    chunk_ns = list(map(_CHUNK_NS, done))
    counts = np.array(list(map(len, chunk_ns)), dtype=np.int64)
    ns = np.concatenate(chunk_ns, dtype=np.int64, casting="unsafe")
    tokens = np.concatenate(list(map(_CHUNK_TOKENS, done)))
    ends = counts.cumsum()
    firsts, lasts = ns[ends - counts].tolist(), ns[ends - 1].tolist()
    sent = np.array(list(map(_SENT, done)), dtype=np.int64)
    completion = np.array(list(map(_COMPLETION, done)), dtype=np.int64)
    for array in (counts, ns, tokens, sent, completion):
        array.flags.writeable = False
    return RoundChunks(firsts, lasts, counts, ns, tokens, sent, completion)


_EMPTY = np.array([], dtype=np.int64)
_EMPTY.flags.writeable = False
_NO_CHUNKS = RoundChunks([], [], _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)


def _chunks_of_arrays(arrays: RoundArrays) -> RoundChunks:
    """`RoundChunks` of a round's requests as arrays (`RoundArrays`: none failed): the same
    chunks, in the same order, as `_chunks_of` gathers from its traces, without them."""
    counts, chunk_ns, chunk_tokens = arrays.counts, arrays.chunk_ns, arrays.chunk_tokens
    completion = arrays.completion
    fewest = int(_MIN(counts)) if len(counts) else 0
    if not fewest:  # only the requests with chunks
        rows = np.flatnonzero(counts)
        if not len(rows):
            return _NO_CHUNKS
        counts, chunk_ns, chunk_tokens = counts[rows], chunk_ns[rows], chunk_tokens[rows]
        completion = completion[rows]
        fewest = int(_MIN(counts))
    width = chunk_ns.shape[1]
    lockstep = grid = None
    if fewest == width:  # every row whole (a round cut at its window's end): as they lie
        ns, tokens = chunk_ns.reshape(-1), chunk_tokens.reshape(-1)
        lasts = chunk_ns[:, -1].tolist()
        lockstep = _lockstep(chunk_ns, chunk_tokens, arrays.lockstep)
        grid = chunk_tokens if lockstep is not None else None
    else:  # row i's first counts[i] columns, row after row
        used = np.arange(width) < counts[:, None]
        ns, tokens = chunk_ns[used], chunk_tokens[used]
        lasts = chunk_ns[np.arange(len(counts)), counts - 1].tolist()
    firsts = chunk_ns[:, 0].tolist()
    sent = np.empty(len(counts), dtype=np.int64)  # (np.full's own two steps)
    sent.fill(arrays.sent_ns)
    chunks = RoundChunks(
        firsts,
        lasts,
        counts.astype(np.int64, copy=False),
        ns.astype(np.int64, copy=False),
        tokens,
        sent,
        completion.astype(np.int64, copy=False),
        lockstep,
        grid,
    )
    for array in (chunks.counts, chunks.ns, tokens, sent, chunks.completion):
        array.flags.writeable = False
    return chunks


def _lockstep(
    chunk_ns: np.ndarray, chunk_tokens: np.ndarray, vouched: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """A round's distinct chunk instants and the tokens that arrived at each, summed over its
    requests (`RoundChunks.lockstep`), where its rows are whole and every request's chunks
    after its first arrived at the first request's instants: a fixed batch decoding in
    lockstep (its first chunks may come at a few instants, a prefill in parts). None
    otherwise, or where the tokens are not whole numbers (summed in another order, fractions
    could round otherwise). Instants that would not ascend `TokenCurve.steps` reads as any
    chunks (it checks). `vouched`: the engine built the rows so (`RoundArrays.lockstep`), and
    they are not compared."""
    if chunk_tokens.dtype.kind not in "iu":
        return None
    row = chunk_ns[0]
    if len(chunk_ns) == 1:
        return row, chunk_tokens[0]
    if not vouched and not bool(_ALL(chunk_ns[:, 1:] == row[1:], axis=None)):
        return None
    tokens = _token_grid(chunk_tokens).sums()
    firsts = chunk_ns[:, 0]
    if bool(_ALL(firsts == row[0])):
        return row, tokens
    # the first chunks' few instants, each once, with the tokens that arrived at each (whole
    # numbers, summed exactly as floats and back)
    instants, inverse = np.unique(firsts, return_inverse=True)
    at_first = np.bincount(inverse, weights=chunk_tokens[:, 0]).astype(tokens.dtype)
    return np.concatenate([instants, row[1:]]), np.concatenate([at_first, tokens[1:]])


class _TokenFacts:
    """What a lockstep round's tokens alone give, each worked out when first asked: the
    tokens summed over the requests, chunk by chunk (`_lockstep`), and `_itl_counts`."""

    __slots__ = ("sums", "itl")

    def __init__(self) -> None:
        self.sums: np.ndarray | None = None
        self.itl: _ItlCounts | None | bool = False  # False: not worked out yet


class _TokenGrid:
    """A lockstep round's tokens (requests x chunks, whole rows) with their `_TokenFacts`. A
    twin sweep runs each planned round, the same read-only token array, at every knob
    setting: only its instants change, and the facts are remembered for the array
    (`_token_grid`)."""

    __slots__ = ("tokens", "facts")

    def __init__(self, tokens: np.ndarray, facts: _TokenFacts) -> None:
        self.tokens = tokens
        self.facts = facts

    def sums(self) -> np.ndarray:
        """The tokens summed over the requests (read-only)."""
        facts = self.facts
        if facts.sums is None:
            # (what ndarray.sum calls, without its wrapper)
            sums = _SUM(self.tokens, axis=0)
            sums.flags.writeable = False
            facts.sums = sums
        return facts.sums

    def itl_counts(self) -> _ItlCounts | None:
        """`_itl_counts` of the tokens."""
        facts = self.facts
        if facts.itl is False:
            facts.itl = _itl_counts(self.tokens)
        return facts.itl  # type: ignore[return-value]


#: `_TokenFacts` by the identity of their (read-only) token arrays, each with a weak
#: reference to its array (the memo keeps no array alive: the engine's cache of planned rounds
#: decides how long one lives), the oldest dropped past the size: as many as the twin engine
#: keeps planned rounds (a demo sweep's setting runs about a hundred).
_GRID_MEMO: dict[int, tuple[weakref.ref[np.ndarray], _TokenFacts]] = {}
_GRID_MEMO_SIZE = 256


def _token_grid(tokens: np.ndarray) -> _TokenGrid:
    """A lockstep round's tokens with their facts: remembered for a read-only array (an
    engine's own, which nothing changes), worked out afresh for any other."""
    if tokens.flags.writeable:
        return _TokenGrid(tokens, _TokenFacts())
    seen = _GRID_MEMO.get(id(tokens))
    if seen is not None and seen[0]() is tokens:
        return _TokenGrid(tokens, seen[1])
    facts = _TokenFacts()
    with _MEMO_LOCK:  # (`_remember`'s steps, by the array's identity, holding it weakly)
        _GRID_MEMO[id(tokens)] = (weakref.ref(tokens), facts)
        while len(_GRID_MEMO) > _GRID_MEMO_SIZE:
            del _GRID_MEMO[next(iter(_GRID_MEMO))]
    return _TokenGrid(tokens, facts)


#: The last few rounds' `RoundChunks`, by the identity of their (immutable) tuple of traces or
#: `RoundArrays`: the runner reads a round's as it measures, and `summarise` again at the end.
#: Keyed by id() and holding the tuple or arrays itself, as `_LATENCY_MEMO`.
_CHUNKS_MEMO: dict[int, tuple[object, RoundChunks]] = {}
_CHUNKS_MEMO_SIZE = 16


def _held(round_: Sequence[RequestTrace] | RoundResult) -> Sequence[RequestTrace] | RoundArrays:
    """What a round's chunks are read from: a result's arrays where it has them, else its
    traces."""
    if isinstance(round_, RoundResult):
        return round_.arrays if round_.arrays is not None else round_.requests
    return round_


def round_chunks(requests: Sequence[RequestTrace] | RoundResult) -> RoundChunks:
    """`RoundChunks` of a round's requests (or of a round: from its arrays where it has them,
    `RoundArrays`); a tuple's or a round's remembered for the next few calls."""
    held = _held(requests)
    if not isinstance(held, (tuple, RoundArrays)):
        return _chunks_of(held)
    seen = _CHUNKS_MEMO.get(id(held))
    if seen is not None and seen[0] is held:
        return seen[1]
    chunks = _chunks_of_arrays(held) if isinstance(held, RoundArrays) else _chunks_of(held)
    _remember(_CHUNKS_MEMO, _CHUNKS_MEMO_SIZE, held, chunks)
    return chunks


#: Held while a memo (`_CHUNKS_MEMO`, `_LATENCY_MEMO`) takes a round and drops its oldest: a
#: local fleet's workers measure in threads of one process and share the memos, and two
#: threads dropping the same oldest round at once failed the later one's cell (KeyError).
_MEMO_LOCK = threading.Lock()
_T = TypeVar("_T")


def _remember(memo: dict[int, tuple[object, _T]], size: int, held: object, value: _T) -> None:
    """Keep `value` in `memo` for `held` (by its id, holding it), dropping the oldest rounds
    past `size` (dicts keep insertion order)."""
    with _MEMO_LOCK:
        memo[id(held)] = (held, value)
        while len(memo) > size:
            del memo[next(iter(memo))]


def _ends(
    requests: Sequence[RequestTrace],
) -> tuple[list[RequestTrace], list[int], list[int]]:
    """The requests that finished without error (with chunks, `_finished`) and each one's
    first and last chunk's instant (ints), from `round_chunks`. The lists of instants are
    shared: read-only."""
    chunks = round_chunks(requests)
    return _finished(requests), chunks.firsts, chunks.lasts


def finished_requests(requests: Sequence[RequestTrace]) -> list[RequestTrace]:
    """The requests that finished without error, with chunks, in order."""
    return _finished(requests)


def result_batch(result: RoundResult) -> int:
    """Concurrency of a round: requests sent before the first one finished."""
    first_finish = min((_last_ns(r) for r in result.requests if len(r.chunk_ns)), default=0)
    return max(1, sum(1 for r in result.requests if r.sent_ns < first_finish))


def tokens_in_window(requests: Sequence[RequestTrace], start_ns: int, end_ns: int) -> int:
    """Tokens whose chunk arrived in (start, end]."""
    if not requests:
        return 0
    ns = np.concatenate([r.chunk_ns for r in requests])
    inside = (ns > start_ns) & (ns <= end_ns)
    return int(np.concatenate([r.chunk_tokens for r in requests])[inside].sum())


@dataclass(frozen=True)
class LatencyStats:
    """Quantiles (QUANTILES) of TTFT, TPOT and ITL in milliseconds; NaN when undefined."""

    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]
    itl_ms: tuple[float, ...]


def _quantiles(values: np.ndarray) -> tuple[float, ...]:
    """`np.quantile(values, QUANTILES)` (Hyndman & Fan's method 7, numpy's "linear") written out
    with numpy's own arithmetic, so the numbers are the same to the last bit: np.quantile's
    argument handling costs more than the work on a cell's few thousand latencies. Only the
    order statistics the quantiles read are put in place (`np.partition`), and the three
    interpolations are done on plain floats (float64, as numpy's)."""
    n = len(values)
    if n == 0:
        return tuple(math.nan for _ in QUANTILES)
    values = np.asarray(values, dtype=float)
    picks, kth = _picks(n)
    if math.isnan(values.max()):  # NaN is the largest value in a sort: every quantile is NaN
        return tuple(math.nan for _ in QUANTILES)
    ordered = np.partition(values, kth)
    return _interpolated(ordered, picks)


def _interpolated(
    ordered: np.ndarray | dict[int, float],
    picks: tuple[tuple[int, int, float], ...],
    scale: float = 1.0,
) -> tuple[float, ...]:
    """Each quantile of `_picks` read off `ordered` (its order statistics in place, or just
    those, by position), each value times `scale` first, interpolated as numpy's "linear"
    method does, on plain floats (x * 1.0 is x to the bit, NaN and infinities included)."""
    out = []
    for below, above, weight in picks:
        lo, hi = float(ordered[below]) * scale, float(ordered[above]) * scale
        step = hi - lo
        out.append(hi - step * (1 - weight) if weight >= 0.5 else lo + step * weight)
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _picks(n: int) -> tuple[tuple[tuple[int, int, float], ...], tuple[int, ...]]:
    """For `n` values: per quantile the lower and upper order statistic and the weight, and
    the order statistics to put in place (a sweep's rounds have a few sizes, asked again and
    again)."""
    picks = []
    for q in QUANTILES:
        position = (n - 1) * q  # numpy's virtual index for "linear"
        below = math.floor(position)
        if position >= n - 1:
            below = above = n - 1
            weight = position + 1  # numpy's arithmetic on index -1: only >= 0.5 matters
        else:
            above = below + 1
            weight = position - below
        picks.append((below, above, weight))
    return tuple(picks), tuple(sorted({i for b, a, _ in picks for i in (b, a)}))


def _quantiles_of_list(values: list[float]) -> tuple[float, ...]:
    """`_quantiles` of plain floats with no NaN (latencies from integer nanoseconds): the
    same interpolations on the same order statistics, the list sorted in place (a round's or
    a cell's few per-request values, where numpy's per-call cost dominates)."""
    n = len(values)
    if n == 0:
        return tuple(math.nan for _ in QUANTILES)
    values.sort()
    out = []
    for below, above, weight in _picks(n)[0]:
        lo, hi = values[below], values[above]
        step = hi - lo
        out.append(hi - step * (1 - weight) if weight >= 0.5 else lo + step * weight)
    return tuple(out)


def _ordered_quantiles(values: np.ndarray) -> tuple[float, ...]:
    """`_quantiles` of a float64 array known to hold no NaN (gaps between integer
    nanoseconds), without the NaN check's pass over it. One partition with every position
    the quantiles read: on a cell's tens of thousands of latencies (a few thousand distinct
    gaps, repeated) it costs a half to a quarter of a partition per position, one after
    another (measured on a demo sweep's latencies, numpy 2.4, 2-core AMD EPYC). `values` is
    the caller's own scratch array: partitioned in place (what `np.partition` does to its
    copy), not copied first."""
    n = len(values)
    if n == 0:
        return tuple(math.nan for _ in QUANTILES)
    picks, kth = _picks(n)
    values.partition(kth)
    return _interpolated(values, picks)


def _gap_quantiles(gaps_ns: np.ndarray) -> tuple[float, ...]:
    """`_ordered_quantiles(gaps_ns * 1e-6)` of integer nanosecond gaps, the order statistics
    picked among the integers (an int64 partition costs about a quarter less than a float64
    one) and only they scaled: x -> x * 1e-6 never reverses an order (float64 rounding is
    monotone), so the k-th smallest scaled gap is the k-th smallest gap scaled, the same
    float64 product. `gaps_ns` is the caller's own scratch array: partitioned in place (a
    cell's tens of thousands of gaps are not copied first)."""
    n = len(gaps_ns)
    if n == 0:
        return tuple(math.nan for _ in QUANTILES)
    picks, kth = _picks(n)
    ordered = gaps_ns
    ordered.partition(kth)
    return _interpolated(ordered, picks, 1e-6)


class _RoundLatency(LatencyStats):
    """`LatencyStats` whose TTFT and ITL are computed when first read: a sweep reads a round's
    median TPOT as it measures and its other statistics hardly ever (the cell's come from all
    its rounds at once), and the ITL of a round is most of the work. Equal to, hashed, copied
    and pickled as the plain `LatencyStats` of the same numbers."""

    def __init__(self, chunks: RoundChunks) -> None:  # pylint: disable=super-init-not-called
        object.__setattr__(self, "_chunks", chunks)
        tpot = _tpot_from(chunks.completion.tolist(), chunks.firsts, chunks.lasts)
        object.__setattr__(self, "tpot_ms", _quantiles_of_list(tpot))

    def __getattr__(self, name: str) -> tuple[float, ...]:
        if name not in ("ttft_ms", "itl_ms"):
            raise AttributeError(name)
        c = self.__dict__["_chunks"]
        full = _latency_from(c.sent, c.completion, c.counts, c.ns, c.tokens)
        object.__setattr__(self, "ttft_ms", full.ttft_ms)
        object.__setattr__(self, "itl_ms", full.itl_ms)
        return getattr(full, name)

    def plain(self) -> LatencyStats:
        return LatencyStats(self.ttft_ms, self.tpot_ms, self.itl_ms)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LatencyStats):
            return (self.ttft_ms, self.tpot_ms, self.itl_ms) == (
                other.ttft_ms,
                other.tpot_ms,
                other.itl_ms,
            )
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.plain())

    def __repr__(self) -> str:
        return repr(self.plain())

    def __reduce__(self) -> tuple[type, tuple[tuple[float, ...], ...]]:
        return LatencyStats, (self.ttft_ms, self.tpot_ms, self.itl_ms)


#: The last few rounds' latency statistics, by the identity of their (immutable) tuple of
#: traces or `RoundArrays`: the runner asks for a round's as it measures, and `summarise`
#: again at the end. Keyed by id() and holding the tuple or arrays itself, so an id is not
#: reused while it is here.
_LATENCY_MEMO: dict[int, tuple[object, LatencyStats]] = {}
_LATENCY_MEMO_SIZE = 16


def latency_stats(requests: Sequence[RequestTrace] | RoundResult) -> LatencyStats:
    """TTFT, TPOT and ITL quantiles over the requests that finished without error, computed on
    their chunks concatenated once (a cell has thousands of chunks). A round's (a tuple of
    traces, as `RoundResult` holds, or a `RoundResult`: from its arrays where it has them) is
    remembered for the next few calls, and its TTFT and ITL are computed when first read
    (`_RoundLatency`)."""
    held = _held(requests)
    if not isinstance(held, (tuple, RoundArrays)):
        c = _chunks_of(held)
        return _latency_from(c.sent, c.completion, c.counts, c.ns, c.tokens)
    seen = _LATENCY_MEMO.get(id(held))
    if seen is not None and seen[0] is held:
        return seen[1]
    chunks = round_chunks(requests)
    stats = _RoundLatency(chunks) if chunks.firsts else _latency_of([])
    _remember(_LATENCY_MEMO, _LATENCY_MEMO_SIZE, held, stats)
    return stats


def _finished(requests: Sequence[RequestTrace]) -> list[RequestTrace]:
    return [r for r in requests if r.error is None and len(r.chunk_ns)]


#: A trace's fields, read request by request by `map` (less than a comprehension costs).
_CHUNK_NS = operator.attrgetter("chunk_ns")
_CHUNK_TOKENS = operator.attrgetter("chunk_tokens")
_SENT = operator.attrgetter("sent_ns")
_VERIFY_CT = operator.attrgetter("spec_verify_ct")
_PROPOSED = operator.attrgetter("spec_proposed_drafts")
_ACCEPTED = operator.attrgetter("spec_accepted_drafts")
_COMPLETION = operator.attrgetter("completion_tokens")
_FINAL_LOST = operator.attrgetter("final_lost")
_RETRACTIONS = operator.attrgetter("retractions")


def _tpot_of(ok: list[RequestTrace], firsts: list[int], lasts: list[int]) -> list[float]:
    """`_tpot_from` of finished requests."""
    return _tpot_from([int(r.completion_tokens) for r in ok], firsts, lasts)


def _tpot_from(completions: list[int], firsts: list[int], lasts: list[int]) -> list[float]:
    """TPOT (ms) of each finished request with more than one token, in order, as plain floats,
    from its completion tokens and its first and last chunk's instant (`_ends`): numpy's
    float64 arithmetic on the same integers (an int64 difference times 1e-6, over the tokens
    less one), value by value."""
    out = []
    for completion, first, last in zip(completions, firsts, lasts, strict=True):
        if completion > 1:
            out.append((last - first) * 1e-6 / (completion - 1))
    return out


def _latency_of(ok: list[RequestTrace]) -> LatencyStats:
    """`latency_stats` of requests that finished (with chunks). Every latency is a difference
    of integer nanoseconds, never NaN: the quantiles skip `_quantiles`' check for one."""
    if not ok:
        empty = _quantiles(np.array([]))
        return LatencyStats(empty, empty, empty)
    c = _chunks_of(ok)
    return _latency_from(c.sent, c.completion, c.counts, c.ns, c.tokens)


def rounds_latency(results: Sequence[RoundResult]) -> LatencyStats:
    """`latency_stats` of every request of the rounds (in order), on each round's chunks as
    `round_chunks` gathered them (the runner's rounds': remembered), put end to end: the
    same arrays as the requests' chunks concatenated at once, without a pass over each
    request's; lockstep rounds of many chunks with their gaps counted (`_lockstep_latency`:
    the same numbers)."""
    rounds = [c for c in (round_chunks(res) for res in results) if c.firsts]
    lockstep = all(c.lockstep is not None for c in rounds)
    if lockstep and sum(len(c.ns) for c in rounds) >= _COUNTED_FROM:
        counted = _lockstep_latency(rounds)
        if counted is not None:
            return counted
    if len(rounds) == 1:
        c = rounds[0]
        return _latency_from(c.sent, c.completion, c.counts, c.ns, c.tokens)
    return _latency_from(
        *(
            np.concatenate([getattr(c, name) for c in rounds] or [_EMPTY])
            for name in ("sent", "completion", "counts", "ns", "tokens")
        )
    )


#: The most tokens a chunk of a lockstep round may carry for `_lockstep_itl` to count its
#: gaps (a count per column and token count): speculative decoding's few per verify pass.
_COUNTED_TOKENS = 64
#: The fewest chunks a cell's lockstep rounds hold for `rounds_latency` to count their gaps
#: (`_lockstep_latency`): below, repeating each gap per token and partitioning costs less
#: than counting round by round (measured on the demo sweep's cells, numpy 2.4).
_COUNTED_FROM = 4096


def _lockstep_latency(rounds: Sequence[RoundChunks]) -> LatencyStats | None:
    """`_latency_from` of lockstep rounds' chunks put end to end (`RoundChunks.lockstep`: whole
    rows, every request's chunks after its first at the first request's instants), the same
    numbers, without the chunks put end to end: TTFT and TPOT from each request's first and
    last chunk, the ITL by `_lockstep_itl`. None where a chunk's tokens are not counted so
    (negative, or more than `_COUNTED_TOKENS`)."""
    grids = [
        (
            c.ns.reshape(len(c.counts), -1),
            _token_grid(c.tokens.reshape(len(c.counts), -1) if c.grid is None else c.grid),
        )
        for c in rounds
    ]
    itl_ms = _lockstep_itl(grids)
    if itl_ms is None:
        return None
    sent = np.concatenate([c.sent for c in rounds])
    completion = np.concatenate([c.completion for c in rounds])
    first = np.concatenate([ns[:, 0] for ns, _ in grids])
    last = np.concatenate([ns[:, -1] for ns, _ in grids])
    ttft = (first - sent) * 1e-6
    multi = completion > 1
    tpot = (last[multi] - first[multi]) * 1e-6 / (completion[multi] - 1)
    return LatencyStats(_ordered_quantiles(ttft), _ordered_quantiles(tpot), itl_ms)


def _lockstep_itl(grids: Sequence[tuple[np.ndarray, _TokenGrid]]) -> tuple[float, ...] | None:
    """The ITL quantiles `_latency_from` takes (each gap over its chunk's tokens, once per
    token; empty chunks left out) of lockstep rounds, each its chunks' instants and tokens
    (requests x chunks, whole rows): the same order statistics of the same values, counted
    instead of repeated. A request's gaps after its second chunk are the first request's, so
    each (gap, tokens) pair is one value with a count (`_itl_counts`, from the tokens alone);
    the second chunks' gaps are each request's own. An empty chunk's value has no count:
    never picked. None where a chunk's tokens are negative or over `_COUNTED_TOKENS`."""
    values, weights = [], []
    for ns, grid in grids:
        if ns.shape[1] < 2:
            continue
        counts = grid.itl_counts()
        if counts is None:
            return None
        row = ns[0]
        values.append(((row[1] - ns[:, 0]) * 1e-6) / counts.second_over)
        weights.append(counts.second)
        if counts.later is not None:  # the later chunks' (column, tokens) pairs
            column, tokens, weight = counts.later
            values.append(((row[2:] - row[1:-1])[column] * 1e-6) / tokens)
            weights.append(weight)
    if not values:
        return tuple(math.nan for _ in QUANTILES)
    return _counted_quantiles(np.concatenate(values), np.concatenate(weights))


@dataclass(frozen=True)
class _ItlCounts:
    """What `_lockstep_itl` weighs a lockstep round's gaps with, from its tokens alone: the
    second chunks' tokens (int64) and the same at least 1 (each request's own gap is over
    them); with more than two chunks a request, `later`: the later chunks' distinct (column,
    tokens) pairs as their columns, their tokens and their weights (tokens x requests with
    the pair). Read-only."""

    second: np.ndarray
    second_over: np.ndarray
    later: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def _itl_counts(tokens: np.ndarray) -> _ItlCounts | None:
    """`_ItlCounts` of a lockstep round's tokens (requests x chunks, at least two a request);
    None where a chunk's tokens are negative or over `_COUNTED_TOKENS`."""
    width = tokens.shape[1]
    most = int(_MAX(tokens, axis=None))
    if most > _COUNTED_TOKENS or int(_MIN(tokens, axis=None)) < 0:
        return None
    tokens = tokens.astype(np.int64, copy=False)  # (whole numbers: `_lockstep`)
    second = tokens[:, 1].copy()  # (not a view: the memo holds no token array, `_GRID_MEMO`)
    later = None
    if width > 2:  # the later chunks' (column, tokens) pairs, each counted once
        span = most + 1
        pairs = np.bincount((tokens + np.arange(0, width * span, span)).reshape(-1))
        pairs = pairs[2 * span :]
        pairs[::span] = 0  # empty chunks
        found = np.flatnonzero(pairs)
        column, counted = np.divmod(found, span)
        later = (column, counted, counted * pairs[found])
    counts = _ItlCounts(second, np.maximum(second, 1), later)
    for array in (second, counts.second_over, *(later or ())):
        array.flags.writeable = False
    return counts


def _counted_quantiles(values: np.ndarray, counts: np.ndarray) -> tuple[float, ...]:
    """The quantiles of `values` each repeated its count of times (non-negative integers),
    without the repeats: the values sorted once, and each order statistic the first value
    whose running count takes the total past its position, the same value as in the
    repeated array (equal floats are one float: no value here is -0.0 or NaN)."""
    order = values.argsort()
    cumulative = np.cumsum(counts[order])
    n = int(cumulative[-1]) if len(cumulative) else 0
    if n == 0:
        return tuple(math.nan for _ in QUANTILES)
    picks, kth = _picks(n)
    # the k-th smallest repeated value: the first whose count takes the total past k
    at = order[cumulative.searchsorted(kth, "right")]
    return _interpolated(dict(zip(kth, values[at].tolist(), strict=True)), picks)


def _latency_from(
    sent: np.ndarray, completion: np.ndarray, counts: np.ndarray, ns: np.ndarray, tokens: np.ndarray
) -> LatencyStats:
    """`_latency_of` on the requests' chunks already end to end, with each one's send instant
    and completion tokens (`RoundChunks`' arrays)."""
    if not len(counts):
        empty = _quantiles(np.array([]))
        return LatencyStats(empty, empty, empty)
    ends = np.cumsum(counts)
    starts = ends - counts
    first, last = ns[starts], ns[ends - 1]
    ttft = (first - sent) * 1e-6
    multi = completion > 1
    tpot = (last[multi] - first[multi]) * 1e-6 / (completion[multi] - 1)
    # A gap belongs to the chunk it ends, unless that chunk is a request's first.
    later = np.ones(len(ns), dtype=bool)
    later[starts] = False
    gaps_ns = (ns[1:] - ns[:-1])[later[1:]]  # np.diff's own step: a fresh array, ours
    if (tokens == 1).all():  # one token a chunk (x / 1 == x): the gaps as they are
        itl_ms = _gap_quantiles(gaps_ns)
    else:  # each gap spread over its tokens, empty chunks dropped
        gap_tokens = tokens[1:][later[1:]]
        if not (gap_tokens > 0).all():
            keep = gap_tokens > 0
            gaps_ns, gap_tokens = gaps_ns[keep], gap_tokens[keep]
        if (gap_tokens == 1).all():
            itl_ms = _gap_quantiles(gaps_ns)
        else:
            # each gap over its tokens, once per token: counted rather than repeated (gaps
            # between integer instants over positive tokens: no NaN, and 0 * 1e-6 / k is
            # +0.0, never -0.0)
            itl_ms = _counted_quantiles((gaps_ns * 1e-6) / gap_tokens, gap_tokens)
    return LatencyStats(_ordered_quantiles(ttft), _ordered_quantiles(tpot), itl_ms)


@dataclass(frozen=True)
class Acceptance:
    """accept_length as SGLang defines it per request (completion tokens / verify passes, so the
    prefill token counts); decode_accept_length leaves the prefill token out, as the server's
    average does, for the cross-check. server_covers: the least share of a round's decode
    iterations the server's figure covers (`dvfs.engines.base.server_accept_covers`)."""

    accept_length: float
    accept_rate: float
    server_accept_length: float
    decode_accept_length: float = math.nan
    server_covers: float = 0.0


def acceptance(
    results: Sequence[RoundResult], requests: Sequence[RequestTrace] | None = None
) -> Acceptance:
    """Pooled over every request: tokens per verify pass, and accepted over proposed drafts.
    `requests`: the results' requests in order, when the caller has them listed already.

    Unknown (NaN) when any request's counters were lost (`RequestTrace.final_lost`: a round
    ended by disconnecting its running requests): pooling only the requests that finished
    would count those that needed the fewest verify passes, the best-accepted ones, and
    overstate acceptance. The server's figure still covers the passes of each round's whole
    blocks of decode iterations (`dvfs.engines.base.server_accept_covers`), not its last."""
    server = [res.server_accept_length for res in results if res.server_accept_length is not None]
    server_mean = _mean(np.array(server, dtype=np.float64)) if server else math.nan
    covers = min((res.server_accept_covers for res in results), default=0.0)
    if requests is None:
        arrays = [res.arrays for res in results]
        if all(a is not None for a in arrays):
            return _pooled_arrays([a for a in arrays if a is not None], server_mean, covers)
        requests = [r for res in results for r in res.requests]
    if any(map(_FINAL_LOST, requests)):
        return Acceptance(math.nan, math.nan, server_mean, server_covers=covers)
    # whole numbers, summed exactly in any order: column by column where every request
    # speculated (or none did), else one pass skipping those that did not
    verify_ct = list(map(_VERIFY_CT, requests))
    if None not in verify_ct:
        n, verify = len(verify_ct), sum(verify_ct)
        proposed_ct = list(map(_PROPOSED, requests))
        accepted_ct = list(map(_ACCEPTED, requests))
        proposed = sum(proposed_ct) if None not in proposed_ct else sum(map(_or_zero, proposed_ct))
        accepted = sum(accepted_ct) if None not in accepted_ct else sum(map(_or_zero, accepted_ct))
        completion = sum(map(_COMPLETION, requests))
    elif verify_ct.count(None) == len(verify_ct):
        n = verify = proposed = accepted = completion = 0  # none speculated
    else:
        n = verify = proposed = accepted = completion = 0
        for r in requests:
            if r.spec_verify_ct is None:
                continue
            n += 1
            verify += r.spec_verify_ct
            proposed += r.spec_proposed_drafts or 0
            accepted += r.spec_accepted_drafts or 0
            completion += r.completion_tokens
    return _pooled(n, verify, proposed, accepted, completion, server_mean, covers)


def _pooled(
    n: int,
    verify: int,
    proposed: int,
    accepted: int,
    completion: int,
    server_mean: float,
    covers: float,
) -> Acceptance:
    """A cell's acceptance from its speculating requests' counts summed (`n` requests):
    accept length over the verify passes, with and without each request's prefill token,
    and the share of proposed drafts accepted; NaN where none speculated."""
    if not n:
        return Acceptance(math.nan, math.nan, server_mean, server_covers=covers)
    length = completion / verify if verify else math.nan
    decode = (completion - n) / verify if verify else math.nan
    rate = accepted / proposed if proposed else math.nan
    return Acceptance(length, rate, server_mean, decode, covers)


def _or_zero(value: int | None) -> int:
    return value or 0


def _pooled_arrays(arrays: Sequence[RoundArrays], server_mean: float, covers: float) -> Acceptance:
    """`acceptance` of rounds as arrays (`RoundArrays`, whose traces' counters are known and
    follow from their chunk counts): the same whole numbers, summed round by round, over the
    rounds that speculated."""
    n = verify = proposed = accepted = completion = 0
    for a in arrays:
        if a.verify_tokens is None:
            continue
        chunks, done = int(_SUM(a.counts)), int(_SUM(a.completion))
        n += len(a.counts)
        verify += chunks - len(a.counts)  # a verify pass a chunk, less the prefill's
        proposed += (chunks - len(a.counts)) * (a.verify_tokens - 1)
        accepted += done - chunks
        completion += done
    return _pooled(n, verify, proposed, accepted, completion, server_mean, covers)


#: The cross-check runs only where the server's figure covers at least this share of each
#: round's decode iterations: its last partial block is left out, and a pool that differs
#: from the server's by that tail alone must not be flagged.
SERVER_COVER_MIN = 0.9


def accept_mismatch(accept: Acceptance) -> bool:
    """`accept_length_mismatch`: the server's accept length and the pool's (prefill token
    excluded) differ by over 5%, where the server's covers enough of every round
    (`SERVER_COVER_MIN`); not checked elsewhere (rounds too short, no figure)."""
    server, ours = accept.server_accept_length, accept.decode_accept_length
    if accept.server_covers < SERVER_COVER_MIN or math.isnan(server) or math.isnan(ours):
        return False
    return abs(server - ours) > 0.05 * ours


# -- the cell's measurement -----------------------------------------------------------------


@dataclass(frozen=True)
class CellMeasurement:
    """Everything measured for one cell; the journal stores it, the cube is built from it. The
    field names are the journal keys and cube variables (`dvfs.records.QUANTITIES`)."""

    energy_j: float
    decode_time_s: float
    output_tokens: int
    rounds: int
    requests: int
    latency: LatencyStats
    accept: Acceptance
    power_mean_w: float
    power_max_w: float
    sm_clock_observed_mhz: float
    temperature_max_c: float
    clock_event_reasons: int
    quality: int
    idle_power_w: float
    timeline_t_s: tuple[float, ...] = ()
    timeline_power_w: tuple[float, ...] = ()
    timeline_sm_clock_mhz: tuple[float, ...] = ()
    #: Student-t interval over the rounds, relative half-width (see `MeasurementRecord`).
    energy_per_token_rel_ci: float = math.nan
    latency_rel_ci: float = math.nan
    counter_updates: int = 0
    temperature_start_c: float = math.nan
    #: Tokens over the windows' intervals between counter updates, a decode step's tokens
    #: spread over the step (a fraction); `output_tokens` rounds it. NaN: use output_tokens.
    window_tokens: float = math.nan
    #: Mean input tokens (by the journal's token count method) of the prompts the cell's
    #: rounds sent, each prompt once per round it went out in: the context its decode started
    #: from, which the roofline reads. NaN: not recorded (the meter does not know the prompts;
    #: the runner passes it to `summarise`).
    prompt_tokens: float = math.nan
    #: Seconds a throttle policy (`dvfs.gpu.base.THROTTLE_POLICIES`: thermal, board limit)
    #: held a GPU below its clocks during the cell's rounds, by NVML's violation counters read
    #: at each round's start and end: in each round the largest growth of any GPU's counter
    #: of those that could tell (`throttle_violation_delta`), summed over the rounds; NaN
    #: where none could (a driver without the call).
    throttle_violation_s: float = math.nan

    def __post_init__(self) -> None:
        if self.energy_j < 0 or math.isnan(self.energy_j):
            raise ValueError(f"energy must be a non-negative number, got {self.energy_j}")
        if self.decode_time_s < 0:
            raise ValueError(f"window must be non-negative, got {self.decode_time_s}")
        if self.output_tokens < 0:
            raise ValueError("token count must be non-negative")

    @property
    def valid(self) -> bool:
        return not (self.quality & INVALIDATING)

    @property
    def tokens(self) -> float:
        """The window's tokens as energy per token divides by them."""
        return self.output_tokens if math.isnan(self.window_tokens) else self.window_tokens

    @property
    def energy_per_token_j(self) -> float:
        return self.energy_j / self.tokens if self.tokens > 0 else math.nan

    @property
    def throughput_tok_s(self) -> float:
        return self.tokens / self.decode_time_s if self.decode_time_s > 0 else math.nan

    @property
    def energy_per_token_above_idle_j(self) -> float:
        if not self.tokens > 0:
            return math.nan
        return (self.energy_j - self.idle_power_w * self.decode_time_s) / self.tokens


def _thin_timeline(
    pieces: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rounds' (time, power, clock) samples end to end, thinned to TIMELINE_POINTS evenly
    spaced ones."""
    if not pieces:
        empty = np.array([])
        return empty, empty, empty
    t, power, clock = (np.concatenate(column) for column in zip(*pieces, strict=True))
    if len(t) > TIMELINE_POINTS:
        picks = _timeline_picks(len(t))
        t, power, clock = t[picks], power[picks], clock[picks]
    return t, power, clock


@functools.lru_cache(maxsize=256)
def _timeline_picks(n: int) -> np.ndarray:
    """TIMELINE_POINTS evenly spaced indices into `n` samples (a cell's sample counts repeat:
    worked out once each; read-only)."""
    picks = np.linspace(0, n - 1, TIMELINE_POINTS).round().astype(int)
    picks.flags.writeable = False
    return picks


@dataclass
class WindowPart:
    """One round's contribution to a cell: its window and the samples taken during it, and
    its energy on the counter's updates when the runner already took it."""

    result: RoundResult
    window: tuple[int, int] | None
    samples: dict[str, np.ndarray]
    energy: RoundEnergy | None = None
    #: Nanoseconds the throttle policies' violation counters grew over the round, the
    #: largest growth of any GPU's (`throttle_violation_delta`); None: no GPU could tell.
    violation_ns: int | None = None

    def round_energy(self, periods_s: Sequence[float | None] = ()) -> RoundEnergy | None:
        """The round's energy and tokens between counter updates (None without a window)."""
        if self.window is None:
            return None
        if self.energy is None:
            done = [r for r in self.result.requests if len(r.chunk_ns)]
            curve = TokenCurve.of([r.chunk_ns for r in done], [r.chunk_tokens for r in done])
            self.energy = round_energy(self.samples, curve, self.window, periods_s)
        return self.energy


def _inside(
    t_ns: np.ndarray, start: int, end: int
) -> tuple[slice | np.ndarray, int, slice | np.ndarray, int]:
    """The samples taken in [start, end] and how many, and those in [start, end - 1] (the
    decode's, before the close) and how many: slices when their instants ascend (a sampler's
    do), else masks (the same samples, in the same order, either way). Both at once: one
    check that the instants ascend, one bisection for the start."""
    # (the ufuncs' own reductions and the array's own searchsorted, as np.all and
    # np.searchsorted call them, without their dispatch)
    if len(t_ns) < 2 or bool(_ALL(t_ns[1:] >= t_ns[:-1])):
        first = int(t_ns.searchsorted(start, "left"))
        before_close, last = t_ns.searchsorted((end - 1, end), "right").tolist()
        return (
            slice(first, max(first, last)),
            max(0, last - first),
            slice(first, max(first, before_close)),
            max(0, before_close - first),
        )
    inside = (t_ns >= start) & (t_ns <= end)
    decoding = (t_ns >= start) & (t_ns <= end - 1)
    return inside, int(inside.sum()), decoding, int(decoding.sum())


_ALL, _MAX, _MIN, _SUM = np.logical_and.reduce, np.maximum.reduce, np.minimum.reduce, np.add.reduce


def _mean(values: np.ndarray) -> float:
    """`float(values.mean())` by its own steps (a float64 sum over the count), without its
    argument handling."""
    return float(np.add.reduce(values, dtype=np.float64)) / len(values)


#: One GPU's throttle violation counters at one instant (`Gpu.throttle_violation_ns`: each
#: `THROTTLE_POLICIES` policy's, ns, None for one it cannot tell); None: a GPU without them.
ViolationRead = tuple[int | None, ...] | None


def throttle_violation_reads(gpus: Iterable[object]) -> tuple[ViolationRead, ...]:
    """Each GPU's throttle violation counters now (`Gpu.throttle_violation_ns`, ns, one per
    policy); None for a GPU that has no such read (a stand-in GPU)."""
    reads: list[ViolationRead] = []
    for gpu in gpus:
        read = getattr(gpu, "throttle_violation_ns", None)
        reads.append(None if read is None else tuple(read()))
    return tuple(reads)


def throttle_violation_delta(
    start: Sequence[ViolationRead], end: Sequence[ViolationRead]
) -> int | None:
    """How long the most-throttled GPU was throttled between two reads
    (`throttle_violation_reads`), by the counter that grew the most: the largest growth of
    any policy's counter of any GPU read both times; None where none was. A counter that went
    back (a driver reloaded between the reads) grew by nothing.

    The largest, not a sum, over the GPUs: a tensor-parallel group's GPUs run the same
    wall-clock window, so their times summed and held against that window
    (`violation_throttled`) flagged two GPUs each throttled for 0.6% of it, neither past the
    share, and recorded more seconds than any GPU was throttled. Nor over one GPU's policies:
    nvml.h has each policy count how long it held the GPU below its clocks, and keeps the
    time any limiter did apart (TOTAL_APP_CLOCKS, which counts the power cap too, so dvfs
    cannot read it instead): two policies may hold the GPU at once, and a throttle both
    thermal and board-limit counted was counted twice. The time some counter was growing lies
    between the largest growth and the sum; the largest is the time certainly throttled, so
    the flag and the recorded seconds never count a throttle twice (two throttles at
    different times, on two GPUs or two policies, each under the share, flag nothing)."""
    largest: int | None = None  # (one loop, no lists: read around every round)
    for first, last in zip(start, end, strict=True):
        if first is None or last is None:
            continue
        for a, b in zip(first, last, strict=True):
            if a is not None and b is not None:
                grown = max(0, b - a)
                if largest is None or grown > largest:
                    largest = grown
    return largest


#: The share of a cell's steady windows that throttle violation time (each round's
#: most-throttled GPU's, `throttle_violation_delta`) must exceed to flag the cell throttled.
#: A counter that grows by a few microseconds over seconds of decode (a healthy GPU's brief
#: thermal or board-limit excursion) cannot move the cell's energy or latency by a fraction
#: of any precision a campaign asks for, yet would invalidate it: the time is recorded
#: either way.
THROTTLE_VIOLATION_SHARE = 0.01


def violation_throttled(violation_ns: int | None, window_ns: float) -> bool:
    """Whether `violation_ns` of throttle violation time (`throttle_violation_delta`, over
    the rounds whose steady windows last `window_ns` in all) flags a cell throttled: more
    than `THROTTLE_VIOLATION_SHARE` of the windows; never where no GPU could tell (None)."""
    return violation_ns is not None and violation_ns > THROTTLE_VIOLATION_SHARE * window_ns


def mean_prompt_tokens(loads: Iterable[Workload]) -> float:
    """The mean input tokens of the prompts `loads` (a cell's rounds) sent, each prompt once
    per round it went out in, by the count each carries (the journal's token count method);
    NaN for none."""
    counts = [p.input_tokens for load in loads for p in load.prompts]
    return math.fsum(counts) / len(counts) if counts else math.nan


def summarise(
    parts: Sequence[WindowPart],
    *,
    requested_clock_mhz: int | None,
    min_window_s: float,
    stock_clock_mhz: int | None = None,
    sample_period_s: float,
    idle_power_w: float,
    counter_periods_s: Sequence[float | None] = (),
    precision: float = 0.01,
    confidence: float = 0.95,
    prompt_tokens: float = math.nan,
) -> CellMeasurement:
    """Combine a cell's rounds into one measurement and run the quality checks.
    `prompt_tokens`: the rounds' mean prompt length (`mean_prompt_tokens`), which the caller
    knows and the measurement records as it is.

    Each round's energy and tokens are taken between counter updates (`WindowPart.round_energy`,
    with the GPUs' detected update periods); the cell's are their sums, and the rounds' energy
    per token and median TPOT give the Student-t intervals (at `confidence`). Windows whose
    length between updates is less certain than `precision` (`counter.length_uncertainty`:
    too few updates, or a counter slower than the window) leave the energy less precise than
    asked: few_counter_updates, invalid.

    The observed clock (the slowest GPU's at each sample) must match a locked clock within
    CLOCK_TOLERANCE_MHZ: the fastest GPU's above it, a lock did not take; below it without
    SwPowerCap, something other than the knobs held it down. Below it with SwPowerCap, the
    power limit bound (the cell's own or the stock one): the cell is valid and flagged
    power_capped, since applying the same setting reproduces it.
    A stock-clock cell (`stock_clock_mhz`: the GPUs' maximum clock, given when dvfs knows of
    no lock) must run at it: below it by more than the tolerance with no reason but
    ApplicationsClocksSetting (a lock or applications clocks set outside dvfs, which NVML
    cannot read back) or SyncBoost (held to another GPU's clock), it is flagged
    clock_held_low, invalid; at full clock 0x2 alone is not.
    Fewer than three samples taken while the windows decoded (a reading on a close is not
    one) leave the cell's power and clock barely observed: invalid.
    A throttle between two samples shows in no sampled reason: rounds whose throttle
    violation counters grew (`WindowPart.violation_ns`, read at their starts and ends) by
    more than `THROTTLE_VIOLATION_SHARE` of the windows flag the cell throttled as a sampled
    throttle reason does; the seconds are kept (`throttle_violation_s`, NaN where no GPU
    could tell).

    The highest power is the largest power sample inside the windows, or a round's mean power
    from the energy counter where that is larger: so the cell's mean power never exceeds it.
    NaN (not measured) where neither is (only closing readings in the windows, a counter that
    gave nothing: counter_stalled), never 0 W.

    Power, clock, reasons and the timeline take a window's samples from its start up to, not
    at, its close: the sampler's last reading of a round that ends at its window's close
    (the twin's, on virtual time) falls on the close and reads the GPU after the decode's
    last step, idle (its power, its idle clock, GpuIdle), which drew a dip at each round's
    close, moved the clock's mean and set GpuIdle (hiding a stock clock held low); nor is it
    counted among the samples (too few: few_samples), or a cell sampled only at its closes
    would pass with no clock observed. The temperature keeps it: the die's temperature does
    not jump at the close (the reading is the decode's last).
    """
    quality = 0
    energy_mj = 0.0
    window_ns = 0
    tokens = 0.0
    spanned_s = 0.0
    intervals = 0
    per_token: list[float] = []
    latency: list[float] = []
    energies: list[RoundEnergy] = []
    clock_weighted = 0.0
    fastest_weighted = 0.0  # the fastest GPU's clock (one GPU: the same), for a lock not held
    clock_ns = 0  # the windows of the rounds sampled inside them: the clock's weights
    power_max = 0.0
    power_seen = False  # a decoding reading or a round's counter energy: else not measured
    temp_max = -math.inf
    reasons = 0
    timeline: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # time, power, clock
    offset_s = 0.0
    in_window_samples = 0
    decoding_samples = 0  # those before the windows' closes: the readings of the decode
    violation_ns: int | None = None
    for part in parts:
        if part.window is None:
            continue
        if part.violation_ns is not None:
            violation_ns = (violation_ns or 0) + part.violation_ns
        start, end = part.window
        s = part.samples
        e = part.round_energy(counter_periods_s)
        assert e is not None
        if not e.energy_mj > 0 or e.stalled:
            quality |= Q_COUNTER_STALLED
        energy_mj += max(e.energy_mj, 0.0)
        window_ns += end - start
        spanned_s += e.seconds
        tokens += e.tokens
        intervals += max(0, e.updates - 1)
        energies.append(e)
        if e.seconds > 0 and e.energy_mj > 0:
            # The sampled instants can miss a round's hottest passes; the counter sees them
            # all, so the highest power is at least the hottest round's mean (and the cell's
            # mean, an average of its rounds', never exceeds it).
            power_max = max(power_max, e.energy_mj / 1000 / e.seconds)
            power_seen = True
        per_token.append(e.energy_per_token_j)
        latency.append(latency_stats(part.result).tpot_ms[0])
        # [start, end] for the temperature; [start, end) (whole ns) for the rest: a reading
        # at the close reads the GPU idle (see the docstring)
        inside, count, decoding, n = _inside(s["t_ns"], start, end)
        in_window_samples += count
        if count:
            temp_max = max(temp_max, float(_MAX(s["temperature_c"][inside])))
        decoding_samples += n
        if n:
            clock = s["sm_clock_mhz"][decoding]
            power = s["power_mw"][decoding]
            clock_weighted += _mean(clock) * (end - start)
            fastest = s.get("sm_clock_max_mhz")
            fastest_weighted += (_mean(clock) if fastest is None else _mean(fastest[decoding])) * (
                end - start
            )
            clock_ns += end - start
            power_max = max(power_max, float(_MAX(power)) / 1000)
            power_seen = True
            reasons |= int(np.bitwise_or.reduce(s["reasons"][decoding]))
            timeline.append(
                (
                    offset_s + (s["t_ns"][decoding] - start) * 1e-9,
                    power / 1000,
                    clock.astype(float),
                )
            )
        offset_s += (end - start) * 1e-9
    window_s = window_ns * 1e-9
    results = [p.result for p in parts]
    if all(res.arrays is not None for res in results):
        # rounds as arrays (`RoundArrays`): no trace built, none retracted
        accept = acceptance(results)
        requests = sum(len(res.arrays.counts) for res in results if res.arrays is not None)
        retracted = False
    else:
        all_requests = [r for res in results for r in res.requests]
        accept = acceptance(results, all_requests)
        requests = len(all_requests)
        retracted = any(map(_RETRACTIONS, all_requests))
    if window_ns == 0:
        quality |= Q_NO_WINDOW
    if 0 < window_s < min_window_s:
        quality |= Q_SHORT_WINDOW
    if window_ns and decoding_samples < 3:
        quality |= Q_FEW_SAMPLES
    if window_ns and length_uncertainty(energies) > precision:
        quality |= Q_FEW_COUNTER_UPDATES
    # A round without a sample in its window says nothing about the clock: its length is
    # left out of the weights, or it would pull the mean down towards zero.
    sm_clock = clock_weighted / clock_ns if clock_ns else math.nan
    if requested_clock_mhz is not None and not math.isnan(sm_clock):
        # above: any GPU (of a tensor-parallel group) whose lock did not take, not the slowest
        above = fastest_weighted / clock_ns > requested_clock_mhz + CLOCK_TOLERANCE_MHZ
        below = sm_clock < requested_clock_mhz - CLOCK_TOLERANCE_MHZ
        if above or (below and not reasons & EVENT_SW_POWER_CAP):
            quality |= Q_CLOCK_NOT_REACHED
    if stock_clock_mhz is not None and not math.isnan(sm_clock):
        held_low = sm_clock < stock_clock_mhz - CLOCK_TOLERANCE_MHZ
        # 0x2 alone is no proof: a driver may report it at default applications clocks, at
        # full speed. Only a clock actually held down counts. SyncBoost explains a low clock
        # no better: a sync-boost group holds it to another GPU's, not this one's stock.
        if held_low and not reasons & ~(EVENT_APPLICATIONS_CLOCKS | EVENT_SYNC_BOOST):
            quality |= Q_CLOCK_HELD_LOW
    if reasons & EVENT_THROTTLE_MASK or violation_throttled(violation_ns, window_ns):
        quality |= Q_THROTTLED
    if reasons & EVENT_SW_POWER_CAP:
        quality |= Q_POWER_CAPPED
    if accept_mismatch(accept):
        quality |= Q_ACCEPT_MISMATCH
    if retracted:
        quality |= Q_RETRACTED
    line_t, line_power, line_clock = _thin_timeline(timeline)
    energy_j = energy_mj / 1000
    temperatures = [p.samples["temperature_c"] for p in parts if len(p.samples["temperature_c"])]
    return CellMeasurement(
        energy_j=energy_j,
        decode_time_s=spanned_s,
        output_tokens=round(tokens),
        rounds=len(parts),
        requests=requests,
        latency=rounds_latency(results),
        accept=accept,
        power_mean_w=energy_j / spanned_s if spanned_s > 0 else math.nan,
        # NaN where only closing readings fell in the windows and the counter gave nothing
        power_max_w=power_max if in_window_samples and power_seen else math.nan,
        sm_clock_observed_mhz=sm_clock,
        temperature_max_c=temp_max if in_window_samples else math.nan,
        clock_event_reasons=reasons,
        quality=quality,
        idle_power_w=idle_power_w,
        timeline_t_s=tuple(line_t.round(6).tolist()),  # (what np.round calls)
        timeline_power_w=tuple(line_power.round(3).tolist()),
        timeline_sm_clock_mhz=tuple(line_clock.tolist()),
        energy_per_token_rel_ci=relative_half_width(per_token, confidence),
        latency_rel_ci=relative_half_width(latency, confidence),
        counter_updates=intervals + sum(1 for p in parts if p.energy and p.energy.updates),
        temperature_start_c=float(temperatures[0][0]) if temperatures else math.nan,
        window_tokens=tokens,
        prompt_tokens=prompt_tokens,
        throttle_violation_s=math.nan if violation_ns is None else violation_ns * 1e-9,
    )
