"""Known answers and monotonicity for the headroom search."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pytest
from cubes import make_cube
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.analysis.headroom import headroom
from dvfs.analysis.targets import Target, parse_slack, parse_slo
from dvfs.errors import AnalysisError

if TYPE_CHECKING:
    import xarray as xr

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


def test_a_reference_measured_without_the_latency_says_so() -> None:
    """Valid stock cells that hold no TPOT (an edited or damaged cube): the row says which
    latency is missing and to rebuild the cube, not "invalid" with no flag to change (and
    `dvfs cube info` showing none)."""
    from dvfs.report.reasons import no_answer, no_answer_advice

    cube = simple(repeats=2)
    cube["tpot_ms"].loc[{"sm_clock": 2000}] = np.nan
    result = headroom(cube, target=Target("preserve", slack=0.1))
    point = result.sel(batch=1, drafter="none", corpus="code")
    problem = str(point["reference_problem"].values)
    assert problem == "no TPOT p50 in its cells", problem
    row = {"target_ms": None, "reference_problem": problem}
    assert no_answer(row) == "no valid reference cell (no TPOT p50 in its cells)"
    assert "dvfs cube build" in no_answer_advice(row), no_answer_advice(row)
    # an invalid stock cell (no flag recorded) is still "invalid"
    flagged = simple(repeats=2, valid=lambda c, *_: c != 2000, quality=lambda c, *_: 0)
    again = headroom(flagged, target=Target("preserve", slack=0.1))
    said = str(again.sel(batch=1, drafter="none", corpus="code")["reference_problem"].values)
    assert said == "invalid", said


def test_slo_target() -> None:
    r = row(headroom(simple(), target=parse_slo("tpot_p90<=11ms")))
    assert r["chosen_sm_clock"] == 1500 and r["lowest_feasible_sm_clock"] == 1500


def test_the_latency_bound_carries_the_unit_of_its_statistic() -> None:
    """Against an SLO the bound is a latency in ms (compared with the limit); against a
    drafter's stock a ratio to that latency (compared with 1 + slack): its units say which."""
    slo = headroom(simple(), target=parse_slo("tpot_p90<=11ms"))
    assert float(row(slo)["latency_bound"]) == TPOT[1500]
    assert slo["latency_bound"].attrs["units"] == "ms"
    kept = headroom(simple(), target=Target("preserve", slack=0.10))
    assert float(row(kept)["latency_bound"]) == pytest.approx(TPOT[1500] / TPOT[2000])
    assert kept["latency_bound"].attrs["units"] == "1"


def test_an_slo_bound_is_over_the_latencies_not_paired_ratios() -> None:
    """Against an SLO each repeat's latency is bounded as it is, paired with nothing: the
    bound's words said "over 2 paired repeat(s) of the latency (ms)"."""
    result = headroom(simple(repeats=2), target=parse_slo("tpot_p90<=11ms"))
    said = result.attrs["bound"]
    assert said == "one-sided 95% Student-t upper bound over 2 repeat(s) of the latency (ms)"
    kept = headroom(simple(repeats=2), target=Target("preserve", slack=0.10)).attrs["bound"]
    assert "over 2 paired repeat(s) of the latency ratio to the reference" in kept


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


#: Independent examples in one cube, one per batch size: a headroom search costs about the
#: same for one row as for a few (xarray's overhead), so each drawn cube checks ROWS rows.
ROWS = 3


def rows(result) -> list[dict]:
    points = [result.sel(batch=b, drafter="none", corpus="code") for b in range(1, ROWS + 1)]
    return [{k: float(point[k]) for k in point.data_vars} for point in points]


@settings(max_examples=25, deadline=None)  # x ROWS rows, two headroom searches each
@given(
    lat=st.lists(latencies, min_size=12 * ROWS, max_size=12 * ROWS),
    en=st.lists(energies, min_size=12 * ROWS, max_size=12 * ROWS),
    slack=st.floats(0.0, 0.5),
    extra=st.floats(0.0, 0.5),
    repeats=st.sampled_from([1, 2]),
    mode=st.sampled_from(["preserve", "slo"]),
)
def test_a_looser_target_never_gives_less_headroom_or_saving(lat, en, slack, extra, repeats, mode):
    clocks, limits = [900, 1200, 1500, 1980], [400.0, 550.0, 700.0]
    shape = (ROWS, len(clocks), len(limits), repeats)
    # Each row draws its own 12 values; repeats beyond the first reuse them in another order.
    lat_a = np.tile(np.array(lat).reshape(ROWS, 12), (1, repeats)).reshape(shape)
    en_a = np.tile(np.array(en).reshape(ROWS, 12), (1, repeats)).reshape(shape)
    cube = make_cube(
        clocks=clocks,
        limits=limits,
        batches=list(range(1, ROWS + 1)),
        repeats=repeats,
        latency=lambda c, p, b, d, k, r: lat_a[b - 1, clocks.index(c), limits.index(p), r],
        energy=lambda c, p, b, d, k, r: en_a[b - 1, clocks.index(c), limits.index(p), r],
    )
    if mode == "slo":
        tight = Target("slo", limit_ms=10 + 100 * slack)
    else:
        tight = Target("preserve", slack=slack)
    loose = tight.loosened(1 + extra)
    for a, b in zip(
        rows(headroom(cube, target=tight)), rows(headroom(cube, target=loose)), strict=True
    ):
        assert b["feasible_settings"] >= a["feasible_settings"]
        if a["feasible"]:
            assert b["feasible"]
            assert b["headroom_mhz"] >= a["headroom_mhz"]
            assert b["headroom_w"] >= a["headroom_w"]
            if a["saving_within_noise"]:
                # Kept only because nothing that saves beyond the noise (nor the reference) met
                # the tight target: a looser one may admit the reference, and its 0 saving.
                assert mode == "slo"
                continue
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
    from dvfs.analysis.bounds import t_quantile

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
            campaign=json.dumps({"name": "merged", "workload": {"batch": [1]}}),
        )
    merged = merge_cubes([a, b])
    assert json.loads(merged.attrs["merged_from"])["GPU-b"]["stock_power_limit_w"] == "650.0"
    result = headroom(merged, target=Target("preserve", slack=0.10))
    for gpu in ("GPU-a", "GPU-b"):
        r = result.sel(gpu=gpu, batch=1, drafter="none", corpus="code")
        assert bool(r["feasible"]) and int(r["chosen_sm_clock"]) == 1500


# --- Student-t bounds (issue 9) ---------------------------------------------------------------

# One-sided Student-t quantiles as printed in statistics tables (3 decimals).
T_TABLE = [
    (0.95, 1, 6.314),
    (0.95, 2, 2.920),
    (0.95, 3, 2.353),
    (0.95, 4, 2.132),
    (0.95, 10, 1.812),
    (0.95, 30, 1.697),
    (0.99, 1, 31.821),
    (0.99, 2, 6.965),
    (0.975, 2, 4.303),
]


@pytest.mark.parametrize(("confidence", "dof", "expected"), T_TABLE)
def test_t_quantile_matches_the_tables(confidence, dof, expected) -> None:
    from dvfs.analysis.bounds import t_quantile

    assert t_quantile(confidence, dof) == pytest.approx(expected, abs=6e-4)


def test_t_quantile_never_falls_back_to_an_approximation(monkeypatch) -> None:
    """Without scipy the old code returned 4.59 for t(0.95, 1): a silently narrow interval.
    A level scipy's table holds is still scipy's number; any other is refused."""
    import sys

    from dvfs.analysis.bounds import t_quantile

    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    assert t_quantile(0.95, 1) == 6.313751514675037
    with pytest.raises(AnalysisError, match="scipy"):
        t_quantile(0.9, 1)


def test_t_quantile_refuses_what_has_no_quantile() -> None:
    from dvfs.analysis.bounds import t_quantile

    for confidence, dof in ((math.nan, 2), (1.0, 2), (0.0, 2), (0.95, 0)):
        with pytest.raises(AnalysisError):
            t_quantile(confidence, dof)


def test_scipy_is_imported_only_when_a_bound_needs_it() -> None:
    import subprocess
    import sys

    code = "import sys, dvfs.analysis.headroom; print('scipy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_two_repeats_use_the_exact_t_quantile() -> None:
    # Ratios 1.00 and 1.04 at 1500 MHz: mean 1.02, sd 0.0283, t(0.95, 1) = 6.314 -> 1.146.
    # With the old expansion (t = 4.59) the bound was 1.112 and a 12% slack let it through.
    def latency(c, p, b, d, k, rep):
        return 10.0 * ({0: 1.00, 1: 1.04}[rep] if c == 1500 else 1.0) if c != 1000 else 99.0

    cube = simple(repeats=2, latency=latency)
    r = row(headroom(cube, target=Target("preserve", slack=0.12)))
    assert r["chosen_sm_clock"] == 2000
    r = row(headroom(cube, target=Target("preserve", slack=0.15)))
    assert r["chosen_sm_clock"] == 1500
    assert r["latency_bound"] == pytest.approx(1.02 + 6.3138 * 0.04 / math.sqrt(2) / math.sqrt(2))


finite_values = st.floats(1e-3, 1e3, allow_nan=False, allow_infinity=False)


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(finite_values, min_size=1, max_size=8),
    confidence=st.floats(0.5, 0.999),
)
def test_the_upper_bound_is_never_below_the_mean(values, confidence) -> None:
    from dvfs.analysis.bounds import upper_bound

    bound = upper_bound(np.array(values), confidence)
    assert bound >= math.fsum(values) / len(values)


def small_cube(lat, en, repeats, clocks=(900, 1500, 1980), limits=(400.0, 700.0)):
    """ROWS independent rows (batch sizes 1..ROWS), filled from `lat` and `en` in order."""
    clocks, limits = list(clocks), list(limits)
    shape = (ROWS, len(clocks), len(limits), repeats)
    lat_a = np.resize(np.array(lat), shape)
    en_a = np.resize(np.array(en), shape)
    return make_cube(
        clocks=clocks,
        limits=limits,
        batches=list(range(1, ROWS + 1)),
        repeats=repeats,
        latency=lambda c, p, b, d, k, r: lat_a[b - 1, clocks.index(c), limits.index(p), r],
        energy=lambda c, p, b, d, k, r: en_a[b - 1, clocks.index(c), limits.index(p), r],
    )


ANSWER = (
    "feasible",
    "feasible_settings",
    "chosen_sm_clock",
    "chosen_power_limit",
    "lowest_feasible_sm_clock",
    "lowest_feasible_power_limit",
    "headroom_mhz",
    "headroom_w",
)


def same_answers(first, second) -> None:
    for a, b in zip(rows(first), rows(second), strict=True):
        same_answer(a, b)


def same_answer(a: dict, b: dict) -> None:
    for key in ANSWER:
        assert (math.isnan(a[key]) and math.isnan(b[key])) or a[key] == b[key], key
    for key in ("chosen_energy_per_token_j", "saving"):
        assert (math.isnan(a[key]) and math.isnan(b[key])) or a[key] == pytest.approx(b[key])


@settings(max_examples=20, deadline=None)
@given(
    lat=st.lists(latencies, min_size=18 * ROWS, max_size=18 * ROWS),
    en=st.lists(energies, min_size=18 * ROWS, max_size=18 * ROWS),
    repeats=st.sampled_from([2, 3]),
    permutation=st.permutations([0, 1, 2]),
    slack=st.floats(0.0, 0.5),
    mode=st.sampled_from(["preserve", "slo"]),
)
def test_the_order_of_repeats_does_not_matter(lat, en, repeats, permutation, slack, mode) -> None:
    cube = small_cube(lat, en, repeats)
    order = [i for i in permutation if i < repeats]
    shuffled = cube.isel(repeat=order).assign_coords(repeat=list(range(repeats)))
    target = Target("slo", limit_ms=10 + 100 * slack) if mode == "slo" else Target(slack=slack)
    same_answers(headroom(cube, target=target), headroom(shuffled, target=target))


@settings(max_examples=20, deadline=None)
@given(
    lat=st.lists(latencies, min_size=12 * ROWS, max_size=12 * ROWS),
    en=st.lists(energies, min_size=12 * ROWS, max_size=12 * ROWS),
    repeats=st.sampled_from([1, 2]),
    scale=st.floats(1e-3, 1e3),
    slack=st.floats(0.0, 0.5),
)
def test_preserve_mode_does_not_depend_on_the_latency_unit(lat, en, repeats, scale, slack) -> None:
    cube = small_cube(lat, en, repeats)
    scaled = cube.copy(deep=True)
    for name in ("tpot_ms", "itl_ms", "ttft_ms"):
        scaled[name] = cube[name] * scale
    target = Target("preserve", slack=slack)
    same_answers(headroom(cube, target=target), headroom(scaled, target=target))


def test_preserve_mode_keeps_a_setting_exactly_on_the_target_under_scaling() -> None:
    # 12 / 10 is 1.2 = 1 + 20% in floating point; (12 x 0.1) / (10 x 0.1) is 1.2000000000000002.
    cube = simple(latency=lambda c, *_: {2000: 10.0, 1500: 12.0, 1000: 99.0}[c])
    scaled = cube.copy(deep=True)
    scaled["tpot_ms"] = cube["tpot_ms"] * 0.1
    for ds in (cube, scaled):
        assert row(headroom(ds, target=Target(slack=0.2)))["chosen_sm_clock"] == 1500


# --- SLO targets (issue 9) ------------------------------------------------------------------


def test_a_strict_slo_excludes_a_cell_exactly_on_the_limit() -> None:
    # TPOT at 1500 MHz is exactly 10.5 ms.
    inclusive = row(headroom(simple(), target=parse_slo("tpot_p90<=10.5ms")))
    assert inclusive["chosen_sm_clock"] == 1500 and inclusive["feasible_settings"] == 2
    strict = headroom(simple(), target=parse_slo("tpot_p90<10.5ms"))
    r = row(strict)
    assert r["chosen_sm_clock"] == 2000 and r["feasible_settings"] == 1
    assert strict.attrs["target"] == "TPOT p90 < 10.5 ms" and strict.attrs["strict"] == 1
    assert row(headroom(simple(), target=parse_slo("tpot_p90<10.6ms")))["chosen_sm_clock"] == 1500


def test_strictness_survives_loosening() -> None:
    loose = parse_slo("tpot_p90<10ms").loosened(1.5)
    assert loose.strict and loose.limit_ms == 15


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("tpot_p90<=", "no limit after <="),
        ("foo<=5ms", "unknown latency 'foo'"),
        ("tpot_p95<=5ms", "quantile 'p95' for tpot: use tpot_p50, tpot_p90 or tpot_p99"),
        ("itl<=8ms", "no quantile for itl: use itl_p50, itl_p90 or itl_p99"),
        ("ITL_<=8ms", "no quantile for itl: use itl_p50"),
        ("tpotp90<=8ms", "unknown latency 'tpotp90'"),
        ("tpot_p90<=-3ms", "positive, finite number, got -3"),
        ("tpot_p90<=0ms", "positive, finite number, got 0"),
        ("tpot_p90<=nanms", "positive, finite number, got nan"),
        ("tpot_p90<=infs", "positive, finite number, got inf"),
        ("tpot_p90<=5us", "unknown unit 'us'"),
        ("tpot_p90<=5", "the limit has no unit"),
        ("tpot_p90<=fastms", "cannot read the limit"),
        ("tpot_p90>=5ms", "must be <= or <, not '>='"),
        ("tpot_p90 5ms", "no <= or <"),
        ("", "no latency named"),
    ],
)
def test_malformed_slos_say_what_is_wrong_and_what_is_allowed(text, says) -> None:
    with pytest.raises(AnalysisError) as caught:
        parse_slo(text)
    message = str(caught.value)
    assert says in message and "\n" not in message
    assert "metrics tpot, itl, ttft; quantiles p50, p90, p99" in message and "ms or s" in message


@pytest.mark.parametrize("text", ["nan", "NaN%", "inf", "-inf", "1e309%", "-5%", "-0.01", "x"])
def test_slack_must_be_a_finite_non_negative_number(text) -> None:
    with pytest.raises(AnalysisError, match="slack"):
        parse_slack(text)


def test_targets_refuse_non_finite_numbers() -> None:
    with pytest.raises(AnalysisError, match="slack"):
        Target(slack=math.nan)
    with pytest.raises(AnalysisError, match="limit"):
        Target("slo", limit_ms=math.inf)


def test_vs_baseline_judges_the_baselines_own_rows_against_their_own_stock() -> None:
    """The baseline's stock is its own measurement, repeat by repeat: its rows pair, as in
    preserve mode, so it always meets its own stock latency (unpaired, the two intervals of
    one set of repeats would make it miss its own target)."""
    noisy = {0: 10.0, 1: 12.0, 2: 8.0}
    cube = make_cube(
        clocks=[1500, 2000],
        drafters=["none", "eagle3"],
        repeats=3,
        latency=lambda c, p, b, d, k, r: noisy[r] * (1.0 if c == 2000 else 1.02),
        energy=lambda c, *_: 0.5 if c == 1500 else 1.0,
    )
    for slack in (0.0, 0.05):
        against = headroom(cube, target=Target("vs-baseline", slack=slack))
        own = headroom(cube, target=Target("preserve", slack=slack))
        mine, same = (r.sel(batch=1, corpus="code", drafter="none") for r in (against, own))
        assert bool(mine["feasible"]) and int(mine["chosen_sm_clock"]) == (1500 if slack else 2000)
        for name in ("chosen_sm_clock", "latency_bound", "headroom_mhz", "saving"):
            assert float(mine[name]) == float(same[name]), name
        # eagle3, with the same latencies on another server, stays unpaired: too noisy here
        assert not bool(against.sel(batch=1, corpus="code", drafter="eagle3")["feasible"])


def test_a_row_without_an_answer_says_why() -> None:
    """No answer has causes a user fixes differently: no valid reference cell (sweep it
    again), repeats not measured yet (resume the sweep), too few usable repeats (add
    repeats), or every judged setting over target."""
    from dvfs.report.headroom import headroom_document, headroom_table_rows

    def table_text(cube, **target) -> str:
        result = headroom(cube, target=Target("preserve", **target))
        doc = headroom_document(result, cube)
        return " ".join(" ".join(map(str, row)) for row in headroom_table_rows(doc)[1])

    slow = {1000: 12.0, 2000: 10.0}
    over = make_cube(clocks=[1000, 2000], repeats=3, latency=lambda c, *_: slow[c])
    assert "none feasible" not in table_text(over)  # stock itself meets its own latency
    partial = make_cube(  # only repeat 0 measured so far
        clocks=[1000, 2000], repeats=3, latency=lambda c, *a: slow[c] if a[4] == 0 else math.nan
    )
    assert "not measured yet" in table_text(partial)
    short = partial.copy()  # measured, but two repeats' latency unusable
    short["cell_status"] = short["cell_status"] * 0 + 1
    short["valid"] = short["valid"].fillna(1)
    assert "too few repeats" in table_text(short)
    flagged = make_cube(  # one invalid repeat disqualifies a setting
        clocks=[1000, 2000], repeats=3, latency=lambda c, *_: slow[c], valid=lambda *a: a[5] == 0
    )
    assert "no valid cell" in table_text(flagged)
    no_ref = make_cube(
        clocks=[1000, 2000], repeats=3, latency=lambda c, *_: slow[c], valid=lambda c, *_: c != 2000
    )
    assert "no valid reference cell (invalid" in table_text(no_ref)


def test_a_setting_short_of_repeats_below_the_answer_leaves_it_a_lower_bound() -> None:
    """The lowest clock measured but left unjudged for want of usable repeats: the answer one
    step above it is a lower bound on the headroom (a setting below might still meet the
    target), never presented as exact."""
    cube = make_cube(
        clocks=[1000, 1200, 1400, 1600, 1980],
        repeats=3,
        latency=lambda c, *a: 10.0,
        energy=lambda c, *a: c / 1000,
    )
    tpot = cube["tpot_ms"].values
    tpot[0, :, :, :, :, 1:, :] = np.nan  # 1000 MHz: one usable repeat of three
    cube["cell_status"].values[:] = 1
    cube["valid"].values[:] = 1
    r = headroom(cube, target=Target(slack=0.05), knob="sm_clock").squeeze()
    assert int(r["short_settings"]) == 1 and float(r["chosen_sm_clock"]) == 1200
    assert bool(r["headroom_mhz_is_lower_bound"]) and bool(r["chosen_at_grid_edge"])
    assert not bool(r["headroom_mhz_unmeasured_below"]) and not bool(
        r["headroom_mhz_invalid_below"]
    )


@settings(max_examples=25, deadline=None)  # x ROWS rows
@given(
    lat=st.lists(latencies, min_size=18 * ROWS, max_size=18 * ROWS),
    en=st.lists(energies, min_size=18 * ROWS, max_size=18 * ROWS),
    flagged=st.lists(st.booleans(), min_size=18 * ROWS, max_size=18 * ROWS),
    slack=st.floats(0.0, 0.5),
)
def test_stock_meets_its_own_latency_with_a_repeat_flagged(lat, en, flagged, slack) -> None:
    """One flagged repeat of the stock cell leaves the other two as the reference, and they
    judge stock too: staying at stock always meets a preserve target, so every row has an
    answer that saves no less than stock (ties aside), and a power cap that never bound is
    not chosen over it. Other settings with a flagged repeat stay disqualified."""
    clocks, limits = [900, 1500, 1980], [400.0, 700.0]
    shape = (ROWS, len(clocks), len(limits), 3)
    bad = np.array(flagged).reshape(shape)
    bad[:, -1, -1, :] = [True, False, False]  # stock: repeat 0 flagged, 1 and 2 usable
    lat_a, en_a = np.resize(np.array(lat), shape), np.resize(np.array(en), shape)
    cube = make_cube(
        clocks=clocks,
        limits=limits,
        batches=list(range(1, ROWS + 1)),
        repeats=3,
        latency=lambda c, p, b, d, k, r: lat_a[b - 1, clocks.index(c), limits.index(p), r],
        energy=lambda c, p, b, d, k, r: en_a[b - 1, clocks.index(c), limits.index(p), r],
        valid=lambda c, p, b, d, k, r: not bad[b - 1, clocks.index(c), limits.index(p), r],
        power_max=lambda *a: 100.0,  # no cap ever bound
    )
    for i, r in enumerate(rows(headroom(cube, target=Target("preserve", slack=slack)))):
        stock = en_a[i, -1, -1, 1:].mean()
        assert r["feasible"] == 1
        assert r["stock_energy_per_token_j"] == pytest.approx(stock)
        assert r["chosen_energy_per_token_j"] <= stock * (1 + 1e-4)
        ci, pi = clocks.index(int(r["chosen_sm_clock"])), limits.index(r["chosen_power_limit"])
        # 400 W never bound: never chosen over 700 W at its clock where 700 W was judged (a
        # flagged repeat there disqualifies it, and 400 W's own operating point stands)
        assert pi == 1 or bad[i, ci, 1].any()
        assert (ci, pi) == (2, 1) or not bad[i, ci, pi].any()
        if slack == 0 and (ci, pi) == (2, 1):
            assert r["saving"] == 0 and r["chosen_latency_ms"] == r["target_ms"]


def test_the_latency_shown_is_over_the_repeats_the_bound_paired() -> None:
    """Stock's repeat 0 flagged: the bound pairs repeats 1 and 2, whose ratio is 1.005, so
    1500 MHz meets a 1% slack; its repeat 0 ran other prompts at 12 ms. The latency shown
    beside the 10.1 ms target is the paired repeats' 10.05 ms, not 10.7 ms over all three,
    which read as a chosen setting over its target."""
    from dvfs.report.headroom import headroom_document, headroom_table_rows

    lat = {1500: [12.0, 10.05, 10.05], 2000: [9.0, 10.0, 10.0]}
    cube = make_cube(
        clocks=[1500, 2000],
        repeats=3,
        latency=lambda c, p, b, d, k, r: lat[c][r],
        energy=lambda c, *a: c / 1000,
        valid=lambda c, p, b, d, k, r: not (c == 2000 and r == 0),
    )
    result = headroom(cube, target=Target("preserve", slack=0.01))
    r = row(result)
    assert r["chosen_sm_clock"] == 1500 and r["repeats"] == 2
    assert r["chosen_latency_ms"] == pytest.approx(10.05)
    assert r["target_ms"] == pytest.approx(10.1)
    assert r["chosen_latency_ms"] <= r["target_ms"]
    (table_row,) = headroom_table_rows(headroom_document(result, cube))[1]
    assert table_row[-2:] == ["10.1", "10.1"]  # latency ms, target ms (10.7 ms before)


def test_the_saving_is_over_the_repeats_paired_with_the_reference() -> None:
    """Stock's repeat 1 flagged; repeat 1's prompts cost 1.3x at every setting. The saving
    against stock (repeats 0 and 2) is 20% over the same prompts; the energy of 1500 MHz over
    all three repeats, its repeat 1 included, read 0.88 J against 1.0 J: a 12% saving that
    compared other prompts, and fell outside its own interval."""
    from dvfs.report.headroom import headroom_document, headroom_table_rows

    cost = [1.0, 1.3, 1.0]  # each repeat's prompts
    cube = make_cube(
        clocks=[1500, 2000],
        repeats=3,
        latency=lambda c, *_: 10.0,
        energy=lambda c, p, b, d, k, r: (0.8 if c == 1500 else 1.0) * cost[r],
        valid=lambda c, p, b, d, k, r: not (c == 2000 and r == 1),
    )
    result = headroom(cube, target=Target("preserve", slack=0.01))
    r = row(result)
    assert r["chosen_sm_clock"] == 1500
    assert r["stock_energy_per_token_j"] == pytest.approx(1.0)
    assert r["chosen_energy_per_token_j"] == pytest.approx(0.8)  # 0.88 before
    assert r["saving"] == pytest.approx(0.2)  # 0.12 before
    header, (cells,) = headroom_table_rows(headroom_document(result, cube))
    assert cells[header.index("saving")] == "20.0%"


def _stock_at_five_repeats_1500_at_three() -> xr.Dataset:
    """Adaptive repeats: stock (2000 MHz) measured at five repeats, 1500 MHz at the first
    three; repeats 3 and 4's prompts cost 1.3x; 1500 MHz costs 0.8x stock on every prompt."""
    cost = [1.0, 1.0, 1.0, 1.3, 1.3]  # each repeat's prompts
    return make_cube(
        clocks=[1500, 2000],
        repeats=5,
        latency=lambda c, *_: 10.0,
        energy=lambda c, p, b, d, k, r: (
            math.nan if c == 1500 and r >= 3 else (0.8 if c == 1500 else 1.0) * cost[r]
        ),
    )


def test_the_saving_is_over_the_repeats_the_chosen_setting_was_measured_at() -> None:
    """Adaptive repeats: stock took five, 1500 MHz three (its repeats 3 and 4 not measured);
    repeats 3 and 4's prompts cost 1.3x. 1500 MHz costs 0.8x stock on every prompt: a 20%
    saving over the repeats both measured. It read 28.6%: 1500 MHz's three repeats against
    stock's 1.12 J over all five, two of them other prompts."""
    from dvfs.report.headroom import headroom_document, headroom_table_rows

    cube = _stock_at_five_repeats_1500_at_three()
    result = headroom(cube, target=Target("preserve", slack=0.01))
    r = row(result)
    assert r["chosen_sm_clock"] == 1500
    assert r["stock_energy_per_token_j"] == pytest.approx(1.12)  # over its five repeats
    assert r["chosen_energy_per_token_j"] == pytest.approx(0.8)
    assert r["saving"] == pytest.approx(0.2)  # 0.286 before
    header, (cells,) = headroom_table_rows(headroom_document(result, cube))
    assert cells[header.index("saving")] == "20.0%"


def test_the_stock_energy_beside_the_saving_is_over_the_same_repeats() -> None:
    """Adaptive repeats: stock took five, 1500 MHz three; repeats 3 and 4's prompts cost 1.3x.
    The table showed 1.12 -> 0.8 J beside a 20.0% saving (stock over all five): the two
    J figures did not give the saving shown. Beside it stock's energy is over the three
    repeats measured at both (1 J), and a note gives the 1.12 J over all of stock's."""
    from dvfs.report.headroom import headroom_document, headroom_notes, headroom_table_rows

    cube = _stock_at_five_repeats_1500_at_three()
    result = headroom(cube, target=Target("preserve", slack=0.01))
    r = row(result)
    assert r["stock_energy_per_token_j"] == pytest.approx(1.12)  # the reference's own energy
    assert r["paired_stock_energy_per_token_j"] == pytest.approx(1.0)
    assert r["saving_repeats"] == 3
    assert r["saving"] == pytest.approx(1 - r["chosen_energy_per_token_j"] / 1.0)
    doc = headroom_document(result, cube)
    header, (cells,) = headroom_table_rows(doc)
    stock, chosen = (float(cells[header.index(h)]) for h in ("J/tok stock", "J/tok chosen"))
    assert f"{(1 - chosen / stock) * 100:.1f}%" == cells[header.index("saving")] == "20.0%"
    (note,) = [n for n in headroom_notes(doc) if n.startswith("J/tok stock")]
    assert "3 repeat(s), 1.12 J over all" in note
    (doc_row,) = doc["rows"]
    assert doc_row["paired_stock_energy_per_token_j"] == pytest.approx(1.0)
    assert doc_row["saving_repeats"] == 3


def test_a_saving_over_every_repeat_shows_stock_as_before_with_no_note() -> None:
    """Both settings measured at every repeat: the paired stock energy is the stock energy,
    and the table says nothing more."""
    from dvfs.report.headroom import headroom_document, headroom_notes

    result = headroom(simple(repeats=3), target=Target("preserve", slack=0.1))
    r = row(result)
    assert r["paired_stock_energy_per_token_j"] == r["stock_energy_per_token_j"] == 1.0
    assert r["saving_repeats"] == 3
    doc = headroom_document(result, simple(repeats=3))
    assert not [n for n in headroom_notes(doc) if n.startswith("J/tok")]


def test_the_saving_against_the_baseline_is_over_the_repeats_both_measured() -> None:
    """Repeat r of every drafter sends the same prompts; repeats 3 and 4's cost 1.3x. none
    (the baseline) took five repeats at stock, eagle3 three at its chosen 1000 MHz, where it
    costs 0.5x none's stock on every prompt: a 50% saving against the baseline. It read
    55.4% (0.5 over three repeats against none's 1.12 J over five). And the baseline's own
    row read another saving against itself than its saving (same setting, same stock)."""
    cost = [1.0, 1.0, 1.0, 1.3, 1.3]

    def energy(c, p, b, d, k, r):  # type: ignore[no-untyped-def]
        if d == "eagle3":
            return math.nan if r >= 3 else (0.5 if c == 1000 else 0.9) * cost[r]
        return math.nan if c == 1000 and r >= 3 else (0.8 if c == 1000 else 1.0) * cost[r]

    cube = make_cube(
        clocks=[1000, 2000],
        drafters=["none", "eagle3"],
        repeats=5,
        latency=lambda c, p, b, d, *_: (5.0 if d == "eagle3" else 10.0) * (1 + (c == 1000) * 0.01),
        energy=energy,
    )
    result = headroom(cube, target=Target("vs-baseline", slack=0.05))
    eagle = result.sel(batch=1, corpus="code", drafter="eagle3")
    assert int(eagle["chosen_sm_clock"]) == 1000
    assert float(eagle["saving_vs_baseline"]) == pytest.approx(0.5)  # 0.554 before
    none = result.sel(batch=1, corpus="code", drafter="none")
    assert int(none["chosen_sm_clock"]) == 1000
    assert float(none["saving"]) == pytest.approx(0.2)
    assert float(none["saving_vs_baseline"]) == pytest.approx(float(none["saving"]))


def test_an_slo_answer_without_a_valid_reference_energy_shows_no_saving() -> None:
    """An SLO needs no reference latency, so a row has an answer while its reference cells are
    all invalid; with no energy there to save against, the saving cell is "-", not "-%"."""
    from dvfs.report.headroom import headroom_document, headroom_table_rows

    cube = make_cube(
        clocks=[1500, 2000],
        repeats=2,
        latency=lambda c, *_: 12.0 if c == 1500 else 10.0,
        energy=lambda c, *_: c / 2000,
        valid=lambda c, *_: c != 2000,
    )
    result = headroom(cube, target=parse_slo("tpot_p50<=20ms"))
    header, (cells,) = headroom_table_rows(headroom_document(result, cube))
    assert cells[header.index("chosen MHz/W")] == "1500/700"
    assert cells[header.index("saving")] == "-"
