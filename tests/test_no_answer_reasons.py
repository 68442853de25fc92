"""Rows without an answer, and answers limited by cells not measured validly, said alike by
every command: the headroom table, the report's findings and caps, and `dvfs cap plan` give
the same reason and advise what would help (resume, change the campaign, loosen the target
only where settings were judged over it); `--model` plans only a model the document measured;
merging unfinished shards says so."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from cubes import as_twin_sweep, make_cube
from test_partial_cube import partial_sweep

from dvfs.cli import cli
from dvfs.cube import write_cube
from dvfs.measure.meter import Q_FEW_COUNTER_UPDATES

H100 = "NVIDIA H100 80GB HBM3 (twin)"


def run(*args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def flagged_cube(  # type: ignore[no-untyped-def]
    path: Path, invalid, drafters: list[str] | None = None, flagged: set[str] | None = None
) -> Path:
    """A twin cube (clocks 1000-1980, limits 300/700, corpora code and math, `drafters`)
    whose latency never changes, so every valid setting meets any target; `invalid(clock,
    limit, corpus)` cells (of the `flagged` drafters only, where given) are flagged
    few_counter_updates."""

    def valid(clock: int, limit: float, batch: int, drafter: str, corpus: str, r: int) -> bool:
        return not (invalid(clock, limit, corpus) and (flagged is None or drafter in flagged))

    ds = make_cube(
        clocks=[1000, 1500, 1980],
        limits=[300.0, 700.0],
        drafters=drafters,
        corpora=["code", "math"],
        repeats=2,
        energy=lambda clock, limit, *_: clock / 1000 + limit / 1000,
        valid=valid,
    )
    quality = np.where(ds["valid"].values == 0, Q_FEW_COUNTER_UPDATES, 0).astype(float)
    ds["quality"] = (ds["valid"].dims, quality, {"units": "1", "long_name": "quality flags"})
    return write_cube(
        as_twin_sweep(
            ds, uuid="GPU-aaaaaaaa-0000-4000-8000-000000000001", gpu_name=H100, campaign="flagged"
        ),
        path,
    )


def test_invalid_cells_below_an_answer_are_not_the_grid_edge(tmp_path: Path) -> None:
    # code: only stock (the TOP of the grid) valid; math: all valid (the grid really ends).
    cube = flagged_cube(
        tmp_path / "c.nc",
        lambda clock, limit, corpus: corpus == "code" and (clock, limit) != (1980, 700.0),
    )
    saved = tmp_path / "h.json"
    run("headroom", str(cube), "--slack", "5%", "--json", "-o", str(saved))
    rows = {r["corpus"]: r for r in json.loads(saved.read_text())["rows"]}
    code, math = rows["code"], rows["math"]
    assert code["chosen"] == {"sm_clock_mhz": 1980, "power_limit_w": 700.0}
    assert not code["headroom_mhz_is_lower_bound"] and not code["headroom_w_is_lower_bound"]
    assert not code["chosen_at_grid_edge"] and not code["at_grid_edge"]
    assert code["headroom_mhz_invalid_below"] and code["headroom_w_invalid_below"]
    assert code["chosen_invalid_below"] and code["invalid_flags"] == "few_counter_updates"
    assert code["invalid_settings"] == 5
    # The grid's real edge still says so, and carries no invalid marks.
    assert math["headroom_mhz_is_lower_bound"] and math["chosen_at_grid_edge"]
    assert not math["headroom_mhz_invalid_below"] and math["invalid_flags"] is None

    text = run("headroom", str(cube), "--slack", "5%").output
    code_line = next(line for line in text.splitlines() if "code" in line and "1980/700" in line)
    assert "0†/0†" in code_line and "≥" not in code_line
    assert "†: " in text and "few_counter_updates" in text and "workload.output_tokens" in text
    # cap plan copies no false grid-edge note for code.
    plan = run(
        "cap", "plan", str(saved), "--batch", "1", "--drafter", "none", "--corpus", "code", code=2
    )
    assert "lowest the campaign swept" not in plan.output and "nothing to cap" in plan.output


def test_invalid_cells_only_limit_an_answer_they_could_change() -> None:
    """Between a feasible clock and one over the target an invalid clock could still meet it
    (marked); below a clock over the target it could not (latency rises as the clock falls):
    no mark, and no "extend the grid" either, the grid does not end at the answer."""
    from dvfs.analysis.headroom import headroom
    from dvfs.analysis.targets import Target

    def latency(clock: int, *_: object) -> float:
        return 10.0 if clock == 1980 else 20.0

    def answer(invalid_clock: int):  # type: ignore[no-untyped-def]
        ds = make_cube(
            clocks=[1000, 1500, 1980], latency=latency, valid=lambda c, *_: c != invalid_clock
        )
        target = Target("preserve", slack=0.05)
        return headroom(ds, target=target).isel(batch=0, drafter=0, corpus=0)

    between, below = answer(1500), answer(1000)
    assert bool(between["headroom_mhz_invalid_below"]) and bool(between["chosen_invalid_below"])
    for r in (between, below):
        assert not bool(r["headroom_mhz_is_lower_bound"]) and not bool(r["chosen_at_grid_edge"])
    assert not bool(below["headroom_mhz_invalid_below"]) and not bool(below["chosen_invalid_below"])


def test_cap_plan_says_an_invalid_reference_cannot_be_fixed_by_loosening(tmp_path: Path) -> None:
    cube = flagged_cube(tmp_path / "c.nc", lambda clock, limit, corpus: corpus == "math")
    saved = tmp_path / "h.json"
    run("headroom", str(cube), "--slack", "5%", "--json", "-o", str(saved))
    args = ("cap", "plan", str(saved), "--batch", "1", "--drafter", "none")
    for corpus in ("math", "worst-case"):
        out = run(*args, "--corpus", corpus, code=2).output
        assert out.count("\n") == 1, out
        assert "no valid reference cell (invalid: few_counter_updates)" in out
        assert "workload.output_tokens" in out
        assert "loosen the target" not in out and "--slack" not in out
    # Where settings were judged over the target, loosening is what is advised.
    tight = tmp_path / "t.json"
    run("headroom", str(cube), "--slo", "tpot_p50<=1ms", "--json", "-o", str(tight))
    out = run(
        "cap", "plan", str(tight), "--batch", "1", "--drafter", "none", "--corpus", "code", code=2
    )
    assert "no setting meets the target" in out.output and "--slo" in out.output


def test_the_headroom_table_gives_the_advice_for_its_rows_without_an_answer(
    tmp_path: Path,
) -> None:
    """`dvfs headroom` wrote "no valid reference cell (invalid: few_counter_updates)" in a row
    and nothing on what would give it an answer, which `cap plan` and the report say: a
    `no answer:` note under the table now gives the same advice (change the campaign for the
    flags, not loosen the target), and loosening only where settings were judged over it."""
    cube = flagged_cube(tmp_path / "c.nc", lambda clock, limit, corpus: corpus == "math")
    table = run("headroom", str(cube), "--slack", "5%").output
    [note] = [line for line in table.splitlines() if line.startswith("no answer:")]
    reason = "no valid reference cell (invalid: few_counter_updates)"
    assert note.startswith(f"no answer: {reason} (batch 1 none on math)"), note
    assert "workload.output_tokens" in note and "--fresh" in note, note
    assert "loosen" not in note.replace("loosen measurement.precision", ""), note
    markdown = run("headroom", str(cube), "--slack", "5%", "--markdown").output
    assert f"no answer: {reason}" in markdown
    tight = run("headroom", str(cube), "--slo", "tpot_p50<=1ms").output
    [note] = [line for line in tight.splitlines() if line.startswith("no answer: none feasible")]
    assert "raise the --slo limit" in note, note


def test_compare_says_why_a_row_has_no_data(tmp_path: Path) -> None:
    """`dvfs compare` wrote "-" and "no data" for a drafter whose baseline's reference cell is
    invalid, and no line said why or what to do: a `no data:` note names the rows and points
    to `dvfs cube info` for the flags and what to change."""
    stock = flagged_cube(
        tmp_path / "c.nc",
        lambda clock, limit, corpus: (clock, limit) == (1980, 700.0),
        drafters=["none", "eagle3"],
        flagged={"none"},
    )
    out = run("compare", str(stock)).output
    said = " ".join(out.split())
    assert "no data: in 2 of 2 rows no repeat at the reference is valid in both" in said, out
    assert "batch 1 eagle3 on code; batch 1 eagle3 on math" in said, out
    assert "flagged invalid: `dvfs cube info` names the flags" in said, out


def test_compare_no_data_note_agrees_with_the_paired_by_repeat_note(tmp_path: Path) -> None:
    """Both arms hold a valid cell at the reference, but never in the same repeat ('none'
    repeat 1, eagle3 repeat 0): the "no data:" note said "the drafter or 'none' has no valid
    cell at the reference", which is false and contradicted the "paired by repeat:" note
    under it (0 paired, 2 dropped); it says there is no repeat valid in both."""
    ds = make_cube(
        clocks=[1000, 1500, 1980],
        limits=[300.0, 700.0],
        drafters=["none", "eagle3"],
        repeats=2,
        energy=lambda clock, limit, *_: clock / 1000 + limit / 1000,
        valid=lambda c, p, b, drafter, corpus, r: r == (1 if drafter == "none" else 0),
    )
    quality = np.where(ds["valid"].values == 0, Q_FEW_COUNTER_UPDATES, 0).astype(float)
    ds["quality"] = (ds["valid"].dims, quality, {"units": "1", "long_name": "quality flags"})
    cube = write_cube(
        as_twin_sweep(
            ds, uuid="GPU-aaaaaaaa-0000-4000-8000-000000000001", gpu_name=H100, campaign="odd"
        ),
        tmp_path / "c.nc",
    )
    doc = json.loads(run("compare", str(cube), "--json").stdout)
    [row] = doc["rows"]
    assert row["verdict_at_stock"] == row["verdict_equal_latency"] == "no data", row
    assert (row["paired_repeats_at_stock"], row["dropped_repeats_at_stock"]) == (0, 2), row
    said = " ".join(run("compare", str(cube)).output.split())
    assert "paired by repeat: in 1 of 1 rows" in said, said
    assert "no valid cell" not in said, said
    assert "no data: in 1 of 1 rows no repeat at the reference is valid in both" in said, said


def test_compare_no_data_in_a_shards_cube_is_left_to_the_merge(tiny_exact_run) -> None:
    """In one shard's cube the other shard's rows have no data: the note said "not measured
    yet ...: resume the sweep", but resuming this shard measures none of them (another shard
    holds them); it says they are not measured here and leaves what measures them to the
    partial-cube note, which names the shards' commands and the merge."""
    said = " ".join(run("compare", str(tiny_exact_run("s0"))).output.split())
    note = said[said.index("no data: ") : said.index("grid edge: ")]
    assert "(batch 8 eagle3 on code)" in note, note
    assert "not measured here" in note and "resume" not in note, note
    assert "`dvfs cube merge SHARD_DIRS" in said, said


@pytest.mark.usefixtures("unsaved_figures")
def test_the_report_gives_a_row_without_an_answer_its_advice_once(tmp_path: Path) -> None:
    """The headroom table's `no answer:` note went into the report's Headroom section too,
    where the Findings below give the same rows the same reason and advice ("No valid
    reference cell (invalid: ...) at: ... What to do: ..."): the report said it twice, word
    for word. The findings keep it, the table's notes leave it to them."""
    cube = flagged_cube(tmp_path / "c.nc", lambda clock, limit, corpus: corpus == "math")
    report = tmp_path / "r.md"
    run("report", str(cube), "-o", str(report), "--slack", "5%")
    text = report.read_text(encoding="utf-8")
    headroom = text.split("## Headroom")[1].split("\n## ")[0]
    findings = text.split("## Findings")[1].split("\n## ")[0]
    advice = "then sweep again with --fresh or into another --out folder"
    assert "No answer" not in headroom and advice not in headroom, headroom
    assert "No valid reference cell (invalid: few\\_counter\\_updates) at: batch 1" in findings
    assert findings.count(advice) == 1, findings
    # the headroom table on the command line still gives it under the table
    assert (
        "no answer: no valid reference cell" in run("headroom", str(cube), "--slack", "5%").output
    )


@pytest.mark.usefixtures("unsaved_figures")
def test_the_report_gives_the_tables_reason_for_rows_never_measured(
    small_sweep: Path, tmp_path: Path
) -> None:
    out = partial_sweep(small_sweep, tmp_path / "out", lambda c: c["drafter"] == "eagle3")
    report = tmp_path / "p.md"
    run("report", str(out), "-o", str(report), "--slack", "5%")
    text = report.read_text(encoding="utf-8")
    findings = text.split("## Findings")[1].split("\n## ")[0]
    caps = text.split("Caps per batch and drafter")[1].split("To write the caps file")[0]
    eagle_findings = [line for line in findings.splitlines() if "eagle3" in line]
    assert eagle_findings and all("No measured setting meets" not in x for x in eagle_findings)
    assert any("No valid reference cell (not measured yet)" in x for x in eagle_findings)
    assert any("resume the sweep" in x for x in eagle_findings)
    eagle_caps = [line for line in caps.splitlines() if "| eagle3 |" in line]
    assert eagle_caps and all("no valid reference cell (not measured yet)" in x for x in eagle_caps)
    assert all("nothing meets the target" not in x and "--slack" not in x for x in eagle_caps)


def test_cap_plan_model_must_be_one_measured(tmp_path: Path) -> None:
    cube = flagged_cube(tmp_path / "c.nc", lambda *_: False)
    saved = tmp_path / "h.json"
    run("headroom", str(cube), "--slack", "5%", "--json", "-o", str(saved))
    args = ("cap", "plan", str(saved), "--batch", "1", "--drafter", "none", "--corpus", "code")
    refused = run(*args, "--model", "NVIDIA A100-SXM4-80GB", code=2).output
    assert refused.count("\n") == 1 and H100 in refused
    (cap,) = tomllib.loads(run(*args, "--model", H100).stdout)["model"]
    assert cap["name"] == H100


def test_merging_unfinished_shards_says_cells_are_missing(tiny_exact_run, tmp_path: Path) -> None:
    from conftest import copy_sweep

    # The session's two shards of TINY_EXACT; the second copied, as it loses cells below.
    shards = [tiny_exact_run("s0"), copy_sweep(tiny_exact_run("s1"), tmp_path / "s1")]
    whole = run("cube", "merge", *map(str, shards), "-o", str(tmp_path / "m.nc"))
    assert "not measured yet" not in whole.output
    # An interrupted shard: drop half its cells from the journal, as a stopped sweep leaves.
    from test_partial_cube import without_cells

    journal = shards[1] / "journal.jsonl"
    before = journal.read_text(encoding="utf-8").count('"type":"cell"')
    without_cells(journal, lambda c: c["sm_clock_mhz"] == 1005)
    assert 0 < journal.read_text(encoding="utf-8").count('"type":"cell"') < before
    merged = run(
        "cube", "merge", *(str(s / "journal.jsonl") for s in shards), "-o", str(tmp_path / "p.nc")
    )
    assert "(2 shards)" in merged.output
    note = merged.output.replace("\n", " ")
    assert note.count("not measured yet") == 1 and "resume" in note and "--shard" in note


def test_vs_baseline_says_the_missing_reference_is_the_baselines(tmp_path: Path) -> None:
    """--vs-baseline holds every drafter to the baseline's stock cell: when that one is
    invalid, another drafter's row (whose own stock cell is valid) says the cell is the
    baseline's, in the table, the JSON document and `cap plan`; the baseline's own row keeps
    the plain reason."""
    stock = flagged_cube(
        tmp_path / "c.nc",
        lambda clock, limit, corpus: (clock, limit) == (1980, 700.0),
        drafters=["none", "eagle3"],
        flagged={"none"},
    )
    theirs = "no valid reference cell (baseline none: invalid: few_counter_updates)"
    table = run("headroom", str(stock), "--vs-baseline").output
    cells = [line for line in table.splitlines() if line.startswith("│")]
    eagle = [line for line in cells if "eagle3" in line]
    plain = [line for line in cells if " none " in f" {line} "]
    assert len(eagle) == 2 and all(theirs in line for line in eagle), table
    mine = "no valid reference cell (invalid: few_counter_updates)"
    assert len(plain) == 2 and all(mine in line for line in plain), table
    saved = tmp_path / "h.json"
    run("headroom", str(stock), "--vs-baseline", "--json", "-o", str(saved))
    rows = json.loads(saved.read_text())["rows"]
    assert {r.get("reference_drafter") for r in rows if r["drafter"] == "eagle3"} == {"none"}
    assert all("reference_drafter" not in r for r in rows if r["drafter"] == "none")
    out = run("cap", "plan", str(saved), "--batch", "1", "--drafter", "eagle3", code=2).output
    assert theirs in out and "workload.output_tokens" in out, out
    # The headroom figure writes the same reason in its cells.
    from dvfs.analysis.headroom import headroom
    from dvfs.analysis.targets import Target
    from dvfs.cube import open_cube
    from dvfs.plots import heatmaps

    order = ("corpus", "drafter", "batch")
    result = headroom(open_cube(stock), target=Target("vs-baseline"))
    labels = heatmaps._no_answer_labels(result, order)
    at = {str(d): i for i, d in enumerate(result["drafter"].values)}
    # (wrapped to four lines in the cell, so cut short)
    assert " ".join(labels[0, at["eagle3"], 0].split()).startswith(theirs[:38]), labels
    assert "baseline" not in labels[0, at["none"], 0]


def test_a_drafter_whose_every_cell_failed_says_failed_not_only_not_measured(
    tmp_path: Path,
) -> None:
    """Against an SLO (no reference needed) a drafter whose server failed at every setting has
    no answer: the table, the JSON document, `cap plan` and the headroom figure say its cells
    failed and that a rerun retries them, as a failed reference's row says, not only "not
    measured yet" of cells that were run; a drafter never run keeps the plain reason."""
    ds = make_cube(
        clocks=[1000, 1980],
        drafters=["none", "eagle3", "medusa"],
        repeats=2,
        latency=lambda clock, limit, batch, drafter, *_: np.nan if drafter != "none" else 10.0,
    )
    ds["cell_status"].loc[{"drafter": "eagle3"}] = 2  # failed; medusa's stay missing (0)
    cube = write_cube(
        as_twin_sweep(
            ds, uuid="GPU-aaaaaaaa-0000-4000-8000-000000000001", gpu_name=H100, campaign="failed"
        ),
        tmp_path / "c.nc",
    )
    slo = ("--slo", "tpot_p50<=20ms")
    table = run("headroom", str(cube), *slo).output
    [eagle] = [line for line in table.splitlines() if "eagle3" in line]
    [medusa] = [line for line in table.splitlines() if "medusa" in line]
    assert "not measured yet (failed)" in eagle, table
    assert "not measured yet" in medusa and "failed" not in medusa, table
    saved = tmp_path / "h.json"
    run("headroom", str(cube), *slo, "--json", "-o", str(saved))
    rows = {r["drafter"]: r for r in json.loads(saved.read_text())["rows"]}
    assert (rows["eagle3"]["failed_settings"], rows["eagle3"]["unmeasured_settings"]) == (2, 2)
    assert (rows["medusa"]["failed_settings"], rows["medusa"]["unmeasured_settings"]) == (0, 2)
    out = run("cap", "plan", str(saved), "--batch", "1", "--drafter", "eagle3", code=2).output
    assert "not measured yet (failed)" in out and "retries failed cells" in out, out
    # (its sweep's command with --fresh would move the journal aside and measure every cell)
    assert "again without --fresh (which starts over): it retries" in " ".join(out.split()), out
    from dvfs.analysis.headroom import headroom
    from dvfs.analysis.targets import parse_slo
    from dvfs.cube import open_cube
    from dvfs.plots import heatmaps

    order = ("corpus", "drafter", "batch")
    result = headroom(open_cube(cube), target=parse_slo("tpot_p50<=20ms"))
    labels = heatmaps._no_answer_labels(result, order)
    at = {str(d): i for i, d in enumerate(result["drafter"].values)}
    assert " ".join(labels[0, at["eagle3"], 0].split()) == "not measured yet (failed)", labels
