"""Power and SM clock through the measurement window, stock against the chosen setting, for the
drafters asked for (`dvfs report --drafter`; none asked: the cube's first two with valid cells,
the others named in the title) at the smallest and largest batch of the first corpus."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.analysis.headroom import reference_setting, valid_mask
from dvfs.cube.knobs import observe_only, swept_knobs
from dvfs.plots.style import (
    Margins,
    cube_drafter_colors,
    panel_figure,
    say_not_drawn,
    say_nothing_drawn,
    styled,
    suptitle,
)

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SETTING_LINESTYLES = {"stock": "-", "chosen": "--"}
#: Drafters drawn where none were asked for: two lines each a panel (stock and chosen).
DEFAULT_DRAFTERS = 2
#: Height of a legend line under the panels (inches), and the space above the first.
LEGEND_LINE_IN = 0.22
LEGEND_TOP_IN = 0.85


def timeline_drafters(
    cube: xr.Dataset, asked: Sequence[str] = ()
) -> tuple[list[str], list[str], list[str]]:
    """The drafters the timelines draw, those of the cube they leave out unasked, and those
    left out for want of a valid cell with a timeline: those `asked` (`dvfs report --drafter`,
    in its order; the baseline a report keeps beside them is not drawn), else the cube's first
    `DEFAULT_DRAFTERS` with a valid cell (one whose every cell failed would leave one line),
    the rest left out (and named); where none has one, the cube's first, as they come."""
    known = [str(d) for d in cube["drafter"].values]
    wanted = [d for d in dict.fromkeys(asked) if d in known]
    if wanted:
        return wanted, [], []
    ok = valid_mask(cube) & cube["timeline_t_s"].notnull().any("sample")
    has = ok.any([d for d in ok.dims if d != "drafter"]).values
    usable = [d for d, yes in zip(known, has, strict=True) if yes]
    if not usable:
        return known[:DEFAULT_DRAFTERS], known[DEFAULT_DRAFTERS:], []
    empty = [d for d in known if d not in usable]
    return usable[:DEFAULT_DRAFTERS], usable[DEFAULT_DRAFTERS:], empty


def setting_text(
    clock_mhz: int, limit_w: float, clock_set: bool, limit_set: bool, observed: bool = False
) -> str:
    """A cell's setting as the GPU held it: a clock the campaign did not sweep was never
    locked (its coordinate is only where the stock cell is filed), a power limit it did not
    sweep is the one found at start; observe-only (`observed`), both as found, a lock set
    outside dvfs included."""
    if observed:
        return f"clock and {limit_w:g} W power limit as found (observe-only)"
    clock = f"{clock_mhz} MHz clock lock" if clock_set else "clock unlocked"
    limit = f"{limit_w:g} W power limit" if limit_set else f"stock {limit_w:g} W power limit"
    return f"{clock}, {limit}"


def first_valid_repeat(cell: xr.Dataset) -> xr.Dataset | None:
    """A cell's first valid repeat with a timeline (None without one): an invalid repeat's
    power and clock are not what the setting does."""
    ok = valid_mask(cell) & cell["timeline_t_s"].notnull().any("sample")
    picks = np.flatnonzero(ok.values)
    return cell.isel(repeat=int(picks[0])) if picks.size else None


#: How far apart the timeline's last instant and the windows' length may lie and still be the
#: same instant: each is stored rounded to the microsecond.
CLOSING_TOLERANCE_S = 1.5e-6


def stored_samples(cell: xr.Dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A cell's stored samples (time, power, SM clock) in its decode, NaN padding left out.
    The meter keeps the samples its windows decoded through (each from its start, up to
    but not at its close), on an axis of whole window lengths, so all are drawn:
    `decode_time_s` (the spans between counter updates) is shorter than that axis and no end
    to cut at. A cube an older dvfs made also holds the sampler's last reading of a round
    that ends at its window's close (a fixed batch's requests all finishing at once, in the
    twin's virtual time), which falls on that closing instant and reads the GPU after the
    decode's last step (115 W where it decoded at 240 W): the sample at the last window's
    close (`gpu_time_window_s`, the windows' length) is left out, or the line plunges there
    as if the decode had. Nothing on the axis marks where an earlier round's window closed,
    so the line stops at the last sample rather than hold its value on."""
    t = cell["timeline_t_s"].values
    keep = ~np.isnan(t)
    if "gpu_time_window_s" in cell:
        closing = float(cell["gpu_time_window_s"])
        last = np.flatnonzero(keep)
        if last.size > 1 and abs(float(t[last[-1]]) - closing) <= CLOSING_TOLERANCE_S:
            keep[last[-1]] = False
    return (
        t[keep],
        cell["timeline_power_w"].values[keep],
        cell["timeline_sm_clock_mhz"].values[keep],
    )


#: The least span of a power axis (W): a power steady within a watt or so is drawn level, not
#: stretched over the whole axis as a sawtooth of its last digits.
MIN_POWER_SPAN_W = 10.0


def level_power_axis(ax: Axes) -> None:
    """Widen a power axis spanning less than MIN_POWER_SPAN_W to that span, around its data,
    never below 0 W. An axis with no line is left as it is: widened around nothing, an empty
    panel's axis read -6 to 6 W."""
    if not ax.lines:
        return
    low, high = ax.get_ylim()
    if high - low < MIN_POWER_SPAN_W:
        bottom = max(0.0, (low + high) / 2 - MIN_POWER_SPAN_W / 2)
        ax.set_ylim(bottom, bottom + MIN_POWER_SPAN_W)


@styled
def draw_timelines(
    cube: xr.Dataset, chosen: xr.Dataset, drafters: Sequence[str] = ()
) -> Figure | None:
    """None when the cube holds no sampled timeline. `drafters`: those asked for (`dvfs
    report --drafter`), each drawn; none: the cube's first two with valid cells, the title
    naming the others (`timeline_drafters`)."""
    if "timeline_power_w" not in cube or np.all(np.isnan(cube["timeline_power_w"].values)):
        return None
    ref = reference_setting(cube)
    colors = cube_drafter_colors(cube)
    drafters, unasked, empty = timeline_drafters(cube, drafters)
    # the smallest and largest batch: the axis is the campaign's order, which need not ascend
    batches = sorted({int(cube["batch"].min()), int(cube["batch"].max())})
    corpus = str(cube["corpus"].values[0])
    stock_word = "stock" if ref.is_stock else "reference"
    clock_set, limit_set = swept_knobs(cube)
    observed = observe_only(cube)

    cols = len(batches)
    title = f"Power and SM clock through the measurement window: {stock_word} vs chosen setting"
    if empty:  # never left out unsaid: a drafter missing reads as one never measured
        first = (
            f"the cube's first {len(drafters)} with valid cells"
            if len(drafters) == DEFAULT_DRAFTERS
            else "the only one with valid cells"
        )
        title += f"\ndrafters {', '.join(drafters)} ({first}; no valid cell: {', '.join(empty)})"
    elif unasked:
        title += (
            f"\ndrafters {', '.join(drafters)} (the cube's first {len(drafters)} of "
            f"{len(drafters) + len(unasked)})"
        )
    if unasked:
        title += f"; not drawn: {', '.join(unasked)} (`dvfs report --drafter` draws them)"
    legend_lines = 2 * len(drafters) + 1  # stock and chosen a drafter, a capped limit
    margins = Margins(
        left=0.9,
        top=0.3 + 0.25 * (title.count("\n") + 1),
        bottom=LEGEND_TOP_IN + LEGEND_LINE_IN * legend_lines,
        wspace=0.9,
        hspace=0.25,
    )
    panels = panel_figure(2 * cols, 5.0, 2.5, margins, max_cols=cols, title=title)
    fig = panels.fig
    for col, batch in enumerate(batches):
        capped = False
        power_ax, clock_ax = panels.axes[col], panels.axes[cols + col]
        clock_ax.sharex(power_ax)
        power_ax.tick_params(labelbottom=False)
        not_drawn = []
        for drafter in drafters:
            drawn = len(power_ax.lines)
            pick = chosen.sel(batch=batch, drafter=drafter, corpus=corpus)
            settings = [("stock", ref.sm_clock, ref.power_limit)]
            if bool(pick["feasible"]):
                settings.append(
                    ("chosen", int(pick["chosen_sm_clock"]), float(pick["chosen_power_limit"]))
                )
            for kind, clock, limit in settings:
                cell = first_valid_repeat(
                    cube.sel(
                        batch=batch,
                        drafter=drafter,
                        corpus=corpus,
                        sm_clock=clock,
                        power_limit=limit,
                    )
                )
                if cell is None:
                    continue
                t, power, sm_clock = stored_samples(cell)
                word = stock_word if kind == "stock" else "chosen"
                style: dict[str, Any] = {
                    "color": colors[drafter],
                    "linestyle": SETTING_LINESTYLES[kind],
                }
                label = f"{drafter}, {word}: " + setting_text(
                    clock, limit, clock_set, limit_set, observed
                )
                power_ax.plot(
                    t,
                    power,
                    drawstyle="steps-post",
                    label=label,
                    **style,
                )
                clock_ax.plot(
                    t,
                    sm_clock,
                    drawstyle="steps-post",
                    **style,
                )
                if kind == "chosen" and limit < ref.power_limit:
                    power_ax.axhline(limit, color=colors[drafter], linestyle=":", lw=1.2)
                    capped = True
            if len(power_ax.lines) == drawn:
                not_drawn.append(drafter)
        if not power_ax.lines:
            say_nothing_drawn(
                power_ax, f"no valid cell with a timeline\nat {stock_word} or at the chosen setting"
            )
        else:  # the lines run level above the idle power at the window's end
            say_not_drawn(power_ax, not_drawn, "no valid cell with a timeline", "lower center")
        level_power_axis(power_ax)
        power_ax.set_title(f"batch {batch}, corpus {corpus}")
        power_ax.set_ylabel("GPU power (W)")
        clock_ax.set_ylabel("SM clock (MHz)")
        clock_ax.set_xlabel("time in steady-state window (s)")
        handles, _ = power_ax.get_legend_handles_labels()
        if capped:
            from matplotlib.lines import Line2D

            handles.append(
                Line2D([], [], color="#555555", linestyle=":", label="capped power limit")
            )
        # under its own column: the chosen settings differ from batch to batch
        clock_ax.legend(
            handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False
        )
    suptitle(fig, title)
    return fig
