"""How long a knob change takes to show: measured on this GPU, not assumed.

`measure_settle` brings the GPUs to one setting through the sweep's `KnobController`, waits
until the observed SM clock (and, under a load, the board power) holds steady, applies the
next setting and samples fast until every GPU's readings have stayed within a tolerance of
their new steady value for a hold time. The time from the change to the first sample of that
final steady run is the settle time (an upper bound, within one sample period of the truth);
the settle to use is the larger of clock and power plus a margin. The whole measurement is
bounded by a timeout and returns the GPU time it took, so a runner can account it.

`Probe` is the small fast reader behind it (and behind `dvfs.measure.baseline`): chosen
readings of every GPU at a fixed period on the clock's ticker, or, on virtual time with GPUs
that answer for many instants at once (the twin), in one call per GPU per batch of ticks.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import cast

import numpy as np

from dvfs.clock import BatchClock, Clock, Ticker
from dvfs.gpu.base import BulkReadable, FieldReadable, Gpu
from dvfs.gpu.knobs import KnobController, KnobSetting

#: The readings a `Probe` can take, named as the `Gpu` getters (and `BulkReadings` fields).
FIELDS = ("energy_mj", "power_mw", "sm_clock_mhz", "temperature_c")


class Probe:
    """Reads `fields` of every GPU now and then every `period_s` (a context manager).

    `arrays(since_ns)` returns the instants (int64 ns, shape (n,)) and one (n, gpus) array per
    field. A reading that fails stops the probe; `check()` raises its error in the caller.
    """

    def __init__(
        self, gpus: Sequence[Gpu], clock: Clock, period_s: float, fields: Sequence[str]
    ) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown readings {sorted(unknown)}; known: {FIELDS}")
        self.gpus = list(gpus)
        self.clock = clock
        self.period_s = period_s
        self.fields = tuple(fields)
        self._lock = threading.Lock()
        self._t: list[int] = []
        self._values: dict[str, list[list[int]]] = {f: [] for f in self.fields}
        self._error: BaseException | None = None
        self._ticker: Ticker | None = None
        #: Whether the instants read so far are in order (they are: one ticker appends them),
        #: which `span` relies on.
        self._ordered = True
        self._bulk: list[BulkReadable] | None = None
        self._by_field: list[FieldReadable] | None = None
        if (
            clock.virtual
            and isinstance(clock, BatchClock)
            and all(isinstance(g, BulkReadable) for g in self.gpus)
        ):
            self._bulk = [cast(BulkReadable, g) for g in self.gpus]
            if all(isinstance(g, FieldReadable) for g in self.gpus):
                self._by_field = [cast(FieldReadable, g) for g in self.gpus]

    def _read_now(self) -> None:
        t = self.clock.now_ns()
        row = {f: [int(getattr(g, f)()) for g in self.gpus] for f in self.fields}
        with self._lock:
            if self._t and t < self._t[-1]:
                self._ordered = False
            self._t.append(t)
            for f in self.fields:
                self._values[f].append(row[f])

    def _read_at(self, t_ns: np.ndarray) -> None:
        assert self._bulk is not None
        if self._by_field is not None:  # only the fields asked for
            per_gpu = [g.fields_at(t_ns, self.fields) for g in self._by_field]
            columns = {
                f: np.stack([r[i] for r in per_gpu], axis=1) for i, f in enumerate(self.fields)
            }
        else:
            readings = [g.readings_at(t_ns) for g in self._bulk]
            columns = {f: np.stack([getattr(r, f) for r in readings], axis=1) for f in self.fields}
        with self._lock:
            if self._t and len(t_ns) and int(t_ns[0]) < self._t[-1]:
                self._ordered = False
            self._t.extend(t_ns.tolist())
            for f in self.fields:
                self._values[f].extend(columns[f].tolist())

    def _tick(self) -> None:
        if self._error is not None:
            return
        try:
            self._read_now()
        except Exception as exc:  # raised in the caller by `check`, never lost in a thread
            self._error = exc

    def _tick_batch(self, t_ns: np.ndarray) -> None:
        if self._error is not None:
            return
        try:
            self._read_at(t_ns)
        except Exception as exc:
            self._error = exc

    def __enter__(self) -> Probe:
        if self._bulk is not None:
            self._read_at(np.array([self.clock.now_ns()], dtype=np.int64))
            self._ticker = cast(BatchClock, self.clock).every_batch(self.period_s, self._tick_batch)
        else:
            self._read_now()
            self._ticker = self.clock.every(self.period_s, self._tick)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        if exc_type is None:
            self.check()

    def check(self) -> None:
        """Raise the error a reading hit, if any."""
        if self._error is not None:
            raise self._error

    def span(self, since_ns: int) -> tuple[int, int] | None:
        """Which readings `arrays(since_ns)` returns, as positions [first, stop) among all
        taken so far: the same span, the same readings (a caller can skip a fit it has made
        already). None when the instants were not read in order (never, with one ticker)."""
        with self._lock:
            if not self._ordered:
                return None
            return bisect.bisect_left(self._t, since_ns), len(self._t)

    def arrays(self, since_ns: int | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Readings so far (from `since_ns` on): instants, and per field an (n, gpus) array."""
        with self._lock:
            first = 0
            if since_ns is not None and self._ordered:  # the readings kept, and no others
                first = bisect.bisect_left(self._t, since_ns)
                since_ns = None
            t = np.asarray(self._t[first:], dtype=np.int64)
            values = {
                f: np.asarray(v[first:], dtype=np.int64).reshape(len(t), len(self.gpus))
                for f, v in self._values.items()
            }
        if since_ns is not None:
            keep = t >= since_ns
            t = t[keep]
            values = {f: v[keep] for f, v in values.items()}
        return t, values


def settle_point(
    t_ns: np.ndarray,
    x: np.ndarray,
    *,
    since_ns: int,
    hold_s: float,
    abs_tolerance: float,
    rel_tolerance: float = 0.0,
) -> tuple[float, float] | None:
    """When one reading settled: (seconds from `since_ns` to the first sample of the final run
    within tolerance of the steady value, the steady value), or None while it has not.

    The steady value is the median of the last `hold_s` of samples; it has settled when those
    samples all lie within max(`abs_tolerance`, `rel_tolerance` x |steady|) of it and at least
    `hold_s` has passed since `since_ns`. The true settle lies between the last sample outside
    the band and the one returned, so the answer is high by less than one sample period.
    """
    t_ns = np.asarray(t_ns, dtype=np.int64)
    x = np.asarray(x, dtype=float)
    hold_ns = round(hold_s * 1e9)
    if len(t_ns) == 0 or t_ns[-1] - since_ns < hold_ns:
        return None
    recent = t_ns >= t_ns[-1] - hold_ns
    steady = float(np.median(x[recent]))
    tolerance = max(abs_tolerance, rel_tolerance * abs(steady))
    outside = np.abs(x - steady) > tolerance
    if outside[recent].any():
        return None
    left = np.flatnonzero(outside)
    first = int(left[-1]) + 1 if len(left) else 0
    return (int(t_ns[first]) - since_ns) / 1e9, steady


@dataclass(frozen=True)
class SettleTime:
    """How long one knob change took to show.

    `clock_s` / `power_s`: seconds from the change until the SM clock / board power of every
    GPU held steady (the slowest GPU); `power_s` is None without a load (power then shows
    nothing of a clock or limit change) and either is None when it did not settle before the
    timeout. `settle_s`: what to wait after such a change, the larger of the two times plus
    the margin and one sample period; the timeout when not `observed`. `gpu_time_s`: the
    time the measurement held the GPUs (both settings). Steady values: the slowest GPU's
    clock (MHz) and the summed power (W) before and after; None where unknown.
    """

    before: KnobSetting
    after: KnobSetting
    clock_s: float | None
    power_s: float | None
    settle_s: float
    observed: bool
    gpu_time_s: float
    samples: int
    sample_period_s: float
    clock_before_mhz: float | None = None
    clock_after_mhz: float | None = None
    power_before_w: float | None = None
    power_after_w: float | None = None
    note: str = ""

    def as_dict(self) -> dict[str, object]:
        """The JSON shape (`dvfs gpu settle --json`, the session record)."""
        return {
            "before": describe_setting(self.before),
            "after": describe_setting(self.after),
            "clock_s": self.clock_s,
            "power_s": self.power_s,
            "settle_s": self.settle_s,
            "observed": self.observed,
            "gpu_time_s": self.gpu_time_s,
            "samples": self.samples,
            "sample_period_s": self.sample_period_s,
            "clock_before_mhz": self.clock_before_mhz,
            "clock_after_mhz": self.clock_after_mhz,
            "power_before_w": self.power_before_w,
            "power_after_w": self.power_after_w,
            "note": self.note,
        }


def describe_setting(setting: KnobSetting) -> str:
    """ "stock", "1500 MHz", "400 W" or "1500 MHz, 400 W"."""
    parts = []
    if setting.sm_clock_mhz is not None:
        parts.append(f"{setting.sm_clock_mhz} MHz")
    if setting.power_limit_w is not None:
        parts.append(f"{setting.power_limit_w:g} W")
    return ", ".join(parts) or "stock"


@dataclass(frozen=True)
class _Steady:
    """Per GPU: seconds to settle and the steady value, for the clock and (under load) power;
    None where it has not settled."""

    clock: list[tuple[float, float] | None]
    power: list[tuple[float, float] | None]

    def done(self) -> bool:
        return all(p is not None for p in (*self.clock, *self.power))

    @staticmethod
    def slowest(points: list[tuple[float, float] | None]) -> float | None:
        if not points or any(p is None for p in points):
            return None
        return max(p[0] for p in points if p is not None)


@dataclass(frozen=True)
class _Tolerance:
    hold_s: float
    clock_mhz: float
    power_rel: float
    power_abs_w: float


def _steady(
    probe: Probe,
    since_ns: int,
    tol: _Tolerance,
    *,
    power: bool,
    away_from: list[float | None] | None,
) -> tuple[_Steady, int]:
    """Where each GPU stands since `since_ns`, and how many samples that saw. `away_from`:
    clocks the steady clock must differ from (the clock was expected to move)."""
    t, values = probe.arrays(since_ns)
    clocks: list[tuple[float, float] | None] = []
    powers: list[tuple[float, float] | None] = []
    for g in range(len(probe.gpus)):
        point = settle_point(
            t,
            values["sm_clock_mhz"][:, g],
            since_ns=since_ns,
            hold_s=tol.hold_s,
            abs_tolerance=tol.clock_mhz,
        )
        old = away_from[g] if away_from is not None else None
        if point is not None and old is not None and abs(point[1] - old) <= tol.clock_mhz:
            point = None  # not moved (yet): the change has not shown
        clocks.append(point)
        if power:
            powers.append(
                settle_point(
                    t,
                    values["power_mw"][:, g] / 1000.0,
                    since_ns=since_ns,
                    hold_s=tol.hold_s,
                    abs_tolerance=tol.power_abs_w,
                    rel_tolerance=tol.power_rel,
                )
            )
    return _Steady(clocks, powers), len(t)


def _wait(
    probe: Probe,
    clock: Clock,
    since_ns: int,
    timeout_s: float,
    tol: _Tolerance,
    *,
    load: Callable[[], None] | None,
    away_from: list[float | None] | None = None,
) -> tuple[_Steady, int]:
    """Run the load (or sleep) until every reading settled or `timeout_s` passed."""
    deadline_ns = since_ns + round(timeout_s * 1e9)
    step_s = max(probe.period_s, tol.hold_s / 5)
    while True:
        if load is not None:
            load()
        else:
            clock.sleep(min(step_s, max(probe.period_s, (deadline_ns - clock.now_ns()) / 1e9)))
        probe.check()
        state, samples = _steady(probe, since_ns, tol, power=load is not None, away_from=away_from)
        if state.done() or clock.now_ns() >= deadline_ns:
            return state, samples


def measure_settle(
    gpus: Sequence[Gpu],
    knobs: KnobController,
    clock: Clock,
    *,
    before: KnobSetting,
    after: KnobSetting,
    sample_period_s: float = 0.005,
    timeout_s: float = 10.0,
    hold_s: float = 0.5,
    load: Callable[[], None] | None = None,
    clock_tolerance_mhz: float = 15.0,
    power_tolerance: float = 0.05,
    power_tolerance_w: float = 5.0,
    margin: float = 0.5,
) -> SettleTime:
    """Measure how long the change from `before` to `after` takes to show on `gpus`.

    `knobs` is an entered `KnobController` over `gpus` (it restores on exit; this function
    leaves the GPUs at `after`). `before` is applied first and held until steady (at most
    `timeout_s`), then `after`; both are sampled every `sample_period_s`. `load`, when given,
    is called over and over while sampling (each call should keep every GPU busy for a short
    while, well under `hold_s`, and return): power is then measured too, and the clock is
    whatever the load and the power limit make it. Without a load, a clock lock that differs
    from the clock seen before must move the clock to count as shown. Tolerances: the clock
    within `clock_tolerance_mhz` (one 15 MHz step on H100); power within `power_tolerance`
    of its steady value, or `power_tolerance_w` if that is larger. Time a wide change (the top
    clock to about half of it): the tolerance is then a small part of the step.

    Not `observed` (with a note, `settle_s` = `timeout_s`, nothing applied): a change that
    changes nothing, or only a power limit without a load (idle, it shows nowhere).
    """
    if sample_period_s <= 0 or timeout_s <= 0 or hold_s <= 0:
        raise ValueError("sample_period_s, timeout_s and hold_s must be positive")
    if hold_s >= timeout_s:
        raise ValueError(f"hold_s ({hold_s:g} s) must be shorter than timeout_s ({timeout_s:g} s)")
    tol = _Tolerance(hold_s, clock_tolerance_mhz, power_tolerance, power_tolerance_w)
    fields = ("sm_clock_mhz", "power_mw") if load is not None else ("sm_clock_mhz",)
    start_ns = clock.now_ns()
    targets = [(knobs.target(g, before), knobs.target(g, after)) for g in knobs.gpus]
    if all(a == b for a, b in targets):
        return _unobserved(
            before, after, start_ns, clock, None, sample_period_s, timeout_s,
            f"{describe_setting(after)} is what the GPUs hold at {describe_setting(before)}: "
            "nothing changes, so there is no settle time to measure",
        )  # fmt: skip
    if load is None and all(a.sm_clock_lock_mhz == b.sm_clock_lock_mhz for a, b in targets):
        return _unobserved(
            before, after, start_ns, clock, None, sample_period_s, timeout_s,
            "only the power limit changes, which an idle GPU does not show: time it under a "
            "load",
        )  # fmt: skip
    knobs.apply(before)
    with Probe(gpus, clock, sample_period_s, fields) as probe:
        pre, _ = _wait(probe, clock, start_ns, timeout_s, tol, load=load)
        if not pre.done():
            return _unobserved(
                before, after, start_ns, clock, probe, sample_period_s, timeout_s,
                f"the GPU did not hold steady at {describe_setting(before)} within "
                f"{timeout_s:g} s, so the change could not be timed",
            )  # fmt: skip
        clocks_before = [p[1] for p in pre.clock if p is not None]
        away: list[float | None] | None = None
        if load is None and after.sm_clock_mhz is not None:
            lock = after.sm_clock_mhz
            away = [c if abs(lock - c) > clock_tolerance_mhz else None for c in clocks_before]
        change_ns = clock.now_ns()
        knobs.apply(after)
        post, samples = _wait(probe, clock, change_ns, timeout_s, tol, load=load, away_from=away)
    end_ns = clock.now_ns()
    clock_s = _Steady.slowest(post.clock)
    power_s = _Steady.slowest(post.power) if load is not None else None
    observed = post.done()
    notes = []
    if clock_s is None:
        notes.append(
            f"the SM clock did not hold within {clock_tolerance_mhz:g} MHz of a new steady value "
            f"for {hold_s:g} s within {timeout_s:g} s of the change"
        )
    if load is not None and power_s is None:
        notes.append(
            f"the power did not hold within {power_tolerance:.0%} of a steady value for "
            f"{hold_s:g} s within {timeout_s:g} s of the change"
        )
    longest = max(s for s in (clock_s, power_s, 0.0) if s is not None)
    settle_s = longest * (1 + margin) + sample_period_s if observed else timeout_s
    return SettleTime(
        before=before,
        after=after,
        clock_s=clock_s,
        power_s=power_s,
        settle_s=settle_s,
        observed=observed,
        gpu_time_s=(end_ns - start_ns) / 1e9,
        samples=samples,
        sample_period_s=sample_period_s,
        clock_before_mhz=min(clocks_before) if clocks_before else None,
        clock_after_mhz=_value(post.clock, min),
        power_before_w=_value(pre.power, sum),
        power_after_w=_value(post.power, sum),
        note="; ".join(notes),
    )


def _value(
    points: list[tuple[float, float] | None], combine: Callable[[list[float]], float]
) -> float | None:
    """The GPUs' steady values combined (min clock, summed power); None if any is unknown."""
    if not points or any(p is None for p in points):
        return None
    return float(combine([p[1] for p in points if p is not None]))


def _unobserved(
    before: KnobSetting,
    after: KnobSetting,
    start_ns: int,
    clock: Clock,
    probe: Probe | None,
    sample_period_s: float,
    timeout_s: float,
    note: str,
) -> SettleTime:
    """A change that could not be timed (nothing measured when `probe` is None)."""
    t = probe.arrays(start_ns)[0] if probe is not None else ()
    return SettleTime(
        before=before,
        after=after,
        clock_s=None,
        power_s=None,
        settle_s=timeout_s,
        observed=False,
        gpu_time_s=(clock.now_ns() - start_ns) / 1e9,
        samples=len(t),
        sample_period_s=sample_period_s,
        note=note,
    )
