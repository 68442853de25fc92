"""Session and server records: who ran on which GPUs with which settings, and which server
served each drafter."""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dvfs.records.version import JOURNAL_SCHEMA, stored_float
from dvfs.redact import NOT_RECORDED, SECRET_WORDS, redact_text


@dataclass(frozen=True)
class Stock:
    """The GPU's settings as found: where the cube shows a cell the campaign left stock."""

    sm_clock_mhz: int
    power_limit_w: float

    @staticmethod
    def describe(stock: Stock | None) -> str:
        """The settings in words, for a refusal ("SM clock 1980 MHz, power limit 700 W")."""
        if stock is None:
            return "not recorded"
        return f"SM clock {stock.sm_clock_mhz} MHz, power limit {stock.power_limit_w:g} W"

    @classmethod
    def from_json(cls, data: Any) -> Stock | None:
        """None for anything that is not a stock record (a damaged line)."""
        try:
            clock = int(data["sm_clock_mhz"])
            return cls(clock, float(data["power_limit_w"])) if _int64(clock) else None
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Session:
    """One run of `dvfs sweep`: who ran, on which GPUs, with which operational settings
    (retries, timeouts, server command: free to change between sessions)."""

    gpus: tuple[dict[str, Any], ...]  # `GpuIdentity` as a dict: the gpu module owns its shape
    stock: Stock
    gpu_backend: str
    engine_backend: str
    actuation: bool
    clock: str
    power_limit_range_w: tuple[float, float, float]  # min, max, default
    idle_power_w: float
    measurement_method: str
    token_count_method: str = ""
    corpora: dict[str, Any] = field(default_factory=dict)
    #: How prompts went out to the server: "chat_template:<hash>" (the model's chat template,
    #: hashed) or "plain" (the text alone), as one dvfs recorded it at session start; "" where
    #: the engine formats none (the twin), and in every later session: the server records
    #: say it now (`Server.prompt_format`), known only once a server has started.
    prompt_format: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    host: str = ""
    started: str = ""
    dvfs_version: str = ""
    journal_schema: int = JOURNAL_SCHEMA
    #: When the journal forced its records to disk (`SyncPolicy.describe`); "" before dvfs
    #: recorded it (every record was synced then).
    journal_sync: str = ""
    #: Each GPU's energy-counter update period (s) detected at session start (None: not seen
    #: to move often enough); empty before version 3.
    counter_update_period_s: tuple[float | None, ...] = ()
    #: The settle time the session waited after each knob change and where it came from.
    settle: dict[str, Any] = field(default_factory=dict)
    #: The session's own GPU time: counter detection, idle baseline, settle measurement.
    gpu_time_s: dict[str, float] = field(default_factory=dict)
    #: A fleet's session: each worker's part (`worker` label, `host`, `gpus` UUIDs, ...);
    #: empty for one GPU group.
    workers: tuple[dict[str, Any], ...] = ()
    #: The variables of the environment dvfs starts its SGLang servers with (its own and the
    #: campaign's `engine.sglang.env`) that can change their kernels, numerics or scheduling
    #: (`server_env_of`), name to value; None: not recorded (an older dvfs, the twin, an
    #: attached server), so not compared.
    server_env: dict[str, str] | None = None
    #: The `SERVER_ENV_PREFIXES` `server_env` was recorded under (empty: not said, an earlier
    #: dvfs's `EARLIER_ENV_PREFIXES`; `recorded_env_prefixes`).
    server_env_prefixes: tuple[str, ...] = ()
    #: Other tenants' compute processes seen on the metered GPUs right before or after the
    #: opening idle measurement (`dvfs.measure.tenants.ForeignProcess`: GPU index, pid, name,
    #: start or end), whose work `idle_power_w` then counts; empty where none was seen.
    idle_foreign_processes: tuple[dict[str, Any], ...] = ()
    #: The opening idle measurement fell back to the mean of the instant power readings (an
    #: energy counter updated less than twice in it), or is one reading of them (`idle_s` =
    #: 0): `idle_power_w` is less exact. Recorded
    #: here, as the cells that subtract it are flagged idle_from_power_readings, for where
    #: none does (every cell at a setting with its own baseline). False: the counter's energy
    #: (or before dvfs recorded it).
    idle_from_power_readings: bool = False
    #: The absolute folder of the campaign file the session read, where its corpora's relative
    #: paths start (`Campaign.base_dir`); "" before dvfs recorded it.
    campaign_dir: str = ""
    #: The power limit (W) each GPU held when the session found it, by GPU UUID, where that
    #: was not the stock its stock cells ran at: a cap dvfs applied (`dvfs cap apply`), lifted
    #: while measuring (the stock is the GPU's default limit) and put back at the end. A GPU
    #: whose limit found is the stock is not in it; empty where none (and before dvfs recorded
    #: it). An earlier dvfs recorded one number, its GPU unnamed: under the key "".
    power_limit_found_w: dict[str, float] = field(default_factory=dict)
    #: The UUIDs of the GPUs whose power limit NVML does not support (NOT_SUPPORTED: some
    #: boards, MIG, a VM's restricted passthrough), whose stock power limit (`stock`, each
    #: stock cell's limit check) is the limit NVML says is enforced, not a configured one;
    #: their power-limit range is not known (`power_limit_range_w` NaN, null in JSON). Empty
    #: where every GPU's is configured (and before dvfs recorded it).
    stock_power_limit_enforced: tuple[str, ...] = ()
    #: The lowest and highest SM clock (MHz) the GPU supports, as NVML listed them at the
    #: session's start: a headroom found at the lowest is the GPU's answer, not one the grid
    #: cut off (the sweep refuses a lower clock). NaN where not known (before dvfs recorded it).
    sm_clock_range_mhz: tuple[float, float] = (math.nan, math.nan)

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "session",
            "journal_schema": self.journal_schema,
            "started": self.started,
            "dvfs_version": self.dvfs_version,
            "host": self.host,
            "settings": self.settings,
            "gpu_backend": self.gpu_backend,
            "engine_backend": self.engine_backend,
            "actuation": self.actuation,
            "clock": self.clock,
            "gpus": list(self.gpus),
            "stock": asdict(self.stock),
            "power_limit_range_w": list(self.power_limit_range_w),
            "idle_power_w": self.idle_power_w,
            "measurement_method": self.measurement_method,
            "token_count_method": self.token_count_method,
            "corpora": self.corpora,
            **({"prompt_format": self.prompt_format} if self.prompt_format else {}),
            "journal_sync": self.journal_sync,
            "counter_update_period_s": list(self.counter_update_period_s),
            "settle": self.settle,
            "gpu_time_s": self.gpu_time_s,
            **({"workers": [dict(w) for w in self.workers]} if self.workers else {}),
            **({"server_env": dict(self.server_env)} if self.server_env is not None else {}),
            **(
                {"server_env_prefixes": list(self.server_env_prefixes)}
                if self.server_env is not None and self.server_env_prefixes
                else {}
            ),
            **(
                {"idle_foreign_processes": [dict(p) for p in self.idle_foreign_processes]}
                if self.idle_foreign_processes
                else {}
            ),
            **({"idle_from_power_readings": True} if self.idle_from_power_readings else {}),
            **({"campaign_dir": self.campaign_dir} if self.campaign_dir else {}),
            **(
                {"power_limit_found_w": dict(self.power_limit_found_w)}
                if self.power_limit_found_w
                else {}
            ),
            **(
                {"stock_power_limit_enforced": list(self.stock_power_limit_enforced)}
                if self.stock_power_limit_enforced
                else {}
            ),
            **(
                {"sm_clock_range_mhz": list(self.sm_clock_range_mhz)}
                if all(math.isfinite(c) for c in self.sm_clock_range_mhz)
                else {}
            ),
        }

    @classmethod
    def from_json(cls, record: dict[str, Any], *, version: int) -> Session:
        stock = Stock.from_json(record["stock"])
        if stock is None:
            raise ValueError(f"a session's stock settings are unreadable: {record['stock']!r}")
        # (null: NVML does not support the GPU's power limit, nor then its range)
        low, high, default = (stored_float(w) for w in record["power_limit_range_w"])
        # What a cube keeps as attributes, which netCDF takes only as a number or a text: a
        # damaged (hand-edited) line is a ValueError for the caller to word, not a cube that
        # fails to write ("internal error").
        gpus = tuple(dict(g) for g in record["gpus"])
        for gpu in gpus:
            memory = gpu.get("memory_clock_mhz")
            if "memory_clock_mhz" in gpu and not (
                isinstance(memory, int) and not isinstance(memory, bool) and _int64(memory)
            ):
                raise ValueError(f"a session's GPU memory clock is unreadable: {memory!r:.40}")
            for key in ("name", "driver_version"):
                if key in gpu and not isinstance(gpu[key], str):
                    raise ValueError(f"a session's GPU {key} is unreadable: {gpu[key]!r:.40}")
        for key in ("gpu_backend", "engine_backend", "clock", "measurement_method"):
            if not isinstance(record[key], str):
                raise ValueError(f"a session's {key} is unreadable: {record[key]!r:.40}")
        return cls(
            gpus=gpus,
            stock=stock,
            gpu_backend=record["gpu_backend"],
            engine_backend=record["engine_backend"],
            actuation=bool(record["actuation"]),
            clock=record["clock"],
            power_limit_range_w=(low, high, default),
            idle_power_w=stored_float(record["idle_power_w"]),
            measurement_method=record["measurement_method"],
            token_count_method=record.get("token_count_method") or "",
            corpora=record.get("corpora") or {},
            prompt_format=record.get("prompt_format") or "",
            settings=record.get("settings") or {},
            host=record.get("host") or "",
            started=record.get("started") or "",
            dvfs_version=record.get("dvfs_version") or "",
            journal_schema=version,
            journal_sync=record.get("journal_sync") or "",
            counter_update_period_s=tuple(
                None if p is None else float(p) for p in record.get("counter_update_period_s") or ()
            ),
            settle=record.get("settle") or {},
            gpu_time_s=record.get("gpu_time_s") or {},
            workers=tuple(dict(w) for w in record.get("workers") or ()),
            server_env=recorded_env(record),
            server_env_prefixes=tuple(str(p) for p in record.get("server_env_prefixes") or ()),
            idle_foreign_processes=tuple(
                dict(p) for p in record.get("idle_foreign_processes") or ()
            ),
            idle_from_power_readings=bool(record.get("idle_from_power_readings")),
            campaign_dir=str(record.get("campaign_dir") or ""),
            power_limit_found_w=found_limits(record.get("power_limit_found_w")),
            stock_power_limit_enforced=tuple(
                str(u) for u in record.get("stock_power_limit_enforced") or ()
            ),
            sm_clock_range_mhz=_clock_range(record.get("sm_clock_range_mhz")),
        )

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(g["uuid"] for g in self.gpus)

    def gpus_of(self, worker: str) -> tuple[str, ...]:
        """The UUIDs of the GPUs a worker of this session measured on; all the session's GPUs
        when it names no such worker (one GPU group)."""
        for part in self.workers:
            if str(part.get("worker")) == worker:
                return tuple(str(u) for u in part.get("gpus") or ())
        return self.gpu_uuids


def _int64(value: int) -> bool:
    """Whether an integer fits the 64 bits netCDF stores one in."""
    return -(1 << 63) <= value < 1 << 63


def found_limits(value: Any) -> dict[str, float]:
    """A recorded `power_limit_found_w` (a session's, a fleet worker's) by GPU UUID: each GPU's
    cap found and lifted ({uuid: W}), or an earlier dvfs's one number, its GPU unnamed, under
    the key ""; empty where absent, what is unreadable (a damaged line) left out."""
    if isinstance(value, dict):
        return {str(k): float(v) for k, v in value.items() if _watts(v)}
    return {"": float(value)} if _watts(value) else {}


def _watts(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


#: What every GPU of one journal shares, whichever run and GPU set measured each cell (the
#: identity key, and how messages name it). Cells of GPUs that agree on these compare arm for
#: arm, so any GPUs of that model may finish a campaign others started (after a node loss, on
#: fewer GPUs); a GPU that differs in one belongs in a journal of its own.
GPU_INVARIANTS: dict[str, str] = {
    "name": "GPU model",
    "driver_version": "driver version",
    "memory_clock_mhz": "memory clock (MHz)",
    "max_sm_clock_mhz": "top SM clock (MHz)",
    "backend": "GPU backend",
    "ecc_mode": "ECC mode",
    "vbios_version": "VBIOS version",
}
#: What every session of one journal shares besides its GPUs' identity (the stock settings are
#: checked apart, with their own advice).
SESSION_INVARIANTS: dict[str, str] = {
    "gpu_backend": "GPU backend",
    "engine_backend": "engine",
    "actuation": "knob actuation",
    "clock": "clock",
    "power_limit_range_w": "power-limit range (W)",
    "measurement_method": "measurement method",
}
#: What every session of one journal sends its servers, besides the corpora's content
#: (`corpus_changes`): how prompt tokens were counted (a tokenizer found in one session and not
#: in the next changes which prompts fit the input lengths) and how prompts were formatted.
#: A session that did not record one (an older dvfs; the twin formats nothing) is not compared
#: in it: unknown, not a change.
PROMPT_INVARIANTS: dict[str, str] = {
    "token_count_method": "token-count method",
    "prompt_format": "prompt format",
}


#: What starts the names of the environment variables that every SGLang server of one journal
#: runs with alike (a session's `server_env`), each with why: another value changes the
#: kernels, numerics or scheduling the arms are served with, not the GPU's settings.
SERVER_ENV_PREFIXES: dict[str, str] = {
    "SGLANG_": "SGLang's own switches (speculative v2, kernels, scheduler, memory)",
    "SGL_": "sgl-kernel's switches and SGLang's older names for its own",
    "CUDA_": "the CUDA runtime: launch blocking, lazy module loading, device connections, MPS",
    "FLASHINFER_": "FlashInfer's kernel and JIT choices (its attention and sampling kernels)",
    "TORCH": "PyTorch (TORCH_*) and TorchInductor (TORCHINDUCTOR_*): compiled kernels, NCCL use",
    "PYTORCH_": "PyTorch's CUDA allocator (PYTORCH_CUDA_ALLOC_CONF) and backend switches",
    "TRITON_": "Triton's compiler and autotuner, which build SGLang's Triton kernels",
    "NCCL_": "NCCL's algorithms, protocols and channels: the tensor-parallel all-reduces",
    "NVIDIA_TF32_OVERRIDE": "TF32 forced on or off in cuBLAS and cuDNN: other matmul numerics",
    "CUBLAS_WORKSPACE_CONFIG": "cuBLAS's workspace, which bounds the GEMM algorithms it may "
    "pick (and makes them deterministic)",
    "CUBLASLT_": "cuBLASLt's workspace and heuristics: which GEMM kernels it picks",
}
#: The `SERVER_ENV_PREFIXES` of the dvfs that first recorded sessions' `server_env`: what a
#: session without `server_env_prefixes` recorded. A name only later prefixes match is not
#: compared against such a session (its value then was not recorded: unknown, not unset).
EARLIER_ENV_PREFIXES = (
    "SGLANG_",
    "SGL_",
    "CUDA_",
    "FLASHINFER_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "NCCL_",
    "NVIDIA_TF32_OVERRIDE",
)
#: Names those prefixes match that are left out, each with why.
SERVER_ENV_LEFT_OUT: dict[str, str] = {
    "CUDA_VISIBLE_DEVICES": "dvfs sets it to the metered GPUs' UUIDs; which GPUs measured is "
    "the GPU invariants' and each cell's `measured_on`",
    "CUDA_DEVICE_ORDER": "only how CUDA numbers GPUs, which dvfs names by UUID",
    "NCCL_DEBUG": "NCCL's logging",
    "NCCL_DEBUG_SUBSYS": "NCCL's logging",
    "NCCL_SOCKET_IFNAME": "the node's network interface (fleet nodes differ); a server on one "
    "node all-reduces over NVLink or PCIe",
}
#: Name beginnings those prefixes match that are left out, each with why.
SERVER_ENV_LEFT_OUT_PREFIXES: dict[str, str] = {
    "TORCHELASTIC_": "torchrun's ids of the run and restart count: new on every launch",
}
#: Name endings of locations (caches, installs, logs), and words of secrets: their values are
#: never recorded, as a path compares nothing (another cache builds the same kernels) and a
#: secret must not reach a journal or cube.
SERVER_ENV_UNRECORDED_ENDINGS = ("_HOME", "_PATH", "_DIR", "_DIRECTORY", "_FILE", "_ROOT", "_BASE")
SERVER_ENV_SECRET_WORDS = SECRET_WORDS


def is_server_env(name: str) -> bool:
    """Whether a session records and compares environment variable `name` (`server_env_of`)."""
    upper = name.upper()
    return (
        name.startswith(tuple(SERVER_ENV_PREFIXES))
        and name not in SERVER_ENV_LEFT_OUT
        and not name.startswith(tuple(SERVER_ENV_LEFT_OUT_PREFIXES))
        and not upper.endswith(SERVER_ENV_UNRECORDED_ENDINGS)
        and not any(word in upper for word in SERVER_ENV_SECRET_WORDS)
    )


def env_value_kept(name: str) -> bool:
    """Whether a journal or cube may hold the value of campaign env variable `name` (its
    sessions' settings, its campaign file's text): those it compares, and those it leaves
    out for dvfs's own reasons (`SERVER_ENV_LEFT_OUT`), none of them a secret or a path."""
    return is_server_env(name) or name in SERVER_ENV_LEFT_OUT


def server_env_of(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of a server's environment a session records (`is_server_env`), sorted;
    every other one (a token, a cache path) is left out, value and all, and a credential in
    a value recorded (a URL's user and password, `--api-key KEY`) hidden (`redact_text`)."""
    return {k: redact_text(str(env[k])) for k in sorted(env) if is_server_env(k)}


#: A `NAME=VALUE` argument of a server command: what a wrapper such as `env NAME=VALUE` or
#: `docker run -e NAME=VALUE` (`--env=NAME=VALUE`) sets in the server's environment.
_ASSIGNMENT = re.compile(r"(?:--env=)?([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)
#: A wrapper's option whose next argument (after a `--`, if any) is a line it splits into
#: words: a shell's command line (`sh -c LINE`, `bash -lc LINE`); env's `-S LINE`
#: (`--split-string`) is one of env's only (`_ENV_SPLIT`): only there is a `NAME=VALUE ...`
#: argument split into words.
_LINE_OPTION = re.compile(r"-[A-Za-z]*c[A-Za-z]*")
#: env's split-string option among env's own (`-S LINE`, `-iS LINE`, `--split-string LINE`),
#: its line attached (`-SLINE`, `--split-string=LINE`) the group's. Another program's `-S`
#: is its own (sudo's reads the password from stdin): the argument after it is one word.
_ENV_SPLIT = re.compile(r"-[i0v]*S(.*)|--split-string(?:=(.*))?", re.DOTALL)
#: env's options that take the next argument (`-u NAME`, `-C DIR`): env's options go on.
_ENV_ARGUMENT_OPTIONS = frozenset({"-u", "--unset", "-C", "--chdir"})


def command_env(
    command: Iterable[Any], *, lines: bool = True, keep: Callable[[str], bool] = is_server_env
) -> dict[str, str]:
    """The variables a server command's wrapper sets on its command line (`env NAME=VALUE
    python -m sglang.launch_server`, `docker run -e NAME=VALUE ...`, a shell line `sh -c
    'NAME=VALUE exec python ...'` where `lines`) that a session records (`is_server_env`; those
    `keep` names otherwise), the last of a name winning: the server starts with them whatever
    the environment dvfs hands the wrapper. An argument is one word, spaces and all (`env
    "NAME=a b"` sets NAME to "a b"), but for a line a wrapper splits (after a shell's `-c`,
    env's `-S`)."""
    found: dict[str, str] = {}
    line_next = False  # the argument is a line (it follows a `_LINE_OPTION`, or its `--`)
    env_option = False  # the argument may be one of env's options (it follows `env`'s)
    env_argument = False  # the argument is an env option's (`-u NAME`'s NAME)
    for token in command:
        current = str(token)
        line = line_next
        line_next = bool(_LINE_OPTION.fullmatch(current)) or (line and current == "--")
        if env_argument:  # env's options go on after it
            env_argument = False
            continue
        split = _ENV_SPLIT.fullmatch(current) if env_option else None
        env_argument = env_option and current in _ENV_ARGUMENT_OPTIONS
        env_option = env_option and current.startswith("-") and current != "--"
        env_option = env_option or current.rsplit("/", 1)[-1] == "env"
        if split is not None:
            attached = next((g for g in split.groups() if g), None)
            if attached is None:  # the line is the next argument
                line_next = True
            elif lines:  # the line is this argument's rest: its words are env's arguments
                parts = _shell_words(attached) or [attached]
                found.update(command_env(parts, lines=False, keep=keep))
            continue
        match = _ASSIGNMENT.fullmatch(current)
        if match is None:
            continue
        name, value = match.groups()
        words = _shell_words(value) if lines and line else None
        if words is not None:
            # A shell line (as `dvfs.redact` reads one): the shell sets NAME to the line's first
            # word, not to the rest of the line, whose own NAME=VALUE words it reads on.
            if keep(name):
                found[name] = words[0]
            found.update(command_env(words[1:], lines=False, keep=keep))
        elif keep(name):
            found[name] = value
    return found


def _shell_words(value: str) -> list[str] | None:
    """The words of a NAME=VALUE argument's VALUE where the shell splits it into more than one
    (a shell line: `NAME=VALUE exec python ...`); None otherwise (one word, quoted or not, or
    quotes a shell could not close). What a record hides (`NOT_RECORDED`, in a server command
    as a session's settings keep it) is one word's part, as the value it stands for was."""
    hidden = "\0"  # no shell word holds it: argv strings cannot
    value = value.replace(NOT_RECORDED, hidden)
    if not re.search(r"\s", value):
        return None
    try:
        words = shlex.split(value)
    except ValueError:
        return None
    return [w.replace(hidden, NOT_RECORDED) for w in words] if len(words) > 1 else None


def recorded_env(session: Mapping[str, Any]) -> dict[str, str] | None:
    """A raw session record's `server_env`, with what its server command set on its command
    line (`command_env` of its `settings`' `engine.sglang.server_command`: a session of a dvfs
    that recorded only its own and the campaign's environment still says it); None where it
    has none (not recorded). A credential in a value (an earlier dvfs recorded one) is read
    hidden, as a session records it now (`server_env_of`), so the two compare."""
    env = session.get("server_env")
    if not isinstance(env, Mapping):
        return None
    settings = session.get("settings")
    command = settings.get(SERVER_COMMAND_SETTING) if isinstance(settings, Mapping) else None
    wrapped = command_env(command) if isinstance(command, list | tuple) else {}
    return {**{str(k): redact_text(str(v)) for k, v in env.items()}, **wrapped}


#: The session setting that holds the server command its servers were started with.
SERVER_COMMAND_SETTING = "engine.sglang.server_command"


#: How `env_changes` starts each entry, and what a run whose servers' environment differs
#: from a journal's may do.
SERVER_ENV_CHANGE = "server environment "
SERVER_ENV_ADVICE = (
    "put each back as the journal's servers had it (engine.sglang.env, a NAME=VALUE of "
    "engine.sglang.server_command, or the environment dvfs runs in), or rerun with --fresh "
    "(or into another --out folder)"
)


def recorded_env_prefixes(session: Mapping[str, Any]) -> tuple[str, ...]:
    """The `SERVER_ENV_PREFIXES` a raw session record (or a cube's attributes, comma-joined)
    recorded its `server_env` under: its `server_env_prefixes`, else `EARLIER_ENV_PREFIXES`."""
    given = session.get("server_env_prefixes")
    if isinstance(given, str):
        given = [p for p in given.split(",") if p]
    return tuple(str(p) for p in given) if given else EARLIER_ENV_PREFIXES


def env_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """Each recorded server environment variable (`SERVER_ENV_PREFIXES`) that differs between
    two session records ("server environment CUDA_LAUNCH_BLOCKING: unset -> '1'"), where both
    recorded one, under prefixes both recorded (`recorded_env_prefixes`)."""
    a, b = recorded_env(before), recorded_env(now)
    if a is None or b is None:
        return []
    both = tuple(set(recorded_env_prefixes(before)) & set(recorded_env_prefixes(now)))
    return [
        f"{SERVER_ENV_CHANGE}{name}: {_env_value(a, name)} -> {_env_value(b, name)}"
        for name in sorted(a.keys() | b.keys())
        if a.get(name) != b.get(name) and name.startswith(both)
    ]


def only_env_changed(changes: Iterable[str]) -> bool:
    """Whether every entry of `incomparable` is a server environment variable's."""
    texts = list(changes)
    return bool(texts) and all(t.startswith(SERVER_ENV_CHANGE) for t in texts)


def _env_value(env: Mapping[str, str], name: str) -> str:
    return repr(env[name]) if name in env else "unset"


#: What every server of one drafter shares across a journal (the server record's key, and how
#: messages name it): another engine version or attention kernel would make its arms compare
#: software, not the GPU's settings.
SERVER_INVARIANTS: dict[str, str] = {
    "engine": "engine",
    "version": "engine version",
    "attention_backend": "attention kernels",
}


def _engine_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What differs between two server records in the `SERVER_INVARIANTS`, and in the model's
    Hub commit where both recorded one (`Server.model_commit`) and that commit changed a file
    both servers' snapshots hold (`Server.model_files`, where both recorded them)."""
    changes = [
        f"{label}: {before.get(key) or 'unknown'} -> {now.get(key) or 'unknown'}"
        for key, label in SERVER_INVARIANTS.items()
        if (before.get(key) or None) != (now.get(key) or None)
    ]
    a, b = before.get("model_commit"), now.get("model_commit")
    if a and b and a != b:  # another commit of an unpinned model: other weights or config
        changed = _files_changed(before.get("model_files"), now.get("model_files"))
        if changed is None:
            changes.append(f"model commit: {a} -> {b}")
        elif changed:
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            changes.append(f"model commit: {a} -> {b} ({', '.join(changed[:3])}{more})")
    return changes


def _files_changed(before: Any, now: Any) -> list[str] | None:
    """The files two servers' Hub snapshots both hold whose blobs differ (`Server.model_files`),
    but for those no server loads (`_unserved`), and the weights files one holds and the other
    not (`_weights`, where both hold some): empty where none (another commit that changed none
    of what both servers loaded: a model card edited upstream); None where either record
    holds none or they share no such file, so the commits themselves are compared."""
    if not isinstance(before, Mapping) or not isinstance(now, Mapping):
        return None
    both = sorted(name for name in before.keys() & now.keys() if not _unserved(str(name)))
    if not both:
        return None
    changed = [name for name in both if before[name] != now[name]]
    # A server fetches every safetensors file of its commit (SGLang's download_weights_from_hf,
    # as a whole repo's download): where both hold some, other names are other weights (a
    # commit that sharded them anew), though the files both hold be the same blobs. Where both
    # hold the shards' index, the server loads the files it names, no other (a Mistral repo's
    # consolidated.safetensors beside them, one snapshot fetched without it): the index, being
    # the same blob or not, says it.
    weights = [{n for n in files if _weights(str(n))} for files in (before, now)]
    if all(weights) and not (_INDEX in before and _INDEX in now):
        changed += sorted(weights[0] ^ weights[1])
    return changed


#: The shards' index: a server loads the safetensors files it names, the others dropped as their
#: duplicates (SGLang's filter_duplicate_safetensors_files).
_INDEX = "model.safetensors.index.json"


def _weights(name: str) -> bool:
    """A weights file a server loads: the repo's top-level `*.safetensors` (not `original/`)."""
    return "/" not in name and name.endswith(".safetensors")


#: What a model repo holds that no server loads (the card, licence, figures): a whole repo's
#: download (`huggingface-cli download`) has them in its snapshot, a server's fetch does not.
_UNSERVED_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp", ".pdf")
_UNSERVED_NAMES = (".gitattributes", "license", "notice")


def _unserved(name: str) -> bool:
    base = name.rsplit("/", 1)[-1].lower()
    return base.endswith(_UNSERVED_SUFFIXES) or base.startswith(_UNSERVED_NAMES)


#: Resolved args SGLang may set otherwise for each drafter (`ARM_ARGS` says why each), so the
#: arms are not compared in them, but one drafter's servers of a journal are: another value
#: on a resume is another server flag (a `server_command` wrapper's `--mem-fraction-static`),
#: which the cube, keeping each drafter's newest server, would not show.
DRAFTER_ARGS = (
    "max_running_requests",
    "mem_fraction_static",
    "enable_multi_layer_eagle",
    "enable_lora_overlap_loading",
    "lora_strict_loading",
    "linear_attn_verify_backend",
    "mamba_ssm_dtype",
)


def server_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What differs between two server records of one drafter ("engine version: A -> B"): the
    `SERVER_INVARIANTS`, and the drafter's own resolved speculative args (`speculative_*`)
    and `DRAFTER_ARGS`, since one drafter's cells must share one configuration even where the
    engine's version did not change but how it resolves unset numbers did. Where both records
    name one engine and version, such an arg one reports and the other not is a change too
    ("speculative_num_steps: 3 -> not reported"), as in `arm_changes`."""
    changes = _engine_changes(before, now)
    old, new = before.get("args"), now.get("args")
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        one_release = _one_release(before, now)
        own = sorted(k for k in {*old, *new} if k.startswith("speculative_") or k in DRAFTER_ARGS)
        for key in own:
            if key in old and key in new:
                if _same(old[key]) != _same(new[key]):
                    changes.append(f"{key}: {old[key]!r} -> {new[key]!r}")
            elif one_release:
                changes.append(f"{key}: {_reported(old, key)} -> {_reported(new, key)}")
    return changes


def what_differs(changes: Iterable[str]) -> str:
    """What two servers that differ in `changes` (`server_changes`) would compare besides the
    settings: "software" (the engine, its version or kernels, the model's commit), "engine
    flags" (their resolved args), or both."""
    software = {*SERVER_INVARIANTS.values(), "model commit"}
    kinds = {change.partition(": ")[0] in software for change in changes}
    return " and ".join(
        what
        for what, there in (("software", True in kinds), ("engine flags", False in kinds))
        if there
    )


#: Where a refusal's line names its changes, filled in (`listed_changes`) once the rest of
#: the line is known.
CHANGES = "\x00changes\x00"


def listed_changes(changes: Sequence[str], room: int) -> str:
    """`changes` joined, as many as fit in `room` characters, the rest counted ("; and 3
    more"), so that a line naming them keeps, within an error line's bound
    (`MAX_MESSAGE_CHARS`), the remedy that follows them."""
    for shown in range(len(changes), 0, -1):
        more = len(changes) - shown
        text = "; ".join(changes[:shown]) + (f"; and {more} more" if more else "")
        if len(text) <= room:
            return text
    return f"{len(changes)} differences"


def with_changes(line: str, changes: Sequence[str], room: int) -> str:
    """A refusal's `line` with its `changes` named where it says CHANGES, as many as fit the
    `room` the whole line has (an error line's bound, `MAX_MESSAGE_CHARS`, less what is said
    ahead of it): they give way to the remedy that follows them, which ends the line whole."""
    return line.replace(CHANGES, listed_changes(changes, room - len(line)), 1)


def restart_as_it_was(changes: Iterable[str], attached: bool = False) -> str:
    """What brings back a drafter's server that differs from its own earlier one in `changes`
    (`server_changes`): the same SGLang and flags, and where the memory fraction differs, why
    it may have though no flag changed. `attached`: a server dvfs attached to
    (engine.sglang.url), started by its user's own command, not engine.sglang.server_command."""
    why = ""
    if any(change.startswith("mem_fraction_static: ") for change in changes):
        # SGLang 0.5.23 memory_hook.py `handle_gpu_memory_settings` reads every GPU's memory
        why = (
            "; SGLang also sizes an unset mem_fraction_static by the host's smallest GPU, "
            "whatever CUDA_VISIBLE_DEVICES"
        )
    if attached:
        return (
            "restart the server at engine.sglang.url as it was (the same SGLang, and the same "
            f"flags and environment it was started with{why})"
        )
    return (
        "start it as it was (the same SGLang, and the same flags from "
        f"engine.sglang.server_command and env{why})"
    )


#: Resolved server args every drafter's server of one journal shares, whatever its drafter
#: (what /server_info reports, kept in the server record's `args`): what the target model
#: computes with and how its batches are scheduled. Read from SGLang's sources (0.5.9:
#: python/sglang/srt/server_args.py; 0.5.23: python/sglang/srt/arg_groups/*.py):
#: - page size, chunked prefill and the radix cache: neither release sets them per algorithm on
#:   a CUDA GPU (0.5.9 `_handle_page_size` and `_handle_gpu_memory_settings`; 0.5.23
#:   overrides.py `_page_size_default`, memory_hook.py `handle_gpu_memory_settings`).
#:   0.5.23 on Blackwell leaves fa4's page size at 1 for EAGLE trees (overrides.py
#:   `_fa4_page_constraint`) and a trtllm_mha draft backend moves it to 64
#:   (`_mla_backend_page_constraints`): compared, those arms are refused. 0.5.9 also
#:   disables the radix cache for a speculative arm of a hybrid Mamba model under the
#:   `no_buffer` strategy (server_args.py lines 1760-1763): compared, such arms are refused
#:   rather than measured with and without the cache.
#: - the overlap scheduler: 0.5.9 turns it off for every speculative algorithm (server_args.py
#:   lines 2372-2384 and 2473: EAGLE/EAGLE3/STANDALONE unless SGLANG_ENABLE_SPEC_V2, NGRAM
#:   always), so dvfs turns it off for every arm there (`dvfs.engines.sglang_args`); 0.5.23
#:   only on a CPU (speculative_hook.py `_disable_overlap_schedule_for_cpu`).
#: - mixed chunked prefill: 0.5.9 turns it off for every algorithm (lines 2390 and 2474),
#:   0.5.23 for NGRAM, STANDALONE and UNO (speculative_hook.py lines 1307, 1112, 600; which
#:   keep it: speculative/spec_info.py `supports_mixed_chunk`). dvfs never sets it; a campaign
#:   that does is refused before any server starts when its drafters would disagree.
#: - the sampling kernels, torch.compile and deterministic inference: neither release sets them
#:   per algorithm (the sampling backend is FlashInfer's where the install has FlashInfer, else
#:   PyTorch's, 0.5.9 `_handle_sampling_backend`); a server started otherwise (another install,
#:   another server_command, an attached server) samples or computes with other kernels.
#: - the stream interval, schedule policy and conservativeness: neither release sets them per
#:   algorithm (the conservativeness is scaled only for DP attention, with `dp_size`, compared);
#:   another value streams a round's tokens in other chunks or admits and preempts its
#:   requests otherwise.
#: - where a request's unset sampling parameters come from (`sampling_defaults`: the model's
#:   generation_config or OpenAI's; `preferred_sampling_params`): dvfs sends the temperature
#:   alone, so these set every arm's top_p, top_k and min_p, and with them how often a draft
#:   is accepted at a temperature above 0. Neither release sets them per algorithm.
#: - custom all-reduce and DP attention: how a tensor-parallel server's ranks exchange
#:   activations and split attention (DP attention is dropped where dp_size is 1, compared);
#:   set for deterministic inference or by the placement, never per algorithm.
#: - the model's implementation (`model_impl`: SGLang's own or transformers'), FP32 logits
#:   (`enable_fp32_lm_head`) and TF32 matmuls (0.5.23 `enable_tf32_matmul`, the flag beside
#:   the NVIDIA_TF32_OVERRIDE the servers' environment is compared in): other kernels or
#:   numerics for the target model, set per model architecture (0.5.23 overrides.py), never
#:   per algorithm.
#: - the scheduler's budgets and pace: the prefill token and request caps, the KV pool's token
#:   cap, the decode tokens reserved per request, decode steps per scheduling round, how often
#:   the scheduler polls for requests and whether it sleeps when idle, the radix cache's
#:   eviction policy, the prefill delayer, and 0.5.23's retraction policy and prefill/decode
#:   interleaving: neither release sets them per algorithm (the delayer may come from
#:   SGLANG_SCHEDULER_DECREASE_PREFILL_IDLE and SGLANG_PREFILL_DELAYER_*; 0.5.23 picks an
#:   interleaving and an eviction policy for Qwen3-VL on Hopper); another value admits,
#:   chunks, retracts or steps a round's requests otherwise.
#: - the hierarchical (host) KV cache, its write policy, IO backend and layout, and MLA's
#:   chunked prefix cache: other copies and prefill kernels for the target; set from one
#:   another, the storage backend or 0.5.23's unified memory, never per algorithm.
#: - weights offloaded to the CPU (`cpu_offload_gb`, the `offload_*` layer groups): the
#:   target's layers stream from host memory; never set by SGLang.
#: - CUDA graphs beyond the decode graph each batch replays (`decode_graph`): padding off (a
#:   batch between captured sizes runs eager), the torch.compile batch limit, 0.5.9's
#:   piecewise prefill graphs, 0.5.23's prefill graphs and decode graph backend: another
#:   prefill or decode path; set per model or from compared args (the chunked prefill size,
#:   the KV pool cap), never per algorithm (0.5.23 sets torch_compile_max_bs on a CPU alone).
#: - kernel choices and their numerics for the target model: Triton attention's KV splits,
#:   tile and FP32 reduction; FP8/FP4/BF16 GEMM runners; MoE runner, all-to-all, DeepEP mode,
#:   expert placement (EPLB), shared-expert fusion, two- and single-batch overlap, dense TP;
#:   the DP LM head; all-reduce transports (symmetric memory, MSCCL++, NVLS, FlashInfer's
#:   fused all-reduce); fused QK-norm/RoPE; FlashInfer autotuning; the sparse attention
#:   backends of DeepSeek's NSA/DSA/V4 and the linear-attention/Mamba backends of hybrid
#:   models (prefill and decode; not the verify backend, set for speculation); set per model,
#:   quantization or device, never per algorithm (0.5.9 derives the draft's
#:   `speculative_moe_runner_backend` from moe_runner_backend, not the other way round).
#: - what the model computes: `json_model_override_args` (its config), the quantization's
#:   parameters (`quantization_param_path`, `modelopt_quant`, 0.5.9 `torchao_config`), the RL
#:   on-policy target, 0.5.9's NaN detection and double sparsity (approximate attention), LoRA
#:   layers (`enable_lora`; 0.5.23 refuses them for UNO, which sets only the loading flags)
#:   and the hidden states a decode graph keeps (`enable_return_hidden_states`): another model,
#:   other numerics or other work per step; never set per algorithm.
#: - sparse and context-parallel attention and the KV pools' layout: 0.5.23's hierarchical
#:   sparse attention, page-major KV layout, unified memory, SWA prefix tails and C128 pages,
#:   both releases' SWA pool (`disable_hybrid_swa_memory`, `swa_full_tokens_ratio`), attention,
#:   prefill and decode context parallelism and KV sharding, 0.5.9's NSA prefill CP: which
#:   tokens a step attends to, where their KV lives and how ranks split it. Neither release
#:   sets them per algorithm (0.5.23 sets the page-major layout from unified memory,
#:   kv_cache_hook.py `handle_page_major_kv_layout`, and attn_cp_size for DeepSeek models by
#:   placement, model_overrides/deepseek_v2.py; 0.5.9 the SWA pool per model, server_args.py
#:   `_handle_model_specific_adjustments`, and for GPT-OSS by its attention kernels, which
#:   follow the GPU's architecture when left to SGLang: `dvfs.cube.merge.AUTO_KERNEL_ARGS`).
#: - more kernels and their numerics for the target that neither release's resolution code
#:   (0.5.9 server_args.py; 0.5.23 arg_groups/, speculative/) ever sets: Lean attention,
#:   FlashInfer MLA's ragged prefill, NVIDIA's megakernel and AMD's monokernel, the fused MoE
#:   all-reduce and INT8 TP communications, aiter's decode all-reduce fusion, FP4 MoE's
#:   all-gather, FlashInfer autotune's skipped ops, MoE dispatch (DeepEP's config and dtype,
#:   FuseEP, W4A4 MegaMoE, Waterfill), paged and CPU (KTransformers) experts, EPLB's pace,
#:   LayerNorm sequence parallelism, the scattered short convolution, attention-TP sharding of
#:   dense and shared experts, the DSA/QSA indexers, encoder SWA replay, ReplaySSM, and the
#:   Mamba cache's rounding, INT8 checkpoints and size; and pipeline micro-batching.
#: - the scheduler's priority queue, pipeline dynamic chunking and the prefill admission delay
#:   (`min_free_slots_delay`); watermarking (other sampled tokens); ModelOpt quantization at
#:   load (`quantize_and_serve`); and the tokenizer's mode and backend (the same prompt split
#:   into other tokens): never set by either release. (0.5.23's scheduler holds prefills back
#:   for DFLASH and DSPARK where `min_free_slots_delay` is unset, its arg left None: compared
#:   apart, `admission_hold`.)
#: The args deliberately not compared are named, with their reasons, in
#: `dvfs.records.uncompared.NOT_COMPARED`.
#: Not compared, as SGLang sets them for speculation (the cube keeps each drafter's in its
#: `server_args`): max_running_requests (48 unless given; dvfs gives the largest batch),
#: mem_fraction_static (0.5.9 reserves 2 GiB for an EAGLE draft, 6 GiB for a STANDALONE one,
#: lines 1051-1057: a smaller KV pool, not other kernels), the speculative_* args, multi-layer
#: EAGLE (`enable_multi_layer_eagle`: 0.5.9 lines 1406 and 1427, 0.5.23 model overrides, for an
#: EAGLE arm of some models), UNO's LoRA loading (`enable_lora_overlap_loading`,
#: `lora_strict_loading`: 0.5.23 speculative_hook.py `_handle_uno`), the linear-attention
#: verify kernels and the replay-SSM state dtype (`linear_attn_verify_backend`,
#: `mamba_ssm_dtype`: 0.5.23 sets them for speculative verify). The attention
#: kernels are compared apart (`SERVER_INVARIANTS`), and the decode CUDA graphs per batch size
#: by `decode_graph`.
ARM_ARGS: dict[str, str] = {
    "model_path": "model",
    "tokenizer_path": "tokenizer",
    "revision": "model revision",
    "dtype": "dtype",
    "quantization": "quantization",
    "kv_cache_dtype": "KV-cache dtype",
    "load_format": "load format",
    "context_length": "context length",
    "tp_size": "tensor parallelism",
    "pp_size": "pipeline parallelism",
    "dp_size": "data parallelism",
    "ep_size": "expert parallelism",
    "trust_remote_code": "remote code",
    "disable_cuda_graph": "CUDA graphs disabled",
    "page_size": "KV page size",
    "chunked_prefill_size": "chunked prefill size",
    "disable_radix_cache": "radix cache disabled",
    "disable_overlap_schedule": "overlap scheduler disabled",
    "enable_mixed_chunk": "mixed chunked prefill",
    "random_seed": "random seed",
    "sampling_backend": "sampling kernels",
    "enable_torch_compile": "torch.compile",
    "enable_deterministic_inference": "deterministic inference",
    "stream_interval": "stream interval",
    "schedule_policy": "schedule policy",
    "schedule_conservativeness": "schedule conservativeness",
    "sampling_defaults": "sampling defaults",
    "preferred_sampling_params": "preferred sampling params",
    "disable_custom_all_reduce": "custom all-reduce disabled",
    "enable_dp_attention": "DP attention",
    "model_impl": "model implementation",
    "enable_fp32_lm_head": "FP32 logits",
    "enable_tf32_matmul": "TF32 matmuls",
    "max_prefill_tokens": "prefill token budget",
    "prefill_max_requests": "prefill request cap",
    "max_total_tokens": "KV pool token cap",
    "num_reserved_decode_tokens": "reserved decode tokens",
    "num_continuous_decode_steps": "continuous decode steps",
    "scheduler_recv_interval": "scheduler poll interval",
    "sleep_on_idle": "sleep on idle",
    "radix_eviction_policy": "radix cache eviction policy",
    "enable_prefill_delayer": "prefill delayer",
    "prefill_delayer_max_delay_passes": "prefill delayer passes",
    "prefill_delayer_max_delay_ms": "prefill delayer delay",
    "prefill_delayer_queue_min_ratio": "prefill delayer queue ratio",
    "prefill_delayer_token_usage_low_watermark": "prefill delayer watermark",
    "retraction_policy": "retraction policy",
    "prefill_decode_interval": "prefill/decode interval",
    "prefill_decode_interval_min_bs": "prefill/decode interval batch",
    "enable_hierarchical_cache": "hierarchical KV cache",
    "hicache_write_policy": "hierarchical cache write policy",
    "hicache_io_backend": "hierarchical cache IO kernels",
    "hicache_mem_layout": "hierarchical cache layout",
    "disable_chunked_prefix_cache": "chunked prefix cache disabled",
    "cpu_offload_gb": "CPU-offloaded weights",
    "offload_group_size": "offload group size",
    "offload_num_in_group": "offloaded layers per group",
    "offload_prefetch_step": "offload prefetch step",
    "offload_mode": "offload mode",
    "disable_cuda_graph_padding": "CUDA graph padding disabled",
    "torch_compile_max_bs": "torch.compile batch limit",
    "enable_piecewise_cuda_graph": "piecewise CUDA graphs",
    "piecewise_cuda_graph_max_tokens": "piecewise CUDA graph tokens limit",
    "piecewise_cuda_graph_tokens": "piecewise CUDA graph tokens",
    "piecewise_cuda_graph_compiler": "piecewise CUDA graph compiler",
    "disable_prefill_cuda_graph": "prefill CUDA graphs disabled",
    "cuda_graph_backend_prefill": "prefill CUDA graph backend",
    "cuda_graph_max_bs_prefill": "prefill CUDA graph limit",
    "cuda_graph_bs_prefill": "prefill CUDA graph sizes",
    "cuda_graph_max_seq_len_prefill": "prefill CUDA graph sequence limit",
    "cuda_graph_prefill_max_context": "prefill CUDA graph context limit",
    "disable_decode_cuda_graph": "decode CUDA graphs disabled",
    "cuda_graph_backend_decode": "decode CUDA graph backend",
    "triton_attention_num_kv_splits": "Triton attention KV splits",
    "triton_attention_split_tile_size": "Triton attention tile size",
    "triton_attention_reduce_in_fp32": "Triton attention FP32 reduction",
    "fp8_gemm_runner_backend": "FP8 GEMM kernels",
    "fp4_gemm_runner_backend": "FP4 GEMM kernels",
    "bf16_gemm_backend": "BF16 GEMM kernels",
    "moe_runner_backend": "MoE kernels",
    "moe_a2a_backend": "MoE all-to-all",
    "flashinfer_mxfp4_moe_precision": "MXFP4 MoE precision",
    "deepep_mode": "DeepEP mode",
    "enable_eplb": "expert load balancing",
    "ep_num_redundant_experts": "redundant experts",
    "ep_dispatch_algorithm": "expert dispatch",
    "init_expert_location": "expert placement",
    "disable_shared_experts_fusion": "shared experts fusion disabled",
    "enforce_shared_experts_fusion": "shared experts fusion enforced",
    "enable_two_batch_overlap": "two-batch overlap",
    "enable_single_batch_overlap": "single-batch overlap",
    "tbo_token_distribution_threshold": "two-batch overlap threshold",
    "moe_dense_tp_size": "MoE dense TP",
    "enable_dp_lm_head": "DP LM head",
    "enable_symm_mem": "symmetric memory",
    "enable_torch_symm_mem": "torch symmetric memory",
    "enable_mscclpp": "MSCCL++ all-reduce",
    "enable_nccl_nvls": "NCCL NVLS",
    "enable_flashinfer_allreduce_fusion": "fused all-reduce",
    "enable_fused_qk_norm_rope": "fused QK norm and RoPE",
    "disable_flashinfer_autotune": "FlashInfer autotune disabled",
    "nsa_prefill_backend": "NSA prefill kernels",
    "nsa_decode_backend": "NSA decode kernels",
    "dsa_prefill_backend": "DSA prefill kernels",
    "dsa_decode_backend": "DSA decode kernels",
    "dsa_topk_backend": "DSA top-k kernels",
    "dsa_paged_mqa_logits_backend": "DSA MQA logits kernels",
    "dsv4_attn_backend": "DeepSeek-V4 attention kernels",
    "dsv4_prefill_backend": "DeepSeek-V4 prefill kernels",
    "linear_attn_backend": "linear attention kernels",
    "linear_attn_prefill_backend": "linear attention prefill kernels",
    "linear_attn_decode_backend": "linear attention decode kernels",
    "mamba_backend": "Mamba kernels",
    "json_model_override_args": "model config overrides",
    "quantization_param_path": "quantization params",
    "modelopt_quant": "ModelOpt quantization",
    "torchao_config": "torchao quantization",
    "rl_on_policy_target": "RL on-policy target",
    "enable_nan_detection": "NaN detection",
    "enable_double_sparsity": "double sparsity",
    "ds_channel_config_path": "double sparsity channels",
    "ds_heavy_channel_num": "double sparsity heavy channels",
    "ds_heavy_channel_type": "double sparsity channel type",
    "ds_heavy_token_num": "double sparsity heavy tokens",
    "ds_sparse_decode_threshold": "double sparsity threshold",
    "enable_lora": "LoRA layers",
    "enable_return_hidden_states": "hidden states kept",
    "enable_hisparse": "hierarchical sparse attention",
    "hisparse_config": "hierarchical sparse attention config",
    "hierarchical_sparse_attention_extra_config": "hierarchical sparse attention config",
    "enable_page_major_kv_layout": "page-major KV layout",
    "enable_unified_memory": "unified KV memory",
    "disable_hybrid_swa_memory": "hybrid SWA memory disabled",
    "swa_full_tokens_ratio": "SWA KV token ratio",
    "swa_prefix_tails": "SWA prefix tails",
    "attn_cp_size": "attention context parallelism",
    "dcp_size": "decode context parallelism",
    "enable_prefill_cp": "prefill context parallelism",
    "cp_strategy": "context parallel sharding",
    "enable_nsa_prefill_context_parallel": "NSA prefill context parallelism",
    "nsa_prefill_cp_mode": "NSA prefill context parallel split",
    "enable_kv_cache_sharding": "KV cache sharding",
    "enable_dsa_cache_layer_split": "DSA cache layer split",
    "enable_lean_attention": "Lean attention",
    "flashinfer_mla_disable_ragged": "FlashInfer MLA ragged prefill disabled",
    "enable_nvidia_megakernel": "NVIDIA megakernel",
    "enable_amd_monokernel": "AMD monokernel",
    "enable_fused_moe_sum_all_reduce": "fused MoE sum all-reduce",
    "enable_quant_communications": "INT8 TP communications",
    "disable_aiter_allreduce_fusion_in_decode": "aiter decode all-reduce fusion disabled",
    "disable_flashinfer_cutlass_moe_fp4_allgather": "FP4 MoE all-gather quantization disabled",
    "flashinfer_autotune_skip_ops": "FlashInfer autotune skipped ops",
    "deepep_config": "DeepEP config",
    "deepep_dispatcher_output_dtype": "DeepEP dispatch dtype",
    "fuseep_mode": "FuseEP MoE mode",
    "enable_w4a4_mxfp4_megamoe": "W4A4 MXFP4 MegaMoE",
    "enable_waterfill": "Waterfill shared-expert dispatch",
    "enable_paged_experts": "paged experts",
    "paged_experts_num_resident": "resident experts",
    "enable_layernorm_sp": "LayerNorm sequence parallelism",
    "enable_scattered_sconv": "scattered short convolution",
    "enable_dense_mlp_attn_tp": "dense MLP over attention TP",
    "enable_shared_experts_attn_tp": "shared experts over attention TP",
    "shared_experts_tp_size": "shared experts TP",
    "disable_attn_tp_gather": "attention TP gather disabled",
    "eplb_rebalance_num_iterations": "EPLB rebalance interval",
    "eplb_rebalance_layers_per_chunk": "EPLB layers per rebalance",
    "eplb_min_rebalancing_utilization_threshold": "EPLB utilization threshold",
    "kt_method": "KTransformers CPU expert format",
    "kt_num_gpu_experts": "KTransformers GPU experts",
    "kt_cpuinfer": "KTransformers CPU threads",
    "kt_threadpool_count": "KTransformers thread pools",
    "kt_max_deferred_experts_per_token": "KTransformers deferred experts",
    "dsa_triton_union": "DSA Triton union",
    "enable_deepseek_v4_fp4_indexer": "DeepSeek-V4 FP4 indexer",
    "enable_dsa_fused_indexer": "DSA fused indexer",
    "qsa_indexer_dtype": "QSA indexer dtype",
    "enable_encoder_swa_bounded_replay": "encoder SWA bounded replay",
    "c128_page_size": "C128 KV page size",
    "enable_linear_replayssm": "ReplaySSM decode kernel",
    "linear_replayssm_cache_len": "ReplaySSM ring length",
    "enable_mamba_cache_stochastic_rounding": "Mamba cache stochastic rounding",
    "mamba_cache_philox_rounds": "Mamba cache Philox rounds",
    "enable_int8_mamba_checkpoint": "INT8 Mamba checkpoints",
    "int8_mamba_ckpt_size": "INT8 Mamba checkpoint slots",
    "max_mamba_cache_size": "Mamba cache size",
    "mamba_max_states_per_path": "Mamba states per path",
    "pp_async_batch_depth": "pipeline async batch depth",
    "pp_max_micro_batch_size": "pipeline micro-batch size",
    "enable_priority_scheduling": "priority scheduling",
    "enable_dynamic_chunking": "dynamic chunking",
    "min_free_slots_delay": "prefill admission delay",
    "enable_watermark": "watermarking",
    "watermark_config": "watermark config",
    "quantize_and_serve": "ModelOpt quantize and serve",
    "tokenizer_mode": "tokenizer mode",
    "tokenizer_backend": "tokenizer backend",
}

#: `ARM_ARGS` an earlier dvfs left to SGLang, which drew them for each server (random_seed: a
#: random one at every start): compared only between the servers of a journal whose dvfs
#: pinned them (its header's `arms_pinned`; `arm_changes`'s `pinned`), so that an earlier
#: journal's servers, each with its own draw, still resume and build.
DRAWN_ARM_ARGS = ("random_seed",)


#: What dvfs gives every drafter's server alike so that SGLang schedules (and samples) the arms
#: alike (from the dvfs that wrote the header key `arms_pinned`, which lists them): each with
#: its words and the start of the `arm_changes` entry a difference in it makes.
ARMS_PINNED: dict[str, tuple[str, str]] = {
    "decode_cuda_graphs": ("decode CUDA graphs", "decode CUDA graph at batch "),
    "overlap_schedule": ("overlap scheduler", "overlap scheduler disabled ("),
    "random_seed": ("random seed", "random seed (random_seed): "),
    "admission_hold": ("prefill admission hold", "prefill admission hold "),
}


def begun_unpinned(pinned: Iterable[str], changes: Iterable[str]) -> str | None:
    """Why servers differ when the dvfs that began their journal (its header's `arms_pinned`)
    did not give every drafter what this one does, and `changes` (`arm_changes`) differ in
    that: "begun by an earlier dvfs, which did not give every drafter the same ..."; None
    otherwise (the difference is the campaign's or the server's, or that dvfs pinned it).
    The `DRAWN_ARM_ARGS` are left out: such a journal's servers are not compared in them."""
    given = set(pinned)
    missing = [key for key in ARMS_PINNED if key not in given and key not in DRAWN_ARM_ARGS]
    texts = list(changes)
    if not any(t.startswith(ARMS_PINNED[key][1]) for key in missing for t in texts):
        return None
    # The admission hold is named only where the servers differ in it: it is a DFLASH or
    # DSPARK arm's alone, where the other pins are every speculative arm's.
    named = [
        key
        for key in missing
        if key != "admission_hold" or any(t.startswith(ARMS_PINNED[key][1]) for t in texts)
    ]
    what = " and ".join(ARMS_PINNED[key][0] for key in named)
    return f"begun by an earlier dvfs, which did not give every drafter the same {what}"


def decode_graph(args: Mapping[str, Any], batch: int) -> int | str | None:
    """The decode CUDA graph a server replays for `batch` running requests, from its resolved
    args: the smallest captured batch size at least `batch` (the batch is padded up to it), or
    "eager" (graphs off, or `batch` above every captured size); None when the args do not say.

    Both releases capture a finer ladder of batch sizes for a speculative server than for a
    plain one (0.5.9 server_args.py `_generate_cuda_graph_batch_sizes`; 0.5.23
    arg_groups/cuda_graph_hook.py `generate_decode_cuda_graph_batch_sizes`), so left alone a
    plain arm pads a batch of 6 to 8 where a speculative arm runs 6; dvfs passes one list to
    every arm. 0.5.23 reports the result as `cuda_graph_config.decode`, 0.5.9 as
    `cuda_graph_bs` (with `disable_cuda_graph`).
    """
    config = args.get("cuda_graph_config")
    if isinstance(config, Mapping) and isinstance(config.get("decode"), Mapping):
        decode = config["decode"]
        if decode.get("backend") == "disabled":
            return "eager"
        sizes = decode.get("bs")
    elif "cuda_graph_bs" in args:
        if args.get("disable_cuda_graph"):
            return "eager"
        sizes = args.get("cuda_graph_bs")
    else:
        return None
    try:
        captured = [int(s) for s in sizes]
    except (TypeError, ValueError):
        return None
    if not captured:
        return None
    fits = [s for s in captured if s >= batch]
    return min(fits) if fits else "eager"


#: The algorithms whose server SGLang 0.5.23 holds new prefills back for (the DFlash family:
#: speculative/spec_info.py `is_dflash_family`), where `--min-free-slots-delay` is not given.
ADMISSION_HOLD_ALGORITHMS = ("DFLASH", "DSPARK")


def admission_hold(args: Mapping[str, Any]) -> int | str | None:
    """How many free running-request slots a server waits for before it admits new requests'
    prefills while others run: a number (the hold), "off" (it admits them as slots free), or
    None where the args do not say (a release without `min_free_slots_delay`: 0.5.9).

    SGLang 0.5.23 decides it in the scheduler, not in its args (managers/
    min_free_slots_delayer.py `resolve_min_free_slots`, scheduler.py
    `_get_new_batch_prefill_raw`): a given `--min-free-slots-delay` N holds min(N,
    max_running_requests) slots (1 or less: off); unset, a DFLASH or DSPARK server with
    max_running_requests of 8 or more holds min(4, max(2, (max_running_requests + 5) // 6)),
    any other server none (the scheduler's max_running_requests: the arg split over its
    attention DP ranks, unless its KV pool lowers it further, which dvfs refuses below the
    largest batch, `dvfs.engines.sglang_client.running_cap_of`).
    Both report `min_free_slots_delay` None, so left alone a plain arm admits a request as
    soon as one finishes where a DFLASH arm waits for 4 to: a batch run at other
    concurrency. dvfs gives every arm one value (`dvfs.engines.sglang_args`).
    """
    if "min_free_slots_delay" not in args or "speculative_algorithm" not in args:
        return None
    try:
        given = args["min_free_slots_delay"]
        given = None if given is None else int(given)
    except (TypeError, ValueError):
        return None
    algorithm = str(args["speculative_algorithm"] or "").upper()
    if (given is None and algorithm not in ADMISSION_HOLD_ALGORITHMS) or (
        given is not None and given <= 1
    ):
        # Off whatever max_running_requests is: a plain server's is None where not given
        # (0.5.23 resolves it in the scheduler; DFLASH and DSPARK set 48 in their args).
        return "off"
    try:
        # The scheduler's is each DP rank's: the arg split over the attention DP groups
        # (mem_cache/kv_cache_configurator.py `resolve_max_num_reqs`).
        ranks = max(1, int(args.get("attn_dp_size") or 1))
        running = max(1, int(args["max_running_requests"]) // ranks)
    except (KeyError, TypeError, ValueError):
        return None
    if given is not None:
        hold = min(given, running)
        return hold if hold > 1 else "off"
    if running >= 8:
        return min(4, max(2, (running + 5) // 6))
    return "off"


def arm_changes(
    before: Mapping[str, Any],
    now: Mapping[str, Any],
    batch_sizes: Iterable[int] = (),
    pinned: Iterable[str] | None = None,
) -> list[str]:
    """What differs between two server records of one journal, of the same drafter or not
    ("engine version: A -> B", "dtype: None -> 'float16'"): the engine, its version and
    attention kernels (`SERVER_INVARIANTS`), the `ARM_ARGS`, and the decode CUDA graph each
    replays at each of `batch_sizes` (`decode_graph`), and the free slots each waits for
    before it admits new prefills (`admission_hold`). Arms that differ here would compare
    software or settings, not drafters. Where both records name one engine and version, an arg
    (or decode CUDA graph) one reports and the other not is a change too ("dtype (dtype): not
    reported -> 'float16'"): one SGLang reports every arg it has, so the servers cannot be
    shown alike in it; across versions the version's change says it. `pinned`: the journal
    header's `arms_pinned`, leaving out the `DRAWN_ARM_ARGS` it lacks (None: every arg
    compared)."""
    changes = _engine_changes(before, now)
    a, b = before.get("prompt_format"), now.get("prompt_format")
    if a and b and a != b:  # the arms would be sent other prompts (`Server.prompt_format`)
        changes.append(f"prompt format: {a} -> {b}")
    old, new = before.get("args"), now.get("args")
    given = None if pinned is None else set(pinned)
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        one_release = _one_release(before, now)
        hold_a, hold_b = admission_hold(old), admission_hold(new)
        for key, label in ARM_ARGS.items():
            if given is not None and key in DRAWN_ARM_ARGS and key not in given:
                continue  # each server of an earlier dvfs's journal drew its own
            if key == "min_free_slots_delay" and hold_a is not None and hold_b is not None:
                # Its one effect, the hold, is compared below: unset and 1 are both "off"
                # for a plain arm, so an earlier dvfs's (unset) and this one's (1) compare.
                continue
            if key in old and key in new:
                if old[key] != new[key]:
                    changes.append(f"{label} ({key}): {old[key]!r} -> {new[key]!r}")
            elif one_release and (key in old or key in new):
                changes.append(f"{label} ({key}): {_reported(old, key)} -> {_reported(new, key)}")
        for batch in sorted(set(batch_sizes)):
            a, b = decode_graph(old, batch), decode_graph(new, batch)
            if a is not None and b is not None and a != b:
                changes.append(f"decode CUDA graph at batch {batch}: {a} -> {b}")
            elif one_release and (a is None) != (b is None):
                changes.append(
                    f"decode CUDA graph at batch {batch}: {_or_unreported(a)} -> "
                    f"{_or_unreported(b)}"
                )
        if hold_a is not None and hold_b is not None and hold_a != hold_b:
            changes.append(
                f"prefill admission hold (free slots awaited): {_hold(hold_a)} -> {_hold(hold_b)}"
            )
    return changes


def _hold(hold: int | str) -> str:
    return hold if isinstance(hold, str) else f"{hold} slots"


#: How `arm_changes` names an arg (or decode CUDA graph) a server's record does not report.
NOT_REPORTED = "not reported"


def _one_release(before: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether two server records name the same engine and version (both named): their
    servers report the same args, so an arg one lacks is unknown, not another release's."""
    return all(before.get(key) and before.get(key) == now.get(key) for key in ("engine", "version"))


def _reported(args: Mapping[str, Any], key: str) -> str:
    return repr(args[key]) if key in args else NOT_REPORTED


def _or_unreported(value: Any) -> str:
    return NOT_REPORTED if value is None else str(value)


def _same(value: Any) -> Any:
    return [_same(v) for v in value] if isinstance(value, list | tuple) else value


def _gpu_values(session: Mapping[str, Any], key: str) -> list[str]:
    """The distinct values of `key` a session's GPUs recorded; "None" for a GPU that did not
    record it or recorded "" (an older dvfs; NVML could not say): unknown, not compared."""
    gpus = session.get("gpus") or ()
    return sorted({str(g.get(key)) if g.get(key) != "" else "None" for g in gpus})


def corpus_hashes(corpora: Any, key: str = "content_hash") -> dict[str, str]:
    """Each corpus's content hash (or its `key`: "pool_hash") from a session's (or cube's)
    `corpora`; those without one (an older record) left out."""
    if not isinstance(corpora, Mapping):
        return {}
    return {
        str(name): str(c[key])
        for name, c in corpora.items()
        if isinstance(c, Mapping) and c.get(key)
    }


def corpus_changes(before: Any, now: Any) -> list[str]:
    """The corpora, named in both, whose content differs ("corpus 'code' content: A -> B"),
    or, with the same content, whose prompts fitted to the input lengths and their token
    counts do (`dvfs.corpora.sampling.pool_hash`: another tokenizer revision): their prompts
    are not the same prompts."""
    old, new = corpus_hashes(before), corpus_hashes(now)
    changes = [
        f"corpus {name!r} content: {old[name]} -> {new[name]}"
        for name in sorted(old.keys() & new.keys())
        if old[name] != new[name]
    ]
    old_pool, new_pool = corpus_hashes(before, "pool_hash"), corpus_hashes(now, "pool_hash")
    changes += [
        f"corpus {name!r} token counts: {old_pool[name]} -> {new_pool[name]} (the same text "
        "counted otherwise: another revision of the tokenizer)"
        for name in sorted(old_pool.keys() & new_pool.keys())
        if old_pool[name] != new_pool[name] and old.get(name) == new.get(name)
    ]
    return changes


def journal_prompts(records: Iterable[Mapping[str, Any]]) -> tuple[str, str]:
    """How a journal's prompts were chosen and sent, from its session and server records: the
    first token-count method a session recorded and the first prompt format a session (a dvfs
    that recorded it there) or server recorded ("" for each where none did). A resume
    reproduces both rather than refusing what this machine would choose now."""
    method = fmt = ""
    for record in records:
        kind = record.get("type")
        if kind == "session" and not method:
            method = str(record.get("token_count_method") or "")
        if kind in ("session", "server") and not fmt:
            fmt = str(record.get("prompt_format") or "")
    return method, fmt


def prompt_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What differs between two session records (raw, as journalled) in the prompts their
    servers were sent: the corpora's content and the `PROMPT_INVARIANTS`, each compared only
    where both record it."""
    changes = corpus_changes(before.get("corpora"), now.get("corpora"))
    for key, label in PROMPT_INVARIANTS.items():
        a, b = before.get(key), now.get(key)
        if a and b and a != b:
            changes.append(f"{label}: {a} -> {b}")
    return changes


def incomparable(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What keeps the cells of two session records (raw, as journalled) from comparing, one
    entry per invariant ("GPU model: A -> B"); empty when any of their GPUs may finish what
    the other started. A key one of them lacks (an older journal) is not compared. The
    prompts are compared too (`prompt_changes`), and the servers' environment
    (`env_changes`)."""
    changes = []
    for key, label in SESSION_INVARIANTS.items():
        a, b = before.get(key), now.get(key)
        if a is not None and b is not None and _same(a) != _same(b):
            changes.append(f"{label}: {a} -> {b}")
    for key, label in GPU_INVARIANTS.items():
        # What the GPUs that read it said: a GPU that did not (an older dvfs's, one NVML
        # could not read it on) is unknown, whether all of a session's or some (a fleet's
        # node, lost since: the rerun on the GPUs left is not refused for it).
        a, b = (_known_gpu_values(s, key) for s in (before, now))
        if a and b and a != b:
            changes.append(f"{label}: {', '.join(a)} -> {', '.join(b)}")
    return changes + prompt_changes(before, now) + env_changes(before, now)


def _known_gpu_values(session: Mapping[str, Any], key: str) -> list[str]:
    """`_gpu_values` without the GPUs that did not record `key`."""
    return [v for v in _gpu_values(session, key) if v != "None"]


def mixed_within(session: Mapping[str, Any]) -> list[str]:
    """The GPU invariants on which one session's own GPUs disagree ("driver version: 550.54,
    560.28"): a fleet's workers of one model on nodes that differ."""
    return [
        f"{label}: {', '.join(values)}"
        for key, label in GPU_INVARIANTS.items()
        if len(values := _known_gpu_values(session, key)) > 1
    ]


def recorded_stock(record: dict[str, Any]) -> Stock | None:
    """The stock settings a raw session record names, None if it names none."""
    return Stock.from_json(record.get("stock"))


@dataclass(frozen=True)
class Server:
    """A started server: which engine and version served a drafter, and with what."""

    drafter: str
    engine: str
    version: str
    args: Any
    attention_backend: str | None = None  # None: the server did not say (e.g. the twin)
    log_path: str | None = None
    started: str = ""
    #: Whether it ran on the metered GPUs: "verified: ...", "verified by memory: ..." or
    #: "unverified: why" (`dvfs.engines.sglang.pinning_outcome`,
    #: `dvfs.engines.server_memory.memory_outcome`); None: not applicable (simulated GPUs), or a
    #: record older than the check (an optional key within journal version 3).
    gpu_pinning: str | None = None
    #: How prompts went out to it: "chat_template:<hash>" or "plain"; "" where the engine
    #: formats none (the twin) or dvfs did not record it here yet. Decided at the journal's
    #: first server start (the server has fetched the model by then, so a fresh machine's
    #: first session sends the chat template too) and kept for every later server and resume.
    prompt_format: str = ""
    #: The block of ports a fleet worker started it on ({"http", "nccl"}: `ServerPorts`),
    #: which may differ from the one the worker's session names: a worker moves to another
    #: block when another program takes a port of its own. None: a free port, or an older
    #: record (an optional key within journal version 3).
    ports: dict[str, int] | None = None
    #: The Hugging Face Hub commit of the model it loaded, read from the server's Hub cache
    #: (`dvfs.engines.sglang.model_commit`); "" where dvfs cannot tell (the twin, a local
    #: model, an attached server) or an older record (an optional key within journal version
    #: 3). Compared where both servers recorded one (`arm_changes`, `server_changes`).
    model_commit: str = ""
    #: What its Hub cache's snapshot of that commit held: each file's path in the repo with
    #: the blob it links to (`dvfs.engines.sglang.model_files`); empty where dvfs cannot tell
    #: or an older record (an optional key within journal version 3). Where two servers'
    #: commits differ, only the files both snapshots hold are compared (`_files_changed`).
    model_files: dict[str, str] = field(default_factory=dict)
    #: Each DP rank's cap on running requests as its scheduler reported it at start
    #: (`dvfs.engines.base.ServerInfo.running_caps`), checked against the largest batch
    #: (`dvfs.engines.sglang.running_cap_refusal`); None where the server reports none (0.5.9,
    #: the twin) or an older record (an optional key within journal version 3).
    running_caps: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "server",
            "started": self.started,
            "drafter": self.drafter,
            "engine": self.engine,
            "version": self.version,
            "args": self.args,
            "log_path": self.log_path,
            "attention_backend": self.attention_backend,
            "gpu_pinning": self.gpu_pinning,
            **({"prompt_format": self.prompt_format} if self.prompt_format else {}),
            **({"ports": self.ports} if self.ports else {}),
            **({"model_commit": self.model_commit} if self.model_commit else {}),
            **({"model_files": dict(self.model_files)} if self.model_files else {}),
            **({"running_caps": list(self.running_caps)} if self.running_caps else {}),
        }

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Server:
        return cls(
            drafter=record["drafter"],
            engine=record["engine"],
            version=record["version"],
            args=record["args"],
            attention_backend=record.get("attention_backend"),
            log_path=record.get("log_path"),
            started=record.get("started") or "",
            gpu_pinning=record.get("gpu_pinning"),
            prompt_format=record.get("prompt_format") or "",
            ports=record.get("ports") or None,
            model_commit=record.get("model_commit") or "",
            model_files=dict(record.get("model_files") or {}),
            running_caps=_running_caps(record.get("running_caps")),
        )


def _running_caps(value: Any) -> list[int] | None:
    """A server record's `running_caps` as recorded: None where absent or damaged (a
    hand-edited line: read as not known, not refused)."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in value):
        return None
    return list(value)


def _clock_range(value: Any) -> tuple[float, float]:
    """A session's `sm_clock_range_mhz` as recorded: (lowest, highest); NaN where absent (an
    earlier dvfs) or damaged (a hand-edited line: read as not known, not refused)."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        return (math.nan, math.nan)
    return (low, high)
