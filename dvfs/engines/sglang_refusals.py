"""Why a real SGLang server that exited as it started would not start for the campaign as it
is, read off what it printed: a rerun meets the same refusal, so the engine raises
`ServerUnfitError` (the twin's `dvfs.twin.limits` refuses the same cases before a start).
Where the GPUs' memory ran short while NVML listed other processes on them (another tenant's
job), that is not the campaign's doing: the engine fails the start plainly, naming them
(`StartRefusal.beside`), and a rerun retries it.

What SGLang prints, read (never copied) from sgl-project/sglang, messages unchanged from the
0.5.x model_runner.py they moved out of to the 0.5.23-era files named here:

- python/sglang/srt/model_executor/pool_configurator.py `MemoryPoolConfig.__post_init__` (the
  KV-cache sizing of python/sglang/srt/mem_cache/kv_cache_configurator.py; before it,
  model_executor/model_runner.py `init_memory_pool`): "Not enough memory. Please try to
  increase --mem-fraction-static." (newer releases add " Current value:
  mem_fraction_static=..."), a RuntimeError when the weights leave the static memory
  (GPU memory x --mem-fraction-static) no token of KV cache.
- python/sglang/srt/managers/tp_worker.py `TpModelWorker.__init__`: the assertion "Memory pool
  size is too small" when the KV pool (--max-total-tokens, or what the memory left) or the
  context cannot hold one request (max_req_len = min(context, pool) - 1, less 5 for its input).
- python/sglang/srt/configs/model_config.py `ModelConfig._derive_context_length`: "User-specified
  context_length (X) is greater than the derived context_length (Y). ... To allow overriding
  this maximum, set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1", a ValueError; for
  a draft model the same with "Target model's context_length" (without the env variable it is
  only a warning, which does not end with that sentence).
- python/sglang/srt/model_executor/cuda_graph_runner.py `CudaGraphRunner.__init__` (0.5.9;
  0.5.23: model_executor/runner/decode_cuda_graph_runner.py, its hint in
  model_executor/runner_backend_utils/__init__.py): "Capture cuda graph failed: {error}" and
  "set --mem-fraction-static to a smaller value ... set --cuda-graph-max-bs to a smaller value"
  (0.5.23: --cuda-graph-max-bs-decode, its only decode flag; newer releases say "This is not an
  out-of-memory error ..." for the others: that alone is no refusal here). The capture of each
  graph is logged as it begins and ends: model_runner.py `init_device_graphs` /
  `init_piecewise_cuda_graphs` ("Capture cuda graph begin.", "Capture piecewise CUDA graph
  begin.", 0.5.9) and model_runner_components/cuda_graph_setup.py ("Capture target prefill
  CUDA graph begin. backend=breakable, num_tokens=[...]", then "... decode ...", 0.5.23).
- The prefill-side graph: 0.5.9's piecewise one (--enable-piecewise-cuda-graph,
  model_executor/piecewise_cuda_graph_runner.py: "Capture cuda graph failed" too, its hint
  naming --piecewise-cuda-graph-max-tokens); 0.5.23's, on by default
  (model_executor/runner_backend_utils/breakable_cuda_graph/context.py logs the error with
  "Fail when using backend: breakable for prefill runner." and a hint naming
  --cuda-graph-max-bs-prefill, then re-raises it: the traceback ends in torch's own line).
  Its size is prefill tokens (up to the chunked prefill size), not the batch dvfs sets.
- The kernel warm-up: 0.5.9's model_executor/model_runner.py (`kernel_warmup`,
  `_flashinfer_autotune`; only with the flashinfer_trtllm or flashinfer_mxfp4 MoE backend),
  0.5.23's model_executor/runner/flashinfer_autotune.py, run by runner/base_runner.py's
  warm-up in the eager runner: "Running FlashInfer autotune with cache: ..." and "FlashInfer
  autotune completed." around a forward of --max-running-requests requests, after the KV
  cache and before any CUDA graph is captured (--disable-flashinfer-autotune skips it, in both
  releases' option tables).
- Each tensor-parallel rank logs its own lines ("[time TP1] ..."), its "Scheduler hit an
  exception: Traceback ..." line too; a --log-level above info drops the "Load weight",
  "Capture ..." and autotune lines, where the traceback's frames still say where it failed
  (model_runner.py `init_torch_distributed` as the communicators are set up, before any
  weights; `load_model`; `init_memory_pool`; the warm-up's; the graph runners').
- NVIDIA/nccl src/include/checks.h `CUDACHECK` and src/include/cudawrap.h `CUCHECK`: NCCL's
  warning "Cuda failure 'out of memory'" (the driver's: "Cuda failure 2 'out of memory'"),
  and the call fails with ncclUnhandledCudaError, which src/init.cc `ncclGetErrorString`
  words "unhandled cuda error (run with NCCL_DEBUG=INFO for details)": SGLang's pynccl
  (distributed/device_communicators/pynccl_wrapper.py) raises "RuntimeError: NCCL error:
  {that}", torch's ProcessGroupNCCL "NCCL error in: ..., {that}" with NCCL's last warning
  after "Last error:". SGLang sets up its tensor-parallel communicators
  (model_runner.py `init_torch_distributed`) before any weights load; NCCL may allocate more
  at a later first collective (a graph capture).
- python/sglang/srt/model_executor/model_runner.py `load_model`: "Load weight begin. avail
  mem=..." and "Load weight end. ..." around each model's weights (the target's, then an EAGLE
  or standalone drafter's draft model), one pair per tensor-parallel rank.
- pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp: "CUDA out of memory. Tried to allocate
  ..." (Python's torch.OutOfMemoryError, torch.cuda.OutOfMemoryError before 2.5); a CUDA call
  that fails so says "CUDA error: out of memory".
- python/sglang/srt/managers/scheduler.py `run_scheduler_process` logs "Scheduler hit an
  exception: {traceback}" and sends its parent SIGQUIT, whose handler
  (python/sglang/srt/entrypoints/engine.py) logs "Received sigquit from a child process. It
  usually means the child failed." and kills the whole process tree: the server exits.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dvfs.campaign.model import DrafterSpec
from dvfs.engines.sglang_args import NEW_CUDA_GRAPH_FLAG, OLD_CUDA_GRAPH_FLAG
from dvfs.twin.limits import (
    LONGER_CONTEXT_ENV,
    MORE_GPUS,
    given_context_length,
    given_max_total_tokens,
    mem_fraction_static,
)

#: The fewest tokens of context or KV pool SGLang starts with (tp_worker.py: a request's
#: max_req_len, the lesser of both less 1, and its input, that less 5, must be above 0).
REQUEST_MIN_TOKENS = 6
#: The most characters of SGLang's own line a refusal quotes.
QUOTE_CHARS = 200

#: A terminal's escape sequence (ANSI colour, CSI, or a two-character one): a log written with
#: colour (FORCE_COLOR, Python 3.13's coloured tracebacks) holds them before and inside the
#: lines read here, where they hid an exception's line from `_OOM` and went into the quote.
_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
_NOT_ENOUGH = re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static")
#: The static fraction the server resolved, as it logs it: its `server_args=ServerArgs(...,
#: mem_fraction_static=0.836, ...)` line as it starts, and 0.5.23's "Not enough memory" line
#: ("Current value: mem_fraction_static=0.836").
_SERVED_FRACTION = re.compile(r"\bmem_fraction_static=([0-9]*\.?[0-9]+)\b")
_POOL_TOO_SMALL = re.compile(r"Memory pool size is too small")
_CONTEXT = re.compile(
    r"(User-specified|Target model's) context_length \((\d+)\) is greater than the derived "
    r"context_length \((\d+)\).*To allow overriding this maximum"
)
_GRAPH = re.compile(r"Capture cuda graph failed")
#: Out of memory as an exception's line says it, where a traceback ends ("torch.OutOfMemoryError:
#: CUDA out of memory. ...", "Exception: Capture cuda graph failed: CUDA out of memory ...",
#: "RuntimeError: CUDA error: out of memory"), after a log line's prefixes ("[time TP0] ",
#: "[rank0]: "); not a warning that quotes one it survived (FlashInfer's autotuner skipping a
#: tactic "due to failure while profiling: CUDA out of memory"), which did not end the start.
#: cuBLAS words its own failed allocation (its workspace, as the first matmul creates its
#: handle: "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling
#: `cublasCreate(handle)`"), which SGLang releases after 0.5.23 take for out of memory in
#: their graph runners too (0.5.9 and 0.5.23 do not name it).
_OOM = re.compile(
    r"^\s*(?:\[[^\]]*\]:?\s*)*[\w.]*(?:Error|Exception): "
    r".*?(CUDA out of memory|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED)"
)
#: NCCL's own words for a CUDA allocation that failed (its warning; torch's "Last error:").
_NCCL_OOM = re.compile(r"Cuda failure (?:\d+ )?'out of memory'")
#: The exception NCCL's failure ends the start with (an exception's line, as for `_OOM`).
_NCCL_FATAL = re.compile(
    r"^\s*(?:\[[^\]]*\]:?\s*)*[\w.]*(?:Error|Exception): .*unhandled cuda error"
)
#: A CUDA graph capture beginning or ending, as SGLang logs it (what: "", "piecewise ",
#: "target prefill ", "target decode ", "draft "...); not "Capture cuda graph failed".
_CAPTURE = re.compile(r"\bCapture (?P<what>[\w .-]*?)(?:CUDA|cuda) graph (?P<edge>begin|end)\b")
#: The prefill-side graph's own failure words, where its capture's begin is not in the log.
_PREFILL_GRAPH = re.compile(
    r"Capture prefill CUDA graph failed|for prefill runner\.|--piecewise-cuda-graph-max-tokens to"
)
#: The prefill token sizes 0.5.23 captures (its begin line); 0.5.9's piecewise runner logs
#: "Capture cuda graph num tokens [...]".
_PREFILL_TOKENS = re.compile(r"(?:num_tokens=|Capture cuda graph num tokens )\[([\d, ]+)\]")
_PIECEWISE = re.compile(r"\bpiecewise\b", re.IGNORECASE)
_LOAD_BEGIN = re.compile(r"Load weight begin\b")
_LOAD_END = re.compile(r"Load weight end\b")
#: The kernel warm-up before any CUDA graph is captured (FlashInfer's autotune, as SGLang logs
#: it: 0.5.9's model_runner.py `_flashinfer_autotune`, 0.5.23's runner/flashinfer_autotune.py).
_WARMUP_BEGIN = re.compile(r"\bRunning FlashInfer autotune\b")
_WARMUP_END = re.compile(r"\bFlashInfer autotune completed\b")
#: The rank a log line's prefix names: SGLang's scheduler logs "[2026-02-14 02:07:50 TP1] ..."
#: (" DP0", " PP0", " EP1" beside it where those are set).
#: The prefix's bracket, read once; its trailing rank words are taken from its end
#: (`_rank_words`) in one pass, where a regular expression backtracked over every word of a
#: long unclosed bracket.
_PREFIX = re.compile(r"\s*\[([^\]]*)\]")
_RANK_KINDS = frozenset({"DP", "PP", "TP", "EP", "CP"})
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
#: A traceback's frame line ("line N" left out by some).
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)"(?:, line \d+)?, in (?P<func>[\w.<>]+)')
#: Where SGLang sets up its tensor-parallel communicators (model_runner.py
#: `init_torch_distributed`, distributed/parallel_state.py), before any weights.
_DISTRIBUTED_FUNCS = frozenset(
    {"init_torch_distributed", "init_distributed_environment", "initialize_model_parallel"}
)
#: Where a draft model's weights load (speculative workers).
_DRAFT_WORKERS = ("eagle_worker", "standalone_worker", "draft")
#: Where the CUDA graphs are captured (model_runner.py, the speculative workers; the graph
#: runners' own files, *cuda_graph*.py, tell it by their names). Not `capture` alone, which
#: names more than a graph's capture in 0.5.23 (an EAGLE3 target's auxiliary hidden states in
#: every forward, routed experts, the overlapped weight load).
_GRAPH_FUNCS = frozenset({"init_device_graphs", "init_cuda_graphs", "init_piecewise_cuda_graphs"})
#: Where the KV cache is sized (after the weights loaded).
_POOL_FILES = frozenset({"pool_configurator.py", "kv_cache_configurator.py"})


@dataclass(frozen=True)
class StartRefusal:
    """Why SGLang would not start the server (`why`, SGLang's own line `said`) and what to
    change in the campaign (`fix`: no ": " in it, as `dvfs.errors.unfit_fix` reads it).
    `memory`: the GPUs' memory ran short (not the campaign's doing where other processes
    held some of it: the engine checks)."""

    why: str
    said: str
    fix: str
    memory: bool = False

    def message(self, drafter: str, log_path: object) -> str:
        """The one line of the `ServerUnfitError`: why, SGLang's words, its log, the fix."""
        return (
            f"SGLang refused to start the {drafter!r} server: {self.why} (it said "
            f'"{self.said}"; its log {log_path}): {self.fix}'
        )

    def beside(self, drafter: str, log_path: object, others: str) -> str:
        """The one line of a start that ran out of GPU memory while `others` (processes not
        the server's, "GPU 0: process 42 (python)") held some of its GPUs' memory: a plain
        failure, which a rerun retries once they are gone, not the campaign's."""
        return (
            f"the {drafter!r} server failed to start: {self.why} (it said "
            f'"{self.said}"; its log {log_path}), while other processes held memory on its '
            f"GPUs ({others}): the campaign may well fit without them; stop them or wait "
            "until they end, then rerun the same command"
        )


def terminal_safe(line: str) -> str:
    """A server log's line as an error may show it: a terminal's escape sequences dropped (a
    colour left on would colour the rest of the user's terminal), any other character that
    does not print (NUL, a bell, a carriage return) shown as '?', a tab as a space."""
    text = _ESCAPE.sub("", line).replace("\t", " ")
    return "".join(c if c.isprintable() else "?" for c in text)


def _quote(line: str, start: int) -> str:
    """SGLang's line from `start` (where its message begins), cut to `QUOTE_CHARS`."""
    text = "".join(c if c.isprintable() else "?" for c in line[start:].strip())
    return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 3].rstrip() + "..."


def _where(flag_value: object, drafter: DrafterSpec) -> str:
    """The campaign key whose extra_args give a flag (`flag_value`: the drafter's own value,
    None where the drafter's extra_args do not give it)."""
    if flag_value is not None:
        return f"drafters.{drafter.name}.extra_args"
    return "engine.sglang.extra_args"


def _first(lines: Sequence[str], pattern: re.Pattern[str]) -> tuple[str, re.Match[str]] | None:
    for line in lines:
        found = pattern.search(line)
        if found is not None:
            return line, found
    return None


def start_refusal(
    log_text: str, drafter: DrafterSpec, launch: Sequence[str], tp_size: int
) -> StartRefusal | None:
    """Why SGLang would not start `drafter`'s server for the campaign, read off `log_text`
    (what the server printed as it started, and exited), with what to change; `launch`: the
    server's argv (the campaign's flags in it), `tp_size`: its tensor-parallel ranks. None:
    nothing it printed is such a refusal (a crash, another program on its port...: a rerun
    may start it)."""
    lines = _ESCAPE.sub("", log_text).splitlines()
    smaller = f"use {MORE_GPUS} or a smaller model"
    if drafter.draft_model:
        smaller = (
            f"use a smaller draft model than {drafter.draft_model}, {MORE_GPUS} or a smaller model"
        )
    fraction = mem_fraction_static(launch)
    fraction_where = _where(mem_fraction_static(drafter.extra_args), drafter)
    default = "SGLang's default"  # the number, where the server's log says it
    served = _first(lines, _SERVED_FRACTION) if fraction is None else None
    if served is not None:
        default += f" ({float(served[1].group(1)):g} here)"

    hit = _first(lines, _CONTEXT)
    if hit is not None:
        line, found = hit
        asked, model = int(found.group(2)), int(found.group(3))
        where = _where(given_context_length(drafter.extra_args), drafter)
        allow = f"set {LONGER_CONTEXT_ENV}=1 in engine.sglang.env"
        if found.group(1) == "User-specified":
            return StartRefusal(
                f"--context-length {asked} is above the model's context length ({model} tokens)",
                _quote(line, found.start()),
                f"give --context-length at most {model} in {where}, or {allow}",
            )
        draft = drafter.draft_model or f"of drafter {drafter.name!r}"
        return StartRefusal(
            f"the context length {asked} is above the draft model {draft}'s ({model} tokens)",
            _quote(line, found.start()),
            f"give --context-length at most {model} in {where}, {allow}, or use a draft model "
            "of a longer context",
        )

    hit = _first(lines, _POOL_TOO_SMALL)
    if hit is not None:
        line, found = hit
        tokens = given_max_total_tokens(launch)
        context = given_context_length(launch)
        # Too small as given (both, maybe), or a pool SGLang sized by what memory was left
        # (--max-total-tokens only caps it): the least each must be, else more memory.
        fixes = []
        if context is not None and context <= REQUEST_MIN_TOKENS:
            where = _where(given_context_length(drafter.extra_args), drafter)
            fixes.append(f"a --context-length above {REQUEST_MIN_TOKENS} in {where}")
        if tokens is not None and tokens <= REQUEST_MIN_TOKENS:
            where = _where(given_max_total_tokens(drafter.extra_args), drafter)
            fixes.append(f"a --max-total-tokens above {REQUEST_MIN_TOKENS} in {where}")
        if fixes:
            fix = "give " + " and ".join(fixes)
        else:
            fix = _more_static(fraction, fraction_where, smaller, default)
        return StartRefusal(
            "its KV cache or context would hold too few tokens for one request",
            _quote(line, found.start()),
            fix,
            memory=not fixes,
        )

    hit = _first(lines, _NOT_ENOUGH)
    if hit is not None:
        line, found = hit
        return StartRefusal(
            "the weights leave its static GPU memory nothing for the KV cache",
            _quote(line, found.start()),
            _more_static(fraction, fraction_where, smaller, default),
            memory=True,
        )

    oom = _out_of_memory(lines)
    if oom is None:
        return None
    at, said, nccl = oom
    ran_out = "NCCL ran out of GPU memory" if nccl else "the GPUs ran out of memory"
    reached = _progress(lines, at, tp_size, bool(drafter.draft_model))
    if reached.stage == "before":
        # Before any weights (a CUDA context, NCCL's buffers as its tensor-parallel
        # communicators are set up: a GPU's first few hundred MiB): the GPU was full already,
        # which nothing in the campaign leaves it. (A log read from its end, the engine's
        # `LOG_TAIL_BYTES`, may have lost its "begin" lines, not its "end" ones.)
        return None
    if reached.stage == "draft":
        # The target's KV cache took its static memory first: the draft's weights load
        # into what that leaves (SGLang's default reserves 2 GiB for an EAGLE draft, 6 GiB
        # for a STANDALONE one), so a lower fraction is the first way out.
        lower = _lower_static(fraction, fraction_where, default)
        return StartRefusal(
            f"{ran_out} loading the draft model {drafter.draft_model} "
            "beside the target's weights and KV cache",
            said,
            f"{lower} (room outside its static pool for the draft model), or {smaller}",
            memory=True,
        )
    if reached.stage == "weights":
        return StartRefusal(
            f"{ran_out} loading the weights",
            said,
            f"use {MORE_GPUS} or a smaller model",
            memory=True,
        )
    lower = _lower_static(fraction, fraction_where, default)
    if reached.stage == "prefill":
        return StartRefusal(
            f"{ran_out} capturing its prefill CUDA graphs, outside its static memory",
            said,
            f"{lower} (more memory outside its static pool), or "
            + _smaller_prefill_graphs(lines, reached.capture, launch),
            memory=True,
        )
    if reached.stage == "warmup":
        # Its kernel warm-up (FlashInfer's autotune, before any graph is captured) runs one
        # forward of --max-running-requests requests outside the static pool; SGLang skips it
        # with --disable-flashinfer-autotune (both releases' option tables).
        return StartRefusal(
            f"{ran_out} warming up its kernels (FlashInfer autotune), outside its static memory",
            said,
            f"{lower} (more memory outside its static pool), give "
            "--disable-flashinfer-autotune in engine.sglang.extra_args, or a smaller largest "
            "batch in workload.batch (the autotune runs a batch of --max-running-requests, which "
            "dvfs sets to it)",
            memory=True,
        )
    what = "capturing its CUDA graphs" if reached.stage == "graph" else "after loading the weights"
    flag = _decode_graph_flag(launch)
    sized = f"dvfs sets {flag} to it" if flag else "dvfs captures CUDA graphs up to it"
    return StartRefusal(
        f"{ran_out} {what}, outside its static memory",
        said,
        f"{lower} (more memory outside its static pool), or a smaller largest batch in "
        f"workload.batch ({sized})",
        memory=True,
    )


def _out_of_memory(lines: Sequence[str]) -> tuple[int, str, bool] | None:
    """Where the start ran out of GPU memory: the index of the exception's line, SGLang's (or
    NCCL's) words to quote, and whether NCCL said it (its "unhandled cuda error", NCCL's own
    "Cuda failure 'out of memory'" beside it); None: it did not."""
    for i, line in enumerate(lines):
        found = _OOM.search(line)
        if found is not None:
            return i, _quote(line, found.start(1)), False
        if _NCCL_FATAL.search(line):
            said = _first(lines, _NCCL_OOM)
            if said is not None:
                return i, _quote(said[0], said[1].start()), True
    return None


@dataclass(frozen=True)
class _Where:
    """How far the failing rank's start had come when it ran out of memory: `stage` one of
    "before" (no weights begun: not the campaign's), "weights", "draft" (the draft model's
    weights, the target's loaded), "warmup" (its kernel autotune), "graph", "prefill" (the
    prefill-side graph), "after" (after loading the weights, none of those); `capture`: the
    graph being captured as SGLang named it in its begin line (None: none logged)."""

    stage: str
    capture: str | None = None


@dataclass
class _Rank:
    """What one tensor-parallel rank's own log lines say of its start, read in order."""

    begun: int = 0  # "Load weight begin" lines
    ended: int = 0  # "Load weight end" lines
    warming: int = 0  # kernel autotunes begun, not completed since the last weights began
    timed: bool = False  # any line that says how far it came
    open_: dict[str, int] = field(default_factory=dict)
    latest: str | None = None

    def read(self, line: str) -> None:
        if _LOAD_BEGIN.search(line):
            self.begun += 1
            self.latest, self.warming, self.timed = None, 0, True
            return
        if _LOAD_END.search(line):
            self.ended += 1
            self.timed = True
            return
        if _WARMUP_BEGIN.search(line):
            self.warming += 1
            self.timed = True
            return
        if _WARMUP_END.search(line):
            self.warming = max(self.warming - 1, 0)
            self.timed = True
            return
        found = _CAPTURE.search(line)
        if found is None:
            return
        self.timed = True
        what = found.group("what").strip().lower()
        if found.group("edge") == "begin":
            self.open_[what] = self.open_.get(what, 0) + 1
            self.latest = what
        else:
            self.open_[what] = max(self.open_.get(what, 0) - 1, 0)
            if self.latest == what and not self.open_[what]:
                self.latest = next((w for w, n in self.open_.items() if n), None)


def _rank_of(line: str) -> str | None:
    """The rank a line of SGLang's log is from, as its prefix names it ("TP1", "DP0 TP1");
    None: no rank named (a traceback's own lines, a server of one rank, NCCL's lines)."""
    found = _PREFIX.match(line)
    if found is None:
        return None
    words = _rank_words(found.group(1))
    return " ".join(words) if words else None


def _rank_words(prefix: str) -> list[str]:
    """The rank words ("DP0", "TP1") that end a log line's bracketed prefix, each after one
    whitespace character ("2026-02-14 02:07:50 DP0 TP1" -> ["DP0", "TP1"])."""
    words: list[str] = []  # from the last
    end = len(prefix)
    while True:
        start = end
        while start > 0 and prefix[start - 1].isdecimal():
            start -= 1
        kind = start - 2
        if start == end or kind < 1 or prefix[kind:start] not in _RANK_KINDS:
            break
        if not prefix[kind - 1].isspace():
            break
        words.append(prefix[kind:end])
        end = kind - 1
    return words[::-1]


def _failing_rank(lines: Sequence[str], at: int) -> str | None:
    """The rank whose exception is at line `at`: the line's own prefix, else that of the
    scheduler's traceback header it ends ("[... TP1] Scheduler hit an exception: Traceback
    ..."), the nearest such line above it; None: none names one."""
    for i in range(at, -1, -1):
        rank = _rank_of(lines[i])
        if rank is not None and (i == at or _TRACEBACK.search(lines[i])):
            return rank
    return None


def _frames(lines: Sequence[str], at: int) -> list[tuple[str, str]]:
    """The (file, function) of each frame of the traceback whose exception is at line `at`."""
    start = next((i for i in range(at, -1, -1) if _TRACEBACK.search(lines[i])), None)
    if start is None:
        return []
    return [
        (found.group("path"), found.group("func"))
        for line in lines[start:at]
        if (found := _FRAME.search(line)) is not None
    ]


def _module_path(path: str) -> str:
    """A frame's file as SGLang's own module path below sglang/srt/ ("model_loader/loader.py"),
    else its file name alone: the folders it is installed under (a virtual environment in
    /home/me/draft-study/) say nothing of where it failed."""
    path = "/" + path.replace("\\", "/")
    at = path.rfind("/sglang/srt/")
    return path[at + len("/sglang/srt/") :] if at >= 0 else path.rsplit("/", 1)[-1]


def _frame_stage(frames: Sequence[tuple[str, str]], draft: bool) -> str | None:
    """How far a start came, by the innermost frame of its traceback that tells (where its
    log, at a --log-level above info, says nothing of it): "before" (its tensor-parallel
    communicators being set up), "weights" or "draft", "warmup", "graph" or "prefill", "after"
    (its KV cache being sized); None: no frame tells."""
    paths = [(_module_path(path), func) for path, func in frames]
    drafting = draft and any(w in path for path, _ in paths for w in _DRAFT_WORKERS)
    stage = None
    for path, func in paths:
        name = path.rsplit("/", 1)[-1]
        if func in _DISTRIBUTED_FUNCS:
            stage = "before"
        elif func in ("load_model", "load_weights") or "model_loader/" in path:
            stage = "draft" if drafting else "weights"
        elif "autotune" in name or "autotune" in func:
            # FlashInfer's autotune itself (0.5.9 `_flashinfer_autotune`, 0.5.23
            # flashinfer_autotune.py), not any warm-up: 0.5.23's runner `warmup` (run once by
            # the eager runner as its CUDA graph setup begins) also sets up allreduce
            # workspaces and model resources.
            stage = "warmup"
        elif "cuda_graph" in name or func in _GRAPH_FUNCS:
            stage = "prefill" if "prefill" in name or "piecewise" in name else "graph"
        elif func == "init_memory_pool" or name in _POOL_FILES:
            stage = "after"
    return stage


def _progress(lines: Sequence[str], at: int, tp_size: int, draft: bool) -> _Where:
    """How far the start had come when the exception at line `at` ended it, read off the
    failing rank's own log lines: each tensor-parallel rank logs its own "Load weight" and
    "Capture ... begin/end" lines, so one rank's graph captured says nothing of another's
    still capturing. Where no line names the rank, every rank's lines are read together."""
    upto = lines[: at + 1]
    rank = _failing_rank(lines, at)
    state = _Rank()
    for line in upto:
        if rank is None or _rank_of(line) == rank:
            state.read(line)
    capture = state.latest
    if capture is not None:
        return _Where(
            "prefill" if "prefill" in capture or "piecewise" in capture else "graph", capture
        )
    # The prefill-side graph's own failure words tell it where no capture begin is logged (a
    # --log-level above info drops SGLang's "Capture ... begin" and "Load weight" lines): it
    # ran out after the weights, whatever those lines say.
    if _first(lines, _PREFILL_GRAPH) is not None and _first(upto, _CAPTURE) is None:
        return _Where("prefill")
    # "Capture cuda graph failed" is read past the out of memory: SGLang raises it inside
    # `except RuntimeError as e` (no `from`), so the scheduler's traceback shows torch's error
    # first, then "During handling of the above exception...", then this one.
    if _first(lines, _GRAPH) is not None:
        return _Where("graph")
    if state.warming:
        return _Where("warmup")
    if state.begun > state.ended:  # out of memory while a model's weights loaded
        loaded = state.ended >= (1 if rank is not None else max(tp_size, 1))
        return _Where("draft" if draft and loaded else "weights")
    if state.timed:
        return _Where("after")
    # No line says how far it came (a --log-level above info drops them all): its traceback's
    # frames may; where none tells, it ran out before any weights, as far as can be known.
    return _Where(_frame_stage(_frames(lines, at), draft) or "before")


def _smaller_prefill_graphs(
    lines: Sequence[str], capture: str | None, launch: Sequence[str]
) -> str:
    """The fix for a prefill-side graph too large: the flag that sizes it in this release
    (0.5.9's piecewise graph, else 0.5.23's prefill graph), with the largest size it captured
    where the log says it, or no such graph."""
    if capture is not None:
        legacy = "piecewise" in capture
    elif NEW_CUDA_GRAPH_FLAG in launch or OLD_CUDA_GRAPH_FLAG in launch:
        # The release as dvfs launched it (each has its own decode graph flag): a line of
        # 0.5.23's holding "piecewise" does not make it 0.5.9, which has no such flags.
        legacy = OLD_CUDA_GRAPH_FLAG in launch
    else:
        legacy = _first(lines, _PIECEWISE) is not None
    sizes = None
    for line in lines:
        found = _PREFILL_TOKENS.search(line)
        if found is not None:
            sizes = [int(n) for n in found.group(1).split(",") if n.strip()]
    here = f" below {max(sizes)}" if sizes else ""
    if legacy:
        return (
            f"give a --piecewise-cuda-graph-max-tokens{here} in engine.sglang.extra_args (the "
            "most tokens its piecewise CUDA graphs hold), or leave out "
            "--enable-piecewise-cuda-graph"
        )
    return (
        f"give a --cuda-graph-max-bs-prefill{here} in engine.sglang.extra_args (the most tokens "
        "its prefill CUDA graphs hold), or --cuda-graph-backend-prefill disabled there"
    )


def _decode_graph_flag(launch: Sequence[str]) -> str | None:
    """The flag dvfs gave the server's decode CUDA graph limit in (the largest batch): 0.5.9's
    --cuda-graph-max-bs, 0.5.23's --cuda-graph-max-bs-decode; None: neither."""
    for flag in (NEW_CUDA_GRAPH_FLAG, OLD_CUDA_GRAPH_FLAG):
        if flag in launch:
            return flag
    return None


def _lower_static(fraction: float | None, where: str, default: str) -> str:
    """A smaller static fraction, for more memory outside SGLang's static pool (the campaign's
    fraction, or below SGLang's `default`)."""
    if fraction is not None:
        return f"lower --mem-fraction-static below {fraction:g} in {where}"
    return f"give a --mem-fraction-static below {default} in engine.sglang.extra_args"


def _more_static(fraction: float | None, where: str, smaller: str, default: str) -> str:
    """The fix for weights that leave the KV cache too little: a larger static fraction (the
    campaign's, or above SGLang's `default`), or less to load per GPU (`smaller`)."""
    if fraction is not None:
        return f"raise --mem-fraction-static above {fraction:g} in {where}, or {smaller}"
    return f"give a --mem-fraction-static above {default} in engine.sglang.extra_args, or {smaller}"
