"""Known answers and monotonicity for the headroom search."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cubes import make_cube
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.analysis.headroom import headroom
from dvfs.analysis.targets import Target, parse_slack, parse_slo
from dvfs.errors import AnalysisError

CLOCKS = [1000, 1500, 2000]
TPOT = {1000: 12.0, 1500: 10.5, 2000: 10.0}
ENERGY = {1000: 0.8, 1500: 0.7, 2000: 1.0}


def simple(**kwargs):
    base = dict(clocks=CLOCKS, latency=lambda c, *_: TPOT[c], energy=lambda c, *_: ENERGY[c])
    base.update(kwargs)
    return make_cube(**base)


def row(result, **sel):
    point = result.sel(batch=1, drafter="none", corpus="code", **sel)
    return {k: float(point[k]) for k in point.data_vars}


def test_zero_slack_keeps_stock() -> None:
    r = row(headroom(simple(), target=Target("preserve")))
    assert r["feasible"] == 1
    assert r["chosen_sm_clock"] == 2000 and r["headroom_mhz"] == 0 and r["saving"] == 0


def test_slack_opens_headroom_and_picks_the_least_energy() -> None:
    r = row(headroom(simple(), target=Target("preserve", slack=0.10)))
    assert r["chosen_sm_clock"] == 1500
    assert r["headroom_mhz"] == 500
    assert r["saving"] == pytest.approx(0.3)
    assert r["chosen_latency_ms"] == 10.5 and r["target_ms"] == pytest.approx(11.0)


def test_headroom_and_chosen_setting_can_differ() -> None:
    # 25%: every clock is feasible; 1000 MHz is the headroom, but 1500 MHz costs least energy.
    r = row(headroom(simple(), target=Target("preserve", slack=0.25)))
    assert r["lowest_feasible_sm_clock"] == 1000 and r["headroom_mhz"] == 1000
    assert r["chosen_sm_clock"] == 1500 and r["chosen_headroom_mhz"] == 500


def test_ties_go_to_the_least_intrusive_setting() -> None:
    # 0.70001 and 0.7 agree to 4 significant digits: a tie, whatever the last digits say.
    cube = simple(energy=lambda c, *_: {2000: 0.70001, 1500: 0.7, 1000: 0.9}[c])
    r = row(headroom(cube, target=Target("preserve", slack=0.10)))
    assert r["chosen_sm_clock"] == 2000  # same energy as 1500, closer to stock
    r = row(
        headroom(
            make_cube(
                clocks=CLOCKS, limits=[300.0, 700.0], latency=lambda *a: 10.0, energy=lambda *a: 0.5
            ),
            target=Target("preserve"),
        )
    )
    assert (r["chosen_sm_clock"], r["chosen_power_limit"]) == (2000, 700.0)


def test_nan_cells_are_skipped_not_zero() -> None:
    cube = simple(energy=lambda c, *_: math.nan if c == 1500 else ENERGY[c])
    r = row(headroom(cube, target=Target("preserve", slack=0.25)))
    assert r["chosen_sm_clock"] == 1000  # 1500 is missing; 1000 is the cheapest left
    assert r["feasible_settings"] == 2


def test_no_feasible_setting_says_so() -> None:
    r = row(headroom(simple(), target=parse_slo("tpot_p50<=5ms")))
    assert r["feasible"] == 0 and r["feasible_settings"] == 0
    assert math.isnan(r["chosen_sm_clock"]) and math.isnan(r["saving"])
    assert r["target_ms"] == 5


def test_invalid_cells_are_never_chosen() -> None:
    cube = simple(valid=lambda c, *_: c != 1500)
    r = row(headroom(cube, target=Target("preserve", slack=0.25)))
    assert r["chosen_sm_clock"] == 1000
    # One invalid repeat disqualifies its setting even when another repeat is valid.
    cube = simple(repeats=2, valid=lambda c, p, b, d, k, rep: not (c == 1500 and rep == 1))
    r = row(headroom(cube, target=Target("preserve", slack=0.25)))
    assert r["chosen_sm_clock"] == 1000


def test_slo_target() -> None:
    r = row(headroom(simple(), target=parse_slo("tpot_p90<=11ms")))
    assert r["chosen_sm_clock"] == 1500 and r["lowest_feasible_sm_clock"] == 1500


def test_vs_baseline_trades_speculation_latency_for_energy() -> None:
    lat = {
        ("none", 1000): 12.0,
        ("none", 1500): 10.5,
        ("none", 2000): 10.0,
        ("eagle3", 1000): 9.0,
        ("eagle3", 1500): 6.0,
        ("eagle3", 2000): 5.0,
    }
    en = {
        ("none", 1000): 0.8,
        ("none", 1500): 0.7,
        ("none", 2000): 1.0,
        ("eagle3", 1000): 0.5,
        ("eagle3", 1500): 0.6,
        ("eagle3", 2000): 0.9,
    }
    cube = make_cube(
        clocks=CLOCKS,
        drafters=["none", "eagle3"],
        latency=lambda c, p, b, d, *_: lat[(d, c)],
        energy=lambda c, p, b, d, *_: en[(d, c)],
    )
    result = headroom(cube, target=Target("vs-baseline"))
    eagle = result.sel(batch=1, corpus="code", drafter="eagle3")
    assert int(eagle["chosen_sm_clock"]) == 1000  # 9 ms still beats none's stock 10 ms
    assert float(eagle["saving"]) == pytest.approx(1 - 0.5 / 0.9)
    assert float(eagle["saving_vs_baseline"]) == pytest.approx(1 - 0.5 / 1.0)
    preserve = headroom(cube, target=Target("preserve")).sel(
        batch=1, corpus="code", drafter="eagle3"
    )
    assert int(preserve["chosen_sm_clock"]) == 2000


def test_repeats_require_the_upper_bound_to_meet_the_target() -> None:
    # At 1500 MHz the mean ratio is 1.04 (target 1.05) but the repeats scatter widely.
    noisy = {0: 9.8, 1: 11.0, 2: 10.4}

    def latency(c, p, b, d, k, rep):
        return noisy[rep] if c == 1500 else TPOT[c]

    cube = simple(repeats=3, latency=latency)
    result = headroom(cube, target=Target("preserve", slack=0.05))
    assert int(result.sel(batch=1, drafter="none", corpus="code")["chosen_sm_clock"]) == 2000
    assert "Student-t upper bound over 3 paired repeat" in result.attrs["bound"]
    one = headroom(
        simple(latency=lambda c, *_: 10.4 if c == 1500 else TPOT[c]),
        target=Target("preserve", slack=0.05),
    )
    assert int(one.sel(batch=1, drafter="none", corpus="code")["chosen_sm_clock"]) == 1500
    assert "no interval" in one.attrs["bound"]


def test_knob_restriction() -> None:
    cube = make_cube(
        clocks=CLOCKS,
        limits=[300.0, 700.0],
        latency=lambda c, p, *_: TPOT[c] * (1.02 if p == 300 else 1.0),
        energy=lambda c, p, *_: ENERGY[c] * (0.9 if p == 300 else 1.0),
    )
    target = Target("preserve", slack=0.10)
    both = row(headroom(cube, target=target, knob="both"))
    assert (both["chosen_sm_clock"], both["chosen_power_limit"]) == (1500, 300.0)
    clock_only = row(headroom(cube, target=target, knob="sm_clock"))
    assert (clock_only["chosen_sm_clock"], clock_only["chosen_power_limit"]) == (1500, 700.0)
    power_only = row(headroom(cube, target=target, knob="power_limit"))
    assert (power_only["chosen_sm_clock"], power_only["chosen_power_limit"]) == (2000, 300.0)
    assert power_only["headroom_w"] == 400


def test_bad_requests_are_clear() -> None:
    with pytest.raises(AnalysisError, match="baseline drafter 'nope'"):
        headroom(simple(), target=Target("vs-baseline", baseline="nope"))
    with pytest.raises(AnalysisError, match="cannot read SLO"):
        parse_slo("latency<50")
    with pytest.raises(AnalysisError, match="unknown knob"):
        headroom(simple(), target=Target(), knob="voltage")
    assert parse_slo("ttft_p99<=1s").limit_ms == 1000
    assert parse_slack("5%") == parse_slack("0.05") == pytest.approx(0.05)
    with pytest.raises(AnalysisError, match="ambiguous: write 5% or a fraction such as 0.05"):
        parse_slack("5")


latencies = st.floats(1.0, 100.0, allow_nan=False)
energies = st.floats(0.01, 5.0, allow_nan=False)


@settings(max_examples=150, deadline=None)
@given(
    lat=st.lists(latencies, min_size=12, max_size=12),
    en=st.lists(energies, min_size=12, max_size=12),
    slack=st.floats(0.0, 0.5),
    extra=st.floats(0.0, 0.5),
    repeats=st.sampled_from([1, 2]),
    mode=st.sampled_from(["preserve", "slo"]),
)
def test_a_looser_target_never_gives_less_headroom_or_saving(lat, en, slack, extra, repeats, mode):
    clocks, limits = [900, 1200, 1500, 1980], [400.0, 550.0, 700.0]
    n = len(clocks) * len(limits)
    lat_a = np.array((lat * repeats)[: n * repeats]).reshape(len(clocks), len(limits), repeats)
    en_a = np.array((en * repeats)[: n * repeats]).reshape(len(clocks), len(limits), repeats)
    cube = make_cube(
        clocks=clocks,
        limits=limits,
        repeats=repeats,
        latency=lambda c, p, b, d, k, r: lat_a[clocks.index(c), limits.index(p), r],
        energy=lambda c, p, b, d, k, r: en_a[clocks.index(c), limits.index(p), r],
    )
    if mode == "slo":
        tight = Target("slo", limit_ms=10 + 100 * slack)
    else:
        tight = Target("preserve", slack=slack)
    loose = tight.loosened(1 + extra)
    a = row(headroom(cube, target=tight))
    b = row(headroom(cube, target=loose))
    assert b["feasible_settings"] >= a["feasible_settings"]
    if a["feasible"]:
        assert b["feasible"]
        assert b["headroom_mhz"] >= a["headroom_mhz"]
        assert b["headroom_w"] >= a["headroom_w"]
        # Energies equal to 4 significant digits are ties (broken towards stock), so the
        # chosen energy can only grow within that resolution.
        assert b["chosen_energy_per_token_j"] <= a["chosen_energy_per_token_j"] * (1 + 1e-3)
        assert b["saving"] >= a["saving"] - 1e-3


def test_missing_repeats_never_loosen_the_test() -> None:
    ratios = {0: 0.99, 1: 1.00, 2: 0.995}

    def latency(c, p, b, d, k, rep):
        return 10.0 * (ratios[rep] if c == 1500 else 1.0) if c != 1000 else 20.0

    full = simple(repeats=3, latency=latency)
    assert row(headroom(full, target=Target("preserve")))["chosen_sm_clock"] == 2000
    # The same cube with repeats 1 and 2 of 1500 MHz failed: one repeat left is not enough.
    gone = simple(
        repeats=3,
        latency=lambda c, p, b, d, k, rep: (
            math.nan if c == 1500 and rep > 0 else latency(c, p, b, d, k, rep)
        ),
    )
    r = row(headroom(gone, target=Target("preserve")))
    assert r["chosen_sm_clock"] == 2000 and r["feasible_settings"] == 1


def test_vs_baseline_bound_is_unpaired_and_conservative() -> None:
    from dvfs.analysis.headroom import t_quantile

    base = {0: 10.0, 1: 10.2, 2: 9.8}
    eagle = {
        (2000, 0): 5.0,
        (2000, 1): 5.1,
        (2000, 2): 4.9,
        (1500, 0): 8.8,
        (1500, 1): 9.0,
        (1500, 2): 8.9,
    }

    def latency(c, p, b, d, k, r):
        return base[r] if d == "none" else eagle[(c, r)]

    cube = make_cube(
        clocks=[1500, 2000],
        drafters=["none", "eagle3"],
        repeats=3,
        latency=latency,
        energy=lambda c, *_: 0.5 if c == 1500 else 1.0,
    )
    result = headroom(cube, target=Target("vs-baseline"))
    r = result.sel(batch=1, corpus="code", drafter="eagle3")
    t = t_quantile(0.975, 2)
    expected = (8.9 + t * 0.1 / 3**0.5) / (10.0 - t * 0.2 / 3**0.5)
    assert int(r["chosen_sm_clock"]) == 1500
    assert float(r["latency_bound"]) == pytest.approx(expected)
    assert "unpaired" in result.attrs["bound"]
    # A noisy baseline: every repeat's ratio is 0.9, but the means' bounds do not pair up.
    noisy = {0: 10.0, 1: 12.0, 2: 8.0}
    cube = make_cube(
        clocks=[1500, 2000],
        drafters=["none", "eagle3"],
        repeats=3,
        latency=lambda c, p, b, d, k, r: noisy[r] * (1.0 if d == "none" else 0.9),
        energy=lambda c, *_: 0.5 if c == 1500 else 1.0,
    )
    r = headroom(cube, target=Target("vs-baseline")).sel(batch=1, corpus="code", drafter="eagle3")
    assert not bool(r["feasible"])


def test_energy_ties_are_relative() -> None:
    cube = simple(energy=lambda c, *_: {2000: 0.123451, 1500: 0.123449, 1000: 0.9}[c])
    assert row(headroom(cube, target=Target("preserve", slack=0.10)))["chosen_sm_clock"] == 2000
    cube = simple(energy=lambda c, *_: {2000: 0.12354, 1500: 0.12345, 1000: 0.9}[c])
    assert row(headroom(cube, target=Target("preserve", slack=0.10)))["chosen_sm_clock"] == 1500


def test_merged_cubes_use_each_gpus_own_stock() -> None:
    import json

    from dvfs.cube import merge_cubes

    a = make_cube(
        clocks=CLOCKS,
        limits=[600.0, 700.0],
        latency=lambda c, *_: TPOT[c],
        energy=lambda c, *_: ENERGY[c],
    )
    b = make_cube(
        clocks=CLOCKS,
        limits=[600.0, 650.0],
        latency=lambda c, *_: TPOT[c],
        energy=lambda c, *_: ENERGY[c],
    )
    for ds, uuid in ((a, "GPU-a"), (b, "GPU-b")):
        ds.attrs.update(
            gpu_uuids=uuid,
            model="m",
            engine_backend="twin",
            tp_size=1,
            measurement_method="x",
            gpu_name=uuid,
        )
    merged = merge_cubes([a, b])
    assert json.loads(merged.attrs["merged_from"])["GPU-b"]["stock_power_limit_w"] == "650.0"
    result = headroom(merged, target=Target("preserve", slack=0.10))
    for gpu in ("GPU-a", "GPU-b"):
        r = result.sel(gpu=gpu, batch=1, drafter="none", corpus="code")
        assert bool(r["feasible"]) and int(r["chosen_sm_clock"]) == 1500
