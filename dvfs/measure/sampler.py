"""Sampling the GPUs while a round runs: energy counters, power, SM clock, temperature, events.

The side-effecting half of measuring a cell (a background reader on the clock's ticker, and the
idle-power reading); `dvfs.measure.meter` turns what it collects into a cell's numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dvfs.clock import Clock, Ticker
from dvfs.errors import GpuError
from dvfs.gpu.base import Gpu

#: How long `Sampler.__exit__` waits for a reading in progress on the sampler thread.
SAMPLER_STOP_TIMEOUT_S = 5.0


@dataclass
class Samples:
    """Readings of all GPUs at instants: energy and power summed, clock min, temperature max.

    Each GPU's energy counter carries its own timestamp (`gpu_energy_t_ns`: the middle of the
    call that read it), since a slow reading can land well after the sample's `t_ns`.
    """

    t_ns: list[int] = field(default_factory=list)
    energy_mj: list[int] = field(default_factory=list)
    power_mw: list[int] = field(default_factory=list)
    sm_clock_mhz: list[int] = field(default_factory=list)
    temperature_c: list[int] = field(default_factory=list)
    reasons: list[int] = field(default_factory=list)
    gpu_energy_mj: list[tuple[int, ...]] = field(default_factory=list)
    gpu_energy_t_ns: list[tuple[int, ...]] = field(default_factory=list)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in self.__dict__.items()}


class SamplerError(GpuError):
    """The background sampler failed or did not stop; its readings are not used."""


class Sampler:
    """Samples every GPU of a server at a fixed period while a round runs (a context manager).

    On a real clock the readings come from the clock's background thread. On exit the sampler
    closes its lists (a reading that finishes later is dropped, never appended while someone
    reads them) and raises `SamplerError` if a reading is still in progress after
    `stop_timeout_s`, or the error a reading raised.
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

    def _read(self, what: str, index: int, fn: Callable[[], int]) -> int:
        self._reading = f"{what} of GPU {index}"
        return fn()

    def sample(self) -> None:
        """Read every GPU once and append the readings (unless the sampler was closed)."""
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
            clock = min(
                self._read("the SM clock", g.identity.index, g.sm_clock_mhz) for g in self.gpus
            )
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
            s = self.samples
            s.t_ns.append(t)
            s.energy_mj.append(sum(energy))
            s.gpu_energy_mj.append(tuple(energy))
            s.gpu_energy_t_ns.append(tuple(energy_t))
            s.power_mw.append(power)
            s.sm_clock_mhz.append(clock)
            s.temperature_c.append(temperature)
            s.reasons.append(reasons)

    def _tick(self) -> None:
        """The periodic callback: an error stops sampling and is raised on exit, not lost."""
        try:
            self.sample()
        except Exception as exc:  # a signal's KeyboardInterrupt (virtual clock) propagates
            with self._cond:
                self._error = self._error or exc
                self._closed = True

    def __enter__(self) -> Sampler:
        self.sample()
        self._ticker = self.clock.every(self.period_s, self._tick)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if self._ticker is not None:
                self._ticker.stop()
        finally:
            stuck = self._close()
        if exc_type is not None:
            return  # the block's own error matters more
        if stuck is not None:
            raise SamplerError(
                f"the power sampler did not stop within {self.stop_timeout_s:g} s of being "
                f"asked: reading {stuck} has not returned; the GPU or its driver is not "
                "responding (see `nvidia-smi`), so this round's readings are discarded"
            )
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
        """No more readings: later ones are dropped."""
        with self._cond:
            self._closed = True


def _energy_now(gpus: Sequence[Gpu], clock: Clock) -> tuple[int, int]:
    """Summed energy counters (mJ) and the time they were read (the middle of the reads)."""
    before = clock.now_ns()
    energy = sum(g.energy_mj() for g in gpus)
    return energy, (before + clock.now_ns()) // 2


def measure_idle_power_w(gpus: Sequence[Gpu], clock: Clock, seconds: float) -> float:
    """Mean board power of idle GPUs from the energy counter over `seconds`."""
    if seconds <= 0:
        return float(sum(g.power_mw() for g in gpus)) / 1000
    e0, t0 = _energy_now(gpus, clock)
    clock.sleep(seconds)
    e1, t1 = _energy_now(gpus, clock)
    return (e1 - e0) / ((t1 - t0) * 1e-9) / 1000
