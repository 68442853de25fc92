"""The backend seam: one module picks twin or NVML, and both backends answer the same protocol
with the same rules (supported clocks, power range, gathered failures)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SMALL_CAMPAIGN, write
from nvml_support import load_fake

from dvfs.backends import (
    open_backends,
    open_gpus,
    parse_devices,
    real_gpus,
    server_plans,
    virtual_time,
)
from dvfs.campaign import load_campaign
from dvfs.clock import VirtualClock
from dvfs.dry_run import DryRunPlan, plan_dry_run
from dvfs.errors import CampaignError, GpuError, GpuPermissionError, GpuValueError
from dvfs.gpu.base import DeviceInfo, PowerLimitRange, unsupported_clock
from dvfs.gpu.knobs import GatheredFailures


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("DVFS_FAKE_NVML_STATE", str(tmp_path / "fake-nvml.json"))
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", "h100-sxm")
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "1")
    module = load_fake()
    module.fake_reset_state()
    return module


@contextlib.contextmanager
def either(kind: str, nvml: Any) -> Iterator[list[Any]]:
    """One H100 from the twin or from the fake NVML, opened through `dvfs.backends`."""
    if kind == "twin":
        with open_gpus([0], twin="h100-sxm") as gpus:
            yield gpus
    else:
        with open_gpus([0], nvml=nvml) as gpus:
            yield gpus


@pytest.mark.parametrize("kind", ["twin", "nvml"])
def test_both_backends_answer_the_whole_protocol(kind: str, nvml: Any) -> None:
    with either(kind, nvml) as (gpu,):
        assert gpu.mig_enabled() is False
        assert gpu.persistence_mode() in (True, None)
        info = gpu.info()
        assert isinstance(info, DeviceInfo)
        assert info.identity == gpu.identity and not info.mig
        assert info.supported_sm_clocks_mhz == gpu.supported_sm_clocks_mhz()
        assert info.power_limits == gpu.power_limit_range()


@pytest.mark.parametrize("kind", ["twin", "nvml"])
def test_both_backends_refuse_a_power_limit_with_the_same_words(kind: str, nvml: Any) -> None:
    with either(kind, nvml) as (gpu,), pytest.raises(GpuValueError) as caught:
        gpu.set_power_limit_mw(900_000)
    assert str(caught.value) == "GPU 0: power limit 900 W is outside the allowed range 200-700 W"


def test_one_clock_rule_names_the_nearest_supported_clocks() -> None:
    supported = (1515, 1500, 1485)
    assert unsupported_clock(1500, supported) is None
    assert unsupported_clock(1507, supported, of=" of GPU 3") == (
        "1507 MHz is not a supported SM clock of GPU 3; nearest supported: 1500, 1515 MHz "
        "(range 1485-1515 MHz)"
    )


def test_one_power_range_rule() -> None:
    allowed = PowerLimitRange(200_000, 700_000, 700_000)
    assert allowed.outside(200_000) is None and allowed.outside(700_000) is None
    assert allowed.outside(150_000) == "power limit 150 W is outside the allowed range 200-700 W"
    assert allowed.describe_w() == "200-700 W"


def test_gathered_failures_raise_once_and_need_root_if_any_did() -> None:
    failures = GatheredFailures()
    failures.raise_if_any("nothing: ")  # nothing failed, nothing raised
    failures.add(GpuError("GPU 0 is lost"), "first: ")
    failures.add(GpuPermissionError("GPU 1 needs root"))
    with pytest.raises(GpuPermissionError) as caught:
        failures.raise_if_any("could not: ", ".")
    assert str(caught.value) == "could not: first: GPU 0 is lost; GPU 1 needs root."


def test_the_twin_takes_indices_and_the_command_line_parses_them() -> None:
    assert parse_devices(("0", "GPU-abc")) == [0, "GPU-abc"]
    with pytest.raises(CampaignError, match="by index"), open_gpus(["GPU-abc"], twin="h100-sxm"):
        pass
    with open_gpus([], twin="h100-sxm") as gpus:
        assert [g.identity.index for g in gpus] == [0]


def test_a_twin_campaign_runs_in_virtual_time(tmp_path: Path) -> None:
    campaign = load_campaign(write(tmp_path / "small.toml", SMALL_CAMPAIGN))
    assert virtual_time(campaign) and not real_gpus(campaign)
    with open_backends(campaign, out_dir=tmp_path / "out") as backends:
        assert isinstance(backends.clock, VirtualClock)
        assert [g.identity.backend for g in backends.gpus] == ["twin"]


def test_the_dry_run_plan_is_data(tmp_path: Path) -> None:
    campaign = load_campaign(write(tmp_path / "small.toml", SMALL_CAMPAIGN))
    plan = plan_dry_run(campaign, tmp_path / "out")
    assert isinstance(plan, DryRunPlan)
    assert plan.already_done == 0 and plan.remaining == plan.cells > 0
    assert [s.drafter for s in plan.servers] == [d.name for d in campaign.drafters]
    assert [s.drafter for s in server_plans(campaign)] == [s.drafter for s in plan.servers]
    doc = plan.as_dict()
    assert doc["remaining"] == plan.cells and doc["gpu"]["backend"] == "twin"
    assert all("argv" not in s for s in doc["servers"])  # the twin starts no server
