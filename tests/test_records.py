"""The journal's record format: one name per measured quantity, and journals written before
the names were unified (record version 1) still build the same cube."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import TINY_EXACT, write
from test_sweep import assert_cubes_equal

from dvfs.cli import cli
from dvfs.cube import TIMELINE, VARIABLES, build_cube, open_cube
from dvfs.errors import CubeError, JournalError
from dvfs.measure.journal import Journal, read_records
from dvfs.measure.meter import Acceptance, CellMeasurement, LatencyStats
from dvfs.measure.plan import Cell
from dvfs.records import (
    JOURNAL_SCHEMA,
    QUANTITIES,
    CellRecord,
    MeasurementRecord,
    decode_journal,
)

# -- a journal written by hand in record version 1 (dvfs before the names were unified) -----

CAMPAIGN = {
    "gpu": {"backend": "twin", "profile": "h100-sxm", "devices": [0], "actuation": True},
    "knobs": {"sm_clocks_mhz": [1980, 1005], "power_limits_w": None, "settle_s": 1.0},
    "engine": {"backend": "twin", "model": "llama-3.1-8b", "tp_size": 1, "twin_model": None},
    "drafters": [{"name": "none", "algorithm": "none"}],
    "workload": {"batch_sizes": [1], "corpora": [{"name": "code", "spec": None}]},
    "measurement": {"repeats": 1},
}
HEADER_V1 = {
    "type": "header",
    "journal_schema": 1,
    "campaign_name": "by-hand",
    "campaign_hash": "0123456789abcdef",
    "campaign": CAMPAIGN,
    "campaign_source": "by-hand.toml",
    "dvfs_version": "0.9",
    "created": "2026-01-01T00:00:00+00:00",
}
SESSION_V1 = {
    "type": "session",
    "started": "2026-01-01T00:00:01+00:00",
    "dvfs_version": "0.9",
    "host": "bench",
    "settings": {"measurement.retries": 2},
    "gpu_backend": "twin",
    "engine_backend": "twin",
    "actuation": True,
    "clock": "virtual",
    "gpus": [
        {
            "index": 0,
            "uuid": "GPU-twin-0",
            "name": "NVIDIA H100 80GB HBM3",
            "driver_version": "550.54",
            "backend": "twin",
            "memory_clock_mhz": 2619,
            "max_sm_clock_mhz": 1980,
        }
    ],
    "stock": {"sm_clock_mhz": 1980, "power_limit_w": 700.0},
    "power_limit_range_w": [200.0, 700.0, 700.0],
    "idle_power_w": 70.5,
    "measurement_method": "by hand",
    "token_count_method": "estimate",
    "corpora": {"code": {"source": "builtin", "content_hash": "ab", "prompts": 10}},
}
SERVER = {
    "type": "server",
    "started": "2026-01-01T00:00:02+00:00",
    "drafter": "none",
    "engine": "twin",
    "version": "twin-1",
    "args": ["--model", "llama-3.1-8b"],
    "log_path": None,
    "attention_backend": None,
}
CELL_1980 = {"drafter": "none", "repeat": 0, "sm_clock_mhz": 1980, "power_limit_w": None,
             "batch": 1, "corpus": "code"}  # fmt: skip
CELL_1005 = {**CELL_1980, "sm_clock_mhz": 1005}
#: What every measurement holds under both versions' keys.
SHARED = {
    "energy_j": 150.0,
    "output_tokens": 300,
    "rounds": 2,
    "requests": 8,
    "energy_per_token_j": 0.5,
    "energy_per_token_above_idle_j": 0.38,
    "throughput_tok_s": 600.0,
    "ttft_ms": [20.0, 25.0, 30.0],
    "tpot_ms": [5.0, 6.0, 7.5],
    "itl_ms": [4.0, 6.0, 9.0],
    "accept_length": None,
    "accept_rate": None,
    "server_accept_length": None,
    "power_mean_w": 300.0,
    "power_max_w": 320.5,
    "temperature_max_c": 61.0,
    "quality": 0,
    "valid": True,
    "idle_power_w": 70.5,
}
OLD_MEASUREMENT = {
    **SHARED,
    "window_s": 0.5,
    "sm_clock_mhz": 1500.0,
    "event_reasons": 4,
    "timeline": {"t_s": [0.0, 0.25, 0.5], "power_w": [290.0, 300.0, 310.0],
                 "sm_clock_mhz": [1500.0, 1500.0, 1500.0]},
}  # fmt: skip
NEW_MEASUREMENT = {
    **SHARED,
    "decode_time_s": 0.5,
    "sm_clock_observed_mhz": 1500.0,
    "clock_event_reasons": 4,
    "timeline_t_s": [0.0, 0.25, 0.5],
    "timeline_power_w": [290.0, 300.0, 310.0],
    "timeline_sm_clock_mhz": [1500.0, 1500.0, 1500.0],
}


def cell_line(cell: dict[str, Any], measurement: dict[str, Any] | None) -> dict[str, Any]:
    head = {"type": "cell", "key": json.dumps(cell, sort_keys=True), "cell": cell}
    if measurement is None:
        return {**head, "status": "failed", "attempts": 3, "finished": "2026-01-01T00:01:00",
                "error": "attempt 3: boom", "errors": ["attempt 3: boom"]}  # fmt: skip
    return {**head, "status": "ok", "attempts": 1, "finished": "2026-01-01T00:01:00",
            "measurement": measurement, "warmup": {}, "errors": []}  # fmt: skip


def jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


OLD_JOURNAL = [HEADER_V1, SESSION_V1, SERVER, cell_line(CELL_1980, OLD_MEASUREMENT),
               cell_line(CELL_1005, None)]  # fmt: skip
NEW_JOURNAL = [
    {**HEADER_V1, "journal_schema": 2},
    {**SESSION_V1, "journal_schema": 2},
    SERVER,
    cell_line(CELL_1980, NEW_MEASUREMENT),
    cell_line(CELL_1005, None),
]


def _built(path: Path):  # type: ignore[no-untyped-def]
    ds = build_cube(path)
    for attr in ("created", "history"):
        ds.attrs.pop(attr)
    return ds


def test_an_old_format_journal_builds_the_same_cube(tmp_path: Path) -> None:
    old = _built(jsonl(tmp_path / "old.jsonl", OLD_JOURNAL))
    new = _built(jsonl(tmp_path / "new.jsonl", NEW_JOURNAL))
    assert old.identical(new)
    at = {"sm_clock": 1980, "power_limit": 700.0, "batch": 1, "drafter": "none",
          "corpus": "code", "repeat": 0}  # fmt: skip
    measured = old.sel(at)
    assert float(measured["decode_time_s"]) == 0.5
    assert float(measured["sm_clock_observed_mhz"]) == 1500.0
    assert float(measured["clock_event_reasons"]) == 4
    assert list(measured["timeline_power_w"].values[:3]) == [290.0, 300.0, 310.0]
    assert np.isnan(measured["timeline_power_w"].values[3:]).all()
    assert math.isnan(float(measured["accept_length"]))
    assert int(old.sel({**at, "sm_clock": 1005})["cell_status"]) == 2  # failed
    assert json.loads(old.attrs["failed_cells"])[0]["error"] == "attempt 3: boom"


def test_a_cube_from_an_earlier_journal_holds_no_credentials(tmp_path: Path) -> None:
    """A journal of a dvfs that recorded the URL's password, an --api-key and the server's
    api_key builds a cube without them (the cube is the file users share)."""
    sglang = {"extra_args": ["--api-key", "key-1", "--dtype", "float16"]}
    campaign = {**CAMPAIGN, "engine": {**CAMPAIGN["engine"], "sglang": sglang}}
    source = (
        '[engine.sglang]\nurl = "http://alice:pw-2@h:1"\n'
        'extra_args = ["--api-key", "key-1", "--dtype", "float16"]\n'
    )
    server = {**SERVER, "args": {"model_path": "llama-3.1-8b", "api_key": "key-1"}}
    header = {**HEADER_V1, "journal_schema": 2, "campaign": campaign, "campaign_source": source}
    journal = [header, *NEW_JOURNAL[1:2], server, *NEW_JOURNAL[3:]]
    ds = _built(jsonl(tmp_path / "j.jsonl", journal))
    assert not [k for k, v in ds.attrs.items() if "key-1" in str(v) or "pw-2" in str(v)]
    assert json.loads(ds.attrs["server_args"])["none"]["args"] == {
        "model_path": "llama-3.1-8b",
        "api_key": "(not recorded)",
    }
    hidden = ["--api-key", "(not recorded)", "--dtype", "float16"]
    assert json.loads(ds.attrs["campaign"])["engine"]["sglang"]["extra_args"] == hidden
    assert ds.attrs["campaign_source"] == (
        source.replace("alice:pw-2", "(not recorded)").replace("key-1", "(not recorded)")
    )


def test_a_journal_resumed_by_a_newer_dvfs_reads_each_session_in_its_version(
    tmp_path: Path,
) -> None:
    """Records follow their session's version: a v2 session appended to a v1 journal."""
    later = {**SESSION_V1, "journal_schema": 2, "started": "2026-01-02T00:00:00+00:00"}
    mixed = [*OLD_JOURNAL[:4], later, SERVER, cell_line(CELL_1005, NEW_MEASUREMENT)]
    contents = decode_journal(mixed, "mixed")
    assert [s.journal_schema for s in contents.sessions] == [1, 2]
    records = list(contents.cells.values())
    assert [r.measurement.decode_time_s for r in records if r.measurement] == [0.5, 0.5]
    assert all(r.measurement and r.measurement.timeline_t_s == (0.0, 0.25, 0.5) for r in records)


def test_a_newer_record_version_is_refused(tmp_path: Path) -> None:
    newer = [*OLD_JOURNAL[:3], {**SESSION_V1, "journal_schema": JOURNAL_SCHEMA + 1}]
    with pytest.raises(JournalError, match=f"journal schema {JOURNAL_SCHEMA + 1}"):
        build_cube(jsonl(tmp_path / "j.jsonl", newer))


def test_an_old_measurement_missing_a_quantile_list_is_a_cube_error(tmp_path: Path) -> None:
    broken = {k: v for k, v in OLD_MEASUREMENT.items() if k != "ttft_ms"}
    journal = [*OLD_JOURNAL[:3], cell_line(CELL_1980, broken)]
    with pytest.raises(CubeError, match="ttft_ms"):
        build_cube(jsonl(tmp_path / "j.jsonl", journal))


# -- one vocabulary -------------------------------------------------------------------------


def _measurement_names() -> set[str]:
    """CellMeasurement's quantities, latency and acceptance flattened (derived ones included)."""
    names = {f.name for f in fields(CellMeasurement)} - {"latency", "accept"}
    names |= {f.name for f in fields(LatencyStats)} | {f.name for f in fields(Acceptance)}
    # Derived on the measurement as properties; the cross-check's length and cover stay in
    # the meter.
    names |= {"energy_per_token_j", "energy_per_token_above_idle_j", "throughput_tok_s", "valid"}
    return names - {"decode_accept_length", "server_covers"}


def test_a_measured_quantity_has_one_name_in_meter_journal_and_cube() -> None:
    cube = {s.name for s in (*VARIABLES, *TIMELINE)}
    assert cube <= set(QUANTITIES)
    assert set(QUANTITIES) - cube == {"idle_power_w"}  # a cube attribute, not a variable
    assert _measurement_names() == set(QUANTITIES)


def _measurement() -> CellMeasurement:
    return CellMeasurement(
        energy_j=150.0,
        decode_time_s=0.5,
        output_tokens=300,
        rounds=2,
        requests=8,
        latency=LatencyStats((20.0, 25.0, 30.0), (5.0, 6.0, 7.5), (4.0, 6.0, 9.0)),
        accept=Acceptance(math.nan, math.nan, math.nan),
        power_mean_w=300.0,
        power_max_w=320.5,
        sm_clock_observed_mhz=1500.0,
        temperature_max_c=61.0,
        clock_event_reasons=4,
        quality=0,
        idle_power_w=70.5,
        timeline_t_s=(0.0, 0.25, 0.5),
        timeline_power_w=(290.0, 300.0, 310.0),
        timeline_sm_clock_mhz=(1500.0, 1500.0, 1500.0),
    )


def test_a_cell_record_round_trips_through_the_journal(tmp_path: Path) -> None:
    cell = Cell.from_dict(CELL_1980)
    record = CellRecord.measured(cell, _measurement(), attempts=1, warmup={}, errors=[])
    with Journal(tmp_path / "journal.jsonl") as journal:
        journal.append(record.to_json())  # NaN stored as null, tuples as lists
    (line,) = read_records(journal.path)
    assert line["key"] == cell.key and set(line["measurement"]) == set(QUANTITIES)
    back = CellRecord.from_json(line, version=JOURNAL_SCHEMA)
    assert back.cell == cell and back.ok and back.measurement is not None
    assert back.measurement.decode_time_s == 0.5 and back.measurement.throughput_tok_s == 600.0
    assert math.isnan(back.measurement.accept_length)
    failed = CellRecord.failed(cell, attempts=3, errors=["a", "b"])
    assert CellRecord.from_json(failed.to_json(), version=JOURNAL_SCHEMA).error == "b"
    assert failed.to_json()["error"] == "b"


def test_a_planned_cell_is_slotted_and_keeps_its_key() -> None:
    """A sweep plans every cell up front (180,000 at 40 repeats of the demo): a cell has no
    __dict__ (its key is cached in a slot), and its key, equality, order and hash are its
    fields' as before, through pickling (a fleet's queue), copying and `replace`."""
    import copy
    import dataclasses
    import pickle

    cell = Cell("none", 3, 1980, 700.0, 4, "code")
    assert not hasattr(cell, "__dict__")
    expected = json.dumps(dataclasses.asdict(cell), sort_keys=True)
    assert cell.key == expected
    for other in (pickle.loads(pickle.dumps(cell)), copy.deepcopy(cell), copy.copy(cell)):
        assert other == cell and hash(other) == hash(cell) and other.key == expected
    moved = dataclasses.replace(cell, repeat=4)
    assert moved.key == json.dumps(dataclasses.asdict(moved), sort_keys=True) != expected
    assert sorted([moved, cell]) == [cell, moved]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cell.repeat = 5  # type: ignore[misc]


def test_a_measurement_record_names_its_fields_as_the_journal_keys() -> None:
    assert tuple(MeasurementRecord.of(_measurement()).to_json()) == QUANTITIES


# -- through the CLI --------------------------------------------------------------------------


def _as_version_1(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A journal as dvfs wrote it before the names were unified."""
    out = []
    for r in records:
        r = dict(r)
        if r["type"] in ("header", "session"):
            r.pop("journal_schema", None)
            if r["type"] == "header":
                r["journal_schema"] = 1
        if r["type"] == "cell" and "measurement" in r:
            m = dict(r["measurement"])
            r["measurement"] = m
            m["window_s"] = m.pop("decode_time_s")
            m["sm_clock_mhz"] = m.pop("sm_clock_observed_mhz")
            m["event_reasons"] = m.pop("clock_event_reasons")
            m["timeline"] = {
                "t_s": m.pop("timeline_t_s"),
                "power_w": m.pop("timeline_power_w"),
                "sm_clock_mhz": m.pop("timeline_sm_clock_mhz"),
            }
        out.append(r)
    return out


def test_a_sweep_resumes_an_old_format_journal(tiny_exact_run, tmp_path: Path) -> None:
    # The exact twin: the resumed cell must equal the uninterrupted run's (no thermal history).
    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)
    clean, old = tiny_exact_run("one"), tmp_path / "old"  # the uninterrupted run: read-only
    sweep = ["sweep", str(campaign), "--no-progress", "--out"]
    records = read_records(clean / "journal.jsonl")
    assert records[0]["journal_schema"] == JOURNAL_SCHEMA
    assert all(r["journal_schema"] == JOURNAL_SCHEMA for r in records if r["type"] == "session")
    old.mkdir()
    jsonl(old / "journal.jsonl", _as_version_1(records))
    assert_cubes_equal(build_cube(old / "journal.jsonl"), open_cube(clean / "cube.nc"))
    # The last cell left unmeasured: the resume measures it under the new record version.
    assert records[-1]["type"] == "cell"
    jsonl(old / "journal.jsonl", _as_version_1(records)[:-1])
    resumed = CliRunner().invoke(cli, [*sweep, str(old)])
    assert resumed.exit_code == 0, resumed.output
    assert "1 cell(s) measured" in resumed.output
    # the resumed cell pays its own overheads (a server start, its knob's settle)
    assert_cubes_equal(
        open_cube(old / "cube.nc"),
        open_cube(clean / "cube.nc"),
        energy_rtol=1e-4,
        ignore=("gpu_time_",),
    )
