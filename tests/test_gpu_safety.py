"""On real GPUs dvfs leaves every setting as it found it: after success, an exception, SIGTERM,
and SIGKILL followed by `dvfs gpu reset`. Runs the real NVML backend against the fake pynvml,
with the twin engine as the workload."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import default_dispositions
from nvml_support import NVML_CAMPAIGN, dvfs_in_process, load_fake, root_fake_env

from dvfs.backends import Backends
from dvfs.campaign import load_campaign
from dvfs.cli import cli
from dvfs.clock import MonotonicClock
from dvfs.engines.twin import TwinEngine
from dvfs.gpu.nvml import open_nvml_gpus
from dvfs.sweep import run_sweep
from dvfs.twin.device import FreeRunningNode
from dvfs.twin.profiles import gpu_profile, model_profile

SETTERS = (
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetPowerManagementLimit",
    "nvmlDeviceSetPowerManagementLimit_v2",
    "nvmlDeviceSetPersistenceMode",
)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return root_fake_env(tmp_path, monkeypatch)


@pytest.fixture
def nvml(env):
    module = load_fake()
    module.fake_reset_state()
    # Not the default: restoring must put back what was there, not the driver default.
    module.fake_update_device(0, power_limit_mw=650_000)
    return module


@pytest.fixture
def dispositions():
    """Put back the signal handlers a test changes."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture
def hang(nvml, monkeypatch: pytest.MonkeyPatch):
    """Make fake NVML calls hang (`hang("nvmlDeviceResetGpuLockedClocks")`); released after."""

    def start(*calls: str) -> None:
        monkeypatch.setenv("DVFS_FAKE_NVML_HANG", ",".join(f"{c}=inf" for c in calls))

    yield start
    monkeypatch.delenv("DVFS_FAKE_NVML_HANG", raising=False)
    nvml.fake_release_hangs()


def wait_for(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def campaign_file(tmp_path: Path, output_tokens: int = 16, repeats: int = 1) -> Path:
    path = tmp_path / "nvml.toml"
    path.write_text(NVML_CAMPAIGN.format(output_tokens=output_tokens, repeats=repeats))
    return path


def long_campaign(tmp_path: Path) -> Path:
    """Short cells (the first is journaled soon), so many that the sweep is still running when
    a test signals it."""
    return campaign_file(tmp_path, output_tokens=16, repeats=60)


def assert_as_found(nvml, state_dir: Path) -> None:
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] is None
    assert device["power_limit_mw"] == 650_000
    assert not list(state_dir.glob("GPU-*.json")), "state file left behind"


def setter_calls(nvml) -> list[dict]:
    return [c for c in nvml.fake_calls() if c["fn"] in SETTERS]


def test_sweep_restores_after_success(nvml, tmp_path: Path) -> None:
    campaign = load_campaign(campaign_file(tmp_path))
    outcome = run_sweep(campaign, tmp_path / "out", nvml=nvml, state_dir=tmp_path / "dvfs-state")
    assert outcome.summary.measured == 4
    calls = setter_calls(nvml)
    locks = [c["args"] for c in calls if c["fn"] == "nvmlDeviceSetGpuLockedClocks"]
    assert [1980, 1980] in locks and [1500, 1500] in locks
    assert all(c["ok"] for c in calls)
    assert_as_found(nvml, tmp_path / "dvfs-state")
    import dvfs

    ds = dvfs.open_cube(str(outcome.cube_path))
    assert ds["sm_clock"].values.tolist() == [1500, 1980]
    assert ds.attrs["gpu_backend"] == "nvml" and ds.attrs["gpu_name"] == "NVIDIA H100 80GB HBM3"


class FailingEngine:
    """The twin engine, failing on its n-th round (a bug in the middle of a sweep)."""

    name = "twin"

    def __init__(self, inner: TwinEngine, fail_on: int) -> None:
        self.inner, self.fail_on, self.runs = inner, fail_on, 0

    def start(self, drafter):
        return self.inner.start(drafter)

    def run(self, workload):
        self.runs += 1
        if self.runs == self.fail_on:
            raise RuntimeError("boom in the middle of the sweep")
        return self.inner.run(workload)

    def stop(self) -> None:
        self.inner.stop()


def sweep_failing_on(nvml, tmp_path: Path, fail_on: int) -> None:
    """Sweep the small NVML campaign with an engine that raises on its `fail_on`-th round."""
    campaign = load_campaign(campaign_file(tmp_path))
    clock = MonotonicClock()
    inner = TwinEngine(
        FreeRunningNode(gpu_profile("h100-sxm"), clock), model_profile("llama-3.1-8b")
    )
    with open_nvml_gpus([0], nvml=nvml) as gpus, pytest.raises(RuntimeError, match="boom"):
        run_sweep(
            campaign,
            tmp_path / "out",
            backends=Backends(clock, list(gpus), FailingEngine(inner, fail_on)),
            state_dir=tmp_path / "dvfs-state",
        )


def test_sweep_restores_after_an_exception(nvml, tmp_path: Path) -> None:
    sweep_failing_on(nvml, tmp_path, fail_on=3)
    assert any(c["fn"] == "nvmlDeviceSetGpuLockedClocks" for c in setter_calls(nvml))
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_a_sweep_whose_restore_fails_at_the_end_still_writes_its_cube(
    nvml, tmp_path: Path, env
) -> None:
    """Every cell measured and journaled, then NVML refused the clock's reset as the sweep put
    the GPU back: the sweep exited 1 with no cube (a rerun after `dvfs gpu reset` built it).
    The cube is written from the journal all the same, then the restore's failure is the
    sweep's one error line, exit 1, its state file kept for `dvfs gpu reset`."""
    nvml.fake_update_device(0, errors={"nvmlDeviceResetGpuLockedClocks": 999})
    campaign, out = campaign_file(tmp_path), tmp_path / "out"
    swept = dvfs_in_process("sweep", str(campaign), "--out", str(out), "--no-progress", env=env)
    text = " ".join(swept.stderr.split())
    assert swept.returncode == 1, text
    assert "could not restore GPU settings" in text and "dvfs gpu reset" in text, text
    assert f"its cube ({out / 'cube.nc'}), written all the same" in text, text
    assert f"cube: {out / 'cube.nc'}" in swept.stdout and "Traceback" not in text
    import dvfs

    with dvfs.open_cube(str(out / "cube.nc")) as ds:
        assert (ds["cell_status"].values == 1).all() and ds["cell_status"].size == 4
    assert len(list((tmp_path / "dvfs-state").glob("GPU-*.json"))) == 1
    nvml.fake_update_device(0, errors={})
    reset = dvfs_in_process("gpu", "reset", env=env)
    assert reset.returncode == 0, reset.stderr
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_observe_only_never_calls_a_setter(nvml, tmp_path: Path, env, monkeypatch) -> None:
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")  # a user without root can observe
    campaign = load_campaign(campaign_file(tmp_path))
    from dvfs.sweep import observe_only

    outcome = run_sweep(
        observe_only(campaign), tmp_path / "out", nvml=nvml, state_dir=tmp_path / "dvfs-state"
    )
    assert outcome.summary.measured == 1
    assert setter_calls(nvml) == []
    import dvfs

    ds = dvfs.open_cube(str(outcome.cube_path))
    assert ds["sm_clock"].values.tolist() == [1980]  # stock: unlocked, max clock
    assert ds["power_limit"].values.tolist() == [650.0]  # the limit observed, not assumed
    assert ds.attrs["actuation"] == 0


def test_campaign_clocks_are_checked_against_the_device(nvml, tmp_path: Path) -> None:
    from dvfs.errors import CampaignError

    path = tmp_path / "bad.toml"
    path.write_text(
        NVML_CAMPAIGN.format(output_tokens=16, repeats=1).replace(
            "sm_clock = [1980, 1500]", "sm_clock = [1980, 2100]"
        )
    )
    with pytest.raises(CampaignError, match="2100 MHz is not a supported SM clock of GPU 0"):
        run_sweep(
            load_campaign(path), tmp_path / "out", nvml=nvml, state_dir=tmp_path / "dvfs-state"
        )
    assert setter_calls(nvml) == []
    assert not (tmp_path / "out").exists()  # no journal binding the folder to the bad clocks


def doctor_checks(campaign: Path, out: Path, env: dict[str, str]) -> dict[str, dict]:
    """`dvfs doctor --json`'s checks by name."""
    result = dvfs_in_process("doctor", str(campaign), "--out", str(out), "--json", env=env)
    return {c["name"]: c for c in json.loads(result.stdout)}


def test_the_reset_an_earlier_runs_changes_call_for_names_the_state_dir_sudo_drops(
    nvml, tmp_path: Path, env
) -> None:
    """A GPU holding an earlier run's changes, its state file in $DVFS_STATE_DIR: the sweep's
    refusal said "Run `dvfs gpu reset` (as root)" and the doctor "run `dvfs gpu reset`", but
    `sudo` drops the environment, so that reset, run as root, looked in /var/lib/dvfs: 'No
    dvfs state files ... nothing to restore', the GPU left changed. Both name the folder;
    followed where the variable names another (as it does not reach the command), it
    restores the GPU."""
    import re

    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    state_dir = Path(env["DVFS_STATE_DIR"])
    nvml.fake_update_device(0, locked_clocks=[210, 1500], power_limit_mw=400_000)
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        StateStore(state_dir).record(GpuSettings(gpu.identity.uuid, None, 650_000))  # a dead run's
    path, out = campaign_file(tmp_path), tmp_path / "out"
    refused = dvfs_in_process("sweep", str(path), "--out", str(out), "--no-progress", env=env)
    assert refused.returncode == 3, refused.stderr
    [advised] = re.findall(r"Run `([^`]*)` \(as root\)", " ".join(refused.stderr.split()))
    assert advised == f"dvfs gpu reset --state-dir {state_dir}", advised
    said = doctor_checks(path, out, env)["state"]["detail"]
    assert said.endswith(f" - run `{advised}`"), said
    sudo = {**env, "DVFS_STATE_DIR": str(tmp_path / "elsewhere")}  # the environment root has
    followed = dvfs_in_process(*shlex.split(advised)[1:], env=sudo)
    assert followed.returncode == 0 and "restored GPU 0" in followed.stdout, followed.stdout
    assert_as_found(nvml, state_dir)


def test_a_sweep_refused_at_the_gpu_leaves_its_folder_as_it_found_it(
    nvml, tmp_path: Path, env
) -> None:
    """A GPU another dvfs holds, or one holding an earlier run's changes (exit 3), and clocks
    it does not support (exit 2) are refused once the journal is open, before anything is
    measured. Such a refusal once left a journal holding only its header (and the folder it
    made, with its lock): the corrected campaign was then refused in that folder ("measured
    with other settings", use --fresh) and `dvfs cube build` failed on it. Now the folder is
    left as it was found, and the corrected campaign runs into it."""
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import GpuLocks, StateStore

    state_dir = tmp_path / "dvfs-state"
    corrected = campaign_file(tmp_path)
    text = corrected.read_text()
    first = tmp_path / "first.toml"
    first.write_text(text.replace("sm_clock = [1980, 1500]", "sm_clock = [1980, 1410]"))
    unsupported = tmp_path / "unsupported.toml"
    unsupported.write_text(text.replace("sm_clock = [1980, 1500]", "sm_clock = [1980, 2100]"))
    made = tmp_path / "made" / "out"  # folders the sweep makes
    found = tmp_path / "found"  # a folder that was there, empty
    found.mkdir()

    def sweep(campaign: Path, out: Path) -> subprocess.CompletedProcess:
        return dvfs_in_process("sweep", str(campaign), "--out", str(out), "--no-progress", env=env)

    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        with GpuLocks(state_dir).hold([gpu]):  # another dvfs on the GPU
            for out in (made, found):
                busy = sweep(first, out)
                assert busy.returncode == 3, busy.stderr
                assert "in use by another dvfs process" in busy.stderr
                assert not (tmp_path / "made").exists() and list(found.iterdir()) == []
            # doctor fails the GPU the sweep refuses, in its words (it said ok), touching nothing
            checked = doctor_checks(first, made, env)
            assert checked["lock GPU 0"]["status"] == "fail"
            assert checked["lock GPU 0"]["detail"] in " ".join(busy.stderr.split())
            assert not (tmp_path / "made").exists()
        assert doctor_checks(first, made, env)["lock GPU 0"]["status"] == "ok"
        store = StateStore(state_dir)
        store.record(GpuSettings(gpu.identity.uuid, None, gpu.power_limit_mw()))  # a dead run's
        pending = sweep(first, made)
        assert pending.returncode == 3 and "dvfs gpu reset" in pending.stderr, pending.stderr
        assert not (tmp_path / "made").exists()
        store.clear(gpu.identity.uuid)
    bad_clock = sweep(unsupported, made)
    assert bad_clock.returncode == 2 and "2100 MHz" in bad_clock.stderr, bad_clock.stderr
    assert not (tmp_path / "made").exists()
    assert setter_calls(nvml) == []
    swept = sweep(corrected, made)
    assert swept.returncode == 0, swept.stderr
    assert "4 cell(s) measured" in swept.stderr
    assert_as_found(nvml, state_dir)


def test_doctor_observe_only_does_not_call_unstepped_knobs_supported(tmp_path: Path, env) -> None:
    """`doctor --observe-only` checks the campaign as `sweep --observe-only` runs it, its
    clock and power-limit lists dropped: its knobs line once said "every clock and power limit
    of the campaign is supported" of a campaign whose 2100 MHz and 150 W the GPU refuses (and
    the sweep without --observe-only refuses, exit 2). It now says none is set, as the sweep's
    note does."""
    campaign = tmp_path / "unsupported.toml"
    text = campaign_file(tmp_path).read_text()
    campaign.write_text(
        text.replace("sm_clock = [1980, 1500]", "sm_clock = [1980, 2100]").replace(
            "power_limit = [700, 400]", "power_limit = [700, 150]"
        )
    )
    out = tmp_path / "out"
    result = dvfs_in_process(
        "doctor", str(campaign), "--observe-only", "--out", str(out), "--json", env=env
    )
    knobs = {c["name"]: c for c in json.loads(result.stdout)}["knobs"]
    assert knobs["status"] == "ok", knobs
    assert "supported" not in knobs["detail"] and "observe-only" in knobs["detail"], knobs
    assert "stock" in knobs["detail"], knobs
    stepped = doctor_checks(campaign, out, env)["knobs"]  # without --observe-only: refused
    assert stepped["status"] == "fail" and "2100 MHz" in stepped["detail"], stepped


def test_a_state_file_from_before_a_reboot_neither_fails_doctor_nor_refuses_a_sweep(
    nvml, tmp_path: Path, env
) -> None:
    """A power loss leaves a dead run's state file, but the reboot reset the GPU: the file
    holds no unrestored change (`gpu reset` only drops it). doctor must not fail the GPU's
    state for it, nor the sweep refuse the GPU (exit 3) and ask for a `gpu reset` "to restore
    the recorded settings"; the sweep's own file takes its place, and it restores as ever."""
    if not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("the kernel gives no boot id here")
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    state_dir = tmp_path / "dvfs-state"
    campaign = campaign_file(tmp_path)
    store = StateStore(state_dir)
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        uuid = gpu.identity.uuid
        store.record(GpuSettings(uuid, (210, 1410), 500_000))  # a dead run's, an earlier boot
    store.path(uuid).write_text(
        json.dumps({**json.loads(store.path(uuid).read_text()), "boot": "an-earlier-boot"})
    )
    out = tmp_path / "out"
    checked = doctor_checks(campaign, out, env)
    assert checked["state"]["status"] == "ok", checked["state"]
    assert store.pending(), "doctor changes nothing"
    swept = dvfs_in_process("sweep", str(campaign), "--out", str(out), "--no-progress", env=env)
    assert swept.returncode == 0, swept.stderr
    assert_as_found(nvml, state_dir)


def _dvfs(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dvfs", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _start_sweep(campaign: Path, out: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dvfs", "sweep", str(campaign), "--out", str(out), "--no-progress"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_dispositions,
    )


def _wait_until_changed(nvml, proc: subprocess.Popen, journal: Path, timeout_s: float = 60) -> None:
    """Until the sweep has locked a clock and journaled at least one cell."""
    deadline = time.monotonic() + timeout_s
    while True:
        locked = nvml.fake_device_state(0)["locked_clocks"] is not None
        cells = journal.exists() and '"type":"cell"' in journal.read_text()
        if locked and cells:
            return
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the sweep never changed the GPU"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_then_gpu_reset_restores(nvml, tmp_path: Path, env) -> None:
    campaign = campaign_file(tmp_path, output_tokens=16, repeats=1)
    out = tmp_path / "out"
    state_dir = tmp_path / "dvfs-state"
    # The killed sweep's own restore hangs in the driver, so however soon it ends its cells the
    # kill finds the GPU changed (a short campaign: the resume below measures what is left).
    stuck_restore = {
        **env,
        "DVFS_NVML_DEADLINE_S": "0",
        "DVFS_FAKE_NVML_HANG": "nvmlDeviceResetGpuLockedClocks=inf",
    }
    proc = _start_sweep(campaign, out, stuck_restore)
    try:
        _wait_until_changed(nvml, proc, out / "journal.jsonl")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert nvml.fake_device_state(0)["locked_clocks"] is not None  # the GPU kept the change
    [state_file] = state_dir.glob("GPU-*.json")
    assert json.loads(state_file.read_text())["original"]["power_limit_mw"] == 650_000
    refused = dvfs_in_process("sweep", str(campaign), "--out", str(out), "--no-progress", env=env)
    assert refused.returncode == 3, refused.stderr
    assert "not restored" in refused.stderr and "dvfs gpu reset" in refused.stderr
    reset = dvfs_in_process("gpu", "reset", env=env)
    assert reset.returncode == 0, reset.stderr
    assert "restored GPU 0" in reset.stdout
    assert_as_found(nvml, state_dir)
    resumed = dvfs_in_process("sweep", str(campaign), "--out", str(out), "--no-progress", env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert_as_found(nvml, state_dir)


@pytest.mark.slow
def test_a_second_sweep_on_the_same_gpu_refuses_and_sigterm_restores(
    nvml, tmp_path: Path, env
) -> None:
    """While a sweep holds the GPU a second one is refused, naming it; SIGTERM then ends the
    first (exit 143) with every setting as it found it."""
    campaign = long_campaign(tmp_path)
    first = _start_sweep(campaign, tmp_path / "first", env)
    try:
        _wait_until_changed(nvml, first, tmp_path / "first" / "journal.jsonl")
        second = dvfs_in_process(
            "sweep", str(campaign), "--out", str(tmp_path / "second"), "--no-progress", env=env
        )
        assert second.returncode == 3, second.stderr
        assert "in use by another dvfs process" in second.stderr
        assert f"pid {first.pid}" in second.stderr
        assert first.poll() is None, "the first sweep must still be running for the signal"
        first.send_signal(signal.SIGTERM)
        output, _ = first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, output
    assert "GPU settings restored" in output
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_gpu_commands_read_only(nvml, env, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # the CLI's `import pynvml` finds the fake
    runner = CliRunner()
    listed = runner.invoke(cli, ["gpu", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert [r["index"] for r in rows] == [0, 1] and rows[0]["power_limit_w"] == 650
    info = runner.invoke(cli, ["gpu", "info", "0", "--json"])
    assert info.exit_code == 0, info.output
    [detail] = json.loads(info.output)
    assert detail["power_limit_w"] == {
        "min": 200,
        "max": 700,
        "default": 700,
        "current": 650,
        "enforced": 650,
    }
    assert detail["supported_sm_clocks_mhz"]["count"] == 119
    assert detail["energy_counter"] and detail["persistence_mode"] is True
    nothing = runner.invoke(cli, ["gpu", "reset"])
    assert nothing.exit_code == 0 and "nothing to restore" in nothing.output
    assert setter_calls(nvml) == []


def test_no_driver_message(env, monkeypatch) -> None:
    monkeypatch.setenv("DVFS_FAKE_NVML_MISSING", "1")
    result = dvfs_in_process("gpu", "list", env={**env, "DVFS_FAKE_NVML_MISSING": "1"})
    assert result.returncode == 1
    assert "no NVIDIA driver was found" in result.stderr and "twin" in result.stderr
    # `dvfs gpu list` has no campaign: the twin's way in is its own option, which the line names
    assert "--twin h100-sxm" in result.stderr and result.stderr.count("\n") == 1
    # With GPUs named, each named GPU was opened on its own and the missing driver counted as
    # that GPU's loss: the line said it once per GPU named (and `--json` gave each a row as a
    # GPU fallen off the bus). It is said once, as with no GPU named, nothing printed.
    missing = {**env, "DVFS_FAKE_NVML_MISSING": "1"}
    for args in (
        ("gpu", "info", "0", "1"),
        ("gpu", "info", "0", "1", "--json"),
        ("gpu", "reset", "0", "1"),
        ("cap", "reset", "0", "1"),
        ("monitor", "--once", "--gpu", "0", "--gpu", "1"),
    ):
        named = dvfs_in_process(*args, env=missing)
        assert named.returncode == 1 and named.stdout == "", (args, named.stdout)
        assert named.stderr.count("no NVIDIA driver was found") == 1, (args, named.stderr)
        assert named.stderr.count("\n") == 1, (args, named.stderr)
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("code", ["NVML_ERROR_RESET_REQUIRED", "NVML_ERROR_UNKNOWN"])
def test_gpu_list_and_info_show_the_gpus_beside_one_failing_nvml(nvml, env, code: str) -> None:
    """Only a GPU fallen off the bus was set aside: one needing a reset, or answering Unknown
    Error, made `gpu list` and `gpu info` print that error alone, the healthy GPU unshown.
    Both now show the others and name the failing GPU with NVML's error, exit 1."""
    nvml.fake_update_device(1, errors={"nvmlDeviceGetUUID": getattr(nvml, code)})
    said = str(nvml.NVMLError(getattr(nvml, code)))
    try:
        for command in ("list", "info"):
            result = dvfs_in_process("gpu", command, env=env)
            assert result.returncode == 1, result.stderr
            out = " ".join((result.stdout + result.stderr).split())
            assert nvml.fake_device_state(0)["uuid"] in out, out
            assert "GPU 1" in out and said in out and "Traceback" not in out, out
    finally:
        nvml.fake_update_device(1, errors={})


def test_gpu_list_lists_the_gpus_beside_one_fallen_off_the_bus(nvml, env) -> None:
    """One GPU of a node lost (GpuIsLost) made `dvfs gpu list` print nothing but that GPU's
    error: the healthy GPUs, and which index is the lost one, were not shown. It now lists
    every GPU it can open, says which one is lost (in the table and the JSON), and exits 1."""
    nvml.fake_update_device(1, lost=True)
    try:
        listed = dvfs_in_process("gpu", "list", env=env)
        assert listed.returncode == 1, listed.stderr
        out = " ".join((listed.stdout + listed.stderr).split())
        assert nvml.fake_device_state(0)["uuid"] in out, out
        assert "GPU 1" in out and "fallen off the bus" in out and "Traceback" not in out, out
        as_json = dvfs_in_process("gpu", "list", "--json", env=env)
        assert as_json.returncode == 1
        rows = json.loads(as_json.stdout)
        assert [r["index"] for r in rows] == [0, 1]
        assert rows[0]["uuid"] == nvml.fake_device_state(0)["uuid"] and "error" not in rows[0]
        assert "fallen off the bus" in rows[1]["error"]
        # Two lost: the error line names both, as every other command over all GPUs does
        nvml.fake_update_device(0, lost=True)
        for extra in ((), ("--json",)):
            both = dvfs_in_process("gpu", "list", *extra, env=env)
            [line] = both.stderr.splitlines()
            assert both.returncode == 1 and "GPU 0" in line and "GPU 1" in line, line
    finally:
        nvml.fake_update_device(0, lost=False)
        nvml.fake_update_device(1, lost=False)


def test_gpu_list_shows_each_gpus_ecc_mode_and_vbios_as_gpu_info_does(nvml, env) -> None:
    """`dvfs gpu info` shows each GPU's ECC mode and VBIOS (invariants a resume compares);
    `dvfs gpu list` showed neither, though a GPU of a node with ECC off is what a fleet
    refuses. It lists both (null in --json where not read, as gpu info): a column where the
    GPUs differ (here their ECC modes), else once under the table, for every GPU listed."""
    nvml.fake_update_device(1, ecc=0)
    try:
        rows = json.loads(dvfs_in_process("gpu", "list", "--json", env=env).stdout)
        details = json.loads(dvfs_in_process("gpu", "info", "--json", env=env).stdout)
        for row, info in zip(rows, details, strict=True):
            for key in ("ecc_mode", "vbios_version"):
                assert row[key] == info[key], (row, info)
        assert [r["ecc_mode"] for r in rows] == ["on", "off"]
        assert rows[0]["vbios_version"] == "96.00.99.00.01"
        table = dvfs_in_process("gpu", "list", env=env)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        [header] = [line for line in lines if "uuid" in line]
        assert [c.strip() for c in header.strip("┃ ").split("┃")][3] == "ECC", header
        for r in rows:
            [line] = [line for line in lines if r["uuid"] in line]
            cells = [c.strip() for c in line.strip("│ ").split("│")]
            assert cells[3] == r["ecc_mode"], line
        said = f"every GPU listed: driver {rows[0]['driver']}, VBIOS {rows[0]['vbios_version']}"
        assert lines[-1].startswith(said), lines[-1]
        twin = dvfs_in_process("gpu", "list", "--twin", "h100-sxm", "--json", env=env)
        [row] = json.loads(twin.stdout)
        assert row["ecc_mode"] is None and row["vbios_version"] is None
    finally:
        nvml.fake_update_device(1, ecc=1)


def test_gpu_info_shows_the_gpus_beside_one_fallen_off_the_bus(nvml, env) -> None:
    """`dvfs gpu info` with no GPU named failed whole on a GPU fallen off the bus, showing none
    of the others. It now shows every GPU it can open (as text or --json), then names the lost
    one in one line, exit 1. Its --json gives the lost GPU the row `gpu list --json` gives it
    (its index and error), not a list that reads as a host without it."""
    nvml.fake_update_device(0, lost=True)
    try:
        uuid = nvml.fake_device_state(1)["uuid"]
        for extra in ((), ("--json",)):
            result = dvfs_in_process("gpu", "info", *extra, env=env)
            assert result.returncode == 1, result.stderr
            [line] = result.stderr.splitlines()
            assert "GPU 0" in line and "fallen off the bus" in line, line
            if extra:
                [lost, info] = json.loads(result.stdout)
                assert (info["index"], info["uuid"]) == (1, uuid)
                listed = json.loads(dvfs_in_process("gpu", "list", "--json", env=env).stdout)
                assert lost == listed[0] and set(lost) == {"index", "error"}, lost
                assert lost["error"] in line
            else:
                assert f"GPU 1 NVIDIA H100 80GB HBM3 ({uuid})" in result.stdout
                assert "power limit: 700 W" in result.stdout and "GPU 0" not in result.stdout
        nvml.fake_update_device(1, lost=True)  # none opens: --json still gives each its row
        result = dvfs_in_process("gpu", "info", "--json", env=env)
        listed = json.loads(dvfs_in_process("gpu", "list", "--json", env=env).stdout)
        assert result.returncode == 1 and json.loads(result.stdout) == listed, result.stderr
        assert [r["index"] for r in listed] == [0, 1] and all("error" in r for r in listed)
    finally:
        nvml.fake_update_device(0, lost=False)
        nvml.fake_update_device(1, lost=False)


def test_a_driver_installed_but_not_loaded_is_not_called_missing(env, monkeypatch) -> None:
    """NVML's DriverNotLoaded (9: the library is there, the kernel module is not, say after a
    driver update without a reboot) is not LibraryNotFound: "install the NVIDIA driver" would
    send the user to install what is installed, instead of loading it."""
    monkeypatch.setenv("DVFS_FAKE_NVML_INIT_ERROR", "9")
    result = dvfs_in_process("gpu", "list", env={**env, "DVFS_FAKE_NVML_INIT_ERROR": "9"})
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert "not loaded" in result.stderr and "sudo modprobe nvidia" in result.stderr
    assert "no NVIDIA driver was found" not in result.stderr
    assert "install the NVIDIA driver" not in result.stderr
    assert "--twin h100-sxm" in result.stderr and "Traceback" not in result.stderr


def test_without_root_nothing_changes_and_nothing_blocks_the_next_run(
    nvml, tmp_path: Path, env, monkeypatch
) -> None:
    from dvfs.errors import GpuPermissionError

    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")
    campaign = load_campaign(campaign_file(tmp_path))
    with pytest.raises(GpuPermissionError, match="run as root"):
        run_sweep(campaign, tmp_path / "out", nvml=nvml, state_dir=tmp_path / "dvfs-state")
    assert_as_found(nvml, tmp_path / "dvfs-state")  # unchanged, and no state file left
    refused = dvfs_in_process(
        "sweep",
        str(campaign_file(tmp_path)),
        "--out",
        str(tmp_path / "o2"),
        "--no-progress",
        env={**env, "DVFS_FAKE_NVML_ROOT": "0"},
    )
    assert refused.returncode == 4, refused.stderr  # the cause, not a stale-state refusal
    assert "permission denied" in refused.stderr
    assert "--observe-only" in refused.stderr and "Traceback" not in refused.stderr
    # Refused at the first cell's clocks, its session journalled: the journal, holding no
    # cell, once bound the folder to the refused campaign, so the rerun the message advises
    # was refused there ("gpu.actuation: true -> false ... use --fresh").
    assert not (tmp_path / "out").exists() and not (tmp_path / "o2" / "journal.jsonl").exists()
    tried = setter_calls(nvml)  # the refused runs' attempts
    observing = dvfs_in_process(
        "sweep",
        str(campaign_file(tmp_path)),
        "--out",
        str(tmp_path / "o2"),
        "--no-progress",
        "--observe-only",
        env={**env, "DVFS_FAKE_NVML_ROOT": "0"},
    )
    assert observing.returncode == 0, observing.stderr
    assert setter_calls(nvml) == tried


def test_termination_signals_wait_until_the_restore_is_done(dispositions) -> None:
    import os

    from dvfs.signals import restoring, signals_raise

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job: set, not inherited
    order = []
    with pytest.raises(KeyboardInterrupt), signals_raise(), restoring(lambda _: None):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        order.append("restored")
    assert order == ["restored"]


def test_a_resumed_sweep_refuses_changed_stock_settings(nvml, tmp_path: Path) -> None:
    from dvfs.errors import JournalError

    sweep_failing_on(nvml, tmp_path, fail_on=3)
    campaign = load_campaign(campaign_file(tmp_path))
    nvml.fake_update_device(0, power_limit_mw=600_000)  # someone changed the stock limit
    with pytest.raises(JournalError, match="stock settings changed"):
        run_sweep(campaign, tmp_path / "out", nvml=nvml, state_dir=tmp_path / "dvfs-state")


# -- hung NVML calls and signals during a restore --------------------------------------------


def test_a_hung_nvml_call_ends_at_its_deadline_naming_the_call_and_gpu(nvml, hang) -> None:
    from dvfs.gpu.deadline import GpuTimeoutError

    with open_nvml_gpus([0], nvml=nvml, deadline_s=0.4) as (gpu,):
        hang("nvmlDeviceSetGpuLockedClocks")
        with pytest.raises(GpuTimeoutError) as caught:
            gpu.lock_sm_clock(1500, 1500)
        uuid = gpu.identity.uuid
        assert f"nvmlDeviceSetGpuLockedClocks on GPU 0 ({uuid}) did not return within 0.4 s" in (
            str(caught.value)
        )
        # Until the stuck call returns, the GPU's next call fails at once, so it can never
        # overtake the stuck setter.
        with pytest.raises(GpuTimeoutError, match="was not attempted.*SetGpuLockedClocks"):
            gpu.reset_sm_clock()
        assert nvml.fake_calls("nvmlDeviceResetGpuLockedClocks") == []
        os.environ.pop("DVFS_FAKE_NVML_HANG")
        nvml.fake_release_hangs()
        wait_for(lambda: nvml.fake_calls("nvmlDeviceSetGpuLockedClocks"), "the stuck call ends")

        def answers() -> bool:
            # The fake logs the call a moment before the worker marks it done: until then
            # the next call is refused without being attempted (no side effect), so retry.
            try:
                gpu.reset_sm_clock()
            except GpuTimeoutError as exc:
                assert "was not attempted" in str(exc)
                return False
            return True

        wait_for(answers, "the GPU answers again")
    assert nvml.fake_device_state(0)["locked_clocks"] is None


def _interrupted_while_hung(nvml, call: str, read) -> None:  # type: ignore[no-untyped-def]
    """`read()` (an NVML call, `call`, that hangs) interrupted by a Ctrl-C sent once it is
    stuck in the driver, as `systemctl stop` interrupts a governor."""
    import threading

    def interrupt() -> None:
        wait_for(nvml.fake_hangs_started, "the read is stuck in NVML")
        os.kill(os.getpid(), signal.SIGINT)

    signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever pytest was given
    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    with pytest.raises(KeyboardInterrupt):
        read()
    sender.join()
    assert [h["fn"] for h in nvml.fake_hangs_started()] == [call]


def test_a_signal_during_a_hung_call_leaves_the_restore_the_rest_of_its_deadline(
    nvml, hang, dispositions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal interrupting the wait on a hung NVML call left the call in the driver, not
    marked as hung: the restore that follows queued behind it and waited a deadline of its
    own (a stuck driver: one more deadline per GPU on the way out, past a unit's
    TimeoutStopSec), then blamed its own call, which never ran. The next call now waits for
    the stuck one only until that one's deadline ends (here: passed, the clock moved on), then
    fails at once, naming it, without being attempted."""
    import threading
    from types import SimpleNamespace

    from dvfs.gpu import deadline
    from dvfs.gpu.deadline import GpuTimeoutError

    later = [0.0]
    monkeypatch.setattr(
        deadline, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + later[0])
    )
    with open_nvml_gpus([0], nvml=nvml, deadline_s=3600) as (gpu,):
        hang("nvmlDeviceGetTotalEnergyConsumption")
        _interrupted_while_hung(nvml, "nvmlDeviceGetTotalEnergyConsumption", gpu.energy_mj)
        later[0] = 3600.0  # the stuck call's deadline has passed
        # (before the fix the reset queued behind the stuck read for a deadline of its own:
        # let the read go at last, so that such a run ends, and fails)
        release = threading.Timer(60, nvml.fake_release_hangs)
        release.start()
        try:
            with pytest.raises(GpuTimeoutError) as caught:
                gpu.reset_sm_clock()
        finally:
            release.cancel()
        message = str(caught.value)
        assert f"nvmlDeviceResetGpuLockedClocks on GPU 0 ({gpu.identity.uuid}) was not " in message
        assert "attempted: nvmlDeviceGetTotalEnergyConsumption has not returned" in message
        assert nvml.fake_calls("nvmlDeviceResetGpuLockedClocks") == []


def test_a_slow_call_a_signal_interrupted_is_waited_for_and_the_next_runs(
    nvml, hang, dispositions
) -> None:
    """The other side: an interrupted call that returns within its deadline (slow, not hung)
    holds the next call on that GPU only until it returns; the restore then runs."""
    import threading

    with open_nvml_gpus([0], nvml=nvml, deadline_s=3600) as (gpu,):
        hang("nvmlDeviceGetTotalEnergyConsumption")
        _interrupted_while_hung(nvml, "nvmlDeviceGetTotalEnergyConsumption", gpu.energy_mj)
        os.environ.pop("DVFS_FAKE_NVML_HANG")
        restored = threading.Event()

        def release() -> None:  # until the read lets go (a release just before it waits)
            while not restored.is_set():
                nvml.fake_release_hangs()
                time.sleep(0.05)

        releaser = threading.Thread(target=release, daemon=True)
        releaser.start()
        try:
            gpu.reset_sm_clock()
        finally:
            restored.set()
            releaser.join()
    assert [c["ok"] for c in nvml.fake_calls("nvmlDeviceResetGpuLockedClocks")] == [True]


def test_a_restore_gives_up_at_the_deadline_and_keeps_the_state_file(
    nvml, hang, tmp_path: Path
) -> None:
    from dvfs.errors import GpuError
    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.gpu.safety import StateStore

    store = StateStore(tmp_path / "dvfs-state")
    with open_nvml_gpus([0], nvml=nvml, deadline_s=0.4) as (gpu,):
        with (
            pytest.raises(GpuError) as caught,
            KnobController([gpu], change_log=store) as knobs,
        ):
            knobs.apply(KnobSetting(1500, 400))
            hang("nvmlDeviceResetGpuLockedClocks")
        message = str(caught.value)
        assert "could not restore" in message and "dvfs gpu reset" in message
        assert "nvmlDeviceResetGpuLockedClocks on GPU 0" in message
        assert "did not return within 0.4 s" in message
        assert store.pending(gpu.identity.uuid)  # for `dvfs gpu reset`


def _abandon_a_stuck_restore(nvml, hang, caplog, store, then=None):  # type: ignore[no-untyped-def]
    """A controller's restore stuck in NVML (its clock reset hangs), given up on at a second
    SIGTERM, the stuck call then let go; `then(gpu)` runs while the GPU is still open. The
    RestoreAbandoned it raised."""
    import threading

    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.signals import RestoreAbandoned

    def signal_twice() -> None:
        wait_for(nvml.fake_hangs_started, "the restore is stuck in NVML")
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: "while restoring GPU settings" in caplog.text, "the first is noted")
        os.kill(os.getpid(), signal.SIGTERM)

    with open_nvml_gpus([0], nvml=nvml, deadline_s=3600) as (gpu,):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # handled anyway, while knobs are held
        sender = threading.Thread(target=signal_twice, daemon=True)
        with (
            pytest.raises(RestoreAbandoned) as caught,
            KnobController([gpu], change_log=store) as knobs,
        ):
            knobs.apply(KnobSetting(1500, None))
            hang("nvmlDeviceResetGpuLockedClocks")
            sender.start()
        sender.join()
        os.environ.pop("DVFS_FAKE_NVML_HANG")
        nvml.fake_release_hangs()
        wait_for(lambda: nvml.fake_calls("nvmlDeviceResetGpuLockedClocks"), "the stuck call ends")
        if then is not None:
            then(gpu)
    return caught.value


def test_a_second_signal_abandons_a_stuck_restore(
    nvml, hang, tmp_path: Path, dispositions, caplog
) -> None:
    """The restore holds one signal back, not forever: the next one gives up, and the state
    file stays for `dvfs gpu reset`, which then puts the GPU back."""
    from dvfs.gpu.safety import StateStore, restore_pending

    store = StateStore(tmp_path / "dvfs-state")

    def pending_then_restored(gpu) -> None:  # type: ignore[no-untyped-def]
        assert store.pending(gpu.identity.uuid)
        restore_pending([gpu], store)

    abandoned = _abandon_a_stuck_restore(nvml, hang, caplog, store, pending_then_restored)
    assert abandoned.exit_code == 143 and "dvfs gpu reset" in str(abandoned)
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_an_abandoned_restore_names_the_reset_of_its_own_state_folder(
    nvml, hang, tmp_path: Path, dispositions, caplog, env
) -> None:
    """A restore given up at a second signal, its state files in a folder not the default
    (`gpu settle`, `gpu roofline` or `govern` run with --state-dir DIR): the notice of the
    first signal and the line of the second said to run `dvfs gpu reset`, which reads the
    default folder and finds nothing to restore (settle's own line beside them named DIR).
    Both name `dvfs gpu reset --state-dir DIR`, and that command, run, puts the GPU back."""
    from dvfs.gpu.safety import StateStore

    folder = tmp_path / "other state"
    abandoned = _abandon_a_stuck_restore(nvml, hang, caplog, StateStore(folder))
    advice = str(abandoned).rsplit("run `", 1)[1].split("`", 1)[0]
    assert f"(then run `{advice}`)" in caplog.text, caplog.text  # the first signal's notice
    assert shlex.split(advice) == ["dvfs", "gpu", "reset", "--state-dir", str(folder)], advice
    followed = dvfs_in_process(*shlex.split(advice)[1:], env=env)
    assert followed.returncode == 0, followed.stderr
    assert_as_found(nvml, folder)


def test_gpu_reset_puts_the_power_limit_back_past_a_refused_clock_reset(
    nvml, tmp_path: Path
) -> None:
    """A state file left with both knobs changed, and NVML refusing the clock's reset (which
    changed nothing): `dvfs gpu reset` put back neither, the power limit staying capped behind
    the clock; it puts the limit back, names the clock and keeps the file for it."""
    from dvfs.errors import GpuError
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore, restore_pending

    store = StateStore(tmp_path / "dvfs-state")
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        stock_mw = gpu.power_limit_mw()
        store.record(GpuSettings(gpu.identity.uuid, None, stock_mw))
        gpu.lock_sm_clock(1500, 1500)
        gpu.set_power_limit_mw(400_000)
        nvml.fake_update_device(
            0, errors={"nvmlDeviceResetGpuLockedClocks": nvml.NVML_ERROR_NOT_SUPPORTED}
        )
        with pytest.raises(GpuError, match="cannot reset locked SM clocks"):
            restore_pending([gpu], store)
        assert store.pending(gpu.identity.uuid)
    state = nvml.fake_device_state(0)
    assert state["power_limit_mw"] == stock_mw != 400_000
    assert state["locked_clocks"] == [1500, 1500]


def test_cap_apply_with_a_hung_driver_fails_in_one_line(nvml, env, tmp_path: Path) -> None:
    from dvfs.caps import CapsFile, GpuCap, dump_caps

    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid=uuid, sm_clock_max_mhz=1410),))))
    result = _dvfs(
        "cap",
        "apply",
        str(caps),
        env={
            **env,
            "DVFS_NVML_DEADLINE_S": "0.4",
            "DVFS_FAKE_NVML_HANG": "nvmlDeviceSetGpuLockedClocks=inf",
        },
    )
    assert result.returncode == 1, result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert f"nvmlDeviceSetGpuLockedClocks on GPU 0 ({uuid}) did not return within 0.4 s" in line


def _start_with_sigint_ignored(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """dvfs started the way a shell starts a background job: SIGINT ignored (set explicitly
    here, so the test means the same however pytest itself was started)."""
    launcher = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "sys.argv = ['dvfs', *sys.argv[1:]]; runpy.run_module('dvfs', run_name='__main__')"
    )
    return subprocess.Popen(
        [sys.executable, "-c", launcher, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_sigint_restores_even_when_inherited_ignored(nvml, tmp_path: Path, env) -> None:
    campaign = long_campaign(tmp_path)
    out = tmp_path / "out"
    proc = _start_with_sigint_ignored(
        ["sweep", str(campaign), "--out", str(out), "--no-progress"], env
    )
    try:
        _wait_until_changed(nvml, proc, out / "journal.jsonl")
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "GPU settings restored" in output and "Traceback" not in output
    assert_as_found(nvml, tmp_path / "dvfs-state")


@pytest.mark.slow
def test_sigint_ends_cap_apply_stuck_in_the_driver(nvml, tmp_path: Path, env) -> None:
    """A hung setter does not make dvfs deaf: the signal ends it (long before the deadline),
    and the record keeps the lock that was applied before."""
    from dvfs.caps import CapsFile, GpuCap, dump_caps

    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(
        dump_caps(CapsFile((GpuCap(uuid=uuid, sm_clock_max_mhz=1410, power_limit_w=400.0),)))
    )
    hung_env = {
        **env,
        "DVFS_NVML_DEADLINE_S": "3600",
        "DVFS_FAKE_NVML_HANG": "nvmlDeviceSetPowerManagementLimit=inf",
    }
    proc = _start_with_sigint_ignored(["cap", "apply", str(caps)], hung_env)
    try:
        wait_for(nvml.fake_hangs_started, "cap apply is stuck in the driver")
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "Traceback" not in output
    record = json.loads((tmp_path / "dvfs-state" / "caps-applied.json").read_text())
    assert record[uuid]["lock_mhz"] == [210, 1410]


def test_gpu_reset_restores_a_dead_runs_gpu_beside_a_live_ones(nvml, tmp_path: Path, env) -> None:
    """The governor unit's ExecStopPost runs `dvfs gpu reset` after a crash: another dvfs
    (a governor of another server) holding another GPU with its state file must not stop the
    dead run's GPU being restored. That GPU is its holder's to restore: skipped with a note;
    named explicitly, it is still refused (exit 3)."""
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import GpuLocks, StateStore

    state_dir = tmp_path / "dvfs-state"
    store = StateStore(state_dir)
    with open_nvml_gpus([0, 1], nvml=nvml) as (dead, live):
        for gpu in (dead, live):  # each run recorded its GPU before changing it
            store.record(GpuSettings(gpu.identity.uuid, None, gpu.power_limit_mw()))
            gpu.lock_sm_clock(210, 1200)
        with GpuLocks(state_dir).hold([live]):  # the live run, still holding its GPU
            result = dvfs_in_process("gpu", "reset", env=env)
            assert result.returncode == 0, result.stderr
            out = " ".join((result.stdout + result.stderr).split())
            assert f"restored GPU 0 ({dead.identity.uuid})" in out, out
            assert f"skipped GPU 1 ({live.identity.uuid}): in use by another dvfs" in out, out
            assert nvml.fake_device_state(0)["locked_clocks"] is None
            assert nvml.fake_device_state(0)["power_limit_mw"] == 650_000
            assert nvml.fake_device_state(1)["locked_clocks"] == [210, 1200]  # left to it
            named = dvfs_in_process("gpu", "reset", "1", env=env)
            assert named.returncode == 3 and "in use by another dvfs" in named.stderr
        assert store.pending(live.identity.uuid) and not store.pending(dead.identity.uuid)


def test_doctor_does_not_send_a_running_dvfss_gpu_to_gpu_reset(nvml, tmp_path: Path, env) -> None:
    """A GPU a running dvfs changed (its state file written, its lock held) is not a dead
    run's: `dvfs gpu reset` skips it ("which restores it itself"), so doctor's state check
    once failed it with "and not restored - run `dvfs gpu reset`", advice that did nothing,
    beside the lock check's "in use by another dvfs process". It now names the running
    process; a dead run's file still fails with the advice."""
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import GpuLocks, StateStore

    state_dir = tmp_path / "dvfs-state"
    campaign = campaign_file(tmp_path)
    out = tmp_path / "out"
    store = StateStore(state_dir)
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        store.record(GpuSettings(gpu.identity.uuid, None, gpu.power_limit_mw()))
        with GpuLocks(state_dir).hold([gpu]):  # the run that wrote it, still running
            checked = doctor_checks(campaign, out, env)
            assert checked["lock GPU 0"]["status"] == "fail"
            state = checked["state"]
            assert "dvfs gpu reset" not in state["detail"], state
            assert "not restored" not in state["detail"], state
            assert state["status"] != "fail" and "restores it itself" in state["detail"], state
        dead = doctor_checks(campaign, out, env)["state"]  # its process gone, the file left
        assert dead["status"] == "fail" and "dvfs gpu reset" in dead["detail"], dead
        store.clear(gpu.identity.uuid)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_doctor_does_not_call_a_gpu_whose_lock_is_no_file_a_running_dvfss(
    nvml, tmp_path: Path, env, kind: str
) -> None:
    """A GPU lock file that is no regular file (a FIFO, a folder) is no lock a running dvfs
    holds (`hold` refuses it), yet doctor's state check read the lock check's complaint as
    one and said a dead run's state file was "being changed by the running dvfs ..., which
    restores it itself". It says what the lock file is now, and fails the state."""
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    state_dir = tmp_path / "dvfs-state"
    campaign = campaign_file(tmp_path)
    store = StateStore(state_dir)
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        uuid = gpu.identity.uuid
        store.record(GpuSettings(uuid, None, gpu.power_limit_mw()))
    lock = state_dir / f"{uuid}.lock"
    os.mkfifo(lock) if kind == "fifo" else lock.mkdir()
    checked = doctor_checks(campaign, tmp_path / "out", env)
    assert checked["lock GPU 0"]["status"] == "fail", checked["lock GPU 0"]
    state = checked["state"]
    assert "restores it itself" not in state["detail"], state
    assert state["status"] == "fail" and "no regular file" in state["detail"], state
    assert str(lock) in state["detail"], state
    store.clear(uuid)


@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_doctor_fails_the_lock_of_a_gpu_whose_lock_is_a_broken_link(
    nvml, tmp_path: Path, env, link: str
) -> None:
    """A GPU lock file that is a symbolic link to no file (or in a loop), which the sweep
    refuses ("remove the link"), passed doctor's lock check: "ok lock GPU 0: no other dvfs
    holds it". The check fails, naming the link and what to do, as the sweep says it."""
    state_dir = tmp_path / "dvfs-state"
    state_dir.mkdir()
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        uuid = gpu.identity.uuid
    lock = state_dir / f"{uuid}.lock"
    lock.symlink_to(lock.name if link == "loop" else tmp_path / "gone" / "x.lock")
    checked = doctor_checks(campaign_file(tmp_path), tmp_path / "out", env)["lock GPU 0"]
    assert checked["status"] == "fail", checked
    assert f"GPU lock file {lock} is a symbolic link" in checked["detail"], checked
    assert "remove the link" in checked["detail"], checked


@pytest.mark.skipif(os.geteuid() != 0, reason="the link check applies to root only")
def test_as_root_no_second_dvfs_holds_a_gpu_through_a_users_lock_link(
    nvml, tmp_path: Path, env
) -> None:
    """A user's link in a shared state folder (1777) in place of a GPU's lock, to a file to be
    made in a folder of theirs: root's dvfs made the lock there and held it, the user removed
    it, and a second dvfs made another there and held the same GPU. As root the link is
    refused by the lock (no GPU held through it) and by doctor's lock check."""
    import pwd

    from dvfs.errors import GpuLockFileError
    from dvfs.gpu.safety import GpuLocks

    nobody = pwd.getpwnam("nobody").pw_uid
    state_dir, theirs = tmp_path / "dvfs-state", tmp_path / "theirs"
    state_dir.mkdir()
    state_dir.chmod(0o1777)
    theirs.mkdir()
    os.chown(theirs, nobody, nobody)
    with open_nvml_gpus([0], nvml=nvml) as gpus:
        lock = state_dir / f"{gpus[0].identity.uuid}.lock"
        lock.symlink_to(theirs / "gpu.lock")
        os.chown(lock, nobody, nobody, follow_symlinks=False)
        with (
            pytest.raises(GpuLockFileError, match="owned by nobody") as refused,
            GpuLocks(state_dir).hold(gpus),
        ):
            pass
        assert "remove the link" in str(refused.value)
    assert not (theirs / "gpu.lock").exists(), "no lock made in the user's folder"
    checked = doctor_checks(campaign_file(tmp_path), tmp_path / "out", env)["lock GPU 0"]
    assert checked["status"] == "fail", checked
    assert f"GPU lock file {lock} goes through the symbolic link" in checked["detail"], checked


def test_doctor_names_a_damaged_caps_record_as_such_not_as_the_driver(
    nvml, tmp_path: Path, env
) -> None:
    """dvfs's caps record damaged made doctor say "FAIL driver: .../caps-applied.json is
    unreadable" (the driver fine, checked ok just above) and skip the GPUs' held-knobs,
    other-process and permission checks. It fails the caps check, naming the record, exit 1
    (a failed check, as every command reading the record exits), and checks the rest."""
    state_dir = tmp_path / "dvfs-state"
    state_dir.mkdir()
    record = state_dir / "caps-applied.json"
    record.write_text('{"GPU-')
    campaign = campaign_file(tmp_path)
    result = dvfs_in_process("doctor", str(campaign), "--out", str(tmp_path / "out"), env=env)
    assert result.returncode == 1, result.stdout
    doc = dvfs_in_process(
        "doctor", str(campaign), "--out", str(tmp_path / "out"), "--json", env=env
    ).stdout
    checked = {c["name"]: c for c in json.loads(doc)}
    assert checked["driver"]["status"] == "ok", checked["driver"]
    assert checked["caps"]["status"] == "fail", checked.get("caps")
    assert f"{record} is unreadable" in checked["caps"]["detail"]
    for name in ("held knobs GPU 0", "other processes GPU 0", "permissions"):
        assert name in checked, sorted(checked)


def _locked_with_a_state_file(nvml: Any, tmp_path: Path, index: int) -> tuple[Any, str]:
    """GPU `index` of the fake locked at 210-1200 MHz as a run that died left it, its state
    file recorded (for `dvfs gpu reset`): the state store and the GPU's UUID."""
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    store = StateStore(tmp_path / "dvfs-state")
    with open_nvml_gpus([index], nvml=nvml) as (gpu,):
        store.record(GpuSettings(gpu.identity.uuid, None, gpu.power_limit_mw()))
        gpu.lock_sm_clock(210, 1200)
    return store, gpu.identity.uuid


def test_gpu_reset_restores_a_dead_runs_gpu_beside_one_fallen_off_the_bus(
    nvml, tmp_path: Path, env
) -> None:
    """`dvfs gpu reset` with no GPU named (the governor unit's ExecStopPost) failed on a GPU
    fallen off the bus before restoring anything: the dead run's other GPU stayed locked. It
    now restores every GPU it can open, then says which one it could not (exit 1)."""
    store, uuid = _locked_with_a_state_file(nvml, tmp_path, 1)
    nvml.fake_update_device(0, lost=True)
    try:
        result = dvfs_in_process("gpu", "reset", env=env)
        out = " ".join((result.stdout + result.stderr).split())
        assert result.returncode == 1, out
        assert f"restored GPU 1 ({uuid})" in out, out
        assert "GPU 0" in out and "fallen off the bus" in out and "Traceback" not in out, out
        assert nvml.fake_device_state(1)["locked_clocks"] is None
        assert not store.pending(uuid)
    finally:
        nvml.fake_update_device(0, lost=False)


def test_gpu_reset_and_info_act_on_the_named_gpus_beside_one_fallen_off_the_bus(
    nvml, tmp_path: Path, env
) -> None:
    """`dvfs gpu reset 0 1` and `dvfs gpu info 0 1` with GPU 0 fallen off the bus failed whole:
    the reset left GPU 1 locked, the info showed nothing. Named GPUs now act as every GPU does:
    the others restored or shown, then the lost one named in the same line (exit 1); a GPU
    not on the machine at all (`gpu info 9`) is still refused, as a typo."""
    store, uuid = _locked_with_a_state_file(nvml, tmp_path, 1)
    nvml.fake_update_device(0, lost=True)
    try:
        every = dvfs_in_process("gpu", "info", env=env)
        result = dvfs_in_process("gpu", "reset", "0", "1", env=env)
        out = " ".join((result.stdout + result.stderr).split())
        assert result.returncode == 1, out
        assert f"restored GPU 1 ({uuid})" in out, out
        assert result.stderr == every.stderr and "Traceback" not in out, out
        assert nvml.fake_device_state(1)["locked_clocks"] is None
        assert not store.pending(uuid)
        for extra in ((), ("--json",)):
            named = dvfs_in_process("gpu", "info", "1", "0", *extra, env=env)
            alone = dvfs_in_process("gpu", "info", *extra, env=env)
            assert named.returncode == 1, named.stderr
            assert (named.stdout, named.stderr) == (alone.stdout, alone.stderr)
            assert uuid in named.stdout
        typo = dvfs_in_process("gpu", "info", "1", "9", env=env)
        assert typo.returncode == 2 and typo.stdout == "", typo.stdout
        assert "no GPU 9: this machine has 2 GPU(s)" in typo.stderr
    finally:
        nvml.fake_update_device(0, lost=False)


def test_a_gpu_fallen_off_the_bus_named_twice_is_refused_as_any_gpu_named_twice(
    nvml, tmp_path: Path, env
) -> None:
    """A GPU named twice is a usage error (exit 2) before anything is changed; one fallen off
    the bus named twice (`cap reset UUID 0`, `gpu reset 0 0 1`) was instead taken as lost
    (exit 1, by index and UUID named twice in the line, as if two GPUs were lost) and the
    others acted on. It is refused alike now, naming it and both names; GPU 1 stays locked.
    A lost GPU named by UUID alone gets its index in --json, where it is the only GPU whose
    UUID NVML cannot read (it was null)."""
    store, uuid = _locked_with_a_state_file(nvml, tmp_path, 1)
    lost = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, lost=True)
    try:
        for args in (
            ("cap", "reset", lost, "0"),
            ("cap", "reset", lost, lost),
            ("gpu", "reset", "0", "0", "1"),
            ("gpu", "info", "0", lost),
        ):
            result = dvfs_in_process(*args, env=env)
            out = " ".join((result.stdout + result.stderr).split())
            assert result.returncode == 2, (args, out)
            first, second = args[2], args[3]
            assert f"GPU 0 (as {first} and {second}) is named twice" in out, out
            assert "Traceback" not in out and "fallen off the bus" not in out, out
        assert nvml.fake_device_state(1)["locked_clocks"] is not None and store.pending(uuid)
        named = dvfs_in_process("gpu", "info", lost, "1", "--json", env=env)
        assert named.returncode == 1, named.stderr
        [row, info] = json.loads(named.stdout)
        assert (row["index"], info["index"]) == (0, 1) and lost in row["error"], row
    finally:
        nvml.fake_update_device(0, lost=False)


def test_gpu_reset_does_not_say_no_state_file_where_the_lost_gpu_may_hold_one(
    nvml, tmp_path: Path, env
) -> None:
    """A governor stopped by its GPU going silent leaves that GPU's state file, for `dvfs gpu
    reset` once it answers again. Run while it was still lost, `gpu reset` said "No dvfs state
    files for these GPUs: nothing to restore", which read as no state file at all, the lost
    GPU's included. It now says none is there for the GPUs that open, then names the lost one
    (exit 1), and the state file stays."""
    store, uuid = _locked_with_a_state_file(nvml, tmp_path, 0)
    nvml.fake_update_device(0, lost=True)
    try:
        result = dvfs_in_process("gpu", "reset", env=env)
        out = " ".join((result.stdout + result.stderr).split())
        assert result.returncode == 1, out
        assert "No dvfs state files for these GPUs" not in out, out
        assert "No dvfs state files for the GPUs that open" in out, out
        assert "GPU 0" in out and "fallen off the bus" in out and "Traceback" not in out, out
        assert store.pending(uuid)
    finally:
        nvml.fake_update_device(0, lost=False)
    assert "restored GPU 0" in dvfs_in_process("gpu", "reset", env=env).stdout


@pytest.mark.parametrize(
    "command",
    ["gpu list", "gpu info", "gpu reset", "cap show", "cap apply", "cap reset", "monitor"],
)
def test_the_help_of_each_command_over_every_gpu_says_what_a_lost_gpu_does(
    env, command: str
) -> None:
    """The README says each command that takes every GPU when none is named shows or acts on
    the others and names a GPU fallen off the bus, exit 1; `gpu list`, `gpu reset` and
    `monitor` --help did not say so."""
    shown = dvfs_in_process(*command.split(), "--help", env=env)
    said = " ".join(shown.stdout.split())
    exits = "; 1 naming a GPU fallen off the bus" if command == "cap apply" else "exit 1"
    if command == "cap apply":  # a file matching none of the GPUs that open: 1, not 2
        assert "if the file matches none of those that open" in said, said
    assert shown.returncode == 0 and "fallen off the bus" in said and exits in said, said
    if command in ("gpu info", "gpu reset", "cap reset", "monitor"):  # named ones too
        assert "or not) is named, exit 1" in said, said


@pytest.mark.parametrize("content", ["[1, 2]", '{"original": 5}', '{"original": {"uuid": 5}}'])
def test_a_malformed_state_file_is_a_state_error(tmp_path: Path, content: str) -> None:
    from dvfs.errors import GpuStateError
    from dvfs.gpu.safety import StateStore

    store = StateStore(tmp_path)
    store.path("GPU-1").write_text(content)
    with pytest.raises(GpuStateError, match="unreadable"):
        store.pending("GPU-1")


def _gpu_0_failing_its_restore(nvml, env: dict[str, str]) -> tuple[Path, str]:
    """Two H100s, GPU 0 with a state file (locked to 1500 MHz, 500 W) whose restore fails (an
    NVML error locking its clocks). Returns the state folder and GPU 0's UUID."""
    nvml.fake_reset_state("h100-sxm,h100-sxm")
    uuid = nvml.fake_device_state(0)["uuid"]
    state = Path(env["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    original = {"uuid": uuid, "sm_clock_lock_mhz": [210, 1500], "power_limit_mw": 500_000}
    (state / f"{uuid}.json").write_text(json.dumps({"original": original}))
    nvml.fake_update_device(0, errors={"nvmlDeviceSetGpuLockedClocks": nvml.NVML_ERROR_UNKNOWN})
    return state, uuid


def test_gpu_reset_defaults_resets_the_others_beside_a_gpu_that_fails_to_restore(
    nvml, env: dict[str, str]
) -> None:
    """`dvfs gpu reset --defaults` with GPU 0's restore failing (an NVML error) stopped there:
    GPU 1, with no state file, kept its changed power limit, and the one line named GPU 0
    alone. Each GPU that can be is restored or reset, and said so, before the failure."""
    state, uuid = _gpu_0_failing_its_restore(nvml, env)
    nvml.fake_update_device(1, power_limit_mw=400_000)
    result = dvfs_in_process("gpu", "reset", "--defaults", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    said = " ".join(result.stdout.split())
    assert f"reset GPU 1 ({nvml.fake_device_state(1)['uuid']}): clocks unlocked" in said, said
    assert "could not restore: GPU 0: cannot lock SM clocks" in result.stderr, result.stderr
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000
    assert (state / f"{uuid}.json").exists()  # kept, for the next try


def test_gpu_reset_names_a_lost_gpu_beside_one_that_fails_to_restore(
    nvml, env: dict[str, str]
) -> None:
    """`dvfs gpu reset` with GPU 0's restore failing and GPU 1 fallen off the bus named GPU 0
    alone: the lost GPU, which its help says is named once the others are restored, went
    unsaid. The one error names both."""
    _gpu_0_failing_its_restore(nvml, env)
    nvml.fake_update_device(1, lost=True)
    result = dvfs_in_process("gpu", "reset", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    [error] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert "could not restore: GPU 0" in error and "GPU 1" in error, error
    assert "fallen off the bus" in error, error


@pytest.mark.parametrize("lock", [[1500], "ab", [1500, 210], ["210", 1500]])
def test_gpu_reset_names_a_state_file_whose_lock_is_damaged(
    nvml, env: dict[str, str], lock: Any
) -> None:
    """A state file whose recorded lock was one clock or text (damaged, edited by hand) gave
    `dvfs gpu reset` "internal error: TypeError" from the NVML call it was passed to; it is
    named unreadable in one line, as a state file that is no JSON object is, and the GPU is
    left as it is."""
    uuid = nvml.fake_device_state(0)["uuid"]
    state = Path(env["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    original = {"uuid": uuid, "sm_clock_lock_mhz": lock, "power_limit_mw": 500_000}
    (state / f"{uuid}.json").write_text(json.dumps({"original": original}))
    result = dvfs_in_process("gpu", "reset", env=env)
    told = " ".join(result.stderr.split())
    assert result.returncode != 0 and "internal error" not in told, told
    assert f"{uuid}.json is unreadable (sm_clock_lock_mhz is" in told, told
    assert nvml.fake_calls() == [] and (state / f"{uuid}.json").exists()


@pytest.mark.parametrize(
    ("lock", "power", "said"),
    [
        ([210, 1500], 900_000, "power_limit_mw is 900000, outside this GPU's range 200-700 W"),
        ([210, 1500], 50_000, "power_limit_mw is 50000, outside this GPU's range 200-700 W"),
        ([210, 5000], 500_000, "sm_clock_lock_mhz is [210, 5000], outside this GPU's SM clocks"),
    ],
)
def test_gpu_reset_leaves_a_gpu_whose_state_file_holds_settings_outside_its_range(
    nvml, env: dict[str, str], lock: list[int], power: int, said: str
) -> None:
    """A state file hand-edited to a power limit outside the GPU's range (900 W above its 700
    W top, 50 W below its floor) or a lock above its clocks: `dvfs gpu reset` (the governor
    unit's ExecStopPost) locked the clocks as recorded, then NVML refused the limit, "could
    not restore: GPU 0: power limit 900 W is outside the allowed range", the file named
    nowhere; or put back the limit past the refused lock. Such a file is damaged: the GPU is
    left as it is (no setter called), the file kept, and one line names it and what to run;
    GPU 1's own state file is still restored."""
    state = _state_files(nvml, env, {1: [210, 1500]})
    uuid = nvml.fake_device_state(0)["uuid"]
    original = {"uuid": uuid, "sm_clock_lock_mhz": lock, "power_limit_mw": power}
    (state / f"{uuid}.json").write_text(json.dumps({"original": original}))
    result = dvfs_in_process("gpu", "reset", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    [error] = result.stderr.splitlines()
    assert f"GPU 0 ({uuid}) was left as it is: its state file" in error, error
    assert f"is damaged ({said}" in error and "internal error" not in error, error
    assert "`dvfs gpu reset 0 --defaults --state-dir" in error, error
    setters = ("nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks")
    setters += ("nvmlDeviceSetPowerManagementLimit",)
    assert not [c for c in nvml.fake_calls() if c["index"] == 0 and c["fn"] in setters]
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert nvml.fake_device_state(0)["power_limit_mw"] == 650_000
    assert (state / f"{uuid}.json").exists()
    assert nvml.fake_device_state(1)["locked_clocks"] == [210, 1500]
    assert f"restored GPU 1 ({nvml.fake_device_state(1)['uuid']})" in result.stdout


def _state_files(nvml, env: dict[str, str], locks: dict[int, Any]) -> Path:
    """A state file per GPU of `locks` (its recorded lock; 500 W), as a dead dvfs left them."""
    state = Path(env["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    for index, lock in locks.items():
        uuid = nvml.fake_device_state(index)["uuid"]
        original = {"uuid": uuid, "sm_clock_lock_mhz": lock, "power_limit_mw": 500_000}
        (state / f"{uuid}.json").write_text(json.dumps({"original": original}))
    return state


def test_gpu_reset_restores_the_others_beside_a_gpu_whose_state_file_is_damaged(
    nvml, env: dict[str, str]
) -> None:
    """`dvfs gpu reset --defaults` with GPU 1's state file damaged (a lock of one clock) refused
    every GPU, exit 3: GPU 0 kept the dead run's changes its state file records, GPU 2 its
    changed power limit. The damaged file's GPU is left as it is and named once the others
    are restored or reset, as a GPU that fails its restore is."""
    nvml.fake_reset_state("h100-sxm,h100-sxm,h100-sxm")
    state = _state_files(nvml, env, {0: [210, 1500], 1: [1500]})
    nvml.fake_update_device(2, power_limit_mw=400_000)
    result = dvfs_in_process("gpu", "reset", "--defaults", env=env)
    assert result.returncode == 3, result.stdout + result.stderr
    said = " ".join(result.stdout.split())
    assert f"restored GPU 0 ({nvml.fake_device_state(0)['uuid']})" in said, said
    assert f"reset GPU 2 ({nvml.fake_device_state(2)['uuid']})" in said, said
    [error] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    uuid = nvml.fake_device_state(1)["uuid"]
    assert f"{uuid}.json is unreadable (sm_clock_lock_mhz is [1500]" in error, error
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000
    assert nvml.fake_device_state(2)["power_limit_mw"] == 700_000
    assert (state / f"{uuid}.json").exists()  # for the operator to inspect
    assert not [c for c in nvml.fake_calls() if c["index"] == 1], nvml.fake_calls()


def test_gpu_reset_names_a_lost_gpu_beside_a_damaged_state_file(nvml, env: dict[str, str]) -> None:
    """`dvfs gpu reset` with GPU 1's state file damaged and GPU 2 fallen off the bus named the
    damaged file alone and restored nothing: GPU 0's state file was not restored, and the lost
    GPU, which the help says is named once the others are restored, went unsaid."""
    nvml.fake_reset_state("h100-sxm,h100-sxm,h100-sxm")
    state = _state_files(nvml, env, {0: [210, 1500], 1: "ab"})
    nvml.fake_update_device(2, lost=True)
    result = dvfs_in_process("gpu", "reset", env=env)
    assert result.returncode != 0, result.stdout + result.stderr
    assert f"restored GPU 0 ({nvml.fake_device_state(0)['uuid']})" in result.stdout, result.stdout
    [error] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert "is unreadable" in error and "fallen off the bus" in error, error
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
    assert not (state / f"{nvml.fake_device_state(0)['uuid']}.json").exists()


def test_state_files_are_readable_by_all_whatever_the_umask(tmp_path: Path) -> None:
    """dvfs's state files (caps record, GPU state) are read by users and the systemd units:
    written 0644 even under a strict umask, replacing the old one whole, no temp file left."""
    import json
    import stat

    from dvfs.gpu.safety import write_json_atomic

    path = tmp_path / "caps-applied.json"
    path.write_text("{}")
    path.chmod(0o600)
    before = os.umask(0o077)
    try:
        write_json_atomic(path, {"GPU-x": {"lock_mhz": [210, 1410]}})
    finally:
        os.umask(before)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert json.loads(path.read_text()) == {"GPU-x": {"lock_mhz": [210, 1410]}}
    assert [p.name for p in tmp_path.iterdir()] == ["caps-applied.json"]


def test_doctor_observe_only_checks_the_campaign_as_the_observe_only_sweep_runs_it(
    nvml, tmp_path: Path, env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without root, with a clock GPU 0 does not support: doctor fails the campaign (exit 2),
    its permission check pointing at --observe-only, which `dvfs sweep --observe-only` runs
    (knobs stock, no setter): `dvfs doctor --observe-only` checks that run and passes it
    (doctor had no such option)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # doctor's root check: not root
    text = campaign_file(tmp_path).read_text()
    campaign = tmp_path / "unsupported.toml"
    campaign.write_text(text.replace("sm_clock = [1980, 1500]", "sm_clock = [1980, 2100]"))

    def doctor(*args: str) -> tuple[int, dict[str, dict]]:
        result = dvfs_in_process(
            "doctor", str(campaign), "--out", str(tmp_path / "c"), *args, "--json", env=env
        )
        return result.returncode, {c["name"]: c for c in json.loads(result.stdout)}

    code, checks = doctor()
    assert code == 2 and checks["knobs"]["status"] == "fail"
    assert "--observe-only" in checks["permissions"]["detail"]
    code, checks = doctor("--observe-only")
    assert code == 0, checks
    assert checks["knobs"]["status"] == checks["permissions"]["status"] == "ok"
    swept = dvfs_in_process(
        "sweep",
        str(campaign),
        "--observe-only",
        "--out",
        str(tmp_path / "o"),
        "--no-progress",
        env=env,
    )
    assert swept.returncode == 0, swept.stderr
    assert setter_calls(nvml) == []


def test_a_busy_gpu_error_pickles_with_its_holder() -> None:
    """A Ray actor's error reaches the driver pickled: GpuBusyError did not unpickle (its pid
    argument lost), so a worker whose GPU another dvfs held was 'internal error:
    UnserializableException ... please report it' instead of its one line."""
    import pickle

    from dvfs.errors import GpuBusyError

    error = pickle.loads(pickle.dumps(GpuBusyError("GPU 1 is in use by dvfs (pid 12)", "12")))
    assert isinstance(error, GpuBusyError)
    assert (str(error), error.pid) == ("GPU 1 is in use by dvfs (pid 12)", "12")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_sweep_whose_restore_fails_exits_as_interrupted(
    nvml, tmp_path: Path, env, signum: int
) -> None:
    """Ctrl-C (or SIGTERM) during a sweep, then NVML refused the clock's reset as the sweep put
    the GPU back: the restore's error replaced the interruption, exit 1, where the README
    gives an interrupted sweep 130 (143). It exits as interrupted, the failed restore said in
    its one line, its state file kept for `dvfs gpu reset`."""
    nvml.fake_update_device(0, errors={"nvmlDeviceResetGpuLockedClocks": 999})
    out = tmp_path / "out"
    proc = _start_sweep(long_campaign(tmp_path), out, env)
    try:
        _wait_until_changed(nvml, proc, out / "journal.jsonl")
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, output
    text = " ".join(output.split())
    assert "Traceback" not in text and "internal error" not in text, text
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, output
    assert "could not restore GPU settings" in errors[0] and "dvfs gpu reset" in errors[0], output
    assert "GPU settings restored" not in text, text
    # its state folder is $DVFS_STATE_DIR's, which `sudo` drops: each reset named carries it
    reset = f"`dvfs gpu reset --state-dir {tmp_path / 'dvfs-state'}`"
    assert text.count("`dvfs gpu reset") == text.count(reset) == 2, text
    assert list((tmp_path / "dvfs-state").glob("GPU-*.json")), "the state file is gone"


@pytest.mark.slow
@pytest.mark.parametrize("cube_blocked", [False, True], ids=["cube-written", "cube-blocked"])
def test_a_signal_held_by_a_restore_that_fails_at_the_sweeps_end_exits_as_interrupted(
    nvml, tmp_path: Path, env, cube_blocked: bool
) -> None:
    """Every cell measured, then Ctrl-C while the sweep put the GPU back (held until the restore
    ended), and the restore failed: the held signal was dropped, exit 1. The sweep exits as
    interrupted (130), the failed restore said in one line, its cube written; also where the
    cube could not be written either (a folder at its path), which had exited 1 with no word
    of the interruption."""
    campaign, out = campaign_file(tmp_path), tmp_path / "out"
    # The reset hangs until its deadline fails the restore: the signal comes meanwhile.
    hanging = {
        **env,
        "DVFS_NVML_DEADLINE_S": "4",
        "DVFS_FAKE_NVML_HANG": "nvmlDeviceResetGpuLockedClocks=inf",
    }
    proc = _start_sweep(campaign, out, hanging)
    try:
        wait_for(nvml.fake_hangs_started, "the restore is in NVML")
        if cube_blocked:
            # the cube's write fails: a folder at its path, made once the sweep has begun (one
            # there at its start is refused before anything is measured)
            (out / "cube.nc").mkdir()
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    text = " ".join(output.split())
    assert "Traceback" not in text and "internal error" not in text, text
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, output
    assert "could not restore GPU settings" in errors[0] and "dvfs gpu reset" in errors[0], output
    assert (f"cube: {out / 'cube.nc'}" in text) is not cube_blocked, text
    assert list((tmp_path / "dvfs-state").glob("GPU-*.json")), "the state file is gone"


@pytest.mark.slow
def test_a_restore_given_up_on_names_the_reset_that_reads_its_state_files(
    nvml, tmp_path: Path, env
) -> None:
    """A second Ctrl-C while the sweep put the GPU back gives up on the restore: its notice
    and its line said "run `dvfs gpu reset`", while the state file is in $DVFS_STATE_DIR,
    which `sudo` drops: that reset, run as root, looked in /var/lib/dvfs and found nothing.
    Both name the reset that reads it, as a failed restore's line does."""
    campaign, out = campaign_file(tmp_path), tmp_path / "out"
    hanging = {  # the reset hangs (until its deadline) while the signals come
        **env,
        "DVFS_NVML_DEADLINE_S": "30",
        "DVFS_FAKE_NVML_HANG": "nvmlDeviceResetGpuLockedClocks=inf",
    }
    proc = _start_sweep(campaign, out, hanging)
    try:
        wait_for(nvml.fake_hangs_started, "the restore is in NVML")
        proc.send_signal(signal.SIGINT)
        assert proc.stdout is not None
        for line in proc.stdout:  # the notice of the first, then the second gives up
            if "send it again to give up" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    text = " ".join((line + rest).split())
    reset = f"`dvfs gpu reset --state-dir {tmp_path / 'dvfs-state'}`"
    assert "dvfs stopped restoring them" in text, text
    assert text.count("`dvfs gpu reset") == text.count(reset) >= 2, text
    assert list((tmp_path / "dvfs-state").glob("GPU-*.json")), "the state file is gone"


@pytest.mark.parametrize("argv", [["gpu", "reset", "1"], ["cap", "reset", "1"]])
def test_a_reset_of_one_gpu_is_not_stopped_by_another_gpus_damaged_governor_record(
    nvml, env: dict[str, str], argv: list[str]
) -> None:
    """`dvfs gpu reset 1` with GPU 0's governor record damaged refused GPU 1 ("governed-<GPU
    0>.json is unreadable"), exit 1, and left GPU 1 as the dead run left it: an operator could
    not reset one GPU for another's record. Only the records of the GPUs reset stop it."""
    nvml.fake_reset_state("h100-sxm,h100-sxm")
    state = _state_files(nvml, env, {1: None})  # the GPU as found: no lock, 500 W
    nvml.fake_update_device(1, locked_clocks=[210, 1500], power_limit_mw=400_000)
    (state / f"governed-{nvml.fake_device_state(0)['uuid']}.json").write_text("{damaged")
    result = dvfs_in_process(*argv, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"GPU 1 ({nvml.fake_device_state(1)['uuid']})" in result.stdout, result.stdout
    assert nvml.fake_device_state(1)["locked_clocks"] is None
    assert nvml.fake_device_state(1)["power_limit_mw"] != 400_000
    assert (state / f"governed-{nvml.fake_device_state(0)['uuid']}.json").exists()


def test_a_reset_of_a_gpu_whose_own_governor_record_is_damaged_fails_in_one_line(
    nvml, env: dict[str, str]
) -> None:
    """The damaged governor record of a GPU reset still stops it: named in one line, exit 1."""
    nvml.fake_reset_state("h100-sxm,h100-sxm")
    state = _state_files(nvml, env, {1: [210, 1500]})
    record = state / f"governed-{nvml.fake_device_state(1)['uuid']}.json"
    record.write_text("{damaged")
    result = dvfs_in_process("gpu", "reset", "1", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    [error] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert "is unreadable" in error and f"governed-{nvml.fake_device_state(1)['uuid']}" in error
    assert "Traceback" not in result.stdout + result.stderr


def test_a_reset_of_every_gpu_restores_the_others_beside_a_damaged_governor_record(
    nvml, env: dict[str, str]
) -> None:
    """`dvfs gpu reset` (every GPU, as a governor's unit runs it after a crash) with GPU 0's
    governor record damaged refused every GPU, exit 1, and left GPU 1 as the dead run left it.
    The damaged record's GPU is left as it is and named once the others are restored, as a
    GPU whose state file is damaged is."""
    nvml.fake_reset_state("h100-sxm,h100-sxm")
    state = _state_files(nvml, env, {1: None})
    nvml.fake_update_device(1, locked_clocks=[210, 1500], power_limit_mw=400_000)
    record = state / f"governed-{nvml.fake_device_state(0)['uuid']}.json"
    record.write_text("{damaged")
    result = dvfs_in_process("gpu", "reset", env=env)
    assert nvml.fake_device_state(1)["locked_clocks"] is None, result.stdout + result.stderr
    assert nvml.fake_device_state(1)["power_limit_mw"] != 400_000
    assert f"GPU 1 ({nvml.fake_device_state(1)['uuid']})" in result.stdout, result.stdout
    assert result.returncode == 1, result.stdout + result.stderr
    [error] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert "is unreadable" in error and record.name in error, error
    assert "Traceback" not in result.stdout + result.stderr
    assert record.exists()


def test_a_server_whose_gpus_differ_in_stock_power_limit_is_refused(
    nvml, env, tmp_path: Path
) -> None:
    """A tensor-parallel server's GPUs at other stock limits (GPU 0 at 650 W, GPU 1 at its
    default 700 W): the cube has one stock limit, the first GPU's, while a stock cell ran GPU 1
    at 700 W. Refused in one line before anything is measured, every GPU left as found."""
    path = tmp_path / "tp.toml"
    path.write_text(
        campaign_file(tmp_path).read_text().replace("devices = [0]", "devices = [[0, 1]]")
    )
    result = dvfs_in_process(
        "sweep", str(path), "--out", str(tmp_path / "out"), "--no-progress", env=env
    )
    assert result.returncode == 1, result.stdout
    assert "stock power limits" in result.stderr and "650 W" in result.stderr
    assert "700 W" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "cube.nc").exists()
    assert_as_found(nvml, tmp_path / "dvfs-state")


def _tensor_parallel(tmp_path: Path) -> Path:
    path = tmp_path / "tp.toml"
    path.write_text(
        campaign_file(tmp_path).read_text().replace("devices = [0]", "devices = [[0, 1]]")
    )
    return path


def _said_the_limits(text: str) -> None:
    said = " ".join(text.split())
    assert "start from other stock power limits" in said, said
    assert "GPU 0 (" in said and "at 650 W" in said and "GPU 1 (" in said and "at 700 W" in said
    assert "`dvfs gpu reset --defaults`" in said, said


@pytest.mark.parametrize("observe_only", [False, True])
def test_doctor_fails_gpus_the_sweep_refuses_for_other_stock_power_limits(
    nvml, env, tmp_path: Path, observe_only: bool
) -> None:
    """A tensor-parallel server (GPU 0 at an operator's 650 W, GPU 1 at its default 700 W) and
    a fleet of those two GPUs (`--gpus 0,1`) are refused by the sweep, whose cube has one stock
    limit: `dvfs doctor` passed both. It fails them in the sweep's line, exit 1, read-only
    (no setter called); observe-only too, whose stock is what is in force: the cube's one
    power limit would still misstate one GPU's."""
    flag = ["--observe-only"] if observe_only else []
    for args in (
        [str(_tensor_parallel(tmp_path))],
        [str(campaign_file(tmp_path)), "--gpus", "0,1"],
    ):
        out = ["--out", str(tmp_path / "out")]
        result = dvfs_in_process("doctor", *args, *out, *flag, env=env)
        assert result.returncode == 1, result.stdout
        checked = dvfs_in_process("doctor", *args, *out, *flag, "--json", env=env).stdout
        failed = [c for c in json.loads(checked) if c["status"] == "fail"]
        assert [c["name"] for c in failed] == ["stock"], failed
        _said_the_limits(failed[0]["detail"])
        fleet = "--gpus" in args
        assert ("the fleet's GPUs" if fleet else "the GPUs of one server") in failed[0]["detail"]
    assert setter_calls(nvml) == []
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_the_dry_run_says_the_sweep_would_stop_on_other_stock_power_limits(
    nvml, env, tmp_path: Path
) -> None:
    """The dry run opens the GPUs as the sweep does and says, in a note, what would stop the
    sweep on this machine: GPUs of one server, or of a fleet, at other stock power limits
    went unsaid. It plans all the same (exit 0: it may plan for another machine)."""
    for args in (
        [str(_tensor_parallel(tmp_path))],
        [str(campaign_file(tmp_path)), "--gpus", "0,1"],
    ):
        result = dvfs_in_process(
            "sweep", *args, "--out", str(tmp_path / "out"), "--dry-run", "--no-estimate", env=env
        )
        assert result.returncode == 0, result.stdout + result.stderr
        notes = [line for line in result.stderr.splitlines() if "sweep would stop" in line]
        assert len(notes) == 1, result.stderr
        _said_the_limits(notes[0])
    assert setter_calls(nvml) == []
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_a_fleet_of_other_stock_power_limits_is_refused_before_its_workers_measure(
    nvml, env, tmp_path: Path
) -> None:
    """`--gpus 0,1` at 650 W and 700 W: the fleet refused it only once each worker had timed
    its energy counters and measured its idle power (minutes on real GPUs). It now reads the
    limits first, read-only, and refuses in one line before any worker opens a GPU. Its advice
    was `dvfs gpu reset`, which leaves a limit dvfs did not set (an operator's: no state file)
    as it is; `--defaults` sets the default."""
    result = dvfs_in_process(
        "sweep",
        str(campaign_file(tmp_path)),
        "--gpus",
        "0,1",
        "--out",
        str(tmp_path / "out"),
        "--no-progress",
        env=env,
    )
    assert result.returncode == 1, result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    _said_the_limits(result.stderr)
    assert "the fleet's GPUs" in result.stderr
    assert "timing the GPUs' energy counter" not in result.stderr  # no worker's session began
    said = " ".join(result.stderr.split())
    assert "start from other stock power limits" in said and "`dvfs gpu reset --defaults`" in said
    assert_as_found(nvml, tmp_path / "dvfs-state")
    reset = dvfs_in_process("gpu", "reset", "--defaults", "0", env=env)  # the advice works
    assert reset.returncode == 0, reset.stderr
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


def test_a_limit_dvfs_applied_as_a_cap_is_no_other_stock_for_doctor_as_for_the_sweep(
    nvml, env, tmp_path: Path
) -> None:
    """GPU 0's 650 W applied by dvfs (its caps record): the sweep measures stock at the
    default, 700 W, as GPU 1's, and runs the server; doctor agrees, and puts the cap back."""
    from dvfs.caps import AppliedCaps

    uuid = nvml.fake_device_state(0)["uuid"]
    AppliedCaps(tmp_path / "dvfs-state").update(uuid, {"lock_mhz": None, "power_limit_mw": 650_000})
    path = _tensor_parallel(tmp_path)
    checked = doctor_checks(path, tmp_path / "out", env)
    assert checked["stock"]["status"] == "ok", checked["stock"]
    assert "700 W" in checked["stock"]["detail"], checked["stock"]
    result = dvfs_in_process(
        "sweep", str(path), "--out", str(tmp_path / "out"), "--no-progress", env=env
    )
    assert "stock power limits" not in result.stderr, result.stderr
    assert (tmp_path / "out" / "cube.nc").exists(), result.stderr
    assert nvml.fake_device_state(0)["power_limit_mw"] == 650_000


def test_doctor_and_the_dry_run_say_a_resume_the_sweep_refuses_for_changed_stock(
    nvml, env, tmp_path: Path
) -> None:
    """An observe-only sweep's stock is the power limit in force: set otherwise outside dvfs
    since its journal was started (650 W then, 600 W now), its rerun is refused ('stock
    settings changed', exit 1), which `dvfs doctor --observe-only` passed and the dry run did
    not say. Doctor now fails it in the sweep's line, the dry run says the sweep would stop,
    and the sweep refuses it before it times the energy counters."""
    path = campaign_file(tmp_path)
    out = ["--out", str(tmp_path / "out"), "--observe-only"]
    first = dvfs_in_process("sweep", str(path), *out, "--no-progress", env=env)
    assert first.returncode == 0, first.stderr
    journal = tmp_path / "out" / "journal.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-1]) + "\n")  # its one cell left to run
    checked = json.loads(dvfs_in_process("doctor", str(path), *out, "--json", env=env).stdout)
    assert {c["name"]: c["status"] for c in checked}["resume stock"] == "ok", checked
    nvml.fake_update_device(0, power_limit_mw=600_000)
    said = "the GPU's stock settings changed since this journal was started"
    doctor = dvfs_in_process("doctor", str(path), *out, env=env)
    assert doctor.returncode == 1, doctor.stdout
    checked = json.loads(dvfs_in_process("doctor", str(path), *out, "--json", env=env).stdout)
    failed = [c for c in checked if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["resume stock"], failed
    assert said in failed[0]["detail"], failed
    # the settings in words (a dict's repr once)
    assert "power limit 650 W then; SM clock" in failed[0]["detail"], failed
    assert "power limit 600 W now" in failed[0]["detail"], failed
    dry = dvfs_in_process("sweep", str(path), *out, "--dry-run", "--no-estimate", env=env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    notes = [line for line in dry.stderr.splitlines() if "sweep would stop" in line]
    assert len(notes) == 1 and said in notes[0], dry.stderr
    fresh = dvfs_in_process(
        "sweep", str(path), *out, "--dry-run", "--no-estimate", "--fresh", env=env
    )
    assert "sweep would stop" not in fresh.stderr, fresh.stderr
    swept = dvfs_in_process("sweep", str(path), *out, "--no-progress", env=env)
    assert swept.returncode == 1 and said in swept.stderr, swept.stderr
    assert "timing the GPUs' energy counter" not in swept.stderr, swept.stderr
    assert setter_calls(nvml) == []


def test_the_dry_run_says_the_sweep_would_stop_on_a_gpu_held_or_holding_changes(
    nvml, env, tmp_path: Path
) -> None:
    """A GPU another dvfs holds, or one holding an earlier run's changes (its state file), is
    refused by the sweep (exit 3) and failed by `dvfs doctor`; the dry run, which opens the
    GPUs as the sweep does to say what would stop it on this machine, said nothing of either.
    It now says each in the sweep's words, and plans all the same (exit 0), touching nothing."""
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import GpuLocks, StateStore

    state_dir = tmp_path / "dvfs-state"
    path = campaign_file(tmp_path)
    out = tmp_path / "out"

    def said(*, sweep: bool = False) -> tuple[subprocess.CompletedProcess, list[str]]:
        if sweep:
            ran = dvfs_in_process("sweep", str(path), "--out", str(out), "--no-progress", env=env)
            return ran, []
        dry = dvfs_in_process(
            "sweep", str(path), "--out", str(out), "--dry-run", "--no-estimate", env=env
        )
        assert dry.returncode == 0, dry.stdout + dry.stderr
        notes = [line for line in dry.stderr.splitlines() if "sweep would stop" in line]
        return dry, [" ".join(n.split()) for n in notes]

    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        with GpuLocks(state_dir).hold([gpu]):  # another dvfs on the GPU
            busy, _ = said(sweep=True)
            assert busy.returncode == 3, busy.stderr
            _, notes = said()
            assert len(notes) == 1 and "in use by another dvfs process" in notes[0], notes
        assert said()[1] == []
        store = StateStore(state_dir)
        store.record(GpuSettings(gpu.identity.uuid, None, gpu.power_limit_mw()))  # a dead run's
        pending, _ = said(sweep=True)
        assert pending.returncode == 3 and "dvfs gpu reset" in pending.stderr, pending.stderr
        _, notes = said()
        # with the folder ($DVFS_STATE_DIR, which `sudo` drops): as root, plain looks elsewhere
        reset = f"Run `dvfs gpu reset --state-dir {state_dir}` (as root)"
        assert len(notes) == 1 and reset in notes[0], notes
        assert gpu.identity.uuid in notes[0]
        assert list(state_dir.glob("GPU-*.json")), "the dry run dropped the state file"
        store.clear(gpu.identity.uuid)
    assert said()[1] == []
    assert setter_calls(nvml) == []


def test_the_dry_run_says_the_sweep_would_stop_on_a_damaged_caps_record_or_no_energy_counter(
    nvml, env, tmp_path: Path
) -> None:
    """A caps record the sweep cannot read (exit 1, before it reads the GPUs' stock) and an
    energy counter that does not read (exit 1, as it times the counters) stop the sweep, and
    `dvfs doctor` fails each; the dry run's note of what would stop the sweep on this machine
    said neither. It now says each in the sweep's words (exit 0), touching nothing."""
    path = campaign_file(tmp_path)
    out = tmp_path / "out"
    record = tmp_path / "dvfs-state" / "caps-applied.json"

    def notes() -> list[str]:
        dry = dvfs_in_process(
            "sweep", str(path), "--out", str(out), "--dry-run", "--no-estimate", env=env
        )
        assert dry.returncode == 0, dry.stdout + dry.stderr
        return [" ".join(n.split()) for n in dry.stderr.splitlines() if "sweep would stop" in n]

    def swept() -> subprocess.CompletedProcess:
        return dvfs_in_process("sweep", str(path), "--out", str(out), "--no-progress", env=env)

    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("{not json")
    refused = swept()
    assert refused.returncode == 1 and "caps-applied.json is unreadable" in refused.stderr
    [note] = notes()
    assert "caps-applied.json is unreadable" in note and "remove it, reset the GPUs" in note, note
    assert record.read_text() == "{not json"
    record.unlink()
    nvml.fake_update_device(0, errors={"nvmlDeviceGetTotalEnergyConsumption": 3})
    refused = swept()
    assert refused.returncode == 1 and "cannot read the energy counter" in refused.stderr
    [note] = notes()
    assert "GPU 0: cannot read the energy counter: NVML says Not Supported" in note, note
    nvml.fake_update_device(0, errors={})
    assert notes() == []
    assert setter_calls(nvml) == []
    assert not out.exists()


def test_the_dry_run_says_the_sweep_would_stop_on_a_folder_another_sweep_holds(
    nvml, env, tmp_path: Path
) -> None:
    """Another sweep holding the output folder (its `sweep.lock`) stops the sweep (exit 3) and
    fails `dvfs doctor`'s output folder check; the dry run said nothing of it. It now says so
    in the sweep's words, and plans all the same (exit 0)."""
    import fcntl

    path = campaign_file(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    args = ("sweep", str(path), "--out", str(out))
    fd = os.open(out / "sweep.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        refused = dvfs_in_process(*args, "--no-progress", env=env)
        assert refused.returncode == 3, refused.stderr
        dry = dvfs_in_process(*args, "--dry-run", "--no-estimate", env=env)
        assert dry.returncode == 0, dry.stdout + dry.stderr
        notes = [" ".join(n.split()) for n in dry.stderr.splitlines() if "would stop" in n]
        assert len(notes) == 1 and "is in use by another dvfs sweep" in notes[0], dry.stderr
    finally:
        os.close(fd)
    dry = dvfs_in_process(*args, "--dry-run", "--no-estimate", env=env)
    assert "would stop" not in dry.stderr, dry.stderr


def test_doctor_names_an_unreadable_state_file_as_such_not_as_the_driver(
    nvml, tmp_path: Path, env
) -> None:
    """A state file the sweep cannot read (it refuses the GPU, exit 3) made doctor say "FAIL
    driver: state file ... is unreadable" (the driver fine, checked ok just above) and skip
    the lock, held-knobs, other-process and permission checks. It fails the state check in
    the sweep's words, exit 1, and checks the rest."""
    state_dir = tmp_path / "dvfs-state"
    state_dir.mkdir()
    uuid = nvml.fake_device_state(0)["uuid"]
    (state_dir / f"{uuid}.json").write_text('{"original": {}}')
    campaign = campaign_file(tmp_path)
    out = ["--out", str(tmp_path / "out")]
    swept = dvfs_in_process("sweep", str(campaign), *out, "--no-progress", env=env)
    assert swept.returncode == 3 and "is unreadable" in swept.stderr, swept.stderr
    result = dvfs_in_process("doctor", str(campaign), *out, env=env)
    assert result.returncode == 1, result.stdout
    doc = dvfs_in_process("doctor", str(campaign), *out, "--json", env=env).stdout
    checked = {c["name"]: c for c in json.loads(doc)}
    assert checked["driver"]["status"] == "ok", checked["driver"]
    assert checked["state"]["status"] == "fail", checked.get("state")
    assert checked["state"]["detail"] in " ".join(swept.stderr.split())
    for name in ("lock GPU 0", "held knobs GPU 0", "other processes GPU 0", "permissions"):
        assert name in checked, sorted(checked)


def test_doctor_and_the_dry_run_say_a_fleet_resume_the_sweep_refuses_for_changed_stock(
    nvml, env, tmp_path: Path
) -> None:
    """A fleet (`--gpus 0,1`, local workers) resuming its folder after an operator set another
    power limit on both GPUs (700 W then, 600 W now: observe-only's stock is what is in
    force) is refused by the sweep ('stock settings changed'), which compared only once every
    worker had timed its energy counters and measured its idle power; `dvfs doctor` passed it
    and the dry run did not say, as they checked the one-server case alone. All three now
    refuse it in the fleet's line, read-only, before any worker opens a session."""
    nvml.fake_update_device(0, power_limit_mw=700_000)  # the fleet's GPUs at one limit
    path = campaign_file(tmp_path)
    out = ["--out", str(tmp_path / "out"), "--observe-only", "--gpus", "0,1"]
    first = dvfs_in_process("sweep", str(path), *out, "--no-progress", env=env)
    assert first.returncode == 0, first.stderr
    journal = tmp_path / "out" / "journal.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-1]) + "\n")  # its last cell left to run
    checked = json.loads(dvfs_in_process("doctor", str(path), *out, "--json", env=env).stdout)
    assert {c["name"]: c["status"] for c in checked}["resume stock"] == "ok", checked
    for index in (0, 1):
        nvml.fake_update_device(index, power_limit_mw=600_000)
    said = f"the GPUs' stock settings changed since {journal} was started"
    doctor = dvfs_in_process("doctor", str(path), *out, env=env)
    assert doctor.returncode == 1, doctor.stdout
    checked = json.loads(dvfs_in_process("doctor", str(path), *out, "--json", env=env).stdout)
    failed = [c for c in checked if c["status"] == "fail"]
    assert [c["name"] for c in failed] == ["resume stock"], failed
    assert said in " ".join(failed[0]["detail"].split()), failed
    # the settings in words (the fleet's line printed the journal's JSON once)
    assert "power limit 700 W then; SM clock" in " ".join(failed[0]["detail"].split()), failed
    assert "power limit 600 W now" in " ".join(failed[0]["detail"].split()), failed
    dry = dvfs_in_process("sweep", str(path), *out, "--dry-run", "--no-estimate", env=env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    notes = [" ".join(n.split()) for n in dry.stderr.splitlines() if "sweep would stop" in n]
    assert len(notes) == 1 and said in notes[0], dry.stderr
    fresh = dvfs_in_process(
        "sweep", str(path), *out, "--dry-run", "--no-estimate", "--fresh", env=env
    )
    assert "sweep would stop" not in fresh.stderr, fresh.stderr
    swept = dvfs_in_process("sweep", str(path), *out, "--no-progress", env=env)
    assert swept.returncode == 1, swept.stderr
    assert said in " ".join(swept.stderr.split()), swept.stderr
    assert "timing the GPUs' energy counter" not in swept.stderr, swept.stderr
    assert setter_calls(nvml) == []


@pytest.mark.parametrize("fleet", [False, True], ids=["one-server", "fleet"])
def test_a_finished_folder_whose_stock_changed_is_no_refusal_in_doctor_or_the_dry_run(
    nvml, env, tmp_path: Path, fleet: bool
) -> None:
    """A folder holding every cell, rerun after its GPUs' stock power limit was changed (700 W
    then, 600 W now), measures nothing: the sweep opens no session, so compares no stock, and
    writes its cube, exit 0. Doctor failed 'resume stock' (exit 1) and the dry run said the
    sweep would stop, for a fleet's folder (its check, new) as for one server's. Both pass it
    now, doctor saying there is nothing to measure; an unfinished folder is still refused."""
    nvml.fake_update_device(0, power_limit_mw=700_000)  # the fleet's GPUs at one limit
    path = campaign_file(tmp_path)
    out = ["--out", str(tmp_path / "out"), *(("--gpus", "0,1") if fleet else ())]
    first = dvfs_in_process("sweep", str(path), *out, "--no-progress", env=env)
    assert first.returncode == 0, first.stderr
    for index in (0, 1):
        nvml.fake_update_device(index, power_limit_mw=600_000)
    doctor = dvfs_in_process("doctor", str(path), *out, env=env)
    checked = json.loads(dvfs_in_process("doctor", str(path), *out, "--json", env=env).stdout)
    stock = {c["name"]: c for c in checked}["resume stock"]
    assert (doctor.returncode, stock["status"]) == (0, "ok"), doctor.stdout
    assert "holds every cell: nothing to measure" in stock["detail"], stock
    dry = dvfs_in_process("sweep", str(path), *out, "--dry-run", "--no-estimate", env=env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "would stop" not in dry.stderr, dry.stderr
    swept = dvfs_in_process("sweep", str(path), *out, "--no-progress", env=env)
    assert swept.returncode == 0, swept.stderr
    assert "0 cell(s) measured" in swept.stderr + swept.stdout, swept.stderr
    journal = tmp_path / "out" / "journal.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-1]) + "\n")  # its last cell left to run
    doctor = dvfs_in_process("doctor", str(path), *out, env=env)
    assert doctor.returncode == 1 and "stock settings changed" in doctor.stdout, doctor.stdout
    dry = dvfs_in_process("sweep", str(path), *out, "--dry-run", "--no-estimate", env=env)
    assert "sweep would stop" in dry.stderr and "stock settings changed" in dry.stderr


def test_a_refusal_over_another_state_dir_names_the_reset_that_restores_it(
    nvml, env, tmp_path: Path
) -> None:
    """A command run with --state-dir refused a GPU a died run left changed, saying "Run `dvfs
    gpu reset`": that looks in the default state folder, finds nothing to restore, and the
    command is refused again. It names `dvfs gpu reset --state-dir DIR`, which restores it."""
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    state = tmp_path / "my state"
    nvml.nvmlInit()
    uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(0))
    nvml.nvmlShutdown()
    StateStore(state).record(GpuSettings(uuid=uuid, sm_clock_lock_mhz=None, power_limit_mw=650_000))
    record = state / f"{uuid}.json"
    died = {**json.loads(record.read_text()), "pid": 2**22 + 1}  # above pid_max: no process
    record.write_text(json.dumps(died))
    nvml.fake_update_device(0, power_limit_mw=300_000)  # the died run's change
    argv = ("gpu", "settle", "--clocks", "1500", "--state-dir", str(state))
    refused = dvfs_in_process(*argv, env=env)
    assert refused.returncode == 3, refused.stderr
    said = " ".join(refused.stderr.split())
    advice = said.split("Run `", 1)[1].split("`", 1)[0]
    reset = dvfs_in_process(*shlex.split(advice)[1:], env=env)
    assert reset.returncode == 0, reset.stderr
    assert "restored GPU 0" in reset.stdout, reset.stdout
    assert not record.exists() and nvml.fake_device_state(0)["power_limit_mw"] == 650_000


@pytest.mark.parametrize("observe", [False, True], ids=["changed", "observe-only"])
def test_a_sweep_whose_gpu_falls_off_the_bus_says_so_and_how_to_resume(
    nvml, tmp_path: Path, env, monkeypatch: pytest.MonkeyPatch, observe: bool
) -> None:
    """A --fresh sweep whose one GPU fell off the bus mid-run ended with the failed restore's
    line alone ('could not restore GPU settings: GPU 0 (...): cannot reset locked SM clocks:
    ...'): no word of the loss that stopped it, of the cells left or of resuming. It names the
    GPU lost (index and UUID) with its cells left, the reset to run once it answers (with
    its state folder) where its settings were left, and the command again less --fresh;
    followed to the letter, the rerun measures only the cells left."""
    from dvfs.measure.journal import read_records
    from dvfs.measure.runner import Runner

    uuid = nvml.fake_device_state(0)["uuid"]
    calls: list[int] = []
    run_cell = Runner.run_cell

    def losing(self, cell):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:  # the GPU falls off the bus on the second cell
            nvml.fake_update_device(0, lost=True)
        return run_cell(self, cell)

    monkeypatch.setattr(Runner, "run_cell", losing)
    out = tmp_path / "out"
    argv = ["sweep", str(campaign_file(tmp_path, repeats=2)), "--out", str(out), "--no-progress"]
    argv += ["--observe-only"] if observe else []
    result = dvfs_in_process(*argv, "--fresh", env=env)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    kept = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    total = 2 if observe else 8
    assert 0 < len(kept) < total
    assert last.startswith(
        f"Error: GPU 0 ({uuid}) was lost with {total - len(kept)} cell(s) left (GPU 0: "
    ), last
    assert "fallen off the bus" in last and "could not restore" not in last, last
    reset = f"run `dvfs gpu reset --state-dir {tmp_path / 'dvfs-state'}`, then "
    assert (reset in last) is not observe, last
    assert last.endswith(
        "the journal keeps every finished cell; "
        + ("once it answers again, " if observe else "its settings could not be restored: ")
        + ("" if observe else f"once it answers again, {reset}")
        + "rerun the same command without --fresh to resume (with it, it starts over)"
    ), last
    # followed: the GPU answers again, is reset where the line says, and the command less
    # --fresh resumes, measuring only the cells left
    monkeypatch.setattr(Runner, "run_cell", run_cell)
    nvml.fake_update_device(0, lost=False)
    if not observe:
        command = shlex.split(last.split("run `", 1)[1].split("`", 1)[0])
        assert dvfs_in_process(*command[1:], env=env).returncode == 0
    resumed = dvfs_in_process(*argv, env=env)
    assert resumed.returncode == 0, resumed.stderr
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == total and cells[: len(kept)] == kept and (out / "cube.nc").is_file()
    assert_as_found(nvml, tmp_path / "dvfs-state")


@pytest.mark.parametrize("kept", [1, 2, 3], ids=["one", "two", "three"])
def test_a_lost_gpus_line_says_the_settings_left_in_grammar_for_one_gpu_and_several(
    tmp_path: Path, kept: int
) -> None:
    """A sweep over several GPUs (tensor parallel) whose GPU 0 fell off the bus, with more
    than one GPU's settings left changed, read "GPU-a, GPU-b's settings could not be restored:
    once it answers again": one possessive for a list, and "it" for several GPUs. Each GPU is
    named ("GPU-a and GPU-b", "GPU-a, GPU-b and GPU-c"), and the reset is for once the GPUs
    answer again; one GPU's settings keep "its settings ... once it answers again"."""
    from types import SimpleNamespace

    from dvfs.errors import GpuUnavailableError
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore
    from dvfs.sweep import gpu_lost_error

    uuids = [f"GPU-{i}0000000-0000-0000-0000-000000000000" for i in range(3)]
    gpus = [SimpleNamespace(identity=SimpleNamespace(index=i, uuid=u)) for i, u in enumerate(uuids)]
    state = tmp_path / "state"
    for uuid in uuids[:kept]:
        StateStore(state).record(GpuSettings(uuid=uuid, sm_clock_lock_mhz=None, power_limit_mw=1))
    loss = GpuUnavailableError("GPU 0: fallen off the bus")
    said = str(gpu_lost_error(loss, gpus, 3, state, fresh=False))  # type: ignore[arg-type]
    reset = f"run `dvfs gpu reset --state-dir {state}`, then rerun the same command to resume"
    whose = {
        1: "its settings could not be restored: once it answers again",
        2: f"the settings of {uuids[0]} and {uuids[1]} could not be restored: "
        "once the GPUs answer again",
        3: f"the settings of {uuids[0]}, {uuids[1]} and {uuids[2]} could not be restored: "
        "once the GPUs answer again",
    }[kept]
    assert said.endswith(f"the journal keeps every finished cell; {whose}, {reset}"), said


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_state_folder_the_sweep_cannot_write_says_what_to_do_there(
    nvml, env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """A sweep on real GPUs whose state folder (DVFS_STATE_DIR, /var/lib/dvfs as root) is on a
    read-only or full file system said "cannot write PATH: ...; choose another path", a path
    the sweep takes no option for. It says what to do there (make it writable, free space),
    then to run the sweep again; not another folder (every dvfs holds its GPUs' locks there),
    exit 1, the --out folder left as it was not there."""
    import errno

    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    state_dir = Path(env["DVFS_STATE_DIR"])
    real_mkdir, real_write = Path.mkdir, os.write
    if fault == "read-only":

        def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
            if self == state_dir:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", mkdir)
        # read-only once: it said "read-only file system; its file system is mounted read-only"
        says = f"cannot write {state_dir}: its file system is mounted "
        says += "read-only: make it writable, then run the sweep again"
    else:

        def full(fd: int, data: bytes) -> int:
            if Path(os.readlink(f"/proc/self/fd/{fd}")).parent == state_dir:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", full)
        says = "no space left on device; free space there, then run the sweep again"
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["sweep", str(campaign_file(tmp_path)), "--out", str(out), "--no-progress"]
    )
    monkeypatch.setattr(Path, "mkdir", real_mkdir)
    monkeypatch.setattr(os, "write", real_write)
    assert result.exit_code == 1, result.output
    line = result.stderr.splitlines()[-1]
    assert says in line and "choose another" not in line, line
    assert line.lower().count("read-only") == (fault == "read-only"), line
    assert not out.exists()


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_doctor_fails_a_state_folder_the_sweep_cannot_lock_its_gpus_in(
    nvml, env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The state folder (DVFS_STATE_DIR, /var/lib/dvfs as root) on a read-only or full file
    system: the sweep fails at once, before it measures (it cannot lock its GPUs there), yet
    `dvfs doctor` said "ok state: no unrestored changes", exit 0. Its state check fails, in
    the sweep's words."""
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    state_dir = Path(env["DVFS_STATE_DIR"])
    state_dir.mkdir(parents=True, exist_ok=True)
    real_statvfs = os.statvfs

    def statvfs(path: Any) -> os.statvfs_result:
        got = real_statvfs(path)
        if Path(path).absolute() != state_dir:
            return got
        fields = list(got)
        if fault == "read-only":
            fields[8] |= os.ST_RDONLY  # f_flag
        else:
            fields[3] = fields[4] = 0  # f_bfree, f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)
    campaign = campaign_file(tmp_path)
    out = ["--out", str(tmp_path / "out")]
    result = CliRunner().invoke(cli, ["doctor", str(campaign), *out, "--json"])
    checked = {c["name"]: c for c in json.loads(result.stdout)}
    assert result.exit_code == 1, result.output
    assert checked["state"]["status"] == "fail", checked["state"]
    words = "mounted read-only: make it writable" if fault == "read-only" else "free space there"
    assert str(state_dir) in checked["state"]["detail"], checked["state"]
    assert words in checked["state"]["detail"], checked["state"]
    assert checked["state"]["detail"].endswith("then run the sweep again"), checked["state"]


def test_a_full_disk_under_the_state_folder_names_the_gpus_lock_not_the_out_folder(
    nvml, env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's lock file could not be written (the state folder's disk full): the error, which
    carried no path, was put on the command's one output, `cannot write OUT: no space left on
    the device; free space or choose another --out`, and another --out changes nothing."""
    import errno

    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    state_dir = Path(env["DVFS_STATE_DIR"])
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).parent == state_dir:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["sweep", str(campaign_file(tmp_path)), "--out", str(out), "--no-progress"]
    )
    monkeypatch.setattr(os, "write", real_write)
    [lock] = state_dir.glob("GPU-*.lock")
    assert result.exit_code == 1, result.output
    assert f"cannot write {lock}: no space left" in result.stderr, result.stderr
    assert str(out) not in result.stderr.splitlines()[-1], result.stderr
    # nor its option: the state folder lay in --out's parent folder, taken for a file
    # written beside an output ("choose another --out", which changes nothing)
    assert "--out" not in result.stderr.splitlines()[-1], result.stderr
    assert load_fake().fake_state()["devices"][0]["locked_clocks"] is None


def test_a_relative_xdg_state_home_is_ignored_as_the_xdg_spec_says(
    tmp_path: Path, monkeypatch
) -> None:
    """The XDG base directory spec: a relative $XDG_STATE_HOME is invalid and ignored. Used, it
    named another state folder from each folder a user ran dvfs in, so a sweep's state files
    were left where a `dvfs gpu reset` run elsewhere never looked."""
    from dvfs.gpu import safety

    monkeypatch.setattr(safety.os, "geteuid", lambda: 1000)
    monkeypatch.delenv("DVFS_STATE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", "state")
    assert safety.default_state_dir() == tmp_path / ".local" / "state" / "dvfs"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert safety.default_state_dir() == tmp_path / "xdg" / "dvfs"


def test_a_reset_advised_for_a_relative_state_folder_names_it_from_anywhere(
    tmp_path: Path, monkeypatch
) -> None:
    """`--state-dir state` given to a sweep or `cap apply`: the `dvfs gpu reset --state-dir`
    its advice names must find that folder whichever folder the operator runs it from."""
    from dvfs.gpu import safety

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVFS_STATE_DIR", raising=False)
    advice = safety.reset_command(Path("state"))
    assert advice == f"`dvfs gpu reset --state-dir {shlex.quote(str(tmp_path / 'state'))}`"


def test_a_restore_puts_every_gpu_back_past_state_files_it_cannot_remove(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither state file can be removed (the folder remounted read-only): both GPUs are put
    back still, the error is raised once, after, and both files stay for `dvfs gpu reset`."""
    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.gpu.safety import StateStore

    store = StateStore(tmp_path / "dvfs-state")
    tried: list[str] = []

    def read_only(self: StateStore, uuid: str) -> None:
        tried.append(uuid)
        raise PermissionError(13, "Read-only file system", str(self.path(uuid)))

    with open_nvml_gpus([0, 1], nvml=nvml) as gpus:
        with (
            pytest.raises(PermissionError),
            KnobController(gpus, change_log=store) as knobs,
        ):
            knobs.apply(KnobSetting(1500, 400))
            monkeypatch.setattr(StateStore, "clear", read_only)
        uuids = [g.identity.uuid for g in gpus]
        # each tried as its GPU is back (the GPUs are put back side by side: in any order)
        assert sorted(tried) == sorted(uuids)
        assert sorted(store.left_by_this_process()) == sorted(uuids)
    for index in (0, 1):
        assert nvml.fake_device_state(index)["locked_clocks"] is None


def test_a_sigterm_during_a_slow_read_restores_once_the_read_returns(
    nvml, hang, tmp_path: Path, dispositions
) -> None:
    """A sweep's SIGTERM lands while a read is in the driver, slow but within its deadline:
    the controller's restore waits for the read, then puts the GPU back (never failing "at
    once" as after a hung call), the state file removed, and the signal still ends the run."""
    import threading

    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.gpu.safety import StateStore
    from dvfs.signals import Interrupted

    store = StateStore(tmp_path / "dvfs-state")
    main = threading.main_thread().ident or 0
    restored = threading.Event()

    def sigterm_then_let_go() -> None:
        wait_for(nvml.fake_hangs_started, "the read is stuck in NVML")
        signal.pthread_kill(main, signal.SIGTERM)
        os.environ.pop("DVFS_FAKE_NVML_HANG", None)
        while not restored.is_set():  # (a release just before the read waits is lost)
            nvml.fake_release_hangs()
            time.sleep(0.05)

    with open_nvml_gpus([0], nvml=nvml, deadline_s=3600) as (gpu,):
        helper = threading.Thread(target=sigterm_then_let_go, daemon=True)
        try:
            with (
                pytest.raises(Interrupted),
                KnobController([gpu], change_log=store) as knobs,
            ):
                knobs.apply(KnobSetting(1500, 400))
                hang("nvmlDeviceGetTotalEnergyConsumption")
                helper.start()
                gpu.energy_mj()
        finally:
            restored.set()
            if helper.is_alive():
                helper.join()
        assert not store.pending(gpu.identity.uuid)
    assert [c["ok"] for c in nvml.fake_calls("nvmlDeviceResetGpuLockedClocks")] == [True]
    assert_as_found(nvml, tmp_path / "dvfs-state")


def test_doctor_does_not_blame_a_dead_runs_clock_lock_on_something_outside_dvfs(
    nvml, tmp_path: Path, env
) -> None:
    """A sweep killed with SIGKILL leaves its GPU locked and its state file. doctor failed the
    state check, naming the dead dvfs run and `dvfs gpu reset`, and then warned in `held knobs`
    that the GPU's clocks "may be locked or set outside dvfs" (unlock: nvidia-smi -rgc): the
    lock is that dvfs run's, which the reset puts back. Once reset, nothing is held."""
    store, uuid = _locked_with_a_state_file(nvml, tmp_path, 0)
    campaign = campaign_file(tmp_path)
    checked = doctor_checks(campaign, tmp_path / "out", env)
    assert checked["state"]["status"] == "fail", checked["state"]
    assert "dvfs gpu reset" in checked["state"]["detail"], checked["state"]
    held = checked["held knobs GPU 0"]
    assert "outside dvfs" not in held["detail"].replace("held outside dvfs seen", ""), held
    assert held["status"] == "ok", held
    assert store.pending(uuid), "doctor changes nothing"
