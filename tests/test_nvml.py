"""The real NVML backend against a fake `pynvml` with NVML's semantics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

from dvfs.errors import (
    GpuNotSupportedError,
    GpuPermissionError,
    GpuUnavailableError,
    GpuValueError,
)
from dvfs.gpu.base import EVENT_GPU_IDLE, EVENT_SW_POWER_CAP
from dvfs.gpu.nvml import open_nvml_gpus


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DVFS_FAKE_NVML_STATE", str(tmp_path / "fake-nvml.json"))
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", "h100-sxm,h200-sxm")
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "1")
    module = load_fake()
    module.fake_reset_state()
    return module


def test_identity_clocks_and_limits(nvml) -> None:
    with open_nvml_gpus([0, 1], nvml=nvml) as (h100, h200):
        assert h100.identity.name == "NVIDIA H100 80GB HBM3"
        assert h200.identity.memory_clock_mhz == 3201
        clocks = h100.supported_sm_clocks_mhz()
        assert clocks[0] == 1980 and clocks[-1] == 210 and all(c % 15 == 0 for c in clocks)
        limits = h100.power_limit_range()
        assert (limits.min_mw, limits.max_mw, limits.default_mw) == (200_000, 700_000, 700_000)
        assert h100.identity.driver_version
    with open_nvml_gpus([h200.identity.uuid], nvml=nvml) as (by_uuid,):
        assert by_uuid.identity.index == 1


def test_setters_and_readings(nvml) -> None:
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        gpu.lock_sm_clock(1500, 1500)
        assert nvml.fake_device_state(0)["locked_clocks"] == [1500, 1500]
        gpu.set_power_limit_mw(400_000)
        assert gpu.power_limit_mw() == 400_000
        gpu.reset_sm_clock()
        assert nvml.fake_device_state(0)["locked_clocks"] is None
        e0 = gpu.energy_mj()
        assert gpu.energy_mj() >= e0
        assert gpu.power_mw() >= 70_000
        assert gpu.clock_event_reasons() & EVENT_GPU_IDLE
        assert 20 < gpu.temperature_c() < 100
        # A heavy load under a low limit: the driver lowers the clock and says why.
        nvml.fake_set_load(0, 1.0)
        gpu.set_power_limit_mw(200_000)
        assert gpu.clock_event_reasons() & EVENT_SW_POWER_CAP
        assert gpu.sm_clock_mhz() < 1980


def test_clear_errors(nvml, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        with pytest.raises(GpuValueError, match="1507 MHz is not a supported SM clock.*1500, 1515"):
            gpu.lock_sm_clock(1507, 1507)
        with pytest.raises(GpuValueError, match="outside the allowed range 200-700 W"):
            gpu.set_power_limit_mw(800_000)
        monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")
        with pytest.raises(GpuPermissionError, match="run as root"):
            gpu.lock_sm_clock(1500, 1500)
        with pytest.raises(GpuPermissionError, match="systemd"):
            gpu.set_power_limit_mw(500_000)
    with (
        pytest.raises(GpuUnavailableError, match="this machine has 2 GPU"),
        open_nvml_gpus([5], nvml=nvml),
    ):
        pass
    monkeypatch.setenv("DVFS_FAKE_NVML_MISSING", "1")
    with (
        pytest.raises(GpuUnavailableError, match='install the NVIDIA driver.*gpu.backend = "twin"'),
        open_nvml_gpus([0], nvml=nvml),
    ):
        pass


def test_a_gpu_that_is_there_but_unusable_is_not_called_missing(nvml) -> None:
    """A GPU fallen off the bus is listed by NVML but cannot be opened: "no GPU 1: this machine
    has 2 GPU(s) (indices 0-1)" would contradict itself and hide the fix (a reset or reboot)."""
    nvml.fake_update_device(1, lost=True)
    for device in (1, nvml.fake_device_state(1)["uuid"]):
        with pytest.raises(GpuUnavailableError) as caught, open_nvml_gpus([device], nvml=nvml):
            pass
        assert "fallen off the bus" in str(caught.value) and "no GPU" not in str(caught.value)
    nvml.fake_update_device(1, lost=False)
    with (
        pytest.raises(GpuUnavailableError, match="no GPU 'GPU-0000"),
        open_nvml_gpus(["GPU-00000000-0000-0000-0000-000000000000"], nvml=nvml),
    ):
        pass


def test_a_gpu_named_where_nvml_sees_none_is_said_so(nvml, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvmlDeviceGetCount can be 0 with the driver loaded: the refusal said "this machine has
    0 GPU(s) (indices 0--1)"."""
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", "")
    nvml.fake_reset_state()
    with pytest.raises(GpuUnavailableError) as caught, open_nvml_gpus([0], nvml=nvml):
        pass
    assert str(caught.value).startswith("no GPU 0: NVML sees no GPU on this machine")
    assert "0--1" not in str(caught.value)


def test_mig_is_refused(nvml) -> None:
    nvml.fake_update_device(1, mig=True)
    with (
        pytest.raises(GpuNotSupportedError, match="MIG enabled.*not per MIG slice"),
        open_nvml_gpus([1], nvml=nvml),
    ):
        pass


def test_old_driver_fallbacks(nvml, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVFS_FAKE_NVML_OLD_DRIVER", "1")
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        assert gpu.clock_event_reasons() & EVENT_GPU_IDLE
        assert 20 < gpu.temperature_c() < 100


def test_instant_power_falls_back_when_the_field_is_unsupported(nvml) -> None:
    nvml.fake_update_device(0, field_errors={186: 3})
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        assert gpu.power_mw() >= 70_000


@pytest.mark.parametrize(("code", "volta"), [(3, True), (999, False), (10, False)])
def test_an_energy_counter_error_blames_the_gpus_generation_only_when_unsupported(
    nvml, code: int, volta: bool
) -> None:
    """NotSupported is what a pre-Volta GPU answers; an Unknown Error or a Timeout mid-sweep on
    an H100 is the driver's, and "needs a Volta or newer GPU" would send the user astray."""
    from dvfs.errors import GpuError

    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        nvml.fake_update_device(0, errors={"nvmlDeviceGetTotalEnergyConsumption": code})
        with pytest.raises(GpuError, match="cannot read the energy counter") as caught:
            gpu.energy_mj()
    assert ("Volta" in str(caught.value)) is volta
    assert isinstance(caught.value, GpuNotSupportedError) is volta


def test_the_deadline_is_configurable(nvml, monkeypatch: pytest.MonkeyPatch) -> None:
    from dvfs.gpu.deadline import DEFAULT_DEADLINE_S

    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        assert gpu.deadline_s == DEFAULT_DEADLINE_S
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "2.5")
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        assert gpu.deadline_s == 2.5
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "0")  # off: calls run directly
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        assert gpu.deadline_s is None and gpu.power_mw() > 0
    with open_nvml_gpus([0], nvml=nvml, deadline_s=1) as (gpu,):
        assert gpu.deadline_s == 1
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "soon")
    with (
        pytest.raises(GpuValueError, match="DVFS_NVML_DEADLINE_S='soon' is not a number"),
        open_nvml_gpus([0], nvml=nvml),
    ):
        pass


def test_permission_errors_point_to_observe_only_and_the_unit(nvml, monkeypatch) -> None:
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")
        with pytest.raises(GpuPermissionError) as caught:
            gpu.lock_sm_clock(1500, 1500)
    message = str(caught.value)
    assert "run as root" in message and "--observe-only" in message and "systemd" in message


def test_a_gpu_nvml_may_not_talk_to_is_not_one_of_every_gpu(nvml, tmp_path: Path) -> None:
    """nvmlDeviceGetCount (its `_v2`) counts every GPU of the machine, also one whose
    nvmlDeviceGetHandleByIndex returns NO_PERMISSION (nvml.h), as for a GPU a device cgroup
    withholds: `gpu list`, `gpu info` and `cap show` stopped on it, "permission denied by the
    driver: run as root" (exit 4), showing none of the GPUs this process may use."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES="h100-sxm,h200-sxm")
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    for command in (
        ["gpu", "list", "--json"],
        ["gpu", "info", "--json"],
        ["cap", "show", "--json"],
    ):
        shown = dvfs_in_process(*command, env=env)
        assert shown.returncode == 0, (command, shown.stdout, shown.stderr)
        assert [row["index"] for row in json.loads(shown.stdout)] == [0], command
    # Named, it is refused; and NVML refusing every GPU is no one GPU's: exit 4 as before.
    assert dvfs_in_process("gpu", "info", "1", env=env).returncode == 4
    nvml.fake_update_device(0, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    refused = dvfs_in_process("gpu", "list", env=env)
    assert refused.returncode == 4 and "does not let this process" in refused.stderr, refused.stderr


def test_a_gpu_nvml_may_not_talk_to_is_not_sent_to_observe_only(nvml, tmp_path: Path) -> None:
    """A GPU whose nvmlDeviceGetHandleByIndex is NO_PERMISSION cannot even be read: opening it
    gave the setters' hint, "... use `dvfs sweep --observe-only`", and an observe-only sweep
    was refused with the same line."""
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES="h100-sxm,h200-sxm")
    campaign = tmp_path / "nvml.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    nvml.fake_update_device(0, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    out = str(tmp_path / "out")
    swept = dvfs_in_process(
        "sweep", str(campaign), "--observe-only", "--out", out, "--no-progress", env=env
    )
    assert swept.returncode == 4, swept.stdout + swept.stderr
    [said] = [line for line in swept.stderr.splitlines() if line.startswith("Error: ")]
    assert said.startswith("Error: cannot open GPU 0: the driver does not let this process"), said
    assert "observe-only" not in said and "systemd" not in said, said


def test_cap_apply_refuses_a_caps_file_naming_a_gpu_nvml_may_not_talk_to(
    nvml, tmp_path: Path
) -> None:
    """Without CUDA_VISIBLE_DEVICES, every GPU leaves out one NVML refuses with NO_PERMISSION,
    whose UUID it cannot read either: a caps file naming that GPU's UUID was told it "is not
    on this host" (exit 5), and with --skip-missing capped the others and exited 0, the GPU
    the file names left uncapped without a word. It is refused in one line, exit 4, nothing
    capped, dry run or not; a UUID truly not here, where NVML refuses no GPU, is still exit 5."""
    env = fake_env(tmp_path)
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(2)]
    caps = tmp_path / "caps.toml"
    caps.write_text("".join(f'[[gpu]]\nuuid = "{u}"\nsm_clock_max_mhz = 1500\n\n' for u in uuids))
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    for extra in (["--skip-missing"], [], ["--dry-run", "--skip-missing"]):
        applied = dvfs_in_process("cap", "apply", str(caps), *extra, env=env)
        assert applied.returncode == 4, (extra, applied.stdout, applied.stderr)
        assert uuids[1] in applied.stderr and "GPU 1" in applied.stderr, applied.stderr
        assert "not on this host" not in applied.stderr, applied.stderr
        assert nvml.fake_device_state(0)["locked_clocks"] is None, extra  # nothing capped
    # A UUID no GPU here has, with every GPU open: "not on this host", exit 5, as before.
    nvml.fake_update_device(1, errors={})
    caps.write_text(
        f'[[gpu]]\nuuid = "{uuids[0]}"\nsm_clock_max_mhz = 1500\n\n'
        '[[gpu]]\nuuid = "GPU-00000000-0000-0000-0000-000000000000"\nsm_clock_max_mhz = 1500\n'
    )
    missing = dvfs_in_process("cap", "apply", str(caps), env=env)
    assert missing.returncode == 5 and "not on this host" in missing.stderr, missing.stderr


def test_cap_apply_of_gpu_entries_naming_only_a_withheld_gpu_says_it_is_withheld(
    nvml, tmp_path: Path
) -> None:
    """A caps file whose [[gpu]] entries name only a GPU NVML may not talk to (its UUID
    unreadable) was refused as a file for another host ("matches no GPU on this host", exit
    2), where one naming that GPU and another is refused, exit 4, naming the withheld GPU and
    the command to run as a user the GPUs admit. It is refused in that line, exit 4, dry run,
    --skip-missing or not, nothing capped."""
    env = fake_env(tmp_path)
    uuid = nvml.fake_device_state(1)["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(f'[[gpu]]\nuuid = "{uuid}"\nsm_clock_max_mhz = 1500\n')
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    for extra in ([], ["--skip-missing"], ["--dry-run"]):
        refused = dvfs_in_process("cap", "apply", str(caps), *extra, env=env)
        assert refused.returncode == 4, (extra, refused.stdout, refused.stderr)
        [line] = refused.stderr.splitlines()
        assert uuid in line and "GPU 1 (NVML: no permission)" in line, line
        assert "as a user the GPUs admit" in line and "no GPU on this host" not in line, line
        assert nvml.fake_device_state(0)["locked_clocks"] is None, extra
    nvml.fake_update_device(1, errors={})  # every GPU open: applied to that GPU
    applied = dvfs_in_process("cap", "apply", str(caps), env=env)
    assert applied.returncode == 0, (applied.stdout, applied.stderr)
    assert nvml.fake_device_state(1)["locked_clocks"] is not None


def test_cap_apply_naming_only_a_withheld_gpu_beside_a_lost_one_says_both(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same file where another GPU has fallen off the bus too: it was refused as matching
    none of the GPUs that open, exit 1, naming the lost GPU alone (the withheld GPU, the one
    the file names, unsaid), where a file matching another GPU too is refused, exit 4, naming
    both. It is refused in that line, exit 4, dry run, --skip-missing or not, nothing capped;
    where no GPU opens at all, too (it named the lost GPUs alone, exit 1)."""
    devices = "h100-sxm,h100-sxm,h100-sxm"
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", devices)
    nvml.fake_reset_state()
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=devices)
    uuid = nvml.fake_device_state(1)["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(f'[[gpu]]\nuuid = "{uuid}"\nsm_clock_max_mhz = 1500\n')
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    nvml.fake_update_device(2, lost=True)
    for extra in ([], ["--skip-missing"], ["--dry-run"]):
        refused = dvfs_in_process("cap", "apply", str(caps), *extra, env=env)
        assert refused.returncode == 4, (extra, refused.stdout, refused.stderr)
        [line] = refused.stderr.splitlines()
        assert uuid in line and "GPU 1 (NVML: no permission)" in line, line
        assert "GPU 2: the GPU has fallen off the bus" in line, line
        assert nvml.fake_device_state(0)["locked_clocks"] is None, extra
    # no GPU that opens at all (GPU 0 lost too): it named the lost GPUs alone, exit 1
    nvml.fake_update_device(0, lost=True)
    refused = dvfs_in_process("cap", "apply", str(caps), "--skip-missing", env=env)
    assert refused.returncode == 4, (refused.stdout, refused.stderr)
    [line] = refused.stderr.splitlines()
    assert uuid in line and "GPU 1 (NVML: no permission)" in line, line
    assert "GPU 0" in line and "GPU 2" in line and "fallen off the bus" in line, line


def test_gpu_reset_says_a_state_file_a_gpu_nvml_may_not_talk_to_may_hold(
    nvml, tmp_path: Path
) -> None:
    """Every GPU leaves out one NVML refuses with NO_PERMISSION (62e301d): `gpu reset` with no
    GPU named then said "No dvfs state files for these GPUs: nothing to restore", exit 0,
    while a state file recorded that GPU's settings, left unrestored (before, it was refused,
    exit 4). The others are restored, then one line names the file and the GPU, exit 4; with
    no such file, or no GPU withheld, nothing changes."""
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    env = fake_env(tmp_path)
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(2)]
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    quiet = dvfs_in_process("gpu", "reset", env=env)  # no state file: nothing to say
    assert quiet.returncode == 0 and "nothing to restore" in quiet.stdout, quiet.stderr
    store = StateStore(Path(env["DVFS_STATE_DIR"]))
    store.record(GpuSettings(uuids[1], None, 700_000))
    store.record(GpuSettings(uuids[0], None, 700_000))
    reset = dvfs_in_process("gpu", "reset", env=env)
    assert reset.returncode == 4, (reset.stdout, reset.stderr)
    assert "GPU 0" in reset.stdout and store.pending(uuids[0]) == []  # the other, restored
    [line] = reset.stderr.splitlines()
    assert uuids[1] in line and "GPU 1 (NVML: no permission)" in line, line
    assert "nothing to restore" not in reset.stdout, reset.stdout
    assert store.pending(uuids[1])  # left for a user the GPU admits


def test_cap_reset_says_caps_a_gpu_nvml_may_not_talk_to_may_hold(nvml, tmp_path: Path) -> None:
    """Every GPU leaves out one NVML refuses with NO_PERMISSION (62e301d): `cap reset` with no
    GPU named (the caps unit's stop) reset GPU 0, exit 0, while dvfs's caps record still held
    GPU 1's caps, in force (before, it was refused, exit 4). The others are reset, then one
    line names that GPU's caps and the withheld GPU, exit 4; named, or with no caps recorded
    for it, nothing is said."""
    env = fake_env(tmp_path)
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(2)]
    caps = tmp_path / "caps.toml"
    caps.write_text("".join(f'[[gpu]]\nuuid = "{u}"\nsm_clock_max_mhz = 1500\n\n' for u in uuids))
    assert dvfs_in_process("cap", "apply", str(caps), env=env).returncode == 0
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    reset = dvfs_in_process("cap", "reset", env=env)
    assert reset.returncode == 4, (reset.stdout, reset.stderr)
    assert "GPU 0" in reset.stdout and nvml.fake_device_state(0)["locked_clocks"] is None
    [line] = reset.stderr.splitlines()
    assert uuids[1] in line and "GPU 1 (NVML: no permission)" in line, line
    assert dvfs_in_process("cap", "reset", "0", env=env).returncode == 0
    nvml.fake_update_device(1, errors={})
    assert dvfs_in_process("cap", "reset", env=env).returncode == 0  # GPU 1's reset too
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    assert dvfs_in_process("cap", "reset", env=env).returncode == 0  # none recorded for it


def test_the_reset_a_withheld_gpus_records_call_for_reads_the_state_dir_given(
    nvml, tmp_path: Path
) -> None:
    """`gpu reset --state-dir DIR` (and `cap reset --state-dir DIR`) with a GPU NVML may not
    talk to, its record in DIR, said "run dvfs gpu reset (dvfs cap reset) as a user the GPUs
    admit (root, with sudo)": that command looks in the default state folder, where nothing
    is recorded. Each names --state-dir DIR; followed once the GPU is admitted, it restores."""
    import re
    import shlex

    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    env = fake_env(tmp_path)
    mine = tmp_path / "my state"
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(2)]
    caps = tmp_path / "caps.toml"
    caps.write_text(f'[[gpu]]\nuuid = "{uuids[1]}"\nsm_clock_max_mhz = 1500\n')
    applied = dvfs_in_process("cap", "apply", str(caps), "--state-dir", str(mine), env=env)
    assert applied.returncode == 0, applied.stderr
    StateStore(mine).record(GpuSettings(uuids[1], None, 700_000))
    withheld = {"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION}
    nvml.fake_update_device(1, errors=withheld)
    for argv, command in [
        (["gpu", "reset"], "dvfs gpu reset"),
        (["gpu", "reset", "--defaults"], "dvfs gpu reset --defaults"),
        (["cap", "reset"], "dvfs cap reset"),
    ]:
        refused = dvfs_in_process(*argv, "--state-dir", str(mine), env=env)
        assert refused.returncode == 4, (refused.stdout, refused.stderr)
        line = " ".join(refused.stderr.split())
        advised = re.findall(r"run (dvfs .*?) as a user the GPUs admit", line)
        assert advised and set(advised) <= {
            f"dvfs gpu reset --state-dir {shlex.quote(str(mine))}",
            f"{command} --state-dir {shlex.quote(str(mine))}",
        }, line
    nvml.fake_update_device(1, errors={})  # run as a user the GPU admits
    followed = dvfs_in_process(*shlex.split(advised[0])[1:], env=env)
    assert followed.returncode == 0 and "GPU 1" in followed.stdout, followed.stdout
    assert nvml.fake_device_state(1)["locked_clocks"] is None


def test_cap_apply_refusing_a_withheld_gpu_names_one_fallen_off_the_bus_too(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal of a caps file that may name a GPU NVML may not talk to (exit 4, nothing
    capped) names a GPU fallen off the bus in the same line, as cap apply's other refusals do."""
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", "h100-sxm,h100-sxm,h100-sxm")
    nvml.fake_reset_state()
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES="h100-sxm,h100-sxm,h100-sxm")
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(3)]
    caps = tmp_path / "caps.toml"
    caps.write_text("".join(f'[[gpu]]\nuuid = "{u}"\nsm_clock_max_mhz = 1500\n\n' for u in uuids))
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    nvml.fake_update_device(2, lost=True)
    refused = dvfs_in_process("cap", "apply", str(caps), env=env)
    assert refused.returncode == 4, (refused.stdout, refused.stderr)
    [line] = refused.stderr.splitlines()
    assert "GPU 1 (NVML: no permission)" in line and "GPU 2" in line, line
    assert "fallen off the bus" in line and nvml.fake_device_state(0)["locked_clocks"] is None


def test_cap_apply_of_a_model_entry_names_a_gpu_nvml_may_not_talk_to(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every GPU leaves out one NVML refuses with NO_PERMISSION (62e301d), whose model it cannot
    read either: a caps file's [[model]] entry capped the other GPUs of that model and exited
    0, dry run too, without a word of the withheld GPU, which the entry may name, left
    uncapped (the [[gpu]] entries' case is refused, exit 4). The others are capped, then one
    line names the withheld GPU, exit 4 (the dry run says so and changes nothing); with every
    GPU open, nothing is said. A file matching none of the others was refused as meant for
    another host ("matches no GPU on this host", exit 2): it may match the withheld GPU, so it
    is refused in that GPU's line, exit 4, nothing capped."""
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", "h100-sxm,h100-sxm")  # one model
    nvml.fake_reset_state()
    env = fake_env(tmp_path)
    caps = tmp_path / "caps.toml"
    caps.write_text('[[model]]\nname = "NVIDIA H100 80GB HBM3"\nsm_clock_max_mhz = 1500\n')
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    dry = dvfs_in_process("cap", "apply", str(caps), "--dry-run", env=env)
    assert dry.returncode == 4, (dry.stdout, dry.stderr)
    assert "would apply to GPU 0" in dry.stdout, dry.stdout
    [line] = dry.stderr.splitlines()
    assert line.startswith("Error: dry run, nothing changed: ") and "GPU 1" in line, line
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    applied = dvfs_in_process("cap", "apply", str(caps), env=env)
    assert applied.returncode == 4, (applied.stdout, applied.stderr)
    assert "applied to GPU 0" in applied.stdout, applied.stdout
    assert nvml.fake_device_state(0)["locked_clocks"] is not None  # the other, capped
    [line] = applied.stderr.splitlines()
    assert "GPU 1 (NVML: no permission)" in line and "[[model]]" in line, line
    other = tmp_path / "h200.toml"
    other.write_text('[[model]]\nname = "NVIDIA H200"\nsm_clock_max_mhz = 1500\n')
    for extra in ([], ["--dry-run"]):
        refused = dvfs_in_process("cap", "apply", str(other), *extra, env=env)
        assert refused.returncode == 4, (extra, refused.stdout, refused.stderr)
        [line] = refused.stderr.splitlines()
        assert "GPU 1 (NVML: no permission)" in line and "no GPU on this host" not in line, line
    nvml.fake_update_device(1, errors={})
    gone = dvfs_in_process("cap", "apply", str(other), env=env)  # with every GPU open: exit 2
    assert gone.returncode == 2 and "no GPU on this host" in gone.stderr, gone.stderr
    again = dvfs_in_process("cap", "apply", str(caps), env=env)
    assert again.returncode == 0, (again.stdout, again.stderr)
    assert nvml.fake_device_state(1)["locked_clocks"] is not None, again.stdout  # both


def test_cap_apply_of_a_model_entry_names_the_command_to_paste_for_a_withheld_gpu(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A [[model]] caps file applied with --state-dir DIR where NVML withholds a GPU said "run
    dvfs cap apply as a user the GPUs admit (root, with sudo)": no caps file, and no --state-dir,
    so pasted it is refused (missing CAPS_FILE), and with the file added it records its caps in
    another folder than DIR, where `cap show --state-dir DIR` and `cap reset --state-dir DIR`
    look. It names the command whole (the file and --state-dir DIR quoted); followed once the
    GPU is admitted, it caps that GPU and records it in DIR."""
    import re
    import shlex

    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", "h100-sxm,h100-sxm")  # one model
    nvml.fake_reset_state()
    env = fake_env(tmp_path)
    folder = tmp_path / "my state"
    caps = tmp_path / "my caps.toml"
    caps.write_text('[[model]]\nname = "NVIDIA H100 80GB HBM3"\nsm_clock_max_mhz = 1500\n')
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    applied = dvfs_in_process("cap", "apply", str(caps), "--state-dir", str(folder), env=env)
    assert applied.returncode == 4, (applied.stdout, applied.stderr)
    line = " ".join(applied.stderr.split())
    [advice] = re.findall(r"run (dvfs cap apply.*?) as a user the GPUs admit", line)
    assert shlex.split(advice) == ["dvfs", "cap", "apply", str(caps), "--state-dir", str(folder)]
    nvml.fake_update_device(1, errors={})  # now as a user the GPU admits: the advice, as said
    followed = dvfs_in_process(*shlex.split(advice)[1:], env=env)
    assert followed.returncode == 0, (followed.stdout, followed.stderr)
    assert nvml.fake_device_state(1)["locked_clocks"] is not None, followed.stdout
    show = dvfs_in_process("cap", "show", "--state-dir", str(folder), "--json", env=env)
    assert nvml.fake_device_state(1)["uuid"] in show.stdout, show.stdout
    # a [[gpu]] entry that may name the withheld GPU (refused, exit 4): its command whole too
    named = tmp_path / "gpu caps.toml"
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(2)]
    named.write_text("".join(f'[[gpu]]\nuuid = "{u}"\nsm_clock_max_mhz = 1500\n\n' for u in uuids))
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    refused = dvfs_in_process("cap", "apply", str(named), "--state-dir", str(folder), env=env)
    assert refused.returncode == 4, (refused.stdout, refused.stderr)
    line = " ".join(refused.stderr.split())
    [advice] = re.findall(r"run (dvfs cap apply.*?) as a user the GPUs admit", line)
    assert shlex.split(advice) == ["dvfs", "cap", "apply", str(named), "--state-dir", str(folder)]


def test_gpu_reset_defaults_says_caps_a_gpu_nvml_may_not_talk_to_may_hold(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpu reset --defaults` with no GPU named resets every GPU's caps, as `cap reset` does
    (the caps record's entries of the GPUs reset go with them). Every GPU leaves out one NVML
    refuses with NO_PERMISSION: it reset GPU 0, exit 0, while dvfs's caps record still held
    GPU 1's caps, in force; `cap reset` names them, exit 4 (42585d9). So does `gpu reset
    --defaults` now, once the others are reset; without --defaults, or a GPU named, or no caps
    recorded for it, nothing is said."""
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", "h100-sxm,h100-sxm")
    nvml.fake_reset_state()
    env = fake_env(tmp_path)
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(2)]
    caps = tmp_path / "caps.toml"
    caps.write_text("".join(f'[[gpu]]\nuuid = "{u}"\nsm_clock_max_mhz = 1500\n\n' for u in uuids))
    assert dvfs_in_process("cap", "apply", str(caps), env=env).returncode == 0
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    assert dvfs_in_process("gpu", "reset", env=env).returncode == 0  # restores no caps
    reset = dvfs_in_process("gpu", "reset", "--defaults", env=env)
    assert reset.returncode == 4, (reset.stdout, reset.stderr)
    assert "GPU 0" in reset.stdout and nvml.fake_device_state(0)["locked_clocks"] is None
    [line] = reset.stderr.splitlines()
    assert uuids[1] in line and "GPU 1 (NVML: no permission)" in line, line
    assert "caps" in line and "gpu reset --defaults" in line, line
    assert dvfs_in_process("gpu", "reset", "--defaults", "0", env=env).returncode == 0
    nvml.fake_update_device(1, errors={})
    assert dvfs_in_process("gpu", "reset", "--defaults", env=env).returncode == 0  # GPU 1 too
    assert nvml.fake_device_state(1)["locked_clocks"] is None
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    assert dvfs_in_process("gpu", "reset", "--defaults", env=env).returncode == 0  # none recorded


@pytest.mark.parametrize("command", [("cap", "reset"), ("gpu", "reset", "--defaults")])
def test_a_reset_with_state_dir_names_its_folder_for_a_gpu_nvml_may_not_talk_to(
    nvml, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """`cap reset` and `gpu reset --defaults` run with --state-dir DIR name the caps that DIR's
    record holds for a GPU NVML may not talk to, and the command to run as a user the GPU
    admits. That command was the plain `dvfs cap reset` (`dvfs gpu reset --defaults`), which
    reads the default folder: followed, the GPU was reset but DIR's record kept its caps, and
    `cap show --state-dir DIR` still said them in force. It names --state-dir DIR, and
    followed, DIR's record is emptied."""
    import shlex

    env = fake_env(tmp_path)
    folder = tmp_path / "other state"
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(2)]
    caps = tmp_path / "caps.toml"
    caps.write_text("".join(f'[[gpu]]\nuuid = "{u}"\nsm_clock_max_mhz = 1500\n\n' for u in uuids))
    applied = dvfs_in_process("cap", "apply", str(caps), "--state-dir", str(folder), env=env)
    assert applied.returncode == 0, (applied.stdout, applied.stderr)
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    reset = dvfs_in_process(*command, "--state-dir", str(folder), env=env)
    assert reset.returncode == 4, (reset.stdout, reset.stderr)
    [line] = reset.stderr.splitlines()
    assert uuids[1] in line, line
    advice = line.split("; run ", 1)[1].split(" as a user the GPUs admit")[0]
    assert advice.startswith(f"dvfs {' '.join(command)}"), line
    nvml.fake_update_device(1, errors={})  # now as a user the GPU admits: the advice, as said
    followed = dvfs_in_process(*shlex.split(advice)[1:], env=env)
    assert followed.returncode == 0, (followed.stdout, followed.stderr)
    show = dvfs_in_process("cap", "show", "--state-dir", str(folder), env=env)
    assert show.returncode == 0 and "dvfs record" not in show.stdout, show.stdout


def test_cap_show_says_caps_a_gpu_nvml_may_not_talk_to_may_hold(nvml, tmp_path: Path) -> None:
    """Every GPU leaves out one NVML refuses with NO_PERMISSION (62e301d): `cap show` showed
    GPU 0 alone, exit 0, while dvfs's caps record held GPU 1's caps, in force, without a word
    (`cap reset` and `gpu reset --defaults` name such caps). A warning line names them and
    the withheld GPU; GPU 0 is shown as before, exit 0 (a look, as `monitor` says the GPU it
    leaves out). No caps recorded for it, or no GPU withheld: no warning."""
    env = fake_env(tmp_path)
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(2)]
    caps = tmp_path / "caps.toml"
    caps.write_text("".join(f'[[gpu]]\nuuid = "{u}"\nsm_clock_max_mhz = 1500\n\n' for u in uuids))
    assert dvfs_in_process("cap", "apply", str(caps), env=env).returncode == 0
    assert "warning" not in dvfs_in_process("cap", "show", env=env).stderr
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    for args in ((), ("--json",)):
        shown = dvfs_in_process("cap", "show", *args, env=env)
        assert shown.returncode == 0, shown.stderr
        [line] = shown.stderr.splitlines()
        assert line.startswith("warning: dvfs's caps record holds caps for"), line
        assert uuids[1] in line and "GPU 1 (NVML: no permission)" in line, line
        assert uuids[0] in shown.stdout and uuids[1] not in shown.stdout
    assert dvfs_in_process("cap", "reset", "0", env=env).returncode == 0
    nvml.fake_update_device(1, errors={})
    assert dvfs_in_process("cap", "reset", env=env).returncode == 0
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    assert dvfs_in_process("cap", "show", env=env).stderr == ""  # none recorded for it


def test_a_signal_landing_as_a_deadlined_calls_wait_wakes_is_the_interruption(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU's calls run on a worker thread, the caller waiting on the call's Event: a Ctrl-C
    (raised in the caller by `dvfs.signals`) landing as that wait takes its lock back left
    the lock unheld, and the Event's own `with` failed "release unlocked lock": an internal
    error, or a cell failed and the sweep going on. It is the KeyboardInterrupt. The landing
    is made where the race puts it: in the Event's condition taking its lock back."""
    import time

    from dvfs.gpu import deadline

    def signal_lands(_state: object) -> None:
        raise KeyboardInterrupt

    made = deadline._Job.__init__
    jobs: list[deadline._Job] = []

    def landing(job: deadline._Job, *args: object) -> None:
        made(job, *args)  # type: ignore[arg-type]
        job.done._cond._acquire_restore = signal_lands  # type: ignore[attr-defined]
        jobs.append(job)

    def once_the_caller_waits() -> None:  # the call returns as its caller waits on it
        while not jobs[0].done._cond._waiters:  # type: ignore[attr-defined]
            time.sleep(0.001)

    monkeypatch.setattr(deadline._Job, "__init__", landing)
    with pytest.raises(KeyboardInterrupt):
        deadline.CallWorker("gpu0").call(once_the_caller_waits, (), 60.0)
