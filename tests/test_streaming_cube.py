"""The cube is built streaming from the journal, and an open journal keeps only what a resume
needs: memory follows the cube's grid, not the journal's length. A later record for a cell
replaces an earlier one, as when the journal was read whole."""

from __future__ import annotations

import gc
import json
import math
import platform
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import xarray as xr
from conftest import _swept, copy_sweep, subprocess_env

import dvfs
import dvfs.cube.build
import dvfs.measure.journal
import dvfs.sweep
from dvfs.campaign import load_campaign
from dvfs.cube import STATUS_FAILED, STATUS_OK, build_cube
from dvfs.measure.journal import Journal, read_records

#: Attributes that say when a cube was built, not what it holds.
WHEN = ("created", "history")


@pytest.fixture(scope="module")
def tiny(tiny_sweep: Path) -> tuple[Any, list[dict[str, Any]]]:
    """A finished sweep of TINY (the session's `tiny_sweep`): (campaign, its journal's
    records)."""
    campaign = load_campaign(tiny_sweep.parent / "tiny.toml")
    return campaign, read_records(tiny_sweep / "journal.jsonl")


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


#: Where the allocations that count were made (by the innermost Python frame): dvfs's code,
#: xarray's, and the json decoder's (a parsed record). Not pytest's, not xdist's messaging
#: thread, not hypothesis's caches.
COUNTED = [
    tracemalloc.Filter(True, str(Path(module.__file__).parent / "*")) for module in (dvfs, xr, json)
]


def _held_when_the_journal_is_read(work: Callable[[], object], reader: ModuleType) -> int:
    """Bytes that dvfs, xarray and the json decoder allocated and can still reach once `work`
    has read the last line of the journal (`reader.iter_records`, the stream it reads): every
    record, were they kept.

    `work` runs once untraced first, so that imports, backend discovery and caches are not
    counted; traced, it must read the whole journal through that stream.
    """
    work()
    real = reader.iter_records
    seen: dict[str, int] = {}

    def iter_records(path: Any, **kwargs: Any) -> Iterator[dict[str, Any]]:
        yield from real(path, **kwargs)
        # What is still reachable: garbage in reference cycles would be counted or not
        # depending on when the collector last ran (the process's whole history, under xdist).
        gc.collect()
        snapshot = tracemalloc.take_snapshot().filter_traces(COUNTED)
        seen["held"] = sum(stat.size for stat in snapshot.statistics("filename"))

    # Whatever lived before is neither traced nor worth the collector's time (a whole test
    # session's heap, under xdist): only what `work` allocates is collected and counted.
    gc.freeze()
    tracemalloc.start()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(reader, "iter_records", iter_records)
            work()
    finally:
        tracemalloc.stop()
        gc.unfreeze()
    assert "held" in seen, "the journal was not read to its end through iter_records"
    return seen["held"]


#: Each cell written this many times: a journal of ~1.4 MB whose cube is TINY's.
TIMES = 50


def _grows_less_than_a_quarter_of_the_journal(
    work: Callable[[Path], object], reader: ModuleType, short: Path, long: Path
) -> None:
    """Kept, parsed records cost more than their text; streamed, the long journal costs what
    the short one does (the same grid, one record at a time)."""
    growth = _held_when_the_journal_is_read(lambda: work(long), reader)
    growth -= _held_when_the_journal_is_read(lambda: work(short), reader)
    assert growth < (long.stat().st_size - short.stat().st_size) / 4


def test_a_long_journal_is_built_in_a_fraction_of_its_size(tiny, tmp_path: Path) -> None:
    _, records = tiny
    short = _jsonl(tmp_path / "short.jsonl", records)
    long = _jsonl(tmp_path / "long.jsonl", _repeated(records, TIMES))
    _same_cube(build_cube(short), build_cube(long))
    _grows_less_than_a_quarter_of_the_journal(build_cube, dvfs.cube.build, short, long)


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
    _grows_less_than_a_quarter_of_the_journal(open_and_close, dvfs.measure.journal, short, long)


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


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not Path("/proc/self/status").exists(),
    reason="malloc_trim is glibc's; RSS read from Linux's /proc",
)
def test_the_memory_a_sweep_freed_goes_back_to_the_os_before_its_cube() -> None:
    """glibc keeps freed heap pages resident (a block still in use above them pins the heap);
    `release_free_memory`, which the sweep calls between its measurement and its cube, hands
    them back."""
    from dvfs.heap import release_free_memory

    blocks = [bytearray(b"x" * 64 * 1024) for _ in range(800)]  # 50 MB, each in the heap
    pin = bytearray(b"x" * 64 * 1024)
    del blocks
    before = _rss_bytes()
    release_free_memory()
    assert before - _rss_bytes() > 25 * 1024 * 1024
    assert len(pin) == 64 * 1024


#: A twin round's garbage, as `pad_heap`'s test makes it: arrays on the heap (96 kB, below
#: glibc's mmap threshold), made and dropped round after round, in a fresh process (unpadded,
#: with numpy alone: whatever else it imported, compiled or freed first moves glibc's
#: thresholds).
_ROUNDS = """
import resource, sys
import numpy as np
if sys.argv[1] == "pad":
    from dvfs.heap import pad_heap
    pad_heap()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    arrays = [np.ones(12_000) for _ in range(8)]
    del arrays
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="M_TOP_PAD is glibc's; faults read from getrusage"
)
def test_a_padded_heap_does_not_fault_a_rounds_arrays_in_again_every_round() -> None:
    """Unpadded, the heap's top went back to the OS as each round's arrays were freed and the
    next round faulted its pages in anew (~31k faults here); padded, the pages stay."""
    faults = {
        how: int(
            subprocess.run(
                [sys.executable, "-c", _ROUNDS, how],
                env=subprocess_env(),
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
            ).stdout
        )
        for how in ("plain", "pad")
    }
    assert faults["pad"] < 2_000 < 10_000 < faults["plain"], faults


def test_a_sweep_pads_the_heap_first(
    tiny_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    padded: list[bool] = []
    monkeypatch.setattr(dvfs.sweep, "pad_heap", lambda: padded.append(True))
    out = copy_sweep(tiny_sweep, tmp_path / "out")
    _swept(tiny_sweep.parent / "tiny.toml", out)  # every cell journaled: the cube again
    assert padded == [True]


def _expected(record: dict[str, Any]) -> dict[str, list[float]]:
    """Each cube array's values at a cell as its journal record states them (NaN where it has
    none): read off the record by name, not by the builder's row layout."""
    from dvfs.cube.schema import GPU_TIME, SPLIT, TIMELINE, VARIABLES
    from dvfs.engines.base import SPLIT_PARTS
    from dvfs.records.cell import GPU_TIME_KEYS

    def number(v: Any) -> float:
        return float("nan") if v is None else float(v)

    m = record.get("measurement") if record["status"] == "ok" else None
    out: dict[str, list[float]] = {}
    for spec in VARIABLES:
        width = 3 if spec.extra_dim == "quantile" else 1
        v = None if m is None else m.get(spec.name)
        out[spec.name] = [number(x) for x in v] if isinstance(v, list) else [number(v)] * width
    for spec in TIMELINE:
        points = [number(x) for x in (m or {}).get(spec.name, [])][:32]
        out[spec.name] = points + [float("nan")] * (32 - len(points))
    seconds = record.get("gpu_time_s") or {}
    for key in GPU_TIME_KEYS:
        out[f"gpu_time_{key}_s"] = [number(seconds[key]) if seconds else float("nan")]
    out["gpu_time_total_s"] = [
        math.fsum(number(seconds[k]) for k in GPU_TIME_KEYS) if seconds else float("nan")
    ]
    split = (m is not None and record.get("energy_split")) or {}
    for part in SPLIT_PARTS:
        out[f"energy_{part}_j"] = [number(split["energy_j"][part]) if split else float("nan")]
        out[f"time_{part}_s"] = [number(split["time_s"][part]) if split else float("nan")]
    assert set(out) == {s.name for s in (*VARIABLES, *TIMELINE, *GPU_TIME, *SPLIT)}
    return out


def _holds_its_records_values(ds: xr.Dataset, record: dict[str, Any]) -> xr.Dataset:
    """The cube at the record's cell, asserted to hold every value the record gives it."""
    cell = record["cell"]
    at = ds.sel(
        sm_clock=cell["sm_clock_mhz"],
        power_limit=cell["power_limit_w"],
        batch=cell["batch"],
        drafter=cell["drafter"],
        corpus=cell["corpus"],
        repeat=cell["repeat"],
    )
    for name, values in _expected(record).items():
        got = np.ravel(at[name].values).astype(float)
        assert np.array_equal(got, np.array(values), equal_nan=True), (record["key"], name)
    return at


@pytest.mark.parametrize("batch", [None, 1, 3])
def test_every_cell_holds_its_last_records_values_by_name(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int | None
) -> None:
    """The builder stores cells' values in the arrays a batch of rows at a time (`_BATCH`):
    every array at every cell must hold what the cell's last record says, read by name, across
    batch boundaries and records that replace others (a failure, another cell's values)."""
    if batch is not None:
        monkeypatch.setattr(dvfs.cube.build, "_BATCH", batch)
    _, records = tiny
    cells = [r for r in records if r["type"] == "cell"]
    a, b, c = cells[0], cells[1], cells[2]
    failure = {
        "type": "cell",
        "key": a["key"],
        "cell": a["cell"],
        "status": "failed",
        "attempts": 2,
        "finished": "",
        "gpu_time_s": {k: 0.25 for k in a["gpu_time_s"]},
        "error": "server crashed",
        "errors": ["server crashed"],
    }
    b_as_c = {**b, "key": c["key"], "cell": c["cell"]}  # c's cell with b's values, then c's
    a_as_b = {**a, "key": b["key"], "cell": b["cell"]}  # b's cell with a's values, last
    journal = [*records[:3], b_as_c, *records[3:], failure, a_as_b]
    ds = build_cube(_jsonl(tmp_path / "j.jsonl", journal))
    last = {r["key"]: r for r in journal if r["type"] == "cell"}
    assert last[a["key"]] is failure and last[b["key"]] is a_as_b and last[c["key"]] is c
    for record in last.values():
        at = _holds_its_records_values(ds, record)
        status = STATUS_OK if record["status"] == "ok" else STATUS_FAILED
        assert int(at["cell_status"]) == status
        assert int(at["energy_split_method"]) == (1 if status == STATUS_OK else 0)
    assert (ds["cell_status"].values != 0).sum() == len(last)


def test_a_campaigns_batches_in_any_order_make_an_ascending_batch_axis(tmp_path: Path) -> None:
    """A campaign may list its batches in any order (`batch = [8, 1]`); the cube's batch axis
    ascends, as its clock and power-limit axes do (what reads it by position, a figure's line
    or the smallest batch, then reads it in order), and every cell's values sit at its own
    batch."""
    from conftest import TINY, _swept, replace_block, write

    campaign = write(tmp_path / "c.toml", replace_block(TINY, "batch = [1, 8]", "batch = [8, 1]"))
    _swept(campaign, tmp_path / "out")
    ds = dvfs.open_cube(tmp_path / "out")
    assert [int(b) for b in ds["batch"].values] == [1, 8]
    records = [r for r in read_records(tmp_path / "out" / "journal.jsonl") if r["type"] == "cell"]
    assert {r["cell"]["batch"] for r in records} == {1, 8}
    for record in records:
        _holds_its_records_values(ds, record)
