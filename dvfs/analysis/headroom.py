"""Latency-preserving DVFS headroom: how far below stock the knobs can go, and what it saves.

For every (batch, drafter, corpus[, gpu]) the search looks at each knob setting measured in
the cube and calls it feasible when its latency meets the target with confidence:

  preserve     x_r = latency(setting, r) / latency(stock, r), paired by repeat: the drafter's
               own stock cell is measured in the same interleaved repeat, so drift cancels;
               feasible <=> mean(x) + t(conf, n-1) sd(x) / sqrt(n) <= 1 + slack
  slo          x_r = latency(setting, r) in ms; the same bound, <= the limit (< for a strict
               limit such as tpot_p90<50ms: a bound exactly on it fails)
  vs-baseline  the baseline drafter ran on another server at another time, so nothing pairs:
               (mean + t se of the setting) / (mean - t se of the baseline's stock), each at
               the two-sided level of the confidence (a conservative ratio bound), <= 1 + slack

With repeats, a setting needs at least two usable repeats (fewer would make the test looser,
not stricter); with one repeat no interval is possible and the point value is compared.
Cells flagged invalid disqualify their setting, but for the reference itself while two or more
of its repeats are usable: those are the reference, and they judge it too.

Two answers come out, both monotone in the target by construction (the statistics do not
depend on the target, so the feasible set only grows as it loosens):
  * headroom: the lowest feasible SM clock (and power limit) below stock;
  * the chosen setting: the feasible one with the least energy per token, and its saving.
Energies within 0.01% of the least (far below any power meter's accuracy) are ties, broken
towards the least intrusive setting (highest clock, then highest power limit).

A power limit the GPU never reached cannot change its energy: a setting whose power limit did
not bind (`cap_not_binding`: every usable repeat's peak power more than CAP_BINDING_MARGIN
below the limit, and no SwPowerCap) is the same operating point as a higher limit at its clock,
and any energy gap between them is noise. Where a higher limit at the same clock was judged
(valid, enough repeats), such a setting is set aside and the choice is made among the others,
so the answer is the highest limit there (stock where swept) unless a lower one bound and
saved energy. The rule is physical, not statistical: it needs no repeats, does not depend on
the target (so the choice stays monotone in it, save where such caps alone meet a tight
target and are kept: a looser one may then choose the higher limit and its noise), and never
hides a cap that bound; a tie rule
on the cells' intervals (energy_per_token_rel_ci) would be a general tie rule, reaching clocks
whose savings are real but uncertain, and ties within an interval do not chain. The headroom
(the lowest feasible limit) is a latency answer and keeps every feasible setting.

A saving the measurement cannot tell apart from zero is no saving: a setting whose energy
ratio to the reference has an interval (`bounds.ratio_interval`: with two or more paired
repeats their Student-t interval at `confidence`, as `dvfs compare` judges; with fewer the
cells' own stated intervals, energy_per_token_rel_ci) that reaches 1 is set aside, and the
choice is made among the settings that save beyond the noise and the reference itself, the
least intrusive. Each setting is tested against the reference alone, so nothing chains; the
test does not depend on the target, so the choice stays monotone in it, save where nothing
but such settings meets the target (an SLO stock misses): the least-energy one is kept, its
saving marked within the noise (`saving_within_noise`), and a looser target that admits the
reference shows no saving. `within_noise_*` give the numbers of the setting set aside (or kept).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.analysis.bounds import (
    finite_mean,
    finite_means,
    level_text,
    meets_all,
    ratio_interval,
    upper_bounds,
)
from dvfs.analysis.targets import Target
from dvfs.cube.schema import CELL_DIMS, STATUS_FAILED, STATUS_MISSING, STATUS_OK
from dvfs.errors import AnalysisError
from dvfs.records import knobs_set, repeat_rule

if TYPE_CHECKING:
    import xarray as xr

    from dvfs.records.header import RepeatRule

#: The per-cell GPU coordinate (dvfs.cube.build.MEASURED_ON; that module imports much more).
MEASURED_ON = "measured_on"

KNOBS = ("both", "sm_clock", "power_limit")
GROUP_DIMS = ("batch", "drafter", "corpus")

#: Energies within this relative distance of the least are ties (0.01%).
ENERGY_TIE = 1e-4

#: A power limit bound a cell unless its peak power (power_max_w) stayed more than this
#: fraction below it (5%; 20 W at 400 W) in every usable repeat with no SwPowerCap seen
#: (power_capped). The peak is the highest power sample (NVML: a 1-second average on
#: Ampere and newer) or round mean: the limiter works on a shorter loop, so a cap that bound
#: in bursts can read a little below it, and the sensor is good to a few watts. The SwPowerCap
#: flag is the direct evidence; the margin covers a sampler that missed it.
CAP_BINDING_MARGIN = 0.05

#: Each cell's stated uncertainty on its energy per token: the relative half-width of its
#: Student-t interval over its rounds (`bounds.ratio_interval` uses it below two repeats).
ENERGY_CI = "energy_per_token_rel_ci"


def gpus_summed(cube: xr.Dataset) -> int:
    """How many GPUs a cell's power_max_w adds up (its server's, engine.tp_size), while a
    power limit is each GPU's: the peak is compared with the limit times this."""
    try:
        return max(int(cube.attrs.get("tp_size", 1)), 1)
    except (TypeError, ValueError):
        return 1


BOUND_DESCRIPTION = (
    "one-sided {conf} Student-t upper bound over {n} paired repeat(s) "
    "of the latency ratio to the reference"
)
#: The bound's words where the cube has one repeat (`bound_description`).
ONE_REPEAT_BOUND = "one repeat: no interval was possible, the point value was compared"
#: Attributes of a headroom result: the fewest and most repeats behind a computed bound
#: (0: none computed), which the bound's description names.
REPEATS_USED = ("bound_repeats_min", "bound_repeats_max")


@dataclass(frozen=True)
class Reference:
    """The setting every analysis compares with: stock, or, where the grid lacks it, the
    closest the cube has (per knob its stock value where swept, else the grid's top). `stock_*`
    are the GPU's stock values, whether swept or not."""

    sm_clock: int
    power_limit: float
    is_stock: bool
    stock_sm_clock: int | None = None
    stock_power_limit: float | None = None

    def describe(self) -> str:
        """The one wording every command uses: "stock (1980 MHz / 700 W)", "top of the grid
        (1800 MHz / 700 W; stock 1980 MHz / 600 W not swept)", or, one knob at stock, each
        as what it is: "1800 MHz (top of the grid; stock 1980 MHz not swept) / 600 W (stock)"."""
        return describe_reference(
            self.sm_clock,
            self.power_limit,
            self.is_stock,
            self.stock_sm_clock,
            self.stock_power_limit,
        )


def describe_reference(
    sm_clock: int | None,
    power_limit: float | None,
    is_stock: bool,
    stock_sm_clock: int | None = None,
    stock_power_limit: float | None = None,
) -> str:
    """A reference setting in words (see `Reference.describe`); None where unknown."""
    setting = f"{sm_clock} MHz / {power_limit:g} W" if power_limit is not None else "unknown"
    if is_stock:
        return f"stock ({setting})"
    missing = []
    if stock_sm_clock is not None and stock_sm_clock != sm_clock:
        missing.append(f"{stock_sm_clock} MHz")
    if stock_power_limit is not None and stock_power_limit != power_limit:
        missing.append(f"{stock_power_limit:g} W")
    clock_stock = stock_sm_clock is not None and stock_sm_clock == sm_clock
    limit_stock = stock_power_limit is not None and stock_power_limit == power_limit
    if power_limit is not None and len(missing) == 1 and (clock_stock or limit_stock):
        # one knob at stock, the other at the grid's top: each said as what it is, so the
        # stock one is not taken for the grid's top
        top = f"(top of the grid; stock {missing[0]} not swept)"
        clock = f"{sm_clock} MHz " + ("(stock)" if clock_stock else top)
        limit = f"{power_limit:g} W " + ("(stock)" if limit_stock else top)
        return f"{clock} / {limit}"
    not_swept = f"; stock {' / '.join(missing)} not swept" if missing else ""
    return f"top of the grid ({setting}{not_swept})"


def reference_setting(cube: xr.Dataset) -> Reference:
    clocks = [int(c) for c in cube["sm_clock"].values]
    limits = [float(p) for p in cube["power_limit"].values]
    stock_clock = int(cube.attrs.get("stock_sm_clock_mhz", max(clocks)))
    stock_limit = float(cube.attrs.get("stock_power_limit_w", max(limits)))
    # Per knob: its stock value where the grid holds it, else the grid's top. Both tops
    # where only one knob's stock is missing would put the reference at a power limit above
    # a stock limit swept (one found lowered at start), said "not swept".
    clock = stock_clock if stock_clock in clocks else max(clocks)
    limit = stock_limit if stock_limit in limits else max(limits)
    is_stock = clock == stock_clock and limit == stock_limit
    return Reference(clock, limit, is_stock, stock_clock, stock_limit)


#: How near the grid's lowest power limit must be to the GPU's lowest allowed one to be it (W):
#: NVML's unit, the milliwatt.
FLOOR_TOLERANCE_W = 1e-3


def _range_floor(cube: xr.Dataset, attr: str) -> float:
    """The first number of a range the cube keeps as `attr` (a list, or its JSON text): the
    GPU's lowest value of that knob as its sweep read it; NaN where the cube records none (a
    merged cube's top level, an older or hand-built cube, a GPU that could not tell)."""
    value = cube.attrs.get(attr)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = json.loads(value)
    try:
        low = float(np.ravel(np.asarray(value, dtype=float))[0])
    except (TypeError, ValueError, IndexError):
        return math.nan
    return low if math.isfinite(low) and low > 0 else math.nan


def lowest_allowed_power_limit(cube: xr.Dataset) -> float:
    """The GPU's lowest allowed power limit (W) (`power_limit_range_w`: min, max, default),
    or NaN. A power limit at it is as low as the GPU goes, so a headroom found there is no
    lower bound the grid cut off."""
    return _range_floor(cube, "power_limit_range_w")


def lowest_supported_clock(cube: xr.Dataset) -> float:
    """The GPU's lowest supported SM clock (MHz) (`sm_clock_range_mhz`: lowest, highest), or
    NaN (a cube of a dvfs before it was recorded too). A clock at it is as low as the GPU
    goes, so a headroom found there is no lower bound the grid cut off."""
    return _range_floor(cube, "sm_clock_range_mhz")


def measured_on(cube: xr.Dataset) -> xr.DataArray:
    """Each cell's GPU UUIDs, comma-joined ("" where unknown: a cube from before the cube
    recorded them, or a hand-built one)."""
    import xarray as xr

    if MEASURED_ON in cube.variables:
        return cube[MEASURED_ON].astype(object)
    shape = tuple(cube.sizes[d] for d in CELL_DIMS)
    return xr.DataArray(
        np.full(shape, "", dtype=object), dims=CELL_DIMS, coords={d: cube[d] for d in CELL_DIMS}
    )


def gpu_set(labels: np.ndarray, mask: np.ndarray) -> frozenset[str]:
    """The GPUs named by `labels` (comma-joined UUIDs) where `mask` holds."""
    return frozenset(
        uuid
        for label, keep in zip(np.ravel(labels), np.ravel(mask), strict=True)
        if keep
        for uuid in str(label).split(",")
        if uuid and uuid != "nan"
    )


def gpu_text(gpus: Iterable[str]) -> str:
    return ",".join(sorted(gpus))


def valid_mask(cube: xr.Dataset) -> xr.DataArray:
    """Cells an analysis may choose: measured, and no invalidating quality flag."""
    valid = cube["valid"].fillna(0) > 0
    measured = cube["cell_status"] == 1 if "cell_status" in cube else valid
    return valid & measured


def invalid_settings(cube: xr.Dataset) -> xr.DataArray:
    """Settings (cells over every axis but `repeat`) with a measured repeat that is invalid:
    one invalid repeat disqualifies the setting, for the headroom search and the figures."""
    ok = valid_mask(cube)
    measured = cube["cell_status"] == 1 if "cell_status" in cube else ok
    return (measured & ~ok).any("repeat")


def ruled_out_settings(cube: xr.Dataset) -> xr.DataArray:
    """Settings the search never judges nor chooses: those with an invalid repeat
    (`invalid_settings`), but for the reference itself while two or more of its repeats (one
    in a cube of one repeat) are usable: those are the reference, the stock energy its
    savings divide by, and a setting it may choose (`headroom`'s `own_reference`). The figures
    draw what this leaves, so they show the stock point the tables state."""
    bad = invalid_settings(cube)
    ref = reference_setting(cube)
    usable = valid_mask(cube).sel(sm_clock=ref.sm_clock, power_limit=ref.power_limit)
    enough = usable.sum("repeat") >= min(2, int(cube.sizes.get("repeat", 1)))
    at_ref = (cube["sm_clock"] == ref.sm_clock) & (cube["power_limit"] == ref.power_limit)
    return bad & ~(at_ref & enough)


#: Axes of the arrays the search reads: a group, a setting, its repeats.
ORDER = (*GROUP_DIMS, "sm_clock", "power_limit", "repeat")


def _values(cube: xr.Dataset, name: str, order: tuple[str, ...] = ORDER) -> np.ndarray:
    """`cube[name]`'s values with its axes in `order`, an axis it lacks broadcast (as
    xarray's arithmetic would): pulled out once, so that masks and reductions are numpy's."""
    var = cube.variables[name]
    present = [d for d in order if d in var.dims]
    values = np.transpose(np.asarray(var.values), [var.dims.index(d) for d in present])
    if len(present) < len(order):
        values = values.reshape([cube.sizes[d] if d in var.dims else 1 for d in order])
        values = np.broadcast_to(values, tuple(cube.sizes[d] for d in order))
    return values


def _where(values: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """`values` as floats, NaN where `keep` does not hold (xarray's `where`, with the values
    widened to float64, which every statistic here does anyway)."""
    return np.where(keep, values.astype(np.float64), np.nan)


def _filled_int(quality: np.ndarray) -> np.ndarray:
    """Quality bits as int64, NaN read as 0 (xarray's `fillna(0).astype(np.int64)`)."""
    if quality.dtype.kind in "fc":
        quality = np.where(np.isnan(quality), 0, quality)
    return quality.astype(np.int64)


@dataclass(frozen=True)
class _Cells:
    """What the search reads of a one-GPU cube, as numpy arrays: per cell over ORDER (the
    settings cut to the knob that may move), per setting over ORDER less `repeat`, and the
    reference cells over (*GROUP_DIMS, repeat); `ref_*` are the baseline drafter's in
    vs-baseline mode, for every drafter. The xarray helpers (`valid_mask`,
    `invalid_settings`, `not_measured`, `invalid_flags`, `cap_not_binding`, `measured_on`,
    `reference_problems`) give the same, one DataArray at a time."""

    clocks: np.ndarray  # the settings' SM clocks (MHz, int) and power limits (W, float)
    limits: np.ndarray
    ok: np.ndarray  # usable cells (valid_mask)
    energy: np.ndarray  # energy per token (J), NaN where not usable
    latency: np.ndarray  # the target's latency (ms), NaN where not usable
    on: np.ndarray  # the cells' GPUs (measured_on)
    invalid: np.ndarray  # settings with an invalid cell (invalid_settings)
    unmeasured: np.ndarray  # settings waiting to be measured, none invalid
    failed: np.ndarray  # of those, settings with a failed cell (a rerun retries it)
    flags: np.ndarray  # invalidating quality bits of the invalid cells, ORed
    not_binding: np.ndarray  # settings whose power limit never bound (cap_not_binding)
    ref_latency: np.ndarray  # reference latency (ms), NaN where not usable
    ref_ok: np.ndarray
    ref_on: np.ndarray
    stock_energy: np.ndarray  # each group's own reference energy (J), NaN where not usable
    # (or the reference is ruled out: `ruled_out_settings`)
    energy_ci: np.ndarray  # each cell's energy_per_token_rel_ci (NaN: none stated)
    stock_ci: np.ndarray  # the reference cells' energy_per_token_rel_ci
    reference_problems: np.ndarray  # per group (reference_problems)


def _cells(
    cube: xr.Dataset, target: Target, ref: Reference, knob: str, *, grid_from_data: bool
) -> _Cells:
    """The arrays `headroom` reads (see `_Cells`), each variable pulled from the cube once."""
    from dvfs.measure.meter import INVALIDATING, Q_POWER_CAPPED

    clock_at = cube.indexes["sm_clock"].get_loc(ref.sm_clock)
    limit_at = cube.indexes["power_limit"].get_loc(ref.power_limit)

    def cut(values: np.ndarray) -> np.ndarray:
        """The settings the knob may reach (axes 3 and 4 of ORDER), as `cube.sel` would."""
        if knob == "sm_clock":
            return values[:, :, :, :, limit_at : limit_at + 1]
        if knob == "power_limit":
            return values[:, :, :, clock_at : clock_at + 1]
        return values

    def at_ref(values: np.ndarray) -> np.ndarray:
        return values[:, :, :, clock_at, limit_at]

    def baseline_row(values: np.ndarray) -> np.ndarray:
        """In vs-baseline mode, the baseline drafter's reference for every drafter."""
        if target.mode != "vs-baseline":
            return values
        b = cube.indexes["drafter"].get_loc(target.baseline)
        return np.broadcast_to(values[:, b : b + 1], values.shape)

    has_status = "cell_status" in cube
    status_all = _values(cube, "cell_status") if has_status else None
    valid_all = _values(cube, "valid")
    ok_all = valid_all > 0  # valid.fillna(0) > 0
    measured_all = ok_all
    if status_all is not None:
        measured_all = status_all == STATUS_OK
        ok_all = ok_all & measured_all
    ok = cut(ok_all)
    bad_cells = cut(measured_all) & ~ok
    invalid = bad_cells.any(axis=-1)  # one invalid repeat disqualifies a setting
    # Not measured yet (a repeat missing or failed, none invalid): an interrupted sweep's
    # cells, which resuming it measures; the grid does not end there (`not_measured`).
    if status_all is not None:
        status = cut(status_all)
        waiting = (status == STATUS_MISSING) | (status == STATUS_FAILED)
        rule = repeat_rule(cube.attrs.get("campaign"))
        if rule is not None and rule.adaptive and "repeat" in cube.variables["cell_status"].dims:
            waiting = waiting & ~_unasked_cells(
                rule,
                cube["repeat"].values.astype(int),
                status,
                lambda: (
                    cut(valid_all),
                    cut(_values(cube, "energy_per_token_j")),
                    cut(_values(cube, "tpot_ms", (*ORDER, "quantile"))[..., 0]),
                ),
            )
        if grid_from_data:
            for dim in data_grid_knobs(cube):
                along = [1] * status_all.ndim
                along[ORDER.index(dim)] = -1
                own = own_settings(cube, dim).reshape(along)
                waiting = waiting & cut(np.broadcast_to(own, status_all.shape))
        unmeasured = waiting.any(axis=-1) & ~invalid
        failed = unmeasured & (waiting & (status == STATUS_FAILED)).any(axis=-1)
    else:
        unmeasured = np.zeros(invalid.shape, dtype=bool)
        failed = unmeasured
    quantile_at = cube.indexes["quantile"].get_loc(target.quantile)
    latency_all = _values(cube, target.variable, (*ORDER, "quantile"))[..., quantile_at]
    energy_all = _values(cube, "energy_per_token_j")
    if ENERGY_CI in cube.variables:
        ci_all = _values(cube, ENERGY_CI).astype(np.float64)
    else:  # a cube of an earlier dvfs: its cells state no interval
        ci_all = np.full(energy_all.shape, np.nan)
    quality = _values(cube, "quality") if "quality" in cube else None
    if quality is None:
        flags = np.zeros(invalid.shape, dtype=np.int64)
    else:  # invalid_flags
        bits = cut(quality)
        if bits.dtype.kind in "iu" and bits.dtype.itemsize > 2:
            bits = bits.astype(np.float64)  # as xarray's `where` promotes it
        flags = np.bitwise_or.reduce(
            _filled_int(np.where(bad_cells, bits, 0)) & INVALIDATING, axis=-1
        )
    clocks, limits = cube["sm_clock"].values, cube["power_limit"].values
    if knob == "sm_clock":
        limits = limits[limit_at : limit_at + 1]
    elif knob == "power_limit":
        clocks = clocks[clock_at : clock_at + 1]
    if "power_max_w" in cube:  # cap_not_binding
        group_limits = limits * gpus_summed(cube) * (1 - CAP_BINDING_MARGIN)
        quiet = cut(_values(cube, "power_max_w")) < group_limits[:, None]
        if quality is not None:
            quiet = quiet & ((_filled_int(cut(quality)) & Q_POWER_CAPPED) == 0)
        not_binding = (quiet | ~ok).all(axis=-1) & ok.any(axis=-1)
    else:
        not_binding = np.zeros(invalid.shape, dtype=bool)
    if MEASURED_ON in cube.variables:
        on_all = _values(cube, MEASURED_ON).astype(object)
    else:
        on_all = np.full(ok_all.shape, "", dtype=object)
    ref_ok = at_ref(ok_all)
    ref_status = at_ref(status_all) if status_all is not None else np.full(ref_ok.shape, STATUS_OK)
    ref_quality = at_ref(quality) if quality is not None else np.full(ref_ok.shape, np.nan)
    ref_latency = at_ref(latency_all)
    usable = baseline_row(ref_ok & _notnull(ref_latency))
    # The stock energy: the reference's usable repeats, but none where an invalid repeat rules
    # the reference out (fewer than two usable, one in a cube of one repeat: `ruled_out_settings`),
    # which no saving divides by and no figure draws.
    ref_measured = at_ref(measured_all)
    ruled_out = (ref_measured & ~ref_ok).any(axis=-1) & (
        ref_ok.sum(axis=-1) < min(2, int(cube.sizes.get("repeat", 1)))
    )
    return _Cells(
        clocks=clocks.astype(int),
        limits=limits.astype(float),
        ok=ok,
        energy=cut(_where(energy_all, ok_all)),
        latency=cut(_where(latency_all, ok_all)),
        on=cut(on_all),
        invalid=invalid,
        unmeasured=unmeasured,
        failed=failed,
        flags=flags,
        not_binding=not_binding,
        ref_latency=baseline_row(_where(ref_latency, ref_ok)),
        ref_ok=baseline_row(ref_ok),
        ref_on=baseline_row(at_ref(on_all)),
        stock_energy=_where(at_ref(energy_all), ref_ok & ~ruled_out[..., None]),
        energy_ci=cut(ci_all),
        stock_ci=at_ref(ci_all),
        reference_problems=_reference_problems(
            usable,
            baseline_row(ref_status),
            baseline_row(ref_quality),
            baseline_row(ref_ok),
            f"{target.metric.upper()} {target.quantile_name}",
        ),
    )


def _notnull(values: np.ndarray) -> np.ndarray:
    """xarray's `notnull` for the numbers a cube holds."""
    if values.dtype.kind in "fc":
        return ~np.isnan(values)
    return np.ones(values.shape, dtype=bool)


def statistic_bounds(
    latency: np.ndarray,
    ref_latency: np.ndarray,
    *,
    target: Target,
    confidence: float,
    min_repeats: int,
    own: np.ndarray,
    need: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Every setting's feasibility bound (NaN: not enough usable repeats) and the number of
    repeats behind it, for the settings in `need`. `latency` is over ORDER, `ref_latency`
    over (*GROUP_DIMS, repeat), NaN where not usable. Against another drafter's stock (vs-
    baseline mode, drafters not `own`) the repeats are unpaired: (mean + t se of the
    setting) / (mean - t se of the baseline's stock), each at the two-sided level. Against
    the drafter's own stock (preserve mode, or the baseline's own rows) each repeat is a
    ratio to its own stock measurement; an SLO bounds the latency itself."""
    reference = ref_latency[:, :, :, None, None, :]
    if target.mode == "slo":
        x = latency
    else:  # paired_ratios: a repeat missing in either arm, or 0 / 0, drops out of both
        with np.errstate(divide="ignore", invalid="ignore"):
            x = latency / reference
    count = np.count_nonzero(~np.isnan(x), axis=-1)
    rows = own[:, None, None, None]  # over (drafter, corpus, sm_clock, power_limit)
    paired = need if target.mode != "vs-baseline" else need & rows
    bounds, _ = upper_bounds(x, confidence, paired & (count >= min_repeats))
    if target.mode != "vs-baseline":
        return bounds, count
    mine = np.count_nonzero(~np.isnan(latency), axis=-1)
    base = np.count_nonzero(~np.isnan(ref_latency), axis=-1)[:, :, :, None, None]
    unpaired = need & ~rows & (mine >= min_repeats) & (base >= min_repeats)
    two_sided = (1 + confidence) / 2
    top, _ = upper_bounds(latency, two_sided, unpaired)
    groups = unpaired.any(axis=(-2, -1))
    bottom = (
        2 * finite_means(ref_latency, groups) - upper_bounds(ref_latency, two_sided, groups)[0]
    )[:, :, :, None, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(bottom > 0, top / bottom, math.inf)
    bounds = np.where(rows, bounds, np.where(unpaired, ratio, math.nan))
    return bounds, np.where(rows, count, mine)


def headroom(
    cube: xr.Dataset,
    *,
    target: Target,
    knob: str = "both",
    confidence: float = 0.95,
    grid_from_data: bool = False,
) -> xr.Dataset:
    """Headroom and the energy-optimal feasible setting for every (batch, drafter, corpus).

    Returns a Dataset over (batch, drafter, corpus[, gpu]); see the module docstring.
    `grid_from_data` (one GPU of a merged cube, whose grid may be smaller than the union):
    a stock knob's setting this GPU measured nothing at (another GPU's stock) is outside its
    grid, not unmeasured (`data_grid_knobs`).
    """
    import xarray as xr

    if knob not in KNOBS:
        raise AnalysisError(f"unknown knob {knob!r}; choose {', '.join(KNOBS)}")
    if not 0.5 <= confidence < 1:
        raise AnalysisError(f"confidence must be in [0.5, 1), got {confidence}")
    if target.variable not in cube:
        raise AnalysisError(f"the cube has no {target.variable} variable")
    if target.mode == "vs-baseline" and target.baseline not in cube["drafter"].values:
        raise AnalysisError(
            f"baseline drafter {target.baseline!r} is not in the cube "
            f"(drafters: {', '.join(map(str, cube['drafter'].values))}); pick one with --baseline"
        )
    if "gpu" in cube.dims:  # merged cube: each GPU against its own stock setting
        parts = [
            headroom(
                single_gpu(cube, g),
                target=target,
                knob=knob,
                confidence=confidence,
                grid_from_data=True,
            )
            for g in cube["gpu"].values
        ]
        merged = xr.concat(parts, dim="gpu", combine_attrs="drop_conflicts")
        merged.attrs["reference_per_gpu"] = reference_per_gpu(cube["gpu"].values, parts)
        # GPUs whose references are of two kinds (one's stock setting, another's the top of the
        # grid) described the target each against its own, and the concat dropped both
        merged.attrs.setdefault("target", target.describe().replace(" stock ", " reference "))
        used = [int(p.attrs[REPEATS_USED[1]]) for p in parts if int(p.attrs[REPEATS_USED[1]])]
        lowest = [int(p.attrs[REPEATS_USED[0]]) for p in parts if int(p.attrs[REPEATS_USED[0]])]
        merged.attrs.update(
            bound_repeats_min=min(lowest, default=0), bound_repeats_max=max(used, default=0)
        )
        merged.attrs["bound"] = bound_description(merged.attrs, cube)
        return merged.assign_coords(gpu=cube["gpu"].values).transpose("gpu", *GROUP_DIMS)
    ref = reference_setting(cube)
    cells = _cells(cube, target, ref, knob, grid_from_data=grid_from_data)
    threshold = float(target.limit_ms) if target.mode == "slo" else 1.0 + target.slack  # type: ignore[arg-type]
    repeats_in_cube = int(cube.sizes.get("repeat", 1))
    min_repeats = min(2, repeats_in_cube)
    baseline_drafter = target.baseline if target.baseline in cube["drafter"].values else None
    clocks, limits = cells.clocks, cells.limits
    higher = [[pj for pj, q in enumerate(limits) if q > p] for p in limits]  # limit indices
    # A knob with one value in the cube was never swept: its headroom is unknown, not 0. A
    # knob the search may move (`free`) has its answer cut off by the grid when the lowest
    # feasible value is the lowest value evaluated for the group.
    # (One GPU of a merged cube holds only its own settings of a knob left at stock: its
    # cube's axis, as `single_gpu` cuts it.)
    clock_swept = int(cube.sizes["sm_clock"]) > 1
    limit_swept = int(cube.sizes["power_limit"]) > 1
    clock_free, limit_free = len(clocks) > 1, len(limits) > 1
    drafters = list(cube["drafter"].values)

    # Every setting's bound at once; a setting with an invalid cell is never judged, but for
    # the reference itself where enough of its repeats are usable: they are the reference
    # every other setting is judged against and the stock energy its saving divides by, so
    # they judge it too (paired with themselves in preserve mode: a ratio of 1). Disqualified,
    # staying at stock would be no answer while the reference stands, and a cap that never
    # bound would win by noise.
    ref_ci, ref_pi = clocks.tolist().index(ref.sm_clock), limits.tolist().index(ref.power_limit)
    own_reference = cells.ok[:, :, :, ref_ci, ref_pi].sum(axis=-1) >= min_repeats
    at_reference = np.zeros(cells.invalid.shape, dtype=bool)
    at_reference[:, :, :, ref_ci, ref_pi] = own_reference
    judge = ~cells.invalid | at_reference
    own = np.array([d == baseline_drafter for d in drafters], dtype=bool)
    bound_v, n_v = statistic_bounds(
        cells.latency,
        cells.ref_latency,
        target=target,
        confidence=confidence,
        min_repeats=min_repeats,
        own=own,
        need=judge,
    )
    judged_v = judge & ~np.isnan(bound_v)
    feasible_v = judge & meets_all(bound_v, threshold, strict=target.strict)
    over_v = judged_v & ~feasible_v
    pending_v = judge & np.isnan(bound_v) & cells.unmeasured
    short_v = judge & np.isnan(bound_v) & ~cells.unmeasured & (n_v > 0)
    energy_mean_v = finite_means(cells.energy, feasible_v)
    # The latency shown beside the target: against the drafter's own reference (preserve, and
    # the baseline's own rows in vs-baseline mode) over the repeats paired with it, those the
    # bound used, since the target is the mean over the reference's usable repeats; a repeat
    # the reference lacks (flagged there) ran other prompts and is no part of the answer.
    shown = cells.latency
    if target.mode != "slo":
        paired_rows = own if target.mode == "vs-baseline" else np.ones(len(drafters), dtype=bool)
        with_reference = np.where(
            np.isnan(cells.ref_latency)[:, :, :, None, None, :], np.nan, cells.latency
        )
        shown = np.where(paired_rows[None, :, None, None, None, None], with_reference, shown)
    latency_mean_v = finite_means(shown, feasible_v)
    n_feasible = feasible_v.sum(axis=(-2, -1)).astype(int)
    # Where no setting meets the target: the fastest judged setting's mean latency, over the
    # repeats its bound used; within the target, that setting's mean met it and only its bound
    # (the confidence asked) did not: not within target, but not too slow either.
    unmet = judged_v & (n_feasible == 0)[..., None, None]
    judged_mean_v = np.where(unmet, finite_means(shown, unmet), np.inf)
    fastest_v = np.where(unmet.any(axis=(-2, -1)), judged_mean_v.min(axis=(-2, -1)), np.nan)
    repeats_used = set(n_v[judged_v].tolist())  # behind each computed bound (adaptive vary)

    group_shape = bound_v.shape[:3]
    out = {
        name: np.full(group_shape, np.nan)
        for name in (
            "chosen_sm_clock",
            "chosen_power_limit",
            "chosen_energy_per_token_j",
            "stock_energy_per_token_j",
            "paired_stock_energy_per_token_j",
            "saving",
            "saving_repeats",
            "baseline_energy_per_token_j",
            "saving_vs_baseline",
            "chosen_latency_ms",
            "reference_latency_ms",
            "target_ms",
            "latency_bound",
            "lowest_feasible_sm_clock",
            "lowest_feasible_power_limit",
            "headroom_mhz",
            "headroom_w",
            "chosen_headroom_mhz",
            "chosen_headroom_w",
            "repeats",
        )
    }
    stock_v = finite_means(cells.stock_energy)
    reference_v = finite_means(cells.ref_latency)
    out["stock_energy_per_token_j"][...] = stock_v
    out["reference_latency_ms"][...] = reference_v
    out["target_ms"][...] = threshold if target.mode == "slo" else reference_v * threshold
    if baseline_drafter is not None:
        b = drafters.index(baseline_drafter)
        out["baseline_energy_per_token_j"][...] = stock_v[:, b : b + 1, :]
    feasible_any = np.zeros(group_shape, dtype=bool)
    per_setting = (-2, -1)
    n_judged = judged_v.sum(axis=per_setting).astype(int)  # bound could be computed
    n_short = short_v.sum(axis=per_setting).astype(int)  # valid, too few usable repeats
    n_unmeasured = pending_v.sum(axis=per_setting).astype(int)  # not measured yet
    n_failed = (pending_v & cells.failed).sum(axis=per_setting).astype(int)  # of them, failed
    n_invalid = cells.invalid.sum(axis=per_setting).astype(int)  # with an invalid cell
    edge = {
        name: np.zeros(group_shape, dtype=bool)
        for name in (
            "headroom_mhz_is_lower_bound",
            "headroom_w_is_lower_bound",
            "chosen_at_grid_edge",
            "chosen_at_clock_edge",
            "chosen_at_limit_edge",
            "headroom_mhz_unmeasured_below",
            "headroom_w_unmeasured_below",
            "chosen_unmeasured_below",
            "headroom_mhz_invalid_below",
            "headroom_w_invalid_below",
            "chosen_invalid_below",
        )
    }
    set_aside = np.zeros(group_shape, dtype=bool)  # a cap that never bound would have won
    noise_set_aside = np.zeros(group_shape, dtype=bool)  # a saving within noise would have won
    noise_kept = np.zeros(group_shape, dtype=bool)  # the chosen saving is within noise
    # that setting's clock, limit, saving, the saving's interval (low, high), paired repeats
    noise_numbers = np.full((*group_shape, 6), np.nan)
    limiting_flags = np.full(group_shape, "", dtype=object)
    settings_on = np.full(group_shape, "", dtype=object)
    reference_on = np.full(group_shape, "", dtype=object)
    different_gpus = np.zeros(group_shape, dtype=bool)
    clock_list, limit_list = clocks.tolist(), limits.tolist()
    floor_limit = lowest_allowed_power_limit(cube)
    floor_clock = lowest_supported_clock(cube)

    def at(mask: np.ndarray) -> list[tuple[int, int]]:
        """The (clock, limit) indices where a group's per-setting `mask` holds, in the order
        of the grid (clock, then limit)."""
        ci, pi = np.nonzero(mask)
        return list(zip(ci.tolist(), pi.tolist(), strict=True))

    for idx in np.ndindex(group_shape):
        stock_here = float(stock_v[idx])
        over = [(clock_list[ci], limit_list[pi]) for ci, pi in at(over_v[idx])]
        flags_here = cells.flags[idx]
        invalid = [
            (clock_list[ci], limit_list[pi], int(flags_here[ci, pi]))
            for ci, pi in at(cells.invalid[idx])
        ]
        # Invalid settings could still change the answer unless a setting at least as fast
        # in both knobs (clock and limit no lower) was judged over the target (measured
        # again with a campaign that clears their quality flags).
        spoilt = [
            (c, p, m) for c, p, m in invalid if not any(c2 >= c and p2 >= p for c2, p2 in over)
        ]
        if not n_feasible[idx]:
            limiting_flags[idx] = flag_text(m for _, _, m in spoilt)
            continue
        bounds_here, n_here = bound_v[idx], n_v[idx]
        energies_here, latencies_here = energy_mean_v[idx], latency_mean_v[idx]
        feasible = [
            (
                float(energies_here[ci, pi]),
                clock_list[ci],
                limit_list[pi],
                float(latencies_here[ci, pi]),
                float(bounds_here[ci, pi]),
                int(n_here[ci, pi]),
                ci,
                pi,
            )
            for ci, pi in at(feasible_v[idx])
        ]
        judged_at = set(at(judged_v[idx]))
        evaluated = [(clock_list[ci], limit_list[pi]) for ci, pi in sorted(judged_at)]
        pending = [(clock_list[ci], limit_list[pi]) for ci, pi in at(pending_v[idx])]
        # An unmeasured setting could still change the answer on the same terms.
        open_ = [(c, p) for c, p in pending if not any(c2 >= c and p2 >= p for c2, p2 in over)]
        # A cap that never bound is the operating point of a higher limit at its clock: where
        # that one was judged, the choice is made without it (see the module docstring); where
        # nothing else meets the target, it stays, harmless.
        not_binding_here = cells.not_binding[idx]
        bound_caps = [
            f
            for f in feasible
            if not (
                not_binding_here[f[6], f[7]] and any((f[6], pj) in judged_at for pj in higher[f[7]])
            )
        ]
        pool = bound_caps or feasible
        least = least_energy(pool)
        set_aside[idx] = not bound_caps or least_energy(feasible)[6:] != least[6:]
        # A saving its interval cannot tell apart from zero is no saving:
        # the choice is made among the settings that save beyond the noise and the reference
        # (see the module docstring); where none of those met the target, the least-energy
        # setting stays, its saving said to be within the noise.
        picked, kept, spread = least, False, None
        if stock_here > 0:
            picked, kept, spread = choose_beyond_noise(
                pool, (ref_ci, ref_pi), functools.partial(_energy_interval, cells, idx, confidence)
            )
        if spread is not None:
            noise_kept[idx] = kept
            noise_set_aside[idx] = not kept
            noise_numbers[idx] = (
                least[1],
                least[2],
                _paired_saving(
                    cells.energy[idx][least[6], least[7]],
                    cells.stock_energy[idx],
                    least[0],
                    stock_here,
                ).saving,
                1 - spread[1],
                1 - spread[0],
                spread[2],
            )
        mean_e, clock, limit, mean_lat, bound, n, c_i, p_i = picked
        paired = _paired_saving(
            cells.energy[idx][c_i, p_i], cells.stock_energy[idx], mean_e, stock_here
        )
        mean_e = paired.energy
        lowest_clock = min(f[1] for f in feasible)
        lowest_limit = min(f[2] for f in feasible)
        # Settings below an answer not measured yet (an interrupted sweep): the answer may
        # lie lower once they are, so it is provisional, not cut off by the grid.
        clock_open = clock_free and any(c < lowest_clock for c, _ in open_)
        limit_open = limit_free and any(p < lowest_limit for _, p in open_)
        chosen_open = any(
            (clock_free and c < clock) or (limit_free and p < limit) for c, p in open_
        )
        edge["headroom_mhz_unmeasured_below"][idx] = clock_open
        edge["headroom_w_unmeasured_below"][idx] = limit_open
        edge["chosen_unmeasured_below"][idx] = chosen_open
        # Settings below an answer whose cells are invalid: the answer stops there because
        # of the measurement, not the GPU, so it is limited by them, not cut off by the grid.
        clock_spoilt = clock_free and any(c < lowest_clock for c, _, _ in spoilt)
        limit_spoilt = limit_free and any(p < lowest_limit for _, p, _ in spoilt)
        below_chosen = [
            m for c, p, m in spoilt if (clock_free and c < clock) or (limit_free and p < limit)
        ]
        edge["headroom_mhz_invalid_below"][idx] = clock_spoilt
        edge["headroom_w_invalid_below"][idx] = limit_spoilt
        edge["chosen_invalid_below"][idx] = bool(below_chosen)
        limiting_flags[idx] = flag_text(
            [
                *below_chosen,
                *(m for c, p, m in spoilt if c < lowest_clock or p < lowest_limit),
            ]
        )
        # Cut off by the grid: the answer is at the lowest value the grid has for the group
        # (judged, waiting to be measured or invalid alike), so the true answer may lie lower
        # (extend the grid downward). A setting below it left unjudged for want of repeats
        # leaves it a lower bound too: the headroom is at least the answer's.
        in_grid = [*evaluated, *pending, *((c, p) for c, p, _ in invalid)]
        bottom_clock = min(c for c, _ in in_grid)
        bottom_limit = min(p for _, p in in_grid)
        # ... unless that is the GPU's lowest allowed power limit: nothing lower can be swept
        # (the sweep refuses it), so the answer there is the GPU's, not the grid's. At it, not
        # below: no sweep measures below it, so a recorded floor above the grid's lowest limit
        # is no floor of this grid (a range written in mW, another GPU's), and the edge stands.
        if math.isclose(bottom_limit, floor_limit, rel_tol=0.0, abs_tol=FLOOR_TOLERANCE_W):
            bottom_limit = -math.inf
        if bottom_clock == floor_clock:  # nor at the GPU's lowest SM clock (MHz: exact)
            bottom_clock = -math.inf
        edge["headroom_mhz_is_lower_bound"][idx] = (
            clock_free and lowest_clock <= bottom_clock and not clock_open
        )
        edge["headroom_w_is_lower_bound"][idx] = (
            limit_free and lowest_limit <= bottom_limit and not limit_open
        )
        # which knob the grid cut off: only one that can go lower (not at the GPU's floor)
        clock_edge = not chosen_open and clock_free and clock <= bottom_clock
        limit_edge = not chosen_open and limit_free and limit <= bottom_limit
        edge["chosen_at_clock_edge"][idx] = clock_edge
        edge["chosen_at_limit_edge"][idx] = limit_edge
        edge["chosen_at_grid_edge"][idx] = clock_edge or limit_edge
        # The GPUs behind the two answers (chosen and lowest feasible) and behind the
        # reference they are judged against; an absolute SLO has no reference to pair with.
        answers = sorted(
            {
                (f[6], f[7])
                for f in feasible
                if (f[6], f[7]) == (c_i, p_i) or f[1] == lowest_clock or f[2] == lowest_limit
            }
        )
        rows, cols = [a[0] for a in answers], [a[1] for a in answers]
        mine = gpu_set(cells.on[idx][rows, cols], cells.ok[idx][rows, cols])
        theirs = gpu_set(cells.ref_on[idx], cells.ref_ok[idx])
        settings_on[idx] = gpu_text(mine)
        reference_on[idx] = gpu_text(theirs)
        different_gpus[idx] = (
            target.mode != "slo" and bool(mine) and bool(theirs) and (mine != theirs)
        )
        feasible_any[idx] = True
        out["chosen_sm_clock"][idx] = clock
        out["chosen_power_limit"][idx] = limit
        out["chosen_energy_per_token_j"][idx] = mean_e
        out["chosen_latency_ms"][idx] = mean_lat
        out["latency_bound"][idx] = bound
        out["repeats"][idx] = n
        out["saving"][idx] = paired.saving
        out["paired_stock_energy_per_token_j"][idx] = paired.reference
        out["saving_repeats"][idx] = paired.repeats
        if baseline_drafter is not None:
            # Repeat r of every drafter sent the same prompts (they follow from the corpus,
            # batch and repeat, never the drafter): paired by repeat, as the saving is.
            at_base = (idx[0], drafters.index(baseline_drafter), idx[2])
            out["saving_vs_baseline"][idx] = _paired_saving(
                cells.energy[idx][c_i, p_i],
                cells.stock_energy[at_base],
                float(picked[0]),
                float(out["baseline_energy_per_token_j"][idx]),
            ).saving
        out["lowest_feasible_sm_clock"][idx] = lowest_clock
        out["lowest_feasible_power_limit"][idx] = lowest_limit
        # A knob `--knob` holds at the reference was not searched: its headroom is unknown
        # (NaN), not the 0 its one candidate gives.
        if clock_swept:
            if clock_free:
                out["headroom_mhz"][idx] = ref.sm_clock - lowest_clock
            out["chosen_headroom_mhz"][idx] = ref.sm_clock - clock
        if limit_swept:
            if limit_free:
                out["headroom_w"][idx] = ref.power_limit - lowest_limit
            out["chosen_headroom_w"][idx] = ref.power_limit - limit

    extra_dims: list[str] = []
    coords = {d: cube[d].values for d in (*extra_dims, *GROUP_DIMS)}
    dims = (*extra_dims, *GROUP_DIMS)
    units = {
        "chosen_sm_clock": ("MHz", "SM clock of the least-energy feasible setting"),
        "chosen_power_limit": ("W", "power limit of the least-energy feasible setting"),
        "chosen_energy_per_token_j": (
            "J",
            "energy per token at the chosen setting (mean over the repeats paired with the "
            "reference, as the saving; where none pairs, over its usable repeats)",
        ),
        "stock_energy_per_token_j": ("J", "energy per token at the reference (stock) setting"),
        "saving": (
            "1",
            "energy saved per token at the chosen setting against stock, over the repeats "
            "measured at both",
        ),
        "paired_stock_energy_per_token_j": (
            "J",
            "energy per token at the reference over the repeats the saving is over (those "
            "measured at both; where none pairs, its usable repeats): the saving is 1 - "
            "chosen_energy_per_token_j / this",
        ),
        "saving_repeats": (
            "1",
            "repeats the saving is over: those measured at both the chosen setting and the "
            "reference (0: none paired, each side's usable repeats)",
        ),
        "baseline_energy_per_token_j": ("J", "baseline drafter's energy per token at stock"),
        "saving_vs_baseline": (
            "1",
            "energy saved against the baseline drafter at stock, over the repeats measured at "
            "both (the same prompts)",
        ),
        "chosen_latency_ms": (
            "ms",
            "latency at the chosen setting (mean over the repeats paired with the reference, "
            "as the bound; against an SLO or another drafter's stock, over its usable repeats)",
        ),
        "reference_latency_ms": ("ms", "reference latency the target is relative to"),
        "target_ms": ("ms", "latency target"),
        "latency_bound": (
            ("ms", "upper bound of the latency at the chosen setting (compared with the SLO)")
            if target.mode == "slo"
            else (
                "1",
                "upper bound of the latency ratio to the reference at the chosen setting "
                "(compared with 1 + slack)",
            )
        ),
        "lowest_feasible_sm_clock": ("MHz", "lowest SM clock meeting the target"),
        "lowest_feasible_power_limit": ("W", "lowest power limit meeting the target"),
        "headroom_mhz": (
            "MHz",
            "SM-clock headroom: reference clock minus the lowest feasible clock (NaN: the cube "
            "has one clock, or --knob held the clock; see headroom_mhz_is_lower_bound)",
        ),
        "headroom_w": (
            "W",
            "power headroom: reference limit minus the lowest feasible limit (NaN: the cube "
            "has one power limit, or --knob held the limit; see headroom_w_is_lower_bound)",
        ),
        "chosen_headroom_mhz": ("MHz", "reference clock minus the chosen clock"),
        "chosen_headroom_w": ("W", "reference limit minus the chosen limit"),
        "repeats": ("1", "repeats behind the chosen setting's bound"),
    }
    data_vars = {
        name: (dims, values, {"units": units[name][0], "long_name": units[name][1]})
        for name, values in out.items()
    }
    data_vars["fastest_latency_ms"] = (
        dims,
        fastest_v,
        {
            "units": "ms",
            "long_name": "where no setting meets the target: the least mean latency of the "
            "settings judged, over the repeats their bounds used (within target_ms: its mean "
            "met the target, its bound at the confidence asked did not); NaN elsewhere",
        },
    )
    data_vars["cap_not_binding"] = (
        dims,
        set_aside,
        {
            "units": "1",
            "long_name": "the least-energy feasible setting had a power limit whose peak "
            "power stayed below it (no SwPowerCap): the cap never bound and its energy gap "
            "is noise, so the choice was made without it (where nothing else met the "
            "target, that setting is chosen, and any saving is its clock's, not its cap's)",
        },
    )
    data_vars["saving_set_aside_within_noise"] = (
        dims,
        noise_set_aside,
        {
            "units": "1",
            "long_name": "the least-energy feasible setting saved nothing beyond the noise "
            "(its saving's interval reaches 0: see within_noise_*), so the choice was made "
            "among the settings that do and the reference",
        },
    )
    data_vars["saving_within_noise"] = (
        dims,
        noise_kept,
        {
            "units": "1",
            "long_name": "the chosen setting's saving is within the noise (see within_noise_*): "
            "no setting that saves beyond it, nor the reference, met the target",
        },
    )
    for k, (name, unit, text) in enumerate(
        (
            ("within_noise_sm_clock", "MHz", "SM clock"),
            ("within_noise_power_limit", "W", "power limit"),
            ("within_noise_saving", "1", "saving against the reference"),
            ("within_noise_saving_low", "1", "low end of the saving's interval"),
            ("within_noise_saving_high", "1", "high end of the saving's interval"),
            (
                "within_noise_paired_repeats",
                "1",
                "repeats paired with the reference (below 2: "
                "the interval is the cells' own, energy_per_token_rel_ci)",
            ),
        )
    ):
        data_vars[name] = (
            dims,
            noise_numbers[..., k],
            {
                "units": unit,
                "long_name": f"where a saving was within the noise: that setting's {text}",
            },
        )
    data_vars["feasible"] = (
        dims,
        feasible_any,
        {"units": "1", "long_name": "some setting meets the target"},
    )
    data_vars["feasible_settings"] = (
        dims,
        n_feasible,
        {"units": "1", "long_name": "settings meeting the target"},
    )
    data_vars["judged_settings"] = (
        dims,
        n_judged,
        {"units": "1", "long_name": "settings whose latency bound could be computed"},
    )
    data_vars["short_settings"] = (
        dims,
        n_short,
        {
            "units": "1",
            "long_name": "valid settings left unjudged: fewer than two usable repeats",
        },
    )
    data_vars["unmeasured_settings"] = (
        dims,
        n_unmeasured,
        {"units": "1", "long_name": "settings not measured yet (missing or failed cells)"},
    )
    data_vars["failed_settings"] = (
        dims,
        n_failed,
        {
            "units": "1",
            "long_name": "of unmeasured_settings, those with a failed cell (a rerun of the "
            "sweep retries it)",
        },
    )
    data_vars["invalid_settings"] = (
        dims,
        n_invalid,
        {"units": "1", "long_name": "settings with an invalid cell (a quality flag)"},
    )
    edge_names = {
        "headroom_mhz_unmeasured_below": "clocks below the lowest feasible one are not "
        "measured yet: the clock headroom may be larger once the sweep is resumed",
        "headroom_w_unmeasured_below": "power limits below the lowest feasible one are not "
        "measured yet: the power headroom may be larger once the sweep is resumed",
        "chosen_unmeasured_below": "settings below the chosen one are not measured yet: one "
        "of them might save more energy once the sweep is resumed",
        "headroom_mhz_invalid_below": "clocks below the lowest feasible one have invalid "
        "cells (invalid_flags): the clock headroom may be larger once they are measured validly",
        "headroom_w_invalid_below": "power limits below the lowest feasible one have invalid "
        "cells (invalid_flags): the power headroom may be larger once they are measured "
        "validly",
        "chosen_invalid_below": "settings below the chosen one have invalid cells "
        "(invalid_flags): one of them might save more energy once measured validly",
        "headroom_mhz_is_lower_bound": "the lowest clock evaluated meets the target: the "
        "clock headroom is at least headroom_mhz (the grid cuts it off)",
        "headroom_w_is_lower_bound": "the lowest power limit evaluated meets the target: the "
        "power headroom is at least headroom_w (the grid cuts it off)",
        "chosen_at_grid_edge": "the chosen setting is at the lowest clock or power limit "
        "evaluated: a setting below the grid might save more energy",
        "chosen_at_clock_edge": "the chosen setting is at the lowest clock evaluated, above "
        "the GPU's lowest: a clock below the grid might save more energy",
        "chosen_at_limit_edge": "the chosen setting is at the lowest power limit evaluated, "
        "above the GPU's lowest: a power limit below the grid might save more energy",
    }
    for name, text in edge_names.items():
        data_vars[name] = (dims, edge[name], {"units": "1", "long_name": text})
    data_vars["different_gpus"] = (
        dims,
        different_gpus,
        {
            "units": "1",
            "long_name": "the chosen or lowest feasible setting and its reference were measured "
            "on different GPUs (GPU-to-GPU spread is in the ratio)",
        },
    )
    # The GPUs behind each answer are coordinates, as the cube's measured_on is: labels, not
    # measurements.
    gpu_coords = {
        "measured_on": (
            dims,
            settings_on,
            {
                "units": "1",
                "long_name": "GPUs that measured the chosen and lowest feasible settings",
            },
        ),
        # Why a group has no reference to judge against: a label, as measured_on is.
        "reference_problem": (
            dims,
            cells.reference_problems,
            {"units": "1", "long_name": "why the reference cell is unusable (empty: usable)"},
        ),
        # Which quality flags invalidated the settings that could change the answer.
        "invalid_flags": (
            dims,
            limiting_flags,
            {
                "units": "1",
                "long_name": "invalidating quality flags of the settings below the answer (with "
                "no answer: of any setting not ruled out by a faster one over the target)",
            },
        ),
        "reference_measured_on": (
            dims,
            reference_on,
            {
                "units": "1",
                "long_name": "GPUs that measured the reference the target is relative to",
            },
        ),
    }
    result = xr.Dataset(data_vars, coords={**coords, **gpu_coords})
    described = target.describe()
    if not ref.is_stock:  # the target is relative to the reference, which is not stock here
        described = described.replace(" stock ", " top-of-grid ")
    result.attrs.update(
        target=described,
        target_mode=target.mode,
        metric=target.metric,
        quantile=target.quantile,
        slack=target.slack,
        threshold=threshold,
        strict=int(target.strict),
        knob=knob,
        confidence=confidence,
        bound_repeats_min=min(repeats_used, default=0),
        bound_repeats_max=max(repeats_used, default=0),
        reference_sm_clock_mhz=ref.sm_clock,
        reference_power_limit_w=ref.power_limit,
        reference_is_stock=int(ref.is_stock),
        stock_sm_clock_mhz=ref.stock_sm_clock if ref.stock_sm_clock is not None else ref.sm_clock,
        stock_power_limit_w=(
            ref.stock_power_limit if ref.stock_power_limit is not None else ref.power_limit
        ),
        sm_clock_swept=int(clock_swept),
        power_limit_swept=int(limit_swept),
        # Whether the campaign locked the SM clock at all (one clock locked is not swept but
        # is still a lock; an unset clock runs unlocked at stock): what an answer's clock is.
        sm_clock_locked=int(knobs_set(cube.attrs.get("campaign"))[0]),
        baseline=target.baseline,
    )
    result.attrs["bound"] = bound_description(result.attrs, cube)
    return result


@dataclass(frozen=True)
class _Paired:
    """A setting's energy per token and its saving against a reference, over the repeats
    measured at both (`repeats`; 0 where none pairs), and the reference's energy over those
    (`reference`): saving = 1 - energy / reference."""

    energy: float
    saving: float
    reference: float
    repeats: int


def _paired_saving(energy: np.ndarray, reference: np.ndarray, mean: float, stock: float) -> _Paired:
    """The energy per token of a setting (per repeat, NaN: not usable) and its saving against
    a reference (per repeat; `stock` its mean over its usable repeats), both over the repeats
    paired with it (usable at both): as its interval and the latency shown beside the target
    are paired. A repeat the reference lacks (flagged there), or the setting lacks (flagged,
    or an adaptive repeat it was not measured at), ran other prompts, so it is no part of a
    saving against the reference. `mean` (over every usable repeat, on which the settings are
    chosen) against `stock` where none pairs; the saving NaN where the reference has no usable
    energy (`stock` NaN or not above 0)."""
    energy = np.asarray(energy, dtype=float)
    reference = np.asarray(reference, dtype=float)
    both = ~np.isnan(energy) & ~np.isnan(reference)
    if not both.any():
        return _Paired(mean, (1 - mean / stock if stock > 0 else math.nan), stock, 0)
    paired, paired_stock = finite_mean(energy[both]), finite_mean(reference[both])
    saving = 1 - paired / paired_stock if stock > 0 and paired_stock > 0 else math.nan
    return _Paired(paired, saving, paired_stock, int(both.sum()))


def _energy_interval(
    cells: _Cells, idx: tuple[int, ...], confidence: float, at: tuple[int, int]
) -> tuple[float, float, int]:
    """`bounds.ratio_interval` of the setting at (clock, limit) indices `at` of group `idx`
    against the group's reference."""
    return ratio_interval(
        cells.energy[idx][at],
        cells.stock_energy[idx],
        cells.energy_ci[idx][at],
        cells.stock_ci[idx],
        confidence,
    )


def choose_beyond_noise(
    pool: list[tuple[Any, ...]],
    reference: tuple[int, int],
    interval: Callable[[tuple[int, int]], tuple[float, float, int]],
) -> tuple[tuple[Any, ...], bool, tuple[float, float, int] | None]:
    """The least-energy setting of `pool` (as `least_energy`: energy, clock, limit, ...,
    clock index, limit index) among those that save beyond the noise and the `reference`
    (clock and limit indices), whose saving is none. `interval(indices)` gives a setting's
    energy ratio interval to the reference (low, high, paired repeats): beyond the noise when
    high < 1. Returns the choice, whether it is a setting kept within the noise (no other
    candidate: the reference not in `pool`), and the interval of `pool`'s least-energy
    setting where that one was set aside or kept for want of another (None otherwise)."""
    least = least_energy(pool)
    if (least[6], least[7]) == reference:
        return least, False, None
    known: dict[tuple[int, int], tuple[float, float, int]] = {}

    def saves(f: tuple[Any, ...]) -> bool:
        at = (f[6], f[7])
        if at == reference:
            return True
        if at not in known:
            known[at] = interval(at)
        return known[at][1] < 1

    ordered = sorted(pool, key=lambda f: f[0])
    first = next((f for f in ordered if saves(f)), None)
    if first is None:
        return least, True, known[(least[6], least[7])]
    picked = least_energy([f for f in ordered if f[0] <= first[0] * (1 + ENERGY_TIE) and saves(f)])
    if (picked[6], picked[7]) == (least[6], least[7]):
        return picked, False, None
    saves(least)
    return picked, False, known[(least[6], least[7])]


def least_energy(feasible: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The feasible setting (energy, clock, limit, ...) with the least energy; energies within
    ENERGY_TIE of the least are ties, broken towards the highest clock, then limit."""
    least = min(f[0] for f in feasible)
    ties = [f for f in feasible if f[0] <= least * (1 + ENERGY_TIE)]
    return max(ties, key=lambda f: (f[1], f[2]))


def bound_description(attrs: dict[str, Any], cube: xr.Dataset) -> str:
    """The feasibility bound in words, from a headroom result's attributes: the repeats it
    rests on are those used (`REPEATS_USED`; an adaptive campaign's cells take from `repeats`
    to `max_repeats`), not the cube's repeat axis, which holds `max_repeats`; where no bound
    could be computed, those the campaign asks for."""
    confidence = float(attrs["confidence"])
    repeats_in_cube = int(cube.sizes.get("repeat", 1))
    if repeats_in_cube <= 1:
        return ONE_REPEAT_BOUND
    if attrs["target_mode"] == "vs-baseline":
        return (
            f"conservative {level_text(confidence)} upper bound of the ratio of mean latencies "
            f"(Student-t bounds of each mean at {level_text((1 + confidence) / 2)}), unpaired: the "
            "baseline ran on another server; the baseline's own rows paired, as preserve"
        )
    lo, hi = (int(attrs.get(key, 0)) for key in REPEATS_USED)
    if not hi:  # nothing judged: the repeats asked for
        rule = repeat_rule(cube.attrs.get("campaign"))
        lo, hi = (rule.repeats, rule.max_repeats) if rule else (repeats_in_cube,) * 2
    n = str(hi) if lo == hi else f"{lo}-{hi}"
    text = BOUND_DESCRIPTION.format(conf=level_text(confidence), n=n)
    if attrs["target_mode"] == "slo":  # the latencies themselves: nothing is paired
        text = text.replace(
            "paired repeat(s) of the latency ratio to the reference",
            "repeat(s) of the latency (ms)",
        )
    return text


def cap_not_binding(cube: xr.Dataset, ok: xr.DataArray) -> xr.DataArray:
    """Per setting (over the repeats): whether its power limit never bound: every usable
    (`ok`) repeat's peak power more than CAP_BINDING_MARGIN below the limit, no SwPowerCap
    (power_capped) seen, and at least one usable repeat. A cube that does not record the peak
    power, or a usable repeat without one, says nothing: the cap may have bound (False)."""
    from dvfs.measure.meter import Q_POWER_CAPPED

    if "power_max_w" not in cube:
        return ok.any("repeat") & False
    limit = cube["power_limit"] * gpus_summed(cube)
    quiet = cube["power_max_w"] < limit * (1 - CAP_BINDING_MARGIN)
    if "quality" in cube:
        quiet = quiet & ((cube["quality"].fillna(0).astype(np.int64) & Q_POWER_CAPPED) == 0)
    return (quiet | ~ok).all("repeat") & ok.any("repeat")


def invalid_flags(cube: xr.Dataset, invalid: xr.DataArray) -> xr.DataArray:
    """Per setting (over the repeats): the invalidating quality-flag bits of its invalid
    cells, ORed (0: none, or no quality recorded)."""
    from dvfs.measure.meter import INVALIDATING

    if "quality" not in cube:
        return invalid.any("repeat").astype(np.int64) * 0
    bits = cube["quality"].where(invalid).fillna(0).astype(np.int64) & INVALIDATING
    return bits.reduce(np.bitwise_or.reduce, dim="repeat")


def flag_text(masks: Iterable[int]) -> str:
    """The invalidating quality flags in `masks`, named and sorted ("" when none)."""
    from dvfs.measure.meter import describe_quality

    union = 0
    for mask in masks:
        union |= int(mask)
    return ", ".join(sorted(describe_quality(union)))


def reference_per_gpu(gpus: Iterable[object], parts: Iterable[xr.Dataset]) -> str:
    """Each GPU's reference setting (JSON), for a merged result: where the GPUs' stock
    settings differ, the single reference attributes are dropped by the merge."""
    import json

    return json.dumps(
        {
            str(gpu): {
                "sm_clock_mhz": int(part.attrs["reference_sm_clock_mhz"]),
                "power_limit_w": float(part.attrs["reference_power_limit_w"]),
                "is_stock": bool(part.attrs.get("reference_is_stock", 1)),
                "stock_sm_clock_mhz": _maybe_int(part.attrs.get("stock_sm_clock_mhz")),
                "stock_power_limit_w": _maybe_float(part.attrs.get("stock_power_limit_w")),
            }
            for gpu, part in zip(gpus, parts, strict=True)
        }
    )


def _maybe_int(value: object) -> int | None:
    return None if value is None else int(float(value))  # type: ignore[arg-type]


def _maybe_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def single_gpu(cube: xr.Dataset, gpu: object) -> xr.Dataset:
    """One GPU of a merged cube, with that GPU's own stock setting as its reference, and along
    a knob its campaign left at stock only its own settings (`own_grid`)."""
    from dvfs.cube.attrs import merged_sources

    one = cube.sel(gpu=gpu, drop=True)
    stock = merged_sources(cube).get(str(gpu), {})
    # its own grid where the merge recorded it: the merged axes hold other GPUs' settings,
    # where this one has no cell (its stock limit another's, not its own grid's)
    own = own_axes(one, stock)
    if own:
        one = one.isel(own)
    attrs = dict(cube.attrs)
    for key in ("stock_sm_clock_mhz", "stock_power_limit_w"):
        try:  # "None" or none: not recorded (an older merge's), as `grid_cells` reads it
            value = float(stock[key])
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(value):  # "inf", "nan": a hand-edited cube's, no setting either
            attrs[key] = value
    for key in ("power_limit_range_w", "sm_clock_range_mhz"):  # its own GPU's ranges
        if stock.get(key) not in (None, "None"):
            attrs[key] = stock[key]
    return own_grid(one.assign_attrs(attrs))


#: Each merged GPU's own knob axes, as `dvfs cube merge` keeps them in `merged_from`.
GRID_ATTRS = {"sm_clock": "grid_sm_clock_mhz", "power_limit": "grid_power_limit_w"}


def own_axes(one: xr.Dataset, source: object) -> dict[str, np.ndarray]:
    """Per knob, the indices along `one`'s (merged) axis of its GPU's own grid as its merge
    recorded it (`source`: its `merged_from` entry); only knobs whose grid is recorded (an
    older merge's is not) and leaves out settings, and keeps at least one."""
    out: dict[str, np.ndarray] = {}
    if not isinstance(source, dict):
        return out
    for dim, key in GRID_ATTRS.items():
        grid = source.get(key)
        if not isinstance(grid, list) or dim not in one.coords:
            continue
        try:
            keep = np.isin(one[dim].values.astype(float), np.asarray(grid, dtype=float))
        except (TypeError, ValueError):
            continue
        if keep.any() and not keep.all():
            out[dim] = np.flatnonzero(keep)
    return out


def own_grid(one: xr.Dataset) -> xr.Dataset:
    """One GPU of a merged cube cut, along each knob its campaign left at stock
    (`data_grid_knobs`), to the settings in that GPU's grid: its own stock setting and those it
    measured at. The merged axis also holds the other GPUs' stock settings, where this GPU has
    no cell: kept, they were a setting of its own (the top of its grid, where its reference is
    there; a second power limit, as if swept; a cap in its figures' legend it never ran at)."""
    if "cell_status" not in one:
        return one
    for dim in data_grid_knobs(one):
        own = own_settings(one, dim)
        if own.any() and not own.all():
            one = one.isel({dim: np.flatnonzero(own)})
    return one


def own_settings(one: xr.Dataset, dim: str) -> np.ndarray:
    """Along `dim`, a knob one GPU's campaign left at stock, the settings in that GPU's grid:
    those it measured at and its own stock setting (`single_gpu` gave it), measured yet or
    not: nothing measured there yet is a setting waiting for its sweep, not another GPU's."""
    status = one["cell_status"]
    own = (status != STATUS_MISSING).any([d for d in status.dims if d != dim]).values
    with contextlib.suppress(KeyError, TypeError, ValueError):
        own = own | (one[dim].values.astype(float) == float(one.attrs[STOCK_ATTRS[dim]]))
    return np.asarray(own, dtype=bool)


def unasked_repeats(cube: xr.Dataset) -> xr.DataArray:
    """Missing cells at adaptive repeats (index `repeats` and up; the repeat axis holds
    `max_repeats`) that the campaign's rule (`dvfs.measure.runner.next_repeats`) does not ask
    for, decided from the cube alone: a cell whose interval across its repeats already meets
    the precision needs no more, and one whose first `repeats` are not all in, or whose next
    repeat is not measured yet, has not been asked for the ones after. A finished sweep leaves
    such cells missing; they are not waiting to be measured. All False for a campaign without
    adaptive repeats or a cube that does not record its campaign."""
    import xarray as xr

    status = cube["cell_status"] if "cell_status" in cube else cube["valid"]
    rule = repeat_rule(cube.attrs.get("campaign"))
    dims = [*(d for d in status.dims if d != "repeat"), "repeat"]
    if (
        rule is None
        or not rule.adaptive
        or "cell_status" not in cube
        or "repeat" not in status.dims
    ):
        return xr.zeros_like(status, dtype=bool).drop_attrs()
    status = status.transpose(*dims)
    beyond = _unasked_cells(
        rule,
        cube["repeat"].values.astype(int),
        status.values,
        lambda: (
            cube["valid"].transpose(*dims).values,
            cube["energy_per_token_j"].transpose(*dims).values,
            cube["tpot_ms"].isel(quantile=0).transpose(*dims).values,  # the median
        ),
    )
    return xr.DataArray(beyond, dims=status.dims, coords=status.coords).transpose(
        *cube["cell_status"].dims
    )


def _unasked_cells(
    rule: RepeatRule,
    index: np.ndarray,
    status_v: np.ndarray,
    measured: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> np.ndarray:
    """`unasked_repeats` on arrays whose last axis is the repeat (`index` its labels):
    `measured` gives the cells' valid flag, energy per token and median TPOT, in the same
    axes, and is called only where the rule's precision has to be judged."""
    from dvfs.measure.counter import repeats_precise

    present = np.where(status_v != STATUS_MISSING, index + 1, 0)
    taken = present.max(axis=-1, initial=0)  # as the rule counts: failed cells were taken
    beyond = (status_v == STATUS_MISSING) & (index >= np.maximum(taken, rule.repeats)[..., None])
    # Groups the rule still judges: their first repeats are in, the last not yet taken.
    judged = beyond.any(axis=-1) & (taken >= rule.repeats) & (taken < rule.max_repeats)
    if judged.any():
        valid_v, energy_v, tpot_v = measured()
        usable = (status_v == STATUS_OK) & (valid_v > 0)  # valid.fillna(0) > 0
        for idx in zip(*np.nonzero(judged), strict=True):
            ok = usable[idx]
            if not repeats_precise(
                energy_v[idx][ok],
                tpot_v[idx][ok],
                precision=rule.precision,
                confidence=rule.confidence,
            ):
                beyond[idx] &= index != taken[idx]  # the next repeat, which the rule asks for
    return beyond


def not_measured(cube: xr.Dataset, *, grid_from_data: bool = False) -> xr.DataArray:
    """Cells not measured yet: missing (the sweep has not reached them) or failed (a rerun
    retries them); not the adaptive repeats the campaign does not ask for (`unasked_repeats`).
    With `grid_from_data` (one GPU of a merged cube), a stock knob's setting with no cell
    measured at all, other than the GPU's own stock (another GPU's stock), is outside that
    GPU's grid, not waiting to be measured (`own_settings`)."""
    import xarray as xr

    if "cell_status" not in cube:
        return cube["valid"].copy(data=np.zeros(cube["valid"].shape, dtype=bool))
    status = cube["cell_status"]
    waiting = (status == STATUS_MISSING) | (status == STATUS_FAILED)
    waiting = waiting & ~unasked_repeats(cube)
    if grid_from_data:
        for dim in data_grid_knobs(cube):
            waiting = waiting & xr.DataArray(own_settings(cube, dim), dims=[dim])
    return waiting


def data_grid_knobs(cube: xr.Dataset) -> tuple[str, ...]:
    """The knob axes along which one GPU of a merged cube holds only the settings it measured:
    those its campaign left at stock, where the merged axis holds each GPU's own stock setting
    (and the others', not its own). A knob the campaign lists is every GPU's grid (merged
    cubes share their campaign's grid), so a setting a GPU has not measured yet there is
    waiting for its sweep, not outside its grid. Both where the cube records no campaign."""
    import json

    from dvfs.records import CampaignFacts

    try:
        grid = CampaignFacts.from_json(json.loads(cube.attrs.get("campaign") or "")).grid
    except (KeyError, ValueError, TypeError, AttributeError):
        return ("sm_clock", "power_limit")
    listed = {"sm_clock": grid.sm_clocks_mhz, "power_limit": grid.power_limits_w}
    return tuple(dim for dim, values in listed.items() if not values)


#: A stock knob's axis and the attribute each merged GPU's own stock setting is in
#: (`merged_from`, as its cube recorded it).
STOCK_ATTRS = {"sm_clock": "stock_sm_clock_mhz", "power_limit": "stock_power_limit_w"}


def grid_cells(cube: xr.Dataset) -> np.ndarray:
    """Which cells (`cell_status`'s axes) are in the grid of the GPU they belong to: all of
    them, but in a merged cube a stock knob's settings other than the GPU's own (another
    GPU's stock setting on the merged axis: `data_grid_knobs`). A GPU's own is the stock
    setting its cube recorded (`merged_from`), measured yet or not, and any it measured at.
    Where the merge recorded each GPU's own axes (`own_axes`), settings off them are outside
    its grid too."""
    import json

    import xarray as xr

    status = cube["cell_status"]
    in_grid = np.ones(status.shape, dtype=bool)
    if "gpu" in status.dims:
        try:
            sources = json.loads(str(cube.attrs.get("merged_from") or "{}"))
        except ValueError:
            sources = {}
        if not isinstance(sources, dict):
            sources = {}
        for dim in GRID_ATTRS:  # each GPU's own grid, where its merge recorded it
            keep = np.ones((cube.sizes["gpu"], cube.sizes[dim]), dtype=bool)
            for i, label in enumerate(cube["gpu"].values):
                own_indices = own_axes(cube, sources.get(str(label))).get(dim)
                if own_indices is not None:
                    keep[i] = np.isin(np.arange(cube.sizes[dim]), own_indices)
            grid = xr.DataArray(
                keep, dims=("gpu", dim), coords={d: status[d] for d in ("gpu", dim)}
            )
            in_grid &= grid.broadcast_like(status).transpose(*status.dims).values
        for dim in data_grid_knobs(cube):  # a stock knob: each GPU's own setting
            others = [d for d in status.dims if d not in ("gpu", dim)]
            seen = (status != STATUS_MISSING).any(others).transpose("gpu", dim)
            own = seen.values.copy()
            values = cube[dim].values.astype(float)
            for i, label in enumerate(cube["gpu"].values):
                source = sources.get(str(label))
                stock = source.get(STOCK_ATTRS[dim]) if isinstance(source, dict) else None
                try:  # "None" or none: not recorded (an older merge's), as `single_gpu`
                    setting = float(stock)  # type: ignore[arg-type]
                except (TypeError, ValueError):
                    continue
                own[i] |= values == setting
            mine = seen.copy(data=own).broadcast_like(status)
            in_grid &= mine.transpose(*status.dims).values
    return in_grid


def coverage(cube: xr.Dataset) -> dict[str, int]:
    """How many cells the campaign asks for and how many are not measured yet (missing or
    failed): a partial cube's answers may change once its sweep is resumed. Adaptive repeats
    the campaign's rule does not ask for (`unasked_repeats`) are counted apart, as
    `not_needed`, in neither. In a merged cube another GPU's stock setting on a stock knob's
    axis is outside a GPU's grid and not counted (`grid_cells`)."""
    if "cell_status" not in cube:
        total = int(cube["valid"].size)
        return {"cells": total, "missing": 0, "failed": 0, "not_needed": 0}
    status = cube["cell_status"]
    in_grid = grid_cells(cube)
    unasked = unasked_repeats(cube).transpose(*status.dims).values & in_grid
    inside = status.values[in_grid & ~unasked]
    return {
        "cells": int(inside.size),
        "missing": int((inside == STATUS_MISSING).sum()),
        "failed": int((inside == STATUS_FAILED).sum()),
        "not_needed": int(unasked.sum()),
    }


def reference_problems(cube: xr.Dataset, at_ref: dict[str, float], target: Target) -> np.ndarray:
    """Per (batch, drafter, corpus): why the reference cell gives no latency to compare with
    ("" where it does): "not measured yet", "failed", or "invalid: <its invalidating quality
    flags>", so a row without a target says what to change."""

    ref = cube.sel(at_ref)
    if target.mode == "vs-baseline":
        ref = ref.sel(drafter=target.baseline, drop=True).expand_dims(
            drafter=cube["drafter"].values
        )
    order = [*GROUP_DIMS, "repeat"]
    valid = valid_mask(ref)
    usable = valid & ref[target.variable].sel(quantile=target.quantile).notnull()
    usable_v = usable.transpose(*order).values
    shape = usable_v.shape
    status_v = (
        ref["cell_status"].transpose(*order).values
        if "cell_status" in ref
        else np.full(shape, STATUS_OK)
    )
    quality_v = (
        ref["quality"].transpose(*order).values if "quality" in ref else np.full(shape, np.nan)
    )
    latency = f"{target.metric.upper()} {target.quantile_name}"
    return _reference_problems(
        usable_v, status_v, quality_v, valid.transpose(*order).values, latency
    )


def _reference_problems(
    usable_v: np.ndarray,
    status_v: np.ndarray,
    quality_v: np.ndarray,
    valid_v: np.ndarray,
    latency: str,
) -> np.ndarray:
    """`reference_problems` on the reference cells' arrays over (*GROUP_DIMS, repeat): whether
    each is usable, its status, its quality bits and whether it is valid; `latency` names the
    target's latency ("TPOT p50"), which valid cells may lack (a damaged or hand-edited cube):
    "no TPOT p50 in its cells", not "invalid" with no flag to change."""
    from dvfs.measure.meter import INVALIDATING, describe_quality

    out = np.full(usable_v.shape[:3], "", dtype=object)
    for idx in zip(*np.nonzero(~usable_v.any(axis=-1)), strict=True):
        status = status_v[idx]
        if (status == STATUS_OK).any():
            masks = [int(q) & INVALIDATING for q in quality_v[idx][status == STATUS_OK] if q == q]
            flags = sorted({name for m in masks for name in describe_quality(m)})
            if flags:
                out[idx] = "invalid: " + ", ".join(flags)
            elif valid_v[idx].any():
                out[idx] = f"no {latency} in its cells"
            else:
                out[idx] = "invalid"
        elif (status == STATUS_FAILED).any():
            out[idx] = "failed"
        else:
            out[idx] = "not measured yet"
    return out
