"""Which measured cells missed the precision their campaign asked: the sweep measures a cell's
rounds until its intervals on energy per token and on median TPOT reach
`measurement.precision` (`dvfs.measure.runner.Runner._precise`), at most
`measurement.max_rounds`, and keeps the cell where the last round leaves it. A cell whose
interval (`energy_per_token_rel_ci`, `latency_rel_ci`) is still wider stopped at
`max_rounds` short of the precision: valid, but less certain than asked. The cube records it
per cell (`precision_missed`), `dvfs cube info` counts it and `dvfs headroom` names the rows
whose answer rests on such a cell. (A window too short or a counter too slow for the precision
is flagged apart: short_window, few_counter_updates.)"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.measure.counter import within_precision

if TYPE_CHECKING:
    import xarray as xr

#: The cube's per-cell variable: 1 where the cell stopped at `max_rounds` with an interval
#: wider than the precision, 0 where it reached it (or the campaign asked no interval:
#: `max_rounds` 1), missing (NaN; -1 in the file) where the cell was not measured.
PRECISION_MISSED = "precision_missed"
PRECISION_MISSED_ATTRS = {
    "units": "1",
    "long_name": "1 if the cell stopped at measurement.max_rounds with its interval on energy "
    "per token or median TPOT wider than measurement.precision",
    "flag_values": np.array([0, 1], dtype=np.int8),
    "flag_meanings": "precision_reached precision_missed",
}
#: The intervals compared with the precision, as the sweep compares them.
INTERVALS = ("energy_per_token_rel_ci", "latency_rel_ci")


def asked(campaign: Any) -> tuple[float, int] | None:
    """The `measurement.precision` and `max_rounds` of a campaign (its dict, or its JSON as a
    cube keeps it); None where it records neither (a hand-built cube)."""
    if isinstance(campaign, str):
        try:
            campaign = json.loads(campaign or "null")
        except ValueError:
            return None
    measurement = campaign.get("measurement") if isinstance(campaign, Mapping) else None
    if not isinstance(measurement, Mapping):
        return None
    try:
        precision = float(measurement["precision"])
        max_rounds = int(measurement["max_rounds"])
    except (KeyError, TypeError, ValueError):
        return None
    return (precision, max_rounds) if math.isfinite(precision) else None


def missed(
    energy_ci: np.ndarray,
    latency_ci: np.ndarray,
    measured: np.ndarray,
    precision: float,
    max_rounds: int,
) -> np.ndarray:
    """`PRECISION_MISSED` from the cells' intervals: 1.0 where a measured cell's intervals
    fail the test the sweep stops a cell's rounds by (`dvfs.measure.counter.within_precision`:
    it stops only once they pass it, or at `max_rounds`), an energy interval the cell could not
    state (NaN: one in-flight block's infinite half-width, which the journal keeps as null)
    included; 0.0 where they pass it; NaN where the cell was not measured. A campaign of one
    round (`max_rounds` 1) asks no interval: none missed it."""
    wider = ~within_precision(energy_ci, latency_ci, precision)
    if max_rounds <= 1:
        wider = np.zeros(np.shape(measured), dtype=bool)
    return np.where(measured, wider.astype(np.float64), np.nan)


def precision_missed(ds: xr.Dataset) -> xr.DataArray | None:
    """Each cell's `PRECISION_MISSED` (1.0, 0.0, NaN where not measured) as the cube records
    it, or as its intervals and campaign say for a cube an earlier dvfs built; None where it
    records neither (no intervals, or no precision)."""
    from dvfs.cube.schema import STATUS_OK

    if PRECISION_MISSED in ds.data_vars:
        return ds[PRECISION_MISSED]
    wanted = asked(ds.attrs.get("campaign"))
    if wanted is None or not all(name in ds.data_vars for name in INTERVALS):
        return None
    energy, latency = (ds[name] for name in INTERVALS)
    measured = ds["cell_status"] == STATUS_OK
    values = missed(
        energy.values,
        latency.transpose(*energy.dims).values,
        measured.transpose(*energy.dims).values,
        *wanted,
    )
    return energy.copy(data=values)


def with_precision_missed(ds: xr.Dataset) -> xr.Dataset:
    """`ds` with its `PRECISION_MISSED` told from its intervals and campaign where an earlier
    dvfs built it without (`precision_missed`): a merge joining it with cubes that record the
    variable would leave its measured cells missing there (as if not measured). Unchanged
    where it records the variable or cannot tell it."""
    if PRECISION_MISSED in ds.data_vars:
        return ds
    values = precision_missed(ds)
    if values is None:
        return ds
    flags = values.copy()
    flags.attrs, flags.encoding = dict(PRECISION_MISSED_ATTRS), {}
    return ds.assign({PRECISION_MISSED: flags})


def missed_count(ds: xr.Dataset) -> dict[str, Any] | None:
    """How many measured cells missed the precision, of how many measured, with the
    precision and `max_rounds` asked (None where unknown: `precision_missed`)."""
    values = precision_missed(ds)
    if values is None:
        return None
    wanted = asked(ds.attrs.get("campaign"))
    flat = np.asarray(values.values, dtype=np.float64)
    return {
        "cells": int((flat == 1).sum()),
        "measured": int((~np.isnan(flat)).sum()),
        "precision": None if wanted is None else wanted[0],
        "max_rounds": None if wanted is None else wanted[1],
    }
