# ruff: noqa: N802, N801, N803, N815, N816, N818
"""Test fake of ``pynvml`` (nvidia-ml-py) for dvfs: NVML semantics, no GPU needed.

Put ``tests/fakes/nvml`` first on ``sys.path``/``PYTHONPATH`` (or load this file by
path and inject it as ``sys.modules["pynvml"]``). Written from NVML-CONTRACT.md and
NVIDIA's documented behaviour; no code is taken from nvidia-ml-py.

Device state lives in a JSON file (env ``DVFS_FAKE_NVML_STATE``) that every call
re-reads under an ``fcntl.flock`` on ``<state>.lock`` and rewrites atomically
(temp file + ``os.replace``) on every change, so locked clocks, power limits and
the energy counter outlive the process that set them, like on a real GPU.

Environment (read at every call):

- ``DVFS_FAKE_NVML_STATE``: state file path (default
  ``$TMPDIR/dvfs-fake-nvml-<uid>.json``); created with defaults when missing.
- ``DVFS_FAKE_NVML_DEVICES``: profiles for a new state file, comma separated
  (default ``h100-sxm,h100-sxm``; empty string = no devices).
- ``DVFS_FAKE_NVML_ROOT``: ``"1"`` (default) allows setters, anything else makes
  them raise ``NVMLError_NoPermission``.
- ``DVFS_FAKE_NVML_MISSING=1``: ``nvmlInit`` raises ``NVMLError_LibraryNotFound``.
- ``DVFS_FAKE_NVML_INIT_ERROR=<code>``: ``nvmlInit`` raises ``NVMLError(code)``.
- ``DVFS_FAKE_NVML_OLD_DRIVER=1``: ``nvmlDeviceGetCurrentClocksEventReasons`` and
  ``nvmlDeviceGetTemperatureV`` raise ``NVMLError_FunctionNotFound``.
- ``DVFS_FAKE_NVML_HANG=fn[@index]=seconds,...``: those device calls hang (sleep) that long
  before doing anything, like a driver call that does not return; ``inf`` hangs until
  ``fake_release_hangs()`` (in the hanging process). Each hang that starts is appended to
  ``<state>.hangs`` (see ``fake_hangs_started``), so a test knows the call is stuck.

Compute processes: each device's ``processes`` list (``{"pid", "used_bytes"}``) is what
``nvmlDeviceGetComputeRunningProcesses`` returns, live pids only (NVML drops a process that
exited), and their ``used_bytes`` count into ``nvmlDeviceGetMemoryInfo``'s ``used`` (with the
driver's own ``memory_used_bytes``), listed or not; ``fake_add_process``/``fake_remove_process``
register and drop one (the SGLang stub registers itself on the devices its
CUDA_VISIBLE_DEVICES names, with the memory it claims there). Inject
``errors={"nvmlDeviceGetComputeRunningProcesses": 3}`` to play a driver that cannot list them.

Energy counter: power is integrated over ``time.time()`` and persisted; the value
returned only advances at the boundaries of a fixed 20 ms wall-clock grid
(``FAKE_ENERGY_UPDATE_S``), like the hardware counter that updates every ~20 ms.

Violation counters (``nvmlDeviceGetViolationStatus``): nanoseconds per perf policy,
cumulative; POWER grows while SwPowerCap holds the clock, the others only by
``fake_throttle_burst`` (a throttle between two samples, which no clock-event reason shows).

Test-only helpers are named ``fake_*`` (plus ``set_load``); the real module has
none of them.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import fcntl
import json
import math
import os
import tempfile
import threading
import time
import uuid as _uuid
from collections.abc import Callable, Iterator
from typing import Any

# --------------------------------------------------------------------------- #
# Constants (values as in NVML / nvidia-ml-py)
# --------------------------------------------------------------------------- #

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_GPU_MAX = 1
NVML_TEMPERATURE_COUNT = 2
nvmlTemperature_v1 = 0x100000C

NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_CLOCK_VIDEO = 3
NVML_CLOCK_COUNT = 4

NVML_CLOCK_LIMIT_ID_RANGE_START = 0xFFFFFF00
NVML_CLOCK_LIMIT_ID_TDP = 0xFFFFFF01
NVML_CLOCK_LIMIT_ID_UNLIMITED = 0xFFFFFF02

NVML_DEVICE_ARCH_HOPPER = 9

NVML_POWER_SCOPE_GPU = 0
NVML_POWER_SCOPE_MODULE = 1
NVML_POWER_SCOPE_MEMORY = 2
nvmlPowerValue_v2 = 0x200000C

NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4

NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION = 83
NVML_FI_DEV_POWER_AVERAGE = 185
NVML_FI_DEV_POWER_INSTANT = 186
NVML_FI_DEV_POWER_MIN_LIMIT = 187
NVML_FI_DEV_POWER_MAX_LIMIT = 188
NVML_FI_DEV_POWER_DEFAULT_LIMIT = 189
NVML_FI_DEV_POWER_CURRENT_LIMIT = 190
NVML_FI_MAX = 308

# Perf policies whose violation time nvmlDeviceGetViolationStatus reads (nvmlPerfPolicyType_t).
NVML_PERF_POLICY_POWER = 0
NVML_PERF_POLICY_THERMAL = 1
NVML_PERF_POLICY_SYNC_BOOST = 2
NVML_PERF_POLICY_BOARD_LIMIT = 3
NVML_PERF_POLICY_LOW_UTILIZATION = 4
NVML_PERF_POLICY_RELIABILITY = 5
NVML_PERF_POLICY_TOTAL_APP_CLOCKS = 10
NVML_PERF_POLICY_TOTAL_BASE_CLOCKS = 11
NVML_PERF_POLICY_COUNT = 12

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonApplicationsClocksSetting = 0x2
nvmlClocksEventReasonUserDefinedClocks = nvmlClocksEventReasonApplicationsClocksSetting
nvmlClocksEventReasonSwPowerCap = 0x4
nvmlClocksEventReasonHwSlowdown = 0x8
nvmlClocksEventReasonSyncBoost = 0x10
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
nvmlClocksEventReasonDisplayClockSetting = 0x100
nvmlClocksEventReasonNone = 0x0
nvmlClocksEventReasonAll = 0x1FF

nvmlClocksThrottleReasonGpuIdle = 0x1
nvmlClocksThrottleReasonApplicationsClocksSetting = 0x2
nvmlClocksThrottleReasonUserDefinedClocks = nvmlClocksThrottleReasonApplicationsClocksSetting
nvmlClocksThrottleReasonSwPowerCap = 0x4
nvmlClocksThrottleReasonHwSlowdown = 0x8
nvmlClocksThrottleReasonSyncBoost = 0x10
nvmlClocksThrottleReasonSwThermalSlowdown = 0x20
nvmlClocksThrottleReasonHwThermalSlowdown = 0x40
nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x80
nvmlClocksThrottleReasonDisplayClockSetting = 0x100
nvmlClocksThrottleReasonBoardLimit = 0x200
nvmlClocksThrottleReasonReliability = 0x400
nvmlClocksThrottleReasonNone = 0x0
nvmlClocksThrottleReasonAll = 0x7FF

# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #

# Same texts as nvidia-ml-py's Python-side table; other codes fall back to
# "NVML Error with code N", which is what the real module prints without a driver.
_ERROR_TEXT: dict[int, str] = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: ("RM has detected an NVML/RM version mismatch."),
    NVML_ERROR_MEMORY: "Insufficient Memory",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """Base NVML error; ``NVMLError(code)`` returns the subclass for ``code``."""

    _valClassMapping: dict[int, type[NVMLError]] = {}
    _code: int | None = None
    value: int

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls._code is not None:
            NVMLError._valClassMapping[cls._code] = cls

    def __new__(cls, value: int | None = None, *args: Any) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, NVMLError)  # type: ignore[arg-type]
        else:
            value = cls._code
        obj = Exception.__new__(cls)
        obj.value = value  # type: ignore[assignment]
        return obj

    def __str__(self) -> str:
        text = _ERROR_TEXT.get(self.value)
        return text if text is not None else f"NVML Error with code {self.value}"

    def __eq__(self, other: object) -> bool:
        # as nvidia-ml-py's: codes compared, whatever `other` is (no `value`: AttributeError),
        # and no __hash__ beside it, so an NVMLError is unhashable
        return bool(self.value == other.value)  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]


class NVMLError_Uninitialized(NVMLError):
    _code = NVML_ERROR_UNINITIALIZED


class NVMLError_InvalidArgument(NVMLError):
    _code = NVML_ERROR_INVALID_ARGUMENT


class NVMLError_NotSupported(NVMLError):
    _code = NVML_ERROR_NOT_SUPPORTED


class NVMLError_NoPermission(NVMLError):
    _code = NVML_ERROR_NO_PERMISSION


class NVMLError_AlreadyInitialized(NVMLError):
    _code = NVML_ERROR_ALREADY_INITIALIZED


class NVMLError_NotFound(NVMLError):
    _code = NVML_ERROR_NOT_FOUND


class NVMLError_InsufficientSize(NVMLError):
    _code = NVML_ERROR_INSUFFICIENT_SIZE


class NVMLError_InsufficientPower(NVMLError):
    _code = NVML_ERROR_INSUFFICIENT_POWER


class NVMLError_DriverNotLoaded(NVMLError):
    _code = NVML_ERROR_DRIVER_NOT_LOADED


class NVMLError_Timeout(NVMLError):
    _code = NVML_ERROR_TIMEOUT


class NVMLError_IrqIssue(NVMLError):
    _code = NVML_ERROR_IRQ_ISSUE


class NVMLError_LibraryNotFound(NVMLError):
    _code = NVML_ERROR_LIBRARY_NOT_FOUND


class NVMLError_FunctionNotFound(NVMLError):
    _code = NVML_ERROR_FUNCTION_NOT_FOUND


class NVMLError_CorruptedInforom(NVMLError):
    _code = NVML_ERROR_CORRUPTED_INFOROM


class NVMLError_GpuIsLost(NVMLError):
    _code = NVML_ERROR_GPU_IS_LOST


class NVMLError_ResetRequired(NVMLError):
    _code = NVML_ERROR_RESET_REQUIRED


class NVMLError_OperatingSystem(NVMLError):
    _code = NVML_ERROR_OPERATING_SYSTEM


class NVMLError_LibRmVersionMismatch(NVMLError):
    _code = NVML_ERROR_LIB_RM_VERSION_MISMATCH


class NVMLError_InUse(NVMLError):
    _code = NVML_ERROR_IN_USE


class NVMLError_Memory(NVMLError):
    _code = NVML_ERROR_MEMORY


class NVMLError_NoData(NVMLError):
    _code = NVML_ERROR_NO_DATA


class NVMLError_VgpuEccNotSupported(NVMLError):
    _code = NVML_ERROR_VGPU_ECC_NOT_SUPPORTED


class NVMLError_InsufficientResources(NVMLError):
    _code = NVML_ERROR_INSUFFICIENT_RESOURCES


class NVMLError_FreqNotSupported(NVMLError):
    _code = NVML_ERROR_FREQ_NOT_SUPPORTED


class NVMLError_ArgumentVersionMismatch(NVMLError):
    _code = NVML_ERROR_ARGUMENT_VERSION_MISMATCH


class NVMLError_Deprecated(NVMLError):
    _code = NVML_ERROR_DEPRECATED


class NVMLError_NotReady(NVMLError):
    _code = NVML_ERROR_NOT_READY


class NVMLError_GpuNotFound(NVMLError):
    _code = NVML_ERROR_GPU_NOT_FOUND


class NVMLError_InvalidState(NVMLError):
    _code = NVML_ERROR_INVALID_STATE


class NVMLError_ResetTypeNotSupported(NVMLError):
    _code = NVML_ERROR_RESET_TYPE_NOT_SUPPORTED


class NVMLError_Unknown(NVMLError):
    _code = NVML_ERROR_UNKNOWN


class NVMLLibraryMismatchError(Exception):
    """Raised by nvidia-ml-py's unversioned process-list wrappers where the driver lacks the
    versioned NVML call they use: a plain ``Exception``, not an ``NVMLError``."""


def nvmlExceptionClass(nvmlErrorCode: int) -> type[NVMLError]:
    """Return the ``NVMLError`` subclass for a code (``ValueError`` if unknown)."""
    try:
        return NVMLError._valClassMapping[nvmlErrorCode]
    except KeyError:
        raise ValueError(f"nvmlErrorCode {nvmlErrorCode} is not valid") from None


# --------------------------------------------------------------------------- #
# Result objects
# --------------------------------------------------------------------------- #


class FakeNvmlDeviceHandle:
    """Opaque device handle (identity equality, like a ctypes pointer)."""

    __slots__ = ("_index", "_uuid")

    def __init__(self, index: int, uuid: str) -> None:
        self._index = index
        self._uuid = uuid

    def __repr__(self) -> str:
        return f"<fake nvmlDevice_t index={self._index} uuid={self._uuid}>"


c_nvmlDevice_t = FakeNvmlDeviceHandle


class c_nvmlValue_t(ctypes.Union):
    """NVML's value union, laid out as nvml.h's ``nvmlValue_t`` (and nvidia-ml-py's): the
    members share their bytes, so only the member of the entry's ``valueType`` reads the
    value; another reads the same bytes reinterpreted (``uiVal`` of a 64-bit value is its
    low 32 bits, ``dVal`` of an integer a meaningless double)."""

    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class c_nvmlFieldValue_t:
    """One entry of ``nvmlDeviceGetFieldValues``; check ``nvmlReturn`` first."""

    __slots__ = (
        "fieldId",
        "scopeId",
        "timestamp",
        "latencyUsec",
        "valueType",
        "nvmlReturn",
        "value",
    )

    def __init__(self, field_id: int, scope_id: int) -> None:
        self.fieldId = field_id
        self.scopeId = scope_id
        self.timestamp = 0
        self.latencyUsec = 0
        self.valueType = NVML_VALUE_TYPE_DOUBLE
        self.nvmlReturn = NVML_SUCCESS
        self.value = c_nvmlValue_t()

    def __repr__(self) -> str:
        return (
            f"c_nvmlFieldValue_t(fieldId={self.fieldId}, scopeId={self.scopeId}, "
            f"nvmlReturn={self.nvmlReturn}, valueType={self.valueType}, "
            f"uiVal={self.value.uiVal})"
        )


class c_nvmlProcessInfo_t:
    """One compute process on a device: ``pid`` (host PID namespace) and ``usedGpuMemory``
    (bytes; None where the driver cannot say, as nvidia-ml-py reports it)."""

    __slots__ = ("pid", "usedGpuMemory", "gpuInstanceId", "computeInstanceId")

    def __init__(self, pid: int, used: int | None) -> None:
        self.pid = pid
        self.usedGpuMemory = used
        self.gpuInstanceId = 0xFFFFFFFF
        self.computeInstanceId = 0xFFFFFFFF

    def __repr__(self) -> str:
        return f"c_nvmlProcessInfo_t(pid={self.pid}, usedGpuMemory={self.usedGpuMemory})"


class c_nvmlViolationTime_t:
    """``nvmlDeviceGetViolationStatus``'s answer: ``violationTime`` (ns the policy held the
    clocks below the requested ones, cumulative since driver load) and ``referenceTime`` (the
    CPU timestamp of the read, microseconds)."""

    __slots__ = ("referenceTime", "violationTime")

    def __init__(self, reference_us: int, violation_ns: int) -> None:
        self.referenceTime = reference_us
        self.violationTime = violation_ns

    def __repr__(self) -> str:
        return (
            f"c_nvmlViolationTime_t(referenceTime={self.referenceTime}, "
            f"violationTime={self.violationTime})"
        )


class c_nvmlMemory_t:
    """Memory info in bytes (``total``, ``free``, ``used``)."""

    __slots__ = ("total", "free", "used", "reserved", "version")

    def __init__(self, total: int, used: int, version: int | None = None) -> None:
        self.total = total
        self.used = used
        self.free = total - used
        self.reserved = 0
        self.version = version or 0

    def __repr__(self) -> str:
        return f"c_nvmlMemory_t(total={self.total}, free={self.free}, used={self.used})"


# --------------------------------------------------------------------------- #
# Device profiles and the physical model
# --------------------------------------------------------------------------- #

_MIB = 1024 * 1024

FAKE_PROFILES: dict[str, dict[str, Any]] = {
    "h100-sxm": {
        "name": "NVIDIA H100 80GB HBM3",
        "architecture": NVML_DEVICE_ARCH_HOPPER,
        "mem_clock_mhz": 2619,
        "memory_total_bytes": 81559 * _MIB,
    },
    "h200-sxm": {
        "name": "NVIDIA H200",
        "architecture": NVML_DEVICE_ARCH_HOPPER,
        "mem_clock_mhz": 3201,
        "memory_total_bytes": 143771 * _MIB,
        # an H200 lists 1980...345 MHz (NVML's supported clocks, read on one, 2026-12-04)
        "min_sm_mhz": 345,
    },
    # A Hopper GPU the twin has no profile of (its name a prefix of the H200's): figures
    # illustrative, the H100 SXM's but the name, memory and a 400 W limit.
    "h20": {
        "name": "NVIDIA H20",
        "architecture": NVML_DEVICE_ARCH_HOPPER,
        "mem_clock_mhz": 2619,
        "memory_total_bytes": 97871 * _MIB,
        "power_max_mw": 400_000,
        "power_default_mw": 400_000,
    },
}
_HOPPER_SXM = {
    "max_sm_mhz": 1980,
    "min_sm_mhz": 210,
    "step_mhz": 15,
    "idle_sm_mhz": 345,
    "tdp_sm_mhz": 1830,
    "power_min_mw": 200_000,
    "power_max_mw": 700_000,
    "power_default_mw": 700_000,
    "idle_w": 75.0,
    "dynamic_w": 500.0,
    "v_min": 0.7,
    "v_min_below_mhz": 1000,
    "v_max": 1.0,
}
for _profile in FAKE_PROFILES.values():
    _profile.update({k: v for k, v in _HOPPER_SXM.items() if k not in _profile})

DEFAULT_DEVICES = "h100-sxm,h100-sxm"
DRIVER_VERSION = "570.133.20"
FAKE_VBIOS = "96.00.99.00.01"
FAKE_ENERGY_UPDATE_S = 0.02
_INITIAL_ENERGY_MJ = 1_000_000_000  # the real counter starts at driver load


def _graphics_clocks(prof: dict[str, Any]) -> list[int]:
    """Supported SM clocks, descending."""
    return list(range(prof["max_sm_mhz"], prof["min_sm_mhz"] - 1, -prof["step_mhz"]))


def _voltage(prof: dict[str, Any], mhz: int) -> float:
    """V/f curve: flat at ``v_min`` up to 1000 MHz, then linear to ``v_max``."""
    lo = prof["v_min_below_mhz"]
    if mhz <= lo:
        return prof["v_min"]
    frac = (mhz - lo) / (prof["max_sm_mhz"] - lo)
    return prof["v_min"] + (prof["v_max"] - prof["v_min"]) * frac


def _power_w(prof: dict[str, Any], mhz: int, util: float) -> float:
    """Board power: idle + util * dynamic * f/fmax * (V/Vmax)^2."""
    fmax = prof["max_sm_mhz"]
    v_ratio = _voltage(prof, mhz) / _voltage(prof, fmax)
    return prof["idle_w"] + prof["dynamic_w"] * util * (mhz / fmax) * v_ratio**2


def _operating_point(prof: dict[str, Any], dev: dict[str, Any]) -> tuple[int, int, int]:
    """Return (SM clock MHz, power mW, clocks-event-reason bitmask)."""
    util = float(dev["load"])
    locked = dev["locked_clocks"]
    # A lock is a user-defined clock setting: NVML reports it (0x2) while it is held.
    reasons = nvmlClocksEventReasonApplicationsClocksSetting if locked is not None else 0
    if util <= 0.0:
        clock = prof["idle_sm_mhz"]
        if locked is not None:
            clock = min(max(clock, locked[0]), locked[1])
        reasons |= nvmlClocksEventReasonGpuIdle
    else:
        clock = locked[1] if locked is not None else prof["max_sm_mhz"]
    limit_w = _enforced_limit_mw(dev) / 1000.0
    capped = False
    while _power_w(prof, clock, util) > limit_w and clock > prof["min_sm_mhz"]:
        clock -= prof["step_mhz"]
        capped = True
    if capped:
        reasons |= nvmlClocksEventReasonSwPowerCap
    power_mw = round(_power_w(prof, clock, util) * 1000.0)
    return clock, power_mw, reasons


def _enforced_limit_mw(dev: dict[str, Any]) -> int:
    """The limit the driver enforces: the configured one, or a lower out-of-band limit (a
    BMC or rack cap, ``fake_update_device(i, oob_power_limit_mw=...)``)."""
    oob = dev.get("oob_power_limit_mw")
    configured = int(dev["power_limit_mw"])
    return configured if oob is None else min(configured, int(oob))


def _temperature_c(power_mw: int) -> int:
    """GPU temperature from power: 30 + 0.06 * W."""
    return int(30 + 0.06 * power_mw / 1000.0)


# --------------------------------------------------------------------------- #
# Persistent state
# --------------------------------------------------------------------------- #

_STATE_SCHEMA = 1
_UUID_NAMESPACE = _uuid.UUID("6f1c1d2e-9a57-4c1b-8d1e-64f5a7c0d3b1")


def _state_path() -> str:
    path = os.environ.get("DVFS_FAKE_NVML_STATE")
    if not path:
        path = os.path.join(tempfile.gettempdir(), f"dvfs-fake-nvml-{os.getuid()}.json")
    return path


def _parse_profiles(devices: str | list[str] | None) -> list[str]:
    if devices is None:
        devices = os.environ.get("DVFS_FAKE_NVML_DEVICES", DEFAULT_DEVICES)
    if isinstance(devices, str):
        devices = [p.strip() for p in devices.split(",") if p.strip()]
    for name in devices:
        if name not in FAKE_PROFILES:
            raise ValueError(f"unknown fake NVML profile {name!r}")
    return list(devices)


def _new_device(index: int, profile: str, now: float) -> dict[str, Any]:
    prof = FAKE_PROFILES[profile]
    energy = _INITIAL_ENERGY_MJ * (index + 1)
    return {
        "index": index,
        "profile": profile,
        "uuid": "GPU-" + str(_uuid.uuid5(_UUID_NAMESPACE, f"{profile}/{index}")),
        "mig": False,
        "ecc": NVML_FEATURE_ENABLED,
        "lost": False,
        "errors": {},
        "field_errors": {},
        "memory_used_bytes": 512 * _MIB,
        "load": 0.0,
        "locked_clocks": None,
        "power_limit_mw": prof["power_default_mw"],
        "oob_power_limit_mw": None,
        "persistence_mode": NVML_FEATURE_ENABLED,
        "energy_mj": energy,
        "energy_exact_mj": float(energy),
        "energy_time": now,
        "processes": [],
        "violation_ns": {},
    }


def _new_state(devices: str | list[str] | None = None) -> dict[str, Any]:
    now = time.time()
    return {
        "schema": _STATE_SCHEMA,
        "driver_version": DRIVER_VERSION,
        "devices": [_new_device(i, p, now) for i, p in enumerate(_parse_profiles(devices))],
        "calls": [],
    }


def _write_atomic(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to a temp file beside ``path`` and rename it over ``path``. Called under
    ``_state_lock`` only, so one fixed temp name serves every writer (a random one is made
    with more system calls). Compact JSON: encoded in C, where an indented one is not."""
    tmp = path + ".tmp"
    data = memoryview(json.dumps(state).encode())
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _integrate_energy(dev: dict[str, Any], now: float) -> None:
    """Advance the exact energy integral to ``now`` and the reported counter to
    the last 20 ms grid boundary; power is constant since the last integration
    because every state change integrates first."""
    t0 = float(dev["energy_time"])
    if now <= t0:
        return
    _, power_mw, reasons = _operating_point(FAKE_PROFILES[dev["profile"]], dev)
    if reasons & 0x4:  # SwPowerCap held the clock all along: the POWER policy's time grows
        violation = dev.setdefault("violation_ns", {})
        key = str(NVML_PERF_POLICY_POWER)
        violation[key] = int(violation.get(key, 0)) + round((now - t0) * 1e9)
    boundary = math.floor(now / FAKE_ENERGY_UPDATE_S) * FAKE_ENERGY_UPDATE_S
    if boundary > t0:
        at_boundary = dev["energy_exact_mj"] + power_mw * (boundary - t0)
        dev["energy_mj"] = max(int(dev["energy_mj"]), int(at_boundary))
    dev["energy_exact_mj"] = dev["energy_exact_mj"] + power_mw * (now - t0)
    dev["energy_time"] = now


@contextlib.contextmanager
def _state_lock() -> Iterator[str]:
    """Hold the exclusive ``flock`` on ``<state>.lock``; yields the state path. Its folder is
    made where it is missing (tried first: a sampler's every reading takes the lock)."""
    path = _state_path()
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
    try:
        fd = os.open(path + ".lock", flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = os.open(path + ".lock", flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _transaction(write: bool, integrate: bool | None = None) -> Iterator[dict[str, Any]]:
    """Lock, load (creating if missing), and on ``write`` integrate energy first
    and save atomically on normal exit. ``integrate`` (default: ``write``) integrates without
    saving, for a query of the energy counter or the violation times: what it returns is the
    same integral (power is constant since the state's last change, which integrated), and
    the file is not rewritten on every reading, which cost most of a sampler's CPU."""
    with _state_lock() as path:
        try:
            with open(path, "rb") as f:
                state = json.loads(f.read())
        except FileNotFoundError:
            state = _new_state()
            _write_atomic(path, state)
        if state.get("schema") != _STATE_SCHEMA:
            raise RuntimeError(f"fake NVML state {path} has an unknown schema")
        if write if integrate is None else integrate:
            now = time.time()
            for dev in state["devices"]:
                _integrate_energy(dev, now)
        yield state
        if write:
            _write_atomic(path, state)


# --------------------------------------------------------------------------- #
# Call plumbing
# --------------------------------------------------------------------------- #

_init_lock = threading.Lock()
_init_count = 0


def _check_init() -> None:
    if _init_count <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)


def _env_flag(name: str, default: str = "0") -> bool:
    return os.environ.get(name, default) == "1"


def _check_uint(value: Any) -> int:
    """Mimic ctypes ``c_uint(value)``: non-integers raise ``TypeError``."""
    if not isinstance(value, int):
        raise TypeError(f"int expected instead of {type(value).__name__}")
    return value


def _device(
    state: dict[str, Any], handle: Any, fn_name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Resolve a handle to (device state, profile), applying injected faults."""
    if not isinstance(handle, FakeNvmlDeviceHandle):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    devices = state["devices"]
    if not 0 <= handle._index < len(devices):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    dev = devices[handle._index]
    if dev["uuid"] != handle._uuid:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if dev["lost"]:
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    injected = dev["errors"].get(fn_name)
    if injected:
        raise NVMLError(int(injected))
    return dev, FAKE_PROFILES[dev["profile"]]


#: Hangs end when `fake_release_hangs` moves the generation on: a call that began hanging in
#: an earlier generation returns even if it was not waiting yet when the release came (an
#: event set and cleared at once was missed by a call between its log line and its wait).
_hang_release = threading.Condition()
_hang_generation = 0


def _hang_seconds(fn_name: str, index: int | None) -> float | None:
    """How long ``DVFS_FAKE_NVML_HANG`` makes this call hang (None: not at all)."""
    spec = os.environ.get("DVFS_FAKE_NVML_HANG", "")
    for item in spec.split(","):
        target, _, seconds = item.partition("=")
        name, _, at = target.strip().partition("@")
        if name != fn_name or (at and index is not None and int(at) != index):
            continue
        return float(seconds)
    return None


def _maybe_hang(fn_name: str, handle: Any) -> None:
    """Hang like a stuck driver call when ``DVFS_FAKE_NVML_HANG`` names this call."""
    index = handle._index if isinstance(handle, FakeNvmlDeviceHandle) else None
    seconds = _hang_seconds(fn_name, index)
    if seconds is None:
        return
    with _hang_release:
        began = _hang_generation
    with open(_state_path() + ".hangs", "a") as log:
        log.write(json.dumps({"fn": fn_name, "index": index, "pid": os.getpid()}) + "\n")
    with _hang_release:
        _hang_release.wait_for(
            lambda: _hang_generation != began, None if math.isinf(seconds) else seconds
        )


def _get(
    fn_name: str,
    handle: Any,
    getter: Callable[[dict[str, Any], dict[str, Any]], Any],
    *,
    write: bool = False,
    integrate: bool = False,
) -> Any:
    """Run a device query: init check, resolve handle, call ``getter(dev, prof)`` (on the state
    integrated to now where ``integrate``: `_transaction`)."""
    _maybe_hang(fn_name, handle)
    _check_init()
    with _transaction(write, integrate or write) as state:
        dev, prof = _device(state, handle, fn_name)
        return getter(dev, prof)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _set(
    fn_name: str,
    handle: Any,
    args: tuple[Any, ...],
    apply: Callable[[dict[str, Any], dict[str, Any]], None],
    *,
    swallow: bool = False,
) -> None:
    """Run a setter and append it to the call log, whether it succeeds or not.

    ``apply(dev, prof)`` must validate everything before it changes anything.
    With ``swallow`` errors after the init check are logged but not raised.
    """
    index = handle._index if isinstance(handle, FakeNvmlDeviceHandle) else None
    _maybe_hang(fn_name, handle)
    error: BaseException | None = None
    try:
        _check_init()
    except NVMLError as exc:
        error = exc
    with _transaction(write=True) as state:
        if error is None:
            try:
                dev, prof = _device(state, handle, fn_name)
                if not _env_flag("DVFS_FAKE_NVML_ROOT", "1"):
                    raise NVMLError(NVML_ERROR_NO_PERMISSION)
                apply(dev, prof)
            except (NVMLError, TypeError) as exc:
                error = exc
        state["calls"].append(
            {
                "fn": fn_name,
                "index": index,
                "args": [_jsonable(a) for a in args],
                "ok": error is None,
                "error": type(error).__name__ if error is not None else None,
                "pid": os.getpid(),
                "time": time.time(),
            }
        )
    if error is None:
        return
    if swallow and not isinstance(error, NVMLError_Uninitialized | TypeError):
        return
    raise error


# --------------------------------------------------------------------------- #
# Library / system
# --------------------------------------------------------------------------- #


def nvmlInitWithFlags(flags: int) -> None:
    """Initialise NVML (reference counted per process)."""
    global _init_count
    if _env_flag("DVFS_FAKE_NVML_MISSING"):
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    code = os.environ.get("DVFS_FAKE_NVML_INIT_ERROR", "")
    if code:
        raise NVMLError(int(code))
    with _transaction(write=False):
        pass  # create / validate the state file
    with _init_lock:
        _init_count += 1


def nvmlInit() -> None:
    """Initialise NVML (reference counted per process)."""
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    """Drop one reference; ``NVMLError_Uninitialized`` if there is none."""
    global _init_count
    with _init_lock:
        if _init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        _init_count -= 1


def nvmlErrorString(result: int) -> str:
    """Text for an NVML return code."""
    if result == NVML_SUCCESS:
        return "Success"
    return _ERROR_TEXT.get(result, "Unknown Error")


def nvmlSystemGetDriverVersion() -> str:
    """Driver version string."""
    _check_init()
    with _transaction(write=False) as state:
        return str(state["driver_version"])


def nvmlDeviceGetCount() -> int:
    """Number of devices."""
    _check_init()
    with _transaction(write=False) as state:
        return len(state["devices"])


def nvmlDeviceGetHandleByIndex(index: int) -> FakeNvmlDeviceHandle:
    """Handle for a device index (``InvalidArgument`` if out of range); hangs as
    ``DVFS_FAKE_NVML_HANG`` says for that index."""
    if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
        _maybe_hang("nvmlDeviceGetHandleByIndex", FakeNvmlDeviceHandle(index, ""))
    _check_init()
    _check_uint(index)
    with _transaction(write=False) as state:
        devices = state["devices"]
        if not 0 <= index < len(devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        dev = devices[index]
        if dev["lost"]:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        injected = dev["errors"].get("nvmlDeviceGetHandleByIndex")
        if injected:
            raise NVMLError(int(injected))
        return FakeNvmlDeviceHandle(index, dev["uuid"])


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> FakeNvmlDeviceHandle:
    """Handle for a UUID string (``NotFound`` if no device has it)."""
    if isinstance(uuid, bytes):
        uuid = uuid.decode()
    _check_init()
    with _transaction(write=False) as state:
        for dev in state["devices"]:
            if dev["uuid"] == uuid:
                if dev["lost"]:
                    raise NVMLError(NVML_ERROR_GPU_IS_LOST)
                return FakeNvmlDeviceHandle(dev["index"], dev["uuid"])
    raise NVMLError(NVML_ERROR_NOT_FOUND)


# --------------------------------------------------------------------------- #
# Device identity
# --------------------------------------------------------------------------- #


def nvmlDeviceGetName(handle: FakeNvmlDeviceHandle) -> str:
    """Product name."""
    return _get("nvmlDeviceGetName", handle, lambda d, p: p["name"])


def nvmlDeviceGetUUID(handle: FakeNvmlDeviceHandle) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    return _get("nvmlDeviceGetUUID", handle, lambda d, p: d["uuid"])


def nvmlDeviceGetIndex(handle: FakeNvmlDeviceHandle) -> int:
    """Device index."""
    return _get("nvmlDeviceGetIndex", handle, lambda d, p: d["index"])


def nvmlDeviceGetArchitecture(device: FakeNvmlDeviceHandle) -> int:
    """Architecture id (9 = Hopper)."""
    return _get("nvmlDeviceGetArchitecture", device, lambda d, p: p["architecture"])


def nvmlDeviceGetMigMode(device: FakeNvmlDeviceHandle) -> list[int]:
    """``[current, pending]`` MIG mode."""
    return _get("nvmlDeviceGetMigMode", device, lambda d, p: [int(d["mig"]), int(d["mig"])])


def nvmlDeviceGetEccMode(handle: FakeNvmlDeviceHandle) -> list[int]:
    """``[current, pending]`` ECC mode: on, unless ``fake_update_device(i, ecc=0)`` turned it
    off (as `nvidia-smi -e 0` and a reboot would: both at once here)."""
    return _get(
        "nvmlDeviceGetEccMode",
        handle,
        lambda d, p: [int(d.get("ecc", NVML_FEATURE_ENABLED))] * 2,
    )


def nvmlDeviceGetVbiosVersion(handle: FakeNvmlDeviceHandle) -> str:
    """The VBIOS version (``fake_update_device(i, vbios=...)``: a reflashed board)."""
    return _get("nvmlDeviceGetVbiosVersion", handle, lambda d, p: str(d.get("vbios") or FAKE_VBIOS))


def nvmlDeviceGetMemoryInfo(
    handle: FakeNvmlDeviceHandle, version: int | None = None
) -> c_nvmlMemory_t:
    """Framebuffer memory (bytes). As on a real GPU, ``used`` is what the driver reserves
    (``memory_used_bytes``) plus every live compute process's own memory (``used_bytes``),
    at most the total: a process that took memory shows there even where its pid is one no
    caller can see, or NVML cannot list processes."""

    def read(d: dict[str, Any], p: dict[str, Any]) -> c_nvmlMemory_t:
        contexts = sum(
            int(e.get("used_bytes") or 0) for e in d.get("processes") or () if _alive(int(e["pid"]))
        )
        total = int(p["memory_total_bytes"])
        return c_nvmlMemory_t(total, min(total, int(d["memory_used_bytes"]) + contexts), version)

    return _get("nvmlDeviceGetMemoryInfo", handle, read)


def nvmlDeviceGetPersistenceMode(handle: FakeNvmlDeviceHandle) -> int:
    """0 or 1."""
    return _get("nvmlDeviceGetPersistenceMode", handle, lambda d, p: d["persistence_mode"])


def nvmlDeviceSetPersistenceMode(handle: FakeNvmlDeviceHandle, mode: int) -> None:
    """Enable/disable persistence mode (root only)."""

    def apply(dev: dict[str, Any], prof: dict[str, Any]) -> None:
        _check_uint(mode)
        if mode not in (NVML_FEATURE_DISABLED, NVML_FEATURE_ENABLED):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        dev["persistence_mode"] = mode

    _set("nvmlDeviceSetPersistenceMode", handle, (mode,), apply)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _processes(fn_name: str, handle: FakeNvmlDeviceHandle) -> list[c_nvmlProcessInfo_t]:
    return _get(
        fn_name,
        handle,
        lambda d, p: [
            c_nvmlProcessInfo_t(int(e["pid"]), e.get("used_bytes"))
            for e in d.get("processes") or ()
            if _alive(int(e["pid"]))
        ],
    )


def nvmlDeviceGetComputeRunningProcesses(handle: FakeNvmlDeviceHandle) -> list[c_nvmlProcessInfo_t]:
    """The compute processes on the device (live pids of its ``processes`` list). Like
    nvidia-ml-py's wrapper, which calls NVML's ``_v3`` and turns its FunctionNotFound (a driver
    without ``_v3``) into ``NVMLLibraryMismatchError``, no ``NVMLError``: inject
    ``errors={"nvmlDeviceGetComputeRunningProcesses": 13}`` for such a driver."""
    try:
        return _processes("nvmlDeviceGetComputeRunningProcesses", handle)
    except NVMLError_FunctionNotFound as exc:
        raise NVMLLibraryMismatchError(
            "nvmlDeviceGetComputeRunningProcesses: this NVML has no versioned call the binding "
            "uses; call a versioned function such as nvmlDeviceGetComputeRunningProcesses_v2"
        ) from exc


def nvmlDeviceGetComputeRunningProcesses_v2(
    handle: FakeNvmlDeviceHandle,
) -> list[c_nvmlProcessInfo_t]:
    """The compute processes through NVML's ``_v2`` call (drivers before ``_v3`` have it):
    the same list; inject ``errors={"nvmlDeviceGetComputeRunningProcesses_v2": 13}`` for a
    driver without it either."""
    return _processes("nvmlDeviceGetComputeRunningProcesses_v2", handle)


# --------------------------------------------------------------------------- #
# Clocks
# --------------------------------------------------------------------------- #


def nvmlDeviceGetSupportedMemoryClocks(handle: FakeNvmlDeviceHandle) -> list[int]:
    """Supported memory clocks (MHz, descending)."""
    return _get("nvmlDeviceGetSupportedMemoryClocks", handle, lambda d, p: [p["mem_clock_mhz"]])


def nvmlDeviceGetSupportedGraphicsClocks(
    handle: FakeNvmlDeviceHandle, memoryClockMHz: int
) -> list[int]:
    """Supported SM clocks for a memory clock (MHz, descending)."""

    def getter(dev: dict[str, Any], prof: dict[str, Any]) -> list[int]:
        if _check_uint(memoryClockMHz) != prof["mem_clock_mhz"]:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return _graphics_clocks(prof)

    return _get("nvmlDeviceGetSupportedGraphicsClocks", handle, getter)


def _clock_of_type(clock_type: int, prof: dict[str, Any], sm_mhz: int) -> int:
    _check_uint(clock_type)
    if clock_type in (NVML_CLOCK_GRAPHICS, NVML_CLOCK_SM):
        return sm_mhz
    if clock_type == NVML_CLOCK_MEM:
        return prof["mem_clock_mhz"]
    if clock_type == NVML_CLOCK_VIDEO:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)


def nvmlDeviceGetClockInfo(handle: FakeNvmlDeviceHandle, type: int) -> int:
    """Current clock (MHz) of ``NVML_CLOCK_SM``/``GRAPHICS``/``MEM``."""
    return _get(
        "nvmlDeviceGetClockInfo",
        handle,
        lambda d, p: _clock_of_type(type, p, _operating_point(p, d)[0]),
    )


def nvmlDeviceGetMaxClockInfo(handle: FakeNvmlDeviceHandle, type: int) -> int:
    """Maximum clock (MHz)."""
    return _get(
        "nvmlDeviceGetMaxClockInfo",
        handle,
        lambda d, p: _clock_of_type(type, p, p["max_sm_mhz"]),
    )


def _round_clock(prof: dict[str, Any], mhz: int) -> int:
    step = prof["step_mhz"]
    return prof["min_sm_mhz"] + round((mhz - prof["min_sm_mhz"]) / step) * step


def _lock_range(prof: dict[str, Any], lo: int, hi: int) -> list[int] | None:
    """Validate a lock request; ``None`` means (UNLIMITED, UNLIMITED) = reset."""
    _check_uint(lo)
    _check_uint(hi)
    if lo < 0 or hi < 0:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    symbolic_lo = lo >= NVML_CLOCK_LIMIT_ID_RANGE_START
    symbolic_hi = hi >= NVML_CLOCK_LIMIT_ID_RANGE_START
    if symbolic_lo != symbolic_hi:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    if symbolic_lo:
        known = (NVML_CLOCK_LIMIT_ID_TDP, NVML_CLOCK_LIMIT_ID_UNLIMITED)
        if lo not in known or hi not in known:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if lo == hi == NVML_CLOCK_LIMIT_ID_UNLIMITED:
            return None
        lo_mhz = prof["tdp_sm_mhz"] if lo == NVML_CLOCK_LIMIT_ID_TDP else prof["min_sm_mhz"]
        hi_mhz = prof["tdp_sm_mhz"] if hi == NVML_CLOCK_LIMIT_ID_TDP else prof["max_sm_mhz"]
        return [lo_mhz, hi_mhz]
    if lo > hi or lo < prof["min_sm_mhz"] or hi > prof["max_sm_mhz"]:
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return [_round_clock(prof, lo), _round_clock(prof, hi)]


def nvmlDeviceSetGpuLockedClocks(
    handle: FakeNvmlDeviceHandle, minGpuClockMHz: int, maxGpuClockMHz: int
) -> None:
    """Lock the SM clock to [min, max] MHz, rounded to supported clocks (root only)."""

    def apply(dev: dict[str, Any], prof: dict[str, Any]) -> None:
        dev["locked_clocks"] = _lock_range(prof, minGpuClockMHz, maxGpuClockMHz)

    _set(
        "nvmlDeviceSetGpuLockedClocks",
        handle,
        (minGpuClockMHz, maxGpuClockMHz),
        apply,
    )


def nvmlDeviceResetGpuLockedClocks(handle: FakeNvmlDeviceHandle) -> None:
    """Remove the SM clock lock (root only)."""

    def apply(dev: dict[str, Any], prof: dict[str, Any]) -> None:
        dev["locked_clocks"] = None

    _set("nvmlDeviceResetGpuLockedClocks", handle, (), apply)


def nvmlDeviceGetCurrentClocksEventReasons(handle: FakeNvmlDeviceHandle) -> int:
    """Bitmask of why clocks are below max (GpuIdle 0x1, a lock held 0x2, SwPowerCap 0x4)."""
    _check_init()
    if _env_flag("DVFS_FAKE_NVML_OLD_DRIVER"):
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
    return _get(
        "nvmlDeviceGetCurrentClocksEventReasons",
        handle,
        lambda d, p: _operating_point(p, d)[2],
    )


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: FakeNvmlDeviceHandle) -> int:
    """Deprecated name of ``nvmlDeviceGetCurrentClocksEventReasons`` (old drivers)."""
    return _get(
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        handle,
        lambda d, p: _operating_point(p, d)[2],
    )


# --------------------------------------------------------------------------- #
# Power, energy, temperature
# --------------------------------------------------------------------------- #


def nvmlDeviceGetPowerManagementLimitConstraints(
    handle: FakeNvmlDeviceHandle,
) -> list[int]:
    """``[min_mW, max_mW]``."""
    return _get(
        "nvmlDeviceGetPowerManagementLimitConstraints",
        handle,
        lambda d, p: [p["power_min_mw"], p["power_max_mw"]],
    )


def nvmlDeviceGetPowerManagementDefaultLimit(handle: FakeNvmlDeviceHandle) -> int:
    """Default power limit (mW)."""
    return _get(
        "nvmlDeviceGetPowerManagementDefaultLimit",
        handle,
        lambda d, p: p["power_default_mw"],
    )


def nvmlDeviceGetPowerManagementLimit(handle: FakeNvmlDeviceHandle) -> int:
    """Current power limit (mW)."""
    return _get("nvmlDeviceGetPowerManagementLimit", handle, lambda d, p: d["power_limit_mw"])


def nvmlDeviceGetEnforcedPowerLimit(handle: FakeNvmlDeviceHandle) -> int:
    """Enforced power limit (mW): the current limit, or an injected lower out-of-band one."""
    return _get("nvmlDeviceGetEnforcedPowerLimit", handle, lambda d, p: _enforced_limit_mw(d))


def _power_limit_apply(limit: int) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    def apply(dev: dict[str, Any], prof: dict[str, Any]) -> None:
        _check_uint(limit)
        if not prof["power_min_mw"] <= limit <= prof["power_max_mw"]:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        dev["power_limit_mw"] = limit

    return apply


def nvmlDeviceSetPowerManagementLimit(handle: FakeNvmlDeviceHandle, limit: int) -> None:
    """Set the power limit in mW (root only; ``InvalidArgument`` out of range)."""
    _set("nvmlDeviceSetPowerManagementLimit", handle, (limit,), _power_limit_apply(limit))


def nvmlDeviceSetPowerManagementLimit_v2(
    device: FakeNvmlDeviceHandle,
    powerScope: int,
    powerLimit: int,
    version: int = nvmlPowerValue_v2,
) -> int:
    """Like nvidia-ml-py's wrapper: ignores the NVML return code and always
    returns ``NVML_SUCCESS`` (failures are only visible in the call log)."""
    base = _power_limit_apply(powerLimit)

    def apply(dev: dict[str, Any], prof: dict[str, Any]) -> None:
        if powerScope != NVML_POWER_SCOPE_GPU:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        base(dev, prof)

    _set(
        "nvmlDeviceSetPowerManagementLimit_v2",
        device,
        (powerScope, powerLimit),
        apply,
        swallow=True,
    )
    return NVML_SUCCESS


def nvmlDeviceGetPowerUsage(handle: FakeNvmlDeviceHandle) -> int:
    """Board power draw (mW)."""
    return _get("nvmlDeviceGetPowerUsage", handle, lambda d, p: _operating_point(p, d)[1])


def nvmlDeviceGetTotalEnergyConsumption(handle: FakeNvmlDeviceHandle) -> int:
    """Energy since "driver load" (mJ); advances in 20 ms updates."""
    return _get(
        "nvmlDeviceGetTotalEnergyConsumption",
        handle,
        lambda d, p: int(d["energy_mj"]),
        integrate=True,
    )


def _field_value(
    dev: dict[str, Any], prof: dict[str, Any], field_id: int, scope_id: int
) -> c_nvmlFieldValue_t:
    entry = c_nvmlFieldValue_t(field_id, scope_id)
    entry.timestamp = int(time.time() * 1_000_000)
    injected = dev["field_errors"].get(str(field_id))
    power_fields = {
        NVML_FI_DEV_POWER_AVERAGE: lambda: _operating_point(prof, dev)[1],
        NVML_FI_DEV_POWER_INSTANT: lambda: _operating_point(prof, dev)[1],
        NVML_FI_DEV_POWER_MIN_LIMIT: lambda: prof["power_min_mw"],
        NVML_FI_DEV_POWER_MAX_LIMIT: lambda: prof["power_max_mw"],
        NVML_FI_DEV_POWER_DEFAULT_LIMIT: lambda: prof["power_default_mw"],
        NVML_FI_DEV_POWER_CURRENT_LIMIT: lambda: dev["power_limit_mw"],
    }
    if injected:
        entry.nvmlReturn = int(injected)
    elif field_id == NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
        entry.valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        entry.value.ullVal = int(dev["energy_mj"])
    elif field_id in power_fields:
        if scope_id != NVML_POWER_SCOPE_GPU:
            entry.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        else:
            entry.valueType = NVML_VALUE_TYPE_UNSIGNED_INT
            entry.value.uiVal = int(power_fields[field_id]())
    elif 0 <= field_id < NVML_FI_MAX:
        entry.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
    else:
        entry.nvmlReturn = NVML_ERROR_INVALID_ARGUMENT
    return entry


def nvmlDeviceGetFieldValues(
    handle: FakeNvmlDeviceHandle, fieldIds: list[int | tuple[int, int]]
) -> list[c_nvmlFieldValue_t]:
    """Field values for ``fieldIds`` (ids or ``(id, scope)`` pairs); a failed
    field sets that entry's ``nvmlReturn`` instead of raising."""
    _check_init()
    requests: list[tuple[int, int]] = []
    for item in fieldIds:
        field_id, scope_id = item if isinstance(item, tuple) else (item, 0)
        requests.append((_check_uint(field_id), _check_uint(scope_id)))
    return _get(
        "nvmlDeviceGetFieldValues",
        handle,
        lambda d, p: [_field_value(d, p, f, s) for f, s in requests],
        integrate=True,
    )


def _temperature(sensor: int) -> Callable[[dict[str, Any], dict[str, Any]], int]:
    def getter(dev: dict[str, Any], prof: dict[str, Any]) -> int:
        if _check_uint(sensor) >= NVML_TEMPERATURE_COUNT:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return _temperature_c(_operating_point(prof, dev)[1])

    return getter


def nvmlDeviceGetTemperatureV(
    handle: FakeNvmlDeviceHandle, sensor: int, version: int = nvmlTemperature_v1
) -> int:
    """GPU temperature (°C); ``FunctionNotFound`` in old-driver mode."""
    if version != nvmlTemperature_v1:
        raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    _check_init()
    if _env_flag("DVFS_FAKE_NVML_OLD_DRIVER"):
        raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
    return _get("nvmlDeviceGetTemperatureV", handle, _temperature(sensor))


def nvmlDeviceGetTemperature(handle: FakeNvmlDeviceHandle, sensor: int) -> int:
    """GPU temperature (°C); deprecated API that old drivers have."""
    return _get("nvmlDeviceGetTemperature", handle, _temperature(sensor))


_POLICIES = (
    NVML_PERF_POLICY_POWER,
    NVML_PERF_POLICY_THERMAL,
    NVML_PERF_POLICY_SYNC_BOOST,
    NVML_PERF_POLICY_BOARD_LIMIT,
    NVML_PERF_POLICY_LOW_UTILIZATION,
    NVML_PERF_POLICY_RELIABILITY,
)


def _violation_ns(dev: dict[str, Any], policy: int) -> int:
    counters = dev.get("violation_ns") or {}
    if policy == NVML_PERF_POLICY_TOTAL_APP_CLOCKS:  # any limiter of 0-5
        return sum(int(counters.get(str(p), 0)) for p in _POLICIES)
    return int(counters.get(str(policy), 0))


def nvmlDeviceGetViolationStatus(
    device: FakeNvmlDeviceHandle, perfPolicyType: int
) -> c_nvmlViolationTime_t:
    """How long (ns, cumulative, monotone) the policy held the clocks below the requested ones:
    POWER grows while SwPowerCap holds the clock; the others only by ``fake_throttle_burst``
    (the fake models no thermal or board limiter otherwise). An unknown policy is
    ``InvalidArgument``; inject ``errors={"nvmlDeviceGetViolationStatus": 3}`` (NotSupported)
    or ``13`` (FunctionNotFound) for a GPU or driver without it."""
    policy = _check_uint(perfPolicyType)
    if policy not in (
        *_POLICIES,
        NVML_PERF_POLICY_TOTAL_APP_CLOCKS,
        NVML_PERF_POLICY_TOTAL_BASE_CLOCKS,
    ):
        _check_init()
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _get(
        "nvmlDeviceGetViolationStatus",
        device,
        lambda d, p: c_nvmlViolationTime_t(int(time.time() * 1_000_000), _violation_ns(d, policy)),
        integrate=True,
    )


# --------------------------------------------------------------------------- #
# Test-only helpers (not in the real module)
# --------------------------------------------------------------------------- #

_UPDATABLE = {
    "mig",
    "ecc",
    "vbios",
    "lost",
    "errors",
    "field_errors",
    "memory_used_bytes",
    "load",
    "locked_clocks",
    "power_limit_mw",
    "oob_power_limit_mw",
    "persistence_mode",
}


def fake_reset_state(devices: str | list[str] | None = None) -> None:
    """Replace the state file with a fresh one (profiles from ``devices`` or
    ``DVFS_FAKE_NVML_DEVICES``); clears the call log."""
    state = _new_state(devices)
    with _state_lock() as path:
        _write_atomic(path, state)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + ".hangs")


def fake_state() -> dict[str, Any]:
    """A copy of the whole persisted state (devices, call log, driver version)."""
    with _transaction(write=True) as state:
        return copy.deepcopy(state)


def fake_device_state(index: int) -> dict[str, Any]:
    """Persisted state of one device plus derived readings under ``"readings"``."""
    with _transaction(write=True) as state:
        dev = copy.deepcopy(state["devices"][index])
    prof = FAKE_PROFILES[dev["profile"]]
    clock, power_mw, reasons = _operating_point(prof, dev)
    dev["readings"] = {
        "sm_clock_mhz": clock,
        "power_mw": power_mw,
        "reasons": reasons,
        "temperature_c": _temperature_c(power_mw),
    }
    return dev


def fake_calls(fn: str | None = None) -> list[dict[str, Any]]:
    """Setter call log (oldest first), optionally only calls of function ``fn``."""
    with _transaction(write=False) as state:
        calls = state["calls"]
        return [dict(c) for c in calls if fn is None or c["fn"] == fn]


def fake_set_load(index: int, utilisation: float) -> None:
    """Set device utilisation in [0, 1] (persisted; energy is integrated first)."""
    if not 0.0 <= float(utilisation) <= 1.0:
        raise ValueError("utilisation must be in [0, 1]")
    fake_update_device(index, load=float(utilisation))


set_load = fake_set_load


def fake_update_device(index: int, **changes: Any) -> None:
    """Change device state directly, bypassing the call log (e.g. ``mig=True``,
    ``lost=True``, ``locked_clocks=[1200, 1200]`` left by an earlier tool,
    ``power_limit_mw=450_000`` set by an admin, ``oob_power_limit_mw=500_000`` (an
    out-of-band cap: the enforced limit is the lower of it and the configured one),
    ``errors={"nvmlDeviceGetPowerUsage": 3}``, ``field_errors={186: 3}``)."""
    unknown = set(changes) - _UPDATABLE
    if unknown:
        raise KeyError(f"not updatable: {sorted(unknown)}")
    if "field_errors" in changes:
        changes["field_errors"] = {str(k): v for k, v in changes["field_errors"].items()}
    if changes.get("locked_clocks") is not None:
        changes["locked_clocks"] = [int(v) for v in changes["locked_clocks"]]
    with _transaction(write=True) as state:
        state["devices"][index].update(changes)


def _device_index(state: dict[str, Any], device: int | str) -> int:
    if isinstance(device, int):
        if not 0 <= device < len(state["devices"]):
            raise KeyError(f"no fake device {device}")
        return device
    for dev in state["devices"]:
        if dev["uuid"] == device:
            return int(dev["index"])
    raise KeyError(f"no fake device with UUID {device!r}")


def fake_add_process(device: int | str, pid: int, used_bytes: int = 1024 * _MIB) -> None:
    """List ``pid`` as a compute process on ``device`` (an index or a UUID), as a process
    that created a CUDA context there would be."""
    with _transaction(write=True) as state:
        dev = state["devices"][_device_index(state, device)]
        entries = [e for e in dev.setdefault("processes", []) if int(e["pid"]) != pid]
        dev["processes"] = [*entries, {"pid": int(pid), "used_bytes": int(used_bytes)}]


def fake_remove_process(pid: int) -> None:
    """Drop ``pid`` from every device's compute processes (the process released its GPUs)."""
    with _transaction(write=True) as state:
        for dev in state["devices"]:
            dev["processes"] = [e for e in dev.get("processes") or () if int(e["pid"]) != pid]


def fake_throttle_burst(
    index: int, nanoseconds: int, policy: int = NVML_PERF_POLICY_THERMAL
) -> None:
    """A throttle of ``nanoseconds`` by ``policy`` (thermal by default) that has just ended:
    its violation counter grows by that much, and nothing else changes. The clock-event
    reasons, read at an instant, never show it, as they miss a real burst shorter than the
    time between two samples."""
    if nanoseconds < 0 or policy not in _POLICIES:
        raise ValueError("a burst lasts a non-negative time, under one of policies 0-5")
    with _transaction(write=True) as state:
        violation = state["devices"][index].setdefault("violation_ns", {})
        violation[str(policy)] = int(violation.get(str(policy), 0)) + int(nanoseconds)


def fake_set_driver_version(version: str) -> None:
    """Change the reported driver version."""
    with _transaction(write=True) as state:
        state["driver_version"] = version


def fake_hangs_started() -> list[dict[str, Any]]:
    """Hangs that began (any process), oldest first: ``{"fn", "index", "pid"}``."""
    try:
        with open(_state_path() + ".hangs") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def fake_release_hangs() -> None:
    """End every hang in progress in this process (unset ``DVFS_FAKE_NVML_HANG`` first, or
    the next call hangs again)."""
    global _hang_generation
    with _hang_release:
        _hang_generation += 1
        _hang_release.notify_all()


def fake_init_count() -> int:
    """This process's ``nvmlInit`` reference count."""
    return _init_count
