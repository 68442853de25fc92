"""What the answers admit: a headroom cut off by the grid, a knob never swept, a reference that
is not stock, and two arms measured on different GPUs; end to end through the CLI on twin
campaigns whose clock grid (1800-1005 MHz) lacks the stock 1980 MHz and has one power limit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SMALL_EXACT, replace_block
from cubes import make_cube
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.analysis.headroom import headroom
from dvfs.analysis.targets import Target
from dvfs.cli import cli
from dvfs.cube import open_analysable, write_cube

#: SMALL_EXACT (the exact twin: 0.2-s windows, exact energy) on a clock grid without stock
#: 1980 MHz, the power limit left stock, one batch and one corpus.
EDGE = replace_block(
    replace_block(
        replace_block(
            replace_block(SMALL_EXACT, 'name = "small"', 'name = "edge"'),
            "sm_clock = [1980, 1500, 1005]\npower_limit = [700, 300]",
            "sm_clock = [1800, 1500, 1200, 1005]",
        ),
        "batch = [1, 8]",
        "batch = [1]",
    ),
    'corpora = ["code", "conversation"]',
    'corpora = ["code"]',
)

#: The reference every command must name for EDGE: its grid's top clock (stock 1980 MHz not
#: swept) at its stock power limit.
TOP_OF_GRID = "1800 MHz (top of the grid; stock 1980 MHz not swept) / 700 W (stock)"


def run(*args: str) -> CliRunner:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture
def one_gpu(shared_run) -> Path:  # type: ignore[no-untyped-def]
    return shared_run(EDGE, "one")


@pytest.fixture
def two_gpus(shared_run) -> Path:  # type: ignore[no-untyped-def]
    return shared_run(EDGE, "two", "--gpus", "0,1")


def test_headroom_at_the_bottom_of_the_grid_is_a_lower_bound(one_gpu: Path) -> None:
    doc = json.loads(run("headroom", str(one_gpu), "--slack", "60%", "--json").output)
    assert doc["swept"] == {"sm_clock": True, "power_limit": False}
    for row in doc["rows"]:
        # Decode on the twin is memory-bound: 60% slack reaches the grid's lowest clock.
        assert row["lowest_feasible"]["sm_clock_mhz"] == 1005, row
        assert row["headroom_mhz"] == 1800 - 1005
        assert row["headroom_mhz_is_lower_bound"] and row["at_grid_edge"]
        assert row["chosen_at_grid_edge"] == (row["chosen"]["sm_clock_mhz"] == 1005)
        # One power limit: its headroom was never measured, so it is unknown, not 0.
        assert row["headroom_w"] is None and row["chosen_headroom_w"] is None
        assert not row["headroom_w_is_lower_bound"]
    table = run("headroom", str(one_gpu), "--slack", "60%").output
    assert "≥795/not swept" in table
    assert "extend knobs.sm_clock downward" in table
    assert "not swept: the cube has one power limit" in table
    markdown = run("headroom", str(one_gpu), "--slack", "60%", "--markdown").output
    assert "≥795/not swept" in markdown and "extend knobs.sm_clock downward" in markdown

    # Without slack, a lower clock is measured and misses the target: the answer is exact.
    exact = json.loads(run("headroom", str(one_gpu), "--json").output)
    for row in exact["rows"]:
        assert row["feasible"] and row["lowest_feasible"]["sm_clock_mhz"] > 1005
        assert not row["at_grid_edge"] and not row["chosen_at_grid_edge"]
    assert "≥" not in run("headroom", str(one_gpu)).output


def test_a_cap_planned_at_the_grid_edge_says_so(one_gpu: Path, tmp_path: Path) -> None:
    saved = tmp_path / "headroom.json"
    run("headroom", str(one_gpu), "--slack", "60%", "--json", "-o", str(saved))
    doc = json.loads(saved.read_text())
    edge_drafters = [r["drafter"] for r in doc["rows"] if r["chosen_at_grid_edge"]]
    assert edge_drafters, "the twin's least-energy setting at 60% slack is 1005 MHz"
    result = run("cap", "plan", str(saved), "--batch", "1", "--drafter", edge_drafters[0])
    assert 'grid_edge = "the chosen setting is the lowest the campaign swept' in result.stdout
    assert "a lower cap might save more energy" in result.stderr
    per_batch = run("cap", "plan", str(saved), "--per-batch", "--drafter", edge_drafters[0])
    assert 'grid_edge = "batch 1: the chosen setting is the lowest' in per_batch.stdout

    exact = tmp_path / "exact.json"
    run("headroom", str(one_gpu), "--slack", "10%", "--json", "-o", str(exact))
    rows = json.loads(exact.read_text())["rows"]
    inner = [r for r in rows if r["chosen"]["sm_clock_mhz"] not in (None, 1005, 1800)]
    for r in inner:  # a cap inside the grid is an optimum of the grid: no note
        plan = run("cap", "plan", str(exact), "--batch", "1", "--drafter", r["drafter"])
        assert "grid_edge" not in plan.stdout and "lower cap" not in plan.stderr


@pytest.mark.usefixtures("unsaved_figures")
def test_every_command_names_the_same_reference(one_gpu: Path, tmp_path: Path) -> None:
    room = json.loads(run("headroom", str(one_gpu), "--json").output)
    assert room["reference"]["description"] == TOP_OF_GRID
    assert room["reference"]["stock_sm_clock_mhz"] == 1980 and not room["reference"]["is_stock"]
    assert "top-of-grid" in room["target"]["description"]
    table = run("headroom", str(one_gpu)).output
    assert f"reference: {TOP_OF_GRID}" in table and "J/tok ref." in table
    assert "J/tok stock" not in table

    cmp = json.loads(run("compare", str(one_gpu), "--json").output)
    assert cmp["reference"]["description"] == TOP_OF_GRID
    compared = run("compare", str(one_gpu)).output
    assert "at reference clock" in compared and "at stock clock" not in compared
    assert f"equal clock: both at the reference, {TOP_OF_GRID}" in compared

    info = run("cube", "info", str(one_gpu)).output
    assert TOP_OF_GRID in info and "1980 MHz;" not in info

    report = tmp_path / "report.md"
    run("report", str(one_gpu), "--slack", "60%", "-o", str(report))
    text = report.read_text()
    assert text.count(TOP_OF_GRID) >= 3  # what was measured, headroom, speculation
    assert "Reference (stock)" not in text and "≥795" in text
    assert "lowest swept: a lower one might save more" in text


OTHER_GPU = "GPU-00000000-0000-4000-8000-000000000002"


def _moved(one_gpu: Path, tmp_path: Path, drafter: str) -> Path:
    """The one-GPU cube with `drafter`'s cells relabelled as measured on another GPU: what a
    fleet that hands each drafter's server its own GPU produces."""
    cube = open_analysable(one_gpu).load()
    on = cube["measured_on"].copy()
    on.loc[{"drafter": drafter}] = OTHER_GPU
    path = tmp_path / "moved.nc"
    write_cube(cube.assign_coords(measured_on=on), path)
    return path


@pytest.mark.usefixtures("unsaved_figures")
def test_arms_on_different_gpus_are_said_to_be(one_gpu: Path, tmp_path: Path) -> None:
    moved = _moved(one_gpu, tmp_path, "eagle3")
    (row,) = json.loads(run("compare", str(moved), "--json").output)["rows"]
    assert row["different_gpus"] is True and row["measured_on"] == [OTHER_GPU]
    lines = [
        line
        for line in run("compare", str(moved)).output.splitlines()
        if line.startswith("different GPUs:")
    ]
    assert len(lines) == 1 and "eagle3 on code: GPU-00000000 vs GPU-" in lines[0]

    # Against its own reference each drafter stayed on its GPU; against the baseline it did not.
    own = json.loads(run("headroom", str(moved), "--json").output)
    assert not any(r["different_gpus"] for r in own["rows"])
    args = ("headroom", str(moved), "--vs-baseline", "--slack", "50%")
    vs = json.loads(run(*args, "--json").output)
    assert {r["drafter"]: r["different_gpus"] for r in vs["rows"]} == {
        "none": False,
        "eagle3": True,
    }
    assert "different GPUs: 1 of 2 rows" in run(*args).output
    report = tmp_path / "report.md"
    run("report", str(moved), "-o", str(report))
    assert report.read_text().count("Different GPUs:") == 1  # the speculation section

    # Both arms on one GPU: nothing to say.
    single = json.loads(run("compare", str(one_gpu), "--json").output)
    assert not any(r["different_gpus"] for r in single["rows"])
    assert "different GPUs" not in run("compare", str(one_gpu)).output


def test_a_fleet_run_is_judged_by_where_each_cell_ran(two_gpus: Path) -> None:
    """Whatever the fleet's queue did with the two drafters, compare flags the row exactly
    when the arms' GPUs differ, and headroom whenever a drafter's reference cells ran on GPUs
    other than those of its chosen setting."""
    cube = open_analysable(two_gpus)
    on = cube["measured_on"]
    arms = {d: set(on.sel(drafter=d).values.ravel()) for d in ("none", "eagle3")}
    (row,) = json.loads(run("compare", str(two_gpus), "--json").output)["rows"]
    assert row["different_gpus"] == (arms["none"] != arms["eagle3"])
    assert ("different GPUs:" in run("compare", str(two_gpus)).output) == row["different_gpus"]
    room = json.loads(run("headroom", str(two_gpus), "--json").output)
    for r in room["rows"]:
        chosen = on.sel(
            drafter=r["drafter"],
            sm_clock=r["chosen"]["sm_clock_mhz"],
            power_limit=r["chosen"]["power_limit_w"],
        )
        reference = on.sel(drafter=r["drafter"], sm_clock=1800, power_limit=700.0)
        assert set(r["reference_measured_on"]) == set(reference.values.ravel())
        if set(chosen.values.ravel()) != set(reference.values.ravel()):
            assert r["different_gpus"]


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.floats(0.0, 0.2), min_size=2, max_size=6),
    slack=st.floats(0.0, 0.6),
    cut=st.integers(0, 5),
    limits=st.sampled_from([[700.0], [500.0, 700.0]]),
)
def test_an_answer_not_flagged_is_the_one_a_longer_grid_gives(steps, slack, cut, limits) -> None:
    """Latency falls as the clock rises (memory-bound decode at worst flat): crop the grid from
    below, and an answer not flagged as a lower bound is the full grid's answer, while a flagged
    one never exceeds it."""
    clocks = [1980 - 150 * i for i in range(len(steps) + 1)]
    latency_at = {1980: 10.0}
    for clock, step in zip(clocks[1:], steps, strict=True):
        latency_at[clock] = latency_at[clock + 150] * (1 + step)
    cropped = clocks[: max(1, len(clocks) - cut)]
    target = Target("preserve", slack=slack)

    def answer(grid: list[int]) -> dict[str, float]:
        cube = make_cube(
            clocks=grid,
            limits=limits,
            latency=lambda c, p, *_: latency_at[c] * (1.0 if p == 700 else 1.01),
            energy=lambda c, p, *_: c / 1000 + p / 1000,
        )
        point = headroom(cube, target=target).sel(batch=1, drafter="none", corpus="code")
        return {k: float(point[k]) for k in point.data_vars}

    full, part = answer(clocks), answer(cropped)
    assert full["feasible"] and part["feasible"]  # stock always meets its own latency
    if len(cropped) == 1:
        assert math.isnan(part["headroom_mhz"]) and not part["headroom_mhz_is_lower_bound"]
    elif part["headroom_mhz_is_lower_bound"]:
        assert part["lowest_feasible_sm_clock"] == min(cropped)
        assert part["headroom_mhz"] <= full["headroom_mhz"]
    else:
        assert part["headroom_mhz"] == full["headroom_mhz"]
    assert np.isnan(full["headroom_w"]) == (len(limits) == 1)
