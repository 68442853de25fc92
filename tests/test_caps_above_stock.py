"""A cap only lowers a knob from stock: a chosen setting with a knob ABOVE stock (a grid that
swept power limits above the GPU's default) cannot be held by caps, so `dvfs cap plan` plans
that row at stock on both knobs and says so, end to end through the CLI. On the old code it
capped the clock and left the limit at stock, below the chosen one: 1500 MHz / 600 W, a
setting that missed the target (17.2 ms against 10.5 ms) where 1500 MHz / 700 W met it."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import xarray as xr
from click.testing import CliRunner, Result
from cubes import as_twin_sweep, make_cube

from dvfs.cli import cli
from dvfs.cube import write_cube

UUID = "GPU-aaaaaaaa-0000-4000-8000-000000000001"
ABOVE = "batch 1, corpus code chose 1500 MHz / 700 W, but the power limit is above stock (600 W)"


def run(*args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def latency(clock: int, limit: float, batch: int, *_: object) -> float:
    """Stock is 1980 MHz / 600 W (10 ms). At batch 1, 1500 MHz meets the target only at the
    700 W limit above stock; at batch 8 it does at stock's 600 W as well."""
    if clock == 1000:
        return 20.0
    if clock == 1500:
        return 10.4 if limit >= (700.0 if batch == 1 else 600.0) else 17.2
    return 10.0 if limit >= 600.0 else 17.0


def above_stock_ds() -> xr.Dataset:
    return make_cube(
        clocks=[1000, 1500, 1980],
        limits=[400.0, 600.0, 700.0],
        batches=[1, 8],
        latency=latency,
        energy=lambda clock, limit, *_: clock / 1000 + limit / 10000,
        stock_clock=1980,
        stock_limit=600.0,
    )


def above_stock_cube(tmp_path: Path) -> Path:
    ds = above_stock_ds()
    return write_cube(
        as_twin_sweep(ds, uuid=UUID, gpu_name="NVIDIA H100 80GB HBM3 (twin)", campaign="above"),
        tmp_path / "cube.nc",
    )


def headroom_json(tmp_path: Path) -> Path:
    cube = above_stock_cube(tmp_path)
    saved = tmp_path / "headroom.json"
    run("headroom", str(cube), "--slack", "5%", "--json", "-o", str(saved))
    room = json.loads(saved.read_text())
    chosen = {r["batch"]: r["chosen"] for r in room["rows"]}
    # headroom's own answer stands: the limit above stock at batch 1
    assert chosen == {
        1: {"sm_clock_mhz": 1500, "power_limit_w": 700.0},
        8: {"sm_clock_mhz": 1500, "power_limit_w": 600.0},
    }
    return saved


def test_a_static_plan_holds_no_setting_with_a_knob_above_stock(tmp_path: Path) -> None:
    saved = headroom_json(tmp_path)
    refused = run("cap", "plan", str(saved), "--batch", "1", "--drafter", "none", code=2)
    assert "nothing to cap" in refused.output and ABOVE in refused.output, refused.output
    assert "1500 MHz / 600 W" not in refused.output
    # batch 8's setting is below stock on the clock, at stock on the limit: capped as before
    plan = run("cap", "plan", str(saved), "--batch", "8", "--drafter", "none")
    (cap,) = tomllib.loads(plan.stdout)["model"]
    assert cap["sm_clock_max_mhz"] == 1500 and "power_limit_w" not in cap
    assert "above stock" not in plan.output


def test_a_per_batch_plan_holds_no_setting_with_a_knob_above_stock(tmp_path: Path) -> None:
    saved = headroom_json(tmp_path)
    plan = run("cap", "plan", str(saved), "--per-batch", "--drafter", "none")
    doc = tomllib.loads(plan.stdout)
    one, eight = doc["batch"]
    assert one == {"batch": 1}  # stock on both knobs
    assert eight["sm_clock_mhz"] == 1500 and "power_limit_w" not in eight
    assert ABOVE in doc["meta"]["above_stock"]
    assert "batch 8" not in doc["meta"]["above_stock"]
    said = [line for line in plan.stderr.splitlines() if line.startswith("batch 1:")]
    assert said == ["batch 1: SM clock stock, power limit stock"], plan.stderr
    notes = " ".join(plan.stderr.split())
    assert f"Note: {ABOVE}" in notes, plan.stderr


@pytest.mark.usefixtures("unsaved_figures")
def test_the_reports_caps_say_why_a_setting_above_stock_is_not_capped(tmp_path: Path) -> None:
    report = tmp_path / "report.md"
    run("report", str(above_stock_cube(tmp_path)), "--slack", "5%", "-o", str(report))
    table = report.read_text().split("Caps per batch and drafter")[1].split("To write")[0]
    one = [line for line in table.splitlines() if line.startswith("| 1 |")]
    eight = [line for line in table.splitlines() if line.startswith("| 8 |")]
    assert len(one) == 1 and "1500 MHz" not in one[0], table
    assert "a knob above stock" in one[0], table
    assert len(eight) == 1 and "1500 MHz" in eight[0] and "above stock" not in eight[0], table


def test_the_headroom_map_names_a_chosen_limit_above_stock() -> None:
    """The map named a cell's power limit only where capped below the reference's (600 W):
    batch 1's 1500 MHz / 700 W read "1500 MHz" alone, the stock limit, the setting plan45's
    caps would have run and which misses the target. It names 700 W, without a cap outline."""
    from dvfs.analysis.headroom import Target, headroom
    from dvfs.plots import draw_headroom

    result = headroom(above_stock_ds(), target=Target("preserve", slack=0.05))
    fig = draw_headroom(result)
    cells = [" ".join(t.get_text().split()) for ax in fig.axes for t in ax.texts]
    one = [c for c in cells if "1500 MHz" in c]
    assert len(one) == 2 and any(c.endswith("1500 MHz 700 W") for c in one), cells
    assert not any(c.endswith("600 W") for c in one), cells  # batch 8: at the reference's
    assert not [p for ax in fig.axes for p in ax.patches if p.get_gid() == "cap"]


def test_a_merged_plan_does_not_call_a_gpu_above_stock_at_stock(tmp_path: Path) -> None:
    """A merged document: the H100 (stock 600 W) chose 1500 MHz / 700 W, the H200 (stock
    700 W) 1000 MHz. The H200 is capped and the H100 left out, but [meta] not_capped said
    "the chosen setting is stock (1980 MHz, 600 W)" on the H100 beside an above_stock note
    naming its chosen 1500 MHz / 700 W: it says the plan is stock there."""
    h100, h200 = "NVIDIA H100 80GB HBM3 (twin)", "NVIDIA H200 (twin)"
    a = write_cube(
        as_twin_sweep(above_stock_ds(), uuid=UUID, gpu_name=h100, campaign="m"), tmp_path / "a.nc"
    )
    other = make_cube(
        clocks=[1000, 1500, 1980],
        limits=[400.0, 600.0, 700.0],
        batches=[1, 8],
        latency=lambda clock, limit, *_: 10.0 if limit >= 700.0 else 30.0,
        energy=lambda clock, limit, *_: clock / 1000 + limit / 10000,
        stock_clock=1980,
        stock_limit=700.0,
    )
    uuid_b = "GPU-bbbbbbbb-0000-4000-8000-000000000002"
    b = write_cube(
        as_twin_sweep(other, uuid=uuid_b, gpu_name=h200, campaign="m"), tmp_path / "b.nc"
    )
    run("cube", "merge", str(a), str(b), "-o", str(tmp_path / "m.nc"))
    saved = tmp_path / "headroom.json"
    run("headroom", str(tmp_path / "m.nc"), "--slack", "5%", "--json", "-o", str(saved))
    plan = run("cap", "plan", str(saved), "--batch", "1", "--drafter", "none")
    caps = tomllib.loads(plan.stdout)
    assert [(c["name"], c["sm_clock_max_mhz"]) for c in caps["model"]] == [(h200, 1000)]
    assert "1500 MHz / 700 W" in caps["meta"]["above_stock"]
    not_capped = caps["meta"]["not_capped"]
    assert f"the plan is stock (1980 MHz, 600 W) on {h100}" in not_capped, not_capped
    assert "the chosen setting is stock" not in not_capped


def test_the_curves_never_call_a_limit_above_stock_a_cap() -> None:
    """The energy-vs-clock and Pareto keys named every limit but the reference's a cap: on a
    grid of 400, 600 and 700 W with stock 600 W, "700 W power limit (cap)", a limit above
    stock that no cap sets. It is named above stock; 400 W is still a cap."""
    from dvfs.analysis.headroom import Target, headroom, reference_setting
    from dvfs.plots import draw_energy_vs_clock, draw_pareto
    from dvfs.plots.style import limit_styles

    ds = above_stock_ds()
    ref = reference_setting(ds)
    styles = limit_styles([400.0, 600.0, 700.0], ref.power_limit, ref.stock_power_limit)
    assert [s.label for s in styles.values()] == [
        "700 W power limit (above stock)",
        "600 W power limit (stock)",
        "400 W power limit (cap)",
    ]
    target = Target("preserve", slack=0.05)
    result = headroom(ds, target=target)
    for fig in (draw_energy_vs_clock(ds, "code"), draw_pareto(ds, result, target, "code")):
        legends = [*fig.legends, *(a.get_legend() for a in fig.axes if a.get_legend())]
        labels = [t.get_text() for legend in legends for t in legend.get_texts()]
        assert "700 W power limit (above stock)" in labels, labels
        assert not [label for label in labels if "700 W" in label and "cap" in label], labels


def test_a_limit_between_stock_and_the_grids_top_is_above_stock_not_a_cap() -> None:
    """The grid swept 650 and 700 W, not the stock limit (600 W): the reference is the grid's
    top, 700 W, and the keys called 650 W "power limit (cap)", a limit below the reference but
    above stock, which no cap sets. Each limit is named against stock: 650 W above stock, the
    reference the top of the grid (above stock too)."""
    from dvfs.analysis.headroom import Target, headroom, reference_setting
    from dvfs.plots import draw_energy_vs_clock, draw_pareto
    from dvfs.plots.style import limit_styles

    ds = make_cube(
        clocks=[1000, 1500, 1980],
        limits=[650.0, 700.0],
        batches=[1, 8],
        latency=latency,
        energy=lambda clock, limit, *_: clock / 1000 + limit / 10000,
        stock_clock=1980,
        stock_limit=600.0,
    )
    ref = reference_setting(ds)
    assert (ref.power_limit, ref.stock_power_limit) == (700.0, 600.0)
    styles = limit_styles([650.0, 700.0], ref.power_limit, ref.stock_power_limit)
    assert [s.label for s in styles.values()] == [
        "700 W power limit (top of the grid, above stock)",
        "650 W power limit (above stock)",
    ]
    # a grid reaching below stock still caps there
    styles = limit_styles([400.0, 650.0, 700.0], 700.0, 600.0)
    assert styles[400.0].label == "400 W power limit (cap)"
    target = Target("preserve", slack=0.05)
    result = headroom(ds, target=target)
    for fig in (draw_energy_vs_clock(ds, "code"), draw_pareto(ds, result, target, "code")):
        legends = [*fig.legends, *(a.get_legend() for a in fig.axes if a.get_legend())]
        labels = [t.get_text() for legend in legends for t in legend.get_texts()]
        assert "650 W power limit (above stock)" in labels, labels
        assert not [label for label in labels if "cap" in label], labels


def test_the_headroom_map_outlines_no_limit_above_stock_as_a_cap() -> None:
    """The same grid (650 and 700 W, stock 600 W): batch 8 chooses 1500 MHz / 650 W, and the
    headroom map outlined the cell and keyed it "power limit capped below 700 W", the
    reference's limit, though 650 W is above stock. No cell is outlined; the limit is still
    named in the cell."""
    from dvfs.analysis.headroom import Target, headroom
    from dvfs.plots import draw_headroom

    ds = make_cube(
        clocks=[1000, 1500, 1980],
        limits=[650.0, 700.0],
        batches=[1, 8],
        latency=latency,
        energy=lambda clock, limit, *_: clock / 1000 + limit / 10000,
        stock_clock=1980,
        stock_limit=600.0,
    )
    result = headroom(ds, target=Target("preserve", slack=0.05))
    row = result.sel(batch=8, drafter="none", corpus="code")
    assert (float(row["chosen_sm_clock"]), float(row["chosen_power_limit"])) == (1500, 650)
    fig = draw_headroom(result)
    texts = [t.get_text() for t in fig.findobj(lambda o: hasattr(o, "get_text"))]
    assert not [t for t in texts if "capped" in t], texts
    assert any("650 W" in t for t in texts), texts
    assert not [p for ax in fig.axes for p in ax.patches if p.get_gid() == "cap"]
