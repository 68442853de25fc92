"""The SGLang engine: a real server per drafter, fixed-batch or closed-loop decoding over HTTP.

The server runs as its own process group (argv list, never a shell) with its log kept in the
sweep folder, on the metered GPUs only (CUDA_VISIBLE_DEVICES = their UUIDs). It is stopped,
whole group, on exit, error, signal and a failed check of what it resolved; and it is asked to
die with dvfs (PR_SET_PDEATHSIG, armed by the `_pdeathsig` launcher rather than a `preexec_fn`)
so a SIGKILLed dvfs leaves no orphan. Or dvfs attaches to a server already running at a URL and
never starts or stops it, after the same checks of what it resolved (the model, the algorithm,
the kernels). Every drafter's server must run the same attention kernels
(`check_same_kernels`); a campaign whose drafters SGLang would schedule differently whatever
dvfs passes is refused before any server starts (`check_arms_can_match`); what else the arms
share is checked by the runner against the journal (`arm_changes`). A started server must run
on the metered GPUs (`pinning_outcome`): NVML's compute processes of every GPU are matched
against the server's process tree, so a `server_command` wrapper that escapes
CUDA_VISIBLE_DEVICES is refused; where NVML lists none of its processes (or cannot list
processes), by where it took its memory (`memory_outcome`: "verified by memory", or refused
alike), and where that cannot tell either, the server record says "unverified". Where it is
verified by PID, the server's process tree is handed on (`ServerInfo.own_pids`), so the runner
can tell another tenant's process on a metered GPU from the server's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dvfs.campaign.model import Campaign, DrafterSpec
from dvfs.campaign.sglang_flags import ADAPTIVE_WHY
from dvfs.clock import Clock
from dvfs.corpora import Prompt
from dvfs.engines.base import (
    DECODE_LOG_INTERVAL,
    KnobTimeline,
    RoundResult,
    ServerInfo,
    Workload,
    server_accept_covers,
)
from dvfs.engines.server_gpus import unjudged_wrapper_devices
from dvfs.engines.server_memory import kv_cap, memory_outcome, server_fraction
from dvfs.engines.sglang_args import (
    Kernels,
    LaunchHelp,
    ServerPorts,
    cached_help,
    check_algorithms_known,
    check_arms_can_match,
    check_flags_known,
    check_predicted_kernels,
    check_same_kernels,
    host_family,
    host_url,
    hub_repo,
    launch_argv,
    launch_env,
    parse_version,
    read_small,
    server_command,
    server_env,
    server_keys,
    unlistenable,
    unstartable,
)
from dvfs.engines.sglang_client import (
    SCHEDULER_PROBE,
    EngineConnectionError,
    SamplingParams,
    SglangClient,
    accept_length_of,
    hung_probe_s,
    rank_caps_of,
)
from dvfs.engines.sglang_refusals import StartRefusal, start_refusal, terminal_safe
from dvfs.errors import (
    MAX_MESSAGE_CHARS,
    CorpusError,
    CorpusUnavailableError,
    EngineCrashedError,
    EngineError,
    EngineHungError,
    GpuError,
    ServerReplacedError,
    ServerUnfitError,
)
from dvfs.gpu.base import GpuProcesses
from dvfs.outputs import check_links
from dvfs.procfs import dead_members, earlier_holder, port_holders, process_name, server_pids
from dvfs.redact import redact_args, redact_argv, redact_text, redact_url
from dvfs.twin.limits import given_max_total_tokens, mem_fraction_static

log = logging.getLogger(__name__)
LOG_TAIL_LINES = 40
#: How much of a log's end `tail` reads: a server's log over a long sweep may be gigabytes.
LOG_TAIL_BYTES = 256 * 1024
STOP_GRACE_S = 20.0
#: After a broken connection, how long to wait for the server to exit before calling it a crash.
CRASH_GRACE_S = 5.0
#: How long a process of a starting server's tree may lie dead, unreaped by its parent, before
#: the start is given up (`_DeadMembers`). SGLang's scheduler that fails by an exception sends
#: its launcher SIGQUIT, which ends the server (managers/scheduler.py `run_scheduler_process`,
#: entrypoints/engine.py's handler). One killed outright (the OS's out-of-memory killer, a
#: crash in native code) sends nothing: 0.5.23's launcher polls every rank each 5 s and exits
#: ("Rank N scheduler died during initialization", entrypoints/engine.py
#: `_wait_for_scheduler_ready`), but 0.5.9's waits on each rank's pipe in turn, so a rank that
#: died behind one still waiting for it (in a collective) leaves it waiting, unreaped, until
#: the start times out, a longer timeout no help.
DEAD_MEMBER_GRACE_S = 30.0
#: How often the server's process tree is read for dead members while it starts.
DEAD_MEMBER_POLL_S = 1.0
#: How many times one server start may move to another block of ports (`PortBlock`) when
#: another program has taken one of its block's.
PORT_MOVES = 3
#: How long a port of the block may stay held before the server moves: the processes of the
#: worker's last server (stopped, or failed to start) close their sockets only as they exit.
PORT_SETTLE_S = 5.0


class PortBlock(Protocol):
    """A fleet worker's block of ports for its servers (`dvfs.fleet.ports.PortBlock`)."""

    @property
    def ports(self) -> ServerPorts: ...

    def held_elsewhere(self, wait_s: float = 0.0) -> str | None:
        """The first port of the block another program holds ("port N: why") after `wait_s`,
        or None."""
        ...

    def move(self, why: str) -> ServerPorts:
        """Trade the block for another free one (saying so); EngineError when none is."""
        ...


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host` (engine.sglang.host); `EngineError` when nothing can listen
    there (a name that does not resolve, an address of another machine)."""
    try:
        with socket.socket(host_family(host), socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    except OSError as exc:
        raise unlistenable(host, exc) or EngineError(
            f"no free port on engine.sglang.host {host!r}: {exc.strerror or exc}"
        ) from exc


def dying_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` behind the `_pdeathsig` launcher, so the server gets SIGTERM when dvfs dies, even
    by SIGKILL (Linux; elsewhere the argv is left as it is)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    launcher = Path(__file__).with_name("_pdeathsig.py")
    return [sys.executable, "-I", str(launcher), str(os.getpid()), *argv]


def same_model(reported: object, wanted: str) -> bool:
    """Whether a server whose /server_info reports model_path `reported` serves the campaign's
    model `wanted`: the same name or path (a trailing '/' aside), or the local file SGLang
    0.5.23 serves a .gguf named on the Hugging Face Hub from, and reports in its place
    (`owner/repo/FILE.gguf`, `owner/repo:QUANT`, `owner/repo` holding one .gguf: downloaded to
    `.../models--owner--repo/snapshots/REVISION/FILE`, FILE ending in `-QUANT.gguf`)."""
    got = str(reported).rstrip("/")
    if got == wanted.rstrip("/"):
        return True
    repo, _, quant = wanted.rpartition(":")
    if not (quant and repo.count("/") == 1 and "/" not in quant):
        repo, quant = wanted, ""
    parts = repo.strip("/").split("/")
    snapshots = "/models--" + "--".join(parts[:2]) + "/snapshots/"
    at = got.find(snapshots)
    if len(parts) < 2 or at < 0 or not got.endswith(".gguf"):
        return False
    file = got[at + len(snapshots) :].partition("/")[2]  # past the revision
    if quant:
        return file.endswith(f"-{quant}.gguf")
    return file == "/".join(parts[2:]) if len(parts) > 2 else bool(file)


_COMMIT_RE = re.compile(r"[0-9a-f]{40}\Z")


def _hub_repos(model_path: object, env: Mapping[str, str], download_dir: object) -> list[Path]:
    """Where a server's weights of model `model_path` may come from, in the order SGLang looks:
    its --download-dir `download_dir` (the cache_dir its weights are fetched to, 0.5.9 and
    0.5.23 model_loader/weight_utils.py `download_weights_from_hf`), then the Hub cache
    (`hub_repo`)."""
    repo = hub_repo(model_path, env)
    if repo is None:
        return []
    given = [Path(str(download_dir)) / repo.name] if download_dir else []  # as given: no shell
    return [*given, repo]


def model_commit(
    model_path: object, revision: object, env: Mapping[str, str], download_dir: object = None
) -> str:
    """The Hugging Face Hub commit of model `model_path` a server with `revision` (None: the
    branch main), environment `env` and --download-dir `download_dir` loads: `revision`
    itself where it is a commit, else what `refs/REVISION` names in its --download-dir (where
    that commit's snapshot is there, as SGLang looks first) or in the Hub cache
    (`_hub_repos`); "" where it cannot tell (a local folder or file, ModelScope, a repo in
    neither). Read once the server answers, so after it fetched the model: a resume weeks
    later whose cache moved to another commit of an unpinned model serves other weights,
    generation config or template."""
    rev = str(revision or "main")
    if _COMMIT_RE.match(rev):
        return rev
    repos = _hub_repos(model_path, env, download_dir)
    for repo in repos:
        try:
            # (a FIFO or device there is not waited on nor read for ever)
            text = read_small(repo / "refs" / rev).strip()
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if _COMMIT_RE.match(text) and (repo == repos[-1] or (repo / "snapshots" / text).is_dir()):
            return text
    return ""


def model_files(
    model_path: object, commit: str, env: Mapping[str, str], download_dir: object = None
) -> dict[str, str]:
    """What the caches a server loaded `commit` of model `model_path` from hold of it (each of
    `_hub_repos` with its snapshot: a --download-dir's holds the weights, fetched there, the
    Hub cache's the config and tokenizer, which transformers fetches there): each file of the
    snapshots, by its path in the repo, with the blob it links to (named by the file's
    content: its git or LFS hash), so that two commits whose files a server loaded are the
    same blobs (a commit that edited the model card alone) are told from two whose weights,
    config, tokenizer or template differ; empty where dvfs cannot tell (no such snapshot, a
    cache without links, one that cannot be read)."""
    if not commit:
        return {}
    files: dict[str, str] = {}
    for repo in _hub_repos(model_path, env, download_dir):
        snapshot = repo / "snapshots" / commit
        if not snapshot.is_dir():
            continue
        try:
            for path in sorted(snapshot.rglob("*")):
                if path.is_symlink():
                    name = path.relative_to(snapshot).as_posix()
                    files.setdefault(name, Path(os.readlink(path)).name)
        except (OSError, ValueError):
            return {}
    return files


def tail(path: Path, lines: int = LOG_TAIL_LINES, start: int = 0) -> str:
    """The log's last lines from byte `start` on (where one server's own output begins in a
    log that servers of the same start number append to, run after run), for an error (and
    so the journal and cube): credentials SGLang prints (its `server_args=ServerArgs(...,
    api_key='...')`) hidden (`redact_text`), each line terminal-safe (`terminal_safe`)."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            begin = max(start, size - LOG_TAIL_BYTES)
            f.seek(begin)
            data = f.read(LOG_TAIL_BYTES)
    except OSError:
        return "(no log)"
    text = data.decode("utf-8", errors="replace").splitlines()
    if begin > start and len(text) > 1:
        text = text[1:]  # the first line read is cut (kept when it is all there is)
    return "\n".join(redact_text(terminal_safe(line)) for line in text[-lines:])


def with_log_tail(first: str, log_path: Path | None, start: int = 0) -> str:
    """An error's line followed by the server log's last lines from byte `start` on (`tail`;
    nothing when it has no log)."""
    shown = tail(log_path, start=start) if log_path else ""
    return f"{first}\n--- last lines of {log_path} ---\n{shown}"


class ChatFormatter:
    """Chat messages to the text `/generate` takes: the model's chat template when its tokenizer
    is available locally (transformers installed), else plain 'role: content' turns.

    SGLang tokenizes that text with the tokenizer's defaults, special tokens added, so a
    template that writes the BOS itself (Llama 3's <|begin_of_text|>) would reach the model
    with two: the templated text goes out without its leading BOS, one BOS in all, as dvfs
    counts the prompt's tokens (`dvfs.corpora.tokens`). A tokenizer that adds no BOS of its
    own (add_bos_token off) keeps the template's. `tokenizer`: one already loaded (tests hand
    in a fake), else the model's is looked up on first use.

    The format is decided once, at the first server start (`settle`), not at session start:
    on a fresh machine the model, its tokenizer with it, is in the local cache only once the
    first server has fetched it, and prompts went out with the chat template from then on
    before dvfs recorded the format. Decided, it stays for every later server, so the arms are
    sent alike; a resume keeps the journal's (`keep`), plain text included."""

    def __init__(self, model: str, tokenizer: Any = None) -> None:
        self.model = model
        self._tokenizer: Any = tokenizer
        self._tried = tokenizer is not None
        self._adds_bos: bool | None = None
        #: The format prompts go out in once decided ("plain" or "chat_template:<hash>").
        self._format: str | None = None

    def _load(self) -> Any:
        if not self._tried:
            self._tried = True
            from dvfs.corpora.tokens import load_tokenizer

            self._tokenizer = load_tokenizer(self.model)
            if self._tokenizer is None:
                log.info("no chat template for %s yet: sending plain text", self.model)
        return self._tokenizer

    def describe(self) -> str:
        """How the loaded tokenizer formats prompts: "chat_template:<hash>" (the first 16 hex
        digits of the template's SHA-256) or "plain"."""
        template = getattr(self._load(), "chat_template", None)
        if not template:
            return "plain"
        text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
        return f"chat_template:{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    def keep(self, recorded: str) -> None:
        """Send prompts as the journal being resumed did: plain text stays plain even where a
        chat template is now at hand; a template is looked up as usual at `settle` (and the
        runner refuses a server whose template's hash differs from `recorded`)."""
        if recorded == "plain":
            self._format = "plain"

    def settle(self) -> str:
        """The format prompts go out in from now on, decided at the first call (a server has
        just started, so the model it fetched is in the cache now: looked up again if an
        earlier look found nothing) and the same at every later call."""
        if self._format is None:
            if self._tokenizer is None:
                self._tried = False
            self._format = self.describe()
        return self._format

    def __call__(self, prompt: Prompt) -> str:
        if self._format == "plain":
            return prompt.text
        tokenizer = self._load()
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            try:
                text = str(
                    tokenizer.apply_chat_template(
                        prompt.as_chat(), tokenize=False, add_generation_prompt=True
                    )
                )
            except ImportError as exc:  # no jinja2 here: no prompt's fault
                from dvfs.corpora.tokens import template_unavailable

                raise template_unavailable(self.model, exc) from exc
            except Exception as exc:  # the template's own raise_exception: a jinja2 error
                raise CorpusError(
                    f"prompt {prompt.id}: the chat template of {self.model} refuses it ({exc}): "
                    "drop or merge the turns it refuses"
                ) from exc
            if self._adds_bos is None:
                self._adds_bos = adds_bos(tokenizer)
            if self._adds_bos:
                return without_bos(text, getattr(tokenizer, "bos_token", None))
            return text
        return prompt.text


def adds_bos(tokenizer: Any) -> bool:
    """Whether encoding plain text with `tokenizer`'s defaults starts with its BOS, as the
    server's tokenizing of "text" does (unknown: assumed, as Llama's tokenizers do)."""
    try:
        first = list(tokenizer.encode("x"))[:1]
    except Exception:
        return True
    bos = (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "bos_token", None))
    return bool(first) and first[0] is not None and first[0] in bos


def without_bos(text: str, bos: Any) -> str:
    """`text` less one leading `bos` (the server adds its own when it tokenizes)."""
    if isinstance(bos, str) and bos and text.startswith(bos):
        return text[len(bos) :]
    return text


def check_servable(campaign: Campaign, launch_help: Callable[[], str | None]) -> None:
    """Refuse, before any server starts, a campaign whose drafters SGLang would already serve
    with other attention kernels (none pinned) or other scheduling args (`check_arms_can_match`;
    its release decides which, from `launch_help()`, called only when a drafter speculates or
    extra_args are given), or whose extra_args name flags, or whose drafters algorithms, the
    release does not know.
    Needs no GPU: `SglangEngine` checks it on creation, a sweep before it makes its journal.
    An attached server (engine.sglang.url) is checked once it answers instead."""
    if campaign.engine.sglang.url:
        return
    check_predicted_kernels(campaign)
    speculates = any(d.algorithm for d in campaign.drafters)
    # Flags this release does not know stop every server at once (a plain arm's too), and each
    # server start reads --help anyway: probed for them alone as well.
    flags = campaign.engine.sglang.extra_args or any(d.extra_args for d in campaign.drafters)
    if speculates or flags:
        help_text = launch_help()
        check_flags_known(campaign, help_text)
        if speculates:
            check_algorithms_known(campaign, help_text)
            check_arms_can_match(campaign, help_text)


def check_attached(campaign: Campaign, info: dict[str, Any]) -> None:
    """Refuse, as each drafter's start refuses it, an attached server (engine.sglang.url) whose
    /server_info says it does not run what the campaign asks (its model, each drafter's
    algorithm, room for the largest batch, the pinned kernels), for `dvfs doctor`."""
    from dvfs.clock import MonotonicClock

    engine = SglangEngine(campaign, clock=MonotonicClock(), log_dir=Path(os.devnull))
    for drafter in campaign.drafters:
        engine._check_resolved(drafter, info, attached=True)


class _DeadMembers:
    """Watches a starting server's process tree for a member that died and lies unreaped
    longer than `DEAD_MEMBER_GRACE_S` (`DEAD_MEMBER_GRACE_S` says why SGLang 0.5.9 may wait
    on one forever); `check` raises the start's `EngineError` naming it. A member that exited
    with 0 is none (a helper its parent has yet to reap)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self._seen: dict[int, float] = {}
        self._next = 0.0

    def check(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return True
        self._next = now + DEAD_MEMBER_POLL_S
        dead = {pid: how for pid, how in dead_members(self.root).items() if how != 0}
        self._seen = {pid: self._seen.get(pid, now) for pid in dead}
        for pid, since in sorted(self._seen.items()):
            if now - since >= DEAD_MEMBER_GRACE_S:
                name = process_name(pid)
                raise EngineError(
                    f"its process {pid}{f' ({name})' if name else ''} {_ended(dead[pid])} as "
                    f"the server started, and the server has waited on it for "
                    f"{DEAD_MEMBER_GRACE_S:g} s without noticing (SGLang before 0.5.23 does not "
                    "notice a scheduler killed outright while its launcher waits on another "
                    "rank): more start-up time would not help"
                )
        return True


def _ended(status: int | None) -> str:
    """How a process ended, from its waitpid(2) status (None: unknown)."""
    if status is None:
        return "died"
    signum = status & 0x7F
    if not signum:
        return f"exited with code {status >> 8}"
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum == signal.SIGKILL:
        return (
            f"was killed ({name}; the OS's out-of-memory killer, most likely: "
            "dmesg -T | grep -i oom tells)"
        )
    return f"was killed ({name})"


class _NoAnswerError(EngineError):
    """A started server exited or timed out before it answered (its ports may be taken)."""


class SglangEngine:
    """The `Engine` protocol over a real (or attached) SGLang server. `launch_help`: its
    `launch_server --help` when already probed (`dvfs.backends.check_engine`)."""

    name = "sglang"

    def __init__(
        self,
        campaign: Campaign,
        *,
        clock: Clock,
        log_dir: Path,
        formatter: ChatFormatter | None = None,
        gpu_uuids: Sequence[str] = (),
        gpu_processes: Callable[[], Sequence[GpuProcesses]] | None = None,
        launch_help: LaunchHelp | None = None,
    ) -> None:
        self.campaign = campaign
        self.config = campaign.engine.sglang
        self.clock = clock
        self.log_dir = log_dir
        self.formatter = formatter or ChatFormatter(campaign.engine.model)
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self._log_path: Path | None = None
        #: Where the running server's own output begins in its log (appended to, as a resumed
        #: sweep's server of the same start number writes to the same file)
        self._log_from = 0
        self._client: SglangClient | None = None
        self._help: str | None = None
        self._help_probed = False
        self._starts = 0
        self._round = 0
        self._version: tuple[int, ...] | None = None
        #: The running server's --decode-log-interval (SGLang's default unless it says).
        self._log_interval = DECODE_LOG_INTERVAL
        #: What the running server's context leaves a request (`ContextRoom`, read from its
        #: /server_info at each start); None: it reports nothing to tell.
        self._room: ContextRoom | None = None
        #: Every GPU as NVML read it right before the server's start (its memory, for
        #: `memory_outcome`), and the --mem-fraction-static and --max-total-tokens dvfs passed
        #: it (None: none).
        self._memory_before: list[GpuProcesses] | None = None
        self._fraction_given: float | None = None
        self._cap_given: int | None = None
        #: The metered GPUs, which the server is pinned to (empty: simulated GPUs, no pinning).
        self.gpu_uuids = tuple(gpu_uuids)
        #: Lists every GPU's compute PIDs (NVML), to check where a started server runs; None:
        #: simulated GPUs, nothing to check.
        self.gpu_processes = gpu_processes
        #: The block of ports its servers use, set by a fleet's worker so that servers on one
        #: node never share one; None: a free --port, SGLang picks the rest.
        self.block: PortBlock | None = None
        #: Each started drafter's resolved attention kernels, for `check_same_kernels`.
        self.kernels: dict[str, Kernels] = {}
        #: The attached server (engine.sglang.url) as it answered at attach, in a server
        #: record's shape: each round checks the server there is still that one.
        self._attached: dict[str, Any] | None = None
        self.pinned_backend: str | None = (
            None if self.config.attention_backend == "auto" else self.config.attention_backend
        )
        if launch_help is not None:
            self._help, self._help_probed = launch_help.text, True
        check_servable(campaign, self.launch_help)

    def __enter__(self) -> SglangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def keep_prompt_format(self, recorded: str) -> None:
        """Send prompts as the journal being resumed recorded (`ChatFormatter.keep`)."""
        self.formatter.keep(recorded)

    @property
    def request_timeout_s(self) -> float:
        """Each request's deadline (engine.sglang.request_timeout_s): a round asking for more
        tokens than the server decodes in it fails (`dvfs.measure.inflight.deadline_tokens`)."""
        return self.config.request_timeout_s

    @property
    def attached_to(self) -> str | None:
        """The server that `start` attaches to (engine.sglang.url), said without its
        credentials; None: `start` starts one."""
        return f"the SGLang server at {redact_url(self.config.url)}" if self.config.url else None

    # -- lifecycle --------------------------------------------------------------------------
    def _client_for(self, url: str) -> SglangClient:
        api_key, admin_api_key = server_keys(self.campaign)
        return SglangClient(
            url,
            clock=self.clock,
            request_timeout_s=self.config.request_timeout_s,
            stall_timeout_s=self.config.stall_timeout_s,
            api_key=api_key,
            admin_api_key=admin_api_key,
        )

    def launch_help(self) -> str | None:
        if not self._help_probed:
            self._help_probed = True
            self._help = cached_help(
                server_command(self.campaign), server_env(self.campaign, self.gpu_uuids)
            )
        return self._help

    def start(self, drafter: DrafterSpec) -> ServerInfo:
        """Start `drafter`'s server. On a worker's block of ports, one another program has
        taken a port of since (found before the start, or after a start that failed) moves
        the server to the next free block, `PORT_MOVES` times at most."""
        self.stop()
        if self.config.url:
            return self._attach(drafter)
        moves = 0
        why = self._held_elsewhere()
        while True:
            if why is not None:
                assert self.block is not None
                self.block.move(why)
                moves += 1
            try:
                return self._start(drafter)
            except _NoAnswerError as exc:
                why = self._held_elsewhere() if moves < PORT_MOVES else None
                if why is None:
                    raise
                log.info("%s", exc)  # moved to another block next

    def _refusal(self, drafter: DrafterSpec, argv: Sequence[str]) -> StartRefusal | None:
        """Why SGLang would not start the server for the campaign as it is, where the server
        exited before it answered and what it printed says so (`start_refusal`); None for
        any other failure (a crash, a timeout, its port taken), which a rerun may not meet."""
        if self._process is None or self._process.poll() is None or self._log_path is None:
            return None
        try:
            with self._log_path.open("rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(self._log_from, size - LOG_TAIL_BYTES))
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return None
        return start_refusal(redact_text(text), drafter, argv, self.campaign.engine.tp_size)

    def _others_on_gpus(self, ours: frozenset[int]) -> str | None:
        """The compute processes NVML lists on the server's GPUs now that are not the
        server's (`ours`), as "GPU 0: process 42 (python); ..."; None: none, or nothing to
        tell (simulated GPUs, NVML cannot list them). Only those /proc here shows: in a
        container's PID namespace NVML names processes by the host's PIDs, so the server's
        own, still dying, would look like another's."""
        if self.gpu_processes is None:
            return None
        try:
            gpus = self.gpu_processes()
        except GpuError:
            return None
        seen = []
        for gpu in gpus:
            if gpu.uuid not in self.gpu_uuids or not gpu.pids:
                continue
            for pid in sorted(gpu.pids - ours):
                name = process_name(pid)
                if name is not None:
                    seen.append(f"GPU {gpu.index}: process {pid} ({name})")
        return "; ".join(seen) or None

    def _held_elsewhere(self) -> str | None:
        """A port of the block another program still holds after `PORT_SETTLE_S`, or None
        (none: no block)."""
        return None if self.block is None else self.block.held_elsewhere(PORT_SETTLE_S)

    def _start(self, drafter: DrafterSpec) -> ServerInfo:
        """One start of the server, on the block's ports or a free --port; `_NoAnswerError`
        when it exited or timed out before it answered (its ports may have been taken)."""
        ports = self.block.ports if self.block is not None else None
        help_text = self.launch_help()  # first: its probe may take seconds, the port is free now
        port = ports.http if ports else free_port(self.config.host)
        argv = launch_argv(self.campaign, drafter, port=port, help_text=help_text, ports=ports)
        self._starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = self.log_dir / f"server-{drafter.name}-{self._starts}.log"
        check_links(self._log_path)  # as root, no server log through another user's link
        self._log_file = open(self._log_path, "ab")  # noqa: SIM115 (closed in stop())
        shown = " ".join(redact_argv(argv))  # the log may be shared: no credentials
        self._log_file.write(("$ " + shown + "\n").encode())
        self._log_file.flush()
        self._log_from = self._log_file.tell()
        try:
            env = server_env(self.campaign, self.gpu_uuids)
        except EngineError:
            self.stop()
            raise
        log.info("starting SGLang: %s", shown)
        problem = unstartable(argv[0], env)
        if problem:
            self.stop()
            raise EngineError(f"cannot start the server: {problem}")
        self._memory_before = self._gpus_now()  # where it took its memory, if NVML lists no PID
        self._fraction_given = mem_fraction_static(argv)
        self._cap_given = given_max_total_tokens(argv)
        try:
            self._process = subprocess.Popen(
                dying_with_parent(argv),
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            self.stop()
            raise EngineError(f"cannot start the server ({argv[0]}): {exc.strerror}") from exc
        self._client = self._client_for(host_url(self.config.host, port))
        members = _DeadMembers(self._process.pid)
        try:
            self._client.wait_healthy(
                self.config.startup_timeout_s,
                alive=lambda: self._alive() and members.check(),
                hint="one still loading its model needs a longer engine.sglang.startup_timeout_s",
            )
            info = self._client.server_info()
        except EngineError as exc:
            log_path = self._log_path
            refusal = self._refusal(drafter, argv)
            ours = self._own_pids()  # before the stop: its dying processes may still be listed
            self.stop()
            others = self._others_on_gpus(ours) if refusal and refusal.memory else None
            if refusal is not None and others is not None:  # not the campaign's doing
                raise _NoAnswerError(refusal.beside(drafter.name, log_path, others)) from exc
            if refusal is not None:  # a rerun meets it again: the campaign must change
                raise ServerUnfitError(refusal.message(drafter.name, log_path)) from exc
            raise _NoAnswerError(
                with_log_tail(
                    f"the {drafter.name!r} server failed to start: {exc}",
                    log_path,
                    self._log_from,  # not an earlier run's server's, in the same log
                )
            ) from exc
        if not self._alive() and self._client.health_status() != 200:
            # It answered, then died, and nothing answers there now: a crash, not another
            # program in its place.
            log_path, code = self._log_path, self._process.poll()
            self.stop()
            raise _NoAnswerError(
                with_log_tail(
                    f"the {drafter.name!r} server exited (exit code {code}) just after it "
                    f"answered on its port {port}",
                    log_path,
                    self._log_from,
                )
            )
        other = self._answered_by_another(drafter, info, port, ports)
        if other is not None:
            log_path = self._log_path
            self.stop()  # its port is another program's: it could not serve there
            raise _NoAnswerError(f"{other} (the server's log: {log_path})")
        try:
            kernels = self._check_resolved(drafter, info)
            pinning = self._check_pinning(drafter, info)
        except EngineError:
            self.stop()  # a server that does not run what was asked must not linger
            raise
        self._version = server_version(info)
        self._log_interval = log_interval(info)
        self._room = ContextRoom.of(info)
        env, model, weights = (
            server_env(self.campaign),
            info.get("model_path"),
            info.get("download_dir"),
        )
        commit = model_commit(model, info.get("revision"), env, weights)
        return ServerInfo(
            "sglang",
            str(info.get("version", "?")),
            drafter.name,
            _resolved_args(info),
            str(self._log_path),
            attention_backend=kernels.label,
            gpu_pinning=pinning,
            # Only where NVML lists its PIDs: verified by memory, every PID there looks foreign.
            own_pids=self._own_pids if pinning and pinning.startswith("verified: ") else None,
            prompt_format=self.formatter.settle(),
            ports=ports.to_json() if ports else None,
            model_commit=commit,
            model_files=model_files(model, commit, env, weights),
            running_caps=_caps(info),
        )

    def _answered_by_another(
        self, drafter: DrafterSpec, info: dict[str, Any], port: int, ports: ServerPorts | None
    ) -> str | None:
        """Why what answered on the started server's `port` (its /health, then /server_info
        `info`) is another program, not that server; None when nothing says so. SGLang
        listens only once its weights are loaded, and one that cannot listen (the port taken)
        exits: until then another program on the port answers in its place. It is told by the
        server having exited while its port still answers (the caller told a server that
        died just after its answer, its port silent since); by reporting another model
        (`same_model`; not checked with SGLANG_USE_MODELSCOPE, with which SGLang reports the
        folder it downloaded the model to), port, TP size or (on a block of ports) NCCL port
        than dvfs started the server with; or by the process listening there having run
        before the server (`earlier_holder`)."""
        url = self._client.shown_url if self._client is not None else f"port {port}"
        if not self._alive():
            code = self._process.poll() if self._process is not None else None
            return (
                f"the {drafter.name!r} server exited (exit code {code}) while another program "
                f"answered on its port {port} ({url}) in its place"
            )
        expected: dict[str, object] = {
            "port": port,
            "tp_size": self.campaign.engine.tp_size,
        }
        env = server_env(self.campaign, self.gpu_uuids)
        # SGLang 0.5.9 reads "true" or "1" as true, 0.5.23 also "yes" or "y"
        if env.get("SGLANG_USE_MODELSCOPE", "").lower() not in ("true", "1", "yes", "y"):
            expected["model_path"] = self.campaign.engine.model
        if ports is not None:
            expected["nccl_port"] = ports.nccl
        for key, wanted in expected.items():
            got = info.get(key)
            if got is None or (
                same_model(got, str(wanted)) if key == "model_path" else str(got) == str(wanted)
            ):
                continue
            if self._process is not None and port_holders(
                port, sorted(server_pids(self._process.pid)), host=self.config.host
            ):  # the server dvfs started listens there: it was started with other flags
                return (
                    f"the {drafter.name!r} server dvfs started reports {key} {got!r}, not "
                    f"{wanted!r} as dvfs set it: engine.sglang.server_command passes "
                    "launch_server flags of its own (a wrapper's arguments reach it too); "
                    "remove them (flags every drafter shares go in engine.sglang.extra_args); "
                    "dvfs stopped the server"
                )
            return (
                f"another program answers on the {drafter.name!r} server's port {port} "
                f"({url} reports {key} {got!r}, not {wanted!r} as dvfs started the server "
                "with); dvfs stopped the server it started"
            )
        if self._process is not None:
            other = earlier_holder(port, self._process.pid, host=self.config.host)
            if other is not None:
                return (
                    f"another program (pid {other}, {process_name(other) or '?'}) answers on the "
                    f"{drafter.name!r} server's port {port} ({url}): it listens there and was "
                    "running before dvfs started the server, which dvfs stopped"
                )
        return None

    def _attach(self, drafter: DrafterSpec) -> ServerInfo:
        assert self.config.url is not None
        self._client = self._client_for(self.config.url)
        self._client.wait_healthy(self.config.startup_timeout_s)
        info = self._client.server_info()
        try:
            # Not started by dvfs: it must serve the campaign's model and drafter.
            kernels = self._check_resolved(drafter, info, attached=True)
        except EngineError:
            self._client = None  # not ours to stop; measure nothing on it
            raise
        self._version = server_version(info)
        self._log_interval = log_interval(info)
        self._room = ContextRoom.of(info)
        self._attached = server_record_of(drafter.name, info)
        return ServerInfo(
            "sglang",
            str(info.get("version", "?")),
            drafter.name,
            _resolved_args(info),
            None,
            attention_backend=kernels.label,
            gpu_pinning=(
                None
                if self.gpu_processes is None
                else "unverified: an attached server's processes are not dvfs's to look up"
            ),
            prompt_format=self.formatter.settle(),
            running_caps=_caps(info),
        )

    def _check_still_attached(self, info: dict[str, Any]) -> None:
        """Refuse a round served by another server than the one attached to (restarted with
        other flags, another SGLang, another drafter): its cells would be journalled under the
        attached one's record, and compare with the drafter's earlier cells in more than the
        knob setting. Compared as two servers of one journal are (`arm_changes` and
        `server_changes`); refused with `ServerReplacedError`, which stops the sweep."""
        from dvfs.records import ARMS_PINNED, arm_changes, server_changes, with_changes
        from dvfs.records.session import CHANGES

        before = self._attached
        assert before is not None
        now = server_record_of(str(before["drafter"]), info)
        batches = self.campaign.workload.batch_sizes
        changes = arm_changes(before, now, batches)
        changes += [c for c in server_changes(before, now) if c not in changes]
        # Refused at attach (`_check_resolved`), and not an arm arg: 0.5.9 leaves the decode
        # CUDA graphs as they were, so nothing above would tell a batch queued behind the cap.
        running, largest = now["args"].get("max_running_requests"), max(batches)
        if isinstance(running, int) and running * dp_replicas(now["args"]) < largest:
            was = before["args"].get("max_running_requests")
            # said once, with why it matters (`server_changes` names it too: a DRAFTER_ARGS)
            changes = [c for c in changes if not c.startswith("max_running_requests: ")]
            changes.append(
                f"max_running_requests: {was!r} -> {running!r}, below the largest batch {largest}"
            )
        if changes:
            how = "restart it as it was"
            seed = before["args"].get("random_seed")
            if seed is not None and any(
                c.startswith(ARMS_PINNED["random_seed"][1]) for c in changes
            ):
                # Both releases draw a seed at every start without --random-seed: the same
                # command restarted is another seed, however it was restarted.
                how += f", with --random-seed {seed} (without it SGLang draws one at each start)"
            # Every later cell would be measured on it and refused alike: the sweep stops.
            line = (
                f"the server at {redact_url(self.config.url or '')} is not the one dvfs "
                f"attached to for drafter {before['drafter']!r} ({CHANGES}): it was "
                "replaced mid-sweep, and its rounds would compare more than the knob settings, "
                "so the sweep stopped (the journal keeps the cells measured before); "
                f"{how} and rerun the same command to resume, or rerun with --fresh (or into "
                "another --out folder)"
            )
            # The changes named give way to the remedy, which ends the line whole.
            raise ServerReplacedError(with_changes(line, changes, MAX_MESSAGE_CHARS))

    def _check_kernels(self, drafter: DrafterSpec, args: dict[str, Any]) -> Kernels:
        """The drafter's attention kernels: the pinned ones, and the same as the other drafters'."""
        kernels = Kernels.from_args(args)
        others = {k: v for k, v in self.kernels.items() if k != drafter.name}
        check_same_kernels({**others, drafter.name: kernels}, self.pinned_backend)
        self.kernels[drafter.name] = kernels
        return kernels

    def _check_resolved(
        self, drafter: DrafterSpec, info: dict[str, Any], *, attached: bool = False
    ) -> Kernels:
        """The server must run what was asked: the model, the algorithm, room for the largest
        batch, and the attention kernels every drafter shares. An attached server (whose flags
        dvfs did not set) is held to the same."""
        args = _resolved_args(info)
        where = f"the server at {redact_url(self.config.url or '')}" if attached else "the server"
        fix = (
            "; attach to a server started for this drafter, or change the campaign to match it"
            if attached
            else ""
        )
        # (dvfs sets --model-path itself when it starts the server: checked when attached.)
        model, wanted = args.get("model_path"), self.campaign.engine.model
        if attached and model is not None and not same_model(model, wanted):
            raise EngineError(
                f"{where} serves model {str(model)!r}, not {wanted!r} as engine.model says{fix}"
            )
        algorithm = args.get("speculative_algorithm")
        if (algorithm or None) != drafter.algorithm and not (
            drafter.algorithm == "NEXTN" and algorithm == "EAGLE"
        ):
            raise EngineError(
                f"{where} runs speculative algorithm {algorithm!r}, "
                f"not {drafter.algorithm!r} as drafter {drafter.name!r} asks{fix}"
            )
        # SGLang resolves --speculative-adaptive off where it cannot apply (its
        # adaptive_unsupported_reason): what /server_info reports on is in force.
        if args.get("speculative_adaptive") is True:
            raise EngineError(
                f"{where} runs with --speculative-adaptive (its /server_info says so): "
                f"{ADAPTIVE_WHY}; start it without the flag, and measure each step count as a "
                "drafter of its own (num_steps)"
            )
        largest = max(self.campaign.workload.batch_sizes)
        # (not a whole number above 0, as no SGLang reports it: unknown, not a traceback)
        running = _count(args.get("max_running_requests"))
        replicas = dp_replicas(args)
        if running is not None and running * replicas < largest:
            across = f" in each of its {replicas} DP replicas" if replicas > 1 else ""
            raise EngineError(
                f"{where} caps running requests at {running}{across}, below the largest batch "
                f"{largest}{fix}"
            )
        dealt = load_balance_refusal(args)
        if dealt is not None:
            how = (
                "; start it with --load-balance-method round_robin" + fix
                if attached
                else "; remove --load-balance-method from the extra_args (dvfs gives a server "
                "of several DP ranks round_robin)"
            )
            raise EngineError(f"{where} {dealt}{how}")
        # Its scheduler may run fewer than the arg says (`rank_caps_of`): the rest of each
        # batch would queue, in this arm alone where another has more memory (no draft).
        caps = rank_caps_of(info)
        refusal = None if caps is None else running_cap_refusal(caps, largest, args)
        if refusal is None:
            refusal = pipeline_cap_refusal(info, caps, largest, args)
        if refusal is not None:
            raise EngineError(f"{where} {refusal}{fix}")
        drift = closed_loop_drift(self.campaign.workload.mode, args)
        if drift is not None:
            log.warning("%s %s", where, drift)
        return self._check_kernels(drafter, args)

    def _gpus_now(self) -> list[GpuProcesses] | None:
        """Every GPU's compute processes and memory now (None: simulated GPUs, or NVML cannot
        tell)."""
        if self.gpu_processes is None:
            return None
        try:
            return list(self.gpu_processes())
        except GpuError:
            return None

    def _check_pinning(self, drafter: DrafterSpec, info: dict[str, Any]) -> str | None:
        """Where the started server runs, by NVML's compute processes of every GPU (None:
        simulated GPUs); refuses one on a GPU dvfs does not meter (`pinning_outcome`). Where
        NVML lists none of its processes, by where it took its memory (`memory_outcome`)."""
        if self.gpu_processes is None or self._process is None:
            return None
        ours = server_pids(self._process.pid)
        try:
            gpus = self.gpu_processes()
        except GpuError as exc:
            outcome = f"unverified: {exc}"
        else:
            outcome = pinning_outcome(drafter.name, ours, gpus, self.gpu_uuids)
            before, self._memory_before = self._memory_before, None
            if outcome.startswith("unverified: ") and before is not None:
                args = _resolved_args(info)
                outcome = memory_outcome(
                    drafter.name,
                    before,
                    gpus,
                    self.gpu_uuids,
                    server_fraction(args, self._fraction_given),
                    outcome.removeprefix("unverified: "),
                    kv_cap(args, self._cap_given),
                )
        said = unjudged_wrapper_devices(self.campaign, gpu_uuids=self.gpu_uuids)
        if said is not None and not outcome.startswith("verified"):
            # What NVML could not tell, the wrapper's index or `all` does not either (doctor
            # warns).
            outcome += f"; {said}"
        level = logging.INFO if outcome.startswith("verified") else logging.WARNING
        log.log(level, "the %r server's GPUs: %s", drafter.name, outcome)
        return outcome

    def _own_pids(self) -> frozenset[int]:
        """The running server's process tree now (empty once it is gone)."""
        process = self._process
        return server_pids(process.pid) if process is not None else frozenset()

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _exited_within(self, seconds: float) -> bool:
        """Whether the server process is gone, giving a dying one time to finish dying."""
        if self._process is None:
            return True
        try:
            self._process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self) -> None:
        """Stop the whole process group: SIGTERM, a grace period, then SIGKILL."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        if process is not None:
            # Children of a crashed server may linger in its group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        self._client = None

    # -- workload ---------------------------------------------------------------------------
    def run(self, workload: Workload, timeline: KnobTimeline | None = None) -> RoundResult:
        if self._client is None:
            raise EngineCrashedError("no server is running (it died or was never started)")
        if timeline is not None and timeline.steps and workload.mode == "closed-loop":
            raise EngineError("knob steps inside a round need a fixed batch")
        client = self._client
        self._round += 1
        try:
            texts = [self.formatter(p) for p in workload.prompts]
        except CorpusUnavailableError:  # a template this environment cannot run
            raise
        except CorpusError as exc:
            raise CorpusError(f"corpus {workload.corpus!r}, {exc}") from exc
        params = SamplingParams(workload.max_new_tokens, workload.temperature, workload.ignore_eos)
        tag = f"dvfs-{os.getpid()}-{self._round}"
        try:
            client.flush_cache()
            started = self.clock.now_ns()
            stepper = _Stepper(timeline, self.clock) if timeline and timeline.steps else None
            try:
                if workload.mode == "closed-loop":
                    traces = client.run_closed_loop(
                        texts, params, workload.batch, tag, end_at_window=workload.end_at_window
                    )
                else:
                    started_cb = stepper.decode_started if stepper else None
                    traces = client.run_batch(
                        texts, params, tag, started_cb, end_at_window=workload.end_at_window
                    )
            finally:
                begun_ns, knob_ns = stepper.finish() if stepper else ((), ())
            ended = self.clock.now_ns()
            # The flush above reset the server's average (Scheduler.flush_cache calls
            # reset_metrics in 0.5.9 and 0.5.23 alike), which then counts only whole blocks
            # of decode_log_interval iterations: the round's, less its last partial block.
            if self._attached is None:
                accept = client.accept_length()
            else:  # not dvfs's server: another may have taken its place since the attach
                info = client.server_info()
                self._check_still_attached(info)
                accept = accept_length_of(info)
        except EngineError as exc:
            if self.config.url:
                raise  # not ours to restart
            if isinstance(exc, EngineConnectionError) and self._exited_within(CRASH_GRACE_S):
                raise EngineCrashedError(self._crash_message(exc)) from exc
            probe_s = hung_probe_s(launch_env(self.campaign))  # a wrapper's setting too
            probe = SCHEDULER_PROBE
            if self._alive() and (status := client.health_status(probe_s, path=probe)) != 200:
                # Alive but wedged (a hung scheduler outputs nothing, so its one-token health
                # generate never answers 200): every later cell would fail on it, so it is
                # stopped and restarted as a dead one is.
                raise EngineHungError(self._stop_hung(exc, status, probe_s)) from exc
            raise
        if not self.config.url and not self._alive():
            raise EngineCrashedError(self._crash_message(None, client))
        covers = (
            server_accept_covers(traces, workload.batch, self._log_interval)
            if accept is not None
            else 0.0
        )
        return RoundResult(
            tuple(traces),
            started,
            ended,
            accept,
            knob_ns,
            server_accept_covers=covers,
            knob_begun_ns=begun_ns,
        )

    def new_tokens_room(self, workload: Workload) -> int | None:
        """The most new tokens each request of `workload` may ask for and have decoded whole
        on the running server (`ContextRoom`); None: no server, or it reports nothing to
        tell (then nothing is bounded)."""
        if self._client is None or self._room is None:
            return None
        return self._room.new_tokens(max((p.input_tokens for p in workload.prompts), default=0))

    def _stop_hung(self, exc: EngineError, status: int | None, probe_s: float) -> str:
        """Stop a live server given up on as hung, and say why (`exc`, and what its scheduler
        probe, SCHEDULER_PROBE, said), with its log's last lines, read once it stopped."""
        health = (
            f"no answer from {SCHEDULER_PROBE} within {probe_s:g} s"
            if status is None
            else f"{SCHEDULER_PROBE} answered {status}"
        )
        log_path = self._log_path
        self.stop()
        return with_log_tail(
            f"the SGLang server stopped answering ({exc}; {health}): dvfs stopped it",
            log_path,
            self._log_from,
        )

    def _crash_message(self, exc: Exception | None, client: SglangClient | None = None) -> str:
        """Why the server is gone; `client`: the server's, when the round's requests were
        answered: if its port still answers, another program listens there (the started
        server could not, and exited) and the round's answers were that program's."""
        code = None
        if self._process is not None:
            code = self._process.poll()
        why = f" ({exc})" if exc else ""
        first = f"the SGLang server died (exit code {code}){why}"
        if exc is None and client is not None and client.health_status() == 200:
            first = (
                f"the SGLang server dvfs started exited (exit code {code}), yet its port still "
                f"answers ({client.shown_url}): another program listens there, and the round's "
                "answers were that program's"
            )
        return with_log_tail(first, self._log_path, self._log_from)


class _Stepper:
    """A `KnobTimeline` run on its own thread while the requests stream: it waits for the
    decode's start (`decode_started`, called from the client's event loop), then runs each
    step at its instant on the clock. `finish` stops it (steps not yet due never run), and
    raises what a step raised (a knob that failed to apply) in the caller's thread."""

    def __init__(self, timeline: KnobTimeline, clock: Clock) -> None:
        self.timeline = timeline
        self.clock = clock
        self._started = threading.Event()
        self._stop = threading.Event()
        self._start_ns = 0
        self.begun: list[int] = []
        self.ran: list[int] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="dvfs-knob-steps", daemon=True)
        self._thread.start()

    def decode_started(self, t_ns: int) -> None:
        self._start_ns = t_ns
        self._started.set()

    def _loop(self) -> None:
        while not self._started.wait(0.05):
            if self._stop.is_set():
                return
        for step in self.timeline.steps:
            due = self._start_ns + round(step.at_s * 1e9)
            while (left := due - self.clock.now_ns()) > 0:
                if self._stop.wait(left * 1e-9):
                    return
            if self._stop.is_set():
                return
            begun = self.clock.now_ns()
            try:
                step.apply()
            except BaseException as exc:  # raised by finish() in the caller's thread
                self.error = exc
                return
            self.begun.append(begun)
            self.ran.append(self.clock.now_ns())

    def finish(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """When each step that ran was called and when it returned (ns)."""
        self._stop.set()
        self._thread.join(timeout=STOP_GRACE_S)
        if self._thread.is_alive():
            raise EngineError("the knob-stepping thread did not stop (a knob change hung)")
        if self.error is not None:
            raise self.error
        return tuple(self.begun), tuple(self.ran)


def pinning_outcome(
    drafter: str, ours: frozenset[int], gpus: Sequence[GpuProcesses], metered: Sequence[str]
) -> str:
    """The invariant "the server runs on the metered GPUs only", as far as NVML can tell:
    "verified: GPU i" when every metered GPU lists one of the server's processes (`ours`) and
    NVML could list every GPU's; else "unverified: why" (NVML cannot list processes; a
    container's PID namespace hides the host's PIDs; no GPU memory allocated yet). One of the
    server's processes on a GPU not metered is refused (`EngineError`): its energy would be
    missed, and the metered GPUs would measure nothing of it."""
    seen = {g.uuid: g for g in gpus if g.pids and g.pids & ours}
    stray = [g for uuid, g in seen.items() if uuid not in metered]
    if stray:
        where = ", ".join(f"GPU {g.index} ({g.uuid})" for g in stray)
        raise EngineError(
            f"the {drafter!r} server runs on {where}, which dvfs does not meter (metered: "
            f"{', '.join(metered)}): check CUDA_VISIBLE_DEVICES and the "
            "engine.sglang.server_command wrapper (docker, srun, env), which must pass it on"
        )
    blind = [g for g in gpus if g.pids is None]
    missing = [uuid for uuid in metered if uuid not in seen]
    if not missing and not blind:
        return "verified: " + ", ".join(f"GPU {seen[u].index} ({u})" for u in metered)
    reasons = []
    if blind:
        reasons.append(
            "NVML cannot list the compute processes of "
            + ", ".join(f"GPU {g.index}" for g in blind)
            + (f" ({blind[0].why})" if blind[0].why else "")
        )
    if missing and not seen and len(blind) < len(gpus):
        reasons.append(
            f"NVML lists none of the server's {len(ours)} process(es) on any GPU (a container's "
            "PID namespace hides them, or the server has not allocated GPU memory yet)"
        )
    elif missing and seen:  # (every GPU blind: the first reason says it all)
        reasons.append(
            "NVML lists the server on "
            + ", ".join(f"GPU {g.index}" for g in seen.values())
            + " but not on the metered "
            + ", ".join(missing)
        )
    return "unverified: " + "; ".join(reasons)


#: The drafters whose draft tokens SGLang counts into each request's input against the
#: context (compute_num_reserved_tokens: is_eagle(); NEXTN is EAGLE's alias).
RESERVING_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")


@dataclass(frozen=True)
class ContextRoom:
    """What a running SGLang server leaves each request of its context, from its /server_info
    (0.5.9 and 0.5.23 alike: `max_req_input_len`, which the scheduler reports beside the
    resolved args and dvfs records with them, and the speculative args). Neither release
    reports the context length itself there (`context_length` is only what the launch gave),
    but `max_req_input_len` is the lesser of the context and the KV pool, less 1, less 5
    (`max_req_len` less 5). A request is refused when its prompt, the draft slots an
    EAGLE-family drafter reserves and its max_new_tokens exceed the context (0.5.23; reach it,
    0.5.9), and its max_new_tokens is cut to `max_req_len` less the prompt less 1 where
    admitted: asking at most `max_req_len` - 1 less the prompt and the reserved slots is
    neither refused nor cut."""

    max_req_input_len: int
    reserved: int

    @staticmethod
    def of(info: dict[str, Any]) -> ContextRoom | None:
        """From a /server_info answer; None where it lacks `max_req_input_len` as a whole
        number above 0 (a string, a bool, a fraction or an infinity is none: SGLang reports
        an int), a speculative arg that is none read as 0."""
        limit = _count(info.get("max_req_input_len"))
        if not limit:
            return None
        reserved = 0
        if str(info.get("speculative_algorithm") or "").upper() in RESERVING_ALGORITHMS:
            numbers = [
                _count(info.get(key)) or 0
                for key in (
                    "speculative_eagle_topk",
                    "speculative_num_steps",
                    "speculative_num_draft_tokens",
                    "max_speculative_num_draft_tokens",
                )
            ]
            topk, steps, drafts, most = numbers
            reserved = max(topk * steps, drafts, most)
        return ContextRoom(limit, reserved)

    def new_tokens(self, prompt_tokens: int) -> int:
        """The most new tokens a request of `prompt_tokens` may ask for (0: none)."""
        return max(0, self.max_req_input_len + 4 - prompt_tokens - self.reserved)


def server_record_of(drafter: str, info: dict[str, Any]) -> dict[str, Any]:
    """A server's /server_info `info`, answering for `drafter`, in the shape of its journal
    record (its engine, version, attention kernels and resolved args), for `arm_changes`."""
    args = _resolved_args(info)
    return {
        "drafter": drafter,
        "engine": "sglang",
        "version": str(info.get("version", "?")),
        "attention_backend": Kernels.from_args(args).label,
        "args": args,
    }


def dp_replicas(args: Mapping[str, Any]) -> int:
    """How many plain data-parallel replicas a server's resolved `args` run, each a scheduler
    given the whole --max-running-requests (and served in turn by the DP controller,
    managers/data_parallel_controller.py), so the server runs that many times the arg at once.
    SGLang 0.5.23 counts replicas with `dp_size` and attention DP ranks, which split the arg
    (kv_cache_configurator.py `resolve_max_num_reqs`), with `attn_dp_size` (its deprecated
    `--dp-size N --enable-dp-attention` resolves to `attn_dp_size` N, `dp_size` 1); 0.5.9,
    which has no `attn_dp_size`, counts attention DP ranks with `dp_size` where
    `enable_dp_attention` is set. 1 where the args do not say."""
    replicas = _count(args.get("dp_size")) or 1
    if "attn_dp_size" not in args and args.get("enable_dp_attention") is True:
        return 1
    return replicas


def dp_ranks(args: Mapping[str, Any]) -> int:
    """How many scheduler ranks (DP ranks, each with its own cap on running requests) a
    server's resolved `args` say run at start: 0.5.23's `dp_size` replicas of `attn_dp_size`
    attention DP ranks; 0.5.9's `dp_size` (which counts attention DP ranks too). 1 where the
    args do not say."""
    return (_count(args.get("dp_size")) or 1) * (_count(args.get("attn_dp_size")) or 1)


def running_cap_refusal(caps: list[int], largest: int, args: Mapping[str, Any]) -> str | None:
    """Why a server whose DP ranks run at most `caps` requests each (`rank_caps_of`) cannot
    serve the largest batch, after "the server", from its resolved `args`; None where it can,
    or where its list of ranks cannot tell.

    The DP controller deals requests to its ranks in turn, whatever each rank's cap
    (managers/data_parallel_controller.py `round_robin_scheduler`, the method "auto" resolves
    to outside PD disaggregation, and the one dvfs holds servers of several ranks to,
    `load_balance_refusal`): a batch of B over N ranks hands ceil(B / N) to a rank, whichever
    rank the turn starts at, so every rank must run that many or one queues (a sum of [4, 2]
    holds 6, yet 3 go to each). ("total_requests" and "total_tokens" deal by load snapshots
    instead, which no turn bounds.)

    With elastic EP (`elastic_ep_backend`) the ranks change while the server runs, and once
    it scales, /server_info asks only each attention DP group's first rank
    (tokenizer_control_mixin.py `update_control_communicator_fan_out`): a list shorter than
    the ranks the args say run, or any list with elastic EP, is not a count of the ranks
    that run, so nothing is refused from it (the arg's own check still holds).

    0.5.23 gives each attention DP rank max(1, max_running_requests // attn_dp_size)
    (mem_cache/kv_cache_configurator.py `resolve_max_num_reqs`), which no memory raises,
    then lowers a rank's share to what its KV pool or Mamba state cache holds."""
    if args.get("elastic_ep_backend") not in (None, "none") or len(caps) < dp_ranks(args):
        return None
    ranks = len(caps)
    need = -(-largest // ranks)
    # /server_info lists the ranks' states as their replies came (communicator.py
    # `FanOutCommunicator.handle_recv`), none saying its rank: a place in it is no DP rank,
    # so the ranks that queue are counted, not named, and the caps said in one order.
    short = sorted(c for c in caps if c < need)
    if not short:
        return None
    total = sum(caps)
    if total < largest and len(set(caps)) == 1:
        said = f"runs at most {total} requests at once, below the largest batch {largest}"
    else:
        run = "runs" if len(short) == 1 else "run"
        least = f" (the fewest {short[0]})" if len(set(short)) > 1 else f" ({short[0]})"
        said = (
            f"runs {total} requests at once over its {ranks} DP ranks "
            f"({sorted(caps, reverse=True)}), but its DP controller deals a batch of {largest} "
            f"to them in turn, up to {need} to each, more than {len(short)} of its ranks "
            f"{run}{least}: the rest would queue"
        )
    attn = _count(args.get("attn_dp_size")) or 1
    running = _count(args.get("max_running_requests")) or 0
    split = max(1, running // attn)
    # (0.5.23 refuses --dp-size replicas beside --attn-dp-size ranks, parallel_hook.py
    # `handle_data_parallelism`, and 0.5.9 has no attn_dp_size: the ranks split are all
    # the server's.)
    if attn > 1 and running and all(c == split for c in short):
        why = (
            f"its scheduler splits --max-running-requests {running} over its {attn} "
            f"attention DP ranks, {split} each"
        )
        # (a multiple of the ranks as the batch is no remedy where the arg is below it)
        return f"{said} ({why}): give it --max-running-requests {attn * need} or more"
    return (
        f"{said} (its scheduler lowered --max-running-requests to what its KV pool or Mamba "
        "state cache holds): give SGLang more memory for it (--mem-fraction-static, "
        "--max-mamba-cache-size in engine.sglang.extra_args) or lower the largest batch"
    )


#: The DP controller's methods that deal requests in turn (0.5.23 data_parallel_controller.py
#: `round_robin_scheduler`); "auto" resolves to it outside a PD prefill server
#: (serving_hook.py `handle_load_balance_method`).
ROUND_ROBIN = "round_robin"


def load_balance_refusal(args: Mapping[str, Any]) -> str | None:
    """Why a server's DP controller deals requests to its ranks other than in turn, after
    "the server", from its resolved `args`; None where it has one rank, deals in turn, or
    the args do not say.

    "total_requests" and "total_tokens" send each request to the rank whose load looks least
    (data_parallel_controller.py `DPBudget.dispatch`), from the ranks' load snapshots, read
    at most every 20 ms (`refresh_load_budget`, on time.perf_counter) and counted up between
    reads: which rank runs which request, and how many one runs, hang on when the snapshots
    were taken, so on each arm's timing (a drafter's steps are other lengths), and a rank
    may be dealt more than its turn of a batch and queue it where the caps say it runs
    (`running_cap_refusal`); "follow_bootstrap_room" (a PD prefill server's) deals by each
    request's bootstrap room. Only "round_robin" deals alike in every arm."""
    method = args.get("load_balance_method")
    if not isinstance(method, str) or dp_ranks(args) < 2:
        return None
    if method == ROUND_ROBIN or (method == "auto" and args.get("disaggregation_mode") != "prefill"):
        return None
    return (
        f"deals requests to its {dp_ranks(args)} DP ranks by --load-balance-method {method}, "
        "not in turn: by load snapshots its DP controller reads on a timer, so which rank runs "
        "which request (and whether one queues) hangs on each arm's timing"
    )


def closed_loop_drift(mode: str, args: Mapping[str, Any]) -> str | None:
    """What a closed-loop workload (`mode`) cannot hold on a server of several DP ranks, after
    "the server", from its resolved `args`; None for a fixed batch or one rank. A finished
    request's replacement goes to the DP controller's next rank in turn
    (data_parallel_controller.py `round_robin_scheduler`), not to the rank it finished on,
    so how many each rank runs drifts from B / ranks with the order requests finish in,
    which each arm's steps change, and a rank may be dealt more than its cap (queued, unseen
    by the caps checked at start): the batch is held whole, each rank's share of it not."""
    ranks = dp_ranks(args)
    if mode != "closed-loop" or ranks < 2:
        return None
    return (
        f"runs {ranks} DP ranks: a closed loop keeps the batch in flight over them, but each "
        "replacement goes to the next rank in turn, so each rank's share drifts with the "
        "order requests finish in (each arm's own) and one may queue unseen; measure a "
        "fixed batch (workload.mode) to hold each rank's share"
    )


def pipeline_cap_refusal(
    info: dict[str, Any], caps: list[int] | None, largest: int, args: Mapping[str, Any]
) -> str | None:
    """Why a server's micro-batches cannot run the largest batch at once, after "the server",
    from /server_info `info`, its ranks' `caps` (`rank_caps_of`) and resolved `args`; None
    where they can, or where nothing says.

    0.5.23's scheduler admits a request only while the running batch holds fewer than
    `pp_max_micro_batch_size` (scheduler.py `get_num_allocatable_reqs`), whatever the
    pipeline: with pipeline parallelism each of its pp_size + pp_async_batch_depth micro-
    batches (scheduler_pp_mixin.py `init_pp_loop_state`) holds that many, and left unset it is
    max(1, the rank's cap // pp_size) (scheduler.py), which a cap no multiple of pp_size
    leaves short of the cap (5 over 2 stages runs 2 + 2); without it, the one running batch.
    Each rank's value is its state's (`internal_states[i].pp_max_micro_batch_size`, the
    resolved one), else the arg, else worked out from its cap; a rank is dealt up to
    ceil(B / ranks) of a batch of B (`running_cap_refusal`, which also says why a list of
    fewer ranks than run, or elastic EP's, refuses nothing)."""
    states = info.get("internal_states")
    ranks = len(states) if isinstance(states, list) else len(caps or [])
    if args.get("elastic_ep_backend") not in (None, "none") or ranks < dp_ranks(args):
        return None  # no count of the ranks that run (`running_cap_refusal`)
    pp = _count(args.get("pp_size")) or 1
    depth = args.get("pp_async_batch_depth")
    depth = depth if isinstance(depth, int) and not isinstance(depth, bool) and depth > 0 else 0
    loop = pp + depth if pp > 1 else 1
    given = _count(args.get("pp_max_micro_batch_size"))
    micros: list[int] = []
    for i in range(max(1, ranks)):
        state = states[i] if isinstance(states, list) and i < len(states) else None
        reported = _count(state.get("pp_max_micro_batch_size")) if isinstance(state, dict) else None
        cap = caps[i] if caps is not None and i < len(caps) else None
        micro = reported or given or (max(1, cap // pp) if cap is not None else None)
        if micro is None:
            return None
        micros.append(micro)
    need = -(-largest // max(1, ranks))
    least = min(micros)
    if loop * least >= need:
        return None
    where = f" in one of its {ranks} DP ranks" if ranks > 1 else ""
    how = f"{loop} micro-batches of at most {least}" if loop > 1 else f"a batch of at most {least}"
    return (
        f"runs at most {loop * least} requests at once{where} ({how}, --pp-max-micro-batch-"
        f"size), below the {need} a batch of {largest} gives it: give it "
        f"--pp-max-micro-batch-size {-(-need // loop)} or more, or lower the largest batch"
    )


def _caps(info: dict[str, Any]) -> tuple[int, ...] | None:
    """Each DP rank's cap on running requests as /server_info `info` lists them, for the
    server's record (`ServerInfo.running_caps`); None where it reports none."""
    caps = rank_caps_of(info)
    return tuple(caps) if caps else None


def _resolved_args(info: dict[str, Any]) -> dict[str, Any]:
    """The server's resolved arguments as /server_info lists them (JSON-safe), credentials
    (`api_key`...) hidden: the journal and cube keep them (`dvfs.redact`)."""
    skip = {"internal_states", "version"}
    return redact_args({k: v for k, v in info.items() if k not in skip and _jsonable(v)})


def _jsonable(value: Any) -> bool:
    return isinstance(value, str | int | float | bool | type(None) | list | dict)


def server_version(info: dict[str, Any]) -> tuple[int, ...] | None:
    return parse_version(str(info.get("version", "")))


def log_interval(info: dict[str, Any]) -> int:
    """The server's decode_log_interval (/server_info), SGLang's default where it is missing
    or not a whole number above 0."""
    return _count(info.get("decode_log_interval")) or DECODE_LOG_INTERVAL


def _count(value: object) -> int | None:
    """`value` (read from /server_info) as a whole number above 0, or None where it is not
    one: a string, a bool, a fraction, a negative, NaN or an infinity."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value != int(value) or value < 1:
        return None
    return int(value)
