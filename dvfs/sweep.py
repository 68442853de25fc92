"""Running a campaign end to end: build the backends it names, run the cells, write the cube.

This is the one place that picks real or simulated backends; everything below receives them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from dvfs.campaign import Campaign
from dvfs.clock import Clock, MonotonicClock, VirtualClock
from dvfs.corpora import Corpus, load_corpus
from dvfs.corpora.model import TokenCounter
from dvfs.cube import CUBE_NAME, build_cube, write_cube
from dvfs.engines.base import Engine
from dvfs.errors import CampaignError, CorpusError, CubeError, JournalError
from dvfs.gpu.base import Gpu
from dvfs.gpu.knobs import KnobController
from dvfs.journal import JOURNAL_NAME, Journal, describe_os_error
from dvfs.plan import Cell, plan_cells
from dvfs.runner import Progress, Runner, RunSummary

LOCK_NAME = "sweep.lock"


class SweepBusyError(JournalError):
    """Another sweep is writing to the same output folder."""

    exit_code = 3


@dataclass
class Backends:
    clock: Clock
    gpus: list[Gpu]
    engine: Engine


def tokenizer_model(campaign: Campaign) -> str | None:
    """The Hugging Face name whose tokenizer counts prompt tokens for this campaign."""
    if campaign.engine.backend == "twin":
        from dvfs.twin.profiles import find_model_profile

        profile = find_model_profile(campaign.engine.twin_model or campaign.engine.model)
        return profile.hf_name if profile is not None and profile.hf_name else None
    return campaign.engine.model


def load_corpora(campaign: Campaign, count: TokenCounter | None = None) -> dict[str, Corpus]:
    """Every corpus the campaign names, with token counts from the target's tokenizer if it is
    available locally (else the documented estimate)."""
    if count is None:
        from dvfs.corpora.tokens import token_counter

        count, _ = token_counter(tokenizer_model(campaign))
    corpora = {}
    for ref in campaign.workload.corpora:
        spec = dict(ref.spec) if ref.spec is not None else None
        corpora[ref.name] = load_corpus(
            ref.name, spec, base_dir=campaign.base_dir, count_tokens=count
        )
    return corpora


def corpus_shortfalls(campaign: Campaign, corpora: dict[str, Corpus]) -> list[str]:
    """Corpora without enough distinct prompts for the largest batch (or closed-loop pool)."""
    from dvfs.corpora.sampling import eligible_prompts

    w = campaign.workload
    largest = max(w.batch_sizes)
    lo, hi = w.input_tokens
    problems = []
    for name, corpus in corpora.items():
        usable = len(eligible_prompts(corpus, w.input_tokens))
        if w.mode == "closed-loop":
            need = w.pool_size or largest + 1
            what = f"a closed-loop pool for batch {largest}"
        else:
            need, what = largest, f"batch {largest}"
        if usable < need:
            problems.append(
                f"corpus {name!r} has {usable} prompts within {lo}-{hi} input tokens; "
                f"{what} needs {need}"
            )
    return problems


def check_corpora(campaign: Campaign, corpora: dict[str, Corpus]) -> None:
    problems = corpus_shortfalls(campaign, corpora)
    if problems:
        raise CorpusError(
            "; ".join(problems) + ". Lower the batch sizes, widen "
            "workload.input_tokens, or add prompts"
        )


def acceptance_aliases(campaign: Campaign) -> dict[str, str]:
    """User corpora that tell the twin which built-in corpus they accept like."""
    aliases = {}
    for ref in campaign.workload.corpora:
        spec = dict(ref.spec or ())
        if "acceptance_like" in spec:
            aliases[ref.name] = str(spec["acceptance_like"])
    return aliases


@contextlib.contextmanager
def open_backends(
    campaign: Campaign,
    *,
    out_dir: Path,
    nvml: ModuleType | None = None,
) -> Iterator[Backends]:
    """The GPUs, engine and clock a campaign names, opened and closed together."""
    from dvfs.twin.profiles import gpu_profile, model_profile

    with contextlib.ExitStack() as stack:
        if campaign.gpu.backend == "twin":
            from dvfs.gpu.twin import TwinGpu
            from dvfs.twin.device import TwinDevice, TwinNode

            # Simulated GPUs live in virtual time, unless a real server sets the pace.
            virtual = campaign.engine.backend == "twin"
            clock: Clock = VirtualClock() if virtual else MonotonicClock()
            profile = gpu_profile(campaign.gpu.profile or "")
            indices = []
            for device in campaign.gpu.devices:
                if not isinstance(device, int):
                    raise CampaignError(f"the twin backend takes GPU indices, not {device!r}")
                indices.append(device)
            devices = [TwinDevice(profile, clock, i) for i in indices]
            gpus: list[Gpu] = [TwinGpu(d) for d in devices]
            node: Any = TwinNode(devices)
        else:
            from dvfs.gpu.nvml import open_nvml_gpus
            from dvfs.twin.device import FreeRunningNode

            clock = MonotonicClock()
            gpus = list(stack.enter_context(open_nvml_gpus(campaign.gpu.devices, nvml=nvml)))
            node = None
            if campaign.engine.backend == "twin":
                from dvfs.twin.profiles import profile_for_gpu_name

                profile = (
                    gpu_profile(campaign.gpu.profile)
                    if campaign.gpu.profile
                    else (profile_for_gpu_name(gpus[0].identity.name))
                )
                node = FreeRunningNode(profile, clock, len(gpus))
        if campaign.engine.backend == "twin":
            from dvfs.engines.twin import TwinEngine

            model = model_profile(campaign.engine.twin_model or campaign.engine.model)
            engine: Engine = stack.enter_context(
                TwinEngine(node, model, acceptance_like=acceptance_aliases(campaign))
            )
        else:
            from dvfs.engines.sglang import SglangEngine

            engine = stack.enter_context(
                SglangEngine.from_campaign(
                    campaign, clock=clock, log_dir=out_dir / "logs", gpus=gpus
                )
            )
        yield Backends(clock, gpus, engine)


def _check_same_gpus(journal: Journal, gpus: list[Gpu]) -> None:
    current = [g.identity.uuid for g in gpus]
    for session in journal.of_type("session"):
        before = [g["uuid"] for g in session["gpus"]]
        if before != current:
            raise JournalError(
                f"{journal.path} was started on GPU(s) {', '.join(before)}, but this run has "
                f"{', '.join(current)}; a cube holds one GPU set: use another --out directory"
            )


def fresh_start(out_dir: Path) -> Path | None:
    """Move an existing journal and cube aside (journal.jsonl -> journal.jsonl.1, ...)."""
    journal = out_dir / JOURNAL_NAME
    if not journal.exists():
        return None
    n = 1
    while (out_dir / f"{JOURNAL_NAME}.{n}").exists():
        n += 1
    target = out_dir / f"{JOURNAL_NAME}.{n}"
    try:
        shutil.move(journal, target)
        cube = out_dir / CUBE_NAME
        if cube.exists():
            shutil.move(cube, out_dir / f"{CUBE_NAME}.{n}")
    except OSError as exc:
        raise JournalError(describe_os_error(exc, "move the old journal aside")) from exc
    return target


@contextlib.contextmanager
def out_dir_lock(out_dir: Path) -> Iterator[None]:
    """Hold OUT/sweep.lock (flock) for the sweep's life, so two sweeps never write one journal.

    The kernel drops the lock when the process dies, however it dies, so there is never a stale
    lock to clear; the file keeps the holder's pid for the refusal message.
    """
    import fcntl

    lock = out_dir / LOCK_NAME
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise JournalError(describe_os_error(exc, f"use {out_dir} as the output folder")) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise SweepBusyError(
                f"{out_dir} is in use by another dvfs sweep{who}: wait for it to finish, or "
                "use another --out folder"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            raise JournalError(describe_os_error(exc, f"write {lock}")) from exc
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class SweepOutcome:
    summary: RunSummary
    journal_path: Path
    cube_path: Path | None
    moved_journal: Path | None = None


def check_knobs_against(campaign: Campaign, gpus: list[Gpu]) -> None:
    """Refuse clocks or power limits a real GPU does not support, before changing anything."""
    for gpu in gpus:
        supported = set(gpu.supported_sm_clocks_mhz())
        for clock in campaign.knobs.sm_clocks_mhz or ():
            if clock not in supported:
                nearest = sorted(supported, key=lambda c: abs(c - clock))[:2]
                raise CampaignError(
                    f"knobs.sm_clock: {clock} MHz is not supported by GPU {gpu.identity.index} "
                    f"({gpu.identity.name}); nearest supported: "
                    f"{', '.join(map(str, sorted(nearest)))} MHz"
                )
        allowed = gpu.power_limit_range()
        for limit in campaign.knobs.power_limits_w or ():
            if not allowed.min_mw <= limit * 1000 <= allowed.max_mw:
                raise CampaignError(
                    f"knobs.power_limit: {limit:g} W is outside GPU {gpu.identity.index}'s range "
                    f"{allowed.min_mw / 1000:g}-{allowed.max_mw / 1000:g} W"
                )


@contextlib.contextmanager
def guarded_knobs(
    campaign: Campaign, gpus: list[Gpu], *, state_dir: Path | None = None
) -> Iterator[KnobController]:
    """A knob controller that restores on exit; on real GPUs also a per-GPU lock and a state
    file recording the original settings, so a crash can be undone with `dvfs gpu reset`."""
    if campaign.gpu.backend != "nvml":
        with KnobController(gpus, actuation=campaign.gpu.actuation) as knobs:
            yield knobs
        return
    from dvfs.caps import AppliedCaps
    from dvfs.gpu.safety import GpuLocks, StateStore, default_state_dir

    directory = state_dir or default_state_dir()
    store = StateStore(directory, command="sweep")
    with GpuLocks(directory).hold(gpus):
        store.refuse_if_pending(gpus)
        check_knobs_against(campaign, gpus)
        controller = KnobController(
            gpus,
            actuation=campaign.gpu.actuation,
            change_log=store if campaign.gpu.actuation else None,
            prior_locks=AppliedCaps(directory).locks(),
        )
        with controller as knobs:
            yield knobs


def run_sweep(
    campaign: Campaign,
    out_dir: Path,
    *,
    fresh: bool = False,
    progress: Progress | None = None,
    backends: Backends | None = None,
    nvml: ModuleType | None = None,
    state_dir: Path | None = None,
) -> SweepOutcome:
    """Run every unfinished cell of `campaign` into `out_dir` (failed cells are retried), then
    write the cube. `fresh` moves an earlier journal aside first. Refuses an output folder
    another sweep is using."""
    with out_dir_lock(out_dir):
        moved = fresh_start(out_dir) if fresh else None
        if moved and progress is not None:
            progress.note(f"moved the previous journal to {moved}")
        outcome = _run_locked(
            campaign, out_dir, progress=progress, backends=backends, nvml=nvml, state_dir=state_dir
        )
    return SweepOutcome(outcome.summary, outcome.journal_path, outcome.cube_path, moved)


def _run_locked(
    campaign: Campaign,
    out_dir: Path,
    *,
    progress: Progress | None,
    backends: Backends | None,
    nvml: ModuleType | None,
    state_dir: Path | None,
) -> SweepOutcome:
    from dvfs.corpora.tokens import token_counter

    journal = Journal.open(out_dir / JOURNAL_NAME, campaign)
    count, count_method = token_counter(tokenizer_model(campaign))
    corpora = load_corpora(campaign, count)
    check_corpora(campaign, corpora)  # before any GPU is touched or server started
    cells: list[Cell] = plan_cells(campaign)
    with contextlib.ExitStack() as stack:
        b = backends or stack.enter_context(open_backends(campaign, out_dir=out_dir, nvml=nvml))
        _check_same_gpus(journal, b.gpus)
        knobs = stack.enter_context(guarded_knobs(campaign, b.gpus, state_dir=state_dir))
        runner = Runner(
            campaign,
            gpus=b.gpus,
            engine=b.engine,
            clock=b.clock,
            journal=journal,
            knobs=knobs,
            corpora=corpora,
            progress=progress,
            token_count_method=count_method,
        )
        summary = runner.run(cells)
    try:
        cube_path = write_cube(build_cube(journal.path), out_dir / CUBE_NAME)
    except CubeError as exc:
        raise CubeError(
            f"{exc} (every measured cell is in {journal.path}: `dvfs cube build {out_dir}` "
            "writes the cube once that is fixed)"
        ) from exc
    return SweepOutcome(summary, journal.path, cube_path)
