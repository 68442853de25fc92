"""Finding a corpus by name: built-ins from package data, user corpora from their campaign table."""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from dvfs.corpora.loaders import chat_messages, check_spec, load_user_corpus
from dvfs.corpora.model import BUILTIN_CORPORA, Corpus, Prompt, TokenCounter, estimate_tokens
from dvfs.errors import CampaignError, CorpusError

BUILTIN_DESCRIPTIONS = {
    "code": "programming tasks and code to continue (Python, Rust, JS/TS, SQL, Go, C, shell)",
    "conversation": "chat-style user turns, many multi-turn",
    "english": "English prose to continue, summarise or rewrite",
    "math": "math word problems asking for step-by-step solutions",
    "romansh": "prompts in Rumantsch Grischun (a low-resource language)",
}


def _builtin_text(name: str) -> str:
    return (
        resources.files("dvfs.corpora")
        .joinpath("data", f"{name}.jsonl")
        .read_text(encoding="utf-8")
    )


@functools.cache
def _builtin(name: str) -> Corpus:
    prompts = []
    for lineno, line in enumerate(_builtin_text(name).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"built-in corpus {name}, line {lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{where}: not valid JSON ({exc.msg})") from exc
        messages = chat_messages(record.get("messages"), where)
        prompts.append(Prompt(record["id"], messages, estimate_tokens(messages)))
    return Corpus(name, tuple(prompts), f"dvfs built-in corpus {name!r}")


def validate_spec(name: str, spec: dict[str, Any], *, where: str) -> None:
    """Check a `[corpus.NAME]` table at campaign load; raises `CampaignError`."""
    try:
        check_spec(spec)
    except CorpusError as exc:
        raise CampaignError(f"{where}: [corpus.{name}]: {exc}") from exc


def load_corpus(
    name: str,
    spec: dict[str, Any] | None = None,
    *,
    base_dir: str = ".",
    count_tokens: TokenCounter = estimate_tokens,
) -> Corpus:
    """A built-in corpus by name, or a user corpus described by its campaign table."""
    if spec is None:
        if name not in BUILTIN_CORPORA:
            raise CorpusError(
                f"no built-in corpus {name!r}; built-ins are {', '.join(BUILTIN_CORPORA)}"
            )
        corpus = _builtin(name)
        if count_tokens is estimate_tokens:
            return corpus
        prompts = tuple(Prompt(p.id, p.messages, count_tokens(p.messages)) for p in corpus.prompts)
        return Corpus(name, prompts, corpus.source)
    return load_user_corpus(name, spec, base_dir=base_dir, count_tokens=count_tokens)
