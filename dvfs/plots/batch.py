"""Energy per token against batch size at the reference setting (stock, or the top of the
grid where stock was not swept): a panel per corpus, a line per
drafter. Two findings read off it at a glance: batching lowers the energy of a token, and
speculation's saving over no speculation shrinks as the batch grows (down to a loss where a
drafter's verify pass is past the ridge point)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.analysis.headroom import reference_setting
from dvfs.plots.curves import measured_colors
from dvfs.plots.data import cell_means, flagged_drafters
from dvfs.plots.style import (
    ENERGY_LABEL,
    Margins,
    cube_drafter_colors,
    grid_shape,
    panel_figure,
    place_legend,
    say_not_drawn,
    say_nothing_drawn,
    styled,
    suptitle,
    text_width_in,
)

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.figure import Figure

PANEL_W_IN = 3.4
PANEL_H_IN = 2.9
DIMS = ("corpus", "drafter", "batch")
BASELINE = "none"


def batch_title(cube: xr.Dataset) -> str:
    """The reference in the words every command uses: stock, or the top of the grid."""
    gpu = cube.attrs.get("gpu_name", "")
    return f"Energy per token vs batch, at {reference_setting(cube).describe()}" + (
        f" - {gpu}" if gpu else ""
    )


def stock_energy(cube: xr.Dataset, usable: xr.DataArray | None = None) -> np.ndarray:
    """Energy per token (J) at the reference setting, axes (corpus, drafter, batch); `usable`
    as `cell_means` takes it."""
    ref = reference_setting(cube)
    return cell_means(
        cube,
        "energy_per_token_j",
        DIMS,
        usable=usable,
        sm_clock=ref.sm_clock,
        power_limit=ref.power_limit,
    )


def line_style(drafter: str) -> dict[str, Any]:
    """No speculation solid and heavier, every drafter dashed: the baseline stands out."""
    baseline = drafter == BASELINE
    return {
        "marker": "o",
        "markersize": 3.5,
        "linewidth": 1.6 if baseline else 1.2,
        "linestyle": "-" if baseline else "--",
    }


def batch_handles(colors: dict[str, str]) -> list[Any]:
    """A legend entry per drafter drawn as its lines are (solid or dashed)."""
    from matplotlib.lines import Line2D

    return [Line2D([], [], color=c, label=d, **line_style(d)) for d, c in colors.items()]


@styled
def draw_energy_vs_batch(cube: xr.Dataset, usable: xr.DataArray | None = None) -> Figure | None:
    """Energy per token (J, log scale) against batch (log scale), one line per drafter; None
    when the cube holds a single batch size. `usable` as `cell_means` takes it."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator

    batches = [int(b) for b in cube["batch"].values]
    if len(batches) < 2:
        return None
    # A line joins its points in batch order: the cube's axis is the campaign's (batch = [16,
    # 1, 4] is allowed), so the points are drawn sorted, not zigzagging back along the axis.
    ascending = np.argsort(batches, kind="stable")
    batches = [batches[i] for i in ascending]
    corpora = [str(c) for c in cube["corpus"].values]
    drafters = [str(d) for d in cube["drafter"].values]
    colors = cube_drafter_colors(cube)
    energy = stock_energy(cube, usable)[..., ascending]
    title = batch_title(cube)
    at = "stock" if reference_setting(cube).is_stock else "the top of the grid"
    rows, cols = grid_shape(len(corpora))
    side = 0.0
    if len(corpora) == rows * cols:  # no free grid slot: the legend goes in a side column
        side = max(text_width_in(label, 9) for label in drafters) + 0.7
    panels = panel_figure(len(corpora), PANEL_W_IN, PANEL_H_IN, Margins(side=side), title=title)
    for c, (ax, corpus) in enumerate(zip(panels.axes, corpora, strict=True)):
        for d, drafter in enumerate(drafters):
            if np.all(np.isnan(energy[c, d])):
                continue
            ax.plot(batches, energy[c, d], color=colors[drafter], **line_style(drafter))
        missing = [d for i, d in enumerate(drafters) if np.all(np.isnan(energy[c, i]))]
        ref = reference_setting(cube)
        # valid cells at the reference, but too few usable repeats there to be the reference
        flagged = flagged_drafters(
            cube, missing, corpus=corpus, sm_clock=ref.sm_clock, power_limit=ref.power_limit
        )
        few = f"too few valid repeats at {at}"
        if np.all(np.isnan(energy[c])):
            say_nothing_drawn(ax, few if flagged else f"no valid cell at {at}")
        else:  # the lines fall from the upper left: its right is free
            say_not_drawn(ax, missing, f"no valid cell at {at}", "upper right", flagged, few)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        # 1-2-5 ticks, labelled, and no minor ticks: readable, and each tick is a few artists
        # to lay out and draw
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_locator(FixedLocator(batches))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_title(f"corpus {corpus}")
        ax.set_xlabel("batch (requests decoded together)")
        ax.set_ylabel(ENERGY_LABEL)
    # a legend entry only for a drafter with a line (`measured_colors`): one with no valid
    # cell at the reference is not drawn
    place_legend(panels, batch_handles(measured_colors(colors, energy)))
    suptitle(panels.fig, title)
    return panels.fig
