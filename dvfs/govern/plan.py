"""The per-batch plan: what `dvfs cap plan --per-batch` writes and `dvfs govern` follows (TOML).

A plan lists, for the batch sizes a campaign measured, the setting (an SM-clock cap and/or a
power limit; either may be stock) that kept latency within the target at the least energy for
one drafter. It is versioned (`dvfs_batch_plan = 1`) and checked whole when read, so a governor
never starts on a plan it would misread. This module only parses, checks and writes the format;
the planning is `dvfs.caps.planning.plan_per_batch`, the following is `dvfs.govern.policy`.

How a running batch maps to a setting ("buckets", ordered by batch): a planned batch gets its
own step, a batch below the smallest planned one gets the smallest one's; a batch between two
planned ones gets, knob by knob, the less aggressive of the two neighbours (the higher clock,
the higher limit, stock if either is stock), which covers it whenever the clock it needs rises
or falls monotonically between them; above the largest planned batch nothing was measured, so
the GPU runs at stock.
"""

from __future__ import annotations

import bisect
import math
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dvfs.caps.files import base_model_name, check_file_safety, exact, is_twin_name
from dvfs.errors import CapsError
from dvfs.toml_text import refuse_beyond_64_bits, toml_line, toml_value

BATCH_PLAN_SCHEMA = 1
SCHEMA_KEY = "dvfs_batch_plan"


@dataclass(frozen=True)
class Setting:
    """One GPU setting: cap the SM clock at `sm_clock_mhz` and set `power_limit_w`; None leaves
    that knob at stock."""

    sm_clock_mhz: int | None = None
    power_limit_w: float | None = None

    @property
    def is_stock(self) -> bool:
        return self.sm_clock_mhz is None and self.power_limit_w is None

    def join(self, other: Setting) -> Setting:
        """The less aggressive of two settings, knob by knob (None, stock, beats any cap)."""

        def high(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else max(a, b)

        clock = high(self.sm_clock_mhz, other.sm_clock_mhz)
        return Setting(
            None if clock is None else int(clock), high(self.power_limit_w, other.power_limit_w)
        )

    def describe(self) -> str:
        clock = (
            "SM clock stock"
            if self.sm_clock_mhz is None
            else f"SM clock <= {self.sm_clock_mhz} MHz"
        )
        limit = (
            "power limit stock"
            if self.power_limit_w is None
            else f"power limit {self.power_limit_w:g} W"
        )
        return f"{clock}, {limit}"


STOCK = Setting()


@dataclass(frozen=True)
class BatchStep:
    """The setting planned for running batches up to `batch` (and above the previous step)."""

    batch: int
    setting: Setting
    energy_per_token_j: float | None = None
    stock_energy_per_token_j: float | None = None


@dataclass(frozen=True)
class BatchPlan:
    steps: tuple[BatchStep, ...]
    measured_on: str
    drafter: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.steps:
            raise CapsError("a per-batch plan needs at least one [[batch]] step")
        batches = [s.batch for s in self.steps]
        if any(b < 1 for b in batches):
            raise CapsError("per-batch plan: batch sizes must be at least 1")
        if batches != sorted(set(batches)):
            raise CapsError(f"per-batch plan: batch sizes must increase strictly, got {batches}")
        if all(s.setting.is_stock for s in self.steps):
            raise CapsError("per-batch plan: every step is stock, so there is nothing to govern")

    @property
    def batches(self) -> tuple[int, ...]:
        return tuple(s.batch for s in self.steps)

    @property
    def simulated(self) -> bool:
        """Planned from a digital twin's cube, not from measurements of real GPUs."""
        return self.meta.get("simulated") is True or is_twin_name(self.measured_on)

    @property
    def stock_bucket(self) -> int:
        """The last bucket: above the plan, or the batch unknown."""
        return 2 * len(self.steps) - 1

    def bucket(self, batch: int | None) -> int:
        """A running batch's bucket, monotone in the batch: 2i for planned batch i (and 0 for
        anything below the first), 2i - 1 between planned batches i - 1 and i, and
        `stock_bucket` above the last or when the batch is unknown."""
        batches = self.batches
        if batch is None:
            return self.stock_bucket
        if batch <= batches[0]:
            return 0
        i = bisect.bisect_left(batches, batch)
        if i == len(batches):
            return self.stock_bucket
        return 2 * i if batches[i] == batch else 2 * i - 1

    def setting(self, bucket: int) -> Setting:
        """A bucket's setting (see the module docstring)."""
        if bucket >= self.stock_bucket:
            return STOCK
        if bucket % 2 == 0:
            return self.steps[bucket // 2].setting
        return self.steps[bucket // 2].setting.join(self.steps[bucket // 2 + 1].setting)

    def band_setting(self, band: tuple[int, int]) -> Setting:
        """The least aggressive setting over buckets band[0]..band[1] (the governor's band)."""
        setting = self.setting(band[0])
        for bucket in range(band[0] + 1, band[1] + 1):
            setting = setting.join(self.setting(bucket))
        return setting

    def band_label(self, band: tuple[int, int]) -> str:
        low, high = (self.bucket_label(b) for b in band)
        return low if band[0] == band[1] else f"{low} to {high}"

    def bucket_batch(self, bucket: int) -> int:
        """The planned batch a bucket reaches up to (0: above the plan, stock)."""
        return 0 if bucket >= self.stock_bucket else self.steps[(bucket + 1) // 2].batch

    def bucket_label(self, bucket: int) -> str:
        if bucket >= self.stock_bucket:
            return f"above plan batch {self.steps[-1].batch} (stock)"
        if bucket % 2 == 0:
            return f"plan batch {self.steps[bucket // 2].batch}"
        low, high = self.steps[bucket // 2].batch, self.steps[bucket // 2 + 1].batch
        return f"between plan batches {low} and {high}"

    def matches_model(self, name: str, *, twin_models: bool) -> bool:
        """Whether a GPU of NVML model `name` is the model the plan was measured on."""
        if name == self.measured_on:
            return True
        return twin_models and base_model_name(name) == base_model_name(self.measured_on)


def _positive_int(value: Any, where: str, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CapsError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _positive_float(value: Any, where: str, key: str) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise CapsError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


STEP_KEYS = {
    "batch",
    "sm_clock_mhz",
    "power_limit_w",
    "energy_per_token_j",
    "stock_energy_per_token_j",
    "comment",
}


def parse_plan(data: dict[str, Any], *, where: str) -> BatchPlan:
    """A plan from its TOML tables; every problem is one CapsError naming the key."""
    if SCHEMA_KEY not in data:
        what = (
            "a caps file (for `dvfs cap apply`), not a per-batch plan"
            if "dvfs_caps" in data
            else f"not a per-batch plan (no {SCHEMA_KEY} = {BATCH_PLAN_SCHEMA})"
        )
        raise CapsError(
            f"{where} is {what}; write one with `dvfs cap plan HEADROOM_JSON --per-batch`"
        )
    version = data[SCHEMA_KEY]
    # (said as written, as a caps file's is; true is no schema: True == 1 in Python)
    if isinstance(version, bool) or version != BATCH_PLAN_SCHEMA:
        raise CapsError(
            f"{where}: per-batch plan schema {SCHEMA_KEY} = {toml_value(version)[:40]} is not "
            f"{BATCH_PLAN_SCHEMA}; write it again with this dvfs's "
            "`dvfs cap plan HEADROOM_JSON --per-batch`"
        )
    unknown = sorted(set(data) - {SCHEMA_KEY, "meta", "batch"})
    if unknown:
        raise CapsError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {SCHEMA_KEY}, meta, batch"
        )
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise CapsError(f"{where}: [meta] must be a table")
    for key in ("measured_on", "drafter"):
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise CapsError(f"{where}: [meta] needs {key} (a string)")
    if not isinstance(meta.get("simulated", False), bool):
        raise CapsError(f"{where}: [meta] simulated must be true or false")
    entries = data.get("batch", [])
    if not isinstance(entries, list) or not entries:
        raise CapsError(f"{where}: needs [[batch]] steps (batch = N, sm_clock_mhz, power_limit_w)")
    steps = []
    for i, entry in enumerate(entries):
        here = f"{where}: [[batch]] #{i + 1}"
        if not isinstance(entry, dict):
            raise CapsError(f"{here}: must be a table, got {entry!r}")
        extra = sorted(set(entry) - STEP_KEYS)
        if extra:
            raise CapsError(
                f"{here}: unknown key(s) {', '.join(extra)}; allowed: "
                f"{', '.join(sorted(STEP_KEYS))}"
            )
        batch = _positive_int(entry.get("batch"), here, "batch")
        if batch is None:
            raise CapsError(f"{here}: needs batch = N")
        steps.append(
            BatchStep(
                batch,
                Setting(
                    _positive_int(entry.get("sm_clock_mhz"), here, "sm_clock_mhz"),
                    _positive_float(entry.get("power_limit_w"), here, "power_limit_w"),
                ),
                _positive_float(entry.get("energy_per_token_j"), here, "energy_per_token_j"),
                _positive_float(
                    entry.get("stock_energy_per_token_j"), here, "stock_energy_per_token_j"
                ),
            )
        )
    try:
        return BatchPlan(tuple(steps), meta["measured_on"], meta["drafter"], dict(meta))
    except CapsError as exc:
        raise CapsError(f"{where}: {exc}") from exc


def load_plan(path: str | Path) -> BatchPlan:
    path = Path(path)
    from dvfs.inputs import link_loop_problem

    loop = link_loop_problem(path)  # as `--profile` and the other paths read say it
    if loop:
        raise CapsError(f"per-batch plan: {loop}")
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # (a file where a folder of its path goes)
        raise CapsError(f"per-batch plan {path} does not exist") from None
    # (any other OSError, a folder this user may not search, goes to the
    # command, which says it with what to do: `describe_os_error` is the CLI's)
    # a pipe (`--plan <(...)`) is read as a file is; a device (/dev/null) or a folder is none
    if not stat.S_ISREG(mode) and not stat.S_ISFIFO(mode):
        what = "a folder" if stat.S_ISDIR(mode) else "a device or socket"
        raise CapsError(
            f"per-batch plan {path} is {what}, not a regular file: give the file "
            "`dvfs cap plan HEADROOM_JSON --per-batch` wrote"
        )
    from dvfs.inputs import MAX_SETTINGS_BYTES, TOO_DEEP, read_text_limited

    try:  # as root, the plan sets GPU caps as a caps file does: checked as one, once open
        data = tomllib.loads(
            read_text_limited(
                path, MAX_SETTINGS_BYTES, CapsError, "per-batch plan", check_file_safety
            )
        )
    except tomllib.TOMLDecodeError as exc:
        raise CapsError(f"{path}: not valid TOML: {exc}") from exc
    except RecursionError as exc:
        raise CapsError(
            f"{path}: not valid TOML: {TOO_DEEP} (a damaged file?); check the file"
        ) from exc
    refuse_beyond_64_bits(data, str(path), CapsError)
    return parse_plan(data, where=str(path))


def dump_plan(plan: BatchPlan) -> str:
    lines = [
        "# Per-batch GPU settings written by `dvfs cap plan --per-batch`; follow them with",
        "# `dvfs govern --plan FILE --url http://127.0.0.1:30000` (systemd/dvfs-govern.service).",
        "# A planned batch gets its step; a batch between two gets the less aggressive of the",
        "# two; above the last the GPU runs at stock. No sm_clock_mhz / power_limit_w: stock.",
    ]
    if plan.simulated:
        lines += [
            f"# SIMULATED: planned from a digital-twin cube ({plan.measured_on}), not from",
            "# measurements of real GPUs; `dvfs govern` refuses it without --allow-simulated.",
        ]
    lines += [f"{SCHEMA_KEY} = {BATCH_PLAN_SCHEMA}", "", "[meta]"]
    lines += [toml_line(k, v) for k, v in plan.meta.items() if v is not None]
    for step in plan.steps:
        lines += ["", "[[batch]]", toml_line("batch", step.batch)]
        if step.setting.sm_clock_mhz is not None:
            lines.append(toml_line("sm_clock_mhz", step.setting.sm_clock_mhz))
        if step.setting.power_limit_w is not None:
            lines.append(f"power_limit_w = {exact(step.setting.power_limit_w)}")
        if step.energy_per_token_j is not None:
            lines.append(f"energy_per_token_j = {step.energy_per_token_j:.6g}")
        if step.stock_energy_per_token_j is not None:
            lines.append(f"stock_energy_per_token_j = {step.stock_energy_per_token_j:.6g}")
    return "\n".join(lines) + "\n"
