"""Prompt sampling remembers its work per corpus: the same prompts as a fresh draw, and no
entry left behind once the corpus is gone."""

from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np

from dvfs.corpora import load_corpus, sample_prompts, sampling
from dvfs.corpora.sampling import eligible_prompts, fit_to_range, stable_seed


def test_eligible_prompts_are_fitted_once_per_corpus() -> None:
    corpus = load_corpus("conversation")
    first = eligible_prompts(corpus, (16, 512))
    assert eligible_prompts(corpus, (16, 512)) is first
    fitted = [fit_to_range(p, 16, 512) for p in corpus.prompts]
    assert list(first) == [p for p in fitted if p is not None]
    assert eligible_prompts(corpus, (16, 2048)) != first


def test_samples_are_the_seeded_draw_whether_remembered_or_not() -> None:
    corpus = load_corpus("english")
    pool = eligible_prompts(corpus, (16, 2048))
    for seed, key in ((0, (8, 0, 1)), (0, (8, 0, 1)), (3, (4, 1, "warmup"))):
        got = sample_prompts(corpus, 8, input_tokens=(16, 2048), seed=seed, key=key)
        rng = np.random.default_rng(stable_seed(seed, corpus.name, *key))
        assert got == tuple(pool[i] for i in rng.choice(len(pool), size=8, replace=False))
    a = sample_prompts(corpus, 8, input_tokens=(16, 2048), seed=1, key=(1,))
    b = sample_prompts(corpus, 8, input_tokens=(16, 2048), seed=1, key=(1.0,))
    assert a != b  # equal keys that print differently seed differently, as they always did


def test_a_dropped_corpus_leaves_the_cache() -> None:
    corpus = replace(load_corpus("math"), name="scratch")
    eligible_prompts(corpus, (16, 99))
    key = (id(corpus), 16, 99)
    assert key in sampling._FITTED
    del corpus
    gc.collect()
    assert key not in sampling._FITTED
