"""Prompts as chat messages, with a token-count estimate when no tokenizer is at hand."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

#: The corpora shipped with dvfs (package data); the vocabulary both loaders and registry use.
BUILTIN_CORPORA = ("code", "conversation", "english", "math", "romansh")
#: Characters per token for the estimate: ~4 for English under Llama-3's 128k vocabulary.
CHARS_PER_TOKEN = 4.0
#: Tokens a chat template adds per message (role header and end-of-turn markers), estimated.
TEMPLATE_TOKENS_PER_MESSAGE = 5


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's input: chat messages and its length in tokens (measured or estimated).
    Slotted, as `Message`: a corpus of millions of short prompts holds a fifth less (a prompt
    of one short message some 300 bytes, not 377)."""

    id: str
    messages: tuple[Message, ...]
    input_tokens: int

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError(f"prompt {self.id} has no messages")
        if self.input_tokens < 1:
            raise ValueError(f"prompt {self.id} has {self.input_tokens} input tokens")

    @property
    def text(self) -> str:
        """The conversation flattened to plain text, for engines that take raw text."""
        if len(self.messages) == 1:
            return self.messages[0].content
        return "\n\n".join(f"{m.role}: {m.content}" for m in self.messages)

    def as_chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


def estimate_tokens(messages: tuple[Message, ...]) -> int:
    """Token count without a tokenizer: characters / 4 plus a chat-template allowance.

    Romansh and code tokenise less efficiently than English, so this under-counts them by
    10-30%; campaigns that need exact lengths should install the `torch` extra's tokenizer.
    """
    chars = sum(len(m.content) for m in messages)
    return max(1, math.ceil(chars / CHARS_PER_TOKEN) + TEMPLATE_TOKENS_PER_MESSAGE * len(messages))


TokenCounter = Callable[[tuple[Message, ...]], int]


@dataclass(frozen=True)
class Corpus:
    """A named set of prompts and where they came from."""

    name: str
    prompts: tuple[Prompt, ...]
    source: str

    @property
    def content_hash(self) -> str:
        """SHA-256 over the prompts' messages: two corpora with equal hashes served equal text."""
        digest = hashlib.sha256()
        for prompt in self.prompts:
            digest.update(json.dumps(prompt.as_chat(), ensure_ascii=False).encode())
            digest.update(b"\n")
        return digest.hexdigest()[:16]
