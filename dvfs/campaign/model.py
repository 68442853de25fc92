"""A campaign as frozen configuration: what to sweep, and the hash of what it measures.

A leaf of the package: the engines, the twin and the journal import these types from here,
while loading and validating a campaign file (`dvfs.campaign.validate`) may call into them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dvfs.redact import NOT_RECORDED, redact_argv, redact_text, redact_url

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
#: How a cell's knob levels are measured: one level per cell (settle, warm up, measure), or
#: several levels stepped inside one long decode (`dvfs.measure.inflight`).
MEASUREMENT_MODES = ("per-level", "in-flight")
#: The order in which one in-flight decode visits its knob levels (`dvfs.measure.inflight`):
#: "abba" (forward then backward in every decode) or "serpentine" (forward, then backward in
#: the next decode).
INFLIGHT_ORDERS = ("abba", "serpentine")
#: Where a round ends: at its steady window (the requests still running aborted) or when
#: every request has finished (the drain measured too, as protocols without aborts do).
ROUND_ENDS = ("window", "complete")
#: How often the server warms up: once per server start and (batch, input length) shape, or
#: before every cell (as a protocol that restarts the server per cell must).
WARMUP_EVERY = ("shape", "cell")
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
#: What a session's settings say for an `engine.sglang.env` value it does not record (and
#: what a record says in place of any credential, `dvfs.redact`).
ENV_NOT_RECORDED = NOT_RECORDED
#: Top-level fields that describe a campaign without changing a number.
UNMEASURED = ("name", "description", "source", "base_dir")
#: Dataclass field names shown as the campaign file spells them.
TOML_NAMES = {
    "knobs.sm_clocks_mhz": "knobs.sm_clock",
    "knobs.power_limits_w": "knobs.power_limit",
    "workload.batch_sizes": "workload.batch",
    "gpu.profile_digest": "the twin profile's figures (digest of `twin predict --profile`)",
}


@dataclass(frozen=True)
class GpuConfig:
    backend: str
    profile: str | None
    #: Every GPU, in order (the groups' GPUs, flattened, when there are groups).
    devices: tuple[int | str, ...]
    actuation: bool
    #: `devices = [[0, 1], [2, 3]]` in the file: one worker (a server) per group; () for a
    #: flat list, which is one server on all the devices.
    groups: tuple[tuple[int | str, ...], ...] = ()
    #: A digest of the twin profile's figures when it was read from a file (`dvfs twin predict
    #: --profile`): every fit shares a key, so the key alone would let a journal resume with
    #: another fit's numbers. Empty for the profiles the twin ships (their key is their figures).
    profile_digest: str = ""

    @property
    def server_size(self) -> int:
        """GPUs one server spans: a group's, else all the devices."""
        return len(self.groups[0]) if self.groups else len(self.devices)


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

    @property
    def simulated_model(self) -> str:
        """The model the twin simulates (a profile key or Hugging Face name): `twin_model`, the
        twin's shape for the served model where the campaign gives one, else `model`."""
        return self.twin_model or self.model


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
    max_rounds: int = 32
    repeats: int = 1
    seed: int = 0
    sample_period_s: float = 0.02
    idle_s: float = 5.0
    retries: int = 2
    #: Target relative half-width of the Student-t interval on energy per token and on the
    #: latency metric (rounds within a cell, repeats across the campaign).
    precision: float = 0.01
    #: Confidence of that interval.
    confidence: float = 0.95
    #: Upper bound on repeats when a cell's interval across repeats misses the target
    #: (`repeats` is the minimum; equal to it: no adaptive repeats).
    max_repeats: int = 1
    #: "per-level" (one knob level per cell) or "in-flight" (levels stepped in one decode).
    mode: str = "per-level"
    #: In-flight mode only: the order of the levels in a decode, one of `INFLIGHT_ORDERS`.
    inflight_order: str = "abba"
    #: Where each round ends, one of `ROUND_ENDS`.
    round_end: str = "window"
    #: How often the server warms up, one of `WARMUP_EVERY`.
    warmup_every: str = "shape"
    #: "measured" (the settle time measured at session start) or seconds.
    settle: str | float = "measured"
    #: Thermal stabilisation: load until the temperature's slope falls below this, at most
    #: thermal_max_s.
    thermal_slope_c_per_min: float = 1.0
    thermal_max_s: float = 120.0
    #: Idle baseline at each knob setting (else once per session, at the stock setting).
    idle_per_setting: bool = True


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
        or the operational settings (retries, timeouts, server command, environment, URL).
        Credentials in extra_args (`--api-key KEY`) read NOT_RECORDED (`measured_part`)."""
        return measured_part(asdict(self))

    def operational_dict(self) -> dict[str, Any]:
        """The operational settings, by dotted key (a journal session records these). Of
        `engine.sglang.env` a token's or a path's value is not recorded (`env_value_kept`),
        only its name; nor are the credentials of the URL, the server command and the env
        values it keeps (`dvfs.redact`)."""
        from dvfs.records.session import env_value_kept

        data = _jsonable(asdict(self))
        flat: dict[str, Any] = {}
        for path in OPERATIONAL:
            value: Any = data
            for part in path:
                value = value.get(part) if isinstance(value, dict) else None
            if path[-1] == "env" and isinstance(value, list):
                value = {
                    str(k): redact_text(str(v)) if env_value_kept(str(k)) else ENV_NOT_RECORDED
                    for k, v in value
                }
            elif path[-1] == "url" and isinstance(value, str):
                value = redact_url(value)
            elif path[-1] == "server_command" and isinstance(value, list):
                value = redact_argv(value)
            flat[".".join(path)] = value
        return flat

    def recorded_source(self) -> str:
        """The campaign file's text as a journal (and its cube) keeps it: each
        engine.sglang.env value it may not hold (a token, a path: `env_value_kept`) and each
        credential of the URL, server command and extra_args (`dvfs.redact`) replaced
        by NOT_RECORDED, the text otherwise as written, so it still parses as this campaign.
        "" in the rare layout where a value cannot be told apart (kept nowhere, rather than
        kept whole)."""
        from dvfs.records.session import env_value_kept

        hidden = [k for k, _ in self.engine.sglang.env if not env_value_kept(k)]
        return hide_unrecorded(self.source, hidden)

    @property
    def hash(self) -> str:
        blob = json.dumps(self.semantic_dict(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def drafter(self, name: str) -> DrafterSpec:
        for drafter in self.drafters:
            if drafter.name == name:
                return drafter
        raise KeyError(name)


#: A TOML string literal: multi-line basic or literal, or one-line basic or literal.
_TOML_STRING = re.compile(
    r'"""(?:[^\\]|\\.)*?"""|\'\'\'.*?\'\'\'|"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'', re.S
)


def hide_unrecorded(source: str, env_names: Iterable[str] = ()) -> str:
    """`source` (a campaign file's text) with the value of each of `env_names` in
    engine.sglang.env, and each credential in engine.sglang's url, server_command, extra_args
    and the env values it keeps and in the drafters' extra_args (`dvfs.redact`), replaced by
    NOT_RECORDED (`hide_strings`); as written when there is none."""
    import tomllib

    edits: list[tuple[tuple[str | int, ...], str]] = [
        (("engine", "sglang", "env", name), ENV_NOT_RECORDED) for name in env_names
    ]
    try:
        data = tomllib.loads(source)
    except ValueError:
        return "" if edits else source
    hidden = {path for path, _ in edits}  # an env value not recorded at all
    edits += [e for e in credential_edits(data) if e[0] not in hidden]
    return hide_strings(source, edits) if edits else source


def credential_edits(data: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """Where a campaign's tables (as its file parses) hold credentials, and what each string
    reads instead (`dvfs.redact`)."""
    edits: list[tuple[tuple[str | int, ...], str]] = []

    def argv(path: tuple[str, ...], value: Any) -> None:
        if isinstance(value, list):
            redacted = redact_argv(str(v) for v in value)
            for i, (old, new) in enumerate(zip(value, redacted, strict=True)):
                if str(old) != new:
                    edits.append(((*path, i), new))

    engine = data.get("engine")
    sglang = engine.get("sglang") if isinstance(engine, dict) else None
    if isinstance(sglang, dict):
        url = sglang.get("url")
        if isinstance(url, str) and redact_url(url) != url:
            edits.append((("engine", "sglang", "url"), redact_url(url)))
        env = sglang.get("env")
        for name, value in env.items() if isinstance(env, dict) else ():
            # a value kept (SGLANG_..., CUDA_...) may still hold one: a URL's user and
            # password, NAME=VALUE or --flag VALUE naming a secret
            if isinstance(value, str) and redact_text(value) != value:
                edits.append((("engine", "sglang", "env", name), redact_text(value)))
        argv(("engine", "sglang", "server_command"), sglang.get("server_command"))
        argv(("engine", "sglang", "extra_args"), sglang.get("extra_args"))
    drafters = data.get("drafters")
    if isinstance(drafters, dict):
        for name, table in drafters.items():
            if isinstance(table, dict):
                argv(("drafters", name, "extra_args"), table.get("extra_args"))
    return edits


def hide_strings(source: str, edits: list[tuple[tuple[str | int, ...], str]]) -> str:
    """`source` (a campaign file's text) with the value at each path of `edits` (table keys
    and list indices) replaced by its new string: the one string literal whose replacement
    changes that value and nothing else (the same text may also be, say, the model's name);
    "" when one cannot be found."""
    import copy
    import tomllib

    try:
        data = tomllib.loads(source)
    except ValueError:
        return ""
    text = source
    for path, value in edits:
        expected = copy.deepcopy(data)
        try:
            parent: Any = expected
            for part in path[:-1]:
                parent = parent[part]
            if isinstance(parent, dict) and path[-1] not in parent:
                return ""
            parent[path[-1]] = value
        except (KeyError, IndexError, TypeError):  # not this text's campaign (one made in code)
            return ""
        for match in _TOML_STRING.finditer(text):
            candidate = text[: match.start()] + json.dumps(value) + text[match.end() :]
            try:
                if tomllib.loads(candidate) == expected:
                    break
            except ValueError:
                continue
        else:
            return ""
        text, data = candidate, expected
    return text


def _jsonable(data: Any) -> Any:
    """As JSON would store it (tuples become lists), so stored and fresh dicts compare."""
    return json.loads(json.dumps(data, default=str))


def measured_part(data: dict[str, Any]) -> dict[str, Any]:
    """A campaign dict (fresh, or stored in a journal or cube by any dvfs version) without the
    fields that do not change a measurement."""
    data = _jsonable(data)
    for key in UNMEASURED:
        data.pop(key, None)
    gpu = data.get("gpu")
    if isinstance(gpu, dict) and not gpu.get("groups"):
        gpu.pop("groups", None)  # campaigns without groups keep the hash they had before
    if isinstance(gpu, dict) and not gpu.get("profile_digest"):
        gpu.pop("profile_digest", None)  # a shipped profile: the hash it always had
    measurement = data.get("measurement")
    if isinstance(measurement, dict) and (
        measurement.get("mode", "per-level") != "in-flight"
        or measurement.get("inflight_order") == INFLIGHT_ORDERS[0]
    ):
        # The in-flight order changes nothing a per-level campaign measures, and "abba" is what
        # in-flight campaigns used before the key existed: both keep the hash (and the journals)
        # they had; "serpentine" changes it.
        measurement.pop("inflight_order", None)
    if isinstance(measurement, dict):
        # At their defaults the round end and warm-up keys keep the hash campaigns had before
        # they existed; another value changes what is measured, so it changes the hash.
        if measurement.get("round_end") == ROUND_ENDS[0]:
            measurement.pop("round_end", None)
        if measurement.get("warmup_every") == WARMUP_EVERY[0]:
            measurement.pop("warmup_every", None)
    drafters = data.get("drafters")
    for drafter in drafters if isinstance(drafters, list) else []:
        if isinstance(drafter, dict) and drafter.get("algorithm") == "NGRAM":
            # An NGRAM drafter's num_steps and eagle_topk reached neither SGLang nor the twin
            # (both refused at load since): a journal that recorded them resumes once they are
            # removed, as the refusal asks, and new campaigns keep their hash.
            for key in ("num_steps", "eagle_topk"):
                if key in drafter:
                    drafter[key] = None
    for path in OPERATIONAL:
        parent: Any = data
        for part in path[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    # Credentials in extra_args (`--api-key KEY`) change nothing measured, and a journal or cube
    # must not hold them: hidden here, so in the hash and every record too.
    return without_credentials(data)


def without_credentials(data: dict[str, Any]) -> dict[str, Any]:
    """A campaign dict (as `asdict` or a journal stores it) with the credentials in
    engine.sglang's and the drafters' extra_args hidden (`dvfs.redact`), in place."""
    engine = data.get("engine")
    sglang = engine.get("sglang") if isinstance(engine, dict) else None
    drafters = data.get("drafters")
    for table in [sglang, *(drafters if isinstance(drafters, list) else [])]:
        if isinstance(table, dict) and isinstance(table.get("extra_args"), list):
            table["extra_args"] = redact_argv(table["extra_args"])
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
            changes.append(f"{shown}: {show(a)} -> {show(b)}")
    return changes


def show(value: Any) -> str:
    """A value as an error message quotes it: JSON, cut at 60 characters."""
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
