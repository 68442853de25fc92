"""A pass's attention FLOPs (`Passes.attention_flops`, which the weight GEMMs' tile and wave
quantisation does not stretch) are on the same footing as its FLOPs: one GPU's share of a TP
group, part of `flops`, the rest the weight GEMMs' 2 P M / tp, for every pass the twin counts
(prefill chunks, plain decode, the drafters' steps, DFLASH's block, the draft-extend and the
verify pass), every model profile (GQA, MLA, sliding-window, MoE) and TP size."""

from __future__ import annotations

import numpy as np
import pytest

from dvfs.twin import physics, traps
from dvfs.twin.drafting import DraftPlan
from dvfs.twin.passes import PassBuilder, decode_passes, prefill_passes, verify_column
from dvfs.twin.profiles import ModelProfile, gpu_profile, model_profile, model_profiles

H100 = traps.without(gpu_profile("h100-sxm"))
TARGETS = ["llama-3.1-8b", "llama-3.1-70b", "deepseek-v2-lite", "gemma-2-9b"]
EAGLE3 = model_profile("eagle3-llama-3.1-8b")
DFLASH = model_profile("dflash-llama-3.1-8b-b16")
SMALL = model_profile("llama-3.2-1b")
PLANS: dict[str, DraftPlan | None] = {
    "none": None,
    "eagle3": DraftPlan("EAGLE3", "eagle3", 5, 4, 8, 5, EAGLE3),
    "dflash": DraftPlan("DFLASH", "dflash", 1, 1, 16, 15, DFLASH),
    "standalone": DraftPlan("STANDALONE", "standalone", 4, 1, 5, 4, SMALL),
    "ngram": DraftPlan("NGRAM", "ngram", 0, 1, 12, 11, None),
}


def decoded(model: ModelProfile, plan: DraftPlan | None, tp: int) -> tuple[physics.Passes, int]:
    """Three decode iterations (batch 1, 7 and 64; contexts 1, 900 and 20,000 tokens; none,
    some and many tokens emitted), as the twin counts them."""
    active = np.array([1.0, 7.0, 64.0])
    context = np.array([1.0, 900.0, 20_000.0])
    builder = PassBuilder(tp)
    width = decode_passes(
        builder,
        model,
        plan,
        active,
        active * context,
        model.kv_bytes_read(context) * active,
        context,
        np.array([0.0, 9.0, 200.0]),
    )
    return physics.Passes.concat(builder.parts), width


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("name", TARGETS)
def test_a_prefill_chunks_attention_flops_are_its_own_share_of_its_flops(
    name: str, tp: int
) -> None:
    model = model_profile(name)
    builder = PassBuilder(tp)
    # prompts ending in the first chunk, across a chunk's end, and one in a last chunk of 6
    prefill_passes(builder, model, np.array([1, 63, 5000, 8198, 3000]))
    passes = physics.Passes.concat(builder.parts)
    assert np.all(passes.attention_flops >= 0)
    assert np.all(passes.attention_flops <= passes.flops)
    assert np.sum(passes.attention_flops) > 0
    gemm = 2.0 * model.active_matmul_params * passes.tokens / tp
    np.testing.assert_allclose(passes.flops - passes.attention_flops, gemm, rtol=1e-12)


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("name", TARGETS)
def test_every_decode_pass_counts_its_attention_on_its_flops_footing(
    name: str, plan_name: str, tp: int
) -> None:
    """The verify pass (the target's), and each drafter pass (the draft model's): attention
    FLOPs of `flops`, per GPU, what is left the pass's weight GEMMs over its M; an n-gram
    lookup none at all. The stretch `time_passes` applies lies between 1 (all attention) and
    the weight GEMMs' own (no attention)."""
    model = model_profile(name)
    plan = PLANS[plan_name]
    passes, width = decoded(model, plan, tp)
    assert len(passes) == 3 * width
    column = np.arange(len(passes)) % width
    verify = column == verify_column(plan, width)
    drafter = plan.draft_model if plan is not None else None
    params = np.where(
        verify, model.active_matmul_params, 0.0 if drafter is None else drafter.active_matmul_params
    )
    attention, flops = passes.attention_flops, passes.flops
    assert np.all(attention >= 0)
    assert np.all(attention <= flops)
    assert np.all(attention[verify] > 0)  # every iteration attends to at least one token
    gemm = 2.0 * params * passes.tokens / tp
    np.testing.assert_allclose(flops - attention, gemm, rtol=1e-12, atol=0)
    # the verify pass's attention: its tokens' at the mean context, per GPU
    k = 1 if plan is None else plan.verify_tokens
    mean_ctx = np.array([1.0, 900.0, 20_000.0])
    expected = model.attention_flops_per_token(mean_ctx) * np.array([1.0, 7.0, 64.0]) * k / tp
    np.testing.assert_allclose(attention[verify], expected, rtol=1e-12)
    stretch = physics._pass_terms(H100, passes).stretch
    gemm_stretch = H100.gemm_efficiency / physics.gemm_efficiency(H100, passes.tokens)
    worked = flops > 0
    assert np.all(stretch[worked] >= 1.0)
    assert np.all(stretch[worked] <= gemm_stretch[worked] * (1 + 1e-12))
    if plan is not None and plan.family == "ngram":
        assert not np.any(attention[~verify])


def test_every_model_profile_has_its_attention_counted() -> None:
    """No model profile slips through: the tests above take each target, and the drafters'
    profiles are the draft models of their plans."""
    used = {*TARGETS, "eagle3-llama-3.1-8b", "dflash-llama-3.1-8b-b16", "llama-3.2-1b"}
    assert set(model_profiles()) <= used


def test_passes_that_differ_only_in_their_attention_share_are_timed_and_capped_apart() -> None:
    """What is remembered of a pass sequence (`_pass_terms` by identity, a short phase's capped
    point by content) is keyed on its attention FLOPs too: the same FLOPs at M = 4, all weight
    GEMMs' or 90% attention's, take different times and clocks whichever is timed first."""
    n = 3
    one = np.ones(n)
    limit_w = 150.0  # both draw more at 1980 MHz (200 and 370 W)
    flops, tokens = 2.0e13 * one, 4.0 * one
    gemms = physics.Passes(flops, 1.0e8 * one, 0 * one, 0 * one, 0 * one, tokens=tokens)
    mostly_attention = physics.Passes(
        flops, 1.0e8 * one, 0 * one, 0 * one, 0 * one, tokens=tokens, attention_flops=0.9 * flops
    )
    assert physics._content(gemms) != physics._content(mostly_attention)
    fresh = {
        name: physics._capped_point(
            H100,
            physics.Passes(*(getattr(p, f).copy() for f in physics.Passes.__dataclass_fields__)),
            np.arange(n),
            1980,
            limit_w,
        )
        for name, p in (("gemms", gemms), ("attention", mostly_attention))
    }
    for order in (("gemms", "attention"), ("attention", "gemms")):
        physics._remembered_cap.cache_clear()
        for name in order:
            passes = gemms if name == "gemms" else mostly_attention
            # copies: nothing remembered by identity carries over between the orders
            passes = physics.Passes(
                *(getattr(passes, f).copy() for f in physics.Passes.__dataclass_fields__)
            )
            point = physics.operating_point(H100, passes, 1980, limit_w)
            assert point.power_capped
            np.testing.assert_array_equal(
                point.timing.duration_s, fresh[name].timing.duration_s, err_msg=str(order)
            )
    assert np.all(
        fresh["attention"].timing.duration_s < fresh["gemms"].timing.duration_s
    )  # 90% of the FLOPs unpadded: a shorter pass
