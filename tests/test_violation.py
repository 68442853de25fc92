"""A throttle between two samples flags its cell: the clock-event reasons are read only at the
sampler's instants, so the meter also reads NVML's cumulative violation counters (thermal,
board limit) at each round's start and end. Runs dvfs's real NVML backend against the fake
pynvml, with the twin engine as the workload."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import xarray as xr
from nvml_support import (  # root_env, fresh_nvml: this module's `env` and `nvml` fixtures
    NVML_CAMPAIGN,
    dvfs_in_process,
    fresh_nvml,  # noqa: F401
    root_env,  # noqa: F401
)

from dvfs.backends import Backends
from dvfs.campaign import load_campaign
from dvfs.clock import MonotonicClock
from dvfs.engines.twin import TwinEngine
from dvfs.gpu.base import EVENT_THROTTLE_MASK
from dvfs.gpu.nvml import open_nvml_gpus
from dvfs.measure.journal import iter_records
from dvfs.measure.meter import describe_quality
from dvfs.sweep import run_sweep
from dvfs.twin.device import FreeRunningNode
from dvfs.twin.profiles import gpu_profile, model_profile

#: A thermal throttle's time between two samples: the fake's sampled reasons never show it,
#: as a real sampler's miss a throttle shorter than its period. A whole second of it stands
#: for a time past `THROTTLE_VIOLATION_SHARE` of a cell's windows however far a loaded
#: machine stretches these real-time rounds (a 64-token decode: under a second), so it flags.
BURST_NS = 1_000_000_000
#: A healthy GPU's blip of violation time: far under that share of any window, recorded only.
BLIP_NS = 5_000


def campaign(path: Path, device: int, output_tokens: int = 64) -> Path:
    """The small NVML campaign on fake GPU `device`: one clock, 700 W and 400 W (two cells).
    A test that reads no cell's flags asks for fewer `output_tokens` (played out in real
    time)."""
    text = NVML_CAMPAIGN.format(output_tokens=output_tokens, repeats=1)
    for old, new in {
        "devices = [0]": f"devices = [{device}]",
        "sm_clock = [1980, 1500]": "sm_clock = [1980]",
    }.items():
        assert old in text
        text = text.replace(old, new)
    path.write_text(text)
    return path


class BurstingEngine:
    """The twin engine; during its first round (an in-flight group's: its first stepped
    decode) the fake GPU throttles thermally (`burst_ns`) and recovers, all between two
    samples: no sampled reason shows it."""

    name = "twin"

    def __init__(
        self, inner: TwinEngine, nvml, device: int, stepped: bool, burst_ns: int = BURST_NS
    ) -> None:
        self.inner, self.nvml, self.device, self.stepped = inner, nvml, device, stepped
        self.burst, self.burst_ns = False, burst_ns

    def start(self, drafter):
        return self.inner.start(drafter)

    def run(self, workload, *args):
        decode = not self.stepped or (args and args[0] is not None)  # not the group's warm-up
        if decode and not self.burst:
            self.burst = True
            self.nvml.fake_throttle_burst(self.device, self.burst_ns)
        return self.inner.run(workload, *args)

    def stop(self) -> None:
        self.inner.stop()


def sweep(path: Path, out: Path, tmp_path: Path, nvml, device: int, burst: bool, burst_ns=BURST_NS):
    """Sweep the campaign at `path` on fake GPU `device` in this process into `out`, its twin
    engine throttled once in its first round (for `burst_ns`) when `burst`."""
    clock = MonotonicClock()
    twin = TwinEngine(
        FreeRunningNode(gpu_profile("h100-sxm"), clock), model_profile("llama-3.1-8b")
    )
    loaded = load_campaign(path)
    stepped = loaded.measurement.mode == "in-flight"
    engine = BurstingEngine(twin, nvml, device, stepped, burst_ns) if burst else twin
    with open_nvml_gpus([device], nvml=nvml) as gpus:
        return run_sweep(
            loaded,
            out,
            backends=Backends(clock, list(gpus), engine),
            state_dir=tmp_path / "dvfs-state",
        )


def cells(out: Path) -> dict[int, dict]:
    """The sweep's measured cells by power limit (W)."""
    records = [r for r in iter_records(out / "journal.jsonl") if r.get("type") == "cell"]
    return {int(r["cell"]["power_limit_w"]): r for r in records}


def flags(record: dict) -> list[str]:
    return describe_quality(int(record["measurement"]["quality"]))


def test_a_throttle_between_samples_flags_its_cell_and_the_cube_keeps_its_time(
    nvml, env, tmp_path: Path
) -> None:
    nvml.fake_set_load(0, 1.0)  # under load: at 400 W the power limit holds the clock
    out = tmp_path / "out"
    outcome = sweep(campaign(tmp_path / "nvml.toml", 0), out, tmp_path, nvml, 0, burst=True)
    assert outcome.summary.measured == 2
    by_limit = cells(out)
    burst = by_limit[700]  # the first cell: its first round held the burst
    m = burst["measurement"]
    # No sampled reason saw it, yet the cell is flagged and its time kept.
    assert not int(m["clock_event_reasons"]) & EVENT_THROTTLE_MASK
    assert "throttled" in flags(burst)
    assert m["throttle_violation_s"] == pytest.approx(BURST_NS * 1e-9)
    assert m["valid"] is False
    # The 400 W cell ran held by its power limit the whole time (the POWER policy's violation
    # time grew): power capped, as its knob means, and not throttled.
    capped = by_limit[400]
    assert "power_capped" in flags(capped)
    assert "throttled" not in flags(capped)
    assert capped["measurement"]["throttle_violation_s"] == 0.0
    nvml.nvmlInit()
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        assert nvml.nvmlDeviceGetViolationStatus(h, nvml.NVML_PERF_POLICY_POWER).violationTime > 0
    finally:
        nvml.nvmlShutdown()
    # The cube holds the time per cell, in seconds, with what it means.
    with xr.open_dataset(out / "cube.nc") as ds:
        var = ds["throttle_violation_s"]
        assert var.attrs["units"] == "s"
        assert "violation" in var.attrs["long_name"]
        seconds = var.sel(power_limit=[700.0, 400.0]).values.ravel().tolist()
        assert seconds == pytest.approx([BURST_NS * 1e-9, 0.0])
    # `cube info` says what the flag means, the counters included.
    info = dvfs_in_process("cube", "info", str(out / "cube.nc"), env=env)
    assert info.returncode == 0, info.stdout + info.stderr
    said = " ".join(info.stdout.split())
    assert "throttled" in said and "throttle_violation_s" in said, said
    # and that the counters flag a cell only past their share of its windows (any growth
    # did once: a valid cell beside it may hold microseconds)
    assert "grew by more than 1% of the cells' steady windows" in said, said


def test_a_blip_of_violation_time_is_recorded_and_flags_nothing(nvml, env, tmp_path: Path) -> None:
    """Five microseconds of thermal violation time in a round of a fraction of a second (a
    healthy GPU's counter may creep so) cannot move the cell's energy or latency by a
    fraction of its precision: recorded, and the cell stays valid (any growth at all flagged
    it throttled, invalid)."""
    from dvfs.measure.meter import THROTTLE_VIOLATION_SHARE

    assert BLIP_NS * 1e-9 < THROTTLE_VIOLATION_SHARE * 1e-3  # under the share of a 1-ms window
    out = tmp_path / "out"
    path = campaign(tmp_path / "nvml.toml", 0)
    outcome = sweep(path, out, tmp_path, nvml, 0, burst=True, burst_ns=BLIP_NS)
    assert outcome.summary.measured == 2
    blipped = cells(out)[700]
    assert blipped["measurement"]["throttle_violation_s"] == pytest.approx(BLIP_NS * 1e-9)
    assert "throttled" not in flags(blipped)
    assert blipped["measurement"]["decode_time_s"] > 1e-3  # the premise: a window past 1 ms


@pytest.mark.parametrize(
    "error",
    ["NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_DEPRECATED"],
    # a driver past the call's deprecation may answer Deprecated (26) rather than drop it
    ids=["old", "unsup", "deprecated"],
)
def test_a_driver_without_the_counters_measures_as_before_with_the_time_unknown(
    nvml, env, tmp_path: Path, error: str
) -> None:
    nvml.fake_update_device(0, errors={"nvmlDeviceGetViolationStatus": getattr(nvml, error)})
    out = tmp_path / "out"
    outcome = sweep(campaign(tmp_path / "nvml.toml", 0), out, tmp_path, nvml, 0, burst=True)
    assert outcome.summary.measured == 2 and outcome.summary.failed == 0
    for record in cells(out).values():
        assert record["status"] == "ok"
        assert record["measurement"]["throttle_violation_s"] is None  # unknown, as JSON has it
        assert "throttled" not in flags(record)  # the burst went unseen, as before
    with xr.open_dataset(out / "cube.nc") as ds:
        assert ds["throttle_violation_s"].isnull().all()


def test_cube_merge_carries_the_time_and_an_unknown_gpu_stays_unknown(
    nvml, env, tmp_path: Path
) -> None:
    nvml.fake_update_device(1, errors={"nvmlDeviceGetViolationStatus": 3})
    zero, one = tmp_path / "gpu0", tmp_path / "gpu1"
    sweep(campaign(tmp_path / "gpu0.toml", 0, 16), zero, tmp_path, nvml, 0, burst=True)
    sweep(campaign(tmp_path / "gpu1.toml", 1, 16), one, tmp_path, nvml, 1, burst=True)
    merged = tmp_path / "merged.nc"
    done = dvfs_in_process("cube", "merge", str(zero), str(one), "-o", str(merged), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    with xr.open_dataset(merged) as ds:
        var = ds["throttle_violation_s"]
        assert var.attrs["units"] == "s"
        first = var.isel(gpu=0).sel(power_limit=700.0).values.ravel().tolist()
        assert first == pytest.approx([BURST_NS * 1e-9])
        assert var.isel(gpu=1).isnull().all()


def test_an_old_journal_without_the_key_resumes_and_builds(nvml, env, tmp_path: Path) -> None:
    """A journal an earlier dvfs wrote (no `throttle_violation_s`) resumes: its cells read as
    unknown (NaN), the cells measured now carry theirs, and the cube builds from both."""
    path = campaign(tmp_path / "nvml.toml", 0, output_tokens=16)
    out = tmp_path / "out"
    sweep(path, out, tmp_path, nvml, 0, burst=False)
    journal = out / "journal.jsonl"
    lines = []
    dropped = False
    for line in journal.read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "cell":
            record["measurement"].pop("throttle_violation_s")
            if int(record["cell"]["power_limit_w"]) == 400 and not dropped:
                dropped = True  # this cell left to the resumed sweep
                continue
        lines.append(json.dumps(record))
    assert dropped
    journal.write_text("\n".join(lines) + "\n")
    (out / "cube.nc").unlink()
    outcome = sweep(path, out, tmp_path, nvml, 0, burst=False)
    assert outcome.summary.measured == 1  # the 700 W cell was kept, the 400 W one measured
    with xr.open_dataset(out / "cube.nc") as ds:
        old = float(ds["throttle_violation_s"].sel(power_limit=700.0).values.ravel()[0])
        new = float(ds["throttle_violation_s"].sel(power_limit=400.0).values.ravel()[0])
    assert math.isnan(old) and new == 0.0
    built = dvfs_in_process("cube", "build", str(out), env=env)
    assert built.returncode == 0, built.stdout + built.stderr


def test_an_inflight_decode_throttled_between_samples_flags_every_level_it_measured(
    nvml, env, tmp_path: Path
) -> None:
    """Counters read at a decode's ends cannot place a throttle in one level: every level the
    decode measured is flagged, with the decode's time."""
    path = tmp_path / "nvml.toml"
    path.write_text(
        NVML_CAMPAIGN.format(output_tokens=16, repeats=1).replace(
            "[measurement]\n", '[measurement]\nmode = "in-flight"\n'
        )
    )
    out = tmp_path / "out"
    outcome = sweep(path, out, tmp_path, nvml, 0, burst=True)
    assert outcome.summary.measured == 4
    records = [r for r in iter_records(out / "journal.jsonl") if r.get("type") == "cell"]
    first = [
        r
        for r in records
        if any(s["round"] == 0 and s["measured_s"] > 0 for s in r["inflight"]["segments"])
    ]
    assert first  # the first decode measured some levels
    for record in records:
        m = record["measurement"]
        assert not int(m["clock_event_reasons"]) & EVENT_THROTTLE_MASK
        if record in first:
            assert "throttled" in flags(record)
            assert m["throttle_violation_s"] == pytest.approx(BURST_NS * 1e-9)
        else:
            assert "throttled" not in flags(record)
            assert m["throttle_violation_s"] == 0.0
