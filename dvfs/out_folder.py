"""A sweep's output folder: one sweep at a time (its lock, released as the folder was found
if the sweep fails before measuring), a fresh start that sets the old files aside, and the
refusals a folder's state gives before anything runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dvfs.campaign import Campaign
from dvfs.cube import CUBE_NAME
from dvfs.errors import (
    JournalError,
    OutputRefusedError,
)
from dvfs.fleet.shard import Shard, ShardDealError, planned_cells
from dvfs.fleet.shard_journal import (
    OtherShardError,
    check_shard,
    folder_journals,
)
from dvfs.measure.journal import (
    JOURNAL_NAME,
    Journal,
    check_journal,
    check_journal_link,
    describe_os_error,
)
from dvfs.measure.runner import Progress
from dvfs.preflight import check_inflight_resume

if TYPE_CHECKING:
    pass


LOCK_NAME = "sweep.lock"


class SweepBusyError(JournalError):
    """Another sweep is writing to the same output folder."""

    exit_code = 3


def fresh_start(out_dir: Path, done: list[tuple[Path, Path]] | None = None) -> Path | None:
    """Move the journals a rerun would resume aside, each with its cube (`fresh_moves`), each
    move added to `done` once made (`OutFolder.moves`: undone if the sweep is refused).
    Returns the first journal's new path, None when there was none."""
    moves = fresh_moves(out_dir)
    try:
        for path, target in moves:
            _move(path, target, dict(moves))
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
    # a link in a loop or to nothing too: left, the sweep refuses it (`check_journal_link`)
    journals = [j for j in folder_journals(out_dir) if os.path.lexists(j)]
    moves = [m for j in journals for m in _aside(j, j.parent / CUBE_NAME)]
    if journals and journals[0].parent != out_dir and os.path.lexists(out_dir / CUBE_NAME):
        moves += _aside(out_dir / CUBE_NAME)
    return moves


def _move(path: Path, target: Path, renamed: dict[Path, Path]) -> None:
    """`shutil.move(path, target)`; a symbolic link (never followed) that points at one of the
    paths `renamed` moves (a loop `journal.jsonl -> journal.jsonl`) made to point at its new
    name, as it did before: left as it was, a relative one named the new run's journal."""
    if not path.is_symlink():
        shutil.move(path, target)
        return
    text = os.readlink(path)
    pointed = Path(os.path.normpath(path.parent / text))
    moved = renamed.get(pointed)
    if moved is None:
        shutil.move(path, target)
        return
    new = str(moved) if os.path.isabs(text) else os.path.relpath(moved, target.parent)
    os.symlink(new, target)
    try:
        path.unlink()
    except OSError:
        target.unlink()
        raise


def _aside(first: Path, *others: Path) -> list[tuple[Path, Path]]:
    """`first` and those of `others` that exist, each to `NAME.n`, one n free for all. A link
    to nothing is there too (moved aside as a link, never followed: the run's cube was written
    through one to where it pointed), and takes its name."""
    paths = (first, *others)
    n = 1
    while any(os.path.lexists(p.with_name(f"{p.name}.{n}")) for p in paths):
        n += 1
    return [(p, p.with_name(f"{p.name}.{n}")) for p in paths if p is first or os.path.lexists(p)]


@dataclass
class OutFolder:
    """The output folder a sweep holds (`out_dir_lock`), and the journals and cubes --fresh
    moved aside in it (`fresh_start`), each (from, to)."""

    path: Path
    moves: list[tuple[Path, Path]] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def out_dir_lock(
    out_dir: Path, progress: Progress | None = None, *, fresh: bool = False
) -> Iterator[OutFolder]:
    """Hold OUT/sweep.lock (flock) for the sweep's life, so two sweeps never write one journal.

    The kernel drops the lock when the process dies, however it dies, so there is never a stale
    lock to clear; the file keeps the holder's pid for the refusal message. A sweep that fails
    (not one interrupted) before it measured anything leaves the folder as it found it
    (`_leave_as_found`, --fresh's moves undone, said to `progress`): a corrected rerun, a
    `dvfs cube merge` of shard folders, find nothing of it there. `fresh`: the run moves the
    folder's journals aside (`fresh_start`), with their cubes, which are none of its own.
    """
    import fcntl

    from dvfs.outputs import check_links

    kernel = kernel_folder(out_dir)
    if kernel:  # before any folder is made there (as root, a cgroup under /sys/fs/cgroup)
        raise JournalError(kernel)
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
            raise JournalError(folder_problem(exc, out_dir)) from exc
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
        check_cube_files(out_dir, fresh=fresh)
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
    rerun without --fresh resumes them). A fleet mixing GPU models that measured on one of
    them keeps every model's journal it began, one holding no cell too (a model whose only
    worker was lost before its first cell): the folder is the campaign's now, that journal
    is where the fleet's error says that model's cells are, and `dvfs cube build` says the
    model is left out of the cube, not a cube of the other models alone as if whole.
    `journals` and `model_folders`: those in `out_dir` before it began. Returns whether it
    undid any move."""
    from dvfs.measure.journal import iter_records

    kept = False
    unmeasured = []
    for path, file in _journal_files(out_dir).items():
        if journals.get(path) == file:
            continue  # the folder's before (a resume): what it holds stays
        try:
            measured = any(r.get("type") == "cell" for r in iter_records(path))
        except Exception:  # unreadable: kept, as found, for the next run to say so
            measured = True
        if measured:
            kept = True
        else:
            unmeasured.append(path)
    for path in unmeasured:
        if kept and path.parent != out_dir:
            continue  # a GPU model's, beside another model's measured cells
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
    back = {target: path for path, target in moves}
    for path, target in reversed(moves):
        if os.path.lexists(target) and not os.path.lexists(path):
            with contextlib.suppress(OSError):
                path.parent.mkdir(exist_ok=True)
                _move(target, path, back)
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


def check_cube_files(out_dir: Path, *, fresh: bool = False) -> None:
    """Refuse (`OutputRefusedError`) a named pipe where the run writes a cube (`cube.nc`, each
    GPU model's `gpu-*/cube.nc`), before anything is measured: the cube goes there only once
    every cell is, hours later, waited on 30 s for a reader then refused; and a folder's cube is
    what the demo and the commands given the folder read back, which a pipe cannot be read as.
    Not tried for a reader now: opening it to try would end a waiting reader's stream. A link
    to a file in a folder that does not exist, which the cube could not be written through,
    is refused so too, and a folder in the cube's place, which its write fails on hours later.
    With `fresh`, a cube --fresh moves aside with its journal (`fresh_moves`) is none of the
    run's."""
    import stat

    aside = {src for src, _ in fresh_moves(out_dir)} if fresh else set()
    for path in (out_dir / CUBE_NAME, *sorted(out_dir.glob(f"gpu-*/{CUBE_NAME}"))):
        if path in aside:
            continue
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            target = os.path.realpath(path)
            if os.path.islink(path) and not os.path.isdir(os.path.dirname(target)):
                # a link to a file in a folder that is not there: the cube's write, hours on,
                # fails "No such file or directory"
                raise OutputRefusedError(
                    f"{path} is a link to {target}, in a folder that does not exist, where the "
                    "cube is written once every cell is measured: make that folder, or remove "
                    "the link, and run again"
                ) from None
            continue  # none yet
        except OSError:
            continue  # one the cube's write refuses in its own words
        if stat.S_ISDIR(mode):
            # the cube's write, once every cell is measured, fails "Is a directory"
            raise OutputRefusedError(
                f"{path} is a folder, where the cube is written once every cell is measured: "
                "move it aside and run again, or choose another --out"
            )
        if stat.S_ISFIFO(mode):
            raise OutputRefusedError(
                f"{path} is a named pipe, where the cube is written once every cell is "
                "measured and read back from as a file: remove it (or move it aside) and run "
                f"again; to send a cube into a pipe, run `dvfs cube build {out_dir} -o PIPE` "
                "once the sweep is done"
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
    check_out_usable(out_dir)
    for journal in folder_journals(out_dir):  # each GPU model's too, as the sweep opens them
        check_journal(journal, campaign)
        check_shard(journal, shard)
        if journal.is_file():
            from dvfs.measure.journal import iter_records

            cells = planned_cells(campaign, shard)
            check_inflight_resume(Journal(journal, iter_records(journal)), campaign, cells)


def check_out_usable(out_dir: Path, *, fresh: bool = False) -> None:
    """What `run_sweep` refuses about `out_dir` before it reads a journal there, found without
    creating or writing anything (`check_out_dir`'s first part, which the dry run says too): a
    file in the way of the folder or its lock, a read-only file system or no permission to
    create them, a file system with no block free (`_no_room`), a link another user may have
    placed (as root), another sweep holding the folder (`SweepBusyError`), a named pipe where
    its cube goes (`check_cube_files`; with `fresh`, one --fresh leaves there)."""
    import fcntl

    broken = _broken_link(out_dir)
    if broken:  # not there, so its folder was probed: doctor said "usable"
        raise JournalError(broken)
    from dvfs.inputs import link_loop_problem

    # a link in a loop on the way to the folder, or in place of its lock: not there
    # (`exists()`), so the folder above was probed and doctor said "usable", the dry run
    # nothing, while the sweep refused it (a journal's is the journal check's)
    for path in (out_dir, out_dir / LOCK_NAME):
        if link_loop_problem(path) is not None:
            problem = OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
            raise JournalError(folder_problem(problem, out_dir))
    kernel = kernel_folder(out_dir)
    if kernel:
        raise JournalError(kernel)
    probe = out_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    code = 0
    if not probe.is_dir():  # the folder itself a file, or a file above it
        code = errno.EEXIST if probe == out_dir else errno.ENOTDIR
    elif os.statvfs(probe).f_flag & os.ST_RDONLY:  # root passes os.access even there
        code = errno.EROFS
    elif _no_room(probe):  # not a byte: the sweep fails at its lock's pid (doctor said "ok")
        code = errno.ENOSPC
    elif not os.access(probe, os.W_OK | os.X_OK):
        code = errno.EACCES
    if code:
        problem = OSError(code, os.strerror(code), str(probe))
        raise JournalError(folder_problem(problem, out_dir))
    from dvfs.outputs import check_links

    lock = out_dir / LOCK_NAME
    # as root, the lock and the journals the sweep would write through another user's link
    for path in (lock, out_dir / JOURNAL_NAME, *folder_journals(out_dir)):
        check_links(path)
    if (
        not lock.exists()
        and os.path.islink(lock)
        and not os.path.isdir(os.path.dirname(os.path.realpath(lock)))
    ):
        # a link to nothing: the sweep creates its target, or fails where that target's folder
        # is not there, as `folder_problem` says ("usable" here, the sweep refused it)
        problem = OSError(errno.ENOENT, os.strerror(errno.ENOENT), str(lock))
        raise JournalError(folder_problem(problem, out_dir))
    if lock.exists():
        try:
            # As the sweep opens it, less O_CREAT: a folder (EISDIR) or a lock the sweep may
            # not write is refused here too, in the sweep's words.
            fd = os.open(lock, os.O_RDWR)
        except OSError as exc:
            raise JournalError(folder_problem(exc, out_dir)) from exc
        try:
            _check_lock_file(lock, fd)
            # A shared lock, dropped at once: refused while a sweep holds its exclusive one.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(out_dir, fd) from None
        finally:
            os.close(fd)
    check_cube_files(out_dir, fresh=fresh)


def _broken_link(out_dir: Path) -> str | None:
    """The refusal of an --out folder that is a symbolic link leading to nothing (or round in
    a loop), or None: it was "File exists; a file is in the way of that folder", of no file."""
    import shlex

    if not os.path.islink(out_dir):
        return None
    try:
        os.stat(out_dir)
    except FileNotFoundError:
        target = os.path.realpath(out_dir)
        return (
            f"cannot use {out_dir} as the output folder: it is a symbolic link to {target}, "
            f"which does not exist: make that folder (mkdir -p {shlex.quote(target)}), or "
            "remove the link, or choose another --out"
        )
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            return None  # said by the sweep's own words where it uses the folder
        return (
            f"cannot use {out_dir} as the output folder: it is a symbolic link that leads back "
            "to itself (a loop): remove it or point it at a folder, or choose another --out"
        )
    return None


def folder_problem(exc: OSError, out_dir: Path) -> str:
    """`describe_os_error`'s line for the output folder `out_dir` that cannot be used, saying
    each thing once: the path where it is the folder's own ("cannot use DIR as the output
    folder (DIR)"), and a read-only file system ("Read-only file system; the filesystem is
    read-only"); a link to nothing in the folder's place as that (`_broken_link`), not "a
    file is in the way"."""
    broken = _broken_link(out_dir) if exc.errno == errno.EEXIST else None
    if broken:
        return broken
    if exc.errno == errno.ELOOP:
        from dvfs.inputs import link_loop_problem

        # a link in a loop on the way to the folder: "point it at the folder", not the
        # journal's "point it at a file" after "Too many levels of symbolic links"
        loop = link_loop_problem(out_dir, "folder")
        if loop:
            return f"cannot use {out_dir} as the output folder: {loop}, or choose another --out"
    linked = exc.filename if exc.errno == errno.ENOENT else None
    if (
        linked
        and os.path.islink(linked)
        and not os.path.isdir(os.path.dirname(os.path.realpath(linked)))
    ):
        # a file of the folder's (its sweep.lock) a link into a folder that is not there: it
        # was "No such file or directory", neither the link nor a way out named
        return (
            f"cannot use {out_dir} as the output folder: {linked} is a symbolic link to "
            f"{os.readlink(linked)}, in a folder that does not exist: remove the link (or make "
            "that folder), or choose another --out"
        )
    doing = f"use {out_dir} as the output folder"
    return describe_os_error(exc, doing, show_file=exc.filename != str(out_dir))


def kernel_folder(out_dir: Path) -> str | None:
    """The refusal of an --out folder on one of the kernel's file systems
    (`kernel_file_system`: /proc, /sys, cgroups...), or None. As root, the usual checks pass
    there (`os.access` says yes, no block is ever short): the sweep then failed at its lock,
    or making the folder, while `dvfs doctor` said the folder was usable."""
    from dvfs.outputs import kernel_file_system

    found = kernel_file_system(out_dir)
    if found is None:
        return None
    mount, kind = found
    return (
        f"cannot use {out_dir} as the output folder: {mount} is the kernel's {kind} file "
        "system (its state shown as files), where no output can go; choose a folder on a "
        "disk with --out"
    )


def _no_room(folder: Path) -> bool:
    """Whether the file system of `folder` has no block (or no inode) left for this user (root
    may use the blocks reserved for it): the sweep's first write (its lock's pid) fails then,
    whatever it would measure. A file system of no size (/proc) is not full."""
    fs = os.statvfs(folder)
    blocks = fs.f_bfree if os.geteuid() == 0 else fs.f_bavail
    inodes = fs.f_ffree if os.geteuid() == 0 else fs.f_favail
    return bool((fs.f_blocks and not blocks) or (fs.f_files and not inodes))


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
        check_journal_link(journal)  # a link the sweep cannot open: its line, raised
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
