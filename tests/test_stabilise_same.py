"""Thermal stabilisation's shortcuts on the twin give the plain loop's bits (issue 15).

Stabilisation runs a cell's load hundreds of times; on the twin it takes four shortcuts: the
engine's repeater runs the load without building the traces nobody reads, the probe reads the
die temperature alone, the slope is not fitted again over the same readings, and a device
makes a schedule's thermal terms once. Each must leave every number as it was: the twin's
state after each load, the `Stabilised` record and the measurements after it.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner
from conftest import TINY, replace_block
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.campaign.model import DrafterSpec
from dvfs.cli import cli
from dvfs.clock import VirtualClock
from dvfs.corpora import load_corpus, sample_prompts
from dvfs.engines.base import Repeating, RoundResult, Workload, load_of
from dvfs.engines.twin import TwinEngine
from dvfs.twin.device import TwinDevice, TwinNode
from dvfs.twin.profiles import gpu_profile, model_profile

H100 = gpu_profile("h100-sxm")
LLAMA8B = model_profile("llama-3.1-8b")
NONE = DrafterSpec("none")
EAGLE3 = DrafterSpec("eagle3", "EAGLE3", "eagle3-llama-3.1-8b", 3, 1, 4)


def _twin(devices: int, limit_w: float) -> tuple[VirtualClock, list[TwinDevice], TwinEngine]:
    clock = VirtualClock()
    node = [TwinDevice(H100, clock, i) for i in range(devices)]
    for d in node:
        d.power_limit_w = limit_w
    return clock, node, TwinEngine(TwinNode(node), LLAMA8B, startup_s=0.0)


def _state(clock: VirtualClock, devices: list[TwinDevice]) -> list[Any]:
    """Everything a later reading depends on: the instant, and per device its temperature,
    true energy and energy counter's recent values there, and its readings a while on."""
    now = clock.now_ns()
    out: list[Any] = [now]
    for d in devices:
        temp, energy, counter = d.timeline.fold_state(now)
        out += [temp, energy]
        if counter is not None:
            out += [counter[0].tolist(), counter[1]]
        r = d.readings_at(now + np.arange(0, 3_000_000_000, 70_000_000))
        out += [a.tolist() for a in (r.energy_j, r.power_average_w, r.temperature_c)]
    return out


def _workload(batch: int, end_at_window: bool) -> Workload:
    prompts = sample_prompts(load_corpus("code"), batch, input_tokens=(16, 2048), seed=3)
    return Workload(
        batch, prompts, "code", 64, 0.0, True, "fixed", seed=5, end_at_window=end_at_window
    )


@pytest.mark.parametrize(("devices", "limit_w"), [(1, 700.0), (2, 700.0), (1, 250.0)])
@pytest.mark.parametrize("drafter", [NONE, EAGLE3], ids=lambda d: d.name)
def test_the_repeater_leaves_the_twin_as_run_does(devices, limit_w, drafter) -> None:
    """Load after load, the repeater (and the thermal terms made once per schedule) leave
    the clock and every device where `run` with fresh terms does, to the bit: through a knob
    change (a new schedule, still settling), a power cap, a restart of the server (a new
    plan) and two GPUs in lock-step."""
    plain_clock, plain_devices, plain = _twin(devices, limit_w)
    fast_clock, fast_devices, fast = _twin(devices, limit_w)
    assert isinstance(fast, Repeating)
    for engine in (plain, fast):
        engine.start(drafter)
    load = _workload(8, end_at_window=drafter is EAGLE3)
    again = fast.repeater(load)
    for i in range(30):
        if i == 10:  # a knob change: what runs next settles, then a new schedule
            for d in plain_devices + fast_devices:
                d.locked_mhz = (1200, 1200)
        if i == 20:  # a restart: a new plan and round cache
            plain.start(drafter)
            fast.start(drafter)
        for d in plain_devices:  # the plain side makes its thermal terms afresh every time
            d._terms = None
        plain.run(load)
        again()
        assert _state(fast_clock, fast_devices) == _state(plain_clock, plain_devices), i


class _RunOnly:
    """An engine with `run` alone (a real server's case): no repeater."""

    def __init__(self, engine: TwinEngine) -> None:
        self.engine = engine

    def run(self, workload: Workload) -> RoundResult:
        return self.engine.run(workload)


@pytest.mark.parametrize("mode", ["fixed", "closed-loop"])
def test_a_load_is_the_repeater_or_run_with_its_result_dropped(mode: str) -> None:
    """`load_of`: the twin's repeater, a closed-loop workload's included, and `run` for an
    engine without one, leave the clock and the device where `run` does, load after load, and
    return nothing."""
    plain_clock, plain_devices, plain = _twin(1, 700.0)
    fast_clock, fast_devices, fast = _twin(1, 700.0)
    bare_clock, bare_devices, bare = _twin(1, 700.0)
    for engine in (plain, fast, bare):
        engine.start(NONE)
    load = replace(_workload(4, end_at_window=False), mode=mode)
    again = load_of(fast, load)
    run_only = load_of(_RunOnly(bare), load)  # type: ignore[arg-type]
    for i in range(3):
        plain.run(load)
        assert again() is None and run_only() is None
        assert _state(fast_clock, fast_devices) == _state(plain_clock, plain_devices), i
        assert _state(bare_clock, bare_devices) == _state(plain_clock, plain_devices), i


@settings(max_examples=40, deadline=None)
@given(
    trap=st.sampled_from(["", "thermal_lag", "leakage"]),
    offsets_s=st.lists(st.floats(-2.0, 40.0), min_size=1, max_size=40),
    fields=st.sampled_from(
        [("temperature_c",), ("energy_mj", "power_mw"), ("temperature_c", "sm_clock_mhz")]
    ),
)
def test_the_temperature_read_alone_is_the_one_read_with_all_the_rest(
    trap: str, offsets_s: list[float], fields: tuple[str, ...]
) -> None:
    """What the probe reads with `fields_at` is what `readings_at` gives for those fields, at
    instants before the last start (clipped), during its passes and in the idle tail after,
    with and without the die's lag and leakage."""
    from dvfs.gpu.twin import TwinGpu
    from dvfs.twin.traps import without

    clock = VirtualClock()
    device = TwinDevice(without(H100, trap) if trap else H100, clock, 0)
    engine = TwinEngine(TwinNode([device]), LLAMA8B, startup_s=0.0)
    engine.start(EAGLE3)
    gpu = TwinGpu(device)
    clock.sleep(5.0)
    fold_ns = clock.now_ns()
    engine.repeater(_workload(8, end_at_window=False))()
    t_ns = fold_ns + np.round(np.array(offsets_s) * 1e9).astype(np.int64)
    alone = gpu.fields_at(t_ns, fields)
    readings = device.readings_at(t_ns)
    with_the_rest = gpu.readings_at(t_ns)
    assert np.array_equal(device.temperature_c_at(t_ns), readings.temperature_c)
    for name, got in zip(fields, alone, strict=True):
        want = getattr(with_the_rest, name)
        assert got.dtype == want.dtype and np.array_equal(got, want), name


@settings(max_examples=40, deadline=None)
@given(offsets_s=st.lists(st.floats(-1.0, 30.0), min_size=1, max_size=20))
def test_a_folded_counters_history_is_its_values_at_those_updates(offsets_s: list[float]) -> None:
    """The history a fold hands on (taken as a slice of the counter's known values where it
    can) is the counter's value at each of those updates, in the work or the tail after."""
    clock = VirtualClock()
    device = TwinDevice(H100, clock, 0)
    engine = TwinEngine(TwinNode([device]), LLAMA8B, startup_s=0.0)
    engine.start(NONE)
    clock.sleep(3.0)
    fold_ns = clock.now_ns()
    engine.repeater(_workload(8, end_at_window=False))()
    counter = device.timeline.counter
    assert counter is not None
    n = counter.sensor.average_n
    for offset_s in offsets_s:
        t_ns = max(fold_ns, fold_ns + round(offset_s * 1e9))
        k = counter.sensor.index_of(t_ns)
        history, _ = counter.history_at(t_ns, 0.0)
        assert np.array_equal(history, counter.at_updates(np.arange(k - n, k + 1)))


def test_a_repeater_before_start_fails_as_run_does() -> None:
    _, _, engine = _twin(1, 700.0)
    again = engine.repeater(_workload(1, end_at_window=False))
    with pytest.raises(Exception, match="before start") as raised:
        again()
    with pytest.raises(type(raised.value), match="before start"):
        engine.run(_workload(1, end_at_window=False))


#: TINY with one repeat and the thermal stabilisation spelled out (120 s, the default).
CAMPAIGN = replace_block(
    replace_block(
        replace_block(TINY, 'name = "small"', 'name = "stabilise-same"'),
        "repeats = 2",
        "repeats = 1",
    ),
    "idle_s = 1.0\n",
    "idle_s = 1.0\nthermal_max_s = 120.0\n",
)

#: Journal fields that hold wall-clock time (or, for the twin's versions, its source's digest).
WALL_CLOCK = {"created", "started", "finished"}


def _journal(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        record = json.loads(re.sub(r"\+[0-9a-f]{12}\b", "+DIGEST", line))
        records.append({k: v for k, v in record.items() if k not in WALL_CLOCK})
    return records


def _sweep(tmp_path: Path, name: str, text: str) -> tuple[list[dict[str, Any]], xr.Dataset]:
    campaign = tmp_path / f"{name}.toml"
    campaign.write_text(text)
    out = tmp_path / name
    result = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    with xr.open_dataset(out / "cube.nc") as cube:
        return _journal(out / "journal.jsonl"), cube.load()


def _plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shortcut off: `run` for the load, all readings for the probe, a fit after every
    load, and the thermal terms and durations made afresh for every timeline."""
    import dvfs.twin.device as device_module
    from dvfs.gpu.twin import TwinGpu
    from dvfs.measure.settle import Probe
    from dvfs.twin.timeline import Work

    def plain_work(*arrays: Any) -> Work:
        return Work(*arrays[:5])

    def run_each_time(self: TwinEngine, workload: Workload) -> Any:
        return lambda: self.run(workload) and None

    def all_readings(self: TwinGpu, t_ns: np.ndarray, fields: Any) -> tuple[np.ndarray, ...]:
        readings = self.readings_at(t_ns)
        return tuple(getattr(readings, f) for f in fields)

    # (replaced, not deleted: a runtime protocol remembers a class it has seen match)
    monkeypatch.setattr(TwinEngine, "repeater", run_each_time)
    monkeypatch.setattr(TwinGpu, "fields_at", all_readings)
    monkeypatch.setattr(Probe, "span", lambda self, since_ns: None)
    monkeypatch.setattr(device_module, "Work", plain_work)


@pytest.mark.parametrize(
    "extra",
    ["", "thermal_max_s = 20.0\nthermal_slope_c_per_min = 0.5\n"],
    ids=["reached", "bounded"],
)
def test_a_sweep_stabilises_and_measures_as_the_plain_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: str
) -> None:
    """The same journal (the `Stabilised` records and every measurement after them, but the
    wall-clock times) and the same cube, with the shortcuts and without: stabilisation that
    reaches its slope, and one cut at its bound before a full window."""
    text = CAMPAIGN.replace("thermal_max_s = 120.0\n", extra or "thermal_max_s = 120.0\n")
    repeated: list[int] = []
    repeater = TwinEngine.repeater

    def spy(self: TwinEngine, workload: Workload) -> Any:
        repeated.append(workload.batch)
        return repeater(self, workload)

    with monkeypatch.context() as patch:
        patch.setattr(TwinEngine, "repeater", spy)
        fast, fast_cube = _sweep(tmp_path, "fast", text)
    assert len(repeated) == 2  # one stabilisation per server (drafter), through the repeater
    with monkeypatch.context() as patch:
        _plain_loop(patch)
        plain, plain_cube = _sweep(tmp_path, "plain", text)
    stabilised = [r["warmup"]["stabilised"] for r in fast if "stabilised" in r.get("warmup", {})]
    assert len(stabilised) == 2 and all(s["loads"] > 20 for s in stabilised)
    assert all(s["reached"] is (not extra) for s in stabilised)
    assert fast == plain
    names = set(map(str, fast_cube.variables))
    assert names == set(map(str, plain_cube.variables))
    for name in sorted(names):
        a, b = fast_cube[name].values, plain_cube[name].values
        same = (
            np.array_equal(a, b, equal_nan=True)
            if a.dtype.kind == "f"
            else np.array_equal(a.astype(str), b.astype(str))
        )
        assert same, name


def test_a_two_gpu_node_starts_one_schedule_for_the_same_load_again() -> None:
    """A tensor-parallel node's schedule (each phase at its slowest device's point) is the
    same object for the same devices' schedules, so a load run again and again starts one
    schedule, whose thermal terms each device keeps (it made them anew every time when the
    node built its schedule anew); the bits against `run` are
    `test_the_repeater_leaves_the_twin_as_run_does`'."""
    _, devices, engine = _twin(2, 700.0)
    engine.start(EAGLE3)
    again = engine.repeater(_workload(8, end_at_window=True))
    started = []
    for _ in range(4):
        again()
        started.append(devices[0].timeline.work)
        assert all(d._terms is not None and d._terms[0] is devices[0]._terms[0] for d in devices)
    assert all(d._terms is not None and d._terms[1] is not None for d in devices)
    assert all(w is not None and w.terms is started[-1].terms for w in started[1:])


def test_a_timeline_keeps_the_devices_pass_bounds_as_its_segments_starts() -> None:
    """A device hands a timeline its passes' starts and last end in the one array it made
    them in; the timeline keeps it as its segments' starts (read-only), as it builds them
    from the starts and the end without it."""
    from dvfs.twin.timeline import Timeline

    _, devices, engine = _twin(1, 700.0)
    engine.start(NONE)
    engine.repeater(_workload(4, end_at_window=False))()
    timeline = devices[0].timeline
    work = timeline.work
    assert work is not None and work.bounds_ns is not None
    assert timeline._seg_start_ns is work.bounds_ns and not work.bounds_ns.flags.writeable
    built = Timeline(
        timeline.profile,
        timeline.thermal,
        timeline.sensor,
        timeline.fold_ns,
        None,
        None,
        None,
        replace(work, bounds_ns=None),
        timeline.idle_w,
        timeline.idle_clock_mhz,
        None,
    )
    assert np.array_equal(built._seg_start_ns, work.bounds_ns)
