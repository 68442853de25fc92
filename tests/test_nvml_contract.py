"""NVML's read-only contract, held by the fake `pynvml` and, where a GPU is present, the real one.

Each test runs once on the fake (always) and once on nvidia-ml-py's module over the machine's
real NVML (skipped where there is no driver, as in CI): the same assertions on both, so a
behaviour the fake gets wrong on a real GPU fails here rather than in a campaign. Read-only:
nothing here calls a setter, so it is safe on a shared GPU.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from dvfs.gpu.nvml import FI_DEV_POWER_INSTANT, POWER_SCOPE_GPU

FAKE_PATH = Path(__file__).parent / "fakes" / "nvml" / "pynvml.py"
#: A well-formed UUID no GPU has.
NO_SUCH_UUID = "GPU-00000000-0000-0000-0000-000000000000"
#: Seconds to wait for the energy counter to move (it steps every 20-100 ms).
COUNTER_PATIENCE_S = 5.0


def _module_from(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the real module's error classes look themselves up there
    spec.loader.exec_module(module)
    return module


def _real_module() -> ModuleType:
    try:
        files = importlib.metadata.files("nvidia-ml-py") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nvidia-ml-py is not installed")
    path = next((f.locate() for f in files if f.name == "pynvml.py"), None)
    if path is None:
        pytest.skip("nvidia-ml-py has no pynvml.py")
    return _module_from(Path(str(path)), "_real_pynvml_contract")


@pytest.fixture(params=["fake", "real"])
def nv(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ModuleType]:
    """An initialised NVML module: the fake on a fresh H200 state, or the real library."""
    if request.param == "fake":
        monkeypatch.setenv("DVFS_FAKE_NVML_STATE", str(tmp_path / "nvml.json"))
        monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", "h200-sxm")
        for var in ("DVFS_FAKE_NVML_MISSING", "DVFS_FAKE_NVML_INIT_ERROR"):
            monkeypatch.delenv(var, raising=False)
        module = _module_from(FAKE_PATH, "_fake_pynvml_contract")
    else:
        module = _real_module()
    with _initialised(module):
        yield module


@contextlib.contextmanager
def _initialised(module: ModuleType) -> Iterator[ModuleType]:
    """`module` initialised for the block (the test skipped where NVML cannot start)."""
    try:
        module.nvmlInit()
    except module.NVMLError as exc:
        pytest.skip(f"no NVML on this machine ({exc})")
    try:
        yield module
    finally:
        module.nvmlShutdown()


@pytest.fixture
def handle(nv: ModuleType) -> Any:
    return nv.nvmlDeviceGetHandleByIndex(0)


def test_identity_reads_as_dvfs_expects(nv: ModuleType, handle: Any) -> None:
    assert nv.nvmlDeviceGetCount() >= 1
    uuid = nv.nvmlDeviceGetUUID(handle)
    assert isinstance(uuid, str) and uuid.startswith("GPU-")
    assert isinstance(nv.nvmlDeviceGetName(handle), str)
    assert isinstance(nv.nvmlSystemGetDriverVersion(), str)
    assert nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(uuid)) == 0
    assert isinstance(nv.nvmlDeviceGetArchitecture(handle), int)
    assert nv.nvmlDeviceGetPersistenceMode(handle) in (0, 1)
    memory = nv.nvmlDeviceGetMemoryInfo(handle)
    assert 0 <= memory.used <= memory.total


def test_an_absent_gpu_raises_the_errors_dvfs_names_as_absent(nv: ModuleType) -> None:
    """`open_device` says "no GPU N" for InvalidArgument or NotFound and nothing else."""
    absent = (nv.NVML_ERROR_INVALID_ARGUMENT, nv.NVML_ERROR_NOT_FOUND)
    with pytest.raises(nv.NVMLError) as by_index:
        nv.nvmlDeviceGetHandleByIndex(nv.nvmlDeviceGetCount())
    assert by_index.value.value in absent
    with pytest.raises(nv.NVMLError) as by_uuid:
        nv.nvmlDeviceGetHandleByUUID(NO_SUCH_UUID)
    assert by_uuid.value.value in absent


def test_clocks_are_integer_mhz_and_the_current_one_is_supported_range(
    nv: ModuleType, handle: Any
) -> None:
    memory = nv.nvmlDeviceGetSupportedMemoryClocks(handle)
    assert memory and all(isinstance(c, int) and c > 0 for c in memory)
    graphics = nv.nvmlDeviceGetSupportedGraphicsClocks(handle, max(memory))
    assert graphics and all(isinstance(c, int) and c > 0 for c in graphics)
    assert len(set(graphics)) == len(graphics)
    now = nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)
    assert isinstance(now, int) and 0 < now <= max(graphics)
    assert nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM) >= max(graphics)


def test_power_limits_are_milliwatts_in_their_range(nv: ModuleType, handle: Any) -> None:
    low, high = nv.nvmlDeviceGetPowerManagementLimitConstraints(handle)
    assert 1000 < low < high  # mW, not W
    for limit in (
        nv.nvmlDeviceGetPowerManagementLimit(handle),
        nv.nvmlDeviceGetPowerManagementDefaultLimit(handle),
    ):
        assert low <= limit <= high
    assert 0 < nv.nvmlDeviceGetEnforcedPowerLimit(handle) <= high


def test_the_energy_counter_is_monotone_millijoules_that_advance(
    nv: ModuleType, handle: Any
) -> None:
    first = nv.nvmlDeviceGetTotalEnergyConsumption(handle)
    assert isinstance(first, int) and first > 0
    give_up = time.monotonic() + COUNTER_PATIENCE_S
    latest = first
    while latest == first and time.monotonic() < give_up:
        time.sleep(0.005)
        latest = nv.nvmlDeviceGetTotalEnergyConsumption(handle)
    assert latest > first, f"the counter did not move in {COUNTER_PATIENCE_S} s"


def test_instant_power_is_a_scoped_field_and_an_unknown_field_is_not_raised(
    nv: ModuleType, handle: Any
) -> None:
    [entry] = nv.nvmlDeviceGetFieldValues(handle, [(FI_DEV_POWER_INSTANT, POWER_SCOPE_GPU)])
    assert entry.nvmlReturn == nv.NVML_SUCCESS
    assert 10_000 < entry.value.uiVal < 2_000_000  # mW
    [unknown] = nv.nvmlDeviceGetFieldValues(handle, [nv.NVML_FI_MAX])
    assert unknown.nvmlReturn != nv.NVML_SUCCESS
    assert 10_000 < nv.nvmlDeviceGetPowerUsage(handle) < 2_000_000


def test_reasons_temperature_processes_and_mig_read_as_dvfs_expects(
    nv: ModuleType, handle: Any
) -> None:
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(handle) >= 0
    assert 0 < nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU) < 120
    assert 0 < nv.nvmlDeviceGetTemperatureV(handle, nv.NVML_TEMPERATURE_GPU) < 120
    for process in nv.nvmlDeviceGetComputeRunningProcesses(handle):
        assert isinstance(process.pid, int) and process.pid > 0
    try:
        current, pending = nv.nvmlDeviceGetMigMode(handle)
    except nv.NVMLError_NotSupported:
        return
    assert current in (0, 1) and pending in (0, 1)


def _exact_twin_profile(name: str) -> Any:
    from dvfs.twin.profiles import gpu_profiles

    return next((p for p in gpu_profiles().values() if p.nvml_name == name), None)


def test_the_fake_and_the_twin_model_this_gpu_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU model the fake and the twin both claim (H100 SXM, H200), its clock table,
    power-limit range and memory clock are theirs: what they model is what the GPU reports."""
    with _initialised(_real_module()) as real:
        handle = real.nvmlDeviceGetHandleByIndex(0)
        name = real.nvmlDeviceGetName(handle)
        memory = max(real.nvmlDeviceGetSupportedMemoryClocks(handle))
        graphics = sorted(real.nvmlDeviceGetSupportedGraphicsClocks(handle, memory), reverse=True)
        limits = tuple(real.nvmlDeviceGetPowerManagementLimitConstraints(handle))
        default_mw = real.nvmlDeviceGetPowerManagementDefaultLimit(handle)
    monkeypatch.setenv("DVFS_FAKE_NVML_STATE", str(tmp_path / "nvml.json"))
    fake = _module_from(FAKE_PATH, "_fake_pynvml_fidelity")
    profile = next((p for p in fake.FAKE_PROFILES.values() if p["name"] == name), None)
    twin = _exact_twin_profile(name)
    if profile is None or twin is None:
        pytest.skip(f"neither the fake nor the twin models a {name!r}")
    assert fake._graphics_clocks(profile) == graphics
    assert profile["mem_clock_mhz"] == memory
    assert (profile["power_min_mw"], profile["power_max_mw"]) == limits
    assert profile["power_default_mw"] == default_mw
    steps = {a - b for a, b in zip(graphics, graphics[1:], strict=False)}
    assert (twin.max_sm_clock_mhz, twin.min_sm_clock_mhz) == (graphics[0], graphics[-1])
    assert steps == {twin.sm_clock_step_mhz}
    assert twin.memory_clock_mhz == memory
    assert (twin.power_limit_min_w * 1000, twin.power_limit_max_w * 1000) == limits
    assert twin.power_limit_default_w * 1000 == default_mw


def test_violation_counters_read_as_dvfs_expects(nv: ModuleType, handle: Any) -> None:
    """`nvmlDeviceGetViolationStatus` (the throttle counters `NvmlGpu.throttle_violation_ns`
    reads between a round's ends): for each policy dvfs reads, an answer whose violationTime
    is an integer number of nanoseconds that never goes back, or NotSupported /
    FunctionNotFound / Deprecated, which dvfs takes for unknown."""
    from dvfs.gpu.base import PERF_POLICY_POWER, THROTTLE_POLICIES

    deprecated = getattr(nv, "NVML_ERROR_DEPRECATED", 26)  # nvml.h's code, in any pynvml
    unknown = (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND, deprecated)
    for policy in (*THROTTLE_POLICIES, PERF_POLICY_POWER):
        try:
            first = nv.nvmlDeviceGetViolationStatus(handle, policy)
        except nv.NVMLError as exc:
            assert exc.value in unknown, (policy, exc)
            continue
        assert isinstance(first.violationTime, int) and first.violationTime >= 0
        assert isinstance(first.referenceTime, int) and first.referenceTime > 0
        time.sleep(0.05)
        again = nv.nvmlDeviceGetViolationStatus(handle, policy)
        assert again.violationTime >= first.violationTime
        assert again.referenceTime >= first.referenceTime
