"""Fleets in the measurement modes one runner has (issue 12): adaptive repeats (the driver
decides further repeats from its journal) and in-flight mode (a group of knob levels is one
unit of work, given to one worker) give the single GPU's cube cell for cell."""

from __future__ import annotations

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
