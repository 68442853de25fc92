"""Helpers for tests that run dvfs's real NVML backend against the fake `pynvml`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
FAKE_DIR = REPO / "tests" / "fakes" / "nvml"

NVML_CAMPAIGN = """
[campaign]
name = "nvml-small"

[gpu]
backend = "nvml"
devices = [0]

[knobs]
sm_clock = [1980, 1500]
power_limit = [700, 400]
settle_s = 0.0

[engine]
backend = "twin"
model = "llama-3.1-8b"

[drafters.none]
algorithm = "none"

[workload]
batch = [1]
corpora = ["code"]
input_tokens = [16, 2048]
output_tokens = {output_tokens}

[measurement]
warmup_tokens = 0
min_window_s = 0.05
max_rounds = 1
repeats = {repeats}
sample_period_s = 0.01
idle_s = 0.05
# real time: the protocol's minute-long steps off (tests/test_protocol.py covers them)
thermal_max_s = 0
settle = 0
idle_per_setting = false
"""


def fresh_fake(tmp_path: Path, monkeypatch: Any, devices: str) -> ModuleType:
    """The fake pynvml on a fresh state of `devices` (its profiles, comma-separated) in
    `tmp_path`, for this process and the dvfs processes a test starts (the environment)."""
    monkeypatch.setenv("DVFS_FAKE_NVML_STATE", str(tmp_path / "fake-nvml.json"))
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", devices)
    module = load_fake()
    module.fake_reset_state()
    return module


def load_fake() -> ModuleType:
    """The fake pynvml, imported from its file under its own name (no clash with the real one)."""
    spec = importlib.util.spec_from_file_location("fake_pynvml", FAKE_DIR / "pynvml.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["fake_pynvml"] = module
    spec.loader.exec_module(module)
    return module


def fake_env(tmp: Path, **extra: str) -> dict[str, str]:
    """Environment for a subprocess whose `import pynvml` finds the fake."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_DIR), str(REPO)])
    env["PYTHONUNBUFFERED"] = "1"
    env["DVFS_FAKE_NVML_STATE"] = str(tmp / "fake-nvml.json")
    env["DVFS_FAKE_NVML_DEVICES"] = "h100-sxm,h100-sxm"
    env["DVFS_STATE_DIR"] = str(tmp / "dvfs-state")
    env.update(extra)
    return env


def root_fake_env(tmp: Path, monkeypatch: Any) -> dict[str, str]:
    """`fake_env`, also set in this process (for `load_fake` and in-process runs), with the
    fake NVML run as root: the `env` fixture of the tests that change a fake GPU's knobs."""
    environment = fake_env(tmp)
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_STATE_DIR"):
        monkeypatch.setenv(key, environment[key])
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "1")
    return environment


def installed_root_fake(tmp: Path, monkeypatch: Any) -> ModuleType:
    """The fake pynvml, fresh, run as root (`root_fake_env`) and installed as `pynvml` for
    in-process CLI runs: the `nvml` fixture of the tests that drive dvfs in process."""
    root_fake_env(tmp, monkeypatch)
    module = load_fake()
    module.fake_reset_state()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


@pytest.fixture(name="env")
def root_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The `env` fixture of tests that change a fake GPU's knobs in process (`root_fake_env`):
    a module imports it with `fresh_nvml` to have both."""
    return root_fake_env(tmp_path, monkeypatch)


@pytest.fixture(name="nvml")
def installed_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The `nvml` fixture of tests that drive dvfs in process as root (`installed_root_fake`):
    a module imports it to have it."""
    return installed_root_fake(tmp_path, monkeypatch)


@pytest.fixture(name="nvml")
def fresh_nvml(env: dict[str, str]) -> ModuleType:
    """The fake pynvml on its default GPUs, fresh, in `env`'s state."""
    module = load_fake()
    module.fake_reset_state()
    return module


def dvfs_in_process(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m dvfs ARGS` with ENV, run in this process: ENV set for the call and `import
    pynvml` finding the fake, as in a subprocess, but without an interpreter start and dvfs's
    imports (a second of CPU each). For commands that neither a signal nor a hang must reach."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    saved = sys.modules.get("pynvml")
    sys.modules["pynvml"] = load_fake()
    try:
        result = CliRunner().invoke(cli, list(args), env=env)
    finally:
        if saved is None:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = saved
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


def _starved() -> int:
    from dvfs.measure.meter import Q_COUNTER_STALLED, Q_FEW_COUNTER_UPDATES, Q_FEW_SAMPLES

    return Q_FEW_SAMPLES | Q_COUNTER_STALLED | Q_FEW_COUNTER_UPDATES


#: What a starved sampler flags: the fake's readings are taken in real time, so on a busy
#: machine a cell may miss samples or counter updates and be invalid for that alone.
STARVED = _starved()


def cube_as_on_an_idle_machine(out: Path, env: dict[str, str]) -> str:
    """The cube of the sweep in OUT rebuilt (`dvfs cube build`) from its journal with the
    `STARVED` flags cleared and every other flag kept: the cube and the analyses a test checks
    then see only the flags it is about, whatever the machine's load did to the sampling."""
    from dvfs.measure.meter import INVALIDATING

    journal = out / "journal.jsonl"
    lines = []
    for line in journal.read_text().splitlines():
        record = json.loads(line)
        measurement = record.get("measurement") if record.get("type") == "cell" else None
        if measurement is not None:
            quality = int(measurement["quality"]) & ~STARVED
            measurement.update(quality=quality, valid=not quality & INVALIDATING)
        lines.append(json.dumps(record))
    journal.write_text("\n".join(lines) + "\n")
    built = dvfs_in_process("cube", "build", str(out), env=env)
    assert built.returncode == 0, built.stdout + built.stderr
    return str(out / "cube.nc")
