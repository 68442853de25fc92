"""Energy per token and latency against the power limit, for a grid of one SM clock (a campaign
that steps only the power limit, or locks one clock): what the energy-vs-clock figure is to a
clock sweep. A figure per corpus, a panel per batch size, a colour per drafter; the stock (or
reference) limit ringed, the setting `dvfs headroom` chooses starred, and on the latency
figure each drafter's target dotted."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dvfs.analysis.headroom import reference_setting
from dvfs.cube.knobs import swept_knobs
from dvfs.plots.curves import DIMS, chosen_label, corpus_panels, measured_colors, tidy
from dvfs.plots.data import at_chosen, cell_means, flagged_drafters, usable_mask
from dvfs.plots.style import (
    CHOSEN_STYLE,
    ENERGY_LABEL,
    STOCK_STYLE,
    Panels,
    chosen_handle,
    clear_panels,
    color_handles,
    cube_drafter_colors,
    place_legend,
    say_not_drawn,
    say_nothing_drawn,
    stock_handle,
    stock_label,
    styled,
    suptitle,
)

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.figure import Figure

    from dvfs.analysis.targets import Target

LIMIT_LABEL = "power limit (W)"
#: A panel with valid cells but no point: each limit has an invalid repeat beside them.
NO_LIMIT = "no power limit without an invalid repeat"
TARGET_LABEL = "target (dotted, each drafter's colour)"


def clock_words(cube: xr.Dataset) -> str:
    """The one SM clock of the grid as the GPU held it: a lock dvfs set, or none."""
    clock = int(reference_setting(cube).sm_clock)
    return f"SM clock locked at {clock} MHz" if swept_knobs(cube)[0] else "SM clock not set"


def energy_limit_title(cube: xr.Dataset, corpus: str) -> str:
    gpu = cube.attrs.get("gpu_name", "")
    return (
        f"Energy per token vs power limit - corpus {corpus}"
        + (f" ({gpu})" if gpu else "")
        + f"\n{clock_words(cube)}"
    )


def latency_limit_title(cube: xr.Dataset, target: Target, target_text: str, corpus: str) -> str:
    """`target_text`: the target in `dvfs headroom`'s words (`curves.target_text`)."""
    return (
        f"{target.metric.upper()} {target.quantile_name} vs power limit - corpus {corpus}\n"
        f"{clock_words(cube)}; target: {target_text}"
    )


def _draw(
    cube: xr.Dataset,
    chosen: xr.Dataset,
    corpus: str,
    panels: Panels,
    title: str,
    values: np.ndarray,
    chosen_values: np.ndarray,
    ylabel: str,
    targets: np.ndarray | None,
) -> Figure:
    """Each drafter's `values` (batch, drafter, power limit, clock) against the power limit at
    the reference clock, the reference ringed, the chosen setting starred on its point
    (`chosen_values`, headroom's (batch, drafter), where none is drawn), `targets` (batch,
    drafter; None: none) dotted."""
    from matplotlib.lines import Line2D

    ref = reference_setting(cube)
    batches = [int(b) for b in cube["batch"].values]
    drafters = [str(d) for d in cube["drafter"].values]
    limits = np.asarray(cube["power_limit"].values, dtype=float)
    clocks = [int(c) for c in cube["sm_clock"].values]
    colors = cube_drafter_colors(cube)
    c, p_stock = clocks.index(ref.sm_clock), int(np.flatnonzero(limits == ref.power_limit)[0])
    at_clock = values[..., c]  # batch, drafter, power limit
    picks = chosen.sel(corpus=corpus).transpose("batch", "drafter")
    feasible = picks["feasible"].values
    chosen_limit = np.where(feasible, picks["chosen_power_limit"].values, np.nan)
    chosen_y = at_chosen(picks, values, clocks, limits.tolist(), chosen_values)
    order = np.argsort(limits)
    handles = [
        *color_handles(measured_colors(colors, values)),
        stock_handle(stock_label(ref.sm_clock, ref.power_limit, ref.is_stock)),
        chosen_handle(chosen_label(ref.is_stock, (chosen_y, chosen_values))),
    ]
    if targets is not None:
        handles.append(Line2D([], [], color="#555555", linestyle=":", label=TARGET_LABEL))
    clear_panels(panels)
    for b, (ax, batch) in enumerate(zip(panels.axes, batches, strict=True)):
        for d, drafter in enumerate(drafters):
            if np.all(np.isnan(at_clock[b, d])):
                continue
            ax.plot(
                limits[order],
                at_clock[b, d, order],
                color=colors[drafter],
                marker="o",
                markersize=3.5,
                linewidth=1.3,
            )
            if targets is not None and np.isfinite(targets[b, d]):
                ax.axhline(targets[b, d], color=colors[drafter], linestyle=":", lw=1.0)
        ax.scatter(
            np.full(len(drafters), ref.power_limit),
            at_clock[b, :, p_stock],
            gid="stock",
            **STOCK_STYLE,
        )
        ax.scatter(
            chosen_limit[b],
            chosen_y[b],
            color=[colors[d] for d in drafters],
            gid="chosen",
            **CHOSEN_STYLE,
        )
        missing = [d for i, d in enumerate(drafters) if np.all(np.isnan(at_clock[b, i]))]
        flagged = flagged_drafters(cube, missing, corpus=corpus, batch=batch, sm_clock=ref.sm_clock)
        if np.all(np.isnan(at_clock[b])):
            say_nothing_drawn(ax, NO_LIMIT if flagged else "no valid cell at any power limit")
        else:
            say_not_drawn(
                ax,
                missing,
                "no valid cell at any power limit",
                "upper center",
                flagged,
                "an invalid repeat at every power limit",
            )
        ax.set_title(f"batch {batch}")
        tidy(ax, LIMIT_LABEL)
        ax.set_ylabel(ylabel)
    place_legend(panels, handles)
    suptitle(panels.fig, title)
    return panels.fig


@styled
def draw_energy_vs_power_limit(
    cube: xr.Dataset,
    chosen: xr.Dataset,
    corpus: str,
    panels: Panels | None = None,
    *,
    usable: xr.DataArray | None = None,
) -> Figure:
    """Energy per token (J) against the power limit at the grid's one SM clock: a line per
    drafter, the reference limit ringed, `dvfs headroom`'s choice (`chosen`) starred. `panels`
    (corpus_panels) are emptied and drawn into; `usable` as in draw_energy_vs_clock."""
    energy = cell_means(cube, "energy_per_token_j", DIMS, usable=usable, corpus=corpus)
    picks = chosen.sel(corpus=corpus).transpose("batch", "drafter")
    title = energy_limit_title(cube, corpus)
    if panels is None:
        panels = corpus_panels(cube, title)
    return _draw(
        cube,
        chosen,
        corpus,
        panels,
        title,
        energy,
        picks["chosen_energy_per_token_j"].values,
        ENERGY_LABEL,
        None,
    )


@styled
def draw_latency_vs_power_limit(
    cube: xr.Dataset,
    chosen: xr.Dataset,
    target: Target,
    corpus: str,
    panels: Panels | None = None,
    *,
    usable: xr.DataArray | None = None,
    target_text: str | None = None,
) -> Figure:
    """The target's latency (its metric and quantile, ms) against the power limit, as
    draw_energy_vs_power_limit draws energy, with each drafter's target dotted: where its
    line crosses that, the headroom ends. `target_text`: the target in `dvfs headroom`'s
    words (default: `target.describe()`)."""
    usable = usable_mask(cube) if usable is None else usable
    latency = cell_means(
        cube, target.variable, DIMS, usable=usable, corpus=corpus, quantile=target.quantile
    )
    picks = chosen.sel(corpus=corpus).transpose("batch", "drafter")
    title = latency_limit_title(cube, target, target_text or target.describe(), corpus)
    if panels is None:
        panels = corpus_panels(cube, title)
    return _draw(
        cube,
        chosen,
        corpus,
        panels,
        title,
        latency,
        picks["chosen_latency_ms"].values,
        f"{target.metric.upper()} {target.quantile_name} (ms)",
        picks["target_ms"].values,
    )
