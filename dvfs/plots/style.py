"""The shared look of dvfs figures: seaborn's white-grid theme and colour-blind palette, fonts
sized for reading, one colour per drafter in every figure, one line style and marker per power
limit, and the stock marker.

Figures are built on `matplotlib.figure.Figure` with an Agg canvas, never through pyplot: no
global backend switch, no figure registry to close, nothing shown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cache, wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.legend import Legend

DPI = 150
ENERGY_LABEL = "energy per token (J)"  # the unit of `dvfs headroom`'s J/tok columns

# Sizes in points at DPI 150: a 10 pt label is ~21 px, legible on a laptop screen and on paper.
RC: dict[str, Any] = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.titley": 1.0,  # fixed: no search of the axes for decorations above, every draw
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "figure.titlesize": 12,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.color": "#dddddd",
    "grid.linewidth": 0.6,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.5,
    # every tick says its whole value: an offset ("+2.408e2" in a corner, ticks 0.075 to
    # 0.095) read as a GPU drawing 0.09 W
    "axes.formatter.useoffset": False,
    "figure.dpi": DPI,
    "savefig.dpi": DPI,
}

# seaborn's "colorblind" palette: distinguishable with the common colour-vision deficiencies.
PALETTE = "colorblind"
LIMIT_LINESTYLES = ("--", ":", "-.")
# Each cap its own marker: the Pareto figure tells limits apart by marker alone (its points are
# not joined by lines). Past these, stars of 4, 6, 7, 8... points (`cap_marker`).
LIMIT_MARKERS: tuple[str, ...] = ("^", "s", "v", "P", "X", "<", ">", "p", "h")

STOCK_STYLE: dict[str, Any] = {
    "marker": "D",
    "s": 90,
    "facecolors": "none",
    "edgecolors": "black",
    "linewidths": 1.4,
    "zorder": 6,
}
CHOSEN_STYLE: dict[str, Any] = {
    "marker": "*",
    "s": 190,
    "edgecolors": "black",
    "linewidths": 0.7,
    "zorder": 7,
}


#: seaborn 0.13's "whitegrid" axes style, written out: importing seaborn (and the scipy.stats
#: it loads) took about a third of `dvfs plot`'s CPU for these few settings. Its "image.cmap"
#: ("rocket", a colour map seaborn registers on import) is left out: every dvfs image names
#: its colour map. tests/test_speed_shortcuts.py checks both against seaborn.
WHITEGRID: dict[str, Any] = {
    "axes.axisbelow": True,
    "axes.edgecolor": ".8",
    "axes.facecolor": "white",
    "axes.grid": True,
    "axes.labelcolor": ".15",
    "axes.spines.bottom": True,
    "axes.spines.left": True,
    "axes.spines.right": True,
    "axes.spines.top": True,
    "figure.facecolor": "white",
    "font.family": ["sans-serif"],
    "font.sans-serif": [
        "Arial",
        "DejaVu Sans",
        "Liberation Sans",
        "Bitstream Vera Sans",
        "sans-serif",
    ],
    "grid.color": ".8",
    "grid.linestyle": "-",
    "lines.solid_capstyle": "round",
    "patch.edgecolor": "w",
    "patch.force_edgecolor": True,
    "text.color": ".15",
    "xtick.bottom": False,
    "xtick.color": ".15",
    "xtick.direction": "out",
    "xtick.top": False,
    "ytick.color": ".15",
    "ytick.direction": "out",
    "ytick.left": False,
    "ytick.right": False,
}

#: seaborn's "colorblind" palette (PALETTE) as hex, in its order.
COLORBLIND: tuple[str, ...] = (
    "#0173b2",
    "#de8f05",
    "#029e73",
    "#d55e00",
    "#cc78bc",
    "#ca9161",
    "#fbafe4",
    "#949494",
    "#ece133",
    "#56b4e9",
)


@cache
def theme() -> dict[str, Any]:
    """seaborn's white-grid style (WHITEGRID) under dvfs's sizes."""
    return {**WHITEGRID, **RC}


@cache
def palette() -> tuple[str, ...]:
    """The drafters' colours, in order."""
    return COLORBLIND


P = ParamSpec("P")
R = TypeVar("R")


def styled(draw: Callable[P, R]) -> Callable[P, R]:
    """Create a figure's artists under RC (artists read rcParams when they are made)."""

    @wraps(draw)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        import matplotlib

        with matplotlib.rc_context(theme()):  # type: ignore[arg-type]
            return draw(*args, **kwargs)

    return wrapper


def text_width_in(text: str, size_pt: float) -> float:
    """A generous estimate of a text's width (DejaVu Sans averages ~0.6 em per character)."""
    return len(text) * 0.62 * size_pt / 72.0


@dataclass(frozen=True)
class Margins:
    """Space around and between panels, in inches (fonts are fixed, so inches are exact)."""

    left: float = 0.85
    right: float = 0.25
    top: float = 0.75
    bottom: float = 0.6
    wspace: float = 0.95
    hspace: float = 0.75
    side: float = 0.0  # a column right of the panels (an outside legend or colourbar)


@dataclass(frozen=True)
class Panels:
    """A figure laid out once by hand: its data panels, the first free grid slot (for a legend
    or a colourbar) and where the side column starts (figure fraction)."""

    fig: Figure
    axes: list[Axes]
    spare: Axes | None
    side_x: float


def panel_figure(
    panels: int,
    panel_w_in: float,
    panel_h_in: float,
    margins: Margins | None = None,
    max_cols: int = 3,
    title: str = "",
) -> Panels:
    """`panels` axes on a grid with fixed margins on an Agg canvas, at least as wide as the
    `title` (its lines at the suptitle's size) so that it is never cut.

    No layout engine runs at save time: laying out text costs as much as drawing it, and the
    margins, sized for the fonts, keep labels clear of each other.
    """
    from matplotlib.figure import Figure

    m = margins or Margins()
    rows, cols = grid_shape(panels, max_cols)
    width = m.left + cols * panel_w_in + (cols - 1) * m.wspace + m.right + m.side
    title_w = max(text_width_in(line, RC["figure.titlesize"]) for line in title.split("\n"))
    if title_w + 0.4 > width:  # widen on the right: the panels keep their size and place
        m = replace(m, right=m.right + title_w + 0.4 - width)
        width = title_w + 0.4
    height = m.top + rows * panel_h_in + (rows - 1) * m.hspace + m.bottom
    fig = Figure(figsize=(width, height), dpi=DPI)
    text_caching_canvas()(fig)
    slots = []
    for r in range(rows):
        for c in range(cols):
            x0 = m.left + c * (panel_w_in + m.wspace)
            y0 = height - m.top - (r + 1) * panel_h_in - r * m.hspace
            rect = (x0 / width, y0 / height, panel_w_in / width, panel_h_in / height)
            slots.append(fig.add_axes(rect))
    for ax in slots[:panels]:
        ax.set_gid("panel")  # data panels, as against free slots, colourbars and keys
    for ax in slots[panels:]:
        ax.set_axis_off()
    spare = slots[panels] if panels < len(slots) else None
    side_x = (width - m.side) / width
    return Panels(fig, slots[:panels], spare, side_x)


#: Strings a text-caching canvas keeps rendered (a figure set has a few hundred).
TEXT_CACHE_SIZE = 4096


@cache
def text_caching_canvas() -> type[FigureCanvasAgg]:
    """The figures' canvas class: one text cache for every figure (see make_text_caching_canvas)."""
    return make_text_caching_canvas()


def make_text_caching_canvas() -> type[FigureCanvasAgg]:
    """An Agg canvas class, with a cache of its own, whose renderer lays out and rasterises
    each string once per font, size and DPI, and then only stamps the bitmap where the text
    goes.

    matplotlib 3.11 shapes and renders every glyph of every text anew at each draw, a glyph at
    a time in Python, and measures each string again for every new renderer (every figure):
    together about half of the figures' drawing. Their few hundred distinct strings (tick
    labels, panel titles, axis labels, cell texts) recur across panels and figures. A string
    is measured as matplotlib measures it (so the layout is the same) and rendered whole, as
    matplotlib did up to 3.10 (placed to the pixel, turned as an image): level text sits
    within a pixel of where 3.11 puts it, turned text where 3.10 put it (under 2 pixels from
    3.11's in these figures, up to 4 at some angles and sizes); nothing else changes.
    Mathtext, and texts with font features or a language, are drawn the stock way.

    While a figure draws, the font matplotlib picks for a text's font properties, and the
    ascent, descent and line gap it lays each text out with (`DrawFonts`), are looked up
    once per properties and draw: looking them up again for every text, several times a
    draw, cost as much as the rest of laying the texts out. Within a draw neither can
    change: they follow from the font properties, the rcParams and the font manager, which
    drawing leaves alone; a new draw looks them up anew."""
    import math
    from types import MethodType

    from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
    from matplotlib.font_manager import fontManager, get_font

    try:
        from matplotlib.backends import _backend_agg
        from matplotlib.backends.backend_agg import get_hinting_flag
        from matplotlib.ft2font import FT2Font
    except ImportError:
        return FigureCanvasAgg
    font_calls = ("set_text", "get_width_height", "draw_glyphs_to_bitmap", "get_bitmap_offset")
    if not (
        hasattr(RendererAgg, "_prepare_font")
        and hasattr(getattr(_backend_agg, "RendererAgg", None), "draw_text_image")
        and all(hasattr(FT2Font, call) for call in (*font_calls, "get_descent", "get_image"))
    ):  # a matplotlib without the calls this cache stands on: draw text its own way
        return FigureCanvasAgg

    #: (width, height, descent, bitmap, bitmap x and y offset), in pixels, by string, font,
    #: size, DPI, hinting and antialiasing
    rendered: dict[tuple[Any, ...], tuple[float, float, float, np.ndarray, float, float]] = {}

    def found_font(renderer: RendererAgg, prop: Any) -> Any:
        """The FT2Font matplotlib draws `prop` with (as `RendererAgg._prepare_font` finds it),
        found once per font properties in a draw (`DrawFonts`)."""
        fonts: DrawFonts | None = vars(renderer).get("draw_fonts")
        if fonts is None:  # outside a draw
            return get_font(fontManager._find_fonts_by_props(prop))
        if (font := fonts.found.get(prop)) is None:
            font = get_font(fontManager._find_fonts_by_props(prop))
            fonts.found[prop.copy()] = font  # a copy: FontProperties hash by their state
        return font

    def render(
        renderer: RendererAgg, s: str, prop: Any, antialiased: bool
    ) -> tuple[float, float, float, np.ndarray, float, float]:
        font = found_font(renderer, prop)
        flags = get_hinting_flag()
        key = (s, font, prop.get_size_in_points(), renderer.dpi, flags, antialiased)
        if (hit := rendered.get(key)) is None:
            font = renderer._prepare_font(prop)  # the same font, cleared and sized
            font.set_text(s, 0.0, flags=flags)
            width, height = font.get_width_height()
            font.draw_glyphs_to_bitmap(antialiased=antialiased)
            x0, y0 = font.get_bitmap_offset()
            image = np.array(font.get_image())
            hit = (width / 64, height / 64, font.get_descent() / 64, image, x0 / 64, y0 / 64)
            if len(rendered) >= TEXT_CACHE_SIZE:
                rendered.clear()
            rendered[key] = hit
        return hit

    def measure(
        renderer: RendererAgg, s: str, prop: Any, ismath: bool | str
    ) -> tuple[float, float, float]:
        if ismath:
            return RendererAgg.get_text_width_height_descent(renderer, s, prop, ismath)
        width, height, descent, *_ = render(renderer, s, prop, True)
        return width, height, descent

    def draw_text(
        renderer: RendererAgg,
        gc: Any,
        x: float,
        y: float,
        s: str,
        prop: Any,
        angle: float,
        ismath: bool | str = False,
        mtext: Any = None,
    ) -> None:
        shaped = mtext is not None and any(
            getattr(mtext, get, lambda: None)() for get in ("get_fontfeatures", "get_language")
        )
        if ismath or shaped:
            RendererAgg.draw_text(renderer, gc, x, y, s, prop, angle, ismath, mtext)
            return
        _, _, descent, image, x0, y0 = render(renderer, s, prop, bool(gc.get_antialiased()))
        x += x0 + descent * math.sin(math.radians(angle))  # the descent turns with the text
        y += y0 + descent * math.cos(math.radians(angle))
        renderer._renderer.draw_text_image(image, round(x), round(y) + 1, angle, gc)

    class DrawFonts:
        """What one draw of a figure has found of its fonts: the FT2Font for each font
        properties, and the line metrics `Text._get_layout` takes from it (`heights`)."""

        def __init__(self, dpi: float) -> None:
            self.dpi = dpi  # the figure's, which Text._get_layout scales the metrics by
            self.found: dict[Any, Any] = {}
            self.metrics: dict[Any, tuple[float | None, float | None, float | None]] = {}

        def heights(self, prop: Any) -> tuple[float | None, float | None, float | None]:
            """The ascent, descent and line gap of `prop`'s font in pixels, worked out as
            `Text._get_layout` works them out when its renderer offers none (from the font's
            OS/2 table, else its hhea table; None, None, None without either: it then
            measures "lp" itself). It asks a renderer that has `_get_font_height_metrics`."""
            if (hit := self.metrics.get(prop)) is not None:
                return hit
            font: Any = self.found.get(prop)  # an FT2Font (typed by table name: looked up here)
            if font is None:
                font = get_font(fontManager._find_fonts_by_props(prop))
            hit = (None, None, None)
            for table_name, linegap_key, ascent_key, descent_key in (
                ("OS/2", "sTypoLineGap", "sTypoAscender", "sTypoDescender"),
                ("hhea", "lineGap", "ascent", "descent"),
            ):
                table = font.get_sfnt_table(table_name)
                if table is None:
                    continue
                fontsize = prop.get_size_in_points()
                units_per_em = font.get_sfnt_table("head")["unitsPerEm"]
                scale = 1 / units_per_em * fontsize * self.dpi / 72
                hit = (
                    table[ascent_key] * scale,
                    -table[descent_key] * scale,
                    table[linegap_key] * scale,
                )
                break
            self.metrics[prop.copy()] = hit
            return hit

    class TextCachingCanvas(FigureCanvasAgg):
        def get_renderer(self) -> RendererAgg:
            renderer = super().get_renderer()
            if "draw_text" not in vars(renderer):  # a new renderer (a new size or DPI)
                renderer.draw_text = MethodType(draw_text, renderer)
                renderer.get_text_width_height_descent = MethodType(measure, renderer)
            return renderer

        def draw(self) -> None:
            """Draw with the fonts found once (DrawFonts); outside a draw, as matplotlib
            does (the renderer offers no line metrics)."""
            renderer = self.get_renderer()  # the one FigureCanvasAgg.draw draws with
            fonts = DrawFonts(self.figure.dpi)
            hooks = {"draw_fonts": fonts, "_get_font_height_metrics": fonts.heights}
            vars(renderer).update(hooks)
            try:
                super().draw()
            finally:
                for name in hooks:
                    vars(renderer).pop(name, None)

    return TextCachingCanvas


def clear_panels(panels: Panels) -> Panels:
    """The same panels emptied of data and legends, ready to draw the next corpus into: their
    data limits emptied too, so that the artists drawn next set them as they are added, as on
    new axes (`relim` after drawing would go over every artist again)."""
    for ax in panels.axes:
        for artist in [*ax.lines, *ax.collections, *ax.patches, *ax.texts, *ax.images]:
            artist.remove()
        ax.relim()  # no artist left: only empties the limits
    if panels.spare is not None and (legend := panels.spare.get_legend()) is not None:
        legend.remove()
    panels.fig.legends.clear()
    return panels


#: The gid of the line a panel with nothing to draw says it with (`say_nothing_drawn`).
NOTHING_DRAWN = "nothing-drawn"


def say_nothing_drawn(ax: Axes, why: str) -> None:
    """A panel with no valid cell to draw says so in its middle, as the headroom map names each
    cell's reason, rather than stand as empty axes that read as a figure gone wrong."""
    ax.text(
        0.5,
        0.5,
        why,
        transform=ax.transAxes,
        ha="center",
        va="center",
        fontsize=9,
        color="#555555",
        gid=NOTHING_DRAWN,
    )


#: The gid of the note naming the drafters a panel has no point of (`say_not_drawn`).
NOT_DRAWN = "not-drawn"

#: Where `say_not_drawn` puts its note, in axes fractions: (x, y, ha, va).
NOTE_CORNERS: dict[str, tuple[float, float, str, str]] = {
    "upper center": (0.5, 0.97, "center", "top"),
    "upper right": (0.98, 0.97, "right", "top"),
    "lower center": (0.5, 0.04, "center", "bottom"),
}


#: Why a drafter with valid cells has no point: each setting's valid repeats sit beside an
#: invalid one, which leaves the setting out whole, as headroom never chooses it.
FLAGGED_WHY = "an invalid repeat at every setting"


def say_not_drawn(
    ax: Axes,
    drafters: Sequence[str],
    why: str,
    corner: str,
    flagged: Sequence[str] = (),
    flagged_why: str = FLAGGED_WHY,
) -> None:
    """Name the drafters of the cube a panel has no point of while it draws others ("no
    valid cell at any setting: ngram"), in `corner` (NOTE_CORNERS: where the figure's data
    seldom are). A line missing from one panel beside panels that draw it under one legend,
    or from a whole figure whose legend then leaves it out, would read as a drafter never
    asked for, where the headroom map names each such cell's reason. Nothing for none.
    Of `drafters`, those also in `flagged` have valid cells, none drawn (`flagged_drafters`):
    they are named for `flagged_why`, not for wanting a valid cell."""
    plain = [d for d in drafters if d not in flagged]
    flagged = [d for d in drafters if d in flagged]
    if not drafters:
        return
    import textwrap

    x, y, ha, va = NOTE_CORNERS[corner]
    said = [(why, plain), (flagged_why, flagged)]
    ax.text(
        x,
        y,
        "\n".join(textwrap.fill(f"{w}: {', '.join(ds)}", 36) for w, ds in said if ds),
        transform=ax.transAxes,
        ha=ha,
        va=va,
        fontsize=8,
        color="#555555",
        zorder=8,
        gid=NOT_DRAWN,
    )


def suptitle(fig: Figure, text: str) -> None:
    """A title 0.1 in below the top edge (Figure.suptitle's default sits by figure fraction)."""
    fig.suptitle(text, y=1.0 - 0.1 / fig.get_figheight(), va="top")


def grid_shape(panels: int, max_cols: int = 3) -> tuple[int, int]:
    cols = max(1, min(max_cols, panels))
    return int(np.ceil(panels / cols)), cols


def place_legend(panels: Panels, handles: Sequence[Any]) -> Legend:
    """A legend where it covers no data: in the free grid slot, else in the side column."""
    if panels.spare is not None:
        return panels.spare.legend(
            handles=handles, loc="upper left", bbox_to_anchor=(-0.05, 1.0), frameon=False
        )
    return panels.fig.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(panels.side_x, 1.0 - 0.75 / panels.fig.get_figheight()),
        frameon=False,
    )


def save(fig: Figure, out_dir: Path, name: str, fmt: str) -> Path:
    """Write `fig` at DPI; a PNG as `write_png` writes it."""
    import io

    from dvfs.outputs import write_bytes

    path = out_dir / f"{name}.{fmt}"
    if fmt == "png":
        write_png(fig, path)
    else:  # whole, or not at all: a full disk keeps the figure drawn before
        buffer = io.BytesIO()
        fig.savefig(buffer, format=fmt, dpi=DPI)
        write_bytes(path, buffer.getvalue(), sync=False)
    return path


def write_png(fig: Figure, path: Path) -> None:
    """`fig` as a PNG of the pixels `savefig` writes, RGB where every pixel is opaque (the
    alpha channel would be a quarter of the bytes and say nothing), else RGBA.

    Written here rather than by PIL: its choice of a filter for each row cost more than the
    compression itself (about a sixth of `dvfs plot`'s CPU). Rows go unfiltered into zlib at
    level 3, which flat-coloured figures compress well: on the demo's figures about 3% smaller
    files than PIL's at level 1 (on a small cube's, up to a quarter larger), in a third of the
    time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    fig.set_dpi(DPI)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
    from dvfs.outputs import write_bytes

    write_bytes(path, png_bytes(rgba, DPI), sync=False)  # atomically: see `save`


def png_bytes(rgba: np.ndarray, dpi: float) -> bytes:
    """A PNG of an (h, w, 4) uint8 image at `dpi` (one IDAT chunk: a figure-sized image):
    RGB if fully opaque, else RGBA."""
    import struct
    import zlib

    height, width, _ = rgba.shape
    channels = 3 if rgba[..., 3].min() == 255 else 4
    rows = np.empty((height, 1 + width * channels), dtype=np.uint8)
    rows[:, 0] = 0  # each row's filter byte: "none"
    # a channel at a time, straight into the rows: a third of the time of a gather by index
    # (np.take) into a temporary copied in after, a quarter of that of copying rgba[..., :3]
    pixels = rows[:, 1:].reshape(height, width, channels)
    for c in range(channels):
        pixels[..., c] = rgba[..., c]

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(data, zlib.crc32(kind))
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    per_metre = round(dpi / 0.0254)
    header = struct.pack(">IIBBBBB", width, height, 8, 2 if channels == 3 else 6, 0, 0, 0)
    return b"".join(
        (
            b"\x89PNG\r\n\x1a\n",
            chunk(b"IHDR", header),
            chunk(b"pHYs", struct.pack(">IIB", per_metre, per_metre, 1)),
            chunk(b"IDAT", zlib.compress(rows.data, 3)),
            chunk(b"IEND", b""),
        )
    )


def drafter_colors(drafters: Iterable[str]) -> dict[str, str]:
    """One colour per drafter, the same in every figure (cube order): the palette's, then as
    many more as there are drafters past it (`extra_colors`), never one colour twice."""
    names = list(dict.fromkeys(drafters))
    colors = palette()
    colors = (*colors, *extra_colors(len(names) - len(colors), exclude=colors))
    return {d: colors[i] for i, d in enumerate(names)}


#: The golden angle as a share of the colour wheel ((3 - sqrt 5) / 2, rounded): hues stepped by
#: it stay spread out however many are asked for, each new one in a widest gap left.
GOLDEN_ANGLE_TURNS = 0.381966


def extra_colors(n: int, *, exclude: Sequence[str] = ()) -> list[str]:
    """`n` colours past the palette's, each new (none of `exclude`'s, none repeated): hues a
    golden angle apart, at three lightnesses in turn, so neighbours in cube order differ in
    hue and in lightness; the same `n` gives the same colours."""
    import colorsys

    used = {c.lower() for c in exclude}
    out: list[str] = []
    k = 0
    while len(out) < n:
        hue = (0.07 + k * GOLDEN_ANGLE_TURNS) % 1.0
        light = (0.42, 0.28, 0.62)[k % 3]
        r, g, b = colorsys.hls_to_rgb(hue, light, 0.7)
        color = "#{:02x}{:02x}{:02x}".format(*(round(v * 255) for v in (r, g, b)))
        k += 1
        if color not in used:
            used.add(color)
            out.append(color)
    return out


#: The attribute of a cube cut to some drafters (`dvfs report --drafter`) that lists the
#: whole cube's drafters (JSON), so that each keeps the colour `dvfs plot` gives it.
ALL_DRAFTERS = "plot_all_drafters"


def cube_drafter_colors(cube: Any) -> dict[str, str]:
    """`drafter_colors` of the cube's drafters (in its order), each coloured by its place
    among the drafters of the cube it was cut from (`ALL_DRAFTERS`), else in this one."""
    import json

    names = [str(d) for d in cube["drafter"].values]
    order = [str(d) for d in json.loads(cube.attrs.get(ALL_DRAFTERS, "[]"))]
    every = drafter_colors([*order, *(d for d in names if d not in order)])
    return {d: every[d] for d in names}


#: A marker as matplotlib takes it: a name, or (points, style, angle), style 1 a star.
Marker = str | tuple[int, Literal[0, 1, 2], int]


@dataclass(frozen=True)
class LimitStyle:
    """How a power limit is drawn: the stock limit solid with circles, caps dashed/dotted
    with other markers, so a capped point never passes for a clock setting."""

    limit_w: float
    linestyle: str
    marker: Marker
    label: str


def cap_marker(cap: int) -> Marker:
    """The marker of the `cap`-th cap below the stock limit (0 first), never another cap's:
    LIMIT_MARKERS, then stars of ever more points ((points, 1, 0) in matplotlib's terms),
    filled markers as the others (a cap's points are drawn hollow: an unfilled marker would
    not show), five points left out (the chosen setting's star)."""
    if cap < len(LIMIT_MARKERS):
        return LIMIT_MARKERS[cap]
    points = 4 + cap - len(LIMIT_MARKERS)  # a three-point star reads as a triangle
    return (points + (points >= 5), 1, 0)


def limit_styles(
    limits: Iterable[float], reference_limit_w: float, stock_limit_w: float | None = None
) -> dict[float, LimitStyle]:
    """How each power limit is drawn: the reference's solid, the others dashed/dotted. Each
    is named against the GPU's stock limit (`stock_limit_w`; None: the reference is it): one
    below it a cap, one above it (a grid that swept above the stock limit) "above stock". The
    reference is named stock only where it is the GPU's stock limit, else the top of the
    grid, as `dvfs headroom` names it (and above stock where it is)."""
    styles: dict[float, LimitStyle] = {}
    caps = 0
    stock_w = reference_limit_w if stock_limit_w is None else stock_limit_w
    for limit in sorted({float(v) for v in limits}, reverse=True):
        if limit == reference_limit_w:
            what = "stock" if limit == stock_w else "top of the grid"
            what += ", above stock" if limit > stock_w else ""
            styles[limit] = LimitStyle(limit, "-", "o", f"{limit:g} W power limit ({what})")
        else:
            styles[limit] = LimitStyle(
                limit,
                LIMIT_LINESTYLES[caps % len(LIMIT_LINESTYLES)],
                cap_marker(caps),
                # a grid without the stock limit may hold limits between it and its top: those
                # are above stock, no cap, though below the reference
                f"{limit:g} W power limit " + ("(cap)" if limit < stock_w else "(above stock)"),
            )
            caps += 1
    return styles


def shared_norm(arrays: Iterable[np.ndarray], *, include_zero: bool = True) -> Normalize:
    """One colour norm for every panel of a figure, so a colour means one value throughout."""
    from matplotlib.colors import Normalize

    finite = [a[np.isfinite(a)] for a in (np.asarray(x, dtype=float) for x in arrays)]
    values = np.concatenate(finite) if finite else np.array([])
    if values.size == 0:
        return Normalize(0.0, 1.0)
    lo, hi = float(values.min()), float(values.max())
    if include_zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi <= lo:
        hi = lo + 1.0
    return Normalize(lo, hi)


def stock_handle(label: str) -> Any:
    from matplotlib.lines import Line2D

    return Line2D(
        [],
        [],
        lw=0,
        marker=STOCK_STYLE["marker"],
        markersize=8,
        markerfacecolor="none",
        markeredgecolor="black",
        markeredgewidth=1.4,
        label=label,
    )


def chosen_handle(label: str) -> Any:
    from matplotlib.lines import Line2D

    return Line2D(
        [],
        [],
        lw=0,
        marker="*",
        markersize=13,
        color="#888888",
        markeredgecolor="black",
        label=label,
    )


def color_handles(colors: dict[str, str], marker: str | None = None) -> list[Any]:
    from matplotlib.lines import Line2D

    return [Line2D([], [], color=c, lw=2.5, marker=marker, label=d) for d, c in colors.items()]


def limit_handles(styles: dict[float, LimitStyle], *, lines: bool = True) -> list[Any]:
    from matplotlib.lines import Line2D

    return [
        Line2D(
            [],
            [],
            color="#555555",
            linestyle=s.linestyle if lines else "none",  # type: ignore[arg-type]
            marker=s.marker,
            markerfacecolor="#555555" if lines or s.linestyle == "-" else "none",
            ms=5,
            label=s.label,
        )
        for s in styles.values()
    ]


def stock_label(sm_clock: int, power_limit_w: float, is_stock: bool) -> str:
    what = "stock" if is_stock else "reference (top of the grid)"
    return f"{what}: {sm_clock} MHz, {power_limit_w:g} W"
