"""The Ray executor (a loopback cluster with twin GPUs) in what issue 12 left open: a rerun
on fewer actors finishes a campaign others started, adaptive repeats and in-flight groups
give the single GPU's cube."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from fleet_rerun_support import ADAPTIVE, INFLIGHT
from fleet_support import FLEET, assert_same_cells

from dvfs.cli import cli
from dvfs.cube import open_cube
from dvfs.measure.journal import read_records

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def sweep(*args: str) -> Result:
    return CliRunner().invoke(cli, ["sweep", *args, "--no-progress"], catch_exceptions=False)


@pytest.mark.timeout(300)
def test_fewer_ray_actors_finish_what_four_gpus_started(
    ray_cluster: object, shared_run, tmp_path: Path
) -> None:
    one, four = shared_run(FLEET, "one"), shared_run(FLEET, "four", "--gpus", "0-3")  # shared runs
    campaign = one.parent / "campaign.toml"
    lines = (four / "journal.jsonl").read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if '"type":"cell"' in line][30]
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.jsonl").write_text("".join(lines[:cut]))
    result = sweep(str(campaign), "--gpus", "2-3", "--executor", "ray", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "42 cell(s) measured" in result.output and "30 already done" in result.output
    assert_same_cells(open_cube(out / "cube.nc"), open_cube(one / "cube.nc"))
    sessions = [r for r in read_records(out / "journal.jsonl") if r["type"] == "session"]
    assert [len(s["gpus"]) for s in sessions] == [4, 2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", [ADAPTIVE, INFLIGHT], ids=["adaptive-repeats", "in-flight"])
def test_ray_modes_give_the_cube_of_one_gpu(
    ray_cluster: object, shared_run, text: str, tmp_path: Path
) -> None:
    one = shared_run(text, "one")  # shared with tests/test_fleet_modes.py
    campaign = one.parent / "campaign.toml"
    # Two actors: enough to spread the units of work (each actor is a process to start).
    result = sweep(
        str(campaign), "--gpus", "0-1", "--executor", "ray", "--out", str(tmp_path / "ray")
    )
    assert result.exit_code == 0, result.output
    assert_same_cells(open_cube(tmp_path / "ray" / "cube.nc"), open_cube(one / "cube.nc"))
    keys = [r["key"] for r in read_records(one / "journal.jsonl") if r["type"] == "cell"]
    ray = [
        r["key"] for r in read_records(tmp_path / "ray" / "journal.jsonl") if r["type"] == "cell"
    ]
    assert sorted(ray) == sorted(keys)
