"""Cubes on disk, as netCDF4 written atomically.

The string axes (drafter, corpus, gpu) follow CF's label convention: the dimension has no
coordinate variable (those must be numeric) and a `<dim>_label` string variable names its
entries; `open_cube` turns them back into indexed coordinates, so `ds.sel(drafter="eagle3")`
works.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shlex
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.cube.arms import arm_differences
from dvfs.cube.precision import PRECISION_MISSED
from dvfs.cube.schema import (
    COORD_ATTRS,
    CUBE_NAME,
    LABEL_DIMS,
    STATUS_OK,
    VARIABLES,
    check_cube,
)
from dvfs.errors import CubeError
from dvfs.measure.journal import JOURNAL_NAME, describe_os_error

if TYPE_CHECKING:
    import xarray as xr


#: Variables smaller than this (bytes in memory) are stored uncompressed: compression needs
#: HDF5's chunked layout, whose index costs about 4 KB a variable, so a small cube's compressed
#: file was three times its uncompressed one (345 against 115 KB for 16 cells) and slower to
#: write. The demo's measured variables (4,500 cells of float64, 36 KB and up) are above it;
#: its two int8 flag variables (4,500 bytes) are stored plain.
COMPRESS_FROM_BYTES = 8192
_ZLIB = {"zlib": True, "complevel": 4}


def _encoding(ds: xr.Dataset) -> dict[str, dict[str, Any]]:
    # Coordinates and labels never hold missing values: CF forbids a _FillValue on them.
    enc: dict[str, dict[str, Any]] = {str(name): {"_FillValue": None} for name in ds.coords}
    integer_names = {s.name for s in VARIABLES if s.integer}
    for name in map(str, ds.data_vars):
        zlib = _ZLIB if ds.variables[name].nbytes >= COMPRESS_FROM_BYTES else {}
        if name in integer_names:
            dtype = "int8" if name == "valid" else "int32"
            enc[name] = {"dtype": dtype, "_FillValue": -1, **zlib}
        elif name == PRECISION_MISSED:  # a flag, missing where the cell was not measured
            enc[name] = {"dtype": "int8", "_FillValue": -1, **zlib}
        elif name in ("cell_status", "energy_split_method"):  # flags, never missing
            enc[name] = {**zlib}
        elif name == "attention_backend":
            enc[name] = {}  # variable-length strings: no fill value, no compression
        else:
            enc[name] = {"_FillValue": np.nan, **zlib}
    return enc


def _labels_to_cf(ds: xr.Dataset) -> xr.Dataset:
    """String axes as CF label variables (`drafter` -> `drafter_label(drafter)`), swapped in one
    step (each swap rebuilds the Dataset's coordinates)."""
    labels = {}
    for dim in LABEL_DIMS:
        if dim in ds.coords and dim in ds.dims and ds[dim].dtype.kind in "OUS":
            values = np.array([str(v) for v in ds[dim].values], dtype=object)
            long_name = COORD_ATTRS[dim][1]
            labels[dim] = ((dim,), values, {"long_name": f"{long_name} (label)"})
    if not labels:
        return ds
    return ds.drop_vars(list(labels)).assign_coords(
        {f"{dim}_label": label for dim, label in labels.items()}
    )


def _labels_from_cf(ds: xr.Dataset) -> xr.Dataset:
    """Label variables back into indexed coordinates (cubes written before labels have none),
    swapped in one step."""
    variables = ds.variables  # (not a DataArray built for each look)
    labels = {
        dim: [str(v) for v in variables[f"{dim}_label"].values]
        for dim in LABEL_DIMS
        if f"{dim}_label" in variables and variables[f"{dim}_label"].dims == (dim,)
    }
    if labels:
        ds = ds.drop_vars([f"{dim}_label" for dim in labels]).assign_coords(labels)
    for dim in LABEL_DIMS:
        if dim in ds.coords:
            units, long_name = COORD_ATTRS[dim]
            ds.variables[dim].attrs.update(units=units, long_name=long_name)
    return ds


#: One cube write at a time in a process: the chunk-cache setting `_no_chunk_cache` changes
#: is process-wide (two overlapping writes would leave it at 0), and netCDF-C is not
#: thread-safe.
_WRITING = threading.Lock()


@contextlib.contextmanager
def _no_chunk_cache() -> Iterator[None]:
    """Files opened meanwhile get no HDF5 chunk cache. A cube variable is one or two chunks,
    written whole once; with netCDF-C's default cache (tens of MB per variable) every
    variable's chunks stayed in memory until the file closed, a second copy of the cube at the
    sweep's peak. The file's content is the same either way. Holds `_WRITING`."""
    import netCDF4

    with _WRITING:
        size, slots, preemption = netCDF4.get_chunk_cache()
        netCDF4.set_chunk_cache(0, slots, preemption)
        try:
            yield
        finally:
            netCDF4.set_chunk_cache(size, slots, preemption)


class _FilledLast:
    """xarray's array writer, less its writing as it goes: each variable's data is kept for
    `fill`, after every variable is defined."""

    def __init__(self) -> None:
        self.pending: list[tuple[Any, Any, Any]] = []

    def add(self, source: Any, target: Any, region: Any = None) -> None:
        self.pending.append((source, target, region))

    def fill(self) -> None:
        for source, target, region in self.pending:
            target[region if region else ...] = source


def _write_netcdf4(ds: xr.Dataset, path: Path, encoding: dict[str, dict[str, Any]]) -> None:
    """The file `ds.to_netcdf(path, format="NETCDF4", engine="netcdf4", encoding=encoding)`
    writes, variables, attributes and data alike, with every variable defined before any is
    filled. Written as it goes, each variable's data took netCDF-C out of define mode and the
    next variable back in, and each exit flushed all of HDF5's metadata so far: a small cube's
    write (60 variables) took 64 ms of CPU, 27 ms this way; the demo's 145 ms, 105 ms.

    A cube held in dask chunks (`dvfs.cube.write_cube` is API) is written by `to_netcdf`,
    which computes them a chunk at a time before it takes the file's lock: filled last, each
    variable was computed under that lock, where reading a lazily opened file waits for it
    (for ever), and a variable of strings refused a dask array (IndexError)."""
    if any(v.chunks is not None for v in ds.variables.values()):
        ds.to_netcdf(path, format="NETCDF4", engine="netcdf4", encoding=encoding)
        return
    try:
        _define_then_fill(ds, path, encoding)
    except _XARRAY_INTERNALS_CHANGED:
        # `NetCDF4DataStore.store` and `encode_dataset_coordinates` are xarray's internals,
        # checked on the xarray this project tests with: where another xarray's differ, the
        # documented write makes the same file (the temp file is written again, whole).
        ds.to_netcdf(path, format="NETCDF4", engine="netcdf4", encoding=encoding)


#: What a change in xarray's internals raises in `_define_then_fill` (a moved name, another
#: signature). An attribute netCDF cannot hold raises TypeError too: the documented write then
#: raises xarray's own error for it, as before.
_XARRAY_INTERNALS_CHANGED = (ImportError, AttributeError, TypeError)


def _define_then_fill(ds: xr.Dataset, path: Path, encoding: dict[str, dict[str, Any]]) -> None:
    from xarray.backends import NetCDF4DataStore
    from xarray.conventions import encode_dataset_coordinates

    variables, attrs = encode_dataset_coordinates(ds)
    for name, enc in encoding.items():
        variables[name].encoding = enc
    unlimited = ds.encoding.get("unlimited_dims") or set()  # as to_netcdf keeps them
    unlimited = {unlimited} if isinstance(unlimited, str) else set(unlimited)
    writer = _FilledLast()
    store = NetCDF4DataStore.open(path, mode="w", format="NETCDF4")
    try:
        store.store(variables, attrs, set(encoding), writer, unlimited_dims=unlimited)
        writer.fill()
    finally:
        store.close()


def write_cube(ds: xr.Dataset, path: str | Path) -> Path:
    """Write atomically (`dvfs.outputs.replacing`): a temp file in the same folder, renamed
    over the target, so a failed write (full disk, read-only folder) leaves the previous cube
    and no partial file; a device such as /dev/null is written, never replaced."""
    from dvfs.outputs import write_netcdf

    path = Path(path)

    def write(tmp: Path) -> None:
        on_disk = _labels_to_cf(ds)
        with _no_chunk_cache():
            _write_netcdf4(on_disk, tmp, _encoding(on_disk))

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_netcdf(path, write, int(ds.nbytes))
    except OSError as exc:
        # The temp file's name means nothing to the user; the cube's path says where.
        raise CubeError(describe_os_error(exc, f"write the cube {path}", show_file=False)) from exc
    except RuntimeError as exc:  # netCDF-C's other failed writes
        raise CubeError(f"cannot write the cube {path}: {_first_line(exc)}") from exc
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _rebuild_hint(path: Path) -> str:
    folder = path.parent
    if (folder / JOURNAL_NAME).is_file():
        return f"rebuild it from its journal with `dvfs cube build {shlex.quote(str(folder))}`"
    return (
        "rebuild it from its sweep's journal with `dvfs cube build SWEEP_DIR` "
        "(a merged cube: merge again with `dvfs cube merge`)"
    )


def _another_dvfs_file(path: Path) -> str | None:
    """The refusal of a file given for a cube that is another of dvfs's files, a sweep's
    journal or a campaign file (a slip of the tab key), said as what it is and what to give
    instead; None for any other file, damaged or not. A journal was "not a readable netCDF
    cube: rebuild it from its journal with `dvfs cube build DIR`", which, followed, left the
    same journal given and refused again."""
    if path.name == CUBE_NAME:
        return None  # the folder's own cube, damaged: the netCDF reader's line says rebuild
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None  # said by the netCDF reader's line
    folder = shlex.quote(str(path.parent))
    if head.lstrip().startswith(b'{"type":"header"') or path.name == JOURNAL_NAME:
        return (
            f"{path} is a sweep's journal, not a cube: give its folder ({folder}) or the "
            f"cube.nc there; `dvfs cube build {folder}` writes that cube from this journal"
        )
    if path.suffix == ".toml" and b"[campaign]" in head:
        return (
            f"{path} is a campaign file, not a cube: sweep it (`dvfs sweep "
            f"{shlex.quote(str(path))}`), then give the folder it sweeps into"
        )
    return None


def _folder_in_the_cubes_place(path: Path) -> str:
    """The refusal of a folder `path` named cube.nc (holding none) where a sweep folder's cube
    file goes: said as that folder, not as "no cube at PATH/cube.nc"."""
    folder = path.parent
    if (folder / JOURNAL_NAME).is_file():
        build = f"dvfs cube build {shlex.quote(str(folder))}"  # pasted as said: 'my run' quoted
        then = f"then rebuild the cube from its journal with `{build}`"
    else:
        then = "or give the cube file's path"
    return f"{path} is a folder, where the cube file should be: move it aside, {then}"


def open_cube(path: str | Path) -> xr.Dataset:
    """Load a cube into memory (the file is closed on return) and check its shape. `path` is
    a cube file or, as every command takes, a sweep folder holding cube.nc.

    The `ds.dvfs` accessor is the analyses' layer, above the cube: `dvfs.open_cube` (or
    `import dvfs.accessor`) registers it.
    """
    import xarray as xr

    path = Path(path)
    if path.is_dir():
        path = path / CUBE_NAME
    if path.is_dir():  # a folder in the cube file's place: not "no cube at cube.nc/cube.nc"
        raise CubeError(_folder_in_the_cubes_place(path))
    if not os.path.lexists(path) and path.parent.is_file():
        # `RUN/cube.nc/cube.nc`, RUN/cube.nc the cube: it was said to be a folder, to be moved
        # aside; or "no cube at", which a sweep would not mend
        raise CubeError(
            f"no cube at {path}: {path.parent} is a file, not a folder; check the path (a cube "
            "file, or the sweep folder holding cube.nc)"
        )
    if path.name == path.parent.name == CUBE_NAME and not os.path.lexists(path):
        raise CubeError(_folder_in_the_cubes_place(path.parent))  # that folder given, or joined
    if not path.exists():
        if _link_in_a_loop(path):  # not "no cube at": a cube built there fails on the link
            raise CubeError(
                f"{path} is a symbolic link in a loop (it leads back to itself), not a cube: "
                f"remove the link, then {_rebuild_hint(path)}"
            )
        raise CubeError(f"no cube at {path}: run `dvfs sweep` or `dvfs cube build` first")
    if not path.is_file():  # netCDF is read by seeking: a FIFO would be waited on for ever
        raise CubeError(
            f"{path} is no regular file (a FIFO, a device), so no cube: give the cube.nc a "
            "sweep wrote, or its folder"
        )
    from dvfs.outputs import netcdf_path_problem

    problem = netcdf_path_problem(path, writing=False) or _another_dvfs_file(path)
    if problem:
        raise CubeError(problem)
    try:
        with xr.open_dataset(path, engine="netcdf4") as ds:
            loaded = _labels_from_cf(ds.load())
    except Exception as exc:  # an untrusted file: truncated, not netCDF, odd variables
        raise CubeError(
            f"{path} is not a readable netCDF cube ({_first_line(exc)}): {_rebuild_hint(path)}"
        ) from exc
    return check_cube(loaded, where=str(path), hint=_rebuild_hint(path))


def _link_in_a_loop(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def refuse_without_a_valid_cell(path: Path, ds: xr.Dataset, nothing: str) -> xr.Variable:
    """The cube's valid measured cells (a mask); refused in one line where it holds none,
    saying `nothing` ("nothing to analyse", "nothing to fit") and what measures one: an
    analysis, and `dvfs twin fit`, would otherwise work from nothing."""
    # The Dataset's Variables, not DataArrays: one Dataset's, they have nothing to align,
    # and aligning them took a sixth of opening a small cube to analyse
    variables = ds.variables
    valid = variables["valid"].fillna(0) > 0
    if "cell_status" in ds:
        valid = valid & (variables["cell_status"] == 1)
    if not bool(valid.any()):
        raise CubeError(_nothing_valid(path, ds, nothing))
    return valid


def _nothing_valid(path: Path, ds: xr.Dataset, nothing: str) -> str:
    """The refusal of a cube with no valid measured cell, with what measures one: where every
    cell (a shard's cube: every one of its own) was measured and flagged, a rerun measures
    none of them again, so the campaign changes and the sweep (each shard's, each merged
    sweep's) starts over with --fresh, and a merged cube is merged again."""
    from dvfs.cube.cells_left import resume_advice, resume_note, shard_cells, shards_of, unfit_left

    shards = shards_of(ds)
    measured = None
    if "cell_status" in ds:
        measured = np.asarray(ds["cell_status"].values == STATUS_OK, dtype=bool)
        if shards.get("shard"):
            own = shard_cells(ds)  # the other shards' cells are missing here, not left
            measured = measured[own] if own is not None and own.any() else None
    if measured is not None and bool(measured.all()):
        # every cell measured and flagged: a rerun measures none of them again
        what = "every cell was measured and flagged invalid"
        fresh = (
            "again with --fresh or into another --out folder (without --fresh it measures no "
            "cell again)"
        )
        if shards.get("shard"):
            label = str(shards["shard"])
            what = (
                f"every one of shard {label}'s own cells was measured and flagged invalid; the "
                "other shards' cells are not in this cube"
            )
            again = (
                f"run each shard's `dvfs sweep CAMPAIGN --shard I/{label.rpartition('/')[2]}` "
                f"{fresh}, then merge them again (`dvfs cube merge SHARD_DIRS -o cube.nc`)"
            )
        elif shards.get("merged_shards"):
            merged = shards["merged_shards"]
            each = ", ".join(f"--shard {lab} --out {folder}" for folder, lab in merged.items())
            again = (
                f"run each shard's `dvfs sweep CAMPAIGN --shard I/N --out SHARD_DIR` ({each}) "
                f"{fresh}, then `dvfs cube merge` them again (this cube is merged from them)"
            )
        elif shards.get("merged_cubes"):
            again = (
                f"run each sweep's `dvfs sweep` command ({', '.join(shards['merged_cubes'])}) "
                f"{fresh}, then `dvfs cube merge` them again (this cube is merged from them)"
            )
        else:
            again = f"run `dvfs sweep` {fresh}"
        return (
            f"{path} has no valid measured cell ({what}): {nothing}; change the "
            f"campaign as `dvfs cube info` advises for its flags, then {again}"
        )
    then = resume_advice("the cells left", shards) if shards else "rerun `dvfs sweep`"
    said = (
        f"{path} has no valid measured cell (every cell is missing, failed or flagged "
        f"invalid): {nothing}; "
    )
    unfit = unfit_left(ds) if "cell_status" in ds else {}
    if unfit:  # failed cells SGLang would not start the server of: a rerun fails them again
        return said + resume_note({**shards, **unfit})
    return f"{said}see `dvfs cube info` and the sweep's journal, then {then}"


def open_analysable(path: str | Path) -> xr.Dataset:
    """The cube at `path` (a cube file or a sweep folder holding cube.nc), refused in one line
    when it holds no valid measured cell: an analysis would otherwise answer from nothing."""
    path = Path(path)
    ds = open_cube(path / CUBE_NAME if path.is_dir() else path)
    for name in ("energy_per_token_j", "valid"):
        if name not in ds:
            raise CubeError(
                f"{path} has no {name} variable, which every analysis needs: "
                "rebuild it with `dvfs cube build`"
            )
    valid = refuse_without_a_valid_cell(path, ds, "nothing to analyse")
    variables = ds.variables
    served = arm_differences(ds)
    if served:
        more = f" (and {len(served) - 3} more)" if len(served) > 3 else ""
        raise CubeError(
            f"{path}'s drafters were served differently ({'; '.join(served[:3])}{more}): the "
            "arms would compare more than their drafters (a cube an earlier dvfs built, which "
            "did not compare this); sweep again with --fresh (or into another --out folder) "
            "with every drafter on one engine version and one set of engine flags"
        )
    energy = variables["energy_per_token_j"]
    # A measured energy is a non-negative number: a valid cell holding NaN or a negative one
    # is a damaged (or hand-edited) file, and no least-energy choice can be made from it.
    damaged = int((valid & ~(np.isfinite(energy) & (energy >= 0))).sum())
    if damaged:
        raise CubeError(
            f"{path} is damaged: {damaged} valid cell(s) hold no energy_per_token_j (NaN) or a "
            f"negative one: {_rebuild_hint(path)}"
        )
    return ds
