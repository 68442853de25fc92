"""The meter's arithmetic on hand-made traces: windows, energy, latency, quality flags."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.engines.base import RequestTrace, RoundResult
from dvfs.gpu.base import EVENT_GPU_IDLE, EVENT_HW_THERMAL, EVENT_SW_POWER_CAP
from dvfs.measure.meter import (
    INVALIDATING,
    Q_CLOCK_HELD_LOW,
    Q_CLOCK_NOT_REACHED,
    Q_COUNTER_STALLED,
    Q_FEW_COUNTER_UPDATES,
    Q_FEW_SAMPLES,
    Q_POWER_CAPPED,
    Q_SHORT_WINDOW,
    Q_THROTTLED,
    WindowPart,
    counter_at,
    latency_stats,
    steady_window_ns,
    summarise,
    tokens_in_window,
)

MS = 1_000_000


def trace(sent: int, chunks: list[tuple[int, int]], **spec) -> RequestTrace:
    times = np.array([t for t, _ in chunks], dtype=np.int64)
    tokens = np.array([n for _, n in chunks], dtype=np.int64)
    return RequestTrace(sent, times, tokens, 10, int(tokens.sum()), "length", **spec)


def test_latency_follows_sglang_bench_definitions() -> None:
    # First chunk at 50 ms, then chunks of 1, 3 and 2 tokens every 30 ms.
    r = trace(0, [(50 * MS, 1), (80 * MS, 1), (110 * MS, 3), (140 * MS, 2)])
    stats = latency_stats([r])
    assert stats.ttft_ms == (50.0, 50.0, 50.0)
    assert stats.tpot_ms[0] == pytest.approx(90 / 6)  # (last - first) / (tokens - 1)
    # ITL spreads each gap over its tokens: 30 (x1), 10 (x3), 15 (x2)
    itl = sorted([30.0, 10, 10, 10, 15, 15])
    assert stats.itl_ms[0] == pytest.approx(float(np.quantile(itl, 0.5)))
    assert stats.itl_ms[2] == pytest.approx(float(np.quantile(itl, 0.99)))
    assert all(math.isnan(v) for v in latency_stats([]).ttft_ms)


def test_fixed_batch_window_runs_from_last_first_token_to_first_finish() -> None:
    a = trace(0, [(10 * MS, 1), (20 * MS, 1), (30 * MS, 1), (40 * MS, 1)])
    b = trace(0, [(15 * MS, 1), (25 * MS, 2), (35 * MS, 1)])
    result = RoundResult((a, b), 0, 40 * MS)
    assert steady_window_ns(result, "fixed") == (15 * MS, 35 * MS)
    assert tokens_in_window([a, b], 15 * MS, 35 * MS) == 2 + 3  # (15, 35]: a's 20,30; b's 25,35


def test_closed_loop_window_ends_when_concurrency_drops() -> None:
    # Concurrency 2 from a pool of 3: the third request starts when the first finishes.
    first = trace(0, [(10 * MS, 1), (50 * MS, 5)])
    second = trace(0, [(12 * MS, 1), (90 * MS, 5)])
    third = trace(50 * MS, [(60 * MS, 1), (120 * MS, 5)])
    result = RoundResult((first, second, third), 0, 120 * MS)
    # Two first tokens by 12 ms; the last request was sent at 50 ms; the first finish after
    # that is at 90 ms.
    assert steady_window_ns(result, "closed-loop") == (12 * MS, 90 * MS)


def samples(times_ms, energy_mj, clock=1500, reasons=0) -> dict[str, np.ndarray]:
    n = len(times_ms)
    return {
        "t_ns": np.array(times_ms, dtype=np.int64) * MS,
        "energy_mj": np.array(energy_mj, dtype=float),
        "power_mw": np.full(n, 300_000),
        "sm_clock_mhz": np.full(n, clock),
        "temperature_c": np.full(n, 60),
        "reasons": np.full(n, reasons),
    }


def part(clock=1500, reasons=0, energy=(0, 100, 200, 300, 400)) -> WindowPart:
    a = trace(0, [(0, 1)] + [(t * MS, 1) for t in range(10, 101, 10)])
    b = trace(0, [(0, 1)] + [(t * MS, 1) for t in range(10, 101, 10)])
    result = RoundResult((a, b), 0, 100 * MS)
    return WindowPart(result, (0, 100 * MS), samples([0, 25, 50, 75, 100], energy, clock, reasons))


def test_energy_is_taken_between_counter_updates_inside_the_window() -> None:
    s = samples([0, 100], [1000, 2000])
    assert counter_at(s, 25 * MS) == 1250
    m = summarise(
        [part()],
        requested_clock_mhz=1500,
        min_window_s=0.05,
        sample_period_s=0.025,
        idle_power_w=75,
        precision=0.5,  # the edges' 25 ms brackets make the 75 ms uncertain by a third
    )
    # Updates seen at 25, 50, 75 and 100 ms, each somewhere in the 25 ms before: at 12.5, 37.5,
    # 62.5 and 87.5 ms (the brackets' middles). Energy from the first to the last inside the
    # window (100 -> 400 mJ over 75 ms), tokens over the same 75 ms (2 every 10 ms).
    assert m.energy_j == pytest.approx(0.3)
    assert m.decode_time_s == pytest.approx(0.075)
    assert m.window_tokens == pytest.approx(15) and m.output_tokens == 15
    assert m.energy_per_token_j == pytest.approx(0.02)
    assert m.power_mean_w == pytest.approx(4.0)
    assert m.valid and m.quality == 0
    assert m.counter_updates == 4
    assert m.energy_per_token_above_idle_j == pytest.approx((0.3 - 75 * 0.075) / 15)


def test_the_readme_says_where_the_counter_is_interpolated() -> None:
    """README ("How it works") said `meter.py` takes "each counter interpolated at the window's
    edges": a relic of the first meter. A round's energy runs from the counter's first to its
    last update inside the window (400 - 100 mJ over 75 ms here, not 400 mJ over the window's
    100 ms); only a counter that updated fewer than twice in it is read at the edges."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = " ".join(readme.split("\n## How it works\n", 1)[1].split("\n## ", 1)[0].split())
    assert "each counter interpolated at the window's edges" not in section
    assert (
        "a round's energy between the counter's first and last update inside its window "
        "(`counter.py`; interpolated at the window's edges only where a counter updated fewer "
        "than twice in it, or moves at every reading)"
    ) in section

    def measured(energy: tuple[int, ...]) -> tuple[float, float]:
        m = summarise(
            [part(energy=energy)],
            requested_clock_mhz=1500,
            min_window_s=0.05,
            sample_period_s=0.025,
            idle_power_w=75,
            precision=0.5,
        )
        return m.energy_j, m.decode_time_s

    assert measured((0, 100, 200, 300, 400)) == pytest.approx((0.3, 0.075))  # between updates
    assert measured((0, 0, 0, 400, 400)) == pytest.approx((0.4, 0.1))  # one update: the edges


@pytest.mark.parametrize(
    ("kwargs", "part_kwargs", "flag", "valid"),
    [
        ({"requested_clock_mhz": 1980}, {"clock": 1500}, Q_CLOCK_NOT_REACHED, False),
        # A power limit (the cell's own or the stock one) held the clock down: valid, flagged.
        (
            {"requested_clock_mhz": 1980},
            {"clock": 1500, "reasons": EVENT_SW_POWER_CAP},
            Q_POWER_CAPPED,
            True,
        ),
        # Above the lock: the lock did not take.
        ({"requested_clock_mhz": 1200}, {"clock": 1500}, Q_CLOCK_NOT_REACHED, False),
        ({}, {"reasons": EVENT_HW_THERMAL}, Q_THROTTLED, False),
        ({}, {"energy": (0, 0, 0, 0, 0)}, Q_COUNTER_STALLED, False),
        ({"min_window_s": 5.0}, {}, Q_SHORT_WINDOW, True),
        # 75 ms between updates seen 25 ms apart: not known to 1%
        ({"precision": 0.01}, {}, Q_FEW_COUNTER_UPDATES, False),
    ],
    ids=["below-lock", "power-capped", "above-lock", "thermal", "stalled", "short", "few-updates"],
)
def test_quality_flags(kwargs, part_kwargs, flag, valid) -> None:
    args = {
        "requested_clock_mhz": None,
        "min_window_s": 0.05,
        "sample_period_s": 0.025,
        "idle_power_w": 75.0,
        "precision": 0.5,
        **kwargs,
    }
    m = summarise([part(**part_kwargs)], **args)
    assert m.quality & flag
    assert m.valid is valid
    assert bool(m.quality & INVALIDATING) is not valid


def test_too_few_samples_in_the_window_invalidate() -> None:
    sparse = part()
    sparse.samples = samples([0, 100], [0, 400])  # nothing sampled inside the window
    m = summarise(
        [sparse],
        requested_clock_mhz=None,
        min_window_s=0.05,
        sample_period_s=0.1,
        idle_power_w=75.0,
    )
    assert m.quality & Q_FEW_SAMPLES and not m.valid


def two_gpu_part(second_mj: np.ndarray, window_ms: int = 20_000) -> WindowPart:
    """A tensor-parallel round over `window_ms`: two GPUs' counters read every 20 ms (GPU 0's
    stepping every 100 ms at 300 W, GPU 1's as given: one per reading); two tokens every 10 ms."""
    t_ms = np.arange(0, window_ms + 1, 20)
    first = (t_ms // 100 * 100) * 300
    chunks = [(0, 1)] + [(t * MS, 1) for t in range(10, window_ms + 1, 10)]
    result = RoundResult((trace(0, chunks), trace(0, chunks)), 0, window_ms * MS)
    s = samples(list(t_ms), first + second_mj)
    s["gpu_energy_mj"] = np.stack([first, second_mj], axis=1).astype(np.int64)
    s["gpu_energy_t_ns"] = np.stack([t_ms * MS, t_ms * MS], axis=1)
    return WindowPart(result, (0, window_ms * MS), s)


@pytest.mark.parametrize("stalled", [False, True], ids=["stepping", "frozen"])
def test_one_gpus_stalled_counter_invalidates_a_tensor_parallel_cell(stalled) -> None:
    """With several GPUs the summed energy stays positive when one GPU's counter stops: that
    GPU's energy would be missing from a valid cell (half the energy per token at TP=2)."""
    t_ms = np.arange(0, 20_001, 20)
    second = np.full(len(t_ms), 5_000_000) if stalled else (t_ms // 100 * 100) * 300 + 7
    m = summarise(
        [two_gpu_part(second)],
        requested_clock_mhz=None,
        min_window_s=1.0,
        sample_period_s=0.02,
        idle_power_w=150.0,
        counter_periods_s=[0.1, 0.1],
        precision=0.02,
    )
    if stalled:
        assert m.quality & Q_COUNTER_STALLED and not m.valid
    else:
        assert m.valid and m.quality == 0
        assert m.power_mean_w == pytest.approx(600.0)


@settings(max_examples=100, deadline=None)
@given(
    gaps=st.lists(st.integers(1, 50), min_size=2, max_size=40),
    tokens=st.lists(st.integers(1, 8), min_size=2, max_size=40),
)
def test_itl_and_tpot_agree_on_the_mean(gaps, tokens) -> None:
    """Spreading each gap over its tokens keeps the total: mean ITL x tokens = decode time."""
    n = min(len(gaps), len(tokens))
    times = np.cumsum([5] + gaps[:n]) * MS
    chunks = [(int(times[0]), 1)] + [
        (int(t), k) for t, k in zip(times[1:], tokens[:n], strict=False)
    ]
    r = trace(0, chunks)
    decode_ms = (r.finished_ns - r.first_token_ns) / MS
    gaps_ms = np.diff(r.chunk_ns) / MS
    per_token = np.repeat(gaps_ms / r.chunk_tokens[1:], r.chunk_tokens[1:])
    assert per_token.sum() == pytest.approx(decode_ms)
    assert latency_stats([r]).tpot_ms[0] == pytest.approx(decode_ms / (r.completion_tokens - 1))


# -- the background sampler -----------------------------------------------------------------


class ManualClock:
    """Time that moves only when told (a reading can take time); every() never fires."""

    virtual = True

    def __init__(self) -> None:
        self.t_ns = 1_000 * MS

    def now_ns(self) -> int:
        return self.t_ns

    def sleep(self, seconds: float) -> None:
        self.t_ns += round(seconds * 1e9)

    def every(self, period_s, callback):
        class Idle:
            def stop(self) -> None:
                pass

        return Idle()


class ThreadClock(ManualClock):
    """Real threads for every(); stop() only asks, like a ticker whose thread may be stuck."""

    virtual = False

    def every(self, period_s, callback):
        import threading

        stopped = threading.Event()

        def loop() -> None:
            while not stopped.is_set():
                callback()
                stopped.wait(period_s)

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()

        class Ticker:
            def stop(self) -> None:
                stopped.set()
                thread.join(0.01)

        self.thread = thread
        return Ticker()


class StubGpu:
    """A GPU whose energy counter is exactly 3 mJ per ms of the clock, read in the middle of a
    call that takes `delay_ms`; `gate` blocks energy reads after the `block_after`-th."""

    def __init__(self, clock, index=0, delay_ms=0, gate=None, block_after=None) -> None:
        from dvfs.gpu.base import GpuIdentity

        self.clock, self.delay_ms, self.gate, self.block_after = clock, delay_ms, gate, block_after
        self.identity = GpuIdentity(index, f"GPU-{index}", "stub", "0", "stub", 2619, 1980)
        self.calls = 0

    def energy_mj(self) -> int:
        self.calls += 1
        if self.gate is not None and self.block_after is not None and self.calls > self.block_after:
            self.gate.wait()
        self.clock.t_ns += self.delay_ms * MS // 2  # the call takes delay_ms; the driver
        value = 3 * self.clock.t_ns // MS  # reads the counter halfway through
        self.clock.t_ns += self.delay_ms * MS // 2
        return value

    def power_mw(self) -> int:
        return 300_000

    def sm_clock_mhz(self) -> int:
        return 1500

    def temperature_c(self) -> int:
        return 60

    def clock_event_reasons(self) -> int:
        return 0


def test_energy_readings_carry_the_time_the_counter_was_read() -> None:
    """A slow energy read (40 ms per GPU) lands long after the sampling loop's own timestamp:
    interpolating at the loop's times would credit energy to the wrong instants."""
    from dvfs.measure.sampler import Sampler

    clock = ManualClock()
    gpus = [StubGpu(clock, 0, delay_ms=40), StubGpu(clock, 1, delay_ms=40)]
    sampler = Sampler(gpus, clock, period_s=0.1)
    for _ in range(5):
        sampler.sample()
        clock.sleep(0.1)
    s = sampler.samples.arrays()
    assert s["gpu_energy_t_ns"].shape == (5, 2)
    assert (s["gpu_energy_t_ns"][:, 0] > s["t_ns"]).all()  # read after the loop's timestamp
    # Each counter is exactly 3 mJ/ms of its own read time, so interpolation must be exact.
    for t_ms in (1_100, 1_210, 1_333):  # within every GPU's readings
        assert counter_at(s, t_ms * MS) == pytest.approx(2 * 3 * t_ms, abs=1e-6)


class LockedStubGpu(StubGpu):
    """A `StubGpu` running at `clock_mhz` (its lock, or the clock it runs at without one)."""

    def __init__(self, clock, index: int, clock_mhz: int) -> None:
        super().__init__(clock, index)
        self.clock_mhz = clock_mhz

    def sm_clock_mhz(self) -> int:
        return self.clock_mhz


@pytest.mark.parametrize("second_mhz", [1500, 1980], ids=["both-locked", "one-unlocked"])
def test_a_tensor_parallel_gpu_above_its_lock_is_flagged(second_mhz) -> None:
    """A lock that did not take on one GPU of a group (reset by an admin or a GPU reset; NVML
    cannot read a lock back) runs that GPU at full clock: the slowest GPU's clock alone still
    reads the lock, and the cell would be valid at a clock it did not run at."""
    from dvfs.cube.quality import INVALID_ADVICE
    from dvfs.gpu.base import BulkReadings
    from dvfs.measure.sampler import Sampler, Samples

    clock = ManualClock()
    gpus = [LockedStubGpu(clock, 0, 1500), LockedStubGpu(clock, 1, second_mhz)]
    sampler = Sampler(gpus, clock, period_s=0.025)
    for _ in range(5):
        sampler.sample()
        clock.sleep(0.025)
    chunks = [(t * MS, 1) for t in range(1_000, 1_101, 10)]
    result = RoundResult((trace(0, chunks), trace(0, chunks)), 0, 1_100 * MS)
    m = summarise(
        [WindowPart(result, (1_000 * MS, 1_100 * MS), sampler.samples.arrays())],
        requested_clock_mhz=1500,
        min_window_s=0.05,
        sample_period_s=0.025,
        idle_power_w=150.0,
        precision=0.5,
    )
    assert m.sm_clock_observed_mhz == 1500  # the slowest GPU's, as before
    assert bool(m.quality & Q_CLOCK_NOT_REACHED) is (second_mhz != 1500)
    assert "lost its lock outside dvfs" in INVALID_ADVICE["clock_not_reached"]  # what to do
    # The twin's bulk readings keep the fastest GPU's clock too.
    one = np.ones(3, dtype=np.int64)
    bulk = [
        BulkReadings(one, one, one * 1500, one, 0 * one),
        BulkReadings(one, one, one * 1980, one, 0 * one),
    ]
    both = Samples()
    both.extend(np.arange(3, dtype=np.int64), bulk)
    arrays = both.arrays()
    assert arrays["sm_clock_mhz"].tolist() == [1500] * 3
    assert arrays["sm_clock_max_mhz"].tolist() == [1980] * 3


def test_the_sampler_raises_when_its_thread_does_not_stop() -> None:
    """A reading that hangs must end the round with a clear error, and nothing may be appended
    to the sampler's lists after it gave up (someone else is reading them by then)."""
    import threading

    from dvfs.measure.sampler import Sampler, SamplerError

    clock = ThreadClock()
    gate = threading.Event()
    gpu = StubGpu(clock, 0, gate=gate, block_after=3)
    sampler = Sampler([gpu], clock, period_s=0.001, stop_timeout_s=0.05)
    try:
        with pytest.raises(SamplerError, match="did not stop.*energy counter of GPU 0"), sampler:
            while gpu.calls <= 3:  # until the sampler thread is stuck in a reading
                threading.Event().wait(0.001)
        frozen = {k: v.tolist() for k, v in sampler.samples.arrays().items()}
    finally:
        gate.set()
    clock.thread.join()
    assert {k: v.tolist() for k, v in sampler.samples.arrays().items()} == frozen


def test_a_failed_reading_is_raised_when_the_sampler_stops() -> None:
    from dvfs.errors import GpuError
    from dvfs.measure.sampler import Sampler

    clock = ManualClock()
    gpu = StubGpu(clock)
    sampler = Sampler([gpu], clock, period_s=0.1)

    def broken() -> int:
        raise GpuError("GPU 0: cannot read power: NVML says Unknown Error")

    with pytest.raises(GpuError, match="cannot read power"), sampler:
        gpu.power_mw = broken  # type: ignore[method-assign]
        sampler._tick()  # what the clock's thread would call


# -- the vectorised statistics against the per-request code they replaced ---------------------


def reference_latency_stats(requests: list[RequestTrace]) -> tuple[tuple[float, ...], ...]:
    """latency_stats as written before it was vectorised: one request at a time."""

    def quantiles(values: np.ndarray) -> tuple[float, ...]:
        if len(values) == 0:
            return (math.nan,) * 3
        return tuple(float(q) for q in np.quantile(values, (0.5, 0.9, 0.99)))

    ok = [r for r in requests if r.error is None and len(r.chunk_ns)]
    ttft = np.array([(int(r.chunk_ns[0]) - r.sent_ns) * 1e-6 for r in ok])
    tpot = np.array(
        [
            (int(r.chunk_ns[-1]) - int(r.chunk_ns[0])) * 1e-6 / (r.completion_tokens - 1)
            for r in ok
            if r.completion_tokens > 1
        ]
    )
    parts = []
    for r in ok:
        if len(r.chunk_ns) < 2:
            continue
        gaps = np.diff(r.chunk_ns) * 1e-6
        tokens = r.chunk_tokens[1:]
        keep = tokens > 0
        parts.append(np.repeat(gaps[keep] / tokens[keep], tokens[keep]))
    itl = np.concatenate(parts) if parts else np.array([])
    return quantiles(ttft), quantiles(tpot), quantiles(itl)


def same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


request_strategy = st.builds(
    lambda sent, chunks, error: trace(
        sent,
        [
            (sent + int(t), k)
            for t, k in zip(
                np.cumsum([g for g, _ in chunks]) * 997, [k for _, k in chunks], strict=True
            )
        ],
        error=error,
    ),
    st.integers(0, 10**9),
    # (gap, tokens) per chunk, drawn together: no tokens drawn for chunks that are not there
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 9)), min_size=0, max_size=30),
    st.sampled_from([None, None, None, "boom"]),
)


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(request_strategy, max_size=12))
def test_latency_stats_equal_the_per_request_reference(requests) -> None:
    stats = latency_stats(requests)
    ttft, tpot, itl = reference_latency_stats(requests)
    assert same(stats.ttft_ms, ttft) and same(stats.tpot_ms, tpot) and same(stats.itl_ms, itl)


def reference_timeline(parts: list[WindowPart]) -> tuple[tuple[float, ...], ...]:
    """summarise's timeline and reasons as computed before, one sample at a time."""
    timeline = []
    offset_s = 0.0
    reasons = 0
    for p in parts:
        assert p.window is not None
        start, end = p.window
        s = p.samples
        # [start, end): a reading at the window's close reads the GPU after it
        inside = (s["t_ns"] >= start) & (s["t_ns"] < end)
        for r in s["reasons"][inside]:
            reasons |= int(r)
        for t, pw, c in zip(
            s["t_ns"][inside], s["power_mw"][inside], s["sm_clock_mhz"][inside], strict=True
        ):
            timeline.append((offset_s + (t - start) * 1e-9, pw / 1000, float(c)))
        offset_s += (end - start) * 1e-9
    if len(timeline) > 32:
        picks = np.linspace(0, len(timeline) - 1, 32).round().astype(int)
        timeline = [timeline[i] for i in picks]
    return (
        tuple(round(t, 6) for t, _, _ in timeline),
        tuple(round(p, 3) for _, p, _ in timeline),
        tuple(c for _, _, c in timeline),
        (float(reasons),),
    )


@settings(max_examples=100, deadline=None)
@given(
    rounds=st.lists(
        st.tuples(
            st.integers(1, 10**9),  # window start
            st.integers(1, 10**9),  # window length
            st.lists(st.integers(0, 2 * 10**9), min_size=2, max_size=60),  # sample times
            st.integers(0, 10**6),  # power seed
            st.booleans(),  # sampled at the window's start and close too
        ),
        min_size=1,
        max_size=4,
    )
)
def test_timeline_equals_the_per_sample_reference(rounds) -> None:
    parts = []
    for start, length, times, seed, edges in rounds:
        rng = np.random.default_rng(seed)
        t = np.array(sorted(times + [start, start + length] * edges), dtype=np.int64)
        n = len(t)
        s = {
            "t_ns": t,
            "energy_mj": np.arange(n, dtype=float) * 1000,
            "power_mw": rng.integers(50_000, 700_000, n),
            "sm_clock_mhz": rng.integers(200, 1980, n),
            "temperature_c": rng.integers(30, 90, n),
            "reasons": rng.choice([0, 1, 4, 8, 0x20], n),
        }
        a = trace(0, [(start, 1), (start + length, 1)])
        parts.append(WindowPart(RoundResult((a,), 0, start + length), (start, start + length), s))
    m = summarise(
        parts, requested_clock_mhz=None, min_window_s=0.0, sample_period_s=0.1, idle_power_w=0.0
    )
    ref = reference_timeline(parts)
    assert m.timeline_t_s == ref[0]
    assert m.timeline_power_w == ref[1]
    assert m.timeline_sm_clock_mhz == ref[2]
    assert m.clock_event_reasons == ref[3][0]


def _sampled_round(start_ms: int, end_ms: int, sample_ms: list[int], clock: int) -> WindowPart:
    """A round decoding one token every 10 ms over [start_ms, end_ms], sampled at `sample_ms`."""
    times = list(range(start_ms, end_ms + 1, 10))
    a = trace(0, [(t * MS, 1) for t in times])
    result = RoundResult((a,), 0, end_ms * MS)
    energy = [float(t) for t in sample_ms]  # 1 W
    return WindowPart(result, (start_ms * MS, end_ms * MS), samples(sample_ms, energy, clock))


def closing_round(decoding_ms: list[int]) -> WindowPart:
    """A steady round decoding at 300 W and 1500 MHz over [0, 100 ms], sampled at
    `decoding_ms`, that ends at its window's close: the sampler's last reading falls on it
    (100 ms, as on the twin's virtual clock) and reads the GPU after the decode's last step,
    idle: 80 W, its idle clock, GpuIdle; the die as the decode left it (the hottest)."""
    part = _sampled_round(0, 100, [*decoding_ms, 100], clock=1500)
    s = part.samples
    s["energy_mj"] = s["t_ns"] * 300 / 1e9 * 1000  # 300 W, the counter read at every sample
    s["power_mw"] = np.where(s["t_ns"] < 100 * MS, 300_000, 80_000)
    s["sm_clock_mhz"] = np.where(s["t_ns"] < 100 * MS, 1500, 345)
    s["reasons"] = np.where(s["t_ns"] < 100 * MS, 0, EVENT_GPU_IDLE)
    s["temperature_c"] = np.array([*(60 for _ in decoding_ms), 65])
    return part


def test_the_closing_reading_of_a_round_is_not_the_decodes() -> None:
    """The sampler's last reading of a round that ends at its window's close falls on the
    close and reads the GPU idle. The timeline held it (a steady 300 W decode ending at 80 W,
    as if it throttled), the observed clock averaged the idle clock in and the reasons took
    GpuIdle, which also hid a stock clock held low (clock_held_low ignores only 0x2 and
    SyncBoost). None of them keeps it, nor the count of samples (too few: few_samples); the
    temperature does (the die's at the close, the decode's last)."""
    m = summarise(
        [closing_round([0, 20, 40, 60, 80])],
        requested_clock_mhz=None,
        stock_clock_mhz=1980,
        min_window_s=0.0,
        sample_period_s=0.02,
        idle_power_w=80.0,
        precision=1.0,
    )
    assert m.timeline_power_w == (300.0,) * 5
    assert m.timeline_sm_clock_mhz == (1500.0,) * 5
    assert m.timeline_t_s[-1] == pytest.approx(0.08)
    assert m.sm_clock_observed_mhz == 1500.0
    assert not m.clock_event_reasons & EVENT_GPU_IDLE
    assert m.quality & Q_CLOCK_HELD_LOW
    assert m.power_max_w == pytest.approx(300.0)
    assert m.temperature_max_c == 65.0
    # two readings while decoding and the closing one: too few describe the decode (a cell
    # sampled only at its closes would pass as valid with no clock ever observed)
    args = {
        "requested_clock_mhz": None,
        "min_window_s": 0.0,
        "sample_period_s": 0.05,
        "idle_power_w": 80.0,
        "precision": 1.0,
    }
    few = summarise([closing_round([0, 50])], **args)
    assert few.quality & Q_FEW_SAMPLES
    assert few.timeline_power_w == (300.0, 300.0)
    enough = summarise([closing_round([0, 30, 60])], **args)
    assert not enough.quality & Q_FEW_SAMPLES


def test_a_cell_with_only_closing_readings_and_a_stalled_counter_has_no_peak_power() -> None:
    """A round sampled only at its window's close (an idle reading, not the decode's) whose
    counter gave nothing: power_max_w was 0.0 W, a number no GPU drew; it is NaN, not
    measured, as where no reading fell in the window at all (the temperature still read)."""
    part = closing_round([])
    part.samples["energy_mj"] = np.zeros(len(part.samples["t_ns"]))  # the counter never moved
    m = summarise(
        [part],
        requested_clock_mhz=None,
        min_window_s=0.0,
        sample_period_s=0.02,
        idle_power_w=80.0,
        precision=1.0,
    )
    assert m.quality & Q_COUNTER_STALLED
    assert math.isnan(m.power_max_w), m.power_max_w
    assert m.temperature_max_c == 65.0


@pytest.mark.parametrize("short_ms", [20, 2990])
def test_a_round_without_samples_inside_does_not_pull_the_observed_clock_down(short_ms) -> None:
    """The observed clock averages the rounds that were sampled, over their own windows: a
    round with no sample inside its window says nothing about the clock, and counting its
    length would read a clock reached as one missed (clock_not_reached)."""
    long = _sampled_round(0, 2990, list(range(0, 2991, 25)), clock=1500)
    # Sampled just before and just after its window, never inside it.
    unsampled = _sampled_round(5000, 5000 + short_ms, [4990, 5000 + short_ms + 10], clock=900)
    args = {
        "requested_clock_mhz": 1500,
        "min_window_s": 0.0,
        "sample_period_s": 0.025,
        "idle_power_w": 0.0,
        "precision": 1.0,
    }
    alone = summarise([long], **args)
    both = summarise([long, unsampled], **args)
    assert alone.sm_clock_observed_mhz == 1500.0
    assert both.sm_clock_observed_mhz == 1500.0
    assert not both.quality & Q_CLOCK_NOT_REACHED


def test_the_observed_clock_weights_sampled_rounds_by_their_windows() -> None:
    """Two sampled rounds: the clock is their means weighted by their windows' lengths."""
    slow = _sampled_round(0, 1000, list(range(0, 1001, 25)), clock=1200)
    fast = _sampled_round(2000, 5000, list(range(2000, 5001, 25)), clock=1600)
    m = summarise(
        [slow, fast],
        requested_clock_mhz=None,
        min_window_s=0.0,
        sample_period_s=0.025,
        idle_power_w=0.0,
        precision=1.0,
    )
    assert m.sm_clock_observed_mhz == pytest.approx((1200 * 1000 + 1600 * 3000) / 4000)


def test_acceptance_is_unknown_when_a_request_lost_its_counters() -> None:
    """Four requests, 16 verify passes each, 64 / 48 / 40 / 32 tokens: the round's truth is
    184 / 64. Ended by disconnects, only the one that finished (the best-accepted) kept its
    counters: pooling it alone said 4.0; the acceptance is unknown instead."""
    from dvfs.measure.meter import acceptance

    def request(tokens: int, *, lost: bool) -> RequestTrace:
        chunks = [(MS * (1 + i), 4) for i in range(tokens // 4)]
        if lost:
            return replace(trace(0, chunks), finish_reason="abort", final_lost=True)
        return trace(0, chunks, spec_verify_ct=16, spec_accepted_drafts=tokens - 17,
                     spec_proposed_drafts=16 * 3)  # fmt: skip

    known = [request(n, lost=False) for n in (64, 48, 40, 32)]
    assert acceptance([RoundResult(tuple(known), 0, 1)]).accept_length == 184 / 64
    cut = (known[0], *(request(n, lost=True) for n in (48, 40, 32)))
    got = acceptance([RoundResult(cut, 0, 1, 2.5)])
    assert math.isnan(got.accept_length) and math.isnan(got.decode_accept_length)
    assert math.isnan(got.accept_rate) and got.server_accept_length == 2.5
