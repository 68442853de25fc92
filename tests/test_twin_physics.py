"""The twin's physics: the properties DESIGN.md promises, checked over many inputs."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.clock import VirtualClock
from dvfs.gpu.base import EVENT_GPU_IDLE, EVENT_SW_POWER_CAP
from dvfs.gpu.twin import TwinGpu
from dvfs.twin import physics, traps
from dvfs.twin.device import TwinDevice, TwinNode
from dvfs.twin.drafting import draws
from dvfs.twin.passes import PassBuilder
from dvfs.twin.profiles import (
    accept_probability,
    expected_accept_length,
    gpu_profile,
    model_profile,
)

H100 = gpu_profile("h100-sxm")
#: The same GPU without NVML's traps: an exact energy counter, history-free temperature, knobs
#: that take effect at once (tests/test_twin_traps.py covers the traps).
EXACT_H100 = traps.without(H100)
H200 = gpu_profile("h200-sxm")
LLAMA8B = model_profile("llama-3.1-8b")
CLOCKS = list(H100.supported_sm_clocks_mhz())


def decode_passes(batch: int, context: int = 600, width: int = 1, tp: int = 1) -> physics.Passes:
    """One decode (or verify) forward pass of Llama-3.1-8B over `batch` x `width` tokens."""
    builder = PassBuilder(tp)
    tokens = np.array([float(batch * width)])
    kv = LLAMA8B.kv_bytes_read(np.array([float(context)])) * batch
    attn = LLAMA8B.attention_flops_per_token(np.array([float(context)])) * tokens
    builder.add(LLAMA8B, tokens, kv, attn, tokens)
    return builder.parts[0]


@settings(max_examples=200, deadline=None)
@given(
    batch=st.integers(1, 512),
    width=st.integers(1, 16),
    context=st.integers(1, 32768),
    clocks=st.lists(st.sampled_from(CLOCKS), min_size=2, max_size=2, unique=True),
    profile=st.sampled_from([H100, H200]),
)
def test_a_lower_clock_never_speeds_up_a_pass(batch, width, context, clocks, profile) -> None:
    low, high = sorted(clocks)
    passes = decode_passes(batch, context, width)
    t_low = physics.time_passes(profile, passes, low).duration_s[0]
    t_high = physics.time_passes(profile, passes, high).duration_s[0]
    assert t_low >= t_high


@settings(max_examples=100, deadline=None)
@given(batch=st.integers(1, 256), clock=st.sampled_from(CLOCKS))
def test_power_stays_between_idle_and_a_physical_ceiling(batch, clock) -> None:
    timing = physics.time_passes(H100, decode_passes(batch), clock)
    assert (
        H100.idle_power_w
        <= timing.power_w[0]
        <= H100.idle_power_w + (H100.sm_active_power_w + H100.tensor_power_w + H100.memory_power_w)
    )


def test_memory_bound_decode_barely_slows_while_compute_bound_prefill_scales() -> None:
    decode = decode_passes(batch=1)
    prefill = decode_passes(batch=8192, context=1)  # 8192 new tokens: far past the ridge point
    ratio_decode = (
        physics.time_passes(H100, decode, 1200).duration_s[0]
        / physics.time_passes(H100, decode, 1980).duration_s[0]
    )
    ratio_prefill = (
        physics.time_passes(H100, prefill, 1200).duration_s[0]
        / physics.time_passes(H100, prefill, 1980).duration_s[0]
    )
    assert ratio_decode < 1.10  # memory-bound: < 10% slower at 61% of the clock
    assert ratio_prefill > 1.5  # compute-bound: close to 1980/1200 = 1.65
    # ... and the memory-bound pass costs less energy at the lower clock.
    assert (
        physics.time_passes(H100, decode, 1200).energy_j
        < physics.time_passes(H100, decode, 1980).energy_j
    )


def test_ridge_point_matches_the_datasheet() -> None:
    # 989.4 TFLOPS at 1830 MHz over 3.35 TB/s (H100) and 4.8 TB/s (H200): DESIGN.md's 295 / 206.
    assert H100.ridge_point(1830) == pytest.approx(295, abs=1)
    assert H200.ridge_point(1830) == pytest.approx(206, abs=1)
    assert H100.ridge_point(1005) < H100.ridge_point(1980)


def test_energy_counter_integrates_power() -> None:
    clock = VirtualClock()
    device = TwinDevice(EXACT_H100, clock)
    gpu = TwinGpu(device)
    passes = physics.Passes.concat([decode_passes(b) for b in (1, 16, 64, 2048, 3)])
    start_mj = gpu.energy_mj()
    point = TwinNode([device]).execute(passes)
    # Sample power on a fine grid through the Gpu protocol and integrate it numerically.
    dt_s = 1e-5
    integral_j = 0.0
    end_ns = clock.now_ns() + round(point.timing.total_s * 1e9)
    while clock.now_ns() < end_ns:
        integral_j += gpu.power_mw() / 1000 * dt_s
        clock.sleep(dt_s)
    measured_j = (gpu.energy_mj() - start_mj) / 1000
    assert measured_j == pytest.approx(integral_j, rel=0.01)
    assert measured_j == pytest.approx(point.timing.energy_j, rel=0.001)
    # After the work, the device idles at idle power.
    before = device.energy_j()
    clock.sleep(2.0)
    assert device.energy_j() - before == pytest.approx(2.0 * H100.idle_power_w)
    assert gpu.clock_event_reasons() == EVENT_GPU_IDLE


@settings(max_examples=50, deadline=None)
@given(steps=st.lists(st.floats(0.0, 0.5), min_size=1, max_size=30))
def test_energy_counter_is_monotone(steps) -> None:
    clock = VirtualClock()
    device = TwinDevice(H100, clock)
    gpu = TwinGpu(device)
    TwinNode([device]).execute(physics.Passes.concat([decode_passes(64)] * 50))
    last = gpu.energy_mj()
    for step in steps:
        clock.sleep(step)
        now = gpu.energy_mj()
        assert now >= last
        last = now


def test_a_power_limit_below_the_draw_lowers_the_clock_and_sets_swpowercap() -> None:
    clock = VirtualClock()
    device = TwinDevice(H100, clock)
    gpu = TwinGpu(device)
    heavy = decode_passes(batch=4096)  # compute-bound: draws well above 300 W at 1980 MHz
    free = TwinNode([device]).plan(heavy)
    assert free.timing.mean_power_w > 300 and free.sm_clock_mhz == 1980 and not free.power_capped
    gpu.set_power_limit_mw(300_000)
    clock.sleep(H100.settle_time_s)  # the new limit has taken effect
    point = TwinNode([device]).execute(heavy)
    assert point.power_capped
    assert point.sm_clock_mhz < 1980
    assert point.timing.mean_power_w <= 300
    clock.sleep(point.timing.total_s / 2)
    assert gpu.sm_clock_mhz() == point.sm_clock_mhz
    assert gpu.clock_event_reasons() & EVENT_SW_POWER_CAP
    # One step up would no longer fit: the limit picks the highest clock that does.
    higher = physics.time_passes(H100, heavy, point.sm_clock_mhz + H100.sm_clock_step_mhz)
    assert higher.mean_power_w > 300


def test_a_limit_above_the_draw_changes_nothing() -> None:
    device = TwinDevice(H100, VirtualClock())
    TwinGpu(device).set_power_limit_mw(400_000)
    light = decode_passes(batch=1)
    point = TwinNode([device]).plan(light)
    assert point.sm_clock_mhz == 1980 and not point.power_capped


@settings(max_examples=200, deadline=None)
@given(tau=st.floats(1.01, 15.0), depth=st.integers(1, 15))
def test_accept_probability_inverts_the_expected_length(tau, depth) -> None:
    tau = min(tau, depth + 1 - 1e-6)
    alpha = accept_probability(tau, depth)
    assert 0.0 <= alpha <= 1.0
    assert expected_accept_length(alpha, depth) == pytest.approx(tau, rel=1e-6)


def test_model_shapes_match_published_sizes() -> None:
    assert LLAMA8B.total_params == pytest.approx(8.03e9, rel=0.01)  # M1
    assert LLAMA8B.kv_bytes_per_token == 128 * 1024  # 128 KiB/token (INF)
    assert model_profile("llama-3.2-1b").total_params == pytest.approx(1.24e9, rel=0.01)
    lite = model_profile("deepseek-v2-lite")
    assert lite.total_params == pytest.approx(16e9, rel=0.05)  # 16B total
    assert lite.active_matmul_params == pytest.approx(2.4e9, rel=0.05)  # 2.4B active


def test_each_phase_settles_at_its_own_clock_under_a_limit() -> None:
    """A compute-heavy prefill is capped; the memory-bound decode after it is not."""
    clock = VirtualClock()
    device = TwinDevice(H100, clock)
    gpu = TwinGpu(device)
    gpu.set_power_limit_mw(400_000)
    clock.sleep(H100.settle_time_s)  # the new limit has taken effect
    prefill = decode_passes(batch=8192, context=1)
    decode = physics.Passes.concat([decode_passes(1)] * 200)
    schedule = TwinNode([device]).execute(prefill, decode)
    first, second = schedule.points
    assert first.power_capped and first.sm_clock_mhz < 1980
    assert not second.power_capped and second.sm_clock_mhz == 1980
    clock.sleep(first.timing.total_s / 2)
    assert gpu.clock_event_reasons() & EVENT_SW_POWER_CAP
    clock.sleep(first.timing.total_s / 2 + second.timing.total_s / 2)
    assert gpu.sm_clock_mhz() == 1980 and not gpu.clock_event_reasons() & EVENT_SW_POWER_CAP


def test_the_draws_are_truncated_geometric() -> None:
    rng = np.random.default_rng(0)
    drawn = draws(rng, (20000,), 0.6, 4)
    assert drawn.min() == 1 and drawn.max() == 5
    expected = sum(0.6**k for k in range(5))  # 1 + sum of P(accepted >= k), k = 1..4
    assert math.isclose(drawn.mean(), expected, rel_tol=0.02)
    assert np.array_equal(draws(rng, (3,), 0.0, 4), [1, 1, 1])
    assert np.array_equal(draws(rng, (3,), 1.0, 4), [5, 5, 5])


def test_every_source_key_in_the_twins_data_is_listed_in_the_readme() -> None:
    """The data files cite sources by key (G5, M1, A1, ...); the README's "Twin profiles"
    table is where a reader resolves them, so a key cited there and missing here is a number
    without a source."""
    root = Path(__file__).resolve().parent.parent
    cited = set()
    for path in [
        *(root / "dvfs" / "twin" / "data").glob("*.toml"),
        *(root / "dvfs" / "twin").glob("*.py"),
        root / "dvfs" / "engines" / "twin.py",
        root / "dvfs" / "gpu" / "twin.py",
    ]:
        cited |= set(re.findall(r"\b([GPMDA][0-9]{1,2})\b", path.read_text()))
    readme = (root / "README.md").read_text()
    table = readme.split("**Twin profiles.**", 1)[1].split("**Which twin.**", 1)[0]
    listed = set()
    for row in re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE):
        for part in row.split(","):
            m = re.fullmatch(r"\s*([A-Z])([0-9]+)(?:-[A-Z]([0-9]+))?\s*", part)
            if m:
                last = int(m.group(3) or m.group(2))
                listed |= {f"{m.group(1)}{i}" for i in range(int(m.group(2)), last + 1)}
    assert cited, "no source keys found: the pattern no longer matches the data files"
    assert sorted(cited - listed) == []


def test_the_decode_power_gpus_toml_states_is_the_twins() -> None:
    """gpus.toml says what batch-1 decode of Llama-3.1-8B at the H100's top clock draws, the
    figure sm_active_power_w is set by: it said ~200 W where the twin drew 236 W."""
    text = (Path(__file__).resolve().parent.parent / "dvfs/twin/data/gpus.toml").read_text()
    h100 = text.split("[h100-sxm]", 1)[1].split("\n[", 1)[0]
    [line] = [x for x in h100.splitlines() if x.startswith("sm_active_power_w")]
    said = re.search(r"decode .* draws ~(\d+) W", line)
    assert said is not None, "the comment no longer says it"
    drawn = physics.time_passes(H100, decode_passes(1), H100.max_sm_clock_mhz).power_w[0]
    assert round(drawn) == float(said.group(1)), (drawn, line)


def test_the_twins_roofline_is_the_one_the_readme_states() -> None:
    """README ("Measure the GPU itself"): `dvfs gpu roofline --twin h100-sxm` at 1980 / 1500 /
    1200 / 900 MHz; at 1980 MHz the largest GEMM (738 W) is held at 1920 MHz by 700 W."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    result = CliRunner().invoke(
        cli, ["gpu", "roofline", "--twin", "h100-sxm", "--clocks", "1500,1200,900", "--json"]
    )
    assert result.exit_code == 0, result.output
    points = json.loads(result.output)["settings"]
    assert [p["setting"] for p in points] == ["stock", "1500", "1200", "900"]
    stated = {
        "peak_flop_s": ([827, 646, 517, 388], 1e12, 0.5),
        "bandwidth_bytes_s": ([2.85, 2.80, 2.71, 2.48], 1e12, 0.005),
        "ridge_point": ([291, 231, 191, 156], 1.0, 0.5),
        "j_per_flop": ([0.84, 0.67, 0.59, 0.58], 1e-12, 0.005),
    }
    for key, (values, unit, tol) in stated.items():
        got = [p[key] / unit for p in points]
        assert got == pytest.approx(values, abs=tol), key
    stock = points[0]["kernels"]
    best = max((k for k in stock if k["kind"] == "gemm"), key=lambda k: k["flop_s"])
    assert best["sm_clock_mhz"] == 1920
    assert best["power_w"] <= 700.0
    # the same GEMM unlimited at 1980 MHz (no host or per-layer overhead, as the roofline)
    bare = dataclasses.replace(EXACT_H100, host_overhead_s=0.0, kernel_cycles_per_layer=0.0)
    one = np.ones(1)
    passes = physics.Passes(
        best["flop_s"] * best["seconds"] * one,
        best["bytes_s"] * best["seconds"] * one,
        0 * one,
        0 * one,
        0 * one,
        tokens=best["m"] * one,
    )
    assert physics.time_passes(bare, passes, 1980).power_w[0] == pytest.approx(738, abs=1)


def test_a_pass_with_no_work_and_no_host_time_draws_idle_power() -> None:
    """An n-gram drafter's draft step launches no kernel: on a profile whose host_overhead_s is
    0 (a hand-edited or fitted one; the cube fit's bound is 0) it takes no time. It draws idle
    power, not 0/0: a NaN there stalled the cell's energy counter, and `dvfs twin predict`
    flagged every n-gram and DFlash cell counter_stalled (invalid)."""
    bare = dataclasses.replace(EXACT_H100, host_overhead_s=0.0)
    builder = PassBuilder(1)
    builder.add_host(2)
    builder.parts.append(decode_passes(4))
    passes = physics.Passes.concat(builder.parts)
    for clock in (1980, np.array([1980.0, 1500.0, 1005.0])):
        timing = physics.time_passes(bare, passes, clock)
        assert timing.duration_s[:2].tolist() == [0.0, 0.0]
        assert timing.duration_s[2] > 0
        assert np.isfinite(timing.power_w).all()
        assert timing.power_w[:2].tolist() == [bare.idle_power_w] * 2
        assert timing.tensor_util[:2].tolist() == [0.0, 0.0]
        assert timing.memory_util[:2].tolist() == [0.0, 0.0]
    # a timing remembered at a requested clock works its utilisations out again the same way
    for _ in range(2):
        again = physics._requested_timing(bare, passes, 1980.0)
        assert again.power_w[:2].tolist() == [bare.idle_power_w] * 2
        assert again.tensor_util[:2].tolist() == again.memory_util[:2].tolist() == [0.0, 0.0]
