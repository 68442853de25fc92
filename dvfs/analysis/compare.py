"""Speculation against no speculation: at equal clock, at equal latency, and where it stops paying.

Every drafter's energy per token is compared with the baseline drafter's (no speculation):
  * at equal clock: both at the same knob setting;
  * at equal latency: each at the setting `dvfs headroom` chooses with the baseline's stock
    latency as the target (the least-energy one of those saving beyond the measurement
    noise, else stock; the baseline itself may also move its clock to get there);
  * the break-even batch: the smallest measured batch at which the drafter no longer saves
    energy (NaN: no batch where it was compared and stopped saving), with a one-line summary
    of what happened at every batch: it saves at every batch, saves up to or from a batch,
    never saves, or was never within the baseline's latency (or never measured) at all. NaN
    alone cannot tell "saves everywhere" from "never got there", so read the summary.

Repeat r of every arm sends the same prompts (keyed on batch, repeat and round), so the arms
are paired by repeat: each ratio is the geometric mean of the per-repeat ratios over the repeats
valid in both arms (`paired_repeats`; `dropped_repeats`: valid in one arm only, left out of both).
The arms ran in separate time blocks, so a drafter "saves" (or "costs") only where the
two-sided Student-t interval of the mean log ratio at the confidence, taken back to a ratio,
lies below (above) 1 (so swapping the arms gives the reciprocal ratio at stock and the
opposite verdict; at equal latency the latency held to is then the other arm's); otherwise it
is "within noise", and a row with one paired repeat has no interval and no verdict. A cube
with one repeat can give no interval over repeats anywhere: there the interval each arm's
cells state (energy_per_token_rel_ci, in quadrature) is judged the same way, and where they
state none the point value, as headroom does. The break-even batch is the smallest batch
judged not to save (costs or within noise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from dvfs.analysis.bounds import finite_means, level_text, meets, upper_bounds
from dvfs.analysis.headroom import (
    ENERGY_CI,
    gpu_set,
    gpu_text,
    headroom,
    measured_on,
    reference_per_gpu,
    reference_setting,
    ruled_out_settings,
    unasked_repeats,
    valid_mask,
)
from dvfs.analysis.targets import Target
from dvfs.errors import AnalysisError

if TYPE_CHECKING:
    import xarray as xr


GROUPS = ("batch", "drafter", "corpus")

SAVES, LOSES, NOT_WITHIN, NO_DATA = "saves", "costs", "not within target", "no data"
WITHIN_NOISE, ONE_REPEAT = "within noise", "one paired repeat"
#: At equal latency: settings valid but left unjudged for want of usable repeats (the
#: baseline's reference or the drafter's settings), none judged: not "no data".
TOO_FEW = "too few repeats"
#: Verdicts on one ratio: the values of `verdict_*` (NOT_WITHIN and TOO_FEW only at equal
#: latency).
VERDICTS = (SAVES, LOSES, WITHIN_NOISE, ONE_REPEAT, TOO_FEW, NOT_WITHIN, NO_DATA)


def _batches(values: Sequence[int]) -> str:
    return ("batch " if len(values) == 1 else "batches ") + ", ".join(str(v) for v in values)


def break_even_summary(states: Sequence[tuple[int, str]]) -> str:
    """What a drafter did across batches, in words: `states` pairs each batch with SAVES,
    LOSES (costs: energy per token above the baseline's), WITHIN_NOISE (the interval holds
    1), ONE_REPEAT (one paired repeat: no interval), TOO_FEW (too few usable repeats to judge
    a setting), NOT_WITHIN (no setting met the baseline's latency) or NO_DATA (nothing valid
    measured).

    "saves at every batch", "saves up to batch 16", "saves from batch 32", "never saves",
    "within noise at every batch", "never within target", "no data", or the batches where it
    saves, followed by the batches where it is within noise and those that could not be
    judged, and why. Up to and from count batches within noise as not saving.
    """
    ordered = sorted(states)
    kinds = (SAVES, LOSES, WITHIN_NOISE, ONE_REPEAT, TOO_FEW, NOT_WITHIN, NO_DATA)
    of = {kind: [b for b, s in ordered if s == kind] for kind in kinds}
    saves, loses, noise = of[SAVES], of[LOSES], of[WITHIN_NOISE]
    short, slow, missing = of[ONE_REPEAT], of[NOT_WITHIN], of[NO_DATA]
    few = of[TOO_FEW]
    not_saving = sorted(loses + noise)
    if not saves and not not_saving:
        # "never within target" only where no batch met it: a batch with one paired repeat
        # did (its ratio exists), so the batches are named instead.
        if slow and not short and not few:
            head, slow = "never within target", []
        elif short:
            head, short = f"{ONE_REPEAT} at {_batches(short)}", []
        elif few:
            head, few = f"{TOO_FEW} at {_batches(few)}", []
        else:
            return NO_DATA
    elif not saves and not loses:
        everywhere = not (short or few or slow or missing)
        head = "within noise at every batch" if everywhere else f"within noise at {_batches(noise)}"
        noise = []
    elif not saves:
        head = "never saves"
    elif not not_saving and not short and not few and not slow and not missing:
        return "saves at every batch"
    elif not not_saving:
        head = f"saves at {_batches(saves)}"
    elif max(saves) < min(not_saving):
        head = f"saves up to batch {max(saves)}"
    elif max(not_saving) < min(saves):
        head = f"saves from batch {min(saves)}"
    else:
        head = f"saves at {_batches(saves)}"
    parts = [head]
    if noise:
        parts.append(f"within noise at {_batches(noise)}")
    if short:
        parts.append(f"{ONE_REPEAT} at {_batches(short)}")
    if few:
        parts.append(f"{TOO_FEW} at {_batches(few)}")
    if slow:
        parts.append(f"not within target at {_batches(slow)}")
    if missing:
        parts.append(f"no data at {_batches(missing)}")
    return "; ".join(parts)


def verdict(ratio: float, low: float, high: float, paired: int, *, point: bool) -> str:
    """SAVES, LOSES (costs), WITHIN_NOISE, ONE_REPEAT or NO_DATA for one paired ratio.

    With an interval (low, high), a verdict needs it to exclude 1 (values within the bounds'
    rounding of 1 do not); `point` (a cube with one repeat, where no interval over repeats
    can exist) judges by the cells' own intervals (`cell_intervals`: saves below 1, costs
    above, else within noise), and where no cell states one, the point value: below 1 saves,
    at or above costs.
    """
    # An infinite ratio (the baseline at zero energy per token) is judged like any other:
    # it costs, or is within noise beside finite ones; only NaN is no ratio.
    if paired == 0 or np.isnan(ratio):
        return NO_DATA
    if point and np.isnan(high):  # no cell states an interval: the point value itself
        return SAVES if ratio < 1.0 else LOSES
    if point:  # the cells' own intervals (`cell_intervals`)
        return SAVES if high < 1.0 else LOSES if low > 1.0 else WITHIN_NOISE
    if paired < 2:
        return ONE_REPEAT
    if meets(high, 1.0, strict=True):
        return SAVES
    if not meets(low, 1.0):
        return LOSES
    return WITHIN_NOISE


@dataclass(frozen=True)
class Paired:
    """Per-repeat ratios of two arms reduced over the repeat axis: mean, interval bounds, the
    repeats behind them (`paired`) and those valid in one arm only (`dropped`; 0 where an
    arm has no valid repeat at all)."""

    ratio: np.ndarray
    low: np.ndarray
    high: np.ndarray
    paired: np.ndarray
    dropped: np.ndarray


def paired_ratio(
    mine: np.ndarray,
    base: np.ndarray,
    confidence: float,
    unasked: tuple[np.ndarray, np.ndarray] | None = None,
) -> Paired:
    """`mine / base` paired by repeat (the last axis; NaN: not valid), per leading index: the
    geometric mean of the per-repeat ratios and the Student-t interval of their mean log, taken
    back to ratios, so that swapping the arms gives the reciprocal ratio and the opposite
    verdict (an arithmetic mean of ratios can say "costs" both ways round). `unasked` (each
    arm's, nonzero where adaptive repeats' rule never asked for the repeat) keeps a repeat the
    other arm was never asked for out of `dropped`: it is not a loss."""
    mine = np.asarray(mine, dtype=float)
    base = np.asarray(base, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        # The log of each per-repeat ratio (paired_ratios, every row at once: NaN where either
        # arm is, or 0 / 0), as a difference of logs: swapping the arms negates it exactly.
        x = np.log(mine) - np.log(base)
        # One paired repeat's ratio is its own a / b, exactly (exp(log a - log b) is not).
        direct = mine / base
    # The repeats paired, said as such even in a row that gets no ratio below.
    pairs = np.count_nonzero(~np.isnan(x), axis=-1)
    # A row with a zero energy in each arm (ratios 0 and infinity) has no mean log: none.
    x[np.isposinf(x).any(axis=-1) & np.isneginf(x).any(axis=-1)] = np.nan
    count = np.count_nonzero(~np.isnan(x), axis=-1)
    # interval(): the two-sided Student-t interval of the mean log ratio, each side at
    # (1 + c) / 2, with two or more; the lower end is minus the upper end of the negated logs,
    # so swapping the arms swaps the ends exactly. Back to ratios: the geometric mean of the
    # per-repeat ratios and its interval, the reciprocals of the swapped arms'.
    side = (1 + confidence) / 2
    two = count >= 2
    # A zero energy in one arm (a log ratio of minus or plus infinity, never both here) has
    # no spread to take a t interval of: where every paired repeat has it, the interval is
    # that one point (a ratio of 0 saves, as its geometric mean says); beside finite ones,
    # it is unbounded (0 to infinity: within noise).
    infinite = np.isinf(x)
    some = infinite.any(axis=-1) & two
    every = some & (infinite | np.isnan(x)).all(axis=-1)
    high, _ = upper_bounds(x, side, two & ~some)
    low = -upper_bounds(-x, side, two & ~some)[0]
    mean = finite_means(x)
    high = np.where(every, mean, np.where(some, np.inf, high))
    low = np.where(every, mean, np.where(some, -np.inf, low))
    with np.errstate(over="ignore"):
        ratio, low, high = np.exp(mean), np.exp(low), np.exp(high)
    one = np.nansum(np.where(np.isnan(x), np.nan, direct), axis=-1)
    ratio = np.where(count == 1, one, ratio)
    # An arm with nothing valid gives no ratio with or without pairing: nothing dropped.
    lost = np.isnan(mine) != np.isnan(base)
    if unasked is not None:
        never = np.nan_to_num(unasked[0]) + np.nan_to_num(unasked[1])
        lost &= never == 0
    dropped = np.count_nonzero(lost, axis=-1)
    nothing = np.isnan(mine).all(axis=-1) | np.isnan(base).all(axis=-1)
    return Paired(
        ratio,
        low,
        high,
        pairs.astype(int),
        np.where(nothing, 0, dropped).astype(int),
    )


def cell_intervals(pairs: Paired, mine_ci: np.ndarray, base_ci: np.ndarray) -> Paired:
    """`pairs` of a one-repeat cube with the interval its cells state: each arm's relative
    half-width over its rounds (energy_per_token_rel_ci, the last axis the one repeat; NaN:
    none stated) combined in quadrature around the ratio. Where neither arm states one, or
    the ratio is not finite, the interval stays NaN (the point value is judged)."""
    mine_w = np.abs(np.asarray(mine_ci, dtype=float)[..., 0])
    base_w = np.abs(np.asarray(base_ci, dtype=float)[..., 0])
    width = np.hypot(np.nan_to_num(mine_w), np.nan_to_num(base_w))
    stated = (width > 0) & np.isfinite(pairs.ratio) & (pairs.paired == 1)
    with np.errstate(over="ignore", invalid="ignore"):
        low = np.where(stated, pairs.ratio * np.exp(-width), np.nan)
        high = np.where(stated, pairs.ratio * np.exp(width), np.nan)
    return Paired(pairs.ratio, low, high, pairs.paired, pairs.dropped)


def compare(
    cube: xr.Dataset,
    *,
    baseline: str = "none",
    metric: str = "tpot",
    quantile: float = 0.5,
    confidence: float = 0.95,
    grid_from_data: bool = False,
) -> xr.Dataset:
    """Energy of each drafter relative to `baseline`, per batch and corpus.

    `grid_from_data`: one GPU of a merged cube, whose grid holds only its own stock setting of
    a knob its campaign left at stock (`headroom`'s)."""
    import xarray as xr

    if "gpu" in cube.dims:  # merged cube: each GPU against its own stock setting
        from dvfs.analysis.headroom import single_gpu

        parts = [
            compare(
                single_gpu(cube, g),
                baseline=baseline,
                metric=metric,
                quantile=quantile,
                confidence=confidence,
                grid_from_data=True,
            )
            for g in cube["gpu"].values
        ]
        merged = xr.concat(parts, dim="gpu", join="outer", combine_attrs="drop_conflicts")
        merged.attrs["reference_per_gpu"] = reference_per_gpu(cube["gpu"].values, parts)
        return merged.assign_coords(gpu=cube["gpu"].values)
    drafters = [str(d) for d in cube["drafter"].values]
    if baseline not in drafters:
        raise AnalysisError(
            f"baseline drafter {baseline!r} is not in the cube (drafters: {', '.join(drafters)})"
        )
    if drafters == [baseline]:
        raise AnalysisError(
            f"the cube has no drafter besides the baseline {baseline!r}: nothing to compare; "
            "sweep a speculative drafter too, or pick another --baseline"
        )
    ref = reference_setting(cube)
    at_ref = {"sm_clock": ref.sm_clock, "power_limit": ref.power_limit}
    point = int(cube.sizes.get("repeat", 1)) <= 1  # no interval anywhere: judge point values
    per_repeat = cube["energy_per_token_j"].where(valid_mask(cube))
    energy = per_repeat.mean("repeat")  # each arm's own mean, for the energies shown
    cell_dims = [str(d) for d in per_repeat.dims if d != "repeat"]
    base_per_repeat = per_repeat.sel(drafter=baseline, drop=True).broadcast_like(per_repeat)
    # Adaptive repeats one arm's rule never asked for: not measured, and not lost to pairing.
    unasked = unasked_repeats(cube).astype(float).broadcast_like(per_repeat)
    base_unasked = unasked.sel(drafter=baseline, drop=True).broadcast_like(per_repeat)

    def by_cell(values: xr.DataArray) -> np.ndarray:
        return values.transpose(*cell_dims, "repeat").values

    by_clock = paired_ratio(
        by_cell(per_repeat),
        by_cell(base_per_repeat),
        confidence,
        (by_cell(unasked), by_cell(base_unasked)),
    )

    def cells(values: np.ndarray, **attrs: str) -> xr.DataArray:
        coords = {d: cube[d].values for d in cell_dims}
        return xr.DataArray(values, dims=cell_dims, coords=coords, attrs=attrs)

    ratio_clock = cells(
        by_clock.ratio,
        units="1",
        long_name="energy per token over the baseline's, same setting (geometric mean of the "
        "per-repeat ratios over the repeats valid in both)",
    )
    at_stock = ratio_clock.sel(at_ref, drop=True)

    drafter_best = headroom(
        cube,
        target=Target("vs-baseline", metric, quantile, baseline=baseline),
        confidence=confidence,
        grid_from_data=grid_from_data,
    )
    baseline_best = headroom(
        cube,
        target=Target("preserve", metric, quantile),
        confidence=confidence,
        grid_from_data=grid_from_data,
    )
    base_best_energy = baseline_best["chosen_energy_per_token_j"].sel(drafter=baseline, drop=True)
    by_latency = paired_ratio(
        *chosen_per_repeat(per_repeat, drafter_best, baseline_best, baseline),
        confidence,
        chosen_per_repeat(unasked, drafter_best, baseline_best, baseline),
    )
    if point:  # no interval over repeats: the one the cells state (`cell_intervals`)
        if ENERGY_CI in cube.variables:
            ci = cube[ENERGY_CI].where(valid_mask(cube))
        else:  # a cube of an earlier dvfs: its cells state none
            ci = per_repeat * np.nan
        base_ci = ci.sel(drafter=baseline, drop=True).broadcast_like(per_repeat)
        by_clock = cell_intervals(by_clock, by_cell(ci), by_cell(base_ci))
        by_latency = cell_intervals(
            by_latency, *chosen_per_repeat(ci, drafter_best, baseline_best, baseline)
        )
    groups = {d: cube[d].values for d in GROUPS}

    def grouped(values: np.ndarray, **attrs: str) -> xr.DataArray:
        return xr.DataArray(values, dims=GROUPS, coords=groups, attrs=attrs)

    ratio_latency = grouped(
        by_latency.ratio,
        units="1",
        long_name="energy per token at headroom's setting within the baseline's stock "
        "latency, over the baseline's within the same latency (geometric mean of the "
        "per-repeat ratios over the repeats valid in both)",
    )

    # Equal latency is undefined either because no setting of the drafter met the baseline's
    # stock latency (not within target: settings were judged, all over it) or because there
    # was nothing to judge (no valid cell; every setting with an invalid repeat, or too few
    # usable ones): a drafter never judged is not too slow.
    measured = valid_mask(cube).any(["sm_clock", "power_limit", "repeat"])
    not_within = (
        (
            ~drafter_best["feasible"].astype(bool)
            & (drafter_best["judged_settings"] > 0)
            & measured
            & np.isfinite(drafter_best["reference_latency_ms"])
            & np.isfinite(base_best_energy)
        )
        .transpose(*GROUPS)
        .values
    )

    # No ratio at equal latency because a side's settings were all left unjudged for want of
    # usable repeats (the baseline's reference with one, say): there are data, too few. A
    # reference with none usable is no data.
    def unjudged(best: xr.Dataset) -> xr.DataArray:
        return (
            (best["judged_settings"] == 0)
            & (best["short_settings"] > 0)
            & np.isfinite(best["reference_latency_ms"])
        )

    too_few = (
        (
            unjudged(drafter_best)
            | unjudged(baseline_best)
            .sel(drafter=baseline, drop=True)
            .broadcast_like(drafter_best["judged_settings"])
        )
        .transpose(*GROUPS)
        .values
    )

    def verdicts(
        pairs: Paired, slow: np.ndarray | None, few: np.ndarray | None = None
    ) -> np.ndarray:
        out = np.empty(pairs.ratio.shape, dtype=object)
        for idx in np.ndindex(out.shape):
            out[idx] = verdict(
                float(pairs.ratio[idx]),
                float(pairs.low[idx]),
                float(pairs.high[idx]),
                int(pairs.paired[idx]),
                point=point,
            )
            if out[idx] == NO_DATA and slow is not None and slow[idx]:
                out[idx] = NOT_WITHIN
            elif out[idx] == NO_DATA and few is not None and few[idx]:
                out[idx] = TOO_FEW
        return out

    stock_pairs = Paired(
        *(
            cells(getattr(by_clock, f.name)).sel(at_ref, drop=True).transpose(*GROUPS).values
            for f in fields(Paired)
        )
    )
    clock_verdicts = verdicts(stock_pairs, None)
    latency_verdicts = verdicts(by_latency, not_within, too_few)

    def break_even(states: np.ndarray) -> xr.DataArray:
        """The smallest batch judged not to save (costs, or within noise); NaN: none. The
        smallest by value: the batch axis is in the campaign's order, which need not ascend
        (`batch = [16, 1, 4]`)."""
        batches = cube["batch"].values
        out = np.full((states.shape[1], states.shape[2]), np.nan)
        for d, c in np.ndindex(out.shape):
            stops = [
                batches[k] for k, v in enumerate(states[:, d, c]) if v in (LOSES, WITHIN_NOISE)
            ]
            if stops:
                out[d, c] = min(stops)
        dims = GROUPS[1:]
        return xr.DataArray(out, dims=dims, coords={k: groups[k] for k in dims})

    def summary(states: np.ndarray) -> xr.DataArray:
        batches = [int(b) for b in cube["batch"].values]
        out = np.empty((states.shape[1], states.shape[2]), dtype=object)
        for d, c in np.ndindex(out.shape):
            out[d, c] = break_even_summary(list(zip(batches, states[:, d, c], strict=True)))
        dims = GROUPS[1:]
        return xr.DataArray(out, dims=dims, coords={k: groups[k] for k in dims})

    def interval_of(pairs: Paired, what: str) -> dict[str, xr.DataArray]:
        level = level_text(confidence)
        return {
            f"energy_ratio_{what}_low": grouped(
                pairs.low,
                units="1",
                long_name=f"lower end of the two-sided {level} Student-t interval of "
                f"energy_ratio_{what} (NaN: fewer than two paired repeats)",
            ),
            f"energy_ratio_{what}_high": grouped(
                pairs.high,
                units="1",
                long_name=f"upper end of the two-sided {level} Student-t interval of "
                f"energy_ratio_{what} (NaN: fewer than two paired repeats)",
            ),
            f"paired_repeats_{what}": grouped(
                pairs.paired,
                units="1",
                long_name="repeats valid in both arms, behind the ratio",
            ),
            f"dropped_repeats_{what}": grouped(
                pairs.dropped,
                units="1",
                long_name="repeats valid in one arm only, left out of the ratio",
            ),
            f"verdict_{what}": grouped(
                latency_verdicts if what == "equal_latency" else clock_verdicts,
                long_name="saves, costs, within noise, one paired repeat, too few repeats, not "
                "within target or no data",
            ),
        }

    # A ratio at equal latency whose drafter's (or baseline's) setting is the lowest clock or
    # power limit the grid has: a setting below the grid might spend less, so the ratio may
    # move (lower for the drafter's, higher for the baseline's) once the grid is extended.
    has_ratio = np.isfinite(by_latency.ratio)
    drafter_edge = drafter_best["chosen_at_grid_edge"].astype(bool).transpose(*GROUPS).values

    def baseline_flag(name: str) -> np.ndarray:
        return (
            baseline_best[name]
            .astype(bool)
            .sel(drafter=baseline, drop=True)
            .broadcast_like(drafter_best[name])
            .transpose(*GROUPS)
            .values
        )

    baseline_edge = baseline_flag("chosen_at_grid_edge")
    # Which knob either arm's setting is at the edge of: only one that can go lower (a clock
    # or power limit at the GPU's floor is no edge), so the note names only what to extend.
    knob_edges = {
        knob: (drafter_best[name].astype(bool).transpose(*GROUPS).values | baseline_flag(name))
        & has_ratio
        for knob, name in (
            ("sm_clock", "chosen_at_clock_edge"),
            ("power_limit", "chosen_at_limit_edge"),
        )
    }
    # Not within target, yet the fastest setting's mean latency met it: only its bound at the
    # confidence asked did not (too few or too noisy repeats), so the drafter is not "too slow".
    point_within = not_within & (
        (drafter_best["fastest_latency_ms"] <= drafter_best["target_ms"]).transpose(*GROUPS).values
    )
    on_text, different = arms_gpus(cube, baseline)
    # The acceptance figure's cells: a setting with an invalid repeat is left out whole, as
    # headroom leaves it (`ruled_out_settings`), so the table and the figure give one number.
    accept = (
        cube["accept_length"].where(valid_mask(cube) & ~ruled_out_settings(cube))
        if "accept_length" in cube
        else None
    )
    data = {
        "energy_ratio_at_stock": at_stock.assign_attrs(
            units="1", long_name="energy per token over the baseline's, both at the stock setting"
        ),
        "energy_ratio_equal_clock": ratio_clock,
        "energy_ratio_equal_latency": ratio_latency,
        "break_even_batch_equal_clock": break_even(clock_verdicts).assign_attrs(
            units="1",
            long_name="smallest batch where the drafter stops saving energy (stock); NaN: none, "
            "see break_even_equal_clock",
        ),
        "break_even_batch_equal_latency": break_even(latency_verdicts).assign_attrs(
            units="1",
            long_name="smallest batch where the drafter stops saving energy (equal latency); "
            "NaN: none, see break_even_equal_latency",
        ),
        "break_even_equal_clock": summary(clock_verdicts).assign_attrs(
            long_name="where the drafter saves energy against the baseline, same setting"
        ),
        "break_even_equal_latency": summary(latency_verdicts).assign_attrs(
            long_name="where the drafter saves energy against the baseline, equal latency"
        ),
        "energy_per_token_at_stock_j": energy.sel(at_ref, drop=True).assign_attrs(
            units="J", long_name="energy per token at the reference setting"
        ),
        "equal_latency_drafter_at_grid_edge": grouped(
            drafter_edge & has_ratio,
            units="1",
            long_name="the drafter's setting at equal latency is the lowest clock or power "
            "limit swept: one below the grid might spend less (the ratio may be lower)",
        ),
        "equal_latency_baseline_at_grid_edge": grouped(
            baseline_edge & has_ratio,
            units="1",
            long_name="the baseline's setting at equal latency is the lowest clock or power "
            "limit swept: one below the grid might spend less (the ratio may be higher)",
        ),
        "equal_latency_sm_clock_at_grid_edge": grouped(
            knob_edges["sm_clock"],
            units="1",
            long_name="a setting at equal latency (either arm's) is at the lowest clock swept, "
            "above the GPU's lowest: extend knobs.sm_clock downward",
        ),
        "equal_latency_power_limit_at_grid_edge": grouped(
            knob_edges["power_limit"],
            units="1",
            long_name="a setting at equal latency (either arm's) is at the lowest power limit "
            "swept, above the GPU's lowest: extend knobs.power_limit downward",
        ),
        "equal_latency_mean_within_target": grouped(
            point_within,
            units="1",
            long_name="not within target, but the fastest setting's mean latency met the "
            "baseline's: its bound at the confidence asked did not",
        ),
        **interval_of(stock_pairs, "at_stock"),
        **interval_of(by_latency, "equal_latency"),
        "measured_on": on_text,
        "different_gpus": different,
    }
    if accept is not None:
        data["accept_length"] = accept.mean(
            [d for d in accept.dims if d not in ("drafter", "corpus", "gpu")]
        ).assign_attrs(units="1", long_name="mean accept length (tokens per verify pass)")
    # Arrays taken from the headroom results carry its `measured_on` coordinates (the GPUs
    # of a chosen setting): dropped, so `measured_on` here is the arms' own (`arms_gpus`).
    result = xr.Dataset(
        {
            name: value.drop_vars(["measured_on", "reference_measured_on"], errors="ignore")
            for name, value in data.items()
        }
    )
    result.attrs.update(
        baseline=baseline,
        latency=f"{metric.upper()} p{int(quantile * 100)}",
        reference_sm_clock_mhz=ref.sm_clock,
        reference_power_limit_w=ref.power_limit,
        reference_is_stock=int(ref.is_stock),
        stock_sm_clock_mhz=ref.stock_sm_clock if ref.stock_sm_clock is not None else ref.sm_clock,
        stock_power_limit_w=(
            ref.stock_power_limit if ref.stock_power_limit is not None else ref.power_limit
        ),
        confidence=confidence,
        interval=interval_description(confidence, point),
    )
    return result


def interval_description(confidence: float, point: bool) -> str:
    """How saves / costs were judged, in words (the headroom wording for one repeat)."""
    if point:
        return (
            "one repeat: no interval over repeats was possible; the interval the cells state "
            "(each arm's energy_per_token_rel_ci over its rounds, combined in quadrature) was "
            "judged: saves or costs only where it excludes 1, else within noise (where no cell "
            "states one, the point value: below 1 saves, at or above costs)"
        )
    return (
        f"two-sided {level_text(confidence)} Student-t interval of the mean log of the "
        "per-repeat ratios over the repeats valid in both arms (a geometric mean): saves or "
        "costs only where it excludes 1, else within noise; at equal latency each arm's "
        "setting is headroom's (the least-energy one of those saving beyond the noise, else "
        "stock), picked on the same repeats, so where several of the drafter's settings spend "
        'alike its ratio leans low and "saves" comes out more often than the level allows'
    )


def chosen_per_repeat(
    per_repeat: xr.DataArray, drafter_best: xr.Dataset, baseline_best: xr.Dataset, baseline: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per (batch, drafter, corpus, repeat): the energy per token at the drafter's chosen
    setting and at the baseline's (NaN: no chosen setting, or the repeat not valid)."""
    order = (*GROUPS, "sm_clock", "power_limit", "repeat")
    e = per_repeat.transpose(*order).values
    clock_at = {int(c): i for i, c in enumerate(per_repeat["sm_clock"].values)}
    limit_at = {float(p): i for i, p in enumerate(per_repeat["power_limit"].values)}
    b = [str(d) for d in per_repeat["drafter"].values].index(baseline)

    def chosen(best: xr.Dataset) -> tuple[np.ndarray, np.ndarray]:
        return (
            best["chosen_sm_clock"].transpose(*GROUPS).values,
            best["chosen_power_limit"].transpose(*GROUPS).values,
        )

    clocks, limits = chosen(drafter_best)
    base_clocks, base_limits = chosen(baseline_best)
    mine = np.full(e.shape[:3] + e.shape[-1:], np.nan)
    base = np.full_like(mine, np.nan)
    for idx in np.ndindex(e.shape[:3]):
        here = (clocks[idx], limits[idx])
        there = (base_clocks[idx[0], b, idx[2]], base_limits[idx[0], b, idx[2]])
        if not np.isfinite([*here, *there]).all():
            continue
        mine[idx] = e[idx + (clock_at[int(here[0])], limit_at[float(here[1])])]
        base[idx] = e[(idx[0], b, idx[2], clock_at[int(there[0])], limit_at[float(there[1])])]
    return mine, base


def arms_gpus(cube: xr.Dataset, baseline: str) -> tuple[xr.DataArray, xr.DataArray]:
    """Per (batch, drafter, corpus): the GPUs that measured the drafter's valid cells
    (comma-joined), and whether they differ from those that measured the baseline's at the
    same batch and corpus: then GPU-to-GPU spread is part of every ratio between the two."""
    import xarray as xr

    order = ("batch", "drafter", "corpus", "sm_clock", "power_limit", "repeat")
    labels = measured_on(cube).transpose(*order).values
    ok = valid_mask(cube).transpose(*order).values
    drafters = [str(d) for d in cube["drafter"].values]
    b = drafters.index(baseline)
    shape = labels.shape[:3]
    text = np.full(shape, "", dtype=object)
    different = np.zeros(shape, dtype=bool)
    for idx in np.ndindex(shape):
        mine = gpu_set(labels[idx], ok[idx])
        theirs = gpu_set(labels[idx[0], b, idx[2]], ok[idx[0], b, idx[2]])
        text[idx] = gpu_text(mine)
        different[idx] = bool(mine) and bool(theirs) and mine != theirs
    coords = {d: cube[d].values for d in order[:3]}
    return (
        xr.DataArray(
            text,
            dims=order[:3],
            coords=coords,
            attrs={"units": "1", "long_name": "GPUs that measured the drafter's valid cells"},
        ),
        xr.DataArray(
            different,
            dims=order[:3],
            coords=coords,
            attrs={
                "units": "1",
                "long_name": "the drafter and the baseline were measured on different GPUs",
            },
        ),
    )
