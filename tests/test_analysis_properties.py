"""Properties of the analysis maths over small random cubes: the headroom search, its bounds,
the comparison of two arms and the caps planned from headroom.

Each cube is drawn whole (latencies, energies, missing and invalid cells, stated intervals,
peak powers); each property is one promise a module's docstring or the README makes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import xarray as xr
from cubes import as_twin_sweep, make_cube
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dvfs.analysis.bounds import ratio_interval, upper_bound
from dvfs.analysis.compare import LOSES, SAVES, compare
from dvfs.analysis.headroom import headroom, reference_setting
from dvfs.analysis.targets import Target
from dvfs.caps.planning import plan_caps, plan_per_batch
from dvfs.cube.schema import CELL_DIMS
from dvfs.errors import CapsError
from dvfs.measure.meter import Q_POWER_CAPPED
from dvfs.report.headroom import headroom_document

CLOCKS = [900, 1200, 1500, 1800, 1980]
LIMITS = [300.0, 450.0, 550.0, 700.0]
DRAFTERS = ["none", "eagle3"]
BATCHES = [1, 4]
CORPORA = ["code", "math"]


@st.composite
def cubes(
    draw: Any, *, power_max: bool | None = None, holes: bool = True, corpora: int = 1
) -> xr.Dataset:
    """A small cube: 2-4 clocks, 1-3 power limits, two batches and drafters, 1-3 repeats;
    latencies and energies drawn per cell, some cells missing or invalid (`holes`), each
    cell's stated interval and peak power drawn or left out (`power_max`: always, never, or
    either where None)."""
    clocks = sorted(draw(st.sets(st.sampled_from(CLOCKS), min_size=2, max_size=4)))
    limits = sorted(draw(st.sets(st.sampled_from(LIMITS), min_size=1, max_size=3)))
    repeats = draw(st.integers(1, 3))
    shape = (len(clocks), len(limits), len(BATCHES), len(DRAFTERS), corpora, repeats)
    size = int(np.prod(shape))
    lat = np.array(draw(st.lists(st.floats(1.0, 30.0), min_size=size, max_size=size)))
    en = np.array(draw(st.lists(st.floats(0.05, 2.0), min_size=size, max_size=size)))
    lat, en = lat.reshape(shape), en.reshape(shape)
    if holes:
        gone = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size))).reshape(shape)
        gone &= np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size))).reshape(
            shape
        )  # about a quarter
        gone &= np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size))).reshape(
            shape
        )  # about an eighth
        lat = np.where(gone, np.nan, lat)
        bad = np.array(
            draw(st.lists(st.sampled_from([False] * 7 + [True]), min_size=size, max_size=size))
        ).reshape(shape)
    else:
        bad = np.zeros(shape, dtype=bool)
    cube = make_cube(
        clocks=clocks,
        limits=limits,
        batches=BATCHES,
        drafters=DRAFTERS,
        corpora=CORPORA[:corpora],
        repeats=repeats,
        latency=lat,
        energy=en,
    )
    if draw(st.booleans()):  # a grid without stock, or with settings above a stock limit
        cube.attrs["stock_sm_clock_mhz"] = draw(st.sampled_from([max(clocks), 2100]))
        cube.attrs["stock_power_limit_w"] = draw(st.sampled_from([*limits, 650.0]))
    cube["valid"] = cube["valid"].where(
        ~xr.DataArray(bad, dims=CELL_DIMS) | cube["valid"].isnull(), 0.0
    )
    if draw(st.booleans()):
        ci = np.array(draw(st.lists(st.floats(0.0, 0.3), min_size=size, max_size=size)))
        cube["energy_per_token_rel_ci"] = (CELL_DIMS, ci.reshape(shape))
    with_peak = draw(st.booleans()) if power_max is None else power_max
    if with_peak:
        fraction = np.array(draw(st.lists(st.floats(0.5, 1.1), min_size=size, max_size=size)))
        peak = fraction.reshape(shape) * np.array(limits)[None, :, None, None, None, None]
        cube["power_max_w"] = (CELL_DIMS, peak)
        capped = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)))
        cube["quality"] = (
            CELL_DIMS,
            np.where(capped.reshape(shape), Q_POWER_CAPPED, 0).astype(np.int64),
        )
    return cube


targets = st.one_of(
    st.builds(lambda s: Target("preserve", slack=s), st.floats(0.0, 0.5)),
    st.builds(lambda s: Target("vs-baseline", slack=s), st.floats(0.0, 0.5)),
    st.builds(lambda ms: Target("slo", limit_ms=ms), st.floats(2.0, 30.0)),
)

#: The answers a headroom row gives: the setting chosen and the lowest feasible one.
ANSWERS = (
    "feasible",
    "feasible_settings",
    "judged_settings",
    "chosen_sm_clock",
    "chosen_power_limit",
    "lowest_feasible_sm_clock",
    "lowest_feasible_power_limit",
    "saving",
    "chosen_energy_per_token_j",
    "latency_bound",
    "saving_within_noise",
    "saving_set_aside_within_noise",
    "cap_not_binding",
    "headroom_mhz",
    "headroom_w",
    "chosen_latency_ms",
    "target_ms",
    "stock_energy_per_token_j",
    "short_settings",
    "unmeasured_settings",
    "invalid_settings",
    "headroom_mhz_is_lower_bound",
    "headroom_w_is_lower_bound",
    "chosen_at_grid_edge",
    "chosen_invalid_below",
)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def answers(result: xr.Dataset) -> dict[tuple[Any, ...], dict[str, float]]:
    """Each row's answers, by its labels (not its place on the axes)."""
    out = {}
    for b in result["batch"].values:
        for d in result["drafter"].values:
            for c in result["corpus"].values:
                point = result.sel(batch=b, drafter=d, corpus=c)
                out[(int(b), str(d), str(c))] = {k: float(point[k]) for k in ANSWERS}
    return out


@settings(max_examples=30)
@given(cubes(), targets, st.sampled_from(["both", "sm_clock", "power_limit"]), st.data())
def test_the_order_of_the_cubes_axes_changes_no_answer(cube, target, knob, data) -> None:
    """Axes reversed and the variables' dimensions transposed: the same cube, so the same
    answers, label by label."""
    flipped = cube.isel(
        {d: slice(None, None, -1) for d in ("sm_clock", "power_limit", "batch", "drafter")}
    )
    order = data.draw(st.permutations(list(CELL_DIMS)))
    flipped = flipped.transpose(*order, ...)
    first = answers(headroom(cube, target=target, knob=knob))
    second = answers(headroom(flipped, target=target, knob=knob))
    assert first.keys() == second.keys()
    for key, row in first.items():
        for name, value in row.items():
            assert same(value, second[key][name]), (key, name, value, second[key][name])


def chosen_cells(cube: xr.Dataset, result: xr.Dataset, key: tuple[Any, ...]) -> xr.Dataset:
    b, d, c = key
    row = result.sel(batch=b, drafter=d, corpus=c)
    return cube.sel(
        batch=b,
        drafter=d,
        corpus=c,
        sm_clock=int(row["chosen_sm_clock"]),
        power_limit=float(row["chosen_power_limit"]),
    )


@settings(max_examples=30)
@given(cubes(), targets, st.sampled_from([0.8, 0.95, 0.99]))
def test_the_chosen_setting_meets_the_target_on_its_own_bound(cube, target, confidence) -> None:
    """The chosen setting's latency bound, computed again from its cells with `upper_bound`,
    is the one stated and meets the target; its cells are measured and valid (the reference
    aside, which its own usable repeats judge); its saving is 1 - energy / paired stock."""
    result = headroom(cube, target=target, confidence=confidence)
    ref = reference_setting(cube)
    repeats = int(cube.sizes["repeat"])
    threshold = target.limit_ms if target.mode == "slo" else 1 + target.slack
    for key, row in answers(result).items():
        if not row["feasible"]:
            assert math.isnan(row["chosen_sm_clock"])
            continue
        cells = chosen_cells(cube, result, key)
        usable = (cells["valid"] > 0) & (cells["cell_status"] == 1)
        at_ref = (
            int(row["chosen_sm_clock"]) == ref.sm_clock
            and float(row["chosen_power_limit"]) == ref.power_limit
        )
        if not at_ref:  # one invalid repeat disqualifies a setting
            assert bool(usable[cells["cell_status"] == 1].all())
        latency = cells[target.variable].sel(quantile=target.quantile).where(usable).values
        if target.mode == "slo":
            x = latency
        else:
            b, d, c = key
            base = d if target.mode == "preserve" else target.baseline
            stock = cube.sel(
                batch=b, drafter=base, corpus=c, sm_clock=ref.sm_clock, power_limit=ref.power_limit
            )
            stock_ok = (stock["valid"] > 0) & (stock["cell_status"] == 1)
            stock_lat = stock[target.variable].sel(quantile=target.quantile).where(stock_ok).values
            if target.mode == "vs-baseline" and d != base:  # unpaired, each mean bounded
                side = (1 + confidence) / 2
                mine, theirs = latency[~np.isnan(latency)], stock_lat[~np.isnan(stock_lat)]
                assert min(len(mine), len(theirs)) >= min(2, repeats)
                low = 2 * theirs.mean() - upper_bound(theirs, side)
                bound = upper_bound(mine, side) / low if low > 0 else math.inf
                assert row["latency_bound"] == pytest.approx(bound, rel=1e-9)
                assert bound <= threshold * (1 + 1e-9)
                continue
            x = latency / stock_lat
        x = x[~np.isnan(x)]
        assert len(x) >= min(2, repeats)
        bound = upper_bound(x, confidence)
        assert row["latency_bound"] == pytest.approx(bound, rel=1e-12)
        assert bound <= threshold * (1 + 1e-9)
        if not math.isnan(row["saving"]):
            stock = result.sel(batch=key[0], drafter=key[1], corpus=key[2])
            paired = float(stock["paired_stock_energy_per_token_j"])
            assert row["saving"] == pytest.approx(1 - row["chosen_energy_per_token_j"] / paired)


@settings(max_examples=25)
@given(
    cubes(power_max=False),
    targets,
    st.floats(0.01, 0.5),
    st.sampled_from(["sm_clock", "power_limit"]),
    st.data(),
)
def test_a_dominated_setting_below_the_grid_changes_no_choice(cube, target, worse, dim, data):
    """A clock (or power limit) added below the grid whose every cell is slower and spends
    more than the lowest one's (by the same factor, repeat by repeat, the same cells missing
    or invalid) is never chosen, and changes no choice. (Never at a stock value: that would
    move the reference.)"""
    low = cube[dim].values.min()
    new = cube.sel({dim: [low]}).assign_coords({dim: [low - (100 if dim == "sm_clock" else 25)]})
    for name in ("tpot_ms", "itl_ms", "ttft_ms", "energy_per_token_j"):
        new[name] = new[name] * (1 + worse)
    bigger = xr.concat([new, cube], dim=dim)
    bigger.attrs = dict(cube.attrs)
    knob = data.draw(st.sampled_from(["both", dim]))
    before = answers(headroom(cube, target=target, knob=knob))
    after = answers(headroom(bigger, target=target, knob=knob))
    for key, row in before.items():
        for name in (
            "feasible",
            "chosen_sm_clock",
            "chosen_power_limit",
            "saving",
            "chosen_energy_per_token_j",
            "saving_within_noise",
        ):
            assert same(row[name], after[key][name]), (key, name, row[name], after[key][name])


@settings(max_examples=25)
@given(cubes(), targets, st.floats(1.0, 2.0))
def test_a_looser_target_never_chooses_a_more_intrusive_setting_for_less(cube, target, factor):
    """Loosening the target only adds feasible settings (their bounds do not depend on it):
    the headroom never shrinks, and the choice spends no more, but where the docstring says it
    may (a cap that never bound, or a saving within the noise, kept at the tight target)."""
    tight = headroom(cube, target=target)
    loose = headroom(cube, target=target.loosened(factor))
    after = answers(loose)
    for key, a in answers(tight).items():
        b = after[key]
        assert b["feasible_settings"] >= a["feasible_settings"]
        if not a["feasible"]:
            continue
        assert b["feasible"]
        assert b["lowest_feasible_sm_clock"] <= a["lowest_feasible_sm_clock"]
        assert b["lowest_feasible_power_limit"] <= a["lowest_feasible_power_limit"]
        if a["saving_within_noise"] or a["cap_not_binding"] or b["cap_not_binding"]:
            continue
        assert b["chosen_energy_per_token_j"] <= a["chosen_energy_per_token_j"] * (1 + 1e-3)


@settings(max_examples=30)
@given(
    st.lists(st.floats(0.5, 2.0), min_size=2, max_size=5),
    st.floats(1.0, 5.0),
    st.sampled_from([0.8, 0.9, 0.95, 0.99]),
)
def test_a_noisier_sample_never_gets_a_tighter_bound(values, spread, confidence) -> None:
    """The same mean, each value's distance from it scaled up: the upper bound does not fall,
    the lower end of the ratio interval does not rise and its upper end does not fall."""
    x = np.array(values)
    mean = x.mean()
    noisier = mean + (x - mean) * spread
    assume((noisier > 0).all())
    assert upper_bound(noisier, confidence) >= upper_bound(x, confidence) - 1e-12
    ones = np.ones(len(x))
    low, high, _ = ratio_interval(x, ones, ones * np.nan, ones * np.nan, confidence)
    low2, high2, _ = ratio_interval(noisier, ones, ones * np.nan, ones * np.nan, confidence)
    # the interval is of the mean log ratio, so compare on logs of the values themselves
    logs, logs2 = np.log(x), np.log(noisier)
    if np.std(logs2) >= np.std(logs) and math.isclose(logs.mean(), logs2.mean()):
        assert low2 <= low * (1 + 1e-12)
        assert high2 >= high * (1 - 1e-12)


@settings(max_examples=30)
@given(
    st.lists(st.one_of(st.floats(0.05, 2.0), st.just(math.nan)), min_size=1, max_size=4),
    st.lists(st.one_of(st.floats(0.05, 2.0), st.just(math.nan)), min_size=4, max_size=4),
    st.lists(st.one_of(st.floats(0.0, 0.3), st.just(math.nan)), min_size=8, max_size=8),
    st.sampled_from([0.8, 0.95, 0.99]),
)
def test_the_ratio_interval_of_the_swapped_arms_is_the_reciprocal(a, b, ci, confidence) -> None:
    n = len(a)
    v, r = np.array(a), np.array(b[:n])
    low, high, pairs = ratio_interval(v, r, np.array(ci[:n]), np.array(ci[4 : 4 + n]), confidence)
    low2, high2, pairs2 = ratio_interval(
        r, v, np.array(ci[4 : 4 + n]), np.array(ci[:n]), confidence
    )
    assert pairs == pairs2
    if math.isnan(low):
        assert math.isnan(low2) and math.isnan(high2)
        return
    assert low <= high
    assert low2 == pytest.approx(1 / high, rel=1e-9)
    assert high2 == pytest.approx(1 / low, rel=1e-9)


def two_arm_cube(mine: np.ndarray, base: np.ndarray, repeats: int) -> xr.Dataset:
    """Two clocks, batches 1, 4 and 16, the drafters `none` (energies `base`) and `eagle3`
    (`mine`), both at 10 ms at stock: per (clock, batch, repeat)."""
    clocks, batches = [1500, 1980], [1, 4, 16]

    def energy(c, p, b, d, k, r):  # type: ignore[no-untyped-def]
        arm = mine if d == "eagle3" else base
        return arm[clocks.index(c), batches.index(b), r]

    return make_cube(
        clocks=clocks,
        batches=batches,
        drafters=["none", "eagle3"],
        repeats=repeats,
        latency=lambda c, *_: 10.0 * 1980 / c,
        energy=energy,
    )


@settings(max_examples=10)  # three comparisons an example
@given(st.integers(1, 3), st.data())
def test_equal_arms_neither_save_nor_cost_and_swapping_flips_the_verdict(repeats, data) -> None:
    """Two arms with the same energies: a ratio of 1 at stock and at equal latency, never
    "saves"; two arms swapped: the reciprocal ratio at stock and the opposite verdict."""
    size = 2 * 3 * repeats
    draws = st.lists(st.floats(0.05, 2.0), min_size=size, max_size=size)
    mine = np.array(data.draw(draws)).reshape(2, 3, repeats)
    base = np.array(data.draw(draws)).reshape(2, 3, repeats)
    equal = compare(two_arm_cube(mine, mine, repeats)).sel(drafter="eagle3", corpus="code")
    assert (equal["energy_ratio_at_stock"] == 1).all()
    assert (equal["energy_ratio_equal_latency"] == 1).all()
    assert not (equal["verdict_at_stock"] == SAVES).any()
    assert not (equal["verdict_equal_latency"] == SAVES).any()

    there = compare(two_arm_cube(mine, base, repeats)).sel(drafter="eagle3", corpus="code")
    back = compare(
        two_arm_cube(base, mine, repeats).assign_coords(drafter=["eagle3", "none"]),
        baseline="eagle3",
    ).sel(drafter="none", corpus="code")
    ratio, ratio_back = there["energy_ratio_at_stock"].values, back["energy_ratio_at_stock"].values
    np.testing.assert_allclose(ratio * ratio_back, 1.0, rtol=1e-12)
    flip = {SAVES: LOSES, LOSES: SAVES}
    for v, w in zip(there["verdict_at_stock"].values, back["verdict_at_stock"].values, strict=True):
        if repeats > 1 or v == SAVES:  # one repeat judges the point value: 1 itself costs
            assert w == flip.get(v, v)


@settings(max_examples=25)
@given(cubes(corpora=2), targets, st.sampled_from(["both", "sm_clock", "power_limit"]), st.data())
def test_a_plan_caps_within_the_grid_below_stock_and_safe_for_every_corpus(
    cube, target, knob, data
) -> None:
    """A cap planned from a headroom document (`dvfs cap plan`, one batch, and `--per-batch`)
    is None (stock) or a value the grid swept below the GPU's stock, no lower than any
    corpus's chosen value; the two plans give one setting per batch."""
    stock_clock = data.draw(st.sampled_from([None, 1980, 2100]))
    if stock_clock is not None:
        cube.attrs["stock_sm_clock_mhz"] = stock_clock
    cube = as_twin_sweep(cube, uuid="GPU-aaaa", gpu_name="NVIDIA H100 80GB HBM3", campaign="p")
    doc = headroom_document(headroom(cube, target=target, knob=knob), cube)
    ref = reference_setting(cube)
    stock = (ref.stock_sm_clock, ref.stock_power_limit)
    grid = (
        [int(c) for c in cube["sm_clock"].values],
        [float(p) for p in cube["power_limit"].values],
    )
    for drafter in DRAFTERS:
        try:
            plan = plan_per_batch(doc, drafter=drafter, corpus="worst-case")
        except CapsError as exc:  # every step stock, and a note why
            assert "nothing to govern" in str(exc)
            continue
        for step in plan.steps:
            rows = [r for r in doc["rows"] if r["batch"] == step.batch and r["drafter"] == drafter]
            setting = (step.setting.sm_clock_mhz, step.setting.power_limit_w)
            for k, value in enumerate(setting):
                if value is None:
                    continue
                assert value in grid[k] and value < stock[k]
                key = ("sm_clock_mhz", "power_limit_w")[k]
                assert all(value >= r["chosen"][key] for r in rows)
            try:
                caps = plan_caps(doc, batch=step.batch, drafter=drafter, corpus="worst-case")
            except CapsError:
                assert step.setting.is_stock
                continue
            (cap,) = caps.caps
            assert (cap.sm_clock_max_mhz, cap.power_limit_w) == setting


@settings(max_examples=30)
@given(
    cubes(holes=False),
    st.sampled_from([*CLOCKS, 2100]),
    st.sampled_from([*LIMITS, 650.0]),
    st.sampled_from([0.0, 0.2]),
)
def test_the_reference_is_stock_on_every_knob_the_grid_swept_it_on(
    cube, stock_clock, stock_limit, slack
) -> None:
    """Where the grid lacks stock, the reference is the closest setting the cube has: the
    stock value of each knob the grid holds it on, the top of the grid on the other; never
    a setting above a stock value the grid holds, nor said "not swept" where it was."""
    cube.attrs.update(stock_sm_clock_mhz=stock_clock, stock_power_limit_w=stock_limit)
    clocks = [int(c) for c in cube["sm_clock"].values]
    limits = [float(p) for p in cube["power_limit"].values]
    ref = reference_setting(cube)
    assert ref.sm_clock == (stock_clock if stock_clock in clocks else max(clocks))
    assert ref.power_limit == (stock_limit if stock_limit in limits else max(limits))
    assert ref.is_stock == (stock_clock in clocks and stock_limit in limits)
    words = ref.describe()
    if stock_clock in clocks:
        assert (
            f"{stock_clock} MHz not swept" not in words
            and f"stock {stock_clock} MHz /" not in words
        )
    if stock_limit in limits:
        assert f"{stock_limit:g} W not swept" not in words
    result = headroom(cube, target=Target("preserve", slack=slack))
    assert result.attrs["reference_power_limit_w"] == ref.power_limit
    for row in answers(result).values():
        if row["feasible"] and len(limits) > 1:
            assert row["lowest_feasible_power_limit"] <= ref.power_limit


def test_a_grid_without_the_stock_clock_is_referenced_at_the_stock_power_limit() -> None:
    """The clock grid stops below stock (1980 MHz) and the power limits swept reach above the
    GPU's stock limit (600 W, the limit found at start, below its maximum): the reference was
    1800 MHz / 700 W, "stock 1980 MHz / 600 W not swept" though 600 W was, every saving counted
    from a power limit above stock and the power headroom from 700 W. It is 1800 MHz / 600 W."""
    cube = make_cube(
        clocks=[1200, 1500, 1800],
        limits=[400.0, 600.0, 700.0],
        stock_clock=1980,
        stock_limit=600.0,
        latency=lambda c, *_: 10.0 * 1980 / c,
        energy=lambda c, p, *_: (c / 1980) ** 2 + p / 1000,
    )
    ref = reference_setting(cube)
    assert (ref.sm_clock, ref.power_limit, ref.is_stock) == (1800, 600.0, False)
    assert ref.describe() == "1800 MHz (top of the grid; stock 1980 MHz not swept) / 600 W (stock)"
    row = headroom(cube, target=Target("preserve", slack=0.3)).sel(
        batch=1, drafter="none", corpus="code"
    )
    assert float(row["stock_energy_per_token_j"]) == pytest.approx((1800 / 1980) ** 2 + 0.6)
    assert float(row["headroom_w"]) == 200.0


@settings(max_examples=25)
@given(cubes(), targets, st.sampled_from(["sm_clock", "power_limit"]))
def test_searching_one_knob_finds_no_setting_searching_both_does_not(cube, target, knob) -> None:
    """`--knob` holds the other knob at the reference: a subset of the settings, each judged
    the same, so no more feasible settings and no lower feasible value."""
    one = answers(headroom(cube, target=target, knob=knob))
    both = answers(headroom(cube, target=target))
    for key, a in one.items():
        b = both[key]
        assert b["feasible_settings"] >= a["feasible_settings"]
        assert b["judged_settings"] >= a["judged_settings"]
        if a["feasible"]:
            assert b["lowest_feasible_sm_clock"] <= a["lowest_feasible_sm_clock"]
            assert b["lowest_feasible_power_limit"] <= a["lowest_feasible_power_limit"]


@settings(max_examples=25)
@given(cubes(), targets, st.sampled_from([(0.8, 0.95), (0.95, 0.99), (0.8, 0.99)]))
def test_more_confidence_never_admits_more_settings(cube, target, levels) -> None:
    low, high = levels
    loose = answers(headroom(cube, target=target, confidence=low))
    strict = answers(headroom(cube, target=target, confidence=high))
    for key, a in strict.items():
        b = loose[key]
        assert a["feasible_settings"] <= b["feasible_settings"]
        if a["feasible"]:
            assert b["lowest_feasible_sm_clock"] <= a["lowest_feasible_sm_clock"]
            assert b["lowest_feasible_power_limit"] <= a["lowest_feasible_power_limit"]


@settings(max_examples=25)
@given(cubes(), targets, st.sampled_from([1e-3, 0.5, 4.0, 1000.0]))
def test_the_energy_unit_changes_no_choice(cube, target, scale) -> None:
    """Every energy per token scaled alike (J to mJ, say): the same choices and savings."""
    scaled = cube.copy(deep=True)
    scaled["energy_per_token_j"] = cube["energy_per_token_j"] * scale
    first = answers(headroom(cube, target=target))
    second = answers(headroom(scaled, target=target))
    for key, a in first.items():
        b = second[key]
        for name in ("chosen_sm_clock", "chosen_power_limit", "saving_within_noise"):
            assert same(a[name], b[name]), (key, name)
        if not math.isnan(a["saving"]):
            assert b["saving"] == pytest.approx(a["saving"], abs=1e-12)


@settings(max_examples=25)
@given(cubes(), targets)
def test_a_rows_answer_depends_on_its_own_cells_alone(cube, target) -> None:
    """Each (batch, drafter, corpus) is judged on its own cells (and, against a baseline, the
    baseline's): a cube cut to one batch gives that batch's rows unchanged."""
    whole = answers(headroom(cube, target=target))
    for b in BATCHES:
        part = answers(headroom(cube.sel(batch=[b]), target=target))
        for key, row in part.items():
            for name, value in row.items():
                assert same(value, whole[key][name]), (key, name)


@settings(max_examples=25)
@given(cubes(), cubes(), targets, st.data())
def test_a_merged_cubes_rows_are_each_gpus_own(first, second, target, data) -> None:
    """Two GPUs' cubes merged (grids and stock settings may differ): each GPU's rows are
    those of its own cube."""
    from dvfs.cube.merge import merge_cubes

    assume(first.sizes["repeat"] == second.sizes["repeat"])
    own = []
    for k, cube in enumerate((first, second)):
        clocks = [int(c) for c in cube["sm_clock"].values]
        limits = [float(p) for p in cube["power_limit"].values]
        cube.attrs["stock_sm_clock_mhz"] = data.draw(st.sampled_from([max(clocks), 2100]))
        cube.attrs["stock_power_limit_w"] = data.draw(st.sampled_from([*limits, 650.0]))
        uuid = f"GPU-{k}{k}{k}{k}0000-0000-0000-0000-000000000000"
        own.append(as_twin_sweep(cube, uuid=uuid, gpu_name="NVIDIA H100 80GB HBM3", campaign="m"))
    merged = headroom(merge_cubes(own), target=target)
    for cube in own:
        alone = answers(headroom(cube, target=target))
        mine = answers(merged.sel(gpu=cube.attrs["gpu_uuids"]))
        for key, row in alone.items():
            for name, value in row.items():
                assert same(value, mine[key][name]), (key, name, value, mine[key][name])


@settings(max_examples=15)
@given(
    st.lists(st.floats(0.3, 3.0), min_size=3, max_size=3, unique=True),
    st.permutations([0, 1, 2]),
)
def test_the_break_even_batch_is_where_a_rising_ratio_crosses_one(ratios, order) -> None:
    """One repeat, no stated interval: each batch's point ratio is judged. Ratios rising with
    the batch and crossing 1 once: the break-even batch is the first at or above 1, whatever
    order the cube's batch axis is in."""
    ratios = sorted(ratios)
    batches = [1, 4, 16]
    mine = np.array([[ratios[k] for k in range(3)]] * 2).reshape(2, 3, 1)
    base = np.ones((2, 3, 1))
    cube = two_arm_cube(mine, base, 1)
    cube = cube.isel(batch=list(order))
    result = compare(cube).sel(drafter="eagle3", corpus="code")
    stops = [b for b, r in zip(batches, ratios, strict=True) if r >= 1]
    expected = stops[0] if stops else math.nan
    assert same(float(result["break_even_batch_equal_clock"]), expected)
    assert same(float(result["break_even_batch_equal_latency"]), expected)
    said = str(result["break_even_equal_clock"].values)
    if not stops:
        assert said == "saves at every batch"
    elif stops[0] == 1:
        assert said == "never saves"
    else:
        assert said == f"saves up to batch {batches[batches.index(stops[0]) - 1]}"


@settings(max_examples=15)
@given(cubes(), st.sampled_from([0.8, 0.95]))
def test_equal_latency_compares_the_settings_headroom_chooses(cube, confidence) -> None:
    """At equal latency each arm sits at headroom's choice for the baseline's stock latency
    (the drafter under --vs-baseline, the baseline under --preserve, one latency for both):
    the ratio is the geometric mean over the repeats valid at both settings of their
    energies' ratio."""
    result = compare(cube, confidence=confidence)
    mine = headroom(cube, target=Target("vs-baseline"), confidence=confidence)
    theirs = headroom(cube, target=Target("preserve"), confidence=confidence)
    usable = (cube["valid"] > 0) & (cube["cell_status"] == 1)
    energy = cube["energy_per_token_j"].where(usable)
    for b in BATCHES:
        for d in DRAFTERS:
            at = {"batch": b, "corpus": "code"}
            one, base = mine.sel(drafter=d, **at), theirs.sel(drafter="none", **at)
            ratio = float(result["energy_ratio_equal_latency"].sel(drafter=d, **at))
            if not (bool(one["feasible"]) and bool(base["feasible"])):
                assert math.isnan(ratio)
                continue
            e = energy.sel(
                drafter=d,
                sm_clock=int(one["chosen_sm_clock"]),
                power_limit=float(one["chosen_power_limit"]),
                **at,
            ).values
            f = energy.sel(
                drafter="none",
                sm_clock=int(base["chosen_sm_clock"]),
                power_limit=float(base["chosen_power_limit"]),
                **at,
            ).values
            both = ~np.isnan(e) & ~np.isnan(f)
            if not both.any():
                assert math.isnan(ratio)
                continue
            expected = math.exp(np.mean(np.log(e[both] / f[both])))
            assert ratio == pytest.approx(expected, rel=1e-9)


@settings(max_examples=25)
@given(cubes(), targets)
def test_with_one_repeat_the_latency_shown_is_the_bound_in_ms(cube, target) -> None:
    """One repeat: no interval, the point value is compared, so the chosen setting's latency
    (ms) is within the target (ms), and its bound is that latency (an SLO's, in ms) or its
    ratio to the reference's (a ratio, compared with 1 + slack)."""
    cube = cube.isel(repeat=[0])
    result = headroom(cube, target=target)
    for b in BATCHES:
        for d in DRAFTERS:
            r = result.sel(batch=b, drafter=d, corpus="code")
            if not bool(r["feasible"]):
                continue
            shown, target_ms = float(r["chosen_latency_ms"]), float(r["target_ms"])
            assert shown <= target_ms * (1 + 1e-9)
            bound = float(r["latency_bound"])
            if target.mode == "slo":
                assert bound == shown
            else:
                assert bound == pytest.approx(shown / float(r["reference_latency_ms"]), rel=1e-12)


@settings(max_examples=10)  # five headroom searches an example
@given(cubes(corpora=2), cubes(corpora=2), targets)
def test_a_merged_documents_caps_are_each_gpus_own(first, second, target) -> None:
    """Two real GPUs' cubes merged: `dvfs cap plan` on the merged headroom document caps
    each GPU (by UUID, or the one --gpu names) as its own cube's document does; it refuses
    (naming the GPU) only where a GPU's own document plans no cap."""
    from dvfs.cube.merge import merge_cubes

    assume(first.sizes["repeat"] == second.sizes["repeat"])
    own = []
    for k, cube in enumerate((first, second)):
        uuid = f"GPU-{k}{k}{k}{k}0000-0000-0000-0000-000000000000"
        cube = as_twin_sweep(cube, uuid=uuid, gpu_name="NVIDIA H100 80GB HBM3", campaign="m")
        own.append(cube.assign_attrs(gpu_backend="nvml"))
    merged = merge_cubes(own)
    doc = headroom_document(headroom(merged, target=target), merged)
    alone = {c.attrs["gpu_uuids"]: headroom_document(headroom(c, target=target), c) for c in own}

    def plan(document: dict[str, Any], b: int, d: str, uuids: tuple[str, ...] = ()) -> Any:
        try:
            caps = plan_caps(document, batch=b, drafter=d, corpus="worst-case", uuids=uuids)
        except CapsError:
            return None
        return {c.uuid: (c.sm_clock_max_mhz, c.power_limit_w) for c in caps.caps}

    for b in BATCHES:
        for d in DRAFTERS:
            each = {u: plan(one, b, d) for u, one in alone.items()}
            for uuid, mine in each.items():
                assert plan(doc, b, d, (uuid,)) == (None if mine is None else {uuid: mine[uuid]})
            every = plan(doc, b, d)
            if every is None:
                assert None in each.values()
            else:
                assert every == {u: p[u] for u, p in each.items() if p is not None}
