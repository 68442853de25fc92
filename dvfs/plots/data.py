"""The numbers the figures draw, as plain arrays: valid settings averaged over repeats, and the
energy-latency Pareto front. Pure functions; no matplotlib here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.analysis.headroom import ruled_out_settings, valid_mask

if TYPE_CHECKING:
    import xarray as xr


def usable_mask(cube: xr.Dataset) -> xr.DataArray:
    """The valid repeats of settings without an invalid one: a setting with an invalid repeat
    is left out whole, as headroom never chooses it; but for the reference while enough of its
    repeats are usable, which headroom takes as the reference and may choose
    (`ruled_out_settings`)."""
    return valid_mask(cube) & ~ruled_out_settings(cube)


def flagged_drafters(cube: xr.Dataset, drafters: Sequence[str], **sel: Any) -> list[str]:
    """Of `drafters` (those a panel draws no point of), the ones with a valid cell where the
    panel looks (`sel`: its corpus, batch, setting): each such setting was left out for an
    invalid repeat beside its valid ones, not for want of a valid cell."""
    valid = valid_mask(cube).sel(**sel)
    has = valid.any([d for d in valid.dims if d != "drafter"])
    return [d for d in drafters if bool(has.sel(drafter=d))]


def cell_means(
    cube: xr.Dataset,
    name: str,
    dims: tuple[str, ...],
    *,
    usable: xr.DataArray | None = None,
    **sel: Any,
) -> np.ndarray:
    """`name` over valid cells, averaged over repeats, as an array with axes in `dims` order;
    NaN for a setting with an invalid repeat. `usable` is `usable_mask(cube)`, made here when
    not given: a caller asking for several means of one cube makes it once."""
    usable = usable_mask(cube) if usable is None else usable
    values = cube[name].where(usable).sel(**sel).mean("repeat")
    return np.asarray(values.transpose(*dims).values, dtype=float)


def at_chosen(
    picks: xr.Dataset,
    values: np.ndarray,
    clocks: Sequence[float],
    limits: Sequence[float],
    fallback: np.ndarray,
) -> np.ndarray:
    """`values` (axes batch, drafter, power limit, clock: as a figure draws them) at each
    (batch, drafter)'s chosen setting in `picks` (headroom's, of one corpus, axes batch and
    drafter), NaN where none meets the target: the marker of a setting sits on the point drawn
    for it. Headroom's own value (`fallback`) stands only where no point is drawn there. (Its
    chosen energy and latency are over the repeats paired with the reference, the saving's: a
    repeat flagged at the reference alone would set the marker apart from every point.)"""
    feasible = picks["feasible"].values.astype(bool)
    clock = picks["chosen_sm_clock"].values
    limit = picks["chosen_power_limit"].values
    clock_at = {float(c): i for i, c in enumerate(clocks)}
    limit_at = {float(p): i for i, p in enumerate(limits)}
    out = np.full(feasible.shape, np.nan)
    for idx in zip(*np.nonzero(feasible), strict=True):
        ci, pi = clock_at.get(float(clock[idx])), limit_at.get(float(limit[idx]))
        drawn = values[(*idx, pi, ci)] if ci is not None and pi is not None else np.nan
        out[idx] = drawn if np.isfinite(drawn) else fallback[idx]
    return out


def pareto_front(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The points no other point beats on both x and y (both lower is better), sorted by x.

    NaN points are ignored. A point ties into the front when it equals the best y so far.
    """
    x = np.asarray(x, dtype=float).ravel()
    y = np.asarray(y, dtype=float).ravel()
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    order = np.lexsort((y, x))
    x, y = x[order], y[order]
    on_front = y <= np.minimum.accumulate(y) if y.size else np.zeros(0, dtype=bool)
    return x[on_front], y[on_front]
