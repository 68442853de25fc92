"""Production caps: from a headroom decision to per-GPU clock locks and power limits.

A caps file (TOML) names GPUs by UUID (or, for a fleet, by model name) with an SM-clock cap
and/or a power limit. `plan_caps` writes one from `dvfs headroom --json`; `apply_caps` puts it
on the GPUs and records what it applied in the state directory, because NVML cannot read a
clock lock back: the record is how `cap show` and a later sweep know a lock is in place.

Caps planned from a digital-twin cube are marked simulated (`[meta] simulated = true`) and
name the twin's GPU model, never its made-up UUID; `cap apply` refuses them unless asked
explicitly (`allow_simulated`), and then matches them by model name.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dvfs.errors import CapsError, GpuError
from dvfs.gpu.base import Gpu, unsupported_clock
from dvfs.gpu.knobs import GatheredFailures

CAPS_SCHEMA = 1
APPLIED_NAME = "caps-applied.json"
#: How the twin's GPUs name themselves: the NVML model name with this suffix.
TWIN_SUFFIX = " (twin)"


class CapsPartlyAppliedError(CapsError):
    """Caps were applied to the GPUs the file matches; entries for others matched nothing."""

    exit_code = 5


@dataclass(frozen=True)
class GpuCap:
    """Caps for one GPU (uuid) or every GPU of a model (name); None leaves a knob at stock."""

    uuid: str | None = None
    name: str | None = None
    sm_clock_max_mhz: int | None = None
    sm_clock_min_mhz: int | None = None
    power_limit_w: float | None = None

    def __post_init__(self) -> None:
        if (self.uuid is None) == (self.name is None):
            raise CapsError("each cap names exactly one of uuid (one GPU) or name (a GPU model)")
        if self.sm_clock_max_mhz is None and self.power_limit_w is None:
            raise CapsError(
                f"cap for {self.uuid or self.name} sets neither a clock nor a power limit"
            )
        if self.sm_clock_min_mhz is not None and self.sm_clock_max_mhz is None:
            raise CapsError(
                f"cap for {self.uuid or self.name}: sm_clock_min_mhz needs sm_clock_max_mhz"
            )
        if (
            self.sm_clock_min_mhz is not None
            and self.sm_clock_max_mhz is not None
            and self.sm_clock_min_mhz > self.sm_clock_max_mhz
        ):
            raise CapsError(
                f"cap for {self.uuid or self.name}: sm_clock_min_mhz is above sm_clock_max_mhz"
            )


@dataclass(frozen=True)
class CapsFile:
    caps: tuple[GpuCap, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def simulated(self) -> bool:
        """Planned from a digital twin's cube, not from measurements of real GPUs."""
        return self.meta.get("simulated") is True or any(is_twin_name(c.name) for c in self.caps)

    def for_gpu(self, uuid: str, name: str, *, twin_models: bool = False) -> GpuCap | None:
        """A GPU's own entry, else its model's entry; with `twin_models` a twin's model name
        ("NVIDIA H100 80GB HBM3 (twin)") also matches the real model."""
        for cap in self.caps:
            if cap.uuid == uuid:
                return cap
        for cap in self.caps:
            if cap.name is None:
                continue
            if cap.name == name or (
                twin_models and base_model_name(cap.name) == base_model_name(name)
            ):
                return cap
        return None

    def expected(self) -> str:
        """What the file names, for messages: its UUIDs and model names."""
        parts = [c.uuid for c in self.caps if c.uuid]
        parts += [f"model {c.name!r}" for c in self.caps if c.name]
        return ", ".join(p for p in parts if p)


def base_model_name(name: str) -> str:
    """A GPU model's NVML name without the twin's suffix."""
    return name.removesuffix(TWIN_SUFFIX)


def is_twin_name(name: str | None) -> bool:
    return bool(name) and str(name).endswith(TWIN_SUFFIX)


# -- reading and writing --------------------------------------------------------------------


def _check_file_safety(path: Path) -> None:
    """As root, a caps file anyone can write would let anyone set GPU caps: refuse it."""
    if os.geteuid() != 0:
        return
    info = path.stat()
    if info.st_mode & stat.S_IWOTH:
        raise CapsError(f"{path} is world-writable; as root dvfs refuses it (chmod o-w {path})")
    if info.st_uid != 0:
        raise CapsError(f"{path} is not owned by root; as root dvfs refuses it (chown root {path})")


def _int_or_none(table: dict[str, Any], key: str) -> int | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CapsError(f"{key} must be a positive integer (MHz), got {value!r}")
    return value


def parse_caps(data: dict[str, Any], *, where: str) -> CapsFile:
    allowed_top = {"dvfs_caps", "meta", "gpu", "model"}
    unknown = sorted(set(data) - allowed_top)
    if unknown:
        raise CapsError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(sorted(allowed_top))}"
        )
    version = data.get("dvfs_caps", CAPS_SCHEMA)
    if version != CAPS_SCHEMA:
        raise CapsError(f"{where}: caps schema {version} is not {CAPS_SCHEMA}")
    caps = []
    for kind in ("gpu", "model"):
        entries = data.get(kind, [])
        if not isinstance(entries, list):
            raise CapsError(f"{where}: [[{kind}]] must be an array of tables")
        for i, entry in enumerate(entries):
            here = f"{where}: [[{kind}]] #{i + 1}"
            if not isinstance(entry, dict):
                raise CapsError(f"{here}: must be a table ([[{kind}]] with keys), got {entry!r}")
            key = "uuid" if kind == "gpu" else "name"
            allowed = {key, "sm_clock_max_mhz", "sm_clock_min_mhz", "power_limit_w", "comment"}
            extra = sorted(set(entry) - allowed)
            if extra:
                raise CapsError(
                    f"{here}: unknown key(s) {', '.join(extra)}; allowed: "
                    f"{', '.join(sorted(allowed))}"
                )
            ident = entry.get(key)
            if not isinstance(ident, str) or not ident:
                raise CapsError(f"{here}: needs a {key} string")
            if kind == "gpu" and not ident.startswith("GPU-"):
                raise CapsError(
                    f"{here}: {ident!r} is not a GPU UUID (GPU-...); `dvfs gpu list` shows them"
                )
            power = entry.get("power_limit_w")
            if power is not None and (
                isinstance(power, bool)
                or not isinstance(power, int | float)
                or not math.isfinite(power)
                or power <= 0
            ):
                raise CapsError(f"{here}: power_limit_w must be a positive number, got {power!r}")
            try:
                caps.append(
                    GpuCap(
                        uuid=ident if kind == "gpu" else None,
                        name=ident if kind == "model" else None,
                        sm_clock_max_mhz=_int_or_none(entry, "sm_clock_max_mhz"),
                        sm_clock_min_mhz=_int_or_none(entry, "sm_clock_min_mhz"),
                        power_limit_w=None if power is None else float(power),
                    )
                )
            except CapsError as exc:
                raise CapsError(f"{here}: {exc}") from exc
    if not caps:
        raise CapsError(f"{where}: no [[gpu]] or [[model]] entries")
    uuids = [c.uuid for c in caps if c.uuid]
    if len(set(uuids)) != len(uuids):
        raise CapsError(f"{where}: a GPU UUID appears twice")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise CapsError(f"{where}: [meta] must be a table")
    if not isinstance(meta.get("simulated", False), bool):
        raise CapsError(f"{where}: [meta] simulated must be true or false")
    return CapsFile(tuple(caps), meta)


def load_caps(path: str | Path) -> CapsFile:
    path = Path(path)
    if not path.exists():
        raise CapsError(f"caps file {path} does not exist")
    _check_file_safety(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise CapsError(f"{path}: not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise CapsError(f"{path}: not a caps file (not UTF-8 text: {exc.reason})") from exc
    return parse_caps(data, where=str(path))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


def dump_caps(caps: CapsFile) -> str:
    lines = [
        "# GPU caps written by `dvfs cap plan`; apply with `dvfs cap apply FILE`",
        "# (or at boot through systemd/dvfs-caps.service).",
    ]
    if caps.simulated:
        lines += [
            f"# SIMULATED: planned from a digital-twin cube ({caps.meta.get('measured_on')}),",
            "# not from measurements of real GPUs. `dvfs cap apply` refuses this file unless",
            "# given --allow-simulated, and then matches GPUs by model name.",
        ]
    lines += [
        f"dvfs_caps = {CAPS_SCHEMA}",
        "",
        "[meta]",
    ]
    lines += [f"{k} = {_toml_value(v)}" for k, v in caps.meta.items() if v is not None]
    for cap in caps.caps:
        lines += ["", "[[gpu]]" if cap.uuid else "[[model]]"]
        lines.append(
            f"uuid = {json.dumps(cap.uuid)}" if cap.uuid else f"name = {json.dumps(cap.name)}"
        )
        if cap.sm_clock_max_mhz is not None:
            lines.append(f"sm_clock_max_mhz = {cap.sm_clock_max_mhz}")
        if cap.sm_clock_min_mhz is not None:
            lines.append(f"sm_clock_min_mhz = {cap.sm_clock_min_mhz}")
        if cap.power_limit_w is not None:
            lines.append(f"power_limit_w = {cap.power_limit_w:g}")
    return "\n".join(lines) + "\n"


# -- planning -------------------------------------------------------------------------------


def load_headroom(path: Path) -> Any:
    """A `dvfs headroom --json` document from a file (`plan_caps` checks its shape)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CapsError(
            f"{path} is not JSON ({exc}); write it with `dvfs headroom CUBE --json -o FILE`"
        ) from exc


def plan_caps(
    doc: dict[str, Any],
    *,
    batch: int,
    drafter: str,
    corpus: str,
    uuids: Sequence[str] = (),
    model_name: str | None = None,
) -> CapsFile:
    """Caps from a `dvfs.headroom/1` document and the operator's choice.

    corpus may be "worst-case": for each knob the least aggressive choice among the corpora
    (highest clock, highest power limit), which keeps every corpus within its target as long
    as latency does not rise when a knob goes up. A knob left at stock is not capped.
    """
    if uuids and model_name:
        raise CapsError("--gpu and --model exclude each other: cap GPUs by UUID or by model")
    not_uuids = [u for u in uuids if not u.startswith("GPU-")]
    if not_uuids:
        raise CapsError(
            f"--gpu {not_uuids[0]!r} is not a GPU UUID (GPU-...); `dvfs gpu list` shows them"
        )
    if not isinstance(doc, dict) or doc.get("schema") != "dvfs.headroom/1":
        raise CapsError("the input is not `dvfs headroom --json` output (schema dvfs.headroom/1)")
    missing = [k for k in ("rows", "reference", "gpu", "target") if k not in doc]
    if missing or not isinstance(doc.get("rows"), list):
        raise CapsError(
            f"the headroom document is incomplete (missing {', '.join(missing) or 'rows'}); "
            "write it again with `dvfs headroom CUBE --json -o FILE`"
        )
    rows = [r for r in doc["rows"] if r["batch"] == batch and r["drafter"] == drafter]
    if not rows:
        batches = sorted({r["batch"] for r in doc["rows"]})
        drafters = sorted({r["drafter"] for r in doc["rows"]})
        raise CapsError(
            f"no headroom rows for batch {batch} and drafter {drafter!r}; the document "
            f"has batches {batches} and drafters {drafters}"
        )
    if corpus != "worst-case":
        rows = [r for r in rows if r["corpus"] == corpus]
        if not rows:
            raise CapsError(
                f"no headroom rows for corpus {corpus!r}; use one of "
                f"{sorted({r['corpus'] for r in doc['rows']})} or worst-case"
            )
    per_gpu: dict[str | None, list[dict[str, Any]]] = {}
    for r in rows:
        per_gpu.setdefault(r.get("gpu"), []).append(r)
    measured_on = doc["gpu"].get("name")
    simulated = doc["gpu"].get("backend") == "twin" or is_twin_name(measured_on)
    if simulated and not (uuids or model_name):
        if len(per_gpu) > 1:
            raise CapsError(
                "simulated caps from a merged cube of several twin GPUs: plan each GPU's cube "
                "on its own, or pass --model NAME"
            )
        # The twin's UUIDs are made up: name its GPU model instead.
        model_name = str(measured_on or "unknown GPU") + (
            "" if is_twin_name(measured_on) else TWIN_SUFFIX
        )
        per_gpu = {None: rows}
    caps = []
    for gpu_uuid, group in per_gpu.items():
        ref = _reference_for(doc["reference"], gpu_uuid)
        infeasible = [r["corpus"] for r in group if not r["feasible"]]
        if infeasible:
            raise CapsError(
                f"no setting meets the target for corpus {', '.join(infeasible)} at batch {batch} "
                f"with drafter {drafter!r}{f' on {gpu_uuid}' if gpu_uuid else ''}; loosen the "
                "target (--slack) or choose another batch or drafter"
            )
        clock = max(r["chosen"]["sm_clock_mhz"] for r in group)
        limit = max(r["chosen"]["power_limit_w"] for r in group)
        clock_cap = None if clock >= ref["sm_clock_mhz"] else int(clock)
        limit_cap = None if limit >= ref["power_limit_w"] else float(limit)
        if clock_cap is None and limit_cap is None:
            raise CapsError(
                f"the chosen setting is stock ({ref['sm_clock_mhz']} MHz, "
                f"{ref['power_limit_w']:g} W)"
                f" for batch {batch}, drafter {drafter!r}, corpus {corpus}: nothing to cap"
            )
        targets = [gpu_uuid] if gpu_uuid else list(uuids) or list(doc["gpu"]["uuids"])
        if model_name:
            caps.append(
                GpuCap(name=model_name, sm_clock_max_mhz=clock_cap, power_limit_w=limit_cap)
            )
        else:
            if not targets:
                raise CapsError("no GPU UUIDs: pass --gpu UUID (repeatable) or --model NAME")
            caps += [
                GpuCap(uuid=u, sm_clock_max_mhz=clock_cap, power_limit_w=limit_cap) for u in targets
            ]
    meta = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "simulated": True if simulated else None,
        "campaign": doc.get("campaign"),
        "measured_on": measured_on,
        "target": doc["target"]["description"],
        "batch": batch,
        "drafter": drafter,
        "corpus": corpus,
    }
    return CapsFile(tuple(caps), meta)


def _reference_for(reference: dict[str, Any], gpu_uuid: str | None) -> dict[str, Any]:
    """The stock setting a group's chosen setting is compared with: in a merged document
    whose GPUs' stock settings differ, each GPU's own (`reference.per_gpu`)."""
    per_gpu = reference.get("per_gpu") or {}
    if gpu_uuid is not None and gpu_uuid in per_gpu:
        return dict(per_gpu[gpu_uuid])
    if reference.get("sm_clock_mhz") is None or reference.get("power_limit_w") is None:
        raise CapsError(
            "the headroom document has no single stock setting (its GPUs differ) and this "
            "group names no GPU; plan each GPU with --gpu UUID"
        )
    return reference


# -- applying -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CapAction:
    """What applying a caps file does to one GPU."""

    index: int
    uuid: str
    lock_mhz: tuple[int, int] | None
    power_limit_mw: int | None
    current_power_limit_mw: int

    def describe(self) -> str:
        parts = []
        if self.lock_mhz:
            parts.append(f"lock SM clock to {self.lock_mhz[0]}-{self.lock_mhz[1]} MHz")
        if self.power_limit_mw is not None:
            change = (
                "unchanged"
                if self.power_limit_mw == self.current_power_limit_mw
                else f"from {self.current_power_limit_mw / 1000:g} W"
            )
            parts.append(f"power limit {self.power_limit_mw / 1000:g} W ({change})")
        return f"GPU {self.index} ({self.uuid}): " + ", ".join(parts)


class AppliedCaps:
    """dvfs's record of the caps it applied (NVML cannot read a clock lock back)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / APPLIED_NAME

    def read(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except ValueError as exc:  # UnicodeDecodeError included
            raise CapsError(f"{self.path} is unreadable ({exc}); remove it and re-apply") from exc
        if not isinstance(data, dict) or not all(isinstance(r, dict) for r in data.values()):
            raise CapsError(
                f"{self.path} is not a dvfs caps record (a JSON object of per-GPU objects); "
                "remove it and re-apply"
            )
        return data

    def locks(self) -> dict[str, tuple[int, int]]:
        return {u: tuple(r["lock_mhz"]) for u, r in self.read().items() if r.get("lock_mhz")}

    def write(self, records: dict[str, dict[str, Any]]) -> None:
        from dvfs.gpu.safety import ensure_dir, write_json_atomic

        if not records:
            if self.path.exists():
                self.path.unlink()
            return
        ensure_dir(self.path.parent)
        write_json_atomic(self.path, records)


@dataclass(frozen=True)
class CapsPlan:
    """What applying a caps file on this host does, and which of its entries match nothing.

    A GPU UUID that is not here means the file was meant for another host or a GPU was
    replaced (`unmatched`); a model that is not here is normal for a fleet file (`unused`).
    """

    actions: tuple[CapAction, ...]
    unmatched: tuple[str, ...]
    host: str
    unused: tuple[str, ...] = ()

    def unmatched_message(self, where: str) -> str:
        return (
            f"{where} names GPU(s) {', '.join(self.unmatched)}, which are not on this host "
            f"(it has {self.host}); caps went to the GPUs that match"
        )

    def unused_message(self, where: str) -> str:
        return f"{where}: no GPU here is a {' or '.join(self.unused)}; those entries were skipped"


def describe_host(gpus: Sequence[Gpu]) -> str:
    """The host's GPUs for messages: index, model name and UUID."""
    if not gpus:
        return "no GPUs"
    return "; ".join(f"GPU {g.identity.index} {g.identity.name} ({g.identity.uuid})" for g in gpus)


def plan_actions(
    caps: CapsFile,
    gpus: Sequence[Gpu],
    *,
    where: str = "the caps file",
    allow_simulated: bool = False,
) -> CapsPlan:
    """Match caps to this host's GPUs and validate them against each GPU's supported clocks
    and power range, without writing.

    Refuses (CapsError) simulated caps unless `allow_simulated`, and a file that matches no
    GPU at all; entries that match nothing are listed in the plan for the caller to report.
    """
    host = describe_host(gpus)
    if caps.simulated and not allow_simulated:
        measured = caps.meta.get("measured_on") or "a digital twin"
        models = sorted({base_model_name(c.name) for c in caps.caps if c.name})
        target = f"GPUs of model {', '.join(models)}" if models else "the GPUs it names"
        raise CapsError(
            f"{where} holds simulated caps, planned from a digital-twin cube ({measured}), not "
            f"from measurements of real GPUs: sweep the real GPUs and plan again, or pass "
            f"--allow-simulated to apply them to {target} anyway"
        )
    actions = []
    matched: set[int] = set()
    for gpu in gpus:
        ident = gpu.identity
        cap = caps.for_gpu(ident.uuid, ident.name, twin_models=allow_simulated)
        if cap is None:
            continue
        matched.add(id(cap))
        lock = None
        if cap.sm_clock_max_mhz is not None:
            supported = gpu.supported_sm_clocks_mhz()
            low = cap.sm_clock_min_mhz if cap.sm_clock_min_mhz is not None else min(supported)
            for mhz in (low, cap.sm_clock_max_mhz):
                problem = unsupported_clock(mhz, supported)
                if problem:
                    raise CapsError(f"GPU {ident.index}: {problem}")
            lock = (low, cap.sm_clock_max_mhz)
        limit = None
        if cap.power_limit_w is not None:
            limit = round(cap.power_limit_w * 1000)
            problem = gpu.power_limit_range().outside(limit)
            if problem:
                raise CapsError(f"GPU {ident.index}: {problem}")
        actions.append(CapAction(ident.index, ident.uuid, lock, limit, gpu.power_limit_mw()))
    if not actions:
        raise CapsError(
            f"{where} matches no GPU on this host, so nothing was capped: it names "
            f"{caps.expected()}; this host has {host} (`dvfs gpu list`)"
        )
    unmatched = tuple(c.uuid for c in caps.caps if c.uuid and id(c) not in matched)
    unused = tuple(c.name for c in caps.caps if c.name and id(c) not in matched)
    return CapsPlan(tuple(actions), unmatched, host, unused)


def apply_actions(
    actions: Sequence[CapAction], gpus: Sequence[Gpu], record: AppliedCaps, source: str
) -> None:
    """Write the caps, recording each applied GPU; failures are gathered and reported together.

    The record is written even when a signal or a hung call ends the loop early, so `cap show`
    and a later sweep know about every lock that was put in place.
    """
    by_uuid = {g.identity.uuid: g for g in gpus}
    applied = record.read()
    failures = GatheredFailures()
    try:
        for action in actions:
            gpu = by_uuid[action.uuid]
            entry: dict[str, Any] = {
                "lock_mhz": None,
                "power_limit_mw": None,
                "source": source,
                "applied": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            try:
                if action.lock_mhz is not None:
                    gpu.lock_sm_clock(*action.lock_mhz)
                    entry["lock_mhz"] = list(action.lock_mhz)  # recorded even if the limit fails
                    applied[action.uuid] = entry
                if action.power_limit_mw is not None:
                    if action.power_limit_mw != gpu.power_limit_mw():
                        gpu.set_power_limit_mw(action.power_limit_mw)
                    entry["power_limit_mw"] = action.power_limit_mw
                    applied[action.uuid] = entry
            except GpuError as exc:
                failures.add(exc)
    finally:
        record.write(applied)
    failures.raise_if_any("could not apply caps: ")


def reset_caps(gpus: Sequence[Gpu], record: AppliedCaps) -> list[str]:
    """Unlock clocks and restore default power limits; returns what was done per GPU."""
    applied = record.read()
    failures = GatheredFailures()
    done = []
    try:
        for gpu in gpus:
            ident = gpu.identity
            try:
                gpu.reset_sm_clock()
                default = gpu.power_limit_range().default_mw
                if gpu.power_limit_mw() != default:
                    gpu.set_power_limit_mw(default)
                applied.pop(ident.uuid, None)
                done.append(
                    f"GPU {ident.index} ({ident.uuid}): clocks unlocked, power limit "
                    f"{default / 1000:g} W (default)"
                )
            except GpuError as exc:
                failures.add(exc)
    finally:  # even when a signal ends the loop early
        record.write(applied)
    failures.raise_if_any("could not reset caps: ")
    return done


def enforce_plan(plan: CapsPlan, gpus: Sequence[Gpu], directory: Path, source: str) -> None:
    """Apply a plan's actions under the same safety layer as a sweep: each GPU's lock held,
    GPUs with unrestored changes refused, and signals unwinding rather than killing."""
    from dvfs.gpu.safety import GpuLocks, StateStore
    from dvfs.signals import signals_raise

    wanted = {a.uuid for a in plan.actions}
    targets = [g for g in gpus if g.identity.uuid in wanted]
    with signals_raise(), GpuLocks(directory).hold(targets):
        StateStore(directory).refuse_if_pending(targets)
        apply_actions(plan.actions, targets, AppliedCaps(directory), source)


def reset_locked(gpus: Sequence[Gpu], directory: Path) -> list[str]:
    """`reset_caps` with each GPU's lock held, so a running dvfs keeps its GPUs."""
    from dvfs.gpu.safety import GpuLocks
    from dvfs.signals import signals_raise

    with signals_raise(), GpuLocks(directory).hold(gpus):
        return reset_caps(gpus, AppliedCaps(directory))


def caps_status(gpus: Sequence[Gpu], directory: Path) -> list[dict[str, Any]]:
    """What is enforced per GPU now: power limits read from the GPU, clock locks from dvfs's
    record (NVML cannot read a lock back)."""
    applied = AppliedCaps(directory).read()
    rows = []
    for g in gpus:
        ident = g.identity
        record = applied.get(ident.uuid, {})
        limits = g.power_limit_range()
        rows.append(
            {
                "index": ident.index,
                "uuid": ident.uuid,
                "name": ident.name,
                "enforced_power_limit_w": g.enforced_power_limit_mw() / 1000,
                "configured_power_limit_w": g.power_limit_mw() / 1000,
                "default_power_limit_w": limits.default_mw / 1000,
                "sm_clock_lock_mhz": record.get("lock_mhz"),
                "sm_clock_mhz": g.sm_clock_mhz(),
                "caps_source": record.get("source"),
                "applied": record.get("applied"),
            }
        )
    return rows


def reset_gpus(
    gpus: Sequence[Gpu], directory: Path, *, defaults: bool, note: Callable[[str], None]
) -> bool:
    """`dvfs gpu reset`: restore what state files record for these GPUs and, with `defaults`,
    reset the others to driver defaults, holding the lock of each GPU acted on. `note` hears
    each GPU as it is done ("restored ..." / "reset ..."). False when there was nothing to do."""
    from dvfs.gpu.safety import GpuLocks, StateStore, restore_pending
    from dvfs.signals import signals_raise

    store = StateStore(directory)
    with_state = [g for g in gpus if store.pending(g.identity.uuid)]
    if not with_state and not defaults:
        return False
    targets = list(gpus) if defaults else with_state
    with signals_raise(), GpuLocks(directory).hold(targets):
        for line in restore_pending(with_state, store):
            note(f"restored {line}")
        if defaults:
            others = [g for g in gpus if g not in with_state]
            for line in reset_caps(others, AppliedCaps(directory)):
                note(f"reset {line}")
    return True
