"""Sampling the GPUs while a round runs: energy counters, power, SM clock, temperature, events.

The side-effecting half of measuring a cell (a background reader on the clock's ticker, and the
idle-power reading); `dvfs.measure.meter` turns what it collects into a cell's numbers.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from dvfs.clock import BatchClock, Clock, Ticker
from dvfs.errors import GpuError
from dvfs.gpu.base import BulkReadable, BulkReadings, Gpu

#: How long `Sampler.__exit__` waits for a reading in progress on the sampler thread.
SAMPLER_STOP_TIMEOUT_S = 5.0


#: What `Samples.arrays` returns, one array per name (gpu_energy_*: one column per GPU).
SAMPLE_FIELDS = (
    "t_ns",
    "energy_mj",
    "power_mw",
    "sm_clock_mhz",
    "temperature_c",
    "reasons",
    "sm_clock_max_mhz",
    "gpu_energy_mj",
    "gpu_energy_t_ns",
)


@dataclass
class Samples:
    """Readings of all GPUs at instants: energy and power summed, clock min (and max:
    `sm_clock_max_mhz`, so one GPU of a group running above its lock is seen), temperature max.

    Each GPU's energy counter carries its own timestamp (`gpu_energy_t_ns`: the middle of the
    call that read it), since a slow reading can land well after the sample's `t_ns`. Kept as
    chunks of int64 arrays (one per reading call, of one or many instants), joined by `arrays`.
    One GPU's readings that come as one block of rows (`dvfs.gpu.twin.BlockReadings`: the
    twin's) are kept as blocks while nothing else is added, and joined in one copy.
    """

    chunks: dict[str, list[np.ndarray]] = field(
        default_factory=lambda: {name: [] for name in SAMPLE_FIELDS}
    )
    #: One GPU's instants and readings blocks ((5, n) int64, `BulkReadings`' fields in order),
    #: before anything in `chunks` (`_unblock` moves them there when something else comes).
    blocks: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(len(t) for t in self.chunks["t_ns"]) + sum(len(t) for t, _ in self.blocks)

    def arrays(self) -> dict[str, np.ndarray]:
        if self.blocks:  # (`chunks` is empty) the fields are the joined block's rows
            t_ns = np.concatenate([t for t, _ in self.blocks])
            energy, power, clock, temperature, reasons = np.concatenate(
                [b for _, b in self.blocks], axis=1
            )
            return {
                "t_ns": t_ns,
                "energy_mj": energy,
                "power_mw": power,
                "sm_clock_mhz": clock,
                "temperature_c": temperature,
                "reasons": reasons,
                "sm_clock_max_mhz": clock.copy(),
                "gpu_energy_mj": energy[:, None],
                "gpu_energy_t_ns": t_ns[:, None],
            }
        return {
            name: np.concatenate(parts) if parts else np.array([], dtype=np.int64)
            for name, parts in self.chunks.items()
        }

    def _unblock(self) -> None:
        """Move the blocks into the per-field chunks, in order (something else is added)."""
        blocks, self.blocks = self.blocks, []
        for t_ns, block in blocks:
            self._extend_one(t_ns, BulkReadings(*block))

    def _add(self, **columns: np.ndarray) -> None:
        if self.blocks:
            self._unblock()
        for name, values in columns.items():
            self.chunks[name].append(values)

    def append(
        self,
        t_ns: int,
        energy_mj: Sequence[int],
        energy_t_ns: Sequence[int],
        power_mw: int,
        sm_clock_mhz: int,
        temperature_c: int,
        reasons: int,
        sm_clock_max_mhz: int | None = None,
    ) -> None:
        """One sample, read GPU by GPU (per-GPU energy counters and their read times)."""

        def one(value: int) -> np.ndarray:
            return np.array([value], dtype=np.int64)

        self._add(
            t_ns=one(t_ns),
            energy_mj=one(sum(energy_mj)),
            power_mw=one(power_mw),
            sm_clock_mhz=one(sm_clock_mhz),
            temperature_c=one(temperature_c),
            reasons=one(reasons),
            sm_clock_max_mhz=one(sm_clock_mhz if sm_clock_max_mhz is None else sm_clock_max_mhz),
            gpu_energy_mj=np.array([energy_mj], dtype=np.int64),
            gpu_energy_t_ns=np.array([energy_t_ns], dtype=np.int64),
        )

    def extend(self, t_ns: np.ndarray, gpus: Sequence[BulkReadings]) -> None:
        """Append readings at several instants (arrays per GPU), combined as `append` does."""
        t_ns = np.asarray(t_ns, dtype=np.int64)
        if len(gpus) == 1:  # the usual twin: one GPU's columns as they are
            (g,) = gpus
            block = getattr(g, "block", None)
            if block is not None and not self.chunks["t_ns"]:
                self.blocks.append((t_ns, block))  # joined with the others in `arrays`
                return
            if self.blocks:
                self._unblock()
            self._extend_one(t_ns, g)
            return
        energy = np.stack([g.energy_mj for g in gpus], axis=1)
        self._add(
            t_ns=t_ns,
            energy_mj=energy.sum(axis=1),
            power_mw=functools.reduce(np.add, (g.power_mw for g in gpus)),
            sm_clock_mhz=functools.reduce(np.minimum, (g.sm_clock_mhz for g in gpus)),
            temperature_c=functools.reduce(np.maximum, (g.temperature_c for g in gpus)),
            reasons=functools.reduce(np.bitwise_or, (g.reasons for g in gpus)),
            sm_clock_max_mhz=functools.reduce(np.maximum, (g.sm_clock_mhz for g in gpus)),
            gpu_energy_mj=energy,
            # virtual time stands still while a GPU is read: each counter is read at the instant
            gpu_energy_t_ns=np.repeat(t_ns[:, None], len(gpus), axis=1),
        )

    def _extend_one(self, t_ns: np.ndarray, g: BulkReadings) -> None:
        """One GPU's columns at several instants, appended as they are."""
        total = g.energy_mj
        c = self.chunks
        c["t_ns"].append(t_ns)
        c["energy_mj"].append(total if total.dtype == np.int64 else total[:, None].sum(axis=1))
        c["power_mw"].append(g.power_mw)
        c["sm_clock_mhz"].append(g.sm_clock_mhz)
        c["temperature_c"].append(g.temperature_c)
        c["reasons"].append(g.reasons)
        c["sm_clock_max_mhz"].append(g.sm_clock_mhz)
        c["gpu_energy_mj"].append(total[:, None])
        c["gpu_energy_t_ns"].append(t_ns[:, None])


@functools.cache
def _reads_in_bulk(clock: type, gpus: tuple[type, ...]) -> bool:
    """Whether a clock hands out batches of ticks and every GPU answers for many instants
    (checked once per combination of types: a protocol check is slow, a round is short)."""
    return issubclass(clock, BatchClock) and all(issubclass(g, BulkReadable) for g in gpus)


@functools.cache
def _defers(gpus: tuple[type, ...]) -> bool:
    """Whether every GPU can name the state its readings come from and read a past state
    (`reading_state`, `readings_of`: the twin), so ticks can be read later, together."""
    return all(
        getattr(g, "reading_state", None) is not None and hasattr(g, "readings_of") for g in gpus
    )


class SamplerError(GpuError):
    """The background sampler failed or did not stop; its readings are not used."""


class Sampler:
    """Samples every GPU of a server at a fixed period while a round runs (a context manager).

    On a real clock the readings come from the clock's background thread. On a virtual clock
    whose GPUs can all answer for many instants at once (`BulkReadable`, the twin), the ticks
    due so far are read in one call per GPU whenever time advances past them: the same
    instants and values, since nothing changes a GPU between ticks but the caller's own
    calls, which happen outside the clock's advance. A GPU that also names the state its
    readings come from (`reading_state`, `readings_of`: the twin's timeline, replaced on every
    start and knob change) has its ticks noted with that state and read when the sampler next
    reads at once (on exit: one call a round), from the state each was due in: the same
    values. On exit the sampler closes its lists (a
    reading that finishes later is dropped, never appended while someone reads them) and raises
    `SamplerError` if a reading is still in progress after `stop_timeout_s`, or the error a
    reading raised.
    """

    def __init__(
        self,
        gpus: Sequence[Gpu],
        clock: Clock,
        period_s: float,
        *,
        stop_timeout_s: float = SAMPLER_STOP_TIMEOUT_S,
    ) -> None:
        self.gpus = list(gpus)
        self.clock = clock
        self.period_s = period_s
        self.stop_timeout_s = stop_timeout_s
        self.samples = Samples()
        self._ticker: Ticker | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._reading: str | None = None  # what the sampler is reading now, for the error
        self._in_flight = 0
        self._error: BaseException | None = None
        self._bulk: list[BulkReadable] | None = None
        #: Ticks noted but not read yet, each with the state of every GPU when it was due.
        self._pending: list[tuple[np.ndarray, tuple[object, ...]]] | None = None
        types = tuple(type(g) for g in self.gpus)
        if clock.virtual and _reads_in_bulk(type(clock), types):
            self._bulk = [cast(BulkReadable, g) for g in self.gpus]
            if _defers(types):
                self._pending = []

    def _read(self, what: str, index: int, fn: Callable[[], int]) -> int:
        self._reading = f"{what} of GPU {index}"
        return fn()

    def sample(self) -> None:
        """Read every GPU once and append the readings (unless the sampler was closed)."""
        if self._pending is not None:
            self._read_noted(np.array([self.clock.now_ns()], dtype=np.int64))
            return
        if self._bulk is not None:
            self._sample_at(np.array([self.clock.now_ns()], dtype=np.int64))
            return
        with self._cond:
            if self._closed:
                return
            self._in_flight += 1
        try:
            t = self.clock.now_ns()
            energy, energy_t = [], []
            for g in self.gpus:  # energy first, back to back, each with its own timestamp
                before = self.clock.now_ns()
                energy.append(self._read("the energy counter", g.identity.index, g.energy_mj))
                energy_t.append((before + self.clock.now_ns()) // 2)
            power = sum(self._read("power", g.identity.index, g.power_mw) for g in self.gpus)
            clocks = [
                self._read("the SM clock", g.identity.index, g.sm_clock_mhz) for g in self.gpus
            ]
            temperature = max(
                self._read("the temperature", g.identity.index, g.temperature_c) for g in self.gpus
            )
            reasons = 0
            for g in self.gpus:
                reasons |= self._read(
                    "clock-event reasons", g.identity.index, g.clock_event_reasons
                )
        finally:
            with self._cond:
                self._in_flight -= 1
                self._reading = None
                self._cond.notify_all()
        with self._cond:
            if self._closed:
                return
            self.samples.append(
                t, energy, energy_t, power, min(clocks), temperature, reasons, max(clocks)
            )

    def _note(self, t_ns: np.ndarray) -> None:
        """Keep instants to read later, with the state each GPU is in now (deferring GPUs)."""
        assert self._pending is not None
        if not self._closed:
            gpus: list[Any] = self.gpus
            if len(gpus) == 1:
                self._pending.append((t_ns, (gpus[0].reading_state(),)))
            else:
                self._pending.append((t_ns, tuple(g.reading_state() for g in gpus)))

    def _read_noted(self, t_ns: np.ndarray | None) -> None:
        """Read the noted instants and `t_ns` (due now, if given), one call per GPU for each
        run of them due in one state, and append the readings in order.

        Deferring GPUs sample on virtual time only (`_reads_in_bulk`), whose ticks are the
        clock's callbacks in the thread that moves it, the one that enters and leaves the
        sampler: nothing else touches the sampler's lists, so no lock is taken and nothing
        is left in flight (a reading that raises drops the noted ticks and appends nothing:
        its round fails with it)."""
        assert self._pending is not None
        if self._closed:
            return
        if t_ns is not None:
            self._note(t_ns)
        pending, self._pending = self._pending, []
        # runs of instants noted in one state (states compare by identity, as a tuple's ==
        # does), each read in one call per GPU
        runs: list[tuple[list[np.ndarray], tuple[object, ...]]] = []
        for instants, states in pending:
            if runs and runs[-1][1] == states:
                runs[-1][0].append(instants)
            else:
                runs.append(([instants], states))
        parts = []
        for times, states in runs:
            at = times[0] if len(times) == 1 else np.concatenate(times)
            gpus: list[Any] = self.gpus
            if len(gpus) == 1:
                parts.append((at, [gpus[0].readings_of(states[0], at)]))
            else:
                parts.append(
                    (at, [g.readings_of(s, at) for g, s in zip(gpus, states, strict=True)])
                )
        for at, readings in parts:
            self.samples.extend(at, readings)

    def _sample_at(self, t_ns: np.ndarray) -> None:
        """Read every GPU at the instants `t_ns` in one call each and append the readings
        (with the noted ticks before them, deferring GPUs)."""
        assert self._bulk is not None
        with self._cond:
            if self._closed:
                return
            self._in_flight += 1
        try:
            readings = []
            for g, gpu in zip(self._bulk, self.gpus, strict=True):
                self._reading = f"the readings of GPU {gpu.identity.index}"
                readings.append(g.readings_at(t_ns))
        finally:
            with self._cond:
                self._in_flight -= 1
                self._reading = None
                self._cond.notify_all()
        with self._cond:
            if not self._closed:
                self.samples.extend(t_ns, readings)

    def _tick(self) -> None:
        """The periodic callback: an error stops sampling and is raised on exit, not lost."""
        try:
            self.sample()
        except Exception as exc:  # a signal's KeyboardInterrupt (virtual clock) propagates
            self._fail(exc)

    def _tick_batch(self, t_ns: np.ndarray) -> None:
        """The batch callback on virtual time (`_tick` for several due instants at once)."""
        try:
            if self._pending is not None:
                self._note(t_ns)  # read with the next reading at once, from this state
            else:
                self._sample_at(t_ns)
        except Exception as exc:  # a signal's KeyboardInterrupt propagates, as in `_tick`
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        with self._cond:
            self._error = self._error or exc
            self._closed = True

    def __enter__(self) -> Sampler:
        self.sample()
        if self._bulk is not None:  # a BatchClock (`_reads_in_bulk`)
            self._ticker = cast(BatchClock, self.clock).every_batch(self.period_s, self._tick_batch)
        else:
            self._ticker = self.clock.every(self.period_s, self._tick)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if self._ticker is not None:
                self._ticker.stop()
        finally:
            if self._pending is None:
                stuck = self._close()
            else:  # deferring GPUs read in this thread only (`_read_noted`): none in flight
                stuck, self._closed = None, False  # the final reading, as `_close` allows
        if exc_type is not None:
            return  # the block's own error matters more
        if stuck is not None:
            raise SamplerError(
                f"the power sampler did not stop within {self.stop_timeout_s:g} s of being "
                f"asked: reading {stuck} has not returned; the GPU or its driver is not "
                "responding (see `nvidia-smi`), so this round's readings are discarded"
            )
        if self._error is None and self._pending is not None:
            try:  # the round's noted ticks and the final reading, read together
                self.sample()
            except Exception as exc:  # a signal's KeyboardInterrupt propagates
                self._fail(exc)
            else:
                return
        if self._error is not None:
            if isinstance(self._error, GpuError):
                raise self._error
            raise SamplerError(f"the power sampler failed: {self._error}") from self._error
        self.sample()

    def _close(self) -> str | None:
        """Stop appending; wait for a reading in progress. Returns what is stuck, if anything."""
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0, timeout=self.stop_timeout_s)
            self._closed = True
            if self._in_flight:
                return self._reading or "a GPU"
            self._closed = False  # the final reading on exit, in this thread
            return None

    def close(self) -> None:
        """No more readings: later ones are dropped (ticks already due are read first)."""
        if self._pending and not self._closed:
            try:
                self._read_noted(None)
            except Exception as exc:  # kept, as a tick's error would be
                self._fail(exc)
        with self._cond:
            self._closed = True


#: How many times the opening idle measurement is taken while an energy counter goes backwards
#: over it (`measure_idle_power_w`).
IDLE_COUNTER_TRIES = 3


def _energy_now(gpus: Sequence[Gpu], clock: Clock) -> tuple[list[int], int]:
    """Each GPU's energy counter (mJ) and the time they were read (the middle of the reads)."""
    before = clock.now_ns()
    energy = [g.energy_mj() for g in gpus]
    return energy, (before + clock.now_ns()) // 2


def measure_idle_power_w(gpus: Sequence[Gpu], clock: Clock, seconds: float) -> float:
    """Mean board power of idle GPUs from the energy counter over `seconds`. A counter that
    went backwards over them (reset by a driver reload or a GPU reset: the difference is not
    the energy spent) is read again over another `seconds`, from its new count; GpuError
    after IDLE_COUNTER_TRIES such tries."""
    if seconds <= 0:
        return float(sum(g.power_mw() for g in gpus)) / 1000
    for _ in range(IDLE_COUNTER_TRIES):
        e0, t0 = _energy_now(gpus, clock)
        clock.sleep(seconds)
        e1, t1 = _energy_now(gpus, clock)
        back = [g.identity.index for g, a, b in zip(gpus, e0, e1, strict=True) if b < a]
        if not back:
            return (sum(e1) - sum(e0)) / ((t1 - t0) * 1e-9) / 1000
    raise GpuError(
        f"the energy counter of GPU {back[0]} went backwards in each of {IDLE_COUNTER_TRIES} "
        f"idle measurements of {seconds:g} s: it is being reset (a driver reload or GPU reset) "
        "or is broken; check the GPU with `dvfs doctor` before measuring"
    )
