"""A cube from a journal: the records, decoded by `dvfs.records`, laid out on the campaign's
grid; cells not (yet) measured are NaN."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.cube.schema import (
    CELL_DIMS,
    COORD_ATTRS,
    CUBE_SCHEMA,
    STATUS_FAILED,
    STATUS_MISSING,
    STATUS_OK,
    TIMELINE,
    VARIABLES,
)
from dvfs.errors import CubeError
from dvfs.measure.journal import read_records
from dvfs.measure.meter import QUALITY_FLAGS, QUANTILES, TIMELINE_POINTS
from dvfs.records import (
    CampaignFacts,
    Header,
    JournalContents,
    check_version,
    decode_journal,
    now_iso,
)
from dvfs.version import __version__

if TYPE_CHECKING:
    import xarray as xr


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
    check_version(path, Header.from_json(records[0]).journal_schema)
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
        return _build(decode_journal(records, journal_path), str(journal_path))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CubeError(
            f"{journal_path}: a record lacks what a cube needs ({type(exc).__name__}: {exc}); "
            "the journal was not written by this dvfs or was edited: rerun the sweep with "
            "--fresh to start a new journal"
        ) from exc


def _build(journal: JournalContents, where: str) -> xr.Dataset:
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
        except KeyError as exc:
            # The grid is part of the campaign's hash, so only an edited journal gets here.
            raise CubeError(
                f"{where}: cell {record.key!r} has {exc.args[0]!r}, which is not in the "
                "campaign's grid; the journal was edited: delete that line, or rerun the "
                "sweep with --fresh"
            ) from None
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
