"""Another tenant's compute process on a metered GPU flags the cells it overlapped
(`foreign_process`, invalid): NVML's energy counter is per GPU, so its work would be counted
into theirs; one around an idle baseline flags the cells whose above-idle energy subtracts it
(`idle_baseline_foreign`). Through `dvfs sweep` with the fake NVML and the SGLang stub, which
plays the tenant (`foreign_pid`) and a container's PID namespace (`nvml_pid`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from nvml_support import (
    NVML_CAMPAIGN,
    cube_as_on_an_idle_machine,
    dvfs_in_process,
    fake_env,
    fresh_fake,
)
from sglang_support import EAGLE3_DRAFTER, running, stub_campaign

import dvfs
from dvfs.measure.meter import (
    INVALIDATING,
    Q_FOREIGN_PROCESS,
    Q_IDLE_BASELINE_FOREIGN,
    describe_quality,
)
from dvfs.measure.runner import IDLE_TENANT_TRIES
from dvfs.measure.tenants import TenantCheck, foreign_quality, idle_quality

DEVICES = "h100-sxm,h100-sxm"


@pytest.fixture
def nv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The fake pynvml on a fresh two-GPU state in `tmp_path` (this process and the sweep's)."""
    return fresh_fake(tmp_path, monkeypatch, DEVICES)


@pytest.fixture
def tenant(live_pid: int) -> int:
    """Another tenant's live process (`live_pid`)."""
    return live_pid


def sweep(
    tmp_path: Path,
    stub: dict,
    *,
    clocks: str,
    drafters: str = "",
    batch: str = "[1]",
    idle_per_setting: bool = False,
) -> tuple[int, list[dict], list[dict], str]:
    """The stub on fake GPU 1 at `clocks`, one prompt length, windows long enough for valid
    cells: exit code, cell records, server records, output."""
    path, marker = stub_campaign(
        tmp_path,
        stub={"tpot_s": 0.004, **stub},  # some 19 updates of the 20 ms counter a window
        drafters='\n[drafters.none]\nalgorithm = "none"\n' + drafters,
        batch=batch,
        knobs=f"sm_clock = {clocks}\nsettle_s = 0.0",
        gpu='backend = "nvml"\ndevices = [1]',
        output_tokens=96,
        measurement_extra="precision = 0.5",
        idle_per_setting=idle_per_setting,
    )
    out = tmp_path / "out"
    result = dvfs_in_process(
        "sweep", str(path), "--out", str(out), "--no-progress", env=env(tmp_path)
    )
    records = journal(out)
    assert running(marker) == []
    cells = [r for r in records if r["type"] == "cell"]
    servers = [r for r in records if r["type"] == "server"]
    return result.returncode, cells, servers, " ".join((result.stdout + result.stderr).split())


def journal(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]


def env(tmp_path: Path) -> dict[str, str]:
    return fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)


def flagged(record: dict) -> bool:
    return "foreign_process" in describe_quality(int(record["measurement"]["quality"]))


def idle_flagged(record: dict) -> bool:
    return "idle_baseline_foreign" in describe_quality(int(record["measurement"]["quality"]))


def test_the_flag_is_invalidating() -> None:
    assert Q_FOREIGN_PROCESS & INVALIDATING
    assert describe_quality(Q_FOREIGN_PROCESS) == ["foreign_process"]
    # A tenant around the idle baseline spoils only the above-idle energy: the cell stays valid.
    assert not Q_IDLE_BASELINE_FOREIGN & INVALIDATING
    assert describe_quality(Q_IDLE_BASELINE_FOREIGN) == ["idle_baseline_foreign"]


def test_a_tenant_arriving_mid_sweep_flags_the_cells_it_overlapped(
    nv: ModuleType, tenant: int, tmp_path: Path
) -> None:
    # /generate #1 is the warm-up, #2-#5 the cells at 1980, 1800, 1500, 1200 MHz: the tenant
    # starts during the 1800 MHz cell (after its start was checked) and is gone during the
    # 1500 MHz one (after its start was checked).
    stub = {"foreign_pid": tenant, "foreign_from_request": 3, "foreign_until_request": 4}
    code, cells, servers, output = sweep(tmp_path, stub, clocks="[1980, 1800, 1500, 1200]")
    assert code == 0, output
    uuid = nv.fake_state()["devices"][1]["uuid"]
    assert servers[0]["gpu_pinning"] == f"verified: GPU 1 ({uuid})"
    seen = {c["cell"]["sm_clock_mhz"]: c.get("foreign_processes", []) for c in cells}
    tenant_at = [{"gpu": 1, "pid": tenant, "name": "sleep"}]
    assert seen == {
        1980: [],
        1800: [{**tenant_at[0], "at": "end"}],
        1500: [{**tenant_at[0], "at": "start"}],
        1200: [],
    }
    assert {c["cell"]["sm_clock_mhz"] for c in cells if flagged(c)} == {1800, 1500}
    assert "foreign_process x2: another tenant's compute process" in output
    # Said as it is first seen, once: not only in the closing summary.
    assert output.count(f"another tenant on GPU 1: process {tenant} (sleep)") == 1, output
    cube = cube_as_on_an_idle_machine(tmp_path / "out", env(tmp_path))
    ds = dvfs.open_cube(cube)
    quality = ds["quality"].squeeze().to_series()
    valid = ds["valid"].squeeze().to_series()
    for clock in (1980, 1800, 1500, 1200):
        hit = clock in (1800, 1500)
        assert bool(int(quality[clock]) & Q_FOREIGN_PROCESS) is hit
        assert int(valid[clock]) == (0 if hit else 1)
    done = dvfs_in_process("headroom", cube, "--json", env=env(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pinning" not in done.stderr  # verified: nothing to say
    [row] = json.loads(done.stdout)["rows"]
    assert row["invalid_settings"] == 2
    assert row["chosen"]["sm_clock_mhz"] in (1980, 1200)
    info = json.loads(dvfs_in_process("cube", "info", cube, "--json", env=env(tmp_path)).stdout)
    assert info["gpu_pinning"] == {"none": f"verified: GPU 1 ({uuid})"}
    assert info["quality_flags"]["foreign_process"] == 2


def test_in_a_containers_pid_namespace_nothing_is_flagged_and_every_command_says_unverified(
    nv: ModuleType, tenant: int, tmp_path: Path
) -> None:
    # NVML names the server by a host PID it cannot see as its own: every PID looks foreign.
    # One clock: the verdict is each server's (drafter's), whatever the clock. Nor does NVML
    # read the GPUs' memory, which would verify the pinning (tests/test_pinning_by_memory.py).
    for index in range(2):
        nv.fake_update_device(index, errors={"nvmlDeviceGetMemoryInfo": 3})  # Not Supported
    code, cells, servers, output = sweep(
        tmp_path, {"nvml_pid": tenant}, clocks="[1980]", drafters=EAGLE3_DRAFTER
    )
    assert code == 0, output
    assert len(cells) == 2 and all(c["status"] == "ok" for c in cells)
    assert not any(flagged(c) or c.get("foreign_processes") for c in cells)
    assert [s["gpu_pinning"] for s in servers] == [
        "unverified: NVML lists none of the server's 1 process(es) on any GPU (a container's "
        "PID namespace hides them, or the server has not allocated GPU memory yet); memory "
        "cannot tell: NVML cannot read the memory of GPU 0 (GPU 0: cannot read its memory: "
        "NVML says Not Supported), GPU 1 (GPU 1: cannot read its memory: NVML says Not "
        "Supported)"
    ] * 2
    assert "server's GPU pinning is unverified" in output
    assert "no cell is checked for them (foreign_process)" in output
    cube = str(tmp_path / "out" / "cube.nc")
    info = dvfs_in_process("cube", "info", cube, env=env(tmp_path))
    said = " ".join(info.stdout.split())
    assert "GPU pinning (none) unverified: NVML lists none" in said, said
    for command in ("headroom", "compare"):
        done = dvfs_in_process(command, cube, "--json", env=env(tmp_path))
        assert done.returncode == 0, done.stdout + done.stderr
        json.loads(done.stdout)  # the line goes to stderr: the JSON stays whole
        line = " ".join(done.stderr.split())
        assert line.startswith("GPU pinning unverified for 2 drafter(s) (eagle3: NVML lists")
        assert "not checked for other tenants' processes" in line
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Facts, Paragraph

    section = measured_section(dvfs.open_cube(cube))
    facts = dict(next(b for b in section.blocks if isinstance(b, Facts)).pairs)
    assert facts["GPU pinning (eagle3)"].startswith("unverified: NVML lists none")
    warnings = [b.text for b in section.blocks if isinstance(b, Paragraph)]
    assert any(w.startswith("GPU pinning unverified for 2 drafter(s)") for w in warnings)


def test_doctor_warns_of_a_compute_process_already_on_a_metered_gpu(
    nv: ModuleType, tenant: int, tmp_path: Path
) -> None:
    campaign = tmp_path / "nvml.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    clean = " ".join(dvfs_in_process("doctor", str(campaign), env=env(tmp_path)).stdout.split())
    assert "other processes GPU 0: no compute process on it" in clean, clean
    nv.fake_add_process(0, tenant)
    busy = " ".join(dvfs_in_process("doctor", str(campaign), env=env(tmp_path)).stdout.split())
    assert f"compute process(es) already on it: {tenant} (sleep)" in busy, busy
    assert "flagged foreign_process" in busy
    nv.fake_update_device(0, errors={"nvmlDeviceGetComputeRunningProcesses": 4})  # NoPermission
    blind = " ".join(dvfs_in_process("doctor", str(campaign), env=env(tmp_path)).stdout.split())
    assert "NVML cannot list its compute processes" in blind, blind


def test_compute_processes_are_listed_on_a_driver_without_the_v3_call(
    nv: ModuleType, tenant: int, tmp_path: Path
) -> None:
    """nvidia-ml-py's nvmlDeviceGetComputeRunningProcesses calls NVML's `_v3` and, on a driver
    without it, raises NVMLLibraryMismatchError, which is no NVMLError (doctor ended in an
    internal error, a sweep's tenant and pinning checks in a traceback): dvfs asks the `_v2`
    call then, and a driver without either cannot list them."""
    from dvfs.gpu.nvml import gpu_processes, nvml_session

    campaign = tmp_path / "nvml.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    nv.fake_add_process(0, tenant)
    nv.fake_update_device(0, errors={"nvmlDeviceGetComputeRunningProcesses": 13})
    old = dvfs_in_process("doctor", str(campaign), env=env(tmp_path))
    assert f"compute process(es) already on it: {tenant} (sleep)" in " ".join(old.stdout.split())
    with nvml_session(nv) as module:
        assert gpu_processes(module)[0].pids == frozenset({tenant})
    neither = {"nvmlDeviceGetComputeRunningProcesses": 13}
    neither["nvmlDeviceGetComputeRunningProcesses_v2"] = 13
    nv.fake_update_device(0, errors=neither)
    older = dvfs_in_process("doctor", str(campaign), env=env(tmp_path))
    assert "NVML cannot list its compute processes" in " ".join(older.stdout.split())
    with nvml_session(nv) as module:
        [blind, _] = gpu_processes(module)
    assert blind.pids is None and "Function Not Found" in blind.why, blind


class Listed:
    """A GPU whose compute processes are `pids` (None: it cannot tell)."""

    def __init__(self, index: int, pids: frozenset[int] | None) -> None:
        self.identity = type("Identity", (), {"index": index})()
        self.pids = pids

    def compute_pids(self) -> frozenset[int] | None:
        return self.pids


def test_a_process_the_server_spawned_since_is_its_own_and_a_blind_gpu_flags_nothing() -> None:
    tree = [frozenset({10})]
    asked = []

    def own() -> frozenset[int]:
        asked.append(1)
        return tree[0]

    check = TenantCheck(own)
    gpus = [Listed(0, frozenset({10})), Listed(1, None)]
    assert check.seen(gpus, "start") == () and len(asked) == 1  # nothing new: not asked again
    tree[0] = frozenset({10, 11})  # the server forked a worker onto GPU 0
    gpus[0].pids = frozenset({10, 11, 99})
    [other] = check.seen(gpus, "end")
    assert (other.gpu, other.pid, other.at) == (0, 99, "end") and len(asked) == 2
    assert foreign_quality([other]) == Q_FOREIGN_PROCESS and foreign_quality([]) == 0
    assert idle_quality([other]) == Q_IDLE_BASELINE_FOREIGN and idle_quality([]) == 0
    # Before any server of dvfs's runs, every process on a metered GPU is another tenant's.
    assert {p.pid for p in TenantCheck.none_ours().seen(gpus, "start")} == {10, 11, 99}
    assert TenantCheck(None).seen(gpus, "start") == ()  # pinning unverified: never foreign


def test_a_tenant_during_the_opening_idle_only_flags_the_above_idle_energy_built_on_it(
    nv: ModuleType, tenant: int, tmp_path: Path
) -> None:
    # The tenant is on GPU 1 before dvfs starts, so during the session's opening idle
    # measurement (every try of it), and gone as the server starts: no cell overlaps it. The
    # stock cell's above-idle energy subtracts that opening measurement.
    nv.fake_add_process(1, tenant)
    stub = {"foreign_pid": tenant, "foreign_from_request": 10**6, "foreign_until_request": 0}
    code, cells, _, output = sweep(tmp_path, stub, clocks='"stock"')
    assert code == 0, output
    [cell] = cells
    said = f"another tenant on GPU 1: process {tenant} (sleep) during the session's opening idle"
    assert output.count(said) == 1, output
    assert f"each of {IDLE_TENANT_TRIES} tries" in output
    # Each try after the first is said as it starts: the measurement takes that much longer.
    for attempt in range(2, IDLE_TENANT_TRIES + 1):
        again = f"(sleep); measuring it again (try {attempt} of {IDLE_TENANT_TRIES})"
        assert output.count(again) == 1, output
    assert "flagged idle_baseline_foreign" in output
    assert idle_flagged(cell) and not flagged(cell) and not cell.get("foreign_processes")
    named = {(p["gpu"], p["pid"], p["name"]) for p in cell["idle_foreign_processes"]}
    assert named == {(1, tenant, "sleep")}
    [session] = [r for r in journal(tmp_path / "out") if r["type"] == "session"]
    assert {(p["gpu"], p["pid"], p["at"]) for p in session["idle_foreign_processes"]} == {
        (1, tenant, "start"),
        (1, tenant, "end"),
    }
    cube = cube_as_on_an_idle_machine(tmp_path / "out", env(tmp_path))
    ds = dvfs.open_cube(cube)
    assert int(ds["quality"].max()) & Q_IDLE_BASELINE_FOREIGN
    assert int(ds["valid"].max()) == 1  # its energy per token does not use the idle: valid
    info = json.loads(dvfs_in_process("cube", "info", cube, "--json", env=env(tmp_path)).stdout)
    # idle_s = 0 (the stub's campaign): its opening idle is one instant power reading
    assert info["quality_flags"] == {"idle_baseline_foreign": 1, "idle_from_power_readings": 1}
    assert [(p["gpu"], p["pid"]) for p in info["idle_foreign_processes"]] == [(1, tenant)] * 2
    shown = dvfs_in_process("cube", "info", cube, env=env(tmp_path))
    text = " ".join(shown.stdout.split())
    assert f"(not idle: another tenant's process {tenant} (sleep) on GPU 1 ran during it)" in text
    assert "idle_baseline_foreign: another tenant's compute process" in text, text
    assert "energy_per_token_above_idle_j is wrong" in text
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Facts

    section = measured_section(ds)
    facts = dict(next(b for b in section.blocks if isinstance(b, Facts)).pairs)
    # followed by the one instant power reading's caveat (idle_s = 0)
    assert (
        f"75 W (not idle: another tenant's process {tenant} (sleep) on GPU 1 ran during it) "
        "(the mean of the instant power readings"
    ) in facts["Idle power"], facts["Idle power"]


def test_a_tenant_during_a_settings_idle_baseline_flags_every_cell_that_subtracts_it(
    nv: ModuleType, tenant: int, tmp_path: Path
) -> None:
    # The tenant arrives with the server (before the 1500 MHz baseline) and is gone at the
    # first /generate (the first cell's warm-up, after that cell's start was checked): the
    # first cell overlaps it, the second only shares its setting's baseline.
    stub = {"foreign_pid": tenant, "foreign_until_request": 1}
    code, cells, _, output = sweep(
        tmp_path, stub, clocks="[1500]", batch="[1, 4]", idle_per_setting=True
    )
    assert code == 0, output
    assert len(cells) == 2 and all(c["status"] == "ok" for c in cells)
    assert all(idle_flagged(c) for c in cells)
    assert [flagged(c) for c in cells] == [True, False]
    for cell in cells:
        assert {p["pid"] for p in cell["idle_foreign_processes"]} == {tenant}
    said = f"another tenant on GPU 1: process {tenant} (sleep) during the idle baseline at 1500"
    assert output.count(said) == 1, output
    [session] = [r for r in journal(tmp_path / "out") if r["type"] == "session"]
    assert "idle_foreign_processes" not in session  # the opening one saw none


def test_merged_cubes_keep_each_sources_idle_tenants() -> None:
    import xarray as xr

    from dvfs.cube.idle import idle_foreign_processes
    from dvfs.cube.merge import _idle_foreign

    seen = {"gpu": 0, "pid": 42, "name": "python", "at": "start"}
    clean = xr.Dataset(attrs={"idle_foreign_processes": "[]"})
    busy = xr.Dataset(attrs={"idle_foreign_processes": json.dumps([seen])})
    merged = xr.Dataset(attrs=_idle_foreign([clean, busy]))
    assert idle_foreign_processes(merged) == [seen]
    assert _idle_foreign([xr.Dataset(), xr.Dataset()]) == {}  # older cubes: nothing to say
