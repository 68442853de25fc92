"""A partial cube (an interrupted sweep, cells not measured yet) through the analyses: the
answers say the cells below are waiting to be measured, not that the grid ends there."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from conftest import TINY, copy_sweep, write

from dvfs.cli import cli


def invoke(*args: str):
    return CliRunner().invoke(cli, [*args], catch_exceptions=False)


def without_cells(journal: Path, drop) -> None:
    """Rewrite a journal without the cell records `drop(cell)` picks, and the server records
    of drafters left with no cell: what a sweep stopped before reaching them leaves."""
    lines = journal.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    kept_cells = [r for r in records if r.get("type") == "cell" and not drop(r["cell"])]
    ran = {r["cell"]["drafter"] for r in kept_cells}
    kept = []
    for line, record in zip(lines, records, strict=True):
        if record.get("type") == "cell" and drop(record["cell"]):
            continue
        if record.get("type") == "server" and record["drafter"] not in ran:
            continue
        kept.append(line)
    journal.write_text("\n".join(kept) + "\n", encoding="utf-8")


def partial_sweep(small_sweep: Path, dest: Path, drop) -> Path:
    out = copy_sweep(small_sweep, dest)
    without_cells(out / "journal.jsonl", drop)
    result = invoke("cube", "build", str(out))
    assert result.exit_code == 0, result.output
    return out


def test_unmeasured_settings_below_an_answer_ask_for_a_resume_not_a_larger_grid(
    small_sweep: Path, tmp_path: Path
) -> None:
    # The 300 W half of the grid not reached yet: every answer sits at 700 W.
    out = partial_sweep(small_sweep, tmp_path / "out", lambda c: c["power_limit_w"] == 300.0)
    doc_path = tmp_path / "h.json"
    result = invoke("headroom", str(out), "--slack", "10%", "-o", str(doc_path))
    assert result.exit_code == 0, result.output
    text = result.output
    assert "extend knobs.power_limit" not in text
    assert "≥0" not in text and "0?" in text
    assert text.count("partial cube:") == 1
    assert "cells not measured yet" in text and "resume" in text
    # `cube info` says what measures them too (it said only "N missing")
    info = " ".join(invoke("cube", "info", str(out)).output.split())
    assert "resume run the same `dvfs sweep` command again without --fresh" in info, info
    assert json.loads(invoke("cube", "info", str(out), "--json").output)["resume"]
    whole = json.loads(invoke("cube", "info", str(small_sweep), "--json").output)
    assert whole["resume"] is None
    doc = json.loads(doc_path.read_text(encoding="utf-8"))
    assert doc["coverage"]["missing"] == doc["coverage"]["cells"] // 2
    feasible = [r for r in doc["rows"] if r["feasible"]]
    assert feasible
    for r in feasible:
        assert r["headroom_w_unmeasured_below"] and not r["headroom_w_is_lower_bound"]
        assert r["chosen_unmeasured_below"] and not r["chosen_at_grid_edge"]
    # cap plan takes the same flags: no grid_edge note for cells merely not measured yet.
    caps = invoke("cap", "plan", str(doc_path), "--batch", "1", "--drafter", "none")
    assert caps.exit_code == 0, caps.output
    assert "grid_edge" not in caps.output and "lowest the grid" not in caps.output


def test_a_complete_cube_still_says_the_grid_cuts_an_answer_off(small_sweep: Path) -> None:
    result = invoke("headroom", str(small_sweep), "--slack", "1000%", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["coverage"]["missing"] == 0 and doc["coverage"]["failed"] == 0
    rows = [r for r in doc["rows"] if r["feasible"]]
    assert rows and all(r["at_grid_edge"] for r in rows)
    assert not any(r["headroom_w_unmeasured_below"] for r in rows)
    text = invoke("headroom", str(small_sweep), "--slack", "1000%").output
    assert "partial cube" not in text and "extend knobs" in text


def test_a_row_whose_reference_is_not_measured_says_so(small_sweep: Path, tmp_path: Path) -> None:
    # eagle3 not started yet: its stock cells are missing.
    out = partial_sweep(small_sweep, tmp_path / "out", lambda c: c["drafter"] == "eagle3")
    result = invoke("headroom", str(out), "--slack", "5%", "--json")
    rows = json.loads(result.output)["rows"]
    eagle = [r for r in rows if r["drafter"] == "eagle3"]
    assert eagle and all(r["reference_problem"] == "not measured yet" for r in eagle)
    assert all(r["reference_problem"] is None for r in rows if r["drafter"] == "none")
    text = invoke("headroom", str(out), "--slack", "5%").output
    assert "no valid reference cell (not measured yet)" in text


def test_compare_roofline_of_a_drafter_never_run_comes_from_the_campaign(
    small_sweep: Path, tmp_path: Path
) -> None:
    """eagle3's server never started: its verify width is the campaign's num_draft_tokens (4
    in SMALL_CAMPAIGN), not a made-up 1; without the campaign either, "no data"."""
    import xarray as xr

    out = partial_sweep(small_sweep, tmp_path / "out", lambda c: c["drafter"] == "eagle3")
    result = invoke("compare", str(out), "--json")
    assert result.exit_code == 0, result.output
    verify = json.loads(result.output)["roofline"]["verify"]
    widths = {(v["batch"], v["drafter"]): v["verify_tokens"] for v in verify}
    assert widths == {(1, "none"): 1, (8, "none"): 8, (1, "eagle3"): 4, (8, "eagle3"): 32}

    with xr.open_dataset(out / "cube.nc") as ds:
        bare = ds.load()
    workload = json.loads(bare.attrs["campaign"])["workload"]
    bare.attrs["campaign"] = json.dumps({"workload": workload})  # no drafter settings
    bare.to_netcdf(tmp_path / "bare.nc")
    doc = json.loads(invoke("compare", str(tmp_path / "bare.nc"), "--json").output)
    eagle = [v for v in doc["roofline"]["verify"] if v["drafter"] == "eagle3"]
    assert eagle and all(
        v["verify_tokens"] is None and v["arithmetic_intensity"] is None for v in eagle
    )
    text = invoke("compare", str(tmp_path / "bare.nc")).output
    roof = text[text.index("Verify pass vs ridge point") :]
    # the table's rows, not the notes under it (one names eagle3 as having no accept length)
    eagle_lines = [line for line in roof.splitlines() if line.startswith("│") and "eagle3" in line]
    assert eagle_lines and all("no data" in line for line in eagle_lines)


#: The reviewer's campaign: short decodes on the H200 twin, whose energy counter updates too
#: rarely for windows this short: many cells measured but invalid (few_counter_updates).
FEW_UPDATES = """
[campaign]
name = "few-updates"

[gpu]
backend = "twin"
profile = "h200-sxm"
devices = [0]

[knobs]
sm_clock = [1980, 1500, 1200]
power_limit = [700]

[engine]
backend = "twin"
model = "meta-llama/Llama-3.1-8B-Instruct"

[drafters.none]
algorithm = "none"

[drafters.eagle3]
algorithm = "EAGLE3"
draft_model = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
num_steps = 5
eagle_topk = 4
num_draft_tokens = 8

[workload]
batch = [1, 16]
corpora = ["code", "math"]
output_tokens = 128

[measurement]
max_rounds = 4
precision = 0.05
repeats = 2
"""


def test_a_sweep_with_invalid_cells_says_how_many_why_and_what_to_change(
    tmp_path: Path,
) -> None:
    campaign = tmp_path / "few.toml"
    campaign.write_text(FEW_UPDATES, encoding="utf-8")
    out = tmp_path / "out"
    result = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    # Invalid cells are not failures (README exit codes: 5 is for failed cells).
    assert result.exit_code == 0, result.output
    info = json.loads(invoke("cube", "info", str(out), "--json").output)
    assert info["invalid"] > 0 and info["failed"] == 0
    summary = next(line for line in result.output.splitlines() if "cell(s) measured" in line)
    assert f"{info['invalid']} invalid in the cube" in summary
    assert f"{info['invalid']} of {info['measured']} measured cell(s) are invalid" in result.output
    assert "few_counter_updates x" in result.output and "workload.output_tokens" in result.output
    # Said from the cube the sweep held in memory: word for word what the file it wrote says.
    from dvfs.cube import open_cube
    from dvfs.cube.quality import invalid_summary

    assert invalid_summary(open_cube(out)) in " ".join(result.output.split())
    fleet = invoke("sweep", str(campaign), "--out", str(tmp_path / "fleet"), "--gpus", "0-1")
    assert fleet.exit_code == 0, fleet.output  # a fleet's report: the same, from its cube
    assert invalid_summary(open_cube(tmp_path / "fleet")) in " ".join(fleet.output.split())
    # headroom says why a row has no reference instead of a bare "no valid reference cell".
    rows = json.loads(invoke("headroom", str(out), "--slack", "5%", "--json").output)["rows"]
    no_ref = [r for r in rows if r["target_ms"] is None]
    assert no_ref and all(r["reference_problem"].startswith("invalid: ") for r in no_ref)
    assert any("few_counter_updates" in r["reference_problem"] for r in no_ref)
    text = invoke("headroom", str(out), "--slack", "5%").output
    assert "no valid reference cell (invalid: few_counter_updates)" in text


def test_a_fresh_sweeps_partial_cube_says_to_resume_without_fresh(tmp_path: Path) -> None:
    """The partial cube of a `--fresh` sweep (stopped halfway) said "run the same `dvfs sweep`
    command again to resume it" (`cube info`; the analyses' retry advice alike): that command,
    --fresh and all, moves the journal aside and measures every cell again. The advice says
    to run it without --fresh, which resumes."""
    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    command = ["sweep", str(campaign), "--out", str(out), "--no-progress", "--fresh"]
    assert invoke(*command).exit_code == 0
    journal = out / "journal.jsonl"
    lines = journal.read_text(encoding="utf-8").splitlines(keepends=True)
    cells = [i for i, line in enumerate(lines) if '"type":"cell"' in line]
    journal.write_text("".join(lines[: cells[6]]), encoding="utf-8")  # 6 of 16 cells in
    assert invoke("cube", "build", str(out)).exit_code == 0
    advice = json.loads(invoke("cube", "info", str(out), "--json").output)["resume"]
    assert "run the same `dvfs sweep` command again" in advice, advice
    if "without --fresh" in advice:  # as the advice says
        command.remove("--fresh")
    again = invoke(*command)
    assert again.exit_code == 0, again.output
    assert "10 cell(s) measured, 0 failed, 6 already done" in again.output, (advice, again.output)
