"""The headroom search reads numpy arrays pulled from the cube once (`_cells`) and bounds every
setting at once (`statistic_bounds`, `upper_bounds`, `finite_means`): the same numbers, to the
last bit, as the xarray helpers and the one-setting statistics they replaced, which stay in the
package and serve as the reference here."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cubes import make_cube
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.analysis import headroom as hr
from dvfs.analysis.bounds import (
    finite_mean,
    finite_means,
    lower_bound,
    meets,
    meets_all,
    paired_ratios,
    t_quantile,
    upper_bound,
    upper_bounds,
)
from dvfs.analysis.targets import Target

#: Values that trip exact summation: signed zeros, infinities, overflow, the tiniest float.
AWKWARD = [math.nan, 0.0, -0.0, 1.0, 1e308, -1e308, math.inf, -math.inf, 5e-324, 0.1, 0.2, 3.0]


def bits(values: object) -> bytes:
    return np.asarray(values, dtype=np.float64).tobytes()


def outcome(f, *args) -> object:
    """The value, or the type of the error raised."""
    try:
        return f(*args)
    except (ValueError, OverflowError) as exc:
        return type(exc)


rows = st.integers(1, 4).flatmap(
    lambda r: st.lists(
        st.lists(
            st.one_of(
                st.sampled_from(AWKWARD), st.floats(-1e3, 1e3, allow_nan=False), st.just(math.nan)
            ),
            min_size=r,
            max_size=r,
        ),
        min_size=1,
        max_size=6,
    )
)


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # inf - inf, overflow
@settings(max_examples=300, deadline=None)
@given(rows, st.sampled_from([0.95, 0.975, 0.8]))
def test_the_row_statistics_are_the_one_row_functions_bit_for_bit(
    values: list[list[float]], confidence: float
) -> None:
    x = np.array(values)
    means = [outcome(finite_mean, row) for row in x]
    bounds = [outcome(upper_bound, row, confidence) for row in x]
    errors = {v for v in means + bounds if isinstance(v, type)}
    if errors:  # the row function raises (fsum: inf - inf, overflow): so does the whole
        with pytest.raises(tuple(errors)):
            finite_means(x)
            upper_bounds(x, confidence)
        return
    assert bits(finite_means(x)) == bits(means)
    got, count = upper_bounds(x, confidence)
    assert bits(got) == bits(bounds)
    assert count.tolist() == [int(np.count_nonzero(~np.isnan(row))) for row in x]


def test_rows_not_needed_are_not_computed() -> None:
    x = np.array([[math.inf, -math.inf, 1.0], [1.0, 2.0, 4.0]])  # the first would raise
    need = np.array([False, True])
    assert bits(upper_bounds(x, 0.95, need)[0]) == bits([math.nan, upper_bound(x[1], 0.95)])
    assert bits(finite_means(x, need)) == bits([math.nan, finite_mean(x[1])])


def test_rows_without_values_have_no_statistic() -> None:
    empty = np.empty((2, 0))
    assert bits(finite_means(empty)) == bits([finite_mean(row) for row in empty])
    got, count = upper_bounds(empty, 0.95)
    assert bits(got) == bits([upper_bound(row, 0.95) for row in empty])
    assert count.tolist() == [0, 0]


@given(st.lists(st.sampled_from(AWKWARD), min_size=1, max_size=8), st.floats(0.5, 100))
def test_meets_all_is_meets(bounds: list[float], threshold: float) -> None:
    for strict in (False, True):
        got = meets_all(np.array(bounds), threshold, strict=strict).tolist()
        assert got == [meets(b, threshold, strict=strict) for b in bounds]


def test_tabulated_quantiles_are_scipys_to_the_last_bit() -> None:
    from scipy import stats

    from dvfs.measure.tquantiles import CONFIDENCES, MAX_DOF

    for c in CONFIDENCES:
        level = (1 + c) / 2
        for dof in range(1, MAX_DOF + 1):
            assert bits(t_quantile(level, dof)) == bits(float(stats.t.ppf(level, dof)))
    assert t_quantile(0.8, 3) == float(stats.t.ppf(0.8, 3))  # not in the table


def test_a_search_at_the_usual_confidence_does_not_import_scipy_stats() -> None:
    """scipy.stats costs most of a second to import; the table holds the usual levels."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r});"
        "from cubes import make_cube;"
        "from dvfs.analysis.headroom import headroom; from dvfs.analysis.targets import Target;"
        "c = make_cube(clocks=[1000, 2000], repeats=3, drafters=['none', 'x']);"
        "r = headroom(c, target=Target()); headroom(c, target=Target('vs-baseline'));"
        "assert int(r['repeats'].max()) == 3; print('scipy.stats' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the cube's arrays against the xarray helpers ---------------------------------------------


def awkward_cube(seed: int, repeats: int, quality: bool, power: bool, stock_swept: bool):
    rng = np.random.default_rng(seed)
    shape = (3, 2, 2, 2, 1, repeats)  # clocks, limits, batches, drafters, corpora, repeats
    latency = rng.uniform(8, 14, shape)
    latency[rng.random(shape) < 0.1] = math.nan  # missing cells
    energy = rng.uniform(0.5, 1.0, shape)
    bad = rng.random(shape) < 0.15
    axes = ([1000, 1500, 2000], [300.0, 700.0], [1, 8], ["none", "eagle"], ["code"])

    def cell(values: np.ndarray):
        """A make_cube function reading `values` at a cell's coordinates."""
        return lambda *at: values[
            (*(ax.index(v) for ax, v in zip(axes, at[:5], strict=True)), at[5])
        ]

    cube = make_cube(
        clocks=axes[0],
        limits=axes[1],
        batches=axes[2],
        drafters=axes[3],
        corpora=axes[4],
        repeats=repeats,
        latency=cell(latency),
        energy=cell(energy),
        valid=cell(~bad),
        power_max=cell(rng.uniform(250, 720, shape)) if power else None,
        quality=cell(rng.integers(0, 1 << 10, shape).astype(float)) if quality else None,
        stock_clock=None if stock_swept else 2100,
    )
    status = cube["cell_status"].values
    status[(status == 0) & (rng.random(shape) < 0.5)] = 2  # some missing cells failed
    return cube


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(1, 3),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from(hr.KNOBS),
    st.sampled_from(["preserve", "vs-baseline", "slo"]),
    st.booleans(),
)
def test_the_cells_are_what_the_xarray_helpers_say(
    seed: int,
    repeats: int,
    quality: bool,
    power: bool,
    stock_swept: bool,
    knob: str,
    mode: str,
    grid_from_data: bool,
) -> None:
    cube = awkward_cube(seed, repeats, quality, power, stock_swept)
    target = Target(mode, baseline="eagle", limit_ms=11.0 if mode == "slo" else None)
    ref = hr.reference_setting(cube)
    cells = hr._cells(cube, target, ref, knob, grid_from_data=grid_from_data)
    sub = cube
    if knob == "sm_clock":
        sub = cube.sel(power_limit=[ref.power_limit])
    elif knob == "power_limit":
        sub = cube.sel(sm_clock=[ref.sm_clock])
    order, settings_order = list(hr.ORDER), list(hr.ORDER[:-1])
    ok = hr.valid_mask(sub)
    invalid = hr.invalid_settings(sub)
    measured = sub["cell_status"] == 1
    waiting = hr.not_measured(sub, grid_from_data=grid_from_data).any("repeat") & ~invalid
    latency = sub["tpot_ms"].sel(quantile=0.5).where(ok)

    def same(got: np.ndarray, want) -> None:
        want = np.asarray(want)
        assert got.shape == want.shape
        if want.dtype.kind == "f":
            assert bits(got) == bits(want)
        else:
            assert got.tolist() == want.tolist()

    same(cells.ok, ok.transpose(*order).values)
    same(cells.invalid, invalid.transpose(*settings_order).values)
    same(cells.unmeasured, waiting.transpose(*settings_order).values)
    flags = hr.invalid_flags(sub, measured & ~ok)
    same(cells.flags, flags.transpose(*settings_order).values)
    same(cells.not_binding, hr.cap_not_binding(sub, ok).transpose(*settings_order).values)
    same(cells.latency, latency.transpose(*order).values)
    same(cells.energy, sub["energy_per_token_j"].where(ok).transpose(*order).values)
    same(cells.clocks, sub["sm_clock"].values.astype(int))
    same(cells.limits, sub["power_limit"].values.astype(float))
    at_ref = {"sm_clock": ref.sm_clock, "power_limit": ref.power_limit}
    same(cells.reference_problems, hr.reference_problems(cube, at_ref, target))
    # the stock energy: the reference's usable repeats, none where it is ruled out
    ref_ok = hr.valid_mask(cube).sel(at_ref) & ~hr.ruled_out_settings(cube).sel(at_ref)
    stock = cube["energy_per_token_j"].sel(at_ref).where(ref_ok)
    same(cells.stock_energy, stock.transpose(*hr.GROUP_DIMS, "repeat").values)


def old_statistic_bound(lat, ref_lat, paired, mode, confidence, min_repeats):
    """The one-setting statistic the search used before it bounded every setting at once."""
    if mode == "vs-baseline" and not paired:
        mine, base = lat[~np.isnan(lat)], ref_lat[~np.isnan(ref_lat)]
        if len(mine) < min_repeats or len(base) < min_repeats:
            return math.nan, len(mine)
        two_sided = (1 + confidence) / 2
        top = upper_bound(mine, two_sided)
        bottom = lower_bound(base, two_sided)
        return (top / bottom if bottom > 0 else math.inf), len(mine)
    x = lat[~np.isnan(lat)] if mode == "slo" else paired_ratios(lat, ref_lat)
    if len(x) < min_repeats:
        return math.nan, len(x)
    return upper_bound(x, confidence), len(x)


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # x / 0 ratios
@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 10_000),
    st.integers(1, 4),
    st.sampled_from(["preserve", "vs-baseline", "slo"]),
    st.sampled_from([0.5, 0.9, 0.95]),
)
def test_every_setting_bounded_at_once_is_each_bounded_alone(
    seed: int, repeats: int, mode: str, confidence: float
) -> None:
    rng = np.random.default_rng(seed)
    shape = (2, 3, 1, 3, 2, repeats)
    latency = rng.uniform(5, 15, shape)
    latency[rng.random(shape) < 0.25] = math.nan
    latency[rng.random(shape) < 0.05] = 0.0
    reference = rng.uniform(5, 15, (2, 3, 1, repeats))
    reference[rng.random(reference.shape) < 0.25] = math.nan
    reference[rng.random(reference.shape) < 0.05] = 0.0
    if mode == "vs-baseline":  # every drafter is judged against the baseline's reference
        reference = np.broadcast_to(reference[:, :1], reference.shape)
    own = np.array([True, False, False])
    need = rng.random(shape[:-1]) < 0.8
    min_repeats = min(2, repeats)
    target = Target(mode, limit_ms=10.0 if mode == "slo" else None)
    got, n = hr.statistic_bounds(
        latency,
        reference,
        target=target,
        confidence=confidence,
        min_repeats=min_repeats,
        own=own,
        need=need,
    )
    for idx in np.ndindex(need.shape):
        if not need[idx]:
            assert math.isnan(got[idx])
            continue
        paired = mode != "vs-baseline" or bool(own[idx[1]])
        want = old_statistic_bound(
            latency[idx], reference[idx[:3]], paired, mode, confidence, min_repeats
        )
        assert bits(got[idx]) == bits(want[0]) and n[idx] == want[1]
