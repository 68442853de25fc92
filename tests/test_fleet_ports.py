"""Servers started together on one node never share a port (issue 12): each fleet worker's
SGLang server gets its own block (--port, --nccl-port, and the ports SGLang derives from
--port), checked before any server starts and against what each server reports."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from conftest import replace_block
from sglang_support import load_stub, running, stub_campaign

from dvfs.campaign import load_campaign
from dvfs.cli import cli
from dvfs.engines.sglang import PORT_MOVES
from dvfs.engines.sglang_args import (
    FIRST_PORT,
    PORT_BLOCK,
    PORT_SLOTS,
    ZMQ_PORT_OFFSET,
    ServerPorts,
    check_distinct_ports,
    launch_argv,
)
from dvfs.errors import EngineError
from dvfs.fleet.ports import PortBlock, claimed_ports
from dvfs.measure.journal import read_records

VERSIONS = ("0.5.9", "0.5.23")


def sweep(*args: str) -> Result:
    return CliRunner().invoke(cli, ["sweep", *args, "--no-progress"], catch_exceptions=False)


@pytest.mark.parametrize("version", VERSIONS)
def test_eight_servers_argv_parse_and_their_ports_are_distinct(
    version: str, tmp_path: Path
) -> None:
    """Eight workers' argv, parsed by the version's own option table: each server listens on
    its block; no port of one block (its --port, --nccl-port, SGLang's ZMQ ports) is
    another's, and every block stays below the kernel's ephemeral range."""
    stub = load_stub()
    path, _ = stub_campaign(tmp_path, version=version)
    campaign = load_campaign(path)
    blocks = [ServerPorts.for_slot(slot) for slot in range(8)]
    for ports, drafter in zip(blocks, itertools.cycle(campaign.drafters), strict=False):
        argv = launch_argv(campaign, drafter, port=1, version=version, ports=ports)
        args, _ = stub.parse_launch_argv(argv[2:], stub.StubConfig(version=version))
        assert int(args["port"]) == ports.http and int(args["nccl_port"]) == ports.nccl
    used = [set(b.used) for b in blocks]
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(used, 2))
    assert all(b.http + ZMQ_PORT_OFFSET in b.used for b in blocks)
    assert max(max(u) for u in used) < 32768 and min(min(u) for u in used) >= FIRST_PORT
    check_distinct_ports([(f"gpu{i}", "node", b) for i, b in enumerate(blocks)])
    # Port flags of the campaign's own would move a server out of its block: refused (in
    # engine.sglang.extra_args: a drafter's take only speculative flags).
    bad = replace_block(
        path.read_text(), "[drafters.none]", 'extra_args = ["--nccl-p", "9"]\n[drafters.none]'
    )
    path.write_text(bad)
    none = next(d for d in load_campaign(path).drafters if d.name == "none")
    with pytest.raises(EngineError, match="--nccl-p in the extra_args of drafter 'none'"):
        launch_argv(load_campaign(path), none, port=1, version=version, ports=blocks[0])


def test_blocks_of_one_node_are_checked_distinct() -> None:
    """Slots wrap past the range; two workers of one node on one block are refused, on two
    nodes they are not (each node has its own ports)."""
    again = ServerPorts.for_slot(PORT_SLOTS)
    assert again == ServerPorts.for_slot(0)
    check_distinct_ports([("a/gpu0", "a", again), ("b/gpu0", "b", ServerPorts.for_slot(0))])
    with pytest.raises(EngineError, match=r"workers gpu0 and gpu48 on a would share port 20000"):
        check_distinct_ports([("gpu0", "a", ServerPorts.for_slot(0)), ("gpu48", "a", again)])


def test_a_claimed_block_is_held_until_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claims on one node (threads here, processes alike) never get the same block; a block
    is free again once its holder lets go; a slot past the range wraps round. (The locks
    alone: no port counts as another program's, though another test's server may listen.)"""
    monkeypatch.setattr("dvfs.fleet.ports.taken", lambda host, ports: None)
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(claimed_ports("127.0.0.1", 3, folder=tmp_path))
        second = stack.enter_context(claimed_ports("127.0.0.1", 3, folder=tmp_path))
        assert (first, second) == (ServerPorts.for_slot(3), ServerPorts.for_slot(4))
    with claimed_ports("127.0.0.1", 3 + PORT_SLOTS, folder=tmp_path) as again:
        assert again == first
    assert ServerPorts.for_slot(4).http == FIRST_PORT + 4 * PORT_BLOCK


def test_a_host_no_server_can_listen_on_lets_the_block_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claiming a block on a host no server can listen on (192.0.2.1, a documentation address
    no machine holds) fails in one line, and lets the block's lock go: it was left held by the
    process until it ended. (The claim on 127.0.0.1 counts its locks alone: another test's
    server may listen there.)"""
    import dvfs.fleet.ports as ports_module

    real = ports_module.taken

    def taken(host: str, ports: Any) -> str | None:
        return None if host == "127.0.0.1" else real(host, ports)

    monkeypatch.setattr(ports_module, "taken", taken)
    folder = tmp_path / "locks"
    refused = pytest.raises(EngineError, match="cannot listen on engine.sglang.host '192.0.2.1'")
    with refused, claimed_ports("192.0.2.1", 3, folder=folder):
        pass
    with claimed_ports("127.0.0.1", 3, folder=folder) as ports:
        assert ports == ServerPorts.for_slot(3)  # the first block, free again


def test_a_block_moves_to_the_next_free_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PortBlock.move` claims the next block no one holds before letting its own go, says so
    in one line; with none free it keeps its own and says what to do."""
    monkeypatch.setattr("dvfs.fleet.ports.taken", lambda host, ports: None)  # the locks alone
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        block = stack.enter_context(PortBlock("127.0.0.1", 3, note=notes.append, folder=tmp_path))
        stack.enter_context(claimed_ports("127.0.0.1", 4, folder=tmp_path))  # another worker's
        assert block.move("port 20768: Address already in use") == ServerPorts.for_slot(5)
        assert block.ports == ServerPorts.for_slot(5)
        last = ServerPorts.for_slot(5).http + PORT_BLOCK - 1
        assert notes == [
            "port 20768: Address already in use: another program took it after dvfs claimed "
            f"the block; the worker's servers move to ports {ServerPorts.for_slot(5).http}-{last}"
        ]
        with claimed_ports("127.0.0.1", 3, folder=tmp_path) as freed:
            assert freed == ServerPorts.for_slot(3), "the old block is let go"
        for _ in range(PORT_SLOTS - 2):  # every other block held too: nowhere to move
            stack.enter_context(claimed_ports("127.0.0.1", 0, folder=tmp_path))
        with pytest.raises(EngineError, match="no free block of SGLang ports on 127.0.0.1"):
            block.move("port 21280: Address already in use")
        assert block.ports == ServerPorts.for_slot(5) and len(notes) == 1
    with claimed_ports("127.0.0.1", 5, folder=tmp_path) as again:
        assert again == ServerPorts.for_slot(5), "closed: its block is free"


def test_a_port_freed_within_the_wait_does_not_count_as_held() -> None:
    """A port of the block held for a moment (the processes of the worker's last server
    exiting) is waited out; one held past the wait is reported."""
    with PortBlock("127.0.0.1", 0) as block:  # held in the node's folder: no dvfs uses it
        holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            holder.bind(("127.0.0.1", block.ports.nccl))
        except OSError:
            holder.close()
            pytest.skip(f"port {block.ports.nccl} is in use here")
        holder.listen()
        assert block.held_elsewhere() == f"port {block.ports.nccl}: Address already in use"
        release = threading.Timer(0.3, holder.close)
        release.start()
        try:
            assert block.held_elsewhere(wait_s=60) is None
        finally:
            release.cancel()
            holder.close()


@pytest.mark.timeout(300)
def test_eight_workers_on_one_node_use_distinct_ports(tmp_path: Path) -> None:
    """Eight twin GPUs, each worker its own SGLang (the stub) on loopback: every server is on
    its worker's block, and no two blocks share a port; none is left running."""
    # One drafter, eight cells: a server per worker, none restarted for a drafter change.
    path, marker = stub_campaign(
        tmp_path, drafters='[drafters.none]\nalgorithm = "none"\n', measurement_extra="repeats = 2"
    )
    out = tmp_path / "out"
    result = sweep(str(path), "--gpus", "0-7", "--out", str(out))
    assert result.exit_code == 0, result.output
    records = read_records(out / "journal.jsonl")
    session = next(r for r in records if r["type"] == "session")
    plans = {w["worker"]: ServerPorts.from_json(w["ports"]) for w in session["workers"]}
    assert len(plans) == 8
    for a, b in itertools.combinations(plans.values(), 2):
        assert set(a.used).isdisjoint(b.used)
    servers = [r for r in records if r["type"] == "server"]
    assert len({s["worker"] for s in servers}) >= 2, "servers must run side by side"
    for server in servers:  # on its worker's block (or the one it moved to: its record's)
        ports = ServerPorts.from_json(server["ports"])
        assert ports == plans[server["worker"]] or f"{server['worker']}: port " in result.output
        assert int(server["args"]["port"]) == ports.http
        assert int(server["args"]["nccl_port"]) == ports.nccl
    assert not running(marker), "a server was left running"


def test_ports_held_elsewhere_move_the_workers(tmp_path: Path) -> None:
    """Block 0 is another program's (it listens on its --port), another block another dvfs
    worker's (it holds its lock): the two workers skip both and take other blocks, one each.
    On the node's one lock folder, as every dvfs (another test's fleet too) uses it: block 0
    is listened on only while no dvfs holds it, and every other block the workers may take is
    one no other dvfs holds, so no exact block is asserted."""
    # One drafter, one batch: a cell per clock, a server per worker.
    path, marker = stub_campaign(
        tmp_path, drafters='[drafters.none]\nalgorithm = "none"\n', batch="[1]"
    )
    block0 = ServerPorts.for_slot(0)
    with contextlib.ExitStack() as stack:
        holder = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        with claimed_ports("127.0.0.1", 0) as ours:
            if ours != block0:  # another dvfs holds block 0, or another program listens there
                pytest.skip(f"block {FIRST_PORT} is in use here")
            try:
                holder.bind(("127.0.0.1", FIRST_PORT))
            except OSError:
                pytest.skip(f"port {FIRST_PORT} is in use here")
            holder.listen()  # any dvfs claiming block 0 from now on finds it held
        other = stack.enter_context(claimed_ports("127.0.0.1", 1))
        result = sweep(str(path), "--gpus", "0-1", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    session = next(
        r for r in read_records(tmp_path / "out" / "journal.jsonl") if r["type"] == "session"
    )
    blocks = [ServerPorts.from_json(w["ports"]) for w in session["workers"]]
    assert len(set(blocks)) == 2, blocks
    assert block0 not in blocks and other not in blocks, (blocks, other)
    assert not running(marker)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["after the claim", "at the server's start"])
def test_a_port_taken_after_the_claim_moves_the_worker(
    when: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another program takes the --port of each worker's block after the worker claimed it:
    before its server starts (dvfs finds it held then), or as it starts (the server fails to
    listen, "Address already in use", as SGLang does). Each worker gives that block up for the
    next free one and says so in one line: every cell is measured, each server record names
    the block its server used, and two workers never share one."""
    import dvfs.engines.sglang as engine
    import dvfs.fleet.ports as node_ports

    # One drafter, two batches: a comparison group (two clocks) and a server per worker.
    path, marker = stub_campaign(tmp_path, drafters='[drafters.none]\nalgorithm = "none"\n')
    claimed: list[ServerPorts] = []  # each worker's block as it opens, before any server
    listeners: dict[int, socket.socket] = {}  # the other program's, by port

    def listen_on(port: int) -> None:
        listeners[port] = holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        holder.bind(("127.0.0.1", port))
        holder.listen()

    real_claim, real_argv = node_ports.claimed_ports, engine.launch_argv

    @contextlib.contextmanager
    def claim_then_taken(host: str, slot: int, **kwargs: Any) -> Iterator[ServerPorts]:
        with real_claim(host, slot, **kwargs) as ports:
            if len(claimed) < 2:  # the two workers' claims as they open
                claimed.append(ports)
                if when == "after the claim":
                    listen_on(ports.http)
            yield ports

    def taken_at_start(*args: Any, **kwargs: Any) -> list[str]:
        argv = real_argv(*args, **kwargs)
        port = int(argv[argv.index("--port") + 1])
        first = {p.http for p in claimed}
        if when != "after the claim" and port in first and port not in listeners:
            listen_on(port)  # after whatever dvfs checks, before the server listens
        return argv

    monkeypatch.setattr(node_ports, "claimed_ports", claim_then_taken)
    monkeypatch.setattr(engine, "launch_argv", taken_at_start)
    monkeypatch.setattr(engine, "PORT_SETTLE_S", 0.2)  # held for good: nothing to wait out
    monkeypatch.setattr("dvfs.engines.sglang_client.HEALTH_PROBE_S", 0.5)  # a silent holder
    out = tmp_path / "out"
    try:
        result = sweep(str(path), "--gpus", "0-1", "--out", str(out))
    finally:
        for holder in listeners.values():
            holder.close()
    assert result.exit_code == 0, result.output
    assert sorted(listeners) == sorted(p.http for p in claimed), "each first block was taken"
    records = read_records(out / "journal.jsonl")
    cells = [r for r in records if r["type"] == "cell"]
    assert len(cells) == 4 and all(c["status"] == "ok" for c in cells), result.output
    # The session keeps the blocks claimed at the start; each server record, its own.
    session = next(r for r in records if r["type"] == "session")
    first = {w["worker"]: ServerPorts.from_json(w["ports"]) for w in session["workers"]}
    assert set(first.values()) == set(claimed)
    used: dict[str, ServerPorts] = {}
    for server in (r for r in records if r["type"] == "server"):
        ports = ServerPorts.from_json(server["ports"])
        assert ports not in claimed, "a server ran on a block where another program listens"
        assert int(server["args"]["port"]) == ports.http
        assert int(server["args"]["nccl_port"]) == ports.nccl
        used[server["worker"]] = ports
    assert sorted(used) == sorted(first)
    check_distinct_ports([(worker, "node", ports) for worker, ports in used.items()])
    said = " ".join(result.output.split())  # the notes, however wrapped
    for worker, ports in used.items():
        moves = re.findall(
            rf"{worker}: port (\d+): Address already in use: [^;]*; the worker's servers move "
            r"to ports (\d+)-(\d+)",
            said,
        )
        last = ports.http + PORT_BLOCK - 1
        assert moves == [(str(first[worker].http), str(ports.http), str(last))], result.output
    if when != "after the claim":  # the servers did fail to listen there first
        logs = [p.read_text() for p in out.rglob("server-*.log")]
        assert sum("Address already in use" in text for text in logs) == 2
    assert not running(marker)


@pytest.mark.timeout(300)
def test_a_worker_moves_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should another program take a port of every block a worker claims, each start moves
    `PORT_MOVES` times, then fails as a server that cannot listen fails: the cells fail, the
    sweep ends."""
    import dvfs.fleet.ports as node_ports

    path, marker = stub_campaign(tmp_path, drafters='[drafters.none]\nalgorithm = "none"\n')
    listeners: list[socket.socket] = []
    real_claim = node_ports.claimed_ports

    @contextlib.contextmanager
    def claim_then_taken(host: str, slot: int, **kwargs: Any) -> Iterator[ServerPorts]:
        with real_claim(host, slot, **kwargs) as ports:
            listeners.append(holder := socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            holder.bind(("127.0.0.1", ports.http))
            holder.listen()
            yield ports

    monkeypatch.setattr(node_ports, "claimed_ports", claim_then_taken)
    monkeypatch.setattr("dvfs.engines.sglang.PORT_SETTLE_S", 0.2)  # held for good
    # the servers' health requests reach the silent holder: no need to wait long on it
    monkeypatch.setattr("dvfs.engines.sglang_client.HEALTH_PROBE_S", 0.5)
    out = tmp_path / "out"
    try:
        result = sweep(str(path), "--gpus", "0-1", "--out", str(out))
    finally:
        for holder in listeners:
            holder.close()
    assert result.exit_code == 5, result.output
    said = " ".join(result.output.split())
    for worker in ("gpu0", "gpu1"):
        moves = re.findall(rf"{worker}: port \d+: Address already in use: [^;]*; the worker", said)
        assert len(moves) == PORT_MOVES, result.output
    assert len(listeners) == 2 * (1 + PORT_MOVES)
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == 4 and all(c["status"] == "failed" for c in cells)
    assert all("Address already in use" in " ".join(c["errors"]) for c in cells)
    assert not running(marker)


def test_a_fleet_whose_servers_would_share_a_port_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should two workers of one node get one block (forced here), the run stops before any
    server starts, in one error line (after the workers' notes on what they measured
    meanwhile, each said as it started)."""
    path, marker = stub_campaign(tmp_path)
    one = ServerPorts.for_slot(5)

    @contextlib.contextmanager
    def same_block(host: str, slot: int, **_: object) -> Iterator[ServerPorts]:
        yield one  # a node whose workers got one block (what the claims prevent)

    monkeypatch.setattr("dvfs.fleet.ports.claimed_ports", same_block)
    result = sweep(str(path), "--gpus", "0-1", "--out", str(tmp_path / "out"))
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    [error] = [line for line in lines if line.startswith("Error: ")]
    assert error == lines[-1] and "Traceback" not in result.output, result.output
    assert "workers gpu0 and gpu1 on" in error and f"share port {one.http}" in error
    assert not (tmp_path / "out" / "journal.jsonl").exists(), "refused before any journal"
    assert not running(marker)


@pytest.mark.skipif(os.geteuid() != 0, reason="the link check applies to root only")
def test_as_root_a_users_link_among_the_port_locks_is_refused_not_made_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port locks' folder ($TMPDIR/dvfs-ports) is every user's, made 1777 by the first
    dvfs to use it: a user's link there as the first block's lock file (`20000.lock`) had
    `sudo dvfs sweep --gpus 0-1` (a fleet of SGLang servers) open its target, any root file,
    and make it world-writable (0666, as lock files are), and a user's link as the folder
    itself had root make its target folder 1777. As root both are refused in one line, exit
    2, the target's mode unchanged."""
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    path, marker = stub_campaign(tmp_path, drafters='[drafters.none]\nalgorithm = "none"\n')
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o700)
    secret = etc / "shadow"
    secret.write_text("root's\n")
    secret.chmod(0o600)
    ports = tmp_path / "ports"
    ports.mkdir()
    ports.chmod(0o1777)
    os.chown(ports, nobody, nobody)
    lock = ports / f"{FIRST_PORT}.lock"
    lock.symlink_to(secret)
    os.chown(lock, nobody, nobody, follow_symlinks=False)
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    folder = sticky / "dvfs-ports"
    folder.symlink_to(etc)
    os.chown(folder, nobody, nobody, follow_symlinks=False)
    for link, whose in (
        (lock, f"in {ports}, which its owner nobody may write"),
        (folder, "owned by nobody"),
    ):
        monkeypatch.setenv("DVFS_PORT_LOCK_DIR", str(link.parent if link == lock else folder))
        result = sweep(str(path), "--gpus", "0-1", "--out", str(tmp_path / link.name))
        assert result.exit_code == 2, result.output
        assert f"goes through the symbolic link {link}, {whose}: it may be pointed at any file" in (
            " ".join(result.output.split())
        )
        assert secret.stat().st_mode & 0o7777 == 0o600 and etc.stat().st_mode & 0o7777 == 0o700
    assert not running(marker)
