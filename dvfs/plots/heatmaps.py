"""Heatmaps: the headroom (energy saved at the chosen setting) per corpus, and the mean accept
length per drafter and corpus. Every panel of a figure shares one colour norm and one colourbar,
so a colour means the same value everywhere in it."""

from __future__ import annotations

import re
import textwrap
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.plots.data import usable_mask
from dvfs.plots.style import (
    Margins,
    Panels,
    grid_shape,
    panel_figure,
    shared_norm,
    styled,
    suptitle,
    text_width_in,
)

if TYPE_CHECKING:
    import xarray as xr
    from matplotlib.axes import Axes
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

MISSING_COLOR = "#d9d9d9"
#: A cell's saving where the row has an answer but no energy at the reference to divide by.
UNKNOWN_SAVING = "-"
UNKNOWN_CELL: dict[str, Any] = {"facecolor": "white", "edgecolor": MISSING_COLOR, "lw": 1.3}
CAP_OUTLINE: dict[str, Any] = {"fill": False, "edgecolor": "black", "linestyle": "--", "lw": 1.3}


def _cmap(name: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad=MISSING_COLOR)


def _label_cells(
    ax: Axes,
    values: np.ndarray,
    labels: list[list[str]],
    colours: tuple[Any, Normalize],
    size: float,
) -> None:
    """Cell text, white on dark cells and black on light ones."""
    cmap, norm = colours
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            v = values[i, j]
            r, g, b, _ = cmap(norm(v)) if np.isfinite(v) else (1.0, 1.0, 1.0, 1.0)
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
            ax.text(
                j,
                i,
                labels[i][j],
                ha="center",
                va="center",
                fontsize=size,
                color="white" if dark else "black",
            )


def _heat_axes(ax: Axes, cols: list[str], rows: list[str] | None, xlabel: str) -> None:
    """Category ticks, no grid; row labels only where given (the first panel of a row)."""
    ax.grid(False)
    ax.set_xticks(range(len(cols)), cols)
    if rows is None:
        ax.set_yticks([])
    else:
        ax.set_yticks(range(len(rows)), rows)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_xlabel(xlabel)


def _colorbar_and_key(
    panels: Panels,
    image: Any,
    label: str,
    key: list[Any],
    values: np.ndarray,
    empty: str = "no cell has an answer",
) -> None:
    """One colourbar for the whole figure, and the key below it: in the free grid slot, else
    in the side column. The bar spans the values the cells hold: where they all hold one
    value it is that value's colour alone, ticked at it (a 0-1 bar would show a range no cell
    has); where no cell has a value there is no bar, and a line says so (`empty`)."""
    fig = panels.fig
    box = panels.spare
    if box is None:
        first = panels.axes[0].get_position()
        w = fig.get_figwidth()
        box = fig.add_axes(
            (panels.side_x + 0.15 / w, first.y0, 1 - panels.side_x - 0.3 / w, first.height)
        )
        box.set_axis_off()
    finite = np.unique(values[np.isfinite(values)])
    if finite.size == 0:
        box.text(0.0, 0.85, f"{label}:\n{empty}", va="center", fontsize=9)
    elif finite.size == 1:
        (v,) = finite
        cax = box.inset_axes((0.0, 0.8, 0.9, 0.1))
        bar = fig.colorbar(
            image,
            cax=cax,
            orientation="horizontal",
            boundaries=[v - 0.5, v + 0.5],
            values=[v],
            # two lines, as long as the bar's own label: one line ran off the figure
            label=f"{label}:\n{v:g} in every cell with an answer",
        )
        bar.set_ticks([v], labels=[f"{v:g}"])
    else:
        cax = box.inset_axes((0.0, 0.8, 0.9, 0.1))
        fig.colorbar(image, cax=cax, orientation="horizontal", label=label)
    if key:
        box.legend(handles=key, loc="upper left", bbox_to_anchor=(0.0, 0.45), frameon=False)


def _no_answer_labels(chosen: xr.Dataset, order: tuple[str, ...]) -> np.ndarray:
    """Why each cell without an answer has none, in `dvfs headroom`'s table's words
    (`dvfs.report.reasons.no_answer`: no valid reference cell and why, settings not measured
    yet, too few usable repeats, no valid cell, or none feasible (so far)), wrapped to fit."""
    from dvfs.report.reasons import no_answer

    shape = tuple(chosen.sizes[d] for d in order)

    def values(name: str) -> np.ndarray | None:
        return chosen[name].transpose(*order).values if name in chosen else None

    target = values("target_ms")
    columns = {
        name: values(name)
        for name in (
            "reference_problem",
            "judged_settings",
            "short_settings",
            "unmeasured_settings",
            "failed_settings",
        )
    }
    out = np.full(shape, "", dtype=object)
    # --vs-baseline: another drafter's reference is the baseline's stock cell, as the table says.
    baseline = (
        chosen.attrs.get("baseline") if chosen.attrs.get("target_mode") == "vs-baseline" else None
    )
    drafters = [str(d) for d in chosen["drafter"].values] if "drafter" in order else []
    for idx in np.ndindex(shape):
        row: dict[str, Any] = {
            "target_ms": float(target[idx])
            if target is not None and np.isfinite(target[idx])
            else None
        }
        if baseline is not None and drafters and drafters[idx[order.index("drafter")]] != baseline:
            row["reference_drafter"] = baseline
        for name, column in columns.items():
            if column is not None:
                value = column[idx]
                row[name] = str(value) if name == "reference_problem" else int(value)
        why = no_answer(row)
        out[idx] = _FlagWrapper(14, max_lines=6, placeholder=" ...").fill(why)
    return out


class _FlagWrapper(textwrap.TextWrapper):
    """Wraps a no-answer reason between words and after a flag name's underscores
    ("foreign_" / "process"), never inside a word ("fore" / "ign_process")."""

    def _split(self, text: str) -> list[str]:
        chunks = super()._split(text)
        return [part for chunk in chunks for part in re.split(r"(?<=_)(?=.)", chunk) if part]


def _answer_label(
    saving: float,
    clock: float,
    limit: float,
    named: bool,
    clock_locked: bool,
    mark: str = "",
    set_aside: float = np.nan,
) -> str:
    """A cell's text: the saving (after `mark`: the table's on a saving within the noise),
    then the knobs the answer sets (the clock only when locked), and where a lower setting's
    saving was set aside within the noise (`set_aside`, its saving), that saving."""
    # no energy at the reference to save against (too few usable repeats there: an --slo or
    # --vs-baseline answer): the table's "-", the setting still named
    said = f"{mark}{saving:.0f}%" if np.isfinite(saving) else UNKNOWN_SAVING
    aside = f"\n{set_aside * 100:.1f}% in noise" if np.isfinite(set_aside) else ""
    # the limit as the table, `dvfs cap plan` and the key write it (250.5 W, not 250 W)
    if not clock_locked:
        return f"{said}\n{limit:g} W{aside}"
    return f"{said}\n{clock:.0f} MHz" + (f"\n{limit:g} W" if named else "") + aside


@styled
def draw_headroom(chosen: xr.Dataset) -> Figure:
    """Energy saved (%) at the setting `dvfs headroom` chooses for the target: a panel per corpus,
    cells drafter x batch; capped power limits outlined and named in the cell."""
    from matplotlib.patches import Patch, Rectangle

    from dvfs.report.headroom import NOISE_MARK

    corpora = [str(c) for c in chosen["corpus"].values]
    drafters = [str(d) for d in chosen["drafter"].values]
    batches = [str(int(b)) for b in chosen["batch"].values]
    order = ("corpus", "drafter", "batch")
    saving = chosen["saving"].transpose(*order).values * 100.0
    # a row with an answer (a setting meets the target) may have no saving: with too few usable
    # repeats at the reference there is no stock energy (an --slo or --vs-baseline answer's
    # saving, the table's "-"); it names its setting, never a reason for an answer it has
    answered = (
        chosen["feasible"].transpose(*order).values.astype(bool)
        if "feasible" in chosen
        else np.isfinite(saving)
    )
    unknown = answered & ~np.isfinite(saving)
    clock = chosen["chosen_sm_clock"].transpose(*order).values
    limit = chosen["chosen_power_limit"].transpose(*order).values
    ref_limit = float(chosen.attrs.get("reference_power_limit_w", np.nan))
    # a cap is below the GPU's stock limit: where the grid lacks it and reaches above it, the
    # reference (the grid's top) is above stock, and a limit between them no cap
    stock_limit = min(ref_limit, float(chosen.attrs.get("stock_power_limit_w", ref_limit)))
    capped = np.isfinite(limit) & (limit < stock_limit)
    # a limit other than the reference's (one above stock too) is named, not outlined: left
    # out, the cell read as the reference's limit, a setting not chosen
    named = capped | (np.isfinite(limit) & np.isfinite(ref_limit) & (limit != ref_limit))
    # a saving within the measurement noise (the table's ≈): no saving is shown to exist
    noise = (
        chosen["saving_within_noise"].transpose(*order).values.astype(bool)
        if "saving_within_noise" in chosen
        else np.zeros(saving.shape, dtype=bool)
    )
    # a lower setting's saving set aside as within the noise (the table's note): its saving,
    # so that a cell at stock does not read as if nothing below it saved anything
    aside = (
        np.where(
            chosen["saving_set_aside_within_noise"].transpose(*order).values.astype(bool),
            chosen["within_noise_saving"].transpose(*order).values,
            np.nan,
        )
        if "saving_set_aside_within_noise" in chosen and "within_noise_saving" in chosen
        else np.full(saving.shape, np.nan)
    )
    # A campaign that left the SM clock unset has no clock answer: the stock clock is not a
    # lock, so the cell names the limit instead (one clock locked is still named). Not set is
    # not "unlocked": observe-only keeps a lock set outside dvfs.
    clock_locked = bool(int(chosen.attrs.get("sm_clock_locked", 1)))
    why = _no_answer_labels(chosen, order)
    versus = "stock" if bool(int(chosen.attrs.get("reference_is_stock", 1))) else "reference"
    norm = shared_norm([saving])
    cmap = _cmap("Greens")
    # the key names only what some cell shows: an outline no cell has read as a finding
    key: list[Any] = []
    if capped.any():
        key.append(Patch(label=f"power limit capped below {stock_limit:g} W", **CAP_OUTLINE))
    if not answered.all():
        key.append(Patch(facecolor=MISSING_COLOR, label="no answer (the cell says why)"))
    if unknown.any():
        no_saving = f"{UNKNOWN_SAVING}: an answer, but no energy at {versus} to save against"
        key.append(Patch(label=no_saving, **UNKNOWN_CELL))
    if (noise & np.isfinite(saving)).any():
        within = f"{NOISE_MARK}: saving within the noise"
        key.append(Patch(facecolor="none", edgecolor="none", label=within))
    if (np.isfinite(aside) & np.isfinite(saving)).any():
        set_aside = "x% in noise: a lower setting's saving, set aside"
        key.append(Patch(facecolor="none", edgecolor="none", label=set_aside))

    rows, cols = grid_shape(len(corpora))
    label_w = max(text_width_in(d, 9) for d in drafters) + 0.45
    bar_label = f"energy saved vs {versus} (%)"
    # the side column (no free slot) holds the colour bar and the key: as wide as its widest
    # line, from 0.15 in into the column ("x% in noise: ..." ran past the figure's edge)
    widest = max(
        [text_width_in(str(p.get_label()), 9) + 0.5 for p in key]
        + [text_width_in(f"{bar_label}:", 10)]
    )
    side = 0.0 if len(corpora) < rows * cols else max(3.2, widest + 0.3)
    # a search that kept one knob at stock says so: the answers are that search's
    moved = {"sm_clock": "; SM clock only", "power_limit": "; power limit only"}
    # one SM clock and one power limit: no setting below the reference was measured, so a map
    # of 0% would read as a finding that none saves (the report's finding says so too)
    unswept = not any(
        int(chosen.attrs.get(f"{knob}_swept", 1)) for knob in ("sm_clock", "power_limit")
    )
    nothing = (
        "\nnothing swept (one SM clock, one power limit): no lower setting was measured"
        if unswept
        else ""
    )
    title = (
        "Headroom: energy saved at the setting dvfs headroom chooses for\n"
        f"{chosen.attrs.get('target', 'the target')}"
        f"{moved.get(str(chosen.attrs.get('knob', 'both')), '')}{nothing}\n"
        + (
            "cell: saving, SM clock lock, and the power limit when not the reference's"
            if clock_locked
            else "cell: saving and the power limit (SM clock not set: the GPU's own)"
        )
    )
    panel_w = 0.8 * len(batches)
    right = Margins().right
    if len(corpora) == rows * cols - 1:  # the free slot is the grid's last: the key and the
        # colour bar's label (left-aligned where no cell has an answer) end at its right, past
        # a slot of few batches; the right margin takes what the slot lacks
        right = max(right, widest - panel_w)
    top = 1.15 + (0.3 if unswept else 0.0)  # a line more of title
    margins = Margins(left=label_w, right=right, top=top, wspace=0.3, hspace=0.85, side=side)
    labels = [
        [
            [
                why[k, i, j]
                if not answered[k, i, j]
                else _answer_label(
                    saving[k, i, j],
                    clock[k, i, j],
                    limit[k, i, j],
                    named[k, i, j],
                    clock_locked,
                    NOISE_MARK if noise[k, i, j] else "",
                    aside[k, i, j],
                )
                for j in range(len(batches))
            ]
            for i in range(len(drafters))
        ]
        for k in range(len(corpora))
    ]
    # a row tall enough for its cells' lines of text (up to six for a reason wrapped; four for
    # a saving, its clock lock, its capped limit and a saving set aside within the noise)
    texts = [str(t) for panel in labels for row in panel for t in row]
    lines = max((t.count("\n") + 1 for t in texts), default=1)
    row_h = max(0.52, 0.13 * lines + 0.1)
    panel_h = max(row_h * len(drafters), 1.6)  # room for the colourbar and key in the free slot
    panels = panel_figure(len(corpora), panel_w, panel_h, margins, title=title)
    images = []
    for k, (ax, corpus) in enumerate(zip(panels.axes, corpora, strict=True)):
        images.append(
            ax.imshow(np.ma.masked_invalid(saving[k]), cmap=cmap, norm=norm, aspect="auto")
        )
        _label_cells(ax, saving[k], labels[k], (cmap, norm), 7.5)
        for i, j in zip(*np.nonzero(unknown[k]), strict=True):  # an answer: not grey
            ax.add_patch(Rectangle((j - 0.46, i - 0.46), 0.92, 0.92, gid="unknown", **UNKNOWN_CELL))
        for i, j in zip(*np.nonzero(capped[k]), strict=True):
            ax.add_patch(Rectangle((j - 0.46, i - 0.46), 0.92, 0.92, gid="cap", **CAP_OUTLINE))
        _heat_axes(ax, batches, drafters if k % cols == 0 else None, "batch")
        if k % cols == 0:
            ax.set_ylabel("drafter")
        ax.set_title(f"corpus {corpus}")
    empty = "no answer has a saving" if answered.any() else "no cell has an answer"
    _colorbar_and_key(panels, images[0], bar_label, key, saving, empty)
    suptitle(panels.fig, title)
    return panels.fig


def draw_acceptance(cube: xr.Dataset, usable: xr.DataArray | None = None) -> Figure | None:
    """Mean accept length (tokens per verify pass) per drafter and corpus; None without one.
    `usable` is `usable_mask(cube)`, made here when not given."""
    from matplotlib.colors import Normalize

    if "accept_length" not in cube:
        return None
    usable = usable_mask(cube) if usable is None else usable
    accept = cube["accept_length"].where(usable)
    others = [d for d in accept.dims if d not in ("drafter", "corpus")]
    table = accept.mean(others)
    values = table.transpose("drafter", "corpus").values
    # A drafter measured without an accept length speculates not (none): no row. One with no
    # usable cell at all (failed, or not run yet) keeps its row of "-": left out, it would
    # read as a drafter never asked for.
    # A drafter the campaign runs without speculation (none) has no row, measured or failed.
    measured = usable.any([d for d in usable.dims if d != "drafter"])
    unmeasured = ~measured.sel(drafter=table["drafter"]).values
    from dvfs.cube.attrs import plain_drafters, speculative_drafters

    plain = plain_drafters(cube)
    unmeasured &= np.array([str(d) not in plain for d in table["drafter"].values], dtype=bool)
    # One the campaign runs speculating whose usable cells record no accept length (a server
    # that reported no speculation counters) keeps its row of "-" too, as `dvfs compare` does.
    speculative = speculative_drafters(cube)
    unmeasured |= np.array([str(d) in speculative for d in table["drafter"].values], dtype=bool)
    keep = ~np.all(np.isnan(values), axis=1)
    if not keep.any():
        return None
    keep |= unmeasured
    values = values[keep]
    drafters = [str(d) for d, k in zip(cube["drafter"].values, keep, strict=True) if k]
    corpora = [str(c) for c in cube["corpus"].values]
    norm = Normalize(1.0, max(float(np.nanmax(values)), 1.5))  # 1 = only the bonus token
    cmap = _cmap("viridis")
    label_w = max(text_width_in(d, 9) for d in drafters) + 0.45
    margins = Margins(left=label_w, top=0.5, side=1.2)
    title = "Mean accept length (bonus token included)"
    panels = panel_figure(1, 1.15 * len(corpora), 0.55 * len(drafters), margins, title=title)
    ax = panels.axes[0]
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    labels = [[f"{v:.2f}" if np.isfinite(v) else "-" for v in row] for row in values]
    _label_cells(ax, values, labels, (cmap, norm), 10)
    _heat_axes(ax, corpora, drafters, "corpus")
    ax.set_ylabel("drafter")
    w = panels.fig.get_figwidth()
    box = ax.get_position()
    cax = panels.fig.add_axes((panels.side_x + 0.2 / w, box.y0, 0.2 / w, box.height))
    panels.fig.colorbar(image, cax=cax, label="tokens per verify pass")
    suptitle(panels.fig, title)
    return panels.fig
