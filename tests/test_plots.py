"""The figures read correctly: every file written, one colour norm per figure, the stock point
marked, energy in J per token (the tables' unit), power limits told apart from clocks, legends
and labels clear of the data and inside the canvas. Small hand-built cubes keep this fast."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
from conftest import SMALL_EXACT, figures_drawn_only, replace_block, unsaved_figure
from cubes import make_cube, one_usable_stock_repeat_cube
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from dvfs.analysis.headroom import headroom
from dvfs.analysis.targets import Target
from dvfs.cube import open_cube
from dvfs.plots import (
    corpus_panels,
    draw_acceptance,
    draw_energy_vs_clock,
    draw_headroom,
    draw_pareto,
    draw_timelines,
    energy_title,
    figures,
    pareto_front,
    plot_all,
)
from dvfs.plots.style import shared_norm

CLOCKS = [1005, 1500, 1980]
LIMITS = [700.0, 300.0]
TARGET = Target("preserve", slack=0.4)


def _binding(clock: int, limit: float) -> int:
    """The twin-like effect of a cap: above 1500 MHz a 300 W limit holds the clock at 1500."""
    return min(clock, 1500) if limit < 700 else clock


def _energy(clock, limit, batch, drafter, corpus, repeat) -> float:
    c = _binding(clock, limit) / 1980
    speculation = 0.6 if drafter == "eagle3" else 1.0
    power = 3 if corpus == "math" else 2  # savings differ by corpus, not only the scale
    return speculation * (0.5 + c**power) / batch


def _latency(clock, limit, batch, drafter, corpus, repeat) -> float:
    speculation = 0.5 if drafter == "eagle3" else 1.0
    return 5.0 * speculation * 1980 / _binding(clock, limit) + 0.01 * batch


def small_cube(
    batches: list[int], corpora: tuple[str, ...] = ("code", "math"), repeats: int = 1
) -> xr.Dataset:
    """A make_cube cube with what the figures also read: accept lengths and timelines."""
    cube = make_cube(
        clocks=CLOCKS,
        limits=LIMITS,
        batches=batches,
        drafters=["none", "eagle3"],
        corpora=list(corpora),
        latency=_latency,
        energy=_energy,
        repeats=repeats,
    )
    cube.attrs["gpu_name"] = "test GPU"
    accept = np.where(cube["drafter"] == "eagle3", 3.0, np.nan)
    cube["accept_length"] = cube["accept_length"].copy(
        data=np.broadcast_to(accept.reshape(1, 1, 1, -1, 1, 1), cube["accept_length"].shape).copy()
    )
    samples = 8
    dims = (*cube["energy_per_token_j"].dims, "sample")
    shape = (*cube["energy_per_token_j"].shape, samples)
    t = np.broadcast_to(np.arange(samples) * 0.05, shape)
    clock = np.broadcast_to(cube["sm_clock"].values.reshape(-1, 1, 1, 1, 1, 1, 1), shape)
    cube["timeline_t_s"] = (dims, t.copy())
    cube["timeline_power_w"] = (dims, (100 + clock / 10).astype(float))
    cube["timeline_sm_clock_mhz"] = (dims, clock.astype(float))
    return cube


@pytest.fixture(scope="module")
def cube() -> xr.Dataset:
    return small_cube([1, 8, 32, 64])  # four panels: two free grid slots


@pytest.fixture(scope="module")
def full_grid_cube() -> xr.Dataset:
    return small_cube([1, 8, 64], corpora=("code", "math", "a-much-longer-corpus-name"))


# Every figure written as a PNG: tests/test_analysis_cli.py, through `dvfs plot`.


def test_svg_figures_and_a_folder_per_gpu_of_a_merged_cube(tmp_path: Path) -> None:
    # Three figures a GPU (no accept lengths or timelines): every kind as SVG is
    # tests/test_analysis_cli.py's, through `dvfs plot --format svg`.
    tiny = small_cube([1], corpora=("code",)).drop_vars(
        ["accept_length", "timeline_t_s", "timeline_power_w"]
    )
    merged = xr.concat([tiny, tiny], dim=xr.DataArray(["GPU-aaaa", "GPU-bbbb"], dims="gpu"))
    svgs = plot_all(merged, tmp_path / "merged", fmt="svg", target=TARGET)
    assert {p.parent.name for p in svgs} == {"GPU-aaaa", "GPU-bbbb"}
    assert len(svgs) == 6  # three figures of one corpus, per GPU
    assert all(p.suffix == ".svg" and p.read_bytes().lstrip().startswith(b"<?xml") for p in svgs)


def test_heatmap_panels_share_one_norm_and_one_colorbar(cube: xr.Dataset) -> None:
    chosen = headroom(cube, target=TARGET)
    fig = draw_headroom(chosen)
    images = [im for ax in fig.axes for im in ax.images]
    assert len(images) == 2  # a panel per corpus
    assert len({(im.norm.vmin, im.norm.vmax) for im in images}) == 1
    assert all(im.norm is images[0].norm for im in images)
    savings = chosen["saving"].values * 100
    assert images[0].norm.vmin <= np.nanmin(savings)
    assert images[0].norm.vmax == pytest.approx(np.nanmax(savings))
    assert sum(im.colorbar is not None for im in images) == 1
    # the corpora differ, so a norm per panel would have differed
    per_corpus = [np.nanmax(savings[..., k]) for k in range(2)]
    assert per_corpus[0] != pytest.approx(per_corpus[1])


def test_the_headroom_colour_bar_spans_only_the_savings_drawn(
    small_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 0% slack every cell of this cube saves 0%, and the map's colour bar ran from 0 to
    1%, a range of colours no cell has. One value drawn: the bar is that value's colour
    alone, ticked at it, and its label says every answer holds it; no answer at all: no bar,
    and a line says so. At 5% slack the savings differ and the bar is a range again."""
    from click.testing import CliRunner

    import dvfs.plots
    from dvfs.analysis.targets import parse_slo
    from dvfs.cli import cli

    drawn: dict[str, Figure] = {}
    save = dvfs.plots.save

    def keep(fig: Figure, out_dir: Path, name: str, fmt: str) -> Path:
        drawn[name] = fig
        return (save if name == "headroom" else unsaved_figure)(fig, out_dir, name, fmt)

    monkeypatch.setattr(dvfs.plots, "save", keep)
    figures_drawn_only(monkeypatch, "draw_headroom")  # the map alone is read

    def bar(slack: str) -> tuple[Any, list[float]]:
        out = str(tmp_path / slack.rstrip("%"))
        result = CliRunner().invoke(cli, ["plot", str(small_sweep), "--out", out, "--slack", slack])
        assert result.exit_code == 0, result.output
        images = [im for ax in drawn["headroom"].axes for im in ax.images]
        (colorbar,) = [im.colorbar for im in images if im.colorbar is not None]
        cells = [v for im in images for v in np.ma.compressed(im.get_array())]
        return colorbar, cells

    colorbar, cells = bar("0%")
    assert cells and set(cells) == {0.0}
    assert [t.get_text() for t in colorbar.ax.get_xticklabels()] == ["0"]
    assert list(colorbar.values) == [0.0]  # one colour, the cells' own
    assert "0 in every cell with an answer" in colorbar.ax.get_xlabel()
    # ... and that label stays on the figure (on one line it ran past the right edge)
    fig = drawn["headroom"]
    fig.canvas.draw()
    inches = fig.get_tightbbox(fig.canvas.get_renderer())  # type: ignore[attr-defined]
    assert _inside(inches, Bbox.from_bounds(-0.01, -0.01, *(fig.get_size_inches() + 0.02)))
    colorbar, cells = bar("5%")
    assert len(set(cells)) > 1
    assert colorbar.vmin <= min(cells) and colorbar.vmax == pytest.approx(max(cells))
    none = draw_headroom(headroom(open_cube(small_sweep), target=parse_slo("tpot_p50<=0.1ms")))
    assert not any(im.colorbar for ax in none.axes for im in ax.images)
    said = [" ".join(t.get_text().split()) for ax in none.axes for t in ax.texts]
    assert "energy saved vs stock (%): no cell has an answer" in said


@pytest.mark.parametrize("batches", [[1, 8], [1, 4, 8, 16, 32]])
def test_the_headroom_maps_key_in_a_free_grid_slot_stays_on_the_figure(batches: list[int]) -> None:
    """Five corpora leave the grid's last slot free for the colour bar and key; with two batch
    sizes that slot is 1.6 in wide, and the key ("power limit capped below 700 W", "no answer
    (the cell says why)") ran past the figure's right edge, cut off. The figure makes room,
    for the line that stands for the colour bar where no cell has an answer too."""
    from dvfs.analysis.targets import parse_slo

    cube = small_cube(batches, corpora=("code", "conversation", "english", "math", "romansh"))
    for target in (TARGET, parse_slo("tpot_p50<=0.1ms")):
        fig = draw_headroom(headroom(cube, target=target))
        fig.canvas.draw()
        inches = fig.get_tightbbox(fig.canvas.get_renderer())  # type: ignore[attr-defined]
        assert _inside(inches, Bbox.from_bounds(-0.01, -0.01, *(fig.get_size_inches() + 0.02)))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(-1e3, 1e3) | st.just(float("nan")), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    )
)
def test_shared_norm_covers_every_panel(panels: list[list[float]]) -> None:
    arrays = [np.array(p) for p in panels]
    norm = shared_norm(arrays)
    assert norm.vmin is not None and norm.vmax is not None and norm.vmin < norm.vmax
    for a in arrays:
        finite = a[np.isfinite(a)]
        assert np.all(finite >= norm.vmin) and np.all(finite <= norm.vmax)


def _stock_offsets(fig: Figure) -> list[np.ndarray]:
    return [
        np.asarray(c.get_offsets())
        for ax in fig.axes
        for c in ax.collections
        if c.get_gid() == "stock"
    ]


def test_stock_point_marked_at_the_stock_setting(cube: xr.Dataset) -> None:
    fig = draw_energy_vs_clock(cube, "code")
    offsets = _stock_offsets(fig)
    assert len(offsets) == cube.sizes["batch"]
    stock = cube["energy_per_token_j"].sel(sm_clock=1980, power_limit=700.0, corpus="code")
    for b, points in enumerate(offsets):
        assert np.allclose(points[:, 0], 1980)
        expected = stock.isel(batch=b).mean("repeat").transpose("drafter").values
        assert np.allclose(points[:, 1], expected)
    chosen = headroom(cube, target=TARGET)
    pareto = draw_pareto(cube, chosen, TARGET, "code")
    assert len(_stock_offsets(pareto)) == cube.sizes["batch"]
    stars = [c for ax in pareto.axes for c in ax.collections if c.get_gid() == "chosen"]
    assert len(stars) == cube.sizes["batch"]


def _data_axes(fig: Figure) -> list:
    """The panels that hold data (not colourbars, keys or free grid slots)."""
    return [ax for ax in fig.axes if ax.get_gid() == "panel"]


def test_energy_is_in_joules_per_token_as_in_the_tables(cube: xr.Dataset) -> None:
    fig = draw_energy_vs_clock(cube, "code")
    for ax in _data_axes(fig):
        assert ax.get_ylabel() == "energy per token (J)"
    ys = np.concatenate([line.get_ydata() for line in _data_axes(fig)[0].lines])
    at_batch_1 = cube["energy_per_token_j"].sel(batch=1, corpus="code").values
    assert np.nanmax(ys) == pytest.approx(np.nanmax(at_batch_1))  # J, not mJ
    chosen = headroom(cube, target=TARGET)
    for ax in _data_axes(draw_pareto(cube, chosen, TARGET, "code")):
        assert ax.get_ylabel() == "energy per token (J)"


def test_power_limits_are_drawn_apart_from_clocks(cube: xr.Dataset) -> None:
    fig = draw_energy_vs_clock(cube, "code")
    lines = _data_axes(fig)[0].lines
    assert len(lines) == 4  # 2 drafters x 2 power limits, each a line over the clocks
    styles = {(line.get_linestyle(), line.get_marker()) for line in lines}
    assert len(styles) == 2  # one (line style, marker) per power limit
    labels = [t.get_text() for t in _legends(fig)[0].get_texts()]
    assert "700 W power limit (stock)" in labels and "300 W power limit (cap)" in labels


def test_every_power_limit_of_a_long_limit_sweep_has_its_own_marker() -> None:
    """A campaign stepping the power limit from 700 W down to 200 W in six caps: the Pareto
    figure tells the limits apart by marker alone (no lines join its points), and there were
    four cap markers, so the fifth cap (250 W) was drawn and keyed as the first (600 W), and
    the sixth as the second: a point read off the key named the wrong limit. Every limit has
    its own marker now, in the points and in the key, and its own line style and marker pair
    in the energy-vs-clock figure."""
    limits = [700.0, 600.0, 500.0, 400.0, 300.0, 250.0, 200.0]
    cube = make_cube(clocks=CLOCKS, limits=limits, latency=_latency, energy=_energy)
    fig = draw_pareto(cube, headroom(cube, target=TARGET), TARGET, "code")
    ax = _data_axes(fig)[0]
    clouds = [c for c in ax.collections if c.get_gid() not in ("stock", "chosen")]
    assert len(clouds) == len(limits)  # one scatter per power limit
    shapes = {c.get_paths()[0].vertices.round(6).tobytes() for c in clouds}
    assert len(shapes) == len(limits)
    keyed = [h for h in _legends(fig)[0].legend_handles if " W power limit" in h.get_label()]
    assert len(keyed) == len(limits)
    assert len({str(h.get_marker()) for h in keyed}) == len(limits)
    lines = _data_axes(draw_energy_vs_clock(cube, "code"))[0].lines
    assert len({(line.get_linestyle(), str(line.get_marker())) for line in lines}) == len(limits)
    # however many caps: each its own, filled marker (a cap is drawn hollow, by its edge: an
    # unfilled marker's edge colour is dropped and its points would not show)
    from matplotlib.markers import MarkerStyle

    from dvfs.plots.style import limit_styles

    many = limit_styles([700.0 - 10 * i for i in range(30)], 700.0)
    markers = [MarkerStyle(s.marker) for s in many.values()]
    assert all(m.is_filled() for m in markers)
    shapes = [m.get_path().transformed(m.get_transform()).vertices.round(6) for m in markers]
    assert len({shape.tobytes() for shape in shapes}) == len(many)


@pytest.mark.parametrize("kind", ["energy", "pareto"])
@pytest.mark.parametrize("first", ["code", "math"])
def test_reused_panels_draw_the_same_figure_as_fresh_ones(
    cube: xr.Dataset, kind: str, first: str
) -> None:
    """Panels drawn into for one corpus, emptied and drawn into for the other, hold what new
    panels hold: the same artists and the same limits, whichever corpus spans more."""
    chosen = headroom(cube, target=TARGET)

    def draw(corpus: str, panels: Any = None) -> Figure:
        if kind == "energy":
            return draw_energy_vs_clock(cube, corpus, panels)
        return draw_pareto(cube, chosen, TARGET, corpus, panels)

    second = "math" if first == "code" else "code"
    panels = corpus_panels(cube, energy_title(cube, "code"))
    draw(first, panels)
    reused = draw(second, panels)
    fresh = draw(second)
    for a, b in zip(_data_axes(reused), _data_axes(fresh), strict=True):
        assert len(a.lines) == len(b.lines) and len(a.collections) == len(b.collections)
        assert a.get_ylim() == b.get_ylim() and a.get_xlim() == b.get_xlim()
    assert len(_legends(reused)) == 1


def _legends(fig: Figure) -> list[Legend]:
    in_axes = [ax.get_legend() for ax in fig.axes]
    return [*fig.legends, *(legend for legend in in_axes if legend is not None)]


def _every_figure(cube: xr.Dataset) -> Iterator[tuple[str, Figure]]:
    for name, fig in figures(cube, TARGET):
        fig.canvas.draw()
        yield name, fig


@pytest.mark.parametrize("which", ["cube", "full_grid_cube"])
def test_legends_cover_no_data_and_nothing_leaves_the_canvas(
    which: str, request: pytest.FixtureRequest
) -> None:
    cube = request.getfixturevalue(which)
    seen = 0
    for name, fig in _every_figure(cube):
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        canvas = fig.bbox.padded(1)
        panels = _data_axes(fig)
        boxes = [ax.get_window_extent(renderer) for ax in panels]
        for legend in _legends(fig):
            box = legend.get_window_extent(renderer)
            assert not any(box.overlaps(panel) for panel in boxes), name
            assert _inside(box, canvas), f"{name}: legend leaves the canvas"
            seen += 1
        inches = fig.get_tightbbox(renderer)  # every drawn artist, in inches
        assert _inside(inches, Bbox.from_bounds(-0.01, -0.01, *(fig.get_size_inches() + 0.02))), (
            f"{name}: something leaves the canvas"
        )
        tight = [ax.get_tightbbox(renderer) for ax in panels]
        for i, a in enumerate(tight):
            for b in tight[i + 1 :]:
                assert not a.overlaps(b), f"{name}: labels of two panels overlap"
    assert seen >= 4


def _inside(box: Bbox, canvas: Bbox) -> bool:
    return bool(
        box.x0 >= canvas.x0 and box.y0 >= canvas.y0 and box.x1 <= canvas.x1 and box.y1 <= canvas.y1
    )


def test_figures_are_sized_to_be_read(cube: xr.Dataset, tmp_path: Path) -> None:
    for name, fig in figures(cube, TARGET):
        assert fig.dpi >= 150, name
        sizes = [float(t.get_fontsize()) for t in fig.findobj(Text)]
        assert min(sizes) >= 7.5, name
    chosen = headroom(cube, target=TARGET)
    assert draw_timelines(cube, chosen) is not None
    assert draw_acceptance(cube) is not None


def test_no_accept_length_or_timeline_means_no_such_figure(cube: xr.Dataset) -> None:
    bare = cube.drop_vars(["accept_length", "timeline_t_s", "timeline_power_w"])
    names = [name for name, _ in figures(bare, TARGET)]
    assert "acceptance" not in names and "timelines" not in names
    assert "headroom" in names


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 20)) | st.just((-1, -1)),
        min_size=1,
        max_size=25,
    )
)
def test_pareto_front_holds_exactly_the_undominated_points(points: list[tuple[int, int]]) -> None:
    x = np.array([float("nan") if p[0] < 0 else p[0] for p in points])
    y = np.array([float("nan") if p[1] < 0 else p[1] for p in points])
    fx, fy = pareto_front(x, y)
    finite = [(a, b) for a, b in zip(x, y, strict=True) if np.isfinite(a)]
    assert np.all(np.diff(fx) >= 0) and np.all(np.diff(fy) <= 0)
    for a, b in zip(fx, fy, strict=True):  # nothing beats a front point on both
        assert not any(p < a and q < b for p, q in finite)
        assert not any((p <= a and q <= b) and (p, q) != (a, b) and q < b for p, q in finite)
    for p, q in finite:  # every point is matched or beaten by a front point
        assert any(a <= p and b <= q for a, b in zip(fx, fy, strict=True))


def test_the_headroom_map_says_why_a_cell_has_no_answer() -> None:
    """A cell without an answer names its cause as the table does: a partial cube's settings
    with one repeat measured so far are 'not measured yet'; measured ones whose other repeats
    are unusable, 'too few repeats'; never 'none feasible'."""
    import math

    from dvfs.report.headroom import headroom_document, headroom_table_rows

    slow = {1000: 12.0, 2000: 10.0}
    cube = make_cube(
        clocks=[1000, 2000],
        drafters=["none", "eagle3"],
        repeats=3,
        # eagle3 measured in repeat 0 only so far; none in all three
        latency=lambda c, p, b, d, k, r: slow[c] if d == "none" or r == 0 else math.nan,
    )
    short = cube.copy()  # every cell measured, but eagle3's later repeats' latency unusable
    short["cell_status"] = short["cell_status"] * 0 + 1
    short["valid"] = short["valid"].fillna(1)
    for partial, says in ((cube, "not measured yet"), (short, "too few repeats")):
        result = headroom(partial, target=Target("preserve", slack=0.3))
        rows = headroom_table_rows(headroom_document(result, partial))[1]
        assert says in " ".join(" ".join(map(str, r)) for r in rows)  # the table's words ...
        # ... and the map's, wrapped over lines
        texts = [
            " ".join(t.get_text().split()) for ax in draw_headroom(result).axes for t in ax.texts
        ]
        assert says in texts and not any("feasible" in t for t in texts)
        assert any(t.endswith("MHz") for t in texts)  # none's cell has its answer


def test_a_steady_power_reads_as_watts_and_level() -> None:
    """A power steady at 240.875-240.895 W through the window: the axis spanned those 0.02 W
    with ticks 0.0750 ... 0.0950 under a "+2.408e2" offset, which reads as a GPU drawing
    0.09 W, and stretched its last digits into a sawtooth the height of the panel. Every tick
    says its watts, and the axis spans at least 10 W, so a level power is drawn level."""
    cube = small_cube([1, 8], corpora=("code",)).isel(power_limit=[0])  # no cap line drawn
    ramp = 240.875 + 0.02 * (np.arange(cube.sizes["sample"]) % 2)
    cube["timeline_power_w"] = cube["timeline_power_w"] * 0 + ramp
    fig = draw_timelines(cube, headroom(cube, target=TARGET))
    assert fig is not None
    fig.canvas.draw()
    power = [ax for ax in fig.axes if ax.get_ylabel() == "GPU power (W)"]
    assert len(power) == 2
    for ax in power:
        low, high = ax.get_ylim()
        assert high - low >= 10.0 and low < 240.875 and high > 240.895, (low, high)
        assert ax.yaxis.get_major_formatter().get_offset() == ""
        labels = [float(t.get_text().replace("\u2212", "-")) for t in ax.get_yticklabels()]
        assert labels and all(230 < v < 251 for v in labels), labels  # watts, not 0.09
    # an energy alike at every clock to the third decimal: each tick its whole joules
    flat = make_cube(clocks=CLOCKS, energy=lambda c, *_: 1.4095 + 1e-7 * c)
    fig = draw_energy_vs_clock(flat, "code")
    fig.canvas.draw()
    assert fig.axes[0].yaxis.get_major_formatter().get_offset() == ""
    assert all(t.get_text().startswith("1.4") for t in fig.axes[0].get_yticklabels())


def test_a_timeline_power_axis_reads_no_negative_watts() -> None:
    """The 10 W least span was laid around whatever the axis held: a panel with no timeline
    to draw (no valid cell at batch 8) had its empty 0-1 axis widened to -4.5 ... 5.5, ticks
    reading -6 W, and a power steady at 2 W spanned -3 ... 7 W. An empty panel keeps its axis;
    a low power's axis starts at 0 W."""
    cube = small_cube([1, 8], corpora=("code",)).isel(power_limit=[0])  # no cap line drawn
    cube["valid"] = cube["valid"].where(cube["batch"] != 8, 0.0)
    cube["timeline_power_w"] = cube["timeline_power_w"] * 0 + 2.0
    fig = draw_timelines(cube, headroom(cube, target=TARGET))
    assert fig is not None
    fig.canvas.draw()
    power = {ax.get_title(): ax for ax in fig.axes if ax.get_ylabel() == "GPU power (W)"}
    assert set(power) == {"batch 1, corpus code", "batch 8, corpus code"}
    assert power["batch 1, corpus code"].get_ylim() == (0.0, 10.0)
    empty = power["batch 8, corpus code"]
    assert not empty.lines and empty.get_ylim() == (0.0, 1.0), empty.get_ylim()
    for ax in power.values():
        ticks = [float(t.get_text().replace("\u2212", "-")) for t in ax.get_yticklabels()]
        assert ticks and min(ticks) >= 0, ticks


def _timeline_labels(cube: xr.Dataset) -> list[str]:
    fig = draw_timelines(cube, headroom(cube, target=TARGET))
    assert fig is not None
    return [t.get_text() for legend in _legends(fig) for t in legend.get_texts()]


def test_timelines_show_the_smallest_and_largest_batch_in_any_batch_order(
    cube: xr.Dataset,
) -> None:
    """The timelines show the smallest and the largest batch, also where the campaign listed
    its batches in another order (the cube keeps it: batch = [8, 64, 1, 32])."""
    shuffled = cube.isel(batch=[1, 3, 0, 2])
    fig = draw_timelines(shuffled, headroom(shuffled, target=TARGET))
    assert fig is not None
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["batch 1, corpus code", "batch 64, corpus code"]


def test_timelines_name_the_setting_a_power_limit_only_campaign_made(shared_run) -> None:
    """A campaign that sweeps only the power limit never locks the clock: the legend says the
    clock was unlocked and names the limit, where it used to call the stock clock a lock."""
    text = replace_block(SMALL_EXACT, "sm_clock = [1980, 1500, 1005]\n", "")
    cube = open_cube(shared_run(text, "limits") / "cube.nc")
    assert cube.sizes["sm_clock"] == 1  # the stock clock, filed at the GPU's top clock
    labels = [label for label in _timeline_labels(cube) if ": " in label]
    stock = [label for label in labels if ", stock: " in label]
    assert len(stock) == 4  # two drafters, two batches
    assert all(label.endswith(": clock unlocked, 700 W power limit") for label in stock)
    chosen = [label for label in labels if ", chosen: " in label]
    # The twin's 300 W cap never binds here (peaks under 275 W), so the chosen limit is stock.
    limits = {float(p) for p in headroom(cube, target=TARGET)["chosen_power_limit"].values.flat}
    assert limits == {700.0}
    assert chosen and all("clock unlocked, 700 W power limit" in label for label in chosen)
    assert not any("clock lock" in label or "MHz" in label for label in labels)


def test_timelines_of_a_clock_sweep_still_say_clock_lock(small_sweep: Path, shared_run) -> None:
    """The clock swept: the stock cell is the top clock locked; a power limit left at stock
    is named as the one found, not as a limit dvfs set."""
    labels = _timeline_labels(open_cube(small_sweep / "cube.nc"))
    stock = [label for label in labels if ", stock: " in label]
    assert len(stock) == 4
    assert all(label.endswith(": 1980 MHz clock lock, 700 W power limit") for label in stock)
    clock_only = replace_block(SMALL_EXACT, "power_limit = [700, 300]\n", "")
    labels = _timeline_labels(open_cube(shared_run(clock_only, "clocks") / "cube.nc"))
    settings = [label.split(": ", 1)[1] for label in labels if ": " in label]
    assert settings and all(" MHz clock lock, stock 700 W power limit" in s for s in settings)


def test_the_headroom_map_of_a_power_limit_only_campaign_names_limits_not_clocks(
    shared_run,
) -> None:
    """Only the power limit swept: the clock in every answer is the unlocked stock clock, so
    the map's cells name the chosen limit and its title says the clock was not swept; a clock
    sweep's map still names the clock lock."""
    text = replace_block(SMALL_EXACT, "sm_clock = [1980, 1500, 1005]\n", "")
    cube = open_cube(shared_run(text, "limits") / "cube.nc")
    fig = draw_headroom(headroom(cube, target=TARGET))
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    answers = [t for t in texts if t.split("\n")[0].endswith("%")]
    assert answers and all(t.split("\n")[-1].endswith(" W") for t in answers)
    assert not any("MHz" in t for t in texts)
    assert any("SM clock not set" in t.get_text() for t in fig.texts)  # the title
    clock_only = replace_block(SMALL_EXACT, "power_limit = [700, 300]\n", "")
    clocks = open_cube(shared_run(clock_only, "clocks") / "cube.nc")
    fig = draw_headroom(headroom(clocks, target=TARGET))
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any(t.endswith("MHz") for t in texts)
    assert not any("SM clock not set" in t.get_text() for t in fig.texts)
    # Observe-only sets no clock either, but keeps a lock set outside dvfs: the title said
    # "SM clock not set: unlocked", which the table's "not set" line and the timelines'
    # "as found" no longer claim.
    observed = open_cube(shared_run(SMALL_EXACT, "observed", "--observe-only") / "cube.nc")
    fig = draw_headroom(headroom(observed, target=TARGET))
    (title,) = [t.get_text() for t in fig.texts if "SM clock not set" in t.get_text()]
    assert "unlocked" not in title, title


def _chosen_column(markdown: str) -> list[str]:
    """The "chosen MHz/W" cells of the headroom table in a Markdown text."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if "| chosen MHz/W |" in line)
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    column = header.index("chosen MHz/W")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")][column])
    return rows


@pytest.mark.usefixtures("unsaved_figures")
def test_the_headroom_table_of_a_power_limit_only_campaign_names_no_clock_lock(
    shared_run, tmp_path: Path
) -> None:
    """Only the power limit swept: the clock was never locked, yet the table's chosen
    setting read "1980/700", the stock clock the cube files those cells under, as if it were
    a lock (the map already said "SM clock not set"). `dvfs headroom` and `dvfs report` say
    "not set/<limit>" and why, the JSON says the campaign set no clock; a clock sweep's table
    still names its clock."""
    import json

    from click.testing import CliRunner

    from dvfs.cli import cli

    def run(*args: str) -> str:
        result = CliRunner().invoke(cli, list(args))
        assert result.exit_code == 0, result.output
        return result.output

    text = replace_block(SMALL_EXACT, "sm_clock = [1980, 1500, 1005]\n", "")
    limits = shared_run(text, "limits")
    doc = json.loads(run("headroom", str(limits), "--json"))
    want = [f"not set/{r['chosen']['power_limit_w']:g}" for r in doc["rows"]]
    assert _chosen_column(run("headroom", str(limits), "--markdown")) == want
    assert doc["knobs_set"] == {"sm_clock": False, "power_limit": True}
    said = " ".join(run("headroom", str(limits)).split())
    assert "not set: the campaign never set the SM clock" in said
    assert "MHz/700" not in said and "1980/" not in said
    run("report", str(limits), "-o", str(tmp_path / "r.md"))
    assert _chosen_column((tmp_path / "r.md").read_text()) == want
    # The report's findings name the largest saving's setting as its table does: the limit
    # alone (they said "1980 MHz / 200 W instead of 1980 MHz / 700 W", a lock never set).
    capped = shared_run(replace_block(text, "[700, 300]", "[700, 200]"), "limits-200")
    run("report", str(capped), "--slack", "5%", "-o", str(tmp_path / "r5.md"))
    doc = json.loads(run("headroom", str(capped), "--slack", "5%", "--json"))
    best = max(doc["rows"], key=lambda r: r["saving"] or 0)
    assert best["saving"] > 0 and best["chosen"]["power_limit_w"] < 700
    (largest,) = [
        line for line in (tmp_path / "r5.md").read_text().splitlines() if "Largest saving" in line
    ]
    limit = f"{best['chosen']['power_limit_w']:g} W instead of 700 W, the SM clock not set"
    assert limit in largest and "MHz" not in largest, largest
    clock_only = replace_block(SMALL_EXACT, "power_limit = [700, 300]\n", "")
    clocks = shared_run(clock_only, "clocks")
    doc = json.loads(run("headroom", str(clocks), "--json"))
    assert doc["knobs_set"] == {"sm_clock": True, "power_limit": False}
    want = [f"{r['chosen']['sm_clock_mhz']}/{r['chosen']['power_limit_w']:g}" for r in doc["rows"]]
    assert _chosen_column(run("headroom", str(clocks), "--markdown")) == want
    assert "not set" not in run("headroom", str(clocks))


def test_a_cube_of_one_sm_clock_has_no_energy_vs_clock_figure(shared_run) -> None:
    """Only the power limit swept: every cell is at the one stock clock, never locked. The
    energy-vs-clock figure drew each limit as a point over one x value on an axis named "SM
    clock lock (MHz)", a lock the campaign never set, with nothing varying along it; it is
    left out, as the energy-vs-batch figure is for one batch size, and the Pareto figure
    still draws every limit. A clock sweep still has its energy-vs-clock figures."""
    text = replace_block(SMALL_EXACT, "sm_clock = [1980, 1500, 1005]\n", "")
    cube = open_cube(shared_run(text, "limits") / "cube.nc")
    assert cube.sizes["sm_clock"] == 1 and cube.sizes["power_limit"] == 2
    names = [name for name, _ in figures(cube, TARGET)]
    corpora = [str(c) for c in cube["corpus"].values]
    assert not any(name.startswith("energy_vs_clock") for name in names)
    assert all(f"pareto_{corpus}" in names for corpus in corpora)
    clock_only = replace_block(SMALL_EXACT, "power_limit = [700, 300]\n", "")
    clocks = open_cube(shared_run(clock_only, "clocks") / "cube.nc")
    names = [name for name, _ in figures(clocks, TARGET)]
    assert all(f"energy_vs_clock_{corpus}" in names for corpus in corpora)


def test_a_merged_power_limit_only_cube_has_no_energy_vs_clock_figure(shared_run) -> None:
    """The power-limit-only grid on two GPU models of different stock clocks (the twin H100
    at 1980 MHz, another at 1755 MHz, as an H100 PCIe): merged, the clock axis holds both
    stock clocks, each GPU's cells at its own. Each GPU's energy-vs-clock figure was drawn,
    its limits as points over one clock of that axis named "SM clock lock (MHz)", a lock the
    campaign never set; it is left out as for the single cube, and the Pareto figure stays."""
    from dvfs.cube import merge_cubes
    from dvfs.plots import per_gpu

    text = replace_block(SMALL_EXACT, "sm_clock = [1980, 1500, 1005]\n", "")
    h100 = open_cube(shared_run(text, "limits") / "cube.nc").load()
    other = h100.assign_coords(sm_clock=[1755]).assign_attrs(
        stock_sm_clock_mhz=1755, gpu_uuids="GPU-0badc0de-0000-0000-0000-000000000000"
    )
    other["sm_clock"].attrs = dict(h100["sm_clock"].attrs)
    merged = merge_cubes([h100, other], ["h100", "other"])
    assert merged.sizes["sm_clock"] == 2
    corpora = [str(c) for c in merged["corpus"].values]
    for _, one in per_gpu(merged):
        names = [name for name, _ in figures(one, TARGET)]
        assert not any(name.startswith("energy_vs_clock") for name in names), names
        assert all(f"pareto_{corpus}" in names for corpus in corpora)


def test_the_headroom_map_names_a_single_locked_clock(shared_run) -> None:
    """One clock locked (1500 MHz) and the power limit swept: the clock is not swept, but it
    is a lock dvfs set, so every answer names it, as the timelines do."""
    text = replace_block(SMALL_EXACT, "sm_clock = [1980, 1500, 1005]\n", "sm_clock = [1500]\n")
    cube = open_cube(shared_run(text, "one-clock") / "cube.nc")
    fig = draw_headroom(headroom(cube, target=TARGET))
    answers = [t.get_text() for ax in fig.axes for t in ax.texts if "%\n" in t.get_text()]
    assert answers and all("\n1500 MHz" in t for t in answers)
    assert not any("SM clock not set" in t.get_text() for t in fig.texts)


@pytest.mark.parametrize("opaque", [True, False])
def test_a_png_holds_the_pixels_savefig_draws(tmp_path: Path, opaque: bool) -> None:
    """`write_png` drops the alpha channel only where every pixel is opaque: the file's pixels
    are savefig's, at the figures' DPI."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    from dvfs.plots.style import DPI, write_png

    fig = Figure(figsize=(3, 2), dpi=72)  # write_png sets the DPI itself
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([0, 1, 2], [2, 0, 1], color="#0173b2")
    ax.set_title("batch 1")
    if not opaque:
        fig.patch.set_alpha(0.0)
    written = tmp_path / "f.png"
    write_png(fig, written)
    reference = io.BytesIO()
    fig.savefig(reference, format="png", dpi=DPI)
    want = Image.open(reference)
    got = Image.open(written)
    assert got.mode == ("RGB" if opaque else "RGBA")
    assert got.size == want.size == (3 * DPI, 2 * DPI)
    assert np.array_equal(np.asarray(got), np.asarray(want.convert(got.mode)))
    assert round(got.info["dpi"][0]) == DPI


def _text_figure(canvas: type, texts: list[dict]) -> Figure:
    """A figure with an axes (lines, ticks, labels) and `texts` (`Figure.text`'s keywords)
    down its right side, drawn on `canvas`."""
    fig = Figure(figsize=(4, 3), dpi=150)
    canvas(fig)
    ax = fig.add_axes((0.15, 0.15, 0.45, 0.7))
    ax.plot([700, 1300, 1980], [0.3, 0.1, 0.2])
    ax.set_title("batch 16\nsecond line")
    ax.set_xlabel("SM clock lock (MHz)")
    ax.set_ylabel("energy per token (J)")  # rotated 90 degrees
    for i, text in enumerate(texts):
        fig.text(0.7, 0.92 - 0.15 * i, "batch 16", **text)
    fig.canvas.draw()
    return fig


def _pixels(fig: Figure) -> np.ndarray:
    return np.asarray(fig.canvas.buffer_rgba()).copy()


TEXTS: list[dict] = [
    {"size": 9},
    {"size": 12},  # the same string at another size
    {"size": 9, "color": "#0173b2"},  # another colour
    {"size": 9, "weight": "bold"},  # another font
    {"size": 9, "rotation": 60},  # turned, as the split's drafter names are
    {"size": 9, "antialiased": False},
]


def test_text_drawn_from_the_cache_is_the_text_drawn_afresh() -> None:
    """A string found in the cache is drawn as it was drawn first: each text alone, drawn by a
    canvas that has seen every other text (at other sizes, colours and angles), has the
    pixels it has when drawn by a canvas with an empty cache."""
    from dvfs.plots.style import make_text_caching_canvas

    warm = make_text_caching_canvas()
    _text_figure(warm, TEXTS)
    for text in TEXTS:
        cold = make_text_caching_canvas()
        assert np.array_equal(
            _pixels(_text_figure(warm, [text])), _pixels(_text_figure(cold, [text]))
        )


def test_the_text_caching_canvas_changes_text_pixels_only() -> None:
    """Against matplotlib's own Agg canvas, the figures' canvas lays text out the same and
    draws it under a pixel away (turned text under two, as matplotlib up to 3.10 did): every
    pixel away from the texts is the same, and each text has as much ink, centred where
    matplotlib centres it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from dvfs.plots.style import make_text_caching_canvas

    ours_fig = _text_figure(make_text_caching_canvas(), TEXTS)
    ours = _pixels(ours_fig)
    fig = _text_figure(FigureCanvasAgg, TEXTS)
    stock = _pixels(fig)
    assert ours.shape == stock.shape
    renderer = fig.canvas.get_renderer()
    extents = [
        [text.get_window_extent(f.canvas.get_renderer()).bounds for text in f.findobj(Text)]
        for f in (ours_fig, fig)
    ]
    assert extents[0] == extents[1]  # measured as matplotlib measures: the same layout
    # and laid out so while drawing: the axis labels, placed then by the tick labels' boxes
    positions = [[text.get_position() for text in f.findobj(Text)] for f in (ours_fig, fig)]
    assert positions[0] == positions[1]
    height = ours.shape[0]
    near_text = np.zeros(ours.shape[:2], dtype=bool)
    boxes = []
    for text in fig.findobj(Text):
        if text.get_visible() and text.get_text():
            box = text.get_window_extent(renderer)
            rows = slice(max(0, int(height - box.y1) - 2), int(height - box.y0) + 3)
            cols = slice(max(0, int(box.x0) - 2), int(box.x1) + 3)
            near_text[rows, cols] = True
            boxes.append((rows, cols, 0.75 if text.get_rotation() == 0 else 1.5))
    assert len(boxes) > 10  # tick labels, title, axis labels and the texts
    assert not near_text.all()
    assert np.array_equal(ours[~near_text], stock[~near_text])
    for rows, cols, shift_px in boxes:
        ink_ours = 255 - ours[rows, cols, :3].astype(float).mean(axis=2)
        ink_stock = 255 - stock[rows, cols, :3].astype(float).mean(axis=2)
        assert ink_ours.sum() == pytest.approx(ink_stock.sum(), rel=0.1)
        if ink_stock.sum() == 0:  # a tick label outside the view: not drawn
            continue
        for axis in (0, 1):
            at = np.arange(ink_ours.shape[axis])
            centre_ours = (ink_ours.sum(axis=1 - axis) * at).sum() / ink_ours.sum()
            centre_stock = (ink_stock.sum(axis=1 - axis) * at).sum() / ink_stock.sum()
            assert centre_ours == pytest.approx(centre_stock, abs=shift_px)


def test_a_matplotlib_without_the_private_text_calls_draws_text_its_own_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The text cache stands on two private matplotlib calls; where a release lacks either,
    the figures use matplotlib's own canvas instead of failing mid-draw."""
    from matplotlib.backends import _backend_agg
    from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg

    from dvfs.plots.style import make_text_caching_canvas

    assert make_text_caching_canvas() is not FigureCanvasAgg
    monkeypatch.delattr(RendererAgg, "_prepare_font")
    assert make_text_caching_canvas() is FigureCanvasAgg
    monkeypatch.undo()
    monkeypatch.delattr(_backend_agg.RendererAgg, "draw_text_image")
    assert make_text_caching_canvas() is FigureCanvasAgg


def test_a_matplotlib_without_the_fonts_calls_draws_text_its_own_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same where FT2Font lacks a call the cache makes (3.11's own text path no longer
    uses them)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.ft2font import FT2Font

    from dvfs.plots.style import make_text_caching_canvas

    monkeypatch.delattr(FT2Font, "draw_glyphs_to_bitmap")
    assert make_text_caching_canvas() is FigureCanvasAgg


def test_a_merged_gpu_figures_name_no_other_gpus_stock_limit(tmp_path: Path) -> None:
    """Two GPUs whose campaign left the power limit at stock, at 700 and 600 W: the merged
    axis holds both limits, each GPU's cells at its own. Each GPU's energy-vs-clock legend
    named the other's stock limit as a "cap" it never ran at (the H200's "700 W power limit
    (cap)", above its own stock), and its Pareto figure drew that limit's empty points; each
    GPU's figures are now those of its own cube alone."""
    from cubes import as_twin_sweep

    from dvfs.cube import merge_cubes, write_cube
    from dvfs.plots import per_gpu

    alone = []
    for name, uuid, watts in (
        ("NVIDIA H100 80GB HBM3 (twin)", "GPU-aaaaaaaa-0000-4000-8000-000000000001", 700.0),
        ("NVIDIA H200 (twin)", "GPU-bbbbbbbb-0000-4000-8000-000000000002", 600.0),
    ):
        ds = make_cube(
            clocks=CLOCKS,
            limits=[watts],
            latency=lambda clock, *_: 10.0 if clock >= 1500 else 20.0,
            energy=lambda clock, *_: clock / 1000,
        )
        path = tmp_path / f"{watts:.0f}.nc"
        write_cube(as_twin_sweep(ds, uuid=uuid, gpu_name=name, campaign="m"), path)
        alone.append(open_cube(path).load())
    merged = merge_cubes(alone, ["a", "b"])
    assert merged.sizes["power_limit"] == 2

    def legends(cube: xr.Dataset, from_merge: bool) -> dict[str, list[str]]:
        return {
            name: [t.get_text() for legend in _legends(fig) for t in legend.get_texts()]
            for name, fig in figures(cube, TARGET, grid_from_data=from_merge)
        }

    for (_, one), own in zip(per_gpu(merged), alone, strict=True):
        said = legends(one, True)
        assert said == legends(own, False)
        assert not any("(cap)" in label for labels in said.values() for label in labels)
        assert one.sizes["power_limit"] == 1


def test_a_power_limit_only_campaign_draws_energy_and_latency_against_the_limit(
    shared_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the power limit swept: the energy-vs-clock figure is left out (one clock), and no
    figure put the limit on its x axis; its limits were only points of the Pareto figure.
    `dvfs plot` draws energy per token and the target's latency against the power limit, a
    line per drafter through its cells' means, the stock limit ringed and `dvfs headroom`'s
    choice starred where its table puts it, each drafter's target dotted; the report
    captions them."""
    import json

    from click.testing import CliRunner
    from conftest import figures_drawn_only, unsaved_figure

    import dvfs.plots
    from dvfs.cli import cli

    text = replace_block(SMALL_EXACT, "sm_clock = [1980, 1500, 1005]\n", "")
    run = shared_run(replace_block(text, "[700, 300]", "[700, 200]"), "limits-200")
    kept: dict[str, dict[int, dict[str, Any]]] = {}

    def note(fig: Figure, out_dir: Path, name: str, fmt: str) -> Path:
        if fig is not None and name.startswith(
            ("energy_vs_power_limit_", "latency_vs_power_limit_")
        ):
            panels: dict[int, dict[str, Any]] = {}
            for ax in fig.axes:
                if not ax.get_title().startswith("batch "):
                    continue
                marks = {str(c.get_gid()): c.get_offsets() for c in ax.collections}
                panels[int(ax.get_title().split()[1])] = {
                    "lines": [
                        (np.asarray(line.get_xdata()), np.asarray(line.get_ydata()))
                        for line in ax.lines
                    ],
                    "stock": np.asarray(marks["stock"]),
                    "chosen": np.asarray(marks["chosen"]),
                    "xlabel": ax.get_xlabel(),
                }
            kept[name] = panels
        return unsaved_figure(fig, out_dir, name, fmt)

    def invoke(*args: str) -> str:
        result = CliRunner().invoke(cli, list(args))
        assert result.exit_code == 0, result.output
        return result.output

    monkeypatch.setattr(dvfs.plots, "save", note)
    said = invoke("plot", str(run), "--slack", "5%", "--out", str(tmp_path / "plots"))
    doc = json.loads(invoke("headroom", str(run), "--slack", "5%", "--json"))
    cube = open_cube(run / "cube.nc")
    drafters = [str(d) for d in cube["drafter"].values]
    corpora = [str(c) for c in cube["corpus"].values]
    for corpus in corpora:
        for kind in ("energy", "latency"):
            assert f"{kind}_vs_power_limit_{corpus}.png" in said
    assert "energy_vs_clock" not in said
    capped = 0
    for row in doc["rows"]:
        d = drafters.index(row["drafter"])
        for kind, value, stock in (
            ("energy", "energy_per_token_j", "stock_energy_per_token_j"),
            ("latency", "latency_ms", "reference_latency_ms"),
        ):
            panel = kept[f"{kind}_vs_power_limit_{row['corpus']}"][row["batch"]]
            assert panel["xlabel"] == "power limit (W)"
            x, y = panel["lines"][d] if kind == "energy" else panel["lines"][2 * d]
            assert x.tolist() == [200.0, 700.0]
            assert y[1] == pytest.approx(row[stock])
            assert panel["stock"][d].tolist() == pytest.approx([700.0, row[stock]])
            chosen = [row["chosen"]["power_limit_w"], row[value]]
            assert panel["chosen"][d].tolist() == pytest.approx(chosen)
            assert y[x.tolist().index(chosen[0])] == pytest.approx(row[value])
            if kind == "latency":  # each drafter's line, then its target
                tx, ty = panel["lines"][2 * d + 1]
                assert ty.tolist() == pytest.approx([row["target_ms"]] * 2)
        capped += row["chosen"]["power_limit_w"] < 700
    assert capped  # the cap binds somewhere: a star away from the stock limit
    figures_drawn_only(monkeypatch)
    invoke("report", str(run), "--slack", "5%", "-o", str(tmp_path / "r.md"))
    report = (tmp_path / "r.md").read_text()
    assert "Energy per token against the power limit, at the grid's one SM clock, " in report
    for corpus in corpora:
        assert f"energy_vs_power_limit_{corpus}.png" in report
        assert f"latency_vs_power_limit_{corpus}.png" in report


def test_the_headroom_map_names_an_answer_that_has_no_saving() -> None:
    """With --slo, a row whose reference has too few usable repeats still has an answer (a
    setting meets the absolute limit) but no stock energy to save against: the table reads
    `-` for its saving and names the setting. The map said "none feasible" there, as if no
    setting met the target, and its bar "no cell has an answer"."""
    from matplotlib.patches import Rectangle

    from dvfs.analysis.targets import parse_slo
    from dvfs.report.headroom import headroom_document, headroom_table_rows

    cube = one_usable_stock_repeat_cube()
    result = headroom(cube, target=parse_slo("tpot_p50<=16ms"))
    row = headroom_table_rows(headroom_document(result, cube))[1][0]
    assert row[3] == "1500/700" and row[7] == "-", row  # the table: the setting, no saving
    fig = draw_headroom(result)
    texts = [" ".join(t.get_text().split()) for ax in fig.axes for t in ax.texts]
    assert "- 1500 MHz" in texts, texts
    assert not any("feasible" in t or "no cell has an answer" in t for t in texts), texts
    # drawn as an answer, not in the grey of a cell without one, and the key says what "-" is
    drawn = [p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_gid()]
    assert [p.get_gid() for p in drawn] == ["unknown"]
    labels = [t.get_text() for legend in _legends(fig) for t in legend.get_texts()]
    assert any(label.startswith("-: an answer, but no energy at stock") for label in labels)


def test_the_headroom_map_of_a_cube_with_nothing_swept_says_so() -> None:
    """One SM clock and one power limit: every cell is stock at 0%, which read as a finding
    that no setting saves, where none below stock was measured (the report's finding and the
    table's "not swept" say so). The map's title says nothing was swept; a swept one does
    not."""
    flat = make_cube(clocks=[1980], batches=[1, 8])
    swept = make_cube(clocks=[1500, 1980], batches=[1, 8])
    for cube, said in ((flat, True), (swept, False)):
        title = draw_headroom(headroom(cube, target=TARGET)).get_suptitle()
        assert ("nothing swept (one SM clock, one power limit)" in title) is said, title


def test_plot_on_a_full_disk_leaves_no_empty_out_folder(
    small_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs plot --out NEW` whose first figure found the disk full (ENOSPC, simulated at the
    write of the figure's bytes) said so, but left NEW behind, an empty folder it had made.
    It is removed again, as `make_parent` removes an output file's folders."""
    import errno

    from click.testing import CliRunner

    from dvfs.cli import cli

    def full(self: Path, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_bytes", full)
    out = tmp_path / "new" / "plots"
    result = CliRunner().invoke(cli, ["plot", str(small_sweep), "--out", str(out)])
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert "no space left on the device" in line and "Traceback" not in line, line
    assert not (tmp_path / "new").exists()
    assert list(tmp_path.iterdir()) == []
