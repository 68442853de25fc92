"""dvfs: how much energy GPU clocks, power caps and speculative decoding really save.

Heavy libraries (xarray, matplotlib, seaborn) load only when a function that needs them is
called, so `dvfs --help` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dvfs.version import __version__

if TYPE_CHECKING:
    import xarray as xr


def open_cube(path: str) -> xr.Dataset:
    """Open a dvfs cube (a netCDF file, or a sweep folder holding cube.nc) with the `ds.dvfs`
    accessor registered."""
    import dvfs.accessor  # noqa: F401  (registers `ds.dvfs` on import)
    from dvfs.cube import open_cube as open_checked

    return open_checked(path)


def __getattr__(name: str) -> Any:
    if name == "load_campaign":
        from dvfs.campaign import load_campaign

        return load_campaign
    raise AttributeError(f"module 'dvfs' has no attribute {name!r}")


__all__ = ["__version__", "open_cube"]
