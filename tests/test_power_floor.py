"""A power-limit headroom found at the GPU's lowest allowed power limit is the GPU's answer, not
one the grid cut off: no `≥`, no "extend knobs.power_limit downward" (a lower limit is refused
by the sweep), no `grid_edge` in a caps file; end to end through the CLI on a twin campaign
whose grid goes down to the H100's 200 W floor, and on a merged cube of it and its H200 twin.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from conftest import SMALL_EXACT, replace_block

from dvfs.cli import cli
from dvfs.cube import open_analysable, write_cube

#: SMALL_EXACT (the exact twin) stepping the power limit alone down to 200 W, the lowest an
#: H100 (and an H200) allows: batch 1 decode stays within the target there at a generous slack.
FLOOR = replace_block(
    replace_block(
        replace_block(
            replace_block(SMALL_EXACT, 'name = "small"', 'name = "floor"'),
            "sm_clock = [1980, 1500, 1005]\npower_limit = [700, 300]",
            "power_limit = [700, 200]",
        ),
        "batch = [1, 8]",
        "batch = [1]",
    ),
    'corpora = ["code", "conversation"]',
    'corpora = ["code"]',
)
FLOOR_H200 = replace_block(FLOOR, 'profile = "h100-sxm:none"', 'profile = "h200-sxm:none"')

EXTEND = "extend knobs.power_limit downward"


def run(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def _assert_at_floor_not_an_edge(rows: list[dict[str, Any]]) -> None:
    assert rows
    for row in rows:
        assert row["lowest_feasible"]["power_limit_w"] == 200, row
        assert row["headroom_w"] == 500
        assert not row["headroom_w_is_lower_bound"], row
        assert not row["at_grid_edge"] and not row["chosen_at_grid_edge"], row


def test_a_headroom_at_the_gpus_lowest_power_limit_is_no_grid_edge(
    shared_run: Callable[..., Path], tmp_path: Path
) -> None:
    out = shared_run(FLOOR, "one")
    doc = json.loads(run("headroom", str(out), "--slack", "60%", "--json").output)
    _assert_at_floor_not_an_edge(doc["rows"])
    table = run("headroom", str(out), "--slack", "60%").output
    assert "/500" in table and "≥500" not in table and EXTEND not in table

    saved = tmp_path / "headroom.json"
    run("headroom", str(out), "--slack", "60%", "--json", "-o", str(saved))
    plan = run("cap", "plan", str(saved), "--batch", "1", "--drafter", "none")
    assert "power_limit_w = 200" in plan.stdout
    assert "grid_edge" not in plan.stdout and "lower cap" not in plan.stderr
    assert "grid edge" not in run("compare", str(out)).output

    # The same cells from a GPU that allows less than 200 W: now the grid cut it off.
    cube = open_analysable(out).load()
    lower = write_cube(
        cube.assign_attrs(power_limit_range_w=[100.0, 700.0, 700.0]), tmp_path / "lower.nc"
    )
    doc = json.loads(run("headroom", str(lower), "--slack", "60%", "--json").output)
    assert all(row["headroom_w_is_lower_bound"] for row in doc["rows"])
    assert EXTEND in run("headroom", str(lower), "--slack", "60%").output


@pytest.mark.usefixtures("unsaved_figures")
def test_each_gpu_of_a_merged_cube_has_its_own_power_floor(
    shared_run: Callable[..., Path], tmp_path: Path
) -> None:
    h100, h200 = shared_run(FLOOR, "one"), shared_run(FLOOR_H200, "one")
    merged = tmp_path / "merged.nc"
    run("cube", "merge", str(h100), str(h200), "-o", str(merged))
    doc = json.loads(run("headroom", str(merged), "--slack", "60%", "--json").output)
    _assert_at_floor_not_an_edge(doc["rows"])
    assert {row["gpu"] for row in doc["rows"]} == set(doc["gpu"]["uuids"])
    assert EXTEND not in run("headroom", str(merged), "--slack", "60%").output
    # speculation's setting at equal latency is at 200 W too: no grid edge there either
    assert "grid edge" not in run("compare", str(merged)).output


#: FLOOR stepping the SM clock alone, down to 210 MHz, the lowest an H100 (and an H200) lists.
CLOCK_FLOOR = replace_block(
    replace_block(FLOOR, "power_limit = [700, 200]", "sm_clock = [1980, 210]"),
    'name = "floor"',
    'name = "clock-floor"',
)
#: CLOCK_FLOOR down to 345 MHz, the lowest an H200 lists (an H100 lists lower), on each.
AT_345 = replace_block(CLOCK_FLOOR, "sm_clock = [1980, 210]", "sm_clock = [1980, 345]")
AT_345_H200 = replace_block(AT_345, 'profile = "h100-sxm:none"', 'profile = "h200-sxm:none"')
EXTEND_CLOCK = "extend knobs.sm_clock downward"


def _assert_at_clock_floor_not_an_edge(rows: list[dict[str, Any]]) -> None:
    assert rows
    for row in rows:
        lowest = row["lowest_feasible"]["sm_clock_mhz"]
        assert lowest in (210, 345), row  # the H100's lowest listed clock, the H200's
        assert row["headroom_mhz"] == 1980 - lowest
        assert not row["headroom_mhz_is_lower_bound"], row


def test_a_headroom_at_the_gpus_lowest_sm_clock_is_no_grid_edge(
    shared_run: Callable[..., Path], tmp_path: Path
) -> None:
    """The clock's floor as the power limit's: the lowest SM clock the GPU lists (the cube's
    `sm_clock_range_mhz`, as its sweep read it) is as low as a sweep goes, so a headroom
    found there is exact; with a cube that records none (an earlier dvfs's) or a GPU that
    lists lower clocks, or a recorded floor above the grid's lowest clock (none of this grid),
    it stays a lower bound the grid cut off."""
    out = shared_run(CLOCK_FLOOR, "one")
    cube = open_analysable(out).load()
    assert [float(c) for c in cube.attrs["sm_clock_range_mhz"]] == [210.0, 1980.0]
    doc = json.loads(run("headroom", str(out), "--slack", "900%", "--json").output)
    _assert_at_clock_floor_not_an_edge(doc["rows"])
    table = run("headroom", str(out), "--slack", "900%").output
    assert "1770/" in table and "≥1770" not in table and EXTEND_CLOCK not in table

    for name, attrs in (
        ("older", {}),
        ("lower", {"sm_clock_range_mhz": [105.0, 1980.0]}),
        ("above the grid", {"sm_clock_range_mhz": [400.0, 1980.0]}),  # no floor of this grid
    ):
        edited = cube.copy()
        edited.attrs.pop("sm_clock_range_mhz")
        path = write_cube(edited.assign_attrs(attrs), tmp_path / f"{name.split()[0]}.nc")
        doc = json.loads(run("headroom", str(path), "--slack", "900%", "--json").output)
        assert all(row["headroom_mhz_is_lower_bound"] for row in doc["rows"]), name
        assert EXTEND_CLOCK in run("headroom", str(path), "--slack", "900%").output


@pytest.mark.usefixtures("unsaved_figures")
def test_each_gpu_of_a_merged_cube_has_its_own_clock_floor(
    shared_run: Callable[..., Path], tmp_path: Path
) -> None:
    """One campaign down to 345 MHz on an H100 and an H200, merged: the H200's headroom there
    is at its lowest clock (exact), the H100's is not (it lists lower clocks: a lower bound),
    each GPU judged by its own range, not the merged cube's top level (which keeps none)."""
    h100, h200 = shared_run(AT_345, "one"), shared_run(AT_345_H200, "one")
    merged = tmp_path / "merged.nc"
    run("cube", "merge", str(h100), str(h200), "-o", str(merged))
    doc = json.loads(run("headroom", str(merged), "--slack", "900%", "--json").output)
    models = json.loads(open_analysable(merged).attrs["gpu_names"])
    names = dict(zip(doc["gpu"]["uuids"], models, strict=True))
    bound = {names[row["gpu"]]: row["headroom_mhz_is_lower_bound"] for row in doc["rows"]}
    assert all(row["lowest_feasible"]["sm_clock_mhz"] == 345 for row in doc["rows"]), doc
    assert bound == {"NVIDIA H100 80GB HBM3 (twin)": True, "NVIDIA H200 (twin)": False}, bound


def test_a_floor_above_the_grids_lowest_limit_is_not_this_grids(
    small_sweep: Path, tmp_path: Path
) -> None:
    """A power-limit range the grid went below (no sweep measures below the GPU's floor) is
    not this grid's GPU's: one written in mW (200000 for the H100's 200 W) took every limit of
    the grid for the floor, and a headroom at the grid's 300 W (the H100 allows 200 W) lost
    its `≥` and the advice to extend the grid downward. Only a limit at the floor is it."""
    cube = open_analysable(small_sweep).load()
    assert list(cube.attrs["power_limit_range_w"]) == [200.0, 700.0, 700.0]
    args = ("--slack", "60%", "--knob", "power_limit")
    doc = json.loads(run("headroom", str(small_sweep), *args, "--json").output)
    edges = [row["headroom_w_is_lower_bound"] for row in doc["rows"]]
    assert any(edges) and all(r["lowest_feasible"]["power_limit_w"] == 300 for r in doc["rows"])
    in_mw = write_cube(
        cube.assign_attrs(power_limit_range_w=[200000.0, 700000.0, 700000.0]), tmp_path / "mw.nc"
    )
    doc = json.loads(run("headroom", str(in_mw), *args, "--json").output)
    assert [row["headroom_w_is_lower_bound"] for row in doc["rows"]] == edges
    assert EXTEND in run("headroom", str(in_mw), *args).output


def _edge_note(out: Path) -> str:
    notes = [line for line in run("compare", str(out)).output.splitlines() if "grid edge:" in line]
    assert len(notes) == 1, notes
    return notes[0]


def test_compare_names_only_the_knob_the_grid_cut_off(
    small_sweep: Path, shared_run: Callable[..., Path], tmp_path: Path
) -> None:
    """`dvfs compare`'s grid-edge note says to extend only the knob a setting at equal latency
    is at the lowest swept value of, above the GPU's floor: the small sweep's drafter is at the
    lowest clock (1005 MHz) but at 700 W, not its lowest limit; FLOOR's is at the lowest limit
    (200 W), which is no edge on an H100 (its floor) but is on a GPU that allows 100 W. It said
    "extend knobs.sm_clock or knobs.power_limit downward" for each."""
    note = _edge_note(small_sweep)
    assert note.endswith("extend knobs.sm_clock downward to find it"), note
    assert "power_limit" not in note
    doc = json.loads(run("compare", str(small_sweep), "--json").output)
    edge = [r for r in doc["rows"] if r["equal_latency_drafter_at_grid_edge"]]
    assert edge and all(r["equal_latency_sm_clock_at_grid_edge"] for r in edge)
    assert not any(r["equal_latency_power_limit_at_grid_edge"] for r in doc["rows"])

    out = shared_run(FLOOR, "one")
    assert "grid edge" not in run("compare", str(out)).output
    lower = write_cube(
        open_analysable(out).load().assign_attrs(power_limit_range_w=[100.0, 700.0, 700.0]),
        tmp_path / "lower.nc",
    )
    note = _edge_note(lower)
    assert note.endswith("extend knobs.power_limit downward to find it"), note
    assert "sm_clock" not in note
