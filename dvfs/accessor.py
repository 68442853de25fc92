"""`ds.dvfs`: a thin accessor that checks a cube's shape and delegates to the analyses."""

from __future__ import annotations

from typing import Any

import xarray as xr

from dvfs.cube import check_cube


@xr.register_dataset_accessor("dvfs")
class DvfsAccessor:
    """Analyses of a dvfs cube; every method returns new objects and never mutates the cube."""

    def __init__(self, ds: xr.Dataset) -> None:
        self._ds = check_cube(ds)

    @property
    def stock(self) -> dict[str, Any]:
        """The reference setting: the unlocked clock (max SM clock) at the stock power limit."""
        return {
            "sm_clock": int(self._ds.attrs["stock_sm_clock_mhz"]),
            "power_limit": float(self._ds.attrs["stock_power_limit_w"]),
        }
