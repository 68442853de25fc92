"""A saving the cells' stated uncertainty cannot tell apart from zero is no saving: headroom
keeps the reference (or a setting that saves beyond the noise), says so with the numbers, and
`dvfs cap plan` plans no cap from it. The interval's maths is checked on its own."""

from __future__ import annotations

import math

import numpy as np
import pytest
import xarray as xr
from cubes import as_twin_sweep, make_cube
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.analysis.bounds import ratio_interval
from dvfs.analysis.headroom import headroom
from dvfs.analysis.targets import Target, parse_slo
from dvfs.caps.planning import plan_caps, plan_per_batch
from dvfs.errors import CapsError
from dvfs.report.headroom import headroom_document, headroom_notes, headroom_table_rows

LIMITS = [400.0, 600.0, 700.0]


def power_limit_cube(energy, ci: float | None, repeats: int = 1, latency=None) -> xr.Dataset:  # type: ignore[no-untyped-def]
    """One SM clock (the campaign never set it), three power limits; `energy(limit, repeat)`,
    every cell stating `ci` as its relative half-width (None: the variable is absent)."""
    cube = make_cube(
        clocks=[1980],
        limits=LIMITS,
        repeats=repeats,
        latency=latency or (lambda c, p, *_: {400.0: 12.0, 600.0: 10.05, 700.0: 10.0}[p]),
        energy=lambda c, p, b, d, k, r: energy(p, r),
    )
    if ci is not None:
        cube["energy_per_token_rel_ci"] = xr.full_like(cube["energy_per_token_j"], ci)
    return cube


def one(result: xr.Dataset) -> xr.Dataset:
    return result.isel(batch=0, drafter=0, corpus=0)


def test_a_saving_within_the_cells_intervals_keeps_stock() -> None:
    """600 W saves 0.2% while each cell is known to +-3%: on the old code it was chosen and
    stated as a 0.2% saving (a cap plan would apply it); now stock is kept and the row says
    which setting was set aside, its saving and that saving's interval."""
    cube = power_limit_cube(lambda p, r: {600.0: 0.998}.get(p, 1.0), ci=0.03)
    r = one(headroom(cube, target=Target("preserve", slack=0.01)))
    assert (float(r["chosen_power_limit"]), float(r["saving"])) == (700.0, 0.0)
    assert bool(r["saving_set_aside_within_noise"]) and not bool(r["saving_within_noise"])
    assert float(r["within_noise_power_limit"]) == 600.0
    assert float(r["within_noise_saving"]) == pytest.approx(0.002)
    width = math.hypot(0.03, 0.03)
    assert float(r["within_noise_saving_low"]) == pytest.approx(1 - 0.998 * math.exp(width))
    assert float(r["within_noise_saving_high"]) == pytest.approx(1 - 0.998 * math.exp(-width))
    # The same saving from cells known to +-0.05% is beyond the noise: 600 W is chosen.
    sharp = power_limit_cube(lambda p, r: {600.0: 0.998}.get(p, 1.0), ci=0.0005)
    r = one(headroom(sharp, target=Target("preserve", slack=0.01)))
    assert float(r["chosen_power_limit"]) == 600.0
    assert not bool(r["saving_set_aside_within_noise"])


def test_paired_repeats_whose_interval_reaches_zero_keep_stock() -> None:
    """Three repeats saving 0.2%, 0.7% and 0.65%: the two-sided 95% interval of their mean
    reaches zero, so no saving beyond noise, though every cell states none of its own. With
    two or more paired repeats their spread is the noise, not the cells' intervals."""
    ratios = [0.998, 0.993, 0.9935]
    cube = power_limit_cube(lambda p, r: ratios[r] if p == 600.0 else 1.0, None, repeats=3)
    r = one(headroom(cube, target=Target("preserve", slack=0.01)))
    assert float(r["chosen_power_limit"]) == 700.0
    assert int(r["within_noise_paired_repeats"]) == 3
    assert float(r["within_noise_saving_low"]) < 0 < float(r["within_noise_saving_high"])
    # Repeats that agree on a 9.5% saving are beyond it.
    clear = [0.90, 0.91, 0.905]
    cube = power_limit_cube(lambda p, r: clear[r] if p == 600.0 else 1.0, 0.5, repeats=3)
    r = one(headroom(cube, target=Target("preserve", slack=0.01)))
    assert float(r["chosen_power_limit"]) == 600.0
    assert float(r["saving"]) == pytest.approx(0.095)


def test_a_setting_that_saves_beyond_the_noise_wins_over_a_lower_one_within_it() -> None:
    """400 W spends least but its cells are known only to +-20%; 600 W saves 5% known to
    +-0.5%: 600 W is the answer, and the note names 400 W and its interval."""
    cube = make_cube(
        clocks=[1980],
        limits=LIMITS,
        latency=lambda *a: 10.0,
        energy=lambda c, p, *_: {400.0: 0.9, 600.0: 0.95, 700.0: 1.0}[p],
    )
    ci = xr.where(cube["power_limit"] == 400.0, 0.2, 0.005)
    cube["energy_per_token_rel_ci"] = ci.broadcast_like(cube["energy_per_token_j"])
    r = one(headroom(cube, target=Target("preserve")))
    assert float(r["chosen_power_limit"]) == 600.0
    assert float(r["within_noise_power_limit"]) == 400.0
    doc = headroom_document(headroom(cube, target=Target("preserve")), cube)
    (note,) = [n for n in headroom_notes(doc) if n.startswith("no saving beyond noise")]
    assert "batch 1 none on code: 1980 MHz / 400 W saves 10.0% [" in note


def test_an_answer_only_within_the_noise_is_kept_and_marked() -> None:
    """Under an SLO stock misses, and the one setting meeting it saves 0.5% within +-3%: it
    stays the answer (nothing else meets the target), its saving marked within the noise."""
    cube = power_limit_cube(
        lambda p, r: {600.0: 0.995}.get(p, 1.0),
        ci=0.03,
        latency=lambda c, p, *_: {400.0: 30.0, 600.0: 9.0, 700.0: 11.0}[p],
    )
    result = headroom(cube, target=parse_slo("tpot_p50<=10ms"))
    r = one(result)
    assert float(r["chosen_power_limit"]) == 600.0
    assert bool(r["saving_within_noise"]) and not bool(r["saving_set_aside_within_noise"])
    header, (cells,) = headroom_table_rows(headroom_document(result, cube))
    assert cells[header.index("saving")] == "≈0.5%"


def test_cap_plan_plans_no_cap_from_a_saving_within_the_noise() -> None:
    cube = as_twin_sweep(
        power_limit_cube(lambda p, r: {600.0: 0.998}.get(p, 1.0), ci=0.03),
        uuid="GPU-00000000-0000-0000-0000-000000000001",
        gpu_name="NVIDIA H100 80GB HBM3 (twin)",
        campaign="noise",
    )
    doc = headroom_document(headroom(cube, target=Target("preserve", slack=0.01)), cube)
    with pytest.raises(CapsError, match="nothing to cap .*within the measurement noise"):
        plan_caps(doc, batch=1, drafter="none", corpus="worst-case")
    with pytest.raises(CapsError, match="nothing to govern .*within the measurement noise"):
        plan_per_batch(doc, drafter="none", corpus="worst-case")


positive = st.floats(0.05, 5.0, allow_nan=False)
widths = st.one_of(st.just(math.nan), st.floats(0.0, 0.2))


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 4),
    data=st.data(),
    confidence=st.sampled_from([0.8, 0.9, 0.95, 0.99]),
)
def test_the_interval_widens_with_every_stated_uncertainty(n, data, confidence) -> None:  # type: ignore[no-untyped-def]
    v = np.array(data.draw(st.lists(positive, min_size=n, max_size=n)))
    r = np.array(data.draw(st.lists(positive, min_size=n, max_size=n)))
    cv = np.array(data.draw(st.lists(widths, min_size=n, max_size=n)))
    cr = np.array(data.draw(st.lists(widths, min_size=n, max_size=n)))
    low, high, pairs = ratio_interval(v, r, cv, cr, confidence)
    assert pairs == n
    # around the geometric mean of the paired ratios; below two, the ratio of the means
    ratio = float(np.exp(np.log(v / r).mean())) if n >= 2 else v.mean() / r.mean()
    assert low <= ratio * (1 + 1e-12) and ratio <= high * (1 + 1e-12)
    # the order of the repeats never matters, bit for bit
    order = np.array(data.draw(st.permutations(range(n))))
    assert ratio_interval(v[order], r[order], cv[order], cr[order], confidence) == (
        low,
        high,
        pairs,
    )
    # scaling either arm's energies scales the interval, nothing else
    s = data.draw(st.floats(0.5, 2.0))
    low_s, high_s, _ = ratio_interval(v * s, r, cv, cr, confidence)
    assert low_s == pytest.approx(low * s, rel=1e-9) and high_s == pytest.approx(high * s, rel=1e-9)
    # more stated uncertainty never narrows it; a wider confidence never narrows it either
    low_w, high_w, _ = ratio_interval(v, r, np.nan_to_num(cv) + 0.01, cr, confidence)
    assert low_w <= low and high <= high_w
    if n >= 2:
        low_c, high_c, _ = ratio_interval(v, r, cv, cr, (1 + confidence) / 2)
        assert low_c <= low and high <= high_c


def test_the_interval_needs_both_arms() -> None:
    nan = np.array([math.nan])
    low, high, pairs = ratio_interval(nan, np.array([1.0]), nan, nan, 0.95)
    assert math.isnan(low) and math.isnan(high) and pairs == 0
    # unpaired repeats: the cells' intervals around the ratio of the means, 0 paired
    low, high, pairs = ratio_interval(
        np.array([0.9, math.nan]), np.array([math.nan, 1.0]), np.zeros(2), np.zeros(2), 0.95
    )
    assert (low, high, pairs) == (pytest.approx(0.9), pytest.approx(0.9), 0)


def test_a_zero_energy_is_a_ratio_of_zero_as_compare_takes_it() -> None:
    """A cube holds any non-negative energy per token. A setting at 0 J per token was read as
    no value: its interval NaN, so it was set aside as "within the noise" and the table's note
    failed on the missing interval (`dvfs headroom`: internal error, TypeError). It is a ratio
    of 0, as `dvfs compare` takes it: every paired repeat at 0, that point; beside another
    ratio, unbounded."""
    ci = np.array([0.03, 0.03])
    assert ratio_interval(np.array([0.0]), np.array([1.0]), ci[:1], ci[:1], 0.95) == (0, 0, 1)
    assert ratio_interval(np.zeros(2), np.ones(2), ci, ci, 0.95) == (0.0, 0.0, 2)
    assert ratio_interval(np.array([0.0, 0.9]), np.ones(2), ci, ci, 0.95) == (0.0, math.inf, 2)
    assert ratio_interval(np.ones(2), np.zeros(2), ci, ci, 0.95) == (math.inf, math.inf, 2)
    # 0 / 0 is no ratio: that repeat is not paired
    low, high, pairs = ratio_interval(np.array([0.0, 0.9]), np.array([0.0, 1.0]), ci, ci, 0.95)
    assert pairs == 1 and low < 0.9 < high
    # one repeat at 0 J: the setting saves it all, beyond any noise the cells state
    cube = power_limit_cube(lambda p, r: {600.0: 0.0}.get(p, 1.0), ci=0.03)
    result = headroom(cube, target=Target("preserve", slack=0.01))
    r = one(result)
    assert (float(r["chosen_power_limit"]), float(r["saving"])) == (600.0, 1.0)
    assert not bool(r["saving_set_aside_within_noise"])
    # paired repeats at 0 J and 0.9 J: within the noise, its interval unbounded; the note says
    cube = power_limit_cube(lambda p, r: [0.0, 0.9][r] if p == 600.0 else 1.0, None, repeats=2)
    result = headroom(cube, target=Target("preserve", slack=0.01))
    assert float(one(result)["chosen_power_limit"]) == 700.0
    doc = headroom_document(result, cube)
    (note,) = [n for n in headroom_notes(doc) if n.startswith("no saving beyond noise")]
    assert "600 W saves 55.0% [-inf%, 100.0%] (over 2 paired repeats)" in note


def test_the_findings_claim_no_saving_the_headroom_marks_within_the_noise() -> None:
    """Under an SLO stock misses, 600 W meets it saving 0.5% within cells of +-3%: the table
    marks it ≈ ("no saving is shown to exist there"), but the report's findings counted it as
    a group that saves energy and led with "Largest saving: 0.5%". They count only savings
    beyond the noise and say which rows' savings are within it."""
    from dvfs.report.document import ReportOptions, build_document
    from dvfs.report.model import Finding

    cube = power_limit_cube(
        lambda p, r: {600.0: 0.995}.get(p, 1.0),
        ci=0.03,
        latency=lambda c, p, *_: {400.0: 30.0, 600.0: 9.0, 700.0: 11.0}[p],
    )
    doc = build_document(cube, ReportOptions(parse_slo("tpot_p50<=10ms")), [], generated="now")
    (findings,) = [s for s in doc.sections if s.title == "Findings"]
    finding = findings.blocks[0]
    assert isinstance(finding, Finding)
    assert finding.headline.startswith("0 of 1 (batch, drafter, corpus) groups save energy")
    assert not any(d.startswith("Largest saving") for d in finding.details)
    (noise,) = [d for d in finding.details if d.startswith("≈")]
    assert "batch 1, drafter none, corpus code" in noise and "within the measurement noise" in noise


def test_the_headroom_map_marks_a_saving_within_the_noise() -> None:
    """An answer kept within the noise (600 W saves 5% within cells of +-10%): the table
    writes ≈5.0%, the headroom map (the report's figure) wrote a plain "5%", a saving like
    any other. The map marks it as the table does and its key says what the mark means."""
    from matplotlib.legend import Legend

    from dvfs.plots import draw_headroom

    cube = power_limit_cube(
        lambda p, r: {600.0: 0.95}.get(p, 1.0),
        ci=0.1,
        latency=lambda c, p, *_: {400.0: 30.0, 600.0: 9.0, 700.0: 11.0}[p],
    )
    result = headroom(cube, target=parse_slo("tpot_p50<=10ms"))
    assert bool(one(result)["saving_within_noise"])
    fig = draw_headroom(result)
    cells = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "≈5%\n1980 MHz\n600 W" in cells, cells
    keys = [t.get_text() for legend in fig.findobj(Legend) for t in legend.get_texts()]
    assert "≈: saving within the noise" in keys, keys
    # a saving beyond the noise is not marked, nor keyed
    sharp = power_limit_cube(
        lambda p, r: {600.0: 0.95}.get(p, 1.0),
        ci=0.001,
        latency=lambda c, p, *_: {400.0: 30.0, 600.0: 9.0, 700.0: 11.0}[p],
    )
    fig = draw_headroom(headroom(sharp, target=parse_slo("tpot_p50<=10ms")))
    assert "5%\n1980 MHz\n600 W" in [t.get_text() for ax in fig.axes for t in ax.texts]
    keys = [t.get_text() for legend in fig.findobj(Legend) for t in legend.get_texts()]
    assert not any(k.startswith("≈") for k in keys), keys


def test_the_headroom_map_names_a_saving_set_aside_within_the_noise() -> None:
    """600 W saves 0.2% within cells of +-3%: headroom keeps stock and its table's note names
    the setting set aside; the map wrote "0%" at stock, as if nothing below it saved anything.
    Its cell names the saving set aside and the key says what that means."""
    from matplotlib.legend import Legend

    from dvfs.plots import draw_headroom

    result = headroom(
        power_limit_cube(lambda p, r: {600.0: 0.998}.get(p, 1.0), ci=0.03),
        target=Target("preserve", slack=0.01),
    )
    assert bool(one(result)["saving_set_aside_within_noise"])
    fig = draw_headroom(result)
    cells = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "0%\n1980 MHz\n0.2% in noise" in cells, cells
    keys = [t.get_text() for legend in fig.findobj(Legend) for t in legend.get_texts()]
    assert "x% in noise: a lower setting's saving, set aside" in keys, keys
    # ... and that key line stays on the figure: the side column (one corpus, no free grid
    # slot) was 3.2 in wide, and it ran past the right edge, cut at "set"
    fig.canvas.draw()
    inches = fig.get_tightbbox(fig.canvas.get_renderer())  # type: ignore[attr-defined]
    width, height = fig.get_size_inches()
    assert inches.x0 >= -0.01 and inches.y0 >= -0.01, inches
    assert inches.x1 <= width + 0.01 and inches.y1 <= height + 0.01, (inches, width)
    # nothing set aside: no such line, nor key
    sharp = power_limit_cube(lambda p, r: {600.0: 0.95}.get(p, 1.0), ci=0.001)
    fig = draw_headroom(headroom(sharp, target=Target("preserve", slack=0.01)))
    assert not any("in noise" in t.get_text() for ax in fig.axes for t in ax.texts)
    keys = [t.get_text() for legend in fig.findobj(Legend) for t in legend.get_texts()]
    assert not any("in noise" in k for k in keys), keys


def test_the_reports_caps_table_says_why_it_plans_stock() -> None:
    """`dvfs cap plan` says a lower setting's saving was within the noise where it plans
    stock; the report's caps table said only "stock: nothing to cap"."""
    from dvfs.report.document import ReportOptions, build_document
    from dvfs.report.model import Table

    cube = power_limit_cube(lambda p, r: {600.0: 0.998}.get(p, 1.0), ci=0.03)
    cube.attrs["gpu_uuids"] = "GPU-1234"
    doc = build_document(cube, ReportOptions(Target("preserve", slack=0.01)), [], generated="now")
    caps = doc.sections[-1].blocks[1]
    assert isinstance(caps, Table)
    assert caps.rows == (
        (
            "1",
            "none",
            "GPU-1234",
            "stock",
            "stock",
            "stock: nothing to cap (a lower setting's saving is within the measurement noise)",
        ),
    )
    # stock for no such reason: the row says only that
    flat = power_limit_cube(lambda p, r: 1.0, ci=0.03)
    flat.attrs["gpu_uuids"] = "GPU-1234"
    doc = build_document(flat, ReportOptions(Target("preserve", slack=0.01)), [], generated="now")
    assert doc.sections[-1].blocks[1].rows[0][-1] == "stock: nothing to cap"  # type: ignore[union-attr]


def test_the_reports_caps_table_names_a_twins_stock_row_as_its_capped_rows() -> None:
    """On a twin cube (the demo's) the caps table named a capped row's GPUs by model, "every
    NVIDIA H100 80GB HBM3 (twin)", as the simulated caps file does, but a row planned at stock
    by the twin's made-up UUID cut mid-group ("GPU-47dfcd23-120"): both now name the model."""
    from dvfs.report.document import ReportOptions, build_document
    from dvfs.report.model import Table

    def caps_rows(saving: float) -> tuple[tuple[str, ...], ...]:
        cube = as_twin_sweep(
            power_limit_cube(lambda p, r: {600.0: saving}.get(p, 1.0), ci=0.03),
            uuid="GPU-47dfcd23-120e-9eab-3043-5d0ea1215572",
            gpu_name="NVIDIA H100 80GB HBM3 (twin)",
            campaign="demo",
        )
        options = ReportOptions(Target("preserve", slack=0.01))
        caps = build_document(cube, options, [], generated="now").sections[-1].blocks[1]
        assert isinstance(caps, Table)
        return caps.rows

    capped, at_stock = caps_rows(0.9), caps_rows(0.998)
    assert capped[0][2:5] == ("every NVIDIA H100 80GB HBM3 (twin)", "stock", "600 W")
    assert at_stock[0][2:5] == ("every NVIDIA H100 80GB HBM3 (twin)", "stock", "stock")
    assert at_stock[0][-1].startswith("stock: nothing to cap")


def test_a_per_batch_plan_says_which_stock_steps_the_noise_kept() -> None:
    """Batch 1's lower setting saves within the noise, batch 8's beyond it: the plan governs
    batch 8 and holds batch 1 at stock, and said nothing of why (only a plan whose every step
    is stock did). Its meta names the batch and the reason, as the CLI's note does."""
    import tomllib

    from dvfs.govern.plan import dump_plan, parse_plan

    cube = as_twin_sweep(
        make_cube(
            clocks=[1980],
            limits=LIMITS,
            batches=[1, 8],
            latency=lambda c, p, *_: {400.0: 12.0, 600.0: 10.05, 700.0: 10.0}[p],
            energy=lambda c, p, b, *_: {600.0: 0.998 if b == 1 else 0.9}.get(p, 1.0),
        ),
        uuid="GPU-00000000-0000-0000-0000-000000000001",
        gpu_name="NVIDIA H100 80GB HBM3 (twin)",
        campaign="noise",
    )
    cube["energy_per_token_rel_ci"] = xr.full_like(cube["energy_per_token_j"], 0.03)
    doc = headroom_document(headroom(cube, target=Target("preserve", slack=0.01)), cube)
    plan = plan_per_batch(doc, drafter="none", corpus="worst-case")
    assert [s.setting.is_stock for s in plan.steps] == [True, False]
    note = plan.meta["within_noise"]
    assert note.startswith("batch 1 at stock: ") and "within the measurement noise" in note
    assert parse_plan(tomllib.loads(dump_plan(plan)), where="plan").meta["within_noise"] == note
    # nothing set aside: no note
    clear = cube.copy()
    clear["energy_per_token_rel_ci"] = xr.full_like(cube["energy_per_token_j"], 0.0001)
    doc = headroom_document(headroom(clear, target=Target("preserve", slack=0.01)), clear)
    assert plan_per_batch(doc, drafter="none", corpus="worst-case").meta["within_noise"] is None


def test_the_reports_say_the_chosen_setting_is_the_least_energy_beyond_the_noise() -> None:
    """The report's headroom section and `dvfs headroom --markdown` said the chosen setting is
    the feasible one with the least energy per token, over a row that keeps stock though 600 W
    meets the target for less (its saving within the noise). They state the rule now kept."""
    from dvfs.report.document import ReportOptions, build_document
    from dvfs.report.headroom import headroom_markdown
    from dvfs.report.model import Paragraph

    cube = as_twin_sweep(
        power_limit_cube(lambda p, r: {600.0: 0.998}.get(p, 1.0), ci=0.03),
        uuid="GPU-00000000-0000-0000-0000-000000000001",
        gpu_name="NVIDIA H100 80GB HBM3 (twin)",
        campaign="noise",
    )
    target = Target("preserve", slack=0.01)
    doc = build_document(cube, ReportOptions(target), [], generated="now")
    (section,) = [s for s in doc.sections if s.title == "Headroom"]
    lead = section.blocks[0]
    assert isinstance(lead, Paragraph)
    rule = "least energy per token of those that save beyond the measurement noise"
    assert rule in lead.text, lead.text
    markdown = headroom_markdown(headroom_document(headroom(cube, target=target), cube))
    assert rule in markdown, markdown


def test_the_figures_do_not_call_a_choice_kept_for_the_noise_the_least_energy() -> None:
    """600 W meets the target for 0.2% less than stock, within the noise: the star is at
    stock (700 W), which the Pareto and energy-vs-limit legends called "least energy meeting
    the target" and the headroom map's title "the least-energy setting meeting" it. They name
    the star as `dvfs headroom`'s choice instead."""
    from dvfs.plots import draw_energy_vs_power_limit, draw_headroom, draw_pareto

    cube = power_limit_cube(lambda p, r: {600.0: 0.998}.get(p, 1.0), ci=0.03)
    target = Target("preserve", slack=0.01)
    result = headroom(cube, target=target)
    assert float(one(result)["chosen_power_limit"]) == 700.0
    for fig in (
        draw_pareto(cube, result, target, "code"),
        draw_energy_vs_power_limit(cube, result, "code"),
    ):
        (star,) = [c for ax in fig.axes for c in ax.collections if c.get_gid() == "chosen"]
        assert star.get_offsets().data.tolist()[0][1] == pytest.approx(1.0)  # stock's energy
        labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        labels += [
            t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()
        ]
        chosen = [label for label in labels if label.startswith("chosen")]
        assert chosen and not any("least energy" in label for label in chosen), labels
    title = draw_headroom(result)._suptitle.get_text()  # type: ignore[union-attr]
    assert "least-energy" not in title and "dvfs headroom" in title, title


@pytest.mark.parametrize("command", ["headroom", "report", "plot"])
def test_confidence_help_names_the_savings_interval(command: str) -> None:
    """--confidence also sets the two-sided interval a saving is judged by (with repeats);
    the help named the latency bound alone."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    out = CliRunner().invoke(cli, [command, "--help"], terminal_width=200).output
    line = " ".join(out.split("--confidence FLOAT", 1)[1].split("\n", 3)[:3])
    assert "latency bound" in line and "saving's interval" in " ".join(line.split()), out


def test_a_headroom_map_cell_of_four_lines_stays_within_its_row() -> None:
    """A locked clock, a capped limit and a lower setting's saving set aside within the noise
    make four lines ("14%", "1680 MHz", "500 W", "15.1% in noise": a sweep of two drafters at
    --slack 10% --confidence 0.999); the rows were sized for three, so the cell's text ran
    over the cap's outline, into the rows above and below. Its row makes room."""
    from dvfs.plots import draw_headroom

    cube = make_cube(
        clocks=[1980, 1680],
        limits=LIMITS,
        drafters=["none", "eagle3", "dflash", "ngram", "standalone"],
        energy=lambda c, p, *_: 1.0 - (1980 - c) / 3000 - (700 - p) / 5000,
    )
    result = headroom(cube, target=Target("preserve", slack=0.5))
    pick = {"drafter": "eagle3", **{d: result[d].values[0] for d in ("batch", "corpus")}}
    # that cell as the sweep above left it (set by hand: a map reads what headroom says)
    result["chosen_sm_clock"].loc[pick] = 1680.0
    result["chosen_power_limit"].loc[pick] = 600.0
    result["saving_set_aside_within_noise"].loc[pick] = True
    result["within_noise_saving"].loc[pick] = 0.151
    fig = draw_headroom(result)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    (ax,) = [a for a in fig.axes if a.texts and a.images]
    (text,) = [t for t in ax.texts if "15.1% in noise" in t.get_text()]
    assert text.get_text().count("\n") == 3, text.get_text()
    i = list(result["drafter"].values).index("eagle3")
    # within the cap's outline (0.46 either side of the cell's centre), in pixels
    row = ax.transData.transform([(0, i - 0.46), (0, i + 0.46)])[:, 1]
    box = text.get_window_extent(renderer)
    assert min(row) <= box.y0 and box.y1 <= max(row), (box, row)
