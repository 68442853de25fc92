"""A simulated SGLang server: chunked prefill, then decode with or without speculation.

Each decode iteration drafts (EAGLE head, standalone model, DFLASH block, or an n-gram lookup
on the host), verifies `num_draft_tokens` tokens per running request in one target forward
pass, and emits the accepted tokens plus a bonus token. The passes are timed and powered by
`dvfs.twin.physics` on the node's GPUs (draft plans from `dvfs.twin.drafting`, pass
counting from `dvfs.twin.passes`), whose virtual clock advances by the work done.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from dvfs.campaign.model import DrafterSpec
from dvfs.clock import Clock
from dvfs.collector import few_collections
from dvfs.corpora.sampling import stable_seed
from dvfs.engines.base import (
    ABORTED,
    DECODE_LOG_INTERVAL,
    ROLE_DRAFT,
    ROLE_PREFILL,
    ROLE_VERIFY,
    KnobTimeline,
    PassLedger,
    RequestTrace,
    RoundArrays,
    RoundResult,
    ServerInfo,
    Workload,
    check_chunk_times,
    check_chunk_tokens,
)
from dvfs.errors import EngineError, ServerUnfitError
from dvfs.twin.drafting import DraftPlan, draws, plan_drafter
from dvfs.twin.identity import twin_version
from dvfs.twin.limits import (
    context_length_refusal,
    context_refusal,
    mem_fraction_static,
    reserved_tokens,
    served_context_length,
    weights_refusal,
)
from dvfs.twin.passes import (
    PassBuilder,
    decode_passes,
    iteration_width,
    prefill_passes,
    verify_column,
)
from dvfs.twin.physics import Passes, PassTiming, Schedule, host_time_s
from dvfs.twin.profiles import GpuProfile, ModelProfile
from dvfs.twin.textprior import TextProfile, profile_prompts

if TYPE_CHECKING:
    from dvfs.corpora.model import Prompt

#: Virtual seconds a (re)start takes: loading weights and capturing CUDA graphs.
STARTUP_S = 60.0
#: Fixed-batch rounds remembered per server: a sweep repeats each (prompts, seed) round at
#: every knob setting, and only the timing differs (bounded, so memory stays flat).
ROUND_CACHE_SIZE = 256


class Node(Protocol):
    """Where the twin engine's passes run (simulated GPUs, or a free-running stand-in)."""

    @property
    def tp_size(self) -> int: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def profile(self) -> GpuProfile: ...

    def execute(self, *phases: Passes) -> Schedule: ...


class TwinEngine:
    """The twin's `Engine`: deterministic given the workload's seed."""

    name = "twin"

    def __init__(
        self,
        node: Node,
        model: ModelProfile,
        *,
        startup_s: float = STARTUP_S,
        texts: Mapping[str, TextProfile] | None = None,
        decode_graph_max_bs: int | None = None,
        server_args: tuple[str, ...] = (),
        server_env: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.node = node
        self.model = model
        #: The decode CUDA graphs' largest batch the server is started with (dvfs's SGLang
        #: launch sets the campaign's largest batch; None: SGLang's default), which its default
        #: static memory fraction reserves memory for (`dvfs.twin.limits`).
        self.decode_graph_max_bs = decode_graph_max_bs
        #: The SGLang args every server is started with (engine.sglang.extra_args): their
        #: `--mem-fraction-static`, with a drafter's own over them, sizes its static memory.
        self.server_args = server_args
        #: The environment every server is started with (engine.sglang.env): SGLang reads
        #: whether a `--context-length` may exceed the model's there.
        self.server_env = server_env
        #: The context length the running server serves (`dvfs.twin.limits`; 0: unknown).
        self._context_length = model.context_length
        self.texts = dict(texts or {})
        self.startup_s = startup_s
        self._drafter: DrafterSpec | None = None
        self._plan: DraftPlan | None = None
        self._alphas: dict[tuple[TextProfile, float], float] = {}
        #: `_alphas` by corpus name, for a text found in `texts` (the text kept to check it)
        self._corpus_alphas: dict[tuple[str, float], tuple[TextProfile, float]] = {}
        self._rounds: OrderedDict[tuple[object, ...], _FixedRound] = OrderedDict()
        #: `_lengths_of` by the prompts' id (the prompts kept to check it)
        self._lengths: dict[int, tuple[tuple[Prompt, ...], np.ndarray, bytes, int]] = {}
        #: the garbage collector's settings while the engine is open (`__enter__`)
        self._collections = contextlib.ExitStack()

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, drafter: DrafterSpec) -> ServerInfo:
        """Start serving `drafter`; refused (`ServerUnfitError`), as SGLang refuses to start, where
        the weights leave the GPUs no memory for the KV cache, or a `--context-length` exceeds
        the model's (`dvfs.twin.limits`)."""
        plan = plan_drafter(drafter, self.model)
        launch = [*self.server_args, *drafter.extra_args]
        refusal = context_length_refusal(self.model, launch, self.server_env) or weights_refusal(
            self.model,
            plan.draft_model if plan is not None else None,
            self.node.profile,
            self.node.tp_size,
            self.decode_graph_max_bs,
            mem_fraction_static(launch),
        )
        if refusal is not None:
            self.stop()
            raise ServerUnfitError(refusal)  # says that SGLang would not start, why, what to do
        self._context_length = served_context_length(self.model, launch, self.server_env)
        self._plan = plan
        self._drafter = drafter
        self._alphas = {}
        self._corpus_alphas = {}
        self._rounds = OrderedDict()
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
        return ServerInfo("twin", twin_version(), drafter.name, args)

    def stop(self) -> None:
        self._drafter = None
        self._plan = None
        self._alphas = {}
        self._corpus_alphas = {}
        self._rounds = OrderedDict()

    def __enter__(self) -> TwinEngine:
        # a sweep on the twin makes and drops hundreds of thousands of small objects (traces,
        # readings): the cyclic collector runs less often while the engine is open
        self._collections.enter_context(few_collections())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self._collections.close()  # the collector as it was (once: a second close is a no-op)

    # -- workload ---------------------------------------------------------------------------
    def run(self, workload: Workload, timeline: KnobTimeline | None = None) -> RoundResult:
        if self._drafter is None:
            raise EngineError("the twin engine was asked to run before start()")
        self._refuse_overlong(workload)
        if workload.mode == "closed-loop":
            if timeline is not None and timeline.steps:
                raise EngineError("knob steps inside a round need a fixed batch")
            return self._run_closed_loop(workload)
        return self._run_fixed(workload, timeline)

    def _refuse_overlong(self, workload: Workload) -> None:
        """Refuse (`EngineError`, as the SGLang client raises for the error SGLang answers) a
        workload with a prompt that, with its reserved draft slots and `max_new_tokens`, does
        not fit the context length the server serves (the model's, or the `--context-length`
        its args give: `dvfs.twin.limits.context_refusal`)."""
        limit = self._context_length
        if not limit:
            return
        longest = self._longest_prompt(workload.prompts) + reserved_tokens(self._plan)
        refusal = context_refusal(longest, workload.max_new_tokens, limit)
        if refusal is not None:
            raise EngineError(f"the server reported an error: {refusal}")

    def new_tokens_room(self, workload: Workload) -> int | None:
        """The most new tokens each request of `workload` may ask for and still fit the
        context length the server serves, as `_refuse_overlong` counts it: that length less
        the batch's longest prompt and the draft slots its drafter reserves (0 where that
        prompt alone does not fit). None: no context length known, or not started."""
        limit = self._context_length
        if not limit or self._drafter is None:
            return None
        longest = self._longest_prompt(workload.prompts) + reserved_tokens(self._plan)
        return max(0, limit - longest)

    def _acceptance(self, workload: Workload) -> tuple[float, int]:
        plan = self._plan
        if plan is None:
            return 0.0, 0
        # What the corpus's text says (profiled once per corpus by the sweep); given none, the
        # round's own prompts are read.
        text = self.texts.get(workload.corpus)
        by_name = (workload.corpus, workload.temperature)
        if text:  # found by the corpus's name (a string hashes at once, a profile field by field)
            known = self._corpus_alphas.get(by_name)
            if known is not None and known[0] is text:
                return known[1], plan.depth
        else:
            text = profile_prompts(workload.prompts)
        key = (text, workload.temperature)
        alpha = self._alphas.get(key)
        if alpha is None:  # the same few per server, asked every round
            alpha = self._alphas[key] = plan.alpha(text, workload.temperature)
        if text is self.texts.get(workload.corpus):
            self._corpus_alphas[by_name] = (text, alpha)
        return alpha, plan.depth

    def _prompt_lengths(self, prompts: tuple[Prompt, ...]) -> tuple[np.ndarray, bytes]:
        """The prompts' token counts (read-only), and as bytes: remembered by the prompts'
        identity, as a sweep asks the same remembered workloads at every knob setting."""
        known = self._lengths_of(prompts)
        return known[1], known[2]

    def _longest_prompt(self, prompts: tuple[Prompt, ...]) -> int:
        """The most tokens a prompt of `prompts` has (0 for none), remembered with their
        lengths: every round is checked against the context length."""
        return self._lengths_of(prompts)[3]

    def _lengths_of(
        self, prompts: tuple[Prompt, ...]
    ) -> tuple[tuple[Prompt, ...], np.ndarray, bytes, int]:
        """(prompts, their lengths, as bytes, the longest), remembered by the prompts'
        identity (the prompts kept with them, so the identity stays theirs)."""
        known = self._lengths.get(id(prompts))
        if known is not None and known[0] is prompts:
            return known
        lengths = np.array([p.input_tokens for p in prompts], dtype=np.int64)
        lengths.flags.writeable = False
        longest = int(lengths.max()) if len(lengths) else 0
        known = self._lengths[id(prompts)] = (prompts, lengths, lengths.tobytes(), longest)
        if len(self._lengths) > ROUND_CACHE_SIZE:
            del self._lengths[next(iter(self._lengths))]  # the oldest
        return known

    def _fixed_round(self, workload: Workload) -> _FixedRound:
        """The round's tokens and passes, from the cache when only the knobs changed."""
        return self._keyed_round(workload)[1]

    def _keyed_round(self, workload: Workload) -> tuple[tuple[object, ...], _FixedRound]:
        """`_fixed_round`, and its key in the cache."""
        lengths, lengths_key = self._prompt_lengths(workload.prompts)
        alpha, depth = self._acceptance(workload)
        key = (
            workload.seed,
            lengths_key,
            workload.max_new_tokens,
            alpha,
            depth,
            workload.end_at_window,
        )
        cached = self._rounds.get(key)
        if cached is not None:
            self._rounds.move_to_end(key)
            return key, cached
        planned = _plan_fixed(
            self.model, self._plan, self.node.tp_size, workload, lengths, alpha, depth
        )
        if workload.end_at_window:
            planned = _ended_at_window(planned, self._plan)
        self._rounds[key] = planned
        if len(self._rounds) > ROUND_CACHE_SIZE:
            self._rounds.popitem(last=False)
        return key, planned

    def repeater(self, workload: Workload) -> Callable[[], None]:
        """`run(workload)` with its result dropped, as a call to make again and again (a
        thermal stabilisation's load): the same passes on the node, the same checks and the
        same virtual time, without the traces and the ledger nobody would read. A closed-loop
        workload runs as `run` runs it."""
        if workload.mode == "closed-loop":

            def run_again() -> None:
                self.run(workload)

            return run_again

        last = _LastRepeat()
        self._refuse_overlong(workload)

        def again() -> None:
            if self._drafter is None:
                raise EngineError("the twin engine was asked to run before start()")
            clock = self.node.clock
            t0 = clock.now_ns()
            planned = last.planned
            if (
                planned is not None
                and last.plan is self._plan
                and last.rounds is self._rounds
                and self._rounds.get(last.key) is planned
            ):
                self._rounds.move_to_end(last.key)  # as `_fixed_round` finding it does
            else:
                last.key, planned = self._keyed_round(workload)
                last.plan, last.rounds, last.planned = self._plan, self._rounds, planned
            done = self.node.execute(*planned.phases)  # `_execute` without knob steps
            ends_ns = done.ends_ns
            if last.checked is not planned or last.checked_schedule is not done:
                self._chunk_ends(planned, t0 + ends_ns)
                last.checked, last.checked_schedule = planned, done
            _wait_until(clock, t0 + int(ends_ns[-1]) if len(ends_ns) else t0)

        return again

    def _chunk_ends(
        self, planned: _FixedRound, ends_ns: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """When each request's prefill token and each decode iteration's tokens arrived (ns),
        checked for the round as a whole."""
        first_ns = ends_ns[: planned.n_prefill][planned.done_chunk]
        iter_ns = ends_ns[_verify_passes(planned, self._plan)]
        # Every request's chunks are its own first chunk then a prefix of the same
        # iterations: the latest first chunk and every iteration stand for them all
        # (`check_chunk_times` on that one row, in two steps).
        # (np.maximum.reduce and np.logical_or.reduce are what ndarray.max and .any call,
        # without their dispatch)
        first_max = np.maximum.reduce(first_ns)
        if (planned.n_iter and first_max > iter_ns[0]) or np.logical_or.reduce(
            iter_ns[1:] < iter_ns[:-1]
        ):
            check_chunk_times(
                np.concatenate([[first_max], iter_ns])[None, :], np.array([planned.n_iter + 1])
            )
        return first_ns, iter_ns

    def _run_fixed(self, workload: Workload, timeline: KnobTimeline | None = None) -> RoundResult:
        clock = self.node.clock
        t0 = clock.now_ns()
        planned = self._fixed_round(workload)
        ends_ns, (begun_ns, knob_ns), timing = self._execute(planned.phases, timeline)
        first_ns, iter_ns = self._chunk_ends(planned, ends_ns)
        # Request i's chunks: its prefill token, then one per verify while it is active (a
        # prefix of the iterations); row views of one array, checked as a whole above.
        chunk_ns = np.empty((workload.batch, planned.n_iter + 1), dtype=np.int64)
        chunk_ns[:, 0] = first_ns
        chunk_ns[:, 1:] = iter_ns
        chunk_ns.flags.writeable = False
        arrays = RoundArrays(
            t0,
            chunk_ns,
            planned.chunk_tokens,
            planned.counts,
            planned.completion,
            planned.lengths,
            planned.aborted,
            self._plan.verify_tokens if self._plan is not None else None,
            lockstep=True,  # every row's iterations are `iter_ns`
        )
        end_ns = int(ends_ns[-1]) if len(ends_ns) else t0
        _wait_until(clock, end_ns)
        role, host_s = _fixed_roles(planned, self._plan, self.node.profile)
        ledger = self._ledger(ends_ns, timing, role, host_s)
        return RoundResult.of_arrays(
            arrays,
            t0,
            end_ns,
            planned.accept_length,
            knob_ns,
            ledger,
            server_accept_covers=planned.accept_covers,
            knob_begun_ns=begun_ns,
        )

    def _ledger(
        self, ends_ns: np.ndarray, timing: PassTiming, role: np.ndarray, host_s: np.ndarray
    ) -> PassLedger:
        """The round's passes by role (`PassLedger`); `host_s`: each pass's host time that is
        overhead (`_overhead_host_s`)."""
        profile = self.node.profile
        return PassLedger(
            ends_ns, timing.duration_s, timing.power_w, role, host_s, profile.idle_power_w
        )

    def _execute(
        self, phases: tuple[Passes, ...], timeline: KnobTimeline | None
    ) -> tuple[np.ndarray, tuple[tuple[int, ...], tuple[int, ...]], PassTiming]:
        """Run a round's phases (the prefill first) from now: when each pass ends (ns on the
        clock), when each of the timeline's steps was called and when it returned, and each
        pass's duration and power.

        Without steps every phase starts at once, each at its own operating point. With
        steps the decode starts when the prefill ends; each step runs at the first pass
        boundary at or after its instant, and the passes up to there form a sub-phase at the
        operating point the node had when it began (the knob then in force): the decode
        splits into sub-phases at the steps, in virtual time. Steps due after the work ends
        do not run."""
        clock = self.node.clock
        t0 = clock.now_ns()
        if timeline is None or not timeline.steps:
            done = self.node.execute(*phases)
            return t0 + done.ends_ns, ((), ()), done.timing
        pieces: list[np.ndarray] = []
        timings: list[PassTiming] = []

        def run(passes: Passes) -> None:
            start = clock.now_ns()
            done = self.node.execute(passes)
            pieces.append(start + done.ends_ns)
            timings.append(done.timing)
            _wait_until(clock, int(pieces[-1][-1]))

        prefill, *decode = phases
        if len(prefill):
            run(prefill)
        decode_ns = clock.now_ns()
        queue = [p for p in decode if len(p)]
        begun: list[int] = []
        ran: list[int] = []
        for step in timeline.steps:
            due = decode_ns + round(step.at_s * 1e9)
            while queue and clock.now_ns() < due:
                head = queue[0]
                k = self._passes_until(head, due - clock.now_ns())
                run(head.slice(0, k))
                queue[0] = head.slice(k)
                if not len(queue[0]):
                    queue.pop(0)
            if clock.now_ns() < due:
                break  # the work ended before this step
            begun.append(clock.now_ns())
            step.apply()
            ran.append(clock.now_ns())
        if queue:
            done = self.node.execute(*queue)
            pieces.append(clock.now_ns() + done.ends_ns)
            timings.append(done.timing)
        timing = PassTiming(
            0.0,
            np.concatenate([t.duration_s for t in timings]),
            np.concatenate([t.power_w for t in timings]),
            np.concatenate([t.tensor_util for t in timings]),
            np.concatenate([t.memory_util for t in timings]),
        )
        return np.concatenate(pieces), (tuple(begun), tuple(ran)), timing

    def _passes_until(self, passes: Passes, within_ns: int) -> int:
        """How many of `passes`, started now, run until the first pass end at least
        `within_ns` away (all of them when they end sooner), at the node's operating point
        now (planned only: nothing starts)."""
        plan = getattr(self.node, "plan", None)
        point = plan(passes) if plan is not None else self.node.execute(passes).points[0]
        ends = np.cumsum(np.round(point.timing.duration_s * 1e9))
        return min(len(passes), int(np.searchsorted(ends, within_ns, side="left")) + 1)

    def _closed_loop_passes(
        self,
        prefill_parts: list[Passes],
        segments: list[tuple[str, int, int]],
        width: int,
        active: np.ndarray,
        ctx_sum: np.ndarray,
        ctx_kv: np.ndarray,
        emitted: np.ndarray,
    ) -> Passes:
        """A closed-loop round's passes in order: its prefill parts and decode iterations as
        `segments` interleave them, the iterations counted in one `decode_passes` call."""
        parts = list(prefill_parts)
        if len(active):
            decoded = PassBuilder(self.node.tp_size)
            counted = decode_passes(
                decoded, self.model, self._plan, active, ctx_sum, ctx_kv, ctx_sum / active, emitted
            )
            if counted != width:
                raise AssertionError(f"decode iterations of {counted} passes, not {width}")
            parts.append(decoded.parts[0])
        whole = Passes.concat(parts)
        decode_base = sum(len(p) for p in prefill_parts)
        starts = np.cumsum([0, *(len(p) for p in prefill_parts)])
        order = []
        for kind, first, count in segments:
            if kind == "prefill":
                order.append(np.arange(starts[first], starts[first + count]))
            else:
                at = decode_base + first * width
                order.append(np.arange(at, at + width))
        return whole.take(np.concatenate(order))

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
        inputs = np.array([p.input_tokens for p in pool], dtype=np.int64)
        slot_req = np.full(batch, -1, dtype=np.int64)  # the request in each slot; -1: free
        next_req = 0
        produced = np.zeros(len(pool), dtype=np.int64)
        verify_ct = np.zeros(len(pool), dtype=np.int64)
        sent_pass = np.full(len(pool), -1)
        # Each iteration's chunks, in time order: (requests, tokens each, pass index).
        chunk_requests: list[np.ndarray] = []
        chunk_counts: list[np.ndarray] = []
        chunk_passes: list[int] = []
        builder = PassBuilder(self.node.tp_size)  # the prefill chunks, in order
        # The passes in order: ("prefill", first part, parts) or ("decode", iteration). A
        # decode iteration's passes are counted after the loop, all iterations at once
        # (`decode_passes` is element-wise over iterations): only its width is known here.
        segments: list[tuple[str, int, int]] = []
        width = iteration_width(self._plan)
        verify_col = verify_column(self._plan, width)
        iteration_roles = _iteration_roles(self._plan, width)
        roles: list[np.ndarray] = []  # each segment's passes' roles
        decode_active: list[float] = []
        decode_ctx_sum: list[float] = []
        decode_ctx_kv: list[float] = []
        decode_emitted: list[float] = []
        pass_index = 0
        while True:
            # Admit new requests into free slots (lowest slot first): their prefill runs as
            # one chunk this iteration.
            first_admitted = next_req
            free = np.flatnonzero(slot_req == -1)[: len(pool) - next_req]
            if len(free):
                admitted = np.arange(next_req, next_req + len(free))
                slot_req[free] = admitted
                next_req += len(free)
            running = slot_req[slot_req != -1]  # in slot order
            if not len(running):
                break
            if len(free):
                sent_at = pass_index - 1
                first = len(builder.parts)
                prefill_passes(builder, self.model, inputs[admitted])  # fixed mode's chunking
                segments.append(("prefill", first, len(builder.parts) - first))
                pass_index += sum(len(p) for p in builder.parts[first:])
                roles.extend(np.full(len(p), ROLE_PREFILL) for p in builder.parts[first:])
                prefill_pass = pass_index - 1  # admitted requests get a token once it is done
                sent_pass[admitted] = sent_at
                produced[admitted] = 1
                chunk_requests.append(admitted)
                chunk_counts.append(np.ones(len(admitted), dtype=np.int64))
                chunk_passes.append(prefill_pass)
            idx = running[(running < first_admitted) & (produced[running] < targets[running])]
            if len(idx):
                drawn = draws(rng, (len(idx),), alpha, depth)
                left = targets[idx] - produced[idx]
                got = np.minimum(drawn, left)
                context = inputs[idx] + produced[idx]
                segments.append(("decode", len(decode_active), 1))
                decode_active.append(float(len(idx)))
                decode_ctx_sum.append(float(context.sum()))
                decode_ctx_kv.append(float(np.sum(self.model.kv_bytes_read(context))))
                decode_emitted.append(float(got.sum()))
                roles.append(iteration_roles)
                produced[idx] += got  # a request sits in one slot: no index repeats
                verify_ct[idx] += 1
                chunk_requests.append(idx)
                chunk_counts.append(got)
                chunk_passes.append(pass_index + verify_col)
                pass_index += width
            busy = slot_req != -1
            held = np.where(busy, slot_req, 0)
            done = busy & (produced[held] >= targets[held])
            slot_req[done] = -1
            if workload.end_at_window and done.any() and next_req >= len(pool):
                # Concurrency drops below batch after the last send: the steady window ends
                # here, and the requests still running are aborted (`base.ROUND_END`).
                break
        passes = self._closed_loop_passes(
            builder.parts,
            segments,
            width,
            np.array(decode_active),
            np.array(decode_ctx_sum),
            np.array(decode_ctx_kv),
            np.array(decode_emitted),
        )
        # One phase: admissions and finishes interleave, so the limit holds on average.
        point = self.node.execute(passes)
        ends_ns = t0 + point.ends_ns
        # Each request's chunks in time order: the iterations' records, grouped by request
        # (a stable sort keeps each request's own order).
        owner = np.concatenate(chunk_requests) if chunk_requests else np.zeros(0, np.int64)
        counts = np.concatenate(chunk_counts) if chunk_counts else np.zeros(0, np.int64)
        at = np.repeat(np.array(chunk_passes, dtype=np.int64), [len(c) for c in chunk_requests])
        by_request = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[by_request], np.arange(len(pool) + 1))
        chunk_ns_all = ends_ns[at[by_request]].astype(np.int64)
        counts_all = counts[by_request].astype(np.int64)
        requests = []
        spec = self._plan is not None
        for r, prompt in enumerate(pool):
            lo, hi = bounds[r], bounds[r + 1]
            if lo == hi:
                continue
            chunk_tokens = counts_all[lo:hi]
            if produced[r] < targets[r]:
                finished = ABORTED
            else:
                finished = "length" if produced[r] >= workload.max_new_tokens else "stop"
            requests.append(
                RequestTrace(
                    sent_ns=t0 if sent_pass[r] < 0 else int(ends_ns[sent_pass[r]]),
                    chunk_ns=chunk_ns_all[lo:hi],
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
        role = np.concatenate(roles) if roles else np.zeros(0, dtype=np.int64)
        ledger = self._ledger(
            ends_ns, point.timing, role, _overhead_host_s(self.node.profile, passes)
        )
        accept, covers = _server_figure_of_iterations(
            np.array(decode_emitted), np.array(decode_active), self._plan
        )
        return RoundResult(
            tuple(requests), t0, end_ns, accept, ledger=ledger, server_accept_covers=covers
        )


@dataclass(frozen=True)
class _FixedRound:
    """What a fixed-batch round does whatever the clock: its passes in three phases (prefill,
    decode with the full batch, the drain) and each request's chunk tokens (read-only)."""

    phases: tuple[Passes, Passes, Passes]
    n_prefill: int
    n_iter: int
    width: int
    done_chunk: np.ndarray
    chunk_tokens: np.ndarray
    counts: np.ndarray
    completion: np.ndarray
    lengths: np.ndarray
    #: What /server_info reports (`_server_figure`).
    accept_length: float | None
    #: Which requests the round's end aborted (`_ended_at_window`); None: none.
    aborted: np.ndarray | None = None
    #: The share of the round's decode iterations `accept_length` covers.
    accept_covers: float = 0.0


def _plan_fixed(
    model: ModelProfile,
    plan: DraftPlan | None,
    tp_size: int,
    workload: Workload,
    lengths: np.ndarray,
    alpha: float,
    depth: int,
) -> _FixedRound:
    """Draw the round's accepted tokens (requests x iterations at once) and count its passes."""
    rng = np.random.default_rng(stable_seed("twin", workload.seed))
    batch = workload.batch
    remaining = workload.max_new_tokens - 1  # the first token comes from prefill
    builder = PassBuilder(tp_size)
    done_chunk = prefill_passes(builder, model, lengths)
    n_prefill = len(builder.parts[0])

    cum = np.minimum(
        np.cumsum(draws(rng, (batch, max(1, remaining)), alpha, depth), axis=1), remaining
    )
    n_iter = int(np.max(np.argmax(cum >= remaining, axis=1))) + 1 if remaining > 0 else 0
    cum = cum[:, :n_iter]
    before = np.concatenate([np.zeros((batch, 1), dtype=np.int64), cum[:, :-1]], axis=1)
    emitted = cum - before
    is_active = before < remaining
    active = is_active.sum(axis=0).astype(float)
    context = lengths[:, None] + 1 + before
    ctx_sum = np.where(is_active, context, 0).sum(axis=0).astype(float)
    ctx_kv = np.where(is_active, model.kv_bytes_read(context), 0.0).sum(axis=0)
    mean_ctx = ctx_sum / np.maximum(active, 1.0)
    iter_emitted = emitted.sum(axis=0).astype(float)
    width = (
        decode_passes(builder, model, plan, active, ctx_sum, ctx_kv, mean_ctx, iter_emitted)
        if n_iter
        else 0
    )
    # Each phase runs at its own operating point under a power limit.
    prefill = builder.parts[0]
    decode = builder.parts[1] if n_iter else prefill.slice(0, 0)
    split = int(np.sum(active == batch)) * width

    verify_counts = is_active.sum(axis=1)
    chunk_tokens = np.empty((batch, n_iter + 1), dtype=np.int64)
    chunk_tokens[:, 0] = 1
    chunk_tokens[:, 1:] = emitted
    chunk_tokens.flags.writeable = False
    completion = chunk_tokens.sum(axis=1)
    check_chunk_tokens(chunk_tokens, verify_counts + 1, completion)
    accept, covers = _server_figure(chunk_tokens[:, 1:], plan)
    return _FixedRound(
        phases=(prefill, decode.slice(0, split), decode.slice(split)),
        n_prefill=n_prefill,
        n_iter=n_iter,
        width=width,
        done_chunk=done_chunk,
        chunk_tokens=chunk_tokens,
        counts=verify_counts + 1,
        completion=completion,
        lengths=lengths,
        accept_length=accept,
        accept_covers=covers,
    )


def _ended_at_window(planned: _FixedRound, plan: DraftPlan | None) -> _FixedRound:
    """The round cut where its steady window ends (`base.ROUND_END`): after the last decode
    iteration with the whole batch running, whose verify emits the first finisher's last
    token. The drain's passes do not run; the requests that had not finished are aborted with
    the tokens they received by then. A round whose requests all finish together (no
    speculation) is unchanged."""
    prefill, full, drain = planned.phases
    if not len(drain) or not planned.width:
        return planned
    n_full = len(full) // planned.width
    keep = n_full + 1  # the prefill token's chunk, then one per full-batch iteration
    tokens = planned.chunk_tokens[:, :keep]
    counts = np.minimum(planned.counts, keep)
    completion = tokens.sum(axis=1)
    accept, covers = _server_figure(tokens[:, 1:], plan)
    return _FixedRound(
        phases=(prefill, full, drain.slice(0, 0)),
        n_prefill=planned.n_prefill,
        n_iter=n_full,
        width=planned.width,
        done_chunk=planned.done_chunk,
        chunk_tokens=tokens,
        counts=counts,
        completion=completion,
        lengths=planned.lengths,
        accept_length=accept,
        aborted=planned.counts > keep,
        accept_covers=covers,
    )


def _verify_passes(planned: _FixedRound, plan: DraftPlan | None) -> np.ndarray:
    """The index of each decode iteration's verify pass among the round's passes, made once
    per planned round and kept with it."""
    known = planned.__dict__.get("_verify_passes")
    if known is not None and known[0] is plan:
        return known[1]
    width = planned.width
    index = planned.n_prefill + np.arange(planned.n_iter) * width + verify_column(plan, width)
    index.flags.writeable = False
    planned.__dict__["_verify_passes"] = (plan, index)
    return index


def _iteration_roles(plan: DraftPlan | None, width: int) -> np.ndarray:
    """The roles of one decode iteration's `width` passes: the verify pass (the decode pass
    without speculation) and, around it, the drafter's (draft steps or n-gram's host lookup
    before, the draft-extend after)."""
    role = np.full(width, ROLE_DRAFT)
    role[verify_column(plan, width)] = ROLE_VERIFY
    return role


def _overhead_host_s(profile: GpuProfile, passes: Passes) -> np.ndarray:
    """Each pass's host time that is overhead (`physics.host_time_s`: launches and a
    speculative step's bookkeeping): none for a host-only pass (n-gram's lookup, which is
    drafting)."""
    return np.where(passes.layers > 0, host_time_s(profile, passes), 0.0)


def _fixed_roles(
    planned: _FixedRound, plan: DraftPlan | None, profile: GpuProfile
) -> tuple[np.ndarray, np.ndarray]:
    """The fixed-batch round's passes' roles and overhead host time (`_overhead_host_s`),
    made once per planned round and kept with it (as `_verify_passes` is)."""
    known = planned.__dict__.get("_roles")
    if known is not None and known[0] is plan and known[1] is profile:
        return known[2]
    n_decode = sum(len(p) for p in planned.phases[1:])
    decode = (
        np.tile(_iteration_roles(plan, planned.width), n_decode // planned.width)
        if planned.width
        else np.zeros(0, dtype=np.int64)
    )
    role = np.concatenate([np.full(planned.n_prefill, ROLE_PREFILL), decode])
    host = np.concatenate([_overhead_host_s(profile, p) for p in planned.phases])
    planned.__dict__["_roles"] = (plan, profile, (role, host))
    return role, host


@dataclass
class _LastRepeat:
    """What a repeater found last. The round planned, with the drafter's plan and the cache
    it was found in, and its key there: while the server is the same one and the round still
    in its cache, `_fixed_round` would find that key again (the prompts' lengths and the
    acceptance follow from the workload and the plan alone) and that round. And the (round,
    schedule) whose chunk times passed the check: it compares differences of times alone, so
    the same schedule from any instant passes it again."""

    plan: DraftPlan | None = None
    rounds: OrderedDict[tuple[object, ...], _FixedRound] | None = None
    key: tuple[object, ...] = ()
    planned: _FixedRound | None = None
    checked: _FixedRound | None = None
    checked_schedule: Schedule | None = None


def _wait_until(clock: Clock, end_ns: int) -> None:
    """Let the simulated work finish: jump there in virtual time, sleep in real time."""
    remaining_s = (end_ns - clock.now_ns()) * 1e-9
    if remaining_s > 0:
        clock.sleep(remaining_s)


def _server_figure(emitted: np.ndarray, plan: DraftPlan | None) -> tuple[float | None, float]:
    """`_server_figure_of_iterations` of a fixed batch's tokens (requests x iterations, 0
    where a request no longer runs)."""
    return _server_figure_of_iterations(
        emitted.sum(axis=0), np.count_nonzero(emitted, axis=0), plan
    )


def _server_figure_of_iterations(
    emitted: np.ndarray, active: np.ndarray, plan: DraftPlan | None
) -> tuple[float | None, float]:
    """What SGLang's /server_info reports after a round, and the share of the round's decode
    iterations it covers: tokens per verify pass (the prefill token is no verify pass's),
    pooled over the whole blocks of `DECODE_LOG_INTERVAL` iterations only (SGLang adds a
    block once it is complete; `dvfs.engines.base.server_accept_covers`). `emitted`,
    `active`: each decode iteration's tokens and requests. None before a whole block."""
    iterations = len(emitted)
    covered = iterations - iterations % DECODE_LOG_INTERVAL
    steps = float(np.sum(active[:covered]))
    if plan is None or not covered or not steps:
        return None, 0.0
    return float(np.sum(emitted[:covered])) / steps, covered / iterations
