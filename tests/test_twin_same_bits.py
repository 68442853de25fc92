"""The twin's fast paths give the same bits as the plain formulas they replace (issue 15).

Each reference here is the straightforward expression the twin evaluated before it kept
clock-free terms and worked in place; floating-point results must match exactly, not within
a tolerance, so a sweep's cube does not move.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.campaign.model import DrafterSpec
from dvfs.twin import physics, scalars, thermal
from dvfs.twin.drafting import plan_drafter
from dvfs.twin.passes import PassBuilder, decode_passes, prefill_passes
from dvfs.twin.profiles import gpu_profile, model_profile
from dvfs.twin.timeline import thermal_of

H100 = gpu_profile("h100-sxm")
H200 = gpu_profile("h200-sxm")
LLAMA8B = model_profile("llama-3.1-8b")
CLOCKS = sorted(H100.supported_sm_clocks_mhz())


def reference_time_passes(gpu, passes: physics.Passes, sm_clock_mhz) -> physics.PassTiming:
    """`physics.time_passes` as one plain expression per term."""
    clocks = None
    if np.ndim(sm_clock_mhz) == 0:
        f = float(sm_clock_mhz)
        bandwidth = float(physics.bandwidth_bytes_s(gpu, f))
        scale = float(physics.dynamic_scale(gpu, f))
    else:
        clocks = np.asarray(sm_clock_mhz, dtype=float)
        f = clocks
        bandwidth, scale = physics.bandwidth_bytes_s(gpu, f), physics.dynamic_scale(gpu, f)
    useful_s = passes.flops / gpu.peak_flops(f)
    stretch = gpu.gemm_efficiency / physics.gemm_efficiency(gpu, passes.tokens)
    # the weight GEMMs' FLOPs are stretched by their tile and wave quantisation, the attention's not
    attention = passes.attention_flops
    gemm_share = ((passes.flops - attention) * stretch + attention) / np.maximum(
        passes.flops, 1e-300
    )
    compute_s = useful_s * np.where(attention > 0, gemm_share, stretch)
    slow = passes.verify_kv_bytes * (1.0 / gpu.verify_attention_efficiency - 1.0)
    memory_s = (passes.bytes + slow) / bandwidth
    p = physics.ROOFLINE_BLEND
    roofline_s = (compute_s**p + memory_s**p) ** (1.0 / p)
    kernel_s = passes.layers * gpu.kernel_cycles_per_layer / (f * 1e6)
    comm_s = (
        passes.comm_bytes / (gpu.nvlink_gb_s * 1e9)
        + passes.comm_calls * physics.ALLREDUCE_LATENCY_S
    )
    busy_s = roofline_s + kernel_s + comm_s
    host_s = (
        gpu.host_overhead_s * passes.launches
        + gpu.spec_host_per_step_s * (passes.spec_requests > 0)
        + gpu.spec_host_per_request_s * passes.spec_requests
        + gpu.spec_host_per_token_s * passes.spec_tokens
    )
    duration_s = busy_s + host_s
    tensor_util = useful_s / duration_s
    memory_util = (passes.bytes / duration_s) / (gpu.hbm_bandwidth_gb_s * 1e9)
    busy = busy_s / duration_s
    power_w = (
        gpu.idle_power_w
        + busy * gpu.sm_active_power_w * scale
        + tensor_util * gpu.tensor_power_w * scale
        + memory_util * gpu.memory_power_w
    )
    return physics.PassTiming(
        float(f) if clocks is None else 0.0, duration_s, power_w, tensor_util, memory_util, clocks
    )


def round_passes(drafter: str, batch: int, context: int, tp: int, seed: int) -> physics.Passes:
    """A prefill and a few decode iterations of Llama-3.1-8B with a drafter."""
    specs = {
        "none": DrafterSpec("none"),
        "eagle3": DrafterSpec("eagle3", "EAGLE3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 5, 4, 8),
        "ngram": DrafterSpec("ngram", "NGRAM", num_draft_tokens=12),
    }
    plan = plan_drafter(specs[drafter], LLAMA8B)
    rng = np.random.default_rng(seed)
    builder = PassBuilder(tp)
    prefill_passes(builder, LLAMA8B, rng.integers(1, context + 1, size=batch))
    n_iter = 5
    active = np.full(n_iter, float(batch))
    ctx_sum = active * context + np.arange(n_iter)
    ctx_kv = LLAMA8B.kv_bytes_read(ctx_sum / active) * active
    emitted = rng.integers(1, 4, size=n_iter).astype(float) * batch
    decode_passes(builder, LLAMA8B, plan, active, ctx_sum, ctx_kv, ctx_sum / active, emitted)
    return physics.Passes.concat(builder.parts)


def same(a: physics.PassTiming, b: physics.PassTiming) -> None:
    for name in ("duration_s", "power_w", "tensor_util", "memory_util"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert x.tobytes() == y.tobytes(), name


@settings(max_examples=60, deadline=None)
@given(
    drafter=st.sampled_from(["none", "eagle3", "ngram"]),
    batch=st.integers(1, 96),
    context=st.integers(1, 9000),
    tp=st.sampled_from([1, 2, 8]),
    seed=st.integers(0, 2**16),
    profile=st.sampled_from([H100, H200]),
    clock=st.sampled_from(CLOCKS),
)
def test_time_passes_at_one_clock_is_the_plain_formula_to_the_bit(
    drafter, batch, context, tp, seed, profile, clock
) -> None:
    passes = round_passes(drafter, batch, context, tp, seed)
    want = reference_time_passes(profile, passes, clock)
    got = physics.time_passes(profile, passes, clock)
    same(got, want)
    assert got.sm_clock_mhz == want.sm_clock_mhz
    same(physics.time_passes(profile, passes, clock), want)  # the kept terms, reused


@settings(max_examples=40, deadline=None)
@given(
    drafter=st.sampled_from(["none", "eagle3", "ngram"]),
    batch=st.integers(1, 64),
    seed=st.integers(0, 2**16),
    clock=st.sampled_from(CLOCKS),
)
def test_time_passes_per_pass_clocks_and_taken_passes_are_the_plain_formula(
    drafter, batch, seed, clock
) -> None:
    passes = round_passes(drafter, batch, 2000, 1, seed)
    physics.time_passes(H100, passes, clock)  # keeps the terms, which `take` carries along
    rng = np.random.default_rng(seed)
    clocks = rng.choice(CLOCKS, size=len(passes)).astype(float)
    same(physics.time_passes(H100, passes, clocks), reference_time_passes(H100, passes, clocks))
    order = rng.permutation(len(passes))[: max(1, len(passes) // 2)]
    taken = passes.take(order)
    same(physics.time_passes(H100, taken, clock), reference_time_passes(H100, taken, clock))
    # the same passes on another GPU: that GPU's terms, not the first one's
    same(physics.time_passes(H200, taken, clock), reference_time_passes(H200, taken, clock))


def test_a_power_capped_round_is_the_bisection_of_the_plain_formula() -> None:
    passes = round_passes("eagle3", 64, 4000, 1, 7)
    limit = float(np.median(reference_time_passes(H100, passes, CLOCKS[-1]).power_w))
    point = physics.operating_point(H100, passes, CLOCKS[-1], limit)
    assert point.power_capped
    clocks = point.timing.pass_clocks_mhz
    same(point.timing, reference_time_passes(H100, passes, clocks))
    # every pass at the highest clock whose plain-formula power fits (or the lowest)
    for i in range(len(passes)):
        one = passes.take(np.array([i]))
        fits = [c for c in CLOCKS if reference_time_passes(H100, one, c).power_w[0] <= limit]
        assert clocks[i] == (max(fits) if fits else CLOCKS[0])


def reference_work_segments(th, t0_c, dynamic_w, duration_s, idle_w):
    """`thermal.work_segments` and `start_temperatures` (one block) as plain expressions."""
    n = len(dynamic_w)
    dynamic = np.concatenate([dynamic_w, [idle_w]])
    steady = th.steady_c(dynamic)
    k = th.leakage_w_per_c
    settled = dynamic + k * (steady - th.reference_c)
    tau = th.tau_s
    x = duration_s / tau
    cum = np.concatenate([[0.0], np.cumsum(x)])
    terms = steady[:n] * np.exp(cum[:-1]) * np.expm1(x)
    start_c = np.concatenate([[t0_c], np.exp(-cum[1:]) * (t0_c + np.cumsum(terms))])
    per_pass = settled[:n] * duration_s + k * (start_c[:n] - steady[:n]) * tau * -np.expm1(
        -duration_s / tau
    )
    return steady, settled, start_c, np.concatenate([[0.0], np.cumsum(per_pass)])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400),
    seed=st.integers(0, 2**16),
    t0_c=st.floats(20.0, 90.0),
    profile=st.sampled_from([H100, H200]),
)
def test_thermal_segments_are_the_plain_formula_to_the_bit(n, seed, t0_c, profile) -> None:
    th = thermal_of(profile)
    assert th.tau_s > 0 and th.leakage_w_per_c > 0  # the branch a sweep takes
    rng = np.random.default_rng(seed)
    dynamic_w = rng.uniform(80.0, 700.0, size=n)
    duration_s = rng.integers(1_000, 80_000_000, size=n) * 1e-9
    idle_w = float(rng.uniform(60.0, 120.0))
    got = thermal.work_segments(th, t0_c, dynamic_w, duration_s, idle_w)
    want = reference_work_segments(th, t0_c, dynamic_w, duration_s, idle_w)
    for g, w in zip(got, want, strict=True):
        assert g.tobytes() == w.tobytes()
    alone = thermal.start_temperatures(th, t0_c, dynamic_w, duration_s)
    assert alone.tobytes() == want[2].tobytes()
    a, b = thermal.relaxation(th, t0_c, idle_w)
    steady = float(th.steady_c(idle_w))
    assert a == float(idle_w + th.leakage_w_per_c * (steady - th.reference_c))
    assert b == float(th.leakage_w_per_c * (t0_c - steady))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    seed=st.integers(0, 2**16),
    profile=st.sampled_from([H100, H200]),
    off_table=st.booleans(),
)
def test_clock_factors_looked_up_per_pass_are_the_array_arithmetic(
    n, seed, profile, off_table
) -> None:
    """Bandwidth and dynamic-power scale per pass, from the per-GPU table of supported clocks,
    are what the array arithmetic gives on the passes' own clocks (any length, any order);
    a clock off the table is computed."""
    rng = np.random.default_rng(seed)
    clocks = rng.choice(np.array(profile.supported_sm_clocks_mhz(), dtype=float), size=n)
    if off_table:
        clocks[rng.integers(n)] += 0.5
    bandwidth, scale = physics._clocks_factors(profile, clocks)
    assert bandwidth.tobytes() == physics.bandwidth_bytes_s(profile, clocks).tobytes()
    assert scale.tobytes() == physics.dynamic_scale(profile, clocks).tobytes()


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 300),
    seed=st.integers(0, 2**16),
    magnitude=st.floats(1e-9, 1e12),
    negative=st.booleans(),
    whole=st.integers(-(2**40), 2**40).filter(lambda v: v != 0),
)
def test_a_0d_array_operand_gives_the_python_scalars_bits(
    n, seed, magnitude, negative, whole
) -> None:
    """`scalars.zero_d`: each ufunc the twin calls with a scalar gives the same bits with the
    scalar as a 0-d array of the dtype beside it (float64 beside float64, int64 beside int64),
    and -x / t is x / -t (what `Timeline._truth` and `_energy_since` divide by)."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1e6, 1e6, size=n) * 10.0 ** rng.integers(-12, 12, size=n)
    t = rng.integers(-(2**50), 2**50, size=n, dtype=np.int64)
    scalar = -magnitude if negative else magnitude
    (f,) = scalars.zero_d(scalar)
    (i,) = scalars.zero_d(whole, dtype=np.int64)
    assert not f.flags.writeable and f.shape == () and f.dtype == np.float64
    floats = [np.add, np.subtract, np.multiply, np.divide, np.maximum]
    for ufunc in floats:
        assert ufunc(x, f).tobytes() == ufunc(x, scalar).tobytes(), ufunc
        assert ufunc(f, x).tobytes() == ufunc(scalar, x).tobytes(), ufunc
    positive = np.abs(x)
    for p in (4.0, 0.25):
        (p_0d,) = scalars.zero_d(p)
        assert np.power(positive, p_0d).tobytes() == np.power(positive, p).tobytes()
    for ufunc in (np.subtract, np.floor_divide, np.maximum, np.minimum):
        assert ufunc(t, i).tobytes() == ufunc(t, whole).tobytes(), ufunc
    assert np.multiply(t, f).tobytes() == np.multiply(t, scalar).tobytes()
    busy = x > 0
    assert np.where(busy, t, i).tobytes() == np.where(busy, t, whole).tobytes()
    assert np.divide(x, -f).tobytes() == (-x / scalar).tobytes()
