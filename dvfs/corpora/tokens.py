"""Counting prompt tokens: the target model's tokenizer when available, else an estimate."""

from __future__ import annotations

import logging
from typing import Any

from dvfs.corpora.model import Message, TokenCounter, estimate_tokens
from dvfs.errors import JournalError

log = logging.getLogger(__name__)
ESTIMATE = "estimate: characters / 4 + 5 per message"
TOKENIZER_OF = "tokenizer of "


def load_tokenizer(model: str) -> Any:
    """`model`'s tokenizer from the local Hugging Face cache (never a download while a sweep
    runs), or None without transformers or a local copy. The one place dvfs loads a tokenizer,
    for counting prompt tokens and for the chat template alike."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # not installed, not cached, no tokenizer: the caller falls back
        log.info("no local tokenizer for %s (%s)", model, exc)
        return None


def download_hint(model: str) -> str:
    """The command that puts `model`'s tokenizer (and weights) in the local cache."""
    return f"`huggingface-cli download {model}`"


def token_counter(model: str | None, recorded: str = "") -> tuple[TokenCounter, str]:
    """A counter and a description of it, for the cube's provenance.

    Uses the tokenizer of `model` from the local cache (`load_tokenizer`); without one, the
    documented character estimate. `recorded`: the method a journal being resumed chose its
    prompts by, which a resume reproduces rather than what this machine has now: the estimate
    stays the estimate when a tokenizer has appeared since (the server downloaded the model),
    and a tokenizer now missing is a `JournalError` (which prompts fit the input lengths would
    change with the method, and the arms would compare other prompts).
    """
    if not model or recorded.startswith("estimate"):
        return estimate_tokens, ESTIMATE
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        if recorded.startswith(TOKENIZER_OF):
            raise JournalError(
                f"the journal chose its prompts by the {recorded}, which is not in the local "
                f"cache: download it ({download_hint(model)}) and rerun, or start over with "
                "--fresh"
            )
        return estimate_tokens, ESTIMATE

    def count(messages: tuple[Message, ...]) -> int:
        chat = [{"role": m.role, "content": m.content} for m in messages]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
            return max(1, len(ids))
        return max(1, len(tokenizer("\n\n".join(m.content for m in messages))["input_ids"]))

    return count, f"tokenizer of {model}"
