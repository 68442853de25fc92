"""NVML's return codes mapped to dvfs's error tree, through one table, with the hints a user needs.

Apart from `dvfs.gpu.nvml` so the mapping is read (and tested) in one place, whatever NVML call
raised: a missing driver, a lost GPU and a permission refusal each get a message that says what
to do next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from dvfs.errors import (
    GpuError,
    GpuNotSupportedError,
    GpuPermissionError,
    GpuUnavailableError,
    GpuValueError,
)

TWIN_HINT = (
    'run on the digital twin (gpu.backend = "twin" in a campaign; `--twin h100-sxm` for '
    "`dvfs gpu list`, `info`, `settle` and `roofline`)"
)
NO_DRIVER_HINT = (
    "no NVIDIA driver was found (NVML is missing): install the NVIDIA driver on a GPU machine, "
    f"or {TWIN_HINT}"
)
# DriverNotLoaded: NVML's library is there but the kernel module is not (a driver updated
# without a reboot, a module that failed to load): installing the driver is not the fix.
NOT_LOADED_HINT = (
    "the NVIDIA driver is installed but its kernel module is not loaded: load it (sudo modprobe "
    "nvidia, or reboot after a driver update; dmesg says why it failed), "
    f"or {TWIN_HINT}"
)
ROOT_HINT = (
    "run as root (sudo), or apply caps through the systemd unit (systemd/dvfs-caps.service); "
    "to sweep without changing clocks or power limits, use `dvfs sweep --observe-only`"
)


class NvmlErrors:
    """Maps an `NVMLError` to dvfs's error tree through one table of NVML return codes."""

    def __init__(self, nvml: ModuleType) -> None:
        self.nvml = nvml

        def code(name: str, default: int) -> int:
            return int(getattr(nvml, name, default))

        self.table: dict[int, type[GpuError]] = {
            code("NVML_ERROR_LIBRARY_NOT_FOUND", 12): GpuUnavailableError,
            code("NVML_ERROR_DRIVER_NOT_LOADED", 9): GpuUnavailableError,
            code("NVML_ERROR_NOT_FOUND", 6): GpuUnavailableError,
            code("NVML_ERROR_GPU_IS_LOST", 15): GpuUnavailableError,
            code("NVML_ERROR_NO_PERMISSION", 4): GpuPermissionError,
            code("NVML_ERROR_NOT_SUPPORTED", 3): GpuNotSupportedError,
            code("NVML_ERROR_FUNCTION_NOT_FOUND", 13): GpuNotSupportedError,
            code("NVML_ERROR_INVALID_ARGUMENT", 2): GpuValueError,
        }
        self.function_not_found = code("NVML_ERROR_FUNCTION_NOT_FOUND", 13)
        #: "The requested functionality has been deprecated" (nvml.h): a driver's answer to a
        #: call it no longer serves, which a deprecated call dvfs reads only where it can
        #: (`NvmlGpu.throttle_violation_ns`) takes for unknown.
        self.deprecated = code("NVML_ERROR_DEPRECATED", 26)
        self.library_not_found = {code("NVML_ERROR_LIBRARY_NOT_FOUND", 12)}
        self.driver_not_loaded = code("NVML_ERROR_DRIVER_NOT_LOADED", 9)
        self.lost = code("NVML_ERROR_GPU_IS_LOST", 15)
        #: Errors of NVML itself, not of one GPU: every GPU's call would fail alike.
        self.whole = {
            code("NVML_ERROR_UNINITIALIZED", 1),
            code("NVML_ERROR_DRIVER_NOT_LOADED", 9),
            code("NVML_ERROR_LIBRARY_NOT_FOUND", 12),
            code("NVML_ERROR_LIB_RM_VERSION_MISMATCH", 18),
        }

    def is_nvml_error(self, exc: BaseException) -> bool:
        return isinstance(exc, self.nvml.NVMLError)

    def machine_wide(self, exc: BaseException) -> bool:
        """Whether an NVML error is NVML's own (not initialised, no driver), not one GPU's."""
        return getattr(exc, "value", None) in self.whole

    @contextlib.contextmanager
    def translated(
        self, what: str, hint: str = "", unsupported_hint: str = "", invalid_hint: str = ""
    ) -> Iterator[None]:
        """NVML errors raised in the block become dvfs's (`raise ... from`); others pass."""
        try:
            yield
        except Exception as exc:
            if self.is_nvml_error(exc):
                raise self.translate(exc, what, hint, unsupported_hint, invalid_hint) from exc
            raise

    def translate(
        self,
        exc: Any,
        what: str,
        hint: str = "",
        unsupported_hint: str = "",
        invalid_hint: str = "",
    ) -> GpuError:
        """`hint` follows any error's message; `unsupported_hint` only NotSupported's (a
        generation's limit must not be blamed for an Unknown Error on a GPU that has it), and
        `invalid_hint` only an invalid argument's (the allowed range is no answer to "not
        supported")."""
        value = getattr(exc, "value", None)
        cls = self.table.get(value, GpuError) if isinstance(value, int) else GpuError
        if cls is GpuNotSupportedError and unsupported_hint:
            hint = f"{hint}; {unsupported_hint}" if hint else unsupported_hint
        if cls is GpuValueError and invalid_hint:
            hint = f"{hint}; {invalid_hint}" if hint else invalid_hint
        if value in self.library_not_found:
            return cls(f"{what}: {NO_DRIVER_HINT}")
        if value == self.driver_not_loaded:
            return cls(f"{what}: {NOT_LOADED_HINT}")
        if value == self.lost:
            return cls(
                f"{what}: the GPU has fallen off the bus (NVML: {exc}); it needs a reset "
                "or a reboot before it can be used"
            )
        if cls is GpuPermissionError:
            return cls(f"{what}: permission denied by the driver: {ROOT_HINT}")
        detail = f"{what}: NVML says {exc}"
        return cls(f"{detail}; {hint}" if hint else detail)
