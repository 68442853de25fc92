"""Fleets in the measurement modes one runner has (issue 12): adaptive repeats (the driver
decides further repeats from its journal) and in-flight mode (a group of knob levels is one
unit of work, given to one worker) give the single GPU's cube cell for cell."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from fleet_rerun_support import ADAPTIVE, INFLIGHT
from fleet_support import assert_same_cells

from dvfs.cli import cli
from dvfs.cube import STATUS_MISSING, open_cube
from dvfs.fleet.worker import Worker
from dvfs.measure.journal import read_records


def sweep(*args: str) -> Result:
    return CliRunner().invoke(cli, ["sweep", *args, "--no-progress"], catch_exceptions=False)


def repeats_of(journal: Path) -> list[int]:
    return [r["cell"]["repeat"] for r in read_records(journal) if r["type"] == "cell"]


@pytest.fixture
def adaptive(shared_run) -> Path:
    """The adaptive campaign on one GPU, the reference (`one`, beside `campaign.toml`; shared
    with tests/test_fleet_ray_modes.py): read-only."""
    return shared_run(ADAPTIVE, "one").parent


def test_adaptive_repeats_on_four_gpus_equal_one(adaptive: Path, shared_run) -> None:
    # The four-GPU run is shared with tests/test_fleet_pairing.py (read-only).
    out = shared_run(ADAPTIVE, "four", "--gpus", "0-3")
    one = repeats_of(adaptive / "one" / "journal.jsonl")
    four = repeats_of(out / "journal.jsonl")
    assert max(one) == 3 and sorted(four) == sorted(one), "the same extra repeats, each once"
    cube, reference = open_cube(out / "cube.nc"), open_cube(adaptive / "one" / "cube.nc")
    assert_same_cells(cube, reference)
    missing = cube["cell_status"].values == STATUS_MISSING
    assert missing.any() and not missing.all(), "some groups reached the precision early"
    np.testing.assert_array_equal(missing, reference["cell_status"].values == STATUS_MISSING)
    # Every worker took part in the extra repeats, not only the one that finished last.
    extra = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len({r["worker"] for r in extra if r["cell"]["repeat"] >= 2}) > 1


def test_a_fleet_resumes_inside_the_extra_repeats(adaptive: Path, tmp_path: Path) -> None:
    """Killed during the extra repeats (the journal cut there), rerun on two GPUs: the driver
    reads what is left from the journal and finishes as one GPU does."""
    lines = (adaptive / "one" / "journal.jsonl").read_text().splitlines(keepends=True)
    cells = [i for i, line in enumerate(lines) if '"type":"cell"' in line]
    cut = cells[72 * 2 + 20]  # the planned repeats and 20 extra ones
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.jsonl").write_text("".join(lines[:cut]))
    result = sweep(str(adaptive / "campaign.toml"), "--gpus", "0-1", "--out", str(out))
    assert result.exit_code == 0, result.output
    keys = [r["key"] for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(keys) == len(set(keys)) == len(cells)
    assert_same_cells(open_cube(out / "cube.nc"), open_cube(adaptive / "one" / "cube.nc"))
    # Nothing left: the rerun runs no cell.
    again = sweep(str(adaptive / "campaign.toml"), "--gpus", "0-1", "--out", str(out))
    assert again.exit_code == 0 and "0 cell(s) measured" in again.output, again.output


def cut_in_the_extra_repeats(adaptive: Path, out: Path, extra: int) -> int:
    """`out` holding the reference journal cut after its planned cells and `extra` extra
    repeats; how many cells it holds."""
    lines = (adaptive / "one" / "journal.jsonl").read_text().splitlines(keepends=True)
    cells = [i for i, line in enumerate(lines) if '"type":"cell"' in line]
    out.mkdir()
    (out / "journal.jsonl").write_text("".join(lines[: cells[72 * 2 + extra]]))
    return 72 * 2 + extra


@pytest.mark.parametrize("gpus", [[], ["--gpus", "0-1"]], ids=["one-gpu", "fleet"])
def test_a_resumed_sweep_counts_the_extra_repeats_done(
    adaptive: Path, gpus: list[str], tmp_path: Path
) -> None:
    """Resumed inside the extra repeats, the closing line counts those the journal holds as
    done (it said '144 already done' of a journal holding 170 cells)."""
    out = tmp_path / "out"
    held = cut_in_the_extra_repeats(adaptive, out, 26)
    result = sweep(str(adaptive / "campaign.toml"), *gpus, "--out", str(out))
    assert result.exit_code == 0, result.output
    measured = len(repeats_of(out / "journal.jsonl")) - held
    assert f"{measured} cell(s) measured, 0 failed, {held} already done" in result.output


@pytest.mark.parametrize("gpus", [[], ["--gpus", "0-1"]], ids=["one-gpu", "fleet"])
def test_the_dry_run_counts_the_extra_repeats(
    adaptive: Path, gpus: list[str], tmp_path: Path
) -> None:
    """The dry run of a folder inside the extra repeats counts those its journal holds as done
    and says how many more the journal asks for now, the repeats the sweep then adds first (it
    said '144 already done, 0 to run' and the sweep measured 105 more)."""
    out = tmp_path / "out"
    held = cut_in_the_extra_repeats(adaptive, out, 26)
    campaign = str(adaptive / "campaign.toml")
    plan = sweep(campaign, *gpus, "--out", str(out), "--dry-run", "--no-estimate", "--json")
    assert plan.exit_code == 0, plan.output
    report = json.loads(plan.output)
    extra = report["adaptive_repeats"]
    assert report["already_done"] + extra["extra_done"] == held
    assert report["remaining"] == 0 and extra["extra_done"] == held - report["cells"]
    assert extra["extra_to_run_now"] > 0 and report["server_starts"] > 0
    text = sweep(campaign, *gpus, "--out", str(out), "--dry-run", "--no-estimate")
    assert (
        f"{extra['extra_done']} extra repeat(s) already done, {extra['extra_to_run_now']} to "
        "run now" in " ".join(text.output.split())
    ), text.output
    result = sweep(campaign, *gpus, "--out", str(out))
    assert result.exit_code == 0, result.output
    # The repeats the sweep adds first: one GPU notes them after the planned cells, a fleet's
    # driver queues them at its start (its total on resuming holds them).
    if gpus:
        start = re.search(r"resuming: (\d+) of (\d+) cells", result.output)
        assert start, result.output
        asked = int(start[2]) - int(start[1])
    else:
        notes = re.findall(r"(\d+) cell\(s\) need another repeat", result.output)
        assert notes, result.output
        asked = int(notes[0])
    assert asked == extra["extra_to_run_now"], result.output
    measured = len(repeats_of(out / "journal.jsonl")) - held
    assert measured >= extra["extra_to_run_now"]


@pytest.fixture
def inflight(shared_run) -> Path:
    """The in-flight campaign on one GPU, as `adaptive`."""
    return shared_run(INFLIGHT, "one").parent


def groups_by_worker(journal: Path) -> dict[str, set[str]]:
    """Each in-flight group (by its id) and the workers whose records carry it."""
    seen: dict[str, set[str]] = {}
    for record in read_records(journal):
        if record["type"] == "cell":
            seen.setdefault(record["inflight"]["group"], set()).add(record.get("worker", ""))
    return seen


def test_in_flight_groups_on_four_gpus_equal_one(inflight: Path, shared_run) -> None:
    """A group is one unit of work: all its levels on one worker, inside its decodes."""
    out = shared_run(INFLIGHT, "four", "--gpus", "0-3")  # shared with test_fleet_pairing.py
    assert_same_cells(open_cube(out / "cube.nc"), open_cube(inflight / "one" / "cube.nc"))
    groups = groups_by_worker(out / "journal.jsonl")
    assert len(groups) == 12 and all(len(w) == 1 for w in groups.values())
    assert len(set().union(*groups.values())) == 4, "every worker stepped groups"


def test_a_lost_worker_gives_back_its_whole_group(
    inflight: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    run_unit = Worker.run_unit

    def failing(self: Worker, unit):  # gpu1 dies on its second group, mid-group
        if self.label == "gpu1":
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("the GPU fell off the bus")
        return run_unit(self, unit)

    monkeypatch.setattr(Worker, "run_unit", failing)
    out = tmp_path / "lost"
    result = sweep(str(inflight / "campaign.toml"), "--gpus", "0-3", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "gpu1" in result.output and "lost: RuntimeError" in result.output
    groups = groups_by_worker(out / "journal.jsonl")
    assert len(groups) == 12 and all(len(w) == 1 for w in groups.values())
    assert sum(w == {"gpu1"} for w in groups.values()) == 1
    keys = [r["key"] for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(keys) == len(set(keys)) == 72
    assert_same_cells(open_cube(out / "cube.nc"), open_cube(inflight / "one" / "cube.nc"))


class CountingProgress:
    """A progress display that checks its count: never more cells done than its total."""

    def __init__(self) -> None:
        self.total = self.done = 0
        self.over: list[str] = []

    def start(self, total: int, done: int) -> None:
        self.total, self.done = total, done

    def more(self, cells: int) -> None:
        self.total += cells

    def advance(self, cell, status: str) -> None:  # type: ignore[no-untyped-def]
        self.done += 1
        if self.done > self.total:
            self.over.append(f"{self.done}/{self.total}")

    def note(self, message: str) -> None:
        pass

    def worker(self, stats, eta_s) -> None:  # type: ignore[no-untyped-def]
        pass


@pytest.mark.parametrize("gpus", [1, 2], ids=["one-gpu", "fleet"])
def test_progress_counts_the_extra_repeats(adaptive: Path, gpus: int, tmp_path: Path) -> None:
    """The bar's total grows with the further repeats `max_repeats` adds, on one GPU and in a
    fleet (it stayed at the planned cells: '275/144', and the fleet's ETA went negative)."""
    from dvfs.campaign import load_campaign
    from dvfs.fleet.driver import run_fleet
    from dvfs.fleet.local import LocalExecutor
    from dvfs.sweep import run_sweep

    campaign = load_campaign(adaptive / "campaign.toml")
    out = tmp_path / "out"
    progress = CountingProgress()
    if gpus == 1:
        run_sweep(campaign, out, progress=progress)
    else:
        run_fleet(campaign, out, [(0,), (1,)], LocalExecutor(out), progress=progress)
    cells = repeats_of(out / "journal.jsonl")
    assert max(cells) == 3, "the campaign must add repeats"
    assert progress.over == []
    assert progress.done == progress.total == len(cells)


def test_the_bars_total_grows_with_more_cells(adaptive: Path) -> None:
    """The rich bars (one GPU's and a fleet's) take `more` cells into their total and ETA."""
    from dvfs.campaign import load_campaign
    from dvfs.cli.fleet_progress import RichFleetProgress
    from dvfs.cli.progress import RichProgress
    from dvfs.measure.plan import plan_cells

    cell = plan_cells(load_campaign(adaptive / "campaign.toml"))[0]
    for bar in (RichProgress("one", enabled=False), RichFleetProgress("fleet", enabled=False)):
        bar.start(10, 2)
        for _ in range(8):
            bar.advance(cell, "ok")
        bar.more(5)
        bar.advance(cell, "ok")
        [task] = bar._progress.tasks
        assert (task.completed, task.total) == (11, 15)
        if isinstance(bar, RichFleetProgress):
            assert not task.fields["eta"].startswith("-"), task.fields["eta"]
