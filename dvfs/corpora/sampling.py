"""Choosing prompts: for a cell (deterministic by seed, fitted to the campaign's input range),
and for `dvfs corpus show` (a seeded preview, with the corpus's statistics)."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dvfs.corpora.model import Corpus, Message, Prompt, estimate_tokens
from dvfs.errors import CorpusError


def stable_seed(*parts: object) -> int:
    """A seed derived from values, identical across processes and Python versions."""
    blob = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:8], "little")


def fit_to_range(prompt: Prompt, min_tokens: int, max_tokens: int) -> Prompt | None:
    """The prompt trimmed to at most `max_tokens`, or None when shorter than `min_tokens`.

    Trimming cuts the last message's text proportionally (earlier turns are context), and
    keeps the prompt's token estimate consistent with the cut.
    """
    if prompt.input_tokens < min_tokens:
        return None
    if prompt.input_tokens <= max_tokens:
        return prompt
    last = prompt.messages[-1]
    last_tokens: float = max(1, math.ceil(len(last.content) / 4))
    estimated = estimate_tokens(prompt.messages)
    if prompt.input_tokens != estimated:
        # counted by a tokenizer: the last message's share at the prompt's own tokens per
        # character, else a tokenizer denser than the estimate drops long prompts or cuts
        # them far below max_tokens
        last_tokens *= prompt.input_tokens / estimated
    others = prompt.input_tokens - last_tokens
    budget_tokens = max_tokens - others
    if budget_tokens < 1:
        return None
    keep_chars = max(1, int(len(last.content) * budget_tokens / max(1, last_tokens)))
    trimmed = (*prompt.messages[:-1], Message(last.role, last.content[:keep_chars]))
    return Prompt(prompt.id, trimmed, max_tokens)


@dataclass
class _Fitted:
    """A corpus's prompts fitted to one range, and the samples drawn from them so far."""

    corpus: weakref.ref[Corpus]
    pool: tuple[Prompt, ...]
    samples: dict[tuple[int, int], tuple[Prompt, ...]] = field(default_factory=dict)


#: Per (corpus object, range): a corpus is immutable, and a sweep samples the same few corpora
#: thousands of times, mostly with seeds it used at another knob setting.
_FITTED: dict[tuple[int, int, int], _Fitted] = {}
#: Samples remembered per corpus and range (bounded, so memory stays flat).
SAMPLE_CACHE_SIZE = 4096


def _fitted(corpus: Corpus, input_tokens: tuple[int, int]) -> _Fitted:
    lo, hi = input_tokens
    key = (id(corpus), lo, hi)
    cached = _FITTED.get(key)
    if cached is not None and cached.corpus() is corpus:
        return cached
    fitted = (fit_to_range(p, lo, hi) for p in corpus.prompts)

    def forget(ref: weakref.ref[Corpus]) -> None:
        entry = _FITTED.get(key)
        if entry is not None and entry.corpus is ref:
            del _FITTED[key]

    # Distinct texts only: a prompt given twice (or two trimmed to the same text) sampled into
    # one batch would be a repeat, which prefix caching flatters.
    pool: dict[tuple[Message, ...], Prompt] = {}
    for prompt in fitted:
        if prompt is not None:
            pool.setdefault(prompt.messages, prompt)
    entry = _Fitted(weakref.ref(corpus, forget), tuple(pool.values()))
    _FITTED[key] = entry
    return entry


def eligible_prompts(corpus: Corpus, input_tokens: tuple[int, int]) -> tuple[Prompt, ...]:
    """The corpus's distinct prompts fitted to the range, in corpus order (the first of those
    with the same messages; computed once per corpus)."""
    return _fitted(corpus, input_tokens).pool


def pool_hash(corpus: Corpus, input_tokens: tuple[int, int]) -> str:
    """SHA-256 over the prompts a sweep draws from (`eligible_prompts`) with their token
    counts: equal content with another tokenizer (a new revision of the same model's) may fit
    other prompts to the input lengths, trim them elsewhere, or give the twin other lengths,
    which the corpus's content hash does not see."""
    digest = hashlib.sha256()
    for prompt in eligible_prompts(corpus, input_tokens):
        digest.update(json.dumps([prompt.as_chat(), prompt.input_tokens]).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:16]


def sample_prompts(
    corpus: Corpus,
    count: int,
    *,
    input_tokens: tuple[int, int],
    seed: int,
    key: tuple[object, ...] = (),
) -> tuple[Prompt, ...]:
    """`count` distinct prompts, the same for the same (seed, key) on every machine.

    Raises when the corpus has fewer eligible prompts than asked: repeating a prompt inside a
    batch would let prefix caching flatter the measurement.
    """
    entry = _fitted(corpus, input_tokens)
    pool = entry.pool
    if len(pool) < count:
        lo, hi = input_tokens
        raise CorpusError(
            f"corpus {corpus.name!r} has {len(pool)} distinct prompts within {lo}-{hi} input "
            f"tokens but the workload needs {count}; widen workload.input_tokens, lower the batch, "
            "or add prompts"
        )
    stream = stable_seed(seed, corpus.name, *key)
    sample = entry.samples.get((count, stream))
    if sample is None:
        rng = np.random.default_rng(stream)
        picks = rng.choice(len(pool), size=count, replace=False)
        sample = tuple(pool[i] for i in picks)
        if len(entry.samples) >= SAMPLE_CACHE_SIZE:
            entry.samples.clear()
        entry.samples[(count, stream)] = sample
    return sample


def preview_prompts(corpus: Corpus, count: int, *, seed: int) -> tuple[Prompt, ...]:
    """Up to `count` distinct prompts for `dvfs corpus show`, in corpus order, the same for the
    same seed on every machine; unlike `sample_prompts`, no length range and never short."""
    rng = np.random.default_rng(stable_seed(seed, corpus.name, "show"))
    picks = sorted(
        rng.choice(len(corpus.prompts), size=min(count, len(corpus.prompts)), replace=False)
    )
    return tuple(corpus.prompts[i] for i in picks)


def corpus_stats(corpus: Corpus) -> dict[str, Any]:
    """Prompt count (`distinct`: of different messages, those a sweep samples from), input-token
    spread and provenance, as `dvfs corpus list/show` report them."""
    tokens = [p.input_tokens for p in corpus.prompts]
    return {
        "name": corpus.name,
        "prompts": len(tokens),
        "distinct": len({p.messages for p in corpus.prompts}),
        "tokens_min": min(tokens),
        "tokens_median": statistics.median(tokens),
        "tokens_max": max(tokens),
        "multi_turn": sum(len(p.messages) > 1 for p in corpus.prompts),
        "content_hash": corpus.content_hash,
        "source": corpus.source,
    }
