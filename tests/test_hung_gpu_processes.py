"""A GPU whose driver hangs holds back only itself where dvfs lists every GPU's compute
processes (`dvfs.gpu.nvml.gpu_processes`: where a sweep's started server really runs, its
`gpu_pinning`). All GPUs were read on one NVML worker, so the GPUs after the hung one were
refused at once ("not attempted"): their processes unknown though they answer, the server on
the metered GPU not found. Runs `dvfs sweep` against the fake pynvml in a child process (the
hung call never returns; the child exits with it); the run is bounded only so that a broken
test does not hang."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from nvml_support import fake_env, fresh_fake
from sglang_support import running, stub_campaign

STUCK_S = 300.0  # a run that takes this long is stuck, not slow
DEVICES = "h100-sxm,h100-sxm,h100-sxm"

pytestmark = pytest.mark.slow


@pytest.fixture
def nv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The fake pynvml on a fresh three-GPU state in `tmp_path` (this process and the sweep's)."""
    return fresh_fake(tmp_path, monkeypatch, DEVICES)


def test_a_server_on_the_metered_gpu_is_found_beside_a_hung_gpu(
    nv: ModuleType, tmp_path: Path
) -> None:
    """A sweep on GPU 2 while GPU 1's UUID read hangs (a GPU the sweep never opens): GPU 2's
    processes and memory were not attempted (GPU 1's call had not returned on the one worker),
    so the server dvfs started on GPU 2 was journalled as listed on no GPU, GPU 2 unlisted and
    its UUID unknown to NVML. Each GPU is read on its own worker now: only GPU 1 is unknown,
    as a lost GPU is."""
    path, marker = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        gpu='backend = "nvml"\ndevices = [2]',
    )
    out = tmp_path / "out"
    env = fake_env(
        tmp_path,
        DVFS_FAKE_NVML_DEVICES=DEVICES,
        DVFS_NVML_DEADLINE_S="5",  # a deadline a healthy call keeps however loaded the machine
        DVFS_FAKE_NVML_HANG="nvmlDeviceGetUUID@1=inf",
    )
    result = subprocess.run(
        [sys.executable, "-m", "dvfs", "sweep", str(path), "--out", str(out), "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=STUCK_S,
    )
    assert running(marker) == []  # the server was stopped
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    records = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    [server] = [r for r in records if r["type"] == "server"]
    uuid = nv.fake_state()["devices"][2]["uuid"]
    pinning = server["gpu_pinning"]
    # Unverified all the same (a GPU NVML cannot list might hold one of the server's
    # processes: `pinning_outcome`), for GPU 1 alone: GPU 2 was said unlisted, the server on
    # no GPU and GPU 2's UUID unknown to NVML
    assert pinning.startswith("unverified: NVML cannot list the compute processes of GPU 1 ("), (
        pinning
    )
    assert "GPU 2" not in pinning and uuid not in pinning, pinning
    assert "lists none of the server's" not in pinning, pinning
