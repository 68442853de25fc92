"""Energy per token against SM clock, and energy against latency (Pareto fronts): a figure per
corpus, a panel per batch size, a colour per drafter, a line style and marker per power limit."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dvfs.analysis.headroom import reference_setting
from dvfs.plots.data import at_chosen, cell_means, flagged_drafters, pareto_front, usable_mask
from dvfs.plots.style import (
    CHOSEN_STYLE,
    ENERGY_LABEL,
    STOCK_STYLE,
    Margins,
    Panels,
    chosen_handle,
    clear_panels,
    color_handles,
    cube_drafter_colors,
    grid_shape,
    limit_handles,
    limit_styles,
    panel_figure,
    place_legend,
    say_not_drawn,
    say_nothing_drawn,
    stock_handle,
    stock_label,
    styled,
    suptitle,
    text_width_in,
)

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from dvfs.analysis.targets import Target

PANEL_W_IN = 3.7
PANEL_H_IN = 3.0
DIMS = ("batch", "drafter", "power_limit", "sm_clock")


#: A panel with valid cells but no point: each setting has an invalid repeat beside them.
NO_SETTING = "no setting without an invalid repeat"

#: `dvfs headroom`'s choice: the least energy meeting the target of the settings that save
#: beyond the measurement noise (and stock), not always the least energy meeting it.
CHOSEN_LABEL = "chosen: dvfs headroom's setting"


def chosen_label(is_stock: bool, *stars: tuple[np.ndarray, np.ndarray]) -> str:
    """The chosen star's legend entry. Each star sits on its setting's point, the mean of
    every usable repeat there (`at_chosen`); the headroom table's values are over the repeats
    paired with the reference, the saving's. Where a repeat flagged at the reference alone
    sets the two apart for any star of the figure (`stars`: its values drawn and the table's,
    pairs of like shape), the entry says which the star shows, so the figure and the table
    read alike; elsewhere they agree and it is CHOSEN_LABEL alone."""
    for drawn, table in stars:
        both = np.isfinite(drawn) & np.isfinite(table)
        if not np.allclose(drawn[both], table[both], rtol=1e-9, atol=0.0):
            versus = "stock" if is_stock else "the reference"
            return (
                f"{CHOSEN_LABEL},\non its point: every usable repeat\n"
                f"(the table's: those paired with {versus})"
            )
    return CHOSEN_LABEL


def energy_title(cube: xr.Dataset, corpus: str) -> str:
    gpu = cube.attrs.get("gpu_name", "")
    return f"Energy per token vs SM clock - corpus {corpus}" + (f" ({gpu})" if gpu else "")


def pareto_title(target: str, corpus: str) -> str:
    """`target` in `dvfs headroom`'s words (its result's "target" attribute: `target_text`)."""
    return (
        f"Energy vs latency, every clock and power limit - corpus {corpus}\n"
        f"lines: Pareto fronts; target: {target}"
    )


def target_text(chosen: xr.Dataset, target: Target) -> str:
    """The target as `dvfs headroom` describes it for the cube `chosen` is of: against "the
    top of the grid" where the grid lacks stock, which `Target.describe` cannot know."""
    return str(chosen.attrs.get("target", target.describe()))


def longest_corpus(cube: xr.Dataset) -> str:
    """The corpus whose title is widest: per-corpus panels are sized for it."""
    return max((str(c) for c in cube["corpus"].values), key=len)


@styled
def corpus_panels(cube: xr.Dataset, title: str) -> Panels:
    """Empty panels for the per-corpus figures of `cube`, a panel per batch: pass them to
    every corpus's draw call (making axes costs more than drawing into them). The legend goes
    in the free grid slot, else in a side column sized for its longest label; the figure is
    as wide as `title` (that of the longest corpus name)."""
    ref = reference_setting(cube)
    batches = int(cube.sizes["batch"])
    labels = [str(d) for d in cube["drafter"].values]
    limits = cube["power_limit"].values
    labels += [
        s.label for s in limit_styles(limits, ref.power_limit, ref.stock_power_limit).values()
    ]
    labels += [stock_label(ref.sm_clock, ref.power_limit, ref.is_stock), CHOSEN_LABEL]
    rows, cols = grid_shape(batches)
    side = 0.0
    if batches == rows * cols:
        side = max(text_width_in(label, 9) for label in labels) + 0.7
    top = 0.45 + 0.25 * (title.count("\n") + 1)
    margins = Margins(top=top, side=side)
    return panel_figure(batches, PANEL_W_IN, PANEL_H_IN, margins, title=title)


def measured_colors(colors: dict[str, str], *values: np.ndarray) -> dict[str, str]:
    """The drafters (axis 1 of `values`, in `colors`' order) with a point to draw: a legend
    entry for a drafter not measured (yet) would name a line that is not there."""
    finite = np.logical_and.reduce([np.isfinite(v) for v in values])
    drawn = finite.any(axis=tuple(a for a in range(finite.ndim) if a != 1))
    return {d: c for (d, c), keep in zip(colors.items(), drawn, strict=True) if keep}


def tidy(ax: Axes, xlabel: str) -> None:
    """At most ~6 ticks an axis: enough to read values, fewer texts to lay out and draw."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(6, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_major_locator(MaxNLocator(6, steps=[1, 2, 2.5, 5, 10]))
    ax.autoscale_view()  # a reused panel's data limits were emptied by clear_panels
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ENERGY_LABEL)


@styled
def draw_energy_vs_clock(
    cube: xr.Dataset,
    corpus: str,
    panels: Panels | None = None,
    *,
    usable: xr.DataArray | None = None,
) -> Figure:
    """Energy per token (J) against the SM clock lock: one line per drafter and power limit,
    the stock setting ringed. `panels` (from corpus_panels) are emptied and drawn into;
    `usable` is `usable_mask(cube)`, made here when not given (`figures` makes it once)."""
    ref = reference_setting(cube)
    clocks = np.asarray(cube["sm_clock"].values, dtype=float)
    batches = [int(b) for b in cube["batch"].values]
    drafters = [str(d) for d in cube["drafter"].values]
    limits = [float(p) for p in cube["power_limit"].values]
    colors = cube_drafter_colors(cube)
    styles = limit_styles(limits, ref.power_limit, ref.stock_power_limit)
    energy = cell_means(cube, "energy_per_token_j", DIMS, usable=usable, corpus=corpus)
    p_stock, c_stock = limits.index(ref.power_limit), int(np.flatnonzero(clocks == ref.sm_clock)[0])
    handles = [
        *color_handles(measured_colors(colors, energy)),
        *limit_handles(styles),
        stock_handle(stock_label(ref.sm_clock, ref.power_limit, ref.is_stock)),
    ]

    if panels is None:
        panels = corpus_panels(cube, energy_title(cube, longest_corpus(cube)))
    clear_panels(panels)
    for b, (ax, batch) in enumerate(zip(panels.axes, batches, strict=True)):
        for d, drafter in enumerate(drafters):
            for p, limit in enumerate(limits):
                if np.all(np.isnan(energy[b, d, p])):
                    continue
                style = styles[limit]
                ax.plot(
                    clocks,
                    energy[b, d, p],
                    color=colors[drafter],
                    linestyle=style.linestyle,
                    marker=style.marker,
                    markersize=3.5,
                    linewidth=1.3,
                )
        stock_y = energy[b, :, p_stock, c_stock]
        ax.scatter(np.full(len(drafters), ref.sm_clock), stock_y, gid="stock", **STOCK_STYLE)
        missing = [d for i, d in enumerate(drafters) if np.all(np.isnan(energy[b, i]))]
        flagged = flagged_drafters(cube, missing, corpus=corpus, batch=batch)
        if np.all(np.isnan(energy[b])):
            say_nothing_drawn(ax, NO_SETTING if flagged else "no valid cell at any setting")
        else:  # U-shaped curves: the space above their dip is free
            say_not_drawn(ax, missing, "no valid cell at any setting", "upper center", flagged)
        ax.set_title(f"batch {batch}")
        tidy(ax, "SM clock lock (MHz)")
    place_legend(panels, handles)
    suptitle(panels.fig, energy_title(cube, corpus))
    return panels.fig


@styled
def draw_pareto(
    cube: xr.Dataset,
    chosen: xr.Dataset,
    target: Target,
    corpus: str,
    panels: Panels | None = None,
    *,
    usable: xr.DataArray | None = None,
) -> Figure:
    """Energy against latency for every clock and power limit; the Pareto front per drafter,
    the stock setting ringed, the headroom choice starred. `panels` and `usable` as in
    draw_energy_vs_clock."""
    ref = reference_setting(cube)
    batches = [int(b) for b in cube["batch"].values]
    drafters = [str(d) for d in cube["drafter"].values]
    limits = [float(p) for p in cube["power_limit"].values]
    clocks = [int(c) for c in cube["sm_clock"].values]
    colors = cube_drafter_colors(cube)
    styles = limit_styles(limits, ref.power_limit, ref.stock_power_limit)
    usable = usable_mask(cube) if usable is None else usable
    energy = cell_means(cube, "energy_per_token_j", DIMS, usable=usable, corpus=corpus)
    latency = cell_means(
        cube, target.variable, DIMS, usable=usable, corpus=corpus, quantile=target.quantile
    )
    p_stock, c_stock = limits.index(ref.power_limit), clocks.index(ref.sm_clock)
    picks = chosen.sel(corpus=corpus).transpose("batch", "drafter")
    chosen_lat = at_chosen(picks, latency, clocks, limits, picks["chosen_latency_ms"].values)
    chosen_energy = at_chosen(
        picks, energy, clocks, limits, picks["chosen_energy_per_token_j"].values
    )
    drafter_rgb = [colors[d] for d in drafters]
    label = chosen_label(
        ref.is_stock,
        (chosen_energy, picks["chosen_energy_per_token_j"].values),
        (chosen_lat, picks["chosen_latency_ms"].values),
    )
    handles = [
        *color_handles(measured_colors(colors, energy, latency)),
        *limit_handles(styles, lines=False),
        stock_handle(stock_label(ref.sm_clock, ref.power_limit, ref.is_stock)),
        chosen_handle(label),
    ]

    if panels is None:
        panels = corpus_panels(
            cube, pareto_title(target_text(chosen, target), longest_corpus(cube))
        )
    clear_panels(panels)
    for b, (ax, batch) in enumerate(zip(panels.axes, batches, strict=True)):
        colour = [c for c in drafter_rgb for _ in clocks]
        for p in sorted(range(len(limits)), key=lambda i: limits[i] == ref.power_limit):
            capped = limits[p] != ref.power_limit  # caps drawn first and hollow: where a cap
            ax.scatter(  # does not bind, the stock-limit point covers it
                latency[b, :, p].ravel(),
                energy[b, :, p].ravel(),
                s=20,
                marker=styles[limits[p]].marker,
                facecolors="none" if capped else colour,
                edgecolors=colour,
                linewidths=0.9 if capped else 0,
                alpha=0.9 if capped else 0.6,
            )
        for d, drafter in enumerate(drafters):
            fx, fy = pareto_front(latency[b, d], energy[b, d])
            ax.plot(fx, fy, color=colors[drafter], lw=1.4)
        ax.scatter(
            latency[b, :, p_stock, c_stock],
            energy[b, :, p_stock, c_stock],
            gid="stock",
            **STOCK_STYLE,
        )
        ax.scatter(chosen_lat[b], chosen_energy[b], color=drafter_rgb, gid="chosen", **CHOSEN_STYLE)
        unpaired = np.isnan(energy[b]) | np.isnan(latency[b])  # no point to draw
        missing = [d for i, d in enumerate(drafters) if np.all(unpaired[i])]
        flagged = flagged_drafters(cube, missing, corpus=corpus, batch=batch)
        if np.all(unpaired):
            say_nothing_drawn(ax, NO_SETTING if flagged else "no valid cell at any setting")
        else:  # slow and costly is where no front lies
            say_not_drawn(ax, missing, "no valid cell at any setting", "upper right", flagged)
        ax.set_title(f"batch {batch}")
        tidy(ax, f"{target.metric.upper()} {target.quantile_name} (ms)")
    place_legend(panels, handles)
    suptitle(panels.fig, pareto_title(target_text(chosen, target), corpus))
    return panels.fig
