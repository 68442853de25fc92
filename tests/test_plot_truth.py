"""The figures say what the cube says: each GPU of a merged cube under its own name, no
average over corpora or over invalid repeats, "stock" only where the reference is stock, and
no legend entry or bar for what was not measured. Small hand-built cubes; the assertions read
the data and text a figure draws, not its pixels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import xarray as xr
from cubes import make_cube
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plots import TARGET, small_cube

import dvfs.plots
from dvfs.analysis.headroom import headroom
from dvfs.plots import draw_timelines, figures, per_gpu, plot_all

if TYPE_CHECKING:
    from matplotlib.figure import Figure

H100 = "NVIDIA H100 80GB HBM3 (twin)"
H200 = "NVIDIA H200 (twin)"
UUIDS = ["GPU-47dfcd23-120e-9eab-3043-5d0ea1215572", "GPU-f39e88b9-d087-92fe-fa29-3ee2861654ce"]


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(match=lambda a: hasattr(a, "get_text"))]


def test_each_gpu_of_a_merged_cube_is_drawn_under_its_own_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = small_cube([1, 8], corpora=("code",))
    merged = xr.concat([one, one], dim=xr.DataArray(UUIDS, dims="gpu"))
    merged.attrs.update(gpu_name=H100, gpu_names=json.dumps([H100, H200]))
    parts = per_gpu(merged)
    folders = [folder for folder, _ in parts]
    assert folders == ["nvidia-h100-80gb-hbm3-twin-GPU-47dfcd23", "nvidia-h200-twin-GPU-f39e88b9"]
    # What `plot_all` draws into each GPU's folder, read where it would save each figure (its
    # text, not its file: tests/test_plots.py writes a merged cube's figures).
    titles: dict[str, dict[str, str]] = {}

    def note(fig: Figure, out_dir: Path, name: str, fmt: str) -> Path:
        titles.setdefault(out_dir.name, {})[name] = fig.get_suptitle()
        return out_dir / f"{name}.{fmt}"

    monkeypatch.setattr(dvfs.plots, "save", note)
    paths = plot_all(merged, tmp_path, fmt="svg", target=TARGET)
    assert {p.parent.name for p in paths} == set(folders) and list(titles) == folders
    for folder, mine, other in zip(folders, (H100, H200), (H200, H100), strict=True):
        drawn = titles[folder]
        assert mine in drawn["energy_vs_clock_code"] and mine in drawn["energy_vs_batch"]
        assert not any(other in t for t in drawn.values())


def _one_bad_repeat(cube: xr.Dataset, **at: object) -> xr.Dataset:
    """`cube` with repeat 0 of the cells at `at` measured but invalid (a quality flag)."""
    cube = cube.copy(deep=True)
    cube["valid"].loc[{**at, "repeat": 0}] = 0.0
    return cube


def test_a_setting_with_an_invalid_repeat_is_not_drawn_as_a_point() -> None:
    """Headroom never chooses a setting with an invalid repeat; the figures do not draw it as
    a valid point from its other repeats either."""
    from dvfs.plots import draw_energy_vs_clock, draw_pareto
    from dvfs.plots.data import cell_means

    cube = _one_bad_repeat(small_cube([1], corpora=("code",), repeats=2), sm_clock=1500)
    dims = ("drafter", "power_limit", "sm_clock")
    energy = cell_means(cube, "energy_per_token_j", dims, batch=1, corpus="code")
    assert np.isnan(energy[:, :, 1]).all() and np.isfinite(energy[:, :, [0, 2]]).all()
    fig = draw_energy_vs_clock(cube, "code")
    lines = [line for ax in fig.axes for line in ax.lines if len(line.get_xdata()) == 3]
    assert lines and all(np.isnan(line.get_ydata()[1]) for line in lines)
    result = headroom(cube, target=TARGET)
    pareto = draw_pareto(cube, result, TARGET, "code")
    drawn = np.concatenate(
        [c.get_offsets() for ax in pareto.axes for c in ax.collections if c.get_gid() is None]
    )
    # 2 drafters x 2 power limits x the 2 clocks whose every repeat is valid
    assert np.isfinite(np.ma.filled(drawn, np.nan)).all(axis=1).sum() == 8


def test_a_reference_with_one_invalid_repeat_is_drawn_as_the_tables_take_it() -> None:
    """With two of its three repeats usable, the stock setting stays headroom's reference: its
    stock energy and a setting it may choose. The figures drew none of it (a setting with an
    invalid repeat left out whole), so the Pareto front starred a chosen setting where no point
    and no stock ring was, and energy against batch had no point where the table states the
    stock energy. They draw it now from its usable repeats, as the tables read it."""
    from dvfs.analysis.split import where_energy_goes
    from dvfs.analysis.targets import Target

    cube = _split_cube(small_cube([1, 8], corpora=("code",), repeats=3))
    energy = cube["energy_per_token_j"].values.copy()
    energy[..., 0] *= 2.0  # repeat 0 (the last cell axis) reads twice the energy ...
    cube["energy_per_token_j"] = cube["energy_per_token_j"].copy(data=energy)
    # ... and is invalid at none's stock setting
    cube = _one_bad_repeat(cube, sm_clock=1980, power_limit=700.0, drafter="none")
    target = Target("preserve", slack=0.0)  # nothing but stock meets it
    result = headroom(cube, target=target)
    stock = {"sm_clock": 1980, "power_limit": 700.0, "drafter": "none", "corpus": "code"}
    usable = cube["energy_per_token_j"].sel(stock).isel(repeat=[1, 2]).mean("repeat")
    row = result.sel(drafter="none", corpus="code")
    assert (row["chosen_sm_clock"] == 1980).all() and (row["chosen_power_limit"] == 700.0).all()
    np.testing.assert_allclose(row["stock_energy_per_token_j"], usable)
    drawn = dict(figures(cube, target))
    for ax, batch in zip(drawn["pareto_code"].axes, (1, 8), strict=False):
        ring, star = (
            np.asarray(c.get_offsets())[0]
            for gid in ("stock", "chosen")
            for c in ax.collections
            if c.get_gid() == gid
        )
        assert ax.get_title() == f"batch {batch}"
        np.testing.assert_allclose(ring, star)  # none's ring is where its chosen star is
        assert ring[1] == pytest.approx(float(row["stock_energy_per_token_j"].sel(batch=batch)))
    (panel,) = [ax for ax in drawn["energy_vs_batch"].axes if ax.get_title() == "corpus code"]
    none_line = panel.lines[0]  # the drafters in the cube's order, none first
    np.testing.assert_allclose(none_line.get_ydata(), row["stock_energy_per_token_j"])
    split = where_energy_goes(cube).sel(drafter="none", corpus="code")
    assert (split["invalid"] == 0).all() and np.isfinite(split["energy_per_token_verify_j"]).all()


def test_a_reference_ruled_out_gives_no_stock_energy_where_the_figures_draw_none() -> None:
    """With two of its three repeats invalid, the stock setting is ruled out (one usable
    repeat: too few to be the reference), and the figures draw no point there. The table still
    stated a stock energy from that one repeat, and an SLO's saving against it (23.5% on a twin
    cube with two stock repeats flagged clock_not_reached), and the report's findings said
    energy at stock falls with batch for pairs energy-vs-batch draws no line of. Now neither."""
    from dvfs.analysis.targets import parse_slo
    from dvfs.report.findings import energy_finding
    from dvfs.report.headroom import headroom_document, headroom_table_rows

    cube = small_cube([1, 8], corpora=("code",), repeats=3)
    cube = cube.copy(deep=True)
    stock = {"sm_clock": 1980, "power_limit": 700.0, "drafter": "none"}
    cube["valid"].loc[{**stock, "repeat": [0, 1]}] = 0.0
    target = parse_slo("tpot_p50<=100ms")  # every setting meets it
    result = headroom(cube, target=target)
    row = result.sel(drafter="none", corpus="code")
    assert (row["chosen_sm_clock"] == 1005).all()  # an answer: the SLO needs no reference
    assert np.isnan(row["stock_energy_per_token_j"]).all() and np.isnan(row["saving"]).all()
    eagle = result.sel(drafter="eagle3", corpus="code")
    assert np.isfinite(eagle["saving"]).all()  # its own stock stands
    header, rows = headroom_table_rows(headroom_document(result, cube))
    none_rows = [r for r in rows if r[header.index("drafter")] == "none"]
    assert none_rows and all(r[header.index("saving")] == "-" for r in none_rows)
    drawn = dict(figures(cube, target))
    (panel,) = [ax for ax in drawn["energy_vs_batch"].axes if ax.get_title() == "corpus code"]
    assert len(panel.lines) == 1  # eagle3's line only: none has no point at stock
    sentence = " ".join(energy_finding(headroom_document(result, cube), ()).details)
    assert "falls for 1 of 1 (drafter, corpus) pairs" in sentence


def test_the_timeline_draws_the_first_valid_repeat_of_the_stock_cell() -> None:
    cube = small_cube([1], corpora=("code",), repeats=2)
    power = cube["timeline_power_w"].values.copy()
    power[..., 0, :] = 999.0  # repeat 0 (the last cell axis) reads 999 W ...
    cube["timeline_power_w"] = cube["timeline_power_w"].copy(data=power)
    cube = _one_bad_repeat(cube, sm_clock=1980, power_limit=700.0)  # ... and is invalid there
    fig = draw_timelines(cube, headroom(cube, target=TARGET))
    stock = [
        line
        for ax in fig.axes
        for line in ax.lines
        if ", stock:" in str(line.get_label()) or ", reference:" in str(line.get_label())
    ]
    assert stock and all(999.0 not in line.get_ydata() for line in stock)


def test_a_grid_without_stock_never_says_stock() -> None:
    """Where the stock clock was not swept, the reference is the top of the grid: the batch
    figure's title, the headroom map's colourbar, the timelines and the report's captions say
    so."""
    from dvfs.plots import draw_energy_vs_batch, draw_headroom
    from dvfs.report.document import figure_caption

    cube = small_cube([1, 8], corpora=("code",))
    cube.attrs["stock_sm_clock_mhz"] = 2100  # not in the grid (max 1980)
    result = headroom(cube, target=TARGET)
    texts = [
        *_texts(draw_energy_vs_batch(cube)),
        *_texts(draw_headroom(result)),
        *_texts(draw_timelines(cube, result)),
        figure_caption("energy_vs_batch.png", stock=False),
        figure_caption("timelines.png", stock=False),
    ]
    assert not [t for t in texts if "stock" in t and "not swept" not in t], texts
    assert "top of the grid" in draw_energy_vs_batch(cube).get_suptitle()
    assert "stock" in figure_caption("energy_vs_batch.png")  # where the reference is stock


def test_the_curves_of_a_grid_without_the_stock_limit_never_call_its_top_limit_stock() -> None:
    """A campaign capping below the stock limit only (700 W and 300 W on a GPU of 800 W): the
    reference is the top of the grid, as `dvfs headroom` says, yet the energy-vs-clock and
    Pareto keys called 700 W "power limit (stock)", and the Pareto title gave the target as
    "each drafter's own stock TPOT", where the table's is the top-of-grid TPOT. They say the
    top of the grid now, the target in the table's words; where the stock limit was swept
    (the stock clock not), its key still says stock."""
    from dvfs.plots import draw_energy_vs_clock, draw_pareto

    cube = small_cube([1, 8], corpora=("code",))
    cube.attrs["stock_power_limit_w"] = 800.0  # not in the grid (700, 300)
    result = headroom(cube, target=TARGET)
    texts = [
        *_texts(draw_energy_vs_clock(cube, "code")),
        *_texts(pareto := draw_pareto(cube, result, TARGET, "code")),
    ]
    assert not [t for t in texts if "stock" in t and "not swept" not in t], texts
    assert "700 W power limit (top of the grid)" in texts
    assert f"target: {result.attrs['target']}" in pareto.get_suptitle()
    cube.attrs.update(stock_power_limit_w=700.0, stock_sm_clock_mhz=2100)  # the clock not swept
    texts = _texts(draw_energy_vs_clock(cube, "code"))
    assert "700 W power limit (stock)" in texts


def _partial_cube() -> xr.Dataset:
    """eagle3's reference cell on code not measured yet, and a drafter not run at all."""
    cube = small_cube([1], corpora=("code",))
    cube = xr.concat(
        [cube, cube.sel(drafter=["eagle3"]).assign_coords(drafter=["dflash"])], dim="drafter"
    )
    unmeasured = {"drafter": "dflash"}
    stock = {"drafter": "eagle3", "sm_clock": 1980, "power_limit": 700.0}
    for at in (unmeasured, stock):
        for name in ("energy_per_token_j", "tpot_ms", "itl_ms", "ttft_ms"):
            cube[name].loc[at] = np.nan
        cube["cell_status"].loc[at] = 0
        cube["valid"].loc[at] = np.nan
    return cube


def test_a_partial_cube_says_what_is_not_measured() -> None:
    """The headroom map gives the table's reason for a missing reference, and the Pareto
    legend names only drafters with points."""
    from dvfs.plots import draw_headroom, draw_pareto

    cube = _partial_cube()
    result = headroom(cube, target=TARGET)
    cells = [" ".join(t.get_text().split()) for ax in draw_headroom(result).axes for t in ax.texts]
    assert "no valid reference cell (not measured yet)" in cells, cells
    fig = draw_pareto(cube, result, TARGET, "code")
    labels = [t.get_text() for legend in _legends(fig) for t in legend.get_texts()]
    assert "none" in labels and "eagle3" in labels and "dflash" not in labels


def test_the_batch_legend_names_only_drafters_drawn() -> None:
    """A drafter with no valid cell at the reference (not run yet, or every one invalid, as
    when another tenant shared the GPU) has no line in the batch figure: nor a legend entry."""
    from dvfs.plots import draw_energy_vs_batch

    cube = small_cube([1, 8], corpora=("code",))
    cube = xr.concat(
        [cube, cube.sel(drafter=["eagle3"]).assign_coords(drafter=["dflash"])], dim="drafter"
    )
    cube["valid"].loc[{"drafter": "dflash"}] = 0.0  # measured, every cell invalid
    fig = draw_energy_vs_batch(cube)
    assert fig is not None
    labels = [t.get_text() for legend in _legends(fig) for t in legend.get_texts()]
    assert labels == ["none", "eagle3"], labels


def _legends(fig) -> list:
    return [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]


def _split_cube(cube: xr.Dataset | None = None) -> xr.Dataset:
    """`cube` (default: the partial cube: dflash not run) with the twin's exact split: eagle3
    drafts 20% of its energy, verification 70%, overhead the rest; prefill 0 J (a fixed
    batch's window holds none)."""
    cube = _partial_cube() if cube is None else cube.copy(deep=True)
    tokens = 100.0
    energy = cube["energy_per_token_j"] * tokens
    cube["window_tokens"] = xr.full_like(energy, tokens).where(energy.notnull())
    cube["energy_j"] = energy
    cube["decode_time_s"] = xr.full_like(energy, 1.0).where(energy.notnull())
    draft = xr.where(cube["drafter"] == "none", 0.0, 0.2)
    cube["energy_prefill_j"] = energy * 0.0
    cube["energy_draft_j"] = energy * draft
    cube["energy_verify_j"] = energy * 0.7
    cube["energy_overhead_j"] = energy * (0.3 - draft)
    cube["energy_split_method"] = xr.where(energy.notnull(), 1, 0).astype(np.int8)
    return cube


def _bar_tops(ax) -> dict[float, float]:
    """The top of each bar stack in a panel, by x position."""
    tops: dict[float, float] = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2, 6)
        tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    return tops


def test_the_energy_split_is_drawn_per_corpus_never_averaged_over_them() -> None:
    cube = _split_cube()
    cube = xr.concat([cube, cube.assign_coords(corpus=["math"]) * 1.0], dim="corpus")
    cube["energy_j"].loc[{"corpus": "math"}] *= 3.0  # math costs 3x code
    for part in ("prefill", "draft", "verify", "overhead"):
        cube[f"energy_{part}_j"].loc[{"corpus": "math"}] *= 3.0
    # one figure drawn again per corpus (its panels reused): read each as it comes
    tops: dict[str, float] = {}
    for name, fig in figures(cube, TARGET):
        assert name != "energy_split"
        if name.startswith("energy_split_"):
            corpus = name.removeprefix("energy_split_")
            assert f"corpus {corpus}" in fig.get_suptitle()
            panel = next(ax for ax in fig.axes if ax.get_title() == "batch 1")
            tops[corpus] = _bar_tops(panel)[0.0]
    assert set(tops) == {"code", "math"}
    for corpus, top in tops.items():
        at = {"sm_clock": 1980, "power_limit": 700.0, "batch": 1, "corpus": corpus}
        per_token = cube["energy_j"] / cube["window_tokens"]
        want = per_token.sel({**at, "drafter": "none"}).mean("repeat")
        assert top == pytest.approx(float(want))


def test_reused_split_panels_draw_the_same_figure_as_fresh_ones() -> None:
    """The split's panels drawn into for a corpus of taller bars, then emptied and drawn into
    for one of lower bars, are scaled to the lower bars as new panels are."""
    from dvfs.analysis.split import where_energy_goes
    from dvfs.plots import draw_energy_split
    from dvfs.plots.split import split_panels

    cube = _split_cube()
    cube = xr.concat([cube, cube.assign_coords(corpus=["math"]) * 1.0], dim="corpus")
    for name in (
        "energy_j",
        *(f"energy_{p}_j" for p in ("prefill", "draft", "verify", "overhead")),
    ):
        cube[name].loc[{"corpus": "math"}] *= 3.0  # math's bars 3x code's
    split = where_energy_goes(cube)
    panels = split_panels(split)
    draw_energy_split(cube, "math", split, panels)
    reused = draw_energy_split(cube, "code", split, panels)
    fresh = draw_energy_split(cube, "code", split)
    assert reused is not None and fresh is not None
    pairs = [(a, b) for a, b in zip(reused.axes, fresh.axes, strict=True) if a.patches]
    assert pairs
    for a, b in pairs:
        assert _bar_tops(a) == _bar_tops(b)
        assert a.get_ylim() == b.get_ylim() and a.get_xlim() == b.get_xlim()


def test_the_energy_split_says_not_measured_and_leaves_out_parts_of_0_joules() -> None:
    from dvfs.plots import draw_energy_split

    fig = draw_energy_split(_split_cube(), "code")
    panel = next(ax for ax in fig.axes if ax.get_title() == "batch 1")
    # eagle3's reference cell is not measured yet, dflash not run at all: no bar of 0 J there
    assert [t.get_text().strip() for t in panel.texts] == ["not measured"] * 2
    assert [t.get_position()[0] for t in panel.texts] == [1, 2]
    assert list(_bar_tops(panel)) == [0.0]
    labels = [t.get_text() for legend in _legends(fig) for t in legend.get_texts()]
    assert labels and not any("prefill" in label for label in labels)


def test_the_energy_split_says_failed_where_the_table_says_failed() -> None:
    """eagle3's reference cell failed (its server crashed there): the split said "not
    measured" beside the headroom map's and table's "no valid reference cell (failed)", as
    if a resume had it still to do; it says failed, and a cell not run yet still says not
    measured."""
    from dvfs.plots import draw_energy_split, draw_headroom

    cube = _split_cube()
    cube["cell_status"].loc[{"drafter": "eagle3", "sm_clock": 1980, "power_limit": 700.0}] = 2
    panel = next(ax for ax in draw_energy_split(cube, "code").axes if ax.get_title() == "batch 1")
    said = [(t.get_text().strip(), t.get_position()[0]) for t in panel.texts]
    assert said == [("failed", 1), ("not measured", 2)]
    cells = [
        " ".join(t.get_text().split())
        for t in draw_headroom(headroom(cube, target=TARGET)).axes[0].texts
    ]
    assert "no valid reference cell (failed)" in cells, cells


def test_the_energy_split_leaves_out_a_reference_with_an_invalid_repeat() -> None:
    """Headroom takes no reference with an invalid repeat and one usable repeat (of two); the
    split does not average that repeat either, and says why there is no bar."""
    from dvfs.analysis.split import where_energy_goes
    from dvfs.plots import draw_energy_split

    cube = _split_cube(small_cube([1], corpora=("code",), repeats=2))
    cube = _one_bad_repeat(cube, sm_clock=1980, power_limit=700.0, drafter="eagle3")
    split = where_energy_goes(cube).sel(batch=1, corpus="code")
    assert np.isnan(split["energy_per_token_verify_j"].sel(drafter="eagle3"))
    assert int(split["split_method"].sel(drafter="eagle3")) == 0
    assert np.isfinite(split["energy_per_token_verify_j"].sel(drafter="none"))
    panel = next(ax for ax in draw_energy_split(cube, "code").axes if ax.get_title() == "batch 1")
    assert list(_bar_tops(panel)) == [0.0]
    assert [(t.get_text().strip(), t.get_position()[0]) for t in panel.texts] == [("invalid", 1)]


def test_acceptance_leaves_out_a_setting_with_an_invalid_repeat() -> None:
    """The valid repeat of a setting with an invalid one is not averaged in (headroom's rule)."""
    from dvfs.plots import draw_acceptance

    cube = small_cube([1], corpora=("code",), repeats=2)
    cube["accept_length"].loc[{"sm_clock": 1500, "drafter": "eagle3", "repeat": 1}] = 9.0
    cube = _one_bad_repeat(cube, sm_clock=1500)
    fig = draw_acceptance(cube)
    values = np.ma.filled(fig.axes[0].images[0].get_array(), np.nan)
    assert values.tolist() == [[3.0]]  # eagle3 on code; none has no accept length


def test_acceptance_keeps_the_row_of_a_drafter_that_failed_everywhere() -> None:
    """dflash failed every cell (its server never came up): its row was dropped from the
    acceptance map as none's is (measured, but nothing speculated), so the map read as if
    no dflash had been asked for, where the headroom map names each of its cells "failed".
    Its row stays, each cell "-" as any cell without a value; none's is still left out."""
    from dvfs.plots import draw_acceptance

    cube = small_cube([1], corpora=("code", "math"))
    cube = xr.concat(
        [cube, cube.sel(drafter=["eagle3"]).assign_coords(drafter=["dflash"])], dim="drafter"
    )
    failed = cube["drafter"] == "dflash"
    for name in ("energy_per_token_j", "tpot_ms", "itl_ms", "ttft_ms", "accept_length"):
        cube[name] = cube[name].where(~failed)
    cube["cell_status"] = cube["cell_status"].where(~failed, 2)
    cube["valid"] = cube["valid"].where(~failed)
    ax = draw_acceptance(cube).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["eagle3", "dflash"]
    assert [t.get_text() for t in ax.texts] == ["3.00", "3.00", "-", "-"]


def _with_dflash_as_eagle3() -> xr.Dataset:
    """A one-batch cube (code, math) of none and eagle3, and dflash measured as eagle3, its
    campaign naming each drafter's algorithm."""
    cube = small_cube([1], corpora=("code", "math"))
    cube = xr.concat(
        [cube, cube.sel(drafter=["eagle3"]).assign_coords(drafter=["dflash"])], dim="drafter"
    )
    cube.attrs["campaign"] = json.dumps(
        {
            "drafters": [
                {"name": "none", "algorithm": None},
                {"name": "eagle3", "algorithm": "EAGLE3"},
                {"name": "dflash", "algorithm": "DFLASH"},
            ]
        }
    )
    return cube


def test_acceptance_has_no_row_for_none_whether_measured_or_failed() -> None:
    """none speculates not, so the acceptance map has no row of it when it is measured; when
    every none cell failed (its server never came up) the map grew a row "none" of "-" beside
    the drafters that speculate, as if none had an accept length to measure. A drafter its
    campaign runs without speculation has no row either way; a failed speculative drafter
    keeps its row."""
    from dvfs.plots import draw_acceptance

    cube = _with_dflash_as_eagle3()
    failed = cube["drafter"].isin(["none", "dflash"])
    for name in ("energy_per_token_j", "tpot_ms", "itl_ms", "ttft_ms", "accept_length"):
        cube[name] = cube[name].where(~failed)
    cube["cell_status"] = cube["cell_status"].where(~failed, 2)
    cube["valid"] = cube["valid"].where(~failed)
    ax = draw_acceptance(cube).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["eagle3", "dflash"]
    assert [t.get_text() for t in ax.texts] == ["3.00", "3.00", "-", "-"]


def test_acceptance_keeps_the_row_of_a_drafter_whose_cells_record_no_accept_length() -> None:
    """dflash, run speculating by its campaign, measured with valid cells that record no
    accept length (a server that reported no speculation counters): its row vanished from the
    map, as if never asked for. It keeps a row of "-", as `dvfs compare`'s table does."""
    from dvfs.plots import draw_acceptance

    cube = _with_dflash_as_eagle3()
    cube["accept_length"] = cube["accept_length"].where(cube["drafter"] != "dflash")
    ax = draw_acceptance(cube).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["eagle3", "dflash"]
    assert [t.get_text() for t in ax.texts] == ["3.00", "3.00", "-", "-"]


def test_compare_gives_the_accept_length_the_acceptance_figure_draws(tmp_path: Path) -> None:
    """`dvfs compare`'s acceptance table (and the report's sentence read off it) averaged the
    valid repeat of a setting with an invalid one, which the acceptance figure beside it
    leaves out (headroom's rule): 7.80 tokens per verify in the table against 3.00 drawn."""
    from click.testing import CliRunner
    from cubes import as_twin_sweep

    from dvfs.cli import cli
    from dvfs.cube import write_cube
    from dvfs.plots import draw_acceptance

    cube = small_cube([1], corpora=("code",), repeats=2)
    cube["accept_length"].loc[{"sm_clock": 1500, "drafter": "eagle3", "repeat": 1}] = 27.0
    cube = _one_bad_repeat(cube, sm_clock=1500)
    drawn = np.ma.filled(draw_acceptance(cube).axes[0].images[0].get_array(), np.nan)
    assert drawn.tolist() == [[3.0]]  # eagle3 on code
    timelines = ["timeline_t_s", "timeline_power_w", "timeline_sm_clock_mhz"]  # not read here
    path = write_cube(
        as_twin_sweep(
            cube.drop_vars(timelines), uuid="GPU-0", gpu_name="test GPU", campaign="accept"
        ),
        tmp_path / "cube.nc",
    )
    result = CliRunner().invoke(cli, ["compare", str(path), "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)["acceptance"]
    assert (row["drafter"], row["corpus"]) == ("eagle3", "code")
    assert row["accept_length"] == pytest.approx(drawn[0, 0])


def test_the_headroom_map_names_a_power_limit_as_the_table_does() -> None:
    """A campaign may sweep a limit of 250.5 W: the table, the report and `dvfs cap plan` say
    250.5 W, where the headroom map's cell said 250 W (and 350.7 W would have read 351 W, a
    cap above the one chosen)."""
    from dvfs.analysis.targets import Target
    from dvfs.plots import draw_headroom
    from dvfs.report.headroom import headroom_document, headroom_table_rows

    for limit in (250.5, 350.7):
        cube = make_cube(
            clocks=[1005, 1980],
            limits=[700.0, limit],
            energy=lambda c, p, *_: 1.0 if p == 700.0 else 0.8,  # the cap saves 20%
            latency=lambda c, *_: 10.0 if c == 1980 else 30.0,  # 1005 MHz is too slow
        )
        result = headroom(cube, target=Target("preserve", slack=0.05))
        _, rows = headroom_table_rows(headroom_document(result, cube))
        assert rows[0][3] == f"1980/{limit:g}", rows  # the chosen setting in the table
        texts = [t.get_text() for ax in draw_headroom(result).axes for t in ax.texts]
        assert texts == [f"20%\n1980 MHz\n{limit:g} W"], texts


def test_the_headroom_maps_key_names_only_what_a_cell_shows() -> None:
    """The key listed "power limit capped below 700 W" and "no answer" on every map, where no
    cell was outlined or grey too: a reader looks for the cap the key promises."""
    from dvfs.analysis.targets import Target, parse_slo
    from dvfs.plots import draw_headroom

    def key(cap_saves: bool, target: Target) -> list[str]:
        cube = make_cube(
            clocks=[1005, 1980],
            limits=[400.0, 700.0],
            energy=lambda c, p, *_: 0.8 if cap_saves and p == 400.0 else 1.0,
            latency=lambda c, *_: 10.0 if c == 1980 else 30.0,  # 1005 MHz is too slow
        )
        fig = draw_headroom(headroom(cube, target=target))
        return [t.get_text() for legend in _legends(fig) for t in legend.get_texts()]

    preserve = Target("preserve", slack=0.05)
    assert key(cap_saves=True, target=preserve) == ["power limit capped below 700 W"]
    assert key(cap_saves=False, target=preserve) == []  # stock chosen: nothing outlined
    assert key(cap_saves=False, target=parse_slo("tpot_p50<=1ms")) == [
        "no answer (the cell says why)"
    ]


def test_the_chosen_star_sits_on_the_point_drawn_for_its_setting() -> None:
    """Stock's third repeat flagged (its other two still the reference): headroom's chosen
    energy is over the two repeats paired with it, the point drawn for 1500 MHz over all three
    (the third spends 30% more). The Pareto star sat at the paired 1.06 J, 9% below the 1.17 J
    point drawn, a point of its own below the front; on the power-limit figures alike. It sits
    on the drawn point, as the stock diamond does."""
    from dvfs.analysis.targets import Target
    from dvfs.plots import draw_energy_vs_power_limit, draw_latency_vs_power_limit, draw_pareto

    extra = {0: 1.0, 1: 1.0, 2: 1.3}
    target = Target("preserve", slack=0.4)
    cube = make_cube(
        clocks=[1000, 1500, 2000],
        repeats=3,
        latency=lambda c, *_: 10 * 2000 / c,
        energy=lambda c, p, b, d, k, r: (0.5 + (c / 2000) ** 2) * extra[r],
        valid=lambda c, p, b, d, k, r: not (c == 2000 and r == 2),
    )
    chosen = headroom(cube, target=target)
    row = chosen.isel(batch=0, drafter=0, corpus=0)
    assert float(row["chosen_sm_clock"]) == 1500
    assert float(row["chosen_energy_per_token_j"]) == pytest.approx(1.0625)  # repeats 0, 1

    def marks(fig: Figure) -> dict[str, list[list[float]]]:
        return {
            str(c.get_gid()): np.asarray(c.get_offsets()).tolist()
            for c in fig.axes[0].collections
            if c.get_gid() in ("chosen", "stock")
        }

    drawn = marks(draw_pareto(cube, chosen, target, "code"))
    assert drawn["chosen"] == [[pytest.approx(2000 * 10 / 1500), pytest.approx(1.16875)]]
    assert drawn["stock"] == [[10.0, 1.5]]
    # one clock and three power limits: the limit figures star the chosen limit on its point
    capped = {700.0: 1.0, 500.0: 1.0, 300.0: 1.2}
    limits = make_cube(
        clocks=[1980],
        limits=list(capped),
        repeats=3,
        latency=lambda c, p, *_: 10.0 * capped[p],
        energy=lambda c, p, b, d, k, r: (0.6 if p == 500 else 1.0) * extra[r],
        valid=lambda c, p, b, d, k, r: not (p == 700 and r == 2),
    )
    chosen = headroom(limits, target=target)
    assert float(chosen["chosen_power_limit"].squeeze()) == 500
    energy = marks(draw_energy_vs_power_limit(limits, chosen, "code"))
    assert energy["chosen"] == [[500.0, pytest.approx(0.6 * 3.3 / 3)]]
    latency = marks(draw_latency_vs_power_limit(limits, chosen, target, "code"))
    assert latency["chosen"] == [[500.0, pytest.approx(10.0)]]


def test_a_star_apart_from_the_table_says_which_energy_it_shows() -> None:
    """Stock's third repeat flagged (its other two still the reference): the star sits on the
    1.17 J point drawn for 1500 MHz (all three repeats), the headroom table's "J/tok chosen" is
    1.06 J (the two paired with stock), and the saving read off the figure (22%) is not the
    table's (29%). The legend called the star only "dvfs headroom's setting", so a reader
    putting the figure beside the table had two energies for one setting and no word why.
    Where they differ the legend says the star is on its point and what the table's is over;
    where they agree (no flag) it says the setting alone."""
    from dvfs.analysis.targets import Target
    from dvfs.plots import draw_energy_vs_power_limit, draw_latency_vs_power_limit, draw_pareto
    from dvfs.plots.curves import CHOSEN_LABEL

    def chosen_entry(fig: Figure) -> str:
        (label,) = [
            t.get_text()
            for legend in _legends(fig)
            for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)
            if getattr(h, "get_marker", lambda: None)() == "*"
        ]
        return " ".join(label.split())

    apart = (
        f"{CHOSEN_LABEL}, on its point: every usable repeat (the table's: those paired with stock)"
    )
    extra = {0: 1.0, 1: 1.0, 2: 1.3}
    target = Target("preserve", slack=0.4)
    capped = {700.0: 1.0, 500.0: 1.0, 300.0: 1.2}
    for flag, said in ((True, apart), (False, CHOSEN_LABEL)):
        cube = make_cube(
            clocks=[1000, 1500, 2000],
            repeats=3,
            latency=lambda c, *_: 10 * 2000 / c,
            energy=lambda c, p, b, d, k, r: (0.5 + (c / 2000) ** 2) * extra[r],
            valid=lambda c, p, b, d, k, r, flag=flag: not (flag and c == 2000 and r == 2),
        )
        chosen = headroom(cube, target=target)
        assert chosen_entry(draw_pareto(cube, chosen, target, "code")) == said, flag
        limits = make_cube(
            clocks=[1980],
            limits=list(capped),
            repeats=3,
            latency=lambda c, p, *_: 10.0 * capped[p],
            energy=lambda c, p, b, d, k, r: (0.6 if p == 500 else 1.0) * extra[r],
            valid=lambda c, p, b, d, k, r, flag=flag: not (flag and p == 700 and r == 2),
        )
        chosen = headroom(limits, target=target)
        assert chosen_entry(draw_energy_vs_power_limit(limits, chosen, "code")) == said, flag
        # the latency drawn is the table's: its star needs no word
        latency = draw_latency_vs_power_limit(limits, chosen, target, "code")
        assert chosen_entry(latency) == CHOSEN_LABEL, flag


@settings(max_examples=40, deadline=None)
@given(
    energy=st.lists(st.floats(0.5, 2.0), min_size=18, max_size=18),
    latency=st.lists(st.floats(5.0, 15.0), min_size=18, max_size=18),
    valid=st.lists(st.booleans(), min_size=18, max_size=18),
)
def test_every_chosen_star_is_a_point_drawn(
    energy: list[float], latency: list[float], valid: list[bool]
) -> None:
    """Whatever the cells and their flags, each chosen setting's marker on the Pareto figure
    sits on a point drawn for that drafter (its setting's), never apart from every point."""
    from dvfs.analysis.targets import Target
    from dvfs.plots.data import at_chosen, cell_means

    shape = (3, 2, 1, 1, 1, 3)  # clocks, limits, batch, drafter, corpus, repeats
    ok = np.array(valid, dtype=bool).reshape(shape)
    ok[-1, 0, ..., :2] = True  # the reference usable: most rows have an answer
    cube = make_cube(
        clocks=[1000, 1500, 2000],
        limits=[700.0, 300.0],
        repeats=3,
        energy=np.array(energy),
        latency=np.array(latency),
        valid=lambda c, p, b, d, k, r: bool(
            ok[[1000, 1500, 2000].index(c), [700.0, 300.0].index(p), 0, 0, 0, r]
        ),
    )
    target = Target("preserve", slack=0.3)
    picks = headroom(cube, target=target).sel(corpus="code").transpose("batch", "drafter")
    dims = ("batch", "drafter", "power_limit", "sm_clock")
    drawn_e = cell_means(cube, "energy_per_token_j", dims, corpus="code")
    drawn_l = cell_means(cube, "tpot_ms", dims, corpus="code", quantile=0.5)
    args = ([1000, 1500, 2000], [700.0, 300.0])
    star_e = at_chosen(picks, drawn_e, *args, picks["chosen_energy_per_token_j"].values)
    star_l = at_chosen(picks, drawn_l, *args, picks["chosen_latency_ms"].values)
    points = set(zip(drawn_l[0, 0].ravel().tolist(), drawn_e[0, 0].ravel().tolist(), strict=True))
    if bool(picks["feasible"].values[0, 0]):
        assert (float(star_l[0, 0]), float(star_e[0, 0])) in points
    else:
        assert np.isnan(star_e[0, 0]) and np.isnan(star_l[0, 0])


def test_timelines_draw_every_stored_sample_and_end_at_the_last() -> None:
    """The meter stores only samples inside its windows, on an axis of whole window lengths,
    which runs past decode_time_s (the spans between counter updates): every stored sample is
    drawn, none cut at decode_time_s, and no value is held past the last one. NaN is padding."""
    cube = small_cube([1], corpora=("code",))
    t = cube["timeline_t_s"].values.copy()
    power = cube["timeline_power_w"].values.copy()
    t[..., -1] = np.nan  # sample 7 is padding (a cell with fewer samples) ...
    power[..., -1] = np.nan
    power[..., 6] = 123.0  # ... and sample 6 (t = 0.30 s) the last real one, a value of its own
    cube["timeline_t_s"] = cube["timeline_t_s"].copy(data=t)
    cube["timeline_power_w"] = cube["timeline_power_w"].copy(data=power)
    cube["decode_time_s"] = xr.full_like(cube["energy_per_token_j"], 0.12)  # counter spans
    fig = draw_timelines(cube, headroom(cube, target=TARGET))
    power_axes = {ax for ax in fig.axes if ax.get_ylabel() == "GPU power (W)"}
    lines = [line for ax in fig.axes for line in ax.lines if len(line.get_xdata()) > 2]
    assert lines and any(line.axes in power_axes for line in lines)
    for line in lines:
        x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
        assert x.tolist() == pytest.approx(np.arange(7) * 0.05)
        assert not np.isnan(y).any()
        if line.axes in power_axes:
            assert y[-1] == 123.0 and y[-2] != 123.0


def test_the_batch_legend_draws_each_drafter_as_its_lines() -> None:
    from dvfs.plots import draw_energy_vs_batch

    fig = draw_energy_vs_batch(small_cube([1, 8], corpora=("code",)))
    drawn = {str(line.get_color()): line.get_linestyle() for ax in fig.axes for line in ax.lines}
    handles = [h for legend in _legends(fig) for h in legend.legend_handles]
    assert {str(h.get_color()): h.get_linestyle() for h in handles} == drawn
    assert sorted(drawn.values()) == ["-", "--"]


def test_a_panel_with_no_valid_cell_says_so_rather_than_stay_blank() -> None:
    """Every cell of batch 8 and of corpus math invalid (an energy counter that updated too
    rarely, say): their energy-vs-clock, Pareto, timeline and energy-vs-batch panels were
    drawn as empty axes, saying nothing, beside the headroom map that names each cell's
    reason. Each such panel says it has no valid cell; a panel with data says nothing of the
    kind."""
    cube = small_cube([1, 8], corpora=("code", "math"))
    cube["valid"] = cube["valid"].where((cube["batch"] != 8) & (cube["corpus"] != "math"), 0.0)
    said = {  # each panel's notes, by figure and panel title, read before the next figure
        name: {
            ax.get_title(): [t.get_text() for t in ax.texts if "no valid cell" in t.get_text()]
            for ax in fig.axes
            if ax.get_title()
        }
        for name, fig in figures(cube, TARGET)
    }
    empty = {  # the panels with nothing to draw
        "energy_vs_clock_code": {"batch 8"},
        "energy_vs_clock_math": {"batch 1", "batch 8"},
        "pareto_code": {"batch 8"},
        "pareto_math": {"batch 1", "batch 8"},
        "timelines": {"batch 8, corpus code"},
        "energy_vs_batch": {"corpus math"},
    }
    for name, titles in empty.items():
        assert {title for title, notes in said[name].items() if notes} == titles, said[name]


def test_a_drafter_with_valid_cells_beside_invalid_repeats_is_not_said_to_have_none() -> None:
    """eagle3's second repeat flagged at every setting of batch 8 (its first valid): each
    setting is left out whole, as headroom never chooses it, and the panels said "no valid
    cell at any setting: eagle3", where `dvfs cube info` counts its valid cells. They say
    why instead: an invalid repeat at every setting (at the reference, too few valid repeats);
    a drafter with no valid cell is still said to have none."""
    cube = small_cube([1, 8], corpora=("code",), repeats=2)
    cube = xr.concat(
        [cube, cube.sel(drafter=["eagle3"]).assign_coords(drafter=["dflash"])], dim="drafter"
    )
    flagged = (cube["drafter"] == "eagle3") & (cube["batch"] == 8) & (cube["repeat"] == 1)
    cube["valid"] = cube["valid"].where(~flagged, 0.0)
    cube["valid"] = cube["valid"].where(~((cube["drafter"] == "dflash") & (cube["batch"] == 8)), 0)
    notes = {
        name: {
            ax.get_title(): " ".join(" ".join(t.get_text() for t in ax.texts).split())
            for ax in fig.axes
            if ax.get_title().startswith("batch 8")
        }
        for name, fig in figures(cube, TARGET)
        if name in ("energy_vs_clock_code", "pareto_code")
    }
    for name, said in notes.items():
        assert said["batch 8"] == (
            "no valid cell at any setting: dflash an invalid repeat at every setting: eagle3"
        ), (name, said)
    # the batch figure at the reference: eagle3 valid there in one repeat of two everywhere
    cube["valid"] = cube["valid"].where(~((cube["drafter"] == "eagle3") & (cube["repeat"] == 1)), 0)
    from dvfs.plots import draw_energy_vs_batch

    fig = draw_energy_vs_batch(cube)
    assert fig is not None
    said = " ".join(" ".join(t.get_text() for t in fig.axes[0].texts).split())
    assert said == "too few valid repeats at stock: eagle3", said


def test_the_limit_figures_and_a_wholly_flagged_panel_say_an_invalid_repeat_not_no_cell() -> None:
    """The figures against the power limit, and a panel whose every drafter has valid cells
    only beside invalid repeats, said "no valid cell at any power limit" (and "... setting"),
    which `dvfs cube info` contradicts: no test held them. Repeat 1 of batch 8 flagged for
    eagle3 alone, then for every drafter."""
    from dvfs.plots import draw_energy_vs_power_limit, draw_latency_vs_power_limit, draw_pareto

    def said(fig: Figure) -> str:
        (ax,) = [ax for ax in fig.axes if ax.get_title() == "batch 8"]
        return " ".join(" ".join(t.get_text() for t in ax.texts).split())

    for whole, limit_note, pareto_note in (
        (
            False,
            "an invalid repeat at every power limit: eagle3",
            "an invalid repeat at every setting: eagle3",
        ),
        (True, "no power limit without an invalid repeat", "no setting without an invalid repeat"),
    ):
        cube = make_cube(
            clocks=[1980],
            limits=[700.0, 500.0, 300.0],
            batches=[1, 8],
            drafters=["none", "eagle3"],
            repeats=2,
            latency=lambda *_: 10.0,
            energy=lambda c, p, *_: p / 700,
            valid=lambda c, p, b, d, k, r, whole=whole: (
                not (b == 8 and r == 1 and (whole or d == "eagle3"))
            ),
        )
        chosen = headroom(cube, target=TARGET)
        corpus = str(cube["corpus"].values[0])
        assert said(draw_energy_vs_power_limit(cube, chosen, corpus)) == limit_note
        assert said(draw_latency_vs_power_limit(cube, chosen, TARGET, corpus)) == limit_note
        assert said(draw_pareto(cube, chosen, TARGET, corpus)) == pareto_note


def test_a_panel_missing_a_drafter_names_it_rather_than_drop_it_silently() -> None:
    """eagle3 failed every cell at batch 8 and every cell on corpus math (a drafter whose
    server crashed there), none measured everywhere. Its line was left out of those panels
    with nothing said: beside panels of the same figure that draw it under one legend, or in
    a figure whose legend leaves it out (math), it read as a drafter never asked for, where
    the headroom map names each such cell's reason. Each panel missing a drafter the cube
    holds now names it and why; a panel drawing every drafter names none."""
    cube = small_cube([1, 8], corpora=("code", "math"))
    failed = (cube["drafter"] == "eagle3") & ((cube["batch"] == 8) | (cube["corpus"] == "math"))
    for name in ("energy_per_token_j", "tpot_ms", "itl_ms", "ttft_ms", "accept_length"):
        cube[name] = cube[name].where(~failed)
    cube["cell_status"] = cube["cell_status"].where(~failed, 2)
    cube["valid"] = cube["valid"].where(~failed)
    said = {  # each panel's note of drafters not drawn, read before the next figure
        name: {
            ax.get_title(): " ".join(
                " ".join(t.get_text().split()) for t in ax.texts if t.get_gid() == "not-drawn"
            )
            for ax in fig.axes
            if ax.get_title()
        }
        for name, fig in figures(cube, TARGET)
    }
    missing = {  # the panels without an eagle3 line, and what they say of it
        "energy_vs_clock_code": {"batch 8": "no valid cell at any setting: eagle3"},
        "energy_vs_clock_math": {
            "batch 1": "no valid cell at any setting: eagle3",
            "batch 8": "no valid cell at any setting: eagle3",
        },
        "pareto_code": {"batch 8": "no valid cell at any setting: eagle3"},
        "pareto_math": {
            "batch 1": "no valid cell at any setting: eagle3",
            "batch 8": "no valid cell at any setting: eagle3",
        },
        "energy_vs_batch": {"corpus math": "no valid cell at stock: eagle3"},
        "timelines": {"batch 8, corpus code": "no valid cell with a timeline: eagle3"},
    }
    for name, notes in missing.items():
        assert {title: note for title, note in said[name].items() if note} == notes, said[name]


def test_an_observe_only_timeline_says_the_knobs_were_as_found() -> None:
    """Observe-only changes no knob: a clock lock set outside dvfs stays, so the timelines'
    legend says the clock and limit were as found, not "clock unlocked" or a lock dvfs set."""
    cube = small_cube([1], corpora=("code",))
    cube.attrs["actuation"] = 0
    fig = draw_timelines(cube, headroom(cube, target=TARGET))
    labels = {str(line.get_label()) for ax in fig.axes for line in ax.lines}
    drawn = [label for label in labels if ", stock:" in label]
    assert drawn and all(label.endswith("as found (observe-only)") for label in drawn), labels
    assert not [label for label in labels if "unlocked" in label or "clock lock" in label]


def test_the_headroom_map_wraps_a_flag_name_after_its_underscores_not_inside_a_word() -> None:
    """An invalid reference cell names its flag in the map's cell, as the table does; wrapped
    to fit, the name breaks after an underscore ("foreign_" / "process"), never mid-word."""
    import re

    from dvfs.measure.meter import Q_FOREIGN_PROCESS
    from dvfs.plots import draw_headroom

    cube = small_cube([1], corpora=("code",))
    cube["quality"] = xr.zeros_like(cube["energy_per_token_j"])
    at = {"drafter": "eagle3", "sm_clock": 1980, "power_limit": 700.0}
    cube["quality"].loc[at] = Q_FOREIGN_PROCESS
    cube["valid"].loc[at] = 0.0
    fig = draw_headroom(headroom(cube, target=TARGET))
    [label] = [t.get_text() for ax in fig.axes for t in ax.texts if "reference" in t.get_text()]
    said = "no valid reference cell (invalid: foreign_process)"
    # joined again: a break after "_" takes nothing away, any other one took a space
    assert re.sub(r"_\n", "_", label).replace("\n", " ") == said, label


def test_the_reports_split_caption_names_the_parts_the_figure_draws(
    small_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fixed batch's windows hold no prefill: the energy-split figure leaves that part out
    of its bars and key, yet the report's caption read "prefill, drafting, verification and
    overhead per token". The caption names the parts the figure draws."""
    from click.testing import CliRunner
    from conftest import figures_drawn_only, unsaved_figure

    from dvfs.analysis.split import where_energy_goes
    from dvfs.cli import cli
    from dvfs.cube import open_cube
    from dvfs.plots.split import PART_LABELS

    legends: dict[str, list[str]] = {}

    def note(fig: Figure, out_dir: Path, name: str, fmt: str) -> Path:
        if fig is not None and name.startswith("energy_split_"):
            legends[name] = [t.get_text() for legend in _legends(fig) for t in legend.get_texts()]
        return unsaved_figure(fig, out_dir, name, fmt)

    monkeypatch.setattr(dvfs.plots, "save", note)
    figures_drawn_only(monkeypatch, "draw_energy_split")
    out = tmp_path / "r.md"
    result = CliRunner().invoke(cli, ["report", str(small_sweep), "-o", str(out)])
    assert result.exit_code == 0, result.output
    split = where_energy_goes(open_cube(small_sweep / "cube.nc"))
    assert not float(split["energy_per_token_prefill_j"].max())  # no prefill in the windows
    captions = [
        line.strip("*")
        for line in out.read_text().splitlines()
        if line.startswith("*Where the energy goes")
    ]
    assert legends and len(captions) == len(legends)
    for caption in captions:
        assert "prefill" not in caption, caption
        assert "drafting, verification and overhead per token, corpus " in caption, caption
    for drawn in legends.values():
        assert PART_LABELS["prefill"] not in drawn and PART_LABELS["draft"] in drawn


def test_the_timelines_draw_every_drafter_asked_for_and_name_those_left_out(
    shared_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timelines drew the first two drafters of the cube the report was cut to, whatever
    `dvfs report --drafter` asked for: `--drafter none --drafter eagle3 --drafter ngram` had
    no ngram timeline, nothing said. They draw each drafter asked for; with none asked (`dvfs
    plot`, a plain report) the first two, the title naming the others."""
    from click.testing import CliRunner
    from conftest import SMALL_EXACT, figures_drawn_only, replace_block, unsaved_figure

    from dvfs.cli import cli

    text = replace_block(SMALL_EXACT, "sm_clock = [1980, 1500, 1005]", "sm_clock = [1980, 1005]")
    text = replace_block(text, 'corpora = ["code", "conversation"]', 'corpora = ["code"]')
    ngram = '[drafters.ngram]\nalgorithm = "NGRAM"\nnum_draft_tokens = 4\n\n'
    text = replace_block(text, "[workload]", ngram + "[workload]")
    run = shared_run(text, "three-drafters")
    drawn: dict[str, tuple[str, list[str]]] = {}

    def note(fig: Figure, out_dir: Path, name: str, fmt: str) -> Path:
        if fig is not None and name == "timelines":
            labels = [t.get_text() for legend in _legends(fig) for t in legend.get_texts()]
            drawn[out_dir.name] = (fig.get_suptitle(), labels)
        return unsaved_figure(fig, out_dir, name, fmt)

    monkeypatch.setattr(dvfs.plots, "save", note)
    figures_drawn_only(monkeypatch, "draw_timelines")

    def timelines(*args: str) -> tuple[str, set[str]]:
        drawn.clear()
        result = CliRunner().invoke(cli, list(args))
        assert result.exit_code == 0, result.output
        ((title, labels),) = drawn.values()
        return title, {label.split(", ")[0] for label in labels if ": " in label}

    asked = ("--drafter", "none", "--drafter", "eagle3", "--drafter", "ngram")
    title, names = timelines("report", str(run), *asked, "-o", str(tmp_path / "r.md"))
    assert names == {"none", "eagle3", "ngram"} and "not drawn" not in title
    title, names = timelines("report", str(run), "--drafter", "ngram", "-o", str(tmp_path / "n.md"))
    assert names == {"ngram"}  # the baseline the report keeps beside it is not asked for
    title, names = timelines("plot", str(run), "--out", str(tmp_path / "plots"))
    assert names == {"none", "eagle3"}
    assert "not drawn: ngram" in title, title


@pytest.mark.parametrize("failed", [("none",), ("none", "eagle3")], ids=["one", "two"])
def test_the_timelines_draw_the_first_drafters_with_valid_cells(failed: tuple[str, ...]) -> None:
    """Every none cell failed (its server never came up): with no drafter asked for, the
    timelines drew "the cube's first 2", none and eagle3, so one line (eagle3's) a panel and
    dflash, measured, left out. They draw the first two drafters with a valid cell, the title
    naming those without one; where fewer than two have any, it says so."""
    cube = small_cube([1], corpora=("code",))
    cube = xr.concat(
        [cube, cube.sel(drafter=["eagle3"]).assign_coords(drafter=["dflash"])], dim="drafter"
    )
    gone = cube["drafter"].isin(list(failed))
    for name in ("energy_per_token_j", "tpot_ms", "itl_ms", "ttft_ms", "accept_length"):
        cube[name] = cube[name].where(~gone)
    cube["cell_status"] = cube["cell_status"].where(~gone, 2)
    cube["valid"] = cube["valid"].where(~gone)
    fig = draw_timelines(cube, headroom(cube, target=TARGET))
    assert fig is not None
    drawn = {str(line.get_label()).split(", ")[0] for ax in fig.axes for line in ax.lines}
    labelled = {name for name in drawn if not name.startswith("_")}
    title = fig.get_suptitle()
    if len(failed) == 1:
        assert labelled == {"eagle3", "dflash"}, labelled
        said = "drafters eagle3, dflash (the cube's first 2 with valid cells; no valid cell: none)"
    else:
        assert labelled == {"dflash"}, labelled
        said = "drafters dflash (the only one with valid cells; no valid cell: none, eagle3)"
    assert title.endswith(said), title
    assert not [t.get_text() for ax in fig.axes for t in ax.texts], "no panel lacks a line"


def test_the_timelines_end_at_the_decode_not_at_the_sample_after_it(small_sweep: Path) -> None:
    """A fixed batch's round ends at its window's close, where the sampler's last reading of
    it falls (on the twin's virtual clock), reading the GPU after the last decode step: idle
    (115 W after 240 W of decode), its idle clock, GpuIdle. The meter kept it and each such
    timeline ended in a plunge that no energy counts. The meter keeps it out of the timeline
    and the reasons now; a cube an older dvfs made still holds it, and the line stops at the
    decode's last sample there; every other stored sample is drawn."""
    from dvfs.analysis.headroom import reference_setting
    from dvfs.cube import open_cube
    from dvfs.gpu.base import EVENT_GPU_IDLE
    from dvfs.plots.timelines import first_valid_repeat

    cube = open_cube(small_sweep / "cube.nc").load()
    # a steady decode (no drafter: one kind of pass) holds its power to the last point
    steady = cube["timeline_power_w"].sel(drafter="none")
    low = int((steady < 0.8 * steady.median("sample")).sum())
    assert low == 0, f"{low} points of steady decodes below 80% of their median power"
    reasons = cube["clock_event_reasons"].values
    assert not (reasons[~np.isnan(reasons)].astype(int) & EVENT_GPU_IDLE).any()
    ref = reference_setting(cube)
    old = cube.copy(deep=True)  # the closing reading as an older dvfs stored it: the last point
    at_ref = {"sm_clock": ref.sm_clock, "power_limit": ref.power_limit}
    for at in (dict(zip(("batch", "corpus", "drafter"), key, strict=True)) for key in _cells(old)):
        for repeat in old["repeat"].values:
            where = {**at_ref, **at, "repeat": repeat}
            t = old["timeline_t_s"].loc[where].values
            if np.isnan(t).all():
                continue
            last = np.flatnonzero(~np.isnan(t))[-1]
            closing = float(old["gpu_time_window_s"].loc[where])
            mean = float(old["power_mean_w"].loc[where])
            old["timeline_t_s"].loc[{**where, "sample": last}] = closing
            old["timeline_power_w"].loc[{**where, "sample": last}] = 0.4 * mean
    for made, stored in ((cube, cube), (old, old)):
        fig = draw_timelines(made, headroom(made, target=TARGET))
        assert fig is not None
        drawn = 0
        for ax in fig.axes:
            if ax.get_ylabel() != "GPU power (W)":
                continue
            batch, corpus = ax.get_title().removeprefix("batch ").split(", corpus ")
            for line in ax.lines:
                label = str(line.get_label())
                if ", stock: " not in label:
                    continue
                at = {"batch": int(batch), "corpus": corpus, "drafter": label.split(", ")[0]}
                cell = first_valid_repeat(stored.sel({**at, **at_ref}))
                assert cell is not None
                t = cell["timeline_t_s"].values
                keep = ~np.isnan(t)
                t, power = t[keep], cell["timeline_power_w"].values[keep]
                x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
                if made is old:  # its last point, the closing reading, left out
                    assert x.tolist() == t[:-1].tolist() and y.tolist() == power[:-1].tolist()
                else:  # no closing reading stored: every point drawn
                    assert x.tolist() == t.tolist() and y.tolist() == power.tolist()
                assert y[-1] > 0.7 * float(cell["power_mean_w"])  # the line ends decoding
                drawn += 1
        assert drawn


def _cells(cube: xr.Dataset) -> list[tuple[int, str, str]]:
    """Every (batch, corpus, drafter) of a cube."""
    return [
        (int(b), str(c), str(d))
        for b in cube["batch"].values
        for c in cube["corpus"].values
        for d in cube["drafter"].values
    ]
