"""Put this folder first on PYTHONPATH to make every NVML setter refuse (NoPermission) and log
its call to $DVFS_GUARD_LOG: dvfs's read-only paths checked on a shared GPU, where a setter
reached by mistake must change nothing (tests/bench/real_gpu_check.sh)."""

import os
import re

try:
    import pynvml as _nv
except Exception:  # noqa: BLE001 - no nvidia-ml-py: nothing to guard
    _nv = None

_WRITES = re.compile(
    r"^nvml\w*?(Set|Reset|Clear|Create|Destroy|Modify|Remove|Freeze|Register|Enable|Disable)"
)
_READS = {"nvmlEventSetCreate", "nvmlEventSetFree", "nvmlEventSetWait", "nvmlEventSetWait_v2"}


def _refusing(name, fn):
    def refuse(*args, **kwargs):
        with open(os.environ.get("DVFS_GUARD_LOG", "/tmp/setter-guard.log"), "a") as log:
            log.write(f"{os.getpid()} {name} {args[1:]!r} {kwargs!r}\n")
        raise _nv.NVMLError(_nv.NVML_ERROR_NO_PERMISSION)

    refuse.__name__ = name
    refuse.__wrapped__ = fn
    return refuse


if _nv is not None:
    _guarded = 0
    for _name in dir(_nv):
        if _WRITES.match(_name) and _name not in _READS and callable(getattr(_nv, _name)):
            setattr(_nv, _name, _refusing(_name, getattr(_nv, _name)))
            _guarded += 1
    _nv.DVFS_SETTERS_GUARDED = _guarded
