"""Tests of the fake ``pynvml`` in tests/fakes/nvml (units, errors, persistence, energy)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

FAKE_DIR = Path(__file__).parent / "fakes" / "nvml"
FAKE_PATH = FAKE_DIR / "pynvml.py"
ENV_VARS = (
    "DVFS_FAKE_NVML_STATE",
    "DVFS_FAKE_NVML_DEVICES",
    "DVFS_FAKE_NVML_ROOT",
    "DVFS_FAKE_NVML_MISSING",
    "DVFS_FAKE_NVML_INIT_ERROR",
    "DVFS_FAKE_NVML_OLD_DRIVER",
)
CONTRACT_FUNCTIONS = [
    "nvmlInit",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetEccMode",
    "nvmlDeviceGetVbiosVersion",
    "nvmlDeviceGetSupportedMemoryClocks",
    "nvmlDeviceGetSupportedGraphicsClocks",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetMaxClockInfo",
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceGetPowerManagementLimitConstraints",
    "nvmlDeviceGetPowerManagementDefaultLimit",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceSetPowerManagementLimit",
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceSetPersistenceMode",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetMemoryInfo",
]

_loaded = 0


def load_fake() -> ModuleType:
    """A fresh instance of the fake (own init refcount), not named ``pynvml``."""
    global _loaded
    _loaded += 1
    spec = importlib.util.spec_from_file_location(f"_fake_pynvml_{_loaded}", FAKE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def state_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "nvml-state.json"
    monkeypatch.setenv("DVFS_FAKE_NVML_STATE", str(path))
    return path


@pytest.fixture
def nv(state_path: Path) -> ModuleType:
    return load_fake()


@pytest.fixture
def gpu(nv: ModuleType) -> Iterator[tuple[ModuleType, Any]]:
    nv.nvmlInit()
    yield nv, nv.nvmlDeviceGetHandleByIndex(0)
    while nv.fake_init_count():
        nv.nvmlShutdown()


def run_child(code: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter that imports the fake as ``pynvml``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_DIR), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=check,
    )


# --------------------------------------------------------------------------- #
# API surface
# --------------------------------------------------------------------------- #


def _load_real_pynvml() -> ModuleType:
    try:
        files = importlib.metadata.files("nvidia-ml-py") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nvidia-ml-py not installed")
    path = next((f.locate() for f in files if f.name == "pynvml.py"), None)
    if path is None:
        pytest.skip("pynvml.py not found in nvidia-ml-py")
    name = "_real_pynvml_for_fake_check"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its error-class generator looks itself up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_names_values_and_signatures_match_real_pynvml(nv: ModuleType) -> None:
    real = _load_real_pynvml()
    for fn in CONTRACT_FUNCTIONS:
        assert callable(getattr(nv, fn)), fn
    public = [n for n in dir(nv) if re.match(r"(nvml|NVML)", n)]
    assert len(public) > 100
    for name in public:
        assert hasattr(real, name), f"{name} is not in the real pynvml"
        fake_obj, real_obj = getattr(nv, name), getattr(real, name)
        if isinstance(fake_obj, int):
            assert fake_obj == real_obj, name
        elif inspect.isfunction(fake_obj):
            fake_params = list(inspect.signature(fake_obj).parameters)
            real_params = list(inspect.signature(real_obj).parameters)
            assert fake_params == real_params, name
    real_errors = [n for n in dir(real) if n.startswith("NVMLError_")]
    assert len(real_errors) >= 30
    for name in real_errors:
        assert getattr(nv, name)().value == getattr(real, name)().value, name
    for code in [*range(0, 32), 999, 12345]:
        assert type(nv.NVMLError(code)).__name__ == type(real.NVMLError(code)).__name__
        if code:
            assert str(nv.NVMLError(code)) == str(real.NVMLError(code)), code


def test_error_classes(nv: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    err = nv.NVMLError(nv.NVML_ERROR_NO_PERMISSION)
    assert type(err) is nv.NVMLError_NoPermission
    assert isinstance(err, nv.NVMLError) and isinstance(err, Exception)
    assert err.value == 4 and str(err) == "Insufficient Permissions"
    assert nv.NVMLError_NotFound().value == nv.NVML_ERROR_NOT_FOUND == 6
    assert nv.NVMLError_LibraryNotFound().value == 12
    assert nv.NVMLError(999) == nv.NVMLError_Unknown()
    # as nvidia-ml-py's: compared by code with anything (AttributeError without one), unhashable
    with pytest.raises(AttributeError):
        _ = err == None  # noqa: E711
    with pytest.raises(TypeError, match="unhashable"):
        hash(err)
    assert type(nv.NVMLError(12345)) is nv.NVMLError
    assert str(nv.NVMLError(12345)) == "NVML Error with code 12345"
    assert nv.nvmlExceptionClass(13) is nv.NVMLError_FunctionNotFound
    with pytest.raises(ValueError):
        nv.nvmlExceptionClass(12345)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        raise nv.NVMLError(2)
    monkeypatch.setitem(sys.modules, nv.__name__, nv)  # pickle finds classes by module
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is nv.NVMLError_NoPermission and again.value == 4


# --------------------------------------------------------------------------- #
# Init, devices, lists
# --------------------------------------------------------------------------- #


def test_calls_before_init_and_refcount(nv: ModuleType) -> None:
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlShutdown()
    nv.nvmlInit()
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlShutdown()
    assert nv.nvmlDeviceGetCount() == 2  # one reference left
    nv.nvmlShutdown()
    for call in (
        lambda: nv.nvmlDeviceGetCount(),
        lambda: nv.nvmlSystemGetDriverVersion(),
        lambda: nv.nvmlDeviceGetName(handle),
        lambda: nv.nvmlDeviceGetPowerUsage(handle),
        lambda: nv.nvmlDeviceGetTotalEnergyConsumption(handle),
        lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(handle),
        lambda: nv.nvmlDeviceSetGpuLockedClocks(handle, 1200, 1200),
        lambda: nv.nvmlShutdown(),
    ):
        with pytest.raises(nv.NVMLError_Uninitialized):
            call()
    assert nv.fake_device_state(0)["locked_clocks"] is None


def test_library_missing_and_init_errors(nv: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVFS_FAKE_NVML_MISSING", "1")
    with pytest.raises(nv.NVMLError_LibraryNotFound) as info:
        nv.nvmlInit()
    assert str(info.value) == "NVML Shared Library Not Found"
    assert nv.fake_init_count() == 0
    monkeypatch.delenv("DVFS_FAKE_NVML_MISSING")
    monkeypatch.setenv("DVFS_FAKE_NVML_INIT_ERROR", str(nv.NVML_ERROR_DRIVER_NOT_LOADED))
    with pytest.raises(nv.NVMLError_DriverNotLoaded):
        nv.nvmlInit()
    monkeypatch.delenv("DVFS_FAKE_NVML_INIT_ERROR")
    nv.nvmlInit()
    assert nv.fake_init_count() == 1
    nv.nvmlShutdown()


def test_identity_and_supported_lists(
    nv: ModuleType, state_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", "h200-sxm,h200-sxm,h100-sxm")
    nv.nvmlInit()
    assert state_path.exists()
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", nv.nvmlSystemGetDriverVersion())
    assert nv.nvmlDeviceGetCount() == 3
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
    assert not any(isinstance(h, int) for h in handles)
    names = [nv.nvmlDeviceGetName(h) for h in handles]
    assert names == ["NVIDIA H200", "NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    uuids = [nv.nvmlDeviceGetUUID(h) for h in handles]
    assert len(set(uuids)) == 3
    hexd = "[0-9a-f]"
    for u in uuids:
        assert re.fullmatch(f"GPU-{hexd}{{8}}-{hexd}{{4}}-{hexd}{{4}}-{hexd}{{4}}-{hexd}{{12}}", u)
    for i, u in enumerate(uuids):
        assert nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(u)) == i
    assert nv.nvmlDeviceGetIndex(nv.nvmlDeviceGetHandleByUUID(uuids[2].encode())) == 2

    h200, h100 = handles[0], handles[2]
    assert nv.nvmlDeviceGetArchitecture(h200) == nv.NVML_DEVICE_ARCH_HOPPER == 9
    assert nv.nvmlDeviceGetMigMode(h200) == [0, 0]
    assert nv.nvmlDeviceGetSupportedMemoryClocks(h200) == [3201]
    assert nv.nvmlDeviceGetSupportedMemoryClocks(h100) == [2619]
    clocks = nv.nvmlDeviceGetSupportedGraphicsClocks(h100, 2619)
    assert clocks == list(range(1980, 209, -15))
    assert clocks[0] == 1980 and clocks[-1] == 210 and len(clocks) == 119
    # an H200 lists 110 clocks down to 345 MHz (read on one; tests/test_nvml_contract.py)
    assert nv.nvmlDeviceGetSupportedGraphicsClocks(h200, 3201) == clocks[:110]
    assert clocks[109] == 345
    assert nv.nvmlDeviceGetMaxClockInfo(h100, nv.NVML_CLOCK_SM) == 1980
    assert nv.nvmlDeviceGetMaxClockInfo(h100, nv.NVML_CLOCK_GRAPHICS) == 1980
    assert nv.nvmlDeviceGetMaxClockInfo(h100, nv.NVML_CLOCK_MEM) == 2619
    assert nv.nvmlDeviceGetClockInfo(h200, nv.NVML_CLOCK_MEM) == 3201
    assert nv.nvmlDeviceGetPowerManagementLimitConstraints(h100) == [200_000, 700_000]
    assert nv.nvmlDeviceGetPowerManagementDefaultLimit(h100) == 700_000
    assert nv.nvmlDeviceGetPowerManagementLimit(h100) == 700_000
    assert nv.nvmlDeviceGetEnforcedPowerLimit(h100) == 700_000
    assert nv.nvmlDeviceGetPersistenceMode(h100) == 1
    mem = nv.nvmlDeviceGetMemoryInfo(h200)
    assert mem.total == 143771 * 2**20 and mem.used + mem.free == mem.total
    nv.nvmlShutdown()

    # UUIDs are stable: a fresh module instance (a "new process") sees the same ones.
    other = load_fake()
    other.nvmlInit()
    assert other.nvmlDeviceGetUUID(other.nvmlDeviceGetHandleByIndex(1)) == uuids[1]
    other.nvmlShutdown()


def test_default_devices_and_bad_profile(nv: ModuleType) -> None:
    nv.nvmlInit()
    assert nv.nvmlDeviceGetCount() == 2
    assert nv.fake_state()["devices"][1]["profile"] == "h100-sxm"
    with pytest.raises(ValueError):
        nv.fake_reset_state("h100-sxm,b200")
    nv.fake_reset_state(["h200-sxm"])
    assert nv.nvmlDeviceGetCount() == 1
    nv.nvmlShutdown()


def test_lookup_errors(gpu: tuple[ModuleType, Any]) -> None:
    nv, h = gpu
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(-1)
    with pytest.raises(nv.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetName(0)  # an int is not a handle
    with pytest.raises(nv.NVMLError_NotFound):
        nv.nvmlDeviceGetSupportedGraphicsClocks(h, 3201)  # H100 memory is 2619 MHz
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetClockInfo(h, 17)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetTemperature(h, 5)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU_MAX)
    with pytest.raises(nv.NVMLError_ArgumentVersionMismatch):
        nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU, version=7)


def test_mig_lost_and_injected_errors(gpu: tuple[ModuleType, Any]) -> None:
    nv, h0 = gpu
    h1 = nv.nvmlDeviceGetHandleByIndex(1)
    nv.fake_update_device(1, mig=True)
    assert nv.nvmlDeviceGetMigMode(h1) == [1, 1]
    assert nv.nvmlDeviceGetMigMode(h0) == [0, 0]
    nv.fake_update_device(
        0, errors={"nvmlDeviceGetTotalEnergyConsumption": 3}, field_errors={186: 3}
    )
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetTotalEnergyConsumption(h0)
    [entry] = nv.nvmlDeviceGetFieldValues(h0, [(186, 0)])
    assert entry.nvmlReturn == nv.NVML_ERROR_NOT_SUPPORTED
    nv.fake_update_device(1, lost=True)
    with pytest.raises(nv.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetPowerUsage(h1)
    with pytest.raises(nv.NVMLError_GpuIsLost):
        nv.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(KeyError):
        nv.fake_update_device(0, energy_mj=0)


# --------------------------------------------------------------------------- #
# Readings and the power model
# --------------------------------------------------------------------------- #


def test_idle_readings_and_field_values(gpu: tuple[ModuleType, Any]) -> None:
    nv, h = gpu
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == 345
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_GRAPHICS) == 345
    assert nv.nvmlDeviceGetPowerUsage(h) == 75_000
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h) == nv.nvmlClocksEventReasonGpuIdle
    assert nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU) == 34  # 30 + 0.06 * 75
    entries = nv.nvmlDeviceGetFieldValues(
        h, [(nv.NVML_FI_DEV_POWER_INSTANT, nv.NVML_POWER_SCOPE_GPU), (186, 1), 5000]
    )
    assert [e.nvmlReturn for e in entries] == [0, nv.NVML_ERROR_NOT_SUPPORTED, 2]
    ok = entries[0]
    assert (ok.fieldId, ok.scopeId, ok.value.uiVal) == (186, 0, 75_000)
    assert ok.valueType == nv.NVML_VALUE_TYPE_UNSIGNED_INT
    # A union, as NVML's: another member reads the same bytes reinterpreted, not the value.
    assert ok.value.dVal != 75_000
    wide = nv.c_nvmlValue_t()
    wide.ullVal = 2**32 + 75_000  # an energy counter past 2**32 mJ
    assert wide.uiVal == 75_000


def test_load_boost_and_locked_clocks(gpu: tuple[ModuleType, Any]) -> None:
    nv, h = gpu
    nv.set_load(0, 1.0)
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == 1980
    assert nv.nvmlDeviceGetPowerUsage(h) == 575_000
    assert nv.nvmlDeviceGetCurrentClocksEventReasons(h) == 0
    assert nv.nvmlDeviceGetTemperatureV(h, 0) == 64
    nv.nvmlDeviceSetGpuLockedClocks(h, 1000, 1401)  # rounded to supported clocks
    assert nv.fake_device_state(0)["locked_clocks"] == [1005, 1395]
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == 1395
    loaded_power = nv.nvmlDeviceGetPowerUsage(h)
    assert 75_000 < loaded_power < 575_000
    nv.fake_set_load(0, 0.0)
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == 1005  # idle, held at lock min
    nv.nvmlDeviceSetGpuLockedClocks(h, nv.NVML_CLOCK_LIMIT_ID_TDP, nv.NVML_CLOCK_LIMIT_ID_TDP)
    assert nv.fake_device_state(0)["locked_clocks"] == [1830, 1830]
    nv.nvmlDeviceSetGpuLockedClocks(
        h, nv.NVML_CLOCK_LIMIT_ID_UNLIMITED, nv.NVML_CLOCK_LIMIT_ID_UNLIMITED
    )
    assert nv.fake_device_state(0)["locked_clocks"] is None
    nv.nvmlDeviceSetGpuLockedClocks(h, 210, 1980)
    nv.nvmlDeviceResetGpuLockedClocks(h)
    assert nv.fake_device_state(0)["locked_clocks"] is None
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == 345
    with pytest.raises(ValueError):
        nv.fake_set_load(0, 1.5)


@pytest.mark.parametrize(
    "lo, hi",
    [
        (1500, 1400),  # min > max
        (150, 1500),  # below the lowest supported clock
        (1500, 2100),  # above max
        (0xFFFFFF01, 1500),  # symbol mixed with a number
        (1500, 0xFFFFFF02),
        (0xFFFFFF00, 0xFFFFFF00),  # not a defined symbol
        (-15, 1500),
    ],
)
def test_locked_clock_invalid_arguments(gpu: tuple[ModuleType, Any], lo: int, hi: int) -> None:
    nv, h = gpu
    nv.nvmlDeviceSetGpuLockedClocks(h, 1200, 1200)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceSetGpuLockedClocks(h, lo, hi)
    assert nv.fake_device_state(0)["locked_clocks"] == [1200, 1200]


def test_locked_clock_type_error(gpu: tuple[ModuleType, Any]) -> None:
    nv, h = gpu
    with pytest.raises(TypeError):
        nv.nvmlDeviceSetGpuLockedClocks(h, 1200.0, 1200)  # like ctypes c_uint(float)
    assert nv.fake_calls()[-1]["error"] == "TypeError"


def test_power_limit_and_power_cap(gpu: tuple[ModuleType, Any]) -> None:
    nv, h = gpu
    for bad in (199_999, 700_001, 0):
        with pytest.raises(nv.NVMLError_InvalidArgument):
            nv.nvmlDeviceSetPowerManagementLimit(h, bad)
    assert nv.nvmlDeviceGetPowerManagementLimit(h) == 700_000
    nv.fake_set_load(0, 1.0)
    nv.nvmlDeviceSetPowerManagementLimit(h, 300_000)
    assert nv.nvmlDeviceGetPowerManagementLimit(h) == 300_000
    assert nv.nvmlDeviceGetEnforcedPowerLimit(h) == 300_000
    clock = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
    power = nv.nvmlDeviceGetPowerUsage(h)
    assert 210 <= clock < 1980 and (1980 - clock) % 15 == 0
    assert 250_000 < power <= 300_000
    reasons = nv.nvmlDeviceGetCurrentClocksEventReasons(h)
    assert reasons & nv.nvmlClocksEventReasonSwPowerCap
    assert not reasons & nv.nvmlClocksEventReasonGpuIdle
    assert nv.nvmlDeviceGetCurrentClocksThrottleReasons(h) == reasons
    [field] = nv.nvmlDeviceGetFieldValues(h, [(186, 0)])
    assert field.nvmlReturn == 0 and field.value.uiVal == power
    # A lock at max does not beat the cap; a lock below the capped clock is not capped.
    nv.nvmlDeviceSetGpuLockedClocks(h, 1980, 1980)
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == clock
    nv.nvmlDeviceSetGpuLockedClocks(h, 1005, 1005)
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == 1005
    assert not nv.nvmlDeviceGetCurrentClocksEventReasons(h) & nv.nvmlClocksEventReasonSwPowerCap
    # Power only caps under load: raising the limit back removes the cap.
    nv.nvmlDeviceResetGpuLockedClocks(h)
    nv.nvmlDeviceSetPowerManagementLimit(h, 700_000)
    assert nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) == 1980


def test_power_limit_v2_ignores_errors_like_the_real_wrapper(gpu: tuple[ModuleType, Any]) -> None:
    nv, h = gpu
    assert nv.nvmlDeviceSetPowerManagementLimit_v2(h, 0, 100_000) == nv.NVML_SUCCESS
    assert nv.nvmlDeviceGetPowerManagementLimit(h) == 700_000
    assert nv.fake_calls()[-1]["error"] == "NVMLError_InvalidArgument"
    nv.nvmlDeviceSetPowerManagementLimit_v2(h, 0, 400_000)
    assert nv.nvmlDeviceGetPowerManagementLimit(h) == 400_000


def test_no_permission_without_root(
    gpu: tuple[ModuleType, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    nv, h = gpu
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")
    before = nv.fake_device_state(0)
    for call in (
        lambda: nv.nvmlDeviceSetGpuLockedClocks(h, 1200, 1200),
        lambda: nv.nvmlDeviceResetGpuLockedClocks(h),
        lambda: nv.nvmlDeviceSetPowerManagementLimit(h, 400_000),
        lambda: nv.nvmlDeviceSetPersistenceMode(h, 0),
    ):
        with pytest.raises(nv.NVMLError_NoPermission):
            call()
    after = nv.fake_device_state(0)
    for key in ("locked_clocks", "power_limit_mw", "persistence_mode"):
        assert after[key] == before[key]
    assert nv.nvmlDeviceGetPowerManagementLimit(h) == 700_000  # reads still work
    calls = nv.fake_calls()
    assert len(calls) == 4
    assert all(not c["ok"] and c["error"] == "NVMLError_NoPermission" for c in calls)


def test_old_driver_fallbacks(gpu: tuple[ModuleType, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    nv, h = gpu
    monkeypatch.setenv("DVFS_FAKE_NVML_OLD_DRIVER", "1")
    with pytest.raises(nv.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetCurrentClocksEventReasons(h)
    with pytest.raises(nv.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetTemperatureV(h, nv.NVML_TEMPERATURE_GPU)
    assert nv.nvmlDeviceGetCurrentClocksThrottleReasons(h) == nv.nvmlClocksThrottleReasonGpuIdle
    assert nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU) == 34


def test_persistence_mode(gpu: tuple[ModuleType, Any]) -> None:
    nv, h = gpu
    nv.nvmlDeviceSetPersistenceMode(h, 0)
    assert nv.nvmlDeviceGetPersistenceMode(h) == 0
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceSetPersistenceMode(h, 2)
    nv.nvmlDeviceSetPersistenceMode(h, 1)
    assert nv.nvmlDeviceGetPersistenceMode(h) == 1


# --------------------------------------------------------------------------- #
# Energy counter
# --------------------------------------------------------------------------- #


def test_energy_counter_monotone_rate_and_quantised(gpu: tuple[ModuleType, Any]) -> None:
    nv, h = gpu
    nv.fake_set_load(0, 0.5)
    power_mw = nv.nvmlDeviceGetPowerUsage(h)
    assert power_mw == 325_000  # 75 W + 0.5 * 500 W at 1980 MHz
    time.sleep(2 * nv.FAKE_ENERGY_UPDATE_S)  # let an update pass at the new power
    t0_before = time.time()
    e0 = nv.nvmlDeviceGetTotalEnergyConsumption(h)
    t0_after = time.time()
    assert isinstance(e0, int) and e0 > 0
    readings = [e0]
    deadline = time.monotonic() + 0.25
    give_up = time.monotonic() + 60  # a guard against hanging, not a speed bound
    # 0.25 s of readings, and on until two come within one update (a loaded machine may space
    # them wider than 20 ms for a while)
    while time.monotonic() < deadline or len(set(readings)) == len(readings):
        assert time.monotonic() < give_up, "no two readings within one 20 ms update"
        readings.append(nv.nvmlDeviceGetTotalEnergyConsumption(h))
        time.sleep(0.001)
    t1_before = time.time()
    e1 = nv.nvmlDeviceGetTotalEnergyConsumption(h)
    t1_after = time.time()
    readings.append(e1)
    assert readings == sorted(readings)
    tick = nv.FAKE_ENERGY_UPDATE_S
    # The reported value is the exact integral at the last 20 ms boundary.
    assert power_mw * (t1_before - t0_after - tick) - 2 <= e1 - e0
    assert e1 - e0 <= power_mw * (t1_after - t0_before + tick) + 2
    # It only moves in whole 20 ms updates: steps are multiples of P * 20 ms.
    per_tick = power_mw * tick
    steps = [b - a for a, b in zip(readings, readings[1:], strict=False) if b != a]
    assert steps and len(set(readings)) < len(readings)
    for step in steps:
        assert abs(step - round(step / per_tick) * per_tick) <= 2
    # Lowering the load lowers the rate but never makes the counter go back.
    nv.fake_set_load(0, 0.0)
    time.sleep(0.05)
    e2 = nv.nvmlDeviceGetTotalEnergyConsumption(h)
    assert e2 >= e1
    [field] = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION])
    assert field.nvmlReturn == 0 and field.value.ullVal >= e2


# --------------------------------------------------------------------------- #
# Persistence across processes and the call log
# --------------------------------------------------------------------------- #


def test_state_survives_a_new_process_and_sigkill(gpu: tuple[ModuleType, Any]) -> None:
    nv, h = gpu
    nv.fake_set_load(0, 1.0)
    nv.nvmlDeviceSetPowerManagementLimit(h, 650_000)
    energy = nv.nvmlDeviceGetTotalEnergyConsumption(h)
    nv.nvmlShutdown()

    # A process that locks clocks and is then killed with SIGKILL.
    killed = run_child(
        """
        import os, signal, pynvml
        assert hasattr(pynvml, "fake_calls"), pynvml.__file__
        pynvml.nvmlInit()
        pynvml.nvmlDeviceSetGpuLockedClocks(pynvml.nvmlDeviceGetHandleByIndex(0), 1200, 1200)
        os.kill(os.getpid(), signal.SIGKILL)
        """,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr

    # A later process sees the lock, the limit and a counter that kept going.
    seen = run_child(
        """
        import json, pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        print(json.dumps([
            pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            pynvml.nvmlDeviceGetPowerManagementLimit(h),
            pynvml.nvmlDeviceGetTotalEnergyConsumption(h),
        ]))
        pynvml.nvmlShutdown()
        """
    )
    clock, limit, energy_later = json.loads(seen.stdout)
    assert (clock, limit) == (1200, 650_000)
    assert energy_later > energy

    # And so does a fresh module instance in this process.
    fresh = load_fake()
    assert fresh.fake_device_state(0)["locked_clocks"] == [1200, 1200]
    calls = fresh.fake_calls("nvmlDeviceSetGpuLockedClocks")
    assert [(c["index"], c["args"], c["ok"]) for c in calls] == [(0, [1200, 1200], True)]
    assert calls[0]["pid"] != os.getpid()


def test_call_log_records_setters_only(gpu: tuple[ModuleType, Any]) -> None:
    nv, h = gpu
    nv.nvmlDeviceGetPowerUsage(h)
    nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
    nv.nvmlDeviceGetTotalEnergyConsumption(h)
    nv.fake_set_load(0, 0.3)
    assert nv.fake_calls() == []  # the "no setter was ever called" assertion

    h1 = nv.nvmlDeviceGetHandleByIndex(1)
    nv.nvmlDeviceSetGpuLockedClocks(h1, 1500, 1500)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceSetPowerManagementLimit(h, 10)
    nv.nvmlDeviceResetGpuLockedClocks(h1)
    nv.nvmlShutdown()
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlDeviceSetPersistenceMode(h, 0)
    got = [(c["fn"], c["index"], c["args"], c["ok"], c["error"]) for c in nv.fake_calls()]
    assert got == [
        ("nvmlDeviceSetGpuLockedClocks", 1, [1500, 1500], True, None),
        ("nvmlDeviceSetPowerManagementLimit", 0, [10], False, "NVMLError_InvalidArgument"),
        ("nvmlDeviceResetGpuLockedClocks", 1, [], True, None),
        ("nvmlDeviceSetPersistenceMode", 0, [0], False, "NVMLError_Uninitialized"),
    ]
    assert len(nv.fake_calls("nvmlDeviceResetGpuLockedClocks")) == 1
    nv.fake_reset_state()
    assert nv.fake_calls() == []


def test_concurrent_processes_keep_the_state_file_valid(state_path: Path) -> None:
    code = """
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for i in range(40):
            pynvml.nvmlDeviceSetPowerManagementLimit(h, 300_000 + i * 1000)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
        pynvml.nvmlShutdown()
        """
    env = dict(os.environ, PYTHONPATH=str(FAKE_DIR))
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env) for _ in range(3)
    ]
    assert [p.wait(timeout=30) for p in procs] == [0, 0, 0]
    state = json.loads(state_path.read_text())
    assert len(state["calls"]) == 120
    assert all(c["ok"] for c in state["calls"])
    assert not [p for p in state_path.parent.iterdir() if p.suffix == ".tmp"]


def test_a_release_between_a_hangs_log_line_and_its_wait_ends_that_hang(
    gpu: tuple[ModuleType, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test releases hung calls once `fake_hangs_started` lists them; a call listed but not
    yet waiting missed a release that set and cleared an event at once, and hung for good (a
    `cap reset` test ran into the suite's 120 s timeout once). The release now ends every hang
    begun before it, whether or not it was waiting yet."""
    nv, handle = gpu
    monkeypatch.setenv("DVFS_FAKE_NVML_HANG", "nvmlDeviceGetName=inf")
    logged = nv.json.dumps

    def release_as_it_logs(record: Any) -> str:
        line = logged(record)
        os.environ.pop("DVFS_FAKE_NVML_HANG", None)
        nv.fake_release_hangs()  # the releaser acts here, before the call waits
        return line

    monkeypatch.setattr(nv.json, "dumps", release_as_it_logs)
    call = threading.Thread(target=nv.nvmlDeviceGetName, args=(handle,), daemon=True)
    call.start()
    call.join(timeout=60)  # (only a guard: a hang missed is a hang for good)
    stuck = call.is_alive()
    monkeypatch.setattr(nv.json, "dumps", logged)
    nv.fake_release_hangs()
    call.join()
    assert not stuck, "a release between the hang's log line and its wait was lost"
    assert [h["fn"] for h in nv.fake_hangs_started()] == ["nvmlDeviceGetName"]
