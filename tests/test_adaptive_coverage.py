"""Adaptive repeats in a finished and an interrupted sweep: the cube's repeat axis holds
`max_repeats`, and a cell that reached its precision sooner leaves the repeats after it
missing. Those are not "not measured yet" (no partial-cube note, not in `coverage`'s missing,
not bad cells in the report, not in the bound's repeat count); a repeat the rule still asks
for is."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import copy_sweep

from dvfs.cli import cli
from dvfs.records import RepeatRule

#: Three clocks, one arm: with repeats = 2 and max_repeats = 4 at ±2%, the exact twin takes a
#: third repeat for some cells and stops the others at two (checked, not assumed, below).
ADAPTIVE = """
[campaign]
name = "adaptive"

[gpu]
backend = "twin"
profile = "h100-sxm:none"
devices = [0]

[knobs]
sm_clock = [1380, 1680, 1980]
power_limit = "stock"
settle_s = 2.0

[engine]
backend = "twin"
model = "meta-llama/Llama-3.1-8B-Instruct"

[drafters.none]
algorithm = "none"

[workload]
batch = [4]
corpora = ["code"]
input_tokens = [16, 256]
output_tokens = 128
mode = "fixed"
temperature = 0.0

[measurement]
warmup_tokens = 16
min_window_s = 0.5
max_rounds = 4
precision = 0.02
repeats = 2
max_repeats = 4
seed = 0
sample_period_s = 0.05
idle_s = 2.0
"""


def invoke(*args: str):
    return CliRunner().invoke(cli, [*args], catch_exceptions=False)


def cell_records(out: Path) -> list[dict]:
    lines = (out / "journal.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == "cell"]


def repeats_taken(out: Path) -> dict[int, int]:
    """Each clock's repeats in the journal."""
    taken: dict[int, int] = {}
    for record in cell_records(out):
        clock = record["cell"]["sm_clock_mhz"]
        taken[clock] = max(taken.get(clock, 0), record["cell"]["repeat"] + 1)
    return taken


def headroom_doc(out: Path) -> tuple[dict, str]:
    result = invoke("headroom", str(out), "--json")
    assert result.exit_code == 0, result.output
    text = invoke("headroom", str(out))
    assert text.exit_code == 0, text.output
    return json.loads(result.output), text.output


@pytest.fixture
def adaptive_sweep(shared_run: Callable[..., Path]) -> Path:
    out = shared_run(ADAPTIVE, "out")
    taken = repeats_taken(out)
    # The premise: some cells stopped before max_repeats, some took an adaptive repeat.
    assert min(taken.values()) < 4 and max(taken.values()) > 2, taken
    return out


@pytest.mark.usefixtures("unsaved_figures")
def test_a_finished_adaptive_sweep_is_not_partial(adaptive_sweep: Path, tmp_path: Path) -> None:
    taken = repeats_taken(adaptive_sweep)
    unused = sum(4 - n for n in taken.values())
    out = copy_sweep(adaptive_sweep, tmp_path / "out")
    # Finished: running it again measures nothing (and writes the cube again).
    rerun = invoke("sweep", str(adaptive_sweep.parent / "campaign.toml"), "--out", str(out))
    assert rerun.exit_code == 0, rerun.output
    assert "0 cell(s) measured, 0 failed" in rerun.output
    doc, text = headroom_doc(out)
    assert "partial cube" not in text and "not measured yet" not in text
    assert doc["coverage"] == {
        "cells": sum(taken.values()),
        "missing": 0,
        "failed": 0,
        "not_needed": unused,
    }
    assert all(not r["unmeasured_settings"] for r in doc["rows"])
    # The bound names the repeats the settings used, not the repeat axis's four.
    lo, hi = min(taken.values()), max(taken.values())
    used = str(hi) if lo == hi else f"{lo}-{hi}"
    assert f"over {used} paired repeat(s)" in doc["bound"]
    assert "over 4 paired" not in text and f"over {used} paired" in text
    assert {r["repeats"] for r in doc["rows"]} <= set(taken.values())

    info = invoke("cube", "info", str(out))
    assert info.exit_code == 0, info.output
    assert "+ 0 missing" in info.output and f"{unused} adaptive repeat(s) not needed" in info.output

    report = tmp_path / "report.md"
    made = invoke("report", str(out), "-o", str(report))
    assert made.exit_code == 0, made.output
    md = report.read_text(encoding="utf-8")
    assert "Data quality: every cell was measured and valid" in md
    assert "failed, missing or flagged invalid" not in md
    assert "**Missing:** 0" in md and f"**Adaptive repeats not needed:** {unused}" in md
    assert "partial cube" not in md and "over 4 paired" not in md


def test_an_interrupted_adaptive_sweep_is_still_partial(
    adaptive_sweep: Path, tmp_path: Path
) -> None:
    out = copy_sweep(adaptive_sweep, tmp_path / "out")
    journal = out / "journal.jsonl"
    lines = journal.read_text(encoding="utf-8").splitlines()
    # Cut the journal before the last adaptive repeat: its cell's two repeats missed the
    # precision, so the rule still asks for it.
    last = max(
        i
        for i, line in enumerate(lines)
        if json.loads(line).get("type") == "cell" and json.loads(line)["cell"]["repeat"] >= 2
    )
    journal.write_text("\n".join(lines[:last]) + "\n", encoding="utf-8")
    built = invoke("cube", "build", str(out))
    assert built.exit_code == 0, built.output
    doc, text = headroom_doc(out)
    assert doc["coverage"]["missing"] == 1 and doc["coverage"]["failed"] == 0
    assert text.count("partial cube:") == 1
    assert f"1 of {doc['coverage']['cells']} cells not measured yet" in text
    info = invoke("cube", "info", str(out))
    assert "+ 1 missing" in info.output
    # Resuming measures what the note said was waiting, and the cube is then finished.
    resumed = invoke("sweep", str(adaptive_sweep.parent / "campaign.toml"), "--out", str(out))
    assert resumed.exit_code == 0, resumed.output
    assert "0 cell(s) measured" not in resumed.output
    doc, text = headroom_doc(out)
    assert "partial cube" not in text and doc["coverage"]["missing"] == 0


def test_a_campaign_stored_before_adaptive_repeats_asks_for_its_repeats_alone() -> None:
    old = {"repeats": 3, "warmup_tokens": 8}  # a measurement table from before version 3
    rule = RepeatRule.from_json(old)
    assert (rule.repeats, rule.max_repeats, rule.adaptive) == (3, 3, False)
    new = RepeatRule.from_json({**old, "max_repeats": 5, "precision": 0.01, "confidence": 0.9})
    assert (new.repeats, new.max_repeats, new.adaptive) == (3, 5, True)
