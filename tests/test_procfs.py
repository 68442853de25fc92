"""/proc readers (`dvfs.procfs`): a process whose name is not UTF-8, anywhere on the machine,
must not stop a sweep (its name is any bytes its program set)."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dvfs.procfs import (
    dead_members,
    earlier_holder,
    port_holders,
    process_name,
    server_pids,
    start_ticks,
)

#: A name a program may give itself (PR_SET_NAME takes any 15 bytes): not UTF-8, with a ')'
#: and a space where /proc/<pid>/stat's fields are split.
BAD_NAME = b"\xff\xfe bad) 1 2"


def _process(proc: Path, pid: int, name: bytes, ppid: int, pgrp: int, started: int) -> None:
    folder = proc / str(pid)
    (folder / "fd").mkdir(parents=True)
    (folder / "comm").write_bytes(name + b"\n")
    rest = ["S", str(ppid), str(pgrp)] + ["0"] * 16 + [str(started), "0"]
    (folder / "stat").write_bytes(b"%d (%s) " % (pid, name) + " ".join(rest).encode() + b"\n")


def _proc_address(address: str) -> str:
    """`address` as /proc/net/tcp{,6} writes it: hex 32-bit words in the host's byte order."""
    packed = ipaddress.ip_address(address).packed
    return "".join(
        f"{int.from_bytes(packed[i : i + 4], sys.byteorder):08X}" for i in range(0, len(packed), 4)
    )


def _listen(proc: Path, pid: int, port: int, inode: int, address: str = "127.0.0.1") -> None:
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
    header += "timeout inode\n"
    remote = _proc_address("::" if ":" in address else "0.0.0.0")
    line = f"   0: {_proc_address(address)}:{port:04X} {remote}:0000 0A 00000000:00000000 "
    line += f"00:00000000 00000000  0  0 {inode} 1\n"
    (proc / "net").mkdir(exist_ok=True)
    with (proc / "net" / ("tcp6" if ":" in address else "tcp")).open("a") as f:
        if f.tell() == 0:
            f.write(header)
        f.write(line)
    os.symlink(f"socket:[{inode}]", proc / str(pid) / "fd" / str(inode))


def test_names_that_are_not_utf8_are_read_and_the_fields_after_them_found(tmp_path: Path) -> None:
    """A server (100) whose child (101) named itself BAD_NAME, and another program (7, older)
    of that name listening on the server's port: the tree, the names (bytes replaced), the
    start times and the listener are all read, none raises."""
    proc = tmp_path / "proc"
    _process(proc, 100, b"python3", 1, 100, started=5000)
    _process(proc, 101, BAD_NAME, 100, 100, started=5001)
    _process(proc, 7, BAD_NAME, 1, 7, started=10)
    _listen(proc, 7, 30000, inode=4242)
    assert server_pids(100, proc) == frozenset({100, 101})
    assert process_name(101, proc) == BAD_NAME.decode("utf-8", errors="replace")
    assert (start_ticks(101, proc), start_ticks(7, proc)) == (5001, 10)
    assert port_holders(30000, None, proc) == frozenset({7})
    assert earlier_holder(30000, 100, proc) == 7
    assert process_name(999, proc) is None and start_ticks(999, proc) is None


def test_a_name_with_a_newline_or_escape_is_read_on_one_line(tmp_path: Path) -> None:
    """A process may name itself with a newline or an ANSI escape (PR_SET_NAME takes any 15
    bytes): its name, in the start's error naming a dead member or a tenant's note, is one
    printable line; its stat's fields are still found after the name's last ')'."""
    proc = tmp_path / "proc"
    _process(proc, 100, b"python3", 1, 100, started=5000)
    _process(proc, 101, b"a) Z\n\x1b[31m(b", 100, 100, started=5001)
    assert process_name(101, proc) == "a) Z??[31m(b"
    assert server_pids(100, proc) == frozenset({100, 101}) and start_ticks(101, proc) == 5001
    assert dead_members(100, proc) == {}
    (proc / "102").mkdir()
    (proc / "102" / "comm").write_bytes(b"\n\n")
    assert process_name(102, proc) == "?"  # named by a newline alone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_NAME is Linux's")
def test_a_real_process_named_in_bytes_that_are_not_utf8_is_in_its_parents_tree() -> None:
    """The real /proc: a child that named itself BAD_NAME (as any program on the machine may)
    stopped `server_pids` with a UnicodeDecodeError, so every SGLang sweep failed."""
    code = (
        "import ctypes, sys; libc = ctypes.CDLL(None); "
        f"libc.prctl(15, {BAD_NAME!r}, 0, 0, 0); print('named', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"named\n"
        assert child.pid in server_pids(os.getpid())
        name = process_name(child.pid)
        assert name is not None and name.startswith("\ufffd")
        assert start_ticks(child.pid) is not None
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)


@pytest.mark.parametrize(
    ("host", "listening", "blamed"),
    [
        ("127.0.0.1", "127.0.0.2", False),
        ("127.0.0.2", "127.0.0.1", False),
        ("127.0.0.1", "::1", False),
        ("::1", "127.0.0.1", False),
        ("::1", "0.0.0.0", False),
        ("127.0.0.1", "127.0.0.1", True),
        ("::1", "::1", True),
        ("127.0.0.1", "0.0.0.0", True),
        ("::1", "::", True),
        ("127.0.0.1", "::", True),  # dual-stack unless IPV6_V6ONLY, which /proc does not tell
        ("127.0.0.1", "::ffff:127.0.0.1", True),
        ("0.0.0.0", "127.0.0.1", True),  # a client connecting to 0.0.0.0 reaches the loopback
    ],
)
def test_an_earlier_listener_is_blamed_only_where_it_takes_the_servers_address(
    tmp_path: Path, host: str, listening: str, blamed: bool
) -> None:
    """An older program listening on the server's port but another address (127.0.0.2 or
    [::1] for 127.0.0.1, or the reverse) does not take the connections to the server's host:
    it was named as the program answering in the server's place, so dvfs stopped a server
    that served there. The same address, or a wildcard of its family, does."""
    proc = tmp_path / "proc"
    _process(proc, 100, b"python3", 1, 100, started=5000)
    _process(proc, 7, b"other", 1, 7, started=10)
    _listen(proc, 7, 30000, inode=4242, address=listening)
    assert earlier_holder(30000, 100, proc, host=host) == (7 if blamed else None)
    assert port_holders(30000, None, proc, host=host) == (frozenset({7}) if blamed else set())
    assert earlier_holder(30000, 100, proc) == 7  # no host: any address, as before


def test_the_servers_own_listener_on_another_address_does_not_clear_an_earlier_one(
    tmp_path: Path,
) -> None:
    """The server's tree listening on its port at another address than its host is not what
    answers there: an older program on the host's address is still named."""
    proc = tmp_path / "proc"
    _process(proc, 100, b"python3", 1, 100, started=5000)
    _process(proc, 7, b"other", 1, 7, started=10)
    _listen(proc, 100, 30000, inode=4243, address="127.0.0.2")
    _listen(proc, 7, 30000, inode=4242, address="127.0.0.1")
    assert earlier_holder(30000, 100, proc, host="127.0.0.1") == 7
    assert earlier_holder(30000, 100, proc, host="127.0.0.2") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/net is Linux's")
@pytest.mark.parametrize(("family", "address"), [("ipv4", "127.0.0.2"), ("ipv6", "::1")])
def test_a_real_listener_is_found_on_its_own_address_only(family: str, address: str) -> None:
    """The real /proc: this process listening on a loopback address is a holder of its port
    for that address, not for 127.0.0.1 or ::1 beside it."""
    kind = socket.AF_INET6 if family == "ipv6" else socket.AF_INET
    try:
        listener = socket.socket(kind, socket.SOCK_STREAM)
        listener.bind((address, 0))
    except OSError as exc:
        pytest.skip(f"cannot listen on {address} here: {exc}")
    with listener:
        listener.listen()
        port = listener.getsockname()[1]
        assert port_holders(port, [os.getpid()], host=address) == frozenset({os.getpid()})
        for other in {"127.0.0.1", "::1"} - {address}:
            assert port_holders(port, [os.getpid()], host=other) == frozenset(), other


@pytest.mark.parametrize(
    ("host", "older", "younger", "blamed"),
    [
        ("127.0.0.1", "::", "127.0.0.1", False),  # beside an IPv4 listener, :: is IPV6_V6ONLY
        ("127.0.0.1", "::", "0.0.0.0", False),
        ("127.0.0.1", "0.0.0.0", "127.0.0.1", False),  # the address's own before a wildcard
        ("::1", "::", "::1", False),
        ("127.0.0.1", "127.0.0.1", "0.0.0.0", True),
        ("127.0.0.1", "0.0.0.0", "::", True),
        ("::1", "::1", "::", True),
    ],
)
def test_an_earlier_listener_is_blamed_only_where_it_takes_the_connections_first(
    tmp_path: Path, host: str, older: str, younger: str, blamed: bool
) -> None:
    """Of the listeners on the server's port whose addresses take its host's, Linux hands a
    connection to the most specific: the address's own before a wildcard, an IPv4 wildcard
    before :: (and a :: beside an IPv4 listener of its port is IPV6_V6ONLY: it takes none).
    An older program on :: was blamed beside the server's own listener on 127.0.0.1 outside
    dvfs's process tree (a container's, started after it): the server that served stopped."""
    proc = tmp_path / "proc"
    _process(proc, 100, b"python3", 1, 100, started=5000)
    _process(proc, 7, b"other", 1, 7, started=10)
    _process(proc, 200, b"container", 1, 200, started=5100)  # not in the server's tree
    _listen(proc, 7, 30000, inode=4242, address=older)
    _listen(proc, 200, 30000, inode=4243, address=younger)
    assert earlier_holder(30000, 100, proc, host=host) == (7 if blamed else None)
    assert port_holders(30000, None, proc, host=host) == frozenset({7 if blamed else 200})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/net is Linux's")
def test_a_real_ipv6_only_listener_is_no_holder_beside_an_ipv4_one() -> None:
    """The real /proc: another process listening on [::] with IPV6_V6ONLY (nginx's default)
    and this one on 127.0.0.1, one port: a client connecting to 127.0.0.1 reaches this one
    alone, which alone holds the port for that host."""
    code = (
        "import socket, sys; s = socket.socket(socket.AF_INET6); "
        "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1); s.bind(('::', 0)); "
        "s.listen(); print(s.getsockname()[1], flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line.strip():
            pytest.skip("cannot listen on [::] here")
        port = int(line)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", port))
            listener.listen()
            pids = [child.pid, os.getpid()]
            with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
                assert client.getpeername()[1] == port
            assert port_holders(port, pids, host="127.0.0.1") == frozenset({os.getpid()})
            assert port_holders(port, pids, host="::1") == frozenset({child.pid})
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)


def test_a_port_docker_proxy_forwards_is_said_to_be_a_containers(tmp_path: Path) -> None:
    """`docker run -p 30000:30000` (as SGLang's images are run): on the host, docker-proxy holds
    the port and the server's processes are not in its tree. The warning said the server had
    not loaded its weights yet, or a PID namespace hid it, and to wait; it now names the proxy
    and what lets dvfs find the server."""
    from types import SimpleNamespace

    from dvfs.govern.servergpus import find_server_gpus

    proc = tmp_path / "proc"
    _process(proc, 900, b"dockerd", 1, 900, started=10)
    _process(proc, 901, b"docker-proxy", 900, 900, started=20)
    _process(proc, 950, b"python3", 940, 950, started=30)  # the container's server
    _listen(proc, 901, 30000, inode=4242, address="0.0.0.0")
    gpu = SimpleNamespace(
        identity=SimpleNamespace(index=0, uuid="GPU-0000"), compute_pids=lambda: frozenset({950})
    )
    got = find_server_gpus("http://127.0.0.1:30000", [gpu], proc)  # type: ignore[list-item]
    assert got.uuids is None and not got.lasting
    assert "forwarded by docker-proxy (pid 901)" in got.why and "--network host" in got.why
    assert "loaded its weights" not in got.why


def test_a_host_that_does_not_resolve_yet_is_looked_up_again_not_called_remote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--url naming this machine by a DNS name, the monitor started at boot before DNS answers:
    the name did not resolve, so it was "not on this machine", never looked at again, and
    every GPU counted for as long as it ran. A name that does not resolve is now tried again."""
    from dvfs.govern.servergpus import find_server_gpus

    def no_dns(*args: object, **kwargs: object) -> object:
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    got = find_server_gpus("http://gpu-node-17.example:30000", [])
    assert got.uuids is None and not got.lasting
    assert "gpu-node-17.example does not resolve" in got.why


def test_dead_members_of_a_tree_are_its_zombies_with_how_they_ended(tmp_path: Path) -> None:
    """A server (100) with a child killed outright and not reaped (101: state Z, stat's
    exit_code 9, SIGKILL), one that exited 0 (102), one dead whose stat is cut short (103: how
    unknown) and one alive (104); a zombie outside its tree (7) is not its. The root is never
    its own dead member (dvfs reaps it)."""
    proc = tmp_path / "proc"
    for pid, state, exit_code in [(101, "Z", "9"), (102, "Z", "0"), (104, "S", "0")]:
        folder = proc / str(pid)
        folder.mkdir(parents=True)
        rest = [state, "100", "100"] + ["0"] * 46 + [exit_code]
        (folder / "stat").write_text(f"{pid} (sglang::schedul) " + " ".join(rest) + "\n")
    _process(proc, 100, b"python3", 1, 100, started=5000)
    (proc / "103").mkdir()
    (proc / "103" / "stat").write_text("103 (python3) Z 100 100 0\n")
    (proc / "7").mkdir()
    (proc / "7" / "stat").write_text("7 (x) Z 1 7 " + " ".join(["0"] * 47) + "\n")
    assert dead_members(100, proc) == {101: 9, 102: 0, 103: None}
