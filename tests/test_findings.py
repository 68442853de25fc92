"""The README's findings on the twin, as properties of one twin sweep with the shipped H100
profile (NVML's traps on), read through the CLI's JSON like a user would: if the physics stops
showing one of them, this fails and the README's "Findings on the twin" is wrong."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SMALL_EXACT, made_once, replace_block, write

from dvfs.cli import cli
from dvfs.cube.files import open_cube

DEMO = (Path(__file__).resolve().parents[1] / "dvfs" / "campaigns" / "demo.toml").read_text()

#: The demo campaign (its model, drafters and measurement) on fewer clocks, one power limit,
#: three batches and four corpora (360 cells): enough for every finding, a few seconds of CPU.
FINDINGS_CAMPAIGN = replace_block(
    replace_block(
        replace_block(
            replace_block(
                DEMO,
                "sm_clock = { start = 705, stop = 1980, step = 75 }",
                "sm_clock = [1980, 1830, 1680, 1530, 1380, 1230]",
            ),
            "power_limit = [700, 400]",
            "power_limit = [700]",
        ),
        "batch = [1, 4, 16, 32, 64]",
        "batch = [1, 16, 64]",
    ),
    'corpora = ["code", "conversation", "english", "math", "romansh"]',
    'corpora = ["code", "conversation", "english", "romansh"]',
)

SPECULATIVE = ("eagle3", "standalone", "ngram", "dflash")
TRAINED = ("eagle3", "standalone", "dflash")
BATCHES = (1, 16, 64)


def _cli(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def _make_findings(base: Path) -> None:
    """The campaign swept into `base`/out, and its compare and headroom JSON beside it."""
    out = base / "out"
    _cli("sweep", str(write(base / "findings.toml", FINDINGS_CAMPAIGN)), "--out", str(out),
         "--no-progress")  # fmt: skip
    (base / "compare.json").write_text(_cli("compare", str(out), "--json"))
    (base / "headroom.json").write_text(_cli("headroom", str(out), "--slack", "5%", "--json"))


@pytest.fixture(scope="module")
def findings(tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    """The campaign's cube, compare and headroom documents; the files are made once per
    session (`made_once`: the xdist workers share them), read-only."""
    base = made_once(tmp_path_factory, "findings", _make_findings)
    compare = json.loads((base / "compare.json").read_text())
    headroom = json.loads((base / "headroom.json").read_text())
    return {"cube": open_cube(base / "out" / "cube.nc"), "compare": compare, "headroom": headroom}


def _ratio(doc: dict, drafter: str, batch: int, corpus: str) -> float:  # type: ignore[type-arg]
    (row,) = [
        r
        for r in doc["rows"]
        if (r["drafter"], r["batch"], r["corpus"]) == (drafter, batch, corpus)
    ]
    return float(row["energy_ratio_at_stock"])


def test_verification_not_drafting_takes_most_of_speculations_energy(findings) -> None:  # type: ignore[no-untyped-def]
    stock = findings["cube"].sel(sm_clock=1980, power_limit=700.0, repeat=0)
    for drafter in SPECULATIVE:
        cells = stock.sel(drafter=drafter)
        assert (cells["energy_split_method"] == 1).all()  # the twin's exact split
        draft, verify = cells["energy_draft_j"].values, cells["energy_verify_j"].values
        assert np.all(verify > draft), drafter


def test_batching_lowers_the_energy_of_a_token_without_speculation(findings) -> None:  # type: ignore[no-untyped-def]
    none = findings["cube"]["energy_per_token_j"].sel(
        sm_clock=1980, power_limit=700.0, drafter="none", repeat=0
    )
    for corpus in none["corpus"].values:
        energy = none.sel(corpus=corpus).sel(batch=list(BATCHES)).values
        assert np.all(np.diff(energy) < 0), corpus


def test_speculations_saving_shrinks_as_the_batch_grows(findings) -> None:  # type: ignore[no-untyped-def]
    doc = findings["compare"]
    for drafter in ("eagle3", "dflash"):
        for corpus in ("code", "conversation", "english"):
            ratios = [_ratio(doc, drafter, b, corpus) for b in BATCHES]
            assert ratios[0] < ratios[1] < ratios[2], (drafter, corpus, ratios)
            assert ratios[0] < 0.5  # a large saving at batch 1


def test_the_block_drafter_at_batch_64_is_past_the_ridge_and_costs_more(findings) -> None:  # type: ignore[no-untyped-def]
    doc = findings["compare"]
    (verify,) = [
        v for v in doc["roofline"]["verify"] if (v["drafter"], v["batch"]) == ("dflash", 64)
    ]
    assert verify["compute_bound_below_mhz"] == 1980  # past the ridge at every clock
    assert verify["arithmetic_intensity"] > max(doc["roofline"]["ridge_point"].values())
    for corpus in ("code", "conversation", "english"):
        assert _ratio(doc, "dflash", 64, corpus) > 1.0, corpus


def test_a_drafter_accepted_less_spends_more_per_token(findings) -> None:  # type: ignore[no-untyped-def]
    doc = findings["compare"]
    accept = {(a["drafter"], a["corpus"]): a["accept_length"] for a in doc["acceptance"]}
    for batch in BATCHES:
        assert accept["eagle3", "romansh"] < accept["eagle3", "code"]
        assert _ratio(doc, "eagle3", batch, "romansh") > _ratio(doc, "eagle3", batch, "code")
    # n-gram, accepted least of the drafters on code, costs more than none at batch 64
    assert accept["ngram", "code"] == min(accept[d, "code"] for d in SPECULATIVE)
    assert _ratio(doc, "ngram", 64, "code") > 1.0


def test_acceptance_follows_the_text(findings) -> None:  # type: ignore[no-untyped-def]
    accept = {
        (a["drafter"], a["corpus"]): a["accept_length"] for a in findings["compare"]["acceptance"]
    }
    for drafter in SPECULATIVE:
        assert accept[drafter, "conversation"] < accept[drafter, "code"], drafter
    for drafter in TRAINED:
        assert accept[drafter, "romansh"] < accept[drafter, "english"], drafter


def test_little_dvfs_headroom_with_speculation_at_large_batch(findings) -> None:  # type: ignore[no-untyped-def]
    rows = {
        (r["drafter"], r["batch"], r["corpus"]): r
        for r in findings["headroom"]["rows"]
        if r["feasible"]
    }
    for corpus in ("code", "conversation"):
        none = rows["none", 64, corpus]["headroom_mhz"]
        assert none >= 300, corpus  # memory-bound decode: the clock can drop
        for drafter in ("eagle3", "dflash"):
            spec = rows[drafter, 64, corpus]
            assert spec["headroom_mhz"] <= none / 2, (drafter, corpus)
            assert spec["headroom_mhz"] < rows[drafter, 1, corpus]["headroom_mhz"]
            assert spec["saving"] < rows["none", 64, corpus]["saving"] / 2


def test_energy_alike_in_every_group_is_said_once_not_as_a_range() -> None:
    """Energy per token at stock equal in every group was said as a range from one row to the
    same row ('ranges from 2.68 J (batch 1, none, code) to 2.68 J (batch 1, none, code)')."""
    from cubes import make_cube

    from dvfs.analysis.headroom import headroom
    from dvfs.analysis.targets import Target
    from dvfs.report.findings import energy_finding
    from dvfs.report.headroom import headroom_document

    cube = make_cube(clocks=[1500, 1980], batches=[1, 8], energy=lambda *a: 2.68)
    document = headroom_document(headroom(cube, target=Target(slack=0.05)), cube)
    said = energy_finding(document, ()).headline
    assert "energy per token is 2.68 J in all 2 (batch, drafter, corpus) groups." in said
    assert "ranges" not in said


def test_an_answer_with_no_stock_energy_is_a_saving_unknown_not_none() -> None:
    """With --slo, stock measured in three repeats of which one is usable has no stock energy
    (it needs two), yet 1500 MHz meets the limit: the findings said "0 of 1 ... groups save
    energy" with nothing more, and "No cell at stock was measured", which it was."""
    from cubes import one_usable_stock_repeat_cube

    from dvfs.analysis.headroom import headroom
    from dvfs.analysis.targets import parse_slo
    from dvfs.report.findings import energy_finding, headroom_finding
    from dvfs.report.headroom import headroom_document

    cube = one_usable_stock_repeat_cube()
    document = headroom_document(headroom(cube, target=parse_slo("tpot_p50<=16ms")), cube)
    assert document["rows"][0]["feasible"] and document["rows"][0]["saving"] is None
    found = headroom_finding(document, ())
    assert found.headline.endswith("; 1 other group meets it with the saving unknown."), (
        found.headline
    )
    assert any("its saving is unknown" in d for d in found.details), found.details
    said = energy_finding(document, ()).headline
    assert "was measured" not in said and "none of its cells is usable" in said, said


#: SMALL_EXACT at one SM clock and one power limit: nothing swept.
NOTHING_SWEPT = replace_block(
    replace_block(
        SMALL_EXACT,
        "sm_clock = [1980, 1500, 1005]\npower_limit = [700, 300]",
        "sm_clock = [1980]\npower_limit = [700]",
    ),
    'name = "small"',
    'name = "flat"',
)


@pytest.mark.usefixtures("unsaved_figures")
def test_a_report_of_a_cube_with_nothing_swept_says_so(
    shared_run: Callable[..., Path], tmp_path: Path
) -> None:
    """A cube of one SM clock and one power limit measures no setting below stock: the
    report's headroom finding said "0 of 8 (batch, drafter, corpus) groups save energy",
    which reads as a finding that none saves; it says nothing was swept."""
    out = shared_run(NOTHING_SWEPT, "one")
    report = tmp_path / "r.md"
    result = CliRunner().invoke(cli, ["report", str(out), "-o", str(report)])
    assert result.exit_code == 0, result.output
    text = " ".join(report.read_text(encoding="utf-8").replace("\\_", "_").split())
    assert "Nothing was swept (the cube has one SM clock and one power limit)" in text, text
    assert "groups save energy" not in text
