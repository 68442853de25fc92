"""Reading the twin in bulk on virtual time gives exactly what reading it tick by tick gave."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.clock import Ticker, VirtualClock
from dvfs.errors import GpuError
from dvfs.gpu.base import EVENT_GPU_IDLE, BulkReadings
from dvfs.gpu.twin import TwinGpu
from dvfs.measure.sampler import Sampler, Samples
from dvfs.signals import signals_raise
from dvfs.twin import physics
from dvfs.twin.device import TwinDevice, TwinNode
from tests.test_twin_physics import EXACT_H100, H100, decode_passes

MS = 1_000_000


class TickClock:
    """A virtual clock without batches: the sampler falls back to one reading per tick."""

    virtual = True

    def __init__(self) -> None:
        self.inner = VirtualClock()

    def now_ns(self) -> int:
        return self.inner.now_ns()

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)

    def every(self, period_s: float, callback: Callable[[], None]) -> Ticker:
        return self.inner.every(period_s, callback)


def exact_energy_j(schedule: physics.Schedule, start_ns: int, start_j: float, t_ns: int) -> float:
    """A trap-free device's energy counter, computed from the schedule one instant at a time
    (as before bulk readings): the energy at the start plus each pass's power x time."""
    ends = start_ns + schedule.ends_ns
    power = schedule.timing.power_w
    cum = np.cumsum(power * ((ends - np.concatenate([[start_ns], ends[:-1]])) * 1e-9))
    end = int(ends[-1])
    idle = EXACT_H100.idle_power_w
    if t_ns <= start_ns:
        since = 0.0
    elif t_ns >= end:
        since = float(cum[-1] + idle * (t_ns - end) * 1e-9)
    else:
        i = int(np.searchsorted(ends, t_ns, side="right"))
        seg_start = start_ns if i == 0 else int(ends[i - 1])
        before = 0.0 if i == 0 else float(cum[i - 1])
        since = before + float(power[i]) * (t_ns - seg_start) * 1e-9
    return start_j + since


def workload(batches: list[int]) -> physics.Passes:
    return physics.Passes.concat([decode_passes(b) for b in batches])


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(st.sampled_from([1, 8, 64, 512, 4096]), min_size=1, max_size=30),
    offsets=st.lists(st.integers(-2 * MS, 400 * MS), min_size=1, max_size=40),
    locked=st.booleans(),
    limit_w=st.sampled_from([300, 700]),
    exact=st.booleans(),
)
def test_bulk_readings_are_the_scalar_readings(batches, offsets, locked, limit_w, exact) -> None:
    clock = VirtualClock(5 * MS)
    device = TwinDevice(EXACT_H100 if exact else H100, clock)
    gpu = TwinGpu(device)
    gpu.set_power_limit_mw(limit_w * 1000)
    if locked:
        gpu.lock_sm_clock(1410, 1410)
    clock.sleep(0.01)
    node = TwinNode([device])
    start = clock.now_ns()
    start_j = device.energy_j()
    schedule = node.execute(workload(batches))
    instants = np.array(sorted({start + max(o, 0) for o in offsets}), dtype=np.int64)
    bulk = gpu.readings_at(instants)
    assert bulk.energy_mj.dtype == np.int64
    for k, t in enumerate(instants.tolist()):
        if exact:
            assert int(exact_energy_j(schedule, start, start_j, t) * 1000) == bulk.energy_mj[k]
        clock.advance_to(t)
        assert gpu.energy_mj() == bulk.energy_mj[k]
        assert gpu.power_mw() == bulk.power_mw[k]
        assert gpu.sm_clock_mhz() == bulk.sm_clock_mhz[k]
        assert gpu.temperature_c() == bulk.temperature_c[k]
        assert gpu.clock_event_reasons() == bulk.reasons[k]


def test_an_idle_device_reads_idle() -> None:
    clock = VirtualClock()
    gpu = TwinGpu(TwinDevice(EXACT_H100, clock))
    r = gpu.readings_at(np.array([0, 10 * MS]))
    assert r.power_mw.tolist() == [round(H100.idle_power_w * 1000)] * 2
    assert r.reasons.tolist() == [EVENT_GPU_IDLE] * 2
    assert r.energy_mj[1] == int(H100.idle_power_w * 0.01 * 1000)


def run_rounds(clock, devices: int, mutate_at_ms: int | None = None) -> dict[str, np.ndarray]:
    """Two sampled rounds (knobs changed between them), the same script on either clock."""
    inner = clock.inner if isinstance(clock, TickClock) else clock
    devs = [TwinDevice(H100, inner, i) for i in range(devices)]
    gpus = [TwinGpu(d) for d in devs]
    node = TwinNode(devs)
    if mutate_at_ms is not None:  # another timer changes the work mid-round
        fired: list[int] = []

        def restart() -> None:
            if not fired:
                fired.append(1)
                node.execute(workload([4096] * 40))

        inner.every(mutate_at_ms / 1000, restart)
    arrays = []
    # Rounds of a few hundred ticks (period 3.1 ms): long enough for both knob settings, the
    # other timer and several bulk reads, short enough that the tick-by-tick reference is quick.
    for knob, batches in ((None, [64] * 60 + [512] * 40), (1200, [1, 8, 4096] * 30)):
        if knob is not None:
            for g in gpus:
                g.lock_sm_clock(knob, knob)
            gpus[-1].set_power_limit_mw(300_000)
        with Sampler(gpus, clock, period_s=0.0031) as sampler:
            point = node.execute(workload(batches))
            clock.sleep(point.timing.total_s + 0.0137)
        arrays.append(sampler.samples.arrays())
        clock.sleep(0.05)
    return {k: np.concatenate([a[k] for a in arrays]) for k in arrays[0]}


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("mutate_at_ms", [None, 31])
def test_bulk_sampling_equals_tick_by_tick(devices: int, mutate_at_ms: int | None) -> None:
    tick = run_rounds(TickClock(), devices, mutate_at_ms)
    bulk = run_rounds(VirtualClock(), devices, mutate_at_ms)
    assert set(tick) == set(bulk)
    assert len(tick["t_ns"]) > 50
    for key in tick:
        assert tick[key].shape == bulk[key].shape, key
        assert (tick[key] == bulk[key]).all(), key
    assert bulk["gpu_energy_mj"].shape[1] == devices


def test_batches_keep_their_order_with_other_timers() -> None:
    def trace(batch: bool) -> list[tuple[str, int]]:
        clock = VirtualClock()
        seen: list[tuple[str, int]] = []
        if batch:
            clock.every_batch(0.003, lambda ts: seen.extend(("a", t) for t in ts.tolist()))
        else:
            clock.every(0.003, lambda: seen.append(("a", clock.now_ns())))
        clock.every(0.007, lambda: seen.append(("b", clock.now_ns())))
        clock.every(0.021, lambda: seen.append(("c", clock.now_ns())))
        for step in (0.001, 0.05, 0.0, 0.013, 0.1):
            clock.sleep(step)
        return seen

    assert trace(True) == trace(False)


class FlakyGpu(TwinGpu):
    """A twin GPU whose bulk read fails once `fail` is set."""

    fail: BaseException | None = None

    def readings_at(self, t_ns: np.ndarray) -> BulkReadings:
        if self.fail is not None:
            raise self.fail
        return super().readings_at(t_ns)


def test_a_failed_bulk_reading_is_raised_when_the_sampler_stops() -> None:
    clock = VirtualClock()
    gpu = FlakyGpu(TwinDevice(H100, clock))
    with pytest.raises(GpuError, match="cannot read"), Sampler([gpu], clock, 0.01) as sampler:
        assert sampler._bulk is not None
        gpu.fail = GpuError("GPU 0: cannot read power")
        clock.sleep(0.05)


def test_keyboard_interrupt_propagates_out_of_a_bulk_reading() -> None:
    clock = VirtualClock()
    gpu = FlakyGpu(TwinDevice(H100, clock))
    with pytest.raises(KeyboardInterrupt), Sampler([gpu], clock, 0.01):
        gpu.fail = KeyboardInterrupt()
        clock.sleep(0.05)


class Signalling(FlakyGpu):
    """Raises SIGINT in its second bulk read (the first after the sampler's entry)."""

    calls: list[int]

    def readings_at(self, t_ns: np.ndarray) -> BulkReadings:
        self.calls.append(len(t_ns))
        if len(self.calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return super().readings_at(t_ns)


class SignallingAtOnce(Signalling):
    """The same, reading each batch of ticks as it falls due (no state to defer with)."""

    reading_state = None  # type: ignore[assignment]


def sigint_in_a_round(gpu: Signalling, clock: VirtualClock, *, during_sleep: bool) -> None:
    saved = signal.getsignal(signal.SIGINT)
    gpu.calls = []
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with pytest.raises(KeyboardInterrupt), signals_raise(), Sampler([gpu], clock, 0.01):
            clock.sleep(0.05)
            if during_sleep:
                pytest.fail("SIGINT did not interrupt the round")
    finally:
        signal.signal(signal.SIGINT, saved)
    assert gpu.calls[1] > 1  # it arrived during a read of several ticks


def test_sigint_during_a_bulk_round_interrupts_it() -> None:
    clock = VirtualClock()
    sigint_in_a_round(SignallingAtOnce(TwinDevice(H100, clock)), clock, during_sleep=True)


def test_sigint_during_the_deferred_read_of_a_rounds_ticks_interrupts_it() -> None:
    # the twin's ticks are noted with its state and read together as the round ends
    clock = VirtualClock()
    sigint_in_a_round(Signalling(TwinDevice(H100, clock)), clock, during_sleep=False)


def test_deferred_ticks_are_read_from_the_state_they_were_due_in() -> None:
    def script(clock: TickClock | VirtualClock) -> tuple[dict[str, np.ndarray], int]:
        inner = clock.inner if isinstance(clock, TickClock) else clock
        device = TwinDevice(H100, inner)
        gpu = TwinGpu(device)
        node = TwinNode([device])
        with Sampler([gpu], clock, 0.01) as sampler:
            node.execute(workload([64] * 200))
            clock.sleep(0.037)
            noted = len(sampler._pending or [])
            gpu.lock_sm_clock(1200, 1200)  # a new state mid-round, after three ticks were due
            node.execute(workload([512] * 100))
            clock.sleep(0.041)
        return sampler.samples.arrays(), noted

    (tick, _), (bulk, noted) = script(TickClock()), script(VirtualClock())
    assert noted == 1  # the twin's ticks were noted, not read, when the state changed
    assert len(tick["t_ns"]) == 2 + 7
    for key in tick:
        assert np.array_equal(tick[key], bulk[key]), key


@pytest.mark.parametrize("make_clock", [TickClock, VirtualClock])
def test_a_finished_sampler_is_freed_without_the_cyclic_collector(
    make_clock: Callable[[], TickClock | VirtualClock],
) -> None:
    """A stopped ticker lets go of its callback, so a sampler (which keeps its ticker) is no
    reference cycle: reference counting frees each round's, with its readings (issue 15: the
    cyclic collector cost a demo sweep ~0.8 s of CPU)."""
    import gc
    import weakref

    clock = make_clock()
    inner = clock.inner if isinstance(clock, TickClock) else clock
    device = TwinDevice(H100, inner)
    gpu = TwinGpu(device)
    enabled = gc.isenabled()
    gc.disable()
    try:
        with Sampler([gpu], clock, 0.01) as sampler:
            TwinNode([device]).execute(workload([64] * 50))
            clock.sleep(0.05)
        assert len(sampler.samples.arrays()["t_ns"]) > 2
        gone = weakref.ref(sampler)
        del sampler
        assert gone() is None
    finally:
        if enabled:
            gc.enable()


def test_samples_join_the_twins_blocks_as_they_join_its_columns() -> None:
    """A twin GPU's readings come as one block of rows (`BlockReadings`), which `Samples` keeps
    and joins in one copy: the same arrays as the per-field chunks, whatever else is added
    after them (kept in order)."""
    clock = VirtualClock()
    device = TwinDevice(H100, clock)
    gpu = TwinGpu(device)
    TwinNode([device]).execute(workload([64] * 40))
    t = np.arange(0, 60 * MS, 3 * MS, dtype=np.int64)
    readings = [gpu.readings_at(t[:1]), gpu.readings_at(t[1:9]), gpu.readings_at(t[9:])]
    assert all(r.block.shape == (5, len(r.energy_mj)) for r in readings)

    def columns(r: BulkReadings) -> BulkReadings:  # the same readings, without the block
        return BulkReadings(r.energy_mj, r.power_mw, r.sm_clock_mhz, r.temperature_c, r.reasons)

    parts = [(t[:1], readings[0]), (t[1:9], readings[1]), (t[9:], readings[2])]
    blocks, plain = Samples(), Samples()
    for at, r in parts:
        blocks.extend(at, [r])
        plain.extend(at, [columns(r)])
    assert blocks.blocks and not plain.blocks and len(blocks) == len(plain) == len(t)
    mixed = Samples()  # a block, then columns, then a block: in order
    mixed.extend(parts[0][0], [parts[0][1]])
    mixed.extend(parts[1][0], [columns(parts[1][1])])
    mixed.extend(parts[2][0], [parts[2][1]])
    mixed.append(int(t[-1]) + MS, [7], [int(t[-1]) + MS], 1, 2, 3, 4)
    plain.append(int(t[-1]) + MS, [7], [int(t[-1]) + MS], 1, 2, 3, 4)
    expected = plain.arrays()
    for got in (blocks.arrays(), mixed.arrays()):
        assert set(got) == set(expected)
        for name, array in got.items():
            want = expected[name][: len(array)]
            assert array.dtype == want.dtype and array.shape == want.shape, name
            assert np.array_equal(array, want), name
    assert len(blocks.arrays()["t_ns"]) == len(t) and len(mixed.arrays()["t_ns"]) == len(t) + 1
