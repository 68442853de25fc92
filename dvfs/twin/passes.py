"""Counting the work of the twin's forward passes: FLOPs, bytes and communication per pass.

A round's prefill chunks and decode iterations (draft, verify and draft-extend passes) become
`Passes`, which `dvfs.twin.physics` times and powers at a clock.
"""

from __future__ import annotations

import math

import numpy as np

from dvfs.twin.drafting import DraftPlan
from dvfs.twin.physics import Passes
from dvfs.twin.profiles import ModelProfile

#: SGLang's chunked-prefill budget (tokens per prefill pass) on large-memory GPUs.
PREFILL_CHUNK_TOKENS = 8192

#: Kernels of a forward pass outside its layers (embedding, final norm, LM head, logits
#: processing, sampling or top-k, a drafter's tree bookkeeping), in layers' worth of kernels:
#: ~6 small kernels against the ~12 of a layer (`kernel_cycles_per_layer`) (INF). Their
#: cycles scale with the clock like the layers' do; they weigh on a one-layer draft head.
PASS_KERNEL_LAYERS = 0.5

#: A drafter's passes run inside the scheduler's decode step: SGLang replays the draft steps
#: as one CUDA graph and the draft-extend as another (`EAGLEDraftCudaGraphRunner`,
#: `EAGLEDraftExtendCudaGraphRunner`), so the step's scheduling is paid once, by the verify
#: pass, and each graph only adds its replay's launch: this share of `host_overhead_s` (INF:
#: a graph launch is tens of microseconds of host time against ~0.3 ms for a scheduler step).
#: The draft kernels' own time is GPU time, clock-scaled cycles and memory traffic.
DRAFT_LAUNCH_SHARE = 0.1


def count_passes(
    model: ModelProfile,
    tp: int,
    tokens: np.ndarray,
    kv_read_bytes: np.ndarray,
    attn_flops: np.ndarray,
    kv_write_tokens: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """FLOPs, bytes, layers, communication bytes and calls of passes over `tokens` tokens, for
    one GPU of a TP group; element-wise, so a whole (iterations x passes) block at once. (The
    passes' GEMMs have M = `tokens` on every GPU: TP splits the weights, not the tokens.)"""
    tokens = np.asarray(tokens, dtype=float)
    flops = 2.0 * model.active_matmul_params * tokens + attn_flops
    weights = model.weight_bytes_read(tokens)
    bytes_ = weights + kv_read_bytes + kv_write_tokens * model.kv_bytes_per_token
    if tp > 1:
        comm = 2 * model.layers * tokens * model.hidden * 2 * 2 * (tp - 1) / tp
        calls = np.full_like(tokens, 2 * model.layers)
    else:
        comm = np.zeros_like(tokens)
        calls = np.zeros_like(tokens)
    layers = np.full_like(tokens, model.layers + PASS_KERNEL_LAYERS)
    return flops / tp, bytes_ / tp, layers, comm, calls


class PassBuilder:
    """Counts FLOPs, bytes and communication of forward passes for one GPU of a TP group."""

    def __init__(self, tp_size: int) -> None:
        self.tp = tp_size
        self.parts: list[Passes] = []

    def add(
        self,
        model: ModelProfile,
        tokens: np.ndarray,
        kv_read_bytes: np.ndarray,
        attn_flops: np.ndarray,
        kv_write_tokens: np.ndarray,
        launches: float = 1.0,
    ) -> None:
        flops, bytes_, layers, comm, calls = count_passes(
            model, self.tp, tokens, kv_read_bytes, attn_flops, kv_write_tokens
        )
        launched = np.full(len(flops), launches)
        m = np.asarray(tokens, dtype=float)
        attention = np.asarray(attn_flops, dtype=float) / self.tp
        zeros = np.zeros(len(flops))
        self.parts.append(
            Passes(flops, bytes_, layers, comm, calls, launched, m, zeros, zeros, zeros, attention)
        )

    def add_host(self, count: int) -> None:
        """Host-only steps (n-gram lookup): pure per-pass overhead, no GPU work."""
        zeros = np.zeros(count)
        self.parts.append(Passes(zeros, zeros, zeros, zeros, zeros))


def prefill_passes(builder: PassBuilder, model: ModelProfile, lengths: np.ndarray) -> np.ndarray:
    """Add chunked-prefill passes; returns the chunk index that completes each request."""
    ends = np.cumsum(lengths)
    total = int(ends[-1])
    n_chunks = max(1, math.ceil(total / PREFILL_CHUNK_TOKENS))
    chunk_tokens = np.full(n_chunks, float(PREFILL_CHUNK_TOKENS))
    chunk_tokens[-1] = total - PREFILL_CHUNK_TOKENS * (n_chunks - 1)
    # Causal attention inside each prompt: sum over positions ~ L^2 / 2 per request.
    attn_per_request = model.attention_flops_per_token(lengths / 2.0) * lengths
    done_chunk = (ends - 1) // PREFILL_CHUNK_TOKENS
    attn = np.bincount(done_chunk, weights=attn_per_request, minlength=n_chunks)
    builder.add(model, chunk_tokens, np.zeros(n_chunks), attn, chunk_tokens)
    return done_chunk


def decode_passes(
    builder: PassBuilder,
    model: ModelProfile,
    plan: DraftPlan | None,
    active: np.ndarray,
    ctx_sum: np.ndarray,
    ctx_kv_bytes: np.ndarray,
    mean_ctx: np.ndarray,
    emitted: np.ndarray,
) -> int:
    """Add draft, verify and draft-extend passes per iteration; returns passes per iteration.

    Passes are laid out iteration-major, the verify pass last but for the extend pass.
    """
    n_iter = len(active)
    k = plan.verify_tokens if plan else 1
    verify_tokens = active * k
    verify_attn = model.attention_flops_per_token(mean_ctx) * verify_tokens
    # A verify pass writes the KV of every token it verifies (drafts included; SGLang frees
    # the rejected slots afterwards), not only of the accepted ones.
    verify = count_passes(
        model, builder.tp, verify_tokens, ctx_kv_bytes, verify_attn, verify_tokens
    )
    zeros = np.zeros(n_iter)
    speculative = plan is not None and k > 1
    # Columns of an (iterations x passes) block per field: drafts, verify, draft-extend.
    # Fields: FLOPs, bytes, layers, comm bytes, comm calls, tokens, verify-attention KV
    # bytes, requests and tokens of the host's speculative bookkeeping, attention FLOPs.
    verify_fields = (
        *verify,
        verify_tokens,
        ctx_kv_bytes / builder.tp if speculative else zeros,
        active if speculative else zeros,
        verify_tokens if speculative else zeros,
        verify_attn / builder.tp,
    )
    blocks: list[tuple[np.ndarray, ...]] = []
    tail: tuple[np.ndarray, ...] = ()
    if plan is not None and plan.family == "ngram":
        blocks.append((np.zeros((n_iter, 1)),) * len(verify_fields))
    elif plan is not None and plan.draft_model is not None:
        draft = plan.draft_model
        if plan.family == "dflash":
            tokens = [active * k]  # one pass drafts the whole block
            attn_tokens = tokens
            writes = tokens
        else:
            tokens = [active * (plan.topk if step > 0 else 1) for step in range(plan.num_steps)]
            tokens.append(np.maximum(emitted, 1))  # the draft-extend pass
            attn_tokens = [*tokens[:-1], emitted]
            writes = [*tokens[:-1], emitted]
        per_token = draft.attention_flops_per_token(mean_ctx)
        draft_attn = np.stack([per_token * t for t in attn_tokens], axis=1)
        counted = count_passes(
            draft,
            builder.tp,
            np.stack(tokens, axis=1),
            (draft.kv_bytes_read(mean_ctx) * active)[:, None],
            draft_attn,
            np.stack(writes, axis=1),
        )
        none = np.zeros((n_iter, len(tokens)))
        drafts = (*counted, np.stack(tokens, axis=1), none, none, none, draft_attn / builder.tp)
        if plan.family == "dflash":
            blocks.append(tuple(drafts))
        else:
            blocks.append(tuple(field[:, :-1] for field in drafts))
            tail = tuple(field[:, -1:] for field in drafts)
    blocks.append(tuple(field[:, None] for field in verify_fields))
    if tail:
        blocks.append(tail)
    # Pass j of iteration n sits at n * width + j.
    fields = [np.concatenate(column, axis=1) for column in zip(*blocks, strict=True)]
    width = fields[0].shape[1]
    launches = np.ones((n_iter, width))
    if plan is not None and plan.draft_model is not None:
        # the draft steps: one graph, launched once; the draft-extend: another
        launches[:, : verify_column(plan, width)] = 0.0
        launches[:, 0] = DRAFT_LAUNCH_SHARE
        launches[:, verify_column(plan, width) + 1 :] = DRAFT_LAUNCH_SHARE
    flops, bytes_, layers, comm, calls, m, verify_kv, requests, spec_tokens, attention = (
        field.reshape(-1) for field in fields
    )
    builder.parts.append(
        Passes(
            flops,
            bytes_,
            layers,
            comm,
            calls,
            launches.reshape(-1),
            m,
            verify_kv,
            requests,
            spec_tokens,
            attention,
        )
    )
    return width


def iteration_width(plan: DraftPlan | None) -> int:
    """Passes per decode iteration, as `decode_passes` lays them out: the drafter's (an
    n-gram lookup, one block draft, or the draft steps and a draft-extend), then the verify."""
    if plan is None:
        return 1
    if plan.family == "ngram":
        return 2
    if plan.draft_model is None:
        return 1
    if plan.family == "dflash":
        return 2
    return plan.num_steps + 2


def verify_column(plan: DraftPlan | None, width: int) -> int:
    """Which of an iteration's `width` passes is the verify pass (a draft-extend may follow)."""
    extends = plan is not None and plan.draft_model is not None and plan.family != "dflash"
    return width - 2 if extends else width - 1
