"""`dvfs headroom`, `dvfs compare` and `dvfs plot` on a real (twin) sweep, through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dvfs.cli import cli


def run(*args: str) -> object:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_headroom_json_document(small_sweep: Path, tmp_path: Path) -> None:
    saved = tmp_path / "headroom.json"
    result = run("headroom", str(small_sweep), "--slack", "5%", "--json", "-o", str(saved))
    doc = json.loads(result.output)
    assert doc == json.loads(saved.read_text())
    assert doc["schema"] == "dvfs.headroom/1"
    assert doc["reference"] == {
        "sm_clock_mhz": 1980,
        "power_limit_w": 700.0,
        "is_stock": True,
        "stock_sm_clock_mhz": 1980,
        "stock_power_limit_w": 700.0,
        "description": "stock (1980 MHz / 700 W)",
    }
    assert "Student-t upper bound over 2 paired repeat" in doc["bound"]
    assert len(doc["rows"]) == 2 * 2 * 2  # batch x drafter x corpus
    for row in doc["rows"]:
        assert row["feasible"]
        # Memory-bound decode on the twin keeps latency within 5% well below 1980 MHz.
        assert row["chosen"]["sm_clock_mhz"] < 1980
        assert row["headroom_mhz"] >= 1980 - row["chosen"]["sm_clock_mhz"] > 0
        assert 0 < row["saving"] < 0.6
        assert row["latency_ms"] <= row["target_ms"] * 1.0001


@pytest.mark.parametrize(("knob", "held"), [("sm_clock", "w"), ("power_limit", "mhz")])
def test_a_knob_held_by_knob_has_no_headroom_not_zero(
    small_sweep: Path, knob: str, held: str
) -> None:
    """`--knob sm_clock` keeps the power limit at the reference, so its headroom was never
    searched: it read 0 (W), as if no lower limit met the target, where the same cube with
    `--knob both` finds one. It is unknown (null) and the table says "held"."""
    args = ("headroom", str(small_sweep), "--slack", "20%", "--json")
    both = json.loads(run(*args).output)["rows"]
    doc = json.loads(run(*args, "--knob", knob).output)
    assert any(r["feasible"] and r[f"headroom_{held}"] > 0 for r in both)  # there is some
    assert all(r[f"headroom_{held}"] is None for r in doc["rows"] if r["feasible"])
    swept = "mhz" if held == "w" else "w"
    assert any(r[f"headroom_{swept}"] for r in doc["rows"] if r["feasible"])  # still searched
    table = run("headroom", str(small_sweep), "--slack", "20%", "--knob", knob).output
    cells = [line.split("│")[5].strip() for line in table.splitlines() if "│ code" in line]
    assert cells and all(("held/" if held == "mhz" else "/held") in c for c in cells), cells


def test_headroom_slo_and_filters(small_sweep: Path) -> None:
    doc = json.loads(
        run(
            "headroom",
            str(small_sweep),
            "--slo",
            "tpot_p90<=1ms",
            "--json",
            "--batch",
            "8",
            "--drafter",
            "none",
        ).output
    )
    assert [(r["batch"], r["drafter"]) for r in doc["rows"]] == [(8, "none"), (8, "none")]
    assert not any(r["feasible"] for r in doc["rows"])  # nothing decodes in 1 ms per token
    assert doc["target"]["mode"] == "slo" and doc["target"]["threshold"] == 1.0


def test_headroom_table_and_markdown(small_sweep: Path) -> None:
    table = run("headroom", str(small_sweep), "--vs-baseline").output
    assert (
        "DVFS headroom" in table
        and "eagle3" in table
        and "reference: stock (1980 MHz / 700 W)" in table
    )
    # With --vs-baseline the title names the baseline's latency: the saving column is still
    # each drafter's against its own stock energy, said as the Markdown says it.
    assert "saving: against the drafter's own energy at the reference" in " ".join(table.split())
    markdown = run("headroom", str(small_sweep), "--markdown", "--corpus", "code").output
    assert markdown.startswith("## DVFS headroom")
    assert "| batch | drafter | corpus |" in markdown
    assert markdown.count("| code |") == 4


def test_headroom_usage_errors(small_sweep: Path) -> None:
    both = CliRunner().invoke(
        cli, ["headroom", str(small_sweep), "--vs-baseline", "--slo", "tpot_p50<=5ms"]
    )
    assert both.exit_code == 2 and "choose one of" in both.output
    bad = CliRunner().invoke(cli, ["headroom", str(small_sweep), "--slo", "fast please"])
    assert bad.exit_code == 2 and "cannot read SLO" in bad.output
    missing = CliRunner().invoke(cli, ["headroom", str(small_sweep / "nope.nc")])
    assert missing.exit_code == 1 and "no cube at" in missing.output


def test_compare_json_and_markdown(small_sweep: Path) -> None:
    doc = json.loads(run("compare", str(small_sweep), "--json").output)
    assert doc["schema"] == "dvfs.compare/4" and doc["baseline"] == "none"
    rows = {(r["batch"], r["corpus"]): r for r in doc["rows"]}
    assert set(rows) == {(1, "code"), (8, "code"), (1, "conversation"), (8, "conversation")}
    assert all(r["energy_ratio_at_stock"] < 1 for r in rows.values())  # EAGLE-3 saves at b<=8
    accept = {
        a["corpus"]: a["accept_length"] for a in doc["acceptance"] if a["drafter"] == "eagle3"
    }
    assert accept["code"] > accept["conversation"] > 1  # priors: code accepts more
    assert doc["roofline"]["model"] == "llama-3.1-8b"
    markdown = run("compare", str(small_sweep), "--markdown").output
    assert "### Mean accept length" in markdown and "### Verify pass vs ridge point" in markdown


def test_compare_lists_the_corpora_in_the_cubes_order(small_sweep: Path, tmp_path: Path) -> None:
    """The acceptance table sorted its corpora by name, where every other table, figure and
    the JSON keep the cube's (the campaign's) order."""
    import dvfs
    from dvfs.cube import write_cube

    with dvfs.open_cube(small_sweep / "cube.nc") as ds:
        turned = ds.isel(corpus=[1, 0]).load()  # conversation, then code
    write_cube(turned, tmp_path / "cube.nc")
    markdown = run("compare", str(tmp_path / "cube.nc"), "--markdown").output
    [header] = [
        x for x in markdown.splitlines() if x.startswith("| drafter |") and "corpus" not in x
    ]
    assert header.split("|")[2:4] == [" conversation ", " code "], header


def test_plot_writes_every_figure(small_sweep: Path, tiny_exact_run, tmp_path: Path) -> None:
    out = tmp_path / "plots"
    files = run("plot", str(small_sweep), "--out", str(out)).output.split()
    names = sorted(Path(f).name for f in files)
    assert names == sorted(
        [
            "energy_vs_clock_code.png",
            "energy_vs_clock_conversation.png",
            "pareto_code.png",
            "pareto_conversation.png",
            "acceptance.png",
            "headroom.png",
            "energy_split_code.png",
            "energy_split_conversation.png",
            "timelines.png",
            "energy_vs_batch.png",
        ]
    )
    for f in files:
        data = Path(f).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # --format reaches the files: every kind of figure, of the session's one-corpus run (the
    # fewest figures that hold every kind).
    one = tiny_exact_run("one")
    svg = run("plot", str(one), "--out", str(tmp_path / "svg"), "--format", "svg").output.split()
    kinds = {
        n.removesuffix(".png").removesuffix("_code").removesuffix("_conversation") for n in names
    }
    assert sorted(Path(f).stem.removesuffix("_code") for f in svg) == sorted(kinds)
    assert all(Path(f).read_bytes().lstrip().startswith(b"<?xml") for f in svg)


def test_python_api(small_sweep: Path) -> None:
    import dvfs

    ds = dvfs.open_cube(str(small_sweep / "cube.nc"))
    assert ds.dvfs.stock == {"sm_clock": 1980, "power_limit": 700.0, "is_stock": True}
    hr = ds.dvfs.headroom(slack=0.05)
    assert bool(hr["feasible"].all())
    assert "energy_ratio_equal_latency" in ds.dvfs.compare()
    vs = ds.dvfs.headroom(mode="vs-baseline")
    assert float(vs["chosen_sm_clock"].sel(batch=1, drafter="eagle3", corpus="code")) < 1980


def test_python_api_reads_slack_and_folders_as_the_cli_does(small_sweep: Path) -> None:
    """A sweep folder opens as its cube; `slack` reads "5%" as the CLI's --slack does, and a
    slack beside an SLO is refused with the CLI's message."""
    import dvfs
    from dvfs.errors import AnalysisError

    ds = dvfs.open_cube(str(small_sweep))
    assert ds.identical(dvfs.open_cube(str(small_sweep / "cube.nc")))
    assert ds.dvfs.headroom(slack="5%").identical(ds.dvfs.headroom(slack=0.05))
    args = ["headroom", str(small_sweep), "--slo", "tpot_p50<=50ms", "--slack", "5%"]
    refusal = CliRunner().invoke(cli, args)
    assert refusal.exit_code == 2, refusal.output
    cli_refusal = refusal.output
    with pytest.raises(AnalysisError) as refused:
        ds.dvfs.headroom(slo="tpot_p50<=50ms", slack=0.05)
    assert str(refused.value) in " ".join(cli_refusal.split())
    for bad, says in (("lots", "cannot read slack"), (-0.1, "negative"), (5, "ambiguous")):
        with pytest.raises(AnalysisError, match=says):
            ds.dvfs.headroom(slack=bad)  # type: ignore[arg-type]


def test_cap_plan_and_gpu_info_refuse_bad_input_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    for content in ("[]", '{"schema": "dvfs.headroom/1"}', "not json"):
        bad.write_text(content)
        result = CliRunner().invoke(
            cli, ["cap", "plan", str(bad), "--batch", "1", "--drafter", "x"]
        )
        assert result.exit_code == 2, result.output
        assert "headroom" in result.output and "Traceback" not in result.output
    twin = CliRunner().invoke(cli, ["gpu", "info", "GPU-abc", "--twin", "h100-sxm"])
    assert twin.exit_code == 2 and "by index" in twin.output


def test_gpu_list_on_the_twin_says_it_has_a_gpu_at_every_index() -> None:
    """`gpu list --twin` showed one GPU, yet `gpu info 5 --twin` and `sweep --gpus 99` on the
    twin ran: the twin has a GPU at every index, each its own UUID, as `gpu info` shows; the
    list says it lists GPU 0 and how to name the others (on stderr: --json stays JSON)."""
    runner = CliRunner()
    listed = runner.invoke(cli, ["gpu", "list", "--twin", "h100-sxm", "--json"])
    assert listed.exit_code == 0, listed.output
    [row] = json.loads(listed.stdout)
    said = " ".join(listed.stderr.split())
    assert "a GPU at every index" in said and "this lists GPU 0" in said, said
    assert "--twin h100-sxm" in said
    info = runner.invoke(cli, ["gpu", "info", "5", "--twin", "h100-sxm", "--json"])
    assert info.exit_code == 0, info.output
    [five] = json.loads(info.stdout)
    assert five["index"] == 5 and five["uuid"] != row["uuid"]


def test_plot_help_names_every_option_its_headroom_points_take() -> None:
    """`dvfs plot --help` said its marked points are headroom's for --slack, --knob and
    --confidence, while --quantile and --metric set them too (README lists all five): its
    text names every option but the figures' folder and format."""
    from dvfs.cli.analysis import plot

    helped = CliRunner().invoke(cli, ["plot", "--help"])
    assert helped.exit_code == 0, helped.output
    said = " ".join(helped.output.split("Options:")[0].split())
    options = [p.opts[-1] for p in plot.params if p.name not in ("cube_path", "out_dir", "fmt")]
    assert len(options) == 5
    assert all(option in said for option in options), (options, said)


def test_too_few_prompts_are_caught_before_anything_runs(tmp_path: Path) -> None:
    from conftest import SMALL_CAMPAIGN, replace_block, write

    campaign = write(
        tmp_path / "big.toml", replace_block(SMALL_CAMPAIGN, "batch = [1, 8]", "batch = [1, 128]")
    )
    dry = CliRunner().invoke(cli, ["sweep", str(campaign), "--dry-run"])
    assert dry.exit_code == 2 and "batch 128 needs 128" in dry.output
    # what to do, as the sweep says it (the dry run and the doctor named the shortfall only)
    advice = "Lower the batch sizes, widen workload.input_tokens, or add prompts"
    assert advice in " ".join(dry.output.split())
    run_ = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--out", str(tmp_path / "o"), "--no-progress"]
    )
    assert run_.exit_code == 2 and "batch 128 needs 128" in run_.output  # as its dry run
    assert advice in run_.output
    doctor = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", str(tmp_path / "o")])
    assert doctor.exit_code == 2 and advice in " ".join(doctor.output.split())
    assert not (tmp_path / "o" / "cube.nc").exists()
    # A closed-loop pool of workload.pool_size needs that many prompts at any batch size: the
    # setting to lower is the pool's (lowering the batch sizes, as it said, changed nothing).
    pool = write(
        tmp_path / "pool.toml",
        replace_block(
            SMALL_CAMPAIGN, "[workload]\n", '[workload]\nmode = "closed-loop"\npool_size = 500\n'
        ),
    )
    for argv in (["sweep", str(pool), "--dry-run"], ["doctor", str(pool)]):
        said = CliRunner().invoke(cli, argv)
        line = " ".join(said.output.split())
        assert said.exit_code == 2 and "needs 500" in line, said.output
        assert "Lower workload.pool_size" in line and "Lower the batch sizes" not in line


def test_compare_keeps_the_accept_length_row_of_a_drafter_with_no_valid_cell(
    small_sweep: Path, tmp_path: Path
) -> None:
    """The small sweep with every cell of its only speculative drafter (eagle3) flagged: the
    accept-length table vanished unsaid. It keeps eagle3's row ("-" per corpus), as the
    acceptance figure does, and a note says why; the JSON names the drafter."""
    from dvfs.cube import open_analysable, write_cube

    cube = open_analysable(small_sweep).load()
    cube["valid"] = cube["valid"].where(cube["drafter"] != "eagle3", 0)
    path = write_cube(cube, tmp_path / "flagged.nc")
    doc = json.loads(run("compare", str(path), "--json").output)
    assert doc["acceptance"] == [] and doc["acceptance_no_valid_cell"] == ["eagle3"]
    markdown = run("compare", str(path), "--markdown").output
    table = markdown.split("### Mean accept length", 1)[1].split("###", 1)[0]
    assert "| eagle3 | - | - |" in table, table
    assert "'eagle3' has no valid cell, so no accept length" in " ".join(markdown.split())
    assert (
        json.loads(run("compare", str(small_sweep), "--json").output)["acceptance_no_valid_cell"]
        == []
    )


def test_compare_names_a_drafter_with_valid_cells_but_no_accept_length(
    small_sweep: Path, tmp_path: Path
) -> None:
    """The small sweep's only speculative drafter (eagle3) valid everywhere but its cells
    recording no accept length (a server that reported no speculation counters), or valid
    cells only beside an invalid repeat at every setting (each left out whole): the
    accept-length table vanished unsaid, as did eagle3's row of the acceptance figure. The
    table keeps its row of "-", a note says why, and the JSON names it."""
    from dvfs.cube import open_analysable, write_cube

    cube = open_analysable(small_sweep).load()
    eagle3 = cube["drafter"] == "eagle3"
    unrecorded = cube.copy()
    unrecorded["accept_length"] = cube["accept_length"].where(~eagle3)
    flagged = cube.copy()  # repeat 1 of eagle3 invalid everywhere: no setting usable
    flagged["valid"] = cube["valid"].where(~(eagle3 & (cube["repeat"] == 1)), 0)
    for name, edited, key, said in (
        ("unrecorded", unrecorded, "acceptance_not_recorded", "none records an accept length"),
        ("flagged", flagged, "acceptance_none_usable", "every setting it was measured at has"),
    ):
        path = write_cube(edited, tmp_path / f"{name}.nc")
        doc = json.loads(run("compare", str(path), "--json").output)
        assert doc["acceptance"] == [] and doc[key] == ["eagle3"], doc
        assert doc["acceptance_no_valid_cell"] == []
        markdown = run("compare", str(path), "--markdown").output
        table = markdown.split("### Mean accept length", 1)[1].split("###", 1)[0]
        assert "| eagle3 | - | - |" in table, table
        text = " ".join(markdown.split())
        assert f"'eagle3' has valid cells, but {said}" in text, text
    doc = json.loads(run("compare", str(small_sweep), "--json").output)
    assert doc["acceptance_not_recorded"] == doc["acceptance_none_usable"] == []


def test_compare_says_a_drafter_not_run_yet_in_a_partial_cube_is_measured_by_resuming(
    small_sweep: Path, tmp_path: Path
) -> None:
    """The small sweep with none of its speculative drafter's (eagle3) cells measured yet: its
    accept-length note says they are not measured yet and points to the partial cube note
    (what measures them), as the "no data:" note does. Before, it said eagle3 "has no valid
    cell" and pointed to `dvfs cube info` for the flags."""
    from dvfs.cube import open_analysable, write_cube

    cube = open_analysable(small_sweep).load()
    eagle = cube["drafter"] == "eagle3"
    for name in ("energy_per_token_j", "tpot_ms", "valid", "accept_length"):
        cube[name] = cube[name].where(~eagle)
    cube["cell_status"] = cube["cell_status"].where(~eagle, 0)
    path = write_cube(cube, tmp_path / "partial.nc")
    said = " ".join(run("compare", str(path), "--markdown").output.split())
    assert "partial cube: " in said, said
    note = said.split("accept length: 'eagle3'", 1)[1]
    assert note.startswith(
        " has no valid cell yet, so no accept length (- in its row): its cells are not measured"
        " yet (the partial cube note above says what measures them) or flagged invalid"
    ), note
