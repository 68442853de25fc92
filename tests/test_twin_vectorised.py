"""The twin's whole-array round against straightforward references kept here: the pass
counts column by column, the power-cap search by bisection, the traces request by request,
and the step-by-step simulator. Equal means bit-equal: the twin is deterministic."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.campaign.model import DrafterSpec
from dvfs.clock import VirtualClock
from dvfs.corpora import load_corpus, sample_prompts
from dvfs.corpora.sampling import stable_seed
from dvfs.engines.base import RequestTrace, RoundResult, Workload, check_chunks
from dvfs.engines.twin import TwinEngine
from dvfs.twin import physics, traps
from dvfs.twin.device import TwinDevice, TwinNode
from dvfs.twin.drafting import DraftPlan, draws, plan_drafter
from dvfs.twin.passes import (
    DRAFT_LAUNCH_SHARE,
    PassBuilder,
    decode_passes,
    prefill_passes,
    verify_column,
)
from dvfs.twin.physics import OperatingPoint, Passes, PassTiming, Schedule
from dvfs.twin.profiles import GpuProfile, gpu_profile, model_profile
from dvfs.twin.textprior import profile_prompts

H100 = gpu_profile("h100-sxm")
LLAMA8B = model_profile("llama-3.1-8b")
DRAFTERS = {
    "none": DrafterSpec("none"),
    "eagle3": DrafterSpec("eagle3", "EAGLE3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 5, 4, 8),
    "standalone": DrafterSpec(
        "standalone", "STANDALONE", "meta-llama/Llama-3.2-1B-Instruct", 4, 1, 5
    ),
    "ngram": DrafterSpec("ngram", "NGRAM", num_draft_tokens=12),
    "dflash": DrafterSpec(
        "dflash", "DFLASH", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", num_draft_tokens=16
    ),
}
PLANS = {name: plan_drafter(spec, LLAMA8B) for name, spec in DRAFTERS.items()}


# -- references ---------------------------------------------------------------------------------
def reference_decode(
    tp: int,
    plan: DraftPlan | None,
    active: np.ndarray,
    ctx_sum: np.ndarray,
    ctx_kv: np.ndarray,
    mean_ctx: np.ndarray,
    emitted: np.ndarray,
) -> tuple[Passes, int]:
    """Decode passes one column (draft step, verify, extend) at a time, then interleaved."""
    builder = PassBuilder(tp)
    k = plan.verify_tokens if plan else 1
    if plan is not None and plan.family == "ngram":
        builder.add_host(len(active))
    elif plan is not None and plan.draft_model is not None:
        draft = plan.draft_model
        kv = draft.kv_bytes_read(mean_ctx) * active
        per_token = draft.attention_flops_per_token(mean_ctx)
        launch = DRAFT_LAUNCH_SHARE
        if plan.family == "dflash":
            builder.add(draft, active * k, kv, per_token * active * k, active * k, launch)
        else:
            for step in range(plan.num_steps):
                tokens = active * (plan.topk if step > 0 else 1)
                builder.add(
                    draft, tokens, kv, per_token * tokens, tokens, launch if step == 0 else 0
                )
    verify = active * k
    # A verify pass writes the KV of every token it verifies; a speculative one also reads
    # its KV through the custom-mask attention and carries the host's per-request bookkeeping.
    builder.add(
        LLAMA8B, verify, ctx_kv, LLAMA8B.attention_flops_per_token(mean_ctx) * verify, verify
    )
    if plan is not None and k > 1:
        builder.parts[-1] = replace(
            builder.parts[-1], verify_kv_bytes=ctx_kv / tp, spec_requests=active, spec_tokens=verify
        )
    if plan is not None and plan.draft_model is not None and plan.family != "dflash":
        draft = plan.draft_model
        builder.add(
            draft,
            np.maximum(emitted, 1),
            draft.kv_bytes_read(mean_ctx) * active,
            draft.attention_flops_per_token(mean_ctx) * emitted,
            emitted,
            DRAFT_LAUNCH_SHARE,
        )
    parts = builder.parts
    names = [f.name for f in fields(Passes)]
    interleaved = Passes(
        *(np.stack([getattr(p, n) for p in parts], axis=1).reshape(-1) for n in names)
    )
    return interleaved, len(parts)


def bisect_operating_point(
    gpu: GpuProfile, passes: Passes, requested: int, limit_w: float
) -> OperatingPoint:
    """The power-cap search one pass and one `time_passes` call at a time: each pass at the
    highest clock where its own power fits the limit."""
    timing = physics.time_passes(gpu, passes, requested)
    if len(passes) == 0 or timing.power_w.max() <= limit_w:
        return OperatingPoint(int(requested), False, timing)
    clocks = sorted(c for c in gpu.supported_sm_clocks_mhz() if c <= requested)
    chosen = []
    for i in range(len(passes)):
        one = passes.slice(i, i + 1)
        if physics.time_passes(gpu, one, requested).power_w[0] <= limit_w:
            chosen.append(float(requested))
            continue
        lo, hi, best = 0, len(clocks) - 1, clocks[0]
        while lo <= hi:
            mid = (lo + hi) // 2
            if physics.time_passes(gpu, one, clocks[mid]).power_w[0] <= limit_w:
                best, lo = clocks[mid], mid + 1
            else:
                hi = mid - 1
        chosen.append(float(best))
    capped = physics.time_passes(gpu, passes, np.array(chosen))
    return OperatingPoint(int(capped.sm_clock_mhz), True, capped)


def reference_round(
    devices: list[TwinDevice], plan: DraftPlan | None, workload: Workload, t0: int, alpha: float
) -> RoundResult:
    """A fixed-batch round request by request, each trace checked by its own constructor."""
    depth = plan.depth if plan else 0
    rng = np.random.default_rng(stable_seed("twin", workload.seed))
    batch = workload.batch
    lengths = np.array([p.input_tokens for p in workload.prompts], dtype=np.int64)
    remaining = workload.max_new_tokens - 1
    builder = PassBuilder(len(devices))
    done_chunk = prefill_passes(builder, LLAMA8B, lengths)
    prefill = builder.parts[0]
    drawn = draws(rng, (batch, max(1, remaining)), alpha, depth)
    emitted_rows = []
    for i in range(batch):  # token by token: each request runs until it has `remaining`
        row, total = [], 0
        for d in drawn[i]:
            if total >= remaining:
                break
            row.append(min(int(d), remaining - total))
            total += row[-1]
        emitted_rows.append(row)
    n_iter = max(len(r) for r in emitted_rows) if remaining > 0 else 0
    emitted = np.zeros((batch, n_iter), dtype=np.int64)
    for i, row in enumerate(emitted_rows):
        emitted[i, : len(row)] = row
    before = np.cumsum(emitted, axis=1) - emitted
    is_active = before < remaining
    active = is_active.sum(axis=0).astype(float)
    context = lengths[:, None] + 1 + before
    ctx_sum = np.where(is_active, context, 0).sum(axis=0).astype(float)
    ctx_kv = np.where(is_active, LLAMA8B.kv_bytes_read(context), 0.0).sum(axis=0)
    mean_ctx = ctx_sum / np.maximum(active, 1.0)
    decode, width = reference_decode(
        len(devices), plan, active, ctx_sum, ctx_kv, mean_ctx, emitted.sum(axis=0).astype(float)
    )
    if not n_iter:
        decode, width = prefill.slice(0, 0), 0
    split = int(np.sum(active == batch)) * width
    timings: list[PassTiming] = []
    for phase in (prefill, decode.slice(0, split), decode.slice(split)):
        if len(phase):
            points = [
                bisect_operating_point(d.profile, phase, d.requested_clock_mhz(), d.power_limit_w)
                for d in devices
            ]
            timings.append(min(points, key=lambda p: p.sm_clock_mhz).timing)
    durations = np.concatenate([t.duration_s for t in timings])
    ends_ns = t0 + np.cumsum(np.round(durations * 1e9)).astype(np.int64)
    first_ns = ends_ns[: len(prefill)][done_chunk]
    iter_ns = ends_ns[len(prefill) + np.arange(n_iter) * width + verify_column(plan, width)]
    requests = []
    for i in range(batch):
        mask = emitted[i] > 0
        chunk_ns = np.concatenate([[first_ns[i]], iter_ns[mask]]).astype(np.int64)
        chunk_tokens = np.concatenate([[1], emitted[i][mask]]).astype(np.int64)
        verifies = int(mask.sum())
        requests.append(
            RequestTrace(
                sent_ns=t0,
                chunk_ns=chunk_ns,
                chunk_tokens=chunk_tokens,
                prompt_tokens=int(lengths[i]),
                completion_tokens=int(chunk_tokens.sum()),
                finish_reason="length",
                spec_verify_ct=verifies if plan else None,
                spec_accepted_drafts=int(emitted[i].sum()) - verifies if plan else None,
                spec_proposed_drafts=verifies * (plan.verify_tokens - 1) if plan else None,
            )
        )
    # What /server_info says: the request steps of the whole blocks of 40 iterations only.
    covered = n_iter - n_iter % 40
    steps = int(np.count_nonzero(emitted[:, :covered]))
    accept = int(emitted[:, :covered].sum()) / steps if plan and steps else None
    covers = covered / n_iter if accept is not None else 0.0
    return RoundResult(tuple(requests), t0, int(ends_ns[-1]), accept, server_accept_covers=covers)


# -- helpers ------------------------------------------------------------------------------------
def node(tp: int, clock_mhz: int | None, limit_w: float) -> list[TwinDevice]:
    clock = VirtualClock()
    # Trap-free: a knob change shows at once and leakage does not move the cap, so a device
    # that just changed knobs and a fresh one run the same round.
    devices = [TwinDevice(traps.without(H100), clock, i) for i in range(tp)]
    for d in devices:
        d.locked_mhz = None if clock_mhz is None else (clock_mhz, clock_mhz)
        d.power_limit_w = limit_w
    return devices


def assert_same_round(got: RoundResult, want: RoundResult) -> None:
    assert (got.started_ns, got.ended_ns) == (want.started_ns, want.ended_ns)
    assert got.server_accept_length == want.server_accept_length
    assert got.server_accept_covers == want.server_accept_covers
    assert len(got.requests) == len(want.requests)
    for g, w in zip(got.requests, want.requests, strict=True):
        for f in fields(RequestTrace):
            a, b = getattr(g, f.name), getattr(w, f.name)
            if isinstance(b, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b), f.name
            else:
                assert a == b and type(a) is type(b), f.name


def workload(batch: int, corpus: str, tokens: int, seed: int) -> Workload:
    prompts = sample_prompts(load_corpus(corpus), batch, input_tokens=(16, 2048), seed=seed)
    return Workload(batch, prompts, corpus, tokens, 0.0, True, "fixed", seed=seed)


# -- pass counting ------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    drafter=st.sampled_from(sorted(DRAFTERS)),
    tp=st.sampled_from([1, 2, 4]),
    n_iter=st.integers(1, 40),
    batch=st.integers(1, 64),
    seed=st.integers(0, 2**32 - 1),
)
def test_decode_passes_equal_a_column_by_column_count(drafter, tp, n_iter, batch, seed) -> None:
    rng = np.random.default_rng(seed)
    active = np.sort(rng.integers(1, batch + 1, n_iter))[::-1].astype(float)
    mean_ctx = rng.uniform(16, 4096, n_iter)
    ctx_sum = mean_ctx * active
    ctx_kv = LLAMA8B.kv_bytes_read(mean_ctx) * active
    emitted = active * rng.integers(1, 8, n_iter)
    plan = PLANS[drafter]
    builder = PassBuilder(tp)
    width = decode_passes(builder, LLAMA8B, plan, active, ctx_sum, ctx_kv, mean_ctx, emitted)
    want, want_width = reference_decode(tp, plan, active, ctx_sum, ctx_kv, mean_ctx, emitted)
    assert width == want_width
    for f in fields(Passes):
        assert np.array_equal(getattr(builder.parts[0], f.name), getattr(want, f.name)), f.name


# -- power-cap search ---------------------------------------------------------------------------
def some_passes(n: int, batch: int, context: float) -> Passes:
    builder = PassBuilder(1)
    tokens = np.full(n, float(batch)) * np.linspace(1.0, 3.0, n)
    ctx = np.full(n, context) + np.arange(n)
    builder.add(
        LLAMA8B,
        tokens,
        LLAMA8B.kv_bytes_read(ctx) * batch,
        LLAMA8B.attention_flops_per_token(ctx) * tokens,
        tokens,
    )
    return builder.parts[0]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    batch=st.integers(1, 512),
    context=st.floats(16, 8192),
    requested=st.sampled_from(list(H100.supported_sm_clocks_mhz())),
    limit_w=st.floats(60.0, 800.0),
)
def test_batched_power_cap_search_equals_bisection(n, batch, context, requested, limit_w) -> None:
    passes = some_passes(n, batch, context)
    got = physics.operating_point(H100, passes, requested, limit_w)
    want = bisect_operating_point(H100, passes, requested, limit_w)
    assert (got.sm_clock_mhz, got.power_capped) == (want.sm_clock_mhz, want.power_capped)
    assert np.array_equal(got.timing.duration_s, want.timing.duration_s)
    assert np.array_equal(got.timing.power_w, want.timing.power_w)
    lowest = min(H100.supported_sm_clocks_mhz())
    at_floor = got.timing.pass_clocks_mhz == lowest
    assert np.all((got.timing.power_w <= limit_w) | at_floor)  # every pass, not the average


def test_a_limit_exactly_at_a_clocks_power_keeps_that_clock() -> None:
    """Ties are where batched sums and `time_passes` could disagree by rounding."""
    passes = some_passes(700, 64, 1500.0)
    for clock in (705, 1200, 1650):
        limit = physics.time_passes(H100, passes, clock).power_w.max()
        got = physics.operating_point(H100, passes, 1980, limit)
        assert got.sm_clock_mhz == bisect_operating_point(H100, passes, 1980, limit).sm_clock_mhz
        assert got.timing.pass_clocks_mhz.min() >= clock


# -- whole rounds ---------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize(
    ("tp", "clock_mhz", "limit_w", "batch", "tokens"),
    [
        (1, None, 700.0, 16, 256),
        (1, 1530, 250.0, 64, 256),
        (2, 1980, 300.0, 4, 33),
        (1, 900, 700.0, 1, 1),
    ],
)
def test_a_round_equals_the_request_by_request_reference(
    drafter, tp, clock_mhz, limit_w, batch, tokens
) -> None:
    devices = node(tp, clock_mhz, limit_w)
    engine = TwinEngine(TwinNode(devices), LLAMA8B)
    engine.start(DRAFTERS[drafter])
    for corpus, seed in (("code", 3), ("romansh", 11)):
        w = workload(batch, corpus, tokens, seed)
        t0 = devices[0].clock.now_ns()
        plan = PLANS[drafter]
        alpha = plan.alpha(profile_prompts(w.prompts), 0.0) if plan else 0.0
        want = reference_round(devices, plan, w, t0, alpha)
        assert_same_round(engine.run(w), want)


def test_a_round_without_drafts_equals_the_step_by_step_simulator() -> None:
    """The closed-loop simulator given exactly `batch` prompts, all run to length, steps
    through the same passes one iteration at a time (in one phase: so no binding limit)."""
    for batch in (1, 7, 32):
        w = workload(batch, "math", 120, batch)
        fixed, stepped = (TwinEngine(TwinNode(node(1, None, 1e6)), LLAMA8B) for _ in range(2))
        for e in (fixed, stepped):
            e.start(DRAFTERS["none"])
        assert_same_round(fixed.run(w), stepped.run(replace(w, mode="closed-loop")))


def test_a_remembered_round_is_the_round_a_fresh_engine_runs() -> None:
    """Rounds that differ only in knobs reuse the planned tokens and passes; the result must be
    what an engine that never saw the workload computes."""
    w = workload(16, "english", 200, 5)
    devices = node(1, 1980, 700.0)
    engine = TwinEngine(TwinNode(devices), LLAMA8B)
    engine.start(DRAFTERS["eagle3"])
    runs = []
    for clock_mhz, limit_w in ((1980, 700.0), (1200, 700.0), (1980, 260.0), (1980, 700.0)):
        devices[0].locked_mhz, devices[0].power_limit_w = (clock_mhz, clock_mhz), limit_w
        got = engine.run(w)
        fresh_devices = node(1, clock_mhz, limit_w)
        fresh_devices[0].clock.sleep((got.started_ns - fresh_devices[0].clock.now_ns()) * 1e-9)
        fresh = TwinEngine(TwinNode(fresh_devices), LLAMA8B, startup_s=0.0)
        fresh.start(DRAFTERS["eagle3"])
        assert_same_round(got, fresh.run(w))
        runs.append(got)
    assert runs[0].ended_ns - runs[0].started_ns < runs[1].ended_ns - runs[1].started_ns
    # The same prompts and seed at another temperature accept fewer drafts: not the same round.
    warm = engine.run(replace(w, temperature=0.7))
    fresh = TwinEngine(TwinNode(node(1, 1980, 700.0)), LLAMA8B)
    fresh.start(DRAFTERS["eagle3"])
    cold = fresh.run(replace(w, temperature=0.7))
    assert warm.server_accept_length is not None and runs[-1].server_accept_length is not None
    assert warm.server_accept_length == cold.server_accept_length
    assert warm.server_accept_length < runs[-1].server_accept_length


def test_traces_are_read_only_views() -> None:
    engine = TwinEngine(TwinNode(node(1, None, 700.0)), LLAMA8B)
    engine.start(DRAFTERS["ngram"])
    trace = engine.run(workload(4, "code", 64, 1)).requests[0]
    with pytest.raises(ValueError):
        trace.chunk_ns[0] = 0
    with pytest.raises(ValueError):
        trace.chunk_tokens[0] = 5


# -- checks once per round ----------------------------------------------------------------------
def test_check_chunks_refuses_what_the_trace_constructor_refuses() -> None:
    ns = np.array([[10, 20, 30], [10, 15, 0]], dtype=np.int64)
    tokens = np.array([[1, 2, 3], [1, 4, 0]], dtype=np.int64)
    counts, completion = np.array([3, 2]), np.array([6, 5])
    check_chunks(ns, tokens, counts, completion)  # the unused tail may hold anything in time
    with pytest.raises(ValueError, match="backwards"):
        check_chunks(ns, tokens, np.array([3, 3]), np.array([6, 5]))
    with pytest.raises(ValueError, match="token count"):
        check_chunks(ns, tokens, counts, np.array([6, 4]))
    with pytest.raises(ValueError, match="shape"):
        check_chunks(ns, tokens[:, :2], counts, completion)
    with pytest.raises(ValueError):
        RequestTrace(0, ns[1], tokens[1], 5, 5)


class BackwardsNode(TwinNode):
    """A node whose last pass ends a second before it starts: a bug the round check catches."""

    def execute(self, *phases: Passes) -> Schedule:
        schedule = super().execute(*phases)
        last = schedule.points[-1]
        durations = last.timing.duration_s.copy()
        durations[-1] = -1.0
        broken = replace(last, timing=replace(last.timing, duration_s=durations))
        return Schedule((*schedule.points[:-1], broken))


def test_a_round_whose_chunks_go_backwards_is_refused() -> None:
    engine = TwinEngine(BackwardsNode(node(1, None, 700.0)), LLAMA8B)
    engine.start(DRAFTERS["none"])
    with pytest.raises(ValueError, match="backwards"):
        engine.run(workload(4, "code", 32, 2))


def test_a_trusted_trace_is_a_checked_trace() -> None:
    args = (5, np.array([7, 9]), np.array([1, 3]), 12, 4, "length", 1, 2, 7)
    trusted, checked = RequestTrace.trusted(*args), RequestTrace(*args)
    for f in fields(RequestTrace):
        a, b = getattr(trusted, f.name), getattr(checked, f.name)
        assert np.array_equal(a, b) if isinstance(b, np.ndarray) else a == b
    assert (trusted.first_token_ns, trusted.finished_ns) == (7, 9)


# -- closed loop ----------------------------------------------------------------------------------
def reference_closed_loop(engine: TwinEngine, w: Workload) -> list[tuple]:
    """The closed-loop round as the twin ran it before its iterations were counted at once:
    slot by slot, request by request, `decode_passes` once per iteration. Returns each
    request's (sent, chunk instants, chunk tokens, finish, verify count)."""
    from dvfs.engines.twin import ABORTED

    clock = engine.node.clock
    t0 = clock.now_ns()
    rng = np.random.default_rng(stable_seed("twin-closed", w.seed))
    alpha, depth = engine._acceptance(w)
    pool = list(w.prompts)
    mean = max(2.0, w.max_new_tokens / 2)
    targets = np.clip(
        rng.exponential(mean, size=len(pool)).astype(np.int64) + 2, 2, w.max_new_tokens
    )
    if w.ignore_eos:
        targets[:] = w.max_new_tokens
    slot_req, next_req = [-1] * w.batch, 0
    produced = np.zeros(len(pool), dtype=np.int64)
    verify_ct = np.zeros(len(pool), dtype=np.int64)
    sent_pass = np.full(len(pool), -1)
    chunks: list[list[tuple[int, int]]] = [[] for _ in pool]
    builder = PassBuilder(engine.node.tp_size)
    pass_index = 0
    while True:
        admitted = []
        for s in range(w.batch):
            if slot_req[s] == -1 and next_req < len(pool):
                slot_req[s] = next_req
                admitted.append(next_req)
                next_req += 1
        running = [r for r in slot_req if r != -1]
        if not running:
            break
        if admitted:
            lengths = np.array([pool[r].input_tokens for r in admitted], dtype=np.int64)
            sent_at, first = pass_index - 1, len(builder.parts)
            prefill_passes(builder, engine.model, lengths)
            pass_index += sum(len(p) for p in builder.parts[first:])
            for r in admitted:
                sent_pass[r], produced[r] = sent_at, 1
                chunks[r].append((pass_index - 1, 1))
        decoding = [r for r in running if r not in admitted and produced[r] < targets[r]]
        if decoding:
            idx = np.array(decoding)
            got = np.minimum(draws(rng, (len(idx),), alpha, depth), targets[idx] - produced[idx])
            context = np.array([pool[r].input_tokens for r in idx]) + produced[idx]
            active = np.array([float(len(idx))])
            ctx_sum = np.array([float(context.sum())])
            width = decode_passes(
                builder,
                engine.model,
                engine._plan,
                active,
                ctx_sum,
                np.array([float(np.sum(engine.model.kv_bytes_read(context)))]),
                ctx_sum / active,
                np.array([float(got.sum())]),
            )
            verify_pass = pass_index + verify_column(engine._plan, width)
            pass_index += width
            for r, g in zip(idx, got, strict=True):
                produced[r] += g
                verify_ct[r] += 1
                chunks[r].append((verify_pass, int(g)))
        freed = False
        for s in range(w.batch):
            r = slot_req[s]
            if r != -1 and produced[r] >= targets[r]:
                slot_req[s], freed = -1, True
        if w.end_at_window and freed and next_req >= len(pool):
            break
    ends_ns = t0 + engine.node.execute(Passes.concat(builder.parts)).ends_ns
    out = []
    for r in range(len(pool)):
        if chunks[r]:
            finished = (
                ABORTED
                if produced[r] < targets[r]
                else ("length" if produced[r] >= w.max_new_tokens else "stop")
            )
            sent = t0 if sent_pass[r] < 0 else int(ends_ns[sent_pass[r]])
            at = [int(ends_ns[p]) for p, _ in chunks[r]]
            out.append((sent, at, [n for _, n in chunks[r]], finished, int(verify_ct[r])))
    return out


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize(
    ("tp", "clock_mhz", "batch", "pool", "tokens", "ignore_eos", "end_at_window"),
    [
        (1, None, 16, 40, 96, False, True),
        (1, 1005, 4, 13, 64, False, False),
        (2, 1530, 1, 5, 33, True, True),
        (1, 1980, 32, 32, 20, False, False),
    ],
)
def test_a_closed_loop_round_equals_the_iteration_by_iteration_reference(
    drafter, tp, clock_mhz, batch, pool, tokens, ignore_eos, end_at_window
) -> None:
    prompts = sample_prompts(load_corpus("conversation"), pool, input_tokens=(16, 2048), seed=5)
    w = Workload(
        batch, prompts, "conversation", tokens, 0.0, ignore_eos, "closed-loop", 7, end_at_window
    )
    engines = [TwinEngine(TwinNode(node(tp, clock_mhz, 700.0)), LLAMA8B) for _ in range(2)]
    for e in engines:
        e.start(DRAFTERS[drafter])
    want = reference_closed_loop(engines[1], w)
    got = engines[0].run(w)
    assert len(got.requests) == len(want) > 0
    for trace, (sent, at, tokens_each, finished, verifies) in zip(got.requests, want, strict=True):
        assert trace.sent_ns == sent and trace.chunk_ns.tolist() == at
        assert trace.chunk_tokens.tolist() == tokens_each and trace.finish_reason == finished
        assert (trace.spec_verify_ct or 0) == (verifies if drafter != "none" else 0)


def test_a_short_capped_phase_is_remembered_by_its_content() -> None:
    """Two rounds' equal prefill passes (distinct objects) share one power-cap search, with
    the bisection's numbers; passes that differ in one number get their own."""
    limit_w = 300.0
    first = physics.operating_point(H100, some_passes(2, 4096, 64.0), 1980, limit_w)
    same = some_passes(2, 4096, 64.0)
    again = physics.operating_point(H100, same, 1980, limit_w)
    assert first.power_capped and again is first
    want = bisect_operating_point(H100, same, 1980, limit_w)
    assert again.sm_clock_mhz == want.sm_clock_mhz
    assert np.array_equal(again.timing.power_w, want.timing.power_w)
    assert np.array_equal(again.timing.duration_s, want.timing.duration_s)
    assert not again.timing.power_w.flags.writeable  # shared: nobody may change it
    names = Passes.__dataclass_fields__
    other = Passes(*(getattr(same, f) * (1.01 if f == "flops" else 1) for f in names))
    got = physics.operating_point(H100, other, 1980, limit_w)
    assert got is not first
    assert np.array_equal(
        got.timing.power_w, bisect_operating_point(H100, other, 1980, limit_w).timing.power_w
    )
