"""`measurement.inflight_order`: validated, in the hash (in-flight campaigns only), recorded in
the cube, and the order the in-flight decodes actually use."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_inflight import INFLIGHT_CAMPAIGN

from dvfs.campaign import load_campaign
from dvfs.campaign.model import measured_differences, measured_part
from dvfs.cli import cli
from dvfs.cube import open_cube
from dvfs.measure.counter import relative_half_width
from dvfs.measure.journal import read_records


def _campaign(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def with_order(order: str, text: str = INFLIGHT_CAMPAIGN) -> str:
    return text.replace('mode = "in-flight"\n', f'mode = "in-flight"\ninflight_order = "{order}"\n')


def test_a_bad_order_is_refused_in_one_line(tmp_path: Path) -> None:
    path = _campaign(tmp_path, with_order("zigzag"))
    result = CliRunner().invoke(cli, ["sweep", str(path), "--dry-run"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "inflight_order" in lines[0] and "abba, serpentine" in lines[0]
    assert "Traceback" not in result.output


def test_the_order_is_in_the_hash_of_an_inflight_campaign_only(tmp_path: Path) -> None:
    default = load_campaign(_campaign(tmp_path, INFLIGHT_CAMPAIGN, "a.toml"))
    abba = load_campaign(_campaign(tmp_path, with_order("abba"), "b.toml"))
    serpentine = load_campaign(_campaign(tmp_path, with_order("serpentine"), "c.toml"))
    assert default.measurement.inflight_order == "abba"
    assert serpentine.measurement.inflight_order == "serpentine"
    assert default.hash == abba.hash != serpentine.hash
    # "abba" hashes (and compares with journals) as campaigns did before the key existed
    before = asdict(default)
    del before["measurement"]["inflight_order"]
    assert measured_part(before) == default.semantic_dict()
    assert measured_differences(before, asdict(serpentine)) == [
        "measurement.inflight_order: '(unset)' -> 'serpentine'"
    ]
    per_level = INFLIGHT_CAMPAIGN.replace('mode = "in-flight"\n', "")
    plain = load_campaign(_campaign(tmp_path, per_level, "d.toml"))
    ordered = load_campaign(
        _campaign(tmp_path, per_level + 'inflight_order = "serpentine"\n', "e.toml")
    )
    assert plain.hash == ordered.hash  # changes nothing a per-level campaign measures


def test_a_serpentine_sweep_steps_in_that_order_and_the_cube_says_so(tmp_path: Path) -> None:
    path = _campaign(tmp_path, with_order("serpentine"))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    cells = [r for r in read_records(out / "journal.jsonl") if r.get("type") == "cell"]
    assert cells and {c["inflight"]["scheme"] for c in cells} == {"serpentine"}
    # a serpentine visits each level once per decode, reversed on the next one
    segments = cells[0]["inflight"]["segments"]
    positions = {(s["round"], s["position"]) for s in segments}
    assert positions and all(p < 3 for _, p in positions)
    with open_cube(out / "cube.nc") as ds:
        assert json.loads(ds.attrs["campaign"])["measurement"]["inflight_order"] == "serpentine"
        cube_ci = sorted(float(v) for v in np.ravel(ds["energy_per_token_rel_ci"].values))
    # Each level's interval is a per-level cell's (two-sided Student-t) over the means of its
    # pairs of decodes (a serpentine cancels a drift over a pair), and the cube holds it.
    confidence = load_campaign(path).measurement.confidence
    expected = []
    for cell in cells:
        pairs: dict[int, list[float]] = {}
        for s in cell["inflight"]["segments"]:
            pairs.setdefault(s["round"] // 2, []).append(s["energy_per_token_j"])
        means = [float(np.mean(v)) for _, v in sorted(pairs.items())]
        assert len(means) >= 2
        expected.append(relative_half_width(means, confidence))
    assert cube_ci == pytest.approx(sorted(expected), rel=1e-9)
