"""In-flight stepping: several knob levels measured inside one long decode.

`measurement.mode = "in-flight"` measures the cells that differ only in their knob setting
(same drafter, repeat, batch and corpus: one group of `inflight_groups`) in one fixed-batch
decode instead of one decode each. The batch keeps decoding while the knob steps every segment;
each segment's first `settle_s` is discarded, the rest is that level's window: energy from the
GPUs' counters over it, tokens over the same interval on the whole decode's token curve (the
pass running at its end counted in part, as a per-level window counts it), ITL and TPOT from
the chunks that arrived in it. TTFT (the prefill) and acceptance (the drafts do not depend on
the knob) are the round's, shared by every level of the group, and the record says so.

Levels are ordered so slow drift cancels: the KV cache grows through the decode and the GPU
warms, so a level measured late would otherwise look different from one measured early.
`segment_order` lays the segments out so that every level's mean position is the same (a
pure function), in the campaign's `measurement.inflight_order`: "abba" visits the levels
forward then backward within each decode (A B C C B A; the middle pair changes nothing, so
its second segment discards no settle); "serpentine" visits each level once per decode,
forward on even rounds and backward on odd ones (rounds come in pairs). Equal segments make
a drift linear in time add the same amount to every level, so the differences between levels
are unbiased.

Decodes are added until every level's energy per token and median TPOT reach
`measurement.precision` (at most `max_rounds`): the interval is Student-t over the decodes
(each one drift-cancelled by its order, each with its own prompts), so it holds the prompts'
variation like a per-level cell's interval over rounds. How well the levels are known against
each other (drift and each decode's prompts fitted out, `level_estimates`) is kept as
provenance. Rounds are sized from the warm-up's decode rate, then from each level's measured
rate, with a few percent to spare, and never past half the engine's request deadline at the
slowest rate the warm-up allows, then the previous decode (`deadline_tokens`); the levels a
decode ends before are left to the next ones. Where every decode ends before the levels'
second visits, each level sits at its own place and no drift is cancelled or can be fitted
(`fit_context_slope`): the levels are flagged `drift_not_cancelled` (invalid).

The decode is as long as its segments need, so it reaches a longer context than a per-level
cell of `output_tokens`, and where attention's KV reads weigh (large batches, long prompts)
energy per token and TPOT grow with it. Each level is carried to a per-level cell's context
(half of `output_tokens` decoded) along a relative drift fitted across the group's segments
(`context_slope`: energy per token = level * (1 + slope * tokens decoded) * an offset per
decode, linear as the KV cache's reads grow; TPOT = level * exp(slope * tokens decoded) *
an offset per decode), each
segment from its own place in the decode (`carried_factor`); the record keeps the measured
value, the slope and the factor (`inflight.context`), and each segment's energy and tokens.

Limits: fixed batches only; a group's levels share one die temperature (the die responds
over tens of seconds, a segment lasts about one), near the steady temperature of the group's
mean power, where a per-level cell runs nearer its own level's: with leakage, a level whose
power is well above the group's mean comes out below a per-level cell (0.6-0.9% at 700 W,
batch 8 on the twin; README, "In-flight stepping"); a nonlinear drift cancels
only in part, and the context factor
assumes one relative slope for every level (its uncertainty is not in the interval): a level
whose own drift differs (a power cap that binds only as the context grows; the top clock,
whose higher base energy per token grows relatively less: 35% per 1,000 tokens against
36-39%, batch 64 on the twin, so it comes out about 0.4% low, 0.2-0.7% with the prompts)
is carried along the levels' common one. Slopes fitted per level were tried: on the twin
they carry such levels right but amplify whatever a level's early and late segments hold
besides a straight drift (a capped level's bending one: 1980 MHz at 200 W, batch 64, came
out 1.6% low; a counter's millijoule: 0.09% between executors).

The seam with the runner (`dvfs.measure.runner`, which dispatches here):

    records = run_inflight(runner, cells, settle_s=settle_s)

- `runner`: the `Runner` (what `InflightHost` names). It has opened the session and started
  the cells' drafter's server; `run_inflight` applies the knobs itself through
  `runner.knobs` (the safety layer records every change) and leaves the GPUs at the last level
  applied, so the runner must forget its current setting (`runner._setting = None`).
- `cells`: one group of `inflight_groups(plan_cells(campaign))`, one cell per knob level.
- `settle_s`: seconds discarded at the start of every segment: the measured settle
  (`dvfs.measure.settle`) where the runner has one, else None for `[measurement] settle`
  when it is a number, else `[knobs] settle_s`.
- Returns one `CellRecord` per cell, in the order of `cells`, not yet journaled (the runner
  appends each and reports progress). Each carries `inflight` provenance: the group id, the
  ordering scheme, the group's decodes (`rounds`; the measurement's `rounds`, `requests` and
  `prompt_tokens` count the level's own: the decodes that measured it), its segments
  (round, position, start and measured seconds, energy per token, tokens decoded), what its
  levels share (TTFT,
  acceptance), the between-level interval, and the group's GPU time (`gpu_time_s`: settle,
  warmup, prefill, window, drain; the levels' idle baselines and their settles go through
  `runner._apply_setting`; a level whose baseline the runner holds, `runner.idle_at`, is not
  applied for it: the runner takes them all before a thermal stabilisation). Each
  also carries the group's power-limit reads (`runner._power_limits`, after the first level
  is applied and after the last decode, against the lowest level's limit): an enforced limit
  below it flags every cell `power_limit_not_held`; and the other tenants' processes seen on
  the metered GPUs then (`runner.tenants`), which flag every cell `foreign_process`; a level
  whose idle baseline another tenant's process overlapped is flagged `idle_baseline_foreign`,
  one whose baseline is the mean of the instant power readings `idle_from_power_readings`.

Engines step the knob through `dvfs.engines.base.KnobTimeline`: the twin splits its decode
at the steps (virtual time), SGLang runs a stepping thread beside the streaming requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dvfs.campaign.model import INFLIGHT_ORDERS
from dvfs.engines.base import RequestTrace, RoundResult
from dvfs.errors import CampaignError, EngineCrashedError, EngineError, EngineHungError
from dvfs.measure.counter import round_energy, t_two_sided
from dvfs.measure.journal import INFLIGHT_ENERGY_DRIFT
from dvfs.measure.meter import (
    Q_ACCEPT_MISMATCH,
    Q_DRIFT_NOT_CANCELLED,
    Q_THROTTLED,
    CellMeasurement,
    LatencyStats,
    PowerLimitRead,
    WindowPart,
    accept_mismatch,
    acceptance,
    latency_stats,
    mean_prompt_tokens,
    power_limit_quality,
    round_chunks,
    steady_window_ns,
    summarise,
    throttle_violation_delta,
    throttle_violation_reads,
    violation_throttled,
)
from dvfs.measure.plan import Cell
from dvfs.measure.tenants import ForeignProcess, foreign_quality, idle_quality

if TYPE_CHECKING:
    from dvfs.campaign import Campaign
    from dvfs.clock import Clock
    from dvfs.engines.base import Engine, Workload
    from dvfs.gpu.base import Gpu
    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.measure.tenants import TenantCheck
    from dvfs.records import CellRecord

SCHEMES = INFLIGHT_ORDERS  # measurement.inflight_order
#: Head room on the round's tokens: sized from the warm-up's rate bound for the first round,
#: from each level's measured rate after it (speculation's acceptance varies round to round).
FIRST_ROUND_MARGIN = 1.15
LATER_ROUND_MARGIN = 1.05
#: Each segment's measured part is this much longer than its share of `min_window_s`: a step
#: lands on the first forward pass (or chunk) after its instant, so a segment can come out a
#: pass shorter than planned.
SEGMENT_HEADROOM = 1.02
#: Shortest measured part of a segment, in sample periods (the meter needs readings inside).
MIN_SEGMENT_SAMPLES = 5
#: The least spread of the tokens decoded that the levels and rounds leave unexplained, as a
#: share of the segments' whole spread, for `context_slope` to fit a slope from.
MIN_SLOPE_SPREAD = 0.1
#: The share of the engine's request deadline a round may take at the slowest decode rate its
#: warm-up allows (`deadline_tokens`).
ROUND_DEADLINE_SHARE = 0.5


# -- ordering (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One stretch of one decode at one knob level: `round` (which decode), `position`
    (its index within that decode) and `level` (an index into the group's settings)."""

    round: int
    position: int
    level: int


def segments_per_round(levels: int, scheme: str) -> int:
    _check_scheme(scheme)
    return 2 * levels if scheme == "abba" else levels


def rounds_step(scheme: str) -> int:
    """Rounds are taken in steps of this many (a serpentine cancels drift over a pair)."""
    _check_scheme(scheme)
    return 1 if scheme == "abba" else 2


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown in-flight order {scheme!r}: choose one of {', '.join(SCHEMES)}")


def level_order(settings: Sequence[Any], scheme: str = "abba", round_index: int = 0) -> list[Any]:
    """The settings in the order one decode visits them (round `round_index`)."""
    _check_scheme(scheme)
    forward = list(settings)
    if scheme == "abba":
        return forward + forward[::-1]
    return forward if round_index % 2 == 0 else forward[::-1]


def segment_order(levels: int, scheme: str = "abba", rounds: int = 1) -> tuple[Segment, ...]:
    """Every segment of `rounds` decodes over `levels` levels, in measuring order. Each level's
    mean global position (round * segments_per_round + position) is the same, for any
    number of rounds with "abba" and any even number with "serpentine"."""
    if levels < 1:
        raise ValueError("in-flight stepping needs at least one level")
    out = []
    for r in range(rounds):
        for position, level in enumerate(level_order(range(levels), scheme, r)):
            out.append(Segment(r, position, level))
    return tuple(out)


def mean_positions(segments: Sequence[Segment], per_round: int) -> dict[int, float]:
    """Each level's mean global position (what must be equal for drift to cancel)."""
    sums: dict[int, list[int]] = {}
    for s in segments:
        sums.setdefault(s.level, []).append(s.round * per_round + s.position)
    return {level: sum(p) / len(p) for level, p in sorted(sums.items())}


# -- grouping (pure) ---------------------------------------------------------------------------


def group_key(cell: Cell) -> tuple[str, int, int, str]:
    return (cell.drafter, cell.repeat, cell.batch, cell.corpus)


def inflight_groups(cells: Sequence[Cell]) -> list[tuple[Cell, ...]]:
    """The plan's cells grouped for in-flight stepping: those sharing (drafter, repeat, batch,
    corpus), one per knob level, in the order each group's first cell appears (so drafters stay
    outermost and a server starts once per drafter); within a group, in plan order."""
    groups: dict[tuple[str, int, int, str], list[Cell]] = {}
    for cell in cells:
        groups.setdefault(group_key(cell), []).append(cell)
    return [tuple(g) for g in groups.values()]


def whole_groups_done(mode: str, cells: Sequence[Cell], done: set[str]) -> set[str]:
    """The keys of `done` (a journal's finished cells) a run of `cells` skips: in flight, not
    those of a group (`inflight_groups`) it holds only some levels of (an older dvfs journaled
    them one by one, or a power loss kept part of the group's one write). Measured apart, in
    decodes of their own, its other levels came out up to 1.2% off an uninterrupted run's; so
    the whole group is measured again, and its new records replace the old ones, as a later
    record of a cell does in the cube."""
    if mode != "in-flight":
        return done
    part = [g for g in inflight_groups(cells) if any(c.key not in done for c in g)]
    return done - {c.key for g in part for c in g}


def group_id(cells: Sequence[Cell]) -> str:
    drafter, repeat, batch, corpus = group_key(cells[0])
    return f"{drafter}/{corpus}/b{batch}/r{repeat}"


# -- one segment's traces (pure) ---------------------------------------------------------------


def segment_requests(
    requests: Sequence[RequestTrace], start_ns: int, end_ns: int
) -> tuple[RequestTrace, ...]:
    """Each request cut to the chunks that arrived in (start, end], led by the chunk before
    (carrying 1 token, outside the window) so the first gap and TPOT span the segment. TTFT of
    these traces means nothing: the caller takes the whole round's."""
    out = []
    for r in requests:
        if r.error is not None or not len(r.chunk_ns):
            continue
        lo = int(np.searchsorted(r.chunk_ns, start_ns, side="right"))
        hi = int(np.searchsorted(r.chunk_ns, end_ns, side="right"))
        if hi <= lo:
            continue
        anchor = max(lo - 1, 0)
        ns = r.chunk_ns[anchor:hi]
        tokens = np.array(r.chunk_tokens[anchor:hi], dtype=np.int64)
        if anchor < lo:
            tokens[0] = 1
        out.append(
            RequestTrace(
                sent_ns=r.sent_ns,
                chunk_ns=ns,
                chunk_tokens=tokens,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=int(tokens.sum()),
                finish_reason=r.finish_reason,
                retractions=r.retractions,
            )
        )
    return tuple(out)


# -- running a group ---------------------------------------------------------------------------


class InflightHost(Protocol):
    """What `run_inflight` uses of the runner."""

    campaign: Campaign
    gpus: list[Gpu]
    engine: Engine
    clock: Clock
    knobs: KnobController
    idle_power_w: float
    #: The idle power at the setting last applied through `_apply_setting`.
    setting_idle_power_w: float
    #: Tells other tenants' compute processes from the server's.
    tenants: TenantCheck
    #: Those seen around the idle baseline `setting_idle_power_w` came from.
    setting_idle_foreign: tuple[ForeignProcess, ...]
    #: That baseline's quality flags (idle_from_power_readings).
    setting_idle_flags: int

    @property
    def fit_periods_s(self) -> list[float | None]: ...

    @property
    def round_sample_period_s(self) -> float: ...

    def _workload(self, cell: Cell, label: object, max_new_tokens: int) -> Workload: ...

    def _apply_setting(self, setting: KnobSetting) -> None: ...

    def idle_at(
        self, setting: KnobSetting
    ) -> tuple[float, tuple[ForeignProcess, ...], int] | None: ...

    def _power_limits(self) -> list[tuple[int | None, int | None]]: ...

    def note_tenants(self, seen: Sequence[ForeignProcess]) -> None: ...

    def server_crashed(self, drafter: str, *, restart: bool, hung: bool = False) -> None: ...

    def _power_limit_reads(
        self,
        cells: Cell | Sequence[Cell],
        start: Sequence[tuple[int | None, int | None]],
        end: Sequence[tuple[int | None, int | None]],
    ) -> tuple[PowerLimitRead, ...]: ...


@dataclass
class _Measured:
    """One segment measured: which, its window and tokens, and where its samples are."""

    segment: Segment
    start_ns: int
    end_ns: int
    window: tuple[int, int] | None
    part: WindowPart
    #: Over this segment alone: energy per token (J), median TPOT (ms), decode rate per
    #: request (tok/s).
    energy_per_token_j: float
    tpot_ms: float
    rate_tok_s: float
    #: Tokens each request had decoded by the middle of the measured span (its context is
    #: its prompt plus these): where along the decode this segment sat.
    decoded_tokens: float
    #: The segment's energy (J, from the counters over its span) and tokens.
    energy_j: float = math.nan
    tokens: float = math.nan


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def decode_rate_tok_s(result: RoundResult) -> float:
    """The fastest request's decode rate in a round (tokens after the first, per second)."""
    rates = [
        (r.completion_tokens - 1) / ((r.chunk_ns[-1] - r.chunk_ns[0]) * 1e-9)
        for r in result.requests
        if r.error is None and len(r.chunk_ns) > 1 and r.chunk_ns[-1] > r.chunk_ns[0]
    ]
    return max(rates) if rates else math.nan


def deadline_tokens(
    warm: RoundResult, deadline_s: float | None, slowest: float = 1.0
) -> int | None:
    """The most output tokens per request a round may ask for and still end within
    `ROUND_DEADLINE_SHARE` of the engine's request deadline (`deadline_s`, from a request's
    sending to its last chunk) at the slowest rate the warm-up allows: each request's tokens
    over its whole time, from its sending to its last chunk (its prefill included), times
    `slowest` (the slowest level's clock over the warm-up's: a lower clock is at most
    proportionally slower). The decode rate between the first and last chunk
    (`decode_rate_tok_s`) reads far too high when the chunks arrive bunched (a stalled
    client, or a server's output path, delivers a backlog at once: the whole warm-up within a
    millisecond), and a round sized from it alone would run past the deadline and fail; a
    stall can only lengthen the whole time. None: no deadline, or nothing to bound by."""
    if deadline_s is None or not math.isfinite(deadline_s):
        return None
    rates = [
        r.completion_tokens / ((r.chunk_ns[-1] - r.sent_ns) * 1e-9)
        for r in warm.requests
        if r.error is None and len(r.chunk_ns) and r.chunk_ns[-1] > r.sent_ns
    ]
    if not rates:
        return None
    return max(2, math.floor(min(rates) * slowest * deadline_s * ROUND_DEADLINE_SHARE))


def rate_bound(rate: float, reference_mhz: float, level_mhz: float) -> float:
    """An upper bound on a level's decode rate from one measured at `reference_mhz`: a lower
    clock is never faster, a higher one at most proportionally faster."""
    return rate * max(1.0, level_mhz / reference_mhz)


def measured_seconds(
    levels: int, scheme: str, min_window_s: float, sample_period_s: float
) -> float:
    """The measured part of each segment (after its settle): a level's segments in one round
    add up to `min_window_s`, with SEGMENT_HEADROOM, and hold MIN_SEGMENT_SAMPLES samples."""
    per_level = segments_per_round(levels, scheme) // levels
    return max(SEGMENT_HEADROOM * min_window_s / per_level, MIN_SEGMENT_SAMPLES * sample_period_s)


def round_seconds(
    levels: int, scheme: str, settle_s: float, min_window_s: float, sample_period_s: float
) -> float:
    """One in-flight decode's stepped part (every segment, settles included), for a dry-run
    estimate: add the prefill, the drain (a few percent, `LATER_ROUND_MARGIN`) and a warm-up
    per group."""
    segment_s = settle_s + measured_seconds(levels, scheme, min_window_s, sample_period_s)
    return segments_per_round(levels, scheme) * segment_s


def tokens_needed(rates_tok_s: Sequence[float], segment_s: float, margin: float) -> int:
    """Output tokens per request so the decode outlasts its segments (one rate per segment,
    tokens per second per request), with head room; the first token comes from the prefill."""
    return math.ceil(sum(rates_tok_s) * segment_s * margin) + 1


def settle_before(order: Sequence[Any], position: int, settle_s: float) -> float:
    """What a segment discards at its start: the settle, except after a segment at the same
    level (abba's middle pair: nothing changed). The pair then spans from one settle after its
    start to its end, whose middle is every other level's mean middle (each level's two
    segments sit symmetrically about the decode's middle, each measured from a settle after
    its start), so a linear drift still cancels."""
    if position > 0 and order[position] == order[position - 1]:
        return 0.0
    return settle_s


#: How a quantity drifts with the tokens decoded (`context_slope`, `carried_factor`):
#: "linear", value = level * (1 + slope * decoded); "exponential", value = level *
#: exp(slope * decoded).
DRIFTS = ("linear", "exponential")


def context_slope(
    values: Sequence[float],
    decoded: Sequence[float],
    segments: Sequence[Segment],
    levels: int,
    drift: str = "linear",
) -> float:
    """`fit_context_slope`, 0 where the segments cannot tell."""
    slope = fit_context_slope(values, decoded, segments, levels, drift)
    return 0.0 if slope is None else slope


def fit_context_slope(
    values: Sequence[float],
    decoded: Sequence[float],
    segments: Sequence[Segment],
    levels: int,
    drift: str = "linear",
) -> float | None:
    """How a quantity grows with the tokens decoded, common to the levels: a relative slope
    per token, fitted as value = level * drift(slope, decoded) * an offset per round (least
    squares on the logs; `DRIFTS`); None when the segments cannot tell (too few finite
    values, no spread in decoded, or each level at one place).

    Energy per token is fitted linear in the tokens decoded: each token's attention reads the
    KV cache once more, so a pass's time (and, at a steady power, its energy) grows by about
    a fixed amount per context token. An exponential fitted across a long decode bends the
    wrong way and carried levels back to a short context too high (up to 2.1% at batch 64 on
    the twin). TPOT keeps the exponential: on the twin its gap to per-level cells (chunks
    inside the segments against each request's whole decode) swamps the drift's shape."""
    if drift not in DRIFTS:
        raise ValueError(f"unknown drift {drift!r}: choose one of {', '.join(DRIFTS)}")
    with np.errstate(divide="ignore", invalid="ignore"):  # a segment without energy: left out
        y = np.log(np.asarray(values, dtype=float))
    d = np.asarray(decoded, dtype=float)
    keep = np.isfinite(y) & np.isfinite(d)
    if keep.sum() < levels + 2:
        return None
    rounds = sorted({s.round for s in segments})
    x = np.zeros((len(segments), levels + 1 + len(rounds) - 1))
    for i, seg in enumerate(segments):
        x[i, seg.level] = 1.0
        x[i, levels] = d[i] if math.isfinite(d[i]) else 0.0
        if seg.round != rounds[0]:
            x[i, levels + rounds.index(seg.round)] = 1.0
    x, y, d = x[keep], y[keep], d[keep]
    used = np.flatnonzero(x.any(axis=0))
    if levels not in used or np.linalg.matrix_rank(x[:, used]) < len(used):
        return None
    # The slope is told by where each level's own segments sit along the decode (what the
    # levels and rounds leave of `decoded`). Where each level sits at one place (a decode
    # that ended before the levels' second visits), that is a few tokens of jitter, and a
    # fit on it takes the levels' own differences for a drift (a 1500 MHz level carried to
    # half its energy per token): the segments cannot tell.
    others = x[:, [c for c in used if c != levels]]
    left = d - others @ np.linalg.lstsq(others, d, rcond=None)[0]
    if float(np.ptp(left)) < MIN_SLOPE_SPREAD * float(np.ptp(d)):
        return None
    if drift == "exponential":
        beta = np.linalg.lstsq(x[:, used], y, rcond=None)[0]
        return float(beta[used.tolist().index(levels)])
    base = x[:, [c for c in used if c != levels]]

    def misfit(slope: float) -> float:
        z = y - np.log1p(slope * d)
        beta = np.linalg.lstsq(base, z, rcond=None)[0]
        residual = z - base @ beta
        return float(residual @ residual)

    # From a relative fall that keeps every segment's value positive to a tenfold rise over
    # the decode; the misfit has one minimum in between.
    top = float(d.max())
    if top <= 0:
        return None
    return _golden_min(misfit, -0.999 / top, 10.0 / top, 1e-6 / top)


def _golden_min(f: Callable[[float], float], lo: float, hi: float, tol: float) -> float:
    """Where `f` is least on [lo, hi], to within `tol`, for an `f` with one minimum there
    (golden-section search: numpy's own, so a sweep need not import scipy)."""
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo, hi
    c, e = b - ratio * (b - a), a + ratio * (b - a)
    fc, fe = f(c), f(e)
    while b - a > tol:
        if fc <= fe:
            b, e, fe = e, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, e, fe
            e = a + ratio * (b - a)
            fe = f(e)
    return (a + b) / 2.0


def _factor(slope: float, target: float, decoded: float, drift: str) -> float:
    """What carries a value from `decoded` tokens decoded to `target` along `slope`."""
    if not math.isfinite(decoded):
        return 1.0
    if drift == "exponential":
        return math.exp(slope * (target - decoded))
    at, start = 1.0 + slope * target, 1.0 + slope * decoded
    # A falling drift carried past where it reaches zero means nothing: no value, not a
    # negative one (the fit keeps 1 + slope * d above 0 only across the decode's segments).
    return at / start if at > 0 and start > 0 else math.nan


def carried_factor(
    slope: float,
    target: float,
    decoded: Sequence[float],
    weights: Sequence[float],
    drift: str = "linear",
) -> float:
    """The factor that carries a level's pooled value to `target` tokens decoded: each
    segment carried from its own position (`decoded`), weighted by its share of the pool
    (its energy for energy per token, its time for TPOT). A pooled value leans toward its
    heavier segments (the early, faster ones for energy per token), so carrying it from the
    segments' plain mean position would misplace it where the drift is strong. 1 where no
    segment has both."""
    pairs = [
        (w, _factor(slope, target, d, drift))
        for d, w in zip(decoded, weights, strict=True)
        if math.isfinite(d) and math.isfinite(w) and w > 0
    ]
    total = math.fsum(w for w, _ in pairs)
    return math.fsum(w * f for w, f in pairs) / total if total > 0 else 1.0


def decoded_by(requests: Sequence[RequestTrace], t_ns: int) -> float:
    """Mean tokens per request that had arrived by `t_ns`."""
    counts = [
        float(r.chunk_tokens[: int(np.searchsorted(r.chunk_ns, t_ns, side="right"))].sum())
        for r in requests
        if r.error is None
    ]
    return float(np.mean(counts)) if counts else math.nan


def level_estimates(
    values: Sequence[float], segments: Sequence[Segment], levels: int, confidence: float
) -> tuple[np.ndarray, np.ndarray]:
    """Each level's value and the relative half-width of its interval, from one value per
    segment, fitted as level + drift * position + round offset (least squares).

    The drift (linear in the position within a decode: the KV cache grows) and each round's
    offset (its prompts, the card's temperature) are estimated beside the levels, so neither
    widens the intervals; with the orders of `segment_order` the level's value is the plain
    mean of its segments (its mean position is everyone's). Half-widths are Student-t on the
    residuals, two-sided like a per-level cell's (inf while there are no degrees of freedom
    left); non-finite values are left out."""
    y = np.asarray(values, dtype=float)
    keep = np.isfinite(y)
    rounds = sorted({s.round for s in segments})
    x = np.zeros((len(segments), levels + 1 + len(rounds) - 1))
    for i, seg in enumerate(segments):
        x[i, seg.level] = 1.0
        x[i, levels] = seg.position
        if seg.round != rounds[0]:
            x[i, levels + rounds.index(seg.round)] = 1.0
    x, y = x[keep], y[keep]
    nan = np.full(levels, np.nan)
    if len(y) == 0:
        return nan, np.full(levels, np.inf)
    used = np.flatnonzero(x.any(axis=0))
    x = x[:, used]
    beta, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    value = nan.copy()
    for j, col in enumerate(used):
        if col < levels:
            value[col] = beta[j]
    dof = len(y) - rank
    half = np.full(levels, np.inf)
    if dof > 0 and rank == x.shape[1]:
        residual = y - x @ beta
        s2 = float(residual @ residual) / dof
        cov = s2 * np.linalg.inv(x.T @ x)
        t = t_two_sided(confidence, dof)
        for j, col in enumerate(used):
            if col < levels and value[col] != 0:
                half[col] = t * math.sqrt(max(cov[j, j], 0.0)) / abs(value[col])
    return value, half


def level_halfwidths(
    values: Sequence[float],
    segments: Sequence[Segment],
    levels: int,
    scheme: str,
    confidence: float,
) -> np.ndarray:
    """Each level's relative half-width as an absolute value: Student-t over the level's
    means in each block of rounds whose order cancels a drift by itself (a round with "abba",
    a pair with "serpentine"). Each block decodes its own prompts, so this holds the prompts'
    variation, which `level_estimates` (the levels against each other) leaves out; inf below
    two blocks. The interval is two-sided, as a per-level cell's (`relative_half_width`), so
    the two modes' `*_rel_ci` mean the same and stop at the same precision."""
    step = rounds_step(scheme)
    blocks: dict[tuple[int, int], list[float]] = {}
    for v, seg in zip(values, segments, strict=True):
        if math.isfinite(v):
            blocks.setdefault((seg.level, seg.round // step), []).append(v)
    half = np.full(levels, np.inf)
    for level in range(levels):
        means = np.array([np.mean(v) for (lv, _), v in sorted(blocks.items()) if lv == level])
        if len(means) >= 2 and means.mean() != 0:
            sd = float(means.std(ddof=1))
            t = t_two_sided(confidence, len(means) - 1)
            half[level] = t * sd / math.sqrt(len(means)) / abs(float(means.mean()))
    return half


def _setting_mhz(cell: Cell, gpus: Sequence[Gpu]) -> float:
    if cell.sm_clock_mhz is not None:
        return float(cell.sm_clock_mhz)
    return float(max(g.identity.max_sm_clock_mhz for g in gpus))


def run_inflight(
    runner: InflightHost, cells: Sequence[Cell], *, settle_s: float | None = None
) -> list[CellRecord]:
    """Measure a group's knob levels inside shared decodes; one record per cell (see the
    module's docstring for the seam). Engine errors are retried `measurement.retries` times
    (a crashed server restarted first: `runner.server_crashed`), then every cell of the group
    fails with them."""
    from dvfs.records import CellRecord

    errors: list[str] = []
    retries = runner.campaign.measurement.retries
    for attempt in range(1, retries + 2):
        try:
            return _measure_group(runner, cells, settle_s, attempt, errors)
        except EngineCrashedError as exc:
            errors.append(f"attempt {attempt}: {exc}")
            # A dead server serves nothing more: forgotten, a fresh one for the retry (else the
            # runner starts one for the next group).
            try:
                runner.server_crashed(
                    cells[0].drafter,
                    restart=attempt <= retries,
                    hung=isinstance(exc, EngineHungError),
                )
            except EngineError as restart_exc:
                errors.append(f"restart failed: {restart_exc}")
                break
            if attempt > retries:
                break
        except EngineError as exc:
            errors.append(f"attempt {attempt}: {exc}")
    return [CellRecord.failed(c, attempts=len(errors), errors=errors) for c in cells]


def _measure_group(
    runner: InflightHost,
    cells: Sequence[Cell],
    settle_s: float | None,
    attempt: int,
    errors: Sequence[str],
) -> list[CellRecord]:
    from dvfs.engines.base import KnobStep, KnobTimeline
    from dvfs.measure.sampler import Sampler
    from dvfs.records import CellRecord

    campaign = runner.campaign
    m = campaign.measurement
    if campaign.workload.mode != "fixed":
        raise CampaignError("in-flight stepping needs workload.mode = 'fixed'")
    if len({c.setting for c in cells}) != len(cells) or len({group_key(c) for c in cells}) != 1:
        raise ValueError(
            "an in-flight group is one cell per knob setting of one (drafter, "
            "repeat, batch, corpus)"
        )
    scheme = m.inflight_order  # validated against SCHEMES when the campaign loaded
    precision, confidence = m.precision, m.confidence
    settle = settle_s
    if settle is None:  # a number in [measurement] settle, else the [knobs] one
        settle = m.settle if isinstance(m.settle, int | float) else campaign.knobs.settle_s
    segment_s = settle + measured_seconds(len(cells), scheme, m.min_window_s, m.sample_period_s)
    clock, knobs = runner.clock, runner.knobs
    periods = runner.fit_periods_s
    gpu_time = dict.fromkeys(("settle", "warmup", "prefill", "window", "drain"), 0.0)

    # Each level's idle baseline (the runner takes one per setting and session, when the
    # campaign asks for it), then the first level and a warm-up decode there that also sizes
    # the rounds.
    first = level_order(cells, scheme, 0)[0]
    idle: dict[int, float] = {}
    idle_foreign: dict[int, tuple[ForeignProcess, ...]] = {}
    idle_flags: dict[int, int] = {}
    # A level whose baseline the runner holds is not applied for it (the runner took them all
    # before stabilising the die at the first level: applying them again idled the GPUs
    # through their settles, the die cooling from where it was brought).
    for index, cell in sorted(enumerate(cells), key=lambda ic: ic[1] == first):
        known = runner.idle_at(cell.setting) if cell is not first else None
        if known is None:
            runner._apply_setting(cell.setting)
            known = (
                runner.setting_idle_power_w,
                runner.setting_idle_foreign,
                runner.setting_idle_flags,
            )
        idle[index], idle_foreign[index], idle_flags[index] = known
    # The group's limits, read at its first level (and after its last decode): the
    # configured one changes with the levels, the enforced one must not fall below them all.
    limits_start = runner._power_limits()
    foreign = runner.tenants.seen(runner.gpus, "start")
    t0 = clock.now_ns()
    warm = runner.engine.run(runner._workload(first, "inflight-warmup", max(m.warmup_tokens, 16)))
    gpu_time["warmup"] = (clock.now_ns() - t0) * 1e-9
    rate = decode_rate_tok_s(warm)
    if not math.isfinite(rate):
        raise EngineError("the in-flight warm-up decoded no tokens to size the rounds by")
    reference = _setting_mhz(first, runner.gpus)
    # No round is asked for more tokens than the request deadline leaves time for, however
    # fast the warm-up's chunks seemed to arrive.
    clocks = [_setting_mhz(c, runner.gpus) for c in cells]
    deadline_s = getattr(runner.engine, "request_timeout_s", None)
    most = deadline_tokens(warm, deadline_s, min(clocks) / reference)

    measured: list[_Measured] = []
    results: list[RoundResult] = []
    #: Each round's decode (the one that stepped: a decode run again in its place is not it).
    decodes: dict[int, RoundResult] = {}
    loads: dict[int, Workload] = {}  # and the prompts it sent
    # and how much its throttle violation counters grew (`summarise`; None: no GPU could tell)
    violations: dict[int, int | None] = {}
    windows_ns: dict[int, int] = {}  # each decode's steady window (ns)
    sent: list[Workload] = []  # every level decodes each round's prompts
    step = rounds_step(scheme)
    max_rounds = max(step, m.max_rounds - m.max_rounds % step)
    rounds = 0
    unstepped = False  # the last decode ran no knob step
    while rounds < max_rounds:
        # a block of rounds whose order cancels a drift by itself (`rounds_step`): a decode that
        # measured no level is run again in its place, so every block is whole
        block_end = rounds + step
        while rounds < block_end:
            order = level_order(cells, scheme, rounds)
            # Each level's rate as measured so far; a level none of whose segments was measured
            # yet (every level before the first decode, or one a decode ended before) has the
            # warm-up's bound. Until a segment is measured, the first round's wider margin.
            seen = {
                i: [
                    s.rate_tok_s
                    for s in measured
                    if s.segment.level == i and math.isfinite(s.rate_tok_s)
                ]
                for i in range(len(cells))
            }
            rates = [
                float(np.mean(seen[cells.index(c)]))
                if seen[cells.index(c)]
                else rate_bound(rate, reference, _setting_mhz(c, runner.gpus))
                for c in order
            ]
            margin = LATER_ROUND_MARGIN if measured else FIRST_ROUND_MARGIN
            tokens = tokens_needed(rates, segment_s, margin)
            if most is not None:
                tokens = min(tokens, most)
            workload = runner._workload(first, ("inflight", rounds), tokens)
            # Nor more than the served context leaves past the batch's longest prompt (the
            # server refuses a request past it: 134,610 tokens asked at 36 levels): the
            # levels a decode so bounded ends before are left to the next ones.
            room = _context_room(runner.engine, workload)
            if room is not None and 0 < room < tokens:
                tokens = room
                workload = runner._workload(first, ("inflight", rounds), tokens)
            sent.append(workload)
            steps = tuple(
                KnobStep(k * segment_s, _applier(knobs.apply, c.setting))
                for k, c in enumerate(order)
            )
            violation_start = throttle_violation_reads(runner.gpus)
            with Sampler(runner.gpus, clock, runner.round_sample_period_s) as sampler:
                result = runner.engine.run(workload, KnobTimeline(steps))
            violation = throttle_violation_delta(
                violation_start, throttle_violation_reads(runner.gpus)
            )
            failed = [r.error for r in result.requests if r.error]
            if failed:
                raise EngineError(f"{len(failed)} request(s) failed; first: {failed[0]}")
            samples = sampler.samples.arrays()
            window = steady_window_ns(result, "fixed")
            if window is None:
                raise EngineError("the in-flight decode had no steady window to step the knob in")
            if not result.knob_ns and unstepped:
                raise EngineError(
                    f"the in-flight decode ({tokens} tokens) ended before its first knob step "
                    "ran, twice in a row: the knob-stepping thread was not scheduled in time (a "
                    "loaded host)"
                )
            results.append(result)
            # A decode's whole time bounds the rate again, its prefill a smaller share of it
            # than of the short warm-up's (which, with a long prefill, can bound the first
            # decode to less than its segments need: the levels it did not reach are left to
            # the next decodes). It ran at any of the levels: the fastest at most bounds it.
            again = deadline_tokens(result, deadline_s, min(clocks) / max(clocks))
            if most is not None and again is not None:
                most = max(most, again)
            unstepped = not result.knob_ns
            if unstepped:
                # A short decode that ended before the stepping thread ran its first step (the
                # level it sets is the one the GPUs are at: the previous decode ended there)
                # measured no level: the round is decoded again, in the same order (taken as
                # the next round, a serpentine's pair held one direction twice and broke the
                # balance of the levels' places; the count of rounds held a decode measuring
                # nothing). Twice in a row is an error above.
                gpu_time["prefill"] += (result.ended_ns - result.started_ns) * 1e-9
                continue
            decodes[rounds] = result
            violations[rounds] = violation
            windows_ns[rounds] = window[1] - window[0]
            loads[rounds] = workload
            # A level runs from its setter's return to the next setter's call: the change
            # between (one NVML call for a lock, more for a power limit) belongs to neither.
            starts = list(result.knob_ns)
            begun = list(result.knob_begun_ns) or starts
            ends = begun[1:] + [starts[-1] + _ns(segment_s)]
            gpu_time["prefill"] += (begun[0] - result.started_ns) * 1e-9
            gpu_time["settle"] += sum(s - b for s, b in zip(starts, begun, strict=True)) * 1e-9
            gpu_time["drain"] += max(0, result.ended_ns - ends[-1]) * 1e-9
            for position, (cell, a, b) in enumerate(zip(order, starts, ends, strict=False)):
                lo = max(a + _ns(settle_before(order, position, settle)), window[0])
                hi = min(b, window[1])
                if hi < b and hi - lo < _ns(MIN_SEGMENT_SAMPLES * m.sample_period_s):
                    # The decode ended inside it, too little of it left for the meter: a
                    # sliver of a few tokens and a counter update or none (energy per token
                    # 0, or 13 times the level's), which the context slope took for the drift
                    # of every level (the others carried 7-59% low on the twin). Left to the
                    # next decodes, as a segment the decode ended before.
                    gpu_time["drain"] += max(0, hi - lo) * 1e-9
                    hi = lo
                gpu_time["settle"] += (min(lo, b) - a) * 1e-9
                span = (lo, hi) if hi > lo else None
                if span is not None:
                    gpu_time["window"] += (hi - lo) * 1e-9
                cut = segment_requests(result.requests, lo, hi) if span else ()
                # Energy and tokens over the same interval on the whole decode's token curve:
                # the cut traces end at the segment's last chunk, so their curve stops rising
                # there and the energy spent from that chunk to the segment's end (or the
                # counter update before it) would count no tokens.
                energy = (
                    round_energy(samples, round_chunks(result.requests).curve(), span, periods)
                    if span
                    else None
                )
                part = WindowPart(
                    RoundResult(cut, result.started_ns, result.ended_ns), span, samples, energy
                )
                alone = _summarise(runner, cell, [part])
                rate_here = (
                    alone.output_tokens / (cell.batch * alone.decode_time_s)
                    if alone.decode_time_s > 0
                    else math.nan
                )
                measured.append(
                    _Measured(
                        Segment(rounds, position, cells.index(cell)),
                        a,
                        b,
                        span,
                        part,
                        alone.energy_per_token_j,
                        alone.latency.tpot_ms[0],
                        rate_here,
                        decoded_by(result.requests, (lo + hi) // 2) if span else math.nan,
                        alone.energy_j,
                        alone.output_tokens,
                    )
                )
            rounds += 1
        half = _halfwidths(measured, len(cells), scheme, confidence)
        if precision <= 0 or all(bool(np.all(h <= precision)) for h in half):
            break

    limit_reads = runner._power_limit_reads(cells, limits_start, runner._power_limits())
    foreign += runner.tenants.seen(runner.gpus, "end")
    runner.note_tenants(foreign)
    held = power_limit_quality(limit_reads) | foreign_quality(foreign)
    shared = latency_stats([r for res in results for r in res.requests])
    accept = acceptance(results)
    mismatch = accept_mismatch(accept)
    gid = group_id(cells)
    group_time = {k: round(v, 6) for k, v in gpu_time.items()}
    energy_half, tpot_half = _halfwidths(measured, len(cells), scheme, confidence)
    segments = [s.segment for s in measured]
    _, energy_between = level_estimates(
        [s.energy_per_token_j for s in measured], segments, len(cells), confidence
    )
    # Each level at the context a per-level cell of output_tokens is measured at (its window's
    # middle: half the tokens decoded), along the drift fitted across the group's segments.
    target = campaign.workload.output_tokens / 2
    decoded = [s.decoded_tokens for s in measured]
    fitted = fit_context_slope(
        [s.energy_per_token_j for s in measured], decoded, segments, len(cells)
    )
    energy_slope = 0.0 if fitted is None else fitted
    # Levels measured at places no drift was fitted across (every decode ended before their
    # second visits): each at its own context, apart by as much as the drift over the decode
    # (up to 5% at batch 64 on the twin), with an interval that does not show it.
    placed = {s.segment.level for s in measured if math.isfinite(s.decoded_tokens)}
    unbalanced = Q_DRIFT_NOT_CANCELLED if fitted is None and len(placed) > 1 else 0
    tpot_slope = context_slope(
        [s.tpot_ms for s in measured], decoded, segments, len(cells), "exponential"
    )
    records = []
    for index, cell in enumerate(cells):
        mine = [s for s in measured if s.segment.level == index]
        cm = _summarise(runner, cell, [s.part for s in mine], idle[index])
        where = [s.decoded_tokens for s in mine if math.isfinite(s.decoded_tokens)]
        at = float(np.mean(where)) if where else math.nan
        places = [s.decoded_tokens for s in mine]
        energy_factor = carried_factor(energy_slope, target, places, [s.energy_j for s in mine])
        spans = [(s.window[1] - s.window[0]) * 1e-9 if s.window else math.nan for s in mine]
        tpot_factor = carried_factor(tpot_slope, target, places, spans, "exponential")
        measured_j = cm.energy_per_token_j
        # The decodes that measured this level and the requests they ran, each counted once
        # (not once per segment: abba visits every level twice in a decode): a level a decode
        # ended before was measured in fewer than the group's (its interval is over these).
        own = sorted({s.segment.round for s in mine if s.window is not None})
        # A throttle in a decode cannot be placed in a level by counters read at its ends:
        # every level the decode measured is flagged, with the decode's time.
        grown = [v for r in own if (v := violations[r]) is not None]
        violation_s = sum(grown) * 1e-9 if grown else math.nan
        # against those decodes' steady windows, as `summarise` holds a cell's rounds'
        throttled = violation_throttled(
            sum(grown) if grown else None,
            sum(windows_ns[r] for r in own),
        )
        cm = replace(
            cm,
            rounds=len(own),
            requests=sum(len(decodes[r].requests) for r in own),
            energy_j=cm.energy_j * energy_factor,
            latency=LatencyStats(
                shared.ttft_ms,
                tuple(v * tpot_factor for v in cm.latency.tpot_ms),
                tuple(v * tpot_factor for v in cm.latency.itl_ms),
            ),
            accept=accept,
            quality=cm.quality
            | (Q_ACCEPT_MISMATCH if mismatch else 0)
            | held
            | idle_quality(idle_foreign[index])
            | idle_flags[index]
            | (unbalanced if index in placed else 0)
            | (Q_THROTTLED if throttled else 0),
            # over the decodes, each one's drift cancelled by the order
            energy_per_token_rel_ci=float(energy_half[index]),
            latency_rel_ci=float(tpot_half[index]),
            # the prompts of the decodes that measured it, as its rounds and requests count
            # (all the group's decodes, a decode run again counted twice, told another
            # context than the level was measured at; those sent for a level none measured)
            prompt_tokens=mean_prompt_tokens([loads[r] for r in own] or sent),
            throttle_violation_s=violation_s,
        )
        provenance = {
            "group": gid,
            "scheme": scheme,
            "levels": len(cells),
            "level": index,
            "rounds": rounds,
            "settle_s": settle,
            "segment_s": segment_s,
            "shared": ["ttft_ms", "accept_length", "accept_rate", "server_accept_length"],
            "confidence": confidence,
            # the levels against each other (drift and each round's prompts fitted out): how
            # well their differences are known, tighter than the absolute interval
            "energy_per_token_rel_ci_between_levels": _finite_or_none(float(energy_between[index])),
            # where along the decode the level was measured, and how its energy per token
            # and TPOT were carried to a per-level cell's context (output_tokens / 2)
            "mean_decoded_tokens": _finite_or_none(at),
            "context": {
                "target_decoded_tokens": target,
                "energy_per_token_measured_j": _finite_or_none(measured_j),
                "energy_per_token_slope_per_1k_tokens": _finite_or_none(1000 * energy_slope),
                "tpot_slope_per_1k_tokens": _finite_or_none(1000 * tpot_slope),
                # value = level * (1 + slope * decoded), and * exp(slope * decoded)
                "energy_per_token_drift": INFLIGHT_ENERGY_DRIFT,
                "tpot_drift": "exponential",
                "energy_factor": energy_factor,
                "tpot_factor": tpot_factor,
            },
            "segments": [
                {
                    "round": s.segment.round,
                    "position": s.segment.position,
                    "start_s": round((s.start_ns - decodes[s.segment.round].started_ns) * 1e-9, 6),
                    "measured_s": round((s.window[1] - s.window[0]) * 1e-9, 6) if s.window else 0.0,
                    "energy_per_token_j": _finite_or_none(s.energy_per_token_j),
                    "decoded_tokens": _finite_or_none(s.decoded_tokens),
                    "energy_j": _finite_or_none(s.energy_j),
                    "tokens": _finite_or_none(s.tokens),
                }
                for s in mine
            ],
            "gpu_time_s": group_time,
        }
        record = CellRecord.measured(
            cell,
            cm,
            attempts=attempt,
            warmup={},
            errors=errors,
            power_limits=limit_reads,
            foreign_processes=foreign,
            idle_foreign_processes=idle_foreign[index],
        )
        records.append(replace(record, inflight=provenance))
    return records


def _halfwidths(
    measured: Sequence[_Measured], levels: int, scheme: str, confidence: float
) -> tuple[np.ndarray, np.ndarray]:
    """Each level's relative half-width on energy per token and on median TPOT."""
    segments = [s.segment for s in measured]
    energy = level_halfwidths(
        [s.energy_per_token_j for s in measured], segments, levels, scheme, confidence
    )
    tpot = level_halfwidths([s.tpot_ms for s in measured], segments, levels, scheme, confidence)
    return energy, tpot


def _context_room(engine: Engine, workload: Workload) -> int | None:
    """The most new tokens per request the engine's served context leaves past `workload`'s
    longest prompt (`new_tokens_room`, the twin's and the SGLang engine's); None where the
    engine cannot tell."""
    room = getattr(engine, "new_tokens_room", None)
    return room(workload) if callable(room) else None


def _applier(apply: Callable[[Any], bool], setting: Any) -> Callable[[], None]:
    def step() -> None:
        apply(setting)

    return step


def _summarise(
    runner: InflightHost, cell: Cell, parts: Sequence[WindowPart], idle_power_w: float = math.nan
) -> CellMeasurement:
    m = runner.campaign.measurement
    return summarise(
        parts,
        requested_clock_mhz=cell.sm_clock_mhz if runner.knobs.actuation else None,
        stock_clock_mhz=runner.knobs.stock_clock_mhz(cell.setting),
        min_window_s=m.min_window_s,
        sample_period_s=m.sample_period_s,
        idle_power_w=idle_power_w,
        counter_periods_s=runner.fit_periods_s,
        precision=m.precision,
        confidence=m.confidence,
    )


def _finite_or_none(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None
