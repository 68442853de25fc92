"""The energy-vs-batch figure draws each drafter's energy per token at the stock setting, one
panel per corpus, and is left out for a cube of one batch size."""

from __future__ import annotations

import numpy as np
from cubes import make_cube

from dvfs.analysis.targets import Target
from dvfs.plots import figures
from dvfs.plots.batch import draw_energy_vs_batch

BATCHES = [1, 4, 16, 64]


def _energy(clock, limit, batch, drafter, corpus, repeat) -> float:
    spec = 0.5 + 0.008 * batch if drafter == "eagle3" else 1.0  # saving shrinks with batch
    scale = 2.0 if corpus == "math" else 1.0
    return scale * spec * (clock / 1980) * (limit / 700) / batch**0.8


def _cube():
    cube = make_cube(
        clocks=[1005, 1980],
        limits=[300.0, 700.0],
        batches=BATCHES,
        drafters=["none", "eagle3"],
        corpora=["code", "math"],
        energy=_energy,
    )
    cube.attrs["stock_sm_clock_mhz"] = 1980
    cube.attrs["stock_power_limit_w"] = 700.0
    return cube


def test_each_line_is_a_drafters_stock_energy_against_batch() -> None:
    fig = draw_energy_vs_batch(_cube())
    assert fig is not None
    panels = [ax for ax in fig.axes if ax.get_gid() == "panel"]
    assert [ax.get_title() for ax in panels] == ["corpus code", "corpus math"]
    for ax, corpus in zip(panels, ["code", "math"], strict=True):
        lines = ax.get_lines()
        assert len(lines) == 2
        for line, drafter in zip(lines, ["none", "eagle3"], strict=True):
            np.testing.assert_array_equal(line.get_xdata(), BATCHES)
            want = [_energy(1980, 700.0, b, drafter, corpus, 0) for b in BATCHES]
            np.testing.assert_allclose(line.get_ydata(), want, rtol=1e-12)
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"


def test_lines_run_in_ascending_batch_whatever_the_campaigns_order() -> None:
    """A campaign may list its batches in any order and the cube keeps it: each line still
    joins its points from the smallest batch to the largest, each point its batch's energy."""
    cube = _cube().isel(batch=[2, 0, 3, 1])  # batch axis 16, 1, 64, 4
    fig = draw_energy_vs_batch(cube)
    assert fig is not None
    panel = next(ax for ax in fig.axes if ax.get_gid() == "panel")
    for line, drafter in zip(panel.get_lines(), ["none", "eagle3"], strict=True):
        np.testing.assert_array_equal(line.get_xdata(), sorted(BATCHES))
        want = [_energy(1980, 700.0, b, drafter, "code", 0) for b in sorted(BATCHES)]
        np.testing.assert_allclose(line.get_ydata(), want, rtol=1e-12)


def test_one_batch_size_draws_no_batch_figure() -> None:
    one = make_cube(clocks=[1980], batches=[8], drafters=["none"], energy=lambda *a: 1.0)
    assert draw_energy_vs_batch(one) is None
    names = [name for name, _ in figures(one, Target("preserve", slack=0.05))]
    assert "energy_vs_batch" not in names
    names = [name for name, _ in figures(_cube(), Target("preserve", slack=0.05))]
    assert "energy_vs_batch" in names


def test_twelve_drafters_get_twelve_colours_in_every_figure(tmp_path, monkeypatch) -> None:
    """The palette has ten colours and drafter 11 took drafter 1's (12, 2's): `dvfs plot` drew
    two drafters alike in every figure with a line per drafter. Each drafter keeps its own
    colour past ten, the first ten still the palette's."""
    from click.testing import CliRunner
    from cubes import as_twin_sweep
    from matplotlib.colors import to_hex

    import dvfs.plots
    from dvfs.cli import cli
    from dvfs.cube import write_cube
    from dvfs.plots.style import palette

    drafters = ["none", *(f"draft{i:02d}" for i in range(1, 12))]
    cube = make_cube(
        clocks=[1005, 1980],
        batches=[1, 8],
        drafters=drafters,
        energy=lambda c, p, b, d, k, r: (1 + drafters.index(d) / 10) * c / 1980 / b,
    )
    path = write_cube(
        as_twin_sweep(cube, uuid="GPU-0", gpu_name="NVIDIA H100", campaign="many"),
        tmp_path / "cube.nc",
    )
    drawn: dict[str, dict[str, str]] = {}
    save = dvfs.plots.save

    def keep(fig, out_dir, name, fmt):
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
        drawn[name] = {
            h.get_label(): to_hex(h.get_color())
            for legend in legends
            for h in legend.legend_handles
            if h.get_label() in drafters
        }
        return save(fig, out_dir, name, fmt)

    monkeypatch.setattr(dvfs.plots, "save", keep)
    result = CliRunner().invoke(cli, ["plot", str(path), "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    for name in ("energy_vs_batch", "energy_vs_clock_code", "pareto_code"):
        colours = drawn[name]
        assert set(colours) == set(drafters), name
        assert len(set(colours.values())) == len(drafters), (name, colours)
        assert [colours[d] for d in drafters[:10]] == list(palette()), name
