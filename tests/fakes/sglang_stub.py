#!/usr/bin/env python3
"""A loopback stand-in for ``python -m sglang.launch_server``, for dvfs's tests.

Why it exists: SGLang needs a CUDA GPU, the test machines have none, and dvfs's
engine code must still be exercised end to end.  This script parses the launch
argv the way SGLang 0.5.9 / 0.5.23 would (rebuilt from the option tables in
``tests/data/sglang-args/``) and then serves SGLang's HTTP protocol
(``/health``, ``/generate`` streaming and not, ``/server_info``, ``/flush_cache``,
``/metrics``) with fake tokens and configurable timing and faults.  Standard
library only.

Launch (in place of ``[python, -m, sglang.launch_server]``)::

    SGLANG_STUB_CONFIG=/tmp/stub.json \\
        python tests/fakes/sglang_stub.py --model-path M --port P [launch_server argv...]

Exit codes: 2 = argparse rejected the argv (as SGLang would; message on stderr);
1 = SGLang-like post-parse failure (``AssertionError``/``ValueError`` line on
stderr: partial speculative triple, unknown algorithm, deprecated flag, port in
use, non-loopback host); 3 = the stub's own config file is bad; 0 = stopped by
SIGTERM/SIGINT or by ``max_lifetime_s``.  ``die_after_requests`` exits with 1.

Config: env ``SGLANG_STUB_CONFIG`` names a JSON object; every key is optional and
unknown keys are refused (exit 3) so that typos do not pass silently.

- ``version`` ("0.5.23"): "0.5.9" or "0.5.23"; picks the option table, meta_info
  names and version differences.
- ``startup_s`` (0.2): seconds after the port opens during which ``/health``,
  ``/health_generate`` and ``/generate`` answer 503.
- ``listen_delay_s`` (0.0): seconds before the port is even bound (connection
  refused meanwhile, like SGLang loading weights).
- ``ttft_s`` (0.02): time from request arrival to the first token.
- ``tpot_s`` (0.005): time per decode step after that.
- ``plain_tpot_s`` (null): ``tpot_s`` of a server launched without a speculative
  algorithm, where a test times only its speculative servers' steps.
- ``accept_length`` (2.5): mean tokens per decode step when a speculative
  algorithm is set; each step emits floor or ceil of it (seeded draw, so the mean
  matches), clamped to [1, tokens one verify can yield].  Without speculation a
  step always emits 1 token.
- ``num_draft_tokens`` (null): overrides the resolved
  ``speculative_num_draft_tokens`` (server_info and draft statistics), e.g. to
  play a DFLASH checkpoint's block size.
- ``seed`` (0): seeds every random choice; each /generate sub-request draws from
  ``Random(f"{seed}:{request_number}:{index}")``.
- ``natural_stop`` (false): when true, requests without ``ignore_eos`` stop at a
  seeded random length in [max(1, min_new_tokens), max_new_tokens] with
  ``finish_reason {"type": "stop", "matched": 2}`` (``length`` if the draw hits
  max_new_tokens).  When false every request runs to max_new_tokens.
- ``die_after_requests`` (null): N >= 1; when the N-th /generate request arrives
  the process calls ``os._exit(1)`` after ``die_delay_s`` (0.0: at once, before
  answering it; > 0: mid-stream of it and of anything else in flight).
- ``die_delay_s`` (0.0): see above.
- ``hang_after_requests`` (null): N >= 1; from the arrival of the N-th /generate request the
  process lives on but answers nothing more, on any route (``/health`` included): every
  request then arriving, that one too, waits without a byte until the process is stopped,
  as a wedged SGLang scheduler leaves its HTTP server (SIGTERM still stops it). With env
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` false, GET ``/health`` still answers 200 at
  once, as SGLang's does then (it asks the scheduler nothing; ``/health_generate`` does).
- ``torch_load_device`` (null): a torch device ("cuda", "cpu") on which matrix-vector
  products over ``torch_load_mib`` (512) MiB of weights run while requests run (``TorchLoad``):
  a real load, and a real compute process, for dvfs on a real GPU.
- ``start_failure`` (null): the start fails as SGLang's does, after ``listen_delay_s`` (its
  weights "loading"), before the port is bound: the scheduler's traceback is logged, ending in
  SGLang's (or torch's) own line, then the launcher's "Received sigquit from a child process"
  line, and the process kills itself (SIGKILL, as SGLang's launcher kills its process tree:
  exit -9). One of ``"kv_cache"`` (the weights leave the KV cache nothing: "Not enough memory.
  Please try to increase --mem-fraction-static."), ``"weights_oom"`` (torch's "CUDA out of
  memory" while the target's weights load), ``"draft_oom"`` (the same while the draft model's
  load, the target's loaded), ``"graph_oom"`` (out of memory capturing the decode CUDA graphs:
  "Capture cuda graph failed: CUDA out of memory ...", the hint naming the release's flag:
  ``--cuda-graph-max-bs``, 0.5.23's ``--cuda-graph-max-bs-decode``), ``"prefill_graph_oom"``
  (out of memory capturing the prefill-side graph: 0.5.9's piecewise one, as with
  ``--enable-piecewise-cuda-graph``; 0.5.23's prefill one, on by default, whose failure ends in
  torch's own line), or ``"crash"`` (a scheduler that fails for no reason of the campaign's: an
  NCCL error, which a rerun may not meet). Each logs the CUDA graph captures begun (and
  ended) before it as its release does. Or ``"scheduler_killed"``: a scheduler rank killed
  outright (SIGKILL, no traceback, no SIGQUIT) beside one waiting for it; 0.5.9's launcher
  then waits on, never reaping it, 0.5.23's notices and exits 1 (``scheduler_killed``).
- ``fail_after_requests`` (null): /generate requests number N, N+1, ... are
  answered ``fail_status`` with ``{"error": {"message": ...}}`` (0 fails them
  all).  Both fault counters number /generate requests from 1 as they arrive
  once the server is ready; a body that is not a JSON object is not counted.
- ``fail_status`` (500): the status used by ``fail_after_requests``.
- ``burst_request`` (null): N >= 1; the N-th /generate request (numbered as the fault
  counters number them) decodes on its schedule but holds every streamed chunk back until its
  last step, then writes them all at once, as a stalled output path (or a stalled client)
  delivers a backlog: the client sees the whole decode arrive in a burst.
- ``malformed_chunk_at`` (null): k >= 0; in every streamed response the k-th data
  chunk (0-based) is replaced by a ``data:`` line that is not JSON; the stream
  then goes on normally.
- ``stall_after_chunks`` (null): k >= 0; every streamed response stops after k
  data chunks (``[DONE]`` not counted), keeps the connection open without sending anything for
  ``stall_s`` seconds, then drops it without the terminating chunk.
- ``stall_s`` (30.0): see above.
- ``busy_health_s`` (0.0): once a /generate request has arrived, ``/health`` and
  ``/health_generate`` take this long to answer 200, as SGLang's do (both run a one-token
  generate and answer once the scheduler outputs anything, polling every 1 s for up to
  ``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s): a busy server that is not hung.
- ``flush_busy_s`` (0.0): ``/flush_cache`` answers 400 while any /generate is in
  flight and also for this many seconds after the server became ready.
- ``max_lifetime_s`` (600.0): the process shuts itself down (exit 0) this many
  seconds after it started, so that no orphan outlives a test run.
- ``abort_route`` (true): false plays a server without ``/abort_request`` (404).
- ``context_len`` (131072): the model's context length (its config.json's), served unless
  ``--context-length`` gives another; see "Context" below.
- ``running_cap`` (null): how many requests each DP rank's KV pool or Mamba state cache
  holds: 0.5.23's /server_info reports
  ``internal_states[i].effective_max_running_requests_per_dp``, the scheduler's own cap on
  running requests, as the resolved ``max_running_requests`` split over the attention DP
  ranks (2048 where none, not split), lowered to this (mem_cache/kv_cache_configurator.py
  ``resolve_max_num_reqs``); null: not lowered.  0.5.23 turns the deprecated ``--dp-size N
  --enable-dp-attention`` into ``attn_dp_size`` N, ``dp_size`` 1, and reports
  ``enable_dp_attention`` as ``attn_dp_size`` > 1, and refuses ``--dp-size`` replicas beside
  ``--attn-dp-size`` ranks at start (exit 1).  0.5.9 reports no cap.
  ``internal_states`` holds one state per DP scheduler: ``--dp-size`` replicas or
  ``--attn-dp-size`` ranks, each with this cap.
- ``patch_route`` (false): true serves POST ``/_stub/patch``, whose JSON object body sets what
  later answers carry, for a test that feeds dvfs hostile answers from one stub: its
  ``server_info`` (an object) sets keys over /server_info's answer (``internal_states``
  replaced whole), its ``final_meta`` (an object) sets keys over every final chunk's
  meta_info, its ``abort_meta`` (an object) over an aborted request's final meta_info alone
  (after ``final_meta``), and its ``raw`` (an object of route paths) answers a route, any
  method, with ``{"status": S, "body": B}`` instead: status S (200 if absent), body B whole
  (a string, each character U+0000..U+00FF one byte: bytes that are not UTF-8, a truncated
  JSON, an HTML page), as a broken server or a proxy in front of it may; with ``"cut":
  true`` B goes out as one HTTP chunk that promises more bytes than it holds, and the
  connection is closed (a stream cut mid-chunk). Each absent key clears its patch.
- ``abort_ignored`` (false): true answers ``/abort_request`` 200 but aborts nothing.
- ``hold_unfinished`` (false): true plays a round whose other requests are always
  still running when its first request finishes, however slow the machine: once a
  request has finished, every other request stops before its last step and waits
  there (sending nothing) until it is aborted, by ``/abort_request`` or by its
  client going away, until the next ``/flush_cache`` (dvfs flushes at the start of
  each round).  Meant for one prompt per /generate and a round whose client ends
  it at that finish (a client that does not abort then stalls).
- ``hold_after_requests`` (null): N >= 1; with ``hold_unfinished``, the hold starts
  at the first finish once N /generate requests arrived since the last flush (a
  closed loop's pool of N: its round ends at the first finish after its last send).

Behaviour that follows the launch argv: ``--enable-metrics`` (``/metrics`` route,
and on 0.5.23 the timing fields in meta_info; as both releases' collectors:
``sglang:generation_tokens_total`` grows as a request finishes, aborted too, by its
whole output, ``sglang:realtime_tokens_total{mode="decode"}`` at every decode step,
and ``sglang:spec_accept_length`` is there, 0, without a speculative algorithm),
``--stream-interval`` (a chunk every N decode steps), ``--stream-output`` (0.5.9) /
``--incremental-streaming-output`` (0.5.23) (delta chunks instead of cumulative
ones), ``--weight-version``, ``--served-model-name``, ``--disable-radix-cache``
(cached_tokens always 0).

Aborts, as SGLang's http_server and scheduler handle them: ``POST /abort_request``
with ``{"rid": R}`` (or ``{"abort_all": true}``) answers 200 whether or not R is
running; every request that arrived by then whose rid starts with R stops at its next
decode step, as SGLang's scheduler matches them (``req.rid.startswith(recv_req.rid)``),
and a request with rid R that has not arrived yet is aborted when it does; the stream of
each ends with a final chunk whose finish_reason is ``{"type": "abort",
"message": ...}``, carrying the tokens it had (and, with speculation, its draft
statistics so far), then ``data: [DONE]``.  A streaming client that disconnects
stops its request at the next chunk the stub fails to write (SGLang aborts it too).
Each abort and each disconnect is logged (``abort_request rid=R ...``, ``aborted
rid=R after K tokens``, ``client went away during POST /generate``).  With a
speculative algorithm each sub-request's counters are logged when it ends, before any
final chunk is written (``spec rid=R tokens=N verify_ct=V correct_drafts=C`` and
``finished``, ``aborted`` or ``cut``: its client went away, or the server stopped), so a
test can pool what the server generated, the requests cut off included.

Timing and tokens: a sub-request (one prompt x one of ``n`` samples) emits its
first token ``ttft_s`` after arrival and then one decode step every ``tpot_s``
(the last step is cut so that the total is exactly the target length); on a loaded
machine a late step delays the later ones rather than being caught up.  Text is
fake words (" tok123"), output_ids ints; prompts count one BOS plus one token per
whitespace word; cached_tokens is the longest prefix shared with a prompt seen
since the last flush, minus the last token.  A stream sends one ``data:`` chunk
per decode step, cumulative by default, ``"index"`` for list inputs, then
``data: [DONE]``, over HTTP/1.1 chunked transfer (keep-alive).

meta_info, every chunk: id, finish_reason (null until the last), prompt_tokens,
completion_tokens, cached_tokens, weight_version, and num_retractions (0.5.23) /
total_retractions (0.5.9); 0.5.23 with --enable-metrics adds request_received_ts,
queue_time, first_token_latency.  Last chunk only: e2e_latency; 0.5.23 with
--enable-metrics adds request_finished_ts, decode_throughput; with a speculative
algorithm (as SGLang's TokenizerManager._handle_batch_output adds them, under ``if
state.finished``, in 0.5.9 and 0.5.23 alike: a stream cut before its final chunk never
gets them, and only when spec_verify_ct > 0: a request that ended at its prefill token or was
aborted before a verify pass has none of them): spec_verify_ct (decode steps), spec_accept_length
(completion_tokens / spec_verify_ct, so the prefill token counts), spec_accept_rate
(accepted drafts / (verify x (num_draft_tokens - 1))), and accepted drafts,
proposed drafts and the per-verify accepted-drafts histogram (length
num_draft_tokens) as spec_num_correct_drafts / spec_num_proposed_drafts /
spec_correct_drafts_histogram (0.5.23) or spec_accept_token_num /
spec_draft_token_num / spec_accept_histogram (0.5.9).
/server_info internal_states[0].avg_spec_accept_length is the mean tokens per
request decode step (prefill token excluded) over the whole blocks of
``--decode-log-interval`` (default 40) decode iterations since the last flush, as
SGLang counts it: its scheduler adds a block's counters to the running totals only
when the iteration count reaches a multiple of the interval (0.5.9
``log_decode_stats``; 0.5.23 ``report_decode_stats``), and ``Scheduler.flush_cache``
resets the count and the totals (``reset_metrics``, both versions). Absent until a
block is complete.  A request's decode step ``j`` is iteration ``b + j`` of the
server, ``b`` being the iterations run when the request got its first token (a fixed
batch decodes its requests in the same iterations).
Without ``--random-seed`` the resolved random_seed is drawn at random at each start, as
SGLang does (0.5.9 server_args.py, 0.5.23 arg_groups/serving_hook.py).

Attention backend, as SGLang 0.5.9 / 0.5.23 resolve it for an MHA model on a Hopper
GPU with CUDA >= 12.3 (the stub plays one): ``--prefill-attention-backend`` equal to
``--decode-attention-backend`` becomes the main backend; unset, the main backend is
fa3 when ``--speculative-eagle-topk`` was not given, or is 1 with ``--page-size`` 1
(SGLang decides before it fills in speculative defaults, so n-gram, DFLASH and
auto-parameter EAGLE stay on fa3), else flashinfer; fa3 with ``--kv-cache-dtype
fp8_e5m2`` is replaced by triton.  /server_info reports attention_backend,
prefill_attention_backend and decode_attention_backend (None: same as the main one).

Scheduling args SGLang sets per speculative algorithm (read from the 0.5.9 wheel's
srt/server_args.py and the 0.5.23 wheel's srt/arg_groups/), for the same Hopper GPU (80 to 160
GB): ``chunked_prefill_size`` 8192 unless given; the decode CUDA-graph batch sizes, from
``--cuda-graph-bs`` (0.5.9) / ``--cuda-graph-bs-decode`` (0.5.23) or else SGLang's ladder up to
the max (given, else 256 below TP 4 and 512 from it, and in 0.5.23 no more than a given
``--max-running-requests``; 0.5.23 captures the max itself too), a finer ladder when
speculating; 0.5.9 reports them as
``cuda_graph_bs`` / ``cuda_graph_max_bs``, 0.5.23 as ``cuda_graph_config`` (``decode`` and
``prefill``: backend, max_bs, bs; the prefill token buckets are left None, its max_bs the
chunked prefill size unless given, no more than a given ``--max-total-tokens``, 4096 for a
Llama 2).  0.5.9 turns the
overlap scheduler off (``disable_overlap_schedule``) for NGRAM and for the EAGLE family (on
instead with env ``SGLANG_ENABLE_SPEC_V2`` true), and mixed chunked prefill
(``enable_mixed_chunk``) off for every algorithm; 0.5.23 keeps the overlap scheduler and turns
mixed chunked prefill off for NGRAM, STANDALONE and UNO.  NGRAM's ``speculative_eagle_topk`` is
its ``--speculative-ngram-max-bfs-breadth`` (and 0.5.23 sets its steps to draft tokens // topk);
STANDALONE's automatic triple is (3, 1, 4) whatever the model.

With env ``SGLANG_USE_MODELSCOPE`` true (0.5.23 also takes "yes" and "y"), a model that is
no existing path is reported as the ModelScope cache folder SGLang downloads it to
(``$MODELSCOPE_CACHE/<model>``), downloading nothing.
A .gguf named on the Hugging Face Hub (``owner/repo/FILE.gguf``, ``owner/repo:QUANT``) is,
in 0.5.23, served from the file SGLang downloads it to, and /server_info reports that local
path as ``model_path`` (``tokenizer_path`` too when it was the model's): the stub reports
``$HF_HOME/hub/models--owner--repo/snapshots/<revision>/FILE`` (for ``:QUANT``,
``repo-QUANT.gguf``), downloading nothing (0.5.23 arg_groups/model_path_hook.py
``resolve_hf_gguf_model_path``, utils/hf_transformers/common.py
``resolve_hf_gguf_reference``).

The log's first line names the GPUs the stub was given: CUDA_VISIBLE_DEVICES and
CUDA_DEVICE_ORDER from its environment.

API keys, as SGLang checks them: a stub started with ``--api-key KEY`` answers 401
``{"error": "Unauthorized"}`` to any route but /health* and /metrics without
``Authorization: Bearer KEY``; with ``--admin-api-key`` /flush_cache and /abort_request want
that key instead (the API key no longer opens them).

GPU processes: when env ``DVFS_FAKE_NVML_STATE`` names a fake NVML state
(``tests/fakes/nvml/pynvml.py``, loaded by path), the stub lists its own pid as a compute
process on the fake devices whose UUIDs its CUDA_VISIBLE_DEVICES names, before it listens, as
a server that loaded its weights would, with the memory SGLang claims (``--mem-fraction-static``,
0.85 unless given, of the GPU's memory, less what is used there; where ``--max-total-tokens``
caps the KV pool, an 8B model's weights and that pool at most: ``claim_bytes``), which the
fake's ``nvmlDeviceGetMemoryInfo`` counts as used; ``neighbour_pid`` (null) is listed on
``neighbour_device`` at start with an uncapped server's claim (another tenant's server starting
on another GPU meanwhile); ``nvml_device`` (null) in the config puts it
on that device index instead (a wrapper that escaped CUDA_VISIBLE_DEVICES).  It drops itself
again on a clean exit (the fake lists only live pids anyway).  ``nvml_pid`` (null) lists that
live pid instead of its own, as a driver outside a container's PID namespace names the server
by a host PID the server's parent cannot see.  ``foreign_pid`` (null) plays another tenant's
job on the same GPU(s): that live pid is listed there when the ``foreign_from_request``-th
/generate arrives (null: at start) and dropped when the ``foreign_until_request``-th does
(null: never; 0: as the stub starts, for a tenant the test listed before dvfs started, gone by
the first cell, with ``foreign_from_request`` past the last request).

Memory: an unset ``--mem-fraction-static`` is resolved and reported as SGLang resolves it
(0.5.9 server_args.py ``_handle_gpu_memory_settings``, 0.5.23 arg_groups/memory_hook.py
``handle_gpu_memory_settings``): (GPU memory - reserved) / GPU memory, rounded to 3 places, the
reserve (MiB) 512, 1.5 per token of the chunked prefill (at least 2048; without chunked
prefill, of ``--max-prefill-tokens``), 128 per tensor-parallel rank, 2 per decode CUDA-graph
batch size of the largest (0.5.9: with ``--disable-cuda-graph`` too), 8 per prefill-side
CUDA-graph token size (0.5.23's prefill graph unless disabled, 0.5.9's piecewise one with
``--enable-piecewise-cuda-graph``), at least 10 GiB on a GPU above 60 GiB;
0.5.9 then adds 6 GiB for a STANDALONE drafter and 2 GiB for the others but NGRAM. The GPU is
the smallest of the fake NVML's devices (``DVFS_FAKE_NVML_STATE``: SGLang reads every GPU's
memory), else an H100 SXM's 81559 MiB.

Context, as SGLang's scheduler and tokenizer manager count it (0.5.9 and 0.5.23 alike): the
KV pool holds ``--max-total-tokens`` (``KV_TOKENS`` unless given) tokens; ``max_req_len`` is
the lesser of the served context less 1 and that pool less 1, ``max_req_input_len`` that less
5, and /server_info reports ``max_total_num_tokens`` and ``max_req_input_len`` beside the
resolved args (``context_length`` there is only what the launch gave, null by default).
A prompt whose tokens with the reserved draft slots (EAGLE, EAGLE3, NEXTN: the greater of
topk x num_steps and num_draft_tokens; nothing for the others) are not shorter than the
context is refused ("The input (N tokens) is longer than the model's context length (C
tokens)."); one whose total with max_new_tokens exceeds the context (0.5.23; reaches it,
0.5.9) is refused too ("Requested token count exceeds the model's maximum context length of
C tokens. ..."), both as a 400, or in-band on a stream; with ``--allow-auto-truncate``
max_new_tokens is cut to what the context leaves instead.  An admitted request's
max_new_tokens is then cut, silently, to ``max_req_len`` less its prompt less 1.
A ``--context-length`` above ``context_len`` is refused at start, as SGLang's ModelConfig
refuses it ("User-specified context_length (N) is greater than the derived context_length
(C). ...", a ValueError, exit 1) unless env ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` is
true (then served, as SGLang warns and serves it); a pool or context that leaves
``max_req_input_len`` at 0 or less fails the start as SGLang's TpModelWorker does (the
assertion "Memory pool size is too small", logged as ``start_failure``'s are).

Errors as SGLang reports them: a malformed body or an unknown sampling key
(0.5.23) is a 400 ``{"error": {"message": ...}}``; a bad sampling value is a 400
too, but on a streaming request it arrives in-band as ``data: {"error": ...}``
followed by ``data: [DONE]`` on a 200 stream.  Logs go to stderr, one line per
HTTP request plus one per finished /generate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import select
import signal
import socket
import sys
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ARGS_DIR = Path(__file__).resolve().parent.parent / "data" / "sglang-args"
VERSIONS = ("0.5.9", "0.5.23")
DEFAULT_VERSION = "0.5.23"
LOOPBACK_HOSTS = {"127.0.0.1": socket.AF_INET, "localhost": socket.AF_INET, "::1": socket.AF_INET6}
EOS_TOKEN_ID = 2
BOS_TOKEN_ID = 1
MAX_BODY_BYTES = 64 * 1024 * 1024

# Names SGLang gives in meta_info, per version (protocol file, "Responses").
RETRACTION_KEY = {"0.5.23": "num_retractions", "0.5.9": "total_retractions"}
SPEC_DRAFT_KEYS = {
    "0.5.23": (
        "spec_num_correct_drafts",
        "spec_num_proposed_drafts",
        "spec_correct_drafts_histogram",
    ),
    "0.5.9": ("spec_accept_token_num", "spec_draft_token_num", "spec_accept_histogram"),
}
# 0.5.23 takes a registry name; these are its built-ins.  NEXTN is an alias of EAGLE.
ALGORITHMS_0523 = {"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "DSPARK", "UNO"}

# Keys SGLang's SamplingParams takes from callers; 0.5.23 refuses any other key.
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
        "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
        "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "custom_params", "stream_interval", "logit_bias", "sampling_seed",
    }
)  # fmt: skip

# The option tables carry no types; these dests get SGLang's int/float conversion so
# that a bad number fails like SGLang (exit 2) and server_info reports numbers.
INT_DESTS = frozenset(
    {
        "port", "tp_size", "tensor_parallel_size", "pp_size", "pipeline_parallel_size",
        "dp_size", "data_parallel_size", "attn_dp_size", "attention_data_parallel_size",
        "ep_size", "expert_parallel_size",
        "max_running_requests", "max_total_tokens", "max_prefill_tokens",
        "chunked_prefill_size", "context_length", "cuda_graph_max_bs",
        "cuda_graph_max_bs_decode", "cuda_graph_max_bs_prefill", "cuda_graph_bs",
        "cuda_graph_bs_decode", "cuda_graph_bs_prefill", "speculative_num_steps",
        "speculative_eagle_topk", "speculative_num_draft_tokens",
        "speculative_dflash_block_size", "speculative_dspark_block_size",
        "speculative_ngram_min_bfs_breadth", "speculative_ngram_max_bfs_breadth",
        "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size",
        "speculative_ngram_branch_length", "speculative_ngram_capacity",
        "speculative_ngram_max_trie_depth", "stream_interval", "random_seed", "base_gpu_id",
        "decode_log_interval",
        "gpu_id_step", "nnodes", "node_rank", "max_queued_requests", "page_size",
        # the ARM_ARGS both releases type int (0.5.9 server_args.py `type=int`, 0.5.23
        # arg_groups/fields/*.py), or one of them
        "prefill_max_requests", "num_reserved_decode_tokens", "num_continuous_decode_steps",
        "scheduler_recv_interval", "prefill_delayer_max_delay_passes",
        "prefill_decode_interval", "prefill_decode_interval_min_bs", "cpu_offload_gb",
        "offload_group_size", "offload_num_in_group", "offload_prefetch_step",
        "torch_compile_max_bs", "piecewise_cuda_graph_max_tokens",
        "piecewise_cuda_graph_tokens", "cuda_graph_max_seq_len_prefill",
        "cuda_graph_prefill_max_context", "triton_attention_num_kv_splits",
        "triton_attention_split_tile_size", "ep_num_redundant_experts", "moe_dense_tp_size",
        "ds_heavy_channel_num", "ds_heavy_token_num", "ds_sparse_decode_threshold",
        "attn_cp_size", "attention_context_parallel_size", "dcp_size", "swa_prefix_tails",
        "c128_page_size", "paged_experts_num_resident", "shared_experts_tp_size",
        "eplb_rebalance_num_iterations", "eplb_rebalance_layers_per_chunk",
        "kt_num_gpu_experts", "kt_cpuinfer", "kt_threadpool_count",
        "kt_max_deferred_experts_per_token", "dsa_triton_union", "linear_replayssm_cache_len",
        "mamba_cache_philox_rounds", "int8_mamba_ckpt_size", "max_mamba_cache_size",
        "mamba_max_states_per_path", "pp_async_batch_depth", "pp_max_micro_batch_size",
        "min_free_slots_delay", "fuseep_mode",
    }
)  # fmt: skip
FLOAT_DESTS = frozenset(
    {
        "mem_fraction_static", "speculative_accept_threshold_single",
        "speculative_accept_threshold_acc", "schedule_conservativeness", "watchdog_timeout",
        "prefill_delayer_max_delay_ms", "prefill_delayer_queue_min_ratio",
        "prefill_delayer_token_usage_low_watermark", "tbo_token_distribution_threshold",
        "swa_full_tokens_ratio", "eplb_min_rebalancing_utilization_threshold",
    }
)  # fmt: skip
#: Options SGLang stores under another name than argparse's own dest (0.5.9 server_args.py
#: `dest=`, 0.5.23 arg_groups/fields `cli_name=`): /server_info reports them by that name.
RENAMED_DESTS = {
    "--fp8-gemm-backend": "fp8_gemm_runner_backend",
    "--fp4-gemm-backend": "fp4_gemm_runner_backend",
    "--elastic-ep-join-mode": "ep_join_mode",
    "--elastic-ep-join-rank-offset": "ep_join_rank_offset",
    # 0.5.23 server_args.py: DeprecatedStoreConstAction, const_value=True (see `STORE_CONSTS`)
    "--monokernel-backend": "enable_amd_monokernel",
}
#: 0.5.23's deprecated valued flags that store a fixed value in another field, not their own
#: (`DeprecatedStoreConstAction`'s `const_value`): `--monokernel-backend amd` is
#: `--enable-amd-monokernel`.
STORE_CONSTS: dict[str, Any] = {"--monokernel-backend": True}
# 0.5.9 names some options by their long flag first; SGLang copies them to these fields.
FIELD_ALIASES = {
    "tensor_parallel_size": "tp_size",
    "pipeline_parallel_size": "pp_size",
    "data_parallel_size": "dp_size",
    "expert_parallel_size": "ep_size",
    "attention_context_parallel_size": "attn_cp_size",
    "attention_data_parallel_size": "attn_dp_size",
    "moe_data_parallel_size": "moe_dp_size",
    "decode_context_parallel_size": "dcp_size",
}
# The few SGLang defaults dvfs may read back from /server_info (the tables carry none).
KNOWN_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 30000,
    "tp_size": 1,
    "pp_size": 1,
    "dp_size": 1,
    "ep_size": 1,
    "stream_interval": 1,
    "decode_log_interval": 40,
    "weight_version": "default",
    "speculative_ngram_max_bfs_breadth": 10,
    # the ARM_ARGS whose SGLang default is neither None nor False (0.5.9 server_args.py,
    # 0.5.23 arg_groups/fields/*.py), so that a flag giving the default is no change
    "attn_cp_size": 1,
    "dcp_size": 1,
    "nsa_prefill_cp_mode": "round-robin-split",
    "deepep_dispatcher_output_dtype": "auto",
    "eplb_rebalance_num_iterations": 1000,
    "eplb_min_rebalancing_utilization_threshold": 1.0,
    "dsa_triton_union": 0,
    "qsa_indexer_dtype": "auto",
    "c128_page_size": 16,
    "linear_replayssm_cache_len": 16,
    "mamba_cache_philox_rounds": 0,
    "mamba_max_states_per_path": -1,
    "pp_async_batch_depth": 0,
    "tokenizer_mode": "auto",
    "tokenizer_backend": "huggingface",
    # 0.5.9's default; 0.5.23's fallback for an unset ratio, which its /server_info reports
    # (arg_groups/fields/schedule.py `fallback=0.8`, overrides.py `resolution_result`)
    "swa_full_tokens_ratio": 0.8,
    "fuseep_mode": 2,  # 0.5.23 fields/exec_.py: Literal[1, 2] = 2
    # 0.5.23 fields/exec_.py; 0.5.9's argparse defaults (server_args.py `--kt-method`,
    # `--kt-threadpool-count`), which `from_cli_args` keeps over the dataclass's None
    "kt_method": "AMXINT4",
    "kt_threadpool_count": 2,
}
#: Each release's defaults for the other compared args (`ARM_ARGS`, `DRAFTER_ARGS`) that it
#: reports unresolved for a model the stub serves (an MHA model on Hopper): 0.5.9 server_args.py
#: `ServerArgs` (whose argparse defaults name these), 0.5.23 arg_groups/fields/*.py (the
#: field's default, or its `fallback=` where unset: `enable_tf32_matmul`). Model-specific
#: resolution (DeepSeek, Mistral Large 3, GLM-4 MoE...: another dtype, KV-cache dtype, MoE or
#: GEMM kernels) is not the stub's. Applied, like `KNOWN_DEFAULTS`, to the options its table has.
RELEASE_DEFAULTS: dict[str, dict[str, Any]] = {
    "0.5.9": {
        "hicache_mem_layout": "layer_first",
        "fp4_gemm_runner_backend": "flashinfer_cutlass",
        "piecewise_cuda_graph_compiler": "eager",
        "torchao_config": "",
        "ds_heavy_channel_num": 32,
        "ds_heavy_channel_type": "qk",
        "ds_heavy_token_num": 256,
        "ds_sparse_decode_threshold": 4096,
    },
    "0.5.23": {
        "hicache_mem_layout": "page_first",
        "fp4_gemm_runner_backend": "auto",
        "bf16_gemm_backend": "auto",
        "enable_tf32_matmul": False,
        "retraction_policy": "length",
        "prefill_decode_interval_min_bs": 0,
        "dsa_topk_backend": "sgl-kernel",
        "dsa_paged_mqa_logits_backend": "auto",
        "dsv4_attn_backend": "auto",
        "dsv4_prefill_backend": "auto",
        "linear_attn_backend": "triton",
        "lora_strict_loading": False,
    },
}
for _defaults in RELEASE_DEFAULTS.values():  # both releases alike
    _defaults.update(
        dtype="auto",
        kv_cache_dtype="auto",
        load_format="auto",
        model_impl="auto",
        json_model_override_args="{}",
        sampling_defaults="model",
        schedule_policy="fcfs",
        schedule_conservativeness=1.0,
        max_prefill_tokens=16384,
        num_reserved_decode_tokens=512,
        num_continuous_decode_steps=1,
        scheduler_recv_interval=1,
        radix_eviction_policy="lru",
        prefill_delayer_max_delay_passes=30,
        hicache_write_policy="write_through",
        hicache_io_backend="kernel",
        cpu_offload_gb=0,
        offload_group_size=-1,
        offload_num_in_group=1,
        offload_prefetch_step=1,
        offload_mode="cpu",
        torch_compile_max_bs=32,
        triton_attention_num_kv_splits=8,
        fp8_gemm_runner_backend="auto",
        moe_runner_backend="auto",
        moe_a2a_backend="none",
        flashinfer_mxfp4_moe_precision="default",
        deepep_mode="auto",
        ep_num_redundant_experts=0,
        init_expert_location="trivial",
        tbo_token_distribution_threshold=0.48,
        mamba_backend="triton",
    )
#: Flags (store_true) whose SGLang field is Optional[bool] = None: not given, None, not False
#: (0.5.23 fields/exec_.py `enable_lean_attention`, fields/lora.py `enable_lora`,
#: `enable_lora_overlap_loading`; arg_utils.py passes the field's default; 0.5.9 server_args.py
#: passes `ServerArgs.enable_lora`...). SGLang resolves the LoRA ones (`_resolve_lora`).
UNSET_FLAGS = frozenset({"enable_lean_attention", "enable_lora", "enable_lora_overlap_loading"})


def log(message: str) -> None:
    """One line on stderr, flushed: dvfs keeps the server log and shows its tail."""
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] sglang_stub: {message}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- config


class StubConfigError(Exception):
    """The SGLANG_STUB_CONFIG file is unusable (exit 3, not an SGLang-like error)."""


@dataclass
class StubConfig:
    """Behaviour knobs from SGLANG_STUB_CONFIG; see the module docstring."""

    version: str = DEFAULT_VERSION
    startup_s: float = 0.2
    listen_delay_s: float = 0.0
    ttft_s: float = 0.02
    tpot_s: float = 0.005
    plain_tpot_s: float | None = None
    accept_length: float = 2.5
    num_draft_tokens: int | None = None
    seed: int = 0
    natural_stop: bool = False
    die_after_requests: int | None = None
    die_delay_s: float = 0.0
    hang_after_requests: int | None = None
    start_failure: str | None = None
    fail_after_requests: int | None = None
    fail_status: int = 500
    burst_request: int | None = None
    malformed_chunk_at: int | None = None
    stall_after_chunks: int | None = None
    stall_s: float = 30.0
    flush_busy_s: float = 0.0
    busy_health_s: float = 0.0
    max_lifetime_s: float = 600.0
    abort_route: bool = True
    context_len: int = 131072
    running_cap: int | None = None
    abort_ignored: bool = False
    patch_route: bool = False
    hold_unfinished: bool = False
    hold_after_requests: int | None = None
    nvml_device: int | None = None
    nvml_pid: int | None = None
    foreign_pid: int | None = None
    foreign_from_request: int | None = None
    foreign_until_request: int | None = None
    #: Another tenant's SGLang server (or a fleet's other worker's) starting on fake device
    #: ``neighbour_device`` as this one does: ``neighbour_pid`` (a live pid) is listed there at
    #: start with an uncapped server's claim; None: no neighbour.
    neighbour_device: int | None = None
    neighbour_pid: int | None = None
    #: A file each /generate body's "text" is appended to (a JSON line), so a test can tell
    #: which prompts went out and how they were formatted; None: nothing recorded.
    requests_log: str | None = None
    #: A torch device ("cuda", "cuda:0", "cpu") the stub loads while requests run, as a real
    #: server's decode would (see ``TorchLoad``); None: no load, and torch is never imported.
    torch_load_device: str | None = None
    #: MiB of bf16 weights (float32 on the CPU) each of the load's matrix-vector products reads.
    torch_load_mib: float = 512.0


#: What the scheduler's traceback ends with for each ``start_failure``, as SGLang 0.5.x and
#: torch print it (sgl-project/sglang python/sglang/srt/model_executor/pool_configurator.py
#: ``MemoryPoolConfig``, before it model_runner.py ``init_memory_pool``; cuda_graph_runner.py
#: ``CudaGraphRunner.__init__``; pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp), and
#: whether it comes after the weights loaded (``Load weight end``) and, with a draft model,
#: after its weights began to load.
_TORCH_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 0 has a total "
    "capacity of 79.19 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this "
    "process has 78.16 GiB memory in use. Of the allocated memory 77.20 GiB is allocated by "
    "PyTorch, and 0.45 GiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
#: 0.5.23's log line as its prefill CUDA graph capture begins (cuda_graph_setup.py): the token
#: sizes it captures, up to --cuda-graph-max-bs-prefill (the chunked prefill size unless given).
_PREFILL_BEGIN = (
    "log:Capture target prefill CUDA graph begin. backend=breakable, num_tokens=[4, 8, 12, 16, "
    "20, 24, 28, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, "
    "768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192], "
    "avail mem=5.10 GB"
)
START_FAILURES: dict[str, tuple[str, ...] | dict[str, tuple[str, ...]]] = {
    "kv_cache": (
        "loaded",
        '  File "sglang/srt/model_executor/model_runner.py", in init_memory_pool',
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
    ),
    "weights_oom": (
        '  File "sglang/srt/model_loader/loader.py", in load_model',
        _TORCH_OOM,
    ),
    "draft_oom": (
        "loaded",
        "draft",
        '  File "sglang/srt/model_loader/loader.py", in load_model',
        _TORCH_OOM,
    ),
    # 0.5.9: model_executor/cuda_graph_runner.py (the message, its CUDA_GRAPH_CAPTURE_FAILED_MSG);
    # model_runner.py `init_device_graphs` logs the capture's begin.
    # 0.5.23: model_executor/runner/decode_cuda_graph_runner.py, its message in
    # model_executor/runner_backend_utils/__init__.py (naming --cuda-graph-max-bs-decode, the
    # only decode flag there); model_runner_components/cuda_graph_setup.py logs each capture's
    # begin and end, the prefill graph's (breakable, on by default) before the decode one's.
    "graph_oom": {
        "0.5.9": (
            "loaded",
            "log:Capture cuda graph begin. This can take up to several minutes. avail mem=5.10 GB",
            '  File "sglang/srt/model_executor/cuda_graph_runner.py", in __init__',
            "Exception: Capture cuda graph failed: " + _TORCH_OOM.partition(": ")[2],
            "Possible solutions:",
            "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)",
            "2. set --cuda-graph-max-bs to a smaller value (e.g., 16)",
            "3. disable torch compile by not using --enable-torch-compile",
            "4. disable CUDA graph by --disable-cuda-graph. (Not recommended. Huge performance "
            "loss)",
        ),
        "0.5.23": (
            "loaded",
            _PREFILL_BEGIN,
            "log:Capture target prefill CUDA graph end. elapsed=9.71 s, mem usage=0.62 GB, "
            "avail mem=4.48 GB.",
            "log:Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
            "avail mem=4.48 GB",
            '  File "sglang/srt/model_executor/runner/decode_cuda_graph_runner.py", in __init__',
            "Exception: Capture cuda graph failed: " + _TORCH_OOM.partition(": ")[2],
            "Possible solutions:",
            "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)",
            "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)",
            "3. disable decode CUDA graph by --cuda-graph-backend-decode=disabled. (Not "
            "recommended. Huge performance loss)",
        ),
    },
    # The prefill-side graph. 0.5.9 (with --enable-piecewise-cuda-graph):
    # model_executor/piecewise_cuda_graph_runner.py, after the decode graph, model_runner.py
    # `init_piecewise_cuda_graphs` logging its begin. 0.5.23 (on by default, breakable):
    # model_executor/runner_backend_utils/breakable_cuda_graph/context.py logs the error with
    # the prefill runner's hint (PREFILL_CUDA_GRAPH_CAPTURE_FAILED_MSG) and re-raises it, so
    # the traceback ends in torch's own line, no "Capture cuda graph failed".
    "prefill_graph_oom": {
        "0.5.9": (
            "loaded",
            "log:Capture cuda graph begin. This can take up to several minutes. avail mem=5.10 GB",
            "log:Capture cuda graph end. Time elapsed: 8.12 s. mem usage=0.61 GB. avail mem=4.49 "
            "GB.",
            "log:Capture piecewise CUDA graph begin. avail mem=4.49 GB",
            '  File "sglang/srt/model_executor/piecewise_cuda_graph_runner.py", in __init__',
            "Exception: Capture cuda graph failed: " + _TORCH_OOM.partition(": ")[2],
            "Possible solutions:",
            "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)",
            "2. set --piecewise-cuda-graph-max-tokens to a smaller value (e.g., 512)",
            "3. disable Piecewise CUDA graph by unset --enable-piecewise-cuda-graph",
        ),
        "0.5.23": (
            "loaded",
            _PREFILL_BEGIN,
            "log:" + _TORCH_OOM.removeprefix("torch."),
            "Fail when using backend: breakable for prefill runner.",
            "Possible suggestions:",
            "1. disable the prefill CUDA graph by --cuda-graph-backend-prefill=disabled",
            "2. if it is an OOM problem, set --mem-fraction-static to a smaller value (e.g., 0.8 "
            "or 0.7) or set --cuda-graph-max-bs-prefill to a smaller value (e.g., 2048)",
            "traceback",
            '  File "sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py", in capture',
            _TORCH_OOM,
        ),
    },
    "crash": (
        "loaded",
        '  File "sglang/srt/distributed/device_communicators/pynccl.py", in __init__',
        "RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for details)",
    ),
}
#: The assertion SGLang's TpModelWorker fails when its pool or context holds no request.
POOL_TOO_SMALL = ("loaded", "AssertionError: Memory pool size is too small")


def fail_start(steps: Sequence[str], draft: bool) -> None:
    """Fail the start as SGLang does (`START_FAILURES`): weights loaded ("loaded"; "draft": the
    draft model's begun, where there is one), its own log lines ("log:" and the line), the
    scheduler's traceback ("traceback": where it begins, else before the first other line),
    its SIGQUIT to the launcher, and the launcher's SIGKILL of its own process tree."""
    log("Load weight begin. avail mem=78.50 GB")
    lines = list(steps)
    if lines and lines[0] == "loaded":
        lines.pop(0)
        log("Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=63.40 GB")
        if lines and lines[0] == "draft":
            lines.pop(0)
            if draft:
                log("Load weight begin. avail mem=63.38 GB")
    header = "Scheduler hit an exception: Traceback (most recent call last):"
    begun = "traceback" not in lines
    for line in lines:
        if line == "traceback":
            log(header)
        elif line.startswith("log:"):
            log(line.removeprefix("log:"))
        else:
            if begun:
                log(header)
                begun = False
            sys.stderr.write(line + "\n")
    log("Received sigquit from a child process. It usually means the child failed.")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def scheduler_killed(cfg: StubConfig, started: float) -> int:
    """``start_failure`` "scheduler_killed": two scheduler ranks forked as SGLang's launcher
    spawns them, rank 1 killed outright as its weights load (SIGKILL: the OS's out-of-memory
    killer), so no "Scheduler hit an exception" and no SIGQUIT; rank 0 waits for it (as in a
    collective). 0.5.9's launcher waits on rank 0's pipe (entrypoints/engine.py
    `_wait_for_scheduler_ready`: a blocking recv per rank, in turn), never reaping rank 1: the
    stub lives on, listening nowhere, until stopped or ``max_lifetime_s``. 0.5.23's polls every
    rank (every 5 s there) and raises "Rank 1 scheduler died during initialization (exit code:
    -9) ...", then its launch_server.py kills its process tree: exit 1."""
    log("Load weight begin. avail mem=78.50 GB")
    sys.stderr.flush()
    lifetime = max(cfg.max_lifetime_s - (time.monotonic() - started), 0.0)
    rank0 = os.fork()
    if rank0 == 0:  # waits for rank 1, as in a collective, until stopped (default SIGTERM)
        time.sleep(lifetime)
        os._exit(0)
    rank1 = os.fork()
    if rank1 == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if cfg.version == "0.5.9":
        stop.wait(lifetime)  # blocked on rank 0's pipe: rank 1 lies dead, unreaped
    else:
        while not stop.is_set() and os.waitpid(rank1, os.WNOHANG) == (0, 0):
            stop.wait(0.05)
        if not stop.is_set():
            print(
                "Traceback (most recent call last):\n  (sglang_stub)\nRuntimeError: Rank 1 "
                "scheduler died during initialization (exit code: -9). If exit code is -9 "
                "(SIGKILL), a common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to "
                "check.",
                file=sys.stderr,
            )
    with contextlib.suppress(ProcessLookupError):
        os.kill(rank0, signal.SIGKILL)
    return 1


#: Tokens the stub's KV pool holds unless --max-total-tokens says (an H100's, for an 8B model).
KV_TOKENS = 460_000

#: How often a held request looks for its abort or its client's disconnect (s).
HOLD_POLL_S = 0.002

_FLOAT_KEYS = ("startup_s", "listen_delay_s", "ttft_s", "tpot_s", "accept_length", "die_delay_s")
_FLOAT_KEYS += ("stall_s", "flush_busy_s", "max_lifetime_s", "torch_load_mib")
_FLOAT_KEYS += ("busy_health_s",)
_OPTIONAL_INT_KEYS = ("num_draft_tokens", "die_after_requests", "fail_after_requests")
_OPTIONAL_INT_KEYS += ("malformed_chunk_at", "stall_after_chunks", "hold_after_requests")
_OPTIONAL_INT_KEYS += ("nvml_device", "nvml_pid", "foreign_pid", "foreign_from_request")
_OPTIONAL_INT_KEYS += ("foreign_until_request", "hang_after_requests", "burst_request")
_OPTIONAL_INT_KEYS += ("neighbour_device", "neighbour_pid")


def load_config(environ: Mapping[str, str]) -> StubConfig:
    """Read and check the JSON config named by SGLANG_STUB_CONFIG (defaults if unset)."""
    path = environ.get("SGLANG_STUB_CONFIG")
    if not path:
        return StubConfig()
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StubConfigError(f"cannot read SGLANG_STUB_CONFIG={path!r}: {exc}") from exc
    if not isinstance(raw, dict):
        raise StubConfigError("SGLANG_STUB_CONFIG must hold a JSON object")
    unknown = sorted(set(raw) - {f.name for f in fields(StubConfig)})
    if unknown:
        raise StubConfigError(f"unknown config key(s): {', '.join(unknown)}")
    cfg = StubConfig(**raw)
    if cfg.version not in VERSIONS:
        raise StubConfigError(f"version must be one of {VERSIONS}, got {cfg.version!r}")
    for key in _FLOAT_KEYS:
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise StubConfigError(f"{key} must be a number >= 0, got {value!r}")
    if cfg.plain_tpot_s is not None and (
        isinstance(cfg.plain_tpot_s, bool)
        or not isinstance(cfg.plain_tpot_s, int | float)
        or cfg.plain_tpot_s < 0
    ):
        raise StubConfigError(f"plain_tpot_s must be a number >= 0, got {cfg.plain_tpot_s!r}")
    for key in (*_OPTIONAL_INT_KEYS, "seed", "fail_status", "context_len"):
        value = getattr(cfg, key)
        if value is None and key in _OPTIONAL_INT_KEYS:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StubConfigError(f"{key} must be an integer >= 0, got {value!r}")
    for key in ("natural_stop", "abort_route", "abort_ignored", "hold_unfinished", "patch_route"):
        if not isinstance(getattr(cfg, key), bool):
            raise StubConfigError(f"{key} must be true or false")
    failures = sorted([*START_FAILURES, "scheduler_killed"])
    if cfg.start_failure is not None and cfg.start_failure not in failures:
        raise StubConfigError(f"start_failure must be one of {failures} or null")
    if cfg.torch_load_device is not None and not isinstance(cfg.torch_load_device, str):
        raise StubConfigError("torch_load_device must be a torch device name or null")
    if cfg.die_after_requests == 0:
        raise StubConfigError("die_after_requests must be >= 1")
    if cfg.hang_after_requests == 0:
        raise StubConfigError("hang_after_requests must be >= 1")
    if cfg.hold_after_requests == 0:
        raise StubConfigError("hold_after_requests must be >= 1")
    if cfg.burst_request == 0:
        raise StubConfigError("burst_request must be >= 1")
    if cfg.num_draft_tokens is not None and cfg.num_draft_tokens < 1:
        raise StubConfigError("num_draft_tokens must be >= 1")
    if not 400 <= cfg.fail_status <= 599:
        raise StubConfigError(f"fail_status must be an HTTP error status, got {cfg.fail_status}")
    return cfg


# --------------------------------------------------------------------------- argv


class LaunchError(Exception):
    """An SGLang-like failure after parsing (exit 1); ``kind`` names the exception."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _RemovedFlag(argparse.Action):
    """0.5.9's DeprecatedAction: using the flag aborts the launch with ValueError."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        raise LaunchError("ValueError", f"{option_string} is deprecated and no longer supported")


class _DeprecatedStoreTrue(argparse.Action):
    """0.5.23's DeprecatedStoreTrueAction: warns, then stores True."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", 0)
        kwargs.setdefault("default", False)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        log(f"warning: '{option_string}' is deprecated and will be removed in a future release")
        setattr(namespace, self.dest, True)


class _DeprecatedStoreValue(argparse.Action):
    """0.5.23's DeprecatedStoreConstAction (one value per the table): warns, stores it."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        log(f"warning: '{option_string}' is deprecated and will be removed in a future release")
        setattr(namespace, self.dest, values)


class _DeprecatedStoreConst(argparse.Action):
    """0.5.23's DeprecatedStoreConstAction with a `const_value`: warns, stores that value."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        log(f"warning: '{option_string}' is deprecated and will be removed in a future release")
        setattr(namespace, self.dest, self.const)


class _LoraPaths(argparse.Action):
    """LoRAPathAction: ``name=path`` or ``path`` entries into a name -> path mapping."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        paths: dict[str, str] = {}
        for entry in values or []:
            name, sep, path = str(entry).partition("=")
            paths[name] = path if sep else name
        setattr(namespace, self.dest, paths)


def _dest_of(flags: Sequence[str]) -> str:
    """The dest SGLang gives the option: argparse's own (the first long flag, dashes to
    underscores) unless it names another (`RENAMED_DESTS`)."""
    return RENAMED_DESTS.get(flags[0]) or flags[0].lstrip("-").replace("-", "_")


def _option_kwargs(option: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Turn one table row into add_argument() flags and kwargs."""
    flags = list(option["flags"])
    action, nargs, choices = option["action"], option["nargs"], option["choices"]
    dest = _dest_of(flags)
    typ = int if dest in INT_DESTS else float if dest in FLOAT_DESTS else None
    valued: dict[str, Any] = {"nargs": nargs, "choices": choices}
    if typ is not None:  # the tables write choices as text; SGLang's are numbers too
        valued["type"] = typ
        valued["choices"] = None if choices is None else [typ(c) for c in choices]
    unset = {"default": None} if dest in UNSET_FLAGS else {}
    simple = {
        "_StoreTrueAction": {"action": "store_true", **unset},
        "_StoreFalseAction": {"action": "store_false"},
        "_CountAction": {"action": "count"},
        "_StoreAction": {"action": "store", **valued},
        "_AppendAction": {"action": "append", **valued},
        "DeprecatedAction": {"action": _RemovedFlag, "nargs": nargs},
        "DeprecatedStoreTrueAction": {"action": _DeprecatedStoreTrue},
        "DeprecatedStoreConstAction": {"action": _DeprecatedStoreValue, **valued},
        "LoRAPathAction": {"action": _LoraPaths, "nargs": nargs},
    }
    if action == "DeprecatedStoreConstAction" and flags[0] in STORE_CONSTS:
        const = STORE_CONSTS[flags[0]]
        return flags, {**valued, "action": _DeprecatedStoreConst, "dest": dest, "const": const}
    if action == "BooleanOptionalAction":
        positive = [f for f in flags if not f.startswith("--no-")]
        return positive, {"action": argparse.BooleanOptionalAction}
    if action not in simple:
        raise StubConfigError(f"option table uses an action class the stub lacks: {action}")
    renamed = {"dest": dest} if flags[0] in RENAMED_DESTS else {}
    return flags, {**simple[action], **renamed}


def build_parser(version: str) -> argparse.ArgumentParser:
    """Rebuild SGLang's launch_server parser for ``version`` from its option table."""
    table = json.loads((ARGS_DIR / f"{version}.json").read_text(encoding="utf-8"))
    parser = argparse.ArgumentParser(prog="launch_server.py", allow_abbrev=True)
    for option in table["options"]:
        flags, kwargs = _option_kwargs(option)
        parser.add_argument(*flags, **kwargs)
    return parser


@dataclass(frozen=True)
class SpecSettings:
    """What the resolved speculative args mean for the fake decode loop."""

    algorithm: str
    num_steps: int | None
    topk: int | None
    num_draft_tokens: int
    max_tokens_per_step: int
    accept_length: float


def _resolve_speculative(args: dict[str, Any], version: str, cfg: StubConfig) -> None:
    """Apply SGLang's speculative defaults and checks (protocol file, "Launch")."""
    algorithm = args.get("speculative_algorithm")
    if algorithm is None:
        return
    algorithm = str(algorithm).upper() if version == "0.5.23" else str(algorithm)
    if version == "0.5.23" and algorithm not in ALGORITHMS_0523:
        raise LaunchError(
            "ValueError", f"Unknown speculative algorithm: {args['speculative_algorithm']}"
        )
    if algorithm == "NEXTN":
        algorithm = "EAGLE"
    args["speculative_algorithm"] = algorithm
    trio = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    if algorithm == "NGRAM":
        # Its tree's breadth is the topk; 0.5.23 derives the steps from it (0.5.9
        # server_args.py lines 2475-2478; 0.5.23 arg_groups/speculative_hook.py lines 1309-1330).
        if args.get("speculative_num_draft_tokens") is None:
            args["speculative_num_draft_tokens"] = 12
        args["speculative_eagle_topk"] = args.get("speculative_ngram_max_bfs_breadth")
        if version == "0.5.23" and args.get("speculative_num_steps") is None:
            args["speculative_num_steps"] = (
                args["speculative_num_draft_tokens"] // args["speculative_eagle_topk"]
            )
    elif algorithm == "DFLASH":
        block = args.get("speculative_dflash_block_size") or args.get(
            "speculative_num_draft_tokens"
        )
        block = block or 16
        args.update(speculative_num_steps=1, speculative_eagle_topk=1)
        args.update(speculative_num_draft_tokens=block, speculative_dflash_block_size=block)
    else:
        given = [name for name in trio if args.get(name) is not None]
        if not given:
            # STANDALONE gets (3, 1, 4) whatever the target (0.5.9 server_args.py line 5749;
            # 0.5.23 arg_groups/speculative_hook.py line 1437).
            llama = "llama" in str(args.get("model_path") or "").lower()
            steps, topk, drafts = (5, 4, 8) if llama and algorithm != "STANDALONE" else (3, 1, 4)
            args.update(dict(zip(trio, (steps, topk, drafts), strict=True)))
        elif len(given) < len(trio):
            missing = ", ".join("--" + n.replace("_", "-") for n in trio if n not in given)
            raise LaunchError(
                "AssertionError",
                f"--speculative-num-steps, --speculative-eagle-topk and "
                f"--speculative-num-draft-tokens must be set all together or not at all; "
                f"missing {missing}",
            )
        if args["speculative_eagle_topk"] == 1:
            forced = args["speculative_num_steps"] + 1
            if args["speculative_num_draft_tokens"] != forced:
                log(f"warning: topk == 1 sets speculative_num_draft_tokens={forced}")
            args["speculative_num_draft_tokens"] = forced
    if cfg.num_draft_tokens is not None:
        args["speculative_num_draft_tokens"] = cfg.num_draft_tokens
        if algorithm == "DFLASH":
            args["speculative_dflash_block_size"] = cfg.num_draft_tokens
    if args.get("max_running_requests") is None:
        args["max_running_requests"] = 48


def _resolve_dp_attention(args: dict[str, Any]) -> None:
    """0.5.23's attention DP width: the deprecated `--dp-size N --enable-dp-attention` is
    attn_dp_size N, dp_size 1 (arg_groups/parallel_hook.py `_handle_deprecated_dp_attention`),
    and /server_info reports enable_dp_attention as attn_dp_size > 1 (server_args.py
    `resolved_dict`)."""
    attn = args.get("attn_dp_size")
    args["attn_dp_size"] = attn = 1 if attn is None else attn
    if args.get("enable_dp_attention") and attn == 1:
        args["attn_dp_size"], args["dp_size"] = args.get("dp_size") or 1, 1
    dp = args.get("dp_size") or 1
    if args["attn_dp_size"] > 1 and dp > 1:  # parallel_hook.py `handle_data_parallelism`
        raise LaunchError(
            "ValueError",
            f"--dp-size {dp} with --attn-dp-size {args['attn_dp_size']}: data-parallel "
            "replicas combined with attention data parallelism are not supported.",
        )
    args["enable_dp_attention"] = args["attn_dp_size"] > 1


def _resolve_attention(args: dict[str, Any]) -> None:
    """SGLang's attention-backend pick on Hopper for an MHA model (docstring, "Attention")."""
    prefill, decode = args.get("prefill_attention_backend"), args.get("decode_attention_backend")
    if prefill is not None and prefill == decode:
        args["attention_backend"] = prefill
    if args.get("attention_backend") is None:
        topk, page = args.get("speculative_eagle_topk"), args.get("page_size")
        no_spec_or_topk_one = topk is None or (topk == 1 and page in (None, 1))
        args["attention_backend"] = "fa3" if no_spec_or_topk_one else "flashinfer"
    if args["attention_backend"] == "fa3" and args.get("kv_cache_dtype") == "fp8_e5m2":
        log("warning: FlashAttention3 only supports fp8_e4m3 if using FP8; using triton")
        args["attention_backend"] = "triton"
    if args.get("page_size") is None:
        args["page_size"] = 1


#: Hopper's chunked prefill size in both releases (the 80 and 141 GB branches of 0.5.9
#: server_args.py `_handle_gpu_memory_settings`, lines 966-985, and 0.5.23
#: arg_groups/memory_hook.py `handle_gpu_memory_settings`, lines 132-161).
HOPPER_CHUNKED_PREFILL = 8192
#: Algorithms 0.5.23 runs without mixed chunked prefill (speculative/spec_info.py
#: `supports_mixed_chunk`; arg_groups/speculative_hook.py lines 600, 1112, 1307).
NO_MIXED_CHUNK_0523 = {"NGRAM", "STANDALONE", "UNO"}
EAGLE_FAMILY = {"EAGLE", "EAGLE3", "STANDALONE"}


def graph_ladder(max_bs: int, speculative: bool, version: str) -> list[int]:
    """SGLang's default decode CUDA-graph batch sizes up to ``max_bs``: finer for a speculative
    server (0.5.9 server_args.py lines 1079-1107, 0.5.23 arg_groups/cuda_graph_hook.py lines
    500-532, where ``max_bs`` itself is always captured)."""
    if speculative:
        steps = [(1, 9, 1), (10, 33, 2), (40, 65, 4), (72, 257, 8), (272, max_bs + 1, 16)]
        sizes = [b for lo, hi, step in steps for b in range(lo, hi, step)]
    else:
        steps = [(16, 257, 8), (272, 512, 16), (512, max_bs + 1, 32)]
        sizes = [1, 2, 4, 8, 12] + [b for lo, hi, step in steps for b in range(lo, hi, step)]
    sizes = [b for b in sizes if b <= max_bs]
    return sizes + [max_bs] if version == "0.5.23" and max_bs not in sizes else sizes


def _resolve_graphs(args: dict[str, Any], version: str) -> None:
    """The decode CUDA graphs (and chunked prefill size) as the release reports them."""
    if args.get("chunked_prefill_size") is None:
        args["chunked_prefill_size"] = HOPPER_CHUNKED_PREFILL
    speculative = args.get("speculative_algorithm") is not None
    default_max = 256 if int(args.get("tp_size") or 1) < 4 else 512
    if version == "0.5.9":
        max_bs = args.get("cuda_graph_max_bs") or default_max
        given = args.get("cuda_graph_bs")
        sizes = given or graph_ladder(max_bs, speculative, version)
        args.update(cuda_graph_bs=list(sizes), cuda_graph_max_bs=max(given) if given else max_bs)
        return
    max_bs = args.get("cuda_graph_max_bs_decode")
    if max_bs is None:
        running = args.get("max_running_requests")  # as given: before the speculative default
        max_bs = default_max if running is None else min(default_max, running)
    sizes = args.get("cuda_graph_bs_decode") or graph_ladder(max_bs, speculative, version)
    off = bool(args.get("disable_cuda_graph"))
    decode_off = off or bool(args.get("disable_decode_cuda_graph"))
    prefill_off = off or bool(args.get("disable_prefill_cuda_graph"))
    prefill_max = args.get("cuda_graph_max_bs_prefill")
    if not prefill_max:
        # The chunked prefill size, no more than a given --max-total-tokens, and 4096 for a
        # Llama 2 (0.5.23 arg_groups/memory_hook.py `handle_gpu_memory_settings`).
        prefill_max = args["chunked_prefill_size"]
        if args.get("max_total_tokens") is not None:
            prefill_max = min(prefill_max, args["max_total_tokens"])
        if "llama-2" in str(args["model_path"]).lower():
            prefill_max = min(prefill_max, 4096)
    args["cuda_graph_config"] = {
        "decode": {
            "backend": args.get("cuda_graph_backend_decode")
            or ("disabled" if decode_off else "full"),
            "max_bs": max(sizes),
            "bs": list(sizes),
        },
        "prefill": {
            "backend": args.get("cuda_graph_backend_prefill")
            or ("disabled" if prefill_off else "breakable"),
            "max_bs": prefill_max,
            "bs": args.get("cuda_graph_bs_prefill"),
        },
    }


def _resolve_sampling_and_lora(args: dict[str, Any], version: str) -> None:
    """What both releases resolve without the GPU: the sampling kernels (FlashInfer, a
    dependency of both wheels, unless deterministic inference asks for PyTorch's: 0.5.9
    server_args.py `_handle_sampling_backend` and `_handle_deterministic_inference`, 0.5.23
    arg_groups/overrides.py `_sampling_backend_default`, `_deterministic_sampling_backend`);
    LoRA turned on by --lora-paths and its overlap loading off (0.5.9 `check_lora_server_args`,
    0.5.23 lora_hook.py); and 0.5.9's piecewise CUDA graph token limit, the chunked prefill
    size for an MHA model (`_handle_gpu_memory_settings`)."""
    if args.get("enable_deterministic_inference"):
        args["sampling_backend"] = "pytorch"
    elif "sampling_backend" in args and args["sampling_backend"] is None:
        args["sampling_backend"] = "flashinfer"
    if args.get("lora_paths") and args.get("enable_lora") is None:
        args["enable_lora"] = True
    if args.get("enable_lora") and args.get("enable_lora_overlap_loading") is None:
        args["enable_lora_overlap_loading"] = False
    if version == "0.5.9" and args.get("piecewise_cuda_graph_max_tokens") is None:
        args["piecewise_cuda_graph_max_tokens"] = args["chunked_prefill_size"]


def _resolve_scheduling(args: dict[str, Any], version: str, environ: Mapping[str, str]) -> None:
    """The overlap scheduler and mixed chunked prefill per algorithm (docstring,
    "Scheduling"): 0.5.9 server_args.py lines 2368-2391 and 2473-2474; 0.5.23
    arg_groups/speculative_hook.py lines 1096-1113 and 1292-1308."""
    algorithm = args.get("speculative_algorithm")
    if algorithm is None:
        return
    if version == "0.5.9":
        spec_v2 = environ.get("SGLANG_ENABLE_SPEC_V2", "").lower() in ("true", "1", "yes", "y")
        args["disable_overlap_schedule"] = algorithm == "NGRAM" or not spec_v2
        args["enable_mixed_chunk"] = False
    elif algorithm in NO_MIXED_CHUNK_0523:
        args["enable_mixed_chunk"] = False


#: The GPU memory (MiB) SGLang sizes an unset --mem-fraction-static by where the stub has no
#: fake NVML: an H100 SXM's (the Hopper GPU it plays).
STUB_GPU_MIB = 81559


def prefill_graph_tokens(max_tokens: int) -> list[int]:
    """0.5.23's default prefill CUDA-graph token sizes up to ``max_tokens`` (arg_groups/
    cuda_graph_hook.py ``generate_prefill_cuda_graph_batch_sizes``)."""
    sizes = [
        *range(4, 33, 4),
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
        *range(4608, max_tokens + 1, 512),
    ]
    return [n for n in sizes if n <= max_tokens]


def smallest_gpu_mib(environ: Mapping[str, str]) -> int:
    """The memory (MiB) of the smallest GPU SGLang would see: the fake NVML's devices where
    ``DVFS_FAKE_NVML_STATE`` names its state, else `STUB_GPU_MIB`."""
    nvml = fake_nvml(environ)
    if nvml is None:
        return STUB_GPU_MIB
    totals = [
        int(nvml.FAKE_PROFILES[dev["profile"]]["memory_total_bytes"]) // 2**20
        for dev in nvml.fake_state()["devices"]
    ]
    return min(totals) if totals else STUB_GPU_MIB


def _resolve_memory(args: dict[str, Any], version: str, gpu_mib: int) -> None:
    """An unset --mem-fraction-static as the release resolves it (module docstring,
    "Memory"), for the GPU memory ``gpu_mib``."""
    if args.get("mem_fraction_static") is not None:
        return
    tp, pp = int(args.get("tp_size") or 1), int(args.get("pp_size") or 1)
    chunked = int(args["chunked_prefill_size"])
    # Without chunked prefill (-1), a prefill of up to --max-prefill-tokens tokens.
    activation = chunked if chunked > 0 else int(args.get("max_prefill_tokens") or 16384)
    reserved = 512 + max(activation, 2048) * 1.5 + tp * pp / 8 * 1024
    if version == "0.5.9":
        # Its decode graphs' share even with --disable-cuda-graph (0.5.9 reserves it always).
        reserved += int(args["cuda_graph_max_bs"]) * 2
        if args.get("enable_piecewise_cuda_graph"):
            tokens = args.get("piecewise_cuda_graph_tokens") or prefill_graph_tokens(
                int(args["piecewise_cuda_graph_max_tokens"])
            )
            reserved += len(tokens) * 8
    else:
        graphs = args["cuda_graph_config"]
        if graphs["decode"]["backend"] != "disabled":
            reserved += int(graphs["decode"]["max_bs"]) * 2
        if graphs["prefill"]["backend"] != "disabled":
            sizes = graphs["prefill"]["bs"] or prefill_graph_tokens(
                int(graphs["prefill"]["max_bs"])
            )
            reserved += len(sizes) * 8
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    algorithm = args.get("speculative_algorithm")
    if version == "0.5.9" and algorithm is not None and algorithm != "NGRAM":
        reserved += 6 * 1024 if algorithm == "STANDALONE" else 2 * 1024
    args["mem_fraction_static"] = round((gpu_mib - reserved) / gpu_mib, 3)


def _resolve_modelscope(args: dict[str, Any], version: str, environ: Mapping[str, str]) -> None:
    """With env SGLANG_USE_MODELSCOPE true (0.5.9: "true" or "1"; 0.5.23 also "yes" or "y",
    any case), a model_path that is no existing path is downloaded from ModelScope, and the
    folder it lands in is reported (``$MODELSCOPE_CACHE``, else ``~/.cache/modelscope/hub``,
    then the model id; nothing downloaded here): 0.5.9 server_args.py
    ``_handle_missing_default_values``, 0.5.23 arg_groups/model_path_hook.py
    ``handle_modelscope_paths`` and environ.py ``EnvBool``."""
    truthy = ("true", "1") if version == "0.5.9" else ("true", "1", "yes", "y")
    model = str(args["model_path"])
    if environ.get("SGLANG_USE_MODELSCOPE", "").lower() not in truthy or os.path.exists(model):
        return
    cache = environ.get("MODELSCOPE_CACHE") or str(Path.home() / ".cache" / "modelscope" / "hub")
    if args.get("tokenizer_path") == model:
        args["tokenizer_path"] = str(Path(cache) / model)
    args["model_path"] = str(Path(cache) / model)


def _resolve_hub_gguf(args: dict[str, Any], environ: Mapping[str, str]) -> None:
    """0.5.23's model_path for a .gguf named on the Hub: the local file it downloads it to
    (docstring); anything else, an existing path included, is left as given."""
    model = str(args["model_path"])
    repo, _, quant = model.rpartition(":")
    parts = model.strip("/").split("/")
    if os.path.exists(model):
        return
    if quant and repo.count("/") == 1 and "/" not in quant:
        filename = f"{repo.split('/')[1]}-{quant}.gguf"
    elif len(parts) > 2 and model.endswith(".gguf"):
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
    else:
        return
    home = Path(environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    folder = home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
    if args.get("tokenizer_path") == model:
        args["tokenizer_path"] = str(folder / filename)
    args["model_path"] = str(folder / filename)


def resolve_server_args(
    ns: argparse.Namespace,
    version: str,
    cfg: StubConfig,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Parsed argv -> SGLang-like server args (field names, defaults, speculative rules);
    ``environ``: the server's environment (SGLANG_ENABLE_SPEC_V2), empty if not given."""
    args = dict(vars(ns))
    for long_name, field_name in FIELD_ALIASES.items():
        if long_name in args:
            args[field_name] = args.pop(long_name)
    for key, value in {**KNOWN_DEFAULTS, **RELEASE_DEFAULTS[version]}.items():
        if key in args and args[key] is None:
            args[key] = value
    for key in ("tokenizer_path", "served_model_name"):
        if key in args and args[key] is None:
            args[key] = args["model_path"]
    _resolve_modelscope(args, version, environ or {})
    if version != "0.5.9":
        _resolve_hub_gguf(args, environ or {})
    if args.get("random_seed") is None:  # SGLang draws one at every start
        args["random_seed"] = random.randint(0, 1 << 30)
    if version != "0.5.9":
        _resolve_dp_attention(args)
    _resolve_attention(args)  # before the speculative defaults, as SGLang does
    _resolve_graphs(args, version)  # likewise (memory settings come first in both)
    _resolve_sampling_and_lora(args, version)
    _resolve_speculative(args, version, cfg)
    _resolve_scheduling(args, version, environ or {})
    _resolve_memory(args, version, smallest_gpu_mib(environ or {}))
    return args


def spec_settings(args: dict[str, Any], cfg: StubConfig) -> SpecSettings | None:
    """How many tokens one verify pass may yield, and the configured mean."""
    algorithm = args.get("speculative_algorithm")
    if algorithm is None:
        return None
    drafts = int(args["speculative_num_draft_tokens"])
    steps, topk = args.get("speculative_num_steps"), args.get("speculative_eagle_topk")
    cap = drafts
    if algorithm not in ("NGRAM", "DFLASH") and steps is not None:
        cap = min(drafts, int(steps) + 1)
    cap = max(cap, 1)
    return SpecSettings(algorithm, steps, topk, drafts, cap, min(max(cfg.accept_length, 1.0), cap))


def parse_launch_argv(
    argv: Sequence[str], cfg: StubConfig, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, Any], SpecSettings | None]:
    """Parse argv like launch_server does; argparse exits 2, LaunchError means exit 1."""
    parser = build_parser(cfg.version)
    ns = parser.parse_args(list(argv))
    if getattr(ns, "model_path", None) is None:
        parser.error("the following arguments are required: --model-path/--model")
    args = resolve_server_args(ns, cfg.version, cfg, environ)
    return args, spec_settings(args, cfg)


# --------------------------------------------------------------------------- requests


class RequestError(Exception):
    """A /generate body SGLang would refuse: 400, or in-band when streaming."""

    def __init__(self, message: str, *, in_band: bool = False) -> None:
        super().__init__(message)
        self.in_band = in_band


#: How late a decode step may be emitted before the later ones move back as much (the time
#: the steps due at one moment take to emit stays within it; a starved process does not).
SLIP_TOLERANCE_S = 0.0005


class ServerStoppingError(Exception):
    """The server is shutting down while a request is in flight."""


@dataclass
class SubRequest:
    """One prompt x one sample of a /generate call, with its precomputed schedule."""

    index: int
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    finish: dict[str, Any]
    steps: list[int]  # tokens per emission; [0] is the prefill token
    token_ids: list[int]
    interval: int
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    verify_ct: int = 0
    correct_drafts: int = 0
    histogram: list[int] = field(default_factory=list)
    first_token_mono: float | None = None
    first_iteration: int = 0  # the server's decode iterations before this one's first token
    finished_mono: float | None = None
    finished_wall: float | None = None
    sent_ids: int = 0

    @property
    def done(self) -> bool:
        """True once every scheduled emission was applied."""
        return self.finished_mono is not None


@dataclass
class Plan:
    """A parsed /generate call: its sub-requests and shared timing."""

    number: int
    stream: bool
    is_list: bool
    subs: list[SubRequest]
    t0: float
    received_wall: float
    running: bool = False  # counted in Stub.running_http, from begin() to end()


def prompt_token_ids(text: str) -> list[int]:
    """Fake tokenizer: BOS plus one stable id per whitespace-separated word."""
    return [BOS_TOKEN_ID] + [1000 + zlib.crc32(word.encode()) % 30000 for word in text.split()]


def token_text(token_id: int) -> str:
    """Fake detokenizer: every token is one word."""
    return f" tok{token_id}"


def _number(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{key} must be a number, got {value!r}", in_band=True)
    return float(value)


def check_sampling_params(params: Any, version: str) -> dict[str, Any]:
    """SGLang's sampling-param checks; 0.5.23 also refuses unknown keys."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise RequestError(f"sampling_params must be an object, got {type(params).__name__}")
    unknown = sorted(set(params) - SAMPLING_KEYS)
    if unknown and version == "0.5.23":
        raise RequestError(f"Unknown sampling parameter(s): {', '.join(unknown)}")
    temperature = _number(params, "temperature", 1.0)
    if not math.isfinite(temperature) or temperature < 0:
        raise RequestError(
            f"temperature must be a non-negative finite number, got {temperature}.", in_band=True
        )
    top_p = _number(params, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.", in_band=True)
    min_p = _number(params, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}.", in_band=True)
    top_k = _number(params, "top_k", -1)
    if top_k != -1 and top_k < 1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.", in_band=True)
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= _number(params, key, 0.0) <= 2.0:
            raise RequestError(f"{key} must be in [-2, 2], got {params[key]}.", in_band=True)
    if not 0.0 < _number(params, "repetition_penalty", 1.0) <= 2.0:
        raise RequestError(
            f"repetition_penalty must be in (0, 2], got {params['repetition_penalty']}.",
            in_band=True,
        )
    for key in ("max_new_tokens", "min_new_tokens", "n", "stream_interval"):
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RequestError(f"{key} must be an integer, got {value!r}", in_band=True)
    max_new = 128 if params.get("max_new_tokens") is None else params["max_new_tokens"]
    min_new = params.get("min_new_tokens") or 0
    if max_new < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.", in_band=True)
    if not 0 <= min_new <= max_new:
        raise RequestError(
            f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.",
            in_band=True,
        )
    if (params.get("n") or 1) < 1:
        raise RequestError(f"n must be at least 1, got {params['n']}.", in_band=True)
    return params


def _prompts(req: dict[str, Any]) -> tuple[list[list[int]], bool]:
    """The prompts of a /generate body as token ids, and whether it was a batch."""
    text, input_ids = req.get("text"), req.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("Exactly one of text or input_ids should be provided.")
    if text is not None:
        if isinstance(text, str):
            return [prompt_token_ids(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [prompt_token_ids(t) for t in text], True
        raise RequestError("text must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(isinstance(i, int) for i in input_ids):
        return [list(input_ids)], False
    if (
        isinstance(input_ids, list)
        and input_ids
        and all(isinstance(p, list) and p and all(isinstance(i, int) for i in p) for p in input_ids)
    ):
        return [list(p) for p in input_ids], True
    raise RequestError("input_ids must be a non-empty list of ints or of lists of ints")


# --------------------------------------------------------------------------- state


class Stub:
    """Shared state of one stub server: config, resolved args, counters, locks."""

    def __init__(self, cfg: StubConfig, args: dict[str, Any], spec: SpecSettings | None) -> None:
        self.cfg = cfg
        self.version = cfg.version
        self.args = args
        #: What POST /_stub/patch set (``patch_route``): keys over answers, or a raw body.
        self.patches: dict[str, Any] = {}
        self.spec = spec
        self.lock = threading.Lock()
        self.stop = threading.Event()
        #: hang_after_requests reached: no request is answered any more (but /health where
        #: `health_generates` is false).
        self.hung = threading.Event()
        #: Whether /health runs its one-token generate: SGLang's env
        #: SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION (true unless "false", "0", "no", "n");
        #: false, /health answers 200 at once from the HTTP server, the scheduler unasked,
        #: and /health_generate alone generates (0.5.9 and 0.5.23 http_server.py).
        self.health_generates = os.environ.get(
            "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true"
        ).lower() not in ("false", "0", "no", "n")
        self.ready_at = math.inf
        self.model_name = str(args.get("served_model_name") or args["model_path"])
        self.enable_metrics = bool(args.get("enable_metrics"))
        self.incremental = bool(
            args.get("incremental_streaming_output") or args.get("stream_output")
        )
        self.stream_interval = max(int(args.get("stream_interval") or 1), 1)
        self.weight_version = str(args.get("weight_version") or "default")
        self.radix_cache = not args.get("disable_radix_cache")
        #: The served context, its KV pool and what the scheduler derives from them.
        self.context_len = int(args.get("context_length") or cfg.context_len)
        self.max_total_num_tokens = int(args.get("max_total_tokens") or KV_TOKENS)
        self.max_req_len = min(self.context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.auto_truncate = bool(args.get("allow_auto_truncate"))
        self.reserved_tokens = 0
        if spec is not None and spec.algorithm in ("EAGLE", "EAGLE3", "NEXTN"):
            self.reserved_tokens = max(
                (spec.topk or 1) * (spec.num_steps or 1), spec.num_draft_tokens
            )
        self.generate_count = 0
        self.running_http = 0
        self.running_subs = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        #: SGLang's tokenizer counts a request's tokens as it finishes (aborted too), its
        #: schedulers the tokens of each decode iteration (realtime_tokens_total, "decode")
        self.generation_tokens_total = 0
        self.decode_tokens_total = 0
        self.verify_calls_total = 0
        #: Decode iterations since the last flush (SGLang's forward_ct_decode), and per
        #: iteration its [tokens, request steps], for the block-wise average.
        self.decode_iterations = 0
        self.spec_by_iteration: dict[int, list[int]] = {}
        self.decode_log_interval = max(int(args.get("decode_log_interval") or 40), 1)
        self.recent_steps: deque[int] = deque(maxlen=40)
        self.gen_window: deque[tuple[float, int]] = deque()
        self.last_gen_throughput = 0.0
        self.prefix_cache: deque[list[int]] = deque(maxlen=64)
        self.abort_rids: set[str] = set()
        #: Each abort's rid and when it came: it stops every request arrived by then whose
        #: rid starts with it.
        self.abort_prefixes: list[tuple[str, float]] = []
        self.abort_all_at = -math.inf  # requests running at this instant are aborted
        self.aborted_total = 0
        self.finished_since_flush = False  # hold_unfinished: whether to hold last steps
        self.arrived_since_flush = 0  # /generate requests (hold_after_requests)
        #: The fake NVML and the devices the stub listed itself on (foreign_pid's GPUs).
        self.nvml: Any = None
        self.devices: list[Any] = []

    # -- lifecycle

    def is_ready(self) -> bool:
        """True once startup_s has passed since the port opened."""
        return time.monotonic() >= self.ready_at

    def count_generate(self) -> int:
        """Number this /generate arrival (from 1); fault injection keys off it."""
        with self.lock:
            self.generate_count += 1
            self.arrived_since_flush += 1
            return self.generate_count

    def maybe_die(self, number: int) -> None:
        """die_after_requests: exit abruptly, now or after die_delay_s."""
        if self.cfg.die_after_requests is None or number < self.cfg.die_after_requests:
            return
        log(f"die_after_requests={self.cfg.die_after_requests} reached at #{number}: os._exit(1)")

        def die() -> None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

        if self.cfg.die_delay_s <= 0:
            die()
        timer = threading.Timer(self.cfg.die_delay_s, die)
        timer.daemon = True
        timer.start()

    def maybe_hang(self, number: int) -> None:
        """hang_after_requests: from now on answer nothing (`StubHandler._dispatch` waits)."""
        if self.cfg.hang_after_requests is None or number < self.cfg.hang_after_requests:
            return
        if not self.hung.is_set():
            log(f"hang_after_requests={self.cfg.hang_after_requests} reached at #{number}: hung")
        self.hung.set()

    def other_tenant(self, number: int) -> None:
        """foreign_pid: list it on the stub's GPUs at foreign_from_request (0: at start),
        drop it at foreign_until_request."""
        cfg, nvml = self.cfg, self.nvml
        if cfg.foreign_pid is None or nvml is None:
            return
        if number == (cfg.foreign_from_request or 0):
            for device in self.devices:
                nvml.fake_add_process(device, cfg.foreign_pid)
            log(f"generate #{number}: foreign pid {cfg.foreign_pid} on fake GPU(s) {self.devices}")
        if number == cfg.foreign_until_request:
            nvml.fake_remove_process(cfg.foreign_pid)
            log(f"generate #{number}: foreign pid {cfg.foreign_pid} gone")

    def should_fail(self, number: int) -> bool:
        """fail_after_requests: request ``number`` and later get fail_status."""
        return self.cfg.fail_after_requests is not None and number >= self.cfg.fail_after_requests

    def flush_refusal(self) -> str | None:
        """Why /flush_cache must answer 400 now, or None."""
        with self.lock:
            if self.running_http:
                return f"{self.running_http} request(s) running"
        if time.monotonic() < self.ready_at + self.cfg.flush_busy_s:
            return "flush_busy_s not over"
        return None

    def flush(self) -> None:
        """Drop the prefix cache and reset the accept-length average (both versions)."""
        with self.lock:
            self.prefix_cache.clear()
            self.decode_iterations = 0
            self.spec_by_iteration.clear()
            self.finished_since_flush = False
            self.arrived_since_flush = 0

    # -- planning

    def plan(self, req: dict[str, Any], number: int) -> Plan:
        """Check a /generate body and precompute every sub-request's schedule."""
        t0, received_wall = time.monotonic(), time.time()
        prompts, is_batch = _prompts(req)
        if self.cfg.requests_log and "text" in req:
            with open(self.cfg.requests_log, "a", encoding="utf-8") as out:
                out.write(json.dumps({"text": req["text"]}) + "\n")
        raw_params = req.get("sampling_params")
        if isinstance(raw_params, list):
            if len(raw_params) != len(prompts):
                raise RequestError("sampling_params list must match the number of prompts")
            params_list = [check_sampling_params(p, self.version) for p in raw_params]
        else:
            params_list = [check_sampling_params(raw_params, self.version)] * len(prompts)
        rid = req.get("rid")
        samples = [int(p.get("n") or 1) for p in params_list]
        is_list = is_batch or any(n > 1 for n in samples)
        subs: list[SubRequest] = []
        for i, (prompt, params, n) in enumerate(zip(prompts, params_list, samples, strict=True)):
            for j in range(n):
                index = len(subs)
                if isinstance(rid, list) and is_batch:
                    base = str(rid[i]) if i < len(rid) else uuid.uuid4().hex
                    sub_rid = base if n == 1 else f"{base}_{j}"
                elif isinstance(rid, str) and not is_list:
                    sub_rid = rid
                elif isinstance(rid, str):
                    sub_rid = f"{rid}_{index}"
                else:
                    sub_rid = uuid.uuid4().hex
                rng = random.Random(f"{self.cfg.seed}:{number}:{index}")
                fitted = self._fit_context(prompt, params)
                subs.append(self._schedule(index, sub_rid, prompt, fitted, rng))
        return Plan(number, bool(req.get("stream")), is_list, subs, t0, received_wall)

    def _fit_context(self, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """`params` with max_new_tokens as SGLang leaves it for `prompt` against the served
        context: refused (`RequestError`) past it, cut to it with --allow-auto-truncate, then
        cut to what ``max_req_len`` leaves (the scheduler's init_req_max_new_tokens)."""
        context, asked = self.context_len, params.get("max_new_tokens")
        max_new = 128 if asked is None else int(asked)
        counted = len(prompt) + self.reserved_tokens
        if counted >= context:
            raise RequestError(
                f"The input ({counted} tokens) is longer than the model's context length "
                f"({context} tokens).",
                in_band=True,
            )
        over = (
            counted + max_new >= context if self.version == "0.5.9" else counted + max_new > context
        )
        if asked is not None and over:
            if not self.auto_truncate:
                raise RequestError(
                    "Requested token count exceeds the model's maximum context length of "
                    f"{context} tokens. You requested a total of {counted + max_new} tokens: "
                    f"{counted} tokens from the input messages and {max_new} tokens for the "
                    "completion. Please reduce the number of tokens in the input messages or "
                    "the completion to fit within the limit.",
                    in_band=True,
                )
            max_new = max(0, context - counted)
        max_new = max(0, min(max_new, self.max_req_len - len(prompt) - 1))
        return params if max_new == asked else {**params, "max_new_tokens": max_new}

    def _schedule(
        self, index: int, rid: str, prompt: list[int], params: dict[str, Any], rng: random.Random
    ) -> SubRequest:
        """Decide length, finish reason and tokens-per-step of one sub-request."""
        max_new = 128 if params.get("max_new_tokens") is None else int(params["max_new_tokens"])
        min_new = int(params.get("min_new_tokens") or 0)
        target, finish = max_new, {"type": "length", "length": max_new}
        if self.cfg.natural_stop and not params.get("ignore_eos") and max_new > 0:
            target = rng.randint(max(1, min_new), max_new)
            if target < max_new:
                finish = {"type": "stop", "matched": EOS_TOKEN_ID}
        steps = [1] if target > 0 else [0]
        remaining = target - 1
        while remaining > 0:
            k = self._draw_step(rng)
            steps.append(min(k, remaining))
            remaining -= steps[-1]
        interval = int(params.get("stream_interval") or self.stream_interval)
        token_ids = [rng.randrange(100, 32000) for _ in range(target)]
        histogram = [0] * (self.spec.num_draft_tokens if self.spec else 0)
        return SubRequest(
            index, rid, prompt, max_new, finish, steps, token_ids, max(interval, 1),
            histogram=histogram,
        )  # fmt: skip

    def _draw_step(self, rng: random.Random) -> int:
        """Tokens one decode step yields: 1, or floor/ceil of accept_length."""
        if self.spec is None:
            return 1
        mean = self.spec.accept_length
        low = math.floor(mean)
        return min(low + (1 if rng.random() < mean - low else 0), self.spec.max_tokens_per_step)

    def begin(self, plan: Plan) -> None:
        """Account a request as running; look its prompts up in the prefix cache."""
        with self.lock:
            plan.running = True
            self.running_http += 1
            self.running_subs += len(plan.subs)
            self.requests_total += len(plan.subs)
            for sub in plan.subs:
                self.prompt_tokens_total += len(sub.prompt_ids)
                if self.radix_cache:
                    sub.cached_tokens = self._cached_prefix(sub.prompt_ids)
                    self.prefix_cache.append(sub.prompt_ids)

    def _cached_prefix(self, prompt: list[int]) -> int:
        """Longest prefix shared with a cached prompt, leaving the last token to compute."""
        best = 0
        for cached in self.prefix_cache:
            low, high = 0, min(len(cached), len(prompt))
            while low < high:
                mid = (low + high + 1) // 2
                if cached[:mid] == prompt[:mid]:
                    low = mid
                else:
                    high = mid - 1
            best = max(best, low)
        return max(0, min(best, len(prompt) - 1))

    def end(self, plan: Plan) -> None:
        """Account a request as no longer running (once: at its last step, or when it fails)."""
        with self.lock:
            if not plan.running:
                return
            plan.running = False
            self.running_http -= 1
            self.running_subs -= len(plan.subs)

    # -- aborts

    def request_abort(self, rid: str | None, abort_all: bool) -> None:
        """POST /abort_request: mark a rid (or everything running) to stop at its next step."""
        with self.lock:
            if abort_all:
                self.abort_all_at = time.monotonic()
            elif rid:
                self.abort_rids.add(rid)
                self.abort_prefixes.append((rid, time.monotonic()))

    def _abort_due(self, plan: Plan, sub: SubRequest) -> bool:
        with self.lock:
            if sub.rid in self.abort_rids or plan.t0 <= self.abort_all_at:
                return True
            return any(sub.rid.startswith(r) and plan.t0 <= at for r, at in self.abort_prefixes)

    def _abort(self, sub: SubRequest) -> None:
        """Finish ``sub`` as aborted with what it has emitted."""
        sub.finish = {"type": "abort", "message": f"request {sub.rid} aborted by /abort_request"}
        sub.finished_mono, sub.finished_wall = time.monotonic(), time.time()
        with self.lock:
            self.abort_rids.discard(sub.rid)
            self.aborted_total += 1
            self.generation_tokens_total += len(sub.output_ids)
        log(f"aborted rid={sub.rid} after {len(sub.output_ids)} tokens")
        self.log_spec(sub, "aborted")

    def log_spec(self, sub: SubRequest, how: str) -> None:
        """The speculative counters ``sub`` ended with (finished, aborted, cut)."""
        if self.spec is not None:
            log(f"spec rid={sub.rid} tokens={len(sub.output_ids)} verify_ct={sub.verify_ct} "
                f"correct_drafts={sub.correct_drafts} {how}")  # fmt: skip

    # -- running

    def run(
        self, plan: Plan, gone: Callable[[], bool] | None = None
    ) -> Iterator[tuple[SubRequest, int]]:
        """Apply emissions in time order, sleeping until each is due (a step emitted more
        than SLIP_TOLERANCE_S late moves every later one back as much: never two steps of a
        request closer than tpot_s less that tolerance); yields (sub, step).
        A sub-request marked for abort stops at its next step instead (yielded once more,
        done, with the step it did not take). Once every sub-request is done the request
        stops counting as running, before its last chunk is yielded (SGLang's scheduler
        frees a request before its final chunk reaches the client, so a /flush_cache sent
        after the stream ended never finds it running). ``gone`` says whether the client
        went away; a held request (``hold_unfinished``) asks it while it waits."""
        tpot = self.cfg.tpot_s
        if self.spec is None and self.cfg.plain_tpot_s is not None:
            tpot = self.cfg.plain_tpot_s
        events = sorted(
            (self.cfg.ttft_s + j * tpot, sub.index, j)
            for sub in plan.subs
            for j in range(len(sub.steps))
        )
        slip = 0.0  # how far behind its schedule the server has fallen (a loaded machine)
        for offset, index, j in events:
            sub = plan.subs[index]
            if sub.done:
                continue
            delay = plan.t0 + offset + slip - time.monotonic()
            if delay < -SLIP_TOLERANCE_S:
                # Late: this step and every later one move back as much. A server that falls
                # behind does not catch up in a burst of steps, which would bring a request's
                # tokens closer than tpot_s apart and its measured TPOT below the stub's. (The
                # moments spent emitting the steps due together are not lateness: counted,
                # they would stretch every request of a batch a little more at each step.)
                slip -= delay
            if self.stop.wait(max(delay, 0.0)):
                raise ServerStoppingError
            if j == len(sub.steps) - 1 and not self._abort_due(plan, sub):
                self._finish_or_hold(plan, sub, gone)
            if self._abort_due(plan, sub):
                self._abort(sub)
            else:
                self._apply(sub, j)
            if all(s.done for s in plan.subs):
                self.end(plan)
            yield sub, j

    def _finish_or_hold(self, plan: Plan, sub: SubRequest, gone: Callable[[], bool] | None) -> None:
        """Before ``sub``'s last step: with ``hold_unfinished``, once a request finished
        since the last flush (and since ``hold_after_requests`` arrived), wait until ``sub``
        is aborted (ConnectionAbortedError if its client goes away first); otherwise note
        the finish about to happen."""
        after = self.cfg.hold_after_requests
        with self.lock:
            if not self.cfg.hold_unfinished or (after and self.arrived_since_flush < after):
                return
            if not self.finished_since_flush:
                self.finished_since_flush = True
                return
        log(f"holding rid={sub.rid} before its last step until it is aborted")
        while not self._abort_due(plan, sub):
            if gone is not None and gone():
                raise ConnectionAbortedError("the client closed the stream")
            if self.stop.wait(HOLD_POLL_S):
                raise ServerStoppingError

    def _apply(self, sub: SubRequest, j: int) -> None:
        """Emit step ``j`` of ``sub``: tokens, draft statistics, global counters."""
        now = time.monotonic()
        k = sub.steps[j]
        start = len(sub.output_ids)
        sub.output_ids.extend(sub.token_ids[start : start + k])
        if j == 0:
            sub.first_token_mono = now
        if j == len(sub.steps) - 1:
            sub.finished_mono, sub.finished_wall = now, time.time()
        with self.lock:
            if j == 0:
                sub.first_iteration = self.decode_iterations
            if j > 0:  # the first step is the prefill's token
                self.decode_tokens_total += k
            if j == len(sub.steps) - 1:
                self.generation_tokens_total += len(sub.output_ids)
            self.gen_window.append((now, k))
            while self.gen_window and self.gen_window[0][0] < now - 1.0:
                self.gen_window.popleft()
            self.last_gen_throughput = float(sum(n for _, n in self.gen_window))
            if self.spec is not None and j > 0:
                sub.verify_ct += 1
                sub.correct_drafts += k - 1
                sub.histogram[min(k - 1, len(sub.histogram) - 1)] += 1
                self.verify_calls_total += 1
                iteration = sub.first_iteration + j
                self.decode_iterations = max(self.decode_iterations, iteration)
                counts = self.spec_by_iteration.setdefault(iteration, [0, 0])
                counts[0] += k
                counts[1] += 1
                self.recent_steps.append(k)
        if j == len(sub.steps) - 1:
            self.log_spec(sub, "finished")

    def chunk_due(self, sub: SubRequest, j: int) -> bool:
        """Whether step ``j`` gets a streamed chunk (first, last, every stream_interval)."""
        return j == 0 or sub.done or j % sub.interval == 0

    # -- output

    def body(self, plan: Plan, sub: SubRequest, *, streamed: bool) -> dict[str, Any]:
        """One result object (a stream chunk or a final answer) for ``sub`` as of now."""
        ids = sub.output_ids
        if streamed and self.incremental:
            ids = sub.output_ids[sub.sent_ids :]
            sub.sent_ids = len(sub.output_ids)
        out: dict[str, Any] = {
            "text": "".join(token_text(t) for t in ids),
            "output_ids": list(ids),
            "meta_info": self.meta_info(plan, sub),
        }
        if streamed and plan.is_list:
            out["index"] = sub.index
        return out

    def meta_info(self, plan: Plan, sub: SubRequest) -> dict[str, Any]:
        """meta_info with the names of the emulated version (protocol file, "Responses")."""
        meta: dict[str, Any] = {
            "id": sub.rid,
            "finish_reason": sub.finish if sub.done else None,
            "prompt_tokens": len(sub.prompt_ids),
            "completion_tokens": len(sub.output_ids),
            "cached_tokens": sub.cached_tokens,
            "weight_version": self.weight_version,
            RETRACTION_KEY[self.version]: 0,
        }
        timed = self.enable_metrics and self.version == "0.5.23"
        if timed:
            meta["request_received_ts"] = plan.received_wall
            meta["queue_time"] = 0.0
            if sub.first_token_mono is not None:
                meta["first_token_latency"] = sub.first_token_mono - plan.t0
        if not sub.done:
            return meta
        assert sub.finished_mono is not None
        meta["e2e_latency"] = sub.finished_mono - plan.t0
        if timed and sub.first_token_mono is not None:
            meta["request_finished_ts"] = sub.finished_wall
            decode_s = sub.finished_mono - sub.first_token_mono
            decoded = len(sub.output_ids) - 1
            meta["decode_throughput"] = decoded / decode_s if decoded > 0 and decode_s > 0 else 0.0
        if self.spec is not None:
            meta.update(self._spec_meta(sub))
        meta.update(self.patches.get("final_meta") or {})
        if isinstance(sub.finish, dict) and sub.finish.get("type") == "abort":
            meta.update(self.patches.get("abort_meta") or {})
        return meta

    def _spec_meta(self, sub: SubRequest) -> dict[str, Any]:
        """Final-chunk speculative statistics of one request: none at all for a request that
        never reached a verify pass (one that ended at its prefill token, or aborted before
        its first decode step), as SGLang's TokenizerManager._calculate_spec_decoding_metrics
        adds every key, spec_verify_ct included, only when spec_verify_ct > 0 and the drafts
        proposed are > 0 (0.5.23 tokenizer_manager.py)."""
        assert self.spec is not None
        correct_key, proposed_key, histogram_key = SPEC_DRAFT_KEYS[self.version]
        proposed = sub.verify_ct * (self.spec.num_draft_tokens - 1)
        if sub.verify_ct <= 0 or proposed <= 0:
            return {}
        return {
            "spec_verify_ct": sub.verify_ct,
            "spec_accept_length": len(sub.output_ids) / sub.verify_ct,
            "spec_accept_rate": sub.correct_drafts / proposed,
            correct_key: sub.correct_drafts,
            proposed_key: proposed,
            histogram_key: list(sub.histogram),
        }

    def server_info(self) -> dict[str, Any]:
        """/server_info: resolved args, version, internal_states."""
        with self.lock:
            state: dict[str, Any] = {"last_gen_throughput": self.last_gen_throughput}
            # One state per DP scheduler (tokenizer_control_mixin.py fans the request out to
            # each): dp_size replicas of attn_dp_size attention DP ranks.
            attn = max(1, int(self.args.get("attn_dp_size") or 1))
            ranks = max(1, int(self.args.get("dp_size") or 1)) * attn
            if self.version != "0.5.9":  # scheduler_components/internal_state.py
                cap = self.cfg.running_cap
                running = self.args.get("max_running_requests")
                # Each scheduler's: the arg split over the attention DP ranks alone
                # (kv_cache_configurator.py `resolve_max_num_reqs`), whole in each replica,
                # lowered (never raised) to what the rank's KV pool holds; with no arg, the
                # pool's estimate (2048 at least), not split.
                share = 2048 if running is None else max(1, int(running) // attn)
                state["effective_max_running_requests_per_dp"] = (
                    share if cap is None else min(share, cap)
                )
            if self.spec is not None:
                average = self.block_accept_length()
                if average is not None:
                    state["avg_spec_accept_length"] = average
        return {
            **self.args,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len,
            "version": self.version,
            "internal_states": [dict(state) for _ in range(ranks)],
        }

    def block_accept_length(self) -> float | None:
        """Tokens per request decode step over the whole blocks of decode iterations since
        the last flush (None before the first block ends); call with the lock held."""
        covered = self.decode_iterations - self.decode_iterations % self.decode_log_interval
        tokens = steps = 0
        for iteration, (k, n) in self.spec_by_iteration.items():
            if iteration <= covered:
                tokens, steps = tokens + k, steps + n
        return tokens / steps if steps else None

    def metrics(self) -> str:
        """/metrics: a few Prometheus series with SGLang's names."""
        label = self.model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        with self.lock:
            series: list[tuple[str, str, str, float]] = [
                ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                 self.prompt_tokens_total),
                ("sglang:generation_tokens_total", "counter", "Number of generated tokens.",
                 self.generation_tokens_total),
                ("sglang:num_requests_total", "counter", "Number of requests processed.",
                 self.requests_total),
                ("sglang:num_running_reqs", "gauge", "The number of running requests.",
                 self.running_subs),
                ("sglang:realtime_tokens_total", "counter",
                 "Total number of tokens processed. mode: prefill_compute, prefill_cache, decode.",
                 self.decode_tokens_total),
                ("sglang:gen_throughput", "gauge", "The generation throughput (token/s).",
                 self.last_gen_throughput),
            ]  # fmt: skip
            if self.spec is not None:
                series.append(
                    (
                        "sglang:spec_verify_calls_total",
                        "counter",
                        "Number of speculative verify passes.",
                        self.verify_calls_total,
                    )
                )
            # exported whatever the algorithm: 0 without one (SGLang's scheduler stats)
            recent = list(self.recent_steps) if self.spec is not None else []
            series.append(("sglang:spec_accept_length", "gauge",
                           "Average accept length over the last decode steps.",
                           sum(recent) / len(recent) if recent else 0.0))  # fmt: skip
        lines = []
        for name, kind, help_text, value in series:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            labels = f'model_name="{label}"'
            if name == "sglang:realtime_tokens_total":
                labels += ',mode="decode"'
            lines.append(f"{name}{{{labels}}} {float(value)}")
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- HTTP


class StubHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer carrying the Stub; one thread per connection."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, stub: Stub) -> None:
        self.address_family = family
        self.stub = stub
        super().__init__(address, StubHandler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets its connection (an idle keep-alive one, an aborted stream) is
        one log line; anything else keeps its traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
            log(f"{client_address[0]} closed the connection ({type(error).__name__})")
            return
        super().handle_error(request, client_address)


class StubHandler(BaseHTTPRequestHandler):
    """SGLang's HTTP routes over HTTP/1.1 (keep-alive; chunked streaming)."""

    protocol_version = "HTTP/1.1"
    server_version = "sglang-stub"
    disable_nagle_algorithm = True
    timeout = 300
    server: StubHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        """Route http.server's per-request line to the stub log."""
        log(f"{self.client_address[0]} {format % args}")

    @property
    def stub(self) -> Stub:
        """The shared state of this server."""
        return self.server.stub

    # -- plumbing

    def _read_body(self) -> bytes:
        """Read the whole request body (Content-Length or chunked) to keep the connection sane."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise RequestError("request body too large")
        return self.rfile.read(length) if length > 0 else b""

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _text(
        self, status: int, text: str, content_type: str = "text/plain; charset=utf-8"
    ) -> None:
        self._send(status, text.encode(), content_type)

    def _chunk(self, data: bytes) -> None:
        """One HTTP/1.1 chunk, flushed at once (empty data ends the body)."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    # -- routing

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        """GET routes."""
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        """POST routes."""
        self._dispatch("POST")

    #: Routes that take the admin key where the server has one (else the API key): SGLang
    #: marks both ADMIN_OPTIONAL (0.5.9 and 0.5.23 http_server.py), which refuses the API key
    #: once an admin key is set.
    ADMIN_ROUTES = ("/flush_cache", "/abort_request")

    def _unauthorized(self, path: str) -> int | None:
        """SGLang's key check: with --api-key, every route but /health* and /metrics needs
        ``Authorization: Bearer KEY``; with --admin-api-key the admin routes need that key
        instead. The status to refuse with, or None."""
        if path.startswith(("/health", "/metrics")):
            return None
        key = self.stub.args.get("api_key")
        if path in self.ADMIN_ROUTES and self.stub.args.get("admin_api_key"):
            key = self.stub.args["admin_api_key"]
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            return 401
        return None

    def _dispatch(self, method: str) -> None:
        if self.stub.hung.is_set() and not self._health_answers_alone(method):
            self.stub.stop.wait()  # a wedged server: nothing is answered until it is stopped
            self.close_connection = True  # its body unread: not a next request
            return
        try:
            body = self._read_body()
        except (ValueError, RequestError) as exc:
            self.close_connection = True
            self._json(400, {"error": {"message": f"bad request body: {exc}"}})
            return
        path = self.path.split("?", 1)[0]
        routes = {
            "/health": ({"GET"}, self._health),
            "/health_generate": ({"GET"}, self._health_generate),
            "/server_info": ({"GET"}, self._server_info),
            # its deprecated name, served by 0.5.9 and 0.5.23 alike (http_server.py)
            "/get_server_info": ({"GET"}, self._server_info),
            "/flush_cache": ({"GET", "POST"}, self._flush_cache),
            "/metrics": ({"GET"}, self._metrics),
            "/generate": ({"POST"}, lambda: self._generate(body)),
            "/abort_request": ({"POST"}, lambda: self._abort_request(body)),
        }
        if self.stub.cfg.patch_route:
            routes["/_stub/patch"] = ({"POST"}, lambda: self._patch(body))
        if path == "/metrics" and not self.stub.enable_metrics:
            routes.pop("/metrics")
        if not self.stub.cfg.abort_route:
            routes.pop("/abort_request")
        route = routes.get(path)
        refusal = self._unauthorized(path)
        raw = self.stub.patches.get("raw", {}).get(path) if self.stub.cfg.patch_route else None
        if raw is not None and raw.get("cut"):
            self.send_response(int(raw.get("status", 200)))
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            data = str(raw.get("body", "")).encode("latin-1")
            self.wfile.write(b"%x\r\n%s" % (len(data) + 64, data))  # 64 bytes short
            self.wfile.flush()
            self.close_connection = True
        elif raw is not None:
            body = str(raw.get("body", "")).encode("latin-1")
            self._send(int(raw.get("status", 200)), body, "text/html; charset=utf-8")
        elif refusal is not None:
            self._json(refusal, {"error": "Unauthorized"})
        elif route is None:
            self._json(404, {"detail": "Not Found"})
        elif method not in route[0]:
            self._json(405, {"detail": "Method Not Allowed"})
        else:
            try:
                route[1]()
            except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
                log(f"client went away during {method} {path}")
                self.close_connection = True

    def _health_answers_alone(self, method: str) -> bool:
        """Whether this is a GET /health that SGLang's HTTP server answers without its
        scheduler (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION false): a wedged scheduler
        does not keep it from answering 200."""
        path = self.path.split("?", 1)[0]
        return method == "GET" and path == "/health" and not self.stub.health_generates

    # -- endpoints

    def _health(self) -> None:
        ready = self.stub.is_ready()
        if ready and self.stub.generate_count and self.stub.health_generates:
            time.sleep(self.stub.cfg.busy_health_s)
        self._send(200 if ready else 503, b"", "text/plain; charset=utf-8")

    def _health_generate(self) -> None:
        if not self.stub.is_ready():
            self._send(503, b"", "text/plain; charset=utf-8")
            return
        time.sleep(
            self.stub.cfg.ttft_s + self.stub.cfg.busy_health_s * bool(self.stub.generate_count)
        )
        self._send(200, b"", "text/plain; charset=utf-8")

    def _server_info(self) -> None:
        self._json(200, {**self.stub.server_info(), **self.stub.patches.get("server_info", {})})

    def _patch(self, raw: bytes) -> None:
        patches = json.loads(raw)
        if not isinstance(patches, dict):
            self._json(400, {"error": {"message": "a patch is a JSON object"}})
            return
        self.stub.patches = patches
        self._json(200, {})

    def _flush_cache(self) -> None:
        reason = self.stub.flush_refusal()
        if reason is not None:
            self._text(400, f"Cache not flushed: {reason}. Retry when no request is running.\n")
            return
        self.stub.flush()
        log("cache flushed")
        self._text(200, "Cache flushed.\n")

    def _abort_request(self, raw: bytes) -> None:
        """SGLang's AbortReq body: {"rid": str} or {"abort_all": true}; 200 either way."""
        try:
            req = json.loads(raw or b"null")
        except ValueError as exc:
            self._json(400, {"error": {"message": f"invalid JSON body: {exc}"}})
            return
        if not isinstance(req, dict):
            self._json(400, {"error": {"message": "the body must be a JSON object"}})
            return
        rid = req.get("rid")
        abort_all = bool(req.get("abort_all"))
        log(f"abort_request rid={rid} abort_all={abort_all}")
        if not self.stub.cfg.abort_ignored:
            self.stub.request_abort(None if rid is None else str(rid), abort_all)
        self._send(200, b"", "text/plain; charset=utf-8")

    def _metrics(self) -> None:
        self._text(200, self.stub.metrics(), "text/plain; version=0.0.4; charset=utf-8")

    def _generate(self, raw: bytes) -> None:
        stub = self.stub
        if not stub.is_ready():
            self._json(503, {"error": {"message": "The server is not ready yet."}})
            return
        try:
            req = json.loads(raw or b"null")
        except ValueError as exc:
            self._json(400, {"error": {"message": f"invalid JSON body: {exc}"}})
            return
        if not isinstance(req, dict):
            self._json(400, {"error": {"message": "the body must be a JSON object"}})
            return
        number = stub.count_generate()
        stub.other_tenant(number)
        stub.maybe_die(number)
        stub.maybe_hang(number)
        if stub.hung.is_set():
            stub.stop.wait()
            self.close_connection = True
            return
        if stub.should_fail(number):
            log(f"generate #{number}: injected failure {stub.cfg.fail_status}")
            message = f"sglang_stub: injected failure on /generate request {number}"
            self._json(stub.cfg.fail_status, {"error": {"message": message}})
            return
        try:
            plan = stub.plan(req, number)
        except RequestError as exc:
            if exc.in_band and req.get("stream"):
                self._stream_error(str(exc))
            else:
                self._json(400, {"error": {"message": str(exc)}})
            return
        stub.begin(plan)
        try:
            if plan.stream:
                self._stream(plan)
            else:
                self._blocking(plan)
        except ServerStoppingError:
            # A client that went away before the stop is logged as one that went away, where
            # the stop found its request waiting for its next step rather than writing it.
            if self._client_gone():
                log("client went away during POST /generate")
            self.close_connection = True
        finally:
            stub.end(plan)
            for sub in plan.subs:
                if not sub.done:  # its client went away, or the server stopped
                    with stub.lock:  # SGLang aborts it, and counts what it made as it ends
                        stub.generation_tokens_total += len(sub.output_ids)
                    stub.log_spec(sub, "cut")
        if all(sub.done for sub in plan.subs):
            tokens = sum(len(sub.output_ids) for sub in plan.subs)
            elapsed = time.monotonic() - plan.t0
            log(f"generate #{plan.number}: {len(plan.subs)} seq, {tokens} tokens, "
                f"stream={plan.stream}, {elapsed:.3f}s")  # fmt: skip

    def _stream_headers(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _stream_error(self, message: str) -> None:
        """SGLang reports a request error inside a stream as a data line, then [DONE]."""
        self._stream_headers()
        self._chunk(b"data: " + json.dumps({"error": {"message": message}}).encode() + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _stream(self, plan: Plan) -> None:
        stub, cfg = self.stub, self.stub.cfg
        self._stream_headers()
        sent = 0
        held: list[bytes] = []  # burst_request: the chunks held back until the last step
        for sub, j in stub.run(plan, self._client_gone):
            if self._client_gone():  # uvicorn sees the disconnect; SGLang aborts the request
                raise ConnectionAbortedError("the client closed the stream")
            if not stub.chunk_due(sub, j):
                continue
            if cfg.stall_after_chunks is not None and sent >= cfg.stall_after_chunks:
                self._stall(plan, sent)
                return
            if cfg.malformed_chunk_at == sent:
                line = (
                    b'data: {"text": "'
                    + token_text(sub.output_ids[-1] if sub.output_ids else 0).encode()
                )
                self._chunk(line + b"\n\n")
            else:
                body = json.dumps(stub.body(plan, sub, streamed=True)).encode()
                if plan.number == cfg.burst_request:
                    held.append(b"data: " + body + b"\n\n")
                else:
                    self._chunk(b"data: " + body + b"\n\n")
            sent += 1
        if held:
            log(f"generate #{plan.number}: {len(held)} chunk(s) written in one burst")
            self.wfile.write(b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in held))
            self.wfile.flush()
        if cfg.stall_after_chunks is not None and sent >= cfg.stall_after_chunks:
            self._stall(plan, sent)
            return
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _client_gone(self) -> bool:
        """Whether the client closed its end of the connection (readable, and at EOF)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _stall(self, plan: Plan, sent: int) -> None:
        """stall_after_chunks: go quiet for stall_s, then drop the connection unfinished."""
        log(f"generate #{plan.number}: stalling after {sent} chunk(s) for {self.stub.cfg.stall_s}s")
        self.stub.stop.wait(self.stub.cfg.stall_s)
        self.close_connection = True

    def _blocking(self, plan: Plan) -> None:
        for _ in self.stub.run(plan, self._client_gone):
            pass
        results = [self.stub.body(plan, sub, streamed=False) for sub in plan.subs]
        self._json(200, results if plan.is_list else results[0])


# --------------------------------------------------------------------------- GPU processes


def fake_nvml(environ: Mapping[str, str]) -> Any:
    """The fake pynvml module, loaded by path, when DVFS_FAKE_NVML_STATE is set; else None."""
    if not environ.get("DVFS_FAKE_NVML_STATE"):
        return None
    import importlib.util

    path = Path(__file__).resolve().parent / "nvml" / "pynvml.py"
    spec = importlib.util.spec_from_file_location("fake_pynvml_for_stub", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: The --mem-fraction-static `claim_bytes` takes where none is known (a neighbour's server,
#: started elsewhere: about SGLang's default on an 80 GiB GPU). The stub's own server claims
#: the fraction it resolved (``_resolve_memory``), as /server_info reports it.
STUB_MEM_FRACTION = 0.85
#: Where ``--max-total-tokens`` caps the KV pool, SGLang takes only the weights and that pool
#: (not its whole claim): an 8B bf16 model's 16 GiB, 128 KiB per token (32 layers x 8 KV heads
#: x 128 x K and V x 2 bytes).
STUB_WEIGHTS_BYTES = 16 * 2**30
STUB_KV_BYTES_PER_TOKEN = 128 * 2**10


def claim_bytes(
    nvml: Any, device: Any, fraction: float | None, max_total_tokens: int | None = None
) -> int:
    """What SGLang takes of a fake device as it starts: it fills the GPU up to
    ``fraction`` (None: `STUB_MEM_FRACTION`) of its memory, less what is used there already
    (another tenant's, the driver's), a CUDA context's at least; where ``max_total_tokens``
    caps the KV pool, no more than the weights and that pool."""
    for dev in nvml.fake_state()["devices"]:
        if device in (dev["index"], dev["uuid"]):
            total = int(nvml.FAKE_PROFILES[dev["profile"]]["memory_total_bytes"])
            used = int(dev["memory_used_bytes"]) + sum(
                int(e.get("used_bytes") or 0) for e in dev.get("processes") or ()
            )
            share = STUB_MEM_FRACTION if fraction is None else fraction
            claim = int(share * total) - used
            if max_total_tokens is not None:
                claim = min(claim, STUB_WEIGHTS_BYTES + max_total_tokens * STUB_KV_BYTES_PER_TOKEN)
            return max(claim, 512 * 2**20)
    return 512 * 2**20


def register_gpu_process(
    nvml: Any,
    cfg: StubConfig,
    environ: Mapping[str, str],
    fraction: float | None = None,
    max_total_tokens: int | None = None,
) -> list[Any]:
    """List this process on the fake devices it runs on: those its CUDA_VISIBLE_DEVICES names
    by UUID, or ``nvml_device``, with the memory it claims there (`claim_bytes`), and
    ``neighbour_pid`` on ``neighbour_device``; returns this process's devices."""
    if cfg.neighbour_device is not None and cfg.neighbour_pid is not None:
        claim = claim_bytes(nvml, cfg.neighbour_device, None)
        nvml.fake_add_process(cfg.neighbour_device, cfg.neighbour_pid, used_bytes=claim)
        log(f"neighbour pid {cfg.neighbour_pid} on fake GPU {cfg.neighbour_device}")
    if cfg.nvml_device is not None:
        devices: list[Any] = [cfg.nvml_device]
    else:
        uuids = {d["uuid"] for d in nvml.fake_state()["devices"]}
        visible = environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        devices = [v.strip() for v in visible if v.strip() in uuids]
    pid = os.getpid() if cfg.nvml_pid is None else cfg.nvml_pid
    for device in devices:
        claim = claim_bytes(nvml, device, fraction, max_total_tokens)
        nvml.fake_add_process(device, pid, used_bytes=claim)
    log(f"listed pid {pid} as a compute process on fake GPU(s) {devices}")
    return devices


class TorchLoad:
    """A real load for a real GPU: while any request runs, one thread streams a weight matrix
    through matrix-vector products on ``torch_load_device``, as decoding a small batch would
    (memory-bound), and idles otherwise. Its tensors are made before the stub listens, so a
    CUDA device lists the stub as a compute process from the start, as a server that loaded
    its weights would: with it dvfs meters, and checks the pinning of, a server on a real GPU
    without SGLang or a model (tests/bench/real_gpu_check.sh)."""

    def __init__(self, stub: Stub, device: str, mib: float) -> None:
        import torch

        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        cols = 4096
        rows = max(1, int(mib * 2**20 / (cols * (4 if device == "cpu" else 2))))
        self.torch, self.stub = torch, stub
        self.weight = torch.randn(rows, cols, device=device, dtype=dtype)
        self.vector = torch.randn(cols, 1, device=device, dtype=dtype)
        self.on_cuda = device.startswith("cuda")
        self.launches = 0
        self._sync()
        log(f"torch load: {rows}x{cols} {dtype} on {device}")
        threading.Thread(target=self._run, daemon=True).start()

    def _sync(self) -> None:
        if self.on_cuda:
            self.torch.cuda.synchronize()

    def _run(self) -> None:
        while not self.stub.stop.is_set():
            if self.stub.running_subs <= 0:
                time.sleep(0.001)
                continue
            for _ in range(8):
                self.weight @ self.vector
            self.launches += 8
            self._sync()


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Parse like launch_server, serve on loopback until signalled or max_lifetime_s."""
    started = time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = load_config(os.environ)
        args, spec = parse_launch_argv(argv, cfg, os.environ)
    except StubConfigError as exc:
        print(f"sglang_stub: {exc}", file=sys.stderr)
        return 3
    except LaunchError as exc:
        print(
            f"Traceback (most recent call last):\n  (sglang_stub)\n{exc.kind}: {exc}",
            file=sys.stderr,
        )
        return 1
    log(
        f"env CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')} "
        f"CUDA_DEVICE_ORDER={os.environ.get('CUDA_DEVICE_ORDER', '<unset>')}"
    )
    host = str(args.get("host") or "127.0.0.1")
    if host not in LOOPBACK_HOSTS:
        print(
            f"ValueError: sglang_stub only listens on loopback; refusing --host {host}",
            file=sys.stderr,
        )
        return 1
    bind_host = "127.0.0.1" if host == "localhost" else host
    asked = int(args.get("context_length") or 0)
    longer = os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "").lower()
    if asked > cfg.context_len and longer not in ("true", "1", "yes", "y"):
        print(
            "Traceback (most recent call last):\n  (sglang_stub)\nValueError: "
            f"User-specified context_length ({asked}) is greater than the derived "
            f"context_length ({cfg.context_len}). This may lead to incorrect model outputs or "
            "CUDA errors. Note that the derived context_length may differ from "
            "max_position_embeddings in the model's config. To allow overriding this maximum, "
            "set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1",
            file=sys.stderr,
        )
        return 1
    if cfg.listen_delay_s:
        time.sleep(cfg.listen_delay_s)
    draft = bool(args.get("speculative_draft_model_path"))
    if cfg.start_failure == "scheduler_killed":
        return scheduler_killed(cfg, started)
    if cfg.start_failure is not None:
        steps = START_FAILURES[cfg.start_failure]
        fail_start(steps[cfg.version] if isinstance(steps, dict) else steps, draft)
    pool = int(args.get("max_total_tokens") or KV_TOKENS)
    if min(int(args.get("context_length") or cfg.context_len), pool) - 1 - 5 <= 0:
        fail_start(POOL_TOO_SMALL, draft)
    nvml = fake_nvml(os.environ)
    stub = Stub(cfg, args, spec)
    load = None
    if cfg.torch_load_device is not None:
        load = TorchLoad(stub, cfg.torch_load_device, cfg.torch_load_mib)
    if nvml is not None:
        fraction = args.get("mem_fraction_static")
        fraction = float(fraction) if isinstance(fraction, int | float) else None
        cap = args.get("max_total_tokens")
        cap = int(cap) if isinstance(cap, int) else None
        devices = register_gpu_process(nvml, cfg, os.environ, fraction, cap)
        stub.nvml, stub.devices = nvml, devices
        stub.other_tenant(0)
    try:
        server = StubHTTPServer((bind_host, int(args["port"])), LOOPBACK_HOSTS[host], stub)
    except OSError as exc:
        print(f"OSError: cannot listen on {host}:{args['port']}: {exc}", file=sys.stderr)
        return 1
    port = server.server_address[1]
    stub.ready_at = time.monotonic() + cfg.startup_s

    def on_signal(signum: int, _frame: Any) -> None:
        log(f"received {signal.Signals(signum).name}, shutting down")
        stub.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log(f"emulating SGLang {cfg.version}; model_path={args['model_path']} "
        f"speculative_algorithm={args.get('speculative_algorithm')}")  # fmt: skip
    log(f"Uvicorn running on http://{host}:{port} (Press CTRL+C to quit)")
    # (the loop sees a shutdown at its next look: SIGTERM's stop waits that out, every server stop)
    serving = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
    )
    serving.start()

    def announce() -> None:
        if not stub.stop.wait(cfg.startup_s):
            log("The server is fired up and ready to roll!")

    threading.Thread(target=announce, daemon=True).start()
    lifetime_left = cfg.max_lifetime_s - (time.monotonic() - started)
    if not stub.stop.wait(max(lifetime_left, 0.0)):
        log(f"max_lifetime_s={cfg.max_lifetime_s} reached, shutting down")
        stub.stop.set()
    server.shutdown()
    server.server_close()
    if load is not None:
        log(f"torch load: {load.launches} matrix-vector products while requests ran")
    if nvml is not None:
        nvml.fake_remove_process(os.getpid() if cfg.nvml_pid is None else cfg.nvml_pid)
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: in-flight handler threads must not delay or disturb the exit.
    os._exit(exit_code)
