"""The one line naming the GPUs a command could not open (`dvfs.backends.lost_gpus`) says
GPUs that failed alike once ("GPU 0, GPU 1: what failed on each"), as the restores' line does,
and a hung call's advice once: each GPU's whole text, the advice repeated in every one, made
six hung GPUs' line overrun the bound of an error line, and its end, what to run, was cut off.
The CLI runs `dvfs` against the fake pynvml in a child process (the hung calls never return;
the child exits with them), bounded only so that a broken test does not hang."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from nvml_support import fake_env, load_fake

from dvfs.backends import lost_gpus
from dvfs.errors import GpuError, GpuUnavailableError
from dvfs.gpu.deadline import GpuTimeoutError

#: What a hung call's error ends with (`dvfs.gpu.deadline.DeadlineExceeded.describe`).
NOT_RESPONDING = (
    "the driver is not responding (see `nvidia-smi` and the kernel log for Xid errors; "
    "$DVFS_NVML_DEADLINE_S sets the deadline)"
)
STUCK_S = 120.0  # a run that takes this long is stuck, not slow
EIGHT = ",".join(["h100-sxm"] * 8)
PLAN = """dvfs_batch_plan = 1
[meta]
measured_on = "NVIDIA H100 80GB HBM3"
drafter = "none"
[[batch]]
batch = 1
sm_clock_mhz = 1200
power_limit_w = 400
"""


def hung_whole(gpus: range) -> str:
    """A `DVFS_FAKE_NVML_HANG` under which every call dvfs makes on `gpus` hangs."""
    calls = ("nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetSupportedMemoryClocks")
    return ",".join(f"{fn}@{i}=inf" for i in gpus for fn in calls)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Eight fake GPUs, GPUs 0-5 hanging whole (a deadline a healthy call keeps however
    loaded the machine)."""
    environment = fake_env(
        tmp_path,
        DVFS_FAKE_NVML_DEVICES=EIGHT,
        DVFS_FAKE_NVML_ROOT="1",
        DVFS_NVML_DEADLINE_S="5",
        DVFS_FAKE_NVML_HANG=hung_whole(range(6)),
    )
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_STATE_DIR"):
        monkeypatch.setenv(key, environment[key])
    return environment


@pytest.fixture
def nvml(env: dict[str, str]) -> ModuleType:
    module = load_fake()
    module.fake_reset_state()
    return module


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("Error: ") and "Traceback" not in result.stderr, result.stderr
    assert not line.endswith("..."), line  # not cut
    return line


def test_govern_names_six_hung_gpus_once_and_says_what_to_run(
    env: dict[str, str], nvml: ModuleType, tmp_path: Path
) -> None:
    """`dvfs govern` with no --gpu on eight GPUs, 0-5 hanging whole: the line named each
    hung GPU with the driver's advice (six times), overran the bound and was cut in GPU 5's,
    so that what to do (--gpu, with the GPUs that open) was never said. Now: every hung GPU
    named, the advice once, and the line ends with what to do; exit 1 as before."""
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    result = subprocess.run(
        [sys.executable, "-m", "dvfs", "govern", "--plan", str(plan), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=STUCK_S,
    )
    assert result.returncode == 1, result.stderr
    line = error_line(result)
    six = ", ".join(f"GPU {i}" for i in range(6))
    assert line.startswith(
        f"Error: {six}: nvmlDeviceGetUUID on each did not return within 5 s; {NOT_RESPONDING}; "
    ), line
    assert line.count("the driver is not responding") == 1, line
    assert line.endswith(
        "name the GPUs the server runs on with --gpu (those that open: GPU 6, GPU 7)"
    ), line
    assert nvml.fake_calls() == []


def lost(text: str, *, index: int | None = None, uuid: str | None = None) -> GpuError:
    exc = GpuTimeoutError(text)
    exc.index, exc.uuid = index, uuid
    return exc


def hung(call: str, where: str) -> str:
    return f"{call} on {where} did not return within 5 s; {NOT_RESPONDING}"


UUIDS = [f"GPU-{n}a2b3c4d-0000-4000-8000-00000000000{n}" for n in range(4)]


def test_gpus_named_by_uuid_or_not_known_are_grouped_each_still_named() -> None:
    """GPUs named by UUID whose handle's read hung: one entry naming each UUID; a GPU whose
    opening hung past its UUID (its text names its index) is grouped by that index, known or
    not; GPUs that failed otherwise keep their own text, in order; one GPU's error is its own."""
    line = str(
        lost_gpus(
            [
                lost(hung("nvmlDeviceGetHandleByUUID", UUIDS[0]), uuid=UUIDS[0]),
                lost(hung("nvmlDeviceGetHandleByUUID", UUIDS[1].upper()), uuid=UUIDS[1]),
                lost(hung("nvmlDeviceGetUUID", "GPU 2"), uuid=UUIDS[2]),
                lost(hung("nvmlDeviceGetUUID", "GPU 3"), index=3, uuid=UUIDS[3]),
                lost("cannot open GPU 12: the GPU has fallen off the bus", index=12),
                lost(hung("nvmlDeviceGetName", "GPU 1 (GPU-ffff)"), index=1),
            ]
        )
    )
    assert line == (
        f"{UUIDS[0]}, {UUIDS[1].upper()}: nvmlDeviceGetHandleByUUID on each did not return "
        "within 5 s; GPU 2, GPU 3: nvmlDeviceGetUUID on each did not return within 5 s; cannot "
        "open GPU 12: the GPU has fallen off the bus; nvmlDeviceGetName on GPU 1 (GPU-ffff) did "
        f"not return within 5 s; {NOT_RESPONDING}"
    ), line
    one = lost(hung("nvmlDeviceGetUUID", "GPU 0"), index=0)
    assert lost_gpus([one]) is one
    assert isinstance(lost_gpus([one, lost(hung("x", "GPU 1"), index=1)]), GpuUnavailableError)


def test_texts_that_do_not_name_their_gpu_are_kept_whole() -> None:
    """Two GPUs' errors that do not say which GPU they are: both kept, not said as one."""
    same = "cannot read the driver version: Unknown Error"
    assert str(lost_gpus([lost(same, index=0), lost(same, index=1)])) == f"{same}; {same}"
