"""The caps unit at boot stopped (`systemctl stop`, a shutdown: SIGTERM) while it waits for the
NVIDIA driver: the journal says in one line that it was stopped and that no cap was applied."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nvml_support import fake_env


def _listed(env: dict[str, str]) -> list[dict[str, object]]:
    """What `dvfs gpu list --json` shows under `env`."""
    listed = subprocess.run(
        [sys.executable, "-m", "dvfs", "gpu", "list", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return list(json.loads(listed.stdout))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_driver_wait_says_no_cap_was_applied(
    tmp_path: Path, signum: int
) -> None:
    """`dvfs cap apply --wait-for-driver 300`, the kernel module not loaded yet, ended by
    SIGTERM: it exited 143 saying nothing after its "waiting" line, so the journal did not
    say whether any cap was in place. It says so in one line, and no GPU was changed."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1", DVFS_FAKE_NVML_DEVICES="h100-sxm")
    listed_gpus = _listed(env)
    gpu = listed_gpus[0]
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
    state_gpus = _listed(env)
    assert state_gpus[0] == gpu


def _caps_for_every_gpu(tmp_path: Path, env: dict[str, str]) -> tuple[Path, list[str]]:
    """A caps file capping every GPU `dvfs gpu list` shows at 1410 MHz and 450 W, and their
    UUIDs."""
    listed_gpus = _listed(env)
    uuids = [str(g["uuid"]) for g in listed_gpus]
    caps = tmp_path / "caps.toml"
    caps.write_text(
        "".join(
            f'[[gpu]]\nuuid = "{u}"\nsm_clock_max_mhz = 1410\npower_limit_w = 450.0\n\n'
            for u in uuids
        )
    )
    return caps, uuids


def _sigterm_as_the_first_power_read_hangs(
    tmp_path: Path, env: dict[str, str], args: list[str]
) -> tuple[int, str, str]:
    """`dvfs ARGS` with GPU 0's power-limit read hung (the fake NVML's hang file says when),
    sent SIGTERM there: its exit code, stdout and stderr."""
    hung = {**env, "DVFS_FAKE_NVML_HANG": "nvmlDeviceGetPowerManagementLimit@0=3600"}
    hangs = tmp_path / "fake-nvml.json.hangs"
    process = subprocess.Popen(
        [sys.executable, "-m", "dvfs", *args],
        env=hung,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not hangs.exists():  # the read hangs (the process would have ended otherwise)
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate()
    return process.returncode, out, err


def test_a_sigterm_mid_apply_says_which_gpus_are_capped_and_which_not(tmp_path: Path) -> None:
    """The caps unit stopped (a shutdown) while `cap apply` capped the second of two GPUs:
    the journal had "applied to GPU 0 ..." and "Interrupted (received SIGTERM).", with no word
    of GPU 1, whose clock lock was in place already. The last line says GPU 0 is capped, GPU 1
    not or in part, and what finishes or undoes it; `cap reset --applied` puts both back."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1", DVFS_NVML_DEADLINE_S="3600")
    caps, _ = _caps_for_every_gpu(tmp_path, env)
    hung = {**env, "DVFS_FAKE_NVML_HANG": "nvmlDeviceSetPowerManagementLimit@1=3600"}
    process = subprocess.Popen(
        [sys.executable, "-m", "dvfs", "cap", "apply", str(caps)],
        env=hung,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    first = process.stdout.readline()  # GPU 0 capped whole; GPU 1's power limit hangs
    assert first.startswith("applied to GPU 0 "), first
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate()
    assert process.returncode == 143, (out, err)
    lines = err.splitlines()
    assert "Traceback" not in err and len(lines) == 1, lines
    assert lines[0].startswith(
        "Interrupted (received SIGTERM while applying the caps: caps applied to GPU 0; GPU 1 "
        "not capped, or only in part (dvfs's caps record lists what each holds: `dvfs cap show"
    ), lines
    assert (
        f"`dvfs cap apply {caps}" in lines[0] and "` applies the rest, `dvfs cap reset " in lines[0]
    )
    reset = subprocess.run(
        [sys.executable, "-m", "dvfs", "cap", "reset", "--applied"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert reset.returncode == 0, reset.stdout + reset.stderr


def test_a_sigterm_before_any_gpu_is_changed_says_no_cap_was_applied(tmp_path: Path) -> None:
    """The caps unit stopped (a shutdown) once the driver was loaded but before `cap apply`
    changed a GPU (an NVML read at boot hung while the caps were planned): it exited 143
    without a word, the journal saying nothing of the caps, as the driver wait did before.
    It says in one line that nothing was changed, and no GPU was."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1", DVFS_NVML_DEADLINE_S="3600")
    caps, uuids = _caps_for_every_gpu(tmp_path, env)
    code, out, err = _sigterm_as_the_first_power_read_hangs(
        tmp_path, env, ["cap", "apply", str(caps), "--wait-for-driver", "300"]
    )
    assert code == 143, (out, err)
    assert "Traceback" not in err and out == "", (out, err)
    assert err.splitlines() == [
        "Interrupted (received SIGTERM before any GPU was changed: nothing changed, no cap "
        "applied; start it again)."
    ], err
    assert not (tmp_path / "dvfs-state" / "caps-applied.json").exists()
    after_gpus = _listed(env)
    assert [g["uuid"] for g in after_gpus] == uuids
    state = json.loads((tmp_path / "fake-nvml.json").read_text())
    assert all(d["locked_clocks"] is None for d in state["devices"]), state["devices"]
    assert all(d["power_limit_mw"] == 700_000 for d in state["devices"]), state["devices"]


def test_a_sigterm_before_the_governor_changes_a_gpu_says_none_was_governed(
    tmp_path: Path,
) -> None:
    """`dvfs govern --wait-for-driver` (the governor unit at boot) stopped once the driver was
    loaded but before it changed a GPU (an NVML read hung as it opened the GPUs): it died of
    the SIGTERM without a word, as `cap apply` did in the same window. It says in one line
    that nothing was changed, exit 143, and no GPU was."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1", DVFS_NVML_DEADLINE_S="3600")
    before = _listed(env)
    plan = tmp_path / "plan.toml"
    plan.write_text(
        'dvfs_batch_plan = 1\n[meta]\nmeasured_on = "NVIDIA H100 80GB HBM3"\ndrafter = "none"\n'
        "[[batch]]\nbatch = 1\nsm_clock_mhz = 1200\npower_limit_w = 400\n"
    )
    code, out, err = _sigterm_as_the_first_power_read_hangs(
        tmp_path,
        env,
        ["govern", "--plan", str(plan), "--url", "http://127.0.0.1:9", "--listen", "off"]
        + ["--wait-for-driver", "300"],
    )
    assert code == 143, (out, err)
    assert "Traceback" not in err and out == "", (out, err)
    assert err.splitlines() == [
        "Interrupted (received SIGTERM before any GPU was changed: nothing changed, no GPU "
        "governed; start it again)."
    ], err
    assert not list((tmp_path / "dvfs-state").glob("governed-*.json"))
    state = json.loads((tmp_path / "fake-nvml.json").read_text())
    assert all(d["locked_clocks"] is None for d in state["devices"]), state["devices"]
    assert all(d["power_limit_mw"] == 700_000 for d in state["devices"]), state["devices"]
    after_gpus = _listed(env)
    assert after_gpus == before
