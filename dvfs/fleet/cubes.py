"""The cubes of a sweep's --out folder: its journal's, or in a fleet mixing GPU models each
model's (`gpu-<model>/cube.nc`) and the merged one. One function writes them, whether the
sweep finished, was interrupted or `dvfs cube build` asks, so that the three agree."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dvfs.errors import CubeError, IncomparableCellsError, MergeRefusedError, NoJournalError
from dvfs.fleet.shard_journal import has_sessions, model_folder_journals

if TYPE_CHECKING:
    import xarray as xr

#: Writes a cube to a path and returns where it went (`dvfs.cube.write_cube`, or the CLI's
#: wrapper of it that words file-system faults).
CubeWriter = Callable[["xr.Dataset", Path], Path]


def cube_journals(out_dir: Path) -> list[Path]:
    """The journals `out_dir`'s cube is built from: its own when it has one, else each GPU
    model's of a fleet mixing models that holds a session (one begun but interrupted before
    its workers' sessions measured nothing); empty when there is none."""
    from dvfs.measure.journal import JOURNAL_NAME

    own = out_dir / JOURNAL_NAME
    if os.path.lexists(own):  # a link in a loop too, for the journal's reader to refuse
        return [own]
    # A model's journal that is no regular file (a folder, a FIFO, a link in a loop) is kept,
    # for the journal's reader to refuse: left out, the cube was built without that model.
    found = model_folder_journals(out_dir)
    return [p for p in found if os.path.lexists(p) and (not p.is_file() or has_sessions(p))]


def unmeasured_journals(out_dir: Path, *, passing_damaged: bool = False) -> list[Path]:
    """The GPU models' journals `cube_journals` leaves out of `out_dir`'s cube: files that hold
    no session yet (empty, or a header alone: nothing measured on that model), and a model
    folder's journal that is missing (moved or deleted: the sweep measures that model again),
    for the line that says so, else the cube reads as the whole campaign. Empty where the
    folder has its own journal (the models' are not read). `passing_damaged`: a journal that
    cannot be read (binary garbage, unreadable) is passed over, as one that is no regular file
    (a folder, a FIFO) is, not refused: for an analysis of the intact cube, whose journals
    `dvfs sweep` and `dvfs cube build` refuse with the line that says what to do."""
    from dvfs.errors import JournalError
    from dvfs.measure.journal import JOURNAL_NAME

    def unmeasured(journal: Path) -> bool:
        if not os.path.lexists(journal):
            return True
        try:
            return journal.is_file() and not has_sessions(journal)
        except (JournalError, OSError):
            if passing_damaged:
                return False
            raise

    if os.path.lexists(out_dir / JOURNAL_NAME):
        return []
    return [p for p in model_folder_journals(out_dir) if unmeasured(p)]


def left_out_of(cube_path: Path, cube: xr.Dataset) -> list[Path]:
    """The GPU models' journals the cube at `cube_path` (a cube file, or a sweep folder holding
    cube.nc), opened as `cube`, leaves out: `unmeasured_journals` of its sweep folder where it
    is that folder's cube, less those of a model the cube holds (its journal emptied or moved
    away since the cube was written: the cube keeps that model's cells, and a rerun would
    measure them again); none for a cube file of another name (the folder it lies in is not
    its sweep)."""
    from dvfs.cube import CUBE_NAME
    from dvfs.fleet.folders import model_folder

    # a model's damaged journal is passed over: the cube is intact, and `dvfs sweep` and
    # `dvfs cube build` refuse the journal with the line that says what to do
    if cube_path.is_dir():
        found = unmeasured_journals(cube_path, passing_damaged=True)
    elif cube_path.name == CUBE_NAME:
        found = unmeasured_journals(cube_path.parent, passing_damaged=True)
    else:
        found = []
    if not found:
        return []
    held = {model_folder(model) for model in cube_models(cube)}
    return [journal for journal in found if journal.parent.name not in held]


def cube_models(cube: xr.Dataset) -> list[str]:
    """The GPU models whose cells `cube` holds: each entry's along its `gpu` axis (a merged
    cube's `gpu_names`), else its one GPU's; none it cannot tell (an axis without them)."""
    import json

    if "gpu" not in cube.dims:
        name = cube.attrs.get("gpu_name")
        return [str(name)] if name else []
    try:
        names = json.loads(str(cube.attrs.get("gpu_names", "")))
    except ValueError:
        return []
    return [str(name) for name in names] if isinstance(names, list) else []


def model_marked(ds: xr.Dataset, journal: Path) -> xr.Dataset:
    """`ds`, the cube of `journal`, marked as one GPU model's own cube of a fleet mixing GPU
    models (`FLEET_MODEL_ATTR`: its model) where the journal is that model's, in the fleet's
    `gpu-<model>/` folder: analysed alone, its cells left name the --gpus they need (a rerun
    on the other models' GPUs measures none of them). A model's folder moved or renamed (out
    of its shard's folder, to be merged with the other shards' of that model) is told by the
    cube beside the journal, which the sweep marked so. `ds` itself where it is not."""
    from dvfs.cube.cells_left import FLEET_MODEL_ATTR
    from dvfs.fleet.folders import model_folder

    name = ds.attrs.get("gpu_name")
    if not name:
        return ds
    if journal.parent.name != model_folder(str(name)) and _marked(journal.parent) != name:
        return ds
    return ds.assign_attrs({FLEET_MODEL_ATTR: str(name)})


def _marked(folder: Path) -> str | None:
    """The GPU model whose own cube of a fleet (`FLEET_MODEL_ATTR`) `folder`'s cube.nc is, or
    None (no cube there, another cube, or one that cannot be read)."""
    import xarray as xr

    from dvfs.cube import CUBE_NAME
    from dvfs.cube.cells_left import FLEET_MODEL_ATTR

    cube = folder / CUBE_NAME
    if not cube.is_file():
        return None
    try:
        with xr.open_dataset(cube, engine="netcdf4") as ds:  # its attributes alone, not loaded
            model = ds.attrs.get(FLEET_MODEL_ATTR)
    except Exception:  # damaged, not netCDF: no mark to read (the build writes it anew)
        return None
    return None if model is None else str(model)


def write_cubes(
    out_dir: Path,
    journals: Sequence[Path],
    *,
    merged_path: Path | None = None,
    write: CubeWriter | None = None,
) -> Path:
    """Each journal's cube beside it; a fleet of several models also the merged one, at
    `merged_path` (default `out_dir/cube.nc`). Returns the folder's cube: the merged one, or
    the one journal's. Cells not measured yet (an interrupted sweep) are missing in them."""
    from dvfs.cube import CUBE_NAME, merge_cubes, write_cube
    from dvfs.fleet.shard import cube_shard, mark_cube
    from dvfs.fleet.shard_journal import shard_cube

    write = write or write_cube
    merged_path = merged_path or out_dir / CUBE_NAME
    cubes = []
    for journal in journals:
        try:
            ds = shard_cube(journal)
        except IncomparableCellsError:
            raise  # nothing to fix in the folder: the message says where to rerun
        except NoJournalError:
            raise  # no journal to hold the cells: the message says what is there
        except CubeError as exc:
            raise CubeError(
                # the fleet's folder: a GPU model's own (the journal's) rebuilds its cube
                # alone, not the merged one
                f"{exc} (every measured cell is in {journal}: `dvfs cube build {out_dir}` "
                "writes the cube once that is fixed)"
            ) from exc
        own = journal.parent / CUBE_NAME
        path = write(model_marked(ds, journal), merged_path if journal.parent == out_dir else own)
        cubes.append((ds, path))
    if len(cubes) == 1 and journals[0].parent == out_dir:
        return cubes[0][1]
    if len(cubes) == 1:
        return write(cubes[0][0], merged_path)
    # Each model's journal holds the same shard: the merged cube is marked with it, its parts
    # merged as cubes of different GPUs.
    shard = cube_shard(cubes[0][0])
    for ds, _ in cubes:
        mark_cube(ds, None)
    try:
        merged = merge_cubes([ds for ds, _ in cubes], [str(p) for _, p in cubes])
    except MergeRefusedError as exc:
        # The user gave one folder, not cubes to merge: its models' journals disagree, an
        # error in the folder (exit 1), not invalid input as `cube merge` of such cubes is.
        raise CubeError(
            f"{exc} (the cubes of the GPU models' journals in {out_dir}; each model's cube is "
            "written beside its journal)"
        ) from exc
    mark_cube(merged, shard)
    return write(merged, merged_path)
