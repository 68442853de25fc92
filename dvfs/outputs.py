"""Writing an output file so that a failed write never costs the user the file they had.

A regular file is replaced atomically: written to a temp file beside it, flushed to disk, then
renamed over it, so a full disk, a read-only file system or a crash leaves the old file or the
new one, never half of either. A symlink's target is replaced and the link kept. A path that is
no regular file (/dev/null, /dev/full, a FIFO) is written in place: renaming over it would
replace a device node, which root may do, with a regular file. As root, a path through a
symbolic link another user may have placed (`check_links`) is refused: its target is theirs
to choose, any file root may write.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import logging
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import BinaryIO

log = logging.getLogger(__name__)


#: The kernel's own file systems: its state shown as files (/proc, /sys, cgroups...), where
#: no output can go (as root, a folder made under /sys/fs/cgroup is a cgroup).
KERNEL_FILE_SYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "efivarfs",
        "fusectl",
        "devpts",
        "mqueue",
        "binfmt_misc",
        "hugetlbfs",
    }
)


def kernel_file_system(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(mount point, type) of the kernel's file system (`KERNEL_FILE_SYSTEMS`) that `path`
    (resolved) lies on: where /proc/self/mountinfo mounts one, else under /proc or /sys; None
    elsewhere, and for a process's open file (/proc/self/fd/N, /dev/stdout), which is where
    that file is."""
    where = os.path.realpath(path)
    if re.fullmatch(r"/proc/(?:self|thread-self|\d+)(?:/task/\d+)?/fd/.*", where):
        return None
    mount, kind = _mount_of(where)
    if kind in KERNEL_FILE_SYSTEMS:
        return mount, kind
    for top, name in (("/proc", "proc"), ("/sys", "sysfs")):
        if where == top or where.startswith(top + "/"):
            return top, name
    return None


def _mount_of(path: str) -> tuple[str, str]:
    """The mount point holding `path` (resolved) and its file system's type, as
    /proc/self/mountinfo says; ("", "") where it cannot be read."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as info:
            lines = info.read().splitlines()
    except OSError:
        return "", ""
    found = ("", "")
    for line in lines:
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        kind = fields[fields.index("-", 6) + 1]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(found[0]):  # the last of a mount point's wins
            found = (point, kind)
    return found


def new_file_mode() -> int:
    """0666 less the umask: the mode `open()` would give a new file."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no way to read the umask without setting it
    os.umask(mask)
    return 0o666 & ~mask


def group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def temp_prefix(name: str) -> str:
    """`.NAME.`, the prefix of a temp file written beside the file NAME (`tempfile.mkstemp`'s
    8 random characters and a suffix of a few follow), NAME cut to 200 bytes: the temp
    file's name stays within the 255 bytes a file system allows a name, so that a NAME near
    that limit, which can be written, was not refused "the name is too long" for the temp
    file's sake."""
    raw = os.fsencode(name)
    return f".{os.fsdecode(raw[:200]) if len(raw) > 200 else name}."


def check_link_target(path: Path) -> None:
    """Refuse (`OutputRefusedError`) an output path that is a symbolic link to a file in a
    folder that does not exist, which the write through it fails on: "cannot open PATH: no
    such file or folder; check the path (does its folder exist?)", of a path whose folder is
    there. Said as `dvfs sweep` says it of a cube.nc linked so (`check_cube_files`). For the
    output options of the CLI (`make_parent`), not `replacing`'s every write (a GPU's state
    file)."""
    if not os.path.islink(path):
        return
    target = os.path.realpath(path)
    if os.path.isdir(os.path.dirname(target)):
        return  # written through (a link in a loop fails in its own words)
    from dvfs.errors import OutputRefusedError

    raise OutputRefusedError(
        f"{path} is a link to {target}, in a folder that does not exist: make that folder, or "
        "remove the link, and run again"
    )


def who_may_replace(folder: os.stat_result) -> str | None:
    """Who but root may replace an entry of a folder with this status, in words (None: root
    alone): its owner, or, without the sticky bit, everyone or a group other than root's."""
    if folder.st_uid != 0:
        return f"its owner {user_name(folder.st_uid)}"
    if folder.st_mode & stat.S_ISVTX:
        return None
    if folder.st_mode & stat.S_IWOTH:
        return "everyone"
    if folder.st_mode & stat.S_IWGRP and folder.st_gid != 0:
        return f"group {group_name(folder.st_gid)}"
    return None


def check_links(
    path: Path, advice: str = "name the file itself, or write in a folder only root can write"
) -> None:
    """As root, refuse an output path that goes through a symbolic link (itself or a folder
    above it) that another user may have placed: one in a folder anyone but root may write
    (`who_may_replace`), or one another user owns (in a sticky folder such as /tmp). Such a
    link points wherever its owner chose, so writing through it would let them replace any
    file root may write (/etc/dvfs/govern-plan.toml) with what dvfs writes. Links root alone
    may place are followed. `advice`: what to do, said last."""
    if os.geteuid() != 0:
        return
    folder = "/"
    # Not `abspath`: it drops `link/..` before the link is followed, as the kernel does not
    names = [n for n in os.path.join(os.getcwd(), path).split("/") if n]
    links = 0
    while (
        names and links <= 40
    ):  # the kernel's own limit on links followed; past it the write fails
        name = names.pop(0)
        if name == "..":
            folder = os.path.dirname(folder)
            continue
        if name == ".":
            continue
        full = os.path.join(folder, name)
        try:
            link = os.lstat(full)
            if not stat.S_ISLNK(link.st_mode):
                folder = full
                continue
            who = who_may_replace(os.stat(folder))
            target = os.readlink(full)
        except OSError:
            return  # nothing there (a new file), or unreadable: no link to follow
        if who is not None:
            whose = f"in {folder}, which {who} may write"
        elif link.st_uid != 0:
            whose = f"owned by {user_name(link.st_uid)}"
        else:
            whose = None
        if whose is not None:
            from dvfs.errors import OutputRefusedError

            raise OutputRefusedError(
                f"{path} goes through the symbolic link {full}, {whose}: it may be pointed at "
                f"any file; as root dvfs refuses to write through it ({advice})"
            )
        links += 1
        if target.startswith("/"):
            folder = "/"
        names[:0] = [n for n in target.split("/") if n]


def is_stream(path: Path) -> bool:
    """Whether `path` is a stream rather than a file of a folder: a pipe, FIFO or device, or a
    link to one of this process's descriptors (`/dev/stdout`, `/dev/fd/N`,
    `/proc/self/fd/N`) whatever it is open on. `/dev/stdout` redirected to a file
    (`> report.md`) resolves to that file, but nothing written beside `/dev/stdout` lands
    beside it, and what is printed to standard output goes into it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        return True
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        folder = os.path.realpath(os.path.dirname(current))
        if re.fullmatch(r"/proc/(?:self|thread-self|\d+)(?:/task/\d+)?/fd", folder):
            return True
        full = os.path.join(folder, os.path.basename(current))
        if not os.path.islink(full):
            return False
        try:
            current = os.path.join(folder, os.readlink(full))
        except OSError:
            return False
    return False


def _named(exc: OSError, path: Path) -> OSError:
    """`exc` naming `path` (the user's), never a temp file."""
    return OSError(exc.errno, exc.strerror, str(path))


@contextlib.contextmanager
def replacing(path: Path, *, sync: bool = True, mode: int | None = None) -> Iterator[Path]:
    """A temp path to write `path`'s new content to; on a clean exit it becomes `path`.

    On an exception the temp file is removed and `path` is untouched. An OSError of the
    replacing itself names `path`. `sync`: flush the new content to disk before the rename,
    and the rename after it (a power loss then keeps one of the two whole; figures, drawn
    again from the cube, skip it). `mode`: the file's permissions (default: the old file's,
    else what `open()` would give a new one). As root, a path through another user's link is
    refused (`check_links`), before anything is written.
    """
    check_links(path)
    real = Path(os.path.realpath(path))
    try:
        # `path` itself, not `real`: a link to an anonymous pipe (`/dev/stdout` piped on,
        # `/dev/fd/63` of `>(...)`) resolves to `pipe:[N]`, which names no file
        existing: int | None = os.stat(path).st_mode
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise _named(exc, path) from exc
    if existing is not None and not stat.S_ISREG(existing) and not stat.S_ISDIR(existing):
        with tempfile.TemporaryDirectory(prefix="dvfs-out-") as folder, _removed_if_killed(folder):
            tmp = Path(folder) / real.name
            yield tmp
            try:
                with open(tmp, "rb") as src, _open_stream(path, existing) as dst:
                    shutil.copyfileobj(src, dst)
            except OSError as exc:
                raise _named(exc, path) from exc
        return
    tmp_path: Path | None = None
    try:
        try:
            fd, name = tempfile.mkstemp(
                prefix=temp_prefix(real.name), suffix=".tmp", dir=real.parent
            )
        except OSError as exc:
            raise _named(exc, path) from exc
        os.close(fd)
        tmp_path = Path(name)
        yield tmp_path
        try:
            if sync:
                fd = os.open(tmp_path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if mode is None:
                mode = new_file_mode() if existing is None else stat.S_IMODE(existing)
            os.chmod(tmp_path, mode)
            os.replace(tmp_path, real)
            tmp_path = None
            if sync:
                _sync_folder(real.parent)
        except OSError as exc:
            raise _named(exc, path) from exc
    finally:
        if tmp_path is not None:
            tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def _removed_if_killed(folder: str) -> Iterator[None]:
    """`folder` removed before SIGTERM, SIGHUP or SIGINT of the default disposition ends the
    process within the block (`systemctl stop` while a cube is copied into a pipe, or waits
    for its reader): the process ends as it would have, but no copy of the output is left in
    the temp folder. A signal a handler takes (an exception, or held) is left to it; main
    thread only, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def remove(signum: int, frame: FrameType | None) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # the default action: the end it would have been

    signums = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {
        s: signal.signal(s, remove) for s in signums if signal.getsignal(s) == signal.SIG_DFL
    }
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


#: How long a named pipe is waited on for its reader (seconds): the one an operator starts
#: after dvfs (`dvfs report CUBE -o pipe`, then `gzip < pipe` in another shell) is read, a pipe
#: left where the cube goes is refused, not waited on for ever.
PIPE_READER_WAIT_S = 30.0
#: How often a named pipe is tried for a reader while it is waited on (seconds).
PIPE_READER_POLL_S = 0.05
#: Whether a named pipe is waited on for its reader: not once the user asked to stop (an
#: interrupted sweep's partial cube, `pipes_not_waited_on`), whose Ctrl-C during the wait for
#: the whole cube's reader was followed by a second wait as long.
_PIPE_WAIT: contextvars.ContextVar[bool] = contextvars.ContextVar("pipe_wait", default=True)


@contextlib.contextmanager
def pipes_not_waited_on() -> Iterator[None]:
    """Within the block, a named pipe no program reads from is refused at once (as before
    `PIPE_READER_WAIT_S`), not waited on for its reader."""
    token = _PIPE_WAIT.set(False)
    try:
        yield
    finally:
        _PIPE_WAIT.reset(token)


def _open_stream(path: Path, mode: int) -> BinaryIO:
    """A pipe, FIFO or device opened for writing. A named pipe no program reads from is waited
    on for its reader `PIPE_READER_WAIT_S`, saying so, then refused: opening it would wait for
    a reader for ever (a FIFO left where the cube goes); refused at once, a reader started a
    moment after dvfs reached it was refused too."""
    if stat.S_ISSOCK(mode):
        own = _own_descriptor(path)
        if own is not None:  # a socket is not opened again by its link: written through a copy
            return os.fdopen(os.dup(own), "wb")
    if not stat.S_ISFIFO(mode):
        return open(path, "wb")  # noqa: SIM115 (the caller's `with` closes it)
    wait = PIPE_READER_WAIT_S if _PIPE_WAIT.get() else 0.0
    deadline = time.monotonic() + wait
    said = False
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
        if time.monotonic() >= deadline:
            from dvfs.errors import OutputRefusedError

            within = f"read from in {wait:g} s" if wait else "reads from"
            raise OutputRefusedError(
                f"{path} is a named pipe no program {within}, so writing there would wait for "
                "ever: start its reader first, or remove the pipe"
            ) from None
        if not said:
            log.warning(
                "waiting up to %g s for a program to read the named pipe %s (start its reader; "
                "Ctrl-C stops)",
                PIPE_READER_WAIT_S,
                path,
            )
            said = True
        time.sleep(PIPE_READER_POLL_S)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "wb")


def _own_descriptor(path: Path) -> int | None:
    """This process's descriptor that `path` is (`/dev/stdout`, `/dev/fd/N`), or None. A
    socket there (standard output under systemd, its journal's) cannot be opened again through
    that link, which fails "no such device or address"."""
    try:
        wanted = os.stat(path)
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        try:
            found = os.fstat(int(name))
        except (OSError, ValueError):  # (the listing's own descriptor, closed since)
            continue
        if (found.st_dev, found.st_ino) == (wanted.st_dev, wanted.st_ino):
            return int(name)
    return None


def _sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename in it) to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def netcdf_path_problem(path: Path, *, writing: bool) -> str | None:
    """Why netCDF-C cannot use `path`, in one line (None when it can): one holding bytes that
    are not UTF-8, which it cannot encode. It reads a backslash
    anywhere in the absolute path as '/' (the Windows separator), even on Linux: `a\\b.nc`
    is created as `a/b.nc`, or fails as "Permission denied" where no folder `a` is, and
    opening one fails as "NetCDF: HDF error" (a damaged file, it seemed). Writing goes to a
    temp file beside the link-resolved path (`replacing`), so that is the path checked."""
    full = os.path.realpath(path) if writing else os.path.abspath(path)
    verb = "write" if writing else "open"
    try:
        full.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8, which netCDF-C cannot take
        # (a sweep measured every cell, then failed writing its cube: "cannot write into text")
        fix = "choose a path in UTF-8" if writing else "rename it (or its folder) in UTF-8"
        where = "" if _not_utf8(str(path)) else f" (in {full})"
        return (
            f"cannot {verb} {path}: netCDF takes paths in UTF-8 alone, and this one{where} "
            f"holds bytes that are not; {fix}"
        )
    if "\\" not in full:
        return None
    fix = "choose a path without one" if writing else "rename it (or its folder) without one"
    where = "" if "\\" in str(path) else f" (in {full})"
    return (
        f"cannot {verb} {path}: netCDF reads a backslash in a path{where} as '/', a Windows "
        f"folder separator; {fix}"
    )


def _not_utf8(text: str) -> bool:
    """Whether `text` (a path, its undecodable bytes as surrogates) holds bytes not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def write_netcdf(path: Path, write: Callable[[Path], None], size_bytes: int) -> None:
    """`write(tmp)` (a `to_netcdf` call) through `replacing`. netCDF-C reports a full disk as
    "Permission denied" (creating) or "NetCDF: HDF error" (writing): where the folder has no
    room for about `size_bytes`, either becomes the ENOSPC it is, naming `path`. A path it
    cannot take (`netcdf_path_problem`) is `NetcdfPathError`, before anything is written.
    SIGINT, SIGTERM and SIGHUP wait until the file is whole and in place (`held_back`): one
    raised inside the write left a lock of xarray's held, and closing the file waited for it
    for ever. Into a pipe or device (written in place, `replacing`) they wait only for the
    netCDF write to its temp file, not for the copy into it: a pipe whose reader stopped
    reading (or a dead device) blocked the copy, and a held SIGTERM then never acted."""
    from dvfs.errors import NetcdfPathError
    from dvfs.signals import held_back

    problem = netcdf_path_problem(path, writing=True)
    if problem:
        raise NetcdfPathError(problem)
    try:
        mode: int | None = os.stat(path).st_mode
    except OSError:
        mode = None  # a new file (or one `replacing` refuses in its words)
    in_place = mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)
    # the file whole and in place, or (in place) only its temp file
    outer = contextlib.nullcontext() if in_place else held_back()
    inner = held_back() if in_place else contextlib.nullcontext()
    try:
        with outer, replacing(path) as tmp, inner:
            write(tmp)
    except (OSError, RuntimeError) as exc:
        # Only netCDF's two words for a full disk: any other error (ENOENT, EPERM...) is what
        # it says, even where the folder shows no free space (/proc and /sys show none).
        said = isinstance(exc, RuntimeError) or exc.errno == errno.EACCES
        if said and _short_of_space(path, size_bytes):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from exc
        if isinstance(exc, OSError):
            raise _named(exc, path) from exc
        raise


def _short_of_space(path: Path, size_bytes: int) -> bool:
    try:
        usage = shutil.disk_usage(Path(os.path.realpath(path)).parent)
    except OSError:
        return False
    # (a file system of no size, /proc or /sys, is not full: it holds no files to write)
    return usage.total > 0 and usage.free < size_bytes + (1 << 20)  # and HDF5's metadata


def write_bytes(path: Path, data: bytes, *, sync: bool = True, mode: int | None = None) -> None:
    """`data` as the content of `path`, replaced atomically (see `replacing`)."""
    with replacing(path, sync=sync, mode=mode) as tmp:
        try:
            tmp.write_bytes(data)
        except OSError as exc:
            raise _named(exc, path) from exc


def write_text(path: Path, text: str) -> None:
    """`text` (UTF-8) as the content of `path`, replaced atomically."""
    write_bytes(path, text.encode("utf-8"))
