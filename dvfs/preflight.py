"""Read-only checks before a sweep measures: are the GPUs free, as the campaign and the journal
say, at the stock settings it was swept from, and does a resumed journal match the campaign
(same GPUs, prompts, server environment)? The sweep, `dvfs doctor` and the dry run all call
these, so each refusal has one rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dvfs.backends import (
    free_running_profile,
    real_gpus,
    simulated_engine,
)
from dvfs.campaign import Campaign
from dvfs.corpora.model import Corpus
from dvfs.errors import (
    CampaignError,
    CapsRecordError,
    DvfsError,
    GpuError,
    GpuNotSupportedError,
    GpuStateError,
    JournalError,
)
from dvfs.gpu.base import Gpu, unsupported_clock
from dvfs.gpu.knobs import (
    GpuSettings,
    check_one_stock_limit,
    stock_limit_is_enforced,
    stock_limit_mw,
)
from dvfs.measure.journal import (
    Journal,
)
from dvfs.measure.plan import Cell

if TYPE_CHECKING:
    from dvfs.gpu.visible import Visible


def check_same_gpus(journal: Journal, gpus: list[Gpu]) -> None:
    """A resume may run on other GPUs of the model (fewer, after a node loss), not on GPUs
    whose cells would not compare (`dvfs.records.incomparable`)."""
    from dataclasses import asdict

    from dvfs.records import incomparable

    now = {"gpus": [asdict(g.identity) for g in gpus]}
    for session in journal.sessions:
        changes = incomparable(session, now)
        if changes:
            from dvfs.fleet.folders import other_gpus_line

            raise JournalError(other_gpus_line(journal.path, changes))


def check_same_prompts(
    journal: Journal, corpora: dict[str, Corpus], count_method: str, campaign: Campaign
) -> None:
    """Refuse, before measuring, to resume a journal whose earlier sessions sent other prompts
    (`prompt_refusal`)."""
    refusal = prompt_refusal(journal.path, journal.sessions, corpora, count_method, campaign)
    if refusal is not None:
        raise refusal


def prompt_refusal(
    path: Path,
    sessions: Sequence[dict[str, Any]],
    corpora: dict[str, Corpus],
    count_method: str,
    campaign: Campaign,
) -> JournalError | None:
    """Why a sweep refuses to resume the journal at `path` whose sessions (its session
    records) sent other prompts (`dvfs.records.prompt_changes`): a corpus edited since, the
    same corpus counted otherwise (another revision of the tokenizer: `pool_hash`), another
    token-count method (the journal's is reproduced, `recorded_count_method`, so only where its
    sessions already differ); the arms would compare prompts. None where they are the same.
    The prompt format is the servers' to check, once one has started
    (`Runner._check_prompt_format`)."""
    from dvfs.corpora.sampling import pool_hash
    from dvfs.records import prompt_changes

    lengths = campaign.workload.input_tokens
    now = {
        "corpora": {
            name: {"content_hash": c.content_hash, "pool_hash": pool_hash(c, lengths)}
            for name, c in corpora.items()
        },
        "token_count_method": count_method,
    }
    for session in sessions:
        changes = prompt_changes(session, now)
        if changes:
            return JournalError(
                f"the prompts differ from those {path} was measured with "
                f"({'; '.join(changes)}): its cells would not compare with this run's; restore "
                "the corpus (and tokenizer) it was measured with, or rerun with --fresh (or "
                "into another --out folder)"
            )
    return None


def check_same_server_env(journal: Journal, campaign: Campaign) -> None:
    """Refuse, before measuring, to resume a journal whose servers ran with another value of
    an environment variable that changes their kernels, numerics or scheduling
    (`server_env_refusal`)."""
    refusal = server_env_refusal(journal.path, journal.sessions, campaign)
    if refusal is not None:
        raise refusal


def server_env_refusal(
    path: Path, sessions: Sequence[dict[str, Any]], campaign: Campaign
) -> JournalError | None:
    """Why a sweep refuses to resume the journal at `path` whose sessions' servers ran with
    another value of an environment variable that changes their kernels, numerics or
    scheduling (`dvfs.records.env_changes`: CUDA_LAUNCH_BLOCKING, an SGLANG_* switch...), set
    in engine.sglang.env or in dvfs's own environment: the later arms would be served
    otherwise than the journal's first ones, unseen. Sessions that recorded none are not
    compared. None where nothing changed."""
    from dvfs.engines.sglang_args import recorded_server_env
    from dvfs.records import SERVER_ENV_ADVICE, SERVER_ENV_PREFIXES, env_changes

    now = {
        "server_env": recorded_server_env(campaign),
        "server_env_prefixes": list(SERVER_ENV_PREFIXES),
    }
    for session in sessions:
        changes = env_changes(session, now)
        if changes:
            return JournalError(
                f"this run's SGLang servers would start with another environment than those "
                f"of {path} ({'; '.join(changes)}): its cells would not compare with "
                f"this run's; {SERVER_ENV_ADVICE}"
            )
    return None


def resume_refusals(
    campaign: Campaign,
    journals: Sequence[Path],
    corpora: dict[str, Corpus] | None,
    count_method: str,
) -> list[JournalError]:
    """What stops a sweep resuming these journals (those that exist) before it measures, as
    it checks each once it opens it: servers that would start with another environment, and
    (given the `corpora`, counted by `count_method` as the sweep counts them) other prompts.
    For `dvfs doctor` and the dry run, which open no journal for writing."""
    from dvfs.measure.journal import session_records

    refusals = []
    for path in journals:
        if not path.is_file():
            continue
        sessions = session_records(path)
        refusal = server_env_refusal(path, sessions, campaign)
        if refusal is None and corpora is not None:
            refusal = prompt_refusal(path, sessions, corpora, count_method, campaign)
        if refusal is not None:
            refusals.append(refusal)
    return refusals


def check_knobs_against(campaign: Campaign, gpus: list[Gpu]) -> None:
    """Refuse clocks or power limits a real GPU does not support, before changing anything:
    power limits on a GPU whose power limit NVML does not support too (in one line naming the
    knob); a grid of clocks alone does not read the power-limit range."""
    for gpu in gpus:
        ident = gpu.identity
        supported = set(gpu.supported_sm_clocks_mhz())
        of = f" of GPU {ident.index} ({ident.name})"
        for clock in campaign.knobs.sm_clocks_mhz or ():
            problem = unsupported_clock(clock, supported, of=of)
            if problem:
                raise CampaignError(f"knobs.sm_clock: {problem}")
        limits = campaign.knobs.power_limits_w or ()
        if not limits:  # a clocks-only grid reads no power-limit range (NVML may lack one)
            continue
        try:
            allowed = gpu.power_limit_range()
        except GpuNotSupportedError as exc:
            raise CampaignError(
                f"knobs.power_limit: GPU {ident.index} ({ident.uuid}): NVML does not support "
                f"its power limit ({exc}), so the campaign's power limits cannot be set: sweep "
                'only SM clocks on it (knobs.power_limit left out, or "stock")'
            ) from exc
        for limit in limits:
            problem = allowed.outside(limit * 1000)
            if problem:
                raise CampaignError(f"knobs.power_limit: GPU {ident.index}: {problem}")


def check_gpus_free(gpus: Sequence[Gpu], directory: Path) -> None:
    """Refuse, read-only, what the sweep's `guarded_knobs` refuses first on real GPUs, in its
    words: a GPU another dvfs holds (its lock in `directory`, or in root's), or one holding an
    earlier run's changes (a state file there, not from before the last reboot). Takes,
    creates and drops nothing."""
    from dvfs.gpu.safety import GpuLocks, StateStore, root_holder

    locks = GpuLocks(directory)
    for gpu in gpus:
        # (root_holder: a user's observe-only run, its locks in its own folder, refuses a GPU
        # root's dvfs holds in /var/lib/dvfs as well)
        held = locks.holder(gpu) or root_holder(gpu, directory)
        if held is not None:
            raise GpuStateError(held)
    StateStore(directory).refuse_if_pending(gpus, drop_rebooted=False)


def stock_as_swept(
    campaign: Campaign, gpus: Sequence[Gpu], *, state_dir: Path | None = None
) -> dict[str, GpuSettings] | None:
    """Each of the campaign's real `gpus`' stock, by UUID, as `guarded_knobs`' controller
    takes it (a power limit dvfs applied as a cap counts as the default; observe-only: as
    found), read without holding or changing anything. None where the sweep refuses these GPUs
    before it reads their stock (another dvfs holds one, an earlier run's changes on one, a
    damaged caps record: its own refusal says so) or one cannot be read."""
    from dvfs.gpu.safety import default_state_dir

    try:
        return read_stock_as_swept(campaign, gpus, state_dir or default_state_dir())
    except DvfsError:
        return None


def read_stock_as_swept(
    campaign: Campaign, gpus: Sequence[Gpu], directory: Path
) -> dict[str, GpuSettings]:
    """`stock_as_swept`, refusing in the sweep's words what `guarded_knobs` refuses before it
    reads the stock: a GPU another dvfs holds or one holding an earlier run's changes
    (`check_gpus_free`), a caps record it cannot read (`AppliedCaps.measuring`), with dvfs's
    records in `directory`. Read-only."""
    from dvfs.caps import AppliedCaps

    check_gpus_free(gpus, directory)
    controller = AppliedCaps(directory).measuring(gpus, actuation=campaign.gpu.actuation)
    return controller.read_stock()


def check_stock_limits(
    campaign: Campaign, servers: Sequence[Sequence[Gpu]], *, state_dir: Path | None = None
) -> dict[str, GpuSettings] | None:
    """Refuse, read-only, what the sweep refuses once it holds the GPUs: a server's GPUs, or
    a fleet's of one GPU model (each server `servers`' one), that start from other stock power
    limits (`check_one_stock_limit`, the sweep's own rule), each GPU's stock as the sweep
    takes it (`stock_as_swept`). Returns that stock; None where it was not compared (the sweep
    refuses the GPUs first for another reason)."""
    gpus = [g for server in servers for g in server]
    stock = stock_as_swept(campaign, gpus, state_dir=state_dir)
    if stock is None:
        return None
    for server in servers:  # as each server's runner refuses it
        check_one_stock_limit(
            server,
            stock,
            of="the GPUs of one server",
            leave_out="leave one out of the server's GPUs",
        )
    if len(servers) > 1:  # as the fleet refuses its workers of one model (`combine_sessions`)
        by_model: dict[str, list[Gpu]] = {}
        for g in gpus:
            by_model.setdefault(g.identity.name, []).append(g)
        for same in by_model.values():
            check_one_stock_limit(
                same,
                stock,
                of="the fleet's GPUs"
                + (f" of model {same[0].identity.name}" if len(by_model) > 1 else ""),
                leave_out="leave those at another limit out of the fleet (--gpus)",
            )
            _check_one_limit_support(same, stock)
    return stock


def _check_one_limit_support(gpus: Sequence[Gpu], stock: dict[str, GpuSettings]) -> None:
    """Refuse a fleet's GPUs of one model where NVML supports the power limit of some and not
    of others: a session records a NaN power-limit range for the latter, which the fleet's
    driver compares among its workers once each opened its session (`combine_sessions`, after
    its counters were timed and its idle power measured) and refuses."""
    unsupported = [g for g in gpus if stock_limit_is_enforced(stock[g.identity.uuid])]
    supported = [g for g in gpus if g not in unsupported]
    if not unsupported or not supported:
        return

    def named(some: Sequence[Gpu]) -> str:
        return ", ".join(f"GPU {g.identity.index} ({g.identity.uuid})" for g in some)

    raise JournalError(
        f"NVML does not support the power limit of {named(unsupported)}, nor then its range, "
        f"but supports that of {named(supported)}: their sessions' power-limit ranges differ, "
        "so their cells cannot share one journal; leave one of them out (--gpus), or run them "
        "into separate --out folders and `dvfs cube merge` the cubes"
    )


def resumed_stock_refusal(
    campaign: Campaign, gpus: Sequence[Gpu], journal: Path, *, state_dir: Path | None = None
) -> JournalError | None:
    """Why the sweep over `gpus` would refuse to resume `journal` (where there is one): its
    sessions recorded other stock settings than the GPUs' now (`stock_change_refusal`, the
    runner's own rule), each GPU's stock read as the sweep takes it (`stock_as_swept`,
    read-only). None where nothing changed, where the sweep refuses the GPUs first, or where
    the journal holds every cell (`nothing_left`: the sweep opens no session, so compares no
    stock)."""
    from dvfs.measure.journal import session_records
    from dvfs.measure.runner import session_stock, stock_change_refusal

    if not journal.is_file():
        return None
    try:
        sessions = session_records(journal)
    except (JournalError, OSError):  # the folder's own check (and the sweep's) says why
        return None
    stock = stock_as_swept(campaign, gpus, state_dir=state_dir)
    if stock is None:
        return None
    refusal = stock_change_refusal(sessions, session_stock(gpus, stock))
    if refusal is not None and nothing_left(campaign, journal.parent):
        return None
    return refusal


def resumed_server_refusal(
    campaign: Campaign,
    journal: Path,
    info: dict[str, Any],
    *,
    worker: str | None = None,
    out_dir: Path | None = None,
    models: Sequence[str] | None = None,
) -> DvfsError | None:
    """Why the sweep resuming `journal` would refuse the attached server (engine.sglang.url)
    whose /server_info is `info`, as each of the campaign's drafters (that one server serves
    them): it differs from the servers that measured the journal's cells, by the runner's own
    rule at each server start (`dvfs.measure.runner.server_refusal`). None where it compares,
    where there is no journal, or one the sweep would not resume (unreadable, another
    campaign's: the output folder's check says why), or where the journal holds every cell
    (`nothing_left`: the sweep starts no server). `worker`: a fleet's (of one, on GPUs of
    `models`), which resumes `journal`, its model's in `out_dir` (`model_journals`): compared
    by the fleet driver's rule (`dvfs.fleet.refusal.server_refusal`), in its line."""
    from dvfs.engines.sglang import server_record_of
    from dvfs.measure.journal import check_resumable, iter_records
    from dvfs.measure.runner import server_refusal
    from dvfs.records import Header

    if not journal.is_file():
        return None
    first: dict[str, Any] | None = None
    servers: list[dict[str, Any]] = []
    try:
        for record in iter_records(journal):
            if first is None:
                first = record
            if record.get("type") == "server":
                servers.append(record)
        if first is None or not servers:
            return None
        check_resumable(journal, first, campaign)
    except (JournalError, OSError):
        return None
    if worker is not None:  # a fleet's: its folder holds the journal (or its gpu-*/)
        from dvfs.fleet.refusal import server_refusal as fleet_refusal

        if nothing_left(campaign, out_dir or journal.parent, models):
            return None
        pinned = Header.from_json(first).arms_pinned
        firsts: dict[str, dict[str, Any]] = {}
        for server in servers:  # each drafter's first, as the driver keeps them
            firsts.setdefault(str(server.get("drafter")), server)
        for drafter in campaign.drafters:
            record = server_record_of(drafter.name, info)
            why = fleet_refusal(campaign, journal, firsts, record, pinned, worker)
            if why is not None:
                return JournalError(why)  # as the fleet ends in it
        return None
    if nothing_left(campaign, journal.parent):
        return None
    pinned = Header.from_json(first).arms_pinned
    for drafter in campaign.drafters:
        record = server_record_of(drafter.name, info)
        refusal = server_refusal(campaign, journal, servers, record, pinned)
        if refusal is not None:
            return refusal
    return None


def nothing_left(campaign: Campaign, out_dir: Path, models: Sequence[str] | None = None) -> bool:
    """Whether a sweep of `campaign` (a fleet's: on GPUs of `models`) into `out_dir` finds
    every cell of the share its journals hold measured, with no further repeat asked
    (`journals_done`, the fleet's own test): it then measures nothing and writes the cube, so
    it opens no session and refuses no change of the GPUs' stock settings since. False where
    that is not known (a journal it cannot read: the folder's own check says why)."""
    from dvfs.fleet.folders import journals_done
    from dvfs.fleet.shard import planned_cells
    from dvfs.fleet.shard_journal import folder_journals, recorded_shard

    try:
        journals = [j for j in folder_journals(out_dir) if j.is_file()]
        shard = recorded_shard(journals[0]) if journals else None
        cells = planned_cells(campaign, shard)
        return journals_done(out_dir, campaign, cells, models) is not None
    except (DvfsError, OSError):
        return False


def resumed_fleet_stock_refusal(
    campaign: Campaign,
    servers: Sequence[Sequence[Gpu]],
    out_dir: Path,
    *,
    state_dir: Path | None = None,
    stock: dict[str, GpuSettings] | None = None,
) -> JournalError | None:
    """Why a fleet whose workers run on `servers` (each worker's GPUs) would refuse to resume
    its journals in `out_dir` (each GPU model's, `model_journals`): one whose sessions recorded
    other stock settings than that model's workers' GPUs start from now (`stock_changed`, the
    fleet's driver's own rule, on the first worker's session stock as `combine_sessions` keeps
    it), each GPU's stock read as the sweep takes it (`stock_as_swept`, read-only; or `stock`,
    so read). None where nothing changed, where the sweep refuses the GPUs or the folder
    first for another reason (its own check says so), or where the journals hold every cell
    of the fleet's GPU models (`nothing_left`: the fleet opens no GPU)."""
    from dvfs.fleet.folders import model_journals, stock_changed
    from dvfs.measure.journal import session_records
    from dvfs.measure.runner import session_stock

    first: dict[str, Sequence[Gpu]] = {}  # each model's first worker's GPUs
    for server in servers:
        if server:
            first.setdefault(server[0].identity.name, server)
    try:
        paths = model_journals(out_dir, first)
    except (JournalError, OSError):
        return None
    if not any(path.is_file() for path in paths):
        return None
    if stock is None:
        stock = stock_as_swept(campaign, [g for s in servers for g in s], state_dir=state_dir)
        if stock is None:
            return None
    for model, path in zip(sorted(first), paths, strict=True):
        if not path.is_file():
            continue
        try:
            sessions = session_records(path)
        except (JournalError, OSError):  # the folder's own check (and the sweep's) says why
            continue
        refusal = stock_changed(path, sessions, session_stock(first[model], stock))
        if refusal is not None:
            return None if nothing_left(campaign, out_dir, sorted(first)) else refusal
    return None


def servers_of(gpus: Sequence[Gpu], groups: Sequence[Sequence[Any]]) -> list[list[Gpu]]:
    """`gpus`, opened in the order of `groups`' devices, cut into one list per group (server)."""
    it = iter(gpus)
    return [[next(it) for _ in group] for group in groups]


def check_fleet_stock(
    campaign: Campaign,
    groups: Sequence[Sequence[int | str]],
    *,
    nvml: ModuleType | None = None,
    state_dir: Path | None = None,
    out_dir: Path | None = None,
) -> None:
    """Before a fleet's workers open their GPUs (and each times its counters and measures its
    idle power before its session is compared with the others'): its real GPUs opened
    read-only here and refused as `check_stock_limits` refuses them, and (its --out folder
    `out_dir`) as its driver refuses to resume a journal there whose GPUs' stock settings
    changed since (`resumed_fleet_stock_refusal`). Nothing where they cannot be opened here
    (the workers' own opening tells)."""
    if not real_gpus(campaign):
        return
    from dvfs.backends import job_gpus, open_gpus

    devices = [d for g in groups for d in g]
    with contextlib.ExitStack() as stack:
        try:
            gpus = stack.enter_context(open_gpus(devices, nvml=nvml, visible=job_gpus()))
        except GpuError:
            return
        servers = servers_of(gpus, groups)
        stock = check_stock_limits(campaign, servers, state_dir=state_dir)
        if out_dir is not None and stock is not None:
            refusal = resumed_fleet_stock_refusal(campaign, servers, out_dir, stock=stock)
            if refusal is not None:
                raise refusal


def read_gpu_names(
    devices: Sequence[int | str],
    *,
    nvml: ModuleType | None = None,
    allow_mig: bool = False,
    visible: Visible | None = None,
) -> list[tuple[int, str]]:
    """Each of `devices`' NVML index and model, in order: the real GPUs opened over NVML (held
    to `visible`; MIG instances refused unless `allow_mig`), nothing set or read back, and
    closed; a `GpuError` where NVML cannot open them. How the sweep (`check_server_gpus`)
    and its dry run (`read_group_models`) read a server's GPU models, for `one_model`."""
    from dvfs.backends import open_gpus

    with open_gpus(devices, nvml=nvml, allow_mig=allow_mig, visible=visible) as gpus:
        return [(g.identity.index, g.identity.name) for g in gpus]


def read_gpu_identities(
    campaign: Campaign, *, nvml: ModuleType | None = None
) -> list[dict[str, Any]]:
    """The identities (as sessions record them) of the real GPUs a sweep of `campaign` on one
    GPU group opens, read as `read_gpu_names` reads them (nothing set, closed); none where
    NVML cannot open them (a machine planning for another: nothing to compare)."""
    from dataclasses import asdict

    from dvfs.backends import job_gpus, open_gpus
    from dvfs.errors import GpuError

    try:
        with open_gpus(campaign.gpu.devices, nvml=nvml, visible=job_gpus()) as gpus:
            return [asdict(g.identity) for g in gpus]
    except GpuError:
        return []


def check_server_gpus(
    campaign: Campaign, *, nvml: ModuleType | None = None, gpus: Sequence[Gpu] | None = None
) -> None:
    """Refuse, before the journal is made or the server started, a server on real GPUs of two
    models (`dvfs.fleet.devices.one_model`, as a fleet and `dvfs doctor` refuse it): its cells
    would not compare, and the cube was refused only once every cell was measured; and the
    twin engine on real GPUs of a model the twin has no profile of, with no `gpu.profile` to
    load them as (`dvfs.backends.free_running_profile`): set, it changes the campaign's hash,
    which a journal made first would refuse. The GPUs are opened to read their models, and
    closed; or `gpus`, those a caller of `run_sweep` opened for it (with its own engine). One
    GPU under a real engine, or the twin's (one profile), has nothing to check."""
    if not real_gpus(campaign):
        return
    from dataclasses import asdict

    from dvfs.backends import job_gpus, open_gpus
    from dvfs.fleet.devices import group_label, one_identity, one_model

    twin_load = gpus is None and simulated_engine(campaign) and not campaign.gpu.profile
    if gpus is None:
        if len(campaign.gpu.devices) < 2 and not twin_load:
            return
        with open_gpus(campaign.gpu.devices, nvml=nvml, visible=job_gpus()) as opened:
            identities = [asdict(g.identity) for g in opened]
    else:
        identities = [asdict(g.identity) for g in gpus]
    named = [(int(i["index"]), str(i["name"])) for i in identities]
    if len(named) > 1:
        worker = group_label(tuple(index for index, _ in named))
        one_model(worker, named)
        one_identity(worker, identities)
    if twin_load:
        free_running_profile(campaign, named[0][1])


def read_group_models(
    campaign: Campaign,
    groups: Sequence[Sequence[int | str]],
    *,
    nvml: ModuleType | None = None,
    fleet: bool = False,
    check: bool = False,
    journal: Path | None = None,
    fleet_dir: Path | None = None,
) -> tuple[list[str] | None, str | None]:
    """For a dry run, each server's GPU model (one of `groups`, as
    `dvfs.fleet.devices.worker_groups` cuts them), as a fleet reads them: over NVML, the GPUs
    opened read-only and closed, no setting read back or changed. A server on real GPUs of two
    models is refused as the sweep and a fleet refuse it (`one_model`, exit 2). (None, None)
    with nothing to read: the twin (its models are its profiles), or one server on one GPU
    that is no `fleet` (a fleet of one, resuming a fleet's folder on the GPUs left, resumes
    its model's journal only); (None, why) where NVML cannot open them (no NVML here: a
    machine planning for another), for the dry run to say what it could not check. The twin
    engine on real GPUs, with no `gpu.profile`, has them read too: a model the twin has no
    profile of is refused as the sweep refuses it (`free_running_profile`).

    With `check` (the dry run itself), the GPUs are always opened, as the sweep opens them
    (`check_gpus`): one that is not here, has fallen off the bus or has MIG enabled, and a
    clock or power limit of the campaign one does not take, make the note say that the sweep
    would stop on this machine, and why. A note, not a refusal: a workstation with a GPU of its
    own may be planning for another machine (`dvfs doctor` there checks that one). `journal`:
    the one the sweep resumes (one server's run, not --fresh), refused as the sweep refuses it
    where the GPUs' stock settings changed since it was started (`resumed_stock_refusal`);
    `fleet_dir`: the --out folder whose journals a fleet resumes (not --fresh), refused as the
    fleet refuses them where so (`resumed_fleet_stock_refusal`)."""
    servers = [tuple(g) for g in groups if len(g) > 1]
    # the twin engine's load on them, which a GPU the twin has no profile of is refused
    twin_load = simulated_engine(campaign) and not campaign.gpu.profile
    read = len(groups) > 1 or bool(servers) or fleet or twin_load
    if not real_gpus(campaign) or not (read or check):
        return None, None
    from dvfs.errors import GpuError
    from dvfs.fleet.devices import group_label, one_model

    devices = [d for g in groups for d in g]
    stop: str | None = None  # why the sweep would stop on this machine
    try:
        if check:
            found, stop = check_gpus(
                campaign, devices, nvml=nvml, groups=groups, journal=journal, fleet_dir=fleet_dir
            )
        else:
            found = read_gpu_names(devices, nvml=nvml, allow_mig=True)
    except GpuError as exc:
        if check and nvml_answers(nvml):  # NVML works here: these GPUs' own fault
            stop = f"on this machine the sweep would stop: {exc}"
        if not read:  # nothing else to read; a machine planning for another needs no note
            return None, stop
        unchecked = []
        if servers:
            unchecked.append("a tensor-parallel server spanning two GPU models is not checked")
        if len(groups) > 1:
            unchecked.append("a fleet mixing GPU models is counted as one model")
        elif fleet:
            unchecked.append("every GPU model's journal in the folder is counted")
        if twin_load:  # first: the others' words end the sentence ("... here")
            unchecked.insert(0, "whether the twin has a profile of their model is not checked")
        why = (
            f"the GPUs' models were not read ({exc})"
            if stop is None
            else f"{stop}; their models were not read either"
        )
        return None, (
            f"{why}, so {' and '.join(unchecked)} here: `dvfs doctor` on the GPU machine checks it"
        )
    named = iter(found)
    models = [one_model(group_label(tuple(g)), [next(named) for _ in g]) for g in groups]
    for model in models if twin_load else ():
        free_running_profile(campaign, model)
    return (models if len(groups) > 1 or servers or fleet else None), stop


def check_gpus(
    campaign: Campaign,
    devices: Sequence[int | str],
    *,
    nvml: ModuleType | None = None,
    groups: Sequence[Sequence[int | str]] | None = None,
    journal: Path | None = None,
    fleet_dir: Path | None = None,
) -> tuple[list[tuple[int, str]], str | None]:
    """Each of the campaign's real GPUs `devices`' NVML index and model, opened as the sweep
    opens them (held to CUDA_VISIBLE_DEVICES, MIG refused), nothing set, and closed; and why
    the sweep would stop on them (a clock or power limit of the campaign one does not take,
    `check_knobs_against`; with `groups`, `devices` cut into servers, a server's GPUs or a
    fleet's of one model at other stock power limits, `check_stock_limits`; a GPU another dvfs
    holds or one holding an earlier run's changes, `check_gpus_free`, or a caps record the
    sweep cannot read, `read_stock_as_swept`; an energy counter that does not read; stock
    settings changed since the `journal` it resumes was started, `resumed_stock_refusal`, or
    since those a fleet resumes in `fleet_dir` were, `resumed_fleet_stock_refusal`), None if
    nothing.
    A `GpuError` where one cannot be opened (not here, fallen off the bus) or NVML does not
    answer. A server whose GPUs differ in their ECC mode or VBIOS is a stop too
    (`one_identity`)."""
    from dataclasses import asdict

    from dvfs.backends import job_gpus, open_gpus
    from dvfs.fleet.devices import fleet_identity_refusal, group_label, one_identity

    with open_gpus(devices, nvml=nvml, visible=job_gpus()) as gpus:
        found = [(g.identity.index, g.identity.name) for g in gpus]
        try:
            from dvfs.gpu.safety import default_state_dir, records_dir

            # the GPUs' locks and state files where the sweep keeps them (one changing knobs
            # runs as root; observe-only as this user), as `dvfs doctor` reads them
            directory = records_dir() if campaign.gpu.actuation else default_state_dir()
            check_gpus_free(gpus, directory)
            check_knobs_against(campaign, gpus)
            for group, server in zip(groups or (), servers_of(gpus, groups or ()), strict=True):
                if len({g.identity.name for g in server}) == 1:  # (two models: one_model's)
                    one_identity(group_label(tuple(group)), [asdict(g.identity) for g in server])
            if groups is not None and len(groups) > 1:  # a fleet's workers, as it opens them
                mixed = fleet_identity_refusal([asdict(g.identity) for g in gpus])
                if mixed is not None:
                    raise JournalError(mixed)
            try:  # a caps record the sweep cannot read
                stock = read_stock_as_swept(campaign, gpus, directory)
            except CapsRecordError as exc:
                if not isinstance(exc.__cause__, PermissionError):  # (root's sweep reads it)
                    raise
            else:  # a GPU reporting neither a power limit nor the one enforced
                for gpu in gpus:
                    stock_limit_mw(gpu, stock[gpu.identity.uuid])
            if groups is not None and len(gpus) > 1:
                # dvfs's caps record where the sweep reads it (root's, for a user's dry run of
                # a sweep changing knobs; a user's observe-only sweep reads the user's own)
                check_stock_limits(campaign, servers_of(gpus, groups), state_dir=directory)
            for gpu in gpus:  # as the runner reads them first, timing their updates
                gpu.energy_mj()
            if journal is not None:
                refusal = resumed_stock_refusal(campaign, gpus, journal, state_dir=directory)
                if refusal is not None:
                    raise refusal
            if fleet_dir is not None and groups is not None:
                refusal = resumed_fleet_stock_refusal(
                    campaign, servers_of(gpus, groups), fleet_dir, state_dir=directory
                )
                if refusal is not None:
                    raise refusal
        except DvfsError as exc:  # (a GPU lost meanwhile too: the sweep would stop on it)
            return found, f"on this machine the sweep would stop: {exc}"
        return found, None


def nvml_answers(nvml: ModuleType | None = None) -> bool:
    """Whether NVML initialises here (a driver answers): a GPU that then fails to open fails
    for its own sake, not for the machine's."""
    from dvfs.errors import GpuError
    from dvfs.gpu.nvml import nvml_session

    try:
        with nvml_session(nvml):
            return True
    except GpuError:
        return False


def model_names(campaign: Campaign, models: Sequence[str | None]) -> list[str] | None:
    """The GPU models `workers_per_model` names (twin GPUs by their profile, real ones by the
    name NVML gives) as the GPUs name themselves in a journal's sessions; None where one is
    not known (a real GPU's model not read)."""
    if not models or not all(models):
        return None
    if campaign.gpu.backend == "twin":
        from dvfs.gpu.twin import twin_gpu_name
        from dvfs.twin.profiles import gpu_profile

        return sorted({twin_gpu_name(gpu_profile(str(m)).nvml_name) for m in models})
    return sorted({str(m) for m in models})


def gpu_identities(campaign: Campaign, models: Sequence[str | None]) -> list[dict[str, Any]]:
    """The identities (`GpuIdentity`, as sessions record them) of GPUs of `models`
    (`workers_per_model`'s), as far as known before they are opened: a twin GPU's whole, from
    its profile; a real one's name as NVML gave it; none where one is not known."""
    if not models or not all(models):
        return []
    if campaign.gpu.backend == "twin":
        from dvfs.gpu.twin import twin_gpu_name
        from dvfs.twin.identity import twin_driver_version
        from dvfs.twin.profiles import gpu_profile

        # What `dvfs.gpu.twin.TwinGpu` says it is (built there too: that file is the twin's,
        # its digest part of every twin GPU's driver version).
        return [
            {
                "name": twin_gpu_name(p.nvml_name),
                "driver_version": twin_driver_version(),
                "backend": "twin",
                "memory_clock_mhz": p.memory_clock_mhz,
                "max_sm_clock_mhz": p.max_sm_clock_mhz,
            }
            for p in (gpu_profile(str(m)) for m in models)
        ]
    return [{"name": str(m)} for m in models]


def fleet_models(
    campaign: Campaign, groups: Sequence[tuple[int | str, ...]], *, nvml: ModuleType | None = None
) -> list[str] | None:
    """The GPU models of a fleet's `groups` (`model_names`): twins' from their profiles, real
    GPUs' read over NVML as the dry run reads them (`read_group_models`, nothing changed);
    None where NVML cannot open them (the workers' own opening then tells)."""
    from dvfs.fleet.devices import workers_per_model

    models = None
    if real_gpus(campaign):
        models, _ = read_group_models(campaign, groups, nvml=nvml, fleet=True)
        if models is None:
            return None
    return model_names(campaign, list(workers_per_model(campaign, groups, models)))


def check_inflight_resume(journal: Journal, campaign: Campaign, cells: Sequence[Cell]) -> None:
    """Refuse, before measuring, to add cells (`cells` not finished, or the repeats the
    journal's records ask for: `dvfs.fleet.folders.extra_repeats`) to an in-flight journal an
    earlier dvfs carried along another drift (`Journal.check_inflight_drift`)."""
    if campaign.measurement.mode != "in-flight" or not journal.path.is_file():
        return
    from dvfs.fleet.folders import extra_repeats

    more = extra_repeats(campaign, journal.path, cells)
    journal.check_inflight_drift([c.key for c in (*cells, *more)])
