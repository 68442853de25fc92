"""A node's blocks of SGLang ports, claimed by the workers that run servers there.

Each worker holds one block (`ServerPorts`: its server's --port, --nccl-port and the ports
SGLang derives from --port) at a time, for its life: an exclusive lock on
`<lock dir>/<port>.lock`, which the kernel drops when the process dies, however it dies. Workers
of one fleet (threads, or Ray actors on one node), and of other dvfs sweeps on the node, so
never pick the same block, whatever their number in their fleet; a block where another program
listens is skipped too. A lock keeps only dvfs off a block: another program may still take one
of its ports before a server listens there, so a worker's `PortBlock` trades its block for the
next free one when that happens (the engine asks, before a server starts and after a start
that failed).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from dvfs.engines.sglang_args import (
    FIRST_PORT,
    PORT_BLOCK,
    PORT_SLOTS,
    ServerPorts,
    host_family,
    unlistenable,
)
from dvfs.errors import EngineError
from dvfs.outputs import check_links

#: Where a node's port locks live (one folder for every dvfs on the node).
LOCK_DIR_ENV = "DVFS_PORT_LOCK_DIR"


def lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "dvfs-ports")


def taken(host: str, ports: Sequence[int]) -> str | None:
    """The first of `ports` another program holds on `host` ("port N: why"), or None."""
    for port in ports:
        try:
            with socket.socket(host_family(host), socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError as exc:  # the socket too: no IPv6 socket where the kernel has no IPv6
            wrong = unlistenable(host, exc)  # not a port taken: no block would do
            if wrong is not None:
                raise wrong from exc
            return f"port {port}: {exc.strerror}"
    return None


def _lock(folder: Path, ports: ServerPorts) -> int | None:
    """The locked file descriptor of `ports`' block, or None when another holds it."""
    import fcntl

    path = folder / f"{ports.http}.lock"
    check_links(path)  # as root, never made 0666 through another user's link to a root file
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
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
    check_links(folder)  # as root, not made 1777 through another user's link to a root folder
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
        try:
            why = taken(host, ports.used)
        except BaseException:  # a host no server can listen on: the block is let go too
            os.close(fd)
            raise
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


class PortBlock:
    """A worker's block of ports (`claimed_ports`, from `slot` on), held until `close`, and
    traded for the next free one by `move` when another program has taken one of its ports:
    the new block is claimed before the old one is let go, so no two workers ever hold one.
    `note` says each move in one line."""

    def __init__(
        self,
        host: str,
        slot: int,
        *,
        note: Callable[[str], None] | None = None,
        folder: Path | None = None,
    ) -> None:
        self.host = host
        self.folder = folder
        self._note = note
        self._held = contextlib.ExitStack()
        #: The block its servers use now.
        self.ports: ServerPorts = self._held.enter_context(claimed_ports(host, slot, folder=folder))

    def __enter__(self) -> PortBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._held.close()

    def held_elsewhere(self, wait_s: float = 0.0) -> str | None:
        """The first port of the block another program holds ("port N: why"), or None: one
        still held after `wait_s` (a process of the worker's last server may be exiting)."""
        deadline = time.monotonic() + wait_s
        while (why := taken(self.host, self.ports.used)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return why

    def move(self, why: str) -> ServerPorts:
        """Claim the next free block after this one (`why`: what is wrong with this one), then
        let this one go; EngineError when no block is free."""
        held = contextlib.ExitStack()
        slot = (self.ports.http - FIRST_PORT) // PORT_BLOCK + 1
        ports = held.enter_context(claimed_ports(self.host, slot, folder=self.folder))
        self._held.close()
        self._held, self.ports = held, ports
        if self._note is not None:
            self._note(
                f"{why}: another program took it after dvfs claimed the block; the worker's "
                f"servers move to ports {ports.http}-{ports.http + PORT_BLOCK - 1}"
            )
        return ports


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
