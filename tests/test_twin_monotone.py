"""The twin's physics is monotone where physics is: properties over its pass timing, its power
limit and its passes, on both GPU profiles, traps on and off.

A higher locked SM clock never makes passes slower at a fixed power limit, and never lowers a
pass's draw where no cap binds; a higher power limit never makes them slower nor lowers a
clock; more tokens (prompt, batch, context, accepted length) never make a round faster; the
time is continuous in the clock (one 15 MHz step changes it by at most the step's ratio); energy
is positive. (ad708b5b fixed one such defect: leakage counted against the limit in 5 W steps.)
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.campaign.model import DrafterSpec
from dvfs.clock import VirtualClock
from dvfs.corpora import load_corpus, sample_prompts
from dvfs.engines.base import Workload
from dvfs.engines.twin import TwinEngine
from dvfs.twin import physics, traps
from dvfs.twin.device import TwinDevice, TwinNode
from dvfs.twin.drafting import plan_drafter
from dvfs.twin.passes import PassBuilder, decode_passes, prefill_passes
from dvfs.twin.profiles import gpu_profile, model_profile

LLAMA8B = model_profile("llama-3.1-8b")
PROFILES = {
    (key, on): gpu_profile(key) if on else traps.without(gpu_profile(key))
    for key in ("h100-sxm", "h200-sxm")
    for on in (True, False)
}
#: each profile's supported clocks, ascending (the H100's from 210 MHz, the H200's from 345)
CLOCKS = {key: sorted(gpu.supported_sm_clocks_mhz()) for key, gpu in PROFILES.items()}
DRAFTERS = [
    DrafterSpec("none"),
    DrafterSpec("eagle3", "EAGLE3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 5, 4, 8),
    DrafterSpec("eagle", "EAGLE", None, 3, 1, 4),
    DrafterSpec("sa", "STANDALONE", "meta-llama/Llama-3.2-1B-Instruct", 4, 1, 5),
    DrafterSpec("ngram", "NGRAM", None, None, None, 12),
    DrafterSpec("dflash", "DFLASH", None, None, None, 16),
]

profiles = st.sampled_from(sorted(PROFILES))
#: a place on a profile's clock grid, 0 the lowest clock, 1 the highest
places = st.floats(0.0, 1.0)


def clock_at(key: tuple[str, bool], place: float, up: int = 0) -> int:
    """The clock at `place` on `key`'s grid, `up` steps higher (at most the top one)."""
    grid = CLOCKS[key]
    return grid[min(round(place * (len(grid) - 1)) + up, len(grid) - 1)]


#: a batch's prompt lengths (tokens)
prompts = st.lists(st.integers(1, 12000), min_size=1, max_size=8)


def prefill(lengths: list[int]) -> physics.Passes:
    builder = PassBuilder(1)
    prefill_passes(builder, LLAMA8B, np.array(lengths, dtype=np.int64))
    return builder.parts[0]


def decode(drafter: DrafterSpec, batch: int, context: float, accepted: float) -> physics.Passes:
    """One steady decode iteration: `batch` requests at `context` tokens, `accepted` each."""
    plan = plan_drafter(drafter, LLAMA8B)
    active, ctx = np.array([float(batch)]), np.array([context])
    builder = PassBuilder(1)
    kv = LLAMA8B.kv_bytes_read(ctx) * active
    emitted = active * (min(accepted, plan.depth + 1) if plan else 1.0)
    decode_passes(builder, LLAMA8B, plan, active, active * context, kv, ctx, emitted)
    return builder.parts[0]


def round_s(gpu, phases: tuple[physics.Passes, ...], mhz: int, limit_w: float) -> float:
    return physics.schedule(gpu, phases, mhz, limit_w).timing.total_s


@settings(max_examples=25, deadline=None)
@given(
    key=profiles,
    lengths=prompts,
    which=st.integers(0, 7),
    more=st.integers(1, 300),
    place=places,
)
def test_a_longer_prompt_never_prefills_faster(key, lengths, which, more, place) -> None:
    """More prompt tokens are more work: the prefill of a batch whose prompt `which` is `more`
    tokens longer, or that has one more prompt, never takes less time, at any clock. (The
    weight GEMMs' tile quantisation stretched the attention's FLOPs too: prompts of 1 and 64
    tokens (M = 65) prefilled slower than of 2 and 64 (M = 66) on the H100 at 210 MHz.)"""
    gpu, mhz = PROFILES[key], clock_at(key, place)
    longer = list(lengths)
    longer[which % len(longer)] += more
    base = physics.time_passes(gpu, prefill(lengths), mhz).total_s
    assert physics.time_passes(gpu, prefill(longer), mhz).total_s >= base * (1 - 1e-12)
    added = physics.time_passes(gpu, prefill([*lengths, more]), mhz).total_s
    assert added >= base * (1 - 1e-12)


def test_a_prompt_one_chunk_longer_never_prefills_faster() -> None:
    """A prompt's attention is counted on the chunk it ends in; a prompt of 8198 tokens ends in
    a chunk of 6 (M = 6), one of 8205 in a chunk of 13, and the weight GEMMs' tile padding
    (64 rows) stretched that chunk's attention FLOPs 12.5x against 5.9x: the longer prompt
    prefilled 34% faster, at every clock, on both profiles. The attention's FLOPs are not
    padded: each prompt from 8193 to 8320 tokens prefills no faster than the one before."""
    for key, gpu in PROFILES.items():
        for mhz in (CLOCKS[key][0], 1410, 1980):
            seconds = [
                physics.time_passes(gpu, prefill([n]), mhz).total_s for n in range(8193, 8321)
            ]
            assert np.all(np.diff(seconds) >= 0), (key, mhz)


@settings(max_examples=25, deadline=None)
@given(
    key=profiles,
    drafter=st.sampled_from(DRAFTERS),
    batch=st.integers(1, 256),
    context=st.integers(16, 32768),
    accepted=st.floats(1.0, 16.0),
    more_batch=st.integers(0, 64),
    more_context=st.integers(0, 4096),
    more_accepted=st.floats(0.0, 4.0),
    place=places,
)
def test_more_tokens_never_make_a_decode_iteration_faster(
    key, drafter, batch, context, accepted, more_batch, more_context, more_accepted, place
) -> None:
    """A larger batch, a longer context or a longer accepted length never shortens an
    iteration (nor any of its passes) at a clock."""
    gpu, mhz = PROFILES[key], clock_at(key, place)
    small = physics.time_passes(gpu, decode(drafter, batch, context, accepted), mhz)
    large = physics.time_passes(
        gpu,
        decode(drafter, batch + more_batch, context + more_context, accepted + more_accepted),
        mhz,
    )
    assert np.all(large.duration_s >= small.duration_s * (1 - 1e-12))


def mixed_round(drafter: DrafterSpec, lengths: list[int], context: int) -> tuple:
    """A round's phases: the prompts' prefill, then a few decode iterations."""
    return (prefill(lengths), decode(drafter, len(lengths), float(context), 3.0))


@settings(max_examples=25, deadline=None)
@given(
    key=profiles,
    drafter=st.sampled_from(DRAFTERS),
    lengths=prompts,
    context=st.integers(16, 16384),
    limit_w=st.floats(200.0, 700.0),
    place=places,
    up=st.integers(1, 40),
)
def test_a_higher_clock_never_slows_a_round_under_a_limit(
    key, drafter, lengths, context, limit_w, place, up
) -> None:
    """At a fixed power limit, a higher requested clock never makes a round (prefill and
    decode phases, each at its operating point) slower, nor any pass's clock lower."""
    gpu = PROFILES[key]
    phases = mixed_round(drafter, lengths, context)
    low, high = clock_at(key, place), clock_at(key, place, up)
    slow = physics.schedule(gpu, phases, low, limit_w)
    fast = physics.schedule(gpu, phases, high, limit_w)
    assert fast.timing.total_s <= slow.timing.total_s * (1 + 1e-12)
    assert np.all(fast.pass_clock_mhz >= slow.pass_clock_mhz)
    assert np.all(fast.timing.duration_s <= slow.timing.duration_s * (1 + 1e-12))


@settings(max_examples=25, deadline=None)
@given(
    key=profiles,
    drafter=st.sampled_from(DRAFTERS),
    lengths=prompts,
    context=st.integers(16, 16384),
    limits=st.lists(st.floats(200.0, 700.0), min_size=2, max_size=2, unique=True),
    place=places,
)
def test_a_higher_power_limit_never_slows_a_round(
    key, drafter, lengths, context, limits, place
) -> None:
    """At a fixed requested clock, a higher power limit never makes a round slower, nor any
    pass's clock lower; no pass draws more than its limit above the lowest clock."""
    gpu, mhz = PROFILES[key], clock_at(key, place)
    phases = mixed_round(drafter, lengths, context)
    low, high = sorted(limits)
    tight = physics.schedule(gpu, phases, mhz, low)
    loose = physics.schedule(gpu, phases, mhz, high)
    assert loose.timing.total_s <= tight.timing.total_s * (1 + 1e-12)
    assert np.all(loose.pass_clock_mhz >= tight.pass_clock_mhz)
    for sched, limit in ((tight, low), (loose, high)):
        floor = sched.pass_clock_mhz == gpu.min_sm_clock_mhz
        assert np.all((sched.timing.power_w <= limit * (1 + 1e-12)) | floor)
        assert sched.timing.energy_j > 0


@settings(max_examples=25, deadline=None)
@given(
    key=profiles,
    drafter=st.sampled_from(DRAFTERS),
    lengths=prompts,
    context=st.integers(16, 16384),
    place=places,
)
def test_uncapped_power_rises_and_time_falls_continuously_with_the_clock(
    key, drafter, lengths, context, place
) -> None:
    """With no cap, one clock step up (15 MHz) never lowers a pass's draw, never lengthens
    it, and shortens it by at most the step's ratio: the time is continuous in the clock."""
    gpu = PROFILES[key]
    low = clock_at(key, place)
    high = clock_at(key, place, 1) if low < CLOCKS[key][-1] else CLOCKS[key][-2]
    low, high = min(low, high), max(low, high)
    for passes in mixed_round(drafter, lengths, context):
        slow = physics.time_passes(gpu, passes, low)
        fast = physics.time_passes(gpu, passes, high)
        assert np.all(fast.power_w >= slow.power_w * (1 - 1e-12))
        assert np.all(fast.duration_s <= slow.duration_s * (1 + 1e-12))
        assert np.all(slow.duration_s <= fast.duration_s * (high / low) * (1 + 1e-12))
        assert np.all(slow.power_w > 0) and slow.energy_j > 0


CODE = load_corpus("code")


def second_round_s(
    key: tuple[str, bool], drafter: DrafterSpec, batch: int, mhz: int, limit_w: float
) -> float:
    """The second of two like rounds (code prompts, 128 tokens each) on a fresh twin GPU
    locked at `mhz` under `limit_w`, idle for 5 s first: its seconds."""
    clock = VirtualClock()
    device = TwinDevice(PROFILES[key], clock, 0)
    device.locked_mhz = (mhz, mhz)
    device.power_limit_w = limit_w
    engine = TwinEngine(TwinNode([device]), LLAMA8B)
    engine.start(drafter)
    clock.sleep(5.0)
    prompts = sample_prompts(CODE, batch, input_tokens=(16, 2048), seed=5)
    for _ in range(2):
        result = engine.run(Workload(batch, prompts, "code", 128, 0.0, True, "fixed", seed=5))
    return (result.ended_ns - result.started_ns) / 1e9


@settings(max_examples=15, deadline=None)
@given(
    key=profiles,
    drafter=st.sampled_from(DRAFTERS),
    batch=st.sampled_from([1, 16, 64]),
    limits=st.lists(st.floats(200.0, 700.0), min_size=2, max_size=2, unique=True),
    place=places,
)
def test_a_higher_power_limit_never_slows_a_round_on_a_twin_gpu(
    key, drafter, batch, limits, place
) -> None:
    """On the twin GPU, die, leakage and traps included: a higher power limit never makes a
    round slower."""
    low, high = sorted(limits)
    mhz = clock_at(key, place)
    tight = second_round_s(key, drafter, batch, mhz, low)
    assert second_round_s(key, drafter, batch, mhz, high) <= tight * (1 + 1e-12)


@settings(max_examples=15, deadline=None)
@given(
    key=profiles,
    drafter=st.sampled_from(DRAFTERS),
    batch=st.sampled_from([1, 16, 64]),
    limit_w=st.sampled_from([200.0, 250.0, 300.0, 450.0]),
    place=st.floats(0.5, 1.0),
)
def test_one_clock_step_up_slows_a_round_on_a_twin_gpu_by_less_than_the_step(
    key, drafter, batch, limit_w, place
) -> None:
    """On the twin GPU, one locked-clock step up never slows a round with the traps off; with
    them on, by less than the step's own ratio. (A higher clock warms the idle and working die,
    which leaks more and leaves the cap a few hundredths of a watt less; a pass whose draw sits
    that close to the limit then drops a whole 15 MHz bin, as the limit picks each pass's
    highest fitting clock: up to 0.55% of a round, 60% of the step, at batch 64 under 200 W.
    The 5 W leakage steps ad708b5b removed cost 1.2%, more than the step's 0.86%.)"""
    low, high = clock_at(key, place), clock_at(key, place, 1)
    if low == high:
        low = clock_at(key, place, -1)
    slow = second_round_s(key, drafter, batch, low, limit_w)
    fast = second_round_s(key, drafter, batch, high, limit_w)
    _, traps_on = key
    assert fast <= slow * (1 + ((high / low - 1) if traps_on else 1e-12))
