"""The speculative iteration's real costs (issue 13): the twin's speedup and energy per token
against batch size, next to the published SGLang table (dvfs/twin/data/published.toml).

Each number comes from one steady decode iteration of the twin's own passes (`decode_passes`,
every request running, acceptance at its expectation), timed and powered by its physics at the
operating point the power limit allows: what a served batch kept full by a queue settles to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner
from cubes import make_cube
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.analysis.roofline import roofline
from dvfs.cli import cli
from dvfs.errors import CampaignError
from dvfs.twin import physics, traps
from dvfs.twin.drafting import plan_drafter
from dvfs.twin.fit import achievable_ridge_point
from dvfs.twin.passes import PassBuilder, decode_passes, verify_column
from dvfs.twin.profiles import (
    accept_probability,
    expected_accept_length,
    gpu_profile,
    model_profile,
    published_tables,
)

H100 = traps.without(gpu_profile("h100-sxm"))
LLAMA8B = model_profile("llama-3.1-8b")
TABLE = published_tables()["eagle3-paper-table3"]
#: MT-bench: prompts of ~100 tokens, answers of a few hundred: a 512-token context (INF).
CONTEXT = 512.0
CLOCKS = list(H100.supported_sm_clocks_mhz())


@dataclass(frozen=True)
class Drafter:
    """A drafter's SGLang settings (`dvfs.twin.drafting.DrafterSettings`)."""

    algorithm: str | None = None
    draft_model: str | None = None
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None


NONE = Drafter()
#: The published table's chain: 3 draft steps, top-1, 4 verified tokens per request.
CHAIN = {"num_steps": TABLE["num_steps"], "eagle_topk": TABLE["eagle_topk"]}
EAGLE3_CHAIN = Drafter("EAGLE3", None, **CHAIN, num_draft_tokens=TABLE["num_draft_tokens"])
EAGLE_CHAIN = Drafter("EAGLE", None, **CHAIN, num_draft_tokens=TABLE["num_draft_tokens"])
EAGLE3_TREE = Drafter("EAGLE3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 5, 4, 8)
DFLASH = Drafter("DFLASH", None, None, None, 16)


def steady_decode(plan: Any, batch: int, accepted: float) -> tuple[PassBuilder, Any]:
    """One steady decode iteration at `batch` as the twin builds it (`decode_passes`), every
    request at CONTEXT tokens of context and `accepted` tokens each: its passes and the
    verify width `decode_passes` returns."""
    active, context = np.array([float(batch)]), np.array([CONTEXT])
    builder = PassBuilder(1)
    width = decode_passes(
        builder,
        LLAMA8B,
        plan,
        active,
        active * CONTEXT,
        LLAMA8B.kv_bytes_read(context) * active,
        context,
        active * accepted,
    )
    return builder, width


def iteration(
    drafter: Drafter,
    batch: int,
    *,
    text: str = "conversation",
    clock_mhz: int = 1980,
    limit_w: float = 700.0,
) -> tuple[float, float, float]:
    """(seconds, joules, tokens) of one steady decode iteration at `batch`."""
    plan = plan_drafter(drafter, LLAMA8B)
    tau = plan.expected_accept_length(text, 0.0) if plan else 1.0
    builder, _ = steady_decode(plan, batch, tau)
    timing = physics.operating_point(H100, builder.parts[0], clock_mhz, limit_w).timing
    return timing.total_s, timing.energy_j, batch * tau


def speedup(drafter: Drafter, batch: int) -> float:
    seconds, _, tokens = iteration(drafter, batch)
    base_s, _, base_tokens = iteration(NONE, batch)
    return (tokens / seconds) / (base_tokens / base_s)


def joules_per_token(drafter: Drafter, batch: int, text: str = "conversation") -> float:
    _, joules, tokens = iteration(drafter, batch, text=text)
    return joules / tokens


def published(algorithm: str) -> dict[int, float]:
    return dict(zip(TABLE["batch"], TABLE["speedup"][algorithm], strict=True))


def test_the_tables_name_their_source_settings_and_roles() -> None:
    assert "arXiv 2503.01840" in TABLE["source"] and TABLE["gpu"] == "h100-sxm"
    assert TABLE["role"] == {"EAGLE3": "calibration", "EAGLE": "held-out"}
    assert plan_drafter(EAGLE3_CHAIN, LLAMA8B).verify_tokens == 4  # chain of 3 + bonus


def test_eagle3_speedup_falls_with_batch_like_the_calibration_table() -> None:
    """Published (SGLang, H100, Llama-3.1-8B, chain of 3): 1.81x at batch 2, ~1.3-1.4x from
    batch 24 on. Before issue 13 the twin stayed flat near 1.95x."""
    table = published("EAGLE3")
    twin = {b: speedup(EAGLE3_CHAIN, b) for b in table}
    log_error = np.array([np.log(twin[b] / table[b]) for b in table])
    assert np.sqrt(np.mean(log_error**2)) < 0.10  # the fit's residual: 0.09
    assert np.abs(log_error).max() < 0.15
    assert twin[64] < twin[2] - 0.35  # published: -0.43
    values = [twin[b] for b in sorted(twin)]
    assert all(later <= earlier + 1e-9 for earlier, later in zip(values, values[1:], strict=False))


def test_eagle1_held_out_follows_the_published_row() -> None:
    """The table's EAGLE row, never fitted: the EAGLE-1 head (full-vocabulary LM head, its
    own acceptance prior: a published chain measurement, acceptance.toml). Published: 1.40x at
    batch 2 falling to ~0.9-1.0x from batch 24 on.

    The twin matches the small batches (1.41x at 2) and the fall, but like its EAGLE-3 fit
    (+0.14 in log at batches 16-32) it falls too slowly in the middle: 1.22x against 0.93x at
    batch 24. So: RMS log error under 0.2 (0.16), every batch within 0.3, and the gain all
    but gone at batch 64 (published 0.99x)."""
    table = published("EAGLE")
    twin = {b: speedup(EAGLE_CHAIN, b) for b in table}
    log_error = np.array([np.log(twin[b] / table[b]) for b in table])
    assert np.sqrt(np.mean(log_error**2)) < 0.2
    for b in table:
        assert abs(twin[b] - table[b]) <= 0.3, b
        assert twin[b] < speedup(EAGLE3_CHAIN, b)  # below EAGLE-3 at every batch, as published
    assert abs(twin[2] - table[2]) <= 0.05  # held out, and the small batch is right
    values = [twin[b] for b in sorted(twin)]
    assert all(later <= earlier + 1e-9 for earlier, later in zip(values, values[1:], strict=False))
    assert twin[64] < 1.05


def test_speculations_saving_shrinks_as_batch_grows() -> None:
    batches = (1, 4, 16, 64)
    ratio = [joules_per_token(EAGLE3_TREE, b) / joules_per_token(NONE, b) for b in batches]
    assert ratio[0] < 0.5  # a large saving at batch 1
    assert all(later > earlier for earlier, later in zip(ratio, ratio[1:], strict=False))


def test_at_batch_64_dflash_verifies_past_the_ridge_and_costs_more_energy_per_token() -> None:
    plan = plan_drafter(DFLASH, LLAMA8B)
    assert plan is not None
    builder = PassBuilder(1)
    active, context = np.array([64.0]), np.array([CONTEXT])
    kv = LLAMA8B.kv_bytes_read(context) * active
    decode_passes(builder, LLAMA8B, plan, active, active * CONTEXT, kv, context, active * 4)
    passes = builder.parts[0]
    verify = verify_column(plan, len(passes))
    tokens = passes.tokens[verify]
    assert tokens == 64 * 16
    intensity = passes.flops[verify] / passes.bytes[verify]
    share = physics.gemm_efficiency(H100, tokens) / H100.gemm_efficiency
    ridge = achievable_ridge_point(H100, H100.max_sm_clock_mhz) * share
    assert intensity > ridge
    assert joules_per_token(DFLASH, 64) > joules_per_token(NONE, 64)


def test_a_low_acceptance_drafter_raises_energy_per_token() -> None:
    """The same head on text it drafts badly (another language) spends more per token, and at
    a large batch more than not speculating at all."""
    for batch in (1, 16, 64):
        assert joules_per_token(EAGLE3_TREE, batch, "romansh") > joules_per_token(
            EAGLE3_TREE, batch, "english"
        )
    assert joules_per_token(EAGLE3_TREE, 64, "romansh") > joules_per_token(NONE, 64)


def test_larger_batches_lower_energy_per_token_without_speculation() -> None:
    per_token = [joules_per_token(NONE, b) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert all(later < earlier for earlier, later in zip(per_token, per_token[1:], strict=False))


def lowest_clock_within(drafter: Drafter, batch: int, slack: float = 0.05) -> int:
    """The lowest clock whose iteration is at most `slack` slower than at the top clock."""
    top_s = iteration(drafter, batch)[0]
    return min(
        c for c in CLOCKS if iteration(drafter, batch, clock_mhz=c)[0] <= top_s * (1 + slack)
    )


def test_speculation_at_large_batch_leaves_little_latency_preserving_headroom() -> None:
    """Decode without speculation at batch 1 can drop to ~1350 MHz for 5% latency; a
    speculative batch of 64 verifies near the ridge and must stay near the top clock."""
    plain = lowest_clock_within(NONE, 1)
    for drafter in (EAGLE3_TREE, DFLASH):
        assert lowest_clock_within(drafter, 64) >= plain + 300
        assert lowest_clock_within(drafter, 64) > lowest_clock_within(drafter, 1) + 300


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 20000), clock=st.sampled_from(CLOCKS))
def test_gemm_time_never_falls_as_tokens_grow_and_efficiency_stays_below_the_large_m_figure(
    tokens, clock
) -> None:
    eff = physics.gemm_efficiency(H100, np.array([tokens, tokens + 1]))
    assert np.all(eff <= H100.gemm_efficiency + 1e-12) and np.all(eff > 0)
    flops = 2.0 * LLAMA8B.active_matmul_params * np.array([tokens, tokens + 1])
    t = physics.compute_time_s(H100, flops, np.array([tokens, tokens + 1]), clock)
    assert t[1] >= t[0] * (1 - 1e-12)  # equal within one tile
    # a full wave of whole tiles reaches the large-M figure
    whole = H100.gemm_tile_tokens * H100.sm_count
    assert physics.gemm_efficiency(H100, whole) == pytest.approx(H100.gemm_efficiency)


def twins_verify_pass(drafter: Drafter, batch: int) -> physics.Passes:
    """The verify pass of one steady decode iteration at `batch`, as the twin builds it
    (`decode_passes`), every request at CONTEXT tokens of context."""
    plan = plan_drafter(drafter, LLAMA8B)
    builder, width = steady_decode(plan, batch, 1.0)
    return builder.parts[0].take(np.array([verify_column(plan, width)]))


ROOFLINE_DRAFTERS = {"none": NONE, "eagle3": EAGLE3_TREE, "dflash": DFLASH}


def roofline_of_the_twins_passes() -> xr.Dataset:
    """The analysis's roofline of no speculation, EAGLE-3 (8 tokens) and DFLASH (16), at
    CONTEXT tokens of context."""
    cube = make_cube(clocks=[705, 1200, 1980], batches=[1, 16, 64], drafters=[*ROOFLINE_DRAFTERS])
    cube.attrs.update(
        model="meta-llama/Llama-3.1-8B-Instruct",
        gpu_name="NVIDIA H100 80GB HBM3",
        tp_size=1,
        server_args='{"none": {"args": {}}, "eagle3": {"args": {"speculative_algorithm": '
        '"EAGLE3", "speculative_num_draft_tokens": 8}}, "dflash": {"args": '
        '{"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": 16}}}',
    )
    return roofline(cube, context_tokens=CONTEXT)


def test_the_roofline_counts_the_flops_and_bytes_of_the_twins_own_verify_pass() -> None:
    """A verify pass's arithmetic intensity is the FLOPs over the bytes the twin's physics
    moves for it: the weights once, each request's KV cache read, and the KV of every token it
    verifies written (the analysis left the writes out: 883 FLOP/B for DFLASH's 1,024-token
    pass in the demo where the twin moves the bytes of 877)."""
    roof = roofline_of_the_twins_passes()
    for name, drafter in ROOFLINE_DRAFTERS.items():
        for batch in (1, 16, 64):
            twins = twins_verify_pass(drafter, batch)
            assert float(roof["verify_tokens"].sel(batch=batch, drafter=name)) == twins.tokens[0]
            intensity = float(roof["arithmetic_intensity"].sel(batch=batch, drafter=name))
            assert intensity == pytest.approx(twins.flops[0] / twins.bytes[0], rel=1e-9), name


def test_the_roofline_analysis_and_the_twins_physics_put_the_ridge_in_the_same_place() -> None:
    """At the analysis's verify ridge, the twin's own verify pass of that many tokens takes as
    long to compute as to read its bytes in the twin's physics (same efficiencies, same context
    length): a speculative pass's KV-cache reads at the custom-mask attention's lower bandwidth
    (`verify_attention_efficiency`) included. Without them the analysis put the demo's batch-64
    standalone pass compute-bound at or below 1905 MHz, and EAGLE-3's at batch 16 at 705 MHz,
    where the twin's physics runs them memory-bound down to 1605 MHz and at every clock (7 of
    the demo's 25 rows were off by one to four clock steps). The compute time is the twin's
    own (`time_passes`'s stretch): the weight GEMMs' FLOPs padded to whole tiles and waves, the
    attention's not; the analysis stretched the attention's too, its ridge up to 1.8% above the
    twin's for a pass of a few tokens at 512 tokens of context (28% at 8,192)."""
    roof = roofline_of_the_twins_passes()
    for name, drafter in ROOFLINE_DRAFTERS.items():
        for batch in (1, 16, 64):
            twins = twins_verify_pass(drafter, batch)
            assert twins.attention_flops[0] > 0
            terms = physics._pass_terms(H100, twins)
            memory_bytes = float(terms.memory_bytes[0])
            for clock in (705, 1200, 1980):
                ridge = float(
                    roof["verify_ridge_point"].sel(batch=batch, drafter=name, sm_clock=clock)
                )
                # the twin's pass with its FLOPs (its GEMMs' and attention's alike) scaled to
                # the ridge intensity: its time at the large-M efficiency, stretched as the
                # twin stretches it
                useful_s = ridge * twins.bytes[0] / H100.peak_flops(clock)
                compute_s = useful_s * float(terms.stretch[0])
                memory_s = memory_bytes / float(physics.bandwidth_bytes_s(H100, clock))
                assert compute_s == pytest.approx(memory_s, rel=1e-9), (name, batch, clock)


def test_a_profile_with_an_impossible_speculative_term_is_refused_in_one_line() -> None:
    with pytest.raises(CampaignError, match="verify_attention_efficiency must be in"):
        replace(H100, verify_attention_efficiency=0.0)
    with pytest.raises(CampaignError, match="spec_host_per_step_s must be >= 0"):
        replace(H100, spec_host_per_step_s=-1e-3)


def test_chain_acceptance_matches_a_held_out_measurement() -> None:
    """vLLM issue #20780 measured chains of 2-7 drafts on MT-bench (published.toml). The
    twin's EAGLE-3 chain comes from the EAGLE-3 paper's tree prior, never from these numbers:
    within 0.12 at every length (it reads 2.75 at 3 drafts against 2.79). EAGLE-1's prior is
    this table's 3-draft value; its other lengths are held out: within 0.25 (a constant
    per-draft probability overstates the long chains a little: 2.66 against 2.47 at 7)."""
    table = published_tables()["vllm-20780-chain-acceptance"]
    for algorithm, tolerance in (("EAGLE3", 0.12), ("EAGLE", 0.25)):
        measured = table["accept_length"][algorithm]
        for steps, want in zip(table["num_steps"], measured, strict=True):
            drafter = Drafter(algorithm, None, steps, 1, steps + 1)
            plan = plan_drafter(drafter, LLAMA8B)
            assert plan is not None
            got = plan.expected_accept_length(table["corpus"], 0.0)
            assert abs(got - want) <= tolerance, (algorithm, steps, got, want)


def test_the_chain_agreement_acceptance_toml_states_holds() -> None:
    """acceptance.toml's [eagle] comment says within what the twin's EAGLE-3 chain reproduces
    vLLM issue #20780's: it said 0.1 where the twin is 0.101 off at 7 drafts (3.64, 3.54)."""
    text = (Path(__file__).resolve().parent.parent / "dvfs/twin/data/acceptance.toml").read_text()
    said = re.search(r"reproduces through `widen` within ([0-9.]+)", text)
    assert said is not None, "the comment no longer says it"
    table = published_tables()["vllm-20780-chain-acceptance"]
    worst = 0.0
    for steps, want in zip(table["num_steps"], table["accept_length"]["EAGLE3"], strict=True):
        plan = plan_drafter(Drafter("EAGLE3", None, steps, 1, steps + 1), LLAMA8B)
        assert plan is not None
        worst = max(worst, abs(plan.expected_accept_length(table["corpus"], 0.0) - want))
    assert worst <= float(said.group(1)), worst


# The README's known limits ("Findings on the twin"), as they stand: each pins a number the
# README states, so a change to the twin that moves it fails here and the README is updated.

EAGLE3_PAPER_TREE = Drafter("EAGLE3", None, 7, 10, 60)
STANDALONE = Drafter("STANDALONE", "meta-llama/Llama-3.2-1B-Instruct", 4, 1, 5)
NGRAM = Drafter("NGRAM", None, None, None, 12)
TEXTS = ("code", "conversation", "english", "math", "romansh")


def accept_length(drafter: Drafter, text: str, temperature: float) -> float:
    plan = plan_drafter(drafter, LLAMA8B)
    assert plan is not None
    return plan.expected_accept_length(text, temperature)


def test_temperature_lowers_acceptance_as_the_readme_says() -> None:
    """A1's EAGLE-3 tree at T = 1: MT-bench 4.24 (the twin's calibration pair with 6.13 at
    T = 0), HumanEval 5.82, GSM8K 4.59, CNN/DM 4.39; the twin's single miss-rate factor gives
    4.04 / 5.10 / 4.20 / 2.96, and drives a weak drafter's acceptance to nothing."""
    assert accept_length(EAGLE3_PAPER_TREE, "conversation", 0.0) == pytest.approx(6.13, abs=0.01)
    # the pair's miss rates at depth 7 differ 2.49-fold: a gain of 1.49 would reproduce it
    miss = [1.0 - accept_probability(tau, 7) for tau in (6.13, 4.24)]
    assert miss[1] / miss[0] == pytest.approx(2.49, abs=0.005)
    assert expected_accept_length(1.0 - miss[0] * 2.49, 7) == pytest.approx(4.24, abs=0.01)
    stated = {"conversation": 4.04, "code": 5.10, "math": 4.20, "english": 2.96}
    for text, tau in stated.items():
        assert accept_length(EAGLE3_PAPER_TREE, text, 1.0) == pytest.approx(tau, abs=0.01), text
    for text in TEXTS:  # n-gram accepts nothing from T of about 0.4-0.55
        assert accept_length(NGRAM, text, 0.56) == 1.0, text
        assert accept_length(NGRAM, text, 0.35) > 1.0, text
    for text in ("conversation", "english", "math"):  # standalone: from about 0.65-0.9
        assert accept_length(STANDALONE, text, 0.95) == 1.0, text
        assert accept_length(STANDALONE, text, 0.6) > 1.0, text
    assert accept_length(STANDALONE, "code", 1.0) == pytest.approx(1.09, abs=0.01)
    assert accept_length(STANDALONE, "romansh", 0.13) == 1.0
    assert accept_length(EAGLE3_TREE, "romansh", 0.5) == 1.0  # the demo's top-k 4
    assert accept_length(EAGLE3_TREE, "romansh", 0.45) > 1.0


def test_eagle3_at_batch_1_runs_faster_than_the_sglang_pr_measured_as_the_readme_says() -> None:
    """sgl-project/sglang PR #4247 (H100, Llama-3.1-8B, MT-bench, batch 1): 5.39 tokens per
    verify at 379 tok/s with 8 draft steps, 4.68 at 362 tok/s with 5 (top-k not stated)."""
    head = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    stated = {  # (steps, top-k, draft tokens): (tau, tok/s)
        (8, 4, 16): (5.64, 556),
        (8, 8, 64): (6.43, 606),
        (5, 4, 8): (4.43, 486),
        (5, 8, 32): (4.84, 517),
    }
    for (steps, topk, tokens), (tau, rate) in stated.items():
        drafter = Drafter("EAGLE3", head, steps, topk, tokens)
        seconds, _, accepted = iteration(drafter, 1)
        assert accept_length(drafter, "conversation", 0.0) == pytest.approx(tau, abs=0.01)
        assert accepted / seconds == pytest.approx(rate, abs=1.0)
        assert accepted / seconds > 379 * 1.25  # the gap the README states


def test_a_model_whose_weights_just_fit_runs_its_batches_as_the_readme_says(
    tmp_path: Path,
) -> None:
    """Llama-3.1-70B (141 GB in BF16) at tp_size = 2 on two 80 GB H100s: its weights just fit
    (a larger model is refused: tests/test_twin_limits.py), and the twin checks no KV cache
    against the memory left, so `dvfs doctor` passes it and every batch runs, each GPU's
    decode timed as the read of its half of the weights at least."""
    big = model_profile("llama-3.1-70b")
    h100 = gpu_profile("h100-sxm")
    assert big.total_params * 2 / 1e9 > h100.memory_gb
    demo = (Path(__file__).parent.parent / "dvfs" / "campaigns" / "demo.toml").read_text()
    lines = []
    for line in demo.splitlines():
        key = line.split("=")[0].strip()
        lines.append(
            {
                "devices": "devices = [0, 1]",
                "model": 'model = "meta-llama/Llama-3.1-70B-Instruct"\ntp_size = 2',
                "sm_clock": "sm_clock = [1980]",
                "power_limit": "power_limit = [700]",
                "batch": "batch = [1, 64]",
                "corpora": 'corpora = ["conversation"]',
            }.get(key, line)
        )
    text = "\n".join(lines)
    text = text[: text.index("[drafters.eagle3]")] + text[text.index("[workload]") :]
    campaign = tmp_path / "big.toml"
    campaign.write_text(text)
    runner = CliRunner()
    out = tmp_path / "out"  # not the campaign's default out/demo, which a demo run fills
    doctor = runner.invoke(cli, ["doctor", str(campaign), "--out", str(out)])
    assert doctor.exit_code == 0, doctor.output
    sweep = runner.invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    assert sweep.exit_code == 0, sweep.output
    with xr.open_dataset(out / "cube.nc") as cube:
        assert cube.attrs["model"] == "meta-llama/Llama-3.1-70B-Instruct"
        tpot_ms = cube["tpot_ms"].sel(quantile=0.5).values
    assert np.isfinite(tpot_ms).all() and tpot_ms.size == 2  # both batches measured
    # no faster than each GPU reading its half of the weights at the peak HBM bandwidth
    half_read_ms = big.total_params * 2 / 2 / (h100.hbm_bandwidth_gb_s * 1e9) * 1e3
    assert (tpot_ms >= half_read_ms).all(), (tpot_ms, half_read_ms)
