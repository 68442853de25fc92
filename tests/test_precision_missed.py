"""Cells that stopped at `measurement.max_rounds` with an interval wider than the precision
asked: recorded per cell in the cube (`precision_missed`), counted by `dvfs cube info`, and
named by `dvfs headroom` where an answer rests on one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import xarray as xr
from click.testing import CliRunner

from dvfs.cli import cli
from dvfs.cube import STATUS_OK, open_cube, write_cube

PRECISION = 0.01  # SMALL_EXACT's (the default), at max_rounds = 2


def _expected(ds: xr.Dataset) -> np.ndarray:
    """1 where a measured cell's interval is wider than the precision, as the sweep stops."""
    energy = ds["energy_per_token_rel_ci"].values
    latency = ds["latency_rel_ci"].transpose(*ds["energy_per_token_rel_ci"].dims).values
    with np.errstate(invalid="ignore"):
        wider = (energy > PRECISION) | (latency > PRECISION)
    measured = ds["cell_status"].transpose(*ds["energy_per_token_rel_ci"].dims).values == STATUS_OK
    return np.where(measured, wider.astype(float), np.nan)


def test_the_cube_records_each_cell_that_missed_its_precision(small_sweep: Path) -> None:
    ds = open_cube(small_sweep)
    assert json.loads(ds.attrs["campaign"])["measurement"]["max_rounds"] == 2
    recorded = ds["precision_missed"].transpose(*ds["energy_per_token_rel_ci"].dims).values
    expected = _expected(ds)
    np.testing.assert_array_equal(recorded, expected)
    # some cells reached ±1% in two rounds, others did not: the variable tells them apart
    assert 0 < int(np.nansum(expected)) < int((~np.isnan(expected)).sum())
    # each missing one stopped at max_rounds
    rounds = ds["rounds"].transpose(*ds["energy_per_token_rel_ci"].dims).values
    assert set(rounds[expected == 1]) == {2}


def test_cube_info_counts_the_cells_that_missed_their_precision(
    small_sweep: Path, tmp_path: Path
) -> None:
    ds = open_cube(small_sweep)
    missed = int(np.nansum(_expected(ds)))
    measured = int((ds["cell_status"].values == STATUS_OK).sum())
    text = CliRunner().invoke(cli, ["cube", "info", str(small_sweep)])
    assert text.exit_code == 0, text.output
    assert (
        f"{missed} of {measured} measured cell(s) stopped at measurement.max_rounds (2) with "
        "an interval on energy per token or median TPOT wider than the precision (±1%)"
    ) in " ".join(text.output.split())  # the table's wrapping undone
    shown = CliRunner().invoke(cli, ["cube", "info", str(small_sweep), "--json"])
    assert json.loads(shown.output)["precision_missed"] == {
        "cells": missed,
        "measured": measured,
        "precision": PRECISION,
        "max_rounds": 2,
    }
    # A cube an earlier dvfs built (no such variable): told from its intervals alike.
    older = tmp_path / "older.nc"
    write_cube(ds.drop_vars("precision_missed"), older)
    again = CliRunner().invoke(cli, ["cube", "info", str(older), "--json"])
    assert json.loads(again.output)["precision_missed"]["cells"] == missed


def test_headroom_names_the_rows_resting_on_a_cell_that_missed_its_precision(
    small_sweep: Path, tmp_path: Path
) -> None:
    """Every cell reached its precision but one row's reference (edited in): that row, and
    it alone, is named, in the table's notes and in its JSON row."""
    ds = open_cube(small_sweep)
    flags = xr_zeros_where_measured(ds)
    stock = {"sm_clock": int(ds["sm_clock"].max()), "power_limit": float(ds["power_limit"].max())}
    at = {**stock, "batch": 1, "drafter": "eagle3", "corpus": "code"}
    flags.loc[at] = 1.0
    ds["precision_missed"] = flags
    path = tmp_path / "cube.nc"
    write_cube(ds, path)
    doc = json.loads(CliRunner().invoke(cli, ["headroom", str(path), "--json"]).output)
    assert doc["measurement"] == {"precision": PRECISION, "max_rounds": 2}
    named = {(r["batch"], r["drafter"], r["corpus"]): r["precision_missed"] for r in doc["rows"]}
    assert named.pop((1, "eagle3", "code")) == ["reference"]
    assert set(map(tuple, named.values())) == {()}
    table = CliRunner().invoke(cli, ["headroom", str(path)], terminal_width=400)
    assert table.exit_code == 0, table.output
    assert (
        f"precision missed: 1 of {len(doc['rows'])} row(s) rest on a cell that stopped at "
        "measurement.max_rounds (2) with an interval wider than the precision (±1%) (batch 1 "
        "eagle3 on code: reference)"
    ) in table.output
    # None missed: no line.
    ds["precision_missed"] = xr_zeros_where_measured(ds)
    write_cube(ds, path)
    quiet = CliRunner().invoke(cli, ["headroom", str(path)], terminal_width=400)
    assert quiet.exit_code == 0 and "precision missed" not in quiet.output


def xr_zeros_where_measured(ds: xr.Dataset) -> xr.DataArray:
    """A `precision_missed` of 0 at every measured cell (NaN elsewhere)."""
    measured = ds["cell_status"] == STATUS_OK
    return measured.astype(float).where(measured) * 0.0


def test_a_merge_with_an_older_dvfs_cube_tells_its_cells_too(
    small_sweep: Path, tmp_path: Path
) -> None:
    """A cube an earlier dvfs built (no `precision_missed`) merged with one that records it,
    either first: its measured cells are told from their intervals, not left missing (cube
    info said "N of <one GPU's cells> measured cell(s)", the older GPU's cells unnamed)."""
    ds = open_cube(small_sweep)
    missed = int(np.nansum(_expected(ds)))
    measured = int((ds["cell_status"].values == STATUS_OK).sum())
    older = ds.drop_vars("precision_missed")
    older.attrs["gpu_uuids"] = "GPU-older-dvfs-0"
    write_cube(older, tmp_path / "older.nc")
    write_cube(ds, tmp_path / "newer.nc")
    for pair in (("older.nc", "newer.nc"), ("newer.nc", "older.nc")):
        out = tmp_path / f"merged-{pair[0]}"
        merged = CliRunner().invoke(
            cli, ["cube", "merge", *(str(tmp_path / p) for p in pair), "-o", str(out)]
        )
        assert merged.exit_code == 0, merged.output
        shown = CliRunner().invoke(cli, ["cube", "info", str(out), "--json"])
        assert json.loads(shown.output)["precision_missed"] == {
            "cells": 2 * missed,
            "measured": 2 * measured,
            "precision": PRECISION,
            "max_rounds": 2,
        }


def test_in_flight_cells_of_one_block_missed_their_precision(tmp_path: Path) -> None:
    """An in-flight group stopped at max_rounds with one block of rounds (a serpentine's pair)
    states no interval (its half-width infinite, null in the journal): the sweep did not stop
    it by the precision, so it missed it (cube info said every measured cell reached it)."""
    from test_inflight import INFLIGHT_CAMPAIGN

    text = INFLIGHT_CAMPAIGN.replace("max_rounds = 6", "max_rounds = 2").replace(
        'mode = "in-flight"', 'mode = "in-flight"\ninflight_order = "serpentine"'
    )
    campaign = tmp_path / "campaign.toml"
    campaign.write_text(text)
    out = tmp_path / "out"
    swept = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    assert swept.exit_code == 0, swept.output
    ds = open_cube(out)
    measured = ds["cell_status"].values == STATUS_OK
    assert measured.sum() > 0
    assert np.isnan(ds["energy_per_token_rel_ci"].values[measured]).all()
    assert (ds["precision_missed"].values[measured] == 1).all()
    shown = CliRunner().invoke(cli, ["cube", "info", str(out), "--json"])
    count = json.loads(shown.output)["precision_missed"]
    assert count["cells"] == count["measured"] == int(measured.sum())


def test_cube_info_of_a_cube_with_nothing_measured_says_so(
    small_sweep: Path, tmp_path: Path
) -> None:
    """A cube whose journal holds a session and no cell yet (a GPU's own cube in a fleet, its
    sweep begun but no cell measured): `cube info` said 'every measured cell reached the
    precision', of no cell at all. It says nothing is measured yet."""
    from dvfs.measure.journal import JOURNAL_NAME

    out = tmp_path / "out"
    out.mkdir()
    lines = (small_sweep / JOURNAL_NAME).read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["type"] != "cell"]
    assert len(kept) < len(lines)
    (out / JOURNAL_NAME).write_text("".join(kept))
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 0, built.output
    text = CliRunner().invoke(cli, ["cube", "info", str(out)])
    assert text.exit_code == 0, text.output
    told = " ".join(text.output.split())
    assert "0 measured" in told, told
    assert "precision nothing measured yet" in told, told
    assert "reached" not in told, told
