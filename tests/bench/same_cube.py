"""Whether two cubes are the same: every data variable and coordinate, exactly or within a
relative tolerance, NaN equal to NaN. `python tests/bench/same_cube.py A.nc B.nc [--rtol R]`;
exit 0 when they are, 1 with the differences listed when not. A variable only in B (a new
quantity the newer dvfs records) changes none of A's: it is named, not a difference; one only
in A (a quantity lost) is.

Used to check that an optimisation leaves the twin's cube as it was (issue 15).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import xarray as xr


def _differ(name: str, x: np.ndarray, y: np.ndarray, rtol: float) -> str | None:
    """What differs between two arrays (None: the same within rtol, NaN == NaN)."""
    if x.shape != y.shape:
        return f"{name}: shape {x.shape} vs {y.shape}"
    if x.dtype.kind not in "fiub" or y.dtype.kind not in "fiub":
        same = np.array_equal(x.astype(str), y.astype(str))
        return None if same else f"{name}: labels differ"
    x, y = x.astype(float), y.astype(float)
    if not np.array_equal(np.isnan(x), np.isnan(y)):
        return f"{name}: NaN in different places ({int((np.isnan(x) != np.isnan(y)).sum())})"
    both = ~np.isnan(x)
    diff = np.abs(x[both] - y[both])
    if not diff.size or not diff.max() > 0:
        return None
    scale = np.maximum(np.abs(x[both]), np.abs(y[both]))
    rel = diff / np.where(scale > 0, scale, 1.0)
    if rel.max() <= rtol:
        return None
    return (
        f"{name}: {int((rel > rtol).sum())} of {diff.size} values differ, "
        f"max abs {diff.max():.3g}, max rel {rel.max():.3g}"
    )


def _names(ds: xr.Dataset) -> set[str]:
    return set(map(str, ds.data_vars)) | set(map(str, ds.coords))


def added(a_path: Path, b_path: Path) -> list[str]:
    """The variables and coordinates only in B: new quantities, which `compare` leaves out."""
    with xr.open_dataset(a_path) as a, xr.open_dataset(b_path) as b:
        return sorted(_names(b) - _names(a))


def _without(ds: xr.Dataset, drafters: frozenset[str]) -> xr.Dataset:
    """`ds` without the drafters named (by their labels, `drafter_label`, as a cube file keeps
    them; the `drafter` coordinate holds their indices)."""
    if not drafters or "drafter" not in ds.dims:
        return ds
    labels = ds["drafter_label"].values if "drafter_label" in ds else ds["drafter"].values
    kept = [i for i, label in enumerate(labels) if str(label) not in drafters]
    return ds.isel(drafter=kept)


def compare(
    a_path: Path,
    b_path: Path,
    rtol: float = 1e-9,
    leave_out: frozenset[str] = frozenset(),
    leave_out_drafters: frozenset[str] = frozenset(),
) -> tuple[bool, list[str], int]:
    """(same, the differences, how many variables and coordinates were compared), over every
    variable and coordinate in both but those in `leave_out`, and over the drafters but those
    in `leave_out_drafters` (changed on purpose since A was made); one only in A is a
    difference, one only in B new (`added`), not one."""
    with xr.open_dataset(a_path) as a_file, xr.open_dataset(b_path) as b_file:
        a, b = _without(a_file, leave_out_drafters), _without(b_file, leave_out_drafters)
        lines: list[str] = []
        names_a = _names(a) - leave_out
        names_b = _names(b) - leave_out
        for name in sorted(names_a - names_b):
            lines.append(f"{name}: only in the first")
        common = sorted(names_a & names_b)
        for name in common:
            problem = _differ(name, a[name].values, b[name].values, rtol)
            if problem:
                lines.append(problem)
        return not lines, lines, len(common)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="a cube, or the sweep folder holding it")
    parser.add_argument("b", type=Path, help="a cube, or the sweep folder holding it")
    parser.add_argument("--rtol", type=float, default=1e-9)
    opts = parser.parse_args()
    # a sweep's folder stands for the cube in it
    a, b = (path / "cube.nc" if path.is_dir() else path for path in (opts.a, opts.b))
    for path in (a, b):
        if not path.is_file():
            parser.error(f"{path}: no such cube")
    same, lines, n = compare(a, b, opts.rtol)
    print(f"{'same' if same else 'DIFFERENT'}: {n} variables and coordinates (rtol {opts.rtol:g})")
    new = added(a, b)
    if new:
        print(f"  new in the second, not compared: {', '.join(new)}")
    for line in lines:
        print(f"  {line}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
