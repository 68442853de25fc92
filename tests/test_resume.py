"""Resuming a sweep: operational settings may change between sessions (each session records its
own), measured settings may not; failed cells are retried; one sweep per output folder."""

from __future__ import annotations

import fcntl
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from conftest import TINY, copy_sweep, replace_block, write
from test_journal import assert_one_line_error

from dvfs.cli import cli
from dvfs.cube import STATUS_OK, open_cube
from dvfs.errors import EngineError
from dvfs.measure.journal import read_records
from dvfs.measure.runner import Runner


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def sweep(campaign: Path, out: Path, *extra: str) -> Result:
    return invoke("sweep", str(campaign), "--out", str(out), "--no-progress", *extra)


def _interrupt_after(journal: Path, cells: int) -> None:
    """Cut the journal back to its first `cells` cell records, as if the sweep had been killed."""
    kept, seen = [], 0
    for record in read_records(journal):
        if record["type"] == "cell":
            seen += 1
            if seen > cells:
                continue
        kept.append(record)
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))


OPERATIONAL = replace_block(
    replace_block(TINY, "idle_s = 1.0\n", "idle_s = 1.0\nretries = 5\n"),
    'model = "llama-3.1-8b"\n',
    'model = "llama-3.1-8b"\n\n[engine.sglang]\nrequest_timeout_s = 600\n'
    'stall_timeout_s = 300\nserver_command = ["/opt/sglang/bin/python", "-m", '
    '"sglang.launch_server"]\nenv = { SGLANG_LOG_LEVEL = "debug" }\n',
)


def test_a_resume_may_change_operational_settings_and_journals_each_session(
    tiny_sweep: Path, tmp_path: Path
) -> None:
    out = copy_sweep(tiny_sweep, tmp_path / "out")  # a sweep of TINY
    journal = out / "journal.jsonl"
    _interrupt_after(journal, 6)
    # Longer timeouts, more retries, another server command and environment: same measurement.
    second = write(tmp_path / "tiny.toml", OPERATIONAL)
    resumed = sweep(second, out)
    assert resumed.exit_code == 0, resumed.output
    assert "10 cell(s) measured" in resumed.output
    sessions = [r for r in read_records(journal) if r["type"] == "session"]
    assert len(sessions) == 2
    before, after = (s["settings"] for s in sessions)
    assert before["measurement.retries"] == 2 and after["measurement.retries"] == 5
    assert before["engine.sglang.request_timeout_s"] == 120.0
    assert after["engine.sglang.request_timeout_s"] == 600.0
    assert after["engine.sglang.env"] == {"SGLANG_LOG_LEVEL": "debug"}
    assert after["engine.sglang.server_command"][0] == "/opt/sglang/bin/python"
    assert all(s["started"] and s["dvfs_version"] for s in sessions)
    assert (open_cube(out / "cube.nc")["cell_status"].values == STATUS_OK).all()


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("output_tokens = 64", "output_tokens = 32", "workload.output_tokens: 64 -> 32"),
        ("settle_s = 1.0", "settle_s = 5.0", "knobs.settle_s: 1.0 -> 5.0"),
        ("sm_clock = [1980, 1005]", "sm_clock = [1980, 1500]", "knobs.sm_clock"),
        ("num_steps = 3", "num_steps = 2", "drafters[eagle3].num_steps: 3 -> 2"),
    ],
)
def test_a_resume_refuses_a_measured_change_and_names_it(
    tiny_sweep: Path, tmp_path: Path, old: str, new: str, named: str
) -> None:
    out = copy_sweep(tiny_sweep, tmp_path / "out")
    text = replace_block(TINY, old, new)
    if "num_steps = 2" in new:
        text = replace_block(text, "num_draft_tokens = 4", "num_draft_tokens = 3")
    result = sweep(write(tmp_path / "changed.toml", text), out)
    line = assert_one_line_error(result, 1, named, "--fresh", "--out")
    assert "--observe-only" not in line


def test_observe_only_on_a_resume_is_named_as_the_change(tiny_sweep: Path, tmp_path: Path) -> None:
    campaign = write(tmp_path / "tiny.toml", TINY)
    out = copy_sweep(tiny_sweep, tmp_path / "out")
    result = sweep(campaign, out, "--observe-only")
    assert_one_line_error(
        result,
        1,
        "gpu.actuation: true -> false",
        "--observe-only",
        "--fresh",
        notes=("note: --observe-only does not step",),
    )


def _failing_eagle3_at_batch_8(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make eagle3's cells at batch 8 fail (a server answering 500) and return the real
    `Runner.measure`, which a test sets back to retry them."""
    measure = Runner.measure

    def flaky(self: Runner, cell):  # noqa: ANN001
        if cell.batch == 8 and cell.drafter == "eagle3":
            raise EngineError("the server answered 500")
        return measure(self, cell)

    monkeypatch.setattr(Runner, "measure", flaky)
    return measure


def test_failed_cells_exit_5_and_a_rerun_retries_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    measure = _failing_eagle3_at_batch_8(monkeypatch)
    result = sweep(campaign, out)
    assert result.exit_code == 5, result.output
    assert "Traceback" not in result.output
    assert "Finished with 4 failed cell(s)" in result.stderr
    assert "eagle3/code/b8" in result.stderr and "rerun" in result.stderr
    ds = open_cube(out / "cube.nc")  # the cube is still written
    assert int((ds["cell_status"].values != STATUS_OK).sum()) == 4
    monkeypatch.setattr(Runner, "measure", measure)
    again = sweep(campaign, out)
    assert again.exit_code == 0, again.output
    assert "4 cell(s) measured" in again.output
    assert (open_cube(out / "cube.nc")["cell_status"].values == STATUS_OK).all()


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")], ids=["one-gpu", "fleet"])
def test_failed_cells_of_a_fresh_sweep_are_retried_without_fresh(
    gpus: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --fresh sweep that ended with failed cells said "rerun the same command to retry
    them": that command, --fresh and all, moves the journal aside and measures every cell
    again. It says to rerun without --fresh, which retries the failed cells alone."""
    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    measure = _failing_eagle3_at_batch_8(monkeypatch)
    result = sweep(campaign, out, *gpus, "--fresh")
    assert result.exit_code == 5, result.output
    said = " ".join(result.stderr.split())
    assert "Finished with 4 failed cell(s)" in said, said
    assert "rerun the same command without --fresh to retry them" in said, said
    monkeypatch.setattr(Runner, "measure", measure)
    again = sweep(campaign, out, *gpus)  # as told: without --fresh
    assert again.exit_code == 0, again.output
    assert "4 cell(s) measured" in again.output, again.output


def test_a_second_sweep_into_a_busy_folder_refuses(tmp_path: Path) -> None:
    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    out.mkdir()
    with open(out / "sweep.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242\n")
        held.flush()
        result = sweep(campaign, out)
        assert_one_line_error(result, 3, "in use by another dvfs sweep", "pid 4242", "--out")
        assert not (out / "journal.jsonl").exists()
        fresh = sweep(campaign, out, "--fresh")  # --fresh must not move a live journal either
        assert fresh.exit_code == 3
    assert sweep(campaign, out).exit_code == 0  # released


def test_a_sweep_that_opened_a_removed_lock_file_takes_the_folders_lock_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused sweep removes the lock file it made, holding its lock meanwhile. A sweep that
    opened that file just before gets its lock once released, on a file no longer in the
    folder: it must take the folder's lock file anew (here made and held by a third sweep:
    refused, exit 3), never run beside the sweep that holds it."""
    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    out.mkdir()
    lock = out / "sweep.lock"
    lock.write_text("4141\n")
    flock = fcntl.flock
    third = []

    def racing(fd, operation):  # noqa: ANN001
        if not third:  # between the sweep's open and its lock: removed, made and held anew
            lock.unlink()
            held = open(lock, "w")  # noqa: SIM115
            third.append(held)
            flock(held, fcntl.LOCK_EX)
            held.write("4242\n")
            held.flush()
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", racing)
    try:
        result = sweep(campaign, out)
    finally:
        for held in third:
            held.close()
    assert_one_line_error(result, 3, "in use by another dvfs sweep", "pid 4242", "--out")
    assert sorted(p.name for p in out.iterdir()) == ["sweep.lock"]
    assert lock.read_text() == "4242\n"  # the holder's file, left to it


def test_a_lock_file_linking_to_no_file_is_made_where_it_points(tmp_path: Path) -> None:
    """`sweep.lock` a link to a file not there: the lock is made there, as ever (not an
    endless retry between "exists" and "not found")."""
    import threading

    from dvfs.out_folder import out_dir_lock

    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.lock").symlink_to(out / "held")
    taken = threading.Event()

    def take() -> None:
        with out_dir_lock(out):
            taken.set()

    worker = threading.Thread(target=take, daemon=True)
    worker.start()
    worker.join(timeout=60)  # a guard against the endless retry, not a speed bound
    assert taken.is_set() and (out / "held").is_file()


# The lock of a running sweep (named, and dying with it): test_sweep.py's SIGKILL test.


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")], ids=["one-gpu", "fleet"])
def test_a_renamed_campaign_resumes_and_says_the_cube_keeps_the_journals_name(
    gpus: tuple[str, ...], tiny_exact_run: Callable[[str], Path], tmp_path: Path
) -> None:
    """The campaign's name is no part of its hash: a campaign renamed and swept into its
    folder again resumes the journal, and the cube keeps the name (and campaign file) of the
    run that started it. That was accepted without a word, so the new name looked taken; the
    resume now says the cube keeps the journal's name, and how to take the new one. A fleet
    (`--gpus`) says it too, once: it said nothing."""
    out = copy_sweep(tiny_exact_run("one"), tmp_path / "out")
    text = (tiny_exact_run("one").parent / "campaign.toml").read_text(encoding="utf-8")
    campaign = write(
        tmp_path / "renamed.toml", replace_block(text, 'name = "small"', 'name = "renamed"')
    )
    result = CliRunner().invoke(
        cli,
        ["sweep", str(campaign), "--out", str(out), "--no-progress", *gpus],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "0 cell(s) measured" in said, said
    assert said.count("resuming campaign") == 1, said
    assert (
        "resuming campaign 'small''s journal: campaign.name is now 'renamed', but the cube "
        "keeps 'small'" in said
    ), said
    assert "--fresh or into another --out folder" in said
    from dvfs.cube import open_cube

    assert open_cube(out / "cube.nc").attrs["campaign_name"] == "small"
