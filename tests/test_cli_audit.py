"""Findings of the CLI audit, end to end through the CLI on small twin campaigns: a GPU merged
twice, per-GPU figure folders that collide, `doctor` passing an output folder `sweep` refuses,
`demo` pointing at an option it lacked, and options whose conflicting or repeated values were
taken silently."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

import click
import pytest
import xarray as xr
from click.testing import CliRunner, Result
from conftest import SMALL_EXACT, TINY, copy_sweep, replace_block, write
from hypothesis import given
from hypothesis import strategies as st
from test_journal import assert_one_line_error
from test_plots import TARGET, small_cube

from dvfs.cli import cli
from dvfs.cube import open_cube
from dvfs.plots import gpu_folders, plot_all


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def test_merge_refuses_one_gpu_in_two_cubes(tiny_sweep: Path, shared_run, tmp_path: Path) -> None:
    """A one-GPU cube and a two-GPU fleet cube that holds the same GPU: their labels differ
    ("uuid0" against "uuid0,uuid1"), the GPU is the same, so the merge would show it twice."""
    pair = shared_run(TINY, "gpus-0-1", "--gpus", "0-1")
    [uuid] = open_cube(tiny_sweep / "cube.nc").attrs["gpu_uuids"].split(",")
    assert uuid in open_cube(pair / "cube.nc").attrs["gpu_uuids"].split(",")
    merged = tmp_path / "merged.nc"
    for first, second in ((tiny_sweep, pair), (pair, tiny_sweep)):
        result = invoke("cube", "merge", str(first), str(second), "-o", str(merged))
        assert_one_line_error(
            result, 2, uuid, str(first / "cube.nc"), str(second / "cube.nc"), "different GPUs"
        )
    assert not merged.exists()


def test_plot_folders_of_gpus_sharing_a_prefix_stay_apart(tmp_path: Path) -> None:
    """Twin and real UUIDs may share their first characters: each GPU keeps its own figures."""
    labels = [
        "GPU-47dfcd23-120e-9eab-3043-5d0ea1215572",
        "GPU-47dfcd23-120e-9eab-3043-5d0ea1215573",
        "GPU-47dfcd23-1,GPU-47dfcd23-2",  # a fleet cube's joined UUIDs
    ]
    # Without accept lengths and timelines: three figures a GPU are as many as the folders need.
    one = small_cube([1], corpora=("code",)).drop_vars(
        ["accept_length", "timeline_t_s", "timeline_power_w"]
    )
    merged = xr.concat([one, one, one], dim=xr.DataArray(labels, dims="gpu"))
    paths = plot_all(merged, tmp_path / "p", fmt="svg", target=TARGET)
    folders = {p.parent.name for p in paths}
    assert folders == {labels[0], labels[1], "GPU-47dfcd23-1+GPU-47dfcd23-2"}
    assert len(paths) == len(set(paths)) == 9  # three figures of one corpus, per GPU
    assert all(p.exists() for p in paths)


@given(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=6, unique=True))
def test_gpu_folder_names_are_distinct_plain_names(labels: list[str]) -> None:
    folders = gpu_folders(labels)
    assert len(set(folders)) == len(labels)
    for folder in folders:
        assert folder not in ("", ".", "..") and not folder.startswith(".")
        assert all(c.isascii() and (c.isalnum() or c in "._+-") for c in folder)


def _doctor_checks(campaign: Path, out: Path) -> tuple[int, dict[str, dict[str, str]]]:
    result = invoke("doctor", str(campaign), "--out", str(out), "--json")
    return result.exit_code, {c["name"]: c for c in json.loads(result.stdout)}


def test_doctor_says_a_read_only_file_system_not_permission_denied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output folder on a read-only mount (as statvfs and access(2) report one, even to
    root): the doctor said "Permission denied; choose a folder you can write to", sending the
    user to fix permissions that are fine."""
    tiny = write(tmp_path / "tiny.toml", TINY)
    mount = tmp_path / "mnt"
    mount.mkdir()
    real_statvfs = os.statvfs

    def read_only_under_mount(path: Any) -> os.statvfs_result:
        got = real_statvfs(path)
        where = Path(path).absolute()
        if where == mount or mount in where.parents:
            fields = list(got)
            fields[8] |= os.ST_RDONLY  # f_flag
            return os.statvfs_result(fields)
        return got

    real_access = os.access

    def access(path: Any, mode: int, **kwargs: Any) -> bool:
        where = Path(path).absolute()
        if mode & os.W_OK and (where == mount or mount in where.parents):
            return False  # EROFS
        return real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "statvfs", read_only_under_mount)
    monkeypatch.setattr(os, "access", access)
    code, checks = _doctor_checks(tiny, mount / "out")
    assert code == 1 and checks["output folder"]["status"] == "fail", checks
    assert "read-only" in checks["output folder"]["detail"].lower()
    assert "permission" not in checks["output folder"]["detail"].lower()


def test_doctor_says_an_empty_journal_is_started_afresh(tmp_path: Path) -> None:
    """A folder whose journal.jsonl is empty: doctor said it "holds a journal to resume",
    though the sweep starts it afresh (it has no header to resume from)."""
    tiny = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.jsonl").write_text("")
    code, checks = _doctor_checks(tiny, out)
    detail = checks["output folder"]["detail"]
    assert code == 0 and checks["output folder"]["status"] == "ok", checks
    assert "resume" not in detail and "empty journal" in detail and "afresh" in detail, detail


def test_doctor_says_a_mixed_fleets_folder_holds_its_models_journals(
    tiny_exact_run: Any, tmp_path: Path
) -> None:
    """A mixed fleet's folder (a journal per GPU model in `gpu-*/`): doctor said it was
    "usable", where a single run's folder with a journal "holds a journal to resume"."""
    from conftest import MIXED_FLEET

    out = tiny_exact_run("mixed")
    campaign = out.parent / "campaign.toml"
    result = invoke("doctor", str(campaign), *MIXED_FLEET, "--out", str(out), "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    detail = checks["output folder"]["detail"]
    assert result.exit_code == 0 and checks["output folder"]["status"] == "ok", checks
    assert "a journal per GPU model to resume" in detail, detail
    for journal in sorted(out.glob("gpu-*/journal.jsonl")):
        assert journal.parent.name in detail, detail
    # each model's journal empty: started afresh, as one run's empty journal is
    empty = tmp_path / "empty"
    for journal in sorted(out.glob("gpu-*/journal.jsonl")):
        (empty / journal.parent.name).mkdir(parents=True)
        (empty / journal.parent.name / "journal.jsonl").write_text("")
    result = invoke("doctor", str(campaign), *MIXED_FLEET, "--out", str(empty), "--json")
    detail = {c["name"]: c for c in json.loads(result.stdout)}["output folder"]["detail"]
    assert "resume" not in detail and "empty" in detail and "afresh" in detail, detail


def test_doctor_fails_an_output_folder_that_sweep_refuses(tiny_sweep: Path, tmp_path: Path) -> None:
    tiny = write(tmp_path / "tiny.toml", TINY)
    other = write(tmp_path / "wide.toml", SMALL_EXACT.replace('name = "small"', 'name = "wide"'))
    # Resuming the campaign's own folder is fine.
    code, checks = _doctor_checks(tiny, tiny_sweep)
    assert code == 0 and checks["output folder"]["status"] == "ok", checks
    assert "a journal to resume" in checks["output folder"]["detail"]
    # A folder under a regular file.
    (tmp_path / "afile").write_text("")
    under_file = tmp_path / "afile" / "x"
    code, checks = _doctor_checks(tiny, under_file)
    assert code == 1 and checks["output folder"]["status"] == "fail"
    assert "part of that path is a file" in checks["output folder"]["detail"]
    # ... and no disk check that calls the file a place with free space.
    assert checks["disk"]["status"] == "fail", checks["disk"]
    assert "unusable" in checks["disk"]["detail"] and "free at" not in checks["disk"]["detail"]
    swept = invoke("sweep", str(tiny), "--out", str(under_file), "--no-progress")
    assert swept.exit_code == 1 and "part of that path is a file" in swept.stderr
    # Another campaign's journal: the doctor's failure is the sweep's refusal, word for word.
    folder = copy_sweep(tiny_sweep, tmp_path / "other")
    code, checks = _doctor_checks(other, folder)
    # (the doctor adds that --fresh is the sweep's, which it names)
    detail = checks["output folder"]["detail"].split(" (--fresh is the sweep's: ")[0]
    assert code == 1 and checks["output folder"]["status"] == "fail"
    assert "another campaign, 'small'" in detail and "not 'wide'" in detail
    swept = invoke("sweep", str(other), "--out", str(folder), "--no-progress")
    assert_one_line_error(swept, 1, detail)
    # A folder another sweep holds.
    fd = os.open(folder / "sweep.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, checks = _doctor_checks(tiny, folder)
    finally:
        os.close(fd)
    assert code == 1 and "in use by another dvfs sweep" in checks["output folder"]["detail"]


def test_doctor_reports_every_check_beside_a_damaged_journal(tmp_path: Path) -> None:
    """A folder whose journal is damaged fails the output folder check with the sweep's
    refusal; the doctor still runs and reports its other checks (it stopped at the journal
    with one error line, and `--json` printed no JSON)."""
    tiny = write(tmp_path / "tiny.toml", TINY)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "journal.jsonl").write_text("garbage\n")
    code, checks = _doctor_checks(tiny, folder)
    assert code == 1, checks
    assert checks["output folder"]["status"] == "fail", checks
    assert "not a dvfs journal" in checks["output folder"]["detail"]
    assert checks["campaign"]["status"] == "ok" and checks["gpu"]["status"] == "ok", checks
    # said once, by the folder's check: the corpora are counted as a sweep starting over
    # counts them (it failed "corpora: ... not a dvfs journal" too, their counts unsaid)
    assert checks["corpora"]["status"] == "ok", checks
    assert "code (" in checks["corpora"]["detail"], checks
    assert "disk" in checks


def test_doctor_help_states_both_failure_exit_codes(tmp_path: Path) -> None:
    text = " ".join(invoke("doctor", "--help").output.split())
    assert "1 when a check failed" in text and "2 when the campaign file" in text
    bad = write(tmp_path / "bad.toml", TINY.replace("[workload]", "[workload]\nbogus_key = 1"))
    assert invoke("doctor", str(bad)).exit_code == 2


def test_demo_offers_its_own_fresh_for_another_campaigns_folder(
    tiny_sweep: Path, tmp_path: Path
) -> None:
    folder = copy_sweep(tiny_sweep, tmp_path / "t1")
    result = invoke("demo", "--out", str(folder), "--no-progress")
    assert_one_line_error(result, 1, "another campaign, 'small'", "not 'demo'", "--fresh")
    assert "--fresh" in invoke("demo", "--help").output
    assert (folder / "journal.jsonl").read_bytes() == (tiny_sweep / "journal.jsonl").read_bytes()


DEMO_LIKE = """
[campaign]
name = "demo"
[gpu]
backend = "twin"
profile = "h100-sxm"
devices = [0]
[knobs]
sm_clock = [1980, 1830]
power_limit = [700, 400]
[engine]
backend = "twin"
model = "meta-llama/Llama-3.1-8B-Instruct"
[drafters.none]
algorithm = "none"
[drafters.ngram]
algorithm = "NGRAM"
num_draft_tokens = 8
[workload]
batch = [1]
corpora = ["code", "conversation"]
output_tokens = 256
"""


def demo_like(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dvfs demo` sweeps DEMO_LIKE, a small demo-shaped campaign, in place of the demo's own,
    and draws no figures."""
    import dvfs.campaign
    import dvfs.plots

    small = write(tmp_path / "demo.toml", DEMO_LIKE)
    load = dvfs.campaign.load_campaign
    monkeypatch.setattr(dvfs.campaign, "load_campaign", lambda path: load(small))
    monkeypatch.setattr(dvfs.plots, "plot_all", lambda *args, **kw: [])


def test_demo_tables_say_what_their_marks_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `dvfs demo`'s headroom tables showed `≥300` with no line saying what it means (a lower
    # bound the grid cuts off, and what to extend), which `dvfs headroom` prints under the same
    # table. A small demo-shaped campaign stands in for the demo's (its figures not drawn).
    demo_like(tmp_path, monkeypatch)
    result = invoke("demo", "--out", str(tmp_path / "out"), "--no-progress")
    assert result.exit_code == 0, result.output
    assert "≥" in result.stdout
    said = " ".join(result.stdout.split())
    assert said.count("≥: the lowest setting swept still meets the target") == 2, said
    assert "extend knobs." in said and "downward to find where it stops" in said


def test_demo_notes_give_the_demos_own_command_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `dvfs demo` prints headroom's notes under its tables; with cells failed (a drafter's
    # server that would not start) they said to "run the same `dvfs sweep` command again",
    # a command the demo's user never typed (no campaign file of theirs): the demo's own.
    from dvfs.engines.twin import TwinEngine
    from dvfs.errors import EngineError

    demo_like(tmp_path, monkeypatch)
    start = TwinEngine.start

    def failing(self: TwinEngine, drafter: Any) -> Any:
        if drafter.name == "ngram":
            raise EngineError("the server would not start (test)")
        return start(self, drafter)

    monkeypatch.setattr(TwinEngine, "start", failing)
    out = tmp_path / "out"
    result = invoke("demo", "--out", str(out), "--no-progress")
    assert result.exit_code == 5, result.output
    said = " ".join(result.stdout.split())
    assert "partial cube" in said, said
    assert "dvfs sweep" not in said, said
    assert f"run `dvfs demo --out {out}` again without --fresh" in said, said


def test_demo_closing_line_keeps_its_commands_whole_in_a_pipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `dvfs demo`'s closing line ("N figures in OUT/plots; next: dvfs headroom OUT --help, dvfs
    # compare OUT, dvfs cube info OUT") was wrapped at the console's width in a pipe or a log,
    # a command broken across two lines ("dvfs \ncube info"); a line of prose is left whole
    # there, as dvfs headroom's are.
    demo_like(tmp_path, monkeypatch)
    out = tmp_path / "a-demo-folder-with-a-long-name" / "[out]"
    result = invoke("demo", "--out", str(out), "--no-progress")
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.stdout.splitlines() if "figures in" in x]
    assert line.endswith(
        f"; next: dvfs headroom {out} --help, dvfs compare {out}, dvfs cube info {out}"
    ), result.stdout


def test_sweep_refuses_json_without_dry_run_and_an_empty_gpu_list(tmp_path: Path) -> None:
    tiny = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    result = invoke("sweep", str(tiny), "--json", "--out", str(out))
    assert result.exit_code == 2 and "--json go with --dry-run" in result.output
    result = invoke("sweep", str(tiny), "--gpus", "", "--out", str(out))
    assert result.exit_code == 2 and "--gpus is empty" in result.output
    assert not out.exists()


def test_cap_plan_refuses_a_repeated_single_valued_option(
    small_sweep: Path, tmp_path: Path
) -> None:
    doc = tmp_path / "headroom.json"
    assert invoke("headroom", str(small_sweep), "--vs-baseline", "-o", str(doc)).exit_code == 0
    plan = ("cap", "plan", str(doc), "--batch", "8", "--drafter", "eagle3")
    result = invoke(*plan, "--corpus", "code", "--corpus", "conversation")
    assert result.exit_code == 2
    assert "--corpus code --corpus conversation" in result.output
    result = invoke("cap", "plan", str(doc), "--batch", "8", "--batch", "1", "--drafter", "none")
    assert result.exit_code == 2 and "--batch takes one value" in result.output
    one = invoke(*plan, "--corpus", "code")
    assert one.exit_code == 0, one.output
    assert 'corpus = "code"' in one.stdout
    default = invoke(*plan)
    assert default.exit_code == 0, default.output
    assert 'corpus = "worst-case"' in default.stdout


def test_a_comma_list_to_a_filter_says_to_repeat_the_option(small_sweep: Path) -> None:
    """`--drafter none,eagle3` and `--batch 1,8` look like lists; each option takes one value
    and repeats for several, and the refusal says how."""
    named = invoke("headroom", str(small_sweep), "--drafter", "none,eagle3")
    assert named.exit_code == 2
    assert "repeat the option: --drafter none --drafter eagle3" in named.output
    sizes = invoke("headroom", str(small_sweep), "--batch", "1,8")
    assert sizes.exit_code == 2 and "(--batch 1 --batch 8)" in sizes.output
    both = invoke("headroom", str(small_sweep), "--batch", "1", "--batch", "8", "--json")
    assert both.exit_code == 0, both.output
    assert {row["batch"] for row in json.loads(both.output)["rows"]} == {1, 8}


def test_doctor_exits_2_where_sweep_refuses_the_campaign_as_invalid(tmp_path: Path) -> None:
    """Corpora that cannot fill the largest batch make the campaign invalid: `dvfs sweep`
    refuses it with exit 2, and the preflight says the same, not exit 1 as for a machine
    problem."""
    narrow = replace_block(TINY, "batch = [1, 8]", "batch = [1, 500]")
    campaign = write(tmp_path / "narrow.toml", narrow)
    swept = invoke("sweep", str(campaign), "--out", str(tmp_path / "o"), "--no-progress")
    assert swept.exit_code == 2, swept.output
    code, checks = _doctor_checks(campaign, tmp_path / "o")
    assert code == 2 and checks["corpora"]["status"] == "fail", checks
    assert "batch 500 needs 500" in checks["corpora"]["detail"]


def test_doctor_fails_a_folder_whose_lock_is_a_folder_as_the_sweep_does(tmp_path: Path) -> None:
    """A folder named sweep.lock: the sweep refuses the output folder (it cannot open its
    lock), and the doctor said "ok" (it looked at the lock only when it was a regular file)."""
    tiny = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    (out / "sweep.lock").mkdir(parents=True)
    swept = invoke("sweep", str(tiny), "--out", str(out), "--no-progress")
    assert_one_line_error(swept, 1, "sweep.lock", "Is a directory")
    code, checks = _doctor_checks(tiny, out)
    assert code == 1 and checks["output folder"]["status"] == "fail", checks
    assert checks["output folder"]["detail"] == swept.stderr.strip().removeprefix("Error: ")


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-null"])
def test_doctor_fails_a_folder_whose_lock_is_no_regular_file_as_the_sweep_does(
    tmp_path: Path, kind: str
) -> None:
    """A FIFO (or a link to /dev/null) named sweep.lock: the sweep took its flock and then
    refused the folder as "cannot write sweep.lock: Invalid argument" (no pid can be written
    there), and the doctor, which opens and flocks it as the sweep does, said "ok". Both
    refuse it now, in one line naming it."""
    tiny = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    out.mkdir()
    if kind == "fifo":
        os.mkfifo(out / "sweep.lock")
    else:
        (out / "sweep.lock").symlink_to(os.devnull)
    swept = invoke("sweep", str(tiny), "--out", str(out), "--no-progress")
    assert_one_line_error(swept, 1, "sweep.lock", "no regular file")
    code, checks = _doctor_checks(tiny, out)
    assert code == 1 and checks["output folder"]["status"] == "fail", checks
    assert checks["output folder"]["detail"] == swept.stderr.strip().removeprefix("Error: ")


def _options_without_help(command: click.Command, path: str, parent: click.Context | None):
    """(command path, option) for each option of `command` and its subcommands, lazy ones
    included, that `--help` lists with no words."""
    ctx = click.Context(command, parent=parent, info_name=path.rsplit(" ", 1)[-1])
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden and not param.help:
            yield path, "/".join(param.opts)
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _options_without_help(sub, f"{path} {name}", ctx)


def test_every_option_says_what_it_does_in_help() -> None:
    """`--json` of `cap show`, `gpu list`, `gpu info`, `corpus list`, `corpus show` and
    `doctor`, and `plot --format`, were listed by `--help` with no words (what the JSON holds,
    what the format is of): every option of every command has help text."""
    assert list(_options_without_help(cli, "dvfs", None)) == []
