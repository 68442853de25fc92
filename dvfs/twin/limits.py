"""What a real SGLang server refuses, refused by the twin too: weights that leave its GPUs no
memory (the server does not start) and requests longer than the model's context (a 400).

Read from SGLang 0.5.23 (`srt/arg_groups/memory_hook.py` `handle_gpu_memory_settings`: the
default `--mem-fraction-static`; `srt/mem_cache/kv_cache_configurator.py`: the start refused
when the loaded weights leave the KV cache nothing under that fraction, target and draft weights
both counted; `srt/managers/tokenizer_manager.py` `_validate_one_request`: the request refused
against the context length from the model's config, `srt/utils/hf_transformers/common.py`
`get_context_length`, or the `--context-length` given, `srt/configs/model_config.py`
`_derive_context_length`, which refuses one above the model's unless
SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set). Pure functions: the twin engine, the sweep's
checks, its dry run and `dvfs doctor` ask the same ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dvfs.twin.profiles import GpuProfile, ModelProfile

if TYPE_CHECKING:
    from dvfs.twin.drafting import DraftPlan

MIB = 1 << 20
GIB = 1 << 30
#: The drafters whose heads take the target's embeddings (and, DFLASH, its LM head) rather than
#: loading their own (`dvfs.twin.drafting`): their embedding table is the target's, not counted.
SHARED_EMBEDDING_ROLES = ("eagle-head", "block")
#: SGLang's algorithms that reserve output slots for draft tokens in every request's context
#: budget (0.5.23 `managers/utils.py` `compute_num_reserved_tokens`: `is_eagle()`).
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")


def default_mem_fraction_static(
    gpu: GpuProfile, tp_size: int, decode_graph_max_bs: int | None = None
) -> float:
    """SGLang 0.5.23's default `--mem-fraction-static` on `gpu`: (GPU memory - reserved) / GPU
    memory, the reserve (MiB) being 512 of metadata, 1.5 per token of the chunked prefill
    (8192 tokens on a 60-160 GiB GPU), 128 per tensor-parallel rank, 2 per decode CUDA-graph
    batch size (`decode_graph_max_bs`, which dvfs sets to the largest batch; None: SGLang's
    own, 256 below tp 4, else 512) and 8 per prefill CUDA-graph token bucket, with a 10 GiB
    floor on a GPU above 60 GiB. (Dense attention, no DP attention, DeepEP or multimodal input,
    post-capture sizing off: its default.)"""
    gpu_mib = gpu.memory_mib()
    if gpu_mib < 20 * 1024:
        chunked, max_bs = 2048, 8
    elif gpu_mib < 35 * 1024:
        chunked, max_bs = 4096, 48 if tp_size < 4 else 160
    elif gpu_mib < 60 * 1024:
        chunked, max_bs = 4096, 32 if tp_size < 4 else 160
    elif gpu_mib < 160 * 1024:
        chunked, max_bs = 8192, 256 if tp_size < 4 else 512
    else:
        chunked, max_bs = 16384, 512
    if decode_graph_max_bs is not None:
        max_bs = decode_graph_max_bs
    reserved = 512 + max(chunked, 2048) * 1.5 + tp_size / 8 * 1024
    reserved += max_bs * 2 + len(_prefill_graph_tokens(chunked)) * 8
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3)


def _prefill_graph_tokens(max_tokens: int) -> list[int]:
    """The token buckets SGLang captures prefill CUDA graphs for, up to the chunked prefill."""
    sizes = [
        *range(4, 33, 4),
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
        *range(4608, max_tokens + 1, 512),
    ]
    return [s for s in sizes if s <= max_tokens]


def weight_bytes(model: ModelProfile, *, draft: bool = False) -> float:
    """The bytes of `model`'s weights a server loads; a draft head's or block drafter's without
    the embedding table it takes from its target."""
    params = model.total_params
    if draft and model.role in SHARED_EMBEDDING_ROLES:
        params -= model.embedding_params
    return float(params * model.bytes_per_param)


def weights_refusal(
    target: ModelProfile,
    draft: ModelProfile | None,
    gpu: GpuProfile,
    tp_size: int,
    decode_graph_max_bs: int | None = None,
    mem_fraction_static: float | None = None,
) -> str | None:
    """Why SGLang would not start serving `target` (with `draft`) on `tp_size` GPUs of `gpu`:
    the weights each GPU holds (all of them divided over the ranks) leave nothing of the static
    memory (GPU memory x `mem_fraction_static`, None: SGLang's default) for the KV cache.
    None: they fit."""
    need = (weight_bytes(target) + (weight_bytes(draft, draft=True) if draft else 0.0)) / tp_size
    default = default_mem_fraction_static(gpu, tp_size, decode_graph_max_bs)
    given = mem_fraction_static is not None
    fraction = mem_fraction_static if mem_fraction_static is not None else default
    have = gpu.memory_mib() * MIB * fraction
    if need < have:
        return None
    name = target.hf_name or target.key
    with_draft = f" with draft model {draft.hf_name or draft.key}" if draft else ""
    whose = "the campaign's --mem-fraction-static" if given else "SGLang's default one"
    todo = f"use {MORE_GPUS} or a smaller model"
    batch = (
        None
        if given or decode_graph_max_bs is None
        else _largest_graph_batch(need, gpu, tp_size, decode_graph_max_bs)
    )
    if batch is not None:  # the decode CUDA graphs' reserve, the batch's, left it too little
        todo = (
            f"lower the largest batch (workload.batch) to at most {batch}: SGLang's default "
            f"fraction reserves 2 MiB for each decode CUDA-graph batch size up to it, "
            f"{decode_graph_max_bs} here; or {todo}"
        )
    if given:  # a fraction the campaign set too low: raising it is the first way out
        least = (math.floor(need / (gpu.memory_mib() * MIB) * 100) + 1) / 100
        if least <= default:
            todo = (
                f"raise --mem-fraction-static to at least {least:.2f} (SGLang's default here "
                f"is {default:g}), or {todo}"
            )
    room = f"{have / GIB:.1f} GiB" if have > 0 else "nothing"  # (a fraction below 0)
    return (
        f"{name}{with_draft} does not fit: its weights need {need / GIB:.1f} GiB per GPU "
        f"(tp {tp_size}) but {gpu.nvml_name} has {room} for weights and KV cache "
        f"(static memory fraction {fraction:g}, {whose}), too little for SGLang to start: {todo}"
    )


def _largest_graph_batch(need: float, gpu: GpuProfile, tp_size: int, most: int) -> int | None:
    """The largest decode CUDA-graph batch size below `most` whose reserve leaves SGLang's
    default static memory room for `need` bytes of weights a GPU; None: none does (the weights
    do not fit at batch 1), or `most` does."""

    def fits(batch: int) -> bool:
        fraction = default_mem_fraction_static(gpu, tp_size, batch)
        return need < gpu.memory_mib() * MIB * fraction

    if fits(most) or not fits(1):
        return None
    low, high = 1, most  # fits(low), not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def kv_pool_tokens(
    target: ModelProfile,
    draft: ModelProfile | None,
    gpu: GpuProfile,
    tp_size: int,
    decode_graph_max_bs: int | None = None,
    mem_fraction_static: float | None = None,
    max_total_tokens: int | None = None,
) -> int:
    """About how many tokens SGLang's KV pool holds serving `target` (with `draft`) on
    `tp_size` GPUs of `gpu`: the static memory (`weights_refusal`'s) the weights leave, over
    the target's KV bytes a token, each GPU holding its share of both; at most
    `max_total_tokens` (--max-total-tokens) where given. The draft model's own KV is not
    counted: the pool is at most this. 0: the weights leave nothing."""
    fraction = (
        mem_fraction_static
        if mem_fraction_static is not None
        else default_mem_fraction_static(gpu, tp_size, decode_graph_max_bs)
    )
    weights = weight_bytes(target) + (weight_bytes(draft, draft=True) if draft else 0.0)
    left = gpu.memory_mib() * MIB * fraction - weights / tp_size
    per_token = target.kv_bytes_per_token / tp_size
    tokens = max(0, math.floor(left / per_token)) if per_token > 0 else 0
    return min(tokens, max_total_tokens) if max_total_tokens else tokens


#: The shortest abbreviations argparse reads as these flags in both SGLang 0.5.9 and 0.5.23 (the
#: shortest prefix no other flag of either release's option table starts with; 0.5.23's
#: --context-length-... flags make "--context" ambiguous there).
MEM_FRACTION_PREFIX = "--mem"
CONTEXT_LENGTH_PREFIX = "--context-l"
MAX_TOTAL_TOKENS_PREFIX = "--max-t"
#: More GPUs per server, as a campaign asks for them: gpu.devices (each group of it), which
#: engine.tp_size must match where the campaign gives it (it defaults to that size).
MORE_GPUS = "more GPUs per server (gpu.devices, and engine.tp_size where given)"
#: The SGLang environment variable that lets `--context-length` exceed the model's own.
LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


def _given(args: Sequence[str], flag: str, shortest: str) -> str | None:
    """The value `args` give `flag` as argparse reads it: the last `--flag VALUE` or
    `--flag=VALUE`, an abbreviation no shorter than `shortest` included; None: none given."""
    value = None
    for i, token in enumerate(args):
        name, eq, rest = token.partition("=")
        if len(name) < len(shortest) or not flag.startswith(name):
            continue
        value = rest if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def mem_fraction_static(args: Sequence[str]) -> float | None:
    """The `--mem-fraction-static` SGLang server args set (as argparse reads them: the last
    one, an abbreviation included), None where they leave SGLang its default (or give no
    number, which SGLang refuses)."""
    value = _given(args, "--mem-fraction-static", MEM_FRACTION_PREFIX)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def given_context_length(args: Sequence[str]) -> int | None:
    """The `--context-length` SGLang server args set (the last one, an abbreviation
    included); None where they give none (or no number, which SGLang refuses)."""
    value = _given(args, "--context-length", CONTEXT_LENGTH_PREFIX)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def given_max_total_tokens(args: Sequence[str]) -> int | None:
    """The `--max-total-tokens` (the KV pool's cap) SGLang server args set (the last one, an
    abbreviation included); None where they give none (or no number, which SGLang refuses)."""
    value = _given(args, "--max-total-tokens", MAX_TOTAL_TOKENS_PREFIX)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _env_true(env: Sequence[tuple[str, str]], name: str) -> bool:
    return any(k == name and v.strip().lower() in ("true", "1", "yes", "y") for k, v in env)


def served_context_length(
    model: ModelProfile, args: Sequence[str], env: Sequence[tuple[str, str]] = ()
) -> int:
    """The context length a server of `model` started with `args` serves (SGLang's
    `ModelConfig`): the `--context-length` given, else the model's own; 0: unknown. One above
    the model's is only served with `LONGER_CONTEXT_ENV` set (else the start is refused:
    `context_length_refusal`)."""
    given = given_context_length(args)
    if given is None:
        return model.context_length
    if model.context_length and given > model.context_length:
        return given if _env_true(env, LONGER_CONTEXT_ENV) else model.context_length
    return given


def context_length_refusal(
    model: ModelProfile, args: Sequence[str], env: Sequence[tuple[str, str]] = ()
) -> str | None:
    """Why SGLang would not start serving `model` with `args`: a `--context-length` above the
    model's own without `LONGER_CONTEXT_ENV` in its environment. None: it starts."""
    given = given_context_length(args)
    if given is None or not model.context_length or given <= model.context_length:
        return None
    if _env_true(env, LONGER_CONTEXT_ENV):
        return None
    return (
        f"--context-length {given} is above the context length of "
        f"{model.hf_name or model.key} ({model.context_length} tokens), which SGLang refuses "
        f"to start with: give at most {model.context_length}, or set {LONGER_CONTEXT_ENV}=1 "
        "in engine.sglang.env"
    )


def reserved_tokens(plan: DraftPlan | None) -> int:
    """The output slots SGLang adds to every request's input count against the context length
    for a drafter (`plan`; None: no speculation): an EAGLE-family drafter's draft tokens,
    nothing for the others."""
    if plan is None or plan.algorithm not in EAGLE_ALGORITHMS:
        return 0
    return max(plan.topk * plan.num_steps, plan.verify_tokens)


def draft_window(plan: DraftPlan | None) -> int:
    """The tokens a verify pass of a drafter (`plan`; None: no speculation) places past a
    request's own, into the request's row of SGLang's token-to-KV map, which is context-length
    wide (`reserved_tokens` counts them for the EAGLE family, which SGLang reserves ahead): the
    most of its tree's drafts (top-k x steps) and the tokens it verifies (num_draft_tokens, a
    DFLASH block). 0: no speculation."""
    if plan is None:
        return 0
    return max(plan.topk * plan.num_steps, plan.verify_tokens)


def context_refusal(input_tokens: int, max_new_tokens: int, context_length: int) -> str | None:
    """SGLang's refusal of a request of `input_tokens` (its reserved slots included) asking for
    `max_new_tokens` against a model's `context_length` (0.5.23: the input alone must be
    shorter than the context, input and output together no longer). None: accepted, or no
    context length known (0)."""
    if not context_length:
        return None
    if input_tokens >= context_length:
        return (
            f"a prompt of {input_tokens} tokens is not shorter than the model's context length "
            f"({context_length} tokens)"
        )
    total = input_tokens + max_new_tokens
    if total > context_length:
        return (
            f"a prompt of {input_tokens} tokens and {max_new_tokens} new tokens come to {total} "
            f"tokens, more than the model's context length ({context_length} tokens)"
        )
    return None
