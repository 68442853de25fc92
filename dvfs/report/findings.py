"""The findings: a few sentences read off the headroom and compare documents, each with the
figures that show it (matched by the figure's file name; any figure left over is still shown)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dvfs.report.common import fmt_ms, gpu_words, short_label
from dvfs.report.compare import MEAN_WITHIN, TOO_FEW, edge_arms, ratio_text, too_slow
from dvfs.report.headroom import NOISE_MARK, UNLOCKED, clock_was_locked, saving_stock_energy
from dvfs.report.model import Figure, Finding, Paragraph, Section
from dvfs.report.reasons import no_answer_groups

#: Which finding shows which figures, by the start of the figure's file name.
FIGURES_OF = {
    "headroom": ("headroom", "pareto", "latency_vs_power_limit", "timelines"),
    "energy": ("energy_vs_clock", "energy_vs_power_limit"),
    "speculation": ("acceptance", "energy_vs_batch", "energy_split"),
}
#: Rows named in a sentence; more are counted.
MAX_NAMED = 6


def _stem(figure: Figure) -> str:
    return figure.name.rsplit("/", 1)[-1].rsplit(".", 1)[0]


def _takes(prefixes: tuple[str, ...], figure: Figure) -> bool:
    stem = _stem(figure)
    return any(stem == p or stem.startswith(p + "_") for p in prefixes)


def _where(row: dict[str, Any]) -> str:
    gpu = f"{gpu_words(short_label(row['gpu']))}, " if row.get("gpu") else ""
    return f"{gpu}batch {row['batch']}, drafter {row['drafter']}, corpus {row['corpus']}"


def _setting(clock: Any, limit: Any, clock_locked: bool = True) -> str:
    """A setting in words; of a campaign that never set the SM clock, the limit alone: the
    clock the cube files its cells under is the stock one, no lock (the table's "not set")."""
    return f"{clock} MHz / {limit:g} W" if clock_locked else f"{limit:g} W"


def _named(items: list[str]) -> str:
    more = len(items) - MAX_NAMED
    return "; ".join(items[:MAX_NAMED]) + (f"; and {more} more" if more > 0 else "")


def _at(ref: dict[str, Any]) -> str:
    """Where the reference is, in a sentence: "stock", or "the top of the grid" (the grid
    lacks stock; the headroom section says which setting that is), or "each GPU's reference"
    where a merged cube's GPUs have both (one GPU's stock setting on the grid, another's not)."""
    per_gpu = ref.get("per_gpu") or {}
    kinds = {bool(r.get("is_stock", True)) for r in per_gpu.values()} or {bool(ref["is_stock"])}
    if len(kinds) > 1:
        return "each GPU's reference"
    return "stock" if kinds == {True} else "the top of the grid"


def _paired_over(row: dict[str, Any]) -> str:
    """Which repeats a saving's energies are over, where the reference's energy over all its
    usable repeats differs: the saving pairs the repeats measured at both."""
    paired, stock = row.get("paired_stock_energy_per_token_j"), row["stock_energy_per_token_j"]
    if paired is None or stock is None or paired == stock:
        return ""
    return (
        f", over the {row['saving_repeats']} repeat(s) measured at both; "
        f"{stock:.4g} J over all the reference's"
    )


def headroom_finding(room: dict[str, Any], figures: tuple[Figure, ...]) -> Finding:
    rows = room["rows"]
    saved = [r for r in rows if r["feasible"] and (r["saving"] or 0) > 0]
    # A saving within the measurement noise (the headroom table's ≈) is no saving shown.
    saving = [r for r in saved if not r.get("saving_within_noise")]
    noise = [r for r in saved if r.get("saving_within_noise")]
    infeasible = [r for r in rows if not r["feasible"]]
    # an answer with no usable energy at the reference (an --slo or --vs-baseline answer, the
    # table's "-"): its saving is unknown, not none
    unknown = [r for r in rows if r["feasible"] and r["saving"] is None]
    details = []
    if saving:
        best = max(saving, key=lambda r: r["saving"])
        ref = room["reference"].get("per_gpu", {}).get(best.get("gpu")) or room["reference"]
        locked = clock_was_locked(room)
        unset = "" if locked else f", the SM clock {UNLOCKED}"
        details.append(
            f"Largest saving: {best['saving']:.1%} of the energy per token at {_where(best)}: "
            f"{_setting(best['chosen']['sm_clock_mhz'], best['chosen']['power_limit_w'], locked)}"
            f" instead of {_setting(ref['sm_clock_mhz'], ref['power_limit_w'], locked)}{unset} "
            f"({saving_stock_energy(best):.4g} -> {best['energy_per_token_j']:.4g} J "
            f"per token{_paired_over(best)}; latency {fmt_ms(best['latency_ms'])} ms against a "
            f"{fmt_ms(best['target_ms'])} ms target)."
        )
    if noise:
        details.append(
            f"{NOISE_MARK}: at {_named([_where(r) for r in noise])} the chosen setting's saving "
            "is within the measurement noise (no setting that saves beyond it, nor "
            f"{_at(room['reference'])}, meets the target): no saving is shown to exist there."
        )
    if unknown:
        details.append(
            f"At {_named([_where(r) for r in unknown])} a setting meets the target, but "
            f"{_at(room['reference'])} has no usable energy to save against (too few usable "
            "repeats there, or none), so its saving is unknown (the headroom table's -)."
        )
    # Each row without an answer with the headroom table's reason and what would give it one:
    # "no setting meets the target" only where settings were judged over it.
    for reason, advice, group in no_answer_groups(infeasible, room["target"].get("mode"), room):
        lead = (
            "No measured setting meets the target (within the confidence bound)"
            if reason == "none feasible"
            else reason[:1].upper() + reason[1:]
        )
        details.append(f"{lead} at: {_named([_where(r) for r in group])}. What to do: {advice}.")
    headline = (
        f"{len(saving)} of {len(rows)} {_groups(rows)} save energy below "
        f"{_at(room['reference'])} "
        f"while meeting {room['target']['description']}"
        + (f"; {_others(unknown)} it with the saving unknown." if unknown else ".")
    )
    swept = room.get("swept") or {}
    if rows and swept.get("sm_clock") is False and swept.get("power_limit") is False:
        # one clock and one limit: no setting below the reference was measured, so "0 of N
        # save" would read as a finding that none saves
        headline = (
            "Nothing was swept (the cube has one SM clock and one power limit), so no setting "
            f"below {_at(room['reference'])} was measured and no saving can be found: sweep "
            "knobs.sm_clock or knobs.power_limit over several values to find one."
        )
    return Finding(headline, tuple(details), figures)


def energy_finding(room: dict[str, Any], figures: tuple[Figure, ...]) -> Finding:
    rows = [r for r in room["rows"] if r["stock_energy_per_token_j"] is not None]
    at = _at(room["reference"])
    if not rows:
        # measured but unusable is not unmeasured: flagged, failed, or one usable repeat of
        # several (an energy there needs two), as the headroom table's rows say
        return Finding(
            f"No energy at {at} to report: none of its cells is usable (not measured yet, "
            "failed, flagged invalid, or too few usable repeats).",
            (),
            figures,
        )
    low = min(rows, key=lambda r: r["stock_energy_per_token_j"])
    high = max(rows, key=lambda r: r["stock_energy_per_token_j"])
    least, most = (f"{r['stock_energy_per_token_j']:.4g}" for r in (low, high))
    if len(rows) == 1:  # one group: no range
        said = f"is {least} J ({_where(low)})"
    elif least == most:  # no range either: naming one row twice would say nothing
        said = f"is {least} J in all {len(rows)} {_groups(rows)}"
    else:
        said = f"ranges from {least} J ({_where(low)}) to {most} J ({_where(high)})"
    return Finding(
        f"At {at}, energy per token {said}.",
        _batch_trend(rows, at),
        figures,
    )


def _batch_trend(rows: list[dict[str, Any]], at: str) -> tuple[str, ...]:
    """Whether energy per token at the reference falls from the smallest to the largest
    batch."""
    groups: dict[tuple[Any, ...], dict[int, float]] = {}
    for r in rows:
        key = (r.get("gpu"), r["drafter"], r["corpus"])
        groups.setdefault(key, {})[r["batch"]] = r["stock_energy_per_token_j"]
    pairs = [g for g in groups.values() if len(g) > 1]
    if not pairs:
        return ()
    lo, hi = min(min(g) for g in pairs), max(max(g) for g in pairs)
    falls = sum(1 for g in pairs if g[max(g)] < g[min(g)])
    what = "(GPU, drafter, corpus) series" if _merged(rows) else "(drafter, corpus) pairs"
    return (
        f"From the smallest to the largest batch measured, energy per token at {at} falls for "
        f"{falls} of {len(pairs)} {what} (batches {lo} to {hi}).",
    )


def _others(rows: list[dict[str, Any]]) -> str:
    """'1 other row meets' / '2 other rows meet' (rows: those not counted as saving)."""
    kind = "rows" if _merged(rows) else "groups"
    one = len(rows) == 1
    return f"{len(rows)} other {kind[:-1] if one else kind} {'meets' if one else 'meet'}"


def _merged(rows: list[dict[str, Any]]) -> bool:
    """Rows of a merged cube: one per GPU of each group."""
    return any(r.get("gpu") for r in rows)


def _groups(rows: list[dict[str, Any]]) -> str:
    """What a headroom row is: a (batch, drafter, corpus) group, per GPU in a merged cube."""
    return (
        "(GPU, batch, drafter, corpus) rows" if _merged(rows) else "(batch, drafter, corpus) groups"
    )


def speculation_finding(comparison: dict[str, Any], figures: tuple[Figure, ...]) -> Finding:
    base = comparison["baseline"]
    details = [
        f"{_gpu(r)}{r['drafter']} on {r['corpus']}: at equal clock "
        f"{r['equal_clock_summary']}; at equal latency {r['equal_latency_summary']}."
        for r in comparison["break_even_batch"]
    ]
    for a in comparison["acceptance"]:
        details.append(
            f"{a['drafter']} on {a['corpus']}: {a['accept_length']:.2f} tokens accepted per "
            "verify pass."
        )
    mixed = [r for r in comparison["rows"] if r.get("different_gpus")]
    if mixed:
        details.append(
            f"In {len(mixed)} of {len(comparison['rows'])} rows the drafter and {base!r} were "
            "measured on different GPUs: GPU-to-GPU spread is part of those ratios."
        )
    ratios = [r for r in comparison["rows"] if r["energy_ratio_equal_latency"] is not None]
    if ratios:
        best = min(ratios, key=lambda r: r["energy_ratio_equal_latency"])
        headline = (
            "At equal latency, speculation's best case is "
            f"{ratio_text(best['energy_ratio_equal_latency'])}x the energy per token of "
            f"{base!r} ({_where(best)}){_judged(best)}."
        )
    else:
        headline = _no_equal_latency(comparison)
    return Finding(headline, tuple(details), figures)


#: What the best case's verdict at equal latency means, where it does not save
#: (`dvfs.analysis.compare.verdict`): the ratio alone read as a saving.
_NOT_SAVING = {
    "within noise": "within noise: its interval holds 1, so it is not judged to save",
    "costs": "judged to cost more",
    "one paired repeat": "on one paired repeat, too few to judge whether it saves",
}


def _judged(row: dict[str, Any]) -> str:
    """What the best case's ratio is, where the ratio alone would mislead: its verdict where
    it is not "saves", and a setting at the grid's lowest (a lower one might spend less)."""
    said = []
    verdict = row.get("verdict_equal_latency")
    if verdict in _NOT_SAVING:
        said.append(_NOT_SAVING[verdict])
    edge = edge_arms(row)
    if edge:
        said.append(
            f"the {' and the '.join(edge)}'s setting is the lowest the grid swept, so the ratio "
            "may move once the grid is extended downward"
        )
    return "; " + "; ".join(said) if said else ""


def _no_equal_latency(comparison: dict[str, Any]) -> str:
    """The headline where no row has an equal-latency ratio: "no drafter meets the baseline's
    latency" only for the rows whose verdict says so (not within target); rows whose settings
    were left unjudged for want of usable repeats (too few repeats) are said to be that, and
    rows with nothing valid to compare (no data: the baseline's reference or the drafter's
    cells unusable) that, never too slow."""
    base, at = comparison["baseline"], _at(comparison["reference"])
    rows = comparison["rows"]
    slow = [r for r in rows if too_slow(r)]
    few = [r for r in rows if not too_slow(r) and r.get("verdict_equal_latency") == TOO_FEW]
    empty = len(rows) - len(slow) - len(few)
    met = _mean_met(slow, every=len(slow) == len(rows))
    if rows and len(slow) == len(rows):
        return f"No drafter meets {base!r}'s latency at {at} at any measured setting{met}."
    few_text = f"{len(few)} have too few usable repeats to judge a setting"
    empty_text = f"{empty} have no valid cells of both to compare"
    if not slow and not few:
        return (
            f"No drafter could be compared with {base!r} at equal latency: no row has valid "
            "cells of both to compare (see the headroom table's reasons)."
        )
    if not slow:
        rest = f"; the other {empty_text}" if empty else ""
        return (
            f"No drafter could be compared with {base!r} at equal latency: {len(few)} of "
            f"{len(rows)} rows have too few usable repeats to judge a setting{rest} (see the "
            "headroom table's reasons)."
        )
    others = [t for n, t in ((len(few), few_text), (empty, empty_text)) if n]
    return (
        f"No drafter meets {base!r}'s latency at {at} at any measured setting in {len(slow)} of "
        f"{len(rows)} rows{met}; of the other {len(rows) - len(slow)}, {' and '.join(others)}."
        if few
        else f"No drafter meets {base!r}'s latency at {at} at any measured setting in "
        f"{len(slow)} of {len(rows)} rows{met}; the other {empty} have no valid cells of both to "
        "compare."
    )


def _mean_met(slow: list[dict[str, Any]], *, every: bool) -> str:
    """Of rows not within target, those whose fastest setting's mean latency met the target
    (its bound at the confidence asked did not), in words: "" for none. Counted in rows, never
    "of them" after a sentence that names no count (`every`: all the rows are not within
    target, and the headline says "any measured setting" without one), which reads as drafters."""
    met = [r for r in slow if r.get(MEAN_WITHIN)]
    if not met:
        return ""
    if every:
        some = "every row" if len(met) == len(slow) else f"{len(met)} of the {len(slow)} rows"
    else:
        some = "all of those" if len(met) == len(slow) else f"{len(met)} of those"
    return (
        f" (in {some} a setting's mean latency met it, its bound at the confidence asked did "
        "not: more repeats may settle it)"
    )


def _gpu(row: dict[str, Any]) -> str:
    return f"{gpu_words(short_label(row['gpu']))}: " if row.get("gpu") else ""


def findings_section(
    room: dict[str, Any], comparison: dict[str, Any] | None, figures: Sequence[Figure]
) -> Section:
    """The findings in reading order; figures no finding claims come last."""

    def claim(key: str) -> tuple[Figure, ...]:
        return tuple(f for f in figures if _takes(FIGURES_OF[key], f))

    findings = [headroom_finding(room, claim("headroom")), energy_finding(room, claim("energy"))]
    claimed = {*FIGURES_OF["headroom"], *FIGURES_OF["energy"]}
    if comparison is not None:
        findings.append(speculation_finding(comparison, claim("speculation")))
        claimed |= set(FIGURES_OF["speculation"])
    rest = tuple(f for f in figures if not _takes(tuple(claimed), f))
    blocks: list[Any] = list(findings)
    if rest:
        blocks.append(Finding("More figures.", (), rest))
    if not figures:
        blocks.append(Paragraph("No figures were drawn for this cube.", tone="note"))
    return Section("Findings", "findings", tuple(blocks))
