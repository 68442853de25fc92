"""Running a campaign end to end: open its backends, run the cells, write the cube.

The backends come from `dvfs.backends` (the one place that picks real or simulated ones),
the corpora from `dvfs.corpora.prepare`, the cells and their measurement from `dvfs.measure`;
this module only puts them in order. `plan_dry_run` says what a sweep would do without
touching a GPU, and estimates its GPU time by sweeping the campaign's twin stand-in (the same
campaign on the twin of its GPU and model) into a temporary folder: exact for a twin campaign,
and beside it what the naive protocol would spend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dvfs.backends import (
    Backends,
    ServerPlan,
    check_engine,
    check_twin_context,
    free_running_profile,
    open_backends,
    real_gpus,
    server_plans,
    simulated_engine,
    tokenizer_model,
    twin_context_overruns,
    twin_start_refusal,
)
from dvfs.campaign import Campaign
from dvfs.corpora.model import Corpus
from dvfs.corpora.prepare import (
    check_corpora,
    corpus_shortfalls,
    counted_corpora,
    estimate_note,
    recorded_count_method,
    shortfall_line,
)
from dvfs.cube import CUBE_NAME, write_cube
from dvfs.errors import (
    CampaignError,
    CapsRecordError,
    CorpusError,
    CubeError,
    DvfsError,
    GpuError,
    GpuPermissionError,
    GpuStateError,
    IncomparableCellsError,
    JournalError,
)
from dvfs.estimate import RunCosts
from dvfs.fleet.queue import group_of
from dvfs.fleet.shard import Shard, ShardDealError, check_deal, planned_cells
from dvfs.fleet.shard_journal import (
    OtherShardError,
    check_shard,
    folder_journals,
    other_shard,
    recorded_shard,
    shard_cube,
)
from dvfs.gpu.base import Gpu, unsupported_clock
from dvfs.gpu.knobs import GpuSettings, KnobController, check_one_stock_limit
from dvfs.measure.journal import (
    JOURNAL_NAME,
    Journal,
    SyncPolicy,
    check_journal,
    describe_os_error,
)
from dvfs.measure.plan import Cell
from dvfs.measure.runner import Progress, Runner, RunSummary, journaled_repeats

if TYPE_CHECKING:
    import xarray as xr

    from dvfs.gpu.visible import Visible

LOCK_NAME = "sweep.lock"


class SweepBusyError(JournalError):
    """Another sweep is writing to the same output folder."""

    exit_code = 3


def _check_same_gpus(journal: Journal, gpus: list[Gpu]) -> None:
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


def fresh_start(out_dir: Path, done: list[tuple[Path, Path]] | None = None) -> Path | None:
    """Move the journals a rerun would resume aside, each with its cube (`fresh_moves`), each
    move added to `done` once made (`OutFolder.moves`: undone if the sweep is refused).
    Returns the first journal's new path, None when there was none."""
    moves = fresh_moves(out_dir)
    try:
        for path, target in moves:
            shutil.move(path, target)
            if done is not None:
                done.append((path, target))
    except OSError as exc:
        raise JournalError(describe_os_error(exc, "move the old journal aside")) from exc
    return moves[0][1] if moves else None


def fresh_moves(out_dir: Path) -> list[tuple[Path, Path]]:
    """What --fresh renames, and to what (journal.jsonl -> journal.jsonl.1, ...), the first a
    journal: the journals a rerun would resume, the folder's own and each GPU model's
    (`gpu-<model>/`, where a fleet mixing models journals; then the merged cube beside them
    too), each with its cube, so that --fresh starts over wherever the sweep would refuse to
    resume. Found without moving anything, so that a dry run can say it."""
    journals = [j for j in folder_journals(out_dir) if j.exists()]
    moves = [m for j in journals for m in _aside(j, j.parent / CUBE_NAME)]
    if journals and journals[0].parent != out_dir and (out_dir / CUBE_NAME).exists():
        moves += _aside(out_dir / CUBE_NAME)
    return moves


def _aside(first: Path, *others: Path) -> list[tuple[Path, Path]]:
    """`first` and those of `others` that exist, each to `NAME.n`, one n free for all."""
    paths = (first, *others)
    n = 1
    while any(p.with_name(f"{p.name}.{n}").exists() for p in paths):
        n += 1
    return [(p, p.with_name(f"{p.name}.{n}")) for p in paths if p is first or p.exists()]


@dataclass
class OutFolder:
    """The output folder a sweep holds (`out_dir_lock`), and the journals and cubes --fresh
    moved aside in it (`fresh_start`), each (from, to)."""

    path: Path
    moves: list[tuple[Path, Path]] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def out_dir_lock(out_dir: Path, progress: Progress | None = None) -> Iterator[OutFolder]:
    """Hold OUT/sweep.lock (flock) for the sweep's life, so two sweeps never write one journal.

    The kernel drops the lock when the process dies, however it dies, so there is never a stale
    lock to clear; the file keeps the holder's pid for the refusal message. A sweep that fails
    (not one interrupted) before it measured anything leaves the folder as it found it
    (`_leave_as_found`, --fresh's moves undone, said to `progress`): a corrected rerun, a
    `dvfs cube merge` of shard folders, find nothing of it there.
    """
    import fcntl

    from dvfs.outputs import check_links

    lock = out_dir / LOCK_NAME
    check_links(lock)  # as root, never truncated through another user's link to a root file
    made_folders = _missing_folders(out_dir)
    journals = _journal_files(out_dir)
    model_folders = set(out_dir.glob("gpu-*"))
    while True:
        made_lock = True
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:  # (or a link to none: made where it points, as before)
                made_lock = False
                fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            _remove_folders(made_folders)
            raise JournalError(
                describe_os_error(exc, f"use {out_dir} as the output folder")
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                raise _busy(out_dir, fd) from None
            finally:
                os.close(fd)
        # A sweep that removed the lock file it made (`_leave_as_found`) held it meanwhile: the
        # file opened before then is not the folder's lock any more, so take the one there now.
        try:
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    folder = OutFolder(out_dir)
    try:
        _check_lock_file(lock, fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            raise JournalError(describe_os_error(exc, f"write {lock}")) from exc
        yield folder
    except Exception:
        made = lock if made_lock else None
        undone = _leave_as_found(out_dir, journals, model_folders, made, made_folders, folder.moves)
        if undone and progress is not None:
            back = folder.moves[0][0]
            progress.note(f"nothing measured: moved the previous journal back to {back}")
        raise
    finally:
        os.close(fd)


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and the folders above it that do not exist yet, deepest first."""
    missing = []
    while not os.path.lexists(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_folders(folders: Sequence[Path]) -> None:
    """Remove those of `folders` (deepest first) that are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone): it, and those above it, stay
            return


def _journal_files(out_dir: Path) -> dict[Path, tuple[int, int]]:
    """The folder's journals, its own and each GPU model's, by file (device and inode)."""
    found = {}
    for path in (out_dir / JOURNAL_NAME, *out_dir.glob("gpu-*/" + JOURNAL_NAME)):
        with contextlib.suppress(OSError):
            st = path.stat()
            found[path] = (st.st_dev, st.st_ino)
    return found


def _leave_as_found(
    out_dir: Path,
    journals: dict[Path, tuple[int, int]],
    model_folders: set[Path],
    lock: Path | None,
    made_folders: Sequence[Path],
    moves: Sequence[tuple[Path, Path]] = (),
) -> bool:
    """After a sweep into `out_dir` failed: remove each journal it began that holds no cell
    (its header, shard record, session and server starts only: refused between the journal's
    making and the first cell, by a GPU another dvfs holds, clocks the GPU does not support,
    no root to change them...), which bound the folder to the campaign as it was then and
    would refuse the corrected one (--observe-only, as the refusal for want of root advises);
    and, when it left no journal of its own, the `lock` file it made (None: it found one) and
    the folders it made (one holding a server's log stays), and --fresh's `moves` undone (a
    rerun without --fresh resumes them). `journals` and `model_folders`: those in `out_dir`
    before it began. Returns whether it undid any move."""
    from dvfs.measure.journal import iter_records

    kept = False
    for path, file in _journal_files(out_dir).items():
        if journals.get(path) == file:
            continue  # the folder's before (a resume): what it holds stays
        try:
            measured = any(r.get("type") == "cell" for r in iter_records(path))
        except Exception:  # unreadable: kept, as found, for the next run to say so
            measured = True
        if measured:
            kept = True
            continue
        try:
            path.unlink()
        except OSError:
            kept = True
    for folder in sorted(set(out_dir.glob("gpu-*")) - model_folders):
        with contextlib.suppress(OSError):
            folder.rmdir()
    if kept:
        return False
    undone = False
    for path, target in reversed(moves):
        if os.path.lexists(target) and not os.path.lexists(path):
            with contextlib.suppress(OSError):
                path.parent.mkdir(exist_ok=True)
                shutil.move(target, path)
                undone = True
    if lock is not None:
        with contextlib.suppress(OSError):
            lock.unlink()
    _remove_folders(made_folders)
    return undone


def _check_lock_file(lock: Path, fd: int) -> None:
    """Refuse (`JournalError`) an opened sweep.lock that is no regular file: a FIFO or a device
    (a link to /dev/null) takes the flock, but not the holder's pid ("invalid argument")."""
    import stat

    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise JournalError(
            f"{lock} is no regular file (a FIFO, a device), so no sweep lock of dvfs's: move it "
            "aside, or use another --out folder"
        )


def _busy(out_dir: Path, fd: int) -> SweepBusyError:
    holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    who = f" (pid {holder})" if holder.isdigit() else ""
    return SweepBusyError(
        f"{out_dir} is in use by another dvfs sweep{who}: wait for it to finish, or "
        "use another --out folder"
    )


def check_out_dir(campaign: Campaign, out_dir: Path, shard: Shard | None = None) -> None:
    """What `run_sweep` (without --fresh) of `shard` (None: the whole campaign) would refuse
    about `out_dir`, found without creating or writing anything (`dvfs doctor`): a file in the
    way of the folder or its lock, no permission to create them, another sweep holding the
    folder, a journal (the folder's own or a GPU model's in `gpu-*/`) of another campaign or of
    other settings, or holding another shard or the whole campaign (`check_shard`), or in-flight
    cells carried along another drift with cells left (`Journal.check_inflight_drift`)."""
    import errno
    import fcntl

    probe = out_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    code = 0
    if not probe.is_dir():  # the folder itself a file, or a file above it
        code = errno.EEXIST if probe == out_dir else errno.ENOTDIR
    elif os.statvfs(probe).f_flag & os.ST_RDONLY:  # root passes os.access even there
        code = errno.EROFS
    elif not os.access(probe, os.W_OK | os.X_OK):
        code = errno.EACCES
    if code:
        problem = OSError(code, os.strerror(code), str(probe))
        raise JournalError(describe_os_error(problem, f"use {out_dir} as the output folder"))
    from dvfs.outputs import check_links

    lock = out_dir / LOCK_NAME
    # as root, the lock and the journals the sweep would write through another user's link
    for path in (lock, out_dir / JOURNAL_NAME, *folder_journals(out_dir)):
        check_links(path)
    if lock.exists():
        try:
            # As the sweep opens it, less O_CREAT: a folder (EISDIR) or a lock the sweep may
            # not write is refused here too, in the sweep's words.
            fd = os.open(lock, os.O_RDWR)
        except OSError as exc:
            raise JournalError(
                describe_os_error(exc, f"use {out_dir} as the output folder")
            ) from exc
        try:
            _check_lock_file(lock, fd)
            # A shared lock, dropped at once: refused while a sweep holds its exclusive one.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(out_dir, fd) from None
        finally:
            os.close(fd)
    for journal in folder_journals(out_dir):  # each GPU model's too, as the sweep opens them
        check_journal(journal, campaign)
        check_shard(journal, shard)
        if journal.is_file():
            from dvfs.measure.journal import iter_records

            cells = planned_cells(campaign, shard)
            check_inflight_resume(Journal(journal, iter_records(journal)), campaign, cells)


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


def check_knobs_against(campaign: Campaign, gpus: list[Gpu]) -> None:
    """Refuse clocks or power limits a real GPU does not support, before changing anything."""
    for gpu in gpus:
        ident = gpu.identity
        supported = set(gpu.supported_sm_clocks_mhz())
        of = f" of GPU {ident.index} ({ident.name})"
        for clock in campaign.knobs.sm_clocks_mhz or ():
            problem = unsupported_clock(clock, supported, of=of)
            if problem:
                raise CampaignError(f"knobs.sm_clock: {problem}")
        allowed = gpu.power_limit_range()
        for limit in campaign.knobs.power_limits_w or ():
            problem = allowed.outside(limit * 1000)
            if problem:
                raise CampaignError(f"knobs.power_limit: GPU {ident.index}: {problem}")


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
    with GpuLocks(directory).hold(gpus):
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
    return stock


def resumed_stock_refusal(
    campaign: Campaign, gpus: Sequence[Gpu], journal: Path, *, state_dir: Path | None = None
) -> JournalError | None:
    """Why the sweep over `gpus` would refuse to resume `journal` (where there is one): its
    sessions recorded other stock settings than the GPUs' now (`stock_change_refusal`, the
    runner's own rule), each GPU's stock read as the sweep takes it (`stock_as_swept`,
    read-only). None where nothing changed, or where the sweep refuses the GPUs first."""
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
    return stock_change_refusal(sessions, session_stock(gpus, stock))


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
) -> None:
    """Before a fleet's workers open their GPUs (and each times its counters and measures its
    idle power before its session is compared with the others'): its real GPUs opened
    read-only here and refused as `check_stock_limits` refuses them. Nothing where they
    cannot be opened here (the workers' own opening tells)."""
    if not real_gpus(campaign):
        return
    from dvfs.backends import job_gpus, open_gpus

    devices = [d for g in groups for d in g]
    with contextlib.ExitStack() as stack:
        try:
            gpus = stack.enter_context(open_gpus(devices, nvml=nvml, visible=job_gpus()))
        except GpuError:
            return
        check_stock_limits(campaign, servers_of(gpus, groups), state_dir=state_dir)


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
        with out_dir_lock(out_dir, progress) as folder:
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


def after_interruption(
    campaign: Campaign, out_dir: Path, shard: Shard | None = None
) -> Interruption:
    """Write the partial cube of an interrupted sweep (a fleet mixing GPU models: each model's
    and the merged one, as a finished fleet writes them) and find what it left unrestored.
    `shard`: the run's, whose cells the folder holds when it is whole."""
    from dvfs.fleet.cubes import cube_journals, write_cubes
    from dvfs.fleet.folders import journals_done
    from dvfs.fleet.shard_journal import has_sessions

    cube_path = cube_error = None
    whole = False
    journals = cube_journals(out_dir)
    if journals and not any(has_sessions(j) for j in journals):
        # Stopped before its first session (the GPU's checks, a server's start): no cell to
        # put in a cube, and nothing for `dvfs cube build` to fix.
        cube_error = "no cell measured yet"
    elif journals:
        try:
            cube_path = write_cubes(out_dir, journals)
        except Exception as exc:  # the interruption matters more than the partial cube
            cube_error = str(exc)
        with contextlib.suppress(Exception):  # not known: the cube is said to be partial
            whole = journals_done(out_dir, campaign, planned_cells(campaign, shard)) is not None
    left, state_dir = unrestored_gpus(campaign)
    return Interruption(cube_path, cube_error, left, state_dir, whole)


def unrestored_gpus(campaign: Campaign) -> tuple[tuple[str, ...], Path | None]:
    """The GPUs (UUIDs) this process changed and did not put back, whose state files are still
    in the state directory (returned with them): after an interruption, or a fleet worker that
    lost its GPU before it could restore it. Nothing on the twin."""
    if not real_gpus(campaign):
        return (), None
    from dvfs.gpu.safety import StateStore

    store = StateStore()
    left = tuple(p.original.uuid for p in store.pending() if p.pid == os.getpid())
    return left, store.directory


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
    except CubeError as exc:
        raise CubeError(
            f"{exc} (every measured cell is in {journal_path}: `dvfs cube build {out_dir}` "
            "writes the cube once that is fixed)"
        ) from exc
    return SweepOutcome(summary, journal_path, cube_path, cube=cube)


#: glibc's mallopt parameter for the C heap's top padding (malloc.h's M_TOP_PAD).
_M_TOP_PAD = -2
#: Bytes the C heap grows by beyond what it needs, and keeps when it shrinks (`pad_heap`).
HEAP_TOP_PAD = 8 << 20


def pad_heap() -> None:
    """Let the C heap grow, and shrink, HEAP_TOP_PAD at a time (glibc's M_TOP_PAD; elsewhere
    nothing). Each round on the twin makes and drops many arrays on the heap (below glibc's
    mmap threshold): at its default padding (128 kB) the heap's top went back to the OS as
    they were freed and was taken again by the next round, every page faulted in anew: 190k
    minor page faults on the demo sweep, 0.6 s of system CPU, against 43k and 0.25 s padded.
    At most HEAP_TOP_PAD more stays resident; `release_free_memory` still hands every free
    page back before the cube."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS)
        return
    mallopt(_M_TOP_PAD, HEAP_TOP_PAD)


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`; elsewhere
    nothing). A sweep on the twin makes and drops millions of small arrays, and glibc kept
    the freed pages: tens of MB on a large campaign, which the cube was then built on top of."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return
    trim(0)


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
) -> tuple[RunSummary, Path, GpuError | None]:
    """Run the cells into the folder's journal; its summary, the journal's path, and the error
    of a restore of the GPUs' settings that failed once every cell had run (None when none
    did)."""
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
    launch_help = check_engine(campaign)
    check_server_gpus(campaign, nvml=nvml, gpus=None if backends is None else backends.gpus)
    note = estimate_note(campaign, count_method, recorded)
    if note and progress is not None:
        progress.note(note)
    # Closing syncs the journal's last group, however the sweep ends (a signal raises), after
    # the knobs are restored and the backends closed.
    with Journal.open(out_dir / JOURNAL_NAME, campaign) as journal:
        claim_shard(journal, shard)
        check_same_server_env(journal, campaign)
        summary: RunSummary | None = None
        try:
            with contextlib.ExitStack() as stack:
                b = backends or stack.enter_context(
                    open_backends(campaign, out_dir=out_dir, nvml=nvml, launch_help=launch_help)
                )
                journal.sync_policy = SyncPolicy.for_clock(b.clock.virtual)
                _check_same_gpus(journal, b.gpus)
                check_same_prompts(journal, corpora, count_method, campaign)
                check_inflight_resume(journal, campaign, cells)
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
                raise
            return summary, journal.path, exc
    assert summary is not None  # the stack raises what it does not return from
    return summary, journal.path, None


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
    from dvfs.backends import job_gpus
    from dvfs.fleet.devices import group_label, one_model

    twin_load = gpus is None and simulated_engine(campaign) and not campaign.gpu.profile
    if gpus is None:
        if len(campaign.gpu.devices) < 2 and not twin_load:
            return
        named = read_gpu_names(campaign.gpu.devices, nvml=nvml, visible=job_gpus())
    else:
        named = [(g.identity.index, g.identity.name) for g in gpus]
    if len(named) > 1:
        one_model(group_label(tuple(index for index, _ in named)), named)
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
    where the GPUs' stock settings changed since it was started (`resumed_stock_refusal`)."""
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
            found, stop = check_gpus(campaign, devices, nvml=nvml, groups=groups, journal=journal)
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
) -> tuple[list[tuple[int, str]], str | None]:
    """Each of the campaign's real GPUs `devices`' NVML index and model, opened as the sweep
    opens them (held to CUDA_VISIBLE_DEVICES, MIG refused), nothing set, and closed; and why
    the sweep would stop on them (a clock or power limit of the campaign one does not take,
    `check_knobs_against`; with `groups`, `devices` cut into servers, a server's GPUs or a
    fleet's of one model at other stock power limits, `check_stock_limits`; a GPU another dvfs
    holds or one holding an earlier run's changes, `check_gpus_free`, or a caps record the
    sweep cannot read, `read_stock_as_swept`; an energy counter that does not read; stock
    settings changed since the `journal` it resumes was started, `resumed_stock_refusal`), None if
    nothing.
    A `GpuError` where one cannot be opened (not here, fallen off the bus) or NVML does not
    answer."""
    from dvfs.backends import job_gpus, open_gpus

    with open_gpus(devices, nvml=nvml, visible=job_gpus()) as gpus:
        found = [(g.identity.index, g.identity.name) for g in gpus]
        try:
            from dvfs.gpu.safety import default_state_dir, records_dir

            # the GPUs' locks and state files where the sweep keeps them (one changing knobs
            # runs as root; observe-only as this user), as `dvfs doctor` reads them
            directory = records_dir() if campaign.gpu.actuation else default_state_dir()
            check_gpus_free(gpus, directory)
            check_knobs_against(campaign, gpus)
            try:  # a caps record the sweep cannot read
                read_stock_as_swept(campaign, gpus, directory)
            except CapsRecordError as exc:
                if not isinstance(exc.__cause__, PermissionError):  # (root's sweep reads it)
                    raise
            if groups is not None and len(gpus) > 1:
                # dvfs's caps record as the sweep (as root) reads it, for a user too
                check_stock_limits(campaign, servers_of(gpus, groups), state_dir=records_dir())
            for gpu in gpus:  # as the runner reads them first, timing their updates
                gpu.energy_mj()
            if journal is not None:
                refusal = resumed_stock_refusal(campaign, gpus, journal, state_dir=records_dir())
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


def claim_shard(journal: Journal, shard: Shard | None) -> None:
    """Mark a new journal as `shard`'s; refuse one that holds another shard (or the whole
    campaign), or a shard dealt by an earlier dvfs (`check_deal`), so two shares never mix in
    one folder."""
    recorded = recorded_shard(journal.path, shard)
    if shard is not None:
        check_deal(journal.path.parent, recorded)
    if recorded == shard:
        return
    if recorded is None and not journal.sessions and not journal.finished():
        if shard is not None:
            journal.append(shard.to_json())
        return
    raise OtherShardError(other_shard(journal.path.parent, recorded, shard))


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


@dataclass(frozen=True)
class DryRunPlan:
    """What a sweep would do, found without touching a GPU or starting a server."""

    campaign: str
    hash: str
    gpu_backend: str
    gpu_profile: str | None
    gpu_devices: tuple[int | str, ...]
    actuation: bool
    grid: dict[str, Any]
    cells: int
    #: The planned cells the journal(s) in the output folder already hold, which a rerun
    #: skips: summed over the GPU models of a fleet mixing them (each model's journal, as
    #: `done_per_model` says); 0 with --fresh; None when the sweep would refuse that folder
    #: before measuring anything (another shard's, dealt otherwise, or another campaign's or
    #: other settings': `problems` says which), so nothing there counts as done or to run.
    already_done: int | None
    #: The server starts and knob changes of the cells still to run (with the extra repeats
    #: the journal asks for now: `extra_to_run`), on the GPU model with the most left (each
    #: model runs them on its own workers).
    server_starts: int
    knob_changes: int
    #: The comparison groups (batch, corpus, repeat) among the planned cells: a fleet runs
    #: each whole on one worker, a shard holds whole ones.
    comparison_groups: int
    #: The closed-form duration of the cells still to run (all of them when the folder is
    #: refused; with `extra_to_run`; on the GPU model with the most left;
    #: `dvfs.measure.plan`): rough (it assumes rounds and leaves out prefill, drain and
    #: baselines), shown only when the twin gives no estimate.
    estimated_s: float
    servers: tuple[ServerPlan, ...]
    problems: tuple[str, ...]
    shard: str | None = None
    #: GPU time on the twin stand-in of the campaign's GPU and model, found by sweeping its
    #: planned cells (all of them, or the shard's) still to run (those the journal of the GPU
    #: model with the most left does not hold) into a temporary folder; None when not
    #: estimated (--no-estimate, corpus problems, or nothing left to run).
    estimate: TwinEstimate | None = None
    #: Where the sweep journals per GPU model (`gpu-<model>/`: a fleet mixing models, or a
    #: folder one began), each model's folder and the planned cells its journal holds; the
    #: cells run once per model. Empty when it journals in the folder itself.
    done_per_model: dict[str, int] = dataclasses.field(default_factory=dict)
    #: With --fresh, what it would move aside and to what (`fresh_moves`); None without.
    fresh_moves: tuple[tuple[Path, Path], ...] | None = None
    #: The exit code of a dry run with these `problems`, the sweep's for them: 0 without; 2
    #: when one makes the run invalid input (a corpus shortfall, another shard's folder); else
    #: 1 (a folder whose journal is another campaign's or of other settings).
    exit_code: int = 0
    #: measurement.max_repeats: above the planned repeats, the sweep adds the next repeat of
    #: each group whose interval across repeats misses the precision, up to this many.
    max_repeats: int = 1
    #: Those extra repeats the journal(s) already hold (done, beside `already_done`'s planned
    #: cells), and the next ones the journal(s) ask for now: the sweep runs them after the
    #: planned cells left (counted in `server_starts`, `knob_changes` and `estimated_s`), and
    #: more may follow up to `max_repeats`. 0 without adaptive repeats; None when refused.
    extra_done: int | None = 0
    extra_to_run: int | None = 0
    #: measurement.precision: the relative half-width the repeats' interval must reach.
    precision: float = 0.0
    #: The cells still to run (those of `server_starts`), in measuring order: what a fleet
    #: deals out to its workers now.
    cells_left: tuple[Cell, ...] = ()
    #: One GPU's sweep of `cells_left` split as a fleet's workers spend it (`dvfs.estimate`):
    #: the twin's (`estimate.costs`), else the closed form's.
    costs: RunCosts = RunCosts({})
    #: The folder (`gpu-<model>`) of the GPU model with the most left, whose cells left the
    #: figures are of; None where the sweep journals in the folder itself.
    most_left_folder: str | None = None
    #: Each GPU model's folder (as `done_per_model`) and how many cells it has left to run,
    #: the extra repeats its journal asks for now included: a model with none left runs
    #: nothing, its workers idle.
    left_per_model: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def comparison_groups_left(self) -> int:
        return len({group_of(c) for c in self.cells_left})

    @property
    def runs(self) -> int:
        """How many times the planned cells are measured: once per GPU model journalled
        apart, else once."""
        return max(1, len(self.done_per_model))

    @property
    def remaining(self) -> int | None:
        if self.already_done is None:
            return None
        return self.cells * self.runs - self.already_done

    @property
    def out_refused(self) -> bool:
        """Whether the sweep would refuse the output folder before measuring anything."""
        return self.already_done is None

    @property
    def twin_gpu_s(self) -> float | None:
        return self.estimate.dvfs_gpu_s if self.estimate else None

    def as_dict(self) -> dict[str, Any]:
        """The document `dvfs sweep --dry-run --json` prints."""
        e = self.estimate
        hours = (e.dvfs_gpu_s if e else self.estimated_s) / 3600
        return {
            "campaign": self.campaign,
            "hash": self.hash,
            "gpu": {
                "backend": self.gpu_backend,
                "profile": self.gpu_profile,
                "devices": list(self.gpu_devices),
                "actuation": "on" if self.actuation else "off (observe-only)",
            },
            "grid": dict(self.grid),
            "cells": self.cells,
            "already_done": self.already_done,
            "remaining": self.remaining,
            "out_refused": self.out_refused,
            **(
                {
                    "adaptive_repeats": {
                        "max_repeats": self.max_repeats,
                        "precision": self.precision,
                        "extra_done": self.extra_done,
                        "extra_to_run_now": self.extra_to_run,
                    }
                }
                if self.max_repeats > self.grid["repeat"]
                else {}
            ),
            **({"done_per_model": dict(self.done_per_model)} if self.done_per_model else {}),
            **(
                {"fresh_moves_aside": [{"path": str(a), "to": str(b)} for a, b in self.fresh_moves]}
                if self.fresh_moves is not None
                else {}
            ),
            "server_starts": self.server_starts,
            "knob_changes": self.knob_changes,
            "comparison_groups": self.comparison_groups,
            "comparison_groups_left": self.comparison_groups_left,
            "estimated_hours_on_hardware": round(hours, 2),
            "estimate": _estimate_dict(e, self.estimated_s),
            "servers": [s.as_dict() for s in self.servers],
            "problems": list(self.problems),
            **({"shard": self.shard} if self.shard else {}),
            **({"twin_gpu_s": round(e.dvfs_gpu_s, 3)} if e is not None else {}),
        }


def _estimate_dict(e: TwinEstimate | None, closed_form_s: float) -> dict[str, Any]:
    if e is None:
        return {"from": "closed form", "gpu_hours": round(closed_form_s / 3600, 2)}
    return {
        "from": "twin",
        "profile": e.profile,
        "profile_from": e.source,
        "cells_measured": e.cells,
        "cells_already_done": e.skipped,
        "gpu_hours": round(e.dvfs_gpu_s / 3600, 3),
        "window_share": round(e.window_s / e.dvfs_gpu_s, 4) if e.dvfs_gpu_s else None,
        "naive_gpu_hours": round(e.naive_gpu_s / 3600, 3),
        "naive_protocol": (
            f"per cell {NAIVE_REPEATS} times: a server start (none when attached), "
            f"knobs.settle_s, warm-up, prefill and one {NAIVE_WINDOW_S:g} s window"
        ),
        "dvfs_over_naive": round(e.dvfs_gpu_s / e.naive_gpu_s, 4) if e.naive_gpu_s else None,
    }


def finished_cells(campaign: Campaign, journal: Path) -> set[str]:
    """Keys of the cells a rerun would skip: those measured ok in `journal`, when it is one of
    this campaign (one that is not, the sweep refuses: `folder_refusals` says so)."""
    from dvfs.measure.journal import iter_records, journal_differences

    if not journal.is_file():
        return set()
    opened = Journal(journal, iter_records(journal))  # every line read, and checked, first
    try:
        header = opened.header
    except JournalError:  # empty, or no header: nothing a rerun would skip
        return set()
    return set() if journal_differences(header, campaign) else opened.finished()


def resumed_journals(
    campaign: Campaign,
    out_dir: Path,
    models: Sequence[str | None],
    cells: Sequence[Cell],
    *,
    fresh: bool = False,
    fleet: bool = False,
) -> list[Path]:
    """The journal each GPU model of a sweep of `cells` into `out_dir` resumes, as the fleet
    picks them: all the folder's journals when they hold every cell (nothing to run, as
    `journals_done` finds), else `dvfs.fleet.folders.model_journals` of `models` as
    `workers_per_model` names them, twin GPUs by their profile, real ones by the name NVML
    gives (`read_group_models`). Where a real GPU's model was not read, a folder a fleet mixing
    models began resumes, as far as this can tell, into each of its `gpu-*/` journals (on the
    GPUs that began it). A folder of a run on other GPUs (another model, finished or not) is
    refused in the fleet's line, or (no `fleet`) the sweep's (`check_same_gpus`). `fresh`: as
    --fresh leaves the folder."""
    from dvfs.fleet.folders import check_same_gpus, journals_done, model_journals

    # Twin GPUs by their profile's name, real ones' as the dry run read them over NVML.
    names = model_names(campaign, models)
    if not fleet and not fresh and (out_dir / JOURNAL_NAME).is_file():
        # One GPU group: its GPUs compared with the journal's sessions, finished or not, as the
        # sweep compares them before it measures (real ones read here: the dry run left them).
        gpus = read_gpu_identities(campaign) if real_gpus(campaign) else None
        check_same_gpus(
            out_dir, gpu_identities(campaign, models) if gpus is None else gpus, fleet=False
        )
    # A folder holding every cell, on these models (a model it never measured is not done).
    done = None if fresh else journals_done(out_dir, campaign, cells, names)
    if done is not None:
        return list(done)
    if names is not None:
        journals = model_journals(out_dir, names, fresh=fresh)
        if fleet and not fresh:
            check_same_gpus(out_dir, gpu_identities(campaign, models))
        return journals
    begun = sorted(out_dir.glob("gpu-*/" + JOURNAL_NAME))
    return begun if begun and not fresh else [out_dir / JOURNAL_NAME]


def plan_dry_run(
    campaign: Campaign,
    out_dir: Path,
    *,
    shard: Shard | None = None,
    estimate: bool = True,
    twin: str | None = None,
    progress: Progress | None = None,
    models: Sequence[str | None] | None = None,
    fresh: bool = False,
    fleet: bool = False,
) -> DryRunPlan:
    """What `run_sweep` (or, `fleet`, a fleet whose workers' GPU models are `models`, default
    the campaign's devices) would do into `out_dir`: cells, those each model's journal already
    holds, server starts, knob changes, each drafter's server, the corpus problems that would
    stop it, and (with `estimate`) the GPU time of the cells (all of them, or the shard's)
    still to run on the campaign's twin stand-in, under dvfs's protocol and the naive one
    (`twin_estimate`; not when there are problems, nor when nothing is left to run). With
    `fresh`, the sweep that first moves the folder's journals aside (`fresh_moves`; nothing is
    moved here). A hardware campaign whose GPU matches no twin profile (and no `twin`) is
    refused in one line, unless the folder holds every cell: nothing is left to estimate, so
    it plans without the estimate."""
    from dvfs.fleet.devices import worker_groups, workers_per_model
    from dvfs.fleet.folders import extra_repeats
    from dvfs.measure.plan import PlanSummary, summarise_plan

    # No matching profile: refused, saying how to go on, unless the folder holds every cell
    # (nothing to estimate; checked below, once the journals are read) and no --twin was named.
    stand_in_problem: CampaignError | None = None
    if estimate:
        try:
            twin_stand_in(campaign, twin)
        except CampaignError as exc:
            stand_in_problem = exc
            if "no model profile" in str(exc):
                stand_in_problem = CampaignError(
                    f"{exc}: the GPU-time estimate runs the campaign on the twin, so name the "
                    "nearest in engine.twin_model, or pass --no-estimate"
                )
                stand_in_problem.__cause__ = exc
        if stand_in_problem is not None and twin is not None:
            raise stand_in_problem
    cells = planned_cells(campaign, shard)
    # A folder the sweep would refuse counts nothing as done: its cells are another share's,
    # or were measured under other settings. --fresh moves every journal there aside first,
    # so nothing is refused or done.
    try:
        refusals = [] if fresh else folder_refusals(campaign, out_dir, shard)
        refused = [str(exc) for exc in refusals]
        if models is None:
            models = list(workers_per_model(campaign, worker_groups(campaign)))
        journals = (
            []
            if refused
            else resumed_journals(campaign, out_dir, models, cells, fresh=fresh, fleet=fleet)
        )
        finished = {j: set() if fresh else finished_cells(campaign, j) for j in journals}
        # With max_repeats above repeats: the extra repeats each journal holds (done, as the
        # sweep's closing line counts them) and the next ones its cells ask for now (the rule
        # the sweep follows, `extra_repeats`), which run after the planned cells left.
        extra_done = {
            j: journaled_repeats(campaign.measurement, cells, finished[j]) for j in journals
        }
        extra_next = {
            j: [
                c
                for c in ([] if fresh else extra_repeats(campaign, j, cells))
                if c.key not in finished[j]
            ]
            for j in journals
        }
    except Exception:
        if stand_in_problem is not None:  # said first, as before the folder was read
            raise stand_in_problem from None
        raise
    already_done = (
        None if refused else sum(len([c for c in cells if c.key in finished[j]]) for j in journals)
    )
    done_per_model = {
        j.parent.name: len([c for c in cells if c.key in finished[j]])
        for j in journals
        if j.parent != out_dir
    }
    # A folder holding every cell (each GPU model's, and no extra repeat asked for) runs
    # nothing: there is nothing to estimate, so no stand-in is needed.
    all_done = (
        already_done is not None
        and already_done == len(cells) * max(1, len(done_per_model))
        and not any(extra_next.values())
    )
    if stand_in_problem is not None and not all_done:
        raise stand_in_problem
    per_journal = {
        j: summarise_plan(campaign, [*cells, *extra_next[j]], finished[j]) for j in journals
    }
    # Each model runs its own cells left: the one with the most left sets the figures, the
    # twin's estimate among them (its cells left swept; none when nothing is left).
    most_left = max(per_journal, key=lambda j: per_journal[j].estimated_s, default=None)
    summary: PlanSummary = (
        per_journal[most_left] if most_left is not None else summarise_plan(campaign, cells, set())
    )
    done_there = frozenset(finished[most_left]) if most_left is not None else frozenset()
    knobs = campaign.knobs
    servers = tuple(server_plans(campaign))
    recorded, method = "", ""
    corpora: dict[str, Corpus] | None = None
    try:
        # Counted as the sweep counts them: by the method of the journals it resumes (the
        # estimate stays the estimate though a tokenizer was cached since), else this machine's.
        recorded = "" if fresh else recorded_count_method(folder_journals(out_dir))
        corpora, method = counted_corpora(campaign, recorded)
        short = corpus_shortfalls(campaign, corpora)
        problems = [shortfall_line(campaign, short)] if short else []  # the sweep's line
        overrun = _twin_refusal(  # the sweep's line, exit 2 too
            lambda c: twin_context_overruns(c, corpora),
            campaign,
            twin,
            stand_in_too=estimate and stand_in_problem is None,
        )
        problems += [overrun] if overrun is not None else []
        codes = [2 for _ in problems]
    except (CorpusError, JournalError) as exc:  # exit code as the sweep's: 2 a bad file, 1 a
        # read fault or a journal's tokenizer this machine lacks
        problems, codes = [str(exc)], [exc.exit_code]
    # The journals it resumes, refused where their servers' environment or prompts changed
    # since (a corpus edited), as the sweep refuses them once it opens them.
    resume = [] if refused or fresh else resume_refusals(campaign, journals, corpora, method)
    codes += [exc.exit_code for exc in [*refusals, *resume]]
    problems += [*refused, *map(str, resume)]
    # Servers the twin engine would not start (weights too large for the GPUs), as SGLang
    # would not: each of their cells would fail, so refused here as an invalid campaign; on
    # the stand-in the estimate sweeps, an estimate of cells that all fail is none.
    unstartable = _twin_refusal(
        twin_start_refusal, campaign, twin, stand_in_too=estimate and stand_in_problem is None
    )
    if unstartable is not None:
        problems.append(unstartable)
        codes.append(2)
    twin_time = (
        twin_estimate(
            campaign,
            shard=shard,
            twin=twin,
            progress=progress,
            skip=done_there,
            count_method=recorded,
        )
        if estimate and not problems and stand_in_problem is None and not all_done
        else None
    )
    if twin_time is not None and twin_time.failed:
        # The estimate's sweep failed cells (a request the server refuses, as an in-flight
        # round asking more new tokens than the context leaves): the sweep would fail them.
        on = "" if twin_stand_in(campaign, twin)[0] is campaign else " on its twin stand-in"
        problems.append(
            f"the twin's sweep of the campaign{on} failed {twin_time.failed} cell(s) (first: "
            f"{twin_time.first_failure}): the sweep would fail them as well; change what that "
            "error names before sweeping"
        )
        codes.append(2)
    cells_left = tuple(
        c
        for c in (cells if most_left is None else [*cells, *extra_next[most_left]])
        if c.key not in done_there
    )
    return DryRunPlan(
        campaign=campaign.name,
        hash=campaign.hash,
        gpu_backend=campaign.gpu.backend,
        gpu_profile=campaign.gpu.profile,
        gpu_devices=tuple(campaign.gpu.devices),
        actuation=campaign.gpu.actuation,
        grid={
            "sm_clock_mhz": list(knobs.sm_clocks_mhz) if knobs.sm_clocks_mhz else "stock",
            "power_limit_w": list(knobs.power_limits_w) if knobs.power_limits_w else "stock",
            "batch": list(campaign.workload.batch_sizes),
            "drafter": [d.name for d in campaign.drafters],
            "corpus": list(campaign.workload.corpus_names),
            "repeat": campaign.measurement.repeats,
        },
        cells=len(cells),
        already_done=already_done,
        server_starts=summary.server_starts,
        knob_changes=summary.knob_changes,
        comparison_groups=len({group_of(c) for c in cells}),
        cells_left=cells_left,
        estimated_s=summary.estimated_s,
        costs=(
            twin_time.costs
            if twin_time is not None and twin_time.costs is not None
            else RunCosts(
                {c.key: summary.per_cell_s for c in cells_left},
                start_s=summary.server_starts * summary.start_s,
                settle_s=summary.knob_changes * summary.settle_s,
            )
        ),
        most_left_folder=(
            most_left.parent.name if most_left is not None and most_left.parent != out_dir else None
        ),
        left_per_model={
            j.parent.name: len([c for c in [*cells, *extra_next[j]] if c.key not in finished[j]])
            for j in journals
            if j.parent != out_dir
        },
        servers=servers,
        problems=tuple(problems),
        shard=shard.label if shard else None,
        estimate=twin_time,
        done_per_model=done_per_model,
        max_repeats=campaign.measurement.max_repeats,
        precision=campaign.measurement.precision,
        extra_done=None if refused else sum(len(e) for e in extra_done.values()),
        extra_to_run=None if refused else sum(len(e) for e in extra_next.values()),
        fresh_moves=tuple(fresh_moves(out_dir)) if fresh else None,
        exit_code=max(codes, default=0),
    )


def folder_refusals(campaign: Campaign, out_dir: Path, shard: Shard | None) -> list[JournalError]:
    """What would stop the run of `campaign` in `out_dir` before it measures, as the sweep
    says it, for its journal and each GPU model's, the first of each as the sweep meets them:
    a journal of another campaign or of other settings (`check_resumable`: the sweep's
    `check_journal`, the fleet's `Journal.open`), a folder holding another shard (or the whole
    campaign), or a shard begun by an earlier dvfs that dealt its cells otherwise
    (`check_shard`), or in-flight cells carried along another drift with cells left
    (`check_inflight_resume`). A journal it cannot read, or a damaged shard record, is raised: the
    sweep's one line, as the sweep refuses it."""
    from dvfs.measure.journal import check_resumable, iter_records

    refusals: list[JournalError] = []
    for journal in folder_journals(out_dir):
        records = iter_records(journal) if journal.exists() else iter(())
        first = next(records, None)
        if first is not None:
            # Read on past a header only (a damaged line is raised, as the sweep raises it):
            # each session's schema, besides the header's, is the sweep's to refuse.
            headed = first.get("type") == "header"
            sessions = [r for r in records if r.get("type") == "session"] if headed else []
            try:
                check_resumable(journal, first, campaign, sessions)
            except JournalError as exc:
                refusals.append(exc)
                continue  # the sweep stops at this one, before its shard record
        try:
            check_shard(journal, shard)
        except (ShardDealError, OtherShardError) as exc:
            refusals.append(exc)
            continue
        if first is not None and campaign.measurement.mode == "in-flight":
            try:
                cells = planned_cells(campaign, shard)
                check_inflight_resume(Journal(journal, iter_records(journal)), campaign, cells)
            except JournalError as exc:
                refusals.append(exc)
    return refusals


def spent_gpu_s(out_dir: Path, cube: xr.Dataset | None = None) -> float:
    """The GPU time a sweep into `out_dir` spent: its cells' `gpu_time_total_s` plus each
    session's overhead (counter detection, idle baseline, settle measurement), which the
    journal keeps on the session record. `cube`: the folder's cube, in memory (else read)."""
    from dvfs.cube import open_cube
    from dvfs.measure.journal import iter_records

    ds = open_cube(out_dir / CUBE_NAME) if cube is None else cube
    cells = float(ds["gpu_time_total_s"].fillna(0.0).sum())
    sessions = sum(
        float((r.get("gpu_time_s") or {}).get("total", 0.0))
        for r in iter_records(out_dir / JOURNAL_NAME)
        if r.get("type") == "session"
    )
    return cells + sessions


def twin_gpu_s(campaign: Campaign, *, shard: Shard | None = None) -> float | None:
    """The GPU time the twin spends on the campaign (or shard): every cell swept into a
    temporary folder in virtual time. None unless both the GPU and the engine are the twin."""
    if campaign.gpu.backend != "twin" or campaign.engine.backend != "twin":
        return None
    return twin_estimate(campaign, shard=shard).dvfs_gpu_s


def _words(text: str) -> set[str]:
    return {w for w in re.split(r"[^a-z0-9]+", text.lower()) if w}


def stand_in_profile(campaign: Campaign, twin: str | None = None) -> tuple[str, str]:
    """The twin GPU profile that stands in for the campaign's GPU: `twin` when given, else the
    campaign's `gpu.profile`, else the one profile whose key's words (h100, sxm) all appear in
    the campaign's name or description; and where it came from. One clear line when none (or
    several) match."""
    from dvfs.twin.profiles import gpu_profile, gpu_profiles

    known = ", ".join(sorted(gpu_profiles()))
    chosen = twin or campaign.gpu.profile
    if chosen:
        gpu_profile(chosen)  # an unknown profile (or trap list) is one line
        return chosen, "--twin" if twin else "gpu.profile"
    said = _words(f"{campaign.name} {campaign.description}")
    matches = [key for key in sorted(gpu_profiles()) if _words(key) <= said]
    if len(matches) != 1:
        what = f"several twin GPUs ({', '.join(matches)})" if matches else "no twin GPU"
        raise CampaignError(
            f"campaign {campaign.name!r} names {what} in its name or description, so no twin "
            f"stands in for its GPU to estimate its GPU time: name one with --twin PROFILE "
            f"({known}), or pass --no-estimate"
        )
    return matches[0], "named in the campaign's name or description"


def _twin_refusal(
    refusal: Callable[[Campaign], str | None],
    campaign: Campaign,
    twin: str | None,
    *,
    stand_in_too: bool,
) -> str | None:
    """What `refusal` (a twin limit's check) says of the campaign; where it says nothing and
    the dry run's estimate sweeps a twin stand-in (`stand_in_too`), what it says of that
    stand-in, as such: the estimate's sweep of it would be refused in that line."""
    found = refusal(campaign)
    if found is not None or not stand_in_too:
        return found
    stand_in, stand_in_key, _ = twin_stand_in(campaign, twin)
    there = None if stand_in is campaign else refusal(stand_in)
    return None if there is None else f"on the twin stand-in {stand_in_key}: {there}"


def twin_stand_in(
    campaign: Campaign, twin: str | None = None, *, profile_digest: str = ""
) -> tuple[Campaign, str, str]:
    """The campaign with its GPU and engine backends switched to the twin (the profile from
    `stand_in_profile`, the model from the engine's `twin_model` or `model`), that profile and
    where it came from. A twin campaign is its own stand-in (unless `twin` names another
    profile). `profile_digest` (`dvfs.twin.fit.profile_digest`) binds a profile lent from a
    file to the journal: its key alone does not say its figures."""
    if campaign.gpu.backend == "twin" and campaign.engine.backend == "twin" and twin is None:
        return campaign, campaign.gpu.profile or "", "the campaign's own"
    profile, source = stand_in_profile(campaign, twin)
    from dvfs.twin.profiles import model_profile

    model_profile(campaign.engine.simulated_model)  # one line if unknown
    devices = campaign.gpu.devices
    twin_devices: tuple[int | str, ...] = (
        devices if all(isinstance(d, int) for d in devices) else tuple(range(len(devices)))
    )
    groups = campaign.gpu.groups
    if groups:
        size = len(groups[0])
        groups = tuple(twin_devices[i : i + size] for i in range(0, len(twin_devices), size))
    gpu = dataclasses.replace(
        campaign.gpu,
        backend="twin",
        profile=profile,
        devices=twin_devices,
        groups=groups,
        profile_digest=profile_digest,
    )
    engine = dataclasses.replace(campaign.engine, backend="twin")
    return dataclasses.replace(campaign, gpu=gpu, engine=engine), profile, source


#: The naive protocol the dry run and `tests/bench/bench_protocol.py` compare against: every
#: cell starts its server, waits a fixed settle (`knobs.settle_s`), warms up, prefills and
#: measures one fixed 5 s window, and is repeated a fixed 3 times.
NAIVE_WINDOW_S = 5.0
NAIVE_REPEATS = 3


@dataclass(frozen=True)
class TwinEstimate:
    """GPU time on the twin stand-in: what dvfs's protocol spends (swept), what the naive
    protocol would (derived per cell from the sweep, `naive_gpu_s`), and the window share."""

    profile: str
    #: Where the profile came from: "--twin", "gpu.profile", the campaign's text, its own.
    source: str
    dvfs_gpu_s: float
    window_s: float
    naive_gpu_s: float
    cells: int
    #: The planned cells left out as already done in the folder planned for (0: all swept).
    skipped: int = 0
    #: The cells its sweep failed (after their retries), and the first one's label and last
    #: error: the sweep of the campaign would fail them too.
    failed: int = 0
    first_failure: str = ""
    #: Its sweep split as a fleet's workers spend it (`dvfs.estimate.RunCosts`): each cell's
    #: own time, and what every worker spends again (starts, settles, idle baselines, session).
    costs: RunCosts | None = None


def naive_gpu_s(ds: Any, campaign: Campaign, *, attached: bool = False) -> float:
    """The naive protocol's GPU time on the cells of a swept cube, from what the twin measured
    in each: per cell, `NAIVE_REPEATS` times one server start (the twin's, as
    `gpu_time_server_start_s` records it), the campaign's fixed `knobs.settle_s`, a warm-up of
    `warmup_tokens` at the cell's time per token (batch / throughput), the median time to first
    token and a fixed `NAIVE_WINDOW_S` window. Each of the campaign's `repeats` measured
    repeats of a cell carries its share of the naive cell (so a shard counts its slice);
    repeats added by adaptive precision, and cells the twin did not measure, count nothing.
    `attached`: the campaign attaches to a running server (engine.sglang.url), which the
    naive protocol does not start either."""
    import numpy as np

    start = float(np.nanmax(ds["gpu_time_server_start_s"].values, initial=0.0))
    if attached:
        start = 0.0
    elif start <= 0:
        from dvfs.engines.twin import STARTUP_S

        start = STARTUP_S
    repeats = campaign.measurement.repeats
    ds = ds.isel(repeat=ds["repeat"].values < repeats)
    per_token = ds["batch"] / ds["throughput_tok_s"]
    ttft = ds["ttft_ms"].sel(quantile=0.5, method="nearest") / 1000
    warm = campaign.measurement.warmup_tokens * per_token
    once = (start + campaign.knobs.settle_s + warm + ttft + NAIVE_WINDOW_S).values
    return float(NAIVE_REPEATS / repeats * np.nansum(once[np.isfinite(once)]))


def twin_estimate(
    campaign: Campaign,
    *,
    shard: Shard | None = None,
    twin: str | None = None,
    progress: Progress | None = None,
    skip: Collection[str] = (),
    count_method: str = "",
) -> TwinEstimate:
    """Sweep the campaign's twin stand-in (`twin_stand_in`) into a temporary folder, in
    virtual time, and read off the GPU time it spends and the naive protocol's. `skip`: keys
    of the cells already done in the folder planned for: swept first, in a sweep of their own
    (not counted), so that the sweep after them resumes as the sweep there would, on the cells
    left and the extra repeats every group then asks for (its own or the done cells' groups,
    with max_repeats); the estimate is of that resumed sweep. `count_method`: the token-count
    method of the journal the estimate is for, which its sweep would keep."""
    import tempfile

    from dvfs.corpora.tokens import TOKENIZER_OF
    from dvfs.cube import open_cube

    stand_in, profile, source = twin_stand_in(campaign, twin)
    if len(stand_in.gpu.groups) > 1:
        from dvfs.fleet.devices import for_group

        # Each cell runs on one group's server, as a fleet's worker runs it: not on one server
        # spanning every group's GPUs (a wider tensor-parallel server, faster than the sweep's).
        stand_in = for_group(stand_in, stand_in.gpu.groups[0])
    if count_method.startswith(TOKENIZER_OF) and count_method != (
        f"{TOKENIZER_OF}{tokenizer_model(stand_in)}"
    ):
        # The tokenizer of the campaign's own model (a local path, say), which the stand-in,
        # naming its model by the twin's profile, cannot count by: counted as a new sweep of
        # the stand-in counts (its profile's tokenizer where cached, else the estimate), not
        # refused as a journal whose tokenizer this machine lacks.
        count_method = ""
    skipped = len([c for c in planned_cells(campaign, shard) if c.key in skip]) if skip else 0
    with tempfile.TemporaryDirectory(prefix="dvfs-dry-run-") as tmp:
        out = Path(tmp)
        before: xr.Dataset | None = None
        if skip:
            before = run_sweep(
                stand_in, out, shard=shard, only=skip, count_method=count_method
            ).cube
            if before is None:
                before = open_cube(out / CUBE_NAME)
            already = spent_gpu_s(out, before)
        # The cube the sweep holds in memory: the numbers of the file it wrote, without
        # reading the file back (twice, before).
        swept = run_sweep(stand_in, out, shard=shard, progress=progress, count_method=count_method)
        failed, first_failure = swept.summary.failed, ""
        if failed:
            first_failure = _first_failure(swept.journal_path)
        ds = swept.cube
        if ds is None:
            ds = open_cube(out / CUBE_NAME)
        spent = spent_gpu_s(out, ds)
        if before is not None:  # what the resumed sweep spent: the cells it measured alone
            spent -= already
            earlier = before["gpu_time_total_s"].notnull()
            ds = ds.where(~earlier.reindex_like(ds["gpu_time_total_s"], fill_value=False))
        window = float(ds["gpu_time_window_s"].fillna(0.0).sum())
        # An attached server (engine.sglang.url) is running already: the stand-in's server
        # starts are not spent (the thermal stabilisation after each attach still is).
        attached = campaign.engine.backend == "sglang" and bool(campaign.engine.sglang.url)
        if attached and "gpu_time_server_start_s" in ds:
            launching = float(ds["gpu_time_server_start_s"].fillna(0.0).sum())
            spent -= launching
        naive = naive_gpu_s(ds, stand_in, attached=attached)
        cells = int(ds["gpu_time_total_s"].notnull().sum())
        costs = _run_costs(swept.journal_path, attached=attached)
    return TwinEstimate(
        profile, source, spent, window, naive, cells, skipped, failed, first_failure, costs
    )


#: The parts of a cell's GPU time that a fleet's every worker spends again on its own GPU
#: (`dvfs.estimate`): a server start, the stabilisation after it, a knob change's settle, a
#: setting's idle baseline. The rest is the cell's own.
_WORKER_PARTS = ("server_start", "stabilise", "settle", "idle_baseline")


def _run_costs(journal: Path, *, attached: bool = False) -> RunCosts:
    """The last session of `journal` (a sweep's, resumed or not) split as `RunCosts`: each
    cell's own GPU time, its starts (none spent launching when `attached`), settles, idle
    baselines and the session's overhead."""
    from dvfs.measure.journal import iter_records
    from dvfs.measure.plan import Cell

    records = list(iter_records(journal))
    last = max((i for i, r in enumerate(records) if r.get("type") == "session"), default=0)
    session_s = float(((records[last] if records else {}).get("gpu_time_s") or {}).get("total", 0))
    cell_s: dict[str, float] = {}
    parts = dict.fromkeys(_WORKER_PARTS, 0.0)
    made = dict.fromkeys(("starts", "changes", "settings"), 0)
    for record in records[last:]:
        if record.get("type") != "cell":
            continue
        time = {k: float(v) for k, v in (record.get("gpu_time_s") or {}).items()}
        key = Cell.from_dict(record["cell"]).key
        own = sum(v for k, v in time.items() if k not in parts and k != "total")
        cell_s[key] = cell_s.get(key, 0.0) + own
        for name in parts:
            parts[name] += time.get(name, 0.0)
        made["starts"] += time.get("server_start", 0.0) + time.get("stabilise", 0.0) > 0
        made["changes"] += time.get("settle", 0.0) > 0
        made["settings"] += time.get("idle_baseline", 0.0) > 0
    if attached:  # an attached server is running already: no start is spent launching it
        parts["server_start"] = 0.0
    return RunCosts(
        cell_s=cell_s,
        start_s=parts["server_start"] + parts["stabilise"],
        settle_s=parts["settle"],
        idle_s=parts["idle_baseline"],
        session_s=session_s,
        **made,
    )


def _first_failure(journal: Path) -> str:
    """The first failed cell of `journal` as "<cell>: <its last error's first line>"."""
    from dvfs.measure.journal import iter_records
    from dvfs.measure.plan import Cell, cell_label

    for record in iter_records(journal):
        if record.get("type") != "cell" or record.get("status") == "ok":
            continue
        errors = record.get("errors") or [record.get("error") or ""]
        if errors[-1]:
            return f"{cell_label(Cell.from_dict(record['cell']))}: {errors[-1].splitlines()[0]}"
    return ""
