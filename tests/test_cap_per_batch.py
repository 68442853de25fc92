"""`dvfs cap plan --per-batch`: a per-batch plan from a headroom document, and its file format."""

from __future__ import annotations

import json
import os
import shlex
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hypothesis import given
from hypothesis import strategies as st

from dvfs.caps.planning import plan_per_batch
from dvfs.cli import cli
from dvfs.errors import CapsError
from dvfs.govern.plan import (
    BatchPlan,
    BatchStep,
    Setting,
    dump_plan,
    load_plan,
    parse_plan,
)

REF = {"sm_clock_mhz": 1980, "power_limit_w": 700.0, "is_stock": True}


def row(batch: int, corpus: str, clock: int, limit: float, **extra: object) -> dict:
    return {
        "batch": batch,
        "drafter": extra.pop("drafter", "eagle3"),
        "corpus": corpus,
        "feasible": extra.pop("feasible", True),
        "chosen": {"sm_clock_mhz": clock, "power_limit_w": limit},
        "energy_per_token_j": 0.5,
        "stock_energy_per_token_j": 0.6,
        **extra,
    }


def doc(rows: list[dict], **gpu: object) -> dict:
    return {
        "schema": "dvfs.headroom/1",
        "campaign": "t",
        "gpu": {"name": "NVIDIA H100 80GB HBM3", "uuids": ["GPU-aaaa"], **gpu},
        "target": {"description": "TPOT p50 <= stock + 5%"},
        "knob": "both",
        "reference": REF,
        "rows": rows,
    }


def test_each_batch_gets_its_least_aggressive_setting_across_corpora() -> None:
    plan = plan_per_batch(
        doc(
            [
                row(1, "code", 1005, 300.0),
                row(1, "math", 1200, 250.0),
                row(8, "code", 1500, 700.0),  # limit at stock: not capped
                row(8, "math", 1305, 500.0),
                row(32, "code", 1980, 700.0),  # stock chosen
                row(32, "math", 1980, 700.0),
            ]
        ),
        drafter=None,
        corpus="worst-case",
    )
    assert plan.batches == (1, 8, 32)
    assert [s.setting for s in plan.steps] == [
        Setting(1200, 300.0),
        Setting(1500, None),
        Setting(None, None),
    ]
    assert plan.drafter == "eagle3" and not plan.simulated
    # One corpus: its own setting and energies.
    code = plan_per_batch(doc([row(1, "code", 1005, 300.0)]), drafter="eagle3", corpus="code")
    assert code.steps == (BatchStep(1, Setting(1005, 300.0), 0.5, 0.6),)


def test_a_planned_stock_energy_is_over_the_repeats_its_saving_is_over() -> None:
    """A row whose saving is over fewer repeats than stock's energy (adaptive repeats): the
    plan wrote stock's energy over all its repeats beside the chosen energy over the paired
    ones (0.6 beside 0.5, not the 0.55 the saving divides by)."""
    paired = row(1, "code", 1005, 300.0, paired_stock_energy_per_token_j=0.55)
    plan = plan_per_batch(doc([paired]), drafter="eagle3", corpus="code")
    assert plan.steps == (BatchStep(1, Setting(1005, 300.0), 0.5, 0.55),)


def test_an_infeasible_batch_is_planned_at_stock() -> None:
    plan = plan_per_batch(
        doc([row(1, "code", 1005, 300.0), row(64, "code", 900, 200.0, feasible=False)]),
        drafter="eagle3",
        corpus="code",
    )
    assert plan.steps[1].setting.is_stock and plan.steps[0].setting == Setting(1005, 300.0)


def test_a_batch_whose_saving_is_unknown_is_planned_at_stock(tmp_path: Path) -> None:
    """Batch 8's --slo answer (1305 MHz meets the limit) has no saving: stock had too few
    usable repeats for an energy. `dvfs cap plan` plans no cap there, yet the per-batch plan
    stepped the GPU down to 1305 MHz at batch 8, a setting that may spend more than stock. It
    holds stock there, says why in a note, and a plan of nothing but such batches is refused."""
    unknown = {"saving": None, "stock_energy_per_token_j": None}
    rows = [row(1, "code", 1005, 300.0, saving=0.2), row(8, "code", 1305, 700.0, **unknown)]
    plan = plan_per_batch(doc(rows), drafter="eagle3", corpus="worst-case")
    assert [s.setting for s in plan.steps] == [Setting(1005, 300.0), Setting(None, None)]
    note = plan.meta["saving_unknown"]
    assert note.startswith("batch 8 at stock: the chosen setting's saving there is unknown"), note
    with pytest.raises(CapsError, match="nothing to govern .*batch 8: the chosen setting's sav"):
        plan_per_batch(doc(rows[1:]), drafter="eagle3", corpus="worst-case")
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(doc(rows)))
    said = CliRunner().invoke(cli, ["cap", "plan", str(headroom), "--per-batch"])
    assert said.exit_code == 0, said.output
    assert "Note: batch 8 at stock: the chosen setting's saving there is unknown" in " ".join(
        said.output.split()
    ), said.output
    # a document older than the saving plans the setting, as before
    older = plan_per_batch(doc([row(8, "code", 1305, 700.0)]), drafter="eagle3", corpus="code")
    assert older.steps[0].setting == Setting(1305, None) and older.meta["saving_unknown"] is None


def test_the_drafter_is_chosen_or_must_be_named() -> None:
    rows = [row(1, "code", 1005, 300.0), row(1, "code", 1200, 300.0, drafter="none")]
    with pytest.raises(CapsError, match=r"drafters \['eagle3', 'none'\]: pass --drafter"):
        plan_per_batch(doc(rows), drafter=None, corpus="worst-case")
    assert plan_per_batch(doc(rows), drafter="none", corpus="worst-case").steps[0].setting == (
        Setting(1200, 300.0)
    )
    with pytest.raises(CapsError, match="no headroom rows for drafter 'dflash'"):
        plan_per_batch(doc(rows), drafter="dflash", corpus="worst-case")
    with pytest.raises(CapsError, match="nothing to govern"):
        plan_per_batch(doc([row(1, "code", 1980, 700.0)]), drafter=None, corpus="worst-case")
    with pytest.raises(CapsError, match="not `dvfs headroom --json` output"):
        plan_per_batch({"schema": "x"}, drafter=None, corpus="worst-case")


def test_a_twin_plan_is_simulated_and_names_the_twin_model() -> None:
    plan = plan_per_batch(
        doc([row(1, "code", 1005, 300.0)], backend="twin"), drafter=None, corpus="code"
    )
    assert plan.simulated and plan.measured_on == "NVIDIA H100 80GB HBM3 (twin)"
    text = dump_plan(plan)
    assert "# SIMULATED" in text
    assert parse_plan(tomllib.loads(text), where="x").simulated


settings = st.builds(
    Setting,
    st.none() | st.integers(210, 1980),
    st.none() | st.integers(100, 700).map(float) | st.floats(100, 700, allow_nan=False),
)


@given(
    st.dictionaries(st.integers(1, 512), settings, min_size=1, max_size=8).filter(
        lambda d: not all(s.is_stock for s in d.values())
    ),
    st.sampled_from(["none", "eagle3"]),
)
def test_a_plan_reads_back_as_written(steps: dict[int, Setting], drafter: str) -> None:
    plan = BatchPlan(
        tuple(BatchStep(b, s) for b, s in sorted(steps.items())),
        "NVIDIA H100 80GB HBM3",
        drafter,
        {"measured_on": "NVIDIA H100 80GB HBM3", "drafter": drafter},
    )
    back = parse_plan(tomllib.loads(dump_plan(plan)), where="x")
    assert back.steps == plan.steps and back.drafter == drafter
    assert back.measured_on == plan.measured_on


GOOD = """dvfs_batch_plan = 1
[meta]
measured_on = "NVIDIA H100 80GB HBM3"
drafter = "none"
[[batch]]
batch = 1
sm_clock_mhz = 1200
"""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dvfs_caps = 1\n", "is a caps file .for `dvfs cap apply`., not a per-batch plan"),
        ("x = 1\n", "is not a per-batch plan"),
        (GOOD.replace("= 1\n[meta]", "= 2\n[meta]"), "schema dvfs_batch_plan = 2 is not 1"),
        (GOOD + "power = 3\n", "unknown key.s. power"),
        (GOOD.replace('drafter = "none"\n', ""), "needs drafter"),
        (GOOD + "[[batch]]\nbatch = 1\n", "must increase strictly"),
        (GOOD + "[[batch]]\nbatch = 0\n", "batch must be a positive integer"),
        (GOOD.replace("1200", "true"), "sm_clock_mhz must be a positive integer"),
        (GOOD + "power_limit_w = -5\n", "power_limit_w must be a positive number"),
        (GOOD.replace("sm_clock_mhz = 1200\n", ""), "every step is stock"),
        ("dvfs_batch_plan = 1\n[meta]\nmeasured_on = 'x'\ndrafter = 'none'\n", "needs .*batch"),
        ("dvfs_batch_plan = [", "not valid TOML"),
    ],
)
def test_a_bad_plan_file_is_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "plan.toml"
    path.write_text(text)
    with pytest.raises(CapsError, match=message) as info:
        load_plan(path)
    assert "\n" not in str(info.value)


def test_cap_plan_per_batch_writes_a_plan_that_reads_back(tmp_path: Path) -> None:
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(doc([row(1, "code", 1005, 300.0), row(8, "code", 1500, 700)])))
    out = tmp_path / "plan.toml"
    result = CliRunner().invoke(cli, ["cap", "plan", str(headroom), "--per-batch", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "batch 8: SM clock <= 1500 MHz, power limit stock" in result.output
    plan = load_plan(out)
    assert plan.batches == (1, 8) and plan.meta["target"] == "TPOT p50 <= stock + 5%"
    bad = CliRunner().invoke(cli, ["cap", "plan", str(headroom), "--per-batch", "--batch", "8"])
    assert bad.exit_code == 2 and "takes no --batch" in bad.output
    static = CliRunner().invoke(cli, ["cap", "plan", str(headroom), "--drafter", "eagle3"])
    assert static.exit_code == 2 and "need --batch and --drafter" in static.output
    missing = CliRunner().invoke(
        cli, ["cap", "plan", str(headroom), "--per-batch", "--drafter", "dflash"]
    )
    assert missing.exit_code == 2 and "Traceback" not in missing.output
    assert missing.output.startswith("Error: no headroom rows for drafter 'dflash'")


@pytest.mark.skipif(os.geteuid() != 0, reason="the folder check applies to root only")
def test_as_root_a_plan_written_in_a_users_folder_is_written_not_refused(tmp_path: Path) -> None:
    """`sudo dvfs cap plan --per-batch -o plan.toml` in a user's folder wrote the plan, then
    read it back through root's check of a plan to follow (`dvfs govern` refuses one others
    may replace) and failed, exit 2, 'as root dvfs refuses it', the plan on disk and no
    `wrote` line. Writing a plan is not following one: the text written is what is checked."""
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(doc([row(1, "code", 1005, 300.0)])))
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chown(home, 1, 1)  # a user's own folder
    out = home / "plan.toml"
    result = CliRunner().invoke(cli, ["cap", "plan", str(headroom), "--per-batch", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    assert parse_plan(tomllib.loads(out.read_text()), where="x").batches == (1,)


@pytest.mark.skipif(os.geteuid() != 0, reason="the link check applies to root only")
def test_as_root_an_output_through_a_users_link_is_refused_not_followed(tmp_path: Path) -> None:
    """`sudo dvfs cap plan ... -o ~user/plan.toml`, where the user made that path a link to
    /etc/dvfs/govern-plan.toml (root-only, followed by the governor unit), replaced the
    root-only file with a plan from the user's headroom document: the link's target was
    written. As root, a path through a link another user may point anywhere is refused in one
    line, exit 2, nothing written: a link (to the file, or to a folder above it) in a folder a
    user owns, and a link another user owns in a sticky folder such as /tmp. Root's own link
    in root's folder is still followed, its target replaced and the link kept."""
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(doc([row(1, "code", 1005, 300.0)])))
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o700)
    plan = etc / "govern-plan.toml"
    plan.write_text("root's plan\n")
    plan.chmod(0o600)
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    (home / "plan.toml").symlink_to(plan)
    (home / "etc").symlink_to(etc)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "plan.toml").symlink_to(plan)
    for link in (home / "plan.toml", home / "etc", sticky / "plan.toml"):
        os.chown(link, nobody, nobody, follow_symlinks=False)
    os.chown(home, nobody, nobody)
    for out, link, whose in (
        (home / "plan.toml", home / "plan.toml", f"in {home}, which its owner nobody may write"),
        (home / "etc" / plan.name, home / "etc", f"in {home}, which its owner nobody may write"),
        (sticky / "plan.toml", sticky / "plan.toml", "owned by nobody"),
    ):
        for args in (["--per-batch"], ["--batch", "1", "--drafter", "eagle3"]):
            result = CliRunner().invoke(cli, ["cap", "plan", str(headroom), *args, "-o", str(out)])
            assert result.exit_code == 2, result.output
            [error] = [x for x in result.output.splitlines() if x.startswith("Error:")]
            assert error == (
                f"Error: {out} goes through the symbolic link {link}, {whose}: it may be pointed "
                "at any file; as root dvfs refuses to write through it (name the file itself, "
                "or write in a folder only root can write)"
            )
            assert plan.read_text() == "root's plan\n" and "wrote" not in result.output
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    (mine / "plan.toml").symlink_to(plan)
    result = CliRunner().invoke(
        cli, ["cap", "plan", str(headroom), "--per-batch", "-o", str(mine / "plan.toml")]
    )
    assert result.exit_code == 0, result.output
    assert (mine / "plan.toml").is_symlink()
    assert parse_plan(tomllib.loads(plan.read_text()), where="x").batches == (1,)


@pytest.mark.skipif(os.geteuid() != 0, reason="the link check applies to root only")
def test_as_root_a_path_whose_dot_dot_follows_a_users_link_is_refused(
    tmp_path: Path, monkeypatch
) -> None:
    """The link check read `home/proj/../plan.toml` as `home/plan.toml` (`abspath` drops
    `proj/..` before anything is followed), but the kernel follows the user's link `proj`
    first and `..` from where it points: `sudo dvfs cap plan ... -o home/proj/../plan.toml`,
    `proj` a link to a folder of /etc/dvfs, replaced /etc/dvfs/plan.toml. Refused now, exit
    2; a `..` that follows no link, and a relative path, are written as before."""
    import pwd

    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(doc([row(1, "code", 1005, 300.0)])))
    etc = tmp_path / "etc"
    (etc / "sub").mkdir(parents=True)
    etc.chmod(0o700)
    plan = etc / "plan.toml"
    plan.write_text("root's plan\n")
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "proj").symlink_to(etc / "sub")
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(home / "proj", nobody, nobody, follow_symlinks=False)
    os.chown(home, nobody, nobody)

    def cap_plan(out: str) -> Result:
        return CliRunner().invoke(cli, ["cap", "plan", str(headroom), "--per-batch", "-o", out])

    out = f"{home}/proj/../plan.toml"
    result = cap_plan(out)
    assert result.exit_code == 2, result.output
    assert f"Error: {out} goes through the symbolic link {home / 'proj'}, in {home}" in (
        result.output
    )
    assert plan.read_text() == "root's plan\n"
    for out in (f"{home}/data/../mine.toml", "data/../relative.toml"):
        monkeypatch.chdir(home)
        result = cap_plan(out)
        assert result.exit_code == 0, result.output
    assert (home / "mine.toml").is_file() and (home / "relative.toml").is_file()


@pytest.mark.skipif(os.geteuid() != 0, reason="the link check applies to root only")
def test_as_root_a_report_or_figure_through_a_users_link_is_refused_before_the_work(
    tmp_path: Path,
) -> None:
    """The report's output check (before the work) and its figures, written beside the page,
    refuse a path through a user's link as the file writes do."""
    import pwd

    from dvfs.cli.report import check_output, write_markdown
    from dvfs.errors import OutputRefusedError

    etc = tmp_path / "etc"
    etc.mkdir(mode=0o700)
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    (home / "report.md").symlink_to(etc / "x.md")
    (home / "figures").symlink_to(etc)
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(home, nobody, nobody)
    with pytest.raises(OutputRefusedError, match="goes through the symbolic link"):
        check_output(home / "report.md")
    with pytest.raises(OutputRefusedError, match=f"{home / 'figures'}, in {home}"):
        write_markdown(home / "page.md", "page", {"figures/a.png": b"png"})
    assert not list(etc.iterdir()) and not (home / "page.md").exists()


def test_the_govern_command_it_suggests_can_be_pasted(tmp_path: Path) -> None:
    """The suggested `dvfs govern` command is one line, however long, with its path quoted:
    split over two lines (the console's wrapping) or with a space unquoted, it cannot be run as
    printed."""
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(doc([row(1, "code", 1005, 300.0)])))
    folder = tmp_path / ("a folder with a long name " * 3).strip()
    folder.mkdir()
    out = folder / "plan.toml"
    result = CliRunner().invoke(cli, ["cap", "plan", str(headroom), "--per-batch", "-o", str(out)])
    assert result.exit_code == 0, result.output
    [line] = [x for x in result.output.splitlines() if "dvfs govern --plan" in x]
    argv = shlex.split(line)
    assert argv[:4] == ["dvfs", "govern", "--plan", str(out)]
    assert argv[4:] == ["--url", "http://127.0.0.1:30000", "--dry-run"]


def test_a_swept_cube_gives_a_plan_per_measured_batch(small_sweep: Path, tmp_path: Path) -> None:
    saved = tmp_path / "headroom.json"
    result = CliRunner().invoke(
        cli, ["headroom", str(small_sweep), "--slack", "20%", "--json", "-o", str(saved)]
    )
    assert result.exit_code == 0, result.output
    out = tmp_path / "plan.toml"
    result = CliRunner().invoke(
        cli, ["cap", "plan", str(saved), "--per-batch", "--drafter", "none", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.batches == (1, 8) and plan.simulated and plan.drafter == "none"
    document = json.loads(saved.read_text())
    for step in plan.steps:
        rows = [r for r in document["rows"] if r["batch"] == step.batch and r["drafter"] == "none"]
        if step.setting.sm_clock_mhz is not None:
            assert step.setting.sm_clock_mhz == max(r["chosen"]["sm_clock_mhz"] for r in rows)


@pytest.mark.parametrize(("written", "said"), [("true", "true"), ('"1"', '"1"'), ("2", "2")])
def test_a_plan_of_another_schema_is_refused_as_written_with_the_way_on(
    tmp_path: Path, written: str, said: str
) -> None:
    """`dvfs_batch_plan = true` was taken for schema 1 (Python's True == 1), as a caps file's
    `dvfs_caps = true` was; a quoted "1" was refused "schema '1' is not 1", and the way on,
    `dvfs cap plan --per-batch`, fails pasted (it takes HEADROOM_JSON). Each is refused, as the
    governor reads it, in one line quoting the value as written and the plan command in full."""
    plan = tmp_path / "plan.toml"
    plan.write_text(GOOD.replace("dvfs_batch_plan = 1", f"dvfs_batch_plan = {written}"))
    with pytest.raises(CapsError) as info:
        load_plan(plan)
    line = str(info.value)
    assert f"per-batch plan schema dvfs_batch_plan = {said} is not 1; " in line, line
    assert "write it again with this dvfs's `dvfs cap plan HEADROOM_JSON --per-batch`" in line
    result = CliRunner().invoke(
        cli, ["govern", "--plan", str(plan), "--url", "http://127.0.0.1:9", "--dry-run"]
    )
    assert result.exit_code == 2, result.output
    [told] = result.stderr.strip().splitlines()
    assert f"schema dvfs_batch_plan = {said} is not 1" in told, told


@pytest.mark.parametrize("args", [["--per-batch"], ["--batch", "1", "--drafter", "eagle3"]])
def test_cap_plan_to_a_stream_advises_no_command_on_it(tmp_path: Path, args: list[str]) -> None:
    """`cap plan -o /dev/stdout` advised `dvfs cap apply /dev/stdout --dry-run` (and `dvfs
    govern --plan /dev/stdout`), which reads no caps file: what it wrote went by. Written to a
    stream (here a pipe's /dev/fd/N, as /dev/stdout is one), the plan is written as without
    -o, and no command is advised on the stream."""
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(doc([row(1, "code", 1005, 300.0)])))
    read, write = os.pipe()
    stream = f"/dev/fd/{write}"
    try:
        result = CliRunner().invoke(cli, ["cap", "plan", str(headroom), *args, "-o", stream])
    finally:
        os.close(write)
    with os.fdopen(read, "rb") as pipe:
        written = pipe.read().decode()
    assert result.exit_code == 0, result.output
    assert stream not in result.output, result.output
    assert "dvfs cap apply" not in result.output and "dvfs govern --plan" not in result.output
    assert ("dvfs_batch_plan" if args == ["--per-batch"] else "[[gpu]]") in written, written
