"""What Linux's /proc says of processes: a server's process tree, when a process started, its
command name, and who listens on a TCP port. Every reader answers None or nothing where /proc
is missing, a process is gone or not ours to read, or a file holds what it should not: a
process's name is any bytes its program chose (not UTF-8, parentheses, spaces), and one such
process anywhere on the machine must not stop a sweep."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

PROC = Path("/proc")


def _read(path: Path) -> str | None:
    """A /proc file's text, bytes that are not UTF-8 replaced; None when it cannot be read."""
    try:
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


def _stat_fields(pid: int | str, proc: Path = PROC) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on: "pid (comm) state ppid pgrp ...", where comm
    may hold spaces and parentheses, so the fields start after its last ')'."""
    text = _read(proc / str(pid) / "stat")
    if text is None:
        return None
    return text[text.rfind(")") + 2 :].split()


def _parent_and_group(pid: int | str, proc: Path = PROC) -> tuple[int, int] | None:
    """(parent pid, process group), None when the process is gone or unreadable."""
    fields = _stat_fields(pid, proc)
    try:
        return (int(fields[1]), int(fields[2])) if fields is not None else None
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int, proc: Path = PROC) -> int | None:
    """When a process started (clock ticks since boot: stat's 22nd field), None when it is
    gone or unreadable."""
    fields = _stat_fields(pid, proc)
    try:
        return int(fields[19]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def process_name(pid: int, proc: Path = PROC) -> str | None:
    """A process's command name (/proc/<pid>/comm), None when it is gone or not ours to read."""
    text = _read(proc / str(pid) / "comm")
    return (text.strip() or None) if text is not None else None


def server_pids(root: int, proc: Path = PROC) -> frozenset[int]:
    """`root`, the members of its process group (dvfs starts the server as a group leader) and
    the descendants of all of them, read from /proc (empty elsewhere but `root`)."""
    children: dict[int, list[int]] = {}
    ours = {root}
    try:
        entries = [e.name for e in proc.iterdir() if e.name.isdigit()]
    except OSError:
        return frozenset(ours)
    for name in entries:
        stat = _parent_and_group(name, proc)
        if stat is None:
            continue
        pid, (ppid, pgrp) = int(name), stat
        children.setdefault(ppid, []).append(pid)
        if pgrp == root:
            ours.add(pid)
    todo = list(ours)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in ours:
                ours.add(child)
                todo.append(child)
    return frozenset(ours)


def port_holders(port: int, pids: Sequence[int] | None = None, proc: Path = PROC) -> frozenset[int]:
    """The processes (among `pids`, else all) holding a TCP socket listening on `port`, IPv4 or
    IPv6, as far as /proc tells: processes this user may not read are left out, and elsewhere
    than Linux none is found."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        text = _read(proc / table)
        for line in text.splitlines()[1:] if text is not None else ():
            # "sl local_address rem_address st ... inode": st 0A is LISTEN
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":
                with contextlib.suppress(ValueError, IndexError):
                    if int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return frozenset()
    if pids is None:
        try:
            pids = [int(e.name) for e in proc.iterdir() if e.name.isdigit()]
        except OSError:
            return frozenset()
    holders = set()
    for pid in pids:
        try:
            fds = os.listdir(proc / str(pid) / "fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(proc / str(pid) / "fd" / fd) in inodes:
                    holders.add(pid)
                    break
    return frozenset(holders)


def earlier_holder(port: int, server: int, proc: Path = PROC) -> int | None:
    """A process listening on `port` that started before the process `server` (so neither it
    nor anything it started: another program), None when none is seen. Processes the server
    started (its tree, or a wrapper's: a container, srun) are never older than it."""
    if port_holders(port, sorted(server_pids(server, proc)), proc):
        return None  # the server's own tree listens there
    born = start_ticks(server, proc)
    if born is None:
        return None
    for pid in sorted(port_holders(port, None, proc)):
        started = start_ticks(pid, proc)
        if started is not None and started < born:
            return pid
    return None
