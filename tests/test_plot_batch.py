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


def test_one_batch_size_draws_no_batch_figure() -> None:
    one = make_cube(clocks=[1980], batches=[8], drafters=["none"], energy=lambda *a: 1.0)
    assert draw_energy_vs_batch(one) is None
    names = [name for name, _ in figures(one, Target("preserve", slack=0.05))]
    assert "energy_vs_batch" not in names
    names = [name for name, _ in figures(_cube(), Target("preserve", slack=0.05))]
    assert "energy_vs_batch" in names
