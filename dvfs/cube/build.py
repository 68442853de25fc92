"""A cube from a journal: the records, decoded by `dvfs.records` one line at a time and laid
out on the campaign's grid as they come, a bounded batch of cells at a time (memory is the
grid's arrays, whatever the journal's length); cells not (yet) measured are NaN."""

from __future__ import annotations

import copy
import errno
import json
import math
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.campaign.model import hide_unrecorded, without_credentials
from dvfs.cube.precision import PRECISION_MISSED, PRECISION_MISSED_ATTRS, asked, missed
from dvfs.cube.schema import (
    CELL_DIMS,
    COORD_ATTRS,
    CUBE_SCHEMA,
    GPU_TIME,
    SPLIT,
    SPLIT_METHOD_VAR,
    STATUS_FAILED,
    STATUS_MISSING,
    STATUS_OK,
    TIMELINE,
    VARIABLES,
)
from dvfs.engines.base import SPLIT_PARTS
from dvfs.errors import (
    CubeError,
    IncomparableCellsError,
    JournalError,
    NoJournalError,
    capped_failed,
)
from dvfs.measure.journal import FRESH, iter_records, read_records
from dvfs.measure.meter import QUALITY_FLAGS, QUANTILES, TIMELINE_POINTS
from dvfs.records import (
    GPU_TIME_KEYS,
    CampaignFacts,
    CellRecord,
    Header,
    JournalContents,
    Server,
    Session,
    arm_changes,
    begun_unpinned,
    check_version,
    incomparable,
    mixed_within,
    now_iso,
    only_env_changed,
    prompt_changes,
    server_changes,
    what_differs,
)
from dvfs.records.cell import SPLIT_METHODS
from dvfs.redact import redact_args
from dvfs.twin.identity import TWIN_CHANGED, twin_changed
from dvfs.version import __version__

if TYPE_CHECKING:
    import xarray as xr


#: The auxiliary coordinate naming, per cell, the GPU(s) that measured it: a campaign resumed on
#: other GPUs of the model (after a node loss) holds cells of several GPU sets.
MEASURED_ON = "measured_on"
MEASURED_ON_ATTRS = {
    "units": "1",
    "long_name": "UUIDs of the GPU(s) that measured the cell (comma-separated; empty: none)",
}


def _num(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    return float(value)


#: Each measured variable's name and whether it holds the latency quantiles, as `_place`
#: walks them (once per cell).
_PLACED = tuple((spec.name, spec.extra_dim == "quantile") for spec in VARIABLES)


def _nums(values: Any) -> list[float]:
    """`_num` of each; floats (what a stored record holds) as they are, without a call each."""
    return [v if type(v) is float else _num(v) for v in values]


def _columns() -> tuple[tuple[str, int, int | None], ...]:
    """Where each array's values sit in a placed cell's row (`_Filler._row`), in the order the
    row lists them: the array's name, its first column, and its width (None: one value, for
    an array without an extra dimension)."""
    layout = [
        *((name, len(QUANTILES) if quantiles else None) for name, quantiles in _PLACED),
        *((spec.name, TIMELINE_POINTS) for spec in TIMELINE),
        *((f"gpu_time_{key}_s", None) for key in GPU_TIME_KEYS),
        ("gpu_time_total_s", None),
        *((f"energy_{part}_j", None) for part in SPLIT_PARTS),
        *((f"time_{part}_s", None) for part in SPLIT_PARTS),
    ]
    columns, start = [], 0
    for name, width in layout:
        columns.append((name, start, width))
        start += width or 1
    return tuple(columns)


_COLUMNS = _columns()
_ROW_WIDTH = sum(width or 1 for _, _, width in _COLUMNS)
#: A row's NaNs where a cell has no measurement (failed), no GPU time, no energy split.
_NO_MEASUREMENT = [math.nan] * (
    len(QUANTILES) * sum(q for _, q in _PLACED)
    + sum(not q for _, q in _PLACED)
    + TIMELINE_POINTS * len(TIMELINE)
)
_NO_GPU_TIME = [math.nan] * (len(GPU_TIME_KEYS) + 1)
_NO_SPLIT = [math.nan] * (2 * len(SPLIT_PARTS))
#: Cells held in a row buffer before their values go into the grid's arrays in one step per
#: array (a store per value and cell cost half the build); bounded, so that memory stays the
#: grid's whatever the journal's length.
_BATCH = 512


def _headless(path: Path, first: dict[str, Any] | None) -> CubeError:
    """A journal with no header to build from, refused with what to do, as a sweep refuses
    it: an empty one (its sweep wrote nothing yet, and resumes it), or one whose first record
    is not a header (not dvfs's, or its first line cut)."""
    if first is None:
        return CubeError(
            f"{path} is empty: nothing measured yet, nothing to put in a cube; run its "
            "`dvfs sweep` command to measure it"
        )
    return CubeError(
        f"{path} does not start with a dvfs journal header: move it aside, or start over "
        f"with {FRESH}, which renames it"
    )


def no_journal(path: Path) -> NoJournalError:
    """The refusal of a journal `path.exists()` denies: none there, or a path there that cannot
    be opened (a symbolic link in a loop or to nothing), which a sweep does not fix."""
    if not os.path.lexists(path):
        return NoJournalError(f"no journal at {path}: run `dvfs sweep` first")
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return NoJournalError(
                f"{path} is a symbolic link in a loop (it leads back to itself), not a journal: "
                "point it at the sweep's journal.jsonl, or remove it and rerun its `dvfs sweep` "
                "command"
            )
        if exc.errno == errno.ENOENT and path.is_symlink():
            return NoJournalError(
                f"{path} is a symbolic link to {os.readlink(path)}, which does not exist: point "
                "it at the sweep's journal.jsonl, or remove it and rerun its `dvfs sweep` command"
            )
        return NoJournalError(
            f"cannot read the journal {path}: {exc.strerror or exc}; check the path and its "
            "permissions"
        )
    return NoJournalError(f"no journal at {path}: run `dvfs sweep` first")


def read_journal(path: str | Path) -> list[dict[str, Any]]:
    """A journal's records in a list (the cube itself is built streaming), refused early when
    it is missing, headless or from a newer dvfs."""
    path = Path(path)
    if not path.exists():
        raise no_journal(path)
    records = read_records(path)
    if not records or records[0].get("type") != "header":
        raise _headless(path, records[0] if records else None)
    check_version(path, Header.from_json(records[0]).journal_schema)
    return records


def _grid(
    journal: JournalContents, facts: CampaignFacts, where: str = "the journal"
) -> dict[str, list[Any]]:
    """The cube's coordinates: the campaign's axes, the knobs' and the batches' ascending (a
    campaign may list them in any order), a stock knob axis at the setting found. `where`:
    the journal's path, which a refusal names (one of several a merge of shards reads)."""
    if not journal.sessions:
        raise CubeError(
            f"{where} has no measurement session yet (its sweep stopped before it measured): "
            "nothing to put in a cube; run its `dvfs sweep` command again to measure it"
        )
    stock = journal.sessions[0].stock
    grid = facts.grid
    clocks, limits = grid.sm_clocks_mhz, grid.power_limits_w
    return {
        "sm_clock": sorted(clocks) if clocks else [stock.sm_clock_mhz],
        "power_limit": sorted(limits) if limits else [stock.power_limit_w],
        "batch": sorted(grid.batch_sizes),
        "drafter": list(grid.drafters),
        "corpus": list(grid.corpora),
        "repeat": list(range(grid.repeats)),
    }


#: A comparison group of cells (batch, corpus, repeat): its arms were sent the same prompts.
Group = tuple[int, str, int]


@dataclass(frozen=True)
class Counted:
    """The token-count method of the session that measured each cell (its latest record's),
    as an index into `methods` per grid cell: 0, "", where unrecorded or not measured."""

    grid: Mapping[str, Sequence[Any]]
    method: np.ndarray
    methods: Sequence[str]


def _mixed_groups(counted: Counted) -> list[Group]:
    """The comparison groups whose cells were measured under more than one token-count
    method ("" not one)."""
    method = counted.method
    axes = [CELL_DIMS.index(d) for d in ("batch", "corpus", "repeat")]
    rest = [i for i in range(len(CELL_DIMS)) if i not in axes]
    by_group = np.transpose(method, (*axes, *rest)).reshape(*(method.shape[i] for i in axes), -1)
    ordered = np.sort(by_group, axis=-1)
    # The distinct recorded methods of each group: each run of one index in its sorted cells.
    starts = (ordered[..., 1:] != ordered[..., :-1]) & (ordered[..., 1:] != 0)
    distinct = starts.sum(axis=-1) + (ordered[..., 0] != 0)
    grid = counted.grid
    return sorted(
        (grid["batch"][b], grid["corpus"][c], grid["repeat"][r])
        for b, c, r in zip(*np.nonzero(distinct > 1), strict=True)
    )


def _check_sessions(
    journal: JournalContents,
    batch_sizes: Sequence[int] = (),
    counted: Counted | None = None,
) -> None:
    """A journal may hold runs on different GPUs of one model (a rerun on the GPUs left after
    a node loss, or on fewer of them); cells of GPUs that differ in an invariant
    (`GPU_INVARIANTS`, `SESSION_INVARIANTS`) would not compare and are refused, and so are
    servers that differ in what the arms share (`arm_changes`, at the grid's batch sizes).

    Sessions that counted prompt tokens differently (journals of a dvfs that did not yet
    reproduce the journal's method on resume) chose their prompts differently; their cells
    still build where every comparison group's cells were measured under one method
    (`counted`: each cell's group and method), as the arms of a group are then sent the same
    prompts; a group measured under both is refused."""
    if not journal.sessions:
        return
    mixed = None if counted is None else _mixed_groups(counted)
    records = [session.to_json() for session in journal.sessions]
    for i, record in enumerate(records):
        # Every earlier session, not the first alone: a key is compared only where both
        # records hold it, so a first session by an older dvfs would leave later ones
        # unchecked against each other.
        for before in records[:i] or [record]:
            _check_session_pair(before, record, mixed)
    first_server: dict[str, Server] = {}
    for server in journal.servers:
        earlier = first_server.setdefault(server.drafter, server)
        changes = server_changes(earlier.to_json(), server.to_json())
        if changes:
            advice = (
                TWIN_CHANGED
                if twin_changed(changes)
                else "rerun with --fresh (or into another --out folder) on one engine version "
                "and one set of engine flags"
            )
            raise IncomparableCellsError(
                f"the journal's cells of drafter {server.drafter!r} were served by different "
                f"engines or flags ({'; '.join(changes)}): they would compare "
                f"{what_differs(changes)}, not settings; {advice}"
            )
    formats = _prompt_formats(journal)
    if len(formats) > 1:  # a session's record and a server's (arm_changes: two servers')
        raise IncomparableCellsError(
            f"the journal's prompts went out in different formats ({' -> '.join(formats)}): "
            "the arms would compare prompts, not settings; rerun with --fresh (or into another "
            "--out folder)"
        )
    # Across drafters too: the arms must differ only in their drafters (`arm_changes`).
    servers = list(journal.servers)
    pinned = journal.header.arms_pinned
    for server in servers[1:]:
        changes = arm_changes(servers[0].to_json(), server.to_json(), batch_sizes, pinned)
        if not changes:
            continue
        served = (
            f"the journal's drafters {servers[0].drafter!r} and {server.drafter!r} were served "
            f"differently ({'; '.join(changes)}): the arms would compare more than their drafters"
        )
        begun = begun_unpinned(pinned, changes)
        if twin_changed(changes):
            raise IncomparableCellsError(f"{served}; {TWIN_CHANGED}")
        if begun:
            raise IncomparableCellsError(
                f"{served}; the journal was {begun}, so it cannot be resumed or compared: "
                "rerun with --fresh (or into another --out folder)"
            )
        raise IncomparableCellsError(
            f"{served}; rerun with --fresh (or into another --out folder) with every drafter "
            "on one engine version and one set of engine flags"
        )


def _check_session_pair(
    earlier: Mapping[str, Any], record: Mapping[str, Any], mixed: list[Group] | None
) -> None:
    """`_check_sessions` for one session record against an earlier one (or itself). Token
    counts that differ alone are let through where no group was measured under both (`mixed`
    empty); every other invariant is still compared."""
    sent = prompt_changes(earlier, record)
    recount = [c for c in sent if c.startswith("token-count method: ")]
    counted_apart = bool(recount) and len(recount) == len(sent) and mixed is not None
    if counted_apart and mixed:
        shown = ", ".join(f"batch {b} corpus {c!r} repeat {r}" for b, c, r in mixed[:3])
        more = f" and {len(mixed) - 3} more" if len(mixed) > 3 else ""
        raise IncomparableCellsError(
            f"the journal's sessions counted prompt tokens differently ({recount[0]}) and "
            f"the cells of {shown}{more} were measured under both, so their arms may have "
            "been sent different prompts: rerun with --fresh (or into another --out folder); "
            "a resume now keeps the journal's first method"
        )
    if sent and not counted_apart:  # a corpus edited, a tokenizer found or lost, a template
        raise IncomparableCellsError(
            "the journal's sessions sent different prompts "
            f"({'; '.join(sent)}): the arms would compare prompts, not settings; rerun "
            "with --fresh (or into another --out folder) on one corpus and tokenizer"
        )
    changes = [c for c in incomparable(earlier, record) if c not in recount]
    if only_env_changed(changes):
        raise IncomparableCellsError(
            "the journal's sessions started their SGLang servers with different environments "
            f"({'; '.join(changes)}): the arms would compare kernels or scheduling, not "
            "settings; rerun with --fresh (or into another --out folder) with one environment"
        )
    changes = changes or mixed_within(record)
    if changes:
        advice = (
            TWIN_CHANGED
            if twin_changed(changes)
            else "keep one journal per GPU model and driver: rerun the other GPUs into "
            "their own --out folder and `dvfs cube merge` the cubes"
        )
        raise IncomparableCellsError(
            "the journal holds measurements from GPUs that do not compare "
            f"({'; '.join(changes)}); {advice}"
        )


def _prompt_formats(journal: JournalContents) -> list[str]:
    """The prompt formats the journal's sessions and servers recorded, each once."""
    found = [s.prompt_format for s in journal.sessions]
    found += [s.prompt_format for s in journal.servers]
    return list(dict.fromkeys(f for f in found if f))


def _all_gpus(
    journal: JournalContents, measured: Collection[str] = frozenset()
) -> list[dict[str, Any]]:
    """Every GPU that measured in the journal, once each, in the order they first ran: those
    of its sessions named by a cell record (`measured`, their UUIDs), not a fleet worker's
    retired (its server refused) or lost before a cell of its came in; every session's GPU
    where none is (no cell yet)."""
    seen: dict[str, dict[str, Any]] = {}
    for session in journal.sessions:
        for gpu in session.gpus:
            seen.setdefault(str(gpu["uuid"]), gpu)
    kept = [gpu for uuid, gpu in seen.items() if uuid in measured]
    return kept or list(seen.values())


def _idle_power_w(journal: JournalContents, gpus: Sequence[dict[str, Any]]) -> float:
    """The sessions' mean opening idle power, of the GPUs the cube names (`gpus`): a fleet's
    session's workers on other GPUs (retired, or lost, before a cell of theirs came in) are
    left out of its mean of its workers', and sessions on none of them out of the whole."""
    named = {str(g["uuid"]) for g in gpus}
    idle: list[float] = []
    for session in journal.sessions:
        workers = [w for w in session.workers if "idle_power_w" in w]
        if not workers or len(workers) < len(session.workers):  # one GPU group's session
            if named & set(session.gpu_uuids):
                idle.append(session.idle_power_w)
            continue
        kept = [w for w in workers if named & {str(u) for u in w.get("gpus") or ()}]
        if len(kept) == len(workers):
            idle.append(session.idle_power_w)
        elif kept:
            idle.append(float(np.mean([float(w["idle_power_w"]) for w in kept])))
    if not idle:
        idle = [s.idle_power_w for s in journal.sessions]
    return float(np.nanmean(idle))


def _idle_parts(
    journal: JournalContents, gpus: Sequence[dict[str, Any]]
) -> list[Mapping[str, Any]]:
    """What the sessions say of their opening idle measurements (`idle_foreign_processes`,
    `idle_from_power_readings`), of the GPUs the cube names (`gpus`), as `_idle_power_w`
    takes their idle power: a session on none of them left out, a fleet's session's workers
    on other GPUs (retired, or lost, before a cell of theirs came in) left out of it (each
    kept worker's own part); every session's where none is named."""
    named = {str(g["uuid"]) for g in gpus}
    parts: list[Mapping[str, Any]] = []
    for session in journal.sessions:
        whole = {
            "idle_foreign_processes": session.idle_foreign_processes,
            "idle_from_power_readings": session.idle_from_power_readings,
        }
        if not named & set(session.gpu_uuids):
            continue
        workers = [w for w in session.workers if "idle_power_w" in w]
        kept = [w for w in workers if named & {str(u) for u in w.get("gpus") or ()}]
        if not workers or len(workers) < len(session.workers) or len(kept) == len(workers):
            parts.append(whole)  # one GPU group's session, or every worker of it named
        else:
            parts.extend(kept)
    return parts or [
        {
            "idle_foreign_processes": s.idle_foreign_processes,
            "idle_from_power_readings": s.idle_from_power_readings,
        }
        for s in journal.sessions
    ]


def _twin_profile_run(profile: str, gpu_name: str) -> str:
    """The twin profile (`KEY:TRAPS`) a twin GPU named `gpu_name` ran, where `profile` is the
    campaign's gpu.profile: that, unless the GPU is the twin of another shipped profile (a
    fleet mixing models, `--gpus 0,h200-sxm:0`, journals every model under the campaign's
    profile), then that profile with the campaign's trap list. A profile that is not shipped
    (one lent from a file to `twin predict`) is kept. (Here, not in `dvfs.twin`, whose files
    are the twin's identity.)"""
    from dvfs.twin.profiles import gpu_profiles

    base, sep, traps = profile.partition(":")
    profiles = gpu_profiles()
    if base not in profiles or gpu_name == f"{profiles[base].nvml_name} (twin)":
        return profile
    for key, other in profiles.items():
        if gpu_name == f"{other.nvml_name} (twin)":
            return key + sep + traps
    return profile


def _utf8_or_empty(path: str) -> str:
    """`path` as a cube's attribute holds it (UTF-8 text); "" for a folder named in bytes that
    are not UTF-8 (Linux's names are bytes: surrogates here, which no netCDF file takes), as
    an earlier dvfs's cube, whose corpora's recorded sources `dvfs twin fit` reads it from."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return ""
    return path


def _pinning_outcomes(servers: Sequence[Server]) -> str:
    """The `gpu_pinning` attribute: each drafter's distinct pinning outcomes, in the order its
    servers started, joined by "; " (as `dvfs.cube.merge` joins its shards')."""
    outcomes: dict[str, list[str]] = {}
    for server in servers:
        if server.gpu_pinning:
            seen = outcomes.setdefault(server.drafter, [])
            if server.gpu_pinning not in seen:
                seen.append(server.gpu_pinning)
    return json.dumps({d: "; ".join(o) for d, o in outcomes.items()}, sort_keys=True)


def _provenance(
    journal: JournalContents, facts: CampaignFacts, measured: Collection[str] = frozenset()
) -> dict[str, Any]:
    header, session = journal.header, journal.sessions[-1]
    if header.campaign_name is None or header.campaign_hash is None:
        raise KeyError("campaign_name" if header.campaign_name is None else "campaign_hash")
    # every session's that measured a cell: a rerun may run on other GPUs of the model
    gpus = _all_gpus(journal, measured)
    idle = _idle_parts(journal, gpus)
    servers: dict[str, Any] = {}
    for s in journal.servers:
        # An earlier dvfs's journal may hold credentials (`dvfs.redact`): not the cube.
        servers[s.drafter] = {
            "engine": s.engine,
            "version": s.version,
            "args": redact_args(s.args),
            **({"model_commit": s.model_commit} if s.model_commit else {}),
            **({"model_files": dict(s.model_files)} if s.model_files else {}),
            # what its scheduler really ran, each DP rank's cap (none from the twin)
            **({"running_caps": list(s.running_caps)} if s.running_caps else {}),
        }
    versions = sorted({s.version for s in journal.servers})
    return {
        "dvfs_schema": CUBE_SCHEMA,
        "Conventions": "CF-1.10",
        "title": f"dvfs sweep: {header.campaign_name}",
        "dvfs_version": __version__,
        "journal_dvfs_version": header.dvfs_version,
        "campaign_name": header.campaign_name,
        "campaign_hash": header.campaign_hash,
        "campaign": json.dumps(without_credentials(copy.deepcopy(header.campaign)), sort_keys=True),
        "campaign_source": hide_unrecorded(header.campaign_source),
        # Where the last session's corpora's relative paths started (`dvfs twin fit CUBE`
        # reads them again from there); "" from an earlier dvfs's journal.
        "campaign_dir": _utf8_or_empty(session.campaign_dir),
        "gpu_backend": session.gpu_backend,
        "gpu_name": gpus[0]["name"],
        "gpu_uuids": ",".join(str(g["uuid"]) for g in gpus),
        "gpu_count": len(gpus),
        "driver_version": gpus[0]["driver_version"],
        "memory_clock_mhz": gpus[0]["memory_clock_mhz"],
        # The GPUs' ECC mode and VBIOS, alike across the journal (`GPU_INVARIANTS`), where
        # its sessions read them (not the twin's, nor an earlier dvfs's).
        **_known_gpu_keys(gpus, ("ecc_mode", "vbios_version")),
        # the campaign's, or the profile of the model this journal's GPUs are (a fleet
        # mixing twin models journals each under the campaign's gpu.profile)
        "twin_profile": _twin_profile_run(facts.twin_profile, str(gpus[0]["name"])),
        "engine_backend": session.engine_backend,
        "engine_version": ", ".join(versions),
        "server_args": json.dumps(servers, sort_keys=True),
        # The variables of the servers' environment that change kernels or scheduling
        # (`dvfs.records.SERVER_ENV_PREFIXES`), alike across the journal (`_check_sessions`);
        # "" where no session recorded them (the twin, an attached server, an older dvfs).
        "server_env": next(
            (
                json.dumps(s.server_env, sort_keys=True)
                for s in journal.sessions
                if s.server_env is not None
            ),
            "",
        ),
        # The prefixes that session recorded them under ("": an earlier dvfs's, or none
        # recorded): a merge compares only the variables both cubes' prefixes cover.
        "server_env_prefixes": next(
            (",".join(s.server_env_prefixes) for s in journal.sessions if s.server_env is not None),
            "",
        ),
        # What the dvfs that began the journal gave every drafter alike (`ARMS_PINNED`): a
        # merge compares the servers' drawn args only where both cubes pinned them.
        "arms_pinned": ",".join(header.arms_pinned),
        # Whether each drafter's servers ran on the metered GPUs, as checked at each start:
        # every distinct outcome, as a merge keeps each shard's (a resume's verified server
        # does not hide the unverified one that measured the journal's earlier cells).
        "gpu_pinning": _pinning_outcomes(journal.servers),
        "model": facts.model,
        "twin_model": facts.twin_model,
        "tp_size": facts.tp_size,
        "actuation": int(session.actuation),
        "clock": session.clock,
        "stock_sm_clock_mhz": session.stock.sm_clock_mhz,
        "stock_power_limit_w": session.stock.power_limit_w,
        # Where NVML does not support a GPU's power limit, its stock limit is the one enforced.
        **_enforced_stock(journal, gpus),
        # The power caps dvfs applied that its sessions found and lifted to measure stock.
        **_found_limits(journal, gpus),
        "power_limit_range_w": list(session.power_limit_range_w),
        # The GPU's lowest and highest SM clock (NaN: not recorded, an earlier dvfs's journal).
        "sm_clock_range_mhz": list(session.sm_clock_range_mhz),
        "idle_power_w": _idle_power_w(journal, gpus),
        # Other tenants' processes seen around the sessions' opening idle measurements: where
        # any was, `idle_power_w` counts their work too (of the GPUs it is the idle of).
        "idle_foreign_processes": json.dumps(
            [dict(p) for part in idle for p in part.get("idle_foreign_processes") or ()]
        ),
        # A session's opening idle measurement from the instant power readings (a counter
        # updated less than twice in it, or idle_s = 0): `idle_power_w` is less exact.
        "idle_from_power_readings": int(any(part.get("idle_from_power_readings") for part in idle)),
        "counter_update_period_s": _counter_periods(journal, gpus),
        "measurement_method": session.measurement_method,
        # Each session's, once: two where an older journal's groups were each measured under
        # one of them (`_check_sessions`).
        "token_count_method": "; ".join(
            dict.fromkeys(s.token_count_method for s in journal.sessions if s.token_count_method)
        ),
        # How the prompts went out: its servers say (or, from one dvfs, its sessions), alike
        # across the journal (`_check_sessions`).
        "prompt_format": next(iter(_prompt_formats(journal)), ""),
        "corpora": json.dumps(session.corpora, sort_keys=True),
        "sessions": len(journal.sessions),
        "created": now_iso(),
        "history": f"{now_iso()} built by dvfs {__version__} from journal",
    }


def _known_gpu_keys(gpus: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, str]:
    """Each of `keys` the cube's GPUs recorded (comma-joined where they differ, which only a
    GPU that did not read it leaves possible); nothing for a key none of them recorded."""
    found = {}
    for key in keys:
        values = dict.fromkeys(str(g[key]) for g in gpus if g.get(key))
        if values:
            found[key] = ",".join(values)
    return found


def _enforced_stock(journal: JournalContents, gpus: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`stock_power_limit_enforced`: the UUIDs (comma-separated) of the GPUs whose power limit
    NVML does not support, whose stock power limit (`stock_power_limit_w`, the stock cells'
    `power_limit` coordinate) is the limit NVML said was enforced; nothing where every
    session's GPUs had a configured one. Of the GPUs the cube names (`gpus`) alone."""
    named = {str(g["uuid"]) for g in gpus}
    uuids = dict.fromkeys(
        u for s in journal.sessions for u in s.stock_power_limit_enforced if u in named
    )
    return {"stock_power_limit_enforced": ",".join(uuids)} if uuids else {}


def _found_limits(journal: JournalContents, gpus: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`power_limit_found_w`: the power limits the sessions found at start where those were
    not the stock their stock cells ran at (a cap dvfs applied, lifted while measuring), each
    once; and `power_limit_found_gpus`, each GPU's (by UUID), where the sessions named it (an
    earlier dvfs's did not). Nothing where every session found the stock. Of the GPUs the
    cube names (`gpus`) alone: a fleet worker's GPU that measured no cell did not run its
    stock cells (its GPU unnamed: where its session's GPUs are the cube's)."""
    named = {str(g["uuid"]) for g in gpus}
    return found_limits_attrs(
        (uuid, watts)
        for s in journal.sessions
        for uuid, watts in s.power_limit_found_w.items()
        if uuid in named or (not uuid and named & set(s.gpu_uuids))
    )


def found_limits_attrs(found: Iterable[tuple[str, float]]) -> dict[str, Any]:
    """The cube's attributes of the caps found at start and lifted, from (GPU UUID, W) pairs
    ("" where the GPU is not known): `power_limit_found_w`, every value once, and
    `power_limit_found_gpus`, each named GPU's values once (JSON); nothing where none."""
    values: list[float] = []
    by_gpu: dict[str, list[float]] = {}
    for uuid, watts in found:
        if watts not in values:
            values.append(watts)
        if uuid and watts not in by_gpu.setdefault(uuid, []):
            by_gpu[uuid].append(watts)
    if not values:
        return {}
    named = {"power_limit_found_gpus": json.dumps(by_gpu)} if by_gpu else {}
    return {"power_limit_found_w": values, **named}


def _counter_periods(journal: JournalContents, gpus: Sequence[dict[str, Any]]) -> list[float]:
    """Each GPU's energy-counter update period (s), in the order of `gpus` (`_all_gpus`), as
    the latest session that detected one on it saw it (NaN where none did)."""
    period: dict[str, float] = {}
    for session in reversed(journal.sessions):
        values = list(session.counter_update_period_s)
        for gpu, value in zip(session.gpus, values, strict=False):
            if value is not None:
                period.setdefault(str(gpu["uuid"]), float(value))
    return [period.get(str(g["uuid"]), math.nan) for g in gpus]


def build_cube(
    journal_path: str | Path, *, others: Callable[[dict[str, Any]], object] | None = None
) -> xr.Dataset:
    """Assemble the cube from a journal, read line by line into the grid's arrays (memory is
    the cube's, not the journal's); cells not (yet) measured are NaN. `others` is handed each
    record the cube does not read (a shard's record), so a caller needing one reads the
    journal once."""
    path = Path(journal_path)
    if not path.exists():
        raise no_journal(path)
    records = iter_records(path)
    try:
        first = next(records, None)
        if first is None or first.get("type") != "header":
            raise _headless(path, first)
        check_version(path, Header.from_json(first).journal_schema)
        filler = _Filler(Header.from_json(first), str(journal_path))
        for record in records:
            if not filler.add(record) and others is not None:
                others(record)
        return filler.dataset()
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        _drain(records)
        raise CubeError(
            f"{journal_path}: a record lacks what a cube needs ({type(exc).__name__}: {exc}); "
            "the journal was not written by this dvfs or was edited: rerun the sweep with "
            "--fresh to start a new journal"
        ) from exc
    except (CubeError, JournalError):
        _drain(records)
        raise


def _drain(records: Iterator[dict[str, Any]]) -> None:
    """Read the rest: a damaged line further on is the error to report, as it was when the
    journal was read whole before any record was decoded."""
    for _ in records:
        pass


class _Filler:
    """The cube's arrays, filled one journal record at a time. A later record for a cell
    replaces an earlier one (a retry after a failure); cells before the first session (only in
    an edited journal) wait until the grid is known."""

    def __init__(self, header: Header, where: str) -> None:
        self.header = header
        self.where = where
        self.version = self.first_version = check_version(where, header.journal_schema)
        self.sessions: list[Session] = []
        self.servers: list[Server] = []
        self.waiting: list[CellRecord] = []
        self.failed: dict[str, CellRecord] = {}
        self.grid: dict[str, list[Any]] | None = None
        self.index: dict[str, dict[Any, int]] = {}
        self.data: dict[str, np.ndarray] = {}
        self.status = np.zeros((), dtype=np.int8)
        #: How each cell's energy split was obtained (`SPLIT_METHODS` index; 0: none).
        self.split_method = np.zeros((), dtype=np.int8)
        #: Which GPU(s) measured each cell: UUIDs joined by ",", "" where none did.
        self.measured_on = np.zeros((), dtype=object)
        #: Whether each session ran every comparison group on one GPU group: a fleet's that
        #: says so, and a single runner's (all its cells on its one group).
        self.paired: list[bool] = []
        #: The token-count method of the session that measured each cell (its latest
        #: record's), as an index into `methods`, for `_check_sessions`.
        self.method = np.zeros((), dtype=np.int16)
        self.methods: dict[str, int] = {"": 0}
        #: Each distinct string of `measured_on` once (a journal's line holds its own copy).
        self.names: dict[str, str] = {}
        #: Placed cells whose values wait in `rows` (their row, by where they go): a later
        #: record of a cell overwrites its row, as it replaces the values in the arrays.
        self.pending: dict[tuple[int, ...], int] = {}
        self.rows = np.empty((0, _ROW_WIDTH))

    def contents(self) -> JournalContents:
        return JournalContents(self.header, tuple(self.sessions), tuple(self.servers), {})

    def add(self, record: dict[str, Any]) -> bool:
        """Take in one record; False for a type the cube does not read."""
        kind = record.get("type")
        if kind == "session":
            self.version = check_version(
                self.where, record.get("journal_schema", self.first_version)
            )
            self.sessions.append(Session.from_json(record, version=self.version))
            self.paired.append(record.get("arms_on_one_gpu") == 1 or not record.get("workers"))
        elif kind == "server":
            self.servers.append(Server.from_json(record))
        elif kind == "cell":
            cell = CellRecord.from_json(record, version=self.version)
            if self.sessions:
                at = self._place(cell, self._gpus_of(cell))
                method = self.sessions[-1].token_count_method
                self.method[at] = self.methods.setdefault(method, len(self.methods))
            else:
                self.waiting.append(cell)
        else:
            return False
        return True

    def _gpus_of(self, record: CellRecord) -> str:
        """The GPUs that measured a cell: its own record's, else its worker's in the session
        it was measured in (the latest), else that session's."""
        if record.gpus:
            gpus = ",".join(record.gpus)
        elif not self.sessions:
            return ""
        else:
            session = self.sessions[-1]
            of = session.gpus_of(record.worker) if record.worker else session.gpu_uuids
            gpus = ",".join(of)
        return self.names.setdefault(gpus, gpus)

    def _allocate(self) -> None:
        self.grid = _grid(self.contents(), self.header.facts(), self.where)
        shape = tuple(len(self.grid[d]) for d in CELL_DIMS)
        self.index = {d: {v: i for i, v in enumerate(self.grid[d])} for d in CELL_DIMS}
        for spec in VARIABLES:
            extra = {"quantile": len(QUANTILES)}.get(spec.extra_dim or "")
            self.data[spec.name] = np.full(shape + ((extra,) if extra else ()), np.nan)
        for spec in TIMELINE:
            self.data[spec.name] = np.full(shape + (TIMELINE_POINTS,), np.nan)
        for spec in (*GPU_TIME, *SPLIT):
            self.data[spec.name] = np.full(shape, np.nan)
        self.status = np.zeros(shape, dtype=np.int8)
        self.split_method = np.zeros(shape, dtype=np.int8)
        self.measured_on = np.full(shape, "", dtype=object)
        self.method = np.zeros(shape, dtype=np.int16)
        self.rows = np.empty((min(_BATCH, math.prod(shape)), _ROW_WIDTH))

    def _place(self, record: CellRecord, gpus: str = "") -> tuple[int, ...]:
        """Lay the record out in the grid's arrays; where it went."""
        if self.grid is None:
            self._allocate()
        stock = self.sessions[0].stock
        cell = record.cell
        clock = cell.sm_clock_mhz if cell.sm_clock_mhz is not None else stock.sm_clock_mhz
        limit = cell.power_limit_w if cell.power_limit_w is not None else stock.power_limit_w
        index = self.index
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
                f"{self.where}: cell {record.key!r} has {exc.args[0]!r}, which is not in the "
                "campaign's grid; the journal was edited: delete that line, or rerun the "
                "sweep with --fresh"
            ) from None
        self.measured_on[at] = gpus
        measured = record.ok and record.measurement is not None
        values = self._row(record, measured)
        if measured:
            self.failed.pop(record.key, None)
            self.status[at] = STATUS_OK
        else:
            self.status[at] = STATUS_FAILED
            self.failed[record.key] = record
        split = record.energy_split if measured else None
        self.split_method[at] = 0 if split is None else SPLIT_METHODS.index(split.method)
        row = self.pending.get(at)
        if row is None:
            if len(self.pending) == len(self.rows):
                self._flush()
            row = self.pending[at] = len(self.pending)
        self.rows[row] = values
        return at

    @staticmethod
    def _row(record: CellRecord, measured: bool) -> list[float]:
        """A cell's values as `_COLUMNS` lays them out, NaN where it has none: a later record
        of a cell replaces every value of the earlier one."""
        if record.gpu_time_s:  # spent whether or not the cell was measured
            seconds = [_num(record.gpu_time_s.get(key, 0.0)) for key in GPU_TIME_KEYS]
            gpu_time = [*seconds, math.fsum(seconds)]
        else:
            gpu_time = _NO_GPU_TIME
        m = record.measurement
        if not measured or m is None:
            return [*_NO_MEASUREMENT, *gpu_time, *_NO_SPLIT]
        row: list[float] = []
        for name, quantiles in _PLACED:
            value = getattr(m, name)
            if not quantiles:  # mostly floats already: those without a call each
                row.append(value if type(value) is float else _num(value))
                continue
            values = _nums(value)
            if len(values) != len(QUANTILES):  # broadcast, or refused, as numpy stores it
                stored = np.full(len(QUANTILES), math.nan)
                stored[:] = values
                values = stored.tolist()
            row += values
        for spec in TIMELINE:
            points = _nums(getattr(m, spec.name)[:TIMELINE_POINTS])
            row += points
            if len(points) < TIMELINE_POINTS:
                row += [math.nan] * (TIMELINE_POINTS - len(points))
        row += gpu_time
        split = record.energy_split
        if split is None:
            row += _NO_SPLIT
        else:
            parts = range(len(SPLIT_PARTS))
            row += [split.energy_j[i] for i in parts]
            row += [split.time_s[i] for i in parts]
        return row

    def _flush(self) -> None:
        """Store the waiting rows' values in the grid's arrays, one step per array."""
        if not self.pending:
            return
        at = tuple(np.array(axis) for axis in zip(*self.pending, strict=True))
        block = self.rows[: len(self.pending)]
        for name, start, width in _COLUMNS:
            self.data[name][at] = (
                block[:, start] if width is None else block[:, start : start + width]
            )
        self.pending.clear()

    def dataset(self) -> xr.Dataset:
        journal = self.contents()
        facts = self.header.facts()
        if self.grid is None:
            self._allocate()  # no cell yet (or none since the first session)
        assert self.grid is not None
        counted = Counted(self.grid, self.method, list(self.methods))
        _check_sessions(journal, facts.grid.batch_sizes, counted)
        for record in self.waiting:
            self._place(record, self._gpus_of(record))
        self.waiting.clear()
        self._flush()
        assert self.grid is not None
        ds = _dataset(
            journal,
            facts,
            self.grid,
            self.data,
            self.status,
            self.failed,
            # In the one Dataset built: set on it afterwards, each cost a merge of the whole
            # cube's variables (half the build of a test's tiny cube).
            {
                SPLIT_METHOD_VAR: (CELL_DIMS, self.split_method, split_method_attrs()),
                **self._precision_missed(),
            },
            {MEASURED_ON: (CELL_DIMS, self.measured_on, dict(MEASURED_ON_ATTRS))},
            # the GPUs of the cells the cube holds: not those of records a later one replaced
            # (failed cells measured again on other GPUs)
            measured={u for on in set(self.measured_on.ravel()) for u in str(on).split(",") if u},
        )
        # Every session ran on one GPU group, or was a fleet that gave each comparison group to
        # one worker (`dvfs.fleet.queue`); whether the valid cells of each (batch, corpus,
        # repeat) did share one GPU group is counted, not refused (a lost worker's groups
        # finish elsewhere, a resume may run on other GPUs).
        ds.attrs["arms_on_one_gpu"] = int(bool(self.paired) and all(self.paired))
        ds.attrs["groups_across_gpus"] = groups_across_gpus(
            self.measured_on, self.status, self.data["valid"]
        )
        return ds

    def _precision_missed(self) -> dict[str, Any]:
        """`PRECISION_MISSED` of every cell, from its intervals and the campaign's precision
        (none where the journal's campaign records no precision)."""
        wanted = asked(self.header.campaign)
        if wanted is None:
            return {}
        values = missed(
            self.data["energy_per_token_rel_ci"],
            self.data["latency_rel_ci"],
            self.status == STATUS_OK,
            *wanted,
        )
        return {PRECISION_MISSED: (CELL_DIMS, values, dict(PRECISION_MISSED_ATTRS))}


def groups_across_gpus(measured_on: np.ndarray, status: np.ndarray, valid: np.ndarray) -> int:
    """How many comparison groups (batch, corpus, repeat) have valid measured cells on more
    than one GPU group (`measured_on`): their arms differ by GPU too."""
    axes = [CELL_DIMS.index(d) for d in ("batch", "corpus", "repeat")]
    rest = [i for i in range(len(CELL_DIMS)) if i not in axes]
    if measured_on.ndim != len(CELL_DIMS):
        return 0
    order = (*axes, *rest)
    on = np.transpose(measured_on, order).reshape(*(measured_on.shape[i] for i in axes), -1)
    ok = np.transpose((status == STATUS_OK) & (valid == 1), order).reshape(on.shape)
    count = 0
    for index in np.ndindex(on.shape[:-1]):
        if len({str(g) for g in on[index][ok[index]]}) > 1:
            count += 1
    return count


def split_method_attrs() -> dict[str, Any]:
    """The CF attributes of `energy_split_method` (`SPLIT_METHODS` as flag values)."""
    return {
        "units": "1",
        "long_name": "how the cell's energy split was obtained",
        "flag_values": np.arange(len(SPLIT_METHODS), dtype=np.int8),
        "flag_meanings": " ".join(SPLIT_METHODS),
    }


def _dataset(
    journal: JournalContents,
    facts: CampaignFacts,
    grid: dict[str, list[Any]],
    data: dict[str, np.ndarray],
    status: np.ndarray,
    failed_cells: dict[str, CellRecord],
    last_variables: Mapping[str, Any] = MappingProxyType({}),
    last_coords: Mapping[str, Any] = MappingProxyType({}),
    measured: Collection[str] = frozenset(),
) -> xr.Dataset:
    """The cube's Dataset; `last_variables` and `last_coords` go after the others, given their
    attributes as they are. `measured`: the UUIDs of the GPUs the journal's cells name."""
    import xarray as xr

    axes: dict[str, Any] = {d: grid[d] for d in CELL_DIMS}
    axes["quantile"] = list(QUANTILES)
    axes["sample"] = list(range(TIMELINE_POINTS))
    variables: dict[str, Any] = {}
    for spec in (*VARIABLES, *TIMELINE, *GPU_TIME, *SPLIT):
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
    # The axes among the variables, where the cube has always listed them (each becomes its
    # dimension's indexed coordinate): after the measured variables, before `last_variables`.
    ds = xr.Dataset(
        {**variables, **{name: (name, values) for name, values in axes.items()}, **last_variables},
        coords=dict(last_coords),
        attrs=_provenance(journal, facts, measured),
    )
    for name, (units, long_name) in COORD_ATTRS.items():
        if name in ds.coords and name not in last_coords:
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
    failed = list(failed_cells.values())
    ds.attrs["failed_cells"] = json.dumps(
        capped_failed([{"cell": asdict(r.cell), "error": r.error} for r in failed])
    )
    return ds
