"""A node's blocks of SGLang ports, claimed by the workers that run servers there.

Each worker holds one block (`ServerPorts`: its server's --port, --nccl-port and the ports
SGLang derives from --port) for its life: an exclusive lock on `<lock dir>/<port>.lock`, which
the kernel drops when the process dies, however it dies. Workers of one fleet (threads, or Ray
actors on one node), and of other dvfs sweeps on the node, so never pick the same block,
whatever their number in their fleet; a block where another program listens is skipped too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from dvfs.engines.sglang_args import PORT_SLOTS, ServerPorts
from dvfs.errors import EngineError

#: Where a node's port locks live (one folder for every dvfs on the node).
LOCK_DIR_ENV = "DVFS_PORT_LOCK_DIR"


def lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "dvfs-ports")


def taken(host: str, ports: Sequence[int]) -> str | None:
    """The first of `ports` another program holds on `host` ("port N: why"), or None."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                return f"port {port}: {exc.strerror}"
    return None


def _lock(folder: Path, ports: ServerPorts) -> int | None:
    """The locked file descriptor of `ports`' block, or None when another holds it."""
    import fcntl

    try:
        fd = os.open(folder / f"{ports.http}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # another user's lock file, not open to others: theirs
        return None
    with contextlib.suppress(OSError):  # open to every user's dvfs, whatever the umask
        os.fchmod(fd, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def claimed_ports(host: str, slot: int, *, folder: Path | None = None) -> Iterator[ServerPorts]:
    """Hold the first block from `slot` on (wrapping round) that no dvfs worker of this node
    holds and where no other program listens, until the context ends."""
    folder = folder or lock_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # shared by every user's dvfs, as /tmp is
            if folder.stat().st_uid == os.getuid():
                folder.chmod(0o1777)
    except OSError as exc:
        raise EngineError(f"cannot use {folder} for SGLang port locks: {exc.strerror}") from exc
    busy: list[str] = []
    for k in range(PORT_SLOTS):
        ports = ServerPorts.for_slot(slot + k)
        fd = _lock(folder, ports)
        if fd is None:
            continue
        why = taken(host, ports.used)
        if why is None:
            try:
                yield ports
            finally:
                os.close(fd)
            return
        os.close(fd)
        busy.append(why)
    raise EngineError(
        f"no free block of SGLang ports on {host} ({len(busy)} held by other programs, e.g. "
        f"{'; '.join(busy[:2]) or 'none'}; the rest by other dvfs workers): stop some, then "
        "rerun"
    )


def _held(folder: Path, ports: ServerPorts) -> bool:
    """Whether a dvfs worker holds `ports`' block now (its lock file locked), found without
    creating a file or keeping a lock."""
    import fcntl

    path = folder / f"{ports.http}.lock"
    if not path.is_file():
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # another user's lock file, not open to others: theirs, as `_lock` takes it
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # dropped at once, with the descriptor
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def short_of_blocks(host: str, count: int, *, folder: Path | None = None) -> str | None:
    """Why `count` workers starting SGLang servers on `host` could not each claim a block of
    ports now (`claimed_ports`): fewer free blocks than workers, those held by other dvfs
    workers or by other programs; None when there are enough. Read-only (`dvfs doctor`): no
    lock file is created and no lock kept."""
    folder = folder or lock_dir()
    free = 0
    dvfs_held = 0
    others: list[str] = []
    for slot in range(PORT_SLOTS):
        ports = ServerPorts.for_slot(slot)
        if _held(folder, ports):
            dvfs_held += 1
            continue
        why = taken(host, ports.used)
        if why is not None:
            others.append(why)
            continue
        free += 1
        if free >= count:
            return None
    said = f", e.g. {'; '.join(others[:2])}" if others else ""
    return (
        f"{count} SGLang servers need {count} blocks of ports on {host}, but only {free} of "
        f"{PORT_SLOTS} are free ({dvfs_held} held by other dvfs workers, {len(others)} by other "
        f"programs{said}): stop some, or give the node fewer GPU groups"
    )
