"""dvfs holds real GPUs to the job's CUDA_VISIBLE_DEVICES: NVML (and so `gpu.devices`, `--gpus`)
ignores it, so without the check a sweep would lock and meter a GPU the job was not given.
The resolver reads the variable as CUDA does; the sweep, its dry run, doctor and `cap reset`
refuse a GPU outside it (exit 2, one line) on the fake NVML; twins are never held to it; Ray's
GPU ids given as UUIDs map to NVML indices."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from click.testing import CliRunner, Result
from conftest import TINY, write
from nvml_support import NVML_CAMPAIGN, installed_root_fake

from dvfs.cli import cli
from dvfs.errors import CampaignError
from dvfs.gpu.visible import Resolved, Visible, check, resolve

UUIDS = [
    "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",
    "GPU-8932f937-aaaa-4106-c12f-20bd9faed9f6",
    "GPU-1c0ffee0-0000-4000-8000-000000000002",
]


def test_resolver_reads_entries_as_cuda_does() -> None:
    assert resolve("2,0", UUIDS).indices == (2, 0)  # CUDA's order, NVML's indices
    assert resolve(UUIDS[1], UUIDS).indices == (1,)
    assert resolve("GPU-1c0ffee0", UUIDS).indices == (2,)  # an unambiguous prefix
    assert resolve(" gpu-1C0FFEE0 , 0", UUIDS).indices == (2, 0)
    ambiguous = resolve("0,GPU-8932f937,2", UUIDS)  # two GPUs share it: CUDA stops there
    assert ambiguous.indices == (0,) and ambiguous.stopped_at == "GPU-8932f937"
    for cut in ("-1", "3", "x"):  # not a GPU here: CUDA sees only the GPUs before it
        assert resolve(f"1,{cut},2", UUIDS) == Resolved((1,), cut)
    assert resolve("GPU-00000000", UUIDS).indices == ()  # not on this machine
    with pytest.raises(CampaignError, match="MIG instance"):
        resolve("MIG-5c89852c-d268-c3f3-1b07-005d5ae1dc3f", UUIDS)
    with pytest.raises(CampaignError, match="MIG instance"):
        resolve("0,MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0", UUIDS)


def test_check_names_the_gpu_the_value_and_what_to_use() -> None:
    check([(2, UUIDS[2])], Visible("2"), UUIDS)
    check([(1, UUIDS[1]), (2, UUIDS[2])], Visible(f"{UUIDS[1]},GPU-1c0ffee0"), UUIDS)
    with pytest.raises(CampaignError) as refused:
        check([(0, UUIDS[0])], Visible("2,1"), UUIDS)
    line = str(refused.value)
    assert "\n" not in line
    for part in (f"GPU 0 ({UUIDS[0]})", "CUDA_VISIBLE_DEVICES='2,1'", "--gpus 2,1"):
        assert part in line, line
    assert "gpu.devices = [2, 1]" in line and "unset CUDA_VISIBLE_DEVICES" in line
    with pytest.raises(CampaignError, match="none of this machine's GPUs.*'GPU-0000'"):
        check([(0, UUIDS[0])], Visible("GPU-0000"), UUIDS)
    with pytest.raises(CampaignError, match="`dvfs cap reset 2`"):
        check([(0, UUIDS[0])], Visible("2", "`dvfs cap reset {spaced}`"), UUIDS)


def test_an_empty_variable_holds_nothing() -> None:
    assert Visible.from_env({}) is None
    assert Visible.from_env({"CUDA_VISIBLE_DEVICES": " "}) is None
    assert Visible.from_env({"CUDA_VISIBLE_DEVICES": "3"}) == Visible("3")


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The fake pynvml (two GPUs, as root) as `pynvml`, its state in tmp_path."""
    return installed_root_fake(tmp_path, monkeypatch)


def _uuid(nvml: ModuleType, index: int) -> str:
    return str(nvml.fake_device_state(index)["uuid"])


def dvfs(visible: str, *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env={"CUDA_VISIBLE_DEVICES": visible})


def _one_line(result: Result, code: int, *parts: str) -> str:
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def _campaign(tmp_path: Path) -> Path:
    return write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=1))


@pytest.mark.parametrize("form", ["uuid", "index"])
def test_a_sweep_refuses_a_gpu_the_variable_does_not_give(
    nvml: ModuleType, tmp_path: Path, form: str
) -> None:
    """gpu.devices = [0] while the job was given NVML GPU 1: refused before any GPU changes."""
    campaign = _campaign(tmp_path)
    given = _uuid(nvml, 1) if form == "uuid" else "1"
    out = tmp_path / "out"
    line = _one_line(
        dvfs(given, "sweep", str(campaign), "--out", str(out), "--no-progress"),
        2,
        f"GPU 0 ({_uuid(nvml, 0)})",
        f"CUDA_VISIBLE_DEVICES={given!r}",
        "--gpus 1",
    )
    assert "gpu.devices = [1]" in line
    assert nvml.fake_calls("nvmlDeviceSetGpuLockedClocks") == []
    assert nvml.fake_calls("nvmlDeviceSetPowerManagementLimit") == []
    assert not (out / "journal.jsonl").exists()
    # The same refusal from the dry run and from doctor, and for a fleet naming GPU 0 too.
    _one_line(dvfs(given, "sweep", str(campaign), "--dry-run", "--no-estimate"), 2, "GPU 0 (")
    two = dvfs(given, "sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress")
    _one_line(two, 2, "GPU 0 (", "--gpus 1")
    doctor = dvfs(given, "doctor", str(campaign), "--out", str(out))
    assert doctor.exit_code == 2, doctor.output
    assert f"CUDA_VISIBLE_DEVICES={given!r}" in doctor.output
    assert nvml.fake_calls("nvmlDeviceSetGpuLockedClocks") == []


def test_a_sweep_runs_on_a_gpu_the_variable_gives(nvml: ModuleType, tmp_path: Path) -> None:
    """Given GPU 0 (by a UUID prefix, and GPU 1 after it): the sweep runs and locks GPU 0 only;
    a fleet on both GPUs the variable gives passes the check."""
    campaign = _campaign(tmp_path)
    given = f"{_uuid(nvml, 0)[:12]},1"
    result = dvfs(given, "sweep", str(campaign), "--out", str(tmp_path / "out"), "--no-progress")
    assert result.exit_code == 0, result.output
    locks = nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")
    assert locks and {c["index"] for c in locks} == {0}
    plan = dvfs(given, "sweep", str(campaign), "--gpus", "0-1", "--dry-run", "--no-estimate")
    assert plan.exit_code == 0, plan.output


def test_cap_reset_is_held_to_the_variable(nvml: ModuleType, tmp_path: Path) -> None:
    _one_line(dvfs("1", "cap", "reset", "0"), 2, "GPU 0 (", "`dvfs cap reset 1`")
    assert dvfs("1", "cap", "reset", "1").exit_code == 0
    # No GPU named: every GPU the job was given, GPU 1 alone; a job given none is refused.
    assert dvfs("1", "cap", "reset").exit_code == 0
    touched = nvml.fake_calls("nvmlDeviceResetGpuLockedClocks") + nvml.fake_calls(
        "nvmlDeviceSetPowerManagementLimit"
    )
    assert touched and {c["index"] for c in touched} == {1}
    _one_line(dvfs("GPU-ffffffff", "cap", "reset"), 2, "GPU 0 (", "none of this machine's")
    assert {c["index"] for c in nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")} <= {1}


def test_the_uuid_of_a_gpu_fallen_off_the_bus_names_that_gpu_not_another_machines() -> None:
    """NVML cannot read a lost GPU's UUID (`machine_uuids` gives ""): a job given it by UUID was
    told to fix CUDA_VISIBLE_DEVICES, and `cap reset` given it beside a healthy GPU reset that one
    and exited 0, the lost GPU unnamed. A UUID entry no readable UUID matches is the one lost
    GPU's; with two lost, the refusal names them."""
    one_lost = [UUIDS[0], "", UUIDS[2]]
    assert resolve(UUIDS[1], one_lost).indices == (1,)
    assert resolve(f"{UUIDS[2]},GPU-8932f937-aaaa", one_lost).indices == (2, 1)
    assert resolve("GPU-8932f937-d72c", one_lost).indices == (0,)  # a readable one still its own
    two_lost = ["", "", UUIDS[2]]
    assert resolve(UUIDS[1], two_lost) == Resolved((), UUIDS[1])
    with pytest.raises(CampaignError, match="perhaps one of GPUs 0, 1, fallen off the bus"):
        check([(2, UUIDS[2])], Visible(UUIDS[1]), two_lost)


@pytest.mark.parametrize("given", ["lost", "healthy,lost"])
def test_cap_reset_given_a_gpu_fallen_off_the_bus_by_uuid_names_it(
    nvml: ModuleType, given: str
) -> None:
    uuids = {"healthy": _uuid(nvml, 0), "lost": _uuid(nvml, 1)}
    nvml.fake_update_device(0, locked_clocks=[210, 1200])
    nvml.fake_update_device(1, lost=True)
    visible = ",".join(uuids[g] for g in given.split(","))
    _one_line(dvfs(visible, "cap", "reset"), 1, "GPU 1", "fallen off the bus")
    assert nvml.fake_device_state(0)["locked_clocks"] is None or given == "lost"


def test_ray_gives_the_uuid_of_a_gpu_fallen_off_the_bus(nvml: ModuleType) -> None:
    """Ray's id of a lost GPU (its UUID unreadable) was blamed on the raylet's
    CUDA_VISIBLE_DEVICES; it is that GPU, whose opening then says it is lost."""
    from dvfs.fleet.ray_executor import placed_group

    lost = _uuid(nvml, 1)
    nvml.fake_update_device(1, lost=True)
    assert placed_group([lost], nvml=nvml) == (1,)


@pytest.mark.parametrize("code", ["NVML_ERROR_RESET_REQUIRED", "NVML_ERROR_UNKNOWN"])
def test_a_gpu_failing_nvml_holds_back_only_itself(
    nvml: ModuleType, tmp_path: Path, code: str
) -> None:
    """Only a lost GPU's unreadable UUID was tolerated: another NVML error on one GPU (it needs
    a reset, an Unknown Error on its handle) refused every command that reads the variable,
    "cannot list GPUs", even a job given only the other GPU. That GPU's UUID is now unknown
    (""), as a lost one's: a job given the other GPU runs; one given the failing GPU by its
    UUID is told that GPU's error when it is opened, not that the variable is wrong."""
    from dvfs.errors import GpuError
    from dvfs.fleet.ray_executor import placed_group
    from dvfs.gpu.nvml import machine_uuids, nvml_session, open_nvml_gpus

    failing, healthy = _uuid(nvml, 0), _uuid(nvml, 1)
    nvml.fake_update_device(0, errors={"nvmlDeviceGetUUID": getattr(nvml, code)})
    with nvml_session(nvml) as module:
        assert machine_uuids(module) == ["", healthy]
    campaign = _campaign(tmp_path)
    for given in ("1", healthy):
        plan = dvfs(given, "sweep", str(campaign), "--gpus", "1", "--dry-run", "--no-estimate")
        assert plan.exit_code == 0, plan.output
    assert placed_group([healthy], nvml=nvml) == (1,)
    with open_nvml_gpus([1], nvml=nvml, visible=Visible(healthy)) as (gpu,):
        assert gpu.identity.index == 1
    with (
        pytest.raises(GpuError) as named,
        open_nvml_gpus([0], nvml=nvml, visible=Visible(failing)),
    ):
        pass
    assert not isinstance(named.value, CampaignError) and "GPU 0" in str(named.value)
    assert str(nvml.NVMLError(getattr(nvml, code))) in str(named.value)


def test_reading_commands_and_restoring_are_not_held(nvml: ModuleType) -> None:
    """Listing every GPU, or restoring what a crashed run left, never meters or changes a GPU
    the job was not given on its behalf."""
    assert dvfs("1", "gpu", "list").exit_code == 0
    assert dvfs("1", "gpu", "info", "0").exit_code == 0
    assert dvfs("1", "gpu", "reset", "0").exit_code == 0


def test_twins_are_never_held_to_it(tmp_path: Path) -> None:
    """The twin's GPUs are no CUDA devices: a twin sweep ignores the variable."""
    campaign = write(tmp_path / "tiny.toml", TINY)
    result = dvfs("GPU-00000000", "sweep", str(campaign), "--out", str(tmp_path / "o"))
    assert result.exit_code == 0, result.output


def test_open_nvml_gpus_holds_to_visible(nvml: ModuleType) -> None:
    """The one place real GPUs are opened applies the rule (the roofline, settle and govern
    open through it too)."""
    from dvfs.gpu.nvml import open_nvml_gpus

    with open_nvml_gpus([1], nvml=nvml, visible=Visible(_uuid(nvml, 1))) as (gpu,):
        assert gpu.identity.index == 1
    with (
        pytest.raises(CampaignError, match="GPU 0 .*--gpu 1"),
        open_nvml_gpus([0], nvml=nvml, visible=Visible("1", "--gpu {indices}")),
    ):
        pass


def test_ray_gpu_ids_given_as_uuids_map_to_nvml_indices(nvml: ModuleType) -> None:
    """Ray's GPU ids are the raylet's CUDA_VISIBLE_DEVICES entries when it had one: UUIDs (or
    prefixes) are looked up through NVML, not cast to int."""
    from dvfs.fleet.ray_executor import placed_group

    assert placed_group([0, 1], nvml=nvml) == (0, 1)
    assert placed_group(["1"], nvml=nvml) == (1,)
    assert placed_group([_uuid(nvml, 1)], nvml=nvml) == (1,)
    assert placed_group([_uuid(nvml, 1)[:13], _uuid(nvml, 0)], nvml=nvml) == (1, 0)
    with pytest.raises(CampaignError, match="GPU-00000000.*CUDA_VISIBLE_DEVICES"):
        placed_group(["GPU-00000000"], nvml=nvml)


def test_a_gpu_named_by_its_index_and_its_uuid_is_named_twice(
    nvml: ModuleType, tmp_path: Path
) -> None:
    """`--gpus 0,UUID-of-0` (or gpu.devices so) names one GPU twice, as `--gpus 0,0` does: the
    sweep, its dry run and doctor refuse it in one line, exit 2, naming the GPU and both
    entries, before any GPU is locked or changed (its two workers each locking it, the second
    was told another dvfs held it, exit 3); two different GPUs by index and UUID still run."""
    campaign = _campaign(tmp_path)
    twice = f"0,{_uuid(nvml, 0)}"
    out = tmp_path / "out"
    why = f"--gpus names GPU 0 (as 0 and {_uuid(nvml, 0)}) twice"
    swept = dvfs("", "sweep", str(campaign), "--gpus", twice, "--out", str(out), "--no-progress")
    _one_line(swept, 2, why)
    _one_line(
        dvfs("", "sweep", str(campaign), "--gpus", twice, "--dry-run", "--no-estimate"), 2, why
    )
    doctor = dvfs("", "doctor", str(campaign), "--gpus", twice, "--out", str(out))
    assert doctor.exit_code == 2, doctor.output
    assert why in " ".join(doctor.output.split()), doctor.output
    # One tensor-parallel server's gpu.devices naming GPU 0 twice: refused alike.
    server = write(
        tmp_path / "tp.toml",
        NVML_CAMPAIGN.format(output_tokens=16, repeats=1).replace(
            "devices = [0]", f'devices = [0, "{_uuid(nvml, 0)}"]'
        ),
    )
    own = f"gpu.devices names GPU 0 (as 0 and {_uuid(nvml, 0)}) twice"
    _one_line(dvfs("", "sweep", str(server), "--out", str(out), "--no-progress"), 2, own)
    assert nvml.fake_calls("nvmlDeviceSetGpuLockedClocks") == []
    assert not out.exists()
    # GPU 0 by index and GPU 1 by UUID are two GPUs: the fleet runs a repeat on each.
    repeated = write(tmp_path / "two.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    fleet = f"0,{_uuid(nvml, 1)}"
    ran = dvfs("", "sweep", str(repeated), "--gpus", fleet, "--out", str(out), "--no-progress")
    assert ran.exit_code == 0, ran.output
    assert {c["index"] for c in nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")} == {0, 1}
