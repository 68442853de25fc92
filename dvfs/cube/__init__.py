"""The cube: every cell's metrics in one `xarray.Dataset`, saved as netCDF4.

`schema` names its dimensions and variables (and keeps the schema's history) and checks a
dataset's shape; `build` assembles a cube from a journal, read through `dvfs.records`;
`files` writes and opens netCDF (`open_analysable`: a cube with something to analyse);
`merge` joins GPUs; `info` summarises for `dvfs cube info`, from what `knobs`, `cells_left`,
`idle`, `pinning` and `quality` say of a cube (read through `attrs`) for every command.
"""

from __future__ import annotations

from dvfs.cube.build import build_cube, read_journal
from dvfs.cube.files import open_analysable, open_cube, write_cube
from dvfs.cube.info import info_text
from dvfs.cube.merge import merge_cubes
from dvfs.cube.schema import (
    CELL_DIMS,
    COORD_ATTRS,
    CUBE_NAME,
    CUBE_SCHEMA,
    KNOB_DIMS,
    LABEL_DIMS,
    MERGE_MAY_DIFFER,
    REQUIRED_VARIABLES,
    STATUS_FAILED,
    STATUS_MISSING,
    STATUS_OK,
    TIMELINE,
    VARIABLES,
    VarSpec,
    check_cube,
)

__all__ = [
    "CELL_DIMS",
    "COORD_ATTRS",
    "CUBE_NAME",
    "CUBE_SCHEMA",
    "KNOB_DIMS",
    "LABEL_DIMS",
    "MERGE_MAY_DIFFER",
    "REQUIRED_VARIABLES",
    "STATUS_FAILED",
    "STATUS_MISSING",
    "STATUS_OK",
    "TIMELINE",
    "VARIABLES",
    "VarSpec",
    "build_cube",
    "check_cube",
    "info_text",
    "merge_cubes",
    "open_analysable",
    "open_cube",
    "read_journal",
    "write_cube",
]
