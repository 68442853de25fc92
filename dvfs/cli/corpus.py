"""`dvfs corpus`: the built-in corpora and a campaign's own, with their prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dvfs.cli.common import console, echo_json, escape, handle_errors

campaign_option = click.option(
    "--campaign",
    "campaign_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also list the user corpora this campaign defines (and count tokens its way).",
)


def _corpora(
    campaign_file: Path | None,
) -> tuple[dict[str, Any], str, dict[str, str], dict[str, str]]:
    """The corpora, how their tokens were counted, their descriptions, and the built-in corpus
    each campaign table's `acceptance_like` names (the twin's class for it, not its text's)."""
    from dvfs.corpora import BUILTIN_CORPORA, load_corpus
    from dvfs.corpora.registry import BUILTIN_DESCRIPTIONS
    from dvfs.corpora.tokens import ESTIMATE

    if campaign_file is None:
        corpora = {name: load_corpus(name) for name in BUILTIN_CORPORA}
        return corpora, ESTIMATE, dict(BUILTIN_DESCRIPTIONS), {}
    from dvfs.backends import tokenizer_model
    from dvfs.campaign import load_campaign
    from dvfs.corpora.prepare import corpus_descriptions, load_corpora
    from dvfs.corpora.tokens import token_counter

    campaign = load_campaign(campaign_file)
    count, method = token_counter(tokenizer_model(campaign))
    own = load_corpora(campaign, count)
    # The built-ins (the campaign's table where it gives one a built-in's name), then the
    # campaign's own, all counted its way.
    corpora = {n: own.get(n) or load_corpus(n, count_tokens=count) for n in BUILTIN_CORPORA}
    corpora.update(own)
    descriptions = {**BUILTIN_DESCRIPTIONS, **corpus_descriptions(campaign)}
    likes: dict[str, str] = {}
    # A [corpus.NAME] table the campaign defines but workload.corpora does not name yet (one
    # being tried out before it is swept): validated when the campaign loaded, listed too.
    import tomllib

    for name, spec in tomllib.loads(campaign.source).get("corpus", {}).items():
        if "acceptance_like" in spec:
            likes[name] = str(spec["acceptance_like"])
        if name not in own:
            corpora[name] = load_corpus(name, spec, base_dir=campaign.base_dir, count_tokens=count)
            descriptions[name] = str(spec.get("description", ""))
    return corpora, method, descriptions, likes


def _counted(stats: dict[str, Any]) -> str:
    """A corpus's prompt count, with how many are distinct where some repeat another (a sweep
    samples only distinct ones, so a batch needs that many)."""
    if stats["distinct"] == stats["prompts"]:
        return str(stats["prompts"])
    return f"{stats['prompts']} ({stats['distinct']} distinct)"


def _reads_as(text: dict[str, Any]) -> str:
    """How a corpus reads (genre, language) and the class the twin's trained drafters accept
    it as: the text's own, or the campaign's `acceptance_like`, said to be set."""
    like = text["acceptance_class"]
    set_by = " (acceptance_like)" if text["acceptance_like"] else ""
    return f"{text['genre']}, {text['language']}; accepts like {like}{set_by}"


@click.group()
def corpus() -> None:
    """The prompt corpora: five built-in, and your own from a campaign file."""


@corpus.command("list")
@campaign_option
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON: each corpus's statistics, and how tokens were counted.",
)
@handle_errors
def list_corpora(campaign_file: Path | None, as_json: bool) -> None:
    """Corpora with prompt counts and input-token statistics."""
    from dvfs.corpora.sampling import corpus_stats
    from dvfs.twin.textprior import profile_corpus

    corpora, method, descriptions, likes = _corpora(campaign_file)
    rows = []
    for n, c in corpora.items():
        text = profile_corpus(c)  # what the twin's acceptance reads from the text
        if n in likes:  # the class the campaign set, as the twin (and the cube) take it
            text = text.overridden(likes[n])
        reads_as = {
            "genre": text.genre,
            "language": text.language,
            "acceptance_class": text.acceptance_class,
            "acceptance_like": text.override,
            "ngram_repetition": round(text.ngram_repetition, 4),
        }
        rows.append({**corpus_stats(c), "description": descriptions.get(n, ""), "text": reads_as})
    if as_json:
        echo_json({"token_count_method": method, "corpora": rows})
        return
    from rich.table import Table

    table = Table()
    columns = ("corpus", "prompts", "multi-turn", "input tokens min/median/max", "reads as")
    for col in (*columns, "description"):
        table.add_column(col, overflow="fold")  # a narrow terminal's: folded, never cut short
    for r in rows:
        text = r["text"]
        table.add_row(  # names and descriptions are the user's text, not markup
            escape(r["name"]),
            _counted(r),
            str(r["multi_turn"]),
            f"{r['tokens_min']}/{r['tokens_median']:g}/{r['tokens_max']}",
            _reads_as(text),
            escape(r["description"]),
        )
    out = console()
    out.print(table)
    out.print(f"token counts: {escape(method)}")  # a tokenizer of a model's path


@corpus.command("show")
@click.argument("name")
@campaign_option
@click.option(
    "-n",
    "count",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Prompts to print.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Which prompts (sampled).")
@click.option(
    "--json", "as_json", is_flag=True, help="Print JSON: the statistics and the prompts sampled."
)
@handle_errors
def show(name: str, campaign_file: Path | None, count: int, seed: int, as_json: bool) -> None:
    """Statistics and a few prompts of corpus NAME."""
    from dvfs.corpora.sampling import corpus_stats, preview_prompts

    corpora, method, _, _ = _corpora(campaign_file)
    if name not in corpora:
        hint = "" if campaign_file else " (user corpora need --campaign FILE)"
        # A name the command does not know is bad usage (exit 2), like an unknown choice.
        raise click.BadParameter(
            f"no corpus {name!r}; known: {', '.join(corpora)}{hint}", param_hint="NAME"
        )
    c = corpora[name]
    prompts = preview_prompts(c, count, seed=seed)
    s = corpus_stats(c)
    if as_json:
        echo_json(
            {
                **s,
                "token_count_method": method,
                "sample": [
                    {"id": p.id, "input_tokens": p.input_tokens, "messages": p.as_chat()}
                    for p in prompts
                ],
            }
        )
        return
    out = console()
    out.print(
        f"[bold]{escape(name)}[/bold]: {s['prompts']} prompts ("
        + ("" if s["distinct"] == s["prompts"] else f"{s['distinct']} distinct, ")
        + f"{s['multi_turn']} multi-turn), "
        f"input tokens {s['tokens_min']}/{s['tokens_median']:g}/{s['tokens_max']} "
        f"(min/median/max, {escape(method)}); hash {s['content_hash']}"
    )
    out.print(f"source: {s['source']}", markup=False)
    for p in prompts:
        # ids come from the user's file: brackets in one are text, not markup
        out.print(f"\n[bold]{escape(p.id)}[/bold] ({p.input_tokens} tokens)")
        for m in p.messages:
            text = m.content if len(m.content) <= 600 else m.content[:600] + " [...]"
            out.print(f"{m.role}: {text}", markup=False)
