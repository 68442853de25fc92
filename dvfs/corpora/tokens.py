"""Counting prompt tokens: the target model's tokenizer when available, else an estimate."""

from __future__ import annotations

import logging
from typing import Any

from dvfs.corpora.model import Message, TokenCounter, estimate_tokens

log = logging.getLogger(__name__)
ESTIMATE = "estimate: characters / 4 + 5 per message"


def token_counter(model: str | None) -> tuple[TokenCounter, str]:
    """A counter and a description of it, for the cube's provenance.

    Uses transformers' tokenizer of `model` from the local cache only (never a download while
    a sweep runs); without transformers or a local copy, the documented character estimate.
    """
    if not model:
        return estimate_tokens, ESTIMATE
    try:
        from transformers import AutoTokenizer

        tokenizer: Any = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # not installed, not cached, no tokenizer: fall back, say why
        log.info("no local tokenizer for %s (%s); estimating token counts", model, exc)
        return estimate_tokens, ESTIMATE

    def count(messages: tuple[Message, ...]) -> int:
        chat = [{"role": m.role, "content": m.content} for m in messages]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
            return max(1, len(ids))
        return max(1, len(tokenizer("\n\n".join(m.content for m in messages))["input_ids"]))

    return count, f"tokenizer of {model}"
