"""Running a campaign end to end: open its backends, run the cells, write the cube.

The backends come from `dvfs.backends` (the one place that picks real or simulated ones),
the corpora from `dvfs.corpora.prepare`, the cells and their measurement from `dvfs.measure`,
the read-only checks from `dvfs.preflight` and the output folder's lock from
`dvfs.out_folder`; this module only puts them in order. `dvfs.dry_run` says what a sweep would
do without running it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dvfs.backends import (
    Backends,
    check_engine,
    check_twin_context,
    open_backends,
    real_gpus,
)
from dvfs.campaign import Campaign
from dvfs.corpora.prepare import (
    check_corpora,
    counted_corpora,
    estimate_note,
    recorded_count_method,
)
from dvfs.cube import CUBE_NAME, write_cube
from dvfs.errors import (
    CubeError,
    DvfsError,
    EngineError,
    GpuError,
    GpuNotFoundError,
    GpuPermissionError,
    GpuUnavailableError,
    IncomparableCellsError,
    NoJournalError,
    OutputRefusedError,
)
from dvfs.fleet.shard import Shard, planned_cells
from dvfs.fleet.shard_journal import claim_shard, shard_cube
from dvfs.gpu.base import Gpu
from dvfs.gpu.knobs import KnobController
from dvfs.heap import pad_heap, release_free_memory
from dvfs.measure.journal import (
    JOURNAL_NAME,
    Journal,
    SyncPolicy,
    check_journal,
    renamed_note,
)
from dvfs.measure.plan import Cell
from dvfs.measure.runner import Progress, Runner, RunSummary, journaled_repeats
from dvfs.out_folder import fresh_start, out_dir_lock
from dvfs.preflight import (
    check_inflight_resume,
    check_knobs_against,
    check_same_gpus,
    check_same_prompts,
    check_same_server_env,
    check_server_gpus,
)

if TYPE_CHECKING:
    import xarray as xr

    from dvfs.gpu.safety import GpuLocks


@dataclass(frozen=True)
class SweepOutcome:
    """What a sweep did; `cube` is the cube it wrote to `cube_path`, in memory (its report
    reads it there rather than reading the file back)."""

    summary: RunSummary
    journal_path: Path
    cube_path: Path | None
    moved_journal: Path | None = None
    cube: xr.Dataset | None = None


class SweepRestoreError(GpuError):
    """The sweep ran its cells, but a GPU's settings could not be put back when it ended
    (`error`, whose exit code it keeps). `outcome`: the sweep's, its cube written all the same,
    for its report; None where the cube could not be written (`cube_error` says why)."""

    def __init__(
        self, error: GpuError, outcome: SweepOutcome | None, cube_error: str | None = None
    ) -> None:
        cube = (
            f"its cube ({outcome.cube_path}), written all the same"
            if outcome is not None
            else f"no cube was written ({cube_error})"
        )
        super().__init__(f"{error} The sweep's cells are in its journal; {cube}.")
        self.exit_code = error.exit_code
        self.error = error
        self.outcome = outcome


def state_lock_problem(exc: OSError) -> str | None:
    """The sweep's line for a GPU's lock it cannot make or write in dvfs's state folder (a
    read-only or full file system, an immutable folder), with what to do there, or None
    (then the error as it is). It was "cannot write PATH: read-only file system; choose
    another path", a path the sweep takes no option for; not "another state folder" either:
    every dvfs holds its GPUs by the locks there. Read-only said once (it was "read-only file
    system; its file system is mounted read-only"). `dvfs doctor` says it too."""
    import errno

    from dvfs.caps.actuation import state_file_problem

    problem = state_file_problem(exc)
    if problem is None:
        return None
    if exc.errno == errno.EROFS:
        problem = f"cannot write {exc.filename}: its file system is mounted read-only"
        problem += ": make it writable"
    return f"{problem}, then run the sweep again"


def _take_locks(stack: contextlib.ExitStack[Any], locks: GpuLocks, gpus: list[Gpu]) -> None:
    """`locks.hold(gpus)` entered on `stack`; a GPU's lock that cannot be made or written in
    dvfs's state folder said as `state_lock_problem` says it."""
    from dvfs.errors import GpuError

    try:
        stack.enter_context(locks.hold(gpus))
    except OSError as exc:
        problem = state_lock_problem(exc)
        if problem is None:
            raise
        raise GpuError(problem) from exc


@contextlib.contextmanager
def guarded_knobs(
    campaign: Campaign, gpus: list[Gpu], *, state_dir: Path | None = None
) -> Iterator[KnobController]:
    """A knob controller that restores on exit; on real GPUs also a per-GPU lock and a state
    file recording the original settings, so a crash can be undone with `dvfs gpu reset`."""
    if not real_gpus(campaign):
        with KnobController(gpus, actuation=campaign.gpu.actuation) as knobs:
            yield knobs
        return
    from dvfs.caps import AppliedCaps
    from dvfs.gpu.safety import GpuLocks, StateStore, default_state_dir, refuse_root_held

    directory = state_dir or default_state_dir()
    store = StateStore(directory, command="sweep")
    with contextlib.ExitStack() as held:
        _take_locks(held, GpuLocks(directory), gpus)
        # A user's sweep (observe-only) keeps its locks in its own folder: one that root's
        # dvfs holds in /var/lib/dvfs is refused too, as the sweep refuses it as root.
        refuse_root_held(gpus, directory)
        store.refuse_if_pending(gpus)
        check_knobs_against(campaign, gpus)
        controller = AppliedCaps(directory).measuring(
            gpus,
            actuation=campaign.gpu.actuation,
            change_log=store if campaign.gpu.actuation else None,
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
    shard: Shard | None = None,
    only: Collection[str] | None = None,
    count_method: str = "",
) -> SweepOutcome:
    """Run every unfinished cell of `campaign` (or of its `shard`) into `out_dir` (failed cells
    are retried), then write the cube. `fresh` moves an earlier journal aside first. Refuses an
    output folder another sweep is using, or one holding another shard. `only`: keys of the
    cells to run (planned ones and extra repeats), and no repeat added: the cells another
    folder holds, which the dry run sweeps first so that the sweep after them resumes as that
    folder's would (`twin_estimate`). `count_method`: how to count prompt tokens where the
    folder's journal recorded no method (a dry run's estimate counts as the journal it
    estimates for)."""
    pad_heap()
    try:
        with out_dir_lock(out_dir, progress, fresh=fresh) as folder:
            moved = fresh_start(out_dir, folder.moves) if fresh else None
            if moved and progress is not None:
                progress.note(f"moved the previous journal to {moved}")
            summary, journal_path, unrestored = _measure(
                campaign,
                out_dir,
                progress=progress,
                backends=backends,
                nvml=nvml,
                state_dir=state_dir,
                shard=shard,
                only=only,
                count_method=count_method,
                fresh=fresh,
            )
            if unrestored is not None:
                # Every cell is journaled: the cube is written as after a restored sweep (a
                # rerun after `dvfs gpu reset` found nothing to measure and wrote it so), then
                # the restore's failure is the sweep's error.
                try:
                    outcome = _with_cube(summary, journal_path, out_dir)
                except DvfsError as cube_exc:
                    raise SweepRestoreError(unrestored, None, str(cube_exc)) from unrestored
                raise SweepRestoreError(
                    unrestored, dataclasses.replace(outcome, moved_journal=moved)
                ) from unrestored
            outcome = _with_cube(summary, journal_path, out_dir)
    except GpuPermissionError as exc:
        if not campaign.gpu.actuation or "--observe-only" in str(exc):
            raise
        raise GpuPermissionError(
            f"{exc}. To measure without changing any GPU setting (no root needed), rerun with "
            "--observe-only"
        ) from exc
    return dataclasses.replace(outcome, moved_journal=moved)


@dataclass(frozen=True)
class Interruption:
    """What an interrupted sweep left: a partial cube (or why not), and the GPUs whose
    settings this process did not restore (their state files are in `state_dir`)."""

    cube_path: Path | None
    cube_error: str | None
    unrestored: tuple[str, ...]
    state_dir: Path | None
    #: Whether the folder's journals hold every cell of the run (a finished folder stopped
    #: while its rerun checked it, or while the cube was written): the cube is whole.
    whole: bool = False
    #: The GPU models' journals left out of the partial cube (a fleet mixing models, one of
    #: which measured nothing yet: its server still starting), as `dvfs cube build` says them.
    left_out: tuple[Path, ...] = ()


def after_interruption(
    campaign: Campaign, out_dir: Path, shard: Shard | None = None
) -> Interruption:
    """Write the partial cube of an interrupted sweep (a fleet mixing GPU models: each model's
    and the merged one, as a finished fleet writes them) and find what it left unrestored.
    `shard`: the run's, whose cells the folder holds when it is whole."""
    from dvfs.fleet.cubes import cube_journals, unmeasured_journals, write_cubes
    from dvfs.fleet.folders import journals_done
    from dvfs.fleet.shard_journal import has_sessions
    from dvfs.outputs import pipes_not_waited_on

    cube_path = cube_error = None
    whole = False
    journals = cube_journals(out_dir)
    if journals and not any(has_sessions(j) for j in journals):
        # Stopped before its first session (the GPU's checks, a server's start): no cell to
        # put in a cube, and nothing for `dvfs cube build` to fix.
        cube_error = "no cell measured yet"
    elif journals:
        try:
            # the user asked to stop: a pipe where the cube goes is not waited on for its reader
            with pipes_not_waited_on():
                cube_path = write_cubes(out_dir, journals)
        except Exception as exc:  # the interruption matters more than the partial cube
            cube_error = str(exc)
        with contextlib.suppress(Exception):  # not known: the cube is said to be partial
            whole = journals_done(out_dir, campaign, planned_cells(campaign, shard)) is not None
    left, state_dir = unrestored_gpus(campaign)
    left_out = tuple(unmeasured_journals(out_dir)) if cube_path is not None else ()
    return Interruption(cube_path, cube_error, left, state_dir, whole, left_out)


def unrestored_gpus(campaign: Campaign) -> tuple[tuple[str, ...], Path | None]:
    """The GPUs (UUIDs) this process changed and did not put back, whose state files are still
    in the state directory (returned with them): after an interruption, or a fleet worker that
    lost its GPU before it could restore it. Nothing on the twin."""
    if not real_gpus(campaign):
        return (), None
    from dvfs.gpu.safety import StateStore

    store = StateStore()
    return tuple(store.left_by_this_process()), store.directory


def _cells_kept(journal_path: Path, out_dir: Path) -> str:
    """What a sweep whose cube could not be written says of its cells, which are not lost."""
    return (
        f"(every measured cell is in {journal_path}: `dvfs cube build {out_dir}` writes the "
        "cube once that is fixed)"
    )


def _with_cube(summary: RunSummary, journal_path: Path, out_dir: Path) -> SweepOutcome:
    """The sweep's outcome once its cube is written, built after `_measure` returned: what the
    measurement held (its plan, the twin's rounds) is garbage by then, and handed back to the
    OS it does not add to the cube's memory at the sweep's peak."""
    release_free_memory()
    try:
        cube = shard_cube(journal_path)
        cube_path = write_cube(cube, out_dir / CUBE_NAME)
    except IncomparableCellsError:
        raise  # nothing to fix in the folder: the message says where to rerun
    except NoJournalError:
        raise  # no journal to hold the cells: the message says what is there
    except CubeError as exc:
        raise CubeError(f"{exc} {_cells_kept(journal_path, out_dir)}") from exc
    except OutputRefusedError as exc:  # a pipe no program reads from where cube.nc goes
        raise OutputRefusedError(f"{exc} {_cells_kept(journal_path, out_dir)}") from exc
    return SweepOutcome(summary, journal_path, cube_path, cube=cube)


def _measure(
    campaign: Campaign,
    out_dir: Path,
    *,
    progress: Progress | None,
    backends: Backends | None,
    nvml: ModuleType | None,
    state_dir: Path | None,
    shard: Shard | None,
    only: Collection[str] | None = None,
    count_method: str = "",
    fresh: bool = False,
) -> tuple[RunSummary, Path, GpuError | None]:
    """Run the cells into the folder's journal; its summary, the journal's path, and the error
    of a restore of the GPUs' settings that failed once every cell had run (None when none
    did). A GPU lost while the cells ran ends it in `gpu_lost_error`'s line (`fresh`: the run
    had --fresh, which its command again would start over with)."""
    # What the campaign alone decides is refused before the journal is made (a refused run
    # leaves none, so the corrected campaign may run into the same folder), and before any
    # GPU is touched or server started: more shards than comparison groups, another
    # campaign's journal (read, not written), corpora that fall short, drafters the engine
    # would serve differently (`check_engine`).
    cells: list[Cell] = planned_cells(campaign, shard)
    if only is not None:  # those cells alone, the extra repeats among them after the planned
        keys = set(only)
        extra = journaled_repeats(campaign.measurement, cells, keys)
        cells = [c for c in cells if c.key in keys] + extra
    check_journal(out_dir / JOURNAL_NAME, campaign)
    recorded = recorded_count_method([out_dir / JOURNAL_NAME]) or count_method
    corpora, count_method = counted_corpora(campaign, recorded)
    check_corpora(campaign, corpora)
    check_twin_context(campaign, corpora)
    # Whoever opened the backends (the CLI here, a Python caller its own): the engine's
    # check of the campaign, then the GPUs, only read: one server's of two models.
    if backends is None:  # the server dvfs starts by default: sglang installed here
        from dvfs.engines.sglang_args import not_installed

        uninstalled = not_installed(campaign)
        if uninstalled is not None:
            raise EngineError(uninstalled)
    launch_help = check_engine(campaign)
    check_server_gpus(campaign, nvml=nvml, gpus=None if backends is None else backends.gpus)
    note = estimate_note(campaign, count_method, recorded)
    if note and progress is not None:
        progress.note(note)
    # Closing syncs the journal's last group, however the sweep ends (a signal raises), after
    # the knobs are restored and the backends closed.
    with Journal.open(out_dir / JOURNAL_NAME, campaign) as journal:
        renamed = renamed_note(journal.header, campaign)
        if renamed is not None and progress is not None:
            progress.note(renamed)
        claim_shard(journal, shard)
        check_same_server_env(journal, campaign)
        summary: RunSummary | None = None
        measuring: list[Gpu] = []  # the GPUs, once the knobs are in hand and cells may run
        try:
            with contextlib.ExitStack() as stack:
                b = backends or stack.enter_context(
                    open_backends(campaign, out_dir=out_dir, nvml=nvml, launch_help=launch_help)
                )
                journal.sync_policy = SyncPolicy.for_clock(b.clock.virtual)
                check_same_gpus(journal, b.gpus)
                check_same_prompts(journal, corpora, count_method, campaign)
                check_inflight_resume(journal, campaign, cells)
                knobs = stack.enter_context(guarded_knobs(campaign, b.gpus, state_dir=state_dir))
                measuring = list(b.gpus)
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
                summary = runner.run(cells, adaptive=only is None)
        except GpuError as exc:
            # Raised as the GPUs' settings were put back, after every cell had run: the
            # cells are journaled, the caller writes the cube and then fails on it.
            if summary is None:
                interruption = interruption_of(exc)
                if interruption is not None:
                    # A signal ended the sweep and the restore it unwound to failed: the
                    # sweep was interrupted (its exit code), the restore's error said beside.
                    interruption.restore_error = exc  # type: ignore[attr-defined]
                    raise interruption from None
                lost = gpu_lost_error(
                    exc, measuring, _cells_left(campaign, cells, journal), state_dir, fresh
                )
                if lost is not None:
                    raise lost from exc
                raise
            return summary, journal.path, exc
    assert summary is not None  # the stack raises what it does not return from
    return summary, journal.path, None


def _cells_left(campaign: Campaign, cells: Sequence[Cell], journal: Journal) -> int:
    """How many of `cells` the journal does not hold finished (as a rerun counts them)."""
    from dvfs.measure.inflight import whole_groups_done

    done = whole_groups_done(campaign.measurement.mode, cells, journal.finished())
    return sum(1 for c in cells if c.key not in done)


def gpu_lost_error(
    exc: GpuError,
    gpus: Sequence[Gpu],
    left: int,
    state_dir: Path | None,
    fresh: bool,
) -> GpuError | None:
    """The sweep's line for a GPU of `gpus` (the sweep's, once its cells could run; none
    before) lost while it measured (fallen off the bus: a `GpuUnavailableError`), `exc` being
    that loss or the failed restore it ended in (whose context it is): which GPU, the cells
    `left`, the `dvfs gpu reset` that puts back the settings this process left in its state
    files once the GPU answers again, and the command again (less --fresh) to resume, as a
    fleet that lost every worker says it; exit 1. None for any other error (a restore that
    needs root keeps its own line and code)."""
    from dvfs.gpu.safety import StateStore, default_state_dir, reset_command
    from dvfs.measure.journal import resume_advice

    seen: BaseException | None = exc
    while seen is not None and not (
        isinstance(seen, GpuUnavailableError) and not isinstance(seen, GpuNotFoundError)
    ):
        seen = seen.__context__
    if not gpus or seen is None or exc.exit_code != 1:
        return None
    loss = str(seen).rstrip(".")
    named = [g for g in gpus if loss.startswith(f"GPU {g.identity.index}:")]
    which = (
        f"GPU {named[0].identity.index} ({named[0].identity.uuid})"
        if len(named) == 1
        else "a GPU of the sweep"
    )
    directory = state_dir or default_state_dir()
    pid = os.getpid()
    kept = [p.original.uuid for p in StateStore(directory).pending() if p.pid == pid]
    if kept:
        if [g.identity.uuid for g in named] == kept:
            whose, once = "its settings", "once it answers again"
        elif len(kept) == 1:
            whose, once = f"{kept[0]}'s settings", "once it answers again"
        else:  # several GPUs' settings left: named each, and said of them all
            listed = f"{', '.join(kept[:-1])} and {kept[-1]}"
            whose, once = f"the settings of {listed}", "once the GPUs answer again"
        then = (
            f"{whose} could not be restored: {once}, run "
            f"{reset_command(directory)}, then {resume_advice(fresh)}"
        )
    else:
        then = f"once it answers again, {resume_advice(fresh)}"
    return GpuError(
        f"{which} was lost with {left} cell(s) left ({loss}): the journal keeps every "
        f"finished cell; {then}"
    )


def interruption_of(exc: GpuError) -> BaseException | None:
    """The interruption a restore's error `exc` hid: the signal's exception the restore ran
    as it unwound from (its context), or the one for a signal the restore held
    (`dvfs.signals.held_signal`); None where no signal came."""
    import signal

    from dvfs.signals import Interrupted, held_signal

    seen: BaseException | None = exc.__context__
    while seen is not None:
        if isinstance(seen, (KeyboardInterrupt, Interrupted)):
            return seen
        seen = seen.__context__
    signum = held_signal(exc)
    if signum is None:
        return None
    return KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)


def observe_only_note(campaign: Campaign) -> str | None:
    """What `observe_only` leaves out of `campaign` (its clock and power-limit lists), in a
    line for the sweep and its dry run to say; None where its knobs are stock already."""
    k = campaign.knobs
    lists = [
        f"{len(values)} {name}{'s' if len(values) > 1 else ''} ({values_text})"
        for values, name, values_text in (
            (k.sm_clocks_mhz, "SM clock", _span(k.sm_clocks_mhz, "MHz")),
            (k.power_limits_w, "power limit", _span(k.power_limits_w, "W")),
        )
        if values
    ]
    if not lists:
        return None
    return (
        f"--observe-only does not step the campaign's {' and '.join(lists)}: every cell is "
        "measured at the GPU's stock setting, as found (the knob dimensions hold that one "
        "setting)"
    )


def _span(values: tuple[float, ...] | None, unit: str) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    return f"{lo:g} {unit}" if lo == hi else f"{lo:g}-{hi:g} {unit}"


def observe_only(campaign: Campaign) -> Campaign:
    """The campaign with knobs at stock and actuation off (`dvfs sweep --observe-only`)."""
    knobs = dataclasses.replace(campaign.knobs, sm_clocks_mhz=None, power_limits_w=None)
    gpu = dataclasses.replace(campaign.gpu, actuation=False)
    return dataclasses.replace(campaign, knobs=knobs, gpu=gpu)
