"""Campaign files: what to sweep, on which GPU and engine, and how to measure.

A campaign is validated whole on load: any mistake raises one `CampaignError` naming the file,
the key, the value and what is allowed, before anything touches a GPU.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dvfs.errors import CampaignError

SPECULATIVE_ALGORITHMS = (
    "EAGLE",
    "EAGLE3",
    "NEXTN",
    "STANDALONE",
    "NGRAM",
    "DFLASH",
    "DSPARK",
    "UNO",
)
#: Algorithms that draft with a separate model and need `draft_model`.
NEEDS_DRAFT_MODEL = ("EAGLE", "EAGLE3", "STANDALONE", "DFLASH", "DSPARK")
#: Algorithms whose three draft numbers SGLang requires all-or-none.
EAGLE_TRIPLE = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
MODES = ("fixed", "closed-loop")
#: Names that become path components (campaign, drafter, corpus): no separators, no "..", no
#: NUL or newline (`\\Z`, not `$`, which would accept a trailing newline).
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
#: Settings that change how a sweep runs, not what it measures: they stay out of the campaign
#: hash, so a day-long sweep can resume with a longer timeout or another server command, and each
#: journal session records the values it ran with. Anything not listed here is measured.
OPERATIONAL: tuple[tuple[str, ...], ...] = (
    ("measurement", "retries"),
    ("engine", "sglang", "url"),
    ("engine", "sglang", "server_command"),
    ("engine", "sglang", "env"),
    ("engine", "sglang", "host"),
    ("engine", "sglang", "startup_timeout_s"),
    ("engine", "sglang", "request_timeout_s"),
    ("engine", "sglang", "stall_timeout_s"),
)
#: Top-level fields that describe a campaign without changing a number.
UNMEASURED = ("name", "description", "source", "base_dir")
#: Dataclass field names shown as the campaign file spells them.
TOML_NAMES = {
    "knobs.sm_clocks_mhz": "knobs.sm_clock",
    "knobs.power_limits_w": "knobs.power_limit",
    "workload.batch_sizes": "workload.batch",
}


@dataclass(frozen=True)
class GpuConfig:
    backend: str
    profile: str | None
    devices: tuple[int | str, ...]
    actuation: bool


@dataclass(frozen=True)
class KnobConfig:
    """SM clocks (MHz) and power limits (W) to sweep; None means leave the stock setting."""

    sm_clocks_mhz: tuple[int, ...] | None
    power_limits_w: tuple[float, ...] | None
    settle_s: float

    @property
    def settings(self) -> list[tuple[int | None, float | None]]:
        clocks: list[int | None] = list(self.sm_clocks_mhz) if self.sm_clocks_mhz else [None]
        limits: list[float | None] = list(self.power_limits_w) if self.power_limits_w else [None]
        return [(c, p) for p in limits for c in clocks]


@dataclass(frozen=True)
class DrafterSpec:
    """One speculative-decoding configuration, in SGLang's terms (algorithm None = no drafter)."""

    name: str
    algorithm: str | None = None
    draft_model: str | None = None
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    extra_args: tuple[str, ...] = ()

    @property
    def speculative(self) -> bool:
        return self.algorithm is not None


@dataclass(frozen=True)
class SglangConfig:
    url: str | None = None
    server_command: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    version: str | None = None
    host: str = "127.0.0.1"
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 120.0
    stall_timeout_s: float = 60.0
    env: tuple[tuple[str, str], ...] = ()
    #: Pinned for every drafter's server ("auto": SGLang picks, and dvfs checks they agree).
    attention_backend: str = "fa3"


@dataclass(frozen=True)
class EngineConfig:
    backend: str
    model: str
    tp_size: int
    twin_model: str | None
    sglang: SglangConfig


@dataclass(frozen=True)
class CorpusRef:
    """A corpus named in the workload; `spec` holds a user corpus's table (None for built-ins)."""

    name: str
    spec: tuple[tuple[str, Any], ...] | None = None


@dataclass(frozen=True)
class WorkloadConfig:
    batch_sizes: tuple[int, ...]
    corpora: tuple[CorpusRef, ...]
    input_tokens: tuple[int, int]
    output_tokens: int
    mode: str
    temperature: float
    ignore_eos: bool
    pool_size: int | None

    @property
    def corpus_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.corpora)


@dataclass(frozen=True)
class MeasurementConfig:
    warmup_tokens: int = 32
    min_window_s: float = 1.0
    max_rounds: int = 8
    repeats: int = 1
    seed: int = 0
    sample_period_s: float = 0.02
    idle_s: float = 5.0
    retries: int = 2


@dataclass(frozen=True)
class Campaign:
    name: str
    description: str
    gpu: GpuConfig
    knobs: KnobConfig
    engine: EngineConfig
    drafters: tuple[DrafterSpec, ...]
    workload: WorkloadConfig
    measurement: MeasurementConfig
    source: str = field(default="", compare=False)
    base_dir: str = field(default=".", compare=False)

    def semantic_dict(self) -> dict[str, Any]:
        """Everything that changes what is measured: not the name, description, file location
        or the operational settings (retries, timeouts, server command, environment, URL)."""
        return measured_part(asdict(self))

    def operational_dict(self) -> dict[str, Any]:
        """The operational settings, by dotted key (a journal session records these)."""
        data = _jsonable(asdict(self))
        flat: dict[str, Any] = {}
        for path in OPERATIONAL:
            value: Any = data
            for part in path:
                value = value.get(part) if isinstance(value, dict) else None
            if path[-1] == "env" and isinstance(value, list):
                value = {str(k): v for k, v in value}
            flat[".".join(path)] = value
        return flat

    @property
    def hash(self) -> str:
        blob = json.dumps(self.semantic_dict(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def drafter(self, name: str) -> DrafterSpec:
        for drafter in self.drafters:
            if drafter.name == name:
                return drafter
        raise KeyError(name)


def _jsonable(data: Any) -> Any:
    """As JSON would store it (tuples become lists), so stored and fresh dicts compare."""
    return json.loads(json.dumps(data, default=str))


def measured_part(data: dict[str, Any]) -> dict[str, Any]:
    """A campaign dict (fresh, or stored in a journal or cube by any dvfs version) without the
    fields that do not change a measurement."""
    data = _jsonable(data)
    for key in UNMEASURED:
        data.pop(key, None)
    for path in OPERATIONAL:
        parent: Any = data
        for part in path[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    return data


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, item in enumerate(value):
            label = item.get("name", i)
            _flatten(item, f"{prefix}[{label}]", out)
    else:
        out[prefix] = value


def measured_differences(
    before: dict[str, Any], after: dict[str, Any], *, ignore: tuple[str, ...] = ()
) -> list[str]:
    """The measured settings that differ between two campaign dicts, as "key: old -> new"
    (keys spelt as in the campaign file; keys starting with an `ignore` prefix are skipped)."""
    old: dict[str, Any] = {}
    new: dict[str, Any] = {}
    _flatten(measured_part(before), "", old)
    _flatten(measured_part(after), "", new)
    changes = []
    for key in sorted(set(old) | set(new)):
        if ignore and key.startswith(ignore):
            continue
        a, b = old.get(key, "(unset)"), new.get(key, "(unset)")
        if a != b:
            shown = TOML_NAMES.get(key, key)
            changes.append(f"{shown}: {_show(a)} -> {_show(b)}")
    return changes


# -- validation helpers ----------------------------------------------------------------------


class _Table:
    """A TOML table being validated: remembers its path and which keys were consumed."""

    def __init__(self, where: str, path: str, data: Any) -> None:
        if not isinstance(data, dict):
            raise CampaignError(f"{where}: [{path}] must be a table, got {_show(data)}")
        self.where = where
        self.path = path
        self.data = data
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def fail(self, name: str, message: str) -> CampaignError:
        misspelt = self._misspelt()
        if misspelt is not None:
            # `backnd = "nvml"` left backend at its default, and this error follows from that:
            # name the misspelling instead.
            return misspelt
        return CampaignError(f"{self.where}: {self.key(name)}: {message}")

    def _misspelt(self) -> CampaignError | None:
        """An unread key that looks like a misspelling of a key already asked for but absent,
        as a did-you-mean error; None if there is none."""
        targets = sorted(self.used - set(self.data))
        unread = [k for k in self.data if k not in self.used and isinstance(k, str)]
        for target in targets:
            # High cutoff: real keys such as stall_timeout_s and startup_timeout_s are 0.81 alike.
            hint = difflib.get_close_matches(target, unread, n=1, cutoff=0.85)
            if hint:
                kind = "table" if isinstance(self.data[hint[0]], dict) else "key"
                shown = f"[{self.key(hint[0])}]" if kind == "table" else repr(self.key(hint[0]))
                return CampaignError(
                    f"{self.where}: unknown {kind} {shown} (did you mean {target!r}?)"
                )
        return None

    def missing(self, name: str, what: str = "key") -> CampaignError:
        """A required key or table is absent: suggest a misspelt one that is present."""
        shown = f"[{self.key(name)}]" if what == "table" else self.key(name)
        unread = [k for k in self.data if k not in self.used and isinstance(k, str)]
        hint = difflib.get_close_matches(name, unread, n=1, cutoff=0.6)
        suggestion = f" (found {self.key(hint[0])!r}: did you mean {name!r}?)" if hint else ""
        return CampaignError(f"{self.where}: missing required {what} {shown}{suggestion}")

    def get(self, name: str, default: Any = None) -> Any:
        self.used.add(name)
        return self.data.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.data

    def require(self, name: str) -> Any:
        if name not in self.data:
            raise self.missing(name)
        self.used.add(name)
        return self.data[name]

    def sub(self, name: str, required: bool = False) -> _Table:
        if name not in self.data:
            if required:
                raise self.missing(name, "table")
            self.used.add(name)
            return _Table(self.where, self.key(name), {})
        self.used.add(name)
        return _Table(self.where, self.key(name), self.data[name])

    def finish(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if not unknown:
            return
        name = unknown[0]
        allowed = sorted(self.used)
        hint = difflib.get_close_matches(name, allowed, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise CampaignError(
            f"{self.where}: unknown key {self.key(name)!r}{suggestion}; "
            f"allowed in [{self.path or 'top level'}]: {', '.join(allowed)}"
        )

    # typed getters -----------------------------------------------------------------------
    def string(
        self, name: str, default: str | None = None, *, choices: tuple[str, ...] = ()
    ) -> Any:
        value = self.get(name, default)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(name, f"expected a string, got {_show(value)}")
        if choices and value not in choices:
            raise self.fail(name, f"{value!r} is not allowed; choose one of {', '.join(choices)}")
        return value

    def integer(self, name: str, default: int | None = None, *, minimum: int | None = None) -> Any:
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, f"expected an integer, got {_show(value)}")
        if minimum is not None and value < minimum:
            raise self.fail(name, f"must be at least {minimum}, got {value}")
        return value

    def number(
        self,
        name: str,
        default: float | None = None,
        *,
        minimum: float | None = None,
        strictly_positive: bool = False,
    ) -> Any:
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(name, f"expected a number, got {_show(value)}")
        if not math.isfinite(value):  # TOML allows nan and inf; no setting means either
            raise self.fail(name, f"expected a finite number, got {value}")
        if strictly_positive and value <= 0:
            raise self.fail(name, f"must be greater than 0, got {value}")
        if minimum is not None and value < minimum:
            raise self.fail(name, f"must be at least {minimum}, got {value}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise self.fail(name, f"expected true or false, got {_show(value)}")
        return value

    def strings(self, name: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
        value = self.get(name, list(default))
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(name, f"expected a list of strings, got {_show(value)}")
        return tuple(value)


def _show(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- sections --------------------------------------------------------------------------------

TOP_LEVEL = ("campaign", "gpu", "knobs", "engine", "drafters", "workload", "measurement", "corpus")


def _gpu(table: _Table) -> GpuConfig:
    backend = table.string("backend", "twin", choices=("twin", "nvml"))
    profile = table.string("profile")
    if backend == "twin":
        from dvfs.twin.profiles import gpu_profiles

        profiles = tuple(sorted(gpu_profiles()))
        if profile is None:
            raise table.fail(
                "profile", f"the twin needs a GPU profile; choose one of {', '.join(profiles)}"
            )
        if profile not in profiles:
            raise table.fail(
                "profile", f"unknown twin profile {profile!r}; choose one of {', '.join(profiles)}"
            )
    devices = table.get("devices", [0])
    if not isinstance(devices, list) or not devices:
        raise table.fail(
            "devices", f"expected a non-empty list of GPU indices or UUIDs, got {_show(devices)}"
        )
    for device in devices:
        ok_index = isinstance(device, int) and not isinstance(device, bool) and device >= 0
        ok_uuid = isinstance(device, str) and device.startswith(("GPU-", "MIG-"))
        if not (ok_index or ok_uuid):
            raise table.fail(
                "devices",
                f"{_show(device)} is neither a GPU index (0, 1, ...) nor a UUID (GPU-...)",
            )
    if len(set(devices)) != len(devices):
        raise table.fail("devices", "lists a GPU twice")
    actuation = table.string("actuation", "on", choices=("on", "off"))
    table.finish()
    return GpuConfig(backend, profile, tuple(devices), actuation == "on")


def _clock_list(table: _Table, value: Any) -> tuple[int, ...] | None:
    if value == "stock":
        return None
    if isinstance(value, dict):
        rng = _Table(table.where, table.key("sm_clock"), value)
        start = rng.integer("start", minimum=1)
        stop = rng.integer("stop", minimum=1)
        step = rng.integer("step", minimum=1)
        rng.finish()
        if start is None or stop is None or step is None:
            raise table.fail("sm_clock", "a range needs start, stop and step (MHz)")
        if start > stop:
            raise table.fail("sm_clock", f"start {start} is above stop {stop}")
        values = list(range(start, stop + 1, step))
        if values[-1] != stop:
            raise table.fail(
                "sm_clock", f"stop {stop} is not reached from {start} in steps of {step}"
            )
        return tuple(values)
    if isinstance(value, list) and value:
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            raise table.fail("sm_clock", f"expected positive integers (MHz), got {_show(value)}")
        if len(set(value)) != len(value):
            raise table.fail("sm_clock", "lists a clock twice")
        return tuple(value)
    raise table.fail(
        "sm_clock",
        f'expected "stock", a list of MHz values, or {{start, stop, step}}; got {_show(value)}',
    )


def _knobs(table: _Table, gpu: GpuConfig) -> KnobConfig:
    clocks = _clock_list(table, table.get("sm_clock", "stock"))
    limits_raw = table.get("power_limit", "stock")
    limits: tuple[float, ...] | None
    if limits_raw == "stock":
        limits = None
    elif (
        isinstance(limits_raw, list)
        and limits_raw
        and all(
            isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in limits_raw
        )
    ):
        if len(set(limits_raw)) != len(limits_raw):
            raise table.fail("power_limit", "lists a power limit twice")
        limits = tuple(float(v) for v in limits_raw)
    else:
        raise table.fail(
            "power_limit", f'expected "stock" or a list of watts, got {_show(limits_raw)}'
        )
    settle_s = table.number("settle_s", 2.0, minimum=0.0)
    table.finish()
    if gpu.backend == "twin" and gpu.profile:
        from dvfs.gpu.base import unsupported_clock
        from dvfs.twin.profiles import gpu_profile

        profile = gpu_profile(gpu.profile)
        supported = set(profile.supported_sm_clocks_mhz())
        for clock in clocks or ():
            problem = unsupported_clock(clock, supported, of=f" of {gpu.profile}")
            if problem:
                raise table.fail("sm_clock", f"{problem}, in {profile.sm_clock_step_mhz} MHz steps")
        allowed = profile.power_limit_range()
        for limit in limits or ():
            problem = allowed.outside(limit * 1000)
            if problem:
                raise table.fail("power_limit", f"{gpu.profile}: {problem}")
    if not gpu.actuation and (clocks or limits):
        raise table.fail(
            "sm_clock" if clocks else "power_limit",
            'gpu.actuation is "off" (observe-only): knobs must be "stock"',
        )
    return KnobConfig(clocks, limits, settle_s)


def _argv_list(table: _Table, name: str) -> tuple[str, ...]:
    value = table.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str | int | float) for v in value):
        raise table.fail(name, f"expected a list of command-line arguments, got {_show(value)}")
    return tuple(str(v) for v in value)


def _engine(table: _Table, gpu: GpuConfig) -> EngineConfig:
    backend = table.string("backend", "twin", choices=("twin", "sglang"))
    model = table.string("model")
    if model is None:
        raise table.missing("model")
    tp_size = table.integer("tp_size", len(gpu.devices), minimum=1)
    if tp_size != len(gpu.devices):
        raise table.fail(
            "tp_size", f"{tp_size} does not match the {len(gpu.devices)} GPU(s) in gpu.devices"
        )
    twin_model = table.string("twin_model")
    sg = table.sub("sglang")
    url = sg.string("url")
    if url is not None and not re.match(r"^https?://", url):
        raise sg.fail("url", f"expected an http:// or https:// URL, got {url!r}")
    env = sg.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise sg.fail("env", "expected a table of string environment variables")
    sglang = SglangConfig(
        url=url,
        server_command=_argv_list(sg, "server_command"),
        extra_args=_argv_list(sg, "extra_args"),
        version=sg.string("version"),
        host=sg.string("host", "127.0.0.1"),
        startup_timeout_s=sg.number("startup_timeout_s", 900.0, strictly_positive=True),
        request_timeout_s=sg.number("request_timeout_s", 120.0, strictly_positive=True),
        stall_timeout_s=sg.number("stall_timeout_s", 60.0, strictly_positive=True),
        env=tuple(sorted(env.items())),
        attention_backend=_attention_backend(sg),
    )
    _refuse_managed_flags(sg, "extra_args", sglang.extra_args, "drafters.<name>")
    _check_visible_devices(sg, env, gpu)
    sg.finish()
    table.finish()
    if backend == "twin":
        from dvfs.twin.profiles import model_profile

        try:
            model_profile(twin_model or model)
        except CampaignError as exc:
            raise table.fail("twin_model" if twin_model else "model", str(exc)) from exc
    return EngineConfig(backend, model, tp_size, twin_model, sglang)


def _attention_backend(sg: _Table) -> str:
    from dvfs.engines.sglang_args import ATTENTION_BACKENDS, DEFAULT_ATTENTION_BACKEND

    value: str = sg.string("attention_backend", DEFAULT_ATTENTION_BACKEND)
    if value != "auto" and value not in ATTENTION_BACKENDS:
        raise sg.fail(
            "attention_backend",
            f'{value!r} is not an SGLang attention backend; choose "auto" (SGLang picks, dvfs '
            f"checks every drafter gets the same) or one of {', '.join(ATTENTION_BACKENDS)}",
        )
    return value


def _refuse_managed_flags(table: _Table, key: str, args: tuple[str, ...], drafter: str) -> None:
    """Flags dvfs sets itself must not come back through extra_args (argparse keeps the last)."""
    from dvfs.engines.sglang_args import managed_flag

    for token in args:
        found = managed_flag(token, drafter)
        if found is not None:
            flag, use = found
            written = "" if token.split("=", 1)[0] == flag else f" (as {token!r})"
            raise table.fail(key, f"sets {flag}{written}, which dvfs sets itself; use {use}")


def _check_visible_devices(sg: _Table, env: dict[str, Any], gpu: GpuConfig) -> None:
    """dvfs pins the server to gpu.devices by UUID; an env naming other GPUs contradicts it."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return
    entries = [v.strip() for v in value.split(",") if v.strip()]
    if not all(e.startswith(("GPU-", "MIG-")) for e in entries):
        raise sg.fail(
            "env",
            f"CUDA_VISIBLE_DEVICES = {value!r}: CUDA and NVML may number GPUs differently, and "
            "dvfs already pins the server to gpu.devices by UUID; remove CUDA_VISIBLE_DEVICES",
        )
    uuids = [d for d in gpu.devices if isinstance(d, str)]
    if len(uuids) == len(gpu.devices) and entries != uuids:
        raise sg.fail(
            "env",
            f"CUDA_VISIBLE_DEVICES = {value!r} contradicts gpu.devices {list(gpu.devices)}; "
            "remove it (dvfs pins the server to gpu.devices by UUID)",
        )


def _drafter(table: _Table, name: str, engine: EngineConfig) -> DrafterSpec:
    if not NAME_RE.match(name):
        raise CampaignError(
            f"{table.where}: drafter name {name!r} must start with a letter or digit and use only "
            "letters, digits, '_', '-' and '.'"
        )
    raw = table.string("algorithm", "none")
    algorithm = None if raw.lower() == "none" else raw.upper()
    if algorithm is not None and algorithm not in SPECULATIVE_ALGORITHMS:
        raise table.fail(
            "algorithm",
            f"{raw!r} is not a speculative algorithm SGLang knows; choose none or one of "
            f"{', '.join(SPECULATIVE_ALGORITHMS)}",
        )
    draft_model = table.string("draft_model")
    steps = table.integer("num_steps", minimum=1)
    topk = table.integer("eagle_topk", minimum=1)
    draft_tokens = table.integer("num_draft_tokens", minimum=1)
    block = table.integer("block_size", minimum=2)
    extra = _argv_list(table, "extra_args")
    table.finish()
    _refuse_managed_flags(table, "extra_args", extra, table.path)
    if algorithm == "NGRAM" and draft_model is not None:
        raise table.fail(
            "draft_model",
            "NGRAM drafts from the text seen so far and takes no draft model; remove draft_model",
        )
    if algorithm is None:
        given = [
            k
            for k, v in (
                ("draft_model", draft_model),
                ("num_steps", steps),
                ("eagle_topk", topk),
                ("num_draft_tokens", draft_tokens),
                ("block_size", block),
            )
            if v is not None
        ]
        if given:
            raise table.fail(
                given[0], "is set but algorithm is none; set an algorithm or remove it"
            )
        return DrafterSpec(name=name, extra_args=extra)
    if algorithm in NEEDS_DRAFT_MODEL and draft_model is None:
        raise table.fail(
            "draft_model", f"{algorithm} needs a draft model (a path or Hugging Face name)"
        )
    if algorithm == "DFLASH":
        if steps not in (None, 1) or topk not in (None, 1):
            raise table.fail(
                "num_steps",
                "DFLASH drafts one block per step: num_steps and eagle_topk are fixed at 1",
            )
        if block is not None and draft_tokens is not None and block != draft_tokens:
            raise table.fail("block_size", "block_size and num_draft_tokens are aliases; give one")
        size = block or draft_tokens
        return DrafterSpec(name, algorithm, draft_model, 1, 1, size, extra)
    if block is not None:
        raise table.fail("block_size", "only block drafters (DFLASH) take a block size")
    if algorithm in EAGLE_TRIPLE:
        triple = {"num_steps": steps, "eagle_topk": topk, "num_draft_tokens": draft_tokens}
        given = [k for k, v in triple.items() if v is not None]
        if 0 < len(given) < 3:
            missing = [k for k in triple if k not in given]
            raise table.fail(
                missing[0],
                f"SGLang needs num_steps, eagle_topk and num_draft_tokens all set or none "
                f"(it asserts on a partial set); missing {', '.join(missing)}",
            )
        if topk == 1 and steps is not None and draft_tokens != steps + 1:
            raise table.fail(
                "num_draft_tokens",
                "with eagle_topk = 1 SGLang forces num_draft_tokens = num_steps + 1 = "
                f"{steps + 1}, "
                f"not {draft_tokens}",
            )
    if engine.backend == "twin" and algorithm in ("DSPARK", "UNO"):
        raise table.fail(
            "algorithm",
            f'the twin has no model of {algorithm}; use it with engine.backend = "sglang"',
        )
    spec = DrafterSpec(name, algorithm, draft_model, steps, topk, draft_tokens, extra)
    if engine.backend == "twin":
        _check_twin_drafter(table, spec, engine)
    return spec


def _check_twin_drafter(table: _Table, spec: DrafterSpec, engine: EngineConfig) -> None:
    """The twin must know the shape of a standalone draft model: refuse at load, not mid-sweep."""
    from dvfs.engines.twin import plan_drafter
    from dvfs.errors import EngineError
    from dvfs.twin.profiles import model_profile

    try:
        plan_drafter(spec, model_profile(engine.twin_model or engine.model))
    except EngineError as exc:
        raise table.fail("draft_model", str(exc)) from exc


def _token_range(table: _Table, name: str, default: Any) -> tuple[int, int]:
    value = table.get(name, default)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return (value, value)
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
        and value[0] <= value[1]
    ):
        return (value[0], value[1])
    raise table.fail(name, f"expected a positive integer or [min, max], got {_show(value)}")


def _workload(table: _Table, user_corpora: dict[str, Any]) -> WorkloadConfig:
    batches = table.require("batch")
    if (
        not isinstance(batches, list)
        or not batches
        or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in batches)
    ):
        raise table.fail("batch", f"expected a list of positive integers, got {_show(batches)}")
    if len(set(batches)) != len(batches):
        raise table.fail("batch", "lists a batch size twice")
    corpus_names = table.strings("corpora")
    if not corpus_names:
        raise table.fail("corpora", "name at least one corpus")
    if len(set(corpus_names)) != len(corpus_names):
        raise table.fail("corpora", "lists a corpus twice")
    from dvfs.corpora import BUILTIN_CORPORA

    refs = []
    for name in corpus_names:
        if name in user_corpora:
            spec = user_corpora[name]
            refs.append(CorpusRef(name, tuple(sorted(spec.items()))))
        elif name in BUILTIN_CORPORA:
            refs.append(CorpusRef(name))
        else:
            choices = sorted(set(BUILTIN_CORPORA) | set(user_corpora))
            hint = difflib.get_close_matches(name, choices, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise table.fail(
                "corpora",
                f"unknown corpus {name!r}{suggestion}; built-in corpora are "
                f"{', '.join(BUILTIN_CORPORA)}, or define your own in a [corpus.{name}] table",
            )
    input_tokens = _token_range(table, "input_tokens", [16, 4096])
    output_tokens = table.integer("output_tokens", 256, minimum=2)
    mode = table.string("mode", "fixed", choices=MODES)
    temperature = table.number("temperature", 0.0, minimum=0.0)
    ignore_eos = table.boolean("ignore_eos", mode == "fixed")
    pool_size = table.integer("pool_size", minimum=1)
    table.finish()
    if mode == "fixed" and not ignore_eos:
        raise table.fail(
            "ignore_eos",
            "fixed-batch mode needs ignore_eos = true so every request decodes output_tokens",
        )
    if pool_size is not None and pool_size < max(batches):
        raise table.fail(
            "pool_size", f"{pool_size} is smaller than the largest batch ({max(batches)})"
        )
    return WorkloadConfig(
        tuple(batches),
        tuple(refs),
        input_tokens,
        output_tokens,
        mode,
        temperature,
        ignore_eos,
        pool_size,
    )


def _measurement(table: _Table) -> MeasurementConfig:
    m = MeasurementConfig(
        warmup_tokens=table.integer("warmup_tokens", 32, minimum=0),
        min_window_s=table.number("min_window_s", 1.0, strictly_positive=True),
        max_rounds=table.integer("max_rounds", 8, minimum=1),
        repeats=table.integer("repeats", 1, minimum=1),
        seed=table.integer("seed", 0, minimum=0),
        sample_period_s=table.number("sample_period_s", 0.02, strictly_positive=True),
        idle_s=table.number("idle_s", 5.0, minimum=0.0),
        retries=table.integer("retries", 2, minimum=0),
    )
    table.finish()
    if m.sample_period_s * 5 > m.min_window_s:
        raise table.fail(
            "sample_period_s",
            f"{m.sample_period_s:g} s is too coarse for min_window_s = {m.min_window_s:g} s: a "
            "window needs several samples of the energy counter; use at most min_window_s / 5",
        )
    return m


def parse_campaign(
    data: dict[str, Any], *, where: str = "campaign", source: str = "", base_dir: str = "."
) -> Campaign:
    """Validate a parsed TOML document into a `Campaign`."""
    top = _Table(where, "", data)
    meta = top.sub("campaign")
    name = meta.string("name")
    if name is None:
        name = Path(where).stem
        if not NAME_RE.match(name):
            raise CampaignError(
                f"{where}: the file name {name!r} cannot name the campaign (it names the output "
                "folder): set [campaign] name, using letters, digits, '_', '-' and '.'"
            )
    elif not NAME_RE.match(name):
        raise meta.fail(
            "name",
            f"{name!r} cannot be used: the name becomes a folder (out/<name>), so it must start "
            "with a letter or digit and use only letters, digits, '_', '-' and '.'",
        )
    description = meta.string("description", "")
    meta.finish()
    gpu = _gpu(top.sub("gpu"))
    knobs = _knobs(top.sub("knobs"), gpu)
    engine = _engine(top.sub("engine", required=True), gpu)
    drafter_tables = top.sub("drafters")
    drafters = []
    for drafter_name in drafter_tables.data:
        drafter_tables.used.add(drafter_name)
        drafters.append(_drafter(drafter_tables.sub(drafter_name), drafter_name, engine))
    if not drafters:
        drafters = [DrafterSpec("none")]
    user_corpora_table = top.sub("corpus")
    user_corpora: dict[str, Any] = {}
    for corpus_name, spec in user_corpora_table.data.items():
        user_corpora_table.used.add(corpus_name)
        if not isinstance(spec, dict):
            raise CampaignError(f"{where}: [corpus.{corpus_name}] must be a table")
        if not NAME_RE.match(corpus_name):
            raise CampaignError(
                f"{where}: corpus name {corpus_name!r} must use letters, digits, '_', '-', '.'"
            )
        from dvfs.corpora import validate_spec

        validate_spec(corpus_name, spec, where=where)
        user_corpora[corpus_name] = spec
    workload = _workload(top.sub("workload", required=True), user_corpora)
    measurement = _measurement(top.sub("measurement"))
    top.finish()
    if engine.backend == "sglang" and engine.sglang.url is not None and len(drafters) > 1:
        raise CampaignError(
            f"{where}: engine.sglang.url attaches to one running server, so the campaign can have "
            f"only one drafter (it is read from the server); found {len(drafters)}"
        )
    return Campaign(
        name=name,
        description=description,
        gpu=gpu,
        knobs=knobs,
        engine=engine,
        drafters=tuple(drafters),
        workload=workload,
        measurement=measurement,
        source=source,
        base_dir=base_dir,
    )


def load_campaign(path: str | Path) -> Campaign:
    """Read and validate a campaign file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise CampaignError(f"campaign file {path} does not exist") from exc
    except OSError as exc:
        raise CampaignError(f"cannot read campaign file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise CampaignError(
            f"{path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} on line {line}): is "
            "it the campaign file? Save it as UTF-8"
        ) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CampaignError(f"{path}: not valid TOML: {exc}") from exc
    return parse_campaign(data, where=str(path), source=text, base_dir=str(path.parent.resolve()))
