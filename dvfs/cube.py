"""The cube: every cell's metrics in one `xarray.Dataset`, saved as netCDF4.

Schema history (`attrs["dvfs_schema"]`):
  1 - dims sm_clock, power_limit, batch, drafter, corpus, repeat (+ quantile, sample, and gpu
      when merged); CF `units` and `long_name` on every variable and coordinate.

Missing cells are NaN. Integer-valued variables are stored as integers with a -1 fill value
and read back as floats with NaN where missing (xarray's CF masking). On disk the string axes
(drafter, corpus, gpu) follow CF's label convention: the dimension has no coordinate variable
(those must be numeric) and a `<dim>_label` string variable names its entries; `open_cube`
turns them back into indexed coordinates, so `ds.sel(drafter="eagle3")` works.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs import __version__
from dvfs.errors import CubeError
from dvfs.journal import JOURNAL_NAME, describe_os_error, read_records
from dvfs.meter import QUALITY_FLAGS, QUANTILES, TIMELINE_POINTS
from dvfs.records import CampaignFacts, JournalContents, check_version, decode_journal, now_iso

if TYPE_CHECKING:
    import xarray as xr

CUBE_SCHEMA = 1
CUBE_NAME = "cube.nc"
KNOB_DIMS = ("sm_clock", "power_limit")
#: String-valued axes, written as CF label variables named `<dim>_label`.
LABEL_DIMS = ("drafter", "corpus", "gpu")
#: Variables every analysis reads; a dataset without them is not a usable cube.
REQUIRED_VARIABLES = ("cell_status", "valid", "energy_per_token_j", "ttft_ms", "tpot_ms")
#: Campaign settings that may differ between merged cubes: the GPU is what a merge varies.
MERGE_MAY_DIFFER = ("gpu.backend", "gpu.profile", "gpu.devices")
CELL_DIMS = ("sm_clock", "power_limit", "batch", "drafter", "corpus", "repeat")


@dataclass(frozen=True)
class VarSpec:
    """A cube variable and its CF attributes; its name is also the measured quantity's name in
    the journal (`dvfs.records.MeasurementRecord`), so no variable needs a source key."""

    name: str
    units: str
    long_name: str
    extra_dim: str | None = None
    integer: bool = False


VARIABLES = (
    VarSpec("energy_per_token_j", "J", "energy per output token in the steady-state window"),
    VarSpec(
        "energy_per_token_above_idle_j", "J", "energy per output token above the idle baseline"
    ),
    VarSpec("energy_j", "J", "GPU energy in the steady-state decode window"),
    VarSpec(
        "output_tokens", "1", "output tokens generated in the steady-state window", integer=True
    ),
    VarSpec("decode_time_s", "s", "length of the steady-state decode window"),
    VarSpec("throughput_tok_s", "s-1", "output tokens per second in the steady-state window"),
    VarSpec("ttft_ms", "ms", "time to first token", extra_dim="quantile"),
    VarSpec(
        "tpot_ms", "ms", "time per output token after the first, per request", extra_dim="quantile"
    ),
    VarSpec(
        "itl_ms",
        "ms",
        "inter-token latency (chunk gap spread over its tokens)",
        extra_dim="quantile",
    ),
    VarSpec("accept_length", "1", "mean tokens per verify pass (bonus token included)"),
    VarSpec("accept_rate", "1", "accepted draft tokens over proposed draft tokens"),
    VarSpec(
        "server_accept_length",
        "1",
        "tokens per verify pass as the server reports it (prefill excluded)",
    ),
    VarSpec("power_mean_w", "W", "mean GPU power in the steady-state window"),
    VarSpec("power_max_w", "W", "highest sampled GPU power in the window"),
    VarSpec("sm_clock_observed_mhz", "MHz", "mean sampled SM clock in the window"),
    VarSpec("temperature_max_c", "degC", "highest sampled GPU temperature in the window"),
    VarSpec(
        "clock_event_reasons",
        "1",
        "NVML clock-event reasons seen in the window (bitmask)",
        integer=True,
    ),
    VarSpec("quality", "1", "measurement quality flags (bitmask)", integer=True),
    VarSpec(
        "valid", "1", "1 if the cell passed every quality check that invalidates", integer=True
    ),
    VarSpec("rounds", "1", "measurement rounds taken to fill the window", integer=True),
    VarSpec("requests", "1", "requests measured", integer=True),
)
TIMELINE = (
    VarSpec(
        "timeline_t_s",
        "s",
        "time since the window start (rounds concatenated)",
        extra_dim="sample",
    ),
    VarSpec("timeline_power_w", "W", "sampled GPU power", extra_dim="sample"),
    VarSpec("timeline_sm_clock_mhz", "MHz", "sampled SM clock", extra_dim="sample"),
)
STATUS_MISSING, STATUS_OK, STATUS_FAILED = 0, 1, 2

COORD_ATTRS = {
    "sm_clock": (
        "MHz",
        "SM clock lock (the stock, unlocked setting is shown at the GPU's max SM clock)",
    ),
    "power_limit": (
        "W",
        "GPU power limit (the stock setting is shown at the limit found at start)",
    ),
    "batch": ("1", "concurrent requests (batch size)"),
    "drafter": ("1", "speculative-decoding configuration"),
    "corpus": ("1", "prompt corpus"),
    "repeat": ("1", "repeat index"),
    "quantile": ("1", "latency quantile"),
    "sample": ("1", "timeline sample index"),
    "gpu": ("1", "GPU UUID"),
}


def _num(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    return float(value)


def read_journal(path: str | Path) -> list[dict[str, Any]]:
    """A journal's records, refused early when it is missing, headless or from a newer dvfs."""
    path = Path(path)
    if not path.exists():
        raise CubeError(f"no journal at {path}: run `dvfs sweep` first")
    records = read_records(path)
    if not records or records[0].get("type") != "header":
        raise CubeError(f"{path} is not a dvfs journal")
    check_version(path, records[0].get("journal_schema", 1))
    return records


def _grid(journal: JournalContents, facts: CampaignFacts) -> dict[str, list[Any]]:
    """The cube's coordinates: the campaign's axes, a stock knob axis at the setting found."""
    if not journal.sessions:
        raise CubeError("the journal has no measurement session yet: nothing to put in a cube")
    stock = journal.sessions[0].stock
    grid = facts.grid
    clocks, limits = grid.sm_clocks_mhz, grid.power_limits_w
    return {
        "sm_clock": sorted(clocks) if clocks else [stock.sm_clock_mhz],
        "power_limit": sorted(limits) if limits else [stock.power_limit_w],
        "batch": list(grid.batch_sizes),
        "drafter": list(grid.drafters),
        "corpus": list(grid.corpora),
        "repeat": list(range(grid.repeats)),
    }


def _check_sessions(journal: JournalContents) -> None:
    uuids = {s.gpu_uuids for s in journal.sessions}
    if len(uuids) > 1:
        raise CubeError(
            "the journal holds measurements from different GPUs "
            f"({'; '.join(', '.join(u) for u in sorted(uuids))}); keep one journal per GPU set"
        )


def _provenance(journal: JournalContents, facts: CampaignFacts) -> dict[str, Any]:
    header, session = journal.header, journal.sessions[-1]
    if header.campaign_name is None or header.campaign_hash is None:
        raise KeyError("campaign_name" if header.campaign_name is None else "campaign_hash")
    gpus = session.gpus
    servers: dict[str, Any] = {}
    for s in journal.servers:
        servers[s.drafter] = {"engine": s.engine, "version": s.version, "args": s.args}
    versions = sorted({s.version for s in journal.servers})
    return {
        "dvfs_schema": CUBE_SCHEMA,
        "Conventions": "CF-1.10",
        "title": f"dvfs sweep: {header.campaign_name}",
        "dvfs_version": __version__,
        "journal_dvfs_version": header.dvfs_version,
        "campaign_name": header.campaign_name,
        "campaign_hash": header.campaign_hash,
        "campaign": json.dumps(header.campaign, sort_keys=True),
        "campaign_source": header.campaign_source,
        "gpu_backend": session.gpu_backend,
        "gpu_name": gpus[0]["name"],
        "gpu_uuids": ",".join(session.gpu_uuids),
        "gpu_count": len(gpus),
        "driver_version": gpus[0]["driver_version"],
        "memory_clock_mhz": gpus[0]["memory_clock_mhz"],
        "twin_profile": facts.twin_profile,
        "engine_backend": session.engine_backend,
        "engine_version": ", ".join(versions),
        "server_args": json.dumps(servers, sort_keys=True),
        "model": facts.model,
        "twin_model": facts.twin_model,
        "tp_size": facts.tp_size,
        "actuation": int(session.actuation),
        "clock": session.clock,
        "stock_sm_clock_mhz": session.stock.sm_clock_mhz,
        "stock_power_limit_w": session.stock.power_limit_w,
        "power_limit_range_w": list(session.power_limit_range_w),
        "idle_power_w": float(np.nanmean([s.idle_power_w for s in journal.sessions])),
        "measurement_method": session.measurement_method,
        "token_count_method": session.token_count_method,
        "corpora": json.dumps(session.corpora, sort_keys=True),
        "sessions": len(journal.sessions),
        "created": now_iso(),
        "history": f"{now_iso()} built by dvfs {__version__} from journal",
    }


def build_cube(journal_path: str | Path) -> xr.Dataset:
    """Assemble the cube from a journal; cells not (yet) measured are NaN."""
    records = read_journal(journal_path)
    try:
        return _build(decode_journal(records, journal_path))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CubeError(
            f"{journal_path}: a record lacks what a cube needs ({type(exc).__name__}: {exc}); "
            "the journal was not written by this dvfs or was edited: rerun the sweep with "
            "--fresh to start a new journal"
        ) from exc


def _build(journal: JournalContents) -> xr.Dataset:
    import xarray as xr

    _check_sessions(journal)
    facts = journal.header.facts()
    grid = _grid(journal, facts)
    stock = journal.sessions[0].stock
    shape = tuple(len(grid[d]) for d in CELL_DIMS)
    index = {d: {v: i for i, v in enumerate(grid[d])} for d in CELL_DIMS}
    data: dict[str, np.ndarray] = {}
    for spec in VARIABLES:
        extra = {"quantile": len(QUANTILES)}.get(spec.extra_dim or "")
        data[spec.name] = np.full(shape + ((extra,) if extra else ()), np.nan)
    for spec in TIMELINE:
        data[spec.name] = np.full(shape + (TIMELINE_POINTS,), np.nan)
    status = np.zeros(shape, dtype=np.int8)
    for record in journal.cells.values():
        cell = record.cell
        clock = cell.sm_clock_mhz if cell.sm_clock_mhz is not None else stock.sm_clock_mhz
        limit = cell.power_limit_w if cell.power_limit_w is not None else stock.power_limit_w
        try:
            at = (
                index["sm_clock"][clock],
                index["power_limit"][limit],
                index["batch"][cell.batch],
                index["drafter"][cell.drafter],
                index["corpus"][cell.corpus],
                index["repeat"][cell.repeat],
            )
        except KeyError:
            continue  # a cell outside the grid cannot happen for a matching campaign hash
        if not record.ok or record.measurement is None:
            status[at] = STATUS_FAILED
            continue
        status[at] = STATUS_OK
        m = record.measurement
        for spec in VARIABLES:
            value = getattr(m, spec.name)
            if spec.extra_dim == "quantile":
                data[spec.name][at] = [_num(v) for v in value]
            else:
                data[spec.name][at] = _num(value)
        for spec in TIMELINE:
            values = [_num(v) for v in getattr(m, spec.name)][:TIMELINE_POINTS]
            data[spec.name][at][: len(values)] = values
    coords: dict[str, Any] = {d: grid[d] for d in CELL_DIMS}
    coords["quantile"] = list(QUANTILES)
    coords["sample"] = list(range(TIMELINE_POINTS))
    variables: dict[str, Any] = {}
    for spec in (*VARIABLES, *TIMELINE):
        dims = CELL_DIMS + ((spec.extra_dim,) if spec.extra_dim else ())
        variables[spec.name] = (
            dims,
            data[spec.name],
            {"units": spec.units, "long_name": spec.long_name},
        )
    # The attention kernels each drafter's server resolved ("" where unknown, e.g. the twin):
    # arms that differ here also compare kernels, not just drafters.
    backends = {s.drafter: s.attention_backend or "" for s in journal.servers}
    variables["attention_backend"] = (
        ("drafter",),
        np.array([backends.get(d, "") for d in grid["drafter"]], dtype=object),
        {"units": "1", "long_name": "attention backend of the drafter's server"},
    )
    variables["cell_status"] = (
        CELL_DIMS,
        status,
        {
            "units": "1",
            "long_name": "cell status",
            "flag_values": np.array([STATUS_MISSING, STATUS_OK, STATUS_FAILED], dtype=np.int8),
            "flag_meanings": "missing measured failed",
        },
    )
    ds = xr.Dataset(variables, coords=coords, attrs=_provenance(journal, facts))
    for name, (units, long_name) in COORD_ATTRS.items():
        if name in ds.coords:
            ds[name].attrs.update(units=units, long_name=long_name)
    ds["quality"].attrs.update(
        flag_masks=np.array(list(QUALITY_FLAGS), dtype=np.int32),
        flag_meanings=" ".join(QUALITY_FLAGS.values()),
    )
    ds["valid"].attrs.update(
        flag_values=np.array([0, 1], dtype=np.int8), flag_meanings="invalid valid"
    )
    from dvfs.gpu.base import EVENT_NAMES

    ds["clock_event_reasons"].attrs.update(
        flag_masks=np.array(list(EVENT_NAMES), dtype=np.int32),
        flag_meanings=" ".join(EVENT_NAMES.values()),
    )
    failed = [r for r in journal.cells.values() if not r.ok]
    ds.attrs["failed_cells"] = json.dumps(
        [{"cell": asdict(r.cell), "error": r.error} for r in failed][:200]
    )
    return ds


def _encoding(ds: xr.Dataset) -> dict[str, dict[str, Any]]:
    # Coordinates and labels never hold missing values: CF forbids a _FillValue on them.
    enc: dict[str, dict[str, Any]] = {str(name): {"_FillValue": None} for name in ds.coords}
    integer_names = {s.name for s in VARIABLES if s.integer}
    for name in map(str, ds.data_vars):
        if name in integer_names:
            dtype = "int8" if name == "valid" else "int32"
            enc[name] = {"dtype": dtype, "_FillValue": -1, "zlib": True, "complevel": 4}
        elif name == "cell_status":
            enc[name] = {"zlib": True, "complevel": 4}
        elif name == "attention_backend":
            enc[name] = {}  # variable-length strings: no fill value, no compression
        else:
            enc[name] = {"_FillValue": np.nan, "zlib": True, "complevel": 4}
    return enc


def _labels_to_cf(ds: xr.Dataset) -> xr.Dataset:
    """String axes as CF label variables (`drafter` -> `drafter_label(drafter)`)."""
    for dim in LABEL_DIMS:
        if dim in ds.coords and dim in ds.dims and ds[dim].dtype.kind in "OUS":
            values = np.array([str(v) for v in ds[dim].values], dtype=object)
            long_name = COORD_ATTRS[dim][1]
            ds = ds.drop_vars(dim).assign_coords(
                {f"{dim}_label": ((dim,), values, {"long_name": f"{long_name} (label)"})}
            )
    return ds


def _labels_from_cf(ds: xr.Dataset) -> xr.Dataset:
    """Label variables back into indexed coordinates (cubes written before labels have none)."""
    for dim in LABEL_DIMS:
        label = f"{dim}_label"
        if label in ds.variables and ds[label].dims == (dim,):
            values = [str(v) for v in ds[label].values]
            ds = ds.drop_vars(label).assign_coords({dim: values})
        if dim in ds.coords:
            units, long_name = COORD_ATTRS[dim]
            ds[dim].attrs.update(units=units, long_name=long_name)
    return ds


def _file_mode() -> int:
    """0666 less the umask: a cube is as readable as the journal next to it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no way to read the umask without setting it
    os.umask(mask)
    return 0o666 & ~mask


def write_cube(ds: xr.Dataset, path: str | Path) -> Path:
    """Write atomically: a temp file in the same folder, renamed over the target, so a failed
    write (full disk, read-only folder) leaves the previous cube and no partial file."""
    path = Path(path)
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        tmp = Path(name)
        os.close(fd)
        on_disk = _labels_to_cf(ds)
        on_disk.to_netcdf(tmp, format="NETCDF4", engine="netcdf4", encoding=_encoding(on_disk))
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        # The temp file's name means nothing to the user; the cube's path says where.
        raise CubeError(describe_os_error(exc, f"write the cube {path}", show_file=False)) from exc
    except RuntimeError as exc:  # netCDF-C reports some failed writes (a full disk) this way
        raise CubeError(f"cannot write the cube {path}: {_first_line(exc)}") from exc
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _rebuild_hint(path: Path) -> str:
    folder = path.parent
    if (folder / JOURNAL_NAME).is_file():
        return f"rebuild it from its journal with `dvfs cube build {folder}`"
    return (
        "rebuild it from its sweep's journal with `dvfs cube build SWEEP_DIR` "
        "(a merged cube: merge again with `dvfs cube merge`)"
    )


def check_cube(ds: xr.Dataset, *, where: str = "cube", hint: str = "") -> xr.Dataset:
    """Refuse datasets that are not dvfs cubes of a schema this version reads."""
    then = f": {hint}" if hint else ""
    schema = ds.attrs.get("dvfs_schema")
    if schema is None:
        raise CubeError(f"{where} is not a dvfs cube (no dvfs_schema attribute){then}")
    try:
        version = int(schema)
    except (TypeError, ValueError):
        raise CubeError(f"{where} has a malformed dvfs_schema {schema!r}{then}") from None
    if version > CUBE_SCHEMA:
        raise CubeError(
            f"{where} has cube schema {schema}; this dvfs ({__version__}) reads up to "
            f"{CUBE_SCHEMA}: upgrade dvfs"
        )
    missing = [d for d in CELL_DIMS if d not in ds.dims or d not in ds.coords]
    if missing:
        raise CubeError(f"{where} lacks dimension(s) {', '.join(missing)}{then}")
    absent = [v for v in REQUIRED_VARIABLES if v not in ds.data_vars]
    if absent:
        raise CubeError(f"{where} lacks variable(s) {', '.join(absent)}{then}")
    return ds


def open_cube(path: str | Path) -> xr.Dataset:
    """Load a cube into memory (the file is closed on return) and register `ds.dvfs`."""
    import xarray as xr

    import dvfs.accessor  # noqa: F401  (registers the accessor)

    path = Path(path)
    if not path.exists():
        raise CubeError(f"no cube at {path}: run `dvfs sweep` or `dvfs cube build` first")
    try:
        with xr.open_dataset(path, engine="netcdf4") as ds:
            loaded = _labels_from_cf(ds.load())
    except Exception as exc:  # an untrusted file: truncated, not netCDF, odd variables
        raise CubeError(
            f"{path} is not a readable netCDF cube ({_first_line(exc)}): {_rebuild_hint(path)}"
        ) from exc
    return check_cube(loaded, where=str(path), hint=_rebuild_hint(path))


def _stock_text(ds: xr.Dataset) -> str:
    """The reference setting in words: unlocked only when the campaign left the clock stock."""
    try:
        facts = CampaignFacts.from_json(json.loads(ds.attrs.get("campaign", "{}")))
        unlocked = facts.grid.sm_clocks_mhz is None
    except (KeyError, ValueError, TypeError, AttributeError):
        unlocked = False
    clock = ds.attrs.get("stock_sm_clock_mhz")
    limit = ds.attrs.get("stock_power_limit_w")
    how = "SM clock unlocked, shown at" if unlocked else "top SM clock of the grid,"
    return f"{how} {clock} MHz; power limit {limit} W as found at start"


def info_text(ds: xr.Dataset) -> dict[str, Any]:
    """A summary for `dvfs cube info`: dimensions, coverage, provenance."""
    status = ds["cell_status"].values
    total = status.size
    if "gpu" in ds.dims:
        names = json.loads(ds.attrs.get("gpu_names", "[]"))
        gpu = f"merged cube of {ds.sizes['gpu']} GPUs: {', '.join(names)}"
    else:
        gpu = (
            f"{ds.attrs.get('gpu_name')} x{ds.attrs.get('gpu_count')} "
            f"({ds.attrs.get('gpu_backend')})"
        )
    return {
        "campaign": ds.attrs.get("campaign_name", ds.attrs.get("title")),
        "schema": int(ds.attrs.get("dvfs_schema", 0)),
        "gpu": gpu,
        "driver": ds.attrs.get("driver_version"),
        "engine": f"{ds.attrs.get('engine_backend')} {ds.attrs.get('engine_version')}",
        "model": ds.attrs.get("model"),
        "dims": {d: int(ds.sizes[d]) for d in ("gpu", *CELL_DIMS) if d in ds.sizes},
        "coords": {
            d: [str(v) for v in ds[d].values] for d in ("gpu", *CELL_DIMS) if d in ds.coords
        },
        "cells": total,
        "measured": int((status == STATUS_OK).sum()),
        "failed": int((status == STATUS_FAILED).sum()),
        "missing": int((status == STATUS_MISSING).sum()),
        "invalid": int(((ds["valid"].values == 0) & (status == STATUS_OK)).sum()),
        "idle_power_w": float(ds.attrs.get("idle_power_w", math.nan)),
        "stock": _stock_text(ds),
        "energy_per_token_j": [
            float(np.nanmin(ds["energy_per_token_j"].values))
            if (status == STATUS_OK).any()
            else math.nan,
            float(np.nanmax(ds["energy_per_token_j"].values))
            if (status == STATUS_OK).any()
            else math.nan,
        ],
        "variables": sorted(str(v) for v in ds.data_vars),
        "created": ds.attrs.get("created"),
    }


def _campaign_attr(ds: xr.Dataset, name: str) -> dict[str, Any]:
    try:
        campaign = json.loads(ds.attrs.get("campaign", ""))
    except ValueError:
        campaign = None
    if not isinstance(campaign, dict) or not campaign:
        raise CubeError(
            f"cannot merge: {name} does not record its campaign, so its workload cannot be "
            "checked; rebuild it with `dvfs cube build`"
        )
    return campaign


def _check_same_workload(first: xr.Dataset, ds: xr.Dataset, first_name: str, name: str) -> None:
    """Refuse cubes of different campaigns (output tokens, clock grid, batches, drafters...):
    their union would be a half-empty cube whose arms measured different things."""
    from dvfs.campaign import measured_differences

    changes = measured_differences(
        _campaign_attr(first, first_name), _campaign_attr(ds, name), ignore=MERGE_MAY_DIFFER
    )
    if changes:
        more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
        raise CubeError(
            f"cannot merge: the campaign differs ({first_name} -> {name}: "
            f"{'; '.join(changes[:3])}{more}); only cubes of one campaign measured on "
            "different GPUs merge"
        )


def merge_cubes(cubes: list[xr.Dataset], names: list[str] | None = None) -> xr.Dataset:
    """Cubes from different GPUs as one, along a new `gpu` dimension (its GPU UUIDs).

    Refused when a provenance key that must match differs (model, engine, method, schema...)
    or when two cubes come from the same GPU. Grids may differ: missing cells are NaN.
    """
    import xarray as xr

    from dvfs.provenance import CHECKED

    if len(cubes) < 2:
        raise CubeError("merging needs at least two cubes")
    names = names or [f"cube {i + 1}" for i in range(len(cubes))]
    first = cubes[0]
    for label, ds in zip(names, cubes, strict=True):
        if "gpu" in ds.dims:
            raise CubeError(f"{label} is already a merged cube; merge the single-GPU cubes")
    for label, ds in zip(names[1:], cubes[1:], strict=True):
        for key in CHECKED:
            if str(ds.attrs.get(key)) != str(first.attrs.get(key)):
                raise CubeError(
                    f"cannot merge: {key} differs ({names[0]}: {first.attrs.get(key)!r}, "
                    f"{label}: {ds.attrs.get(key)!r}); cubes must measure the same thing"
                )
        _check_same_workload(first, ds, names[0], label)
    labels = [str(ds.attrs.get("gpu_uuids", f"gpu-{i}")) for i, ds in enumerate(cubes)]
    if len(set(labels)) != len(labels):
        raise CubeError("two of the cubes come from the same GPU(s); merge different GPUs")
    stripped = [ds.drop_attrs(deep=False) for ds in cubes]
    merged = xr.concat(
        stripped,
        dim="gpu",
        join="outer",
        combine_attrs="drop",
        data_vars="all",
        coords="minimal",
        compat="override",
    )
    merged = merged.assign_coords(gpu=labels)
    for name in merged.data_vars:
        merged[name].attrs = dict(first[name].attrs)
    for name in merged.coords:
        if name in first.coords:
            merged[name].attrs = dict(first[name].attrs)
    merged["gpu"].attrs.update(units=COORD_ATTRS["gpu"][0], long_name=COORD_ATTRS["gpu"][1])
    attrs = {k: first.attrs[k] for k in (*CHECKED, "Conventions") if k in first.attrs}
    attrs.update(
        title="dvfs merged cube",
        dvfs_version=__version__,
        gpu_names=json.dumps([str(ds.attrs.get("gpu_name")) for ds in cubes]),
        gpu_name=str(first.attrs.get("gpu_name")),
        merged_from=json.dumps(
            {
                label: {
                    k: str(ds.attrs.get(k))
                    for k in (
                        "campaign_name",
                        "campaign_hash",
                        "gpu_name",
                        "driver_version",
                        "engine_version",
                        "created",
                        "stock_sm_clock_mhz",
                        "stock_power_limit_w",
                    )
                }
                for label, ds in zip(labels, cubes, strict=True)
            }
        ),
        stock_sm_clock_mhz=max(int(ds.attrs.get("stock_sm_clock_mhz", 0)) for ds in cubes),
        stock_power_limit_w=max(float(ds.attrs.get("stock_power_limit_w", 0)) for ds in cubes),
        campaign=first.attrs.get("campaign", "{}"),
        **{
            key: ", ".join(sorted({str(ds.attrs.get(key, "")) for ds in cubes}))
            for key in ("gpu_backend", "driver_version", "engine_version", "campaign_name")
        },
        server_args=first.attrs.get("server_args", "{}"),
        history=f"{now_iso()} merged {len(cubes)} cubes by dvfs {__version__}",
        created=now_iso(),
    )
    merged.attrs = attrs
    # Cells absent from one GPU's grid: cell_status 0 (missing), integer flags NaN.
    merged["cell_status"] = merged["cell_status"].fillna(STATUS_MISSING).astype(np.int8)
    return merged
