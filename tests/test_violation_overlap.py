"""Throttle time that two counters hold at once counts once. A tensor-parallel cell's GPUs run
the same wall-clock window, and NVML's thermal and board-limit policies may count the same
throttle (nvml.h: each says how long it held the GPU below its clocks; a separate counter,
TOTAL_APP_CLOCKS, has the time any limiter did): the cell's throttle time is the largest of
those counters' growth, held against its windows, never their sum. Runs dvfs's real NVML
backend against the fake pynvml, the twin engine as the workload (`test_violation`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from nvml_support import (  # root_env, fresh_nvml: this module's `env` and `nvml` fixtures
    NVML_CAMPAIGN,
    REPO,
    fresh_nvml,  # noqa: F401
    root_env,  # noqa: F401
)
from test_violation import cells, flags

from dvfs.backends import Backends
from dvfs.campaign import load_campaign
from dvfs.clock import MonotonicClock
from dvfs.engines.twin import TwinEngine
from dvfs.gpu.nvml import open_nvml_gpus
from dvfs.measure.meter import THROTTLE_VIOLATION_SHARE, steady_window_ns
from dvfs.sweep import run_sweep
from dvfs.twin.device import FreeRunningNode
from dvfs.twin.profiles import gpu_profile, model_profile

#: Each counter's throttle time in a round, as a share of the round's steady window: under
#: `THROTTLE_VIOLATION_SHARE`, twice it over.
SHARE = 0.6 * THROTTLE_VIOLATION_SHARE


class ThrottlingEngine:
    """The twin engine; at the end of each of its rounds, every (device, policy) counter in
    `counters` grows by `SHARE` of the round's steady window (one throttle each counter saw:
    several counters, the same throttle), between two samples: no sampled reason shows it.
    The throttle times it added, per counter, are in `added_ns`."""

    name = "twin"

    def __init__(self, inner: TwinEngine, nvml, counters: list[tuple[int, int]]) -> None:
        self.inner, self.nvml, self.counters = inner, nvml, counters
        self.added_ns = 0

    def start(self, drafter):
        return self.inner.start(drafter)

    def run(self, workload, *args):
        result = self.inner.run(workload, *args)
        window = steady_window_ns(result, workload.mode)
        if window is not None:
            ns = int(SHARE * (window[1] - window[0]))
            for device, policy in self.counters:
                self.nvml.fake_throttle_burst(device, ns, policy)
            self.added_ns += ns
        return result

    def stop(self) -> None:
        self.inner.stop()


def sweep_throttled(tmp_path: Path, nvml, counters: list[tuple[int, int]]) -> ThrottlingEngine:
    """One clock and two power limits on the GPUs `counters` name (several: one
    tensor-parallel server), each round throttled on every counter (`ThrottlingEngine`)."""
    devices = sorted({device for device, _ in counters})
    text = NVML_CAMPAIGN.format(output_tokens=64, repeats=1)
    for old, new in {
        "devices = [0]": f"devices = {devices}",
        "sm_clock = [1980, 1500]": "sm_clock = [1980]",
        'model = "llama-3.1-8b"': f'model = "llama-3.1-8b"\ntp_size = {len(devices)}',
    }.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "nvml.toml"
    path.write_text(text)
    clock = MonotonicClock()
    twin = TwinEngine(
        FreeRunningNode(gpu_profile("h100-sxm"), clock, tp_size=len(devices)),
        model_profile("llama-3.1-8b"),
    )
    engine = ThrottlingEngine(twin, nvml, counters)
    with open_nvml_gpus(devices, nvml=nvml) as gpus:
        outcome = run_sweep(
            load_campaign(path),
            tmp_path / "out",
            backends=Backends(clock, list(gpus), engine),
            state_dir=tmp_path / "dvfs-state",
        )
    assert outcome.summary.measured == 2 and outcome.summary.failed == 0
    assert engine.added_ns > 0
    return engine


def test_a_tensor_parallel_cell_holds_its_most_throttled_gpu_against_its_window(
    nvml, env, tmp_path: Path
) -> None:
    """Two GPUs of one server, each thermally throttled for under the share of the rounds'
    windows: neither crossed it, so the cell is not flagged (the GPUs' times summed, 1.2% of
    one window, flagged it), and its time is one GPU's (the sum exceeded both)."""
    thermal = nvml.NVML_PERF_POLICY_THERMAL
    engine = sweep_throttled(tmp_path, nvml, [(0, thermal), (1, thermal)])
    for record in cells(tmp_path / "out").values():
        assert "throttled" not in flags(record)
    total = sum(r["measurement"]["throttle_violation_s"] for r in cells(tmp_path / "out").values())
    assert total == pytest.approx(engine.added_ns * 1e-9)


def test_one_throttle_both_policies_count_is_counted_once(nvml, env, tmp_path: Path) -> None:
    """One GPU's throttle that its thermal and its board-limit counters both count (NVML's
    policies may overlap in time): held against the windows once, not flagged, and recorded
    once (the two counters' growth summed counted it twice)."""
    engine = sweep_throttled(
        tmp_path,
        nvml,
        [(0, nvml.NVML_PERF_POLICY_THERMAL), (0, nvml.NVML_PERF_POLICY_BOARD_LIMIT)],
    )
    for record in cells(tmp_path / "out").values():
        assert "throttled" not in flags(record)
    total = sum(r["measurement"]["throttle_violation_s"] for r in cells(tmp_path / "out").values())
    assert total == pytest.approx(engine.added_ns * 1e-9)


def test_two_gpus_each_past_the_share_flag_the_cell_with_one_gpus_time(
    nvml, env, tmp_path: Path
) -> None:
    """The other side: a GPU whose own counter passed the share flags the cell (a most-
    throttled GPU, not an average), with that GPU's time."""
    thermal = nvml.NVML_PERF_POLICY_THERMAL
    engine = sweep_throttled(tmp_path, nvml, [(0, thermal), (0, thermal), (1, thermal)])
    for record in cells(tmp_path / "out").values():
        assert "throttled" in flags(record)
    total = sum(r["measurement"]["throttle_violation_s"] for r in cells(tmp_path / "out").values())
    assert total == pytest.approx(2 * engine.added_ns * 1e-9)


def test_one_counters_throttles_add_up_and_the_readme_says_which_flag_nothing(
    nvml, env, tmp_path: Path
) -> None:
    """README said two throttles at different times, each under the share, flag nothing, and
    that two GPUs each throttled for 0.6% of a window are not 1.2% of it. Only throttles two
    counters count go unflagged so: one counter's add up (NVML's count is cumulative), so one
    GPU's two thermal throttles in a round, each under the share, flag the cell with both
    times; and two GPUs' throttles at different times did hold the group for their sum. The
    README says which throttles flag nothing."""
    thermal = nvml.NVML_PERF_POLICY_THERMAL
    engine = sweep_throttled(tmp_path, nvml, [(0, thermal), (0, thermal)])
    for record in cells(tmp_path / "out").values():
        assert "throttled" in flags(record)
    total = sum(r["measurement"]["throttle_violation_s"] for r in cells(tmp_path / "out").values())
    assert total == pytest.approx(2 * engine.added_ns * 1e-9)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "two throttles at different times, each under the share, flag nothing" not in readme
    assert "are not 1.2% of it" not in readme
    said = "two throttles at different times that two counters count, on two GPUs or by two "
    assert said + "policies, each under the share, flag nothing" in readme
    assert "one counter's throttles in a round add up" in readme
