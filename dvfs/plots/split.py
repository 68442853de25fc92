"""Where the energy goes: each drafter's energy per token stacked by part (prefill, drafting,
verification, overhead), a figure per corpus, one panel per batch, at the cube's reference
setting."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dvfs.analysis.split import ESTIMATED, NO_DRAFTER, no_estimate_reasons, where_energy_goes
from dvfs.cube.schema import STATUS_FAILED
from dvfs.engines.base import SPLIT_PARTS
from dvfs.plots.style import (
    ENERGY_LABEL,
    Margins,
    Panels,
    clear_panels,
    palette,
    panel_figure,
    place_legend,
    stock_label,
    styled,
    suptitle,
    text_width_in,
)

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.figure import Figure

#: Each part's colour, as an index into the palette: prefill green, drafting orange,
#: verification blue, overhead grey.
PART_COLORS = (2, 1, 0, 7)
PART_LABELS = {
    "prefill": "prefill",
    "draft": "drafting",
    "verify": "verification (decode without a drafter)",
    "overhead": "host overhead and idle",
}


def split_title(split: xr.Dataset, corpus: str) -> str:
    """The title of `corpus`'s figure (`split`: where_energy_goes's, every corpus or one)."""
    ref = split.attrs
    return (
        f"Where the energy goes: energy per token by part - corpus {corpus}\n"
        + stock_label(
            int(ref["reference_sm_clock_mhz"]),
            float(ref["reference_power_limit_w"]),
            bool(ref["reference_is_stock"]),
        )
        + "; mean over repeats"
        + ("; hatched: estimated" if bool((split["split_method"] == ESTIMATED).any()) else "")
    )


def worth_drawing(split: xr.Dataset, reasons: dict[str, str]) -> bool:
    """Whether a figure of `split` (where_energy_goes's, every corpus or one) has something to
    show: a drafter's split, or a speculative drafter measured without one, whose bars then
    say why (`reasons`: `no_estimate_reasons`), as a cube whose only family gets no estimate
    (a top-k 1 chain) has."""
    if bool((split["split_method"] > 0).any()):
        return True
    measured = (split["measured"] > 0).any([d for d in split["measured"].dims if d != "drafter"])
    return any(
        bool(measured.sel(drafter=d)) and reasons.get(str(d), "") != NO_DRAFTER
        for d in split["drafter"].values
    )


def parts_drawn(split: xr.Dataset) -> list[str]:
    """The parts a figure of `split` (where_energy_goes's, one corpus) draws and keys: a part
    nowhere above 0 J (prefill, outside every fixed batch's window) is neither drawn nor in
    the legend, nor named in the report's caption."""
    return [
        p
        for p in SPLIT_PARTS
        if bool(np.nan_to_num(split[f"energy_per_token_{p}_j"].values, nan=0.0).any())
    ]


@styled
def split_panels(split: xr.Dataset) -> Panels:
    """Empty panels for every corpus's figure, a panel per batch, as wide as the longest
    corpus's title: pass them to each corpus's draw call (making axes costs more than drawing
    into them)."""
    drafters = [str(d) for d in split["drafter"].values]
    corpus = max((str(c) for c in split["corpus"].values), key=len)
    panel_w = max(2.4, 0.55 * len(drafters) + 0.6)
    label_h = max(text_width_in(d, 9) for d in drafters) * 0.87 + 0.25  # labels at 60 degrees
    margins = Margins(left=0.9, top=0.8, bottom=0.35 + label_h, hspace=0.55 + label_h, side=2.9)
    title = split_title(split, corpus)
    return panel_figure(int(split.sizes["batch"]), panel_w, 2.6, margins, max_cols=3, title=title)


@styled
def draw_energy_split(
    cube: xr.Dataset,
    corpus: str | None = None,
    split: xr.Dataset | None = None,
    panels: Panels | None = None,
) -> Figure | None:
    """Where the energy goes on one corpus (default: the cube's first): never a mean over
    corpora, whose drafters accept (and so spend) differently. A drafter measured without a
    split says why at its bar ("no split: " and `no_estimate_reasons`'s reason). None when no
    cell carries a split, exact or estimated, and no speculative drafter was measured (a cube
    built before the split, a real GPU's cube without speculation). `split` is
    `where_energy_goes(cube)` and `panels` `split_panels(split)`, to make them once for every
    corpus."""
    from matplotlib.patches import Patch

    if "energy_split_method" not in cube:
        return None
    corpus = str(cube["corpus"].values[0]) if corpus is None else corpus
    whole = split if split is not None else where_energy_goes(cube)
    split = whole.sel(corpus=corpus)
    reasons = no_estimate_reasons(cube)
    if not worth_drawing(split, reasons):
        return None
    drafters = [str(d) for d in split["drafter"].values]
    batches = [int(b) for b in split["batch"].values]
    values = {
        part: split[f"energy_per_token_{part}_j"].transpose("batch", "drafter").values
        for part in SPLIT_PARTS
    }
    shown = parts_drawn(split)
    colors = dict(zip(SPLIT_PARTS, (palette()[i] for i in PART_COLORS), strict=True))
    title = split_title(split, corpus)
    panels = clear_panels(panels) if panels is not None else split_panels(whole)
    x = np.arange(len(drafters))
    # a reference cell that failed is no cell still to measure: said as the table says it
    failed_at = (
        (
            cube["cell_status"].sel(
                sm_clock=int(split.attrs["reference_sm_clock_mhz"]),
                power_limit=float(split.attrs["reference_power_limit_w"]),
                corpus=corpus,
            )
            == STATUS_FAILED
        )
        .any("repeat")
        .sel(drafter=drafters, batch=batches)
        .transpose("batch", "drafter")
        .values
    )
    for b, (ax, batch) in enumerate(zip(panels.axes, batches, strict=True)):
        one = split.sel(batch=batch)
        estimated = one["split_method"].values == ESTIMATED
        measured = one["measured"].values > 0
        invalid = one["invalid"].values > 0
        failed = failed_at[b]
        split_known = one["split_method"].values > 0
        bottom = np.zeros(len(drafters))
        for part in shown:
            heights = np.nan_to_num(values[part][b], nan=0.0)
            bars = ax.bar(
                x[split_known],
                heights[split_known],
                0.7,
                bottom=bottom[split_known],
                color=colors[part],
                linewidth=0,
                label=part,
            )
            for bar, est in zip(bars, estimated[split_known], strict=True):
                if est:
                    bar.set_hatch("//")
            bottom += heights
        # No bar is not a bar of 0 J: say why there is none.
        for i in np.flatnonzero(~split_known):
            why = reasons.get(drafters[i])
            ax.text(
                float(i),
                0.0,
                " invalid"
                if invalid[i]
                else (f" no split:\n {why}" if why else " no split")
                if measured[i]
                else " failed"
                if failed[i]
                else " not measured",
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=8,
                color="#555555",
                gid="missing",
            )
        ax.set_title(f"batch {batch}")
        ax.set_xticks(x, drafters, rotation=60, ha="right")
        ax.set_ylabel(ENERGY_LABEL)
        ax.set_xlim(-0.6, len(drafters) - 0.4)
        # a reused panel may hold the last corpus's fixed y limits (its data limits were
        # emptied by clear_panels)
        ax.autoscale(enable=True, axis="y")
        ax.autoscale_view()
        if not split_known.any():  # a panel of text only: give it a scale to stand on
            ax.set_ylim(0.0, 1.0)
    handles = [Patch(color=colors[p], label=PART_LABELS[p]) for p in shown]
    place_legend(panels, handles)
    suptitle(panels.fig, title)
    return panels.fig
