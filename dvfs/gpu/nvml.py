"""The `Gpu` protocol over NVML (nvidia-ml-py's `pynvml`), with every NVML error translated.

Only current NVML calls: locked GPU clocks (not the deprecated applications clocks), the v1
power-limit setter (pynvml's `_v2` wrapper ignores errors), the total-energy counter, and
instant power through field values. The `pynvml` module arrives as an argument, so tests hand
in a fake with NVML's semantics. Every call has a deadline (`dvfs.gpu.deadline`): a hung driver
call is reported as `GpuTimeoutError` naming the call and the GPU; NVML's return codes map to
dvfs's errors through one table (`dvfs.gpu.nvml_errors`).

Six calls beyond /work/shared/NVML-CONTRACT.md's table; their rows, as that table would hold
them:
  call: `nvmlDeviceGetEccMode(h)` (`GpuIdentity.ecc_mode`): `[current, pending]`, each
    `NVML_FEATURE_ENABLED` (1) or `DISABLED` (0); pending differs until a reboot.
  may raise: `NotSupported` (a board without ECC: "unsupported"), `FunctionNotFound`,
    `NoPermission`, `Unknown` (not known: ""), `GpuIsLost` (raised).
  call: `nvmlDeviceGetVbiosVersion(h)` (`GpuIdentity.vbios_version`): text (nvidia-ml-py
    decodes it; an older one gives bytes).
  may raise: as `nvmlDeviceGetEccMode`, `NotSupported` not known too ("").
  call: `nvmlDeviceGetViolationStatus(h, policy)`, policy `NVML_PERF_POLICY_THERMAL` (1) or
    `NVML_PERF_POLICY_BOARD_LIMIT` (3) (`dvfs.gpu.base.THROTTLE_POLICIES`); pynvml marks it
    deprecated in favour of field values ("will be removed in CUDA 14.0").
  returns: an `nvmlViolationTime_t`: `.violationTime` the nanoseconds that policy held the
    clocks below the requested ones, cumulative; `.referenceTime` the CPU
    timestamp of the read (microseconds). Two reads' difference is the throttling between them.
  may raise: `NotSupported`, `FunctionNotFound` (an older driver, or a pynvml without it),
    `Deprecated` (code 26, a driver past the call's deprecation): unknown, None, never a
    failure (`NvmlGpu.throttle_violation_ns`).
  call: `nvmlDeviceGetComputeRunningProcesses(h)` (a server's processes on a GPU, a tenant's).
  returns: a list of process structs, `.pid` read (`.usedGpuMemory` may be None: not read).
  may raise: `NotSupported`; nvidia-ml-py 13's wrapper calls NVML's `_v3` only and raises
    `NVMLLibraryMismatchError`, no `NVMLError`, on a driver without it (`process_lister`).
  call: `nvmlDeviceGetIndex(h)` (the NVML index of a GPU opened by UUID): int.
  call: `nvmlDeviceGetMemoryInfo(h)` (`dvfs gpu info`): a struct, `.total`/`.used` bytes;
    None where NVML does not support it.

The one adapter to the NVML API, kept whole near 400 lines: every method of `NvmlGpu` is a
call, a deadline and a translation, so splitting it further would scatter one job.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, TypeVar

from dvfs.errors import (
    CampaignError,
    GpuError,
    GpuMigError,
    GpuNotFoundError,
    GpuNotSupportedError,
    GpuPermissionError,
    GpuUnavailableError,
    GpuValueError,
)
from dvfs.gpu.base import (
    THROTTLE_POLICIES,
    UNREAD_UUID,
    DeviceInfo,
    GpuIdentity,
    GpuProcesses,
    PowerLimitRange,
    canonical_uuid,
    mig_off_advice,
    unsupported_clock,
)
from dvfs.gpu.deadline import CallWorker, DeadlineExceeded, GpuTimeoutError, default_deadline_s
from dvfs.gpu.nvml_errors import NvmlErrors
from dvfs.gpu.visible import Visible
from dvfs.gpu.visible import check as check_visible
from dvfs.gpu.visible import resolve as resolve_visible

log = logging.getLogger(__name__)

#: Where this thread keeps its warnings of a GPU's opening (`warnings_held`), where it does.
_held = threading.local()


@contextlib.contextmanager
def warnings_held() -> Iterator[list[str]]:
    """Within the block, this thread's warnings of a GPU's opening (`NvmlGpu._unread`) are kept
    in the list yielded instead of logged: GPUs probed side by side
    (`dvfs.backends.reachable_gpus`) warn in the order they finish, which changes from run to
    run; the caller logs each GPU's (`log_held`) in the GPUs' order, as one after another."""
    held: list[str] = []
    _held.warnings = held
    try:
        yield held
    finally:
        _held.warnings = None


def log_held(warnings: Sequence[str]) -> None:
    """Log the warnings `warnings_held` kept, as they would have been."""
    for warning in warnings:
        log.warning("%s", warning)


T = TypeVar("T")

# NVML field id for instantaneous board power and its scope (nvml.h).
FI_DEV_POWER_INSTANT = 186
POWER_SCOPE_GPU = 0


def resolve_deadline_s(deadline_s: float | None) -> float | None:
    """None: the default deadline ($DVFS_NVML_DEADLINE_S, else 10 s); 0: no deadline."""
    if deadline_s is None:
        return default_deadline_s()
    return float(deadline_s) or None


def _bounded(
    worker: CallWorker, deadline_s: float | None, where: str, fn: Callable[..., T], *args: Any
) -> T:
    """`fn(*args)` through `worker` within the deadline; an overrun names the call and `where`."""
    try:
        return worker.call(fn, args, deadline_s)
    except DeadlineExceeded as exc:
        raise GpuTimeoutError(exc.describe(where)) from exc


def load_pynvml() -> ModuleType:
    """Import nvidia-ml-py's module, or explain how to get it."""
    try:
        import pynvml
    except ImportError as exc:
        raise GpuUnavailableError(
            "the nvml backend needs nvidia-ml-py: pip install nvidia-ml-py "
            "(not the deprecated 'pynvml' package)"
        ) from exc
    return pynvml


class NvmlGpu:
    """One GPU through NVML. NVML must be initialised (see `open_nvml_gpus`)."""

    def __init__(
        self,
        nvml: ModuleType,
        handle: Any,
        index: int,
        *,
        deadline_s: float | None = None,
        worker: CallWorker | None = None,
    ) -> None:
        self.nvml = nvml
        self.handle = handle
        self.index = index
        self.errors = NvmlErrors(nvml)
        #: Seconds each NVML call may take (None: unbounded); see `resolve_deadline_s`.
        self.deadline_s = resolve_deadline_s(deadline_s)
        self._worker = worker or CallWorker(f"gpu{index}")
        self._where = f"GPU {index}"
        uuid = self._call(nvml.nvmlDeviceGetUUID, "read the GPU UUID")
        name = self._call(nvml.nvmlDeviceGetName, "read the GPU name")
        driver = self._call_plain(nvml.nvmlSystemGetDriverVersion, "read the driver version")
        memory_clocks = self._memory_clocks()
        self._sm_clocks = self._graphics_clocks(memory_clocks[0])
        self._identity = GpuIdentity(
            index=index,
            uuid=_text(uuid),
            name=_text(name),
            driver_version=_text(driver),
            backend="nvml",
            memory_clock_mhz=memory_clocks[0],
            max_sm_clock_mhz=max(self._sm_clocks),
            ecc_mode=self._ecc_mode(),
            vbios_version=self._vbios_version(),
        )
        self._where = f"GPU {index} ({self._identity.uuid})"

    # -- plumbing -----------------------------------------------------------------------------
    def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return _bounded(self._worker, self.deadline_s, self._where, fn, *args)

    def _call(
        self,
        fn: Callable[..., T],
        what: str,
        *args: Any,
        hint: str = "",
        unsupported_hint: str = "",
        invalid_hint: str = "",
    ) -> T:
        with self.errors.translated(
            f"GPU {self.index}: cannot {what}", hint, unsupported_hint, invalid_hint
        ):
            return self._run(fn, self.handle, *args)

    def _call_plain(self, fn: Callable[..., T], what: str) -> T:
        with self.errors.translated(f"cannot {what}"):
            return self._run(fn)

    def _with_fallback(self, current: str, old: str, what: str, *args: Any) -> Any:
        """Call `current`, or `old` on drivers that predate it (FunctionNotFound)."""
        fn = getattr(self.nvml, current, None)
        if fn is not None:
            try:
                return self._call(fn, what, *args)
            except GpuNotSupportedError as exc:
                if getattr(exc.__cause__, "value", None) != self.errors.function_not_found:
                    raise
        return self._call(getattr(self.nvml, old), what, *args)

    def _ecc_mode(self) -> str:
        """The ECC mode in force ("on", "off", "unsupported"); "" where NVML cannot say (an
        older nvidia-ml-py, a VM's restricted passthrough, `_unread`): not known, so not
        compared."""
        fn = getattr(self.nvml, "nvmlDeviceGetEccMode", None)
        if fn is None:
            return ""
        try:
            current, _pending = self._call(fn, "read the ECC mode")
        except GpuNotSupportedError as exc:
            found = getattr(exc.__cause__, "value", None) != self.errors.function_not_found
            return "unsupported" if found else ""
        except GpuError as exc:
            return self._unread(exc)
        return "on" if int(current) else "off"

    def _vbios_version(self) -> str:
        """The VBIOS version; "" where NVML cannot say (`_unread`)."""
        fn = getattr(self.nvml, "nvmlDeviceGetVbiosVersion", None)
        if fn is None:
            return ""
        try:
            return _text(self._call(fn, "read the VBIOS version")).strip()
        except GpuNotSupportedError:
            return ""
        except GpuError as exc:
            return self._unread(exc)

    def _unread(self, exc: GpuError) -> str:
        """Not known ("") for an ECC mode or VBIOS NVML would not give: permission refused, or
        an error of that read alone (Unknown Error, a buffer too small), logged. Part of the
        GPU's identity only for a resume to compare, so no reason to refuse the GPU: `dvfs gpu
        reset` must still open it to restore its knobs. A GPU fallen off the bus, a hung
        call or NVML's own error (`machine_wide`) raise, as any other call then would."""
        cause = exc.__cause__
        own = (
            type(exc) is GpuError
            and cause is not None
            and self.errors.is_nvml_error(cause)
            and not self.errors.machine_wide(cause)
        )
        if not (own or isinstance(exc, GpuPermissionError)):
            raise exc
        held: list[str] | None = getattr(_held, "warnings", None)
        if held is None:
            log.warning("%s; taken as not known", exc)
        else:
            held.append(f"{exc}; taken as not known")
        return ""

    def _memory_clocks(self) -> list[int]:
        clocks = self._call(self.nvml.nvmlDeviceGetSupportedMemoryClocks, "list memory clocks")
        return sorted((int(c) for c in clocks), reverse=True)

    def _graphics_clocks(self, memory_mhz: int) -> tuple[int, ...]:
        clocks = self._call(
            self.nvml.nvmlDeviceGetSupportedGraphicsClocks, "list supported SM clocks", memory_mhz
        )
        return tuple(sorted((int(c) for c in clocks), reverse=True))

    # -- Gpu protocol -------------------------------------------------------------------------
    @property
    def identity(self) -> GpuIdentity:
        return self._identity

    def supported_sm_clocks_mhz(self) -> tuple[int, ...]:
        return self._sm_clocks

    def power_limit_range(self) -> PowerLimitRange:
        lo, hi = self._call(
            self.nvml.nvmlDeviceGetPowerManagementLimitConstraints, "read the power-limit range"
        )
        default = self._call(
            self.nvml.nvmlDeviceGetPowerManagementDefaultLimit, "read the default power limit"
        )
        return PowerLimitRange(int(lo), int(hi), int(default))

    def power_limit_mw(self) -> int:
        return int(self._call(self.nvml.nvmlDeviceGetPowerManagementLimit, "read the power limit"))

    def enforced_power_limit_mw(self) -> int:
        return int(
            self._call(self.nvml.nvmlDeviceGetEnforcedPowerLimit, "read the enforced power limit")
        )

    def lock_sm_clock(self, min_mhz: int, max_mhz: int) -> None:
        for mhz in (min_mhz, max_mhz):
            problem = unsupported_clock(mhz, self._sm_clocks)
            if problem:
                raise GpuValueError(f"GPU {self.index}: {problem}")
        if min_mhz > max_mhz:
            raise GpuValueError(
                f"GPU {self.index}: clock range {min_mhz}-{max_mhz} MHz is reversed"
            )
        self._call(
            self.nvml.nvmlDeviceSetGpuLockedClocks, "lock SM clocks", int(min_mhz), int(max_mhz)
        )

    def reset_sm_clock(self) -> None:
        self._call(self.nvml.nvmlDeviceResetGpuLockedClocks, "reset locked SM clocks")

    def set_power_limit_mw(self, limit_mw: int) -> None:
        allowed = self.power_limit_range()
        problem = allowed.outside(limit_mw)
        if problem:
            raise GpuValueError(f"GPU {self.index}: {problem}")
        # v1 on purpose: pynvml's _v2 wrapper discards NVML's return code.
        self._call(
            self.nvml.nvmlDeviceSetPowerManagementLimit,
            "set the power limit",
            int(limit_mw),
            invalid_hint=f"allowed {allowed.describe_w()}",
            unsupported_hint="this GPU or its driver does not let its power limit be set",
        )

    def energy_mj(self) -> int:
        return int(
            self._call(
                self.nvml.nvmlDeviceGetTotalEnergyConsumption,
                "read the energy counter",
                unsupported_hint="the energy counter needs a Volta or newer GPU",
            )
        )

    def power_mw(self) -> int:
        """Instant power (field 186); falls back to the averaged power reading."""
        try:
            values = self._call(
                self.nvml.nvmlDeviceGetFieldValues,
                "read instant power",
                [(FI_DEV_POWER_INSTANT, POWER_SCOPE_GPU)],
            )
            entry = values[0]
            if entry.nvmlReturn == 0:
                return int(entry.value.uiVal)
        except GpuNotSupportedError:
            pass
        return int(self._call(self.nvml.nvmlDeviceGetPowerUsage, "read power"))

    def sm_clock_mhz(self) -> int:
        return int(
            self._call(
                self.nvml.nvmlDeviceGetClockInfo, "read the SM clock", self.nvml.NVML_CLOCK_SM
            )
        )

    def temperature_c(self) -> int:
        return int(
            self._with_fallback(
                "nvmlDeviceGetTemperatureV",
                "nvmlDeviceGetTemperature",
                "read the temperature",
                self.nvml.NVML_TEMPERATURE_GPU,
            )
        )

    def clock_event_reasons(self) -> int:
        return int(
            self._with_fallback(
                "nvmlDeviceGetCurrentClocksEventReasons",
                "nvmlDeviceGetCurrentClocksThrottleReasons",
                "read clock-event reasons",
            )
        )

    def throttle_violation_ns(self) -> tuple[int | None, ...]:
        """`nvmlDeviceGetViolationStatus`'s violationTime (ns) of each `THROTTLE_POLICIES`
        policy, in that order, each apart (not summed: the policies may count the same
        throttle, `throttle_violation_delta`); None for a policy the GPU or driver does not
        report (NotSupported, or FunctionNotFound or Deprecated: the call is deprecated in
        favour of field values, and a pynvml without it is the same)."""
        fn = getattr(self.nvml, "nvmlDeviceGetViolationStatus", None)
        if fn is None:
            return (None,) * len(THROTTLE_POLICIES)
        reads: list[int | None] = []
        for policy in THROTTLE_POLICIES:
            try:
                status = self._call(fn, "read the throttle violation time", policy)
            except GpuNotSupportedError:
                reads.append(None)
                continue
            except GpuError as exc:
                if getattr(exc.__cause__, "value", None) != self.errors.deprecated:
                    raise
                reads.append(None)
                continue
            reads.append(int(status.violationTime))
        return tuple(reads)

    # -- inspection ---------------------------------------------------------------------------
    def mig_enabled(self) -> bool:
        try:
            current, _pending = self._call(self.nvml.nvmlDeviceGetMigMode, "read the MIG mode")
        except GpuNotSupportedError:
            return False
        return int(current) == 1

    def compute_pids(self) -> frozenset[int] | None:
        """PIDs NVML lists as compute processes on this GPU (read-only; host PID namespace);
        None when the driver cannot tell (NotSupported, NoPermission)."""
        try:
            procs = self._call(process_lister(self.nvml), "list compute processes")
        except (GpuNotSupportedError, GpuPermissionError):
            return None
        return frozenset(int(p.pid) for p in procs)

    def persistence_mode(self) -> bool | None:
        try:
            return bool(self._call(self.nvml.nvmlDeviceGetPersistenceMode, "read persistence mode"))
        except GpuNotSupportedError:
            return None

    def info(self) -> DeviceInfo:
        """A read-only snapshot for `dvfs gpu info`; unsupported readings become None."""

        def maybe(fn: Callable[[], T]) -> T | None:
            try:
                return fn()
            except GpuNotSupportedError:
                return None

        energy_ok = maybe(self.energy_mj) is not None
        configured = maybe(self.power_limit_mw)  # None: not supported, nor then its range
        memory = maybe(lambda: self._call(self.nvml.nvmlDeviceGetMemoryInfo, "read memory"))
        arch = maybe(
            lambda: int(self._call(self.nvml.nvmlDeviceGetArchitecture, "read the architecture"))
        )
        return DeviceInfo(
            identity=self.identity,
            architecture=arch,
            supported_sm_clocks_mhz=self._sm_clocks,
            supported_memory_clocks_mhz=tuple(self._memory_clocks()),
            power_limits=None if configured is None else self.power_limit_range(),
            power_limit_mw=configured,
            enforced_power_limit_mw=self.enforced_power_limit_mw(),
            persistence_mode=self.persistence_mode(),
            energy_counter=energy_ok,
            sm_clock_mhz=self.sm_clock_mhz(),
            power_mw=maybe(self.power_mw),
            temperature_c=maybe(self.temperature_c),
            event_reasons=maybe(self.clock_event_reasons),
            mig=self.mig_enabled(),
            memory_total_bytes=int(memory.total) if memory is not None else None,
        )


def process_lister(nvml: ModuleType) -> Callable[[Any], Any]:
    """`nvmlDeviceGetComputeRunningProcesses(handle)` as every driver answers it. nvidia-ml-py's
    wrapper of that name calls NVML's `_v3` and, on a driver without `_v3`, raises
    `NVMLLibraryMismatchError`, a plain Exception and no `NVMLError`, which no translation
    catches: then the `_v2` call is asked instead, and a driver without that either is
    FunctionNotFound (not supported: the processes are unknown)."""
    mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)

    def listed(handle: Any) -> Any:
        try:
            return nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception as exc:
            if mismatch is None or not isinstance(exc, mismatch):
                raise
        older = getattr(nvml, "nvmlDeviceGetComputeRunningProcesses_v2", None)
        if older is None:
            raise nvml.NVMLError(int(getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)))
        return older(handle)

    listed.__name__ = "nvmlDeviceGetComputeRunningProcesses"  # what a deadline's error names
    return listed


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@contextlib.contextmanager
def nvml_session(
    nvml: ModuleType | None = None, *, deadline_s: float | None = None
) -> Iterator[ModuleType]:
    """NVML initialised for the block, shut down after (never in a destructor)."""
    module = nvml or load_pynvml()
    errors = NvmlErrors(module)
    limit = resolve_deadline_s(deadline_s)
    worker = CallWorker("nvml")
    try:
        with errors.translated("cannot initialise NVML"):
            _bounded(worker, limit, "this machine", module.nvmlInit)
    except BaseException:
        worker.close()
        raise
    try:
        yield module
    finally:
        try:
            _bounded(worker, limit, "this machine", module.nvmlShutdown)
        except Exception as exc:  # a failed shutdown must not mask the real outcome
            log.warning("nvmlShutdown failed: %s", exc)
        worker.close()


#: How often `wait_for_driver` tries NVML again while the NVIDIA kernel module is not loaded.
DRIVER_POLL_S = 5.0
#: A wait no boot outlasts (about 31,700 years): longer ones are waited as this long.
_FOREVER_S = 1e12


def wait_span(wait_s: float) -> str:
    """How long `wait_for_driver` waits, in words: "up to 300 s", or, past `_FOREVER_S` (an
    "until it loads" of any number of digits), not all those digits."""
    if wait_s > _FOREVER_S:
        return "with no time limit"
    return f"up to {wait_s} s"


def wait_for_driver(
    wait_s: float,
    waiting: Callable[[], None],
    nvml: ModuleType | None = None,
    *,
    dry_run: bool = False,
) -> GpuError | None:
    """Return once NVML starts, or at once where it fails for any reason but the NVIDIA kernel
    module not being loaded yet (no driver, a refusal: waiting does not fix those); while it is
    not loaded (at boot: a DKMS build after a kernel update), NVML is tried again every
    `DRIVER_POLL_S`, `waiting` hearing it once, for at most `wait_s` seconds. It never raises:
    the command then starts NVML as it would without waiting, and says any failure itself;
    where the wait ran out, the module still not loaded, it returns that failure in the line
    to raise instead, which says how long it waited. A `dry_run` waits for nothing: NVML is
    tried once, and a module not loaded is returned at once in a line saying what the apply
    would wait for."""
    if wait_s <= 0:
        return None
    # an int past a float's range (OverflowError) is a wait for ever, as any this long
    deadline = time.monotonic() + min(wait_s, _FOREVER_S)
    told = False
    try:
        module = nvml or load_pynvml()
    except GpuError:  # no NVML at all: no driver to wait for
        return None
    not_loaded = NvmlErrors(module).driver_not_loaded
    while True:
        try:
            with nvml_session(module):
                return None
        except GpuError as exc:
            if getattr(exc.__cause__, "value", None) != not_loaded:
                return None
            last = exc
        if dry_run:  # changes nothing, so waits for nothing: says what the apply would
            line = str(last).replace(
                " not loaded:",
                f" not loaded (a dry run does not wait; the apply would wait {wait_span(wait_s)} "
                "for it):",
                1,
            )
            told_so = type(last)(line)
            told_so.__cause__ = last.__cause__
            return told_so
        left = deadline - time.monotonic()
        if left <= 0:  # "not loaded: load it" said with the wait, not as if none was made
            line = str(last).replace(" not loaded:", f" not loaded after waiting {wait_s} s:", 1)
            spent = type(last)(line)
            spent.__cause__ = last.__cause__
            return spent
        if not told:
            waiting()
            told = True
        _sleep(min(DRIVER_POLL_S, left))


def _sleep(seconds: float) -> None:
    """`time.sleep`, apart so that a test can play the driver loading meanwhile."""
    time.sleep(seconds)


def device_count(nvml: ModuleType, *, deadline_s: float | None = None) -> int:
    errors = NvmlErrors(nvml)
    worker = CallWorker("nvml")
    try:
        with errors.translated("cannot count GPUs"):
            return int(
                _bounded(
                    worker, resolve_deadline_s(deadline_s), "this machine", nvml.nvmlDeviceGetCount
                )
            )
    finally:
        worker.close()


def gpu_processes(nvml: ModuleType, *, deadline_s: float | None = None) -> list[GpuProcesses]:
    """Every GPU NVML sees (not only the campaign's) with the compute PIDs on it: where a server
    really runs. Read-only, each call within the deadline; a GPU whose processes NVML cannot
    list (NotSupported, NoPermission, an NVML error on it, a call on it that overran its
    deadline) has `pids` None and says why. Each GPU's used and total memory too, and each
    listed process's own (usedGpuMemory, where NVML gives it): where a server NVML names by
    PIDs dvfs cannot see took its memory. Each GPU is read on its own NVML worker, side by side
    (`dvfs.gpu.knobs.side_by_side`), as `machine_uuids`: on one worker, the GPUs after one
    whose call hung were refused at once ("not attempted"), their processes unknown though
    they answer (the server's GPU not found, a tenant check with nothing to go on)."""
    from dvfs.gpu.knobs import side_by_side

    errors = NvmlErrors(nvml)
    limit = resolve_deadline_s(deadline_s)

    def read(index: int) -> GpuProcesses:
        worker = CallWorker(f"processes-gpu{index}")
        try:
            return _read_processes(nvml, errors, worker, limit, index)
        finally:
            worker.close()

    worker = CallWorker("nvml-processes")
    try:
        with errors.translated("cannot count GPUs"):
            count = int(_bounded(worker, limit, "this machine", nvml.nvmlDeviceGetCount))
    finally:
        worker.close()
    found: list[GpuProcesses | None] = [None] * count
    reading = side_by_side(list(range(count)), read, named=lambda i: f"processes-gpu{i}")
    with contextlib.closing(reading) as finishing:
        for index, listed in finishing:
            found[index] = listed
    return [listed for listed in found if listed is not None]


def _read_processes(
    nvml: ModuleType, errors: NvmlErrors, worker: CallWorker, limit: float | None, index: int
) -> GpuProcesses:
    """GPU `index`'s compute processes and memory (`gpu_processes`), on `worker`."""
    where, uuid, handle = f"GPU {index}", UNREAD_UUID, None
    pids: frozenset[int] | None = None
    why, own = "", {}
    try:
        with errors.translated(f"GPU {index}: cannot list compute processes"):
            handle = _bounded(worker, limit, where, nvml.nvmlDeviceGetHandleByIndex, index)
            uuid = _text(_bounded(worker, limit, where, nvml.nvmlDeviceGetUUID, handle))
            procs = _bounded(worker, limit, where, process_lister(nvml), handle)
    except GpuError as exc:
        why = str(exc)
    else:
        pids = frozenset(int(p.pid) for p in procs)
        own = {
            int(p.pid): int(used)
            for p in procs
            if isinstance(used := getattr(p, "usedGpuMemory", None), int)
        }
    used = total = None
    memory_why = "no handle"
    if handle is not None:
        try:
            with errors.translated(f"GPU {index}: cannot read its memory"):
                memory = _bounded(worker, limit, where, nvml.nvmlDeviceGetMemoryInfo, handle)
                used, total = int(memory.used), int(memory.total)
                memory_why = ""
        except GpuError as exc:
            memory_why = str(exc)
    return GpuProcesses(index, uuid, pids, why, used, total, memory_why, process_bytes=own)


def processes_probe(
    gpus: Sequence[object],
) -> Callable[[], list[GpuProcesses]] | None:
    """What lists the compute processes of every GPU on the machine, through the NVML module
    the campaign's GPUs were opened with (None when they are not NVML GPUs)."""
    first = next((g for g in gpus if isinstance(g, NvmlGpu)), None)
    if first is None:
        return None
    module, deadline = first.nvml, first.deadline_s or 0
    return lambda: gpu_processes(module, deadline_s=deadline)


def open_device(
    nvml: ModuleType,
    device: int | str,
    *,
    allow_mig: bool = False,
    deadline_s: float | None = None,
) -> NvmlGpu:
    """A GPU by index or UUID; MIG-enabled GPUs are refused (energy is not per slice).

    `deadline_s` bounds every NVML call on it (None: $DVFS_NVML_DEADLINE_S or 10 s; 0: none).
    """
    if isinstance(device, str):
        device = canonical_uuid(device)  # NVML finds no GPU by an upper-cased UUID
    errors = NvmlErrors(nvml)
    limit = resolve_deadline_s(deadline_s)
    worker = CallWorker(f"gpu{device}")
    where = f"GPU {device}" if isinstance(device, int) else str(device)
    try:
        if isinstance(device, int):
            handle = _bounded(worker, limit, where, nvml.nvmlDeviceGetHandleByIndex, device)
            index = device
        else:
            handle = _bounded(worker, limit, where, nvml.nvmlDeviceGetHandleByUUID, device)
            index = int(_bounded(worker, limit, where, nvml.nvmlDeviceGetIndex, handle))
    except Exception as exc:
        if not errors.is_nvml_error(exc):
            raise
        absent = {
            int(getattr(nvml, "NVML_ERROR_INVALID_ARGUMENT", 2)),
            int(getattr(nvml, "NVML_ERROR_NOT_FOUND", 6)),
        }
        if getattr(exc, "value", None) == int(getattr(nvml, "NVML_ERROR_NO_PERMISSION", 4)):
            # nvml.h: "the user doesn't have permission to talk to this device". Not the
            # setters' hint (systemd unit, --observe-only): no command can read it either.
            raise GpuPermissionError(
                f"cannot open {where}: the driver does not let this process talk to it "
                f"(NVML: {exc}), not even to read it: run dvfs as a user the GPU admits (root, "
                "with sudo), or name a GPU this process may use"
            ) from exc
        if getattr(exc, "value", None) not in absent:  # there, but unusable: lost, no power...
            raise errors.translate(exc, f"cannot open {where}") from exc
        count = device_count(nvml, deadline_s=deadline_s)
        if not count:  # not "0 GPU(s) (indices 0--1)"
            raise GpuNotFoundError(
                f"no GPU {device!r}: NVML sees no GPU on this machine (the driver is loaded: "
                "`nvidia-smi` says which GPUs it finds)"
            ) from exc
        raise GpuNotFoundError(
            f"no GPU {device!r}: this machine has {count} GPU(s) "
            f"(indices 0-{count - 1}); `dvfs gpu list` shows them"
        ) from exc
    gpu = NvmlGpu(nvml, handle, index, deadline_s=limit or 0, worker=worker)
    if not allow_mig and gpu.mig_enabled():
        raise GpuMigError(
            f"GPU {index} ({gpu.identity.uuid}) has MIG enabled: NVML measures energy and power "
            "per GPU, not per MIG slice, so dvfs refuses it; disable MIG "
            f"({mig_off_advice([index])}) or "
            "choose another GPU"
        )
    return gpu


def machine_uuids(nvml: ModuleType, *, deadline_s: float | None = None) -> list[str]:
    """The UUID of every GPU NVML sees, by NVML index (what CUDA_VISIBLE_DEVICES is read
    against); "" for a GPU whose UUID NVML cannot read: fallen off the bus, needing a reset,
    any NVML error on that GPU, a call on it that overran its deadline (an index entry names
    it, and a UUID entry no other GPU matches where it is the only one: `dvfs.gpu.visible`;
    opening it then names its error). One such GPU must not refuse every command on the
    others; an error of NVML itself (not initialised, no driver) still stops. Each GPU is read
    on its own NVML worker, side by side (`dvfs.gpu.knobs.side_by_side`): on one worker, the
    GPUs after one whose call hung were refused at once ("not attempted"), and that refusal
    stopped the whole listing; one after another, GPUs whose driver hangs whole would cost a
    deadline each."""
    errors = NvmlErrors(nvml)
    limit = resolve_deadline_s(deadline_s)
    worker = CallWorker("nvml-uuids")
    try:
        with errors.translated("cannot list GPUs"):
            count = int(_bounded(worker, limit, "this machine", nvml.nvmlDeviceGetCount))
            return uuids_of(nvml, range(count), deadline_s=deadline_s)
    finally:
        worker.close()


def uuids_of(
    nvml: ModuleType, indices: Sequence[int], *, deadline_s: float | None = None
) -> list[str]:
    """The UUIDs of the GPUs `indices` names, in their order, each read on its own NVML worker,
    side by side (`machine_uuids`); "" for a GPU whose UUID NVML cannot read (that GPU's own
    error, a call on it that overran its deadline). An error of NVML itself still stops."""
    from dvfs.gpu.knobs import side_by_side

    errors = NvmlErrors(nvml)
    limit = resolve_deadline_s(deadline_s)

    def read(index: int) -> str:
        """GPU `index`'s UUID, "" where it is that GPU's own error that NVML cannot say it."""
        worker = CallWorker(f"uuid-gpu{index}")
        where = f"GPU {index}"
        try:
            handle = _bounded(worker, limit, where, nvml.nvmlDeviceGetHandleByIndex, index)
            return _text(_bounded(worker, limit, where, nvml.nvmlDeviceGetUUID, handle))
        except GpuTimeoutError:
            return ""  # its driver hangs: that GPU's, as its opening then says
        except Exception as exc:
            if not errors.is_nvml_error(exc) or errors.machine_wide(exc):
                raise
            return ""
        finally:
            worker.close()

    uuids: dict[int, str] = {}
    reading = side_by_side(list(indices), read, named=lambda i: f"uuid-gpu{i}")
    with errors.translated("cannot read the GPUs' UUIDs"), contextlib.closing(reading) as finishing:
        for index, uuid in finishing:
            uuids[index] = uuid
    return [uuids[index] for index in indices]


def every_gpu(
    nvml: ModuleType,
    *,
    visible: Visible | None = None,
    deadline_s: float | None = None,
    hung: dict[int, GpuError] | None = None,
) -> list[int]:
    """What "every GPU" means to a command, as NVML indices: every GPU NVML lets this process
    talk to (`permitted`, which fills `hung`), or with `visible` every one it gives the job
    (all of them where it gives none, for `check` to refuse in one line). NVML must be
    initialised."""
    devices = list(range(device_count(nvml, deadline_s=deadline_s)))
    if visible is not None:
        uuids = machine_uuids(nvml, deadline_s=deadline_s)
        return list(resolve_visible(visible.value, uuids).indices) or devices
    return permitted(nvml, devices, deadline_s=deadline_s, hung=hung)


def permitted(
    nvml: ModuleType,
    indices: Sequence[int],
    *,
    deadline_s: float | None = None,
    hung: dict[int, GpuError] | None = None,
    known_hung: Sequence[int] = (),
) -> list[int]:
    """`indices` less the GPUs NVML has no permission to talk to. nvmlDeviceGetCount (its
    `_v2`) counts every GPU of the machine, also those for which nvmlDeviceGetHandleByIndex
    returns NO_PERMISSION (nvml.h), as it does for the GPUs a job's device cgroup withholds:
    they are no GPU of this process, as nvidia-smi leaves them out. Where NVML refuses every
    one, all are kept: a permission problem of the whole machine, which opening them says
    (exit 4). Any other error on a GPU keeps it, for its opening to name. Each GPU is asked on
    its own NVML worker, side by side (`dvfs.gpu.knobs.side_by_side`), as `machine_uuids`: on
    one worker, the GPUs after one whose call hung were "not attempted" and kept, one NVML has
    no permission to talk to among them too, whose opening then refused every command over
    every GPU (exit 4: `dvfs gpu list`, `gpu reset`, `cap reset`); one after another, GPUs
    whose driver hangs would cost a deadline each. `hung` (where given) gets the error of each
    GPU whose handle did not come within the deadline, for the command to name it as it
    names a GPU that does not open, not to ask it again: its opening, which asks for the same
    handle, cost one deadline more (`gpu list`, `gpu reset`, `cap reset` with a hung GPU).
    `known_hung`: GPUs whose calls already hung in this command, kept unasked, as one whose
    handle hangs is kept: asked again, each cost a deadline more."""
    from dvfs.gpu.knobs import side_by_side

    errors = NvmlErrors(nvml)
    refused = int(getattr(nvml, "NVML_ERROR_NO_PERMISSION", 4))
    limit = resolve_deadline_s(deadline_s)

    def allowed(index: int) -> bool:
        if index in known_hung:
            return True
        worker = CallWorker(f"permitted-gpu{index}")
        try:
            _bounded(worker, limit, f"GPU {index}", nvml.nvmlDeviceGetHandleByIndex, index)
        except Exception as exc:
            if errors.is_nvml_error(exc) and getattr(exc, "value", None) == refused:
                return False
            if not errors.is_nvml_error(exc) and not isinstance(exc, GpuTimeoutError):
                raise
            if isinstance(exc, GpuTimeoutError) and hung is not None:
                hung[index] = exc
        finally:
            worker.close()
        return True

    asked = side_by_side(list(indices), allowed, named=lambda index: f"permitted-gpu{index}")
    answers: dict[int, bool] = {}
    with contextlib.closing(asked) as finishing:
        for index, answer in finishing:
            answers[index] = answer
    kept = [index for index in indices if answers[index]]
    return kept or list(indices)


def refused_gpus(
    nvml: ModuleType, *, deadline_s: float | None = None, hung: Sequence[int] = ()
) -> list[int]:
    """The NVML indices `every_gpu` (without `visible`) leaves out: the GPUs NVML counts but
    has no permission to talk to (`permitted`), whose UUIDs it cannot read either. A command
    over every GPU that a file names by UUID (`cap apply`) must not read such a GPU's UUID as
    "not on this host"; none where NVML refuses every GPU (opening them says so, exit 4).
    `hung`: GPUs whose calls already hung in this command, not asked again (`permitted`)."""
    devices = list(range(device_count(nvml, deadline_s=deadline_s)))
    kept = set(permitted(nvml, devices, deadline_s=deadline_s, known_hung=hung))
    return [index for index in devices if index not in kept]


class GpuNamedTwiceError(CampaignError):
    """One GPU named twice among the GPUs a command opens (by index, by UUID, or both): a usage
    error, exit 2, as in a campaign. Opened twice, a command would lock it against itself ("in
    use by another dvfs process", its own pid) or read and export it twice. `twice` names it
    ("GPU 0 (as 0 and GPU-...)"), for a command that says which option named it
    (`named_twice`)."""

    twice = ""


def named_twice(option: str, twice: str) -> str:
    """The one line refusing `option` for naming a GPU twice (`GpuNamedTwiceError.twice`)."""
    return f"{option} names {twice} twice: name each GPU once, by its index or its UUID"


def named_twice_error(twice: str) -> GpuNamedTwiceError:
    """The refusal of a GPU named twice, `twice` naming it ("GPU 0 (as 0 and GPU-...)"): one
    wording whether the GPUs opened (`_refuse_named_twice`) or did not
    (`dvfs.backends.reachable_gpus`)."""
    error = GpuNamedTwiceError(
        f"{twice} is named twice: name each GPU once, by its index or its UUID"
    )
    error.twice = twice
    return error


def _refuse_named_twice(devices: Sequence[int | str], gpus: Sequence[NvmlGpu]) -> None:
    """`GpuNamedTwiceError` where two of `devices` opened as one GPU."""
    seen: dict[str, int | str] = {}
    for device, gpu in zip(devices, gpus, strict=True):
        ident = gpu.identity
        if ident.uuid in seen:
            raise named_twice_error(f"GPU {ident.index} (as {seen[ident.uuid]} and {device})")
        seen[ident.uuid] = device


@contextlib.contextmanager
def open_nvml_gpus(
    devices: Sequence[int | str] | None,
    *,
    nvml: ModuleType | None = None,
    allow_mig: bool = False,
    deadline_s: float | None = None,
    visible: Visible | None = None,
    lost: list[GpuError] | None = None,
) -> Iterator[list[NvmlGpu]]:
    """The campaign's GPUs (every GPU when `devices` is None), NVML initialised around them;
    `deadline_s` as for `open_device`. With `visible` (the process's CUDA_VISIBLE_DEVICES, for
    a command that changes or meters them), a GPU it does not give the job is refused, exit 2
    (`dvfs.gpu.visible`), and "every GPU" means every GPU it gives.

    The GPUs are opened side by side (`dvfs.gpu.knobs.side_by_side`, each on its own NVML
    worker): GPUs whose driver hangs cost one deadline in all, as when `reachable_gpus`
    probed them (a unit's stop timeout assumes so). The first GPU, in the GPUs' order, that
    does not open fails the whole; with `lost` (a command acting on the others: `gpu reset`,
    `cap reset`), the error of each GPU that does not open (one that began hanging, or fell
    off the bus, since it was probed) is added to it, its `index` or `uuid` set as named, and
    the others are yielded, in order."""
    from dvfs.gpu.knobs import side_by_side

    with nvml_session(nvml, deadline_s=deadline_s) as module:
        if devices is None:
            devices = every_gpu(module, visible=visible, deadline_s=deadline_s)

        def opening(entry: tuple[int, int | str]) -> NvmlGpu | GpuError:
            try:
                return open_device(module, entry[1], allow_mig=allow_mig, deadline_s=deadline_s)
            except GpuError as exc:
                return exc

        entries = list(enumerate(devices))
        outcomes: dict[int, NvmlGpu | GpuError] = {}
        opening_all = side_by_side(entries, opening, named=lambda entry: f"open-gpu{entry[1]}")
        with contextlib.closing(opening_all) as finishing:
            for (position, _), outcome in finishing:
                outcomes[position] = outcome
        opened: list[int | str] = []
        gpus: list[NvmlGpu] = []
        for position, device in entries:
            outcome = outcomes[position]
            if isinstance(outcome, GpuError):
                if lost is None:
                    raise outcome
                outcome.index = device if isinstance(device, int) else outcome.index
                outcome.uuid = device if isinstance(device, str) else outcome.uuid
                lost.append(outcome)
                continue
            opened.append(device)
            gpus.append(outcome)
        _refuse_named_twice(opened, gpus)
        if visible is not None:
            check_visible(
                [(g.identity.index, g.identity.uuid) for g in gpus],
                visible,
                machine_uuids(module, deadline_s=deadline_s),
            )
        yield gpus
