"""The caps unit at boot stopped (`systemctl stop`, a shutdown: SIGTERM) while it waits for the
NVIDIA driver: the journal says in one line that it was stopped and that no cap was applied."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from nvml_support import fake_env


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_driver_wait_says_no_cap_was_applied(
    tmp_path: Path, signum: int
) -> None:
    """`dvfs cap apply --wait-for-driver 300`, the kernel module not loaded yet, ended by
    SIGTERM: it exited 143 saying nothing after its "waiting" line, so the journal did not
    say whether any cap was in place. It says so in one line, and no GPU was changed."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1", DVFS_FAKE_NVML_DEVICES="h100-sxm")
    listed = subprocess.run(
        [sys.executable, "-m", "dvfs", "gpu", "list", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    gpu = json.loads(listed.stdout)[0]
    caps = tmp_path / "caps.toml"
    caps.write_text(f'[[gpu]]\nuuid = "{gpu["uuid"]}"\npower_limit_w = 450.0\n')
    env["DVFS_FAKE_NVML_INIT_ERROR"] = "9"  # NVML_ERROR_DRIVER_NOT_LOADED
    process = subprocess.Popen(
        [sys.executable, "-m", "dvfs", "cap", "apply", str(caps), "--wait-for-driver", "300"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    waiting = process.stderr.readline()  # once said, the wait has begun
    assert "waiting up to 300 s" in waiting, waiting
    process.send_signal(signum)
    out, err = process.communicate()
    assert process.returncode == 128 + signum, (out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, lines
    name = signal.Signals(signum).name
    assert lines[0] == (
        f"Interrupted (received {name} while waiting for the NVIDIA kernel module to load: "
        "nothing changed, no cap applied; start it again once the driver is loaded)."
    ), lines
    del env["DVFS_FAKE_NVML_INIT_ERROR"]
    state = subprocess.run(
        [sys.executable, "-m", "dvfs", "gpu", "list", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(state.stdout)[0] == gpu
