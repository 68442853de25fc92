"""Caps are taken against the GPU's stock setting, not the top of the grid: end to end through
the CLI on a twin campaign whose grid (1800/1200 MHz, 600/400 W) holds neither stock knob
(1980 MHz / 700 W), so every setting it chose is below stock and must be capped."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import SMALL_EXACT, replace_block

from dvfs.cli import cli

#: SMALL_EXACT on a grid without either stock knob: one batch, one corpus.
NO_STOCK = replace_block(
    replace_block(
        replace_block(
            replace_block(SMALL_EXACT, 'name = "small"', 'name = "nostock"'),
            "sm_clock = [1980, 1500, 1005]\npower_limit = [700, 300]",
            "sm_clock = [1800, 1200]\npower_limit = [600, 400]",
        ),
        "batch = [1, 8]",
        "batch = [1]",
    ),
    'corpora = ["code", "conversation"]',
    'corpora = ["code"]',
)


def run(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture
def no_stock(shared_run) -> Path:  # type: ignore[no-untyped-def]
    return shared_run(NO_STOCK, "one")


@pytest.mark.parametrize("knob", ["both", "power_limit", "sm_clock"])
def test_every_chosen_setting_below_stock_is_capped(
    no_stock: Path, tmp_path: Path, knob: str
) -> None:
    """Static and per-batch plans cap both knobs at the chosen setting: on the old code a
    choice at the top of the grid (1800 MHz or 600 W) was taken for stock and left uncapped,
    so `cap apply` left the GPU at a setting never measured ("nothing to cap" when both)."""
    saved = tmp_path / "headroom.json"
    run("headroom", str(no_stock), "--knob", knob, "--slack", "5%", "--json", "-o", str(saved))
    room = json.loads(saved.read_text())
    assert room["reference"]["stock_sm_clock_mhz"] == 1980
    assert room["reference"]["stock_power_limit_w"] == 700.0
    for r in room["rows"]:
        assert r["feasible"], r
        chosen = r["chosen"]
        plan = run("cap", "plan", str(saved), "--batch", "1", "--drafter", r["drafter"])
        (cap,) = tomllib.loads(plan.stdout)["model"]
        assert cap["sm_clock_max_mhz"] == chosen["sm_clock_mhz"]
        assert cap["power_limit_w"] == chosen["power_limit_w"]

        per_batch = run("cap", "plan", str(saved), "--per-batch", "--drafter", r["drafter"])
        (step,) = tomllib.loads(per_batch.stdout)["batch"]
        assert step["sm_clock_mhz"] == chosen["sm_clock_mhz"]
        assert step["power_limit_w"] == chosen["power_limit_w"]
        said = [line for line in per_batch.stderr.splitlines() if line.startswith("batch 1:")]
        assert len(said) == 1 and "stock" not in said[0], per_batch.stderr


@pytest.mark.usefixtures("unsaved_figures")
def test_the_reports_caps_are_taken_against_stock(no_stock: Path, tmp_path: Path) -> None:
    """The report's caps come from `cap plan`: none reads "stock" on this grid."""
    report = tmp_path / "report.md"
    run("report", str(no_stock), "-o", str(report))
    text = report.read_text()
    table = text.split("Caps per batch and drafter")[1].split("To write the caps file")[0]
    rows = [line for line in table.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 2, table
    for line in rows:
        assert "stock" not in line and " MHz |" in line and " W |" in line, line
