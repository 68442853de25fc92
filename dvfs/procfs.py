"""What Linux's /proc says of processes: a server's process tree, when a process started, its
command name, which of a tree's processes died unreaped (`dead_members`), and who listens
on a TCP port and address. Every reader answers None or nothing
where /proc is missing, a process is gone or not ours to read, or a file holds what it should
not: a process's name is any bytes its program chose (not UTF-8, parentheses, spaces), and one
such process anywhere on the machine must not stop a sweep."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

PROC = Path("/proc")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


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
    """A process's command name (/proc/<pid>/comm), None when it is gone or not ours to read;
    characters that do not print (a newline, an escape: any 15 bytes a program chose) as '?',
    so an error naming it stays one line."""
    text = _read(proc / str(pid) / "comm")
    if text is None:
        return None
    name = text.removesuffix("\n")
    return "".join(c if c.isprintable() else "?" for c in name).strip() or None


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


def dead_members(root: int, proc: Path = PROC) -> dict[int, int | None]:
    """The processes of `root`'s tree (`server_pids`) but `root` that have died and wait for
    their parent to reap them (zombies: state Z), each with how it ended as waitpid(2) words it
    (stat's 52nd field, exit_code, from Linux 3.5; None where it cannot be read)."""
    dead: dict[int, int | None] = {}
    for pid in sorted(server_pids(root, proc) - {root}):
        fields = _stat_fields(pid, proc)
        if not fields or fields[0] != "Z":
            continue
        try:
            dead[pid] = int(fields[49])
        except (IndexError, ValueError):
            dead[pid] = None
    return dead


def _listen_address(text: str) -> Address:
    """A local address as /proc/net/tcp and tcp6 write it: hex 32-bit words, each in the
    host's byte order ("0100007F" is 127.0.0.1 on a little-endian machine); an IPv4-mapped
    IPv6 address (::ffff:127.0.0.1) as the IPv4 address it is."""
    raw = b"".join(
        int(text[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(text), 8)
    )
    address = ipaddress.ip_address(raw)
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return mapped or address


def connect_addresses(host: str) -> frozenset[Address] | None:
    """The addresses a client connecting to `host` (engine.sglang.host: an address or a name)
    reaches: its own, each a name resolves to, and for an unspecified one (0.0.0.0, ::) the
    loopback Linux connects it to. None when it does not resolve (then any address)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    addresses: set[Address] = set()
    for *_, sockaddr in found:
        with contextlib.suppress(ValueError):
            address = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
            if address.is_unspecified:
                address = ipaddress.ip_address("127.0.0.1" if address.version == 4 else "::1")
            mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
            addresses.add(mapped or address)
    return frozenset(addresses) or None


def _taking(listeners: Sequence[tuple[Address, str]], target: Address) -> list[str]:
    """The sockets among `listeners` (address, inode; one port) that Linux hands a connection
    to `target`: the most specific that listen where it goes, the address's own, else its
    family's wildcard (0.0.0.0, ::), else, for IPv4, :: (dual stack, as Linux lets it unless
    the program set IPV6_V6ONLY, which /proc does not tell; beside an IPv4 listener on the
    port it took none either way: set, or outranked)."""
    exact = [inode for address, inode in listeners if address == target]
    wildcard = [
        inode
        for address, inode in listeners
        if address.is_unspecified and address.version == target.version
    ]
    dual = [
        inode
        for address, inode in listeners
        if target.version == 4 and address.is_unspecified and address.version == 6
    ]
    return exact or wildcard or dual


def port_holders(
    port: int,
    pids: Sequence[int] | None = None,
    proc: Path = PROC,
    *,
    host: str | None = None,
) -> frozenset[int]:
    """The processes (among `pids`, else all) holding a TCP socket listening on `port`, IPv4 or
    IPv6, that takes the connections a client makes to `host` (`connect_addresses`,
    `_taking`; None: on any address), as far as /proc tells: processes this user may not read
    are left out, and elsewhere than Linux none is found."""
    inodes = listening_sockets(port, proc, host=host)
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


def listening_sockets(port: int, proc: Path = PROC, *, host: str | None = None) -> frozenset[str]:
    """The TCP sockets ("socket:[inode]", as /proc/<pid>/fd links name them) listening on
    `port`, IPv4 or IPv6, that take the connections a client makes to `host` (None: on any
    address), from /proc/net/tcp and tcp6 (every user's sockets; empty elsewhere than Linux)."""
    targets = connect_addresses(host) if host is not None else None
    listeners: list[tuple[Address, str]] = []
    for table in ("net/tcp", "net/tcp6"):
        text = _read(proc / table)
        for line in text.splitlines()[1:] if text is not None else ():
            # "sl local_address rem_address st ... inode": st 0A is LISTEN
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":
                with contextlib.suppress(ValueError, IndexError):
                    address, _, hex_port = fields[1].rpartition(":")
                    if int(hex_port, 16) == port:
                        listeners.append((_listen_address(address), f"socket:[{fields[9]}]"))
    if targets is None:
        return frozenset(inode for _, inode in listeners)
    return frozenset(inode for target in targets for inode in _taking(listeners, target))


def is_local(host: str) -> bool:
    """Whether a client connecting to `host` reaches this machine: every address the name
    resolves to is a loopback or unspecified one, or one this machine holds (it binds)."""
    addresses = connect_addresses(host)
    if addresses is None:
        return False
    for address in addresses:
        if address.is_loopback:
            continue
        family = socket.AF_INET if address.version == 4 else socket.AF_INET6
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((str(address), 0))
        except OSError:
            return False
    return True


def earlier_holder(
    port: int, server: int, proc: Path = PROC, *, host: str | None = None
) -> int | None:
    """A process listening on `port`, where a client connecting to `host` reaches it (None:
    any address; `port_holders`), that started before the process `server` (so neither it
    nor anything it started: another program), None when none is seen. Processes the server
    started (its tree, or a wrapper's: a container, srun) are never older than it. A program
    on another address of that port (127.0.0.2, ::1 for 127.0.0.1) is not what answers there."""
    if port_holders(port, sorted(server_pids(server, proc)), proc, host=host):
        return None  # the server's own tree listens there
    born = start_ticks(server, proc)
    if born is None:
        return None
    for pid in sorted(port_holders(port, None, proc, host=host)):
        started = start_ticks(pid, proc)
        if started is not None and started < born:
            return pid
    return None
