"""The fleet keeps the arms of every comparison on one GPU: each comparison group (the cells
sharing a batch, a corpus and a repeat: every drafter and knob setting of them) runs whole on
one worker, in fixed and in-flight mode and for the repeats the driver adds; the queue alone
never splits a group except by a lost worker, hands each cell out once, and keeps server
starts low."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result
from conftest import write
from fleet_rerun_support import ADAPTIVE, INFLIGHT
from fleet_support import fleet_campaign, lose_worker_on_its_third_cell, refuse_servers_on
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.cli import cli
from dvfs.cube import STATUS_OK, build_cube, open_cube
from dvfs.fleet.queue import CellQueue, group_of, simulated_starts
from dvfs.measure.journal import read_records
from dvfs.measure.plan import Cell


def sweep(*args: str) -> Result:
    return CliRunner().invoke(cli, ["sweep", *args, "--no-progress"], catch_exceptions=False)


def swept_on_four(tmp_path: Path, text: str) -> Path:
    """TEXT swept on four twin GPUs into tmp_path (a test that changes the run or the fleet's
    behaviour needs its own; one that only reads it takes `shared_run`'s `four`)."""
    write(tmp_path / "campaign.toml", text)
    out = tmp_path / "four"
    result = sweep(str(tmp_path / "campaign.toml"), "--gpus", "0-3", "--out", str(out))
    assert result.exit_code == 0, result.output
    return out


def assert_groups_on_one_gpu(out: Path) -> dict[tuple[int, str, int], set[str]]:
    """Every (batch, corpus, repeat)'s measured cells share one `measured_on`, in the cube and
    in the journal; the fleet used more than one GPU; the cube says it paired the arms."""
    cube = open_cube(out / "cube.nc")
    on = cube["measured_on"].transpose("batch", "corpus", "repeat", ...).values
    ok = cube["cell_status"].transpose("batch", "corpus", "repeat", ...).values == STATUS_OK
    used = set()
    for index in np.ndindex(on.shape[:3]):
        gpus = {str(g) for g in on[index][ok[index]]}
        assert len(gpus) <= 1, f"group {index} ran on {gpus}"
        used |= gpus
    assert len(used) > 1, "the groups went to several GPUs"
    assert cube.attrs["arms_on_one_gpu"] == 1
    assert cube.attrs["groups_across_gpus"] == 0
    workers: dict[tuple[int, str, int], set[str]] = {}
    for r in read_records(out / "journal.jsonl"):
        if r["type"] == "cell":
            c = r["cell"]
            workers.setdefault((c["batch"], c["corpus"], c["repeat"]), set()).add(r["worker"])
    assert all(len(w) == 1 for w in workers.values()), workers
    return workers


def assert_few_server_starts(out: Path, workers: dict[tuple[int, str, int], set[str]]) -> None:
    """Each worker starts each drafter's server about once: at most the drafters for the
    groups dealt to it (as many as the others), and the drafters again per group it took
    beyond those."""
    records = read_records(out / "journal.jsonl")
    drafters = len({r["cell"]["drafter"] for r in records if r["type"] == "cell"})
    starts: dict[str, int] = {}
    for r in records:
        if r["type"] == "server":
            starts[r["worker"]] = starts.get(r["worker"], 0) + 1
    ran: dict[str, int] = {}
    for (w,) in workers.values():
        ran[w] = ran.get(w, 0) + 1
    fair = len(workers) // 4
    for w, n in starts.items():
        assert n <= drafters * max(0, ran.get(w, 0) - fair) + drafters, (w, n, ran)


def test_fixed_mode_runs_each_group_on_one_gpu(tmp_path: Path) -> None:
    out = swept_on_four(tmp_path, fleet_campaign("pairs", repeats=2))
    assert_few_server_starts(out, assert_groups_on_one_gpu(out))
    # A cell of one group moved to another GPU (as a lost worker's group finishing elsewhere
    # would): the cube counts that group, and only it.
    lines = (out / "journal.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    cells = [i for i, r in enumerate(records) if r["type"] == "cell"]
    first = records[cells[0]]
    other = next(r for r in (records[i] for i in cells) if r["worker"] != first["worker"])
    first["gpus"] = other.get("gpus") or ["GPU-elsewhere"]
    first.pop("worker")
    lines[cells[0]] = json.dumps(first)
    (out / "journal.jsonl").write_text("\n".join(lines) + "\n")
    cube = build_cube(out / "journal.jsonl")
    assert cube.attrs["groups_across_gpus"] == 1
    assert cube.attrs["arms_on_one_gpu"] == 1  # the fleet's schedule; the count tells


def test_in_flight_mode_runs_each_group_on_one_gpu(shared_run) -> None:
    out = shared_run(INFLIGHT, "four", "--gpus", "0-3")  # shared with tests/test_fleet_modes.py
    assert_few_server_starts(out, assert_groups_on_one_gpu(out))


def test_the_repeats_the_driver_adds_keep_their_groups_whole(shared_run) -> None:
    out = shared_run(ADAPTIVE, "four", "--gpus", "0-3")  # shared with tests/test_fleet_modes.py
    repeats = {
        r["cell"]["repeat"] for r in read_records(out / "journal.jsonl") if r["type"] == "cell"
    }
    assert max(repeats) >= 2, "the driver added repeats"
    assert_groups_on_one_gpu(out)


def test_a_lost_workers_groups_go_whole_to_the_others(tmp_path: Path, monkeypatch) -> None:
    """gpu2 dies on its third cell: the groups it held go to the others whole; only those it
    had started span two GPUs, and the cube counts exactly them."""
    lose_worker_on_its_third_cell(monkeypatch, "gpu2")
    out = swept_on_four(tmp_path, fleet_campaign("lost", repeats=2))
    workers: dict[tuple[int, str, int], set[str]] = {}
    for r in read_records(out / "journal.jsonl"):
        if r["type"] == "cell":
            c = r["cell"]
            workers.setdefault((c["batch"], c["corpus"], c["repeat"]), set()).add(r["worker"])
    split = {g for g, w in workers.items() if len(w) > 1}
    started = {g for g, w in workers.items() if "gpu2" in w}
    assert split == started and split, (split, started)
    assert all(len(w - {"gpu2"}) == 1 for w in workers.values()), "the rest of each on one"
    cube = open_cube(out / "cube.nc")
    assert cube.attrs["groups_across_gpus"] == len(split)


def test_a_lost_worker_with_no_other_left_says_so(tmp_path: Path, monkeypatch) -> None:
    """A worker lost said its unfinished cells go to the others, a comparison group at a time,
    also where no other worker was left (a fleet's folder resumed by a fleet of one, `--gpus
    0`): the run stops there. It says so; one lost beside another still says they go to it."""
    write(tmp_path / "campaign.toml", fleet_campaign("alone"))
    out = tmp_path / "out"
    argv = [str(tmp_path / "campaign.toml"), "--gpus", "0-1", "--out", str(out)]
    lose_worker_on_its_third_cell(monkeypatch, "gpu1")
    result = sweep(*argv)
    assert result.exit_code == 0, result.output
    told = " ".join(result.output.split())
    assert "worker gpu1 lost (RuntimeError: the GPU fell off the bus); its unfinished " in told
    assert "no other worker is left" not in told, told
    journal = out / "journal.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if '"type":"cell"' in line][1]
    journal.write_text("".join(lines[:cut]))  # a fleet's folder, unfinished
    monkeypatch.undo()
    lose_worker_on_its_third_cell(monkeypatch, "gpu0")
    argv[2] = "0"
    result = sweep(*argv)
    assert result.exit_code == 1, result.output
    told = " ".join(result.output.split())
    assert (
        "worker gpu0 lost (RuntimeError: the GPU fell off the bus): no other worker is left "
        "to measure its cells" in told
    ), told
    assert "go to the others" not in told, told
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: every worker was lost with "), told


def retired_fleet_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Result]:
    """The `retired` fleet campaign swept on GPUs 0 and 1 into tmp_path/out, gpu1's server
    refused (the worker retired), exiting 0: (the folder, the sweep's result)."""
    refuse_servers_on(monkeypatch, "gpu1")
    write(tmp_path / "campaign.toml", fleet_campaign("retired"))
    out = tmp_path / "out"
    result = sweep(str(tmp_path / "campaign.toml"), "--gpus", "0-1", "--out", str(out))
    assert result.exit_code == 0, result.output
    return out, result


def rebuilt(out: Path, records: list[dict[str, Any]]) -> None:
    """`records` written back as out's journal, and its cube built again (exiting 0)."""
    (out / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 0, built.output


def test_a_worker_retired_for_its_server_is_not_reported_lost(tmp_path: Path, monkeypatch) -> None:
    """A fleet's worker whose server the driver refused (retired), the other finishing every
    cell: the sweep's report said "gpu1 ...: 0 cell(s) ... lost: <the refusal>", as if its GPU
    or server had been lost. It says it was retired, its server refused, in the note and the
    report; the other worker's line names no loss."""
    _, result = retired_fleet_sweep(tmp_path, monkeypatch)
    told = " ".join(result.output.split())
    why = "the server of drafter 'none' on gpu1 differs"
    assert f"worker gpu1 retired, its server refused ({why}); its unfinished cells go " in told
    assert f"h of GPU time retired, its server refused: {why}" in told, told
    assert "lost" not in told, told


def test_a_retired_workers_gpu_that_measured_nothing_is_not_the_cubes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet's worker retired at its first server (refused), the other measuring every
    cell: the cube named both GPUs ("x2" in `dvfs cube info`, `gpu_uuids`, a counter period
    each) and its idle power was both GPUs' mean, though every cell ran on one. It names the
    GPU that measured, and its idle power is that GPU's."""
    out, _ = retired_fleet_sweep(tmp_path, monkeypatch)
    records = read_records(out / "journal.jsonl")
    [session] = [r for r in records if r["type"] == "session"]
    [gpu0] = [w for w in session["workers"] if w["worker"] == "gpu0"]
    assert len(session["gpus"]) == 2 and {r.get("worker") for r in records[2:]} == {"gpu0"}
    # The retired GPU's idle another than the measuring one's (the twin's GPUs idle alike).
    for w in session["workers"]:
        if w["worker"] == "gpu1":
            w["idle_power_w"] = gpu0["idle_power_w"] + 100.0
    session["idle_power_w"] = gpu0["idle_power_w"] + 50.0
    rebuilt(out, records)
    info = CliRunner().invoke(cli, ["cube", "info", "--json", str(out / "cube.nc")])
    assert json.loads(info.output)["gpu"] == "NVIDIA H100 80GB HBM3 (twin) x1", info.output
    cube = open_cube(out / "cube.nc")
    assert set(cube["measured_on"].values.ravel()) == {",".join(gpu0["gpus"])}
    assert cube.attrs["gpu_uuids"] == ",".join(gpu0["gpus"]) and cube.attrs["gpu_count"] == 1
    assert len(np.atleast_1d(cube.attrs["counter_update_period_s"])) == 1
    assert cube.attrs["idle_power_w"] == gpu0["idle_power_w"]


def test_a_retired_workers_cap_tenants_and_idle_readings_are_not_the_cubes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cube of a fleet whose worker was retired before measuring names the GPU that
    measured alone, and its idle power is that GPU's; but the retired GPU's cap found at
    start, its stock limit NVML enforced, the tenant seen at its idle and its idle from the
    power readings stayed the cube's: `dvfs cube info` said the one GPU's stock limit was
    "the GPU's default, not the 450 W found at start: a cap dvfs applied" (no cap was on it),
    and the idle power was said to count a tenant it does not. They are the named GPU's
    alone, as its idle power is."""
    out, _ = retired_fleet_sweep(tmp_path, monkeypatch)
    records = read_records(out / "journal.jsonl")
    [session] = [r for r in records if r["type"] == "session"]
    [gpu1] = [w for w in session["workers"] if w["worker"] == "gpu1"]
    [retired] = gpu1["gpus"]
    tenant = {"gpu": 1, "pid": 4242, "name": "other", "at": "start"}
    gpu1.update(idle_foreign_processes=[tenant], idle_from_power_readings=True)
    session.update(
        power_limit_found_w={retired: 450.0},
        stock_power_limit_enforced=[retired],
        idle_foreign_processes=[tenant],
        idle_from_power_readings=True,
    )
    rebuilt(out, records)
    cube = open_cube(out / "cube.nc")
    assert retired not in cube.attrs["gpu_uuids"]
    for name in ("power_limit_found_w", "power_limit_found_gpus", "stock_power_limit_enforced"):
        assert name not in cube.attrs, (name, cube.attrs.get(name))
    assert json.loads(cube.attrs["idle_foreign_processes"]) == []
    assert cube.attrs["idle_from_power_readings"] == 0
    info = CliRunner().invoke(cli, ["cube", "info", str(out / "cube.nc")])
    assert "stock power limit as found at start" in " ".join(info.output.split()), info.output
    assert "4242" not in info.output, info.output


def test_a_gpu_whose_failed_cells_were_measured_again_elsewhere_is_not_the_cubes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep on GPU 1 whose server would not start (every cell failed), then the rerun on
    GPU 0 measuring every cell: the cube named both GPUs ("x2" in `dvfs cube info`,
    `gpu_uuids`, `gpu_count` 2), though each of its cells ran on GPU 0, the failed records of
    GPU 1 replaced. It names the GPUs of the cells it holds."""
    from dvfs.engines.twin import TwinEngine
    from dvfs.errors import EngineError

    campaign = write(tmp_path / "campaign.toml", fleet_campaign("failed-then-measured"))
    out = tmp_path / "out"
    start = TwinEngine.start

    def failing(self: TwinEngine, drafter: object) -> None:
        raise EngineError("the server would not start (test)")

    monkeypatch.setattr(TwinEngine, "start", failing)
    failed = sweep(str(campaign), "--gpus", "1", "--out", str(out))
    assert failed.exit_code != 0 and "failed cell(s)" in failed.output, failed.output
    monkeypatch.setattr(TwinEngine, "start", start)
    measured = sweep(str(campaign), "--gpus", "0", "--out", str(out))
    assert measured.exit_code == 0, measured.output
    first, second = [r for r in read_records(out / "journal.jsonl") if r["type"] == "session"]
    [gpu1], [gpu0] = ([g["uuid"] for g in s["gpus"]] for s in (first, second))
    cube = open_cube(out / "cube.nc")
    assert set(cube["measured_on"].values.ravel()) == {gpu0}
    assert cube.attrs["gpu_uuids"] == gpu0 and cube.attrs["gpu_count"] == 1, gpu1
    info = CliRunner().invoke(cli, ["cube", "info", "--json", str(out / "cube.nc")])
    assert json.loads(info.output)["gpu"] == "NVIDIA H100 80GB HBM3 (twin) x1", info.output


def test_a_retired_workers_later_failure_does_not_call_it_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker retired for its refused server whose close then failed (its GPU's restore)
    was noted "worker gpu1, lost, then: ...": it was retired, not lost, as its other lines
    say. The note says how it left, then what failed."""
    from dvfs.errors import GpuError
    from dvfs.fleet.worker import Worker

    close = Worker.close

    def failing(self: Worker) -> None:
        close(self)
        if self.label == "gpu1":
            raise GpuError("could not restore the clocks of GPU 1")

    refuse_servers_on(monkeypatch, "gpu1", "the server on gpu1 differs")
    monkeypatch.setattr(Worker, "close", failing)
    write(tmp_path / "campaign.toml", fleet_campaign("closing"))
    out = tmp_path / "out"
    result = sweep(str(tmp_path / "campaign.toml"), "--gpus", "0-1", "--out", str(out))
    told = " ".join(result.output.split())
    then = "then: GpuError: could not restore the clocks of GPU 1"
    assert f"worker gpu1, retired, its server refused, {then}" in told, told
    assert "lost" not in told, told


def mixed_fleet_whose_h200_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, h200: str
) -> tuple[Path, Any, str, str]:
    """A fleet of an H100 and an H200 (`--gpus 0,h200-sxm:0`) whose H200 worker (`h200`, its
    label) was retired (`how`: its servers refused) or lost at its third cell, swept to its
    exit 1: the out folder, the result, its output on one line, and its last line."""
    if how == "retired":
        refuse_servers_on(monkeypatch, h200)
    else:
        lose_worker_on_its_third_cell(monkeypatch, h200)
    write(tmp_path / "campaign.toml", fleet_campaign(how))
    out = tmp_path / "out"
    result = sweep(str(tmp_path / "campaign.toml"), "--gpus", "0,h200-sxm:0", "--out", str(out))
    assert result.exit_code == 1, result.output
    told = " ".join(result.output.split())
    return out, result, told, result.output.strip().splitlines()[-1]


@pytest.mark.parametrize("how", ["retired", "lost"])
def test_a_gpu_models_only_worker_gone_stops_the_fleet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A fleet mixing GPU models (`--gpus 0,h200-sxm:0`) whose H200 worker, its model's only
    one, is retired (its server refused) or lost: the H100 worker, its own model's cells all
    measured, waited for the whole campaign to finish, which no worker was left to do, and
    the sweep hung for ever. It stops once its model's cells are in, in the line that says
    why the H200's are not: the refusal, or the loss (it said "every worker was lost", the
    H100's worker too, where the H200's alone was: it names the model whose cells are left),
    and the journal that keeps them (it said "the journal keeps every finished cell", the
    folder holding no journal of its own: each model's is in gpu-<model>/)."""
    from dvfs import load_campaign
    from dvfs.fleet.shard import planned_cells

    h200 = "h200-sxm_none-gpu0"
    out, result, told, last = mixed_fleet_whose_h200_left(tmp_path, monkeypatch, how, h200)
    assert f"worker {h200} {how}" in told and "no other worker is left" in told, told
    planned = {c.key for c in planned_cells(load_campaign(tmp_path / "campaign.toml"), None)}
    [h100] = out.glob("gpu-nvidia-h100*/journal.jsonl")
    if how == "retired":
        assert last == f"Error: the server of drafter 'none' on {h200} differs", told
    else:
        [journal] = out.glob("gpu-nvidia-h200*/journal.jsonl")
        left = len(planned) - sum(r["type"] == "cell" for r in read_records(journal))
        assert last.startswith(
            f"Error: every worker on the NVIDIA H200 (twin) GPUs was lost with {left} cell(s) "
            f"of that model left ({h200}: RuntimeError: the GPU fell off the bus): "
        ), told
        # where that model's finished cells are: its own journal (none in `out` itself), not
        # "the journal"
        assert not (out / "journal.jsonl").exists()
        assert last.endswith(
            f"): its journal {journal} keeps every finished cell; rerun the same command to resume"
        ), told
    # the H100's cells, every one measured, are journalled
    cells = [r for r in read_records(h100) if r["type"] == "cell"]
    assert sorted(r["key"] for r in cells) == sorted(planned), len(cells)


def test_a_gpu_models_worker_lost_before_its_first_cell_keeps_that_models_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet mixing GPU models whose H200 worker, its model's only one, was lost at its first
    cell while the H100's measured every cell of its own: the error line named the H200's
    journal as where that model's finished cells are, but the run, leaving the folder as found,
    had removed it (it held no cell), so `dvfs cube build` then wrote the H100's cube alone,
    without a word of the H200, as if the campaign were whole. The journal stays (the
    folder, holding the H100's cells, is the campaign's): the cube build says the H200 is left
    out of the cube."""
    from dvfs.fleet.worker import Worker

    h200 = "h200-sxm_none-gpu0"
    run = Worker.run

    def lost_at_once(self: Worker, cell: Any) -> Any:
        if self.label == h200:
            raise RuntimeError("the GPU fell off the bus")
        return run(self, cell)

    monkeypatch.setattr(Worker, "run", lost_at_once)
    write(tmp_path / "campaign.toml", fleet_campaign("lost-at-once"))
    out = tmp_path / "out"
    result = sweep(str(tmp_path / "campaign.toml"), "--gpus", "0,h200-sxm:0", "--out", str(out))
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    journal = out / "gpu-nvidia-h200-twin" / "journal.jsonl"
    assert last.endswith(
        f"): its journal {journal} keeps every finished cell; rerun the same command to resume"
    ), last
    assert journal.is_file(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert not [r for r in read_records(journal) if r["type"] == "cell"]
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 0, built.output
    assert built.stderr.strip().splitlines() == [
        f"{journal} holds no session yet (nothing measured on that GPU model): left out of the cube"
    ], built.output


def test_a_rerun_on_some_models_says_the_cells_left_of_one_that_measured_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet mixing GPU models whose H200 worker was lost at its first cell, rerun on the
    H100 alone (the H200's node gone): it said "0 cell(s) measured, N already done" and
    nothing of the H200's cells, every one left, as it says of a model that had measured some
    ("gpu-<model>: N cell(s) left for GPUs of that model (none in this run)"): its journal,
    holding no session, was not looked at. Its cells left are said; its cube joins nothing."""
    from dvfs import load_campaign
    from dvfs.fleet.shard import planned_cells

    campaign, out = _h200_lost_after(tmp_path, monkeypatch, 0)
    again = sweep(str(campaign), "--gpus", "0", "--out", str(out))
    assert again.exit_code == 0, again.output
    left = len(planned_cells(load_campaign(campaign), None))
    told = " ".join(again.output.split())
    assert (
        f"gpu-nvidia-h200-twin: {left} cell(s) left for GPUs of that model (none in this run); "
        "rerun with them to finish"
    ) in told, told
    assert "gpu" not in open_cube(out / "cube.nc").sizes  # the H100's cube alone


def test_a_ctrl_c_while_one_models_server_starts_says_that_model_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet mixing GPU models stopped by Ctrl-C while the H200's worker was still starting
    (its journal a header alone), the H100 having measured cells: the sweep said 'partial
    cube written to OUT/cube.nc', the H100's cube alone, without the line `dvfs cube build`
    prints of a model left out. It says it too."""
    import threading

    from dvfs.fleet.worker import Worker
    from dvfs.measure.journal import Journal

    started = threading.Event()
    run = Worker.run

    def still_starting(self: Worker, cell: Any) -> Any:
        if self.label.startswith("h200"):
            started.wait(60)  # bounded: set by the Ctrl-C below
            raise RuntimeError("stopped while its server started")
        return run(self, cell)

    note = Journal._note
    cells = {"n": 0}

    def ctrl_c_at_the_third_cell(self: Journal, record: dict[str, Any]) -> None:
        note(self, record)
        if record.get("type") == "cell":
            cells["n"] += 1
            if cells["n"] == 3:
                started.set()
                raise KeyboardInterrupt

    monkeypatch.setattr(Worker, "run", still_starting)
    monkeypatch.setattr(Journal, "_note", ctrl_c_at_the_third_cell)
    campaign = write(tmp_path / "campaign.toml", fleet_campaign("ctrl-c-starting"))
    out = tmp_path / "out"
    args = ["sweep", str(campaign), "--gpus", "0,h200-sxm:0", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 130, result.output
    journal = out / "gpu-nvidia-h200-twin" / "journal.jsonl"
    assert journal.is_file() and not [r for r in read_records(journal) if r["type"] != "header"]
    told = result.stderr.splitlines()
    assert f"partial cube written to {out / 'cube.nc'}" in told, result.output
    assert (
        f"{journal} holds no session yet (nothing measured on that GPU model): left out of the cube"
    ) in told, result.output


def _h200_lost_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cells: int, *, failed: int = 0
) -> tuple[Path, Path]:
    """The fleet campaign swept on an H100 and an H200 whose worker was lost after CELLS
    cells, the first FAILED of them failed (their server would not start) (exit 1): the
    campaign file and the --out folder."""
    from dvfs.fleet.worker import Worker

    run = Worker.run
    calls = {"n": 0}

    def lost(self: Worker, cell: Any) -> Any:
        if not self.label.startswith("h200"):
            return run(self, cell)
        calls["n"] += 1
        if calls["n"] > cells:
            raise RuntimeError("the GPU fell off the bus")
        if calls["n"] > failed:
            return run(self, cell)
        with monkeypatch.context() as patched:
            patched.setattr(self._runner, "_server_for", lambda drafter: "would not start")
            return run(self, cell)

    monkeypatch.setattr(Worker, "run", lost)
    campaign = write(tmp_path / "campaign.toml", fleet_campaign("lost-after"))
    out = tmp_path / "out"
    assert sweep(str(campaign), "--gpus", "0,h200-sxm:0", "--out", str(out)).exit_code == 1
    monkeypatch.setattr(Worker, "run", run)
    return campaign, out


def test_the_analyses_after_a_rerun_on_some_models_name_the_models_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet mixing GPU models whose H200 worker was lost after two cells, rerun on the H100
    alone: `cube info`, `dvfs headroom`, `dvfs compare` and `dvfs report` of the folder's
    merged cube said 'run the same `dvfs sweep` command again', which (on the H100 alone)
    measures none of the H200's cells left. Each names the model whose GPUs the command's
    --gpus must name; followed, the cube is whole."""
    campaign, out = _h200_lost_after(tmp_path, monkeypatch, 2)
    assert sweep(str(campaign), "--gpus", "0", "--out", str(out)).exit_code == 0
    shown = CliRunner().invoke(cli, ["cube", "info", str(out), "--json"])
    assert shown.exit_code == 0, shown.output
    resume = json.loads(shown.output)["resume"]
    assert resume.endswith(
        "its --gpus naming GPUs of NVIDIA H200 (twin): the cells left are on that model alone "
        "(a run on the other models' GPUs measures none of them)"
    ), resume
    text = CliRunner().invoke(cli, ["cube", "info", str(out)])
    assert "--gpus naming GPUs of NVIDIA H200 (twin)" in " ".join(text.output.split())
    # headroom, compare and report advised "the same command" alike: they name the model too
    named = "its --gpus naming GPUs of NVIDIA H200 (twin): the cells left are on that model"
    for command in ("headroom", "compare"):
        said = CliRunner().invoke(cli, [command, str(out)])
        assert said.exit_code == 0, said.output
        assert named in " ".join(said.output.split()), said.output
        assert "to resume it, its --gpus" in " ".join(said.output.split()), said.output
        # nor does a note name no command: "?: clocks below ... resume the sweep to measure"
        assert "resume the sweep to measure them" not in said.output, said.output
        doc = json.loads(CliRunner().invoke(cli, [command, str(out), "--json"]).stdout)
        assert doc["models_left"] == ["NVIDIA H200 (twin)"], doc.get("models_left")
    report = tmp_path / "report.md"
    assert CliRunner().invoke(cli, ["report", str(out), "-o", str(report)]).exit_code == 0
    assert named in " ".join(report.read_text().replace("\\", "").split())
    again = sweep(str(campaign), "--gpus", "0,h200-sxm:0", "--out", str(out))
    assert again.exit_code == 0, again.output
    whole = CliRunner().invoke(cli, ["cube", "info", str(out), "--json"])
    assert json.loads(whole.output)["resume"] is None, whole.output
    doc = json.loads(CliRunner().invoke(cli, ["headroom", str(out), "--json"]).output)
    assert "models_left" not in doc and not doc["coverage"]["missing"], doc["coverage"]


def test_a_models_own_cube_after_a_rerun_on_the_others_names_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet mixing GPU models whose H200 worker was lost after two cells, rerun on the H100
    alone: the H200's own cube (gpu-nvidia-h200-twin/cube.nc), analysed alone, said 'run the
    same `dvfs sweep` command again', which (on the H100 alone) measures none of its cells:
    nothing in it said it is one model's of a mixed fleet. It is marked, and `cube info`,
    `dvfs headroom`, `dvfs compare` and `dvfs report` of it name the model's --gpus; the H100's
    own (whole) and the fleet's merged cube carry no such advice or mark."""
    campaign, out = _h200_lost_after(tmp_path, monkeypatch, 2)
    assert sweep(str(campaign), "--gpus", "0", "--out", str(out)).exit_code == 0
    own = out / "gpu-nvidia-h200-twin" / "cube.nc"
    named = "its --gpus naming GPUs of NVIDIA H200 (twin): the cells left are on that model"

    def said_of(path: Path) -> None:
        resume = json.loads(CliRunner().invoke(cli, ["cube", "info", str(path), "--json"]).output)
        assert named in resume["resume"], resume["resume"]
        for command in ("headroom", "compare"):
            said = CliRunner().invoke(cli, [command, str(path)])
            assert said.exit_code == 0, said.output
            assert named in " ".join(said.output.split()), said.output
            doc = json.loads(CliRunner().invoke(cli, [command, str(path), "--json"]).stdout)
            assert doc["models_left"] == ["NVIDIA H200 (twin)"], doc.get("models_left")
        report = tmp_path / "report.md"
        made = CliRunner().invoke(cli, ["report", str(path), "-o", str(report)])
        assert made.exit_code == 0, made.output
        assert named in " ".join(report.read_text().replace("\\", "").split())

    said_of(own)
    from dvfs.cube.cells_left import FLEET_MODEL_ATTR

    assert open_cube(own).attrs[FLEET_MODEL_ATTR] == "NVIDIA H200 (twin)"
    assert FLEET_MODEL_ATTR not in open_cube(out / "cube.nc").attrs  # the models' merged cube
    # `dvfs cube build` of the model's folder alone rebuilds its cube marked alike
    built = CliRunner().invoke(cli, ["cube", "build", str(own.parent)])
    assert built.exit_code == 0, built.output
    said_of(own)
    whole = out / "gpu-nvidia-h100-80gb-hbm3-twin" / "cube.nc"
    assert open_cube(whole).attrs[FLEET_MODEL_ATTR] == "NVIDIA H100 80GB HBM3 (twin)"
    info = json.loads(CliRunner().invoke(cli, ["cube", "info", str(whole), "--json"]).output)
    assert info["resume"] is None, info["resume"]  # nothing left on the H100
    again = sweep(str(campaign), "--gpus", "0,h200-sxm:0", "--out", str(out))
    assert again.exit_code == 0, again.output
    info = json.loads(CliRunner().invoke(cli, ["cube", "info", str(own), "--json"]).output)
    assert info["resume"] is None, info["resume"]


def test_a_failed_reference_on_the_model_left_after_a_rerun_names_the_model_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet mixing GPU models whose H200 failed its first cell (its server would not start)
    and was then lost, rerun on the H100 alone: the report named the H200 for the cells never
    run, but for the row whose reference failed it said "run the same `dvfs sweep` command
    again ...: it retries failed cells", which (on the H100 alone) retries none of the H200's.
    It names the model whose GPUs the command's --gpus must name, as for the cells not run."""
    campaign, out = _h200_lost_after(tmp_path, monkeypatch, 1, failed=1)
    assert sweep(str(campaign), "--gpus", "0", "--out", str(out)).exit_code == 0
    info = json.loads(CliRunner().invoke(cli, ["cube", "info", str(out), "--json"]).output)
    assert info["failed"] == 1, info  # the H200's reference, failed
    report = tmp_path / "report.md"
    made = CliRunner().invoke(cli, ["report", str(out), "-o", str(report)])
    assert made.exit_code == 0, made.output
    lines = report.read_text().replace("\\", "").splitlines()
    failed = [line for line in lines if "No valid reference cell (failed)" in line]
    assert len(failed) == 1, lines
    named = "its --gpus naming GPUs of NVIDIA H200 (twin): the cells left are on that model"
    assert named in failed[0] and "a rerun retries failed cells" in failed[0], failed[0]
    assert not [line for line in lines if "it retries failed cells" in line], lines


def test_cube_info_of_a_folder_whose_one_model_measured_nothing_says_it_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet mixing GPU models whose H200 worker was lost before its first cell: `cube
    build` says the H200 is left out, but `cube info` of the folder's cube said the H100's
    cells alone, '72 = 72 measured + 0 missing', no word of the H200, as if the campaign
    were whole. It says the model's journal is left out and how to measure it; followed, it
    no longer does."""
    campaign, out = _h200_lost_after(tmp_path, monkeypatch, 0)
    assert CliRunner().invoke(cli, ["cube", "build", str(out)]).exit_code == 0
    journal = out / "gpu-nvidia-h200-twin" / "journal.jsonl"
    for where in (out, out / "cube.nc"):
        shown = CliRunner().invoke(cli, ["cube", "info", str(where), "--json"])
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.output)["left_out"] == [str(journal)], shown.output
    text = CliRunner().invoke(cli, ["cube", "info", str(out)])
    assert (
        f"left out: {journal} holds no session yet (nothing measured on that GPU model): the "
        "cube leaves that model out; run the `dvfs sweep` command again without --fresh, its "
        "--gpus naming GPUs of that model, to measure it"
    ) in text.output.splitlines(), text.output
    again = sweep(str(campaign), "--gpus", "0,h200-sxm:0", "--out", str(out))
    assert again.exit_code == 0, again.output
    whole = CliRunner().invoke(cli, ["cube", "info", str(out), "--json"])
    assert json.loads(whole.output)["left_out"] == [], whole.output
    assert json.loads(whole.output)["resume"] is None, whole.output


def test_the_analyses_of_a_folder_whose_one_model_measured_nothing_say_it_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet mixing GPU models whose H200 worker was lost before its first cell: `cube info`
    says the H200 is left out, but `dvfs headroom`, `dvfs compare` (table, --markdown,
    --json), `dvfs plot` and `dvfs report` of the folder answered from the H100's cells alone,
    no word of the H200, as if the campaign were whole. Each says it, in cube info's line;
    followed, none does."""
    campaign, out = _h200_lost_after(tmp_path, monkeypatch, 0)
    assert CliRunner().invoke(cli, ["cube", "build", str(out)]).exit_code == 0
    journal = out / "gpu-nvidia-h200-twin" / "journal.jsonl"
    line = (
        f"left out: {journal} holds no session yet (nothing measured on that GPU model): the "
        "cube leaves that model out; run the `dvfs sweep` command again without --fresh, its "
        "--gpus naming GPUs of that model, to measure it"
    )
    # (compare's notes go to stderr, headroom's under its table)
    for command, notes in (("headroom", "stdout"), ("compare", "stderr")):
        for where in (out, out / "cube.nc"):
            table = CliRunner().invoke(cli, [command, str(where)])
            assert table.exit_code == 0, table.output
            assert line in getattr(table, notes).splitlines(), table.output
            markdown = CliRunner().invoke(cli, [command, str(where), "--markdown"])
            assert f"- {line}" in markdown.stdout.splitlines(), markdown.output
            doc = CliRunner().invoke(cli, [command, str(where), "--json"])
            assert json.loads(doc.stdout)["left_out"] == [str(journal)], doc.output
    report = tmp_path / "report.md"
    made = CliRunner().invoke(cli, ["report", str(out), "-o", str(report)])
    assert made.exit_code == 0, made.output
    said = report.read_text().replace("\\`", "`").replace("\\_", "_")  # Markdown's escapes
    assert "Left out: " + line.removeprefix("left out: ") in said, said
    drawn = CliRunner().invoke(cli, ["plot", str(out), "--out", str(tmp_path / "plots")])
    assert drawn.exit_code == 0, drawn.output
    assert line in drawn.stderr.splitlines(), drawn.stderr
    # the H100's own cube is not the folder's: it leaves nothing out
    own = CliRunner().invoke(cli, ["headroom", str(out / "gpu-nvidia-h100-80gb-hbm3-twin")])
    assert own.exit_code == 0 and "left out" not in own.output, own.output
    again = sweep(str(campaign), "--gpus", "0,h200-sxm:0", "--out", str(out))
    assert again.exit_code == 0, again.output
    whole = CliRunner().invoke(cli, ["headroom", str(out), "--json"])
    assert "left_out" not in json.loads(whole.output), whole.output
    assert "left out" not in CliRunner().invoke(cli, ["headroom", str(out)]).output
    assert CliRunner().invoke(cli, ["report", str(out), "-o", str(report)]).exit_code == 0
    assert "Left out" not in report.read_text()
    compared = CliRunner().invoke(cli, ["compare", str(out), "--json"])
    assert compared.exit_code == 0 and "left out" not in compared.stderr, compared.output
    assert "left_out" not in json.loads(compared.stdout), compared.stdout


@pytest.mark.parametrize("h200_cells", [0, 2])
def test_a_dry_run_on_some_models_says_the_cells_left_of_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, h200_cells: int
) -> None:
    """A fleet mixing GPU models whose H200 worker was lost (before its first cell, or after
    two), dry-run on the H100 alone: it said '72 already done, 0 to run' and nothing of the
    H200's cells left, which the sweep itself says ('gpu-<model>: N cell(s) left for GPUs of
    that model (none in this run); rerun with them to finish'). The dry run says them too,
    in its text and its --json; with --fresh (every journal moved aside) it does not."""
    from dvfs import load_campaign
    from dvfs.fleet.shard import planned_cells

    campaign, out = _h200_lost_after(tmp_path, monkeypatch, h200_cells)
    left = len(planned_cells(load_campaign(campaign), None)) - h200_cells
    args = ["sweep", str(campaign), "--gpus", "0", "--out", str(out), "--dry-run"]
    dry = CliRunner().invoke(cli, [*args, "--no-estimate"])
    assert dry.exit_code == 0, dry.output
    line = (
        f"gpu-nvidia-h200-twin: {left} cell(s) left for GPUs of that model (none in this run); "
        "rerun with them to finish"
    )
    assert line in " ".join(dry.output.split()), dry.output
    shown = CliRunner().invoke(cli, [*args, "--no-estimate", "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["left_for_other_models"] == {"gpu-nvidia-h200-twin": left}
    fresh = CliRunner().invoke(cli, [*args, "--no-estimate", "--fresh", "--json"])
    assert "left_for_other_models" not in json.loads(fresh.output), fresh.output
    # the sweep says the same
    again = sweep(str(campaign), "--gpus", "0", "--out", str(out))
    assert again.exit_code == 0, again.output
    assert line in " ".join(again.output.split()), again.output


@pytest.mark.parametrize("h200", ["retired", "lost"])
def test_a_fleet_mixing_models_whose_every_worker_left_ends_in_the_line_of_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, h200: str
) -> None:
    """A fleet mixing GPU models whose H100 worker was lost and whose H200 worker was retired
    (its server refused) or lost too ended in the H100's line alone: "every worker was lost
    with N cell(s) left", N the H100's cells, the H200's refusal (which a rerun meets again)
    or loss and its cells unsaid. The refusal's line comes first, as within one model; two
    models lost are one line over both: every cell left, and each loss; and where the
    finished cells are: it said "the journal keeps every finished cell", where each model's
    are in its own journal (`gpu-<model>/journal.jsonl`), and none in the folder's."""
    from dvfs import load_campaign
    from dvfs.fleet.shard import planned_cells

    label = "h200-sxm_none-gpu0"
    lose_worker_on_its_third_cell(monkeypatch, "gpu0")
    out, result, told, last = mixed_fleet_whose_h200_left(tmp_path, monkeypatch, h200, label)
    if h200 == "retired":
        assert last == f"Error: the server of drafter 'none' on {label} differs", told
        return
    planned = planned_cells(load_campaign(tmp_path / "campaign.toml"), None)
    journals = sorted(out.glob("gpu-*/journal.jsonl"))
    done = sum(r["type"] == "cell" for j in journals for r in read_records(j))
    assert len(journals) == 2 and done < 2 * len(planned), journals
    lost = "RuntimeError: the GPU fell off the bus"
    assert last.startswith(
        f"Error: every worker was lost with {2 * len(planned) - done} cell(s) left "
        f"(gpu0: {lost}; {label}: {lost}): "
    ), told
    # the finished cells are in each model's journal (there is no journal.jsonl in `out`)
    assert not (out / "journal.jsonl").exists()
    assert last.endswith(
        f"): the journals in {out}/gpu-*/ keep every finished cell; rerun the same command "
        "to resume"
    ), told


# -- the queue alone --


def _counting(monkeypatch: Any, owner: type, name: str) -> list[int]:
    """Count the calls of `owner.name` (patched for the test): a one-element list, updated."""
    calls = [0]
    original = getattr(owner, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_the_queue_of_a_large_campaign_is_built_without_comparing_every_pair_of_cells(
    monkeypatch,
) -> None:
    """Queueing a group's cells tells a cell already queued without comparing it with every
    cell queued before it (that made a 25,000-cell fleet wait 15 s, a 770,000-cell one hours,
    before its first server started); counted in cell comparisons, not seconds."""
    cells = [
        Cell("none", 0, 210 + 15 * i, float(p), 1, "code")
        for i in range(40)
        for p in range(200, 700, 10)
    ]
    calls = _counting(monkeypatch, Cell, "__eq__")
    queue = CellQueue(cells, ["w0", "w1"])
    assert len(queue) == len(cells)
    assert calls[0] <= len(cells), calls


def test_a_worker_takes_its_next_cell_without_looking_through_every_group_it_holds(
    monkeypatch,
) -> None:
    """A worker's next cell is found without ranking the next cell of each of its groups: that
    made every take cost as much as the groups it holds, so the dry run of a fleet of 12,000
    groups took a minute to count its workers' server starts (and the fleet's driver as long
    over its run); counted in cells ranked, not seconds. The starts counted stay those of the
    queue's drafter-major order: each worker starts each drafter once."""
    cells = [
        Cell(d, r, 1980, None, b, c)
        for r in range(4)
        for b in range(1, 41)
        for c in "abc"
        for d in ("none", "eagle3", "ngram")
    ]
    calls = _counting(monkeypatch, CellQueue, "_rank")
    assert simulated_starts(cells, 8) == [3] * 8
    assert calls[0] <= 10 * len(cells), calls


DRAFTERS = ("none", "eagle3", "ngram")


@st.composite
def plans(draw: st.DrawFn) -> tuple[list[Cell], int, list[int], int | None]:
    """Cells of random groups and drafters, a number of workers, the order in which workers
    ask (indices), and maybe a step at which one worker is lost."""
    batches = draw(st.lists(st.sampled_from([1, 4, 16, 64]), min_size=1, max_size=3, unique=True))
    corpora = draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=3, unique=True))
    repeats = draw(st.integers(1, 3))
    drafters = draw(st.lists(st.sampled_from(DRAFTERS), min_size=1, max_size=3, unique=True))
    levels = draw(st.integers(1, 3))
    cells = [
        Cell(d, r, 1000 + 100 * k, None, b, c)
        for d in drafters
        for r in range(repeats)
        for k in range(levels)
        for c in corpora
        for b in batches
    ]
    workers = draw(st.integers(1, 5))
    asks = draw(st.lists(st.integers(0, workers - 1), min_size=0, max_size=400))
    lost = draw(st.none() | st.integers(0, len(cells)))
    return cells, workers, asks, lost


@settings(max_examples=150, deadline=None)
@given(plans(), st.data())
def test_the_queue_never_splits_a_group_but_by_a_loss(plan, data) -> None:
    """As above, on a resume too: some groups an earlier run began, each kept by a worker
    (`CellQueue.keep`)."""
    cells, count, asks, lose_at = plan
    labels = [f"w{i}" for i in range(count)]
    groups = sorted({group_of(c) for c in cells})
    begun = data.draw(st.dictionaries(st.sampled_from(groups), st.sampled_from(labels)))
    queue = CellQueue(cells)
    queue.keep(begun, labels)
    queue.join(labels)
    dealt = {w: {g for g in {group_of(c) for c in cells} if queue.holder(g) == w} for w in labels}
    alive = list(labels)
    server: dict[str, str | None] = dict.fromkeys(labels)
    starts = dict.fromkeys(labels, 0)
    got: dict[str, set] = {w: set() for w in labels}  # the groups each worker ran cells of
    ran: dict[tuple, set[str]] = {}  # group -> the workers that ran its cells
    handed: list[Cell] = []
    lost: str | None = None
    split_by_loss: set = set()
    step = 0

    def ask(worker: str) -> bool:
        nonlocal step
        cell = queue.take(worker, server[worker])
        if cell is None:
            return False
        step += 1
        handed.append(cell)
        if cell.drafter != server[worker]:
            starts[worker] += 1
            server[worker] = cell.drafter
        got[worker].add(group_of(cell))
        ran.setdefault(group_of(cell), set()).add(worker)
        return True

    for i in asks:  # workers ask in a random order
        worker = labels[i]
        if worker not in alive:
            continue
        if lose_at is not None and lost is None and step >= lose_at and len(alive) > 1:
            lost = worker  # lost holding a cell in hand, which goes back
            alive.remove(worker)
            cell = queue.take(worker, server[worker])
            if cell is not None:
                queue.give_back([cell])
            split_by_loss = set(got[worker])
            queue.leave(worker)
            continue
        ask(worker)
    while alive:  # then every live worker until none gets a cell
        alive = [w for w in alive if ask(w)]
    assert sorted(c.key for c in handed) == sorted(c.key for c in cells), "each cell once"
    assert len(queue) == 0
    for group, workers in ran.items():
        assert len(workers) == 1 or group in split_by_loss, f"{group} split over {workers}"
    for worker in labels:
        if worker == lost:
            continue
        later = got[worker] - dealt[worker]  # from the pool, stolen, or a lost worker's
        drafters = len({c.drafter for c in cells})
        assert starts[worker] <= drafters * len(later) + drafters, (worker, starts, later)


def test_groups_that_arrive_later_are_dealt_out_whole() -> None:
    """Further repeats (new groups) are shared among the workers, each group to one; a cell of
    a group some worker holds goes back to it."""
    cells = [Cell(d, 0, 1000, None, b, "a") for d in DRAFTERS for b in (1, 2, 3, 4)]
    queue = CellQueue(cells, ["w0", "w1"])
    more = [Cell(d, 1, 1000, None, b, "a") for d in DRAFTERS for b in (1, 2, 3, 4)]
    queue.give_back(more)
    holders = {queue.holder(group_of(c)) for c in more}
    assert holders == {"w0", "w1"}
    late = Cell("none", 1, 1410, None, 1, "a")
    queue.give_back([late])
    assert queue.holder(group_of(late)) == queue.holder(group_of(more[0]))


def test_a_resume_on_more_gpus_keeps_begun_groups_up_to_a_fair_share() -> None:
    """A run resumed on more GPUs than began it: the groups the earlier workers began stay
    with them (`CellQueue.keep`) up to each one's share of the cells left, so the added
    GPU gets its share too (it got only the groups nobody began, none here: idle while the
    others finished theirs, and it may not steal a begun group); resumed on the same GPUs,
    every begun group stays where it began."""
    cells = [
        Cell(d, 0, clock, None, b, "a")
        for d in DRAFTERS
        for clock in (1000, 1400)
        for b in range(1, 7)
    ]
    begun = {(b, "a", 0): ("w0" if b <= 3 else "w1") for b in range(1, 7)}

    def run(workers: list[str]) -> tuple[dict[str, int], dict[tuple, set[str]]]:
        queue = CellQueue(cells)
        queue.keep(begun, workers)
        queue.join(workers)
        count = dict.fromkeys(workers, 0)
        ran: dict[tuple, set[str]] = {}
        server: dict[str, str | None] = dict.fromkeys(workers)
        alive = list(workers)
        while alive:  # the workers take turns, as equally fast GPUs would
            for worker in list(alive):
                cell = queue.take(worker, server[worker])
                if cell is None:
                    alive.remove(worker)
                    continue
                server[worker] = cell.drafter
                count[worker] += 1
                ran.setdefault(group_of(cell), set()).add(worker)
        assert sum(count.values()) == len(cells)
        return count, ran

    count, ran = run(["w0", "w1", "w2"])
    group = len(cells) // 6
    assert all(n >= len(cells) // 3 - group for n in count.values()), count
    assert all(len(w) == 1 for w in ran.values()), ran
    count, ran = run(["w0", "w1"])  # the same GPUs: nothing moves
    assert {g: w for g, (w,) in ran.items()} == begun


def test_the_dry_run_estimates_a_fleet_by_its_comparison_groups(tmp_path: Path) -> None:
    """Whole groups per worker: the busiest of W workers runs ceil(G / W) of the G groups, and
    workers beyond G idle, which the dry run says; each busy worker starts every drafter's
    server itself (the one that takes the group left over after the deal, its drafters again
    but the one it runs), so those starts are counted per worker, not shared out."""
    from conftest import TINY

    from dvfs.measure.plan import SERVER_START_S

    campaign = write(tmp_path / "tiny.toml", TINY)  # batch 1 and 8, one corpus, 2 repeats
    one = ["sweep", str(campaign), "--dry-run", "--no-estimate", "--json"]
    alone = json.loads(CliRunner().invoke(cli, one).output)
    drafters = alone["server_starts"]
    assert drafters == 2
    starts_h = drafters * SERVER_START_S / 3600
    for spec, busiest, starts, again in (("0-2", 2, 3 * 2 + 1, 1 / 2), ("0-7", 1, 4 * 2, 0)):
        args = ["sweep", str(campaign), "--dry-run", "--no-estimate", "--gpus", spec]
        doc = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)
        assert doc["comparison_groups"] == doc["comparison_groups_left"] == 4
        assert doc["server_starts"] == starts, spec
        hours = alone["estimated_hours_on_hardware"]  # one worker's, rounded to 0.01 h
        makespan = (hours - starts_h) * busiest / 4 + starts_h * (1 + again)
        assert abs(doc["estimated_makespan_hours"] - makespan) <= 0.011, spec
    text = CliRunner().invoke(cli, args).output
    assert "8 workers in parallel (only 4 busy" in text


def _fleet_gpu_s(records: list[dict[str, Any]]) -> float:
    """The GPU time a fleet's journal records: its cells' and its sessions' overheads."""
    cells = sum(sum(r["gpu_time_s"].values()) for r in records if r["type"] == "cell")
    sessions = sum(
        w["gpu_time_s"]["total"] for r in records if r["type"] == "session" for w in r["workers"]
    )
    return cells + sessions


def test_the_dry_run_of_a_fleet_counts_every_workers_server_starts_in_its_gpu_time(
    tmp_path: Path,
) -> None:
    """The dry run's GPU time of a fleet (fresh, or resumed on a half-done folder) was the
    twin's sweep of the cells left as one run, starting each drafter's server once, where
    each busy worker of the fleet starts its drafters' servers (and waits out the thermal
    stabilisation after each): it ran far short of what the fleet then spent. It counts the
    workers' starts now, as the makespan does."""
    from conftest import TINY

    campaign = write(tmp_path / "tiny.toml", TINY)  # 4 groups, 2 drafters
    full = tmp_path / "full"
    args = [str(campaign), "--gpus", "0-1"]
    plan = json.loads(sweep(*args, "--out", str(full), "--dry-run", "--json").output)
    assert sweep(*args, "--out", str(full)).exit_code == 0
    spent = _fleet_gpu_s(read_records(full / "journal.jsonl"))
    assert abs(plan["twin_gpu_s"] - spent) <= 0.1 * spent, (plan["twin_gpu_s"], spent)
    # Half of it done: the first half of its cells, as an interrupted fleet leaves them.
    lines = (full / "journal.jsonl").read_text().splitlines(keepends=True)
    cells = [i for i, line in enumerate(lines) if json.loads(line)["type"] == "cell"]
    half = tmp_path / "half"
    half.mkdir()
    dropped = set(cells[len(cells) // 2 :])
    (half / "journal.jsonl").write_text(
        "".join(line for i, line in enumerate(lines) if i not in dropped)
    )
    before = len(read_records(half / "journal.jsonl"))
    plan = json.loads(sweep(*args, "--out", str(half), "--dry-run", "--json").output)
    assert plan["already_done"] == len(cells) - len(dropped), plan["problems"]
    assert sweep(*args, "--out", str(half)).exit_code == 0
    spent = _fleet_gpu_s(read_records(half / "journal.jsonl")[before:])
    assert abs(plan["twin_gpu_s"] - spent) <= 0.1 * spent, (plan["twin_gpu_s"], spent)


def test_the_dry_run_of_a_fleet_counts_the_servers_and_time_its_workers_spend(
    tmp_path: Path,
) -> None:
    """On the twin, what the fleet's dry run says it would do is what the fleet then does:
    as many server starts as its workers make, and a makespan near its slowest worker's GPU
    time (the dry run of one GPU's sweep scaled down by the groups alone counted one start per
    drafter for the whole fleet, and its makespan fell short by more than half)."""
    from conftest import TINY

    campaign = write(tmp_path / "tiny.toml", TINY)  # 4 groups: 3 dealt, 1 left over
    out = tmp_path / "three"
    args = [str(campaign), "--gpus", "0-2", "--out", str(out)]
    plan = json.loads(sweep(*args, "--dry-run", "--json").output)
    assert sweep(*args).exit_code == 0
    records = read_records(out / "journal.jsonl")
    assert plan["server_starts"] == len([r for r in records if r["type"] == "server"])
    spent: dict[str, float] = {}
    for r in records:
        if r["type"] == "cell":
            spent[r["worker"]] = spent.get(r["worker"], 0.0) + sum(r["gpu_time_s"].values())
        elif r["type"] == "session":
            for w in r["workers"]:
                spent[w["worker"]] = spent.get(w["worker"], 0.0) + w["gpu_time_s"]["total"]
    makespan = max(spent.values()) / 3600
    assert abs(plan["estimated_makespan_hours"] - makespan) <= 0.15 * makespan + 0.005, (
        plan["estimated_makespan_hours"],
        makespan,
    )
    done = sweep(*args, "--dry-run", "--no-estimate").output  # the folder holds every cell
    assert "0 server start(s), 0 knob change(s);" in " ".join(done.split()), done


def test_the_dry_run_of_a_fleet_counts_the_knob_changes_its_workers_make(tmp_path: Path) -> None:
    """Each busy worker sets its GPU's knobs for every cell whose setting differs from the one
    it left there, over its own groups and again over a group it takes left over after the
    deal: the dry run counts them as the fleet's queue hands the cells out (it counted one
    GPU's sweep's once per busy worker, 20 where the fleet made 23). Which worker takes a
    left-over group depends on which finishes first, so one change either way."""
    from conftest import TINY

    text = TINY.replace("batch = [1, 8]", "batch = [1, 8, 16]")  # 6 groups on 4 workers
    campaign = write(tmp_path / "tiny.toml", text)
    out = tmp_path / "four"
    args = [str(campaign), "--gpus", "0-3", "--out", str(out)]
    plan = json.loads(sweep(*args, "--dry-run", "--no-estimate", "--json").output)
    assert sweep(*args).exit_code == 0
    changes, setting = 0, {}
    for r in read_records(out / "journal.jsonl"):
        if r["type"] == "cell":
            here = (r["cell"]["sm_clock_mhz"], r["cell"]["power_limit_w"])
            changes += setting.get(r["worker"]) != here
            setting[r["worker"]] = here
    assert abs(plan["knob_changes"] - changes) <= 1, (plan["knob_changes"], changes)


def test_the_dry_run_of_a_fleet_mixing_gpu_models_counts_the_campaign_once_per_model(
    tiny_exact_run, tmp_path: Path
) -> None:
    """Two GPU models each run the whole campaign on their own workers: the dry run counts
    every model's cells, as the run measures them, and the model whose busiest worker ends
    last sets the makespan (on 0-2,h200-sxm:0 the H100s', one of which runs two groups and
    starts a server for the one left over, not the lone H200's); a twin GPU named with the
    campaign's own profile is the same model."""
    from conftest import MIXED_FLEET, TINY_EXACT

    from dvfs.measure.plan import SERVER_START_S

    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)  # 16 cells, 4 comparison groups
    starts_h = 2 * SERVER_START_S / 3600  # one worker's: both drafters' servers
    one = ["sweep", str(campaign), "--dry-run", "--no-estimate", "--json"]
    alone = json.loads(CliRunner().invoke(cli, one).output)
    # (--gpus, models, the busiest worker's groups and server starts, the fleet's busy
    # workers, left over)
    cases = (
        (MIXED_FLEET[1], 2, 4, 2, 2, 0),
        ("0-2,h200-sxm:0", 2, 2, 3, 4, 1),
        ("0,h100-sxm:1", 1, 2, 2, 2, 0),
    )
    for spec, models, busiest, busiest_starts, busy, leftover in cases:
        args = ["sweep", str(campaign), "--dry-run", "--no-estimate", "--gpus", spec, "--json"]
        doc = json.loads(CliRunner().invoke(cli, args).output)
        assert doc["gpu_models"] == models, spec
        assert doc["cells_all_models"] == 16 * models
        assert doc["server_starts"] == 2 * busy + leftover, spec
        hours = alone["estimated_hours_on_hardware"]  # one worker's, rounded to 0.01 h
        makespan = (hours - starts_h) * busiest / 4 + busiest_starts * SERVER_START_S / 3600
        assert abs(doc["estimated_makespan_hours"] - makespan) <= 0.011, spec
    out = tiny_exact_run("mixed")  # the session's run of TINY_EXACT on MIXED_FLEET
    measured = [
        r
        for journal in sorted(out.glob("gpu-*/journal.jsonl"))
        for r in read_records(journal)
        if r["type"] == "cell"
    ]
    assert len(measured) == 32  # what the dry run counted


def test_a_worker_that_left_the_queue_is_handed_nothing_more() -> None:
    """A worker's thread may ask for its next cell after the driver retired it (a refused
    server) or lost it: the queue hands it none and does not count it live again, or a group
    it claimed would wait for a worker that never takes another cell (a hang)."""
    cells = [Cell("none", 0, 1980, None, b, c) for b in (1, 2) for c in "abcd"]
    queue = CellQueue(cells, ["w0", "w1"])
    queue.leave("w1")
    assert queue.take("w1", "none") is None
    assert not queue.available("w1")
    assert queue.live() == ("w0",)
    taken = []
    while (cell := queue.take("w0", "none")) is not None:
        taken.append(cell)
    assert sorted(taken, key=lambda c: c.key) == sorted(cells, key=lambda c: c.key)
