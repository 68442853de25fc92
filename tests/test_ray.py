"""`dvfs sweep --executor ray` on a Ray cluster of this machine (loopback), twin GPUs as a
custom resource: the same cube as one GPU, and a killed actor loses no finished cell."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
import types
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import PYTHON, replace_block, write
from fleet_support import FLEET, assert_same_cells, refuse_servers_on, signalled_at

from dvfs.cli import cli
from dvfs.cube import STATUS_OK, open_cube
from dvfs.measure.journal import read_records

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

CAMPAIGN = FLEET


def sweep(*args: str) -> Result:
    return CliRunner().invoke(cli, ["sweep", *args, "--no-progress"], catch_exceptions=False)


@pytest.mark.timeout(300)
def test_ray_gives_the_cube_of_one_gpu(ray_cluster: object, shared_run, tmp_path: Path) -> None:
    one = shared_run(CAMPAIGN, "one")  # shared with the other fleet tests
    campaign = one.parent / "campaign.toml"
    # Two actors: as many as show the cells spread and merged (each one a process to start).
    result = sweep(
        str(campaign), "--gpus", "0-1", "--executor", "ray", "--out", str(tmp_path / "ray")
    )
    assert result.exit_code == 0, result.output
    cube = open_cube(tmp_path / "ray" / "cube.nc")
    assert (cube["cell_status"].values == STATUS_OK).all()
    assert_same_cells(cube, open_cube(one / "cube.nc"))
    records = read_records(tmp_path / "ray" / "journal.jsonl")
    workers = {r["worker"] for r in records if r["type"] == "cell"}
    assert len(workers) == 2 and all(w.endswith(("/gpu0", "/gpu1")) for w in workers)
    assert sum(r["type"] == "session" for r in records) == 1
    # Finished on H100 twins, the folder is not done for a fleet adding an H200 (a twin's
    # model is its profile's, wherever Ray runs it): refused as without Ray, not "0 cell(s)
    # measured" and an H100-only cube.
    mixed = sweep(
        str(campaign), "--gpus", "0,h200-sxm:0", "--executor", "ray", "--out", str(tmp_path / "ray")
    )
    assert mixed.exit_code == 1, mixed.output
    assert "holds a run on one GPU model" in mixed.output, mixed.output


def kill_once_journalled(
    monkeypatch: pytest.MonkeyPatch, ray: object, actor: str, cells: int, **kill: bool
) -> list[str]:
    """Kill the actor named `actor` as the driver journals the shipment that brings the
    journal to `cells` cells, in the driver's own thread: the kill lands mid-campaign however
    fast the machine (a thread polling the journal could find the campaign over). Returns the
    keys journalled by then (empty until the kill)."""
    from dvfs.fleet.driver import Fleet

    ship = Fleet.shipped
    journalled: list[str] = []
    before: list[str] = []

    def journal(self: Fleet, worker: str, shipment) -> None:  # type: ignore[no-untyped-def]
        ship(self, worker, shipment)
        journalled.extend(cell.key for cell in shipment.all_cells)
        if len(journalled) >= cells and not before:
            before.extend(journalled)
            ray.kill(ray.get_actor(actor, namespace="dvfs"), **kill)  # type: ignore[attr-defined]

    monkeypatch.setattr(Fleet, "shipped", journal)
    return before


@pytest.mark.timeout(300)
def test_a_killed_actor_loses_no_finished_cell(
    ray_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bigger = replace_block(
        CAMPAIGN, "sm_clock = [1980, 1410, 1005]", "sm_clock = [1980, 1710, 1410, 1200, 1005, 810]"
    )
    campaign = write(tmp_path / "rayed.toml", bigger)
    assert sweep(str(campaign), "--out", str(tmp_path / "one")).exit_code == 0
    out = tmp_path / "ray"
    # Once 20 cells are journalled, kill the actor of twin GPU 1.
    before = kill_once_journalled(monkeypatch, ray_cluster, "dvfs-gpu1", 20, no_restart=True)
    result = sweep(str(campaign), "--gpus", "0-1", "--executor", "ray", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert before, "the campaign ended before the kill"
    assert "lost" in result.output and "gpu1" in result.output
    records = read_records(out / "journal.jsonl")
    cells = [r for r in records if r["type"] == "cell"]
    keys = [r["key"] for r in cells]
    # Every cell journalled before the kill is still there, once; none is missing.
    assert set(before) <= set(keys)
    assert len(keys) == len(set(keys)) == 144 and all(r["status"] == "ok" for r in cells)
    lost = [r for r in records if r["type"] == "worker_lost"]
    assert [r["worker"].split("/")[-1] for r in lost] == ["gpu1"]
    assert_same_cells(open_cube(out / "cube.nc"), open_cube(tmp_path / "one" / "cube.nc"))


@pytest.mark.timeout(300)
def test_a_fresh_run_whose_every_actor_died_says_to_resume_without_fresh(
    ray_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --fresh run on Ray whose every actor died with cells left said "rerun the same command
    to resume": that command, --fresh and all, moves the journal aside and measures every cell
    again. It says to rerun without --fresh, which resumes: the cells journalled stay."""
    campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
    out = tmp_path / "ray"
    args = (str(campaign), "--gpus", "0", "--executor", "ray", "--out", str(out))
    # Once 20 cells are journalled, kill the only actor.
    killed = kill_once_journalled(monkeypatch, ray_cluster, "dvfs-gpu0", 20)
    result = sweep(*args, "--fresh")
    assert killed, "the campaign ended before the kill"
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert "rerun the same command without --fresh to resume" in said, said
    kept = {r["key"] for r in read_records(out / "journal.jsonl") if r["type"] == "cell"}
    resumed = sweep(*args)  # as the advice says
    assert resumed.exit_code == 0, resumed.output
    assert f"{len(kept)} already done" in resumed.output, resumed.output
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert kept <= {r["key"] for r in cells} and len({r["key"] for r in cells}) == 72


@pytest.mark.timeout(300)
def test_a_ray_fleet_whose_actor_died_before_any_unit_journals_no_session(
    ray_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume whose only actor is killed as the driver hands it its first unit: its
    `worker_lost` record brought the run's session into the journal with it, a session
    that measured nothing, which the next resume counted among the journal's runs. As the
    local fleet's, the run leaves the journal as it found it."""
    from dvfs.fleet.driver import Fleet

    campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
    out = tmp_path / "ray"
    args = (str(campaign), "--gpus", "0", "--executor", "ray", "--out", str(out))
    first = kill_once_journalled(monkeypatch, ray_cluster, "dvfs-gpu0", 20, no_restart=True)
    assert sweep(*args).exit_code == 1 and first  # 20 cells or more journalled, the rest left
    monkeypatch.undo()
    journal = out / "journal.jsonl"
    before = journal.read_bytes()
    started = Fleet.started
    killed: list[str] = []

    def kill_first(self: Fleet, worker: str, unit) -> None:  # type: ignore[no-untyped-def]
        if not killed:  # in the driver's thread, before the unit goes to the actor
            killed.append(worker)
            actor = ray_cluster.get_actor("dvfs-gpu0", namespace="dvfs")  # type: ignore[attr-defined]
            ray_cluster.kill(actor, no_restart=True)  # type: ignore[attr-defined]
        started(self, worker, unit)

    monkeypatch.setattr(Fleet, "started", kill_first)
    lost = sweep(*args)
    assert killed and lost.exit_code == 1, lost.output
    assert "every worker was lost" in " ".join(lost.output.split()), lost.output
    assert journal.read_bytes() == before
    monkeypatch.undo()
    resumed = sweep(*args)
    assert resumed.exit_code == 0, resumed.output
    records = read_records(journal)
    assert sum(r["type"] == "session" for r in records) == 2  # the first run's, the resume's
    assert sum(r["type"] == "worker_lost" for r in records) == 1  # the first run's


@pytest.mark.timeout(300)
def test_ctrl_c_journals_the_units_the_actors_finish(
    ray_cluster: object, shared_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C on the driver mid-run: each actor finishes its unit in flight before it closes,
    and those units are journalled (they were measured, then thrown away, and measured again
    by the rerun); the rerun finishes the rest, every cell once, with the cube of one GPU."""
    from dvfs.fleet.driver import Fleet, as_unit

    one = shared_run(CAMPAIGN, "one")  # shared with the other fleet tests
    campaign = one.parent / "campaign.toml"
    handed: list[str] = []  # every cell the driver handed to an actor
    shipped: list[str] = []  # and every cell it journalled, before the interruption
    interrupted: list[int] = []
    started, ship = Fleet.started, Fleet.shipped
    wait = ray_cluster.wait  # type: ignore[attr-defined]

    def hand(self: Fleet, worker: str, unit) -> None:  # type: ignore[no-untyped-def]
        handed.extend(cell.key for cell in as_unit(unit))
        started(self, worker, unit)

    def journal(self: Fleet, worker: str, shipment) -> None:  # type: ignore[no-untyped-def]
        shipped.extend(cell.key for cell in shipment.all_cells)
        ship(self, worker, shipment)

    def ctrl_c(refs, **kwargs):  # type: ignore[no-untyped-def]
        """Ctrl-C while the driver waits on its actors, once 16 cells are journalled (where
        SIGINT's handler raises it mid-run, at a point the test can count)."""
        if len(shipped) >= 16 and not interrupted:
            interrupted.append(len(shipped))  # the cells journalled by then
            raise KeyboardInterrupt
        return wait(refs, **kwargs)

    monkeypatch.setattr(Fleet, "started", hand)
    monkeypatch.setattr(Fleet, "shipped", journal)
    monkeypatch.setattr(ray_cluster, "wait", ctrl_c)
    out = tmp_path / "ray"
    args = [str(campaign), "--gpus", "0-1", "--executor", "ray", "--out", str(out)]
    result = CliRunner().invoke(cli, ["sweep", *args, "--no-progress"])
    assert result.exit_code != 0 and "GPU settings restored" in result.output, result.output
    keys = [r["key"] for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert interrupted and len(keys) < 72, "the interruption must land mid-campaign"
    assert len(handed) > interrupted[0]  # units were in flight
    # Every cell an actor was handed is in the journal, once: none was measured to be lost.
    assert sorted(keys) == sorted(handed)
    monkeypatch.undo()
    again = sweep(*args)
    assert again.exit_code == 0, again.output
    assert f"{len(keys)} already done" in again.output
    cells = [r["key"] for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == len(set(cells)) == 72
    assert_same_cells(open_cube(out / "cube.nc"), open_cube(one / "cube.nc"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_ray_fleet_of_real_gpus_attached_to_one_server_is_refused(
    ray_nvml, tmp_path: Path, dry_run: bool
) -> None:
    """Real GPUs on Ray: Ray places a worker on each of the cluster's GPUs (two here), not on
    gpu.devices, so a campaign attached to one server (engine.sglang.url) made two workers,
    each metering its own GPU while both sent their requests to that one server, as `--gpus
    0-1` is refused for. Refused in the same line (exit 2) before any actor opens a GPU or
    asks the server anything; the dry run too (it said nothing and exited 0)."""
    import socket

    from sglang_support import stub_campaign

    held = socket.socket()
    held.bind(("127.0.0.1", 0))  # nothing answers there, and nothing must be asked
    url = f"http://127.0.0.1:{held.getsockname()[1]}"
    try:
        path, _ = stub_campaign(
            tmp_path,
            drafters='\n[drafters.none]\nalgorithm = "none"\n',
            sglang_extra=f'url = "{url}"',
            batch="[1]",
            knobs="sm_clock = [1500]\nsettle_s = 0.0",
            gpu='backend = "nvml"\ndevices = [0]',
        )
        out = tmp_path / "out"
        dry = ["--dry-run", "--no-estimate"] if dry_run else []
        result = sweep(str(path), "--executor", "ray", *dry, "--out", str(out))
    finally:
        held.close()
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == (
        "Error: the Ray cluster places 2 workers (one per engine.tp_size = 1 GPU(s) of its "
        f"nodes), but engine.sglang.url attaches every one to the one server at {url}: each "
        "would meter its own GPUs while all their requests ran on that server; run without "
        "--executor ray on the server's node (gpu.devices naming its GPUs), or drop "
        "engine.sglang.url so that dvfs starts a server per worker"
    )
    assert not (out / "journal.jsonl").exists()
    assert ray_nvml.fake_calls("nvmlDeviceSetGpuLockedClocks") == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("executor", ["ray", "local"])
def test_a_fleet_worker_whose_attached_server_is_replaced_stops_the_sweep_in_its_line(
    ray_cluster: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, executor: str
) -> None:
    """A fleet of one twin worker attached to a server (engine.sglang.url) that is replaced
    between its cells (another started on its port with --dtype float16): on Ray (`--gpus 0
    --executor ray`), and on this machine (`--gpus 0` resuming that Ray run's folder: a fleet
    of one, as it reads the fleet's journal). The worker stops at once, as one GPU's sweep
    does, and the sweep ends in that stop's own line (exit 1), naming the change and saying
    to restart the server as it was. It ended 'every worker was lost with 1 cell(s) left
    (vm/gpu0: ServerReplacedError: the server ... its rounds would...): ...; rerun the same
    command to resume', the restart cut off. The cell measured before is in a partial cube,
    and the GPUs' settings restored are said so, as after a Ctrl-C."""
    import socket
    import sys
    import urllib.request

    from sglang_support import STUB, stub_campaign

    from dvfs.engines.sglang import SglangEngine
    from dvfs.fleet.driver import Fleet

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "attach.json"
    config.write_text(json.dumps({"version": "0.5.23", "max_lifetime_s": 60, "tpot_s": 0.004}))
    path, marker = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        sglang_extra=f'url = "http://127.0.0.1:{port}"',
        batch="[1]",
        knobs="sm_clock = [1980, 1500, 1200]\nsettle_s = 0.0",
    )

    def serve(*extra: str) -> subprocess.Popen[bytes]:
        argv = ["--port", str(port), "--model-path", marker, "--random-seed", "0", *extra]
        return subprocess.Popen(
            [sys.executable, str(STUB), *argv],
            env={**os.environ, "SGLANG_STUB_CONFIG": str(config)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    servers: list[subprocess.Popen[bytes]] = []

    def replace() -> None:
        """The server replaced once, the new one answering before the sweep goes on."""
        if len(servers) > 1:
            return
        servers[0].terminate()
        servers[0].wait(timeout=10)
        servers.append(serve("--dtype", "float16"))
        while True:  # no deadline of its own: the test's timeout ends a hang
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5):
                    return
            except OSError:
                assert servers[-1].poll() is None, "the replacement server exited"
                time.sleep(0.05)

    ship, run = Fleet.shipped, SglangEngine.run

    def shipped(self: Fleet, worker: str, shipment) -> None:  # type: ignore[no-untyped-def]
        # As the driver journals the Ray worker's first cell, before it is handed the next.
        ship(self, worker, shipment)
        replace()

    def ran(self: SglangEngine, workload, timeline=None):  # type: ignore[no-untyped-def]
        # After the local worker's first round, in its own thread: its next round finds it.
        result = run(self, workload, timeline)
        replace()
        return result

    out = tmp_path / "out"
    for on in ("ray", "local") if executor == "local" else ("ray",):
        servers[:] = [serve()]
        with monkeypatch.context() as patched:
            if on == "ray":
                patched.setattr(Fleet, "shipped", shipped)
            else:
                patched.setattr(SglangEngine, "run", ran)
            try:
                result = sweep(str(path), "--gpus", "0", "--executor", on, "--out", str(out))
            finally:
                for server in servers:
                    server.terminate()
                    server.wait(timeout=10)
        assert len(servers) == 2, result.output
        assert result.exit_code == 1, result.output
        last = result.output.strip().splitlines()[-1]
        assert last.startswith(
            f"Error: the server at http://127.0.0.1:{port} is not the one dvfs attached to"
        ), result.output
        assert "dtype (dtype): 'auto' -> 'float16'" in last
        assert "restart it as it was and rerun the same command to resume" in last
        cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
        assert [c["status"] for c in cells] == ["ok"]
        # written and said as after a Ctrl-C (it wrote no cube, and said nothing of the GPUs)
        assert f"partial cube written to {out / 'cube.nc'}" in result.output, result.output
        assert "GPU settings restored." in result.output.splitlines()


#: What Ray's memory monitor says of a worker it killed (an OutOfMemoryError's message).
OOM_MESSAGE = (
    "Task was killed due to the node running low on memory.\nMemory on the node (IP: "
    "127.0.0.1, ID: 1a2b) where the lease was running was 22.56GB / 23.54GB (0.958417), which "
    "exceeds the memory usage threshold of 0.95."
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["gpu-lost", "actor-killed", "oom-killed"])
def test_a_worker_that_leaves_its_gpu_changed_fails_the_sweep(
    ray_nvml, ray_cluster, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GPUs (the fake NVML's two) on Ray: a worker whose GPU falls off the bus, or whose
    actor is killed, after it set the GPU's knobs cannot put them back. Every cell is measured
    by the other, yet the sweep ends with exit 1 naming the GPUs, the node and `dvfs gpu
    reset` (it ended 0, the GPU left locked, as the local executor's sweep no longer does).
    `oom-killed`: killed by Ray's memory monitor as its node ran low on memory, which SIGKILLs
    the actor's process and answers its calls with an OutOfMemoryError (not a RayActorError):
    the worker was said lost, but its GPUs were not (the sweep ended 0, the GPU locked)."""
    if how == "oom-killed":
        import ray.exceptions

        get = ray_cluster.get  # type: ignore[attr-defined]

        def get_as_the_memory_monitor_says(*args, **kwargs):  # type: ignore[no-untyped-def]
            try:
                return get(*args, **kwargs)
            except ray.exceptions.RayActorError:
                raise ray.exceptions.OutOfMemoryError(OOM_MESSAGE) from None

        monkeypatch.setattr(ray_cluster, "get", get_as_the_memory_monitor_says)
    from nvml_support import NVML_CAMPAIGN

    # (16 tokens: no cell's validity is read here; each token is played out in real time)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=3))
    out = tmp_path / "out"
    journal = out / "journal.jsonl"
    lost: list[int] = []
    from dvfs.fleet.driver import Fleet

    ship = Fleet.shipped

    def lose_a_gpu(self: Fleet, worker: str, shipment) -> None:  # type: ignore[no-untyped-def]
        """As the driver journals a worker's first cell (its GPU's knobs are set), lose its
        GPU, or SIGKILL the actor's process (the one that set the GPU's clocks, in the fake's
        call log): in the driver's thread, so it lands before the campaign ends."""
        ship(self, worker, shipment)
        cell = next((r for r in shipment.records if r.get("type") == "cell"), None)
        if cell is None or lost:
            return
        index = int(cell["worker"].rsplit("gpu", 1)[1])
        if how == "gpu-lost":
            ray_nvml.fake_update_device(index, lost=True)
        else:
            calls = ray_nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")
            os.kill(next(c["pid"] for c in calls if c["index"] == index), signal.SIGKILL)
        lost.append(index)

    monkeypatch.setattr(Fleet, "shipped", lose_a_gpu)
    result = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert lost, result.output
    assert result.exit_code == 1, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert "NOT restored" in last and "dvfs gpu reset" in last, result.output
    if how == "oom-killed":
        said = f"/gpu{lost[0]} lost (OutOfMemoryError: Task was killed due to the node running"
        assert said in result.output and "internal error" not in result.output, result.output
    gpu = ray_nvml.fake_device_state(lost[0])
    assert gpu["locked_clocks"] is not None  # what the sweep's last line is about
    if how == "gpu-lost":
        assert gpu["uuid"] in last
    else:
        assert f"/gpu{lost[0]} (its actor died)" in last
    assert "Traceback" not in result.output
    cells = [r["key"] for r in read_records(journal) if r["type"] == "cell"]
    assert len(cells) == len(set(cells)) == 12 and (out / "cube.nc").is_file()
    other = ray_nvml.fake_device_state(1 - lost[0])
    assert other["locked_clocks"] is None  # the other worker put its GPU back
    # followed as the line says, with sudo (which drops DVFS_STATE_DIR: the actors' state
    # folder), once the GPU answers again: the reset names that folder and puts the GPU back
    from nvml_support import dvfs_in_process

    ray_nvml.fake_update_device(lost[0], lost=False)
    command = shlex.split(last.split("run `", 1)[1].split("`", 1)[0])
    assert command[:3] == ["dvfs", "gpu", "reset"] and f"` on {platform.node()}" in last, last
    unset: dict = {"DVFS_STATE_DIR": None}
    reset = dvfs_in_process(*command[1:], env=unset)
    assert reset.returncode == 0, reset.stderr
    assert ray_nvml.fake_device_state(lost[0])["locked_clocks"] is None, reset.stdout


@pytest.mark.timeout(300)
def test_a_ray_fleet_that_loses_every_gpu_names_the_losses_and_the_reset_first(
    ray_nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GPUs on Ray, each falling off the bus after its worker's first cell: the line
    named each worker by its failed restore ('vm/gpu0: GpuError: could not restore GPU
    settings: ...', cut mid-word), not by its loss, and said to rerun without a word of the
    GPUs left changed, whose state files are in the node's $DVFS_STATE_DIR. It names each
    loss, then the reset to run there (with --state-dir) before the command less --fresh;
    followed (the reset run as with sudo, the variable dropped), the sweep resumes."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process

    from dvfs.fleet.driver import Fleet

    # (16 tokens: no cell's validity is read here; each token is played out in real time)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=3))
    out = tmp_path / "out"
    ship = Fleet.shipped
    lost: set[int] = set()

    def lose(self: Fleet, worker: str, shipment) -> None:  # type: ignore[no-untyped-def]
        ship(self, worker, shipment)
        cell = next((r for r in shipment.records if r.get("type") == "cell"), None)
        if cell is not None:  # in the driver's thread, as the driver journals it
            index = int(cell["worker"].rsplit("gpu", 1)[1])
            if index not in lost:
                ray_nvml.fake_update_device(index, lost=True)
                lost.add(index)

    monkeypatch.setattr(Fleet, "shipped", lose)
    argv = [str(campaign), "--executor", "ray", "--out", str(out)]
    result = sweep(*argv, "--fresh")
    assert result.exit_code == 1, result.output
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    assert last.startswith("Error: every worker was lost with "), result.output
    named = last.split(" cell(s) left (", 1)[1].split("): the journal keeps", 1)[0]
    host = platform.node()
    for i in range(2):
        assert f"{host}/gpu{i}: GpuUnavailableError: GPU {i}: " in named, named
    assert "could not restore" not in named and named.count("fallen off the bus") == 2, named
    reset = f"`dvfs gpu reset --state-dir {os.environ['DVFS_STATE_DIR']}` on {host}"
    assert last.endswith(
        f"the journal keeps every finished cell; GPU settings were left unrestored on {host}: "
        f"once the GPUs answer again, run {reset}, then rerun the same command without "
        "--fresh to resume (with it, it starts over)"
    ), last
    assert "Traceback" not in result.output
    kept = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    # followed: the GPUs answer again, the reset is run as the line says, with sudo (which
    # drops DVFS_STATE_DIR), and the command less --fresh resumes
    monkeypatch.setattr(Fleet, "shipped", ship)
    for i in range(2):
        ray_nvml.fake_update_device(i, lost=False)
    command = shlex.split(last.split(", run `", 1)[1].split("`", 1)[0])
    unset: dict = {"DVFS_STATE_DIR": None}
    assert dvfs_in_process(*command[1:], env=unset).returncode == 0
    assert all(ray_nvml.fake_device_state(i)["locked_clocks"] is None for i in range(2))
    resumed = sweep(*argv)
    assert resumed.exit_code == 0, resumed.output
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == 12 and cells[: len(kept)] == kept and (out / "cube.nc").is_file()


@pytest.mark.timeout(300)
def test_a_retired_ray_workers_notes_are_shown_as_a_local_ones(
    ray_cluster: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ray worker's notes come with its unit: those of a unit the driver refused (its
    server differs; the worker retired) were dropped, so its "starting twin server" line,
    which the local executor shows, was never said. They are said, before the refusal."""
    from conftest import TINY_EXACT

    refuse_servers_on(monkeypatch, "gpu1")
    campaign = write(tmp_path / "campaign.toml", TINY_EXACT)
    out = tmp_path / "out"
    result = sweep(str(campaign), "--gpus", "0-1", "--executor", "ray", "--out", str(out))
    assert result.exit_code == 0, result.output
    told = " ".join(result.output.split())
    worker = f"{platform.node()}/gpu1"
    started = f"{worker}: starting twin server with drafter "
    retired = f"worker {worker} retired, its server refused"
    assert started in told and retired in told, told
    assert told.index(started) < told.index(retired), told


@pytest.mark.timeout(300)
def test_a_ray_fleet_whose_worker_was_retired_and_the_other_lost_its_gpu_names_the_reset(
    ray_nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GPUs on Ray: one worker retired (its server refused), the other's GPU off the bus
    after its first cell, its settings left changed. The last line was the refusal alone,
    without the reset to run on the node first. It ends in it."""
    from nvml_support import NVML_CAMPAIGN

    from dvfs.fleet.driver import Fleet

    why = "the server of drafter 'none' on gpu0 differs (test): rerun with --fresh"
    ship = Fleet.shipped

    def lose(self: Fleet, worker: str, shipment) -> None:  # type: ignore[no-untyped-def]
        ship(self, worker, shipment)
        if worker.endswith("/gpu1"):  # in the driver's thread, as the driver journals it
            ray_nvml.fake_update_device(1, lost=True)

    refuse_servers_on(monkeypatch, "gpu0", why)
    monkeypatch.setattr(Fleet, "shipped", lose)
    # (16 tokens: no cell's validity is read here; each token is played out in real time)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=3))
    result = sweep(str(campaign), "--executor", "ray", "--out", str(tmp_path / "out"))
    assert result.exit_code == 1, result.output
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    host = platform.node()
    reset = f"`dvfs gpu reset --state-dir {os.environ['DVFS_STATE_DIR']}` on {host}"
    assert last == (
        f"Error: {why}; and GPU settings were left unrestored on {host}: once the GPUs answer "
        f"again, run {reset} first"
    ), result.output
    assert ray_nvml.fake_device_state(1)["locked_clocks"] is not None  # what it is about
    assert "NOT restored" not in result.output  # the line names them: not twice
    assert "Traceback" not in result.output


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("nvml_error", "code"), [(4, 4), (999, 1)])
def test_a_restore_nvml_refuses_on_ray_says_why_as_one_gpus_sweep(
    ray_nvml, tmp_path: Path, nvml_error: int, code: int
) -> None:
    """Every cell measured, then NVML refused the actors' reset of their GPUs' clocks: the
    last line said "a worker lost its GPU, or its actor died ... once the GPU answers again",
    exit 1 even where the reset needed root. It says the restore's own error (as one GPU's
    sweep does), exit 4 where it needs root, else 1, naming the node's `dvfs gpu reset` once
    (each actor's error named it too); the cube is written all the same."""
    from nvml_support import NVML_CAMPAIGN

    for i in range(2):
        ray_nvml.fake_update_device(i, errors={"nvmlDeviceResetGpuLockedClocks": nvml_error})
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    out = tmp_path / "out"
    result = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert result.exit_code == code, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert "NOT restored" in last and "cannot reset locked SM clocks" in last, result.output
    assert last.count("dvfs gpu reset") == 1 and "lost its GPU" not in last, last
    assert "Traceback" not in result.output
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == 4 and (out / "cube.nc").is_file()


@pytest.mark.timeout(300)
def test_a_bug_in_a_ray_workers_restore_is_the_runs_internal_error(
    ray_nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every cell measured on Ray, then the restore of the GPU that measured the first cell
    stopped on a bug in dvfs (the fake given a value it cannot read as an NVML code: a
    ValueError in the restore's call, no GPU's error). The sweep ended "GPU settings NOT
    restored ...", the bug in that line alone, where the local fleet (and one GPU's sweep)
    makes it the run's internal error, its traceback with -vv. Now the same, naming the
    node: exit 1, the cube written."""
    from nvml_support import NVML_CAMPAIGN

    from dvfs.fleet.driver import Fleet

    ship = Fleet.shipped
    buggy: list[int] = []

    def bug_in_its_restore(self: Fleet, worker: str, shipment) -> None:  # type: ignore[no-untyped-def]
        ship(self, worker, shipment)  # in the driver's thread, as the driver journals it
        if not buggy:  # the first GPU to measure a cell (its clocks set)
            buggy.append(int(worker.rsplit("gpu", 1)[1]))
            reset = {"nvmlDeviceResetGpuLockedClocks": "a bug"}
            ray_nvml.fake_update_device(buggy[0], errors=reset)

    monkeypatch.setattr(Fleet, "shipped", bug_in_its_restore)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    out = tmp_path / "out"
    result = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert result.exit_code == 1, result.output
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    index = buggy[0]
    uuid = ray_nvml.fake_device_state(index)["uuid"]
    assert last.startswith(
        f"Error: internal error: RestoreBugError: on {platform.node()}: could not restore GPU "
        f"settings: GPU {index} ({uuid}): its restore stopped on a bug in dvfs (ValueError: "
    ), result.output
    assert "dvfs gpu reset" in last and "please report it" in last, last
    assert "NOT restored" not in result.output, result.output  # the GPU named once
    assert ray_nvml.fake_device_state(index)["locked_clocks"] is not None  # what it is about
    assert ray_nvml.fake_device_state(1 - index)["locked_clocks"] is None
    assert (out / "cube.nc").is_file()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("gpu0", ["answers", "off the bus"])
def test_a_ray_fleet_lost_whole_with_a_restore_that_needs_root_exits_4_and_says_root(
    ray_nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpu0: str
) -> None:
    """Both Ray workers lost after their first cell (NVML fails their energy counters; or
    GPU 0 falls off the bus, its restore failing too), and NVML refused GPU 1's restore for
    want of root. The sweep exited 1 with "GPU settings were left unrestored on NODE: once the
    GPUs answer again, run `dvfs gpu reset`": root unsaid (and GPU 1 never stopped answering),
    where the local fleet exits 4 (README's exit codes: a restore that needs root). Now exit
    4, the line saying the reset is to run as root (once the GPUs answer again where one was
    lost)."""
    from nvml_support import NVML_CAMPAIGN

    from dvfs.fleet.driver import Fleet

    ship = Fleet.shipped

    def lose(self: Fleet, worker: str, shipment) -> None:  # type: ignore[no-untyped-def]
        ship(self, worker, shipment)  # in the driver's thread, as the driver journals it
        index = int(worker.rsplit("gpu", 1)[1])
        if index == 0 and gpu0 == "off the bus":
            ray_nvml.fake_update_device(0, lost=True)
            return
        errors = {"nvmlDeviceGetTotalEnergyConsumption": 999}
        if index == 1:
            errors["nvmlDeviceResetGpuLockedClocks"] = 4  # NoPermission
        ray_nvml.fake_update_device(index, errors=errors)

    monkeypatch.setattr(Fleet, "shipped", lose)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    result = sweep(str(campaign), "--executor", "ray", "--out", str(tmp_path / "out"))
    assert result.exit_code == 4, result.output
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    host = platform.node()
    reset = f"`dvfs gpu reset --state-dir {os.environ['DVFS_STATE_DIR']}` on {host}"
    assert last.startswith("Error: every worker was lost with "), result.output
    if gpu0 == "answers":
        said = f"{host} for want of root: run {reset} as root"
    else:
        said = f"{host} (for want of root on {host}): once the GPUs answer again, run {reset}, "
        said += f"as root on {host}"
    assert last.endswith(
        f"GPU settings were left unrestored on {said}, then rerun the same command to resume"
    ), last
    assert ray_nvml.fake_device_state(1)["locked_clocks"] is not None  # what it is about
    assert "Traceback" not in result.output


@pytest.mark.timeout(300)
def test_a_refusal_on_ray_names_each_restores_error_once_and_exits_4_for_root(
    ray_nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GPUs on Ray: gpu0 retired (its server refused), its close at the run's end
    refused by NVML for want of root; gpu1's GPU off the bus after its first cell, its
    restore failing. The refusal's line names gpu1's node and reset first; the line before it
    named GPU 0 with both restores' errors, GPU 1's (fallen off the bus, named in the
    refusal's line already) as if GPU 0's, and the sweep exited 1 where the local fleet exits
    4 for a restore that needs root. Now GPU 0's line has GPU 0's error alone; exit 4."""
    from nvml_support import NVML_CAMPAIGN

    from dvfs.fleet.driver import Fleet

    why = "the server of drafter 'none' on gpu0 differs (test): rerun with --fresh"
    ship = Fleet.shipped

    def lose(self: Fleet, worker: str, shipment) -> None:  # type: ignore[no-untyped-def]
        ship(self, worker, shipment)
        if worker.endswith("/gpu1"):  # in the driver's thread, as the driver journals it
            ray_nvml.fake_update_device(1, lost=True)

    refuse_servers_on(monkeypatch, "gpu0", why)
    monkeypatch.setattr(Fleet, "shipped", lose)
    ray_nvml.fake_update_device(0, errors={"nvmlDeviceResetGpuLockedClocks": 4})
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=3))
    result = sweep(str(campaign), "--executor", "ray", "--out", str(tmp_path / "out"))
    assert result.exit_code == 4, result.output
    lines = [" ".join(x.split()) for x in result.stderr.strip().splitlines()]
    host = platform.node()
    reset = f"`dvfs gpu reset --state-dir {os.environ['DVFS_STATE_DIR']}` on {host}"
    assert lines[-1] == (
        f"Error: {why}; and GPU settings were left unrestored on {host}: once the GPUs answer "
        f"again, run {reset} first"
    ), result.output
    uuid0 = ray_nvml.fake_device_state(0)["uuid"]
    assert lines[-2].startswith(
        f"GPU settings NOT restored for {uuid0} on {host}: could not restore GPU settings: "
        f"GPU 0 ({uuid0}): GPU 0: cannot reset locked SM clocks: permission denied"
    ), result.output
    assert "GPU 1" not in lines[-2], lines[-2]
    assert lines[-2].endswith(f"; run {reset} as root."), lines[-2]  # NVML refused: root
    assert "Traceback" not in result.output


@pytest.mark.timeout(300)
def test_a_finished_folder_is_not_done_for_a_ray_cluster_with_another_gpu_model(
    ray_nvml, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Real GPUs (the fake NVML's) on Ray: a folder the cluster's two H100s finished is done
    for them (nothing runs, no GPU is set), but not once an H200 is among the cluster's GPUs,
    whose cells were never measured there: refused as without Ray, where the run said "0
    cell(s) measured" and wrote the H100s' cube (the driver took the models for not known)."""
    campaign, out = finished_nvml_folder(tmp_path, tmp_path_factory)
    journal = (out / "journal.jsonl").read_text()
    set_calls = len(ray_nvml.fake_calls())
    # The dry run starts no Ray, so reads no GPU: it plans nothing to run, and says for which
    # models that holds (it said nothing, where the run now finds an H200's cells to measure).
    planned = sweep(
        str(campaign), "--executor", "ray", "--out", str(out), "--dry-run", "--no-estimate"
    )
    assert planned.exit_code == 0, planned.output
    said = " ".join(planned.stderr.split())
    assert "with Ray the dry run reads no GPU, so the folder is done for the GPU models it" in said
    again = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert again.exit_code == 0, again.output
    assert "0 cell(s) measured" in again.output, again.output
    assert len(ray_nvml.fake_calls()) == set_calls  # no GPU setting touched
    assert (out / "journal.jsonl").read_text() == journal
    ray_nvml.fake_reset_state("h100-sxm,h200-sxm")  # GPU 1 now an H200
    mixed = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert mixed.exit_code == 1, mixed.output
    assert "holds a run on one GPU model" in mixed.output, mixed.output
    assert "Traceback" not in mixed.output
    assert (out / "journal.jsonl").read_text() == journal


#: `finished_nvml_folder`'s one Ray sweep per test session (per xdist worker): the folder it
#: finished and the fake NVML's state file and dvfs's state folder as it left them.
_FINISHED_NVML: dict[Path, Path] = {}


def finished_nvml_folder(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The fake NVML's campaign, and the folder a Ray run on its two H100s finished, in
    `tmp_path`. Call it under `ray_nvml`.

    The Ray sweep runs once (seconds of CPU for every test that reruns its folder); each test
    gets a copy of its folder, with the fake NVML's state (GPUs, call log) and dvfs's state
    folder put back as that sweep left them, as if it had just run here. The one path the
    folder records is the campaign's folder (`campaign_dir`, in the journal's session and the
    cube's attributes): the copy's names `tmp_path`, as the sweep's own would."""
    import netCDF4
    from nvml_support import NVML_CAMPAIGN

    state_file = Path(os.environ["DVFS_FAKE_NVML_STATE"])
    state_dir = Path(os.environ["DVFS_STATE_DIR"])
    base = tmp_path_factory.getbasetemp()
    if base not in _FINISHED_NVML:
        built = tmp_path_factory.mktemp("finished-nvml")
        # (16 tokens: its tests read what the folder holds, no cell's validity; each token
        # is played out in real time)
        text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
        campaign = write(built / "run" / "nvml.toml", text)
        first = sweep(str(campaign), "--executor", "ray", "--out", str(built / "run" / "out"))
        assert first.exit_code == 0, first.output
        shutil.copyfile(state_file, built / "fake-nvml.json")
        if state_dir.exists():
            shutil.copytree(state_dir, built / "dvfs-state")
        _FINISHED_NVML[base] = built
    built = _FINISHED_NVML[base]
    shutil.copytree(built / "run", tmp_path, dirs_exist_ok=True)
    journal = tmp_path / "out" / "journal.jsonl"
    recorded = f'"campaign_dir":{json.dumps(str(built / "run"))}'
    assert journal.read_text().count(recorded) == 1
    journal.write_text(
        journal.read_text().replace(recorded, f'"campaign_dir":{json.dumps(str(tmp_path))}')
    )
    with netCDF4.Dataset(tmp_path / "out" / "cube.nc", "a") as cube:
        assert cube.getncattr("campaign_dir") == str(built / "run")
        cube.setncattr("campaign_dir", str(tmp_path))
    shutil.copyfile(built / "fake-nvml.json", state_file)
    shutil.rmtree(state_dir, ignore_errors=True)
    if (built / "dvfs-state").exists():
        shutil.copytree(built / "dvfs-state", state_dir)
    return tmp_path / "nvml.toml", tmp_path / "out"


@pytest.mark.timeout(300)
def test_a_finished_folder_waits_for_gpus_ray_cannot_place_in_a_note_as_the_run_does(
    ray_nvml,
    ray_cluster,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finished folder on real GPUs, rerun while another job holds one of the cluster's two:
    the actors that read the GPUs' models wait for it as the run's workers do, and say so in
    the run's note, then give up in its one line (they waited the 30 minutes silently)."""
    from dvfs.fleet import ray_executor

    campaign, out = finished_nvml_folder(tmp_path, tmp_path_factory)
    monkeypatch.setattr(ray_executor, "OPEN_TIMEOUT_S", 3.0)
    monkeypatch.setattr(ray_executor, "OPEN_NOTE_S", 1.0)

    class Job:
        def ping(self) -> int:
            return 1

    job = ray_cluster.remote(num_gpus=1, num_cpus=0)(Job).remote()
    try:
        ray_cluster.get(job.ping.remote(), timeout=60)
        result = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    finally:
        ray_cluster.kill(job)
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert re.search(r"waiting for [12] of 2 Ray worker\(s\) to start", said), said
    last = result.output.strip().splitlines()[-1]
    assert re.match(r"Error: [12] of 2 Ray worker\(s\) did not start within 3 s", last), last
    assert "Traceback" not in result.output


@pytest.mark.timeout(300)
def test_ray_address_ignored_is_said_for_a_finished_folder_too_and_once(
    ray_nvml,
    ray_cluster,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without --address, RAY_ADDRESS set: the Ray dvfs starts on this machine reads the GPUs'
    models of a finished folder, so the note that RAY_ADDRESS's cluster is not joined is said
    there too (the folder was done or refused for this machine's GPUs without a word), and
    said once where the run follows."""
    campaign, out = finished_nvml_folder(tmp_path, tmp_path_factory)
    # Ray "starts" here as without --address: the shared loopback instance stands for it.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    monkeypatch.setattr(ray_cluster, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_cluster, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray_cluster, "shutdown", lambda: None)
    done = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert done.exit_code == 0, done.output
    assert "0 cell(s) measured" in done.output, done.output
    assert " ".join(done.output.split()).count("RAY_ADDRESS is set (127.0.0.1:9)") == 1
    ray_nvml.fake_reset_state("h100-sxm,h200-sxm")  # GPU 1 now an H200: the run follows
    mixed = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert mixed.exit_code == 1, mixed.output
    assert "holds a run on one GPU model" in mixed.output, mixed.output
    assert " ".join(mixed.output.split()).count("RAY_ADDRESS is set (127.0.0.1:9)") == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_models_probe_waits_says_the_cube_is_whole(
    ray_nvml,
    ray_cluster,
    sig: int,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C or SIGTERM while the actors read the GPUs' models of a finished folder: nothing
    was measured and its cube holds every cell, which the sweep says (it said "partial cube
    written", as of a sweep stopped midway); it ends as the signal, with no traceback."""
    from dvfs.fleet import ray_executor

    campaign, out = finished_nvml_folder(tmp_path, tmp_path_factory)
    journal = (out / "journal.jsonl").read_text()
    probe_wait = ray_executor.RayExecutor._open

    def signalled(*args: object, **kwargs: object) -> object:
        signal.raise_signal(sig)  # the user's Ctrl-C (or Slurm's SIGTERM) while it waits
        return probe_wait(*args, **kwargs)

    monkeypatch.setattr(ray_executor.RayExecutor, "_open", staticmethod(signalled))
    result = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--executor", "ray", "--out", str(out), "--no-progress"]
    )
    assert result.exit_code == (130 if sig == signal.SIGINT else 128 + sig), result.output
    said = " ".join(result.output.split())
    assert "partial" not in said, said
    assert f"cube written to {out / 'cube.nc'} (whole: the folder already held" in said, said
    assert "Traceback" not in result.output
    assert (out / "journal.jsonl").read_text() == journal
    assert (open_cube(out / "cube.nc")["cell_status"].values == STATUS_OK).all()


@pytest.mark.timeout(300)
def test_a_finished_folder_is_done_on_a_ray_cluster_without_gpus(
    ray_nvml,
    ray_cluster,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finished folder rerun where the Ray cluster offers no GPUs (its GPU nodes gone, or a
    login node's own Ray): no worker would measure a model it lacks, so it is done, as it is
    without Ray where NVML opens no GPU (it failed, exit 2: "the Ray cluster offers 0
    GPU(s)"), and its cube is written again."""
    campaign, out = finished_nvml_folder(tmp_path, tmp_path_factory)
    journal = (out / "journal.jsonl").read_text()
    (out / "cube.nc").unlink()
    monkeypatch.setattr(ray_cluster, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray_cluster, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}])
    again = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert again.exit_code == 0, again.output
    assert "0 cell(s) measured" in again.output, again.output
    assert (out / "journal.jsonl").read_text() == journal
    assert (open_cube(out / "cube.nc")["cell_status"].values == STATUS_OK).all()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("actor", ["probe", "worker"])
def test_an_actor_that_dies_as_it_starts_is_one_line_not_an_internal_error(
    ray_nvml,
    ray_cluster,
    actor: str,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real GPUs on Ray: one of the actors placed to read the GPUs' models of a finished
    folder (`probe`), or one of a new run's workers as it opens its GPUs (`worker`), dies
    (its node gone, the OOM killer) before it answers. The sweep fails in one line saying so
    and to rerun (a worker's, that its GPUs may need `dvfs gpu reset`), not "internal error:
    ActorDiedError ...; please report it"; the journal is left as it was."""
    if actor == "probe":
        campaign, out = finished_nvml_folder(tmp_path, tmp_path_factory)
    else:
        from nvml_support import NVML_CAMPAIGN

        text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)  # (no cell is measured)
        campaign, out = write(tmp_path / "nvml.toml", text), tmp_path / "out"
    journal = out / "journal.jsonl"
    before = journal.read_text() if journal.exists() else None
    remote, wait = ray_cluster.remote, ray_cluster.wait
    placed: list[object] = []  # the actors the sweep places, as it places them

    def recorded(made: object) -> object:
        def options(**kwargs: object) -> object:
            chosen = made.options(**kwargs)  # type: ignore[attr-defined]

            def place(*args: object, **kw: object) -> object:
                placed.append(chosen.remote(*args, **kw))
                return placed[-1]

            return types.SimpleNamespace(remote=place)

        return types.SimpleNamespace(options=options)

    def kill_one_then_wait(refs, **kwargs):  # type: ignore[no-untyped-def]
        if placed:  # the first placed actor's process dies before it is waited for
            ray_cluster.kill(placed.pop(0), no_restart=True)
            placed.clear()
        return wait(refs, **kwargs)

    monkeypatch.setattr(ray_cluster, "remote", lambda **kw: lambda cls: recorded(remote(**kw)(cls)))
    monkeypatch.setattr(ray_cluster, "wait", kill_one_then_wait)
    result = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert result.exit_code == 1, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: a Ray worker died as it started (") and "rerun" in line, line
    assert ("dvfs gpu reset" in line) == (actor == "worker"), line
    # its state folder is the cluster's $DVFS_STATE_DIR, which `sudo` drops: the reset says it
    reset = f"`dvfs gpu reset --state-dir {os.environ['DVFS_STATE_DIR']}` there"
    assert (reset in line) == (actor == "worker"), line
    assert "internal error" not in line
    assert (journal.read_text() if journal.exists() else None) == before


@pytest.mark.timeout(300)
def test_a_finished_folder_is_not_done_for_a_new_model_beside_a_gpu_off_the_bus(
    ray_nvml, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A folder the cluster's H100s finished, rerun once the cluster has an H200 and one GPU
    that fell off the bus: the H200's cells were never measured, so the run goes on (and
    fails, naming the lost GPU), where one GPU that could not be read made every model
    unknown and the folder done ("0 cell(s) measured", exit 0, the H200 never measured)."""
    campaign, out = finished_nvml_folder(tmp_path, tmp_path_factory)
    journal = (out / "journal.jsonl").read_text()
    ray_nvml.fake_reset_state("h100-sxm,h200-sxm")  # GPU 1 now an H200
    ray_nvml.fake_update_device(0, lost=True)  # and GPU 0 off the bus
    again = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert again.exit_code == 1, again.output
    assert "fallen off the bus" in again.output, again.output
    assert "0 cell(s) measured" not in again.output, again.output
    assert "Traceback" not in again.output and "internal error" not in again.output
    assert (out / "journal.jsonl").read_text() == journal


def test_without_ray_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "ray", None)
    campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
    result = sweep(str(campaign), "--executor", "ray", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "Error: --executor ray needs Ray, which is not installed: pip install 'dvfs[ray]' "
        "(on every node of the cluster)"
    ]
    address = CliRunner().invoke(cli, ["sweep", str(campaign), "--address", "auto"])
    assert address.exit_code == 2 and "--executor ray" in address.output
    assert not (tmp_path / "o").exists()


def test_no_cluster_at_the_address_is_one_line_not_about_the_folder(
    tmp_path: Path, monkeypatch
) -> None:
    """Ray's ConnectionError is an OSError, which was worded as a fault of the --out folder
    ("cannot use DIR: ...")."""

    def init(**kwargs: object) -> None:
        raise ConnectionError(
            "Could not find any running Ray instance. Please specify the one to connect to "
            "by setting `--address` flag or `RAY_ADDRESS` environment variable."
        )

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
    out = tmp_path / "o"
    result = sweep(str(campaign), "--executor", "ray", "--address", "auto", "--out", str(out))
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        "Error: no Ray cluster to join at --address auto (Could not find any running Ray "
        "instance): start it first (`ray start --head` on the head node, `ray start --address "
        "HEAD:6379` on the others), or leave out --address to run Ray on this machine only"
    ]
    assert not (out / "journal.jsonl").exists()


def test_an_address_nothing_listens_on_is_one_line_at_once(tmp_path: Path, monkeypatch) -> None:
    """--address HOST:PORT with no cluster there: Ray's join retries for about 14 minutes,
    printing nothing a log keeps, before it gives up; dvfs tries the port first and refuses in
    the same one line as a cluster Ray cannot find, never calling ray.init."""
    import socket

    def init(**kwargs: object) -> None:
        raise AssertionError("ray.init was called for an address nothing listens on")

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    with socket.socket() as s:  # a loopback port that was free: nothing listens there now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
    out = tmp_path / "o"
    address = f"127.0.0.1:{port}"
    result = sweep(str(campaign), "--executor", "ray", "--address", address, "--out", str(out))
    assert result.exit_code == 1, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith(
        f"Error: no Ray cluster to join at --address {address} (nothing accepts a connection "
        "there: "
    ), line
    assert line.endswith("or leave out --address to run Ray on this machine only"), line
    assert not (out / "journal.jsonl").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("answer", "joined"),
    [(b"HTTP/1.1 400 Bad Request\r\n\r\n", False), (bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]), True)],
    ids=["not-ray", "grpc"],
)
def test_an_address_that_is_not_a_ray_head_is_one_line_at_once(
    tmp_path: Path, monkeypatch, answer: bytes, joined: bool
) -> None:
    """--address HOST:PORT where something other than a Ray head listens (the dashboard's
    port given for the head's): Ray's join retries there for as long as where nothing
    listens; dvfs tells it by its answer to a gRPC client's opening and refuses in one line,
    never calling ray.init. A server that answers as gRPC does (a Ray head's GCS) is joined."""
    import socket

    called = []

    def init(**kwargs: object) -> None:
        called.append(kwargs)
        raise ConnectionError("joined. Ray's advice")

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(30)

    def serve() -> None:
        with server, server.accept()[0] as conn:
            conn.sendall(answer)
            conn.recv(1024)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
    out = tmp_path / "o"
    result = sweep(str(campaign), "--executor", "ray", "--address", address, "--out", str(out))
    thread.join(30)
    assert result.exit_code == 1, result.output
    (line,) = result.output.strip().splitlines()
    why = "joined" if joined else "something accepts a connection there but does not answer as"
    assert line.startswith(f"Error: no Ray cluster to join at --address {address} ({why}"), line
    assert bool(called) == joined
    assert not (out / "journal.jsonl").exists()


@pytest.mark.timeout(300)
def test_without_address_ray_runs_here_whatever_ray_address_says(
    shared_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --address dvfs starts its own Ray on this machine, as the README says, even
    where RAY_ADDRESS names a cluster (here a loopback port nothing listens on): it said
    'internal error: ValueError: When connecting to an existing cluster, resources must not be
    provided', and with RAY_ADDRESS=auto blamed the --out folder. In this process (nothing of
    it is about processes; a subprocess paid a second of imports): the shared instance is
    stopped by now (this test does not use it), and the note below is said only where dvfs
    starts Ray itself."""
    one = shared_run(CAMPAIGN, "one")  # shared with the other fleet tests
    out = tmp_path / "ray"
    argv = [str(one.parent / "campaign.toml"), "--gpus", "0-1", "--executor", "ray"]
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    result = sweep(*argv, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "RAY_ADDRESS is set (127.0.0.1:9)" in result.stderr
    assert_same_cells(open_cube(out / "cube.nc"), open_cube(one / "cube.nc"))


@pytest.mark.timeout(300)
def test_sigterm_on_a_ray_sweep_ends_as_without_ray(shared_run, tmp_path: Path) -> None:
    """SIGTERM (Slurm's at a job's time limit) on a sweep that started its own Ray: exit 143,
    the partial cube and the lines saying the GPUs are restored and to resume, as without Ray.
    `ray.init` made SIGTERM `sys.exit(15)`: exit 15, none of those lines, Ray's stack dump."""
    one = shared_run(CAMPAIGN, "one")  # shared with the other fleet tests
    campaign = one.parent / "campaign.toml"
    out = tmp_path / "ray"
    argv = [str(campaign), "--gpus", "0-1", "--out", str(out)]
    journal = out / "journal.jsonl"
    command = [PYTHON, "-m", "dvfs", "sweep", *argv, "--executor", "ray", "--no-progress"]
    code, output = signalled_at(command, journal, 16, signal.SIGTERM)
    assert code == 143, output
    assert "partial cube written" in output and "Run the same command again" in output, output
    assert "SIGTERM received" not in output
    done = [r["key"] for r in read_records(journal) if r["type"] == "cell"]
    assert 16 <= len(done) < 72, "the signal must land mid-campaign"
    again = sweep(*argv)  # the journal resumes on any executor: these threads are enough
    assert again.exit_code == 0, again.output
    keys = [r["key"] for r in read_records(journal) if r["type"] == "cell"]
    assert len(keys) == len(set(keys)) == 72
    assert_same_cells(open_cube(out / "cube.nc"), open_cube(one / "cube.nc"))


def test_ray_that_cannot_start_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """A local Ray that fails to start is one line saying so, not 'internal error ... please
    report it'; the --out folder is left as it was."""

    def init(**kwargs: object) -> None:
        raise RuntimeError("Failed to start the GCS server. Check logs at /tmp/ray/x.err")

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    monkeypatch.setattr("dvfs.fleet.ray_executor.import_ray", lambda local=False: fake)
    campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
    out = tmp_path / "o"
    result = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert result.exit_code == 1, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: could not start Ray on this machine (RuntimeError: Failed")
    assert "internal error" not in line and not out.exists()


@pytest.mark.timeout(120)
def test_workers_ray_cannot_place_are_a_note_then_one_line(
    ray_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another job holds two of the cluster's four twin GPUs: two of four workers cannot
    start. A note says so while the sweep waits, and at the time limit one line says why
    (it waited silently, then blamed the --out folder: 'cannot use DIR: get timed out')."""
    from dvfs.fleet import ray_executor
    from dvfs.fleet.ray_executor import TWIN_RESOURCE

    monkeypatch.setattr(ray_executor, "OPEN_TIMEOUT_S", 3.0)
    monkeypatch.setattr(ray_executor, "OPEN_NOTE_S", 1.0, raising=False)

    class Job:
        def ping(self) -> int:
            return 1

    job = ray_cluster.remote(resources={TWIN_RESOURCE: 2}, num_cpus=0)(Job).remote()
    try:
        ray_cluster.get(job.ping.remote(), timeout=60)
        campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
        out = tmp_path / "o"
        result = sweep(str(campaign), "--gpus", "0-3", "--executor", "ray", "--out", str(out))
    finally:
        ray_cluster.kill(job)
    assert result.exit_code == 1, result.output
    # At least the two Ray cannot place wait; on a loaded machine the two it placed may not
    # have started yet either (a Ray worker process takes seconds to start).
    said = " ".join(result.output.split())
    assert re.search(r"waiting for [234] of 4 Ray worker\(s\) to start", said), said
    assert "or the workers are still opening their GPUs" in said  # slow to start, not held
    last = result.output.strip().splitlines()[-1]
    assert re.match(r"Error: [234] of 4 Ray worker\(s\) did not start within 3 s", last), last
    assert "0 of the cluster's 4 twin_gpu free" in last and "--gpus" in last
    assert not (out / "journal.jsonl").exists()


@pytest.mark.timeout(120)
def test_too_few_twin_gpus_on_the_cluster_is_one_line(ray_cluster: object, tmp_path: Path) -> None:
    campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
    result = sweep(
        str(campaign), "--gpus", "0-5", "--executor", "ray", "--out", str(tmp_path / "o")
    )
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: the Ray cluster offers 4 twin_gpu") and "need 6" in last


@pytest.mark.timeout(300)
def test_each_test_gets_the_shared_ray_cluster_whole(
    ray_cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test may leave the shared Ray instance's GPUs held for as long as it runs: Ray 2.60
    keeps the worker it leased for an actor killed as it was being created, with that actor's
    GPUs (the kill reaches the worker before the actor does, and is ignored). The next test's
    sweep then waited for them until its timeout ("waiting for 1 of 2 Ray worker(s) to start
    (0 of the cluster's 2 GPU free"). The next test gets every resource free."""
    import conftest

    from dvfs.fleet.ray_executor import TWIN_RESOURCE

    class Holder:
        def ping(self) -> int:
            return 1

    # What such a worker holds, here held by an actor left alive (the race is not at will).
    holder = ray_cluster.remote(num_gpus=1, num_cpus=0, resources={TWIN_RESOURCE: 1})(Holder)
    held = holder.remote()
    ray_cluster.get(held.ping.remote())
    monkeypatch.setattr(conftest, "RAY_FREE_GRACE_S", 0.0, raising=False)  # no need to wait
    ray = conftest._RAY.start()  # as the next test's `ray_cluster` does
    total, free = ray.cluster_resources(), ray.available_resources()  # type: ignore[attr-defined]
    for name in ("CPU", "GPU", TWIN_RESOURCE):
        assert free.get(name, 0) == total[name], (name, free, total)


def test_real_gpu_workers_are_placed_on_whole_servers_of_one_node() -> None:
    """Real GPUs, engine.tp_size = 2, on two nodes of 3 GPUs each: two servers fit (one per
    node), not the three that 6 GPUs would make, the third waited for the 30 minutes of the
    actors' start before the sweep failed ("other jobs may hold them"); two nodes of 1 GPU
    each hold no server, said in one line."""
    from dvfs.errors import CampaignError
    from dvfs.fleet.ray_executor import RayExecutor

    def cluster(*gpus: int, dead: int = 0) -> types.SimpleNamespace:
        nodes = [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": float(n)}} for n in gpus]
        nodes += [{"Alive": False, "Resources": {"GPU": 8.0}}] * dead
        return types.SimpleNamespace(
            cluster_resources=lambda: {"GPU": float(sum(gpus))}, nodes=lambda: nodes
        )

    engine = types.SimpleNamespace(
        tp_size=2, backend="sglang", sglang=types.SimpleNamespace(url=None)
    )
    campaign = types.SimpleNamespace(engine=engine)
    executor = RayExecutor(Path("out"))
    placed = executor._placements(cluster(3, 3, dead=1), campaign, [], False)
    assert placed == [(None, {"num_gpus": 2, "num_cpus": 0})] * 2
    assert len(executor._placements(cluster(8, 2), campaign, [], False)) == 5
    with pytest.raises(CampaignError, match="no node of the Ray cluster has engine.tp_size = 2"):
        executor._placements(cluster(1, 1), campaign, [], False)
    with pytest.raises(CampaignError, match="offers 1 GPU"):
        executor._placements(cluster(1), campaign, [], False)


def test_twin_workers_are_placed_on_whole_servers_of_one_node() -> None:
    """Twin GPUs, engine.tp_size = 2, on two nodes of 3 `twin_gpu` each: three workers of 2
    need 6, which the cluster offers, but each node holds one whole server, so the third was
    waited for the 30 minutes of the actors' start before the sweep failed blaming other
    jobs; now one line says so before any actor is placed. Workers that fit are placed."""
    from dvfs.errors import CampaignError
    from dvfs.fleet.ray_executor import TWIN_RESOURCE, RayExecutor

    def cluster(*twins: int, dead: int = 0) -> types.SimpleNamespace:
        nodes = [{"Alive": True, "Resources": {"CPU": 8.0, TWIN_RESOURCE: float(n)}} for n in twins]
        nodes += [{"Alive": False, "Resources": {TWIN_RESOURCE: 8.0}}] * dead
        return types.SimpleNamespace(
            cluster_resources=lambda: {TWIN_RESOURCE: float(sum(twins))}, nodes=lambda: nodes
        )

    campaign = types.SimpleNamespace(engine=types.SimpleNamespace(tp_size=2))
    executor = RayExecutor(Path("out"))
    groups = [(0, 1), (2, 3), (4, 5)]
    with pytest.raises(CampaignError, match="hold 2 twin worker") as refused:
        executor._placements(cluster(3, 3, dead=1), campaign, groups, True)
    assert "of 2 twin_gpu each" in str(refused.value) and "\n" not in str(refused.value)
    placed = executor._placements(cluster(4, 2), campaign, groups, True)
    assert placed == [(g, {"resources": {TWIN_RESOURCE: 2}, "num_cpus": 0}) for g in groups]
    with pytest.raises(CampaignError, match="offers 4 twin_gpu"):
        executor._placements(cluster(2, 2), campaign, groups, True)


def test_after_ctrl_c_each_unit_an_actor_finishes_is_journalled_as_it_comes() -> None:
    """Once interrupted, the driver journals each unit as its actor finishes it, not once all
    have: a second Ctrl-C (or Slurm's SIGKILL after its SIGTERM) while one actor is still on a
    long unit lost the units the others had finished (measured, then measured again)."""
    from dvfs.fleet.ray_executor import RayExecutor

    finished = ["fast"]  # the slow actor's unit never finishes before the second signal

    def wait(refs, *, num_returns, timeout):  # type: ignore[no-untyped-def]
        ready = [r for r in refs if r in finished]
        if len(ready) < num_returns:
            raise KeyboardInterrupt  # the second Ctrl-C, while the driver waits
        return ready[:num_returns], [r for r in refs if r not in ready[:num_returns]]

    fake = types.SimpleNamespace(wait=wait, get=lambda ref: f"shipment of {ref}")
    shipped: list[tuple[str, str]] = []
    fleet = types.SimpleNamespace(shipped=lambda label, s: shipped.append((label, s)))
    pending = {"fast": ("gpu0", "unit0"), "slow": ("gpu1", "unit1")}
    with pytest.raises(KeyboardInterrupt):
        RayExecutor._collect(fake, fleet, pending)  # type: ignore[arg-type]
    assert shipped == [("gpu0", "shipment of fast")]


def fake_ray_fleet(actor_class, get, gpus: int, nodes, wait=None, actuation=True):  # type: ignore[no-untyped-def]
    """A stand-in `ray` module whose every actor is `actor_class`'s, answering `get` (and
    `wait`: default, every ref ready), on a cluster of `gpus` GPUs over `nodes()`, and a fleet
    of an SGLang campaign on real GPUs (NVML) to hand `RayExecutor._run` with it (`actuation`
    False: an --observe-only one)."""
    fake = types.SimpleNamespace(
        remote=lambda **kw: lambda cls: actor_class,
        cluster_resources=lambda: {"GPU": gpus},
        nodes=nodes,
        available_resources=lambda: {"GPU": 0},
        wait=wait or (lambda refs, num_returns, timeout: (list(refs), [])),
        get=get,
        kill=lambda actor: None,
    )
    campaign = types.SimpleNamespace(
        gpu=types.SimpleNamespace(backend="nvml", actuation=actuation),
        engine=types.SimpleNamespace(
            tp_size=1, backend="sglang", sglang=types.SimpleNamespace(url=None)
        ),
    )
    fleet = types.SimpleNamespace(
        campaign=campaign, corpora=None, open=lambda sessions: None, note=lambda message: None
    )
    return fake, fleet


def test_a_signal_while_the_actors_close_names_the_gpus_left_changed(monkeypatch) -> None:
    """Real GPUs: Ctrl-C, then another while the actors close (each behind its unit in
    flight), gives up waiting, and the actors are killed with their GPUs as they set them.
    The sweep's last line names them and `dvfs gpu reset` (it said 'GPU settings restored.',
    which on another node's GPUs it could not know)."""
    from dvfs.fleet.ray_executor import RayExecutor

    closed: list[str] = []

    class Actor:
        def __init__(self, label: str) -> None:
            self.label = label
            self.open = types.SimpleNamespace(remote=lambda: {"worker": label})
            self.close = types.SimpleNamespace(remote=lambda: ("close", self))
            self.unrestored = types.SimpleNamespace(remote=lambda: [])
            told = [label.split("/")[0], "`dvfs gpu reset --state-dir /s`"]
            self.reset_command = types.SimpleNamespace(remote=lambda: told)

    labels = iter(["n1/gpu0", "n2/gpu0", "n2/gpu1"])
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(labels)))
    )

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if isinstance(ref, tuple):  # a close
            if ref[1].label == "n2/gpu0":
                raise KeyboardInterrupt  # the user's next Ctrl-C, while it waits
            closed.append(ref[1].label)
            return None
        return ref

    fake, fleet = fake_ray_fleet(
        actor_class, get, 3, lambda: [{"Alive": True, "Resources": {"GPU": 3.0}}]
    )

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt  # the first Ctrl-C

    executor = RayExecutor(Path("out"))
    monkeypatch.setattr(executor, "_drive", interrupted)
    with pytest.raises(KeyboardInterrupt):
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    assert closed == ["n1/gpu0"]
    assert executor.unrestored == {
        "n2": [
            "the GPUs of worker n2/gpu0 (its close was given up)",
            "the GPUs of worker n2/gpu1 (its close was given up)",
        ]
    }
    assert executor.reset_on("n2") == "`dvfs gpu reset --state-dir /s`"


def test_sigterm_while_ray_starts_ends_as_without_ray(tmp_path: Path, monkeypatch) -> None:
    """SIGTERM (scancel) while `ray.init` starts Ray: exit 143 and the line to resume, as
    without Ray. `ray.init` sets its own SIGTERM handlers as it starts (`sys.exit(15)`, then
    the head node's, which exits 1), so the sweep ended 15 or 1 without a word."""
    import sys

    def set_sigterm_handler(handler):  # type: ignore[no-untyped-def]
        signal.signal(signal.SIGTERM, handler)

    utils = types.SimpleNamespace(set_sigterm_handler=set_sigterm_handler)

    def init(**kwargs: object) -> None:
        fake._private.utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))
        os.kill(os.getpid(), signal.SIGTERM)  # scancel, while Ray starts
        time.sleep(5)  # Python runs the handler at once; this is never waited out

    fake = types.SimpleNamespace(
        is_initialized=lambda: False, init=init, _private=types.SimpleNamespace(utils=utils)
    )
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr("dvfs.fleet.ray_executor.import_ray", lambda local=False: fake)
    campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
    result = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--executor", "ray", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 143, result.output
    assert "Run the same command again to resume" in result.output
    assert "Traceback" not in result.output


@pytest.mark.timeout(300)
def test_a_worker_that_cannot_open_leaves_the_others_gpus_restored(
    ray_nvml, tmp_path: Path
) -> None:
    """Real GPUs (the fake NVML's two) on Ray: GPU 1 is held by another dvfs, so its actor
    cannot open, while GPU 0's opened and measured its settle time (its clocks changed). The
    sweep fails in one line, and GPU 0 is put back: its actor was killed with its clocks
    locked, unsaid."""
    import fcntl

    from nvml_support import NVML_CAMPAIGN

    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1).replace(
        "settle = 0", 'settle = "measured"'
    )
    campaign = write(tmp_path / "nvml.toml", text)
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / f"{ray_nvml.fake_device_state(1)['uuid']}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = sweep(str(campaign), "--executor", "ray", "--out", str(tmp_path / "out"))
    finally:
        os.close(fd)
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    assert ray_nvml.fake_calls("nvmlDeviceSetGpuLockedClocks"), "GPU 0 never changed"
    assert ray_nvml.fake_device_state(0)["locked_clocks"] is None, result.output


def test_a_signal_raised_inside_rays_compiled_code_comes_back_as_itself() -> None:
    """A signal handler's exception raised while Ray's Cython `ray.wait` ran came back as a
    SystemError ("returned a result with an exception set") caused by it: a SIGTERM on a
    loaded machine ended the sweep as an internal error, exit 1, not 143. Through
    `SignalSafe` it is the signal's own exception again; other SystemErrors stay as they are."""
    from dvfs.fleet.ray_executor import SignalSafe
    from dvfs.signals import Interrupted

    def compiled(signalled: BaseException | None) -> object:
        def call(*args: object, **kwargs: object) -> object:
            if signalled is None:
                raise SystemError("a fault of Ray's own")
            try:
                raise signalled
            except BaseException as exc:
                raise SystemError(
                    "<cyfunction CoreWorker.wait> returned a result with an exception set"
                ) from exc

        return call

    for signalled in (Interrupted(signal.SIGTERM), KeyboardInterrupt()):
        ray = SignalSafe(types.SimpleNamespace(wait=compiled(signalled), get=compiled(signalled)))
        with pytest.raises(type(signalled)):
            ray.wait([], num_returns=1, timeout=0.1)
        with pytest.raises(type(signalled)):
            ray.get([])
    plain = SignalSafe(types.SimpleNamespace(wait=compiled(None), is_initialized=lambda: True))
    with pytest.raises(SystemError, match="a fault of Ray's own"):
        plain.wait([])
    assert plain.is_initialized()


def test_a_ray_workers_long_error_is_cut_at_a_word_and_marked() -> None:
    """A Ray worker's error longer than 200 characters was cut at 200 in the middle of a word
    and without a mark ('... cannot reset locked SM clocks: unrecovered unrecove'), read as
    the whole error. It is cut as the local fleet's all-lost line cuts one (one helper): at a
    word, marked "…", within 200 characters; a short one is kept whole."""
    from dvfs.errors import GpuError
    from dvfs.fleet.ray_executor import RayExecutor

    said: list[str] = []

    class Fleet:
        campaign = None

        def lost(self, label: str, cell: object, why: str, record: dict) -> None:
            said.append(why)

    head = "could not restore GPU settings: GPU 0 (GPU-0): cannot reset locked SM clocks:"
    for words in (40, 2):
        wrapped = RuntimeError("the actor raised")
        wrapped.cause = GpuError(" ".join([head, *["unrecovered"] * words]))  # type: ignore[attr-defined]
        RayExecutor.__new__(RayExecutor)._lost(Fleet(), "vm/gpu0", None, wrapped)  # type: ignore[arg-type]
    long, short = said
    whole = f"GpuError: {head} " + " ".join(["unrecovered"] * 40)
    assert len(long) <= 200 and long.endswith(" unrecovered…"), long
    assert whole.startswith(long[:-1]) and whole[len(long) - 1] == " ", long
    from dvfs.fleet.driver import bounded_why  # the local fleet's, for its all-lost line

    assert long == bounded_why(whole)
    assert short == f"GpuError: {head} unrecovered unrecovered", short


def test_a_signal_while_the_actors_open_names_the_reset_their_node_told(monkeypatch) -> None:
    """Real GPUs: Ctrl-C while the actors open their GPUs (a measured settle changes them),
    then another while they close, gives up waiting: the actors are killed with their GPUs as
    they set them. Each had told its node's reset (with the --state-dir of its
    $DVFS_STATE_DIR, which `sudo` drops) before it opened, but only a run past the opening
    noted it: the last line said a plain `dvfs gpu reset`, which finds no state file there."""
    from dvfs.cli.sweep import _ray_unrestored
    from dvfs.fleet.ray_executor import RayExecutor

    class Actor:
        def __init__(self, label: str) -> None:
            self.label = label
            self.open = types.SimpleNamespace(remote=lambda: ("open", label))
            self.close = types.SimpleNamespace(remote=lambda: ("close", label))
            self.unrestored = types.SimpleNamespace(remote=lambda: [])
            told = (label.split("/")[0], "`dvfs gpu reset --state-dir /s`")
            self.reset_command = types.SimpleNamespace(remote=lambda: told)

    labels = iter(["n1/gpu0", "n1/gpu1"])
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(labels)))
    )
    waited: list[int] = []

    def wait(refs, num_returns, timeout):  # type: ignore[no-untyped-def]
        opening = any(isinstance(r, tuple) and r[0] == "open" for r in refs)
        if opening and not waited:
            waited.append(1)
            raise KeyboardInterrupt  # the first Ctrl-C, while the actors open
        return list(refs), []

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if ref[0] == "open":  # each opened: its GPUs changed
            return {"worker": ref[1]}
        if ref[0] == "close":
            raise KeyboardInterrupt  # the user's next Ctrl-C, while it waits
        return ref

    fake, fleet = fake_ray_fleet(
        actor_class, get, 2, lambda: [{"Alive": True, "Resources": {"GPU": 2.0}}], wait=wait
    )
    executor = RayExecutor(Path("out"))
    with pytest.raises(KeyboardInterrupt):
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    assert executor.unrestored == {
        "n1": [
            "the GPUs of worker n1/gpu0 (its close was given up)",
            "the GPUs of worker n1/gpu1 (its close was given up)",
        ]
    }
    line = _ray_unrestored(executor.unrestored, resets=executor.resets)
    assert "run `dvfs gpu reset --state-dir /s` on n1 once the GPU answers again" in line, line


class ActorDiedError(Exception):
    """Stands in for Ray's error of an actor that died (its name is what the lines show)."""


def _actors_n1_dies_opening(told: dict[str, str]):  # type: ignore[no-untyped-def]
    """A stand-in actor class (one actor a label of `told`, in its order, each telling its
    node's reset command) and `ray.get`, where actor n1/gpu0 dies as it opens."""

    class Actor:
        def __init__(self, label: str) -> None:
            self.open = types.SimpleNamespace(remote=lambda: ("open", label))
            self.close = types.SimpleNamespace(remote=lambda: ("close", label))
            self.unrestored = types.SimpleNamespace(remote=lambda: ("unrestored", label))
            node = (label.split("/")[0], told[label])
            self.reset_command = types.SimpleNamespace(remote=lambda: ("told", node))

    made = iter(told)
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(made)))
    )

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if ref == ("open", "n1/gpu0"):
            raise ActorDiedError("The actor died unexpectedly before finishing this task.")
        if ref[0] == "open":
            return {"worker": ref[1]}
        if ref[0] == "unrestored":
            return []
        return None if ref[0] == "close" else ref[1]

    return actor_class, get


def test_an_actor_that_dies_opening_names_its_own_nodes_reset_on_mixed_nodes() -> None:
    """Real GPUs on two nodes, one whose $DVFS_STATE_DIR keeps the state files (its reset needs
    --state-dir, `sudo` dropping the variable), the other the default: the actor on the first
    dies as it opens, after it told its node's reset. The line said a plain `dvfs gpu reset`
    there (the nodes' commands differ), which finds no state file on that node: it names the
    one the dead actor told."""
    from dvfs.fleet.ray_executor import RayExecutor

    actor_class, get = _actors_n1_dies_opening(
        {"n1/gpu0": "`dvfs gpu reset --state-dir /s`", "n2/gpu0": "`dvfs gpu reset`"}
    )
    fake, fleet = fake_ray_fleet(
        actor_class, get, 2, lambda: [{"Alive": True, "Resources": {"GPU": 1.0}}] * 2
    )
    with pytest.raises(Exception, match="died as it started") as died:
        RayExecutor(Path("out"))._run(fake, fleet, [], False)  # type: ignore[arg-type]
    line = str(died.value)
    assert "settings it set: `dvfs gpu reset --state-dir /s` there" in line, line


@pytest.mark.parametrize("name", ["system-error", "object-store-full-in-the-actor"])
def test_a_ray_error_as_an_actor_opens_names_its_own_nodes_reset_on_mixed_nodes(name: str) -> None:
    """As for an actor that died opening: real GPUs on two nodes whose resets differ (one with
    --state-dir), and the actor on the first answers its open with Ray's own error (not its
    death). Its line said a plain `dvfs gpu reset` there, which finds no state file on that
    node: it names the one that actor told."""
    from dvfs.errors import DvfsError
    from dvfs.fleet.ray_executor import RayExecutor

    actor_class, get = _actors_n1_dies_opening(
        {"n1/gpu0": "`dvfs gpu reset --state-dir /s`", "n2/gpu0": "`dvfs gpu reset`"}
    )
    error = dict(ray_errors())[name]

    def failing(ref, timeout=None):  # type: ignore[no-untyped-def]
        try:
            return get(ref, timeout)
        except ActorDiedError:
            raise error from None

    fake, fleet = fake_ray_fleet(
        actor_class, failing, 2, lambda: [{"Alive": True, "Resources": {"GPU": 1.0}}] * 2
    )
    with pytest.raises(DvfsError) as raised:
        RayExecutor(Path("out"))._run(fake, fleet, [], False)  # type: ignore[arg-type]
    line = str(raised.value)
    assert line.startswith("Ray failed as a worker started ("), line
    assert "settings it set: `dvfs gpu reset --state-dir /s` there" in line, line


def test_gpus_the_closes_leave_changed_after_a_worker_died_starting_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GPUs on two nodes: the actor on n1 dies as it opens (the run fails in its line,
    naming n1's reset), then the actor that opened on n2 is closed and NVML refuses its
    restore, GPU-n2 left changed. The sweep said the line alone: GPU-n2, on another node with
    its own reset, was never named. It is, with n2's reset, beside the line."""
    import ray.exceptions
    from conftest import TINY_EXACT

    from dvfs.errors import GpuError
    from dvfs.fleet.ray_executor import RayExecutor

    actor_class, get = _actors_n1_dies_opening(
        {"n1/gpu0": "`dvfs gpu reset`", "n2/gpu0": "`dvfs gpu reset --state-dir /s`"}
    )

    def restore_refused(ref, timeout=None):  # type: ignore[no-untyped-def]
        if ref == ("close", "n2/gpu0"):
            refused = GpuError("GPU 0: cannot reset the locked clocks: NVML refused (Unknown)")
            raise ray.exceptions.RayTaskError("close", "", refused).as_instanceof_cause()
        if ref == ("unrestored", "n2/gpu0"):
            return ["GPU-n2"]
        return get(ref, timeout)

    fake, fleet = fake_ray_fleet(
        actor_class, restore_refused, 2, lambda: [{"Alive": True, "Resources": {"GPU": 1.0}}] * 2
    )

    def run(self: RayExecutor, _fleet: object, groups: object) -> None:
        self._run(fake, fleet, [], False)  # type: ignore[arg-type]

    monkeypatch.setattr(RayExecutor, "__call__", run)
    campaign = write(tmp_path / "campaign.toml", TINY_EXACT)
    result = sweep(str(campaign), "--gpus", "0-1", "--executor", "ray", "--out", str(tmp_path))
    assert result.exit_code == 1, result.output
    said = " ".join(result.stderr.split())
    assert "a Ray worker died as it started" in said, said
    assert "GPU settings NOT restored for GPU-n2 on n2: " in said, said
    assert "NVML refused" in said and "`dvfs gpu reset --state-dir /s` on n2" in said, said
    assert "Traceback" not in result.output


@pytest.mark.parametrize("actuation", [True, False])
def test_an_observe_only_actor_that_dies_names_no_settings_kept_nor_reset(actuation: bool) -> None:
    """An --observe-only Ray fleet on real GPUs changes no GPU setting: an actor that died as
    it opened was said to leave "its GPUs [that] may keep settings it set: `dvfs gpu reset`
    there", and one dying mid-sweep "died without restoring its GPUs: run `dvfs gpu reset`",
    sending the user to reset GPUs nothing changed. Neither line names settings or a reset,
    and nothing is noted as left unrestored."""
    from dvfs.fleet.ray_executor import RayExecutor

    actor_class, get = _actors_n1_dies_opening(
        {"n1/gpu0": "`dvfs gpu reset`", "n2/gpu0": "`dvfs gpu reset`"}
    )
    fake, fleet = fake_ray_fleet(
        actor_class,
        get,
        2,
        lambda: [{"Alive": True, "Resources": {"GPU": 1.0}}] * 2,
        actuation=actuation,
    )
    executor = RayExecutor(Path("out"))
    with pytest.raises(Exception, match="died as it started") as died:
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    opening = str(died.value)
    assert opening.startswith("a Ray worker died as it started (ActorDiedError: "), opening
    assert opening.endswith("; rerun the same command once the cluster is whole"), opening

    said: list[str] = []
    lost: list[dict] = []  # type: ignore[type-arg]
    mid = types.SimpleNamespace(
        campaign=fleet.campaign,
        note=said.append,
        lost=lambda label, cell, why, record: lost.append(record),
    )
    executor._lost(mid, "n1/gpu0", None, ActorDiedError("The actor died unexpectedly."))  # type: ignore[arg-type]
    [record] = lost
    if actuation:  # as before: it may have measured a settle, or set a knob
        assert "may keep settings it set: `dvfs gpu reset` there" in opening, opening
        assert said == [
            "worker n1/gpu0 died without restoring its GPUs: run `dvfs gpu reset` on n1"
        ]
        assert record["reset"] == "run `dvfs gpu reset` on n1"
        assert executor.unrestored
        return
    assert "settings" not in opening and "reset" not in opening, opening
    assert not said and "reset" not in record and not executor.unrestored, said


def _ray_error(name: str) -> BaseException:
    """Ray's own error `name` of a call whose actor's process is gone, as `ray.get` raises it."""
    import ray.exceptions

    kind = getattr(ray.exceptions, name)
    if name == "ObjectLostError":
        return kind("ab" * 28, None, "")
    return kind() if name == "WorkerCrashedError" else kind(OOM_MESSAGE)


@pytest.mark.parametrize(
    "error", ["OutOfMemoryError", "NodeDiedError", "WorkerCrashedError", "ObjectLostError"]
)
def test_a_worker_ray_kills_as_it_opens_is_one_line_not_an_internal_error(error: str) -> None:
    """Real GPUs on Ray: a worker's actor killed as it opens by Ray's memory monitor (the node
    short of memory: an OutOfMemoryError, a RayError but not a RayActorError), or lost with
    its node, or whose worker process crashed. It came out of the run as Ray's own error, which
    the sweep said as "internal error: OutOfMemoryError: ...; please report it": one line
    saying what befell it, its node's reset, and to rerun."""
    from dvfs.errors import DvfsError
    from dvfs.fleet.ray_executor import RayExecutor

    actor_class, get = _actors_n1_dies_opening(
        {"n1/gpu0": "`dvfs gpu reset --state-dir /s`", "n2/gpu0": "`dvfs gpu reset`"}
    )

    def killed(ref, timeout=None):  # type: ignore[no-untyped-def]
        try:
            return get(ref, timeout)
        except ActorDiedError:
            raise _ray_error(error) from None

    fake, fleet = fake_ray_fleet(
        actor_class, killed, 2, lambda: [{"Alive": True, "Resources": {"GPU": 1.0}}] * 2
    )
    with pytest.raises(DvfsError) as died:
        RayExecutor(Path("out"))._run(fake, fleet, [], False)  # type: ignore[arg-type]
    line = str(died.value)
    assert "\n" not in line and "settings it set: `dvfs gpu reset --state-dir /s` there" in line
    if error == "OutOfMemoryError":
        assert line.startswith(
            "a Ray worker was killed as it started: its node ran out of memory (OutOfMemoryError: "
            "Task was killed due to the node running low on memory.)"
        ), line
        assert line.endswith("free memory on that node (its other jobs) and rerun the same command")
    else:
        assert line.startswith(f"a Ray worker died as it started ({error}"), line


@pytest.mark.parametrize(
    "error", ["OutOfMemoryError", "NodeDiedError", "WorkerCrashedError", "ObjectLostError"]
)
def test_a_worker_ray_kills_mid_sweep_or_as_it_closes_is_lost_with_its_gpus(error: str) -> None:
    """Real GPUs on Ray: an actor killed by Ray's memory monitor (or lost with its node, or
    crashed) while it measured a cell, or as it was asked to close. Its process is gone, its
    GPUs as it set them: the loss names `dvfs gpu reset` on its node and the sweep's last line
    its GPUs, as for an actor that died. It was said lost without a reset (the sweep ended 0,
    the GPUs locked), and a close it never answered was taken for a failed restore."""
    from dvfs.fleet.ray_executor import RayExecutor

    actor_class, get = _actors_n1_dies_opening({"n1/gpu0": "`dvfs gpu reset`"})
    fake, fleet = fake_ray_fleet(
        actor_class, get, 1, lambda: [{"Alive": True, "Resources": {"GPU": 1.0}}]
    )
    said: list[str] = []
    lost: list[dict] = []  # type: ignore[type-arg]
    mid = types.SimpleNamespace(
        campaign=fleet.campaign,
        note=said.append,
        lost=lambda label, cell, why, record: lost.append(record),
    )
    executor = RayExecutor(Path("out"))
    executor._lost(mid, "n1/gpu0", None, _ray_error(error))  # type: ignore[arg-type]
    [record] = lost
    assert record["error"].startswith(error), record
    assert record["reset"] == "run `dvfs gpu reset` on n1", record
    assert said == ["worker n1/gpu0 died without restoring its GPUs: run `dvfs gpu reset` on n1"]
    assert executor.unrestored == {"n1": ["the GPUs of worker n1/gpu0 (its actor died)"]}

    def close_killed(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, tuple) and ref[0] == "close":
            raise _ray_error(error)
        return get(ref, timeout)

    fake.get = close_killed
    closing = RayExecutor(Path("out"))
    closing._close(fake, fleet.campaign, {"n1/gpu0": actor_class.options().remote()})
    assert closing.unrestored == {"n1": ["the GPUs of worker n1/gpu0 (its actor died)"]}
    assert not closing.close_errors, closing.close_errors


def test_a_ray_fleet_lost_on_two_nodes_keeps_the_resume_within_the_line() -> None:
    """A Ray fleet of two nodes of four GPUs each, every GPU off the bus: the line names three
    losses (each with its node), then each node twice in the reset to run there first, and ran
    past the error line's bound (1000 characters), cutting the resume advice short ('rerun the
    same command without --fresh to resume (with it, it st...'). The losses named give way
    to the reset and the resume, which end the line whole."""
    from dvfs.cli.common import MAX_MESSAGE_CHARS, one_line
    from dvfs.errors import JournalError
    from dvfs.fleet.driver import Driver, resume_advice
    from dvfs.fleet.ray_executor import RayExecutor

    hosts = [f"gpu-node-{i:03d}.cluster.example.org" for i in range(2)]
    executor = RayExecutor(Path("out"))
    for host in hosts:
        executor.resets[host] = "`dvfs gpu reset --state-dir /shared/scratch/dvfs-state`"
        executor.unrestored[host] = [f"the GPUs of worker {host}/gpu0"]
    lost = (
        "GpuUnavailableError: GPU {}: cannot read the power limit: the GPU has fallen off the "
        "bus (NVML: GPU is lost); it needs a reset or a reboot before it can be used"
    )
    stats = {
        f"{host}/gpu{i}": types.SimpleNamespace(label=f"{host}/gpu{i}", lost=lost.format(i))
        for host in hosts
        for i in range(4)
    }
    driver = types.SimpleNamespace(
        finished=False, refused=None, stats=stats, _outstanding=set(range(37))
    )
    with pytest.raises(JournalError) as failed:
        Driver.check_finished(driver, True, executor.reset_first())  # type: ignore[arg-type]
    message = str(failed.value)
    assert len(message) <= MAX_MESSAGE_CHARS, message
    line = f"Error: {one_line(message)}"  # as the sweep says it
    assert line.startswith("Error: every worker was lost with 37 cell(s) left ("), line
    assert f"{hosts[0]}/gpu0: GpuUnavailableError: GPU 0: " in line, line
    assert line.endswith(
        f"the journal keeps every finished cell; {executor.reset_first()}, then "
        + resume_advice(True)
    ), line


def test_the_actors_are_asked_to_close_at_once_so_their_restores_run_side_by_side() -> None:
    """At a fleet's end each actor stops its server and restores its GPUs: the driver asked
    the next actor to close only once the one before had closed, so a fleet of eight real
    GPUs waited the sum of eight server stops and restores. Every close is asked first, then
    each awaited; what each left changed is still noted, in the actors' order."""
    from dvfs.fleet.ray_executor import RayExecutor

    events: list[str] = []

    class Method:
        def __init__(self, label: str, name: str, answer: object) -> None:
            self.label, self.name, self.answer = label, name, answer

        def remote(self) -> tuple[str, str, object]:
            events.append(f"ask {self.name} {self.label}")
            return (self.name, self.label, self.answer)

    class Actor:
        def __init__(self, label: str, left: list[str]) -> None:
            self.close = Method(label, "close", None)
            self.unrestored = Method(label, "unrestored", left)

    def get(ref: tuple[str, str, object], timeout: float | None = None) -> object:
        events.append(f"get {ref[0]} {ref[1]}")
        return ref[2]

    def wait(refs: list, *, num_returns: int, timeout: float) -> tuple[list, list]:  # type: ignore[type-arg]
        events.append(f"wait {len(refs)}")
        return list(refs), []

    ray = types.SimpleNamespace(get=get, wait=wait)
    campaign = types.SimpleNamespace(gpu=types.SimpleNamespace(backend="twin", actuation=True))
    alive = {"node-a/w0": Actor("node-a/w0", []), "node-b/w1": Actor("node-b/w1", ["GPU-b"])}
    executor = RayExecutor(Path("out"))
    executor._close(ray, campaign, alive)  # type: ignore[arg-type]
    closes = [e for e in events if " close " in e or e.startswith("wait")]
    assert closes == [
        "ask close node-a/w0",
        "ask close node-b/w1",
        "wait 4",  # every close (and what each left changed) awaited together
        "get close node-a/w0",
        "get close node-b/w1",
    ], events
    assert executor.unrestored == {"node-b": ["GPU-b"]}


@pytest.mark.parametrize("failure", ["another-version", "system-error"])
def test_a_cluster_ray_cannot_join_for_another_reason_is_one_line(
    tmp_path: Path, monkeypatch, failure: str
) -> None:
    """--address of a running cluster that Ray's join refuses other than with a
    ConnectionError: one started with another Ray or Python (Ray's RuntimeError "Version
    mismatch: ...", raised as its own check raises it), or a RaySystemError. Each was an
    internal error ("please report it") of Ray's first line, not what to do."""
    import ray._private.utils
    import ray.exceptions

    def init(**kwargs: object) -> None:
        if failure == "another-version":
            ray._private.utils.check_version_info(
                {"ray_version": "2.9.3", "python_version": "3.10.12"}, "127.0.0.1"
            )
        raise ray.exceptions.RaySystemError("the raylet of this node died")

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init)
    monkeypatch.setitem(__import__("sys").modules, "ray", fake)
    campaign = write(tmp_path / "rayed.toml", CAMPAIGN)
    out = tmp_path / "o"
    result = sweep(str(campaign), "--executor", "ray", "--address", "auto", "--out", str(out))
    assert result.exit_code == 1, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("Error: could not join the Ray cluster at --address auto ("), line
    assert "internal error" not in line and "Traceback" not in result.output
    if failure == "another-version":
        assert "cluster: Ray 2.9.3, Python 3.10.12" in line, line
        assert "pip install 'ray==2.9.3'" in line, line
    else:
        assert "RaySystemError: System error: the raylet of this node died" in line, line
        assert "ray status" in line, line
    assert not (out / "journal.jsonl").exists()


def ray_errors() -> list:  # type: ignore[type-arg]
    """Ray's errors other than a dead actor's, built as Ray builds them: (id, the error)."""
    import ray.exceptions as rex

    def wrapped(cause: BaseException) -> BaseException:
        # what an actor's method that raised `cause` answers (Ray's own wrapper)
        error = rex.RayTaskError("WorkerActor.open", "Traceback (most recent call last):", cause)
        return error.as_instanceof_cause()

    full = "Failed to put object 00ff in object store because it is full. Object size is 9 bytes."
    return [
        ("object-store-full", rex.ObjectStoreFullError(full)),
        ("object-store-full-in-the-actor", wrapped(rex.ObjectStoreFullError(full))),
        ("out-of-disk", rex.OutOfDiskError("Failed to put object 00ff in object store")),
        ("cancelled", rex.TaskCancelledError(error_message="the task was cancelled")),
        ("get-timeout", rex.GetTimeoutError("Get timed out: some object(s) not ready.")),
        ("system-error", rex.RaySystemError("the raylet died")),
        # an actor unreachable for now (restarting, its network): it may answer again
        ("actor-unavailable", rex.ActorUnavailableError("the actor is restarting", None)),
        # as a real Ray answers an actor whose runtime_env (its job's) could not be set up
        ("runtime-env", rex.RuntimeEnvSetupError(error_message=RUNTIME_ENV_FAILED)),
        ("unschedulable", rex.ActorUnschedulableError("its node affinity's node is dead")),
    ]


#: What Ray 2.60 said of an actor given runtime_env={"conda": ...} on a node without conda.
RUNTIME_ENV_FAILED = (
    "Could not create the actor because its associated runtime env failed to be created.\n"
    "[Node 127.0.0.1] Traceback (most recent call last):\n"
    '  File "ray/_private/runtime_env/conda_utils.py", line 195, in get_conda_info_json\n'
    '    raise ValueError(f"Could not find Conda executable at {conda_path}.")\n'
    "ValueError: Could not find Conda executable at conda."
)


@pytest.mark.parametrize("name", [n for n, _ in ray_errors()])
def test_a_ray_error_as_the_workers_open_is_one_line_naming_the_reset(name: str) -> None:
    """Real GPUs: one actor's open answers one of Ray's errors other than a dead actor's (the
    object store full, a cancelled task, a timeout, Ray's system error). The run fails in one
    dvfs line that names it, says what to do and that its GPUs may keep what it set (its
    worker may have opened them), and closes the actor that opened: it raised Ray's error
    raw, an internal error (a GetTimeoutError, an OSError, even "cannot use DIR")."""
    from dvfs.errors import DvfsError
    from dvfs.fleet.ray_executor import RayExecutor

    error = dict(ray_errors())[name]
    closed: list[str] = []

    class Actor:
        def __init__(self, label: str) -> None:
            self.label = label
            self.open = types.SimpleNamespace(remote=lambda: ("open", self))
            self.close = types.SimpleNamespace(remote=lambda: ("close", self))
            self.unrestored = types.SimpleNamespace(remote=lambda: [])
            told = [label.split("/")[0], "`dvfs gpu reset --state-dir /s`"]
            self.reset_command = types.SimpleNamespace(remote=lambda: told)

    labels = iter(["n1/gpu0", "n1/gpu1"])
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(labels)))
    )

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if isinstance(ref, tuple):
            what, actor = ref
            if what == "open" and actor.label == "n1/gpu1":
                raise error
            if what == "close":
                closed.append(actor.label)
            return {"worker": actor.label} if what == "open" else None
        return ref

    fake, fleet = fake_ray_fleet(
        actor_class, get, 2, lambda: [{"Alive": True, "Resources": {"GPU": 2.0}}]
    )
    executor = RayExecutor(Path("out"))
    with pytest.raises(DvfsError) as raised:
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    assert not isinstance(raised.value, OSError)  # not worded as the --out folder's fault
    (line,) = str(raised.value).splitlines()
    assert line.startswith("Ray failed as a worker started ("), line
    cause = getattr(error, "cause", error)
    assert f"{type(cause).__name__}: " in line or line.count(type(cause).__name__) == 1, line
    # a worker whose process never ran opened no GPU: no reset to run
    started = name not in ("runtime-env", "unschedulable")
    assert ("`dvfs gpu reset --state-dir /s` there" in line) == started, line
    assert "rerun the same command" in line, line
    if "full" in name or "disk" in name:
        assert "ray memory" in line and "df" in line, line
    elif name == "runtime-env":
        why = (
            "(RuntimeEnvSetupError: Failed to set up runtime environment: ValueError: Could "
            "not find Conda executable at conda.)"
        )
        assert why in line, line
        assert "runtime_env" in line and "ray job submit" in line, line
    else:
        assert "ray status" in line, line
    assert closed == ["n1/gpu0"]  # the one that opened put its GPUs back


@pytest.mark.parametrize("name", ["get-timeout", "system-error", "actor-unavailable"])
def test_a_close_ray_lost_names_the_gpus_left_changed(name: str) -> None:
    """Real GPUs: an actor's close answers one of Ray's errors other than a dead actor's (a
    close that did not finish in time, Ray's system error), and its actor is then killed:
    its GPUs may keep what it set. The sweep names them and the reset (it noted nothing, and
    the sweep ended 0 with the GPU changed)."""
    from dvfs.fleet.ray_executor import RayExecutor

    error = dict(ray_errors())[name]

    class Actor:
        def __init__(self, label: str) -> None:
            self.label = label
            self.open = types.SimpleNamespace(remote=lambda: ("open", self))
            self.close = types.SimpleNamespace(remote=lambda: ("close", self))
            self.unrestored = types.SimpleNamespace(remote=lambda: ("unrestored", self))
            self.close_error = types.SimpleNamespace(remote=lambda: ("close_error", self))
            told = [label.split("/")[0], "`dvfs gpu reset --state-dir /s`"]
            self.reset_command = types.SimpleNamespace(remote=lambda: told)

    labels = iter(["n1/gpu0", "n1/gpu1"])
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(labels)))
    )

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if isinstance(ref, tuple):
            what, actor = ref
            if what == "open":
                return {"worker": actor.label}
            if actor.label == "n1/gpu1" and what in ("close", "unrestored"):
                raise error  # (its close still runs: what is asked after it waits too)
            return [] if what == "unrestored" else None
        return ref

    fake, fleet = fake_ray_fleet(
        actor_class, get, 2, lambda: [{"Alive": True, "Resources": {"GPU": 2.0}}]
    )
    executor = RayExecutor(Path("out"))
    executor._drive = lambda *args: None  # type: ignore[method-assign]
    executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    (what,) = executor.unrestored["n1"]
    assert what.startswith("the GPUs of worker n1/gpu1 (its close failed: "), what
    assert type(error).__name__ in what, what
    assert executor.reset_first().endswith("run `dvfs gpu reset --state-dir /s` on n1")


@pytest.mark.timeout(300)
def test_a_unit_ray_itself_failed_closes_its_worker_and_restores_its_gpus(
    ray_nvml, ray_cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GPUs (the fake NVML's two) on Ray: the first unit handed out is answered by Ray's
    own error (a RaySystemError, Ray's real class), not its actor's death nor its worker's
    raise: the actor lives on, its worker open, its GPU set. Its worker is closed (its GPU put
    back) and the other measures every cell: exit 0, no reset to run (the actor was killed
    with its GPU locked, and the sweep ended 1 asking for `dvfs gpu reset`)."""
    import ray.exceptions

    from dvfs.fleet.driver import Fleet

    get, started = ray_cluster.get, Fleet.started  # type: ignore[attr-defined]
    armed: list[bool] = []

    def start(self: Fleet, worker: str, unit) -> None:  # type: ignore[no-untyped-def]
        armed.append(True)
        started(self, worker, unit)

    def get_as_ray_fails(ref, *args, **kwargs):  # type: ignore[no-untyped-def]
        if armed and armed[0] and not isinstance(ref, list) and not args and not kwargs:
            armed[0] = False  # once: the first unit's answer
            raise ray.exceptions.RaySystemError("the raylet lost the unit's answer")
        return get(ref, *args, **kwargs)

    monkeypatch.setattr(Fleet, "started", start)
    monkeypatch.setattr(ray_cluster, "get", get_as_ray_fails)
    from nvml_support import NVML_CAMPAIGN

    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=3))
    out = tmp_path / "out"
    result = sweep(str(campaign), "--executor", "ray", "--out", str(out))
    assert armed and armed[0] is False, result.output  # the failure was injected
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "lost (RaySystemError: System error: the raylet lost the unit's answer)" in said
    assert "NOT restored" not in result.output and "internal error" not in result.output
    assert ray_nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")  # the GPUs were set
    assert all(ray_nvml.fake_device_state(i)["locked_clocks"] is None for i in range(2))
    records = list(read_records(out / "journal.jsonl"))
    cells = [r["key"] for r in records if r["type"] == "cell"]
    assert len(cells) == len(set(cells)) == 12 and (out / "cube.nc").is_file()
    assert [r["type"] for r in records].count("worker_lost") == 1


@pytest.mark.timeout(300)
def test_actors_whose_close_never_answers_are_killed_and_their_gpus_named(
    ray_cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GPUs, Ray's real actors: at a fleet's end two actors never answer their close (their
    node cut off, a restore stuck). Their closes were awaited in turn, half an hour each, then
    what each left changed half an hour more, and the actors were left running. All the closes
    are awaited together under one bound (`CLOSE_TIMEOUT_S`, made short here): those that did
    not answer are killed, and their GPUs named as left changed with their node's reset."""
    from dvfs.fleet import ray_executor
    from dvfs.fleet.ray_executor import RayExecutor

    class Stuck:
        def close(self) -> None:
            threading.Event().wait()  # never answers

        def unrestored(self) -> list[str]:
            return []

        def ping(self) -> str:
            return "up"

    # Both bounds short: the run's before this change waited on each close with the open's.
    monkeypatch.setattr(ray_executor, "CLOSE_TIMEOUT_S", 1.0, raising=False)
    monkeypatch.setattr(ray_executor, "OPEN_TIMEOUT_S", 1.0)
    stuck = ray_cluster.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(Stuck)  # type: ignore[attr-defined]
    alive = {"n1/gpu0": stuck.remote(), "n2/gpu0": stuck.remote()}
    ray_cluster.get([a.ping.remote() for a in alive.values()])  # type: ignore[attr-defined]
    kill = ray_cluster.kill  # type: ignore[attr-defined]
    killed: list[object] = []

    def spy(actor: object, **kwargs: object) -> None:
        killed.append(actor)
        kill(actor, **kwargs)

    monkeypatch.setattr(ray_cluster, "kill", spy)
    campaign = types.SimpleNamespace(gpu=types.SimpleNamespace(backend="nvml", actuation=True))
    executor = RayExecutor(Path("out"))
    executor.resets = {"n1": "`dvfs gpu reset --state-dir /s`", "n2": "`dvfs gpu reset`"}
    try:
        executor._close(ray_cluster, campaign, alive)
        assert killed == list(alive.values())
        assert executor.unrestored == {
            host: [f"the GPUs of worker {host}/gpu0 (its close did not come within 1 s)"]
            for host in ("n1", "n2")
        }
        assert executor.reset_first().endswith(
            "run `dvfs gpu reset --state-dir /s` on n1, `dvfs gpu reset` on n2"
        ), executor.reset_first()
        assert not executor.close_errors, executor.close_errors
    finally:
        for actor in alive.values():
            kill(actor)  # the shared cluster whole for the next test


def test_a_close_not_answered_in_time_is_given_up_and_the_others_read() -> None:
    """Of two actors asked to close, one answers (its GPU `GPU-a` left changed, a restore
    NVML refused) and one does not within the bound: the driver never waits on the one that
    did not (a `get` of it would wait as long again), kills it and names its GPUs; the one that
    answered is read as ever, and its GPUs not named as its actor's."""
    from dvfs.fleet.ray_executor import RayExecutor

    hung: list[str] = []

    class Method:
        def __init__(self, label: str, name: str, answer: object) -> None:
            self.label, self.name, self.answer = label, name, answer

        def remote(self) -> tuple[str, str, object]:
            return (self.name, self.label, self.answer)

    class Actor:
        def __init__(self, label: str, left: list[str]) -> None:
            self.label = label
            self.close = Method(label, "close", None)
            self.unrestored = Method(label, "unrestored", left)

    def get(ref: tuple[str, str, object], timeout: float | None = None) -> object:
        if ref[1] == "b/w1":
            hung.append(ref[0])  # Ray's get would wait for it (until its timeout)
            import ray.exceptions

            raise ray.exceptions.GetTimeoutError("Get timed out")
        return ref[2]

    def wait(refs: list, *, num_returns: int, timeout: float) -> tuple[list, list]:  # type: ignore[type-arg]
        return [r for r in refs if r[1] != "b/w1"], [r for r in refs if r[1] == "b/w1"]

    killed: list[str] = []
    ray = types.SimpleNamespace(get=get, wait=wait, kill=lambda actor: killed.append(actor.label))
    campaign = types.SimpleNamespace(gpu=types.SimpleNamespace(backend="nvml", actuation=True))
    alive = {"a/w0": Actor("a/w0", ["GPU-a"]), "b/w1": Actor("b/w1", [])}
    executor = RayExecutor(Path("out"))
    executor._close(ray, campaign, alive)  # type: ignore[arg-type]
    assert not hung, hung
    assert killed == ["b/w1"]
    assert executor.unrestored == {
        "a": ["GPU-a"],
        "b": ["the GPUs of worker b/w1 (its close did not come within 1800 s)"],
    }


def test_a_signal_while_the_actors_close_names_only_those_not_closed_yet() -> None:
    """A second Ctrl-C while the driver waits for the actors' closes: one had closed by then
    (its GPUs put back, but for `GPU-a`, which NVML would not restore), the other not. Every
    actor was named as given up, its GPUs left changed, the one that had restored them too.
    Those that closed by then are read as ever; only the others are given up."""
    from dvfs.fleet.ray_executor import RayExecutor

    class Method:
        def __init__(self, label: str, name: str, answer: object) -> None:
            self.label, self.name, self.answer = label, name, answer

        def remote(self) -> tuple[str, str, object]:
            return (self.name, self.label, self.answer)

    class Actor:
        def __init__(self, label: str, left: list[str]) -> None:
            self.close = Method(label, "close", None)
            self.unrestored = Method(label, "unrestored", left)

    def wait(refs: list, *, num_returns: int, timeout: float) -> tuple[list, list]:  # type: ignore[type-arg]
        if timeout:
            raise KeyboardInterrupt  # the user's next Ctrl-C, while the driver waits
        return [r for r in refs if r[1] == "a/w0"], [r for r in refs if r[1] != "a/w0"]

    ray = types.SimpleNamespace(get=lambda ref, timeout=None: ref[2], wait=wait)
    campaign = types.SimpleNamespace(gpu=types.SimpleNamespace(backend="nvml", actuation=True))
    alive = {"a/w0": Actor("a/w0", ["GPU-a"]), "b/w1": Actor("b/w1", [])}
    executor = RayExecutor(Path("out"))
    with pytest.raises(KeyboardInterrupt):
        executor._close(ray, campaign, alive)  # type: ignore[arg-type]
    assert executor.unrestored == {
        "a": ["GPU-a"],
        "b": ["the GPUs of worker b/w1 (its close was given up)"],
    }


def drive_two_workers(  # type: ignore[no-untyped-def]
    error: BaseException,
    answers_after: int | None,
    left: tuple[list[str], int] | None = None,
    b_error: BaseException | None = None,
    closing: BaseException | None = None,
):
    """`RayExecutor._drive` over stand-ins of Ray and a fleet of four units on two real-GPU
    workers: the first unit of worker `a/w0` answers `error`; what its actor is asked then
    (its close, what it left changed) answers once `b/w1` shipped `answers_after` units
    (None: never, its node cut off). `left`: the GPUs its `unrestored` answers, once `b/w1`
    shipped how many units (by default none, with the rest). `b_error`: what `b/w1`'s units
    answer (by default, each its shipment). `closing`: what `a/w0`'s `close_error` answers
    (what its worker's close raised as its failed unit closed it). The executor and what
    happened, in order."""
    import ray.exceptions

    from dvfs.fleet.ray_executor import RayExecutor

    events: list[str] = []
    queue = ["u0", "u1", "u2", "u3"]
    shipped: list[str] = []
    killed: list[str] = []

    class Method:
        def __init__(self, label: str, name: str) -> None:
            self.label, self.name = label, name

        def remote(self, *args: object) -> tuple[object, ...]:
            events.append(f"ask {self.name} {self.label}")
            return (self.name, self.label, *args)

    class Actor:
        def __init__(self, label: str) -> None:
            self.label = label
            for name in ("run", "close", "unrestored", "close_error"):
                setattr(self, name, Method(label, name))

    def ready(ref: tuple[object, ...]) -> bool:
        if ref[0] == "run" or ref[1] != "a/w0":
            return True
        if ref[0] == "unrestored" and left is not None:
            return len(shipped) >= left[1]
        return answers_after is not None and len(shipped) >= answers_after

    def wait(refs: list, *, num_returns: int, timeout: float) -> tuple[list, list]:  # type: ignore[type-arg]
        done = [r for r in refs if ready(r)][:num_returns]
        return done, [r for r in refs if r not in done]

    def get(ref: tuple[object, ...], timeout: float | None = None) -> object:
        if not ready(ref):
            events.append(f"hung {ref[0]} {ref[1]}")  # Ray's get waits for it (its timeout)
            raise ray.exceptions.GetTimeoutError("Get timed out")
        events.append(f"get {ref[0]} {ref[1]}")
        if ref[0] == "run":
            if ref[1] == "a/w0":
                raise error
            if b_error is not None:
                raise b_error
            cell = types.SimpleNamespace(drafter=None)
            return types.SimpleNamespace(unit=ref[2], cell=cell, gpu_time_s=1.0)
        if ref[0] == "unrestored":
            return left[0] if left is not None and ref[1] == "a/w0" else []
        if ref[0] == "close_error" and ref[1] == "a/w0":
            return closing
        return None

    def lost(label: str, cell: str, why: str, record: dict) -> None:  # type: ignore[type-arg]
        events.append(f"lost {label} {cell}")
        queue.insert(0, cell)

    def ship(label: str, shipment: types.SimpleNamespace) -> None:
        events.append(f"shipped {label} {shipment.unit}")
        shipped.append(shipment.unit)

    campaign = types.SimpleNamespace(gpu=types.SimpleNamespace(backend="nvml", actuation=True))

    class Fleet(types.SimpleNamespace):
        @property
        def finished(self) -> bool:
            return len(shipped) == 4

        def check_finished(self, reset: str = "") -> None:
            from dvfs.errors import JournalError

            raise JournalError(f"every worker was lost with {4 - len(shipped)} cell(s) left")

    fleet = Fleet(
        campaign=campaign,
        take=lambda label, drafter: queue.pop(0) if queue else None,
        started=lambda label, unit: None,
        shipped=ship,
        lost=lost,
        has_cells=lambda label: False,
        note=lambda message: events.append(f"note {message}"),
    )
    ray = types.SimpleNamespace(get=get, wait=wait, kill=lambda actor: killed.append(actor.label))
    alive = {"a/w0": Actor("a/w0"), "b/w1": Actor("b/w1")}
    executor = RayExecutor(Path("out"))
    executor._drive(ray, fleet, alive, False)  # type: ignore[arg-type]
    return executor, events, killed, shipped


def test_a_worker_that_raised_on_a_cut_off_node_stalls_no_one_and_its_gpus_are_named() -> None:
    """Real GPUs: a worker raised in its unit, and its actor's node is cut off as the driver
    asks what its close left changed. Two gets in turn waited for it, half an hour each, the
    other worker idle, and the actor was left running with its GPUs unnamed. It is read as it
    answers while the other goes on; not answered by the run's end (under the close bound),
    its actor is killed and its GPUs named."""
    import ray.exceptions

    raised = ray.exceptions.RayTaskError("WorkerActor.run", "Traceback", RuntimeError("boom"))
    executor, events, killed, shipped = drive_two_workers(raised.as_instanceof_cause(), None)
    assert not [e for e in events if e.startswith("hung")], events
    assert sorted(shipped) == ["u0", "u1", "u2", "u3"]  # the other worker took its unit
    assert killed == ["a/w0"]
    assert executor.unrestored == {
        "a": [
            "the GPUs of worker a/w0 (its word on the GPUs it left changed did not come "
            "within 1800 s)"
        ]
    }


@pytest.mark.parametrize("name", ["system-error", "actor-unavailable"])
def test_a_unit_ray_failed_closes_its_actor_while_the_others_go_on(name: str) -> None:
    """Real GPUs: Ray failed a worker's unit (its system error; its actor unreachable for a
    while, restarting or its network), and the actor's close answers only once the other worker
    shipped two units. The driver waited on that close (up to the close bound) with the other
    worker idle, then, the close not yet answered, killed it and named its GPUs; an unreachable
    actor was taken for dead: never closed, its GPUs named. Its close is now read as it
    answers while the other goes on: its GPUs restored, nothing named, nothing killed."""
    import ray.exceptions

    error = {
        "system-error": ray.exceptions.RaySystemError("the raylet died"),
        "actor-unavailable": ray.exceptions.ActorUnavailableError("it is restarting", None),
    }[name]
    executor, events, killed, shipped = drive_two_workers(error, 2)
    assert not [e for e in events if e.startswith("hung")], events
    assert sorted(shipped) == ["u0", "u1", "u2", "u3"]
    assert killed == []
    assert executor.unrestored == {}, executor.unrestored
    assert "ask close a/w0" in events
    # the other worker shipped its first units while the close ran
    assert events.index("get close a/w0") > events.index("shipped b/w1 u1"), events


class _RefMethod:
    """A fake actor method whose `.remote(...)` answers a ref naming the method, the actor's
    label and the arguments, for the fake `ray.wait`/`ray.get` of a test to read."""

    def __init__(self, label: str, name: str) -> None:
        self.label, self.name = label, name

    def remote(self, *args: object) -> tuple[object, ...]:
        return (self.name, self.label, *args)


class _RefActor:
    def __init__(self, label: str) -> None:
        self.label = label
        for name in ("open", "reset_command", "run", "close", "unrestored", "close_error"):
            setattr(self, name, _RefMethod(label, name))


def _ref_actors(*labels: str) -> types.SimpleNamespace:
    """A fake actor class whose `.options(...).remote(...)` makes `_RefActor`s labelled
    `labels` in turn."""
    names = iter(labels)
    return types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: _RefActor(next(names)))
    )


def run_lost_and_live(executor, signal_at_end: bool):  # type: ignore[no-untyped-def]
    """`executor._run` (a `RayExecutor`'s) over stand-ins of Ray and a fleet of four units on
    two real-GPU workers: the first unit of worker `a/w0` raises, and what its actor is asked
    then (which GPUs it left changed: `GPU-a`; what its close raised) does not answer (its node
    cut off); `b/w1` runs the rest. With `signal_at_end`, a Ctrl-C comes as the driver waits at
    the run's end, once `a/w0` answered. The bounded waits on the actors' ends (the refs
    awaited, the bound) and the units shipped."""
    import ray.exceptions

    actor_class = _ref_actors("a/w0", "b/w1")
    raised = ray.exceptions.RayTaskError("WorkerActor.run", "Traceback", RuntimeError("boom"))
    ending = {"close", "unrestored", "close_error"}
    bounded: list[tuple[set, float]] = []  # type: ignore[type-arg]

    def ready(ref: tuple[object, ...]) -> bool:
        return not (ref[1] == "a/w0" and ref[0] in ending) or bool(bounded and signal_at_end)

    def wait(refs: list, num_returns: int, timeout: float) -> tuple[list, list]:  # type: ignore[type-arg]
        if timeout and any(r[0] in ending for r in refs):
            bounded.append(({r[:2] for r in refs}, timeout))
            if signal_at_end:
                raise KeyboardInterrupt  # the user's Ctrl-C, as the driver waits
        done = [r for r in refs if ready(r)][:num_returns]
        return done, [r for r in refs if r not in done]

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        assert ready(ref), ref  # Ray's get would wait for it
        if ref[0] == "open":
            return {"worker": ref[1]}
        if ref[0] == "reset_command":
            return (ref[1].split("/")[0], "`dvfs gpu reset`")
        if ref[0] == "run":
            if ref[1] == "a/w0":
                raise raised.as_instanceof_cause()
            return types.SimpleNamespace(
                unit=ref[2], cell=types.SimpleNamespace(drafter=None), gpu_time_s=1.0
            )
        if ref[0] == "unrestored":
            return ["GPU-a"] if ref[1] == "a/w0" else []
        return None

    fake, fleet = fake_ray_fleet(
        actor_class, get, 2, lambda: [{"Alive": True, "Resources": {"GPU": 2.0}}], wait=wait
    )
    queue = ["u0", "u1", "u2", "u3"]
    shipped: list[str] = []

    class Fleet(types.SimpleNamespace):
        @property
        def finished(self) -> bool:
            return len(shipped) == 4

    run_fleet = Fleet(
        **vars(fleet),
        take=lambda label, drafter: queue.pop(0) if queue else None,
        started=lambda label, unit: None,
        shipped=lambda label, shipment: shipped.append(shipment.unit),
        lost=lambda label, cell, why, record: queue.insert(0, cell),
        has_cells=lambda label: False,
    )
    executor._run(fake, run_fleet, [], False)
    return bounded, shipped


def test_the_runs_end_awaits_the_lost_and_the_live_actors_under_one_bound() -> None:
    """Real GPUs: a worker raised in its unit and its actor's node is cut off as the driver
    asks what it left changed; the other worker runs the rest. At the run's end the lost
    actor's answers were awaited under the close bound, then the live actor's close under it
    again, one after the other: a cut-off node held the sweep's end twice `CLOSE_TIMEOUT_S`.
    Both are awaited in one wait, under one bound."""
    from dvfs.fleet.ray_executor import CLOSE_TIMEOUT_S, RayExecutor

    executor = RayExecutor(Path("out"))
    bounded, shipped = run_lost_and_live(executor, False)
    assert sorted(shipped) == ["u0", "u1", "u2", "u3"]  # the other worker took its unit
    assert bounded == [
        (
            {
                ("unrestored", "a/w0"),
                ("close_error", "a/w0"),
                ("close", "b/w1"),
                ("unrestored", "b/w1"),
            },
            CLOSE_TIMEOUT_S,
        )
    ], bounded
    assert executor.unrestored == {
        "a": [
            "the GPUs of worker a/w0 (its word on the GPUs it left changed did not come "
            f"within {CLOSE_TIMEOUT_S:g} s)"
        ]
    }


def test_a_signal_at_the_runs_end_reads_the_lost_actor_that_answered_by_then() -> None:
    """Real GPUs: a Ctrl-C as the driver waits at the run's end for a lost worker's actor
    (`run_lost_and_live`), which answered by then (`GPU-a` left changed), and the live one's
    close. The lost actor was given up, its GPUs named as set, and `GPU-a` unsaid: as for the
    live ones' closes, what answered by then is read, and only the rest given up."""
    from dvfs.fleet.ray_executor import RayExecutor

    executor = RayExecutor(Path("out"))
    with pytest.raises(KeyboardInterrupt):
        run_lost_and_live(executor, True)
    assert executor.unrestored == {"a": ["GPU-a"]}, executor.unrestored


def test_a_refusal_names_the_gpus_the_live_closes_left_changed_beside_its_line() -> None:
    """Real GPUs: worker `a/w0` raised in its first unit (its actor left `GPU-a` changed),
    then the driver refused `b/w1`'s server with cells left, and `b/w1`'s close at the run's
    end failed to restore `GPU-b` (NVML refused). The refusal's line gives the reset of the
    lost worker's node first, as it did before the live actors' closes were awaited with the
    lost ones; `GPU-b`, which its close left changed after the line, is said beside it
    (`unsaid`), with what its restore raised: it was folded into the line, by its node alone,
    and what NVML refused was said nowhere."""
    import ray.exceptions

    from dvfs.cli.sweep import _ray_unrestored
    from dvfs.errors import GpuError, JournalError
    from dvfs.fleet.ray_executor import RayExecutor

    actor_class = _ref_actors("a/w0", "b/w1")
    raised = ray.exceptions.RayTaskError("WorkerActor.run", "Traceback", RuntimeError("boom"))
    nvml = GpuError("could not restore GPU settings: GPU 0: NVML refused (test)")
    restore = ray.exceptions.RayTaskError("WorkerActor.close", "Traceback", nvml)

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if ref[0] == "open":
            return {"worker": ref[1]}
        if ref[0] == "reset_command":
            return (ref[1].split("/")[0], "`dvfs gpu reset`")
        if ref[0] == "run":
            if ref[1] == "a/w0":
                raise raised.as_instanceof_cause()
            return types.SimpleNamespace(
                unit=ref[2], cell=types.SimpleNamespace(drafter=None), gpu_time_s=1.0
            )
        if ref[0] == "close" and ref[1] == "b/w1":
            raise restore.as_instanceof_cause()
        if ref[0] == "unrestored":
            return ["GPU-a"] if ref[1] == "a/w0" else ["GPU-b"]
        return None

    fake, fleet = fake_ray_fleet(
        actor_class, get, 2, lambda: [{"Alive": True, "Resources": {"GPU": 2.0}}]
    )
    queue = ["u0", "u1", "u2"]
    refused: list[str] = []

    def check_finished(reset: str) -> None:
        raise JournalError("refused (test)" + (f"; and {reset} first" if reset else ""))

    run_fleet = types.SimpleNamespace(
        **vars(fleet),
        finished=False,
        fresh=False,
        take=lambda label, drafter: None if refused or not queue else queue.pop(0),
        started=lambda label, unit: None,
        shipped=lambda label, shipment: refused.append(label),  # then its server refused
        lost=lambda label, cell, why, record: queue.insert(0, cell),
        has_cells=lambda label: False,
        check_finished=check_finished,
    )
    executor = RayExecutor(Path("out"))
    with pytest.raises(JournalError) as line:
        executor._run(fake, run_fleet, [], False)
    assert str(line.value) == (
        "refused (test); and GPU settings were left unrestored on a: once the GPUs answer "
        "again, run `dvfs gpu reset` on a first"
    ), line.value
    assert executor.unsaid() == {"b": ["GPU-b"]}, executor.unrestored
    said = _ray_unrestored(executor.unsaid(), executor.close_errors, executor.resets)
    assert "GPU-b on b: could not restore GPU settings: GPU 0: NVML refused (test)" in said


def test_a_unit_ray_failed_whose_close_answered_before_its_word_on_its_gpus_names_them() -> None:
    """Real GPUs: Ray failed a worker's unit (its actor unreachable for a while), and the
    driver asked the actor's close and which GPUs it left changed. The close answered (the
    unit ran on and its worker, which raised, had closed itself: nothing left to close) before
    its word on the GPUs, at one of the driver's looks as the other worker went on: it was read
    as restored at once and `GPU-a`, which the actor named a moment later, went unsaid. It is
    read once both answered."""
    import ray.exceptions

    error = ray.exceptions.ActorUnavailableError("it is restarting", None)
    executor, events, killed, shipped = drive_two_workers(error, 1, (["GPU-a"], 2))
    assert sorted(shipped) == ["u0", "u1", "u2", "u3"]
    assert killed == []
    assert executor.unrestored == {"a": ["GPU-a"]}, (executor.unrestored, events)


@pytest.mark.parametrize("code", [3, 4])
def test_a_refusal_every_ray_worker_meets_keeps_its_line_and_exit_code(code: int) -> None:
    """Real GPUs: both workers raise a refusal in their first unit (a GPU another dvfs holds,
    exit 3; a setter that needs root, exit 4), which a rerun would meet again. Ray took them
    for lost workers: the run ended "every worker was lost", exit 1, the refusal's line a
    loss among others. It ends in the refusal's own line and exit code, as the local fleet's
    (`LocalExecutor._drive`)."""
    import ray.exceptions

    from dvfs.errors import DvfsError, GpuBusyError, GpuPermissionError

    refusal: DvfsError = (
        GpuBusyError("GPU 0 is in use by another dvfs process (pid 42)", "42")
        if code == 3
        else GpuPermissionError("GPU 0: cannot lock SM clocks: permission denied")
    )

    def raised(error: BaseException) -> BaseException:
        wrapped = ray.exceptions.RayTaskError("WorkerActor.run", "Traceback", error)
        return wrapped.as_instanceof_cause()

    with pytest.raises(DvfsError) as ended:
        drive_two_workers(raised(refusal), 0, b_error=raised(refusal))
    assert str(ended.value) == str(refusal)
    assert ended.value.exit_code == code
    assert "every worker was lost" not in str(ended.value)


def test_an_interrupted_ray_sweep_says_why_a_restore_was_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GPUs: SIGTERM, and as the actors close NVML refuses a restore for want of root on
    n2. The interrupted sweep's line said "a worker lost its GPU ... once the GPU answers
    again" (its restores' errors were not handed to it), which waits for nothing and hides
    that the reset needs root. It says the restore's own error, and the reset."""
    from conftest import TINY_EXACT

    from dvfs.errors import GpuPermissionError
    from dvfs.fleet.ray_executor import RayExecutor
    from dvfs.signals import Interrupted

    refused = GpuPermissionError(
        "could not restore GPU settings: GPU 0 (GPU-n2): GPU 0: cannot reset locked SM clocks: "
        "permission denied"
    )

    def run(self: RayExecutor, _fleet: object, groups: object) -> None:
        self.unrestored = {"n2": ["GPU-n2"]}
        self.close_errors = [refused]
        self.resets = {"n2": "`dvfs gpu reset --state-dir /s`"}
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(RayExecutor, "__call__", run)
    campaign = write(tmp_path / "campaign.toml", TINY_EXACT)
    result = sweep(str(campaign), "--gpus", "0-1", "--executor", "ray", "--out", str(tmp_path))
    assert result.exit_code == 143, result.output
    said = " ".join(result.stderr.split())
    assert "GPU settings NOT restored for GPU-n2 on n2: " in said, said
    assert "cannot reset locked SM clocks: permission denied" in said, said
    assert "`dvfs gpu reset --state-dir /s` on n2" in said, said
    assert "once the GPU answers again" not in said, said
    assert "Traceback" not in result.output


def test_a_unit_ray_failed_whose_worker_closed_with_an_error_says_it_and_exits_4() -> None:
    """Real GPUs: Ray failed a worker's unit (its actor unreachable for a while), and inside the
    actor the unit had raised, its worker closed, NVML refusing the restore for want of root.
    The driver closed the actor (a no-op: closed already) and named its GPU from its word,
    but never asked what that first close raised (`close_error`, which a worker's own raise
    asks): the sweep named no cause, said "once the GPU answers again" and exited 1, not 4.
    Now the restore's error is kept (`close_errors`), as for a worker that raised."""
    import ray.exceptions

    from dvfs.cli.sweep import _restore_exit_code
    from dvfs.errors import GpuPermissionError

    refused = GpuPermissionError(
        "could not restore GPU settings: GPU 0 (GPU-a): GPU 0: cannot reset locked SM clocks: "
        "permission denied"
    )
    error = ray.exceptions.ActorUnavailableError("it is restarting", None)
    executor, events, killed, shipped = drive_two_workers(
        error, 0, left=(["GPU-a"], 0), closing=refused
    )
    assert sorted(shipped) == ["u0", "u1", "u2", "u3"]
    assert executor.unrestored == {"a": ["GPU-a"]}
    assert [str(e) for e in executor.close_errors] == [str(refused)]
    assert _restore_exit_code(executor.close_errors) == 4  # the sweep's exit code
    assert "for want of root: run `dvfs gpu reset` on a as root" in executor.reset_first()


def test_a_signal_as_actors_still_open_names_their_gpus_and_reset() -> None:
    """Real GPUs: Ctrl-C while two actors on n1 are still inside `open` (a measured settle
    sets their clocks there) and a third waits to be placed. The run killed them all, and
    named none: the two on n1 left their GPUs as the settle set them, their state files
    kept, unsaid. They are named now, with the reset their node told; the one never placed
    (it told nothing: it opened nothing) is not."""
    from dvfs.cli.sweep import _ray_unrestored
    from dvfs.fleet.ray_executor import RayExecutor

    class Actor:
        def __init__(self, label: str) -> None:
            self.open = types.SimpleNamespace(remote=lambda: ("open", label))
            self.close = types.SimpleNamespace(remote=lambda: ("close", label))
            self.unrestored = types.SimpleNamespace(remote=lambda: ("unrestored", label))
            self.reset_command = types.SimpleNamespace(remote=lambda: ("told", label))

    labels = iter(["n1/gpu0", "n1/gpu1", "n2/gpu0"])
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(labels)))
    )
    signalled: list[int] = []

    def ready(ref: tuple[str, str]) -> bool:
        return ref[0] == "told" and ref[1].startswith("n1/")  # n2's was never placed

    def wait(refs, num_returns, timeout):  # type: ignore[no-untyped-def]
        if any(r[0] == "open" for r in refs) and not signalled:
            signalled.append(1)
            raise KeyboardInterrupt  # Ctrl-C while they open
        done = [r for r in refs if ready(r)]
        return done, [r for r in refs if r not in done]

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        assert ready(ref), ref
        return (ref[1].split("/")[0], "`dvfs gpu reset --state-dir /s`")

    fake, fleet = fake_ray_fleet(
        actor_class, get, 3, lambda: [{"Alive": True, "Resources": {"GPU": 3.0}}], wait=wait
    )
    executor = RayExecutor(Path("out"))
    with pytest.raises(KeyboardInterrupt):
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    assert executor.unrestored == {
        "n1": [
            "the GPUs of Ray actor dvfs-0 (killed as it opened them)",
            "the GPUs of Ray actor dvfs-1 (killed as it opened them)",
        ]
    }
    line = _ray_unrestored(executor.unrestored, resets=executor.resets)
    assert "run `dvfs gpu reset --state-dir /s` on n1" in line, line


@pytest.mark.timeout(300)
def test_a_refusal_both_real_ray_workers_meet_ends_in_its_line_and_exit_4(
    ray_nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GPUs on Ray: after each worker's first cell NVML refuses to lock SM clocks for
    want of root, a refusal a rerun would meet again. Ray took each worker for lost: "every
    worker was lost", exit 1. The sweep ends in the refusal's own line, exit 4, as the local
    fleet's."""
    from nvml_support import NVML_CAMPAIGN

    from dvfs.fleet.driver import Fleet

    ship = Fleet.shipped

    def refuse(self: Fleet, worker: str, shipment) -> None:  # type: ignore[no-untyped-def]
        ship(self, worker, shipment)  # in the driver's thread, as the driver journals it
        index = int(worker.rsplit("gpu", 1)[1])
        ray_nvml.fake_update_device(index, errors={"nvmlDeviceSetGpuLockedClocks": 4})

    monkeypatch.setattr(Fleet, "shipped", refuse)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    result = sweep(str(campaign), "--executor", "ray", "--out", str(tmp_path / "out"))
    assert result.exit_code == 4, result.output
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    assert last.startswith("Error: "), result.output
    assert "permission denied" in last, result.output
    assert "every worker was lost" not in result.output, result.output
    assert "Traceback" not in result.output


def _three_opening_actors(closed: list[str]):  # type: ignore[no-untyped-def]
    """An actor class of three real-GPU actors on n1 (their `open` answering their session,
    their close noted in `closed`), and Ray's `get` over their answers."""

    class Actor:
        def __init__(self, label: str) -> None:
            self.open = types.SimpleNamespace(remote=lambda: ("open", label))
            self.close = types.SimpleNamespace(remote=lambda: ("close", label))
            self.unrestored = types.SimpleNamespace(remote=lambda: ("unrestored", label))
            self.reset_command = types.SimpleNamespace(remote=lambda: ("told", label))

    labels = iter(["n1/gpu0", "n1/gpu1", "n1/gpu2"])
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(labels)))
    )

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        if ref[0] == "open":
            return {"worker": ref[1]}
        if ref[0] == "close":
            closed.append(ref[1])
            return None
        if ref[0] == "unrestored":
            return []
        return (ref[1].split("/")[0], "`dvfs gpu reset --state-dir /s`")

    return actor_class, get


def test_actors_whose_open_answers_as_the_run_stops_are_closed_or_named() -> None:
    """Real GPUs: Ctrl-C while three actors open; their opens answer just after the driver
    looked which had opened (none: nothing to close), before it looked which were still inside
    `open` (none: every open had answered). Each look took the other's for its own: the three
    were killed with their GPUs as their settle set them, neither closed nor named. Each is
    now closed or named."""
    from dvfs.fleet.ray_executor import RayExecutor

    closed: list[str] = []
    actor_class, get = _three_opening_actors(closed)
    looks: list[int] = []

    def wait(refs, num_returns, timeout):  # type: ignore[no-untyped-def]
        if any(r[0] == "open" for r in refs):
            looks.append(1)
            if len(looks) == 1:
                raise KeyboardInterrupt  # Ctrl-C while they open
            if len(looks) == 2:  # the driver's first look after it: none opened yet
                return [], list(refs)
        return list(refs), []  # every open answered now

    fake, fleet = fake_ray_fleet(
        actor_class, get, 3, lambda: [{"Alive": True, "Resources": {"GPU": 3.0}}], wait=wait
    )
    executor = RayExecutor(Path("out"))
    with pytest.raises(KeyboardInterrupt):
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    named = " ".join(executor.unrestored.get("n1", []))
    for i, label in enumerate(["n1/gpu0", "n1/gpu1", "n1/gpu2"]):
        assert label in closed or f"dvfs-{i} " in named, (closed, executor.unrestored)


def test_a_signal_as_the_opened_actors_are_noted_closes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real GPUs: every actor opened (a measured settle set its clocks), and a signal lands
    once their sessions came back, before the driver noted them as opened (as it sorts them).
    None was closed and none named: the three were killed with their GPUs as they set them,
    the sweep's line silent. They are closed."""
    from dvfs.fleet import ray_executor
    from dvfs.fleet.ray_executor import RayExecutor

    closed: list[str] = []
    actor_class, get = _three_opening_actors(closed)
    fake, fleet = fake_ray_fleet(
        actor_class, get, 3, lambda: [{"Alive": True, "Resources": {"GPU": 3.0}}]
    )

    def signalled(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # the signal, as the sessions are put in order

    monkeypatch.setattr(ray_executor, "sorted", signalled, raising=False)
    executor = RayExecutor(Path("out"))
    with pytest.raises(KeyboardInterrupt):
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    assert sorted(closed) == ["n1/gpu0", "n1/gpu1", "n1/gpu2"], executor.unrestored
    assert executor.unrestored == {}


def test_the_ray_line_naming_gpus_a_root_refusal_left_says_to_reset_as_root() -> None:
    """NVML refused n2's restore for want of root, and n1's GPU fell off the bus. The line
    said "run `dvfs gpu reset` on n1, n2": not that n2's reset needs root, which the local
    fleet's line and `reset_first` say. It says "as root" for n2, and not for n1."""
    from dvfs.cli.sweep import _ray_unrestored
    from dvfs.errors import GpuError, GpuPermissionError

    refused = GpuPermissionError(
        "could not restore GPU settings: GPU 0 (GPU-n2): GPU 0: cannot reset locked SM clocks: "
        "permission denied"
    )
    lost = GpuError("could not restore GPU settings: GPU 0 (GPU-n1): GPU is lost")
    line = " ".join(
        _ray_unrestored({"n1": ["GPU-n1"], "n2": ["GPU-n2"]}, [lost, refused], {}).split()
    )
    assert "`dvfs gpu reset` on n1, `dvfs gpu reset` on n2 as root" in line, line
    only = _ray_unrestored({"n2": ["GPU-n2"]}, [refused], {"n2": "`dvfs gpu reset --state-dir /s`"})
    assert "run `dvfs gpu reset --state-dir /s` on n2 as root." in only, only


def test_gpus_of_actors_killed_as_they_opened_are_reset_now_not_once_they_answer() -> None:
    """The run stopped while two actors on n1 were still inside `open`: killed, their GPUs
    named. The lines said to run the reset "once the GPU answers again": a GPU that never
    stopped answering, its open killed before or after its settle set the clocks. They say to
    run it now (it puts back what the open set; finds nothing to restore where it set
    nothing); a GPU lost on n2 beside them still waits until it answers again."""
    from dvfs.cli.sweep import _ray_unrestored
    from dvfs.fleet.ray_executor import RayExecutor

    killed = {"n1": ["the GPUs of Ray actor dvfs-0 (killed as it opened them)"]}
    resets = {"n1": "`dvfs gpu reset --state-dir /s`"}
    line = " ".join(_ray_unrestored(killed, [], resets).split())
    assert "answers again" not in line, line
    assert "run `dvfs gpu reset --state-dir /s` on n1 now" in line, line
    assert "nothing to restore" in line, line
    executor = RayExecutor(Path("out"))
    executor.unrestored, executor.resets = dict(killed), dict(resets)
    first = executor.reset_first()
    assert "answer again" not in first and " now" in first, first
    lost = {**killed, "n2": ["the GPUs of worker n2/gpu0 (its actor died)"]}
    line = " ".join(_ray_unrestored(lost, [], resets).split())
    assert "on n1 now" in line and "once the GPU answers again" in line, line
    executor.unrestored = dict(lost)
    first = executor.reset_first()
    assert "n1 now" in first and "answer again" in first, first


def test_a_worker_whose_open_and_close_fail_raises_the_opens_error_and_keeps_the_closes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A worker's open failed, and the close it ran then failed too (NVML refusing the
    restore of what the open set, for want of root). The close's error replaced the open's:
    the run's line said the restore, not what stopped the worker. The open's error is raised;
    the close's is kept (`open_close_error`) for the executor, and said by the actor's
    `close_error`."""
    from dvfs.errors import GpuPermissionError
    from dvfs.fleet.ray_executor import WorkerActor
    from dvfs.fleet.worker import Worker

    opened = RuntimeError("the server would not start")
    refused = GpuPermissionError("could not restore GPU settings: GPU 0 (GPU-a): refused")

    def fails(self: Worker) -> None:
        raise opened

    def close_fails(self: Worker) -> None:
        raise refused

    monkeypatch.setattr(Worker, "_claim_ports", fails)
    monkeypatch.setattr(Worker, "close", close_fails)
    worker = object.__new__(Worker)
    worker.corpora, worker.out_dir, worker.label = ({}, "none"), tmp_path, "gpu0"  # type: ignore[assignment]
    worker.open_close_error = None
    with pytest.raises(RuntimeError) as raised:
        worker.open()
    assert raised.value is opened
    assert worker.open_close_error is refused
    actor = object.__new__(WorkerActor)
    actor.worker = worker
    assert actor.close_error() is refused


def test_an_actor_whose_open_raised_is_asked_what_it_left_changed() -> None:
    """Real GPUs: one actor's open raised (its worker closed itself, NVML refusing the restore
    of what it set), the other opened. The run failed in the open's line, and the failed
    actor's GPU left changed was asked of no one: unnamed, its restore's error lost. It is
    asked (its `unrestored` and `close_error`) and named, with that error."""
    from dvfs.errors import GpuPermissionError
    from dvfs.fleet.ray_executor import RayExecutor

    opened = RuntimeError("the server would not start")
    refused = GpuPermissionError("could not restore GPU settings: GPU 0 (GPU-b): refused")

    class Actor:
        def __init__(self, label: str) -> None:
            for method in ("open", "close", "unrestored", "close_error", "reset_command"):
                setattr(self, method, types.SimpleNamespace(remote=lambda m=method: (m, label)))

    labels = iter(["n1/gpu0", "n1/gpu1"])
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(labels)))
    )

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        method, label = ref
        if method == "open":
            if label == "n1/gpu1":
                raise opened
            return {"worker": label}
        if method == "unrestored":
            return ["GPU-b"] if label == "n1/gpu1" else []
        if method == "close_error":
            return refused if label == "n1/gpu1" else None
        if method == "close":
            return None
        return ("n1", "`dvfs gpu reset --state-dir /s`")

    fake, fleet = fake_ray_fleet(
        actor_class, get, 2, lambda: [{"Alive": True, "Resources": {"GPU": 2.0}}]
    )
    executor = RayExecutor(Path("out"))
    with pytest.raises(RuntimeError) as raised:
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    assert raised.value is opened
    assert executor.unrestored == {"n1": ["GPU-b"]}, executor.unrestored
    assert executor.close_errors == [refused]


def test_a_signal_as_a_lost_actors_word_is_read_names_its_gpus_once() -> None:
    """Real GPUs: a lost worker's actor answered which GPUs it left changed (GPU-a) and what
    its close raised, and a signal landed as the driver read the second answer, the first
    noted. Given up, the actor was named again as "the GPUs of worker n1/gpu0 (its close was
    given up)": GPU-a said twice. It is named once."""
    from dvfs.fleet.ray_executor import RayExecutor

    class Ref:
        def __init__(self, what: str) -> None:
            self.what = what

    unrestored, close_error = Ref("unrestored"), Ref("close_error")
    actor = types.SimpleNamespace(
        unrestored=types.SimpleNamespace(remote=lambda: unrestored),
        close_error=types.SimpleNamespace(remote=lambda: close_error),
    )

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if ref is close_error:
            raise KeyboardInterrupt  # the signal, as the second answer is read
        return ["GPU-a"]

    fake, fleet = fake_ray_fleet(None, get, 1, lambda: [{"Alive": True, "Resources": {"GPU": 1.0}}])
    executor = RayExecutor(Path("out"))
    asked = {"n1/gpu0": executor._raised(fake, "n1/gpu0", actor)}
    with pytest.raises(KeyboardInterrupt):
        executor._settle(fake, fleet.campaign, asked, 5.0)
    assert len(executor.unrestored["n1"]) == 1, executor.unrestored


def test_a_ray_fleet_lost_whole_with_a_restore_bug_says_the_bug_not_answers_again() -> None:
    """Every Ray worker lost, and the restore of GPU-a on n1 stopped on a bug in dvfs. The
    line's resets said "once the GPUs answer again" (a GPU that never stopped answering) and
    nothing of the bug, which the local fleet's line says ("a bug in dvfs stopped the restore
    ...: please report it"). It says the bug, and to run the reset now."""
    from dvfs.fleet.ray_executor import RayExecutor
    from dvfs.gpu.knobs import RestoreBugError

    bug = RestoreBugError(
        "could not restore GPU settings: GPU 0 (GPU-a): its restore stopped on a bug in dvfs "
        "(RuntimeError: a bug). `dvfs gpu reset` retries from the state file."
    )
    executor = RayExecutor(Path("out"))
    executor.unrestored, executor.close_errors = {"n1": ["GPU-a"]}, [bug]
    executor.resets = {"n1": "`dvfs gpu reset --state-dir /s`"}
    first = executor.reset_first()
    assert "answer again" not in first, first
    assert "a bug in dvfs" in first and "please report it" in first, first
    assert "run `dvfs gpu reset --state-dir /s` on n1" in first, first


def test_actors_still_opening_as_another_fails_finish_opening_and_close() -> None:
    """Real GPUs: one actor's open raised (a refusal) while the two others, placed, were still
    inside `open`. They were killed with the run, their GPUs as the open left them, named for
    a reset; the local fleet lets such workers finish opening and closes them (their GPUs
    restored). They finish opening and close now; none is named."""
    from dvfs.errors import GpuStateError
    from dvfs.fleet.ray_executor import RayExecutor

    refusal = GpuStateError("GPU 0 is held (test)")
    closed: list[str] = []

    class Actor:
        def __init__(self, label: str) -> None:
            for method in ("open", "close", "unrestored", "close_error", "reset_command"):
                setattr(self, method, types.SimpleNamespace(remote=lambda m=method: (m, label)))

    labels = iter(["n1/gpu0", "n1/gpu1", "n1/gpu2"])
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(labels)))
    )
    waited: list[float] = []
    refused: list[str] = []

    def wait(refs, num_returns, timeout):  # type: ignore[no-untyped-def]
        # the others' opens answer once the driver, the run failed, waits for them
        if any(r[0] == "open" for r in refs) and timeout and refused:
            waited.append(timeout)
        opening = not waited
        done = [r for r in refs if not (opening and r[0] == "open" and r[1] != "n1/gpu0")]
        return done, [r for r in refs if r not in done]

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        method, label = ref
        if method == "open":
            if label == "n1/gpu0":
                refused.append(label)
                raise refusal
            return {"worker": label}
        if method == "close":
            closed.append(label)
            return None
        if method == "unrestored":
            return []
        if method == "close_error":
            return None
        return ("n1", "`dvfs gpu reset --state-dir /s`")

    fake, fleet = fake_ray_fleet(
        actor_class, get, 3, lambda: [{"Alive": True, "Resources": {"GPU": 3.0}}], wait=wait
    )
    executor = RayExecutor(Path("out"))
    with pytest.raises(GpuStateError):
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    assert sorted(closed) == ["n1/gpu1", "n1/gpu2"], (closed, executor.unrestored)
    assert executor.unrestored == {}


def _one_refused_two_opening(closed: list[str], wait):  # type: ignore[no-untyped-def]
    """A stand-in Ray and real-GPU fleet of three actors on n1 whose first one's open raises
    a refusal (`GpuStateError`) while the two others are still inside `open` (`wait`: Ray's,
    given which refusal was raised); their closes noted in `closed`, the fleet's notes in
    `fleet.said`."""
    from dvfs.errors import GpuStateError

    refused: list[str] = []

    class Actor:
        def __init__(self, label: str) -> None:
            for method in ("open", "close", "unrestored", "close_error", "reset_command"):
                setattr(self, method, types.SimpleNamespace(remote=lambda m=method: (m, label)))

    labels = iter(["n1/gpu0", "n1/gpu1", "n1/gpu2"])
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(labels)))
    )

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        method, label = ref
        if method == "open":
            if label == "n1/gpu0":
                refused.append(label)
                raise GpuStateError("GPU 0 is held (test)")
            return {"worker": label}
        if method == "close":
            closed.append(label)
            return None
        if method == "unrestored":
            return []
        if method == "close_error":
            return None
        return ("n1", "`dvfs gpu reset --state-dir /s`")

    fake, fleet = fake_ray_fleet(
        actor_class,
        get,
        3,
        lambda: [{"Alive": True, "Resources": {"GPU": 3.0}}],
        wait=lambda refs, num_returns, timeout: wait(refs, timeout, refused),
    )
    fleet.said = []
    fleet.note = fleet.said.append
    return fake, fleet


def test_ctrl_c_while_actors_still_opening_are_waited_for_ends_in_the_signal() -> None:
    """Real GPUs: one actor's open raised a refusal while two others were still inside `open`;
    the driver waits for them to finish opening, and the operator presses Ctrl-C. The wait
    swallowed the signal: the run ended in the refusal's line and exit code, not 130, the
    signal lost. It ends in the signal (the sweep's 130, its line naming the GPUs left
    changed), and the two killed as they opened are named for a reset now."""
    from dvfs.cli.sweep import _ray_unrestored
    from dvfs.fleet.ray_executor import RayExecutor

    closed: list[str] = []

    def wait(refs, timeout, refused):  # type: ignore[no-untyped-def]
        still = [r for r in refs if r[0] == "open" and r[1] != "n1/gpu0"]
        if still and timeout and refused:
            raise KeyboardInterrupt  # Ctrl-C while the driver waits for them
        return [r for r in refs if r not in still], still

    fake, fleet = _one_refused_two_opening(closed, wait)
    executor = RayExecutor(Path("out"))
    with pytest.raises(KeyboardInterrupt):
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    assert closed == [], closed
    assert executor.unrestored == {
        "n1": [
            "the GPUs of Ray actor dvfs-1 (killed as it opened them)",
            "the GPUs of Ray actor dvfs-2 (killed as it opened them)",
        ]
    }, executor.unrestored
    line = " ".join(_ray_unrestored(executor.unrestored, [], executor.resets).split())
    assert "run `dvfs gpu reset --state-dir /s` on n1 now" in line, line


def test_actors_still_opening_after_an_open_timeout_get_a_short_said_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real GPUs: the opens ran out of their bound (`OPEN_TIMEOUT_S`: an actor never placed)
    while two placed actors were still inside `open`. The driver then waited for them up to
    `CLOSE_TIMEOUT_S` more (half an hour after the half hour the timeout waited), unsaid. It
    waits `OPENING_GRACE_S`, said in one note; a failure before the opens' bound waits no
    longer than that bound."""
    from dvfs.errors import DvfsError
    from dvfs.fleet import ray_executor
    from dvfs.fleet.ray_executor import CLOSE_TIMEOUT_S, RayExecutor

    monkeypatch.setattr(ray_executor, "OPEN_TIMEOUT_S", 0.0)
    closed: list[str] = []
    bounds: list[float] = []

    def wait(refs, timeout, refused):  # type: ignore[no-untyped-def]
        if any(r[0] == "open" for r in refs) and timeout:
            bounds.append(timeout)
        opening = [r for r in refs if r[0] == "open" and r[1] != "n1/gpu0" and not bounds]
        return [r for r in refs if r not in opening], opening

    def never_placed(refs, timeout, refused):  # type: ignore[no-untyped-def]
        done, waiting = wait(refs, timeout, refused)
        unplaced = [r for r in done if r[1] == "n1/gpu0"]  # neither told nor opened
        return [r for r in done if r not in unplaced], waiting + unplaced

    fake, fleet = _one_refused_two_opening(closed, never_placed)
    executor = RayExecutor(Path("out"))
    with pytest.raises(DvfsError, match="did not start within"):
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    assert len(bounds) == 1 and bounds[0] < CLOSE_TIMEOUT_S, bounds  # not another half hour
    assert bounds == [ray_executor.OPENING_GRACE_S], bounds
    assert sorted(closed) == ["n1/gpu1", "n1/gpu2"], (closed, executor.unrestored)
    [said] = [x for x in fleet.said if "still opening" in x]
    assert f"waiting up to {bounds[0]:g} s for the 2 still opening" in said, said


def test_an_open_that_fails_between_the_drivers_looks_names_its_gpus_once() -> None:
    """Real GPUs: Ctrl-C while two actors open; n1/gpu1's open raises (its worker closed
    itself, leaving GPU-b changed) just after the driver looked which opens had answered
    (none), before it asked those whose open raised. The first look named it as killed as it
    opened, the second asked it and named GPU-b too: one actor's GPUs said twice. By the
    same look, it is named once."""
    from dvfs.fleet.ray_executor import RayExecutor

    opened = RuntimeError("the server would not start")

    class Actor:
        def __init__(self, label: str) -> None:
            for method in ("open", "close", "unrestored", "close_error", "reset_command"):
                setattr(self, method, types.SimpleNamespace(remote=lambda m=method: (m, label)))

    labels = iter(["n1/gpu0", "n1/gpu1"])
    actor_class = types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Actor(next(labels)))
    )
    looks: list[int] = []

    def wait(refs, num_returns, timeout):  # type: ignore[no-untyped-def]
        if any(r[0] == "open" for r in refs):
            looks.append(1)
            if len(looks) == 1:
                raise KeyboardInterrupt  # Ctrl-C while they open
            if len(looks) == 2:  # the driver's first look after it: none answered yet
                return [], list(refs)
            done = [r for r in refs if r[1] == "n1/gpu1"]  # its open raised since
            return done, [r for r in refs if r not in done]
        return list(refs), []

    def get(ref, timeout=None):  # type: ignore[no-untyped-def]
        if isinstance(ref, list):
            return [get(r) for r in ref]
        method, label = ref
        if method == "open":
            raise opened
        if method == "unrestored":
            return ["GPU-b"]
        if method == "close_error":
            return None
        return ("n1", "`dvfs gpu reset --state-dir /s`")

    fake, fleet = fake_ray_fleet(
        actor_class, get, 2, lambda: [{"Alive": True, "Resources": {"GPU": 2.0}}], wait=wait
    )
    executor = RayExecutor(Path("out"))
    with pytest.raises(KeyboardInterrupt):
        executor._run(fake, fleet, [], False)  # type: ignore[arg-type]
    named = executor.unrestored["n1"]
    assert len([x for x in named if "dvfs-1" in x or x == "GPU-b"]) == 1, named
