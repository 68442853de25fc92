"""Counting prompt tokens: the target model's tokenizer when available, else an estimate."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dvfs.corpora.model import Message, TokenCounter, estimate_tokens
from dvfs.errors import CorpusError, CorpusUnavailableError, JournalError

log = logging.getLogger(__name__)
ESTIMATE = "estimate: characters / 4 + 5 per message"
TOKENIZER_OF = "tokenizer of "


def hub_gguf(model: str) -> tuple[str, str, str] | None:
    """(repo id, file, quantization) of a .gguf named on the Hugging Face Hub as SGLang takes
    one (`dvfs.engines.sglang.same_model`): `owner/repo:QUANT` (file "", the repo's
    `*-QUANT.gguf`) or `owner/repo/FILE.gguf` (quantization ""); None for any other name (a
    repo id, a local path), which names its tokenizer itself. Neither is a repo id: the
    tokenizer is the .gguf's own (transformers reads it with `gguf_file`)."""
    if model.startswith(("/", ".", "~")) or _exists(model):
        return None
    repo, _, quant = model.rpartition(":")
    if quant and repo.count("/") == 1 and "/" not in quant:
        return repo, "", quant
    parts = model.split("/")
    if len(parts) > 2 and model.endswith(".gguf") and all(parts):
        return "/".join(parts[:2]), "/".join(parts[2:]), ""
    return None


def _exists(path: str) -> bool:
    """Whether `path` names something here; False for no path a file may have (too long)."""
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


def _cached_gguf(repo: str, file: str, quant: str) -> str:
    """The path in `repo` of its .gguf in the local cache: `file`, or the one of `quant`."""
    from huggingface_hub import snapshot_download

    pattern = file or f"*-{quant}.gguf"
    folder = Path(snapshot_download(repo, allow_patterns=[pattern], local_files_only=True))
    found = sorted(p.relative_to(folder).as_posix() for p in folder.glob(pattern))
    if not found:
        raise FileNotFoundError(f"no {pattern} of {repo} in the local cache")
    return found[0]


def load_tokenizer(model: str) -> Any:
    """`model`'s tokenizer from the local Hugging Face cache (never a download while a sweep
    runs), or None without transformers or a local copy. The one place dvfs loads a tokenizer,
    for counting prompt tokens and for the chat template alike. A .gguf named on the Hub
    (`hub_gguf`) is read from its cached file, as SGLang reads it."""
    try:
        from transformers import AutoTokenizer

        gguf = hub_gguf(model)
        if gguf is None:
            return AutoTokenizer.from_pretrained(model, local_files_only=True)
        repo = gguf[0]
        return AutoTokenizer.from_pretrained(
            repo, gguf_file=_cached_gguf(*gguf), local_files_only=True
        )
    except Exception as exc:  # not installed, not cached, no tokenizer: the caller falls back
        log.info("no local tokenizer for %s (%s)", model, exc)
        return None


def transformers_missing() -> bool:
    """Whether dvfs's own environment lacks transformers, with which it reads every tokenizer
    (`load_tokenizer`): then no download puts one within its reach."""
    import importlib.util

    try:
        return importlib.util.find_spec("transformers") is None
    except (ImportError, ValueError):
        return True


def download_hint(model: str) -> str:
    """The command that puts `model`'s tokenizer (and weights) in the local cache: for a .gguf
    named on the Hub (`hub_gguf`, no repo id), its repo's file of that quantization alone (and
    the gguf package, with which transformers reads its tokenizer); first `pip install
    transformers jinja2` where dvfs's environment lacks transformers (a server run in a
    container, or attached by url, needs no SGLang here), without which a download changes
    nothing: jinja2 too, with which transformers renders chat templates without depending on
    it (`template_unavailable`)."""
    library = "`pip install transformers jinja2` and " if transformers_missing() else ""
    gguf = hub_gguf(model)
    if gguf is None:
        return f"{library}`huggingface-cli download {model}`"
    repo, file, quant = gguf
    return (
        f"{library}`huggingface-cli download {repo} --include '{file or f'*-{quant}.gguf'}'` "
        "and `pip install gguf`"
    )


def template_unavailable(model: str, exc: ImportError) -> CorpusUnavailableError:
    """The error for a chat template this environment cannot run (transformers renders them
    with jinja2, which it does not itself depend on: a `pip install transformers` alone lacks
    it, or has too old a one): this environment's, not the chat's, so it names no prompt."""
    return CorpusUnavailableError(
        f"dvfs's environment cannot run the chat template of {model} ({exc}): "
        "`pip install -U jinja2` there"
    )


def _takes_return_dict(tokenizer: Any) -> bool:
    """Whether `tokenizer.apply_chat_template` names a `return_dict` argument (a tokenizer
    whose signature cannot be read is assumed to, as every recent transformers release does)."""
    import inspect

    try:
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    except (AttributeError, TypeError, ValueError):
        return True
    return "return_dict" in parameters


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

    # return_dict=False: transformers 5 returns a BatchEncoding by default, whose len() is its
    # two keys (input_ids, attention_mask), not the prompt's tokens. Only where it is an
    # argument: before it was (4.34, the first with chat templates) every further keyword went
    # on to encode(), whose fast tokenizer refuses one it does not know (a TypeError).
    as_ids = {"return_dict": False} if _takes_return_dict(tokenizer) else {}

    def count(messages: tuple[Message, ...]) -> int:
        chat = [{"role": m.role, "content": m.content} for m in messages]
        if getattr(tokenizer, "chat_template", None):
            try:
                ids = tokenizer.apply_chat_template(
                    chat, tokenize=True, add_generation_prompt=True, **as_ids
                )
            except ImportError as exc:  # no jinja2 here: no chat's fault
                raise template_unavailable(str(model), exc) from exc
            except Exception as exc:  # the template's own raise_exception: a jinja2 error
                # The loader names the file and line (`dvfs.corpora.loaders._prompt`).
                raise CorpusError(
                    f"the chat template of {model} refuses this chat ({exc}): drop or merge "
                    "the turns it refuses"
                ) from exc
            if isinstance(ids, Mapping):  # a tokenizer that returns its encoding regardless
                ids = ids["input_ids"]
            return max(1, len(ids))
        return max(1, len(tokenizer("\n\n".join(m.content for m in messages))["input_ids"]))

    return count, f"tokenizer of {model}"
