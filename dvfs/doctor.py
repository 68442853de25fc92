"""Preflight checks for a campaign: will it run here, and will its numbers be trustworthy?

Read-only: nothing here changes a GPU or starts a server.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dvfs.backends import (
    check_engine,
    check_twin_context,
    open_campaign_gpus,
    real_gpus,
    simulated_engine,
    twin_start_refusal,
)
from dvfs.campaign import Campaign
from dvfs.errors import (
    CampaignError,
    CapsRecordError,
    CorpusShortfallError,
    DvfsError,
    GpuNotSupportedError,
    GpuStateError,
    JournalError,
)
from dvfs.gpu.knobs import GpuSettings, power_limit_or_none, stock_limit_mw
from dvfs.gpu.nvml import GpuNamedTwiceError, named_twice
from dvfs.redact import redact_argv

if TYPE_CHECKING:
    from dvfs.fleet.devices import Group
    from dvfs.fleet.shard import Shard
    from dvfs.gpu.base import Gpu

OK, WARN, FAIL = "ok", "warn", "fail"
MIN_FREE_BYTES = 1 << 30


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    #: A failure that makes the campaign itself invalid, as `dvfs sweep` refuses it before any
    #: server starts (exit 2): an error whose exit code is 2 (drafters SGLang would serve
    #: differently, clocks or limits the GPUs do not support, corpora that fall short).
    invalid: bool = False


def _run(name: str, fn: Callable[[], tuple[str, str]]) -> Check:
    try:
        status, detail = fn()
    except DvfsError as exc:
        return Check(name, FAIL, str(exc), invalid=exc.exit_code == 2)
    return Check(name, status, detail)


def check_campaign(
    campaign: Campaign,
    out_dir: Path,
    *,
    nvml: ModuleType | None = None,
    state_dir: Path | None = None,
    shard: Shard | None = None,
    groups: Sequence[Group] | None = None,
    executor: str = "local",
) -> list[Check]:
    """Every check of `campaign` swept into `out_dir` (as `shard`'s sweep). `groups`: the GPU
    groups `dvfs sweep --gpus` would run it on (`dvfs.cli.common.sweep_groups`), each group's
    GPUs checked, and the fleet's ports and folder as its workers use them; None: the
    campaign's own gpu.devices. `executor` "ray": as `dvfs sweep --executor ray` runs it from
    this driver, whose Ray actors start the servers and open the real GPUs on their nodes:
    those are not checked here (`dvfs doctor` on a node checks them)."""
    from dvfs.fleet.devices import for_group, group_label, worker_groups
    from dvfs.fleet.folders import fleet_journal
    from dvfs.measure.journal import JOURNAL_NAME

    given = groups is not None
    groups = list(groups) if groups is not None else worker_groups(campaign)
    ray = executor == "ray"
    try:
        fleet = len(groups) > 1 or ray or fleet_journal(out_dir)
    except (DvfsError, OSError):  # a damaged journal: the output folder check says so
        fleet = len(groups) > 1
    # What the sweep runs: its one group's campaign (--gpus on one group), else the campaign
    # (a fleet's workers each run their group's; the folder is the campaign's).
    swept = for_group(campaign, groups[0]) if given and not fleet else campaign
    checks = [
        Check(
            "campaign",
            OK,
            f"{campaign.name}: {len(campaign.drafters)} drafter(s), "
            f"{len(campaign.workload.corpora)} corpora",
        )
    ]
    if ray:  # as the sweep imports it, before anything else
        checks.append(_run("ray", _ray))
    models: list[str] = []
    identities: list[dict[str, Any]] = []
    if ray and real_gpus(campaign):  # the driver opens none: Ray's actors, on their nodes
        checks.append(Check("gpu", OK, RAY_GPUS))
    else:
        checks += _gpu_checks(
            _on_groups(campaign, groups) if given else campaign,
            nvml=nvml,
            state_dir=state_dir,
            groups=groups,
            models=models,
            identities=identities,
            given=given,
            # the journal one server's sweep resumes, its stock compared as the sweep does
            journal=None if fleet else out_dir / JOURNAL_NAME,
            # the journals a fleet resumes there, compared as the fleet does
            fleet_dir=out_dir if fleet else None,
        )
    if _own_servers(campaign) and not ray:  # a Ray worker's server listens on its node
        checks.append(_run("ports", lambda: _ports(campaign, len(groups) if fleet else 0)))
    # an attached server compared with the journal one server's sweep resumes, as it does (a
    # fleet's, of one worker as an attached server serves one, as the fleet's driver does)
    resumed = None if fleet else out_dir / JOURNAL_NAME
    worker = group_label(groups[0]) if fleet and len(groups) == 1 and models else None
    if worker is not None:
        from dvfs.fleet.folders import model_journals

        try:
            [resumed] = model_journals(out_dir, models[:1])
        except (DvfsError, OSError):  # the output folder's check says why
            worker = None
    if ray and _own_servers(campaign):  # its sglang (or server_command) is the nodes'
        checks.append(Check("engine", OK, RAY_SERVERS))
    else:
        checks.append(_run("engine", lambda: _engine(campaign, resumed, worker, out_dir, models)))
    if not simulated_engine(campaign) and not campaign.engine.sglang.url:  # dvfs starts SGLang
        checks.append(_run("models", lambda: _model_paths(campaign, ray=ray)))
        checks.append(_run("arms", lambda: _arms(campaign)))
    if shard is not None:
        checks.append(_run("shard", lambda: _shard(campaign, shard)))
    checks.append(_run("corpora", lambda: _corpora(campaign, out_dir)))
    if not simulated_engine(campaign):
        checks.append(_run("tokenizer", lambda: _tokenizer(campaign, out_dir)))
    folder_models = models if fleet else None
    checks.append(
        _run("output folder", lambda: _out_dir(swept, out_dir, shard, folder_models, identities))
    )
    checks.append(_run("disk", lambda: _disk(out_dir)))
    return [_fresh_is_the_sweeps(c, out_dir) for c in checks]


def _ray() -> tuple[str, str]:
    """Ray on this driver, which `dvfs sweep --executor ray` refuses to run without (exit 2)."""
    from dvfs.fleet.ray_executor import ray_version

    return OK, f"Ray {ray_version()} on this driver (every node of the cluster needs it too)"


#: What `dvfs doctor --executor ray` leaves to the Ray workers' nodes, said in its checks.
RAY_GPUS = (
    "the Ray workers' nodes' GPUs (--executor ray: Ray places a worker on each), not this "
    "driver's: `dvfs doctor` on a node checks them"
)
RAY_SERVERS = (
    "the SGLang servers start on the Ray workers' nodes, from their Python (--executor ray), "
    "not on this driver: `dvfs doctor` on a node checks its sglang"
)


def _fresh_is_the_sweeps(check: Check, out_dir: Path) -> Check:
    """A failed check whose advice is the sweep's --fresh ("rerun with --fresh", "use --fresh
    to move the old journal aside"), which `dvfs doctor` does not take (its user, told so
    by the doctor, adds it to the doctor's command: "No such option"): the sweep's command
    named."""
    from dvfs.measure.journal import fresh_is_the_sweeps

    if check.status != FAIL:
        return check
    return replace(check, detail=fresh_is_the_sweeps(check.detail, out_dir))


def _on_groups(campaign: Campaign, groups: Sequence[Group]) -> Campaign:
    """The campaign on every GPU of `groups` (`--gpus`), one server per group, for the GPU
    checks."""
    import dataclasses

    from dvfs.fleet.devices import for_group

    if len(groups) == 1:
        return for_group(campaign, groups[0])
    devices = tuple(d for g in groups for d in g)
    gpu = dataclasses.replace(campaign.gpu, devices=devices, groups=tuple(groups))
    return dataclasses.replace(campaign, gpu=gpu)


def _fleet_journals(out_dir: Path) -> bool:
    """Whether `out_dir` holds a journal a fleet would resume (its own, or a GPU model's)."""
    from dvfs.measure.journal import JOURNAL_NAME

    return (out_dir / JOURNAL_NAME).is_file() or any(out_dir.glob("gpu-*/" + JOURNAL_NAME))


def _own_servers(campaign: Campaign) -> bool:
    """Whether the sweep starts SGLang servers of its own (not the twin, not attached)."""
    return not simulated_engine(campaign) and not campaign.engine.sglang.url


def _ports(campaign: Campaign, workers: int) -> tuple[str, str]:
    """A block of SGLang ports for each worker's server, as each claims one when it starts;
    `workers` 0 (no fleet): a free port for the one server (`free_port`, refused where no
    server can listen on engine.sglang.host, as each of the sweep's server starts is)."""
    from dvfs.engines.sglang import free_port
    from dvfs.fleet.ports import lock_dir, short_of_blocks

    host = campaign.engine.sglang.host
    if not workers:
        free_port(host)
        return OK, f"a free port on {host} for the server"
    problem = short_of_blocks(host, workers)
    if problem:
        return FAIL, problem
    return OK, f"a free block of ports on {host} for each of the {workers} servers ({lock_dir()})"


def _gpu_checks(
    campaign: Campaign,
    *,
    nvml: ModuleType | None,
    state_dir: Path | None,
    groups: Sequence[Group],
    models: list[str],
    identities: list[dict[str, Any]],
    given: bool = False,
    journal: Path | None = None,
    fleet_dir: Path | None = None,
) -> list[Check]:
    """The GPUs' checks (`given`: `groups` are --gpus's); `models` gets each group's GPU
    model, as a fleet's workers report it, and `identities` each GPU's identity as its
    session records it (nothing where the GPUs cannot be opened). `journal`: the one the
    sweep resumes, whose stock settings the GPUs' must still be; `fleet_dir`: the --out folder
    whose journals a fleet resumes, likewise."""
    from dvfs.fleet.devices import group_label

    if not real_gpus(campaign):
        from dvfs.fleet.devices import for_group
        from dvfs.gpu.twin import twin_gpu_name
        from dvfs.preflight import gpu_identities
        from dvfs.twin.profiles import gpu_profile

        try:  # each group's model, as its twin GPUs name it (a fleet's journal folders)
            profiles = [for_group(campaign, g).gpu.profile or "" for g in groups]
            names = [twin_gpu_name(gpu_profile(p).nvml_name) for p in profiles]
        except DvfsError as exc:
            return [Check("gpu", FAIL, str(exc), invalid=exc.exit_code == 2)]
        models.extend(names)
        identities.extend(gpu_identities(campaign, profiles))
        if len(groups) > 1:
            workers = zip(groups, names, strict=True)
            shown = f"{len(groups)} workers: " + ", ".join(
                f"{group_label(g)} ({n})" for g, n in workers
            )
        else:
            shown = f"({campaign.gpu.profile}), devices {list(campaign.gpu.devices)}"
        return [Check("gpu", OK, f"digital twin {shown}")]
    from dvfs.caps import AppliedCaps
    from dvfs.clock import MonotonicClock
    from dvfs.gpu.safety import (
        GpuLocks,
        StateStore,
        default_state_dir,
        records_dir,
        reset_command,
        root_holder,
    )
    from dvfs.preflight import check_knobs_against, servers_of

    checks: list[Check] = []
    try:
        with open_campaign_gpus(campaign, MonotonicClock(), nvml=nvml) as gpus:
            first = gpus[0].identity
            identities.extend(asdict(g.identity) for g in gpus)
            # Each model, with its count where a fleet mixes them (not the first GPU's alone).
            counts: dict[str, int] = {}
            for g in gpus:
                counts[g.identity.name] = counts.get(g.identity.name, 0) + 1
            named = ", ".join(
                name if len(counts) == 1 else f"{name} x{count}" for name, count in counts.items()
            )
            checks.append(
                Check(
                    "driver",
                    OK,
                    f"NVIDIA driver {first.driver_version}, {len(gpus)} GPU(s): {named}",
                )
            )
            for g in gpus:
                ident = g.identity
                persistence = g.persistence_mode()
                checks.append(
                    Check(
                        f"persistence GPU {ident.index}",
                        OK if persistence else WARN,
                        "on"
                        if persistence
                        else "off or unknown: a power limit is lost when the "
                        "driver unloads; enable it (nvidia-smi -pm 1 or nvidia-persistenced)",
                    )
                )
                try:
                    g.energy_mj()
                    checks.append(Check(f"energy counter GPU {ident.index}", OK, "supported"))
                except DvfsError as exc:
                    checks.append(Check(f"energy counter GPU {ident.index}", FAIL, str(exc)))

            def knobs() -> tuple[str, str]:
                # the sweep's rule (`check_knobs_against`), observe-only too: its runner reads
                # each GPU's power-limit range, which NVML may not support on a GPU
                check_knobs_against(campaign, gpus)
                if not campaign.gpu.actuation:  # observe-only: no list left to check
                    return OK, (
                        "observe-only: no clock or power limit is set; every cell is measured "
                        "at the GPU's stock setting, as found"
                    )
                return OK, "every clock and power limit of the campaign is supported"

            checks.append(_run("knobs", knobs))
            if simulated_engine(campaign):

                def twin_load() -> tuple[str, str]:
                    from dvfs.backends import free_running_profile

                    # As the sweep refuses a GPU the twin has no profile of, none named: each
                    # model's, as each worker of a fleet mixing models loads its own GPUs.
                    loads: dict[str, str] = {}
                    for g in gpus:
                        name = g.identity.name
                        if name not in loads:
                            loads[name] = free_running_profile(campaign, name).key
                    if len(set(loads.values())) == 1:
                        return OK, f"the twin engine puts {loads[first.name]}'s load on the GPUs"
                    each = ", ".join(f"{key}'s on the {name}" for name, key in loads.items())
                    return OK, f"the twin engine puts each GPU model's own load on it: {each}"

                checks.append(_run("twin load", twin_load))
            # Each group's GPUs, in the order opened: one worker (and server) each.
            by_group = servers_of(gpus, groups)
            # dvfs's records as the sweep reads them: one changing knobs runs as root, which
            # keeps them in /var/lib/dvfs, so a user's doctor reads those (as the dry run
            # does); an observe-only sweep runs as this user, in the user's own.
            directory = state_dir or (
                records_dir() if campaign.gpu.actuation else default_state_dir()
            )
            if len(groups) > 1 or len(gpus) > 1:  # a fleet, or a tensor-parallel server
                servers = _workers(groups, by_group, models)
                if servers.status == OK and len(groups) > 1:
                    from dvfs.fleet.devices import fleet_identity_refusal

                    refusal = fleet_identity_refusal([asdict(g.identity) for g in gpus])
                    if refusal is not None:
                        servers = Check("workers", FAIL, refusal)
                checks.append(servers)
                if servers.status == OK:  # (GPUs of two models: that line says so)
                    checks.append(_run("stock", lambda: _stock(campaign, by_group, directory)))
            else:
                models.append(first.name)
            if journal is not None and journal.is_file():

                def resume_stock() -> tuple[str, str]:
                    from dvfs.preflight import nothing_left, resumed_stock_refusal

                    refusal = resumed_stock_refusal(campaign, gpus, journal, state_dir=directory)
                    if refusal is not None:
                        raise refusal
                    if nothing_left(campaign, journal.parent):
                        return OK, f"{journal} holds every cell: nothing to measure at any stock"
                    return OK, f"the stock settings {journal} was started with"

                checks.append(_run("resume stock", resume_stock))
            elif fleet_dir is not None and _fleet_journals(fleet_dir):

                def fleet_stock() -> tuple[str, str]:
                    from dvfs.preflight import nothing_left, resumed_fleet_stock_refusal

                    refusal = resumed_fleet_stock_refusal(
                        campaign, by_group, fleet_dir, state_dir=directory
                    )
                    if refusal is not None:
                        raise refusal
                    run_models = sorted({g.identity.name for g in gpus})
                    if nothing_left(campaign, fleet_dir, run_models):
                        return OK, f"{fleet_dir} holds every cell: nothing to measure at any stock"
                    return OK, f"the stock settings the journals in {fleet_dir} were started with"

                checks.append(_run("resume stock", fleet_stock))
            if _own_servers(campaign):

                def server_gpus() -> tuple[str, str]:
                    from dvfs.engines.server_gpus import (
                        check_visible_devices,
                        check_wrapper_visible_devices,
                        pinned_by,
                        unjudged_remedy,
                        unjudged_wrapper_devices,
                    )

                    pinned = []
                    for group in by_group:
                        uuids = [g.identity.uuid for g in group]
                        # As the sweep refuses to start each server (every cell failing).
                        check_visible_devices(dict(campaign.engine.sglang.env), uuids)
                        check_wrapper_visible_devices(campaign, uuids)
                        pinned.append(",".join(uuids))
                    servers = "the server is" if len(pinned) == 1 else "the servers are"
                    # As the sweep's server record says it (`SglangEngine._check_pinning`).
                    metered = [g.identity.uuid for group in by_group for g in group]
                    said = unjudged_wrapper_devices(campaign, "; ".join(pinned), metered)
                    if said is not None:  # it replaces the UUIDs dvfs hands the wrapper
                        return WARN, (
                            f"{said}: the sweep stops the server only where NVML lists it or "
                            f"its memory on another GPU; {unjudged_remedy(campaign, metered)}"
                        )
                    return OK, f"{servers} pinned to {'; '.join(pinned)} ({pinned_by(campaign)})"

                checks.append(_run("server GPUs", server_gpus))
            # A file from before the last reboot refuses nothing (the reboot reset the GPU):
            # the sweep drops it.
            unreadable: Check | None = None
            try:
                pending = [
                    p
                    for g in gpus
                    for p in StateStore(directory).pending(g.identity.uuid)
                    if not p.before_this_boot
                ]
            except GpuStateError as exc:  # a state file the sweep refuses, named: not the driver's
                unreadable, pending = Check("state", FAIL, str(exc)), []
            held = GpuLocks(directory)
            holders = {g.identity.uuid: held.holder(g) or root_holder(g, directory) for g in gpus}
            # A lock file that is no regular file no running dvfs holds (`hold` refuses it):
            # the lock check's complaint about it is no running dvfs's.
            no_lock = {g.identity.uuid: held.not_a_lock(g) for g in gpus}
            # A file whose GPU a running dvfs holds is that run's (`gpu reset` skips it: the
            # run restores it itself), not a dead run's: the lock check fails that GPU.
            running = {u for u, h in holders.items() if h and not no_lock.get(u)}
            dead = [p for p in pending if p.original.uuid not in running]
            live = [p for p in pending if p.original.uuid in running]
            if unreadable is not None:
                state = unreadable
            elif dead:
                unlockable = [b for p in dead if (b := no_lock.get(p.original.uuid))]
                reset = reset_command(directory)  # with the folder read where not the default
                state = Check(
                    "state",
                    FAIL,
                    "; ".join(p.describe() for p in dead)
                    + (
                        f" - {'; '.join(unlockable)}, then run {reset}"
                        if unlockable
                        else f" - run {reset}"
                    ),
                )
            elif live:
                state = Check(
                    "state",
                    WARN,
                    "; ".join(
                        f"GPU {p.original.uuid} is being changed by the running dvfs "
                        f"{p.command!r} (pid {p.pid}), which restores it itself"
                        for p in live
                    ),
                )
            else:
                state = _state_folder_writable(directory, gpus)
            checks.append(state)
            for g in gpus:
                busy = holders[g.identity.uuid]
                checks.append(
                    Check(f"lock GPU {g.identity.index}", FAIL, busy)
                    if busy
                    else Check(f"lock GPU {g.identity.index}", OK, "no other dvfs holds it")
                )
            try:  # the caps root's `cap apply` recorded, for observe-only too (measured under)
                locks = AppliedCaps(state_dir or records_dir()).locks()
                limits = AppliedCaps(state_dir or records_dir()).power_limits_held(gpus)
            except CapsRecordError as exc:  # dvfs's own record, named: not the driver's
                checks.append(Check("caps", FAIL, str(exc)))
                locks, limits = {}, {}
            # A GPU a dvfs run changed (its state file: a dead run's, named in the state check
            # with the reset that puts it back, or a running one's) holds that run's lock
            changed = {p.original.uuid for p in pending}
            for g in gpus:
                checks.append(
                    _held_knobs(
                        g,
                        locked_by_dvfs=g.identity.uuid in locks or g.identity.uuid in changed,
                        observe_only=not campaign.gpu.actuation,
                    )
                )
                checks.append(_tenants(g, attached=campaign.engine.sglang.url))
            caps = _caps_in_force(gpus, locks, limits)
            if caps:
                checks.append(_caps_check(caps, observe_only=not campaign.gpu.actuation))
    except GpuNamedTwiceError as exc:  # as the sweep refuses it: its workers would each lock it
        option = "--gpus" if given else "gpu.devices"
        checks.append(Check("gpus", FAIL, named_twice(option, exc.twice), invalid=True))
        return checks
    except DvfsError as exc:  # exit 2: GPUs the sweep refuses too (outside CUDA_VISIBLE_DEVICES)
        checks.append(Check("driver", FAIL, str(exc), invalid=exc.exit_code == 2))
        return checks
    if campaign.gpu.actuation:
        root = os.geteuid() == 0
        checks.append(
            Check(
                "permissions",
                OK if root else FAIL,
                "running as root"
                if root
                else "changing clocks and power limits needs root: run with sudo, or use "
                '--observe-only / actuation = "off" to measure without changing',
            )
        )
    else:
        checks.append(Check("permissions", OK, "observe-only: no setter will be called"))
    return checks


def _caps_in_force(
    gpus: Sequence[Gpu], locks: dict[str, tuple[int, int]], limits: dict[str, int]
) -> list[str]:
    """Each GPU's caps dvfs applied and left in force, by its caps record, as the sweep's knob
    controller takes them (`AppliedCaps.measuring`): a clock lock, and a power limit where the
    GPU still holds the one dvfs applied (another is the operator's stock, kept)."""
    shown = []
    for g in gpus:
        uuid = g.identity.uuid
        caps = []
        if uuid in locks:
            caps.append(f"SM clock locked to {locks[uuid][0]}-{locks[uuid][1]} MHz")
        if uuid in limits and limits[uuid] == g.power_limit_mw():
            caps.append(f"power limit {limits[uuid] / 1000:g} W")
        if caps:
            shown.append(f"GPU {g.identity.index} ({', '.join(caps)})")
    return shown


def _caps_check(caps: Sequence[str], *, observe_only: bool) -> Check:
    """What the sweep does with the caps dvfs applied and left in force (`_caps_in_force`):
    it lifts them while it measures, its stock being the GPU's own (`KnobController.stock`),
    and puts them back; observe-only, it changes nothing and measures under them."""
    found = f"dvfs caps in force: {'; '.join(caps)}"
    if observe_only:
        return Check(
            "caps",
            WARN,
            f"{found}; the observe-only sweep changes nothing, so every cell is measured "
            "under them (its stock is the capped setting, not the GPU's own)",
        )
    return Check(
        "caps",
        WARN,
        f"{found}; the sweep lifts them while it measures (stock cells at unlocked clocks "
        "and the default power limit, the GPU's own stock) and puts them back when it ends",
    )


def _workers(
    groups: Sequence[Group], by_group: Sequence[Sequence[Gpu]], models: list[str]
) -> Check:
    """A fleet's workers (or one tensor-parallel server), one per group, each of one GPU
    model: the sweep refuses a group spanning two models (exit 2), a fleet's or its one
    server's, in `one_model`'s words. `models` gets each group's."""
    from dvfs.fleet.devices import group_label, one_identity, one_model

    shown = []
    for group, gpus in zip(groups, by_group, strict=True):
        try:
            model = one_model(
                group_label(group), [(g.identity.index, g.identity.name) for g in gpus]
            )
            one_identity(group_label(group), [asdict(g.identity) for g in gpus])
        except CampaignError as exc:
            return Check("workers", FAIL, str(exc), invalid=True)
        models.append(model)
        shown.append(f"{group_label(group)} ({model})")
    workers = f"{len(groups)} workers" if len(groups) > 1 else "1 worker"
    return Check("workers", OK, f"{workers}: {', '.join(shown)}")


def _stock(
    campaign: Campaign, servers: Sequence[Sequence[Gpu]], state_dir: Path
) -> tuple[str, str]:
    """The stock power limit each server's GPUs, and a fleet's of one model, start from, as
    the sweep takes it (a cap dvfs applied counts as the default): other limits fail, as the
    sweep refuses them (`check_stock_limits`), before it measures anything."""
    from dvfs.preflight import check_stock_limits

    stock = check_stock_limits(campaign, servers, state_dir=state_dir)
    if stock is None:
        return OK, (
            "stock power limits not compared: the sweep refuses these GPUs first (the state, "
            "lock or caps check says why)"
        )
    by_uuid = {g.identity.uuid: g for server in servers for g in server}
    watts = sorted({stock_limit_mw(by_uuid[u], s) / 1000 for u, s in stock.items()})
    if len(watts) == 1:
        return OK, f"the GPUs start from one stock power limit, {watts[0]:g} W"
    limits = ", ".join(f"{w:g} W" for w in watts)
    return OK, f"each GPU model's GPUs start from one stock power limit ({limits})"


def _state_folder_writable(directory: Path, gpus: Sequence[Gpu]) -> Check:
    """The state check of a folder holding no unrestored change: failed where the sweep could
    not lock its GPUs there (a read-only or full file system, an immutable folder or lock:
    `state_folder_unwritable`), in the sweep's words; doctor said "no unrestored changes",
    exit 0, and the sweep failed at once."""
    from dvfs.gpu.safety import state_folder_unwritable
    from dvfs.sweep import state_lock_problem

    locks = [directory / f"{g.identity.uuid}.lock" for g in gpus]
    unwritable = state_folder_unwritable(directory, locks)
    problem = state_lock_problem(unwritable) if unwritable is not None else None
    if problem is not None:
        return Check("state", FAIL, f"no unrestored changes, but {problem}")
    return Check("state", OK, f"no unrestored changes ({directory})")


def _held_knobs(gpu: Gpu, *, locked_by_dvfs: bool, observe_only: bool = False) -> Check:
    """Whether something outside dvfs holds a GPU's knobs: a clock lock or applications
    clocks (NVML's ApplicationsClocksSetting reason; the lock itself cannot be read back), or
    a limiter enforcing less than the configured power limit (a BMC or rack cap). An
    observe-only campaign measures the clocks as it finds them: nothing is flagged for a
    lock."""
    from dvfs.gpu.base import EVENT_APPLICATIONS_CLOCKS

    name = f"held knobs GPU {gpu.identity.index}"
    problems = []
    try:
        if not locked_by_dvfs and gpu.clock_event_reasons() & EVENT_APPLICATIONS_CLOCKS:
            problems.append(
                "reports ApplicationsClocksSetting (0x2): clocks may be locked or set outside "
                "dvfs, which NVML cannot read back; "
                + (
                    "observe-only measures the GPU as it is set, its cells not flagged "
                    "clock_held_low (unlock to observe stock: nvidia-smi -rgc)"
                    if observe_only
                    else "stock-clock cells held below the maximum clock would be flagged "
                    "clock_held_low (unlock: nvidia-smi -rgc)"
                )
            )
        configured = power_limit_or_none(gpu)
        if configured is None:  # not supported: the sweep's stock is the limit enforced
            try:
                enforced = stock_limit_mw(gpu, GpuSettings(gpu.identity.uuid, None, None))
            except GpuNotSupportedError as exc:  # as the sweep refuses it
                return Check(name, FAIL, str(exc))
            problems.append(
                f"power limit not supported by NVML (not settable): the sweep records the "
                f"{enforced / 1000:g} W it enforces as the stock power limit"
            )
            return Check(name, WARN if len(problems) > 1 else OK, "; ".join(problems))
        enforced = gpu.enforced_power_limit_mw()
    except DvfsError as exc:
        return Check(name, WARN, f"could not read: {exc}")
    if enforced < configured:
        problems.append(
            f"enforces {enforced / 1000:g} W below its configured {configured / 1000:g} W (an "
            "out-of-band limit): cells above it would be flagged power_limit_not_held"
        )
    if problems:
        return Check(name, WARN, "; ".join(problems))
    return Check(name, OK, "no clock lock or power limit held outside dvfs seen")


def _tenants(gpu: Gpu, *, attached: str | None) -> Check:
    """The compute processes on a GPU now: before a sweep starts its server, any is another
    tenant's, whose work the per-GPU energy counter would count into the cells (flagged
    foreign_process) and which competes for the GPU. With an attached server, one is its."""
    from dvfs.procfs import process_name

    name = f"other processes GPU {gpu.identity.index}"
    try:
        pids = gpu.compute_pids()
    except DvfsError as exc:
        return Check(name, WARN, f"could not list compute processes: {exc}")
    if pids is None:
        return Check(
            name,
            WARN,
            "NVML cannot list its compute processes (not supported or not permitted): cells "
            "cannot be checked for other tenants' processes (foreign_process)",
        )
    if not pids:
        return Check(name, OK, "no compute process on it")
    listed = ", ".join(f"{pid} ({process_name(pid) or '?'})" for pid in sorted(pids))
    if attached:
        return Check(
            name,
            OK,
            f"compute process(es) {listed}: the server at {attached} should be among them; any "
            "other is another tenant's and flags the cells foreign_process",
        )
    return Check(
        name,
        WARN,
        f"compute process(es) already on it: {listed}; its energy would be counted into the "
        "cells (flagged foreign_process, invalid) and it competes for the GPU: stop it or "
        "sweep on another GPU",
    )


def _engine(
    campaign: Campaign,
    journal: Path | None = None,
    worker: str | None = None,
    out_dir: Path | None = None,
    models: Sequence[str] | None = None,
) -> tuple[str, str]:
    """The engine the sweep runs: the twin, an attached server (`journal`: the one the sweep
    resumes, whose servers it must compare with, as the runner compares them; or as a fleet's
    driver does, `worker` the fleet of one's, on GPUs of `models`, into `out_dir`), a server
    command, or SGLang installed here."""
    if simulated_engine(campaign):
        # Its servers start, as SGLang's would: the weights fit the GPUs (exit 2 where not,
        # as the dry run says; the sweep's cells would fail at every server start).
        refusal = twin_start_refusal(campaign)
        if refusal is not None:
            raise CampaignError(refusal)
        return OK, f"twin engine, model {campaign.engine.simulated_model}"
    sg = campaign.engine.sglang
    if sg.url:
        from dvfs.engines.sglang import check_attached
        from dvfs.engines.sglang_args import server_keys
        from dvfs.engines.sglang_client import probe_server
        from dvfs.preflight import resumed_server_refusal

        def check(info: dict[str, Any]) -> None:
            check_attached(campaign, info)
            refusal = (
                None
                if journal is None
                else resumed_server_refusal(
                    campaign, journal, info, worker=worker, out_dir=out_dir, models=models
                )
            )
            if refusal is not None:
                raise refusal

        return probe_server(sg.url, *server_keys(campaign), check=check)
    if sg.server_command:
        from dvfs.engines.sglang_args import server_env, unstartable

        # As the sweep starts it: with the campaign's env (its PATH), executable or refused.
        problem = unstartable(sg.server_command[0], server_env(campaign))
        return (
            FAIL if problem else OK,
            f"server command {' '.join(redact_argv(sg.server_command))}"
            + (f": {problem}" if problem else ""),
        )
    from importlib import metadata

    from dvfs.engines.sglang_args import (
        SEARCH_PATH_ENV,
        not_installed,
        server_env,
        server_finds_sglang,
        sglang_importable,
    )

    problem = not_installed(campaign)  # as the sweep refuses it
    if problem is not None:
        return FAIL, problem
    try:
        return OK, f"sglang {metadata.version('sglang')}"
    except metadata.PackageNotFoundError:
        pass
    if sglang_importable():  # importable, not installed as a package
        return OK, "sglang (its version unknown: not installed as a package)"
    moved = [name for name in SEARCH_PATH_ENV if name in dict(sg.env)]
    if moved and server_finds_sglang(server_env(campaign)):
        return OK, (
            f"sglang, found where the server's Python looks (engine.sglang.env sets "
            f"{', '.join(moved)})"
        )
    return WARN, (
        "sglang is not installed in this environment: fine if engine.sglang.env's "
        "PYTHONPATH or PYTHONHOME finds it for the server, else pip install 'dvfs[sglang]'"
    )


#: How a model name that can only be a path on the server's host begins (any other name may be
#: a Hugging Face repo id, or a folder SGLang finds before it asks the hub).
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~")


def _model_paths(campaign: Campaign, *, ray: bool = False) -> tuple[str, str]:
    """The target's and each drafter's model named by a local path that is not there, which
    every server of it would fail to start on (the cells after an hour of others'): a failure
    where dvfs starts SGLang on this host, a warning where the server command may start it
    elsewhere (a container's paths, a remote host's) or `ray` (`--executor ray`: the servers
    start on the Ray workers' nodes). Relative paths read from here: the folder the sweep
    runs in, which the server it starts inherits."""
    named: list[tuple[str, str | None]] = [("engine.model", campaign.engine.model)]
    named += [(f"drafters.{d.name}.draft_model", d.draft_model) for d in campaign.drafters]
    paths = [(key, name) for key, name in named if name and name.startswith(LOCAL_PATH_PREFIXES)]
    # dvfs starts SGLang with the name as written, in an argv no shell reads: a '~' stays a
    # folder of that name to SGLang (and to transformers, reading dvfs's own tokenizer), which
    # then asks the Hugging Face hub for it as a repo id; not the home it names in a shell
    tilde = [(key, name) for key, name in paths if name.startswith("~")]
    if tilde and not campaign.engine.sglang.server_command:
        return FAIL, (
            "; ".join(f"{key} {name!r}{_in_full(name)}" for key, name in tilde)
            + ": dvfs starts SGLang with the path as written, and no shell expands its '~' "
            "(SGLang would look for a folder named '~'); write the path in full"
        )
    missing = [f"{key} {name!r}" for key, name in paths if not _path_here(name)]
    if not missing:
        return OK, (
            f"every model path is here ({len(paths)})" if paths else "named by repo id, not path"
        )
    if ray:
        return WARN, (
            f"no such path on this driver: {', '.join(missing)}; fine if the Ray workers' "
            "nodes have it (`dvfs doctor` on a node checks it), else correct the path"
        )
    if campaign.engine.sglang.server_command:
        return WARN, (
            f"no such path on this host: {', '.join(missing)}; fine if the server command "
            "starts SGLang where it is (a container, another host), else correct the path"
        )
    return FAIL, (
        f"no such path: {', '.join(missing)}: SGLang would fail to start on it; correct the "
        "path, or name the model's Hugging Face repo id"
    )


def _in_full(name: str) -> str:
    """`name` with its `~` expanded, as ", in full 'PATH'"; "" where no home is known."""
    try:
        return f", in full {str(Path(name).expanduser())!r}"
    except RuntimeError:
        return ""


def _path_here(name: str) -> bool:
    """Whether the model path `name` names something on this host; False where it cannot: a
    `~user` of no such user (a typo of `~/`), a name longer than any path may be."""
    try:
        return Path(name).expanduser().exists()
    except (RuntimeError, OSError, ValueError):
        return False


def _arms(campaign: Campaign) -> tuple[str, str]:
    """What the sweep refuses before any server starts (`check_engine`): drafters SGLang would
    serve with other kernels or scheduling than each other."""
    from dvfs.engines.sglang_args import legacy_rules, parse_version

    launch_help = check_engine(campaign)
    alike = "SGLang would give no drafter other attention kernels or scheduling than the others"
    if launch_help is None:
        return OK, f"{alike} (no drafter speculates)"
    version = campaign.engine.sglang.version
    release = "0.5.9" if legacy_rules(launch_help.text, parse_version(version)) else "0.5.23"
    source = (
        "read from launch_server --help"
        if launch_help.text
        else "from engine.sglang.version"
        if version
        else "assumed: launch_server --help could not run here and engine.sglang.version is unset"
    )
    return OK, f"{alike} (SGLang {release}'s rules, {source})"


def _shard(campaign: Campaign, shard: Shard) -> tuple[str, str]:
    """The shard's cells as the sweep plans them; more shards than the campaign has units to
    deal is refused, as the sweep refuses it (exit 2)."""
    from dvfs.fleet.queue import group_of
    from dvfs.fleet.shard import planned_cells
    from dvfs.measure.plan import too_many_to_list

    too_many = too_many_to_list(campaign, "doctor")  # counted: listed, they run out of memory
    if too_many is not None:
        return WARN, f"shard {shard.label}: not dealt here: {too_many}"
    cells = planned_cells(campaign, shard)
    groups = len({group_of(c) for c in cells})
    return OK, (
        f"shard {shard.label}: {len(cells)} of the campaign's {len(planned_cells(campaign))} "
        f"cells, {groups} whole comparison group(s)"
    )


def _corpora(campaign: Campaign, out_dir: Path) -> tuple[str, str]:
    """The corpora as the sweep into `out_dir` counts them: by its journals' method, which a
    resume keeps (the estimate, though a tokenizer was cached since), else the model's cached
    tokenizer; so the prompts that fit the input lengths are the sweep's."""
    from dvfs.corpora.prepare import (
        corpus_shortfalls,
        corpus_usage,
        counted_corpora,
        recorded_count_method,
        shortfall_line,
    )
    from dvfs.fleet.shard_journal import folder_journals
    from dvfs.measure.journal import session_records
    from dvfs.preflight import prompt_refusal

    journals = folder_journals(out_dir)
    try:
        recorded = recorded_count_method(journals)
        sessions = {j: session_records(j) for j in journals if j.is_file()}
    except JournalError:  # damaged: the output folder check says so, and how to start over
        recorded, sessions = "", {}
    corpora, method = counted_corpora(campaign, recorded)
    short = corpus_shortfalls(campaign, corpora)
    if short:  # as `dvfs sweep` refuses it: exit 2
        raise CorpusShortfallError(shortfall_line(campaign, short))
    check_twin_context(campaign, corpora)  # prompts the twin's model has no room for: exit 2
    for journal, records in sessions.items():  # a corpus edited since: refused
        refusal = prompt_refusal(journal, records, corpora, method, campaign)
        if refusal is not None:
            raise refusal
    # What the sweep samples from: the prompts skipped, trimmed or repeated said, not only
    # the file's count (a corpus of mostly short prompts measures a few of them, over again).
    lengths = campaign.workload.input_tokens
    return OK, ", ".join(f"{n} ({corpus_usage(c, lengths)})" for n, c in corpora.items())


def _tokenizer(campaign: Campaign, out_dir: Path) -> tuple[str, str]:
    """How the sweep into `out_dir` will count prompt tokens: its journals' method, which a
    resume keeps (fails where that journal's tokenizer is missing, as the sweep refuses), else
    the model's cached tokenizer; a warning where a new campaign would estimate throughout."""
    from dvfs.corpora.prepare import estimate_note, recorded_count_method
    from dvfs.corpora.tokens import token_counter
    from dvfs.fleet.shard_journal import folder_journals

    # Every journal the sweep resumes, each GPU model's in `gpu-*/` too, as it reads them.
    try:
        recorded = recorded_count_method(folder_journals(out_dir))
    except JournalError:  # damaged: the output folder check says so, and how to start over
        recorded = ""
    _, method = token_counter(campaign.engine.model, recorded)
    note = estimate_note(campaign, method, recorded)
    if note:
        return WARN, note
    kept = " (the journal's, kept on resume)" if recorded else ""
    return OK, f"prompt tokens counted by: {method}{kept}"


def _out_dir(
    campaign: Campaign,
    out_dir: Path,
    shard: Shard | None,
    models: Sequence[str] | None,
    identities: Sequence[dict[str, Any]] = (),
) -> tuple[str, str]:
    """The folder as the sweep uses it: `check_out_dir`; for a fleet (`models`: its workers'
    GPU models, as far as they were read), each model's journal as the fleet picks them, its
    sessions' GPUs compared with this run's (`identities`) as the fleet compares them."""
    from dvfs.fleet.folders import fleet_journal
    from dvfs.fleet.shard_journal import folder_journals, model_journal_paths
    from dvfs.measure.journal import JOURNAL_NAME, iter_records
    from dvfs.measure.plan import too_many_to_list
    from dvfs.out_folder import check_out_dir, check_out_usable
    from dvfs.preflight import resume_refusals

    too_many = too_many_to_list(campaign, "doctor")  # counted: listed, they run out of memory
    if too_many is not None and (models or any(j.is_file() for j in folder_journals(out_dir))):
        check_out_usable(out_dir)
        return WARN, f"{out_dir}: usable; its journals not read: {too_many}"
    check_out_dir(campaign, out_dir, shard)
    # refused as the sweep refuses it: its servers' environment changed since the journal's
    # (say CUDA_LAUNCH_BLOCKING=1); changed prompts are the corpora check's
    for refusal in resume_refusals(campaign, folder_journals(out_dir), None, ""):
        raise refusal
    if models:
        from dvfs.fleet.folders import check_same_gpus, journals_done, model_journals
        from dvfs.fleet.shard import planned_cells

        # As the fleet picks its journals: none when they hold every cell already on these
        # models, else each model's (a folder holding one model's run is refused for a fleet
        # mixing models, finished or not), refused where another model's GPUs measured it.
        cells = planned_cells(campaign, shard)
        if journals_done(out_dir, campaign, cells, set(models)) is None:
            model_journals(out_dir, set(models))
            check_same_gpus(out_dir, identities)
    elif identities and not fleet_journal(out_dir):
        from dvfs.fleet.folders import check_same_gpus

        check_same_gpus(out_dir, identities, fleet=False)  # as the sweep on one group compares
    # The folder's own state: whether its journal's prompts still compare is the corpora
    # check's (a FAIL there beside "the sweep resumes" read as a contradiction).
    journal = out_dir / JOURNAL_NAME
    if not journal.is_file():
        # a fleet mixing models journals each model in its `gpu-<model>/`: said as one run's
        held = [j for j in model_journal_paths(out_dir) if j.is_file()]
        resumed = [j.parent.name for j in held if next(iter_records(j), None) is not None]
        if resumed:
            return OK, f"{out_dir}: holds a journal per GPU model to resume ({', '.join(resumed)})"
        if held:  # no header in any: the sweep starts each afresh
            return OK, f"{out_dir}: holds empty GPU model journals, which the sweep starts afresh"
        return OK, f"{out_dir}: usable"
    if next(iter_records(journal), None) is None:  # no header: the sweep starts it afresh
        return OK, f"{out_dir}: holds an empty journal, which the sweep starts afresh"
    return OK, f"{out_dir}: holds a journal to resume"


def _disk(out_dir: Path) -> tuple[str, str]:
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():  # a file where a folder of --out should be: no disk to speak of
        return FAIL, f"{out_dir} is unusable: {probe} is a file, not a folder; choose another --out"
    free = shutil.disk_usage(probe).free
    status = OK if free >= MIN_FREE_BYTES else WARN
    return status, f"{free / 2**30:.1f} GiB free at {probe}"
