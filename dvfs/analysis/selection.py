"""The rows a user's filters name, checked against the cube: a value the cube lacks is refused
naming what it has, so a selection is never silently empty."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dvfs.errors import AnalysisError

if TYPE_CHECKING:
    import xarray as xr


class SelectionError(AnalysisError):
    """A filter names a value the cube lacks; `option` is the command-line option that gave it
    (so the CLI can report it as that option's bad value)."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


def check_drafter(ds: xr.Dataset, name: str, option: str) -> None:
    """Refuse a drafter the cube does not hold (`option` names where it came from)."""
    drafters = [str(d) for d in ds["drafter"].values]
    if name not in drafters:
        raise SelectionError(
            f"drafter {name!r} is not in the cube, which has {', '.join(drafters)}", option
        )


def select(
    ds: xr.Dataset,
    batch: Sequence[int] = (),
    drafter: Sequence[str] = (),
    corpus: Sequence[str] = (),
) -> xr.Dataset:
    """`ds` cut to these batches, drafters and corpora (an empty filter keeps every value); a
    repeated value is one row, not two."""
    sel: dict[str, list[Any]] = {}
    for dim, values in (
        ("batch", list(batch)),
        ("drafter", list(drafter)),
        ("corpus", list(corpus)),
    ):
        if values:
            known = [v.item() if hasattr(v, "item") else v for v in ds[dim].values]
            missing = [v for v in values if v not in known]
            if missing:
                listed = [v for v in missing if isinstance(v, str) and "," in v]
                hint = (
                    "; to give several, repeat the option: "
                    + " ".join(f"--{dim} {p.strip()}" for p in listed[0].split(",") if p.strip())
                    if listed
                    else ""
                )
                raise SelectionError(
                    f"{', '.join(map(str, missing))} not in the cube, which has "
                    f"{', '.join(map(str, known))}{hint}",
                    f"--{dim}",
                )
            sel[dim] = list(dict.fromkeys(values))
    return ds.sel(sel) if sel else ds
