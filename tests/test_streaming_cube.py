"""The cube is built streaming from the journal, and an open journal keeps only what a resume
needs: memory follows the cube's grid, not the journal's length. A later record for a cell
replaces an earlier one, as when the journal was read whole."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
from conftest import write
from test_journal import TINY

from dvfs.campaign import load_campaign
from dvfs.cube import STATUS_FAILED, STATUS_OK, build_cube
from dvfs.measure.journal import Journal, read_records
from dvfs.sweep import run_sweep

#: Attributes that say when a cube was built, not what it holds.
WHEN = ("created", "history")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[dict[str, Any]]]:
    """A finished sweep of TINY: (campaign, its journal's records)."""
    base = tmp_path_factory.mktemp("tiny")
    campaign = load_campaign(write(base / "tiny.toml", TINY))
    run_sweep(campaign, base / "out")
    return campaign, read_records(base / "out" / "journal.jsonl")


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _same_cube(a: xr.Dataset, b: xr.Dataset) -> None:
    xr.testing.assert_equal(a, b)
    assert {k: v for k, v in a.attrs.items() if k not in WHEN} == {
        k: v for k, v in b.attrs.items() if k not in WHEN
    }


def _repeated(records: list[dict[str, Any]], times: int) -> list[dict[str, Any]]:
    """The journal with every cell record written `times` times (each replaces the last)."""
    out: list[dict[str, Any]] = []
    for r in records:
        out.extend([r] * (times if r["type"] == "cell" else 1))
    return out


def _peak_bytes(work: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


#: Each cell written this many times: a journal of a few MB whose cube is TINY's.
TIMES = 200


def test_a_long_journal_is_built_in_a_fraction_of_its_size(tiny, tmp_path: Path) -> None:
    """Read whole, a journal costs more than its size (its bytes, then its records); streamed,
    the cube's grid and one record at a time (CPython's bounded free lists aside)."""
    _, records = tiny
    short = _jsonl(tmp_path / "short.jsonl", records)
    long = _jsonl(tmp_path / "long.jsonl", _repeated(records, TIMES))
    _same_cube(build_cube(short), build_cube(long))
    assert _peak_bytes(lambda: build_cube(long)) < long.stat().st_size / 2


def test_an_open_journal_keeps_the_finished_keys_not_the_records(tiny, tmp_path: Path) -> None:
    campaign, records = tiny
    for name in ("short", "long"):
        (tmp_path / name).mkdir()
    short = _jsonl(tmp_path / "short" / "journal.jsonl", records)
    long = _jsonl(tmp_path / "long" / "journal.jsonl", _repeated(records, TIMES))

    def open_and_close(path: Path) -> set[str]:
        with Journal.open(path, campaign) as journal:
            return journal.finished()

    assert open_and_close(short) == open_and_close(long)
    assert len(open_and_close(short)) == 16
    assert _peak_bytes(lambda: open_and_close(long)) < long.stat().st_size / 2


def test_a_retried_cell_shows_its_last_record(tiny, tmp_path: Path) -> None:
    _, records = tiny
    cells = [i for i, r in enumerate(records) if r["type"] == "cell"]
    retried, broken = records[cells[0]], records[cells[1]]
    failure = {
        "type": "cell",
        "key": retried["key"],
        "cell": retried["cell"],
        "status": "failed",
        "attempts": 3,
        "finished": "",
        "error": "server crashed",
        "errors": ["server crashed"],
    }
    # A failure, then the success of the rerun: the same cube as a journal without it.
    edited = records[: cells[0]] + [failure] + records[cells[0] :]
    reference = build_cube(_jsonl(tmp_path / "ref.jsonl", records))
    _same_cube(build_cube(_jsonl(tmp_path / "retried.jsonl", edited)), reference)
    # A success, then (by hand) a failure of the same cell: the failure is what the cube shows.
    late = {**failure, "key": broken["key"], "cell": broken["cell"]}
    ds = build_cube(_jsonl(tmp_path / "late.jsonl", [*records, late]))
    ok = reference["cell_status"].values == STATUS_OK
    now = ds["cell_status"].values
    assert (now == STATUS_FAILED).sum() == 1 and (now == STATUS_OK).sum() == ok.sum() - 1
    where = now == STATUS_FAILED
    assert np.isnan(ds["energy_per_token_j"].values[where]).all()
    assert np.isnan(ds["timeline_power_w"].values[where]).all()
    (listed,) = json.loads(ds.attrs["failed_cells"])
    assert listed == {"cell": broken["cell"], "error": "server crashed"}
