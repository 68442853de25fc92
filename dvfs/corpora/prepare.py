"""A campaign's corpora made ready to measure: loaded, token-counted with the target's
tokenizer, and checked for enough prompts before a sweep touches a GPU.

Apart from `dvfs.sweep` so the doctor and `dvfs corpus` can ask the same questions without
loading the sweep's orchestration.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from dvfs.backends import tokenizer_model
from dvfs.campaign import Campaign
from dvfs.corpora.model import Corpus, TokenCounter
from dvfs.corpora.registry import load_corpus
from dvfs.errors import CorpusShortfallError


def load_corpora(campaign: Campaign, count: TokenCounter | None = None) -> dict[str, Corpus]:
    """Every corpus the campaign names, with token counts from the target's tokenizer if it is
    available locally (else the documented estimate)."""
    if count is None:
        from dvfs.corpora.tokens import token_counter

        count, _ = token_counter(tokenizer_model(campaign))
    corpora = {}
    for ref in campaign.workload.corpora:
        spec = dict(ref.spec) if ref.spec is not None else None
        corpora[ref.name] = load_corpus(
            ref.name, spec, base_dir=campaign.base_dir, count_tokens=count
        )
    return corpora


def counted_corpora(campaign: Campaign, recorded: str = "") -> tuple[dict[str, Corpus], str]:
    """Every corpus the campaign names, counted with its target's tokenizer, and how the
    tokens were counted (the tokenizer, or the documented estimate). `recorded`: the method of
    the journal being resumed, which is reproduced (`dvfs.corpora.tokens.token_counter`)."""
    from dvfs.corpora.tokens import token_counter

    count, method = token_counter(tokenizer_model(campaign), recorded)
    return load_corpora(campaign, count), method


def recorded_count_method(journals: Iterable[Path]) -> str:
    """The token-count method the first of these journals (those that exist) that recorded
    one chose its prompts by: what a resume reproduces (`counted_corpora`); "" for none."""
    from dvfs.measure.journal import iter_records
    from dvfs.records import journal_prompts

    for path in journals:
        if path.is_file():
            method = journal_prompts(iter_records(path))[0]
            if method:
                return method
    return ""


def estimate_note(campaign: Campaign, method: str, recorded: str) -> str | None:
    """The line a new SGLang campaign prints when no tokenizer of its model is cached yet: its
    prompts are chosen by the estimate, and its resumes keep that (`counted_corpora`), even
    once the first server has fetched the model. None otherwise."""
    from dvfs.backends import simulated_engine
    from dvfs.corpora.tokens import download_hint, transformers_missing

    if recorded or not method.startswith("estimate") or simulated_engine(campaign):
        return None
    model = campaign.engine.model
    if transformers_missing():  # no download helps: prompts go out plain too (README)
        return (
            f"transformers is not installed in dvfs's environment, so no tokenizer of {model} "
            "is read: which prompts fit workload.input_tokens is estimated (characters / 4) "
            "for this whole campaign, resumes included, and prompts go out as plain text, "
            f"without the model's chat template; {download_hint(model)} before its first "
            "sweep makes them exact"
        )
    return (
        f"no tokenizer of {model} in the local cache: which prompts fit workload.input_tokens "
        f"is estimated (characters / 4) for this whole campaign, resumes included; "
        f"{download_hint(model)} before its first sweep makes it exact"
    )


def corpus_descriptions(campaign: Campaign) -> dict[str, str]:
    """Each campaign corpus's description: a table's own ("" for none: a table named as a
    built-in is the campaign's corpus, not the built-in), else the built-in's."""
    from dvfs.corpora.registry import BUILTIN_DESCRIPTIONS

    descriptions = {}
    for ref in campaign.workload.corpora:
        if ref.spec is None:
            descriptions[ref.name] = BUILTIN_DESCRIPTIONS.get(ref.name, "")
        else:
            descriptions[ref.name] = str(dict(ref.spec).get("description", ""))
    return descriptions


def corpus_shortfalls(campaign: Campaign, corpora: dict[str, Corpus]) -> list[str]:
    """Corpora without enough distinct prompts for the largest batch (or closed-loop pool);
    a prompt given twice counts once (`eligible_prompts`)."""
    from dvfs.corpora.sampling import eligible_prompts

    w = campaign.workload
    largest = max(w.batch_sizes)
    lo, hi = w.input_tokens
    limits = {ref.name: dict(ref.spec).get("limit") for ref in w.corpora if ref.spec is not None}
    problems = []
    for name, corpus in corpora.items():
        usable = len(eligible_prompts(corpus, w.input_tokens))
        if w.mode == "closed-loop":
            need = w.pool_size or largest + 1
            what = f"a closed-loop pool for batch {largest}"
        else:
            need, what = largest, f"batch {largest}"
        if usable < need:
            limit = limits.get(name)
            # The table's `limit` read no more records: more prompts in the file go unread.
            capped = (
                f" (its limit = {limit} stopped reading at {limit} records: raise "
                f"[corpus.{name}] limit if the source holds more)"
                if isinstance(limit, int) and len(corpus.prompts) >= limit
                else ""
            )
            problems.append(
                f"corpus {name!r} has {usable} distinct prompts within {lo}-{hi} input tokens"
                f"{capped}; {what} needs {need}"
            )
    return problems


def corpus_usage(corpus: Corpus, input_tokens: tuple[int, int]) -> str:
    """How many of the corpus's prompts a sweep samples from, and what became of the others, in
    words (`dvfs doctor`): shorter than `input_tokens` skipped, longer trimmed to it (or
    dropped where the earlier turns alone exceed it), a text given twice (or two trimmed to
    one) counted once. Just the count where every prompt is used as written."""
    from dvfs.corpora.sampling import eligible_prompts, fit_to_range

    lo, hi = input_tokens
    short = sum(p.input_tokens < lo for p in corpus.prompts)
    long = [p for p in corpus.prompts if p.input_tokens > hi]
    dropped = sum(fit_to_range(p, lo, hi) is None for p in long)
    pool = len(eligible_prompts(corpus, input_tokens))
    repeats = len(corpus.prompts) - short - dropped - pool
    fates = [
        (short, f"under {lo} tokens skipped"),
        (len(long) - dropped, f"over {hi} trimmed"),
        (dropped, f"over {hi} skipped (too long to trim)"),
        (repeats, "repeat" if repeats == 1 else "repeats"),
    ]
    said = ", ".join(f"{n} {what}" for n, what in fates if n)
    total = f"{len(corpus.prompts)} prompts"
    return f"{total}, {pool} to sample: {said}" if said else total


def shortfall_line(campaign: Campaign, problems: list[str]) -> str:
    """`corpus_shortfalls` as the one line the sweep, its dry run and `dvfs doctor` say, with
    what to do: a closed-loop pool of `workload.pool_size` needs that many prompts whatever
    the batch sizes, so it is the setting to lower there."""
    w = campaign.workload
    lower = (
        "Lower workload.pool_size (to above the largest batch)"
        if w.mode == "closed-loop" and w.pool_size is not None
        else "Lower the batch sizes"
    )
    return "; ".join(problems) + f". {lower}, widen workload.input_tokens, or add prompts"


def check_corpora(campaign: Campaign, corpora: dict[str, Corpus]) -> None:
    """Refuse a campaign whose corpora cannot fill its largest batch (exit 2, as an invalid
    campaign: `CorpusShortfallError`)."""
    problems = corpus_shortfalls(campaign, corpora)
    if problems:
        raise CorpusShortfallError(shortfall_line(campaign, problems))
