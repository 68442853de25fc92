"""`dvfs compare` pairs its arms by repeat (each repeat sends its own prompts) and calls a drafter's
saving real only where the paired ratio's Student-t interval excludes 1; hand-built cubes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner
from conftest import SMALL_EXACT, replace_block
from cubes import as_twin_sweep, make_cube
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dvfs.analysis.bounds import interval, paired_ratios, t_quantile
from dvfs.analysis.compare import (
    LOSES,
    NO_DATA,
    NOT_WITHIN,
    ONE_REPEAT,
    SAVES,
    WITHIN_NOISE,
    break_even_summary,
    compare,
    paired_ratio,
    verdict,
)
from dvfs.cli import cli
from dvfs.cube import write_cube

CLOCKS = [1000, 2000]
BATCHES = [1, 8, 64]

energies = st.floats(min_value=0.05, max_value=5.0, allow_nan=False)


@st.composite
def two_arms(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Per-repeat energies of a drafter and its baseline, some repeats invalid (NaN) in one."""
    n = draw(st.integers(min_value=1, max_value=6))
    mine = np.array(draw(st.lists(energies, min_size=n, max_size=n)))
    base = np.array(draw(st.lists(energies, min_size=n, max_size=n)))
    for arm in (mine, base):
        for r in draw(st.sets(st.integers(min_value=0, max_value=n - 1), max_size=n)):
            arm[r] = math.nan
    return mine, base


def _twin_cube(ds: xr.Dataset, tmp_path: Path) -> Path:
    """`ds` written as one twin GPU's sweep cube, for the CLI to read."""
    return write_cube(
        as_twin_sweep(ds, uuid="GPU-0", gpu_name="NVIDIA H100", campaign="pairing"),
        tmp_path / "cube.nc",
    )


@settings(max_examples=200, deadline=None)
@given(two_arms(), st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_an_invalid_repeat_in_one_arm_leaves_both(arms, confidence) -> None:
    mine, base = arms
    both = ~(np.isnan(mine) | np.isnan(base))
    got = paired_ratio(mine[None, :], base[None, :], confidence)
    # The same as if the repeat had never been measured in either arm.
    kept = paired_ratio(mine[None, both], base[None, both], confidence)
    for name in ("ratio", "low", "high", "paired"):
        np.testing.assert_array_equal(getattr(got, name), getattr(kept, name))
    assert int(got.paired[0]) == int(both.sum())
    lost = int((np.isnan(mine) != np.isnan(base)).sum())
    empty = np.isnan(mine).all() or np.isnan(base).all()  # no ratio either way: none lost
    assert int(got.dropped[0]) == (0 if empty else lost)
    # Order-free: the repeats' order never changes an answer.
    order = np.random.default_rng(int(both.sum())).permutation(len(mine))
    shuffled = paired_ratio(mine[None, order], base[None, order], confidence)
    for name in ("ratio", "low", "high"):
        np.testing.assert_array_equal(getattr(got, name), getattr(shuffled, name))


@settings(max_examples=200, deadline=None)
@given(two_arms(), st.sampled_from([0.8, 0.95, 0.99]))
def test_the_interval_is_the_t_interval_of_the_per_repeat_log_ratios(arms, confidence) -> None:
    mine, base = arms
    x = np.log(paired_ratios(mine, base))
    got = paired_ratio(mine[None, :], base[None, :], confidence)
    ratio, low, high = float(got.ratio[0]), float(got.low[0]), float(got.high[0])
    if len(x) < 2:
        assert math.isnan(low) and math.isnan(high)
        return
    half = t_quantile((1 + confidence) / 2, len(x) - 1) * np.std(x, ddof=1) / math.sqrt(len(x))
    assert ratio == pytest.approx(math.exp(np.mean(x)), rel=1e-12)  # the geometric mean
    assert low == pytest.approx(math.exp(np.mean(x) - half), rel=1e-9, abs=1e-12)
    assert high == pytest.approx(math.exp(np.mean(x) + half), rel=1e-9, abs=1e-12)
    # A verdict never contradicts its point value, and a wider interval never adds one.
    said = verdict(ratio, low, high, len(x), point=False)
    if said == SAVES:
        assert high < 1 and ratio < 1
    elif said == LOSES:
        assert low > 1 and ratio > 1
    else:
        assert said == WITHIN_NOISE and low <= 1 + 1e-9 and high >= 1 - 1e-9
    wider = np.exp(interval(x, (1 + confidence) / 2))
    if verdict(ratio, *wider, len(x), point=False) != WITHIN_NOISE:
        assert verdict(ratio, *wider, len(x), point=False) == said


#: Ten repeats whose per-repeat ratios are 10 and 0.1 by turns: their arithmetic mean (5.05) is
#: "costs" at 95% whichever arm is the baseline (and so is the mean of the reciprocals).
SPREAD_MINE = [10.0, 1.0] * 5
SPREAD_BASE = [1.0, 10.0] * 5
OPPOSITE = {SAVES: LOSES, LOSES: SAVES}


def _judged(mine, base, confidence) -> tuple[str, float, float, float]:
    got = paired_ratio(np.asarray(mine)[None, :], np.asarray(base)[None, :], confidence)
    ratio, low, high = float(got.ratio[0]), float(got.low[0]), float(got.high[0])
    return verdict(ratio, low, high, int(got.paired[0]), point=False), ratio, low, high


@settings(max_examples=300, deadline=None)
@example((np.array(SPREAD_MINE), np.array(SPREAD_BASE)), 0.95)
@given(
    st.integers(min_value=2, max_value=10).flatmap(
        lambda n: st.tuples(
            *(st.lists(st.floats(0.01, 100.0), min_size=n, max_size=n).map(np.array),) * 2
        )
    ),
    st.sampled_from([0.8, 0.9, 0.95, 0.99]),
)
def test_swapping_the_arms_inverts_the_verdict(arms, confidence) -> None:
    mine, base = arms
    said, ratio, low, high = _judged(mine, base, confidence)
    back, r_ratio, r_low, r_high = _judged(base, mine, confidence)
    assert back == OPPOSITE.get(said, said)
    assert r_ratio == pytest.approx(1 / ratio, rel=1e-12)
    assert r_low == pytest.approx(1 / high, rel=1e-12)
    assert r_high == pytest.approx(1 / low, rel=1e-12)


def _both_ways(path: Path) -> tuple[dict, dict]:
    """eagle3's row against none, and none's against eagle3 (`--baseline eagle3`)."""
    rows = {}
    for baseline, drafter in (("none", "eagle3"), ("eagle3", "none")):
        doc = json.loads(run("compare", str(path), "--json", "--baseline", baseline).stdout)
        (rows[drafter],) = [r for r in doc["rows"] if r["drafter"] == drafter]
    return rows["eagle3"], rows["none"]


def test_compare_cli_with_the_arms_swapped_gives_the_opposite_verdict(tmp_path: Path) -> None:
    """End to end: `--baseline` either way round over per-repeat ratios of 10 and 0.1 (an
    arithmetic mean of 5.05 both ways: "costs" twice) gives reciprocal ratios and verdicts."""
    ds = make_cube(
        clocks=CLOCKS,
        drafters=["none", "eagle3"],
        repeats=10,
        latency=lambda c, p, b, d, *_: 10.0 * 2000 / c,
        energy=lambda c, p, b, d, corpus, r: (SPREAD_MINE if d == "eagle3" else SPREAD_BASE)[r],
    )
    there, back = _both_ways(_twin_cube(ds, tmp_path))
    assert there["paired_repeats_at_stock"] == back["paired_repeats_at_stock"] == 10
    assert there["energy_ratio_at_stock"] == pytest.approx(1 / back["energy_ratio_at_stock"])
    said, said_back = there["verdict_at_stock"], back["verdict_at_stock"]
    assert said_back == OPPOSITE.get(said, said), (said, said_back)


def test_a_drafter_measured_at_zero_energy_saves_or_is_within_noise(tmp_path: Path) -> None:
    """A valid cell may hold an energy per token of 0 (the cube admits any non-negative one):
    its log ratio is minus infinity. Zero in every paired repeat (batch 1) is a ratio of 0
    with no spread: it saves, never "costs"; zero in one repeat beside finite ratios (batch
    8) leaves the interval unbounded: within noise. No warning of the arithmetic leaks."""
    import warnings

    ds = repeats_cube(lambda b, r: 0.0 if b == 1 or (b == 8 and r == 0) else 0.45 * BASE[r])
    path = _twin_cube(ds, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        doc = json.loads(run("compare", str(path), "--json").stdout)
    rows = {r["batch"]: r for r in doc["rows"]}
    assert rows[1]["energy_ratio_at_stock"] == 0.0
    assert rows[1]["energy_ratio_at_stock_interval"] == [0.0, 0.0]
    assert rows[1]["verdict_at_stock"] == SAVES
    assert rows[8]["energy_ratio_at_stock"] == 0.0
    assert rows[8]["verdict_at_stock"] == WITHIN_NOISE
    assert rows[64]["verdict_at_stock"] == SAVES
    table = run("compare", str(path)).output
    assert "saves at batches 1, 64; within noise at batch 8" in table
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run("compare", str(path), "--json")


def test_the_readme_says_swapping_the_arms_inverts_the_ratio_at_stock_only(
    tmp_path: Path,
) -> None:
    """README said swapping the arms (`--baseline`) gives each ratio's reciprocal and the
    opposite verdict; at equal latency each arm is held to the baseline's own stock latency,
    so swapped it is another ratio: a drafter faster and cheaper than `none` saves at equal
    latency, and `none` against it is not within its target at all. The README says so."""
    ds = make_cube(
        clocks=[1000, 1500, 2000],
        drafters=["none", "eagle3"],
        repeats=3,
        latency=lambda c, p, b, d, *_: (8.0 if d == "eagle3" else 10.0) * 2000 / c,
        energy=lambda c, p, b, d, corpus, r: (0.5 if d == "eagle3" else 1.0) * c / 1000 + 0.01 * r,
    )
    there, back = _both_ways(_twin_cube(ds, tmp_path))
    assert there["energy_ratio_at_stock"] == pytest.approx(1 / back["energy_ratio_at_stock"])
    assert there["verdict_equal_latency"] == SAVES
    assert back["verdict_equal_latency"] == NOT_WITHIN
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    said = readme.split("swapping the arms, `--baseline`, gives", 1)[1].split("), and", 1)[0]
    assert "at stock" in said and "equal-latency" in said, said


def test_a_baseline_measured_at_zero_energy_costs_or_is_within_noise(tmp_path: Path) -> None:
    """The arms of the zero-energy test swapped: the baseline at zero energy per token makes
    an infinite ratio. Zero in every paired repeat (batch 1) costs, the opposite of the
    drafter's "saves", never "no data" beside three paired repeats; zero in one (batch 8) is
    within noise, its interval [0, infinity) written [0.0, null], not null as if unpaired."""
    ds = repeats_cube(lambda b, r: 0.0 if b == 1 or (b == 8 and r == 0) else 0.45 * BASE[r])
    path = _twin_cube(ds, tmp_path)
    doc = json.loads(run("compare", str(path), "--json", "--baseline", "eagle3").stdout)
    rows = {r["batch"]: r for r in doc["rows"]}
    assert rows[1]["verdict_at_stock"] == LOSES
    assert rows[1]["paired_repeats_at_stock"] == 3
    assert rows[1]["energy_ratio_at_stock"] is None  # infinite: JSON has no infinity
    assert rows[8]["verdict_at_stock"] == WITHIN_NOISE
    assert rows[8]["energy_ratio_at_stock_interval"] == [0.0, None]
    assert rows[64]["verdict_at_stock"] == LOSES
    table = run("compare", str(path), "--baseline", "eagle3").output
    assert "never saves; within noise at batch 8" in table
    assert "no data" not in table
    assert "inf [0.00, inf]" in table
    # The drafter's own side: its batch 8 interval is [0, infinity) too, not null.
    doc = json.loads(run("compare", str(path), "--json").stdout)
    (row,) = [r for r in doc["rows"] if r["batch"] == 8]
    assert row["energy_ratio_at_stock_interval"] == [0.0, None]


def test_verdict_rules() -> None:
    assert verdict(0.9, 0.8, 0.95, 3, point=False) == SAVES
    assert verdict(1.1, 1.05, 1.2, 3, point=False) == LOSES
    assert verdict(0.97, 0.9, 1.04, 3, point=False) == WITHIN_NOISE
    assert verdict(0.5, math.nan, math.nan, 1, point=False) == ONE_REPEAT
    assert verdict(math.nan, math.nan, math.nan, 0, point=False) == NO_DATA
    # A cube with one repeat has no interval anywhere: the point value is judged, as before.
    assert verdict(0.997, math.nan, math.nan, 1, point=True) == SAVES
    assert verdict(1.0, math.nan, math.nan, 1, point=True) == LOSES


@pytest.mark.parametrize(
    ("states", "says"),
    [
        ([SAVES, WITHIN_NOISE, LOSES], "saves up to batch 1; within noise at batch 8"),
        ([WITHIN_NOISE, SAVES, SAVES], "saves from batch 8; within noise at batch 1"),
        ([SAVES, SAVES, WITHIN_NOISE], "saves up to batch 8; within noise at batch 64"),
        ([WITHIN_NOISE] * 3, "within noise at every batch"),
        (
            [WITHIN_NOISE, WITHIN_NOISE, NOT_WITHIN],
            "within noise at batches 1, 8; not within target at batch 64",
        ),
        ([LOSES, WITHIN_NOISE, LOSES], "never saves; within noise at batch 8"),
        ([SAVES, ONE_REPEAT, SAVES], "saves at batches 1, 64; one paired repeat at batch 8"),
        ([ONE_REPEAT] * 3, "one paired repeat at batches 1, 8, 64"),
        ([ONE_REPEAT, NO_DATA, NO_DATA], "one paired repeat at batch 1; no data at batches 8, 64"),
        # batch 8 met the baseline's latency (one paired repeat): not "never within target"
        (
            [NOT_WITHIN, ONE_REPEAT, NOT_WITHIN],
            "one paired repeat at batch 8; not within target at batches 1, 64",
        ),
    ],
)
def test_the_summary_names_noise_and_single_repeats(states, says) -> None:
    assert break_even_summary(list(zip(BATCHES, states, strict=True))) == says


#: Per-repeat energy per token of each arm at stock (2000 MHz), batch 1; repeat r's prompts
#: differ, so both arms move together from repeat to repeat. The drafter spends 0.45x.
BASE = [1.0, 1.3, 0.9]


def repeats_cube(drafter_energy, *, valid=None, repeats: int = 3):
    def energy(c, p, b, d, corpus, r):
        scale = (1.0 if c == 2000 else 0.8) / b
        return scale * (drafter_energy(b, r) if d == "eagle3" else BASE[r])

    return make_cube(
        clocks=CLOCKS,
        batches=BATCHES,
        drafters=["none", "eagle3"],
        repeats=repeats,
        latency=lambda c, p, b, d, *_: (4.0 if d == "eagle3" else 10.0) * 2000 / c,
        energy=energy,
        valid=valid,
    )


def test_one_invalid_repeat_in_one_arm_is_dropped_from_both() -> None:
    # EAGLE-3 saves 0.45x in every repeat; its repeat 0 at stock is invalid. Averaging each
    # arm's valid repeats alone would divide its (1.3, 0.9) by none's (1.0, 1.3, 0.9): 0.464.
    ds = repeats_cube(
        lambda b, r: 0.45 * BASE[r],
        valid=lambda c, p, b, d, corpus, r: not (d == "eagle3" and c == 2000 and r == 0),
    )
    at = compare(ds).sel(drafter="eagle3", corpus="code", batch=1)
    assert float(at["energy_ratio_at_stock"]) == pytest.approx(0.45, rel=1e-12)
    assert int(at["paired_repeats_at_stock"]) == 2 and int(at["dropped_repeats_at_stock"]) == 1
    assert str(at["verdict_at_stock"].item()) == SAVES


def test_a_saving_inside_the_noise_is_not_called_a_saving() -> None:
    # Batch 1: 0.5x in every repeat (saves). Batch 8: 0.9x, 1.05x, 1.0x (a mean of 0.98 whose
    # interval holds 1). Batch 64: 1.2x, 1.3x, 1.25x (costs).
    wobble = {1: [0.5, 0.5, 0.5], 8: [0.9, 1.05, 1.0], 64: [1.2, 1.3, 1.25]}
    ds = repeats_cube(lambda b, r: wobble[b][r] * BASE[r])
    at = compare(ds).sel(drafter="eagle3", corpus="code")
    assert [str(v) for v in at["verdict_at_stock"].values] == [SAVES, WITHIN_NOISE, LOSES]
    assert float(at["energy_ratio_at_stock"].sel(batch=8)) < 1  # a point value below 1 ...
    assert int(at["break_even_batch_equal_clock"]) == 8  # ... does not count as saving
    assert str(at["break_even_equal_clock"].item()) == (
        "saves up to batch 1; within noise at batch 8"
    )
    low, high = (float(at[f"energy_ratio_at_stock_{e}"].sel(batch=8)) for e in ("low", "high"))
    assert low < 1 < high


def test_one_paired_repeat_gives_no_verdict_in_a_cube_with_repeats() -> None:
    ds = repeats_cube(
        lambda b, r: 0.45 * BASE[r],
        valid=lambda c, p, b, d, corpus, r: not (b == 8 and c == 2000 and r < 2 and d == "none"),
    )
    at = compare(ds).sel(drafter="eagle3", corpus="code")
    assert str(at["verdict_at_stock"].sel(batch=8).item()) == ONE_REPEAT
    assert float(at["energy_ratio_at_stock"].sel(batch=8)) == pytest.approx(0.45)
    says = "saves at batches 1, 64; one paired repeat at batch 8"
    assert str(at["break_even_equal_clock"].item()) == says


def run(*args: str):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_compare_cli_pairs_repeats_and_says_so(tmp_path: Path) -> None:
    """End to end: an invalid repeat in one arm leaves the ratio the paired one, and the JSON
    and the table say which rows lost repeats to pairing."""
    ds = repeats_cube(
        lambda b, r: (0.45 if b == 1 else 0.6) * BASE[r],
        valid=lambda c, p, b, d, corpus, r: not (d == "eagle3" and c == 2000 and r == 0),
    )
    path = _twin_cube(ds, tmp_path)
    doc = json.loads(run("compare", str(path), "--json").stdout)
    assert doc["confidence"] == 0.95 and "Student-t" in doc["interval"]
    rows = {r["batch"]: r for r in doc["rows"]}
    for batch, saving in ((1, 0.45), (8, 0.6), (64, 0.6)):
        row = rows[batch]
        assert row["energy_ratio_at_stock"] == pytest.approx(saving, rel=1e-12)
        assert row["paired_repeats_at_stock"] == 2 and row["dropped_repeats_at_stock"] == 1
        assert row["verdict_at_stock"] == "saves"
        low, high = row["energy_ratio_at_stock_interval"]
        assert low <= row["energy_ratio_at_stock"] <= high < 1
    table = run("compare", str(path)).output
    assert "2 repeats paired, 1 dropped" in table
    assert "paired by repeat: in 3 of 3 rows" in table
    assert "saves / costs: two-sided 95% Student-t interval" in table
    # --confidence reaches the interval: a wider one at 99%.
    wide = json.loads(run("compare", str(path), "--json", "--confidence", "0.99").stdout)
    w_low, w_high = wide["rows"][0]["energy_ratio_at_stock_interval"]
    low, high = rows[1]["energy_ratio_at_stock_interval"]
    assert w_low <= low and w_high >= high


def test_one_paired_repeat_is_its_own_ratio_and_zeros_in_both_arms_keep_their_pairs(
    tmp_path: Path,
) -> None:
    """Batch 8 pairs one repeat (45 over 100 J): its ratio was exp(log 45 - log 100),
    0.44999999999999973, where it is 45 / 100 = 0.45. Batch 64 has a zero energy in each arm
    (ratios 0 and infinity): no ratio, but its 3 paired repeats were said as 0."""

    def energy(c, p, b, d, corpus, r):
        if b == 64:
            return 0.0 if (d, r) in (("eagle3", 0), ("none", 1)) else 1.0
        return 45.0 if d == "eagle3" else 100.0

    ds = make_cube(
        clocks=CLOCKS,
        batches=BATCHES,
        drafters=["none", "eagle3"],
        repeats=3,
        latency=lambda c, p, b, d, *_: (4.0 if d == "eagle3" else 10.0) * 2000 / c,
        energy=energy,
        valid=lambda c, p, b, d, corpus, r: not (b == 8 and r > 0),
    )
    doc = json.loads(run("compare", str(_twin_cube(ds, tmp_path)), "--json").stdout)
    rows = {r["batch"]: r for r in doc["rows"]}
    assert rows[8]["energy_ratio_at_stock"] == 0.45
    assert rows[8]["paired_repeats_at_stock"] == 1 and rows[8]["verdict_at_stock"] == ONE_REPEAT
    assert rows[64]["energy_ratio_at_stock"] is None, rows[64]
    assert rows[64]["paired_repeats_at_stock"] == 3 and rows[64]["verdict_at_stock"] == NO_DATA


def test_a_flagged_repeat_of_the_baselines_stock_keeps_equal_latency(tmp_path: Path) -> None:
    """End to end: repeat 0 of no speculation's stock cell flagged leaves its repeats 1 and 2
    as the reference, and staying at stock still meets its own latency: `dvfs headroom` keeps
    stock as the baseline's answer (not "none feasible"), and `dvfs compare` compares at equal
    latency over the repeats both arms kept instead of reporting no data."""
    ds = repeats_cube(
        lambda b, r: 0.45 * BASE[r],
        valid=lambda c, p, b, d, corpus, r: not (d == "none" and c == 2000 and r == 0),
    )
    path = _twin_cube(ds, tmp_path)
    room = json.loads(run("headroom", str(path), "--json", "--drafter", "none").stdout)
    for row in room["rows"]:
        assert row["feasible"] and row["chosen"] == {"sm_clock_mhz": 2000, "power_limit_w": 700.0}
        assert row["saving"] == 0 and row["repeats"] == 2
    doc = json.loads(run("compare", str(path), "--json").stdout)
    for row in doc["rows"]:
        # EAGLE-3 meets none's stock 10 ms at 1000 MHz (8 ms) at 0.8 x 0.45 of none's stock.
        assert row["energy_ratio_equal_latency"] == pytest.approx(0.8 * 0.45, rel=1e-12)
        assert row["verdict_equal_latency"] == SAVES
        assert row["paired_repeats_equal_latency"] == 2
        assert row["dropped_repeats_equal_latency"] == 1
    summary = {r["equal_latency_summary"] for r in doc["break_even_batch"]}
    assert summary == {"saves at every batch"}


def test_too_few_usable_repeats_at_equal_latency_are_not_no_data(tmp_path: Path) -> None:
    """none's stock cell is valid in one of three repeats at batch 8 (too few to judge any
    setting against it, as headroom says): EAGLE-3 has data there, so its equal-latency
    verdict, table cell and summary say "too few repeats", not "no data" or "-"."""
    ds = make_cube(
        clocks=CLOCKS,
        batches=BATCHES,
        drafters=["none", "eagle3"],
        repeats=3,
        latency=lambda c, p, b, d, *_: (5.0 if d == "eagle3" else 10.0) * 2000 / c,
        energy=lambda c, p, b, d, corpus, r: (0.5 if d == "eagle3" else 1.0) * BASE[r],
        valid=lambda c, p, b, d, corpus, r: not (c == 2000 and b == 8 and d == "none" and r > 0),
    )
    path = _twin_cube(ds, tmp_path)
    doc = json.loads(run("compare", str(path), "--json").stdout)
    verdicts = {r["batch"]: r["verdict_equal_latency"] for r in doc["rows"]}
    assert verdicts == {1: SAVES, 8: "too few repeats", 64: SAVES}
    [entry] = doc["break_even_batch"]
    assert entry["equal_latency_summary"] == "saves at batches 1, 64; too few repeats at batch 8"
    table = run("compare", str(path), "--markdown").output
    [row] = [line for line in table.splitlines() if line.startswith("| 8 | eagle3 |")]
    assert row.rstrip(" |").endswith("too few repeats"), row


def test_the_table_says_too_slow_only_where_no_setting_was_fast_enough(tmp_path: Path) -> None:
    """End to end: the equal-latency column says "too slow" where the verdict is "not within
    target" (EAGLE-3 slower than none at every setting), whether or not the drafter's own
    stock cell is usable, and never where the baseline's reference is unusable (no data)."""
    ds = make_cube(
        clocks=CLOCKS,
        batches=BATCHES,
        drafters=["none", "eagle3"],
        repeats=3,
        latency=lambda c, p, b, d, *_: (12.0 if d == "eagle3" else 10.0) * 2000 / c,
        energy=lambda c, p, b, d, corpus, r: 0.5 * BASE[r],
        # batch 1: none's stock cell invalid in every repeat; batch 8: eagle3's
        valid=lambda c, p, b, d, corpus, r: (
            not (c == 2000 and ((b == 1 and d == "none") or (b == 8 and d == "eagle3")))
        ),
    )
    path = _twin_cube(ds, tmp_path)
    doc = json.loads(run("compare", str(path), "--json").stdout)
    verdicts = {r["batch"]: r["verdict_equal_latency"] for r in doc["rows"]}
    assert verdicts == {1: NO_DATA, 8: NOT_WITHIN, 64: NOT_WITHIN}
    table = run("compare", str(path), "--markdown").output
    cells = {}
    for line in table.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 5 and parts[1] == "eagle3" and parts[0].isdigit():
            cells[int(parts[0])] = parts[4]
    assert cells == {1: "-", 8: "too slow", 64: "too slow"}


def test_the_table_says_not_within_target_where_only_the_bound_failed(tmp_path: Path) -> None:
    """EAGLE-3's TPOT at batch 1 is 9.0, 11.5 and 9.2 ms in three repeats at stock, against
    none's 10 ms: its mean meets none's latency, the bound at 95% does not. The JSON says "not
    within target" and the table must too, not "too slow", which it says at batch 8, where
    EAGLE-3 is slower than none in every repeat; the report's headline says which is which."""
    from dvfs.report.findings import speculation_finding

    noisy = [9.0, 11.5, 9.2]
    ds = make_cube(
        clocks=CLOCKS,
        batches=[1, 8],
        drafters=["none", "eagle3"],
        repeats=3,
        latency=lambda c, p, b, d, corpus, r: (
            ((noisy[r] if b == 1 else 12.0) if d == "eagle3" else 10.0) * 2000 / c
        ),
        energy=lambda c, p, b, d, corpus, r: (0.5 if d == "eagle3" else 1.0) * BASE[r],
    )
    path = _twin_cube(ds, tmp_path)
    doc = json.loads(run("compare", str(path), "--json").stdout)
    verdicts = {r["batch"]: r["verdict_equal_latency"] for r in doc["rows"]}
    assert verdicts == {1: NOT_WITHIN, 8: NOT_WITHIN}
    table = run("compare", str(path), "--markdown").output
    cells = {}
    for line in table.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 5 and parts[1] == "eagle3" and parts[0].isdigit():
            cells[int(parts[0])] = parts[4]
    assert cells == {1: NOT_WITHIN, 8: "too slow"}
    mean_met = {r["batch"]: r["equal_latency_mean_within_target"] for r in doc["rows"]}
    assert mean_met == {1: True, 8: False}
    # Every row is not within target, so the headline names no count of rows: the ones whose
    # mean met the target are counted in rows, never "1 of them" (read as one of the drafters).
    headline = speculation_finding(doc, ()).headline
    assert "in 1 of the 2 rows a setting's mean latency met it" in headline, headline
    assert "of them" not in headline, headline
    only_met = {**doc, "rows": [r for r in doc["rows"] if r["batch"] == 1]}
    headline = speculation_finding(only_met, ()).headline
    assert "(in every row a setting's mean latency met it" in headline, headline


#: Two arms with adaptive repeats (1 asked, up to 3): the arms take different numbers.
ADAPTIVE_ARMS = replace_block(
    replace_block(SMALL_EXACT, 'corpora = ["code", "conversation"]', 'corpora = ["code"]'),
    "repeats = 2\n",
    "repeats = 1\nmax_repeats = 3\n",
)


def test_a_repeat_the_adaptive_rule_never_asked_of_one_arm_is_not_dropped(
    shared_run, tmp_path: Path
) -> None:
    """With adaptive repeats the arms take as many repeats as each needs: a repeat one arm
    never measured because its rule did not ask is not a loss to pairing (no "dropped", no
    warning); one it measured and lost is."""
    from dvfs.cube import open_cube

    out = shared_run(ADAPTIVE_ARMS, "out")
    cube = open_cube(out)
    measured = cube["energy_per_token_j"].notnull().sum("repeat")
    at_stock = measured.sel(sm_clock=1980, power_limit=700.0)
    # The premise: at stock some row's arms took different numbers of repeats.
    assert (at_stock.sel(drafter="eagle3") != at_stock.sel(drafter="none")).any()
    doc = json.loads(run("compare", str(out), "--json").stdout)
    assert all(row["dropped_repeats_at_stock"] == 0 for row in doc["rows"]), doc["rows"]
    assert all(row["dropped_repeats_equal_latency"] == 0 for row in doc["rows"])
    assert "paired by repeat:" not in run("compare", str(out)).output
    # A repeat measured in both arms and invalid in one is dropped, as without the rule.
    valid = cube["valid"].copy()
    where = {"sm_clock": 1980, "power_limit": 700.0, "batch": 1, "corpus": "code"}
    assert measured.sel(where).min() >= 1
    valid.loc[{**where, "drafter": "eagle3", "repeat": 0}] = 0
    edited = cube.assign(valid=valid)
    path = tmp_path / "cube.nc"
    write_cube(edited, path)
    rows = {r["batch"]: r for r in json.loads(run("compare", str(path), "--json").stdout)["rows"]}
    assert rows[1]["dropped_repeats_at_stock"] == 1


def test_the_readme_lists_every_verdict_of_the_compare_json() -> None:
    """README (`dvfs.compare/4`'s `verdict_*`) names each verdict a row can carry, in the
    analysis's order, and no other."""
    import re

    from dvfs.analysis.compare import VERDICTS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    said = " ".join(
        readme.split("`verdict_*` (", 1)[1].split("), `paired_repeats_*`", 1)[0].split()
    )
    assert tuple(re.findall(r'"([^"]+)"', said)) == VERDICTS, said


def test_the_compare_json_whose_verdicts_or_ratios_changed_has_a_new_schema_id(
    tmp_path: Path,
) -> None:
    """The verdict "too few repeats" and `equal_latency_mean_within_target` came after
    `dvfs.compare/2` (a reader of /2 would meet a verdict it cannot know: /3), and the ratios
    became geometric means after /3 (the same field, another number: /4). README and
    `dvfs compare --help` name the id it writes and what each id changed."""
    import re

    from dvfs.analysis.compare import TOO_FEW

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    readme = " ".join(readme.split())
    path = _twin_cube(repeats_cube(lambda b, r: 0.5), tmp_path)
    schema = json.loads(run("compare", str(path), "--json").stdout)["schema"]
    assert schema == "dvfs.compare/4"
    assert f"`{schema}` has `confidence`" in readme
    changed = readme.split("Changed from `dvfs.compare/2`:", 1)[1].split("Changed from", 1)[0]
    assert f'"{TOO_FEW}"' in changed and "`equal_latency_mean_within_target`" in changed
    changed = readme.split("Changed from `dvfs.compare/3`:", 1)[1].split("Changed from", 1)[0]
    assert "geometric mean" in changed and "`energy_ratio_at_stock`" in changed
    said = {f"dvfs.compare/{n}" for n in re.findall(r"dvfs\.compare/(\d+)", readme)}
    older = {"dvfs.compare/3", "dvfs.compare/2", "dvfs.compare/1"}
    assert said <= {schema} | older  # older ids only as history
    assert f"(schema {schema})" in " ".join(run("compare", "--help").output.split())


def test_the_report_reads_the_verdicts_the_analysis_writes() -> None:
    """The report layer sits below the analyses and keeps its own copies of the verdicts it
    branches on ("too slow", "too few repeats" cells): a verdict renamed in one place only
    would make those cells "-" unseen."""
    from dvfs.analysis import compare as analysis
    from dvfs.report import compare as report

    assert (report.NOT_WITHIN, report.TOO_FEW) == (analysis.NOT_WITHIN, analysis.TOO_FEW)


def test_one_repeat_is_judged_by_the_intervals_its_cells_state() -> None:
    """A cube of one repeat has no interval over repeats; its cells state their own
    (energy_per_token_rel_ci). EAGLE-3 at 0.997x of none with cells known to +-5% was said to
    save (the point value below 1), and at 1.0005x to cost: both are within noise. 0.8x and
    1.2x, beyond the cells' intervals, still save and cost; a cube whose cells state none is
    judged on the point value, as before."""
    ratio = {1: 0.997, 8: 1.0005, 64: 0.8, 128: 1.2}
    ds = make_cube(
        clocks=CLOCKS,
        batches=list(ratio),
        drafters=["none", "eagle3"],
        energy=lambda c, p, b, d, k, r: ratio[b] if d == "eagle3" else 1.0,
    )
    point = compare(ds).sel(drafter="eagle3", corpus="code")
    assert [str(v) for v in point["verdict_at_stock"].values] == [SAVES, LOSES, SAVES, LOSES]
    ds["energy_per_token_rel_ci"] = xr.full_like(ds["energy_per_token_j"], 0.05)
    at = compare(ds).sel(drafter="eagle3", corpus="code")
    assert [str(v) for v in at["verdict_at_stock"].values] == [
        WITHIN_NOISE,
        WITHIN_NOISE,
        SAVES,
        LOSES,
    ]
    width = math.exp(math.hypot(0.05, 0.05))
    low, high = (float(at[f"energy_ratio_at_stock_{e}"].sel(batch=1)) for e in ("low", "high"))
    assert (low, high) == (pytest.approx(0.997 / width), pytest.approx(0.997 * width))
    assert int(at["break_even_batch_equal_clock"]) == 1  # 0.997x no longer counts as saving
    assert str(at["break_even_equal_clock"].item()) == (
        "saves at batch 64; within noise at batches 1, 8"
    )
