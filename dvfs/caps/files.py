"""The caps file: what `dvfs cap plan` writes and `dvfs cap apply` reads (TOML).

A caps file names GPUs by UUID (or, for a fleet, by model name) with an SM-clock cap and/or a
power limit. Caps planned from a digital-twin cube are marked simulated (`[meta] simulated =
true`) and name the twin's GPU model, never its made-up UUID. This module only parses, checks
and writes the format; planning (`dvfs.caps.planning`) and actuation (`dvfs.caps.actuation`)
build on it, so a reader of the format needs neither headroom documents nor GPUs.
"""

from __future__ import annotations

import math
import os
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dvfs.errors import CapsError
from dvfs.gpu.base import canonical_uuid
from dvfs.outputs import group_name, who_may_replace
from dvfs.toml_text import refuse_beyond_64_bits, toml_line, toml_value

CAPS_SCHEMA = 1
#: How the twin's GPUs name themselves: the NVML model name with this suffix.
TWIN_SUFFIX = " (twin)"


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
        """Planned from a digital twin's cube, not from measurements of real GPUs: so marked,
        an entry naming a twin's model, or `[meta] measured_on` naming one (a file an older
        dvfs planned from a twin, before the mark, with `--model` naming the real model)."""
        measured = self.meta.get("measured_on")
        return (
            self.meta.get("simulated") is True
            or any(is_twin_name(c.name) for c in self.caps)
            or (
                isinstance(measured, str)
                and any(is_twin_name(m.strip()) for m in measured.split(", "))
            )
        )

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

    def measured_models(self) -> tuple[str, ...]:
        """The GPU models the caps were measured on (`[meta] measured_on`, which a merged
        cube's caps list comma-separated), without the twin's suffix; () when the file does not
        say (written by hand)."""
        measured = self.meta.get("measured_on")
        if not isinstance(measured, str):
            return ()
        return tuple(base_model_name(m.strip()) for m in measured.split(", ") if m.strip())

    def expected(self) -> str:
        """What the file names, for messages: its UUIDs and model names."""
        parts = [c.uuid for c in self.caps if c.uuid]
        parts += [f"model {c.name!r}" for c in self.caps if c.name]
        return ", ".join(p for p in parts if p)


def plan_again(meta: dict[str, Any], model: str | None = None) -> str:
    """The `dvfs cap plan` that plans a caps file again from its headroom written anew: the
    batch, drafter and corpus its [meta] records (`cap plan` writes them), else placeholders;
    with `model`, its --model."""
    import shlex

    batch, drafter, corpus = meta.get("batch"), meta.get("drafter"), meta.get("corpus")
    command = "dvfs cap plan headroom.json"
    command += f" --batch {batch}" if isinstance(batch, int) else " --batch N"
    command += (
        f" --drafter {shlex.quote(drafter)}" if isinstance(drafter, str) else " --drafter NAME"
    )
    if isinstance(corpus, str) and corpus != "worst-case":
        command += f" --corpus {shlex.quote(corpus)}"
    command += f" --model {shlex.quote(model)}" if model else ""
    return command + " -o caps.toml"


def headroom_again(target: Any, out: str = "headroom.json") -> str:
    """The `dvfs headroom` that writes a cube's headroom document again, with the target it
    was written for (`target`, its description) where known: the defaults ask their own
    question, and caps planned from that document would hold another target."""
    command = f"`dvfs headroom CUBE --json -o {out}`"
    if isinstance(target, str) and target:
        command += f" with the options of its target, {target}"
    return command


def base_model_name(name: str) -> str:
    """A GPU model's NVML name without the twin's suffix."""
    return name.removesuffix(TWIN_SUFFIX)


def is_twin_name(name: str | None) -> bool:
    return bool(name) and str(name).endswith(TWIN_SUFFIX)


def check_file_safety(path: Path, info: os.stat_result | None = None) -> None:
    """As root, a file that steers GPU settings (a caps file, a governor's plan) and that
    anyone but root can write would let anyone set GPU caps: refuse it. So is one in a folder
    anyone but root can write (its owner, or a group or everyone without the sticky bit), where
    the entry is theirs to replace (by their own file, or a link to any root-owned one); a
    symbolic link's folder and its target's are both checked. `info`: the opened file's
    `os.fstat` (`read_limited`'s `check`), so that the file checked is the file read."""
    if os.geteuid() != 0:
        return
    info = path.stat() if info is None else info
    if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
        # (a device is world-writable: the advice to `chmod o-w` it would change the device)
        raise CapsError(f"{path} is a device, not a file: give the file `dvfs cap plan` wrote")
    # The folder first: where another user may replace the file, no change to the file (chown,
    # chmod) makes it safe, so the error names the fix that does (a root-only folder).
    if stat.S_ISREG(info.st_mode):  # a pipe (`<(...)`) root's shell made has no folder
        _check_folders(path)
    if info.st_mode & stat.S_IWOTH:
        raise CapsError(f"{path} is world-writable; as root dvfs refuses it (chmod o-w {path})")
    if info.st_mode & stat.S_IWGRP and info.st_gid != 0:  # its group's members are not root
        raise CapsError(
            f"{path} is group-writable; as root dvfs refuses it (group {group_name(info.st_gid)} "
            f"may write it: chmod g-w {path})"
        )
    if info.st_uid != 0:
        raise CapsError(f"{path} is not owned by root; as root dvfs refuses it (chown root {path})")


def _check_folders(path: Path) -> None:
    """Refuse `path` where a folder above it, or above the file it links to, lets anyone but
    root replace it (`check_file_safety`)."""
    given = Path(os.path.abspath(path))
    folders = dict.fromkeys([*given.parents, *Path(os.path.realpath(path)).parents])
    for folder in folders:
        try:
            held = folder.stat()
        except OSError:
            continue  # gone meanwhile: the file opened is what was checked
        who = who_may_replace(held)
        if who is not None:
            where = "is in" if folder in given.parents else "links to a file in"
            raise CapsError(
                f"{path} {where} {folder}, which {who} may write (and so replace the file); as "
                "root dvfs refuses it: keep it in a folder only root can write, such as /etc/dvfs"
            )


def _int_or_none(table: dict[str, Any], key: str) -> int | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CapsError(f"{key} must be a positive integer (MHz), got {value!r}")
    return value


def parse_caps(data: dict[str, Any], *, where: str) -> CapsFile:
    if "dvfs_batch_plan" in data and "dvfs_caps" not in data:  # /etc/dvfs/ holds both kinds
        raise CapsError(
            f"{where} is a per-batch plan (for `dvfs govern --plan`), not a caps file; write "
            "one with `dvfs cap plan HEADROOM_JSON --batch N --drafter NAME`"
        )
    allowed_top = {"dvfs_caps", "meta", "gpu", "model"}
    unknown = sorted(set(data) - allowed_top)
    if unknown:
        raise CapsError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(sorted(allowed_top))}"
        )
    version = data.get("dvfs_caps", CAPS_SCHEMA)
    # (said as written: a quoted "1" read "caps schema 1 is not 1"; true is no schema either)
    if isinstance(version, bool) or version != CAPS_SCHEMA:
        raise CapsError(
            f"{where}: caps schema dvfs_caps = {toml_value(version)[:40]} is not "
            f"{CAPS_SCHEMA}; write it again with this dvfs's `dvfs cap plan HEADROOM_JSON "
            "--batch N --drafter NAME`"
        )
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
            if kind == "gpu" and not ident.upper().startswith("GPU-"):
                raise CapsError(
                    f"{here}: {ident!r} is not a GPU UUID (GPU-...); `dvfs gpu list` shows them"
                )
            if kind == "gpu":
                ident = canonical_uuid(ident)  # matched against NVML's, lower-case
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
    names = [c.name for c in caps if c.name]
    for model in dict.fromkeys(base_model_name(n) for n in names):
        entries = [n for n in names if base_model_name(n) == model]
        if len(entries) > 1:  # the first would cap the model's GPUs, the others nothing
            # An older dvfs's `cap plan --model` of a merged cube wrote one entry per GPU, each
            # GPU's own setting: which to keep is no guess (another GPU's may be too low).
            raise CapsError(
                f"{where}: GPU model {model!r} appears twice ([[model]] names "
                f"{', '.join(repr(n) for n in entries)}): its GPUs would take the first "
                "entry's caps only; keep one [[model]] entry per model (one an older dvfs's "
                "`cap plan --model` wrote from a merged cube, an entry per GPU: write that "
                f"cube's headroom again, {headroom_again(meta.get('target'))}, then plan "
                f"again, `{plan_again(meta, entries[0])}`, which takes the least aggressive "
                "setting over the model's GPUs)"
            )
    if not isinstance(meta.get("simulated", False), bool):
        raise CapsError(f"{where}: [meta] simulated must be true or false")
    return CapsFile(tuple(caps), meta)


def load_caps(path: str | Path) -> CapsFile:
    path = Path(path)
    from dvfs.inputs import MAX_SETTINGS_BYTES, TOO_DEEP, link_loop_problem, read_text_limited

    if not path.exists():
        loop = link_loop_problem(path)  # not "does not exist", of a link that is there
        raise CapsError(f"caps file: {loop}" if loop else f"caps file {path} does not exist")

    try:
        data = tomllib.loads(
            read_text_limited(path, MAX_SETTINGS_BYTES, CapsError, "caps file", check_file_safety)
        )
    except tomllib.TOMLDecodeError as exc:
        raise CapsError(f"{path}: not valid TOML: {exc}") from exc
    except RecursionError as exc:
        raise CapsError(
            f"{path}: not valid TOML: {TOO_DEEP} (a damaged file?); check the file"
        ) from exc
    refuse_beyond_64_bits(data, str(path), CapsError)
    return parse_caps(data, where=str(path))


def exact(value: float) -> str:
    """A number as TOML, short when that is exact (400, 412.5), else in full: a caps file
    must read back as the limit planned."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


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
    lines += [toml_line(k, v) for k, v in caps.meta.items() if v is not None]
    for cap in caps.caps:
        lines += ["", "[[gpu]]" if cap.uuid else "[[model]]"]
        lines.append(
            f"uuid = {toml_value(cap.uuid)}" if cap.uuid else f"name = {toml_value(cap.name)}"
        )
        if cap.sm_clock_max_mhz is not None:
            lines.append(toml_line("sm_clock_max_mhz", cap.sm_clock_max_mhz))
        if cap.sm_clock_min_mhz is not None:
            lines.append(toml_line("sm_clock_min_mhz", cap.sm_clock_min_mhz))
        if cap.power_limit_w is not None:
            lines.append(f"power_limit_w = {exact(cap.power_limit_w)}")
    return "\n".join(lines) + "\n"
