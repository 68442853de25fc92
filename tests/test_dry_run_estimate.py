"""`dvfs sweep --dry-run` on a twin campaign: the GPU time it prints is what the sweep spends."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from conftest import REPO, SMALL_CAMPAIGN, write

from dvfs.cli import cli
from dvfs.cube import open_cube
from dvfs.measure.journal import read_records


def spent_s(out: Path) -> float:
    """Cells' gpu_time_total_s plus the sessions' overhead, read from the sweep's own output."""
    with open_cube(out / "cube.nc") as ds:
        cells = float(ds["gpu_time_total_s"].fillna(0.0).sum())
    sessions = [r for r in read_records(out / "journal.jsonl") if r.get("type") == "session"]
    assert sessions and all(s["gpu_time_s"]["total"] > 0 for s in sessions)
    return cells + sum(s["gpu_time_s"]["total"] for s in sessions)


def test_dry_run_prints_the_gpu_time_the_twin_then_spends(tmp_path: Path) -> None:
    campaign = write(tmp_path / "small.toml", SMALL_CAMPAIGN)  # every trap on
    out = tmp_path / "out"
    dry = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--out", str(out), "--dry-run", "--json"]
    )
    assert dry.exit_code == 0, dry.output
    predicted = json.loads(dry.output)["twin_gpu_s"]
    assert not out.exists()  # the dry run swept into a temporary folder, not --out

    text = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--dry-run"])
    assert text.exit_code == 0, text.output
    assert f"the twin spends {predicted / 3600:.2f} GPU-hours" in text.output

    run = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out)])
    assert run.exit_code == 0, run.output
    actual = spent_s(out)
    assert actual > 0
    assert abs(predicted - actual) <= 1e-3 + 1e-6 * actual, (predicted, actual)


def test_dry_run_on_real_hardware_has_no_twin_figure() -> None:
    result = CliRunner().invoke(
        cli, ["sweep", str(REPO / "sweeps" / "h100-llama8b.toml"), "--dry-run", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert "twin_gpu_s" not in json.loads(result.output)
