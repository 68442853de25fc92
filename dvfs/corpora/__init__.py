"""Prompt corpora: the five built-ins shipped with dvfs, and the user's own data.

Acceptance depends on the text being served, so the corpus is a dimension of the cube.
"""

from __future__ import annotations

from dvfs.corpora.model import Corpus, Message, Prompt, estimate_tokens
from dvfs.corpora.registry import BUILTIN_CORPORA, load_corpus, validate_spec
from dvfs.corpora.sampling import sample_prompts

__all__ = [
    "BUILTIN_CORPORA",
    "Corpus",
    "Message",
    "Prompt",
    "estimate_tokens",
    "load_corpus",
    "sample_prompts",
    "validate_spec",
]
