"""Production caps: from a headroom decision to per-GPU clock locks and power limits.

Three jobs, three modules: `files` reads and writes the caps file (TOML), `planning` turns a
`dvfs headroom --json` document into one (pure), and `actuation` puts it on this host's GPUs
under the sweep's safety layer and records what it applied. Everything is re-exported here,
so `from dvfs.caps import ...` names the whole surface.
"""

from __future__ import annotations

from dvfs.caps.actuation import (
    APPLIED_NAME,
    AppliedCaps,
    CapAction,
    CapsPartlyAppliedError,
    CapsPlan,
    GovernorLocks,
    LockInForce,
    apply_actions,
    caps_status,
    describe_host,
    enforce_plan,
    locks_in_force,
    plan_actions,
    reset_caps,
    reset_gpus,
    reset_locked,
)
from dvfs.caps.files import (
    CAPS_SCHEMA,
    TWIN_SUFFIX,
    CapsFile,
    GpuCap,
    base_model_name,
    dump_caps,
    is_twin_name,
    load_caps,
    parse_caps,
)
from dvfs.caps.planning import load_headroom, plan_caps

__all__ = [
    "APPLIED_NAME",
    "CAPS_SCHEMA",
    "TWIN_SUFFIX",
    "AppliedCaps",
    "CapAction",
    "CapsFile",
    "CapsPartlyAppliedError",
    "CapsPlan",
    "GovernorLocks",
    "GpuCap",
    "LockInForce",
    "apply_actions",
    "base_model_name",
    "caps_status",
    "describe_host",
    "dump_caps",
    "enforce_plan",
    "is_twin_name",
    "load_caps",
    "load_headroom",
    "locks_in_force",
    "parse_caps",
    "plan_actions",
    "plan_caps",
    "reset_caps",
    "reset_gpus",
    "reset_locked",
]
