"""Where NVML lists none of a started server's processes by a PID dvfs knows (a container's
PID namespace) or cannot list processes, where the server took its memory says where it runs
(`dvfs.engines.server_memory`): the metered GPUs' memory grew by its claim, "verified by
memory"; a GPU dvfs does not meter did while they did not, refused. Through `dvfs sweep` with
the fake NVML and the SGLang stub (`nvml_pid`: the container's host PID; `nvml_device`: a
wrapper that escaped CUDA_VISIBLE_DEVICES), and the parts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from nvml_support import dvfs_in_process, fake_env, fresh_fake
from sglang_support import EAGLE3_DRAFTER, running, stub_campaign

import dvfs
from dvfs.engines.server_memory import kv_cap, memory_outcome, server_fraction
from dvfs.errors import EngineError
from dvfs.gpu.base import GpuProcesses
from dvfs.gpu.nvml import gpu_processes

DEVICES = "h100-sxm,h100-sxm,h100-sxm"
GIB = 2**30
TOTAL = 80 * GIB


@pytest.fixture
def nv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The fake pynvml on a fresh three-GPU state in `tmp_path` (this process and the sweep's)."""
    return fresh_fake(tmp_path, monkeypatch, DEVICES)


@pytest.fixture
def host_pid(live_pid: int) -> int:
    """The host PID NVML names a container's server by (`live_pid`)."""
    return live_pid


def _sweep(
    tmp_path: Path, stub: dict, drafters: str = "", devices: str = "[1]", sglang_extra: str = ""
) -> tuple[int, list, list, str]:
    """The stub's drafters ("none", and `drafters`) on the fake's GPU 1 (or `devices`, one
    tensor-parallel server on them; `sglang_extra`: more of [engine.sglang]): exit code, cell
    records, server records, output on one line."""
    path, marker = stub_campaign(
        tmp_path,
        stub={"tpot_s": 0.004, **stub},  # windows long enough for valid cells
        drafters='\n[drafters.none]\nalgorithm = "none"\n' + drafters,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        gpu=f'backend = "nvml"\ndevices = {devices}',
        output_tokens=96,
        measurement_extra="precision = 0.5",
        sglang_extra=sglang_extra,
    )
    if devices != "[1]":
        tp = f"tp_size = {len(json.loads(devices))}"
        path.write_text(
            path.read_text().replace(f'model = "{marker}"', f'model = "{marker}"\n{tp}')
        )
    out = tmp_path / "out"
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    result = dvfs_in_process("sweep", str(path), "--out", str(out), "--no-progress", env=env)
    assert running(marker) == []  # every server was stopped, a refused one too
    records = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    cells = [r for r in records if r["type"] == "cell"]
    servers = [r for r in records if r["type"] == "server"]
    return result.returncode, cells, servers, " ".join((result.stdout + result.stderr).split())


# -- end to end ----------------------------------------------------------------------------------


def test_a_container_server_on_the_metered_gpu_is_verified_by_memory(
    nv: ModuleType, host_pid: int, tmp_path: Path
) -> None:
    """NVML names each server by a host PID (a container's PID namespace): the pinning was
    "unverified", whichever GPU the server ran on. Its memory, which only the metered GPU's
    grew by, verifies it now, for each drafter's server (a restart mid-sweep: the second reads
    the GPUs afresh once the first is gone); the cube, `cube info`, the analyses and the report
    say it, and that no cell was checked for other tenants (nothing flagged)."""
    code, cells, servers, output = _sweep(tmp_path, {"nvml_pid": host_pid}, EAGLE3_DRAFTER)
    assert code == 0, output
    assert len(cells) == 2 and all(c["status"] == "ok" for c in cells)
    assert not any(c.get("foreign_processes") for c in cells)
    uuid = nv.fake_state()["devices"][1]["uuid"]
    assert len(servers) == 2
    for server in servers:
        pinning = server["gpu_pinning"]
        assert pinning.startswith(f"verified by memory: GPU 1 ({uuid}) "), pinning
        assert "GiB in 1 new compute process(es), used memory +" in pinning, pinning
        assert "GiB as the server started, of its " in pinning, pinning
        assert "no GPU dvfs does not meter more than 0.0 GiB" in pinning, pinning
        assert "NVML lists none of the server's 1 process(es)" in pinning, pinning
        assert "\n" not in pinning and "unverified" not in pinning
    assert "no cell is checked for them (foreign_process)" in output, output
    cube = str(tmp_path / "out" / "cube.nc")
    recorded = json.loads(dvfs.open_cube(cube).attrs["gpu_pinning"])
    assert recorded == {s["drafter"]: s["gpu_pinning"] for s in servers}
    env = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=DEVICES)
    info = " ".join(dvfs_in_process("cube", "info", cube, env=env).stdout.split())
    assert f"GPU pinning (eagle3) verified by memory: GPU 1 ({uuid})" in info, info
    done = dvfs_in_process("headroom", cube, "--json", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    line = " ".join(done.stderr.split())
    assert line.startswith(
        "GPU pinning verified by memory only (NVML's process lists could not tell) for 2 "
        "drafter(s) (eagle3, none): their cells were not checked for other tenants' processes"
    ), line
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Facts, Paragraph

    section = measured_section(dvfs.open_cube(cube))
    facts = dict(next(b for b in section.blocks if isinstance(b, Facts)).pairs)
    assert facts["GPU pinning (none)"].startswith("verified by memory: GPU 1")
    warnings = [b.text for b in section.blocks if isinstance(b, Paragraph)]
    assert any(w.startswith("GPU pinning verified by memory only") for w in warnings), warnings


def test_a_container_server_that_escaped_to_another_gpu_is_refused_by_its_memory(
    nv: ModuleType, host_pid: int, tmp_path: Path
) -> None:
    """The container's server on GPU 0 (a wrapper that escaped CUDA_VISIBLE_DEVICES: `docker
    run --gpus all`), named by a host PID: the metered GPU 1 measured an idle GPU while the
    pinning said only "unverified". GPU 0's memory grew by the server's claim and GPU 1's did
    not: refused, as a stray PID is, every cell failing with one line naming GPU 0 and the
    wrapper."""
    code, cells, servers, output = _sweep(tmp_path, {"nvml_pid": host_pid, "nvml_device": 0})
    assert code == 5, output
    assert servers == []  # a refused server is never recorded as having served
    assert cells and all(c["status"] == "failed" for c in cells)
    devices = nv.fake_state()["devices"]
    for cell in cells:
        error = cell["error"]
        assert "\n" not in error
        assert f"'none' server's memory went to GPU 0 ({devices[0]['uuid']})" in error, error
        assert "a GPU dvfs does not meter" in error and f"GPU 1 ({devices[1]['uuid']})" in error
        assert "CUDA_VISIBLE_DEVICES" in error and "server_command" in error
    assert all(not d["processes"] for d in nv.fake_state()["devices"])


def test_a_container_tensor_parallel_server_is_verified_by_every_metered_gpus_memory(
    nv: ModuleType, host_pid: int, tmp_path: Path
) -> None:
    code, cells, servers, output = _sweep(tmp_path, {"nvml_pid": host_pid}, devices="[1, 2]")
    assert code == 0, output
    devices = nv.fake_state()["devices"]
    [server] = servers
    pinning = server["gpu_pinning"]
    assert pinning.startswith(f"verified by memory: GPU 1 ({devices[1]['uuid']}) "), pinning
    assert f"; GPU 2 ({devices[2]['uuid']}) " in pinning, pinning


def test_a_kv_capped_server_is_not_refused_for_another_servers_memory(
    nv: ModuleType, host_pid: int, tmp_path: Path
) -> None:
    """--max-total-tokens caps the server's KV pool, so it takes its weights and that pool
    (24 GiB of the stub's 8B model), not its 68 GiB claim, on the metered GPU 1; another
    tenant's uncapped server starts on GPU 0 meanwhile. The server is where it should be: the
    sweep was refused ("memory went to GPU 0"), stopping a user's sweep; now memory cannot
    tell, saying the cap, and the cells run."""
    with host_process() as neighbour:
        stub = {"nvml_pid": host_pid, "neighbour_device": 0, "neighbour_pid": neighbour}
        capped = 'extra_args = ["--max-total-tokens", "65536"]'
        code, cells, servers, output = _sweep(tmp_path, stub, sglang_extra=capped)
    assert code == 0, output
    assert "memory went to" not in output, output
    assert cells and all(c["status"] == "ok" for c in cells)
    [server] = servers
    pinning = server["gpu_pinning"]
    assert pinning.startswith("unverified: NVML lists none of the server's"), pinning
    assert "memory cannot tell: the metered GPU 1 (" in pinning, pinning
    assert "used memory +24.0 GiB" in pinning, pinning
    assert "(--max-total-tokens 65536 caps the server's KV pool: it takes only" in pinning
    assert "GPU 0 (" in pinning and "as it started too" in pinning, pinning


def test_a_server_nvml_cannot_list_is_verified_by_memory(nv: ModuleType, tmp_path: Path) -> None:
    """NVML that lists no processes (Not Supported) but reads memory: verified by memory,
    saying why PIDs could not tell."""
    for index in range(3):
        errors = {"nvmlDeviceGetComputeRunningProcesses": nv.NVML_ERROR_NOT_SUPPORTED}
        nv.fake_update_device(index, errors=errors)
    code, cells, servers, output = _sweep(tmp_path, {})
    assert code == 0, output
    [server] = servers
    pinning = server["gpu_pinning"]
    assert pinning.startswith("verified by memory: GPU 1 ("), pinning
    assert "used memory +" in pinning and "NVML cannot list the compute processes" in pinning


# -- the fake ------------------------------------------------------------------------------------


def test_the_fakes_used_memory_holds_its_live_processes(nv: ModuleType) -> None:
    """As real NVML reads it: used = the driver's reserve + each live context's memory, listed
    or not; a process that exited frees its memory."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    nv.nvmlInit()
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(0)
        idle = nv.nvmlDeviceGetMemoryInfo(handle)
        assert idle.used == 512 * 2**20 and idle.used + idle.free == idle.total
        with host_process() as pid:
            nv.fake_add_process(0, pid, used_bytes=10 * GIB)
            nv.fake_add_process(0, gone.pid, used_bytes=5 * GIB)
            busy = nv.nvmlDeviceGetMemoryInfo(handle)
            assert busy.used == idle.used + 10 * GIB and busy.free == busy.total - busy.used
            errors = {"nvmlDeviceGetComputeRunningProcesses": nv.NVML_ERROR_NOT_SUPPORTED}
            nv.fake_update_device(0, errors=errors)
            assert nv.nvmlDeviceGetMemoryInfo(handle).used == busy.used  # unlisted, still used
        assert nv.nvmlDeviceGetMemoryInfo(handle).used == idle.used
    finally:
        nv.nvmlShutdown()


class host_process:  # noqa: N801 (a context manager read as a phrase)
    """A live `sleep` for the block: its pid."""

    def __enter__(self) -> int:
        self.process = subprocess.Popen(["sleep", "120"])
        return self.process.pid

    def __exit__(self, *exc: object) -> None:
        self.process.kill()
        self.process.wait()


def test_gpu_processes_reads_every_gpus_memory_and_each_processes_own(nv: ModuleType) -> None:
    nv.nvmlInit()
    try:
        with host_process() as pid:
            nv.fake_add_process(2, pid, used_bytes=3 * GIB)
            unsupported = {"nvmlDeviceGetMemoryInfo": nv.NVML_ERROR_NOT_SUPPORTED}
            nv.fake_update_device(1, errors=unsupported)
            gpus = gpu_processes(nv)
    finally:
        nv.nvmlShutdown()
    assert [g.used_bytes for g in gpus] == [512 * 2**20, None, 512 * 2**20 + 3 * GIB]
    assert gpus[0].total_bytes == gpus[2].total_bytes == 81559 * 2**20
    assert "Not Supported" in gpus[1].memory_why
    assert gpus[2].process_bytes == {pid: 3 * GIB} and gpus[2].pids == frozenset({pid})


# -- the parts -----------------------------------------------------------------------------------


def _gpu(
    index: int,
    used_gib: float | None,
    pids: dict[int, float] | None = None,
    total: int = TOTAL,
) -> GpuProcesses:
    """GPU `index` (UUID GPU-<index>) using `used_gib`, listing `pids` with their own GiB (None:
    NVML cannot list them)."""
    listed = None if pids is None else frozenset(pids)
    own = {p: int(g * GIB) for p, g in (pids or {}).items()}
    used = None if used_gib is None else int(used_gib * GIB)
    return GpuProcesses(
        index, f"GPU-{index}", listed, "", used, total, "" if used is not None else "no", own
    )


FRACTION = (0.85, "mem_fraction_static 0.85")
WHY = "NVML lists none of the server's 3 process(es) on any GPU"


def test_the_metered_gpus_grown_by_the_claim_verify_a_tensor_parallel_group() -> None:
    before = [_gpu(0, 0.5, {}), _gpu(1, 0.5, {}), _gpu(2, 0.5, {})]
    after = [_gpu(0, 68, {9: 67.5}), _gpu(1, 68, {10: 67.5}), _gpu(2, 1.5, {})]
    outcome = memory_outcome("d", before, after, ["GPU-0", "GPU-1"], FRACTION, WHY)
    assert outcome.startswith(
        "verified by memory: GPU 0 (GPU-0) 67.5 GiB in 1 new compute process(es), used memory "
        "+67.5 GiB; GPU 1 (GPU-1) 67.5 GiB in 1 new compute process(es), used memory +67.5 GiB "
        "as the server started, of its "
        "68.0 GiB claim (mem_fraction_static 0.85), and no GPU dvfs does not meter more than "
        "1.0 GiB"
    ), outcome
    assert outcome.endswith(f"(PIDs could not tell: {WHY})")
    # One of the group's GPUs that did not grow: memory cannot tell.
    half = [_gpu(0, 68, {9: 67.5}), _gpu(1, 0.5, {}), _gpu(2, 0.5, {})]
    short = memory_outcome("d", before, half, ["GPU-0", "GPU-1"], FRACTION, WHY)
    assert short.startswith(f"unverified: {WHY}; memory cannot tell: the metered GPU 1"), short


def test_a_stray_gpus_memory_is_refused_only_where_no_metered_gpu_grew() -> None:
    before = [_gpu(0, 0.5, {}), _gpu(1, 0.5, {})]
    escaped = [_gpu(0, 68, {9: 67.5}), _gpu(1, 0.5, {})]
    with pytest.raises(EngineError) as refused:
        memory_outcome("d", before, escaped, ["GPU-1"], FRACTION, WHY)
    said = str(refused.value)
    assert "\n" not in said
    assert said.startswith(
        "the 'd' server's memory went to GPU 0 (GPU-0) 67.5 GiB in 1 new compute process(es), "
        "used memory +67.5 GiB as it started, a GPU dvfs does not meter (the server's claim "
        "there: 68.0 GiB, mem_fraction_static 0.85), not to the metered (GPU 1 (GPU-1) used "
        "memory +0.0 GiB): "
        "check CUDA_VISIBLE_DEVICES and the engine.sglang.server_command wrapper"
    ), said
    # Another tenant's job starting on GPU 0 meanwhile, the server on the metered GPU 1 too:
    # memory cannot tell which is which.
    both = [_gpu(0, 40, {9: 39.5}), _gpu(1, 68, {10: 67.5})]
    outcome = memory_outcome("d", before, both, ["GPU-1"], FRACTION, WHY)
    assert outcome.startswith(f"unverified: {WHY}; memory cannot tell: GPU 0 (GPU-0) 39.5 GiB")
    assert "a GPU dvfs does not meter (another tenant's job starting meanwhile" in outcome


def test_tenants_memory_noise_and_an_earlier_servers_memory_do_not_mislead() -> None:
    """A tenant's few GiB more on another GPU is noise; an earlier server's memory still being
    freed as the next one starts hides its growth, but not its new process's own memory."""
    before = [_gpu(0, 10.5, {5: 10}), _gpu(1, 70, {7: 69.5})]  # 7: the old server, exiting
    after = [_gpu(0, 14.5, {5: 14}), _gpu(1, 68, {8: 67.5})]
    outcome = memory_outcome("d", before, after, ["GPU-1"], FRACTION, WHY)
    assert outcome.startswith("verified by memory: GPU 1 (GPU-1) 67.5 GiB in 1 new"), outcome
    assert "no GPU dvfs does not meter more than 4.0 GiB" in outcome
    # Without process lists the used memory alone cannot tell: it fell.
    blind_before = [_gpu(0, 10.5), _gpu(1, 70)]
    blind_after = [_gpu(0, 14.5), _gpu(1, 68)]
    unsure = memory_outcome("d", blind_before, blind_after, ["GPU-1"], FRACTION, WHY)
    assert unsure.startswith("unverified: ") and "used memory -2.0 GiB" in unsure, unsure


def test_a_metered_gpu_still_full_before_the_start_refuses_nothing() -> None:
    """NVML that lists no processes, the metered GPU still holding an earlier server's memory
    as the next starts (it cannot grow by the claim), while a fleet's other worker starts its
    server on GPU 0: no refusal, memory cannot tell."""
    before = [_gpu(0, 0.5), _gpu(1, 68)]
    after = [_gpu(0, 68), _gpu(1, 68)]
    outcome = memory_outcome("d", before, after, ["GPU-1"], FRACTION, WHY)
    assert outcome.startswith(f"unverified: {WHY}; memory cannot tell: the metered GPU 1"), outcome
    assert "GPU 0 (GPU-0) used memory +67.5 GiB as it started too" in outcome, outcome


def test_memory_that_cannot_tell_leaves_the_pinning_unverified_saying_why() -> None:
    before = [_gpu(0, 0.5), _gpu(1, 0.5)]
    unread = memory_outcome("d", before, [_gpu(0, 0.5), _gpu(1, None)], ["GPU-1"], FRACTION, WHY)
    assert (
        unread
        == f"unverified: {WHY}; memory cannot tell: NVML cannot read the memory of GPU 1 (no)"
    )
    # A tenant's 50 GiB there before: SGLang filled the GPU to its claim, 18 GiB more.
    crowded = memory_outcome(
        "d", [_gpu(0, 0.5), _gpu(1, 50)], [_gpu(0, 0.5), _gpu(1, 68)], ["GPU-1"], FRACTION, WHY
    )
    assert "memory cannot tell: the metered GPU 1 (GPU-1) used memory +18.0 GiB" in crowded
    assert "(memory held there before, another tenant's or an earlier server's" in crowded
    small = memory_outcome(
        "d",
        before,
        [_gpu(0, 0.5), _gpu(1, 1.5)],
        ["GPU-1"],
        (0.01, "mem_fraction_static 0.01"),
        WHY,
    )
    assert "is under 2.0 GiB, within tenants' memory noise" in small, small
    gone = memory_outcome("d", before, [_gpu(0, 0.5)], ["GPU-1"], FRACTION, WHY)
    assert gone.endswith("memory cannot tell: NVML lists no GPU GPU-1"), gone


def test_a_server_whose_gpu_a_tenant_left_meanwhile_is_not_refused() -> None:
    """NVML that lists no processes; a tenant's 30 GiB on the metered GPU 1 before the start.
    SGLang claims mem_fraction_static of the memory free as it starts (0.85 x 49.5 GiB: 42.1
    GiB), then the tenant's job ends before the server answers: GPU 1 grew by 12.1 GiB only,
    while another server took 68 GiB of GPU 0. The server is on GPU 1 (its 12 GiB say so):
    memory cannot tell, no refusal; a metered GPU that took nothing (under 2 GiB) still is."""
    before = [_gpu(0, 0.5), _gpu(1, 30.5)]
    after = [_gpu(0, 68.5), _gpu(1, 0.5 + 0.85 * 49.5)]
    outcome = memory_outcome("d", before, after, ["GPU-1"], FRACTION, WHY)
    assert outcome.startswith(f"unverified: {WHY}; memory cannot tell: the metered GPU 1"), outcome
    assert "GPU 0 (GPU-0) used memory +68.0 GiB as it started too" in outcome, outcome
    escaped = [_gpu(0, 68.5), _gpu(1, 32)]  # the tenant's noise: 1.5 GiB more
    with pytest.raises(EngineError, match="memory went to GPU 0"):
        memory_outcome("d", before, escaped, ["GPU-1"], FRACTION, WHY)


def test_a_kv_capped_server_short_of_its_claim_refuses_nothing() -> None:
    """A small model's weights and capped KV pool (1.5 GiB) on the metered GPU 1, another
    server's 68 GiB on GPU 0: without the cap that is the escape refused; with it, memory
    cannot tell."""
    before = [_gpu(0, 0.5), _gpu(1, 0.5)]
    after = [_gpu(0, 68.5), _gpu(1, 2)]
    with pytest.raises(EngineError):
        memory_outcome("d", before, after, ["GPU-1"], FRACTION, WHY)
    outcome = memory_outcome("d", before, after, ["GPU-1"], FRACTION, WHY, 65536)
    assert outcome.startswith(f"unverified: {WHY}; memory cannot tell: the metered GPU 1"), outcome
    assert "(--max-total-tokens 65536 caps the server's KV pool: it takes only its" in outcome
    # Grown by the claim all the same, and nothing elsewhere: verified, capped or not.
    full = memory_outcome("d", before, [_gpu(0, 0.5), _gpu(1, 68)], ["GPU-1"], FRACTION, WHY, 8)
    assert full.startswith("verified by memory: GPU 1 (GPU-1) used memory +67.5 GiB"), full
    assert kv_cap({"max_total_tokens": 65536}, None) == 65536
    assert kv_cap({"max_total_tokens": None}, 4096) == 4096
    assert kv_cap({}, None) is None and kv_cap({"max_total_tokens": True}, None) is None


def test_the_note_on_a_memory_verified_server_says_only_what_nvml_could_not_tell() -> None:
    """NVML listed the server on its metered GPU but could not list another GPU's processes:
    verified by memory, and the note does not say NVML listed none of its PIDs."""
    import xarray as xr

    from dvfs.cube.pinning import pinning_note

    blind = "NVML cannot list the compute processes of GPU 2 (Not Supported)"
    outcome = memory_outcome(
        "d", [_gpu(0, 0.5), _gpu(1, 0.5)], [_gpu(0, 0.5), _gpu(1, 68)], ["GPU-1"], FRACTION, blind
    )
    assert outcome.startswith("verified by memory: GPU 1 (GPU-1)"), outcome
    note = pinning_note(xr.Dataset(attrs={"gpu_pinning": json.dumps({"d": outcome})}))
    assert note is not None and "verified by memory only" in note, note
    assert "listed none" not in note, note


def test_the_claim_is_the_servers_reported_fraction_else_the_one_passed() -> None:
    assert server_fraction({"mem_fraction_static": 0.88}, 0.7) == (0.88, "mem_fraction_static 0.88")
    assert server_fraction({"mem_fraction_static": None}, 0.6) == (
        0.6,
        "mem_fraction_static 0.6 as passed",
    )
    assert server_fraction({}, None) == (0.7, "mem_fraction_static unreported, 0.7 taken")


@pytest.mark.parametrize(
    "reported", [85, 1.5, float("inf"), float("nan"), 1e308, -0.5, 0, True, "0.8", [0.8], {"a": 1}]
)
def test_a_reported_fraction_that_is_no_share_of_memory_is_not_taken(reported: object) -> None:
    """A /server_info saying anything but a number in (0, 1] (a percentage, inf, a string) is
    as good as unreported: its claim would be above the GPU's memory, or NaN."""
    assert server_fraction({"mem_fraction_static": reported}, 0.6) == (
        0.6,
        "mem_fraction_static 0.6 as passed",
    )
    assert server_fraction({"mem_fraction_static": reported}, None)[0] == 0.7
    assert server_fraction({}, float("inf"))[0] == 0.7


NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE (c_ulonglong(-1)), as a binding may pass it


def test_memory_nvml_cannot_mean_refuses_nothing() -> None:
    """A process whose usedGpuMemory is NVML_VALUE_NOT_AVAILABLE, or a GPU said to use more than
    it has, on a GPU dvfs does not meter is no server's claim: the metered GPU that took nothing
    is not refused for it; memory cannot tell."""
    before = [_gpu(0, 0.5, {}), _gpu(1, 0.5, {})]
    stray = _gpu(1, 0.5, {})
    garbled = GpuProcesses(
        1, "GPU-1", frozenset({9}), "", stray.used_bytes, TOTAL, "", {9: NOT_AVAILABLE}
    )
    outcome = memory_outcome("d", before, [_gpu(0, 0.5, {}), garbled], ["GPU-0"], FRACTION, WHY)
    assert outcome.startswith(f"unverified: {WHY}; memory cannot tell: the metered GPU 0"), outcome
    over = GpuProcesses(1, "GPU-1", frozenset(), "", NOT_AVAILABLE, TOTAL, "", {})
    outcome = memory_outcome("d", before, [_gpu(0, 0.5, {}), over], ["GPU-0"], FRACTION, WHY)
    assert f"NVML cannot read the memory of GPU 1 (NVML says {NOT_AVAILABLE} bytes used of" in (
        outcome
    ), outcome
    # Nor is a metered GPU verified by such memory.
    mine = GpuProcesses(
        0, "GPU-0", frozenset({9}), "", stray.used_bytes, TOTAL, "", {9: NOT_AVAILABLE}
    )
    outcome = memory_outcome("d", before, [mine, _gpu(1, 0.5, {})], ["GPU-0"], FRACTION, WHY)
    assert outcome.startswith("unverified: "), outcome
    # A process NVML cannot read the memory of (None, as nvidia-ml-py reports it): its GPU's
    # used memory alone tells.
    unread = GpuProcesses(0, "GPU-0", frozenset({9}), "", int(68 * GIB), TOTAL, "", {})
    outcome = memory_outcome("d", before, [unread, _gpu(1, 0.5, {})], ["GPU-0"], FRACTION, WHY)
    assert outcome.startswith("verified by memory: GPU 0 (GPU-0) used memory +67.5 GiB"), outcome


def test_a_drafter_verified_by_pid_in_one_session_and_by_memory_in_another_is_named_so() -> None:
    """A resumed (or merged) cube joins each drafter's distinct outcomes: one verified by PID
    in one session and by memory in another is not memory-only; the line says which."""
    import xarray as xr

    from dvfs.cube.pinning import pinning_note

    both = "verified: GPU 0 (GPU-a); verified by memory: GPU 0 (GPU-a) grew 60 GiB"
    pinning = {"eagle3": both, "none": "verified by memory: GPU 0 (GPU-a)"}
    note = pinning_note(xr.Dataset(attrs={"gpu_pinning": json.dumps(pinning)}))
    assert note is not None
    assert "PID" in note and "for 1 drafter(s) (none)" in note, note
    assert "for some servers of 1 drafter(s) (eagle3; the others by PID)" in note, note
    # whether NVML listed processes at all is another server's story: only what it could not tell
    assert "listed none" not in note and "could not tell" in note, note
    alone = {"eagle3": "verified by memory: GPU 0 (GPU-a); verified: GPU 0 (GPU-a)"}
    note = pinning_note(xr.Dataset(attrs={"gpu_pinning": json.dumps(alone)}))
    assert note is not None and "memory only (NVML listed none of the server's PIDs) for 1" not in (
        note
    ), note
    assert note.endswith(
        "(eagle3; the others by PID): those servers' cells were not checked for other tenants' "
        "processes on the metered GPUs (foreign_process)"
    ), note
    verified = {"eagle3": "verified: GPU 0 (GPU-a)"}
    assert pinning_note(xr.Dataset(attrs={"gpu_pinning": json.dumps(verified)})) is None


def test_gpus_whose_uuid_nvml_could_not_read_are_each_compared_with_themselves() -> None:
    """Two GPUs dvfs does not meter whose UUID read failed ("?"): each is found again after the
    start by its index, not taken for the other (a tenant's full GPU 0 read against the empty
    GPU 2's earlier memory grew by 69.5 GiB: a stray server's, leaving the pinning unverified)."""

    def unnamed(gpu: GpuProcesses) -> GpuProcesses:
        return GpuProcesses(
            gpu.index, "?", gpu.pids, "", gpu.used_bytes, gpu.total_bytes, "", gpu.process_bytes
        )

    before = [unnamed(_gpu(0, 70, {})), _gpu(1, 0.5, {}), unnamed(_gpu(2, 0.5, {}))]
    after = [unnamed(_gpu(0, 70, {})), _gpu(1, 68, {9: 67.5}), unnamed(_gpu(2, 0.5, {}))]
    outcome = memory_outcome("d", before, after, ["GPU-1"], FRACTION, WHY)
    assert outcome.startswith("verified by memory: GPU 1 (GPU-1) 67.5 GiB"), outcome
    assert "no GPU dvfs does not meter more than 0.0 GiB" in outcome, outcome
    # The server escaped to the second of them: refused, that GPU named by its index.
    escaped = [unnamed(_gpu(0, 70, {})), _gpu(1, 0.5, {}), unnamed(_gpu(2, 68, {9: 67.5}))]
    with pytest.raises(EngineError, match=r"memory went to GPU 2 \(\?\) 67\.5 GiB"):
        memory_outcome("d", before, escaped, ["GPU-1"], FRACTION, WHY)
