"""A simulated SGLang server: chunked prefill, then decode with or without speculation.

Each decode iteration drafts (EAGLE head, standalone model, DFLASH block, or an n-gram lookup
on the host), verifies `num_draft_tokens` tokens per running request in one target forward
pass, and emits the accepted tokens plus a bonus token. The passes are timed and powered by
`dvfs.twin.physics` on the node's GPUs, whose virtual clock advances by the work done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dvfs import __version__
from dvfs.campaign import DrafterSpec
from dvfs.clock import Clock
from dvfs.corpora.sampling import stable_seed
from dvfs.engines.base import RequestTrace, RoundResult, ServerInfo, Workload
from dvfs.errors import EngineError
from dvfs.twin import profiles
from dvfs.twin.physics import Passes, Schedule
from dvfs.twin.profiles import GpuProfile, ModelProfile

#: SGLang's chunked-prefill budget (tokens per prefill pass) on large-memory GPUs.
PREFILL_CHUNK_TOKENS = 8192
#: Virtual seconds a (re)start takes: loading weights and capturing CUDA graphs.
STARTUP_S = 60.0
#: How much sampling at temperature T raises the draft miss rate: EAGLE-3's tau falls from
#: 6.13 (T=0) to 4.24 (T=1) on MT-bench (A1), a 2.7x higher miss rate at depth 7 (INF).
TEMPERATURE_MISS_GAIN = 1.7

FAMILY = {
    "EAGLE3": "eagle3",
    "EAGLE": "eagle",
    "NEXTN": "eagle",
    "STANDALONE": "standalone",
    "NGRAM": "ngram",
    "DFLASH": "dflash",
}


class Node(Protocol):
    """Where the twin engine's passes run (simulated GPUs, or a free-running stand-in)."""

    @property
    def tp_size(self) -> int: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def profile(self) -> GpuProfile: ...

    def execute(self, *phases: Passes) -> Schedule: ...


@dataclass(frozen=True)
class DraftPlan:
    """A drafter resolved to what the twin needs: cost model and acceptance depth."""

    algorithm: str
    family: str
    num_steps: int
    topk: int
    verify_tokens: int
    depth: int
    draft_model: ModelProfile | None

    def alpha(self, corpus: str, temperature: float) -> float:
        prior = profiles.acceptance_priors()[self.family]
        alpha_ref = profiles.accept_probability(prior.tau(corpus), prior.ref_depth)
        alpha = profiles.widen(alpha_ref, prior.ref_topk, self.topk)
        miss = (1.0 - alpha) * (1.0 + TEMPERATURE_MISS_GAIN * min(max(temperature, 0.0), 1.0))
        return max(0.0, 1.0 - miss)

    def expected_accept_length(self, corpus: str, temperature: float) -> float:
        return profiles.expected_accept_length(self.alpha(corpus, temperature), self.depth)


def _generic_head(target: ModelProfile, vocab: int) -> ModelProfile:
    """A one-layer draft head shaped like one target layer (EAGLE without a known profile)."""
    return ModelProfile(
        key=f"{target.key}-head",
        hf_name="",
        layers=1,
        hidden=target.hidden,
        intermediate=target.intermediate,
        heads=target.heads,
        kv_heads=target.kv_heads,
        head_dim=target.head_dim,
        vocab=vocab,
        tied_embeddings=False,
        role="eagle-head",
        fc_inputs=3,
        attention_inputs=2,
    )


def plan_drafter(drafter: DrafterSpec, target: ModelProfile) -> DraftPlan | None:
    """Resolve a drafter like SGLang does (defaults for unset numbers) into a `DraftPlan`."""
    if drafter.algorithm is None:
        return None
    algorithm = drafter.algorithm
    if algorithm not in FAMILY:
        raise EngineError(f"the twin has no model of speculative algorithm {algorithm}")
    family = FAMILY[algorithm]
    steps, topk, tokens = drafter.num_steps, drafter.eagle_topk, drafter.num_draft_tokens
    if algorithm == "DFLASH":
        block = tokens or 16
        return DraftPlan(
            algorithm,
            family,
            1,
            1,
            block,
            block - 1,
            profiles.find_model_profile(drafter.draft_model)
            or profiles.model_profile("dflash-llama-3.1-8b-b16"),
        )
    if algorithm == "NGRAM":
        tokens = tokens or 12
        return DraftPlan(algorithm, family, 0, 1, tokens, tokens - 1, None)
    if steps is None:
        steps, topk, tokens = (5, 4, 8) if "llama" in target.key.lower() else (3, 1, 4)
    assert topk is not None and tokens is not None
    if topk == 1:
        tokens = steps + 1
    known = profiles.find_model_profile(drafter.draft_model)
    if algorithm == "STANDALONE":
        if known is None:
            raise EngineError(
                f"the twin needs the shape of standalone draft model {drafter.draft_model!r}; "
                f"use a twin model profile ({', '.join(sorted(profiles.model_profiles()))})"
            )
        draft = known
    elif known is not None:
        draft = known
    else:
        draft = _generic_head(target, 32000 if algorithm == "EAGLE3" else target.vocab)
    return DraftPlan(algorithm, family, steps, topk, tokens, min(steps, tokens - 1), draft)


class _PassBuilder:
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
    ) -> None:
        tokens = np.asarray(tokens, dtype=float)
        flops = 2.0 * model.active_matmul_params * tokens + attn_flops
        weights = model.weight_bytes_read(tokens)
        bytes_ = weights + kv_read_bytes + kv_write_tokens * model.kv_bytes_per_token
        if self.tp > 1:
            comm = 2 * model.layers * tokens * model.hidden * 2 * 2 * (self.tp - 1) / self.tp
            calls = np.full_like(tokens, 2 * model.layers)
        else:
            comm = np.zeros_like(tokens)
            calls = np.zeros_like(tokens)
        self.parts.append(
            Passes(
                flops / self.tp, bytes_ / self.tp, np.full_like(tokens, model.layers), comm, calls
            )
        )

    def add_host(self, count: int) -> None:
        """Host-only steps (n-gram lookup): pure per-pass overhead, no GPU work."""
        zeros = np.zeros(count)
        self.parts.append(Passes(zeros, zeros, zeros, zeros, zeros))


class TwinEngine:
    """The twin's `Engine`: deterministic given the workload's seed."""

    name = "twin"

    def __init__(
        self,
        node: Node,
        model: ModelProfile,
        *,
        startup_s: float = STARTUP_S,
        acceptance_like: dict[str, str] | None = None,
    ) -> None:
        self.node = node
        self.model = model
        self.acceptance_like = acceptance_like or {}
        self.startup_s = startup_s
        self._drafter: DrafterSpec | None = None
        self._plan: DraftPlan | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, drafter: DrafterSpec) -> ServerInfo:
        self._plan = plan_drafter(drafter, self.model)
        self._drafter = drafter
        if self.node.clock.virtual:  # loading weights costs virtual time only; never wait for real
            self.node.clock.sleep(self.startup_s)
        args: dict[str, object] = {
            "model_path": self.model.hf_name or self.model.key,
            "tp_size": self.node.tp_size,
            "speculative_algorithm": drafter.algorithm,
        }
        if self._plan is not None:
            args.update(
                speculative_draft_model_path=drafter.draft_model,
                speculative_num_steps=self._plan.num_steps,
                speculative_eagle_topk=self._plan.topk,
                speculative_num_draft_tokens=self._plan.verify_tokens,
            )
        return ServerInfo("twin", f"dvfs-twin {__version__}", drafter.name, args)

    def stop(self) -> None:
        self._drafter = None
        self._plan = None

    def __enter__(self) -> TwinEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- workload ---------------------------------------------------------------------------
    def run(self, workload: Workload) -> RoundResult:
        if self._drafter is None:
            raise EngineError("the twin engine was asked to run before start()")
        if workload.mode == "closed-loop":
            return self._run_closed_loop(workload)
        return self._run_fixed(workload)

    def _acceptance(self, workload: Workload) -> tuple[float, int]:
        plan = self._plan
        if plan is None:
            return 0.0, 0
        corpus = self.acceptance_like.get(workload.corpus, workload.corpus)
        return plan.alpha(corpus, workload.temperature), plan.depth

    def _draws(
        self, rng: np.random.Generator, shape: tuple[int, ...], alpha: float, depth: int
    ) -> np.ndarray:
        """Tokens each verify emits: 1 + accepted drafts, a truncated geometric draw."""
        if depth == 0 or alpha <= 0.0:
            return np.ones(shape, dtype=np.int64)
        if alpha >= 1.0:
            return np.full(shape, depth + 1, dtype=np.int64)
        u = rng.random(shape)
        accepted = np.floor(np.log1p(-u) / math.log(alpha)).astype(np.int64)
        return 1 + np.minimum(accepted, depth)

    def _prefill(self, builder: _PassBuilder, lengths: np.ndarray) -> np.ndarray:
        """Add chunked-prefill passes; returns the chunk index that completes each request."""
        ends = np.cumsum(lengths)
        total = int(ends[-1])
        n_chunks = max(1, math.ceil(total / PREFILL_CHUNK_TOKENS))
        chunk_tokens = np.full(n_chunks, float(PREFILL_CHUNK_TOKENS))
        chunk_tokens[-1] = total - PREFILL_CHUNK_TOKENS * (n_chunks - 1)
        # Causal attention inside each prompt: sum over positions ~ L^2 / 2 per request.
        attn_per_request = self.model.attention_flops_per_token(lengths / 2.0) * lengths
        done_chunk = (ends - 1) // PREFILL_CHUNK_TOKENS
        attn = np.bincount(done_chunk, weights=attn_per_request, minlength=n_chunks)
        builder.add(self.model, chunk_tokens, np.zeros(n_chunks), attn, chunk_tokens)
        return done_chunk

    def _decode_passes(
        self,
        builder: _PassBuilder,
        active: np.ndarray,
        ctx_sum: np.ndarray,
        ctx_kv_bytes: np.ndarray,
        mean_ctx: np.ndarray,
        emitted: np.ndarray,
    ) -> int:
        """Add draft, verify and draft-extend passes per iteration; returns passes per iteration.

        Passes are laid out iteration-major, the verify pass last but for the extend pass.
        """
        plan = self._plan
        n_iter = len(active)
        k = plan.verify_tokens if plan else 1
        columns: list[
            tuple[ModelProfile | None, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
        ] = []

        def draft_pass(draft: ModelProfile, tokens: np.ndarray) -> None:
            columns.append(
                (
                    draft,
                    tokens,
                    draft.kv_bytes_read(mean_ctx) * active,
                    draft.attention_flops_per_token(mean_ctx) * tokens,
                    tokens,
                )
            )

        if plan is not None and plan.family == "ngram":
            columns.append((None, active, active, active, active))
        elif plan is not None and plan.draft_model is not None:
            if plan.family == "dflash":
                draft_pass(plan.draft_model, active * k)  # one pass drafts the whole block
            else:
                for step in range(plan.num_steps):
                    draft_pass(plan.draft_model, active * (plan.topk if step > 0 else 1))
        verify_tokens = active * k
        verify_attn = self.model.attention_flops_per_token(mean_ctx) * verify_tokens
        columns.append((self.model, verify_tokens, ctx_kv_bytes, verify_attn, emitted))
        if plan is not None and plan.draft_model is not None and plan.family != "dflash":
            draft = plan.draft_model
            columns.append(
                (
                    draft,
                    np.maximum(emitted, 1),
                    draft.kv_bytes_read(mean_ctx) * active,
                    draft.attention_flops_per_token(mean_ctx) * emitted,
                    emitted,
                )
            )
        # Interleave columns so pass j of iteration n sits at n * width + j.
        width = len(columns)
        start = len(builder.parts)
        for model, tokens, kv, attn, writes in columns:
            if model is None:
                builder.add_host(n_iter)
            else:
                builder.add(model, tokens, kv, attn, writes)
        block = builder.parts[start:]
        del builder.parts[start:]
        interleaved = Passes(
            *(
                np.stack([getattr(p, f) for p in block], axis=1).reshape(-1)
                for f in Passes.__dataclass_fields__
            )
        )
        builder.parts.append(interleaved)
        return width

    def _run_fixed(self, workload: Workload) -> RoundResult:
        clock = self.node.clock
        t0 = clock.now_ns()
        rng = np.random.default_rng(stable_seed("twin", workload.seed))
        batch = workload.batch
        lengths = np.array([p.input_tokens for p in workload.prompts], dtype=np.int64)
        remaining = workload.max_new_tokens - 1  # the first token comes from prefill
        alpha, depth = self._acceptance(workload)

        builder = _PassBuilder(self.node.tp_size)
        done_chunk = self._prefill(builder, lengths)
        n_prefill = len(builder.parts[0])

        draws = self._draws(rng, (batch, max(1, remaining)), alpha, depth)
        cum = np.minimum(np.cumsum(draws, axis=1), remaining)
        n_iter = int(np.max(np.argmax(cum >= remaining, axis=1))) + 1 if remaining > 0 else 0
        cum = cum[:, :n_iter]
        before = np.concatenate([np.zeros((batch, 1), dtype=np.int64), cum[:, :-1]], axis=1)
        emitted = cum - before
        is_active = before < remaining
        active = is_active.sum(axis=0).astype(float)
        context = lengths[:, None] + 1 + before
        ctx_sum = np.where(is_active, context, 0).sum(axis=0).astype(float)
        ctx_kv = np.where(is_active, self.model.kv_bytes_read(context), 0.0).sum(axis=0)
        mean_ctx = ctx_sum / np.maximum(active, 1.0)
        iter_emitted = emitted.sum(axis=0).astype(float)
        width = (
            self._decode_passes(builder, active, ctx_sum, ctx_kv, mean_ctx, iter_emitted)
            if n_iter
            else 0
        )

        # Three phases, each at its own operating point under a power limit: prefill, decode
        # with the full batch (the steady window), and the drain as requests finish.
        prefill = builder.parts[0]
        decode = builder.parts[1] if n_iter else prefill.slice(0, 0)
        split = int(np.sum(active == batch)) * width
        point = self.node.execute(prefill, decode.slice(0, split), decode.slice(split))
        ends_ns = t0 + np.cumsum(np.round(point.timing.duration_s * 1e9)).astype(np.int64)
        prefill_end = ends_ns[:n_prefill]
        first_ns = prefill_end[done_chunk]
        verify_col = (
            width - 1
            if not (
                self._plan and self._plan.draft_model is not None and self._plan.family != "dflash"
            )
            else width - 2
        )
        iter_ns = (
            ends_ns[n_prefill + np.arange(n_iter) * width + verify_col]
            if n_iter
            else np.array([], dtype=np.int64)
        )
        # Decode begins when the last prefill chunk is done: shift iterations accordingly.
        requests = []
        verify_counts = is_active.sum(axis=1)
        for i in range(batch):
            mask = emitted[i] > 0
            chunk_ns = np.concatenate([[first_ns[i]], iter_ns[mask]]).astype(np.int64)
            chunk_tokens = np.concatenate([[1], emitted[i][mask]]).astype(np.int64)
            spec = self._plan is not None
            accepted = int(emitted[i].sum() - verify_counts[i]) if spec else None
            requests.append(
                RequestTrace(
                    sent_ns=t0,
                    chunk_ns=chunk_ns,
                    chunk_tokens=chunk_tokens,
                    prompt_tokens=int(lengths[i]),
                    completion_tokens=int(chunk_tokens.sum()),
                    finish_reason="length",
                    spec_verify_ct=int(verify_counts[i]) if spec else None,
                    spec_accepted_drafts=accepted,
                    spec_proposed_drafts=int(verify_counts[i] * (self._plan.verify_tokens - 1))
                    if self._plan is not None
                    else None,
                )
            )
        end_ns = int(ends_ns[-1]) if len(ends_ns) else t0
        _wait_until(clock, end_ns)
        return RoundResult(tuple(requests), t0, end_ns, _server_accept_length(requests))

    def _run_closed_loop(self, workload: Workload) -> RoundResult:
        """Concurrency held at `batch` from the prompt pool, natural output lengths.

        Iteration by iteration: finished slots take the next prompt, whose prefill joins the
        iteration (SGLang mixes prefill chunks into decode batches).
        """
        clock = self.node.clock
        t0 = clock.now_ns()
        rng = np.random.default_rng(stable_seed("twin-closed", workload.seed))
        alpha, depth = self._acceptance(workload)
        pool = list(workload.prompts)
        # Natural lengths: geometric-like with mean max_new_tokens / 2, at least 2 tokens.
        mean = max(2.0, workload.max_new_tokens / 2)
        targets = np.clip(
            rng.exponential(mean, size=len(pool)).astype(np.int64) + 2, 2, workload.max_new_tokens
        )
        if workload.ignore_eos:
            targets[:] = workload.max_new_tokens
        batch = workload.batch
        slot_req = [-1] * batch
        next_req = 0
        produced = np.zeros(len(pool), dtype=np.int64)
        verify_ct = np.zeros(len(pool), dtype=np.int64)
        sent_pass = np.full(len(pool), -1)
        chunks: list[list[tuple[int, int]]] = [[] for _ in pool]  # (pass index, tokens)
        builder = _PassBuilder(self.node.tp_size)
        pass_index = 0
        verify_positions: list[int] = []
        while True:
            # Admit new requests into free slots: their prefill runs as one chunk this iteration.
            admitted = []
            for s in range(batch):
                if slot_req[s] == -1 and next_req < len(pool):
                    slot_req[s] = next_req
                    admitted.append(next_req)
                    next_req += 1
            running = [r for r in slot_req if r != -1]
            if not running:
                break
            if admitted:
                lengths = np.array([pool[r].input_tokens for r in admitted], dtype=np.int64)
                sent_at = pass_index - 1
                first = len(builder.parts)
                self._prefill(builder, lengths)  # the same chunked prefill as fixed mode
                pass_index += sum(len(p) for p in builder.parts[first:])
                prefill_pass = pass_index - 1  # admitted requests get a token once it is done
                for r in admitted:
                    sent_pass[r] = sent_at
                    produced[r] = 1
                    chunks[r].append((prefill_pass, 1))
            decoding = [r for r in running if r not in admitted and produced[r] < targets[r]]
            if decoding:
                idx = np.array(decoding)
                draws = self._draws(rng, (len(idx),), alpha, depth)
                left = targets[idx] - produced[idx]
                got = np.minimum(draws, left)
                context = np.array([pool[r].input_tokens for r in idx]) + produced[idx]
                active = np.array([float(len(idx))])
                ctx_sum = np.array([float(context.sum())])
                ctx_kv = np.array([float(np.sum(self.model.kv_bytes_read(context)))])
                width = self._decode_passes(
                    builder, active, ctx_sum, ctx_kv, ctx_sum / active, np.array([float(got.sum())])
                )
                verify_col = (
                    width - 1
                    if not (
                        self._plan
                        and self._plan.draft_model is not None
                        and self._plan.family != "dflash"
                    )
                    else width - 2
                )
                verify_pass = pass_index + verify_col
                verify_positions.append(verify_pass)
                pass_index += width
                for r, g in zip(idx, got, strict=True):
                    produced[r] += g
                    verify_ct[r] += 1
                    chunks[r].append((verify_pass, int(g)))
            for s in range(batch):
                r = slot_req[s]
                if r != -1 and produced[r] >= targets[r]:
                    slot_req[s] = -1
        # One phase: admissions and finishes interleave, so the limit holds on average.
        point = self.node.execute(Passes.concat(builder.parts))
        ends_ns = t0 + np.cumsum(np.round(point.timing.duration_s * 1e9)).astype(np.int64)
        requests = []
        spec = self._plan is not None
        for r, prompt in enumerate(pool):
            if not chunks[r]:
                continue
            chunk_ns = np.array([ends_ns[p] for p, _ in chunks[r]], dtype=np.int64)
            chunk_tokens = np.array([n for _, n in chunks[r]], dtype=np.int64)
            finished = "length" if produced[r] >= workload.max_new_tokens else "stop"
            requests.append(
                RequestTrace(
                    sent_ns=t0 if sent_pass[r] < 0 else int(ends_ns[sent_pass[r]]),
                    chunk_ns=chunk_ns,
                    chunk_tokens=chunk_tokens,
                    prompt_tokens=prompt.input_tokens,
                    completion_tokens=int(chunk_tokens.sum()),
                    finish_reason=finished,
                    spec_verify_ct=int(verify_ct[r]) if spec else None,
                    spec_accepted_drafts=int(produced[r] - 1 - verify_ct[r]) if spec else None,
                    spec_proposed_drafts=int(verify_ct[r] * (self._plan.verify_tokens - 1))
                    if self._plan is not None
                    else None,
                )
            )
        end_ns = int(ends_ns[-1]) if len(ends_ns) else t0
        _wait_until(clock, end_ns)
        return RoundResult(tuple(requests), t0, end_ns, _server_accept_length(requests))


def _wait_until(clock: Clock, end_ns: int) -> None:
    """Let the simulated work finish: jump there in virtual time, sleep in real time."""
    remaining_s = (end_ns - clock.now_ns()) * 1e-9
    if remaining_s > 0:
        clock.sleep(remaining_s)


def _server_accept_length(requests: list[RequestTrace]) -> float | None:
    """What SGLang's /server_info reports: tokens per verify pass (the prefill token is no
    verify pass's), pooled over the round."""
    verify = sum(r.spec_verify_ct or 0 for r in requests)
    if not any(r.spec_verify_ct is not None for r in requests) or verify == 0:
        return None
    return (sum(r.completion_tokens for r in requests) - len(requests)) / verify
