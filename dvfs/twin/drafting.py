"""Draft planning: a drafter's SGLang settings resolved to what the twin's physics needs.

`plan_drafter` is pure (a drafter and a target model in, a plan out), so the campaign loader can
ask it whether the twin can model a drafter without starting an engine. It reads a drafter
through the `DrafterSettings` protocol (which `dvfs.campaign.DrafterSpec` satisfies), so the
twin's physics does not import the configuration that sits above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dvfs.errors import EngineError
from dvfs.twin import profiles, textprior
from dvfs.twin.profiles import ModelProfile
from dvfs.twin.textprior import TextProfile

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


class DrafterSettings(Protocol):
    """A drafter's SGLang speculative settings (None: unset, SGLang's default applies)."""

    @property
    def algorithm(self) -> str | None: ...

    @property
    def draft_model(self) -> str | None: ...

    @property
    def num_steps(self) -> int | None: ...

    @property
    def eagle_topk(self) -> int | None: ...

    @property
    def num_draft_tokens(self) -> int | None: ...


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

    def alpha(self, text: TextProfile | str, temperature: float) -> float:
        """Per-draft acceptance on a text: its class's prior for a trained drafter, its
        repetition for an n-gram drafter; then this plan's tree width and the temperature.
        A name stands for that built-in corpus's text."""
        if isinstance(text, str):
            text = _builtin_text(text)
        prior = profiles.acceptance_priors()[self.family]
        if prior.alpha_intercept is not None and prior.alpha_per_sqrt_repetition is not None:
            alpha_ref = textprior.ngram_alpha(
                text.ngram_repetition, prior.alpha_intercept, prior.alpha_per_sqrt_repetition
            )
        else:
            alpha_ref = profiles.accept_probability(
                prior.tau(text.acceptance_class), prior.ref_depth
            )
        alpha = profiles.widen(alpha_ref, prior.ref_topk, self.topk)
        miss = (1.0 - alpha) * (1.0 + TEMPERATURE_MISS_GAIN * min(max(temperature, 0.0), 1.0))
        return max(0.0, 1.0 - miss)

    def expected_accept_length(self, text: TextProfile | str, temperature: float) -> float:
        return profiles.expected_accept_length(self.alpha(text, temperature), self.depth)


def _builtin_text(name: str) -> TextProfile:
    from dvfs.corpora.model import BUILTIN_CORPORA

    if name not in BUILTIN_CORPORA:
        raise EngineError(
            f"the twin needs the text of corpus {name!r} to draw its acceptance "
            f"(or a built-in corpus's name: {', '.join(BUILTIN_CORPORA)})"
        )
    return textprior.builtin_profile(name)


@dataclass(frozen=True)
class HeadShape:
    """How a trained draft head without a profile of its own is built around its target's
    layer shape: the fc's input width and the attention's input width (in hidden sizes), and
    its vocabulary (None: the target's LM head)."""

    fc_inputs: int
    attention_inputs: int
    vocab: int | None


#: Draft-head shapes by algorithm.
#: EAGLE (EAGLE-1; Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature
#: Uncertainty", ICML 2024, arXiv 2401.15077, section 4.1 and Figure 6; SafeAILab/EAGLE
#: `eagle/model/cnets.py`, `fc = Linear(2 x hidden, hidden)`): the target's last hidden state
#: and the next token's embedding, concatenated (2 x hidden), go through an fc to hidden and
#: ONE decoder layer whose attention takes hidden; the target's own LM head maps it to the
#: target's vocabulary. NEXTN (DeepSeek-V3's multi-token prediction module, arXiv 2412.19437
#: section 2.2: a 2 x hidden projection of the normed hidden state and embedding, one
#: transformer block, the shared output head) has the same shape.
#: EAGLE-3 (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
#: via Training-Time Test", arXiv 2503.01840, section 3; TWIN-REFERENCE D1, D2): low, mid and
#: high features fused by an fc from 3 x hidden, the decoder layer's q/k/v take 2 x hidden
#: (embedding and fused feature), and its own LM head to a 32000-token draft vocabulary.
HEAD_SHAPES = {
    "EAGLE": HeadShape(fc_inputs=2, attention_inputs=1, vocab=None),
    "NEXTN": HeadShape(fc_inputs=2, attention_inputs=1, vocab=None),
    "EAGLE3": HeadShape(fc_inputs=3, attention_inputs=2, vocab=32000),
}


def _generic_head(target: ModelProfile, algorithm: str) -> ModelProfile:
    """A one-layer draft head shaped like one target layer, built as `algorithm`'s heads are
    (`HEAD_SHAPES`): for a drafter without a profile of its own."""
    shape = HEAD_SHAPES[algorithm]
    return ModelProfile(
        key=f"{target.key}-{algorithm.lower()}-head",
        hf_name="",
        layers=1,
        hidden=target.hidden,
        intermediate=target.intermediate,
        heads=target.heads,
        kv_heads=target.kv_heads,
        head_dim=target.head_dim,
        vocab=target.vocab if shape.vocab is None else shape.vocab,
        tied_embeddings=False,
        role="eagle-head",
        fc_inputs=shape.fc_inputs,
        attention_inputs=shape.attention_inputs,
    )


def plan_drafter(drafter: DrafterSettings, target: ModelProfile) -> DraftPlan | None:
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
    if steps is None:  # SGLang's automatic choice (0.5.9 server_args.py and 0.5.23
        # arg_groups/speculative_hook.py, `_auto_choose_speculative_params`): STANDALONE always
        # (3, 1, 4); otherwise (5, 4, 8) for a Llama target, (3, 1, 4) for most others.
        llama = "llama" in target.key.lower() and algorithm != "STANDALONE"
        steps, topk, tokens = (5, 4, 8) if llama else (3, 1, 4)
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
        draft = _generic_head(target, algorithm)
    return DraftPlan(algorithm, family, steps, topk, tokens, min(steps, tokens - 1), draft)


def draws(rng: np.random.Generator, shape: tuple[int, ...], alpha: float, depth: int) -> np.ndarray:
    """Tokens each verify emits: 1 + accepted drafts, a truncated geometric draw."""
    if depth == 0 or alpha <= 0.0:
        return np.ones(shape, dtype=np.int64)
    if alpha >= 1.0:
        return np.full(shape, depth + 1, dtype=np.int64)
    u = rng.random(shape)
    accepted = np.floor(np.log1p(-u) / math.log(alpha)).astype(np.int64)
    return 1 + np.minimum(accepted, depth)
