"""A GPU whose driver hangs holds back only itself where dvfs reads every GPU's UUID
(`dvfs.gpu.nvml.machine_uuids`: CUDA_VISIBLE_DEVICES is read against them, and a GPU named by
UUID that does not open is given its index by them). The hung call's overrun was no NVML
error, so it stopped the whole listing, and with it every command that reads the variable,
even for a job not given that GPU. Runs `dvfs` against the fake pynvml in a child process;
the hang never ends (the child exits with its stuck driver call), and the runs are bounded only
so that a broken test does not hang."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from nvml_support import NVML_CAMPAIGN, fake_env, load_fake

STUCK_S = 120.0  # a run that takes this long is stuck, not slow
FOUR = ",".join(["h100-sxm"] * 4)
#: GPU 1's driver hangs whole: every call dvfs makes on it past its handle.
HUNG = ",".join(
    f"{fn}@1=inf"
    for fn in (
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetSupportedMemoryClocks",
        "nvmlDeviceGetPowerManagementLimit",
        "nvmlDeviceResetGpuLockedClocks",
        "nvmlDeviceSetPowerManagementLimit",
    )
)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Four fake GPUs run as root, GPU 1's driver hanging whole (a deadline a healthy call
    keeps however loaded the machine)."""
    environment = fake_env(
        tmp_path,
        DVFS_FAKE_NVML_DEVICES=FOUR,
        DVFS_FAKE_NVML_ROOT="1",
        DVFS_NVML_DEADLINE_S="5",
        DVFS_FAKE_NVML_HANG=HUNG,
    )
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_STATE_DIR"):
        monkeypatch.setenv(key, environment[key])
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "1")
    return environment


@pytest.fixture
def nvml(env: dict[str, str]) -> ModuleType:
    module = load_fake()
    module.fake_reset_state()
    return module


def uuid(nvml: ModuleType, index: int) -> str:
    return str(nvml.fake_device_state(index)["uuid"])


def run(env: dict[str, str], *args: str, visible: str = "") -> subprocess.CompletedProcess[str]:
    environment = {**env, "CUDA_VISIBLE_DEVICES": visible}
    return subprocess.run(
        [sys.executable, "-m", "dvfs", *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=STUCK_S,
    )


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("Error: ") and "Traceback" not in result.stderr, result.stderr
    return line


@pytest.mark.parametrize("by", ["uuid", "index"])
def test_cap_reset_of_the_jobs_gpus_is_not_stopped_by_another_gpus_hung_driver(
    env: dict[str, str], nvml: ModuleType, by: str
) -> None:
    """A job given GPUs 0 and 2 (CUDA_VISIBLE_DEVICES, by UUID or index) while GPU 1, not
    its, hangs: `dvfs cap reset` refused the job's GPUs, exit 1, naming GPU 1's hung UUID
    read, and reset none. GPU 1's UUID is now unknown, as a lost GPU's is: GPUs 0 and 2 are
    reset, exit 0, and GPUs 1 and 3, not the job's, are left as they are."""
    for index in range(4):
        nvml.fake_update_device(index, locked_clocks=[1500, 1500], power_limit_mw=400_000)
    visible = f"{uuid(nvml, 0)},{uuid(nvml, 2)}" if by == "uuid" else "0,2"
    result = run(env, "cap", "reset", visible=visible)
    assert result.returncode == 0, result.stderr
    for index in (0, 2):
        assert f"GPU {index} ({uuid(nvml, index)}): clocks unlocked" in result.stdout
        found = nvml.fake_device_state(index)
        assert found["locked_clocks"] is None and found["power_limit_mw"] == 700_000
    for index in (1, 3):
        assert nvml.fake_device_state(index)["locked_clocks"] == [1500, 1500]
    assert {c["index"] for c in nvml.fake_calls()} == {0, 2}
    assert "Traceback" not in result.stderr


def test_a_sweep_on_the_jobs_gpu_named_by_uuid_runs_while_another_gpu_hangs(
    env: dict[str, str], nvml: ModuleType, tmp_path: Path
) -> None:
    """`dvfs sweep --gpus UUID` of a job given GPUs 0 and 2 while GPU 1 hangs: refused, exit 1,
    GPU 1's hung UUID read named, though the sweep never touches it. It runs, exit 0."""
    campaign = tmp_path / "nvml.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    visible = f"{uuid(nvml, 0)},{uuid(nvml, 2)}"
    out = tmp_path / "out"
    result = run(
        env,
        *("sweep", str(campaign), "--gpus", uuid(nvml, 2), "--out", str(out), "--no-progress"),
        visible=visible,
    )
    assert result.returncode == 0, result.stderr
    assert (out / "cube.nc").is_file()
    assert {c["index"] for c in nvml.fake_calls()} == {2}
    assert "GPU 1" not in result.stdout + result.stderr


def test_a_hung_gpu_named_by_its_uuid_and_its_index_is_named_twice(
    env: dict[str, str], nvml: ModuleType
) -> None:
    """`dvfs gpu reset UUID 1`, GPU 1's UUID and its index, while GPU 1 hangs: its UUID's
    index was not known (every UUID's read stopped at GPU 1's), so the one GPU was named as
    two that did not open, its hung read said twice, exit 1. Its index is now known (the only
    GPU whose UUID cannot be read, as for a lost GPU): named twice, exit 2, as a GPU that
    opens is."""
    result = run(env, "gpu", "reset", uuid(nvml, 1), "1")
    assert result.returncode == 2, result.stderr
    line = error_line(result)
    assert f"GPU 1 (as {uuid(nvml, 1)} and 1) is named twice" in line, line
    assert nvml.fake_calls() == []
