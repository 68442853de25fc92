"""The `launch_server` argv for a drafter, following SGLang's flag rules.

- The three EAGLE numbers go together or not at all (SGLang asserts on a partial set).
- `--max-running-requests` at least the largest batch: any speculative algorithm otherwise
  caps it at 48 without saying so; under attention DP or pipeline parallelism, rounded up so
  that the ranks and micro-batches that split it each hold their turn (`running_arg`).
- CUDA graphs captured up to the largest batch: `--cuda-graph-max-bs` up to 0.5.9;
  0.5.23 split it into `--cuda-graph-max-bs-decode` / `-prefill`, and the old flag is then an
  ambiguous prefix that argparse rejects. Which one is read from `launch_server --help`,
  else from the version.
- One list of decode CUDA-graph batch sizes for every arm (`graph_batch_sizes`): SGLang's own
  ladder is finer for a speculative server than for a plain one, so a plain arm would pad a
  batch of 6 to 8 where a speculative arm runs 6. `--cuda-graph-bs` up to 0.5.9,
  `--cuda-graph-bs-decode` from 0.5.23.
- On SGLang older than 0.5.23, `--disable-overlap-schedule` for every arm when SGLang turns
  the overlap scheduler off for some drafter itself: 0.5.9 does for each speculative algorithm,
  but with SGLANG_ENABLE_SPEC_V2 only for NGRAM (the EAGLE family then keeps it on).
  What cannot be made alike (SGLang forcing a value for some drafters only) is refused before a
  server starts (`arm_mismatches`). The flags looked for in extra_args are matched as SGLang's
  argparse matches them, abbreviations included (`SHORTEST_PREFIXES`).
- DFLASH (a block drafter) exists from 0.5.23; its block size is --speculative-num-draft-tokens.
- On 0.5.23's rules, `--min-free-slots-delay 1` for every arm of a campaign with a DFLASH or
  DSPARK drafter (`admission_hold_args`): left unset, 0.5.23's scheduler holds such a server's
  new prefills until up to 4 running-request slots are free (managers/
  min_free_slots_delayer.py), where a plain arm admits each request as a slot frees, so the
  arms would run their batches at other concurrency (`dvfs.records.admission_hold`).
- `--attention-backend` always (engine.sglang.attention_backend, fa3 unless "auto"): left to
  itself SGLang 0.5.9 / 0.5.23 picks fa3 on Hopper, except flashinfer when --speculative-eagle-topk
  is above 1 (or is 1 with --page-size above 1), so "EAGLE vs none" would also compare kernels;
  "auto" is refused before a server starts when that prediction differs between drafters.
- Flags dvfs sets itself may not come back through `extra_args` (argparse keeps the last value,
  abbreviations included): `managed_flag` (in `dvfs.campaign.sglang_flags`, re-exported here)
  finds them so the campaign loader can refuse them.
- The server sees only the metered GPUs: CUDA_VISIBLE_DEVICES holds their UUIDs (CUDA and NVML
  may number GPUs differently; a UUID means the same GPU to both); what could move it off
  them is judged in `dvfs.engines.server_gpus`.
- Servers started together on one node (a fleet's workers) each get a block of ports
  (`ServerPorts`): --port, and --nccl-port, which SGLang would otherwise pick at random 100 to
  1000 above --port (so two servers could collide); SGLang's ZMQ ports at --port + 233 and up
  (with DP attention) fall inside the block too. Both flags are in the 0.5.9 and 0.5.23 tables.
"""

from __future__ import annotations

import errno
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dvfs.campaign.model import Campaign, DrafterSpec
from dvfs.campaign.serving import LAUNCHER, server_command
from dvfs.campaign.sglang_flags import ATTENTION_BACKENDS as ATTENTION_BACKENDS
from dvfs.campaign.sglang_flags import DEFAULT_ATTENTION_BACKEND as DEFAULT_ATTENTION_BACKEND
from dvfs.campaign.sglang_flags import MANAGED_FLAGS as MANAGED_FLAGS
from dvfs.campaign.sglang_flags import managed_flag as managed_flag
from dvfs.engines.server_gpus import check_visible_devices, check_wrapper_visible_devices
from dvfs.errors import ArmMismatchError, CampaignError, EngineError
from dvfs.redact import SGLANG_SECRET_FLAGS, sglang_secret_flag

NEW_CUDA_GRAPH_FLAG = "--cuda-graph-max-bs-decode"
OLD_CUDA_GRAPH_FLAG = "--cuda-graph-max-bs"
#: The flag listing the decode CUDA-graph batch sizes, with each of the two above.
GRAPH_SIZES_FLAG = {
    NEW_CUDA_GRAPH_FLAG: "--cuda-graph-bs-decode",
    OLD_CUDA_GRAPH_FLAG: "--cuda-graph-bs",
}
#: Algorithms each SGLang release accepts (0.5.9's argparse choices; 0.5.23's registry).
ALGORITHMS_BY_VERSION = {
    (0, 5, 9): ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"),
    (0, 5, 23): ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO"),
}


#: Ports per server, from its --port up: its --nccl-port and SGLang's derived ports fit inside.
PORT_BLOCK = 256
#: Where SGLang 0.5.9 / 0.5.23 put their ZMQ ports with DP attention (`ZMQ_TCP_PORT_DELTA` in
#: its server_args.py), and how many it may take from there (dist-init, tokenizer, detokenizer,
#: RPC, metrics, and one scheduler input per DP rank).
ZMQ_PORT_OFFSET = 233
ZMQ_PORT_SPAN = 16
#: The first block's --port: below Linux's default ephemeral range (32768-60999), where the
#: kernel hands ports to any client socket between our check and SGLang's bind.
FIRST_PORT = 20000
#: Blocks below the ephemeral range, shared by every dvfs worker of a node
#: (`dvfs.fleet.ports` claims them; `check_distinct_ports` checks a fleet's before any server
#: starts).
PORT_SLOTS = (32768 - FIRST_PORT) // PORT_BLOCK
#: Flags that would move a server's ports out of its block (argparse prefixes included).
PORT_FLAGS = ("--nccl-port", "--dist-init-addr", "--nccl-init-addr")


@dataclass(frozen=True)
class ServerPorts:
    """The ports one server opens: its HTTP --port and --nccl-port (torch.distributed's store),
    both set on its command line, and the ports SGLang derives from --port."""

    http: int
    nccl: int

    @classmethod
    def for_slot(cls, slot: int) -> ServerPorts:
        """The block of a node's `slot`-th worker (slots past `PORT_SLOTS` wrap around)."""
        base = FIRST_PORT + (slot % PORT_SLOTS) * PORT_BLOCK
        return cls(base, base + 1)

    @property
    def used(self) -> tuple[int, ...]:
        """Every port the server may open on its node."""
        zmq = self.http + ZMQ_PORT_OFFSET
        return (self.http, self.nccl, *range(zmq, zmq + ZMQ_PORT_SPAN))

    def to_json(self) -> dict[str, int]:
        return {"http": self.http, "nccl": self.nccl}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ServerPorts:
        return cls(int(str(data["http"])), int(str(data["nccl"])))


def host_family(host: str) -> socket.AddressFamily:
    """The address family of engine.sglang.host: IPv6 for an IPv6 address (`::1`, `::`, which
    SGLang's --host takes), else IPv4 (`127.0.0.1`, `0.0.0.0`, a name such as localhost)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


#: What binding a socket fails with (port 0 or any) when its address is none of this machine's:
#: another machine's, of a family the kernel lacks, link-local without its interface.
_NOT_AN_ADDRESS_HERE = frozenset({errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL})


def unlistenable(host: str, exc: OSError) -> EngineError | None:
    """The error to stop with when making or binding a socket on `host` failed with `exc`
    because no server can listen there at all (a name that does not resolve, another
    machine's address, an IPv6 address where the kernel has no IPv6, a link-local one without
    its interface), not because a port is taken; None for a port taken (or not ours to bind)."""
    if not isinstance(exc, socket.gaierror) and exc.errno not in _NOT_AN_ADDRESS_HERE:
        return None
    return EngineError(
        f"a server cannot listen on engine.sglang.host {host!r} here "
        f"({exc.strerror or exc}): name an address of this machine, such as 127.0.0.1"
    )


def host_url(host: str, port: int) -> str:
    """The HTTP URL of a server listening on `host`:`port` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def check_distinct_ports(plans: Sequence[tuple[str, str, ServerPorts]]) -> None:
    """Refuse (worker, host, ports) plans where two servers of one node would share a port."""
    owner: dict[tuple[str, int], str] = {}
    for worker, host, ports in plans:
        for port in ports.used:
            other = owner.setdefault((host, port), worker)
            if other != worker:
                raise EngineError(
                    f"the servers of workers {other} and {worker} on {host or 'this node'} "
                    f"would share port {port}: each server needs its own block of ports "
                    f"(at most {PORT_SLOTS} on a node); give the node fewer GPU groups"
                )


def check_ports_resolved(drafter: str, args: Mapping[str, object], ports: ServerPorts) -> None:
    """The server must listen where it was told (its /server_info args): a port outside its
    block could be another server's."""
    for key, planned in (("port", ports.http), ("nccl_port", ports.nccl)):
        value = args.get(key)
        if value is not None and str(value) != str(planned):
            raise EngineError(
                f"the {drafter!r} server reports {key} {value}, not {planned} as dvfs set it: "
                "servers on one node could then share a port; remove port flags from "
                "engine.sglang.extra_args"
            )


def _port_flag(token: str) -> str | None:
    """The port flag argparse would read `token` as (an abbreviation included), or None."""
    name = token.split("=", 1)[0]
    if len(name) <= len("--nccl-"):
        return None
    return next((flag for flag in PORT_FLAGS if flag.startswith(name)), None)


def parse_version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        return None
    return tuple(int(p) for p in match.groups(default="0"))


def server_env(campaign: Campaign, gpu_uuids: Sequence[str] = ()) -> dict[str, str]:
    """The environment a server (and its --help probe) runs with: ours plus the campaign's, and
    CUDA_VISIBLE_DEVICES set to the metered GPUs' UUIDs when they are known."""
    env = {**os.environ, **dict(campaign.engine.sglang.env)}
    if gpu_uuids:
        check_visible_devices(dict(campaign.engine.sglang.env), gpu_uuids)
        check_wrapper_visible_devices(campaign, gpu_uuids)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_uuids)
        # Irrelevant to UUIDs, but keeps any index the server prints in NVML's (PCI) order.
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env


def recorded_server_env(campaign: Campaign) -> dict[str, str] | None:
    """What of the servers' environment (`server_env`) a session records and every later
    session must repeat (`dvfs.records.server_env_of`); None where dvfs starts no server (the
    twin, a server attached at engine.sglang.url). What a server_command wrapper sets is read
    from the command as the session's settings keep it (`dvfs.redact.redact_argv`: a URL's
    user and password hidden), as a later session reads it back from there
    (`dvfs.records.session.recorded_env`)."""
    from dvfs.records.session import command_env, server_env_of
    from dvfs.redact import redact_argv

    if campaign.engine.backend != "sglang" or campaign.engine.sglang.url:
        return None
    wrapped = command_env(redact_argv(server_command(campaign)))
    return server_env_of({**server_env(campaign), **wrapped})


def launch_env(campaign: Campaign) -> dict[str, str]:
    """The environment SGLang itself starts with, as far as dvfs can tell: `server_env`, and
    over it what a server_command wrapper sets on its command line (`env NAME=VALUE python
    ...`: `dvfs.records.session.command_env`), which reaches the server whatever dvfs hands
    the wrapper (its SGLANG_ENABLE_SPEC_V2 decides 0.5.9's overlap scheduler)."""
    from dvfs.records.session import command_env

    return {**server_env(campaign), **command_env(server_command(campaign))}


def unstartable(executable: str, env: Mapping[str, str]) -> str | None:
    """Why the server command's `executable` cannot be started with `env` (its PATH, as the
    server is started), or None: the one check `dvfs sweep` makes before starting a server and
    `dvfs doctor` repeats, so doctor passes no command every cell would fail on."""
    if shutil.which(executable, path=env.get("PATH")) is not None:
        return None
    given = Path(executable)
    if os.sep in executable and given.exists():
        what = "a folder" if given.is_dir() else "not executable"
        return (
            f"{executable} is {what}: name an executable file first in server_command "
            "(its interpreter first for a script, or chmod +x it)"
        )
    return f"{executable} not found" + (
        "" if os.sep in executable else " on the PATH the server is started with"
    )


def sglang_importable() -> bool:
    """Whether this Python finds sglang (imports nothing) as `python -m sglang.launch_server`
    started in this folder would: from its path, or from this folder, which `-m` puts first
    on the path (a source checkout's `python/` folder) unless PYTHONSAFEPATH is set."""
    if importlib.util.find_spec("sglang") is not None:
        return True
    if os.environ.get("PYTHONSAFEPATH"):
        return False
    try:
        here = os.getcwd()
    except OSError:  # a folder removed under the shell: the server's -m finds nothing there
        return False
    importlib.invalidate_caches()
    return importlib.machinery.PathFinder.find_spec("sglang", [here]) is not None


#: What of engine.sglang.env moves where the server's Python looks for packages otherwise than
#: this one's (its user site, the folder `-m` puts first): asked of that Python itself.
SEARCH_PATH_ENV = ("PYTHONUSERBASE", "PYTHONNOUSERSITE", "PYTHONSAFEPATH")


def server_finds_sglang(env: Mapping[str, str], timeout_s: float = 30.0) -> bool | None:
    """Whether this Python, started as the server is (in this folder, with the server's
    environment `env`), finds sglang (imports nothing); None where it cannot be asked."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        result = subprocess.run(
            [sys.executable, "-c", probe],
            env=dict(env),
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 1: False}.get(result.returncode)


def not_installed(campaign: Campaign) -> str | None:
    """Why the SGLang server dvfs starts by default (no server_command: this Python's
    `-m sglang.launch_server`) cannot start, or None: SGLang is not importable here. The one
    rule `dvfs sweep` refuses by before it measures and `dvfs doctor` fails by. Judged only
    where it surely holds: never for a server_command (a wrapper, another venv's python), nor
    where engine.sglang.env points Python elsewhere (PYTHONPATH, PYTHONHOME). Where it sets
    what moves the user site or the folder first on the path (`SEARCH_PATH_ENV`), this
    Python is asked, in the server's environment."""
    sg = campaign.engine.sglang
    names = {name for name, _ in sg.env}
    if (
        campaign.engine.backend != "sglang"
        or sg.server_command
        or sg.url
        or {"PYTHONPATH", "PYTHONHOME"} & names
    ):
        return None
    moved = [name for name in SEARCH_PATH_ENV if name in names]
    if moved:
        if server_finds_sglang(server_env(campaign)) is not False:
            return None
        return (
            "sglang is not installed where the server's Python looks (engine.sglang.env sets "
            f"{', '.join(moved)}): pip install 'dvfs[sglang]' where it finds it, or change "
            "engine.sglang.env"
        )
    if sglang_importable():
        return None
    return "sglang is not installed in this environment: pip install 'dvfs[sglang]'"


def probe_help(
    command: Sequence[str], timeout_s: float = 180.0, env: dict[str, str] | None = None
) -> str | None:
    """`launch_server --help` text, or None when it cannot be run here."""
    try:
        result = subprocess.run(
            [*command, "--help"],
            capture_output=True,
            text=True,
            errors="replace",  # a wrapper's message in another encoding: the options still read
            timeout=timeout_s,
            check=False,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = result.stdout + result.stderr
    return text if "--model-path" in text else None


#: `launch_server --help` texts this process has read (`cached_help`), by `_help_key`.
_HELP_CACHE: dict[tuple[object, ...], str] = {}
_HELP_LOCK = threading.Lock()
#: What pins a server to its GPUs, which changes no option its --help lists (each fleet
#: worker's server sees other GPUs): not part of the key.
HELP_UNKEYED = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"})


def sglang_identity() -> tuple[object, ...] | None:
    """Which sglang this Python's `-m sglang.launch_server` runs, as far as its files tell
    without importing it: the package's path, its __init__'s size and modification time (a
    reinstall in place changes them) and its distribution's version; None where it is not
    found here or a `sglang` folder in this folder (first on `-m`'s path) may shadow it."""
    from importlib import metadata

    try:
        spec = importlib.util.find_spec("sglang")
        here = os.getcwd()
    except (ImportError, ValueError, OSError):
        return None
    if spec is None or not spec.origin:
        return None
    if not os.environ.get("PYTHONSAFEPATH"):
        importlib.invalidate_caches()
        local = importlib.machinery.PathFinder.find_spec("sglang", [here])
        if local is not None and local.origin != spec.origin:
            return None
    try:
        found = os.stat(spec.origin)
        version = metadata.version("sglang")
    except (OSError, metadata.PackageNotFoundError):
        return None
    return (spec.origin, found.st_size, found.st_mtime_ns, version, here)


def _help_key(command: Sequence[str], env: Mapping[str, str] | None) -> tuple[object, ...] | None:
    """What one `launch_server --help` text holds for: this Python's own launcher (a
    server_command is a wrapper or another Python, whose sglang this process cannot tell),
    its sglang (`sglang_identity`) and the server's environment but its GPUs; None where
    that cannot be told surely: the environment moves where Python finds packages, or sglang
    is not found here."""
    if list(command) != [sys.executable, "-m", LAUNCHER]:
        return None
    env = dict(os.environ if env is None else env)
    moved = ("PYTHONPATH", "PYTHONHOME", *SEARCH_PATH_ENV)
    if any(env.get(name) != os.environ.get(name) for name in moved):
        return None  # the server's Python looks elsewhere than this one does
    identity = sglang_identity()
    if identity is None:
        return None
    kept = sorted((k, v) for k, v in env.items() if k not in HELP_UNKEYED)
    return (tuple(command), identity, tuple(kept))


def cached_help(command: Sequence[str], env: dict[str, str] | None = None) -> str | None:
    """`probe_help`, once per process for each `_help_key` (a fleet's workers, each building
    its engine, import SGLang for it once, not once each); probed every time where the key
    cannot be told, and never kept where it could not run (it may run the next time)."""
    key = _help_key(command, env)
    if key is None:
        return probe_help(command, env=env)
    with _HELP_LOCK:  # one probe at a time: the others then read what it read
        if key not in _HELP_CACHE:
            text = probe_help(command, env=env)
            if text is None:
                return None
            _HELP_CACHE[key] = text
        return _HELP_CACHE[key]


@dataclass(frozen=True)
class LaunchHelp:
    """`launch_server --help` as probed once (`text` None: it could not run here), handed from
    the checks made before a sweep's journal exists to the engine it then opens, so SGLang (slow
    to import) is probed once."""

    text: str | None


def cuda_graph_flag(help_text: str | None, version: tuple[int, ...] | None) -> str:
    """The flag that sets the decode CUDA-graph batch limit for this SGLang."""
    if help_text is not None:
        if NEW_CUDA_GRAPH_FLAG in help_text:
            return NEW_CUDA_GRAPH_FLAG
        if re.search(r"--cuda-graph-max-bs\b(?!-)", help_text):
            return OLD_CUDA_GRAPH_FLAG
    if version is not None and version < (0, 5, 23):
        return OLD_CUDA_GRAPH_FLAG
    return NEW_CUDA_GRAPH_FLAG


def legacy_rules(help_text: str | None, version: tuple[int, ...] | None) -> bool:
    """Whether this SGLang resolves its args by 0.5.9's rules rather than 0.5.23's: told apart as
    `cuda_graph_flag` tells them (`launch_server --help`, else the version, else 0.5.23)."""
    return cuda_graph_flag(help_text, version) == OLD_CUDA_GRAPH_FLAG


def graph_batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    """The decode CUDA-graph batch sizes every arm captures: each of the campaign's batches, so
    none is padded, and the powers of two up to the largest, so a batch shrinking as its
    requests finish is padded less than twice (alike in every arm)."""
    largest = max(batch_sizes)
    powers = {1 << k for k in range(largest.bit_length()) if 1 << k <= largest}
    return sorted(set(batch_sizes) | powers)


#: The EAGLE family as 0.5.9 handles it (NEXTN is its alias of EAGLE).
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
#: The algorithms 0.5.23 runs without mixed chunked prefill whatever the flags say: those its
#: speculative/spec_info.py `supports_mixed_chunk` leaves out (arg_groups/speculative_hook.py,
#: `_handle_uno`, `_handle_eagle_family`, `_handle_ngram`). 0.5.9 turns it off for every
#: algorithm (server_args.py `_handle_speculative_decoding`).
NO_MIXED_CHUNK_0523 = ("STANDALONE", "NGRAM", "UNO")
#: The draft architectures for which 0.5.23 serves an EAGLE or NEXTN drafter as FROZEN_KV_MTP
#: (arg_groups/speculative_hook.py `_resolve_speculative_algorithm_alias`), which it runs
#: without mixed chunked prefill too (`_handle_frozen_kv_mtp`).
FROZEN_KV_MTP_DRAFTS = ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")


def _draft_architectures(draft_model: str | None, env: Mapping[str, str]) -> list[str]:
    """The `architectures` of a draft model's config.json as far as it is here: a local folder,
    or the Hub cache's snapshot of its branch main (empty where it cannot be read)."""
    if not draft_model:
        return []
    config = Path(draft_model) / "config.json"
    repo = hub_repo(draft_model, env)
    try:
        if repo is not None:
            commit = read_small(repo / "refs" / "main").strip()
            config = repo / "snapshots" / commit / "config.json"
        found = json.loads(read_small(config)).get("architectures")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return []  # (json nested too deeply: RecursionError)
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


def hub_repo(model_path: object, env: Mapping[str, str]) -> Path | None:
    """The Hub cache folder of model `model_path` for a server with environment `env`, found as
    huggingface_hub's constants find it (HF_HUB_CACHE, else the legacy HUGGINGFACE_HUB_CACHE,
    else HF_HOME/hub, else XDG_CACHE_HOME or ~/.cache, then huggingface/hub; '~' and $VARS
    expanded in `env`); None for a local folder or file, or a name that is no Hub repo id."""
    model = str(model_path or "")
    parts = model.strip("/").split("/")
    if len(parts) != 2 or not all(parts) or model.startswith(("/", ".", "~")):
        return None
    if os.path.exists(model):
        return None
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
        )
        cache = os.path.join(_expanded(home, env), "hub")
    return Path(_expanded(cache, env)) / f"models--{parts[0]}--{parts[1]}"


_ENV_VAR_RE = re.compile(r"\$(\w+)|\$\{([^}]*)\}")


def _expanded(path: str, env: Mapping[str, str]) -> str:
    """`path` as huggingface_hub reads a cache variable in the server's environment `env`: a
    leading '~' is its HOME, and each $NAME or ${NAME} set there its value (others kept)."""
    if path == "~" or path.startswith("~/"):
        path = (env.get("HOME") or str(Path.home())) + path[1:]

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return env.get(name, match.group(0))

    return _ENV_VAR_RE.sub(value, path)


def read_small(path: Path) -> str:
    """A model's small file (config.json, a ref) as text: opened without blocking and refused
    (`ValueError`) unless a regular file of at most `MAX_SETTINGS_BYTES`, so that a FIFO is not
    waited on for ever, nor a device (/dev/zero) read until memory runs out."""
    from dvfs.inputs import MAX_SETTINGS_BYTES

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:  # (a folder: IsADirectoryError)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is no regular file")
        data = f.read(MAX_SETTINGS_BYTES + 1)
    if len(data) > MAX_SETTINGS_BYTES:
        raise ValueError(f"{path} is larger than any config.json")
    return data.decode("utf-8")


def _no_mixed_chunk_0523(drafter: DrafterSpec, env: Mapping[str, str]) -> bool:
    """Whether 0.5.23 turns mixed chunked prefill off for `drafter` whatever the flags say."""
    if drafter.algorithm in NO_MIXED_CHUNK_0523:
        return True
    return drafter.algorithm in ("EAGLE", "NEXTN") and any(
        a in FROZEN_KV_MTP_DRAFTS for a in _draft_architectures(drafter.draft_model, env)
    )


#: Per release, the shortest abbreviation argparse reads as each flag dvfs looks for in
#: extra_args: the shortest prefix no other flag of that release's option table starts with
#: (SGLang's parser takes any unambiguous prefix). Worked out from SGLang 0.5.9's and 0.5.23's
#: option tables (tests/data/sglang-args/; tests/test_arm_scheduling.py recomputes them from
#: there): 0.5.23's `--enable-mis` makes `--enable-mi` ambiguous in that release.
SHORTEST_PREFIXES: dict[tuple[int, ...], dict[str, str]] = {
    (0, 5, 9): {
        "--enable-mixed-chunk": "--enable-mi",
        "--disable-overlap-schedule": "--disable-ov",
    },
    (0, 5, 23): {
        "--enable-mixed-chunk": "--enable-mix",
        "--disable-overlap-schedule": "--disable-ov",
    },
}


def names_flag(tokens: Sequence[str], flag: str, *, legacy: bool) -> bool:
    """Whether argparse would read one of `tokens` as `flag`: the flag, or an abbreviation of
    it no shorter than `SHORTEST_PREFIXES` gives for the release (`legacy`: 0.5.9's table,
    else 0.5.23's)."""
    return flag_token(tokens, flag, legacy=legacy) is not None


def flag_token(tokens: Sequence[str], flag: str, *, legacy: bool) -> str | None:
    """The token argparse would read as `flag` (as the campaign spells it), None if none."""
    shortest = SHORTEST_PREFIXES[(0, 5, 9) if legacy else (0, 5, 23)][flag]
    for token in tokens:
        name = token.split("=", 1)[0]
        if token.startswith("--") and len(name) >= len(shortest) and flag.startswith(name):
            return name
    return None


def _env_true(env: Mapping[str, str], name: str) -> bool:
    """An SGLang boolean environment variable as SGLang 0.5.9 reads it (srt/environ.py)."""
    return env.get(name, "").strip().lower() in ("true", "1", "yes", "y")


def _forced_overlap_off(algorithm: str | None, *, legacy: bool, spec_v2: bool) -> bool | None:
    """What SGLang sets `disable_overlap_schedule` to for a drafter whatever the flags say; None
    where it keeps what it was given. 0.5.9 (server_args.py `_handle_speculative_decoding`):
    True for NGRAM, and for the EAGLE family unless SGLANG_ENABLE_SPEC_V2, which sets False.
    0.5.23 only for a CPU device (speculative_hook.py `_disable_overlap_schedule_for_cpu`)."""
    if not legacy or algorithm is None:
        return None
    if algorithm == "NGRAM":
        return True
    if algorithm in EAGLE_FAMILY:
        return not spec_v2
    return None


@dataclass(frozen=True)
class OverlapPlan:
    """Who sets each drafter's `disable_overlap_schedule`: SGLang itself (`forced`, per drafter:
    the value, or None where it keeps what it was given), dvfs (`pin`: it passes
    `--disable-overlap-schedule` to every arm because SGLang turns the scheduler off for some
    drafter itself), the campaign (`user`: the flag, or an abbreviation, in
    engine.sglang.extra_args); `off`: each drafter's resulting value."""

    forced: dict[str, bool | None]
    pin: bool
    user: bool

    @property
    def off(self) -> dict[str, bool]:
        given = self.pin or self.user
        return {name: given if off is None else off for name, off in self.forced.items()}


def _overlap_plan(campaign: Campaign, *, legacy: bool, env: Mapping[str, str]) -> OverlapPlan:
    spec_v2 = _env_true(env, "SGLANG_ENABLE_SPEC_V2")
    forced = {
        d.name: _forced_overlap_off(d.algorithm, legacy=legacy, spec_v2=spec_v2)
        for d in campaign.drafters
    }
    user = names_flag(
        campaign.engine.sglang.extra_args, "--disable-overlap-schedule", legacy=legacy
    )
    return OverlapPlan(forced, pin=True in forced.values(), user=user)


def _names(drafters: Sequence[str]) -> str:
    return ", ".join(repr(d) for d in drafters)


def arm_mismatches(campaign: Campaign, *, legacy: bool, env: Mapping[str, str]) -> list[str]:
    """What SGLang would set differently for some drafters than for others, whatever dvfs passes
    (one line each; empty: the arms can differ in their drafters alone). `legacy`: 0.5.9's rules
    (`legacy_rules`); `env`: the server's environment."""
    rules = "SGLang 0.5.9" if legacy else "SGLang 0.5.23"
    problems = []
    extra = campaign.engine.sglang.extra_args
    written = flag_token(extra, "--enable-mixed-chunk", legacy=legacy)
    if written is not None:
        abbreviates = "" if written == "--enable-mixed-chunk" else f", which {written} abbreviates"
        off = [
            d.name
            for d in campaign.drafters
            if d.algorithm is not None and (legacy or _no_mixed_chunk_0523(d, env))
        ]
        kept = [d.name for d in campaign.drafters if d.name not in off]
        if off and kept:
            problems.append(
                f"{written} in engine.sglang.extra_args: {rules} turns mixed chunked "
                f"prefill off for drafters {_names(off)} but not for {_names(kept)} "
                f"(enable_mixed_chunk{abbreviates}), so the arms would schedule prefills "
                "differently; remove the flag"
            )
    overlap = _overlap_plan(campaign, legacy=legacy, env=env)
    if len(set(overlap.off.values())) > 1:
        problems.append(_overlap_mismatch(rules, overlap))
    return problems


def _overlap_mismatch(rules: str, plan: OverlapPlan) -> str:
    """One line on drafters that would run with and without the overlap scheduler: which
    SGLang decides itself (0.5.9 with SGLANG_ENABLE_SPEC_V2: on for the EAGLE family, off for
    NGRAM), which dvfs's flag or the campaign's turns off, and what would make them alike."""
    kept_on = [name for name, off in plan.forced.items() if off is False]
    forced_off = [name for name, off in plan.forced.items() if off is True]
    given_off = [name for name, off in plan.forced.items() if off is None and plan.off[name]]
    said = f"{rules} with SGLANG_ENABLE_SPEC_V2 keeps the overlap scheduler on for drafters "
    said += _names(kept_on)
    if forced_off:
        said += f" and turns it off for {_names(forced_off)}"
    said += " whatever the flags say (disable_overlap_schedule)"
    if given_off:
        causes = []
        if plan.pin:
            causes.append(
                "the --disable-overlap-schedule dvfs gives every drafter to match "
                + _names(forced_off)
            )
        if plan.user:
            causes.append("the --disable-overlap-schedule in engine.sglang.extra_args")
        said += f", and {' and '.join(causes)} turns it off for {_names(given_off)}"
    fixes = [
        "unset SGLANG_ENABLE_SPEC_V2 (engine.sglang.env, engine.sglang.server_command or dvfs's "
        "environment)"
    ]
    alike = []
    if forced_off:
        alike.append(f"sweep {_names(forced_off)} in one campaign and {_names(kept_on)} in another")
    if plan.user:
        alike.append("remove --disable-overlap-schedule from engine.sglang.extra_args")
    if alike:
        fixes.append(" and ".join(alike))
    return f"{said}, so the arms would schedule differently; {', or '.join(fixes)}"


def check_arms_can_match(
    campaign: Campaign, help_text: str | None = None, version: str | None = None
) -> None:
    """Refuse (`ArmMismatchError`, one line) a campaign whose drafters SGLang would serve with
    other scheduling settings than each other whatever dvfs passes (`arm_mismatches`)."""
    parsed = parse_version(version or campaign.engine.sglang.version)
    legacy = legacy_rules(help_text, parsed)
    problems = arm_mismatches(campaign, legacy=legacy, env=launch_env(campaign))
    if problems:
        raise ArmMismatchError("; ".join(problems))


def check_flags_known(campaign: Campaign, help_text: str | None) -> None:
    """Refuse (CampaignError, one line) a flag in engine.sglang.extra_args or a drafter's that
    this SGLang's `launch_server --help` does not list, nor any option it abbreviates: one
    renamed or removed in this release (0.5.23 dropped --speculative-ngram-branch-length)
    would otherwise stop the server of the first arm that passes it, perhaps hours in."""
    if help_text is None:
        return
    options = set(re.findall(r"(?<![\w-])--[A-Za-z0-9][\w-]*", help_text))
    given = [("engine.sglang.extra_args", campaign.engine.sglang.extra_args)]
    given += [(f"drafters.{d.name}.extra_args", d.extra_args) for d in campaign.drafters]
    for where, args in given:
        for token in args:
            flag = token.split("=", 1)[0]
            if not flag.startswith("--") or flag == "--":
                continue
            if flag in options or any(o.startswith(flag) for o in options):
                continue
            raise CampaignError(
                f"{where}: {flag} is not an option of this SGLang's launch_server (its "
                "--help lists none by that name): it was renamed or removed in this release, "
                "or is misspelt; remove it or use the release's own flag"
            )


def check_algorithms_known(campaign: Campaign, help_text: str | None) -> None:
    """Refuse (CampaignError, one line) a drafter whose algorithm this SGLang does not have:
    one its `launch_server --help` leaves out of --speculative-algorithm's choices (0.5.9
    lists them; 0.5.23 takes a registry name and lists none), or, with engine.sglang.version
    pinned, one that release lacks (`_check_algorithm`). Checked before any server starts:
    that drafter's server would otherwise exit at SGLang's argparse, and every cell of its arm
    fail after the other arms were measured, at each rerun again."""
    match = re.search(r"--speculative-algorithm\s+\{([^}]*)\}", help_text or "")
    choices = [c.strip() for c in match.group(1).split(",")] if match else None
    version = parse_version(campaign.engine.sglang.version)
    for drafter in campaign.drafters:
        if drafter.algorithm is None:
            continue
        if choices is not None and drafter.algorithm not in choices:
            raise CampaignError(
                f"drafters.{drafter.name}.algorithm: this SGLang's launch_server takes "
                f"--speculative-algorithm {', '.join(choices)}, not {drafter.algorithm} "
                "(DFLASH, DSPARK and UNO need SGLang 0.5.23 or newer); upgrade SGLang or "
                "remove the drafter"
            )
        try:
            _check_algorithm(drafter, version)
        except EngineError as exc:
            raise CampaignError(f"drafters.{drafter.name}.algorithm: {exc}") from exc


def _check_algorithm(drafter: DrafterSpec, version: tuple[int, ...] | None) -> None:
    if drafter.algorithm is None or version is None:
        return
    known = None
    for release, algorithms in sorted(ALGORITHMS_BY_VERSION.items()):
        if version >= release:
            known = algorithms
    if known is not None and drafter.algorithm not in known:
        raise EngineError(
            f"drafter {drafter.name!r}: SGLang {'.'.join(map(str, version))} has no "
            f"{drafter.algorithm} speculative algorithm (it knows {', '.join(known)}); "
            "DFLASH, DSPARK and UNO need SGLang 0.5.23 or newer"
        )


#: What turns 0.5.23's prefill admission hold off (1: "1 disables", its --help says).
ADMISSION_HOLD_FLAG = "--min-free-slots-delay"


def admission_hold_args(campaign: Campaign, *, legacy: bool, help_text: str | None) -> list[str]:
    """`--min-free-slots-delay 1` for every arm where 0.5.23's rules (not `legacy`) hold some
    drafter's new prefills back (DFLASH, DSPARK: `dvfs.records.ADMISSION_HOLD_ALGORITHMS`)
    and none other's, so that every arm admits a request as soon as a slot frees; nothing
    where no drafter is held, where this SGLang's `launch_server --help` (`help_text`, when
    read) lists no such flag (a release without the hold), or where engine.sglang.extra_args
    ask for pipeline parallelism (0.5.23 refuses the flag there, validation_hook.py
    `check_pipeline_parallel_compat`, and serves no DFLASH or DSPARK drafter either)."""
    from dvfs.records import ADMISSION_HOLD_ALGORITHMS

    if legacy or not any(d.algorithm in ADMISSION_HOLD_ALGORITHMS for d in campaign.drafters):
        return []
    if help_text is not None and ADMISSION_HOLD_FLAG not in help_text:
        return []
    if _pipeline_parallel(campaign.engine.sglang.extra_args):
        return []
    return [ADMISSION_HOLD_FLAG, "1"]


#: 0.5.23's pipeline-parallel flags and the shortest abbreviation its argparse reads as each
#: (its option table: "--pp" is ambiguous with --pp-max-micro-batch-size).
PIPELINE_FLAGS_0523 = {"--pp-size": "--pp-s", "--pipeline-parallel-size": "--pi"}


def _pipeline_parallel(tokens: Sequence[str]) -> bool:
    """Whether `tokens` (engine.sglang.extra_args) set 0.5.23's pipeline-parallel size above 1
    as its argparse reads them: either flag, abbreviated or not, `=VALUE` or not, the last
    one. A value that is not a number is SGLang's to refuse."""
    value = None
    for i, token in enumerate(tokens):
        name, eq, rest = token.partition("=")
        if any(
            len(name) >= len(shortest) and flag.startswith(name)
            for flag, shortest in PIPELINE_FLAGS_0523.items()
        ):
            value = rest if eq else (tokens[i + 1] if i + 1 < len(tokens) else None)
    try:
        return value is not None and int(value) > 1
    except ValueError:
        return False


#: The flags that set attention data parallelism, per release (`legacy`: 0.5.9), with the
#: shortest abbreviation its argparse reads as each (from the option tables): 0.5.23's
#: `--attn-dp-size`, and the deprecated `--dp-size N --enable-dp-attention` both releases read
#: as N attention DP ranks (0.5.23 parallel_hook.py `_handle_deprecated_dp_attention`).
ATTN_DP_FLAGS_0523 = {
    "--attn-dp-size": "--attn-d",
    "--attention-data-parallel-size": "--attention-d",
}
DP_SIZE_FLAGS = {"--dp-size": "--dp", "--data-parallel-size": "--da"}
ENABLE_DP_ATTENTION = {
    True: ("--enable-dp-attention", "--enable-dp-a"),
    False: ("--enable-dp-attention", "--enable-dp-attention"),
}


def _last_value(tokens: Sequence[str], flags: Mapping[str, str]) -> str | None:
    """The value argparse keeps for any of `flags` (each with its shortest abbreviation) in
    `tokens`: the last one given, `=VALUE` or the next token; None where none is given."""
    value = None
    for i, token in enumerate(tokens):
        name, eq, rest = token.partition("=")
        if name.startswith("--") and any(
            len(name) >= len(shortest) and flag.startswith(name) for flag, shortest in flags.items()
        ):
            value = rest if eq else (tokens[i + 1] if i + 1 < len(tokens) else None)
    return value


def attention_dp_ranks(tokens: Sequence[str], *, legacy: bool) -> int:
    """How many attention DP ranks `tokens` (the extra_args) ask for as the release's argparse
    reads them: 0.5.23's --attn-dp-size where above 1, else --dp-size where
    --enable-dp-attention is given (both releases); 1 otherwise, or where a value is not a
    number (SGLang's to refuse)."""
    try:
        if not legacy:
            attn = int(_last_value(tokens, ATTN_DP_FLAGS_0523) or 1)
            if attn > 1:
                return attn
        flag, shortest = ENABLE_DP_ATTENTION[legacy]
        enabled = any(
            len(t) >= len(shortest) and flag.startswith(t) for t in tokens if t.startswith("--")
        )
        return max(1, int(_last_value(tokens, DP_SIZE_FLAGS) or 1)) if enabled else 1
    except ValueError:
        return 1


def load_balance_args(tokens: Sequence[str], *, legacy: bool) -> list[str]:
    """`--load-balance-method round_robin` for a server of several DP ranks (`tokens`: the
    extra_args; plain --dp-size replicas, or attention DP ranks), so that its DP controller
    deals each arm's requests to its ranks in turn and not by load snapshots read on a timer
    (`dvfs.engines.sglang.load_balance_refusal`); nothing for one rank, whose argv stays as
    it was. Both releases have the flag and the choice (their option tables)."""
    try:
        plain = int(_last_value(tokens, DP_SIZE_FLAGS) or 1)
    except ValueError:
        plain = 1
    if plain < 2 and attention_dp_ranks(tokens, legacy=legacy) < 2:
        return []
    return ["--load-balance-method", "round_robin"]


def pipeline_stages(tokens: Sequence[str]) -> int:
    """The pipeline-parallel size `tokens` (the extra_args) ask for as argparse reads them
    (the last flag given); 1 where none is given or its value is not a number above 1."""
    try:
        return max(1, int(_last_value(tokens, PIPELINE_FLAGS_0523) or 1))
    except ValueError:
        return 1


def running_arg(largest: int, ranks: int, stages: int = 1) -> int:
    """The --max-running-requests dvfs gives a server of `ranks` attention DP ranks and
    `stages` pipeline stages so that each rank holds its turn of the largest batch at once:
    the scheduler gives each rank max_running_requests // ranks (0.5.23 kv_cache_configurator.py
    `resolve_max_num_reqs`), and the DP controller deals a batch of B to them in turn, up to
    ceil(B / ranks) to one (data_parallel_controller.py `round_robin_scheduler`); a rank's
    pipeline runs its pp_size micro-batches of at most its share // pp_size each (scheduler.py
    `pp_max_micro_batch_size`, `get_num_allocatable_reqs`). B itself would leave a rank, or a
    micro-batch, short where B is no multiple of them: each rounded up to a whole turn."""
    need = -(-largest // ranks)
    return ranks * stages * -(-need // stages)


def speculative_args(drafter: DrafterSpec) -> list[str]:
    """The drafter's speculative flags, all-or-none for the EAGLE numbers."""
    if drafter.algorithm is None:
        return []
    args = ["--speculative-algorithm", drafter.algorithm]
    if drafter.draft_model:
        args += ["--speculative-draft-model-path", drafter.draft_model]
    if drafter.algorithm in ("NGRAM", "DFLASH"):
        if drafter.num_draft_tokens is not None:
            args += ["--speculative-num-draft-tokens", str(drafter.num_draft_tokens)]
        return args
    numbers = (drafter.num_steps, drafter.eagle_topk, drafter.num_draft_tokens)
    if all(n is not None for n in numbers):
        args += [
            "--speculative-num-steps",
            str(drafter.num_steps),
            "--speculative-eagle-topk",
            str(drafter.eagle_topk),
            "--speculative-num-draft-tokens",
            str(drafter.num_draft_tokens),
        ]
    elif any(n is not None for n in numbers):
        raise EngineError(
            f"drafter {drafter.name!r}: set num_steps, eagle_topk and "
            "num_draft_tokens all together or none"
        )
    return args


def launch_argv(
    campaign: Campaign,
    drafter: DrafterSpec,
    *,
    port: int,
    help_text: str | None = None,
    version: str | None = None,
    ports: ServerPorts | None = None,
) -> list[str]:
    """The full argv (a list: never a shell string) for one drafter's server; with `ports`,
    on that block (its --port replaces `port`, and --nccl-port is set)."""
    sg = campaign.engine.sglang
    pinned: list[str] = []
    if ports is not None:
        port = ports.http
        pinned = ["--nccl-port", str(ports.nccl)]
        for token in (*sg.extra_args, *drafter.extra_args):
            flag = _port_flag(token)
            if flag is not None:
                raise EngineError(
                    f"{token} in the extra_args of drafter {drafter.name!r} or engine.sglang: "
                    f"dvfs sets {flag.split('=')[0]} itself when servers share a node (each "
                    "its own ports); remove it"
                )
    parsed = parse_version(version or sg.version)
    _check_algorithm(drafter, parsed)
    largest = max(campaign.workload.batch_sizes)
    graph_flag = cuda_graph_flag(help_text, parsed)
    legacy = graph_flag == OLD_CUDA_GRAPH_FLAG
    overlap = _overlap_plan(campaign, legacy=legacy, env=launch_env(campaign))
    extra = [*sg.extra_args, *drafter.extra_args]  # as argparse reads them: in argv's order
    argv = [
        *server_command(campaign),
        "--model-path",
        campaign.engine.model,
        "--host",
        sg.host,
        "--port",
        str(port),
        *pinned,
        "--tp-size",
        str(campaign.engine.tp_size),
        # the largest batch, rounded up to a whole turn of it for each attention DP rank and
        # pipeline micro-batch (`running_arg`); CUDA graphs still to the largest batch, which
        # no rank exceeds
        "--max-running-requests",
        str(running_arg(largest, attention_dp_ranks(extra, legacy=legacy), pipeline_stages(extra))),
        graph_flag,
        str(largest),
        GRAPH_SIZES_FLAG[graph_flag],
        *(str(b) for b in graph_batch_sizes(campaign.workload.batch_sizes)),
        *(["--disable-overlap-schedule"] if overlap.pin else []),
        *admission_hold_args(campaign, legacy=legacy, help_text=help_text),
        *load_balance_args(extra, legacy=legacy),
        "--enable-metrics",
        # one seed for every drafter's server: SGLang draws a random one at each start
        "--random-seed",
        str(campaign.measurement.seed),
        *attention_args(campaign),
        *speculative_args(drafter),
        *sg.extra_args,
        *drafter.extra_args,
    ]
    return argv


#: The port a planned (not started) server is shown with; the real one is chosen at start.
PLANNED_PORT = 30000


def planned_launches(campaign: Campaign, *, here: bool = True) -> list[tuple[str, list[str], str]]:
    """Per drafter: its name, the argv its server would start with, and where the version-
    dependent flags came from. Runs `launch_server --help` unless the campaign pins a version;
    refuses, as a sweep would, drafters SGLang would schedule differently (`arm_mismatches`).
    Only for servers dvfs starts: an attached one (engine.sglang.url) has no launch here
    (`dvfs.backends.server_plans`). `here` False: the servers start elsewhere (`--executor
    ray`: on the Ray workers' nodes), so sglang missing here is no refusal to name."""
    if campaign.engine.sglang.url:
        raise EngineError("a campaign attached at engine.sglang.url starts no server to plan")
    check_predicted_kernels(campaign)
    pinned = campaign.engine.sglang.version
    help_text = None if pinned else cached_help(server_command(campaign), server_env(campaign))
    if any(d.algorithm for d in campaign.drafters):
        check_algorithms_known(campaign, help_text)  # refused as the sweep refuses it
    check_arms_can_match(campaign, help_text)
    uninstalled = None if pinned or help_text or not here else not_installed(campaign)
    source = (
        "engine.sglang.version"
        if pinned
        else "launch_server --help"
        if help_text
        else "assumed SGLang >= 0.5.23 (launch_server --help could not run here; "
        "set engine.sglang.version)"
        if uninstalled is None
        else f"assumed SGLang >= 0.5.23 ({uninstalled}, as the sweep here refuses without it; "
        "to plan for another machine, set engine.sglang.version)"
    )
    return [
        (d.name, launch_argv(campaign, d, port=PLANNED_PORT, help_text=help_text), source)
        for d in campaign.drafters
    ]


def attention_args(campaign: Campaign) -> list[str]:
    """`--attention-backend X` for a pinned backend; nothing for "auto" (SGLang chooses)."""
    backend = campaign.engine.sglang.attention_backend
    return [] if backend == "auto" else ["--attention-backend", backend]


@dataclass(frozen=True)
class Kernels:
    """The target model's attention kernels as a server resolved them (None: not reported)."""

    attention: str | None
    prefill: str | None
    decode: str | None

    @classmethod
    def from_args(cls, args: Mapping[str, object]) -> Kernels:
        """From /server_info's resolved args: the split backends fall back to the main one."""

        def text(key: str) -> str | None:
            value = args.get(key)
            return str(value) if value not in (None, "") else None

        attention = text("attention_backend")
        prefill = text("prefill_attention_backend") or attention
        decode = text("decode_attention_backend") or attention
        return cls(attention, prefill, decode)

    @property
    def label(self) -> str:
        """One name when prefill and decode agree, else both."""
        if self.prefill == self.decode:
            return str(self.decode)
        return f"prefill={self.prefill},decode={self.decode}"


#: The shortest abbreviation of --page-size that SGLang 0.5.9's and 0.5.23's argparse both read
#: as it (0.5.23's --paged-experts-num-resident makes "--page" ambiguous there).
PAGE_SIZE_PREFIX = "--page-"


def given_page_size(tokens: Sequence[str]) -> int | None:
    """The --page-size `tokens` (engine.sglang.extra_args) give, as argparse reads it (the last
    one, `--page-size=N` and abbreviations included); None when none is given or it is not a
    number (SGLang then refuses it itself)."""
    size = None
    for i, token in enumerate(tokens):
        name, eq, value = token.partition("=")
        if len(name) < len(PAGE_SIZE_PREFIX) or not "--page-size".startswith(name):
            continue
        if not eq:
            value = tokens[i + 1] if i + 1 < len(tokens) else ""
        try:
            size = int(value)
        except ValueError:
            size = None
    return size


def given_value(tokens: Sequence[str], flag: str) -> str | None:
    """The value `tokens` give `flag` as argparse reads it (`--flag VALUE` or `--flag=VALUE`,
    the last one; for a secret flag, `SGLANG_SECRET_FLAGS`, its abbreviations too), None when
    they give none."""
    value = None
    for i, token in enumerate(tokens):
        name, eq, rest = token.partition("=")
        if name != flag and not (flag in SGLANG_SECRET_FLAGS and sglang_secret_flag(name) == flag):
            continue
        value = rest if eq else (tokens[i + 1] if i + 1 < len(tokens) else None)
    return value


def server_keys(campaign: Campaign) -> tuple[str | None, str | None]:
    """The server's `--api-key` and `--admin-api-key`, as its argparse reads them: from
    engine.sglang.extra_args and, where dvfs starts the servers, from a server_command that
    passes them (a wrapper script's arguments reach launch_server before dvfs's own flags and
    extra_args, so extra_args win). dvfs sends them (`SglangClient`) and never records them
    (`dvfs.redact`)."""
    sg = campaign.engine.sglang
    command: tuple[str, ...] = ()
    if not sg.url:
        # After the launcher, its own argv (refused at load, but read as SGLang would);
        # without one, a wrapper that passes its arguments on.
        command = sg.server_command
        if LAUNCHER in command:
            command = command[command.index(LAUNCHER) + 1 :]
    given = (*command, *sg.extra_args)
    return given_value(given, "--api-key"), given_value(given, "--admin-api-key")


def predicted_attention_backend(drafter: DrafterSpec, page_size: int | None = None) -> str:
    """What SGLang 0.5.9 / 0.5.23 pick on Hopper for an MHA target when not told.

    They decide before filling in speculative defaults, from the topk given on the command line
    and the page size (`page_size`: --page-size, None when not given): fa3 unless
    --speculative-eagle-topk is above 1, or is 1 with a page size above 1 (then flashinfer).
    n-gram and DFLASH runs get their topk later, so they stay on fa3.
    """
    if drafter.algorithm in ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE") and (
        drafter.eagle_topk is not None and (drafter.eagle_topk > 1 or (page_size or 1) > 1)
    ):
        return "flashinfer"
    return "fa3"


def check_predicted_kernels(campaign: Campaign) -> None:
    """With the attention backend left to SGLang ("auto"), refuse drafters it would give other
    kernels (`predicted_attention_backend`, `check_same_kernels`) before any server starts."""
    if campaign.engine.sglang.attention_backend == "auto":
        page_size = given_page_size(campaign.engine.sglang.extra_args)
        predicted = {
            d.name: Kernels(*(predicted_attention_backend(d, page_size),) * 3)
            for d in campaign.drafters
        }
        check_same_kernels(predicted)


def check_same_kernels(kernels: Mapping[str, Kernels], pinned: str | None = None) -> None:
    """The invariant: every drafter's server runs the same attention kernels (the pinned ones).

    Otherwise "speculation vs none" would also compare attention implementations.
    """
    if pinned is not None:
        for name, k in kernels.items():
            if k.attention is None:
                raise EngineError(
                    f"the {name!r} server does not report its attention backend, so dvfs cannot "
                    f"confirm it runs {pinned} as engine.sglang.attention_backend pins"
                )
            if {k.prefill, k.decode} != {pinned}:
                raise EngineError(
                    f"the {name!r} server runs attention backend {k.label}, not {pinned} as "
                    "engine.sglang.attention_backend pins (SGLang replaced it; check the flags "
                    "in extra_args, e.g. --kv-cache-dtype)"
                )
    labels = {name: k.label for name, k in kernels.items()}
    if len(set(labels.values())) > 1:
        described = ", ".join(f"{name}: {label}" for name, label in labels.items())
        raise ArmMismatchError(  # an invalid campaign, as `arm_mismatches` (exit 2)
            f"drafters would run different attention backends ({described}): speculation vs none "
            'would also compare kernels; pin one with engine.sglang.attention_backend (e.g. "fa3")'
        )
