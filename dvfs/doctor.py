"""Preflight checks for a campaign: will it run here, and will its numbers be trustworthy?

Read-only: nothing here changes a GPU or starts a server.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from dvfs.backends import check_engine, open_campaign_gpus, real_gpus, simulated_engine
from dvfs.campaign import Campaign
from dvfs.errors import CorpusShortfallError, DvfsError
from dvfs.redact import redact_argv

if TYPE_CHECKING:
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
) -> list[Check]:
    checks = [_run("campaign", lambda: _campaign(campaign, shard))]
    checks += _gpu_checks(campaign, nvml=nvml, state_dir=state_dir)
    checks.append(_run("engine", lambda: _engine(campaign)))
    if not simulated_engine(campaign) and not campaign.engine.sglang.url:
        checks.append(_run("arms", lambda: _arms(campaign)))
    checks.append(_run("corpora", lambda: _corpora(campaign)))
    if not simulated_engine(campaign):
        checks.append(_run("tokenizer", lambda: _tokenizer(campaign, out_dir)))
    checks.append(_run("output folder", lambda: _out_dir(campaign, out_dir, shard)))
    checks.append(_run("disk", lambda: _disk(out_dir)))
    return checks


def _campaign(campaign: Campaign, shard: Shard | None) -> tuple[str, str]:
    from dvfs.fleet.shard import planned_cells

    if shard is not None:  # more shards than the campaign has groups: the sweep refuses it
        planned_cells(campaign, shard)
    return OK, (
        f"{campaign.name}: {len(campaign.drafters)} drafter(s), "
        f"{len(campaign.workload.corpora)} corpora"
    )


def _gpu_checks(
    campaign: Campaign, *, nvml: ModuleType | None, state_dir: Path | None
) -> list[Check]:
    if not real_gpus(campaign):
        return [
            Check(
                "gpu",
                OK,
                f"digital twin ({campaign.gpu.profile}), devices {list(campaign.gpu.devices)}",
            )
        ]
    from dvfs.caps import AppliedCaps
    from dvfs.clock import MonotonicClock
    from dvfs.gpu.safety import GpuLocks, StateStore, default_state_dir
    from dvfs.sweep import check_knobs_against

    checks: list[Check] = []
    try:
        with open_campaign_gpus(campaign, MonotonicClock(), nvml=nvml) as gpus:
            first = gpus[0].identity
            checks.append(
                Check(
                    "driver",
                    OK,
                    f"NVIDIA driver {first.driver_version}, {len(gpus)} GPU(s): {first.name}",
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
                check_knobs_against(campaign, gpus)
                return OK, "every clock and power limit of the campaign is supported"

            checks.append(_run("knobs", knobs))
            if not simulated_engine(campaign) and not campaign.engine.sglang.url:

                def server_gpus() -> tuple[str, str]:
                    from dvfs.engines.sglang_args import check_visible_devices

                    uuids = [g.identity.uuid for g in gpus]
                    # As the sweep refuses to start each server (every cell failing).
                    check_visible_devices(dict(campaign.engine.sglang.env), uuids)
                    return OK, f"the server is pinned to {','.join(uuids)} (CUDA_VISIBLE_DEVICES)"

                checks.append(_run("server GPUs", server_gpus))
            directory = state_dir or default_state_dir()
            pending = [p for g in gpus for p in StateStore(directory).pending(g.identity.uuid)]
            checks.append(
                Check(
                    "state",
                    FAIL if pending else OK,
                    "; ".join(p.describe() for p in pending) + " - run `dvfs gpu reset`"
                    if pending
                    else f"no unrestored changes ({directory})",
                )
            )
            held = GpuLocks(directory)
            for g in gpus:
                busy = held.holder(g)
                checks.append(
                    Check(f"lock GPU {g.identity.index}", FAIL, busy)
                    if busy
                    else Check(f"lock GPU {g.identity.index}", OK, "no other dvfs holds it")
                )
            locks = AppliedCaps(directory).locks()
            for g in gpus:
                checks.append(
                    _held_knobs(
                        g,
                        locked_by_dvfs=g.identity.uuid in locks,
                        observe_only=not campaign.gpu.actuation,
                    )
                )
                checks.append(_tenants(g, attached=campaign.engine.sglang.url))
            capped = [g.identity.index for g in gpus if g.identity.uuid in locks]
            if capped:
                checks.append(
                    Check(
                        "caps",
                        WARN,
                        f"GPU(s) {capped} carry dvfs caps; the sweep "
                        "restores them afterwards, but 'stock' then "
                        "means the capped setting",
                    )
                )
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
        configured, enforced = gpu.power_limit_mw(), gpu.enforced_power_limit_mw()
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
    from dvfs.measure.tenants import process_name

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


def _engine(campaign: Campaign) -> tuple[str, str]:
    if simulated_engine(campaign):
        return OK, f"twin engine, model {campaign.engine.twin_model or campaign.engine.model}"
    sg = campaign.engine.sglang
    if sg.url:
        from dvfs.engines.sglang import check_attached
        from dvfs.engines.sglang_args import server_keys
        from dvfs.engines.sglang_client import probe_server

        return probe_server(
            sg.url, *server_keys(campaign), check=lambda info: check_attached(campaign, info)
        )
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

    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return FAIL, "sglang is not installed in this environment: pip install 'dvfs[sglang]'"
    return OK, f"sglang {version}"


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


def _corpora(campaign: Campaign) -> tuple[str, str]:
    from dvfs.corpora.prepare import corpus_shortfalls, load_corpora

    corpora = load_corpora(campaign)
    short = corpus_shortfalls(campaign, corpora)
    if short:
        raise CorpusShortfallError("; ".join(short))  # as `dvfs sweep` refuses it: exit 2
    return OK, ", ".join(f"{n} ({len(c.prompts)} prompts)" for n, c in corpora.items())


def _tokenizer(campaign: Campaign, out_dir: Path) -> tuple[str, str]:
    """How the sweep into `out_dir` will count prompt tokens: its journal's method, which a
    resume keeps (fails where that journal's tokenizer is missing, as the sweep refuses), else
    the model's cached tokenizer; a warning where a new campaign would estimate throughout."""
    from dvfs.corpora.prepare import estimate_note, recorded_count_method
    from dvfs.corpora.tokens import token_counter
    from dvfs.measure.journal import JOURNAL_NAME

    recorded = recorded_count_method([out_dir / JOURNAL_NAME])
    _, method = token_counter(campaign.engine.model, recorded)
    note = estimate_note(campaign, method, recorded)
    if note:
        return WARN, note
    kept = " (the journal's, kept on resume)" if recorded else ""
    return OK, f"prompt tokens counted by: {method}{kept}"


def _out_dir(campaign: Campaign, out_dir: Path, shard: Shard | None) -> tuple[str, str]:
    from dvfs.measure.journal import JOURNAL_NAME
    from dvfs.sweep import check_out_dir

    check_out_dir(campaign, out_dir, shard)
    resumes = (out_dir / JOURNAL_NAME).is_file()
    return OK, f"{out_dir}: " + ("the sweep resumes its journal" if resumes else "usable")


def _disk(out_dir: Path) -> tuple[str, str]:
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():  # a file where a folder of --out should be: no disk to speak of
        return FAIL, f"{out_dir} is unusable: {probe} is a file, not a folder; choose another --out"
    free = shutil.disk_usage(probe).free
    status = OK if free >= MIN_FREE_BYTES else WARN
    return status, f"{free / 2**30:.1f} GiB free at {probe}"
