"""The journal's durability policy: every record reaches the OS at once (a killed process
loses nothing), and the disk once per cell on real hardware, in groups on the twin, and always
when the journal closes (normal end, error, signal)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import PYTHON, TINY, TINY_EXACT, replace_block, subprocess_env, write

import dvfs.measure.journal as journal_module
from dvfs.campaign import load_campaign
from dvfs.measure.journal import GROUP_SYNC_S, Journal, SyncPolicy, read_records
from dvfs.measure.plan import Cell
from dvfs.measure.runner import NullProgress
from dvfs.sweep import run_sweep


class FakeTime:
    """A wall clock the test moves: each cell takes `step` seconds."""

    def __init__(self, step: float) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        return self.now


class FsyncLog:
    """Stands in for os.fsync: records the file's size at each call (what reached the disk)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.inodes: list[int] = []

    def __call__(self, fd: int) -> None:
        st = os.fstat(fd)
        self.sizes.append(st.st_size)
        self.inodes.append(st.st_ino)

    def of(self, path: Path) -> list[int]:
        """The sizes synced of the file now at `path` (a file renamed there counts)."""
        ino = path.stat().st_ino
        return [s for s, i in zip(self.sizes, self.inodes, strict=True) if i == ino]


#: A cell's coordinates as the journal holds them (the reader checks them: `_cell_problem`).
CELL = {
    "drafter": "none",
    "repeat": 0,
    "sm_clock_mhz": 1980,
    "power_limit_w": None,
    "batch": 1,
    "corpus": "code",
}


def _cell(i: int) -> dict[str, Any]:
    return {"type": "cell", "key": f"k{i}", "cell": {**CELL, "repeat": i}, "status": "ok"}


def _journal(path: Path, policy: SyncPolicy, time: FakeTime, fsync: FsyncLog) -> Journal:
    return Journal(path, sync=policy, fsync=fsync, monotonic=time)


def _append_cells(journal: Journal, time: FakeTime, n: int) -> None:
    journal.append({"type": "header"})
    for i in range(n):
        time.now += time.step
        journal.append(_cell(i))


def test_the_twin_syncs_in_groups_and_on_close(tmp_path: Path) -> None:
    time, fsync = FakeTime(step=0.01), FsyncLog()
    journal = _journal(tmp_path / "j.jsonl", SyncPolicy.for_clock(virtual=True), time, fsync)
    _append_cells(journal, time, 1000)  # 10 s of cells, 10 ms each
    during = len(fsync.sizes)
    # The header at once, then about one per group_s: not one per cell.
    assert 2 <= during <= 10 / GROUP_SYNC_S + 2
    # Between syncs every record was already readable: written through to the OS.
    assert len(read_records(journal.path)) == 1001
    journal.close()
    assert len(fsync.sizes) == during + 1, "closing syncs the last group"
    assert fsync.sizes[-1] == journal.path.stat().st_size
    journal.close()  # closing twice is harmless and syncs nothing more
    assert len(fsync.sizes) == during + 1


def test_real_hardware_syncs_every_record(tmp_path: Path) -> None:
    time, fsync = FakeTime(step=0.01), FsyncLog()
    journal = _journal(tmp_path / "j.jsonl", SyncPolicy.for_clock(virtual=False), time, fsync)
    _append_cells(journal, time, 50)
    assert len(fsync.sizes) == 51  # the header and each cell
    sizes = [len(line) + 1 for line in journal.path.read_bytes().splitlines()]
    assert fsync.sizes == [sum(sizes[: i + 1]) for i in range(51)], "each after its record"
    journal.close()
    assert len(fsync.sizes) == 51, "nothing left to sync on close"


def test_a_slow_twin_cell_still_syncs_per_record(tmp_path: Path) -> None:
    """The group is bounded in time: cells slower than group_s sync one by one."""
    time, fsync = FakeTime(step=2 * GROUP_SYNC_S), FsyncLog()
    journal = _journal(tmp_path / "j.jsonl", SyncPolicy.for_clock(virtual=True), time, fsync)
    _append_cells(journal, time, 5)
    assert len(fsync.sizes) == 6  # the header and each cell
    journal.close()


def test_the_readme_says_which_twin_records_are_grouped(tmp_path: Path) -> None:
    """README ("How it works") said the twin's journal is fsynced "in one-second groups": only
    its cells are; the header, sessions and servers are synced at once, as on hardware, and
    the journal on close. The README says so now, with the group's span (`GROUP_SYNC_S`)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = " ".join(readme.split("\n## How it works\n", 1)[1].split("\n## ", 1)[0].split())
    assert (
        "(every record on hardware; on the twin the cells in groups, at the first cell "
        f"{GROUP_SYNC_S:g} s of wall time or more after the last fsync, every other record at "
        "once, and the journal on close)"
    ) in section
    time, fsync = FakeTime(step=GROUP_SYNC_S / 100), FsyncLog()
    journal = _journal(tmp_path / "j.jsonl", SyncPolicy.for_clock(virtual=True), time, fsync)
    journal.append({"type": "header"})
    journal.append(_cell(0))
    journal.append({"type": "session"})
    journal.append({"type": "server"})
    journal.append(_cell(1))
    sizes = [len(line) + 1 for line in journal.path.read_bytes().splitlines()]
    assert fsync.sizes == [sizes[0], sum(sizes[:3]), sum(sizes[:4])]  # not after the cells
    journal.close()
    assert fsync.sizes[-1] == sum(sizes)


@pytest.mark.parametrize("policy", [SyncPolicy(), SyncPolicy(group_s=1e9)], ids=str)
def test_sigkill_loses_no_written_record(tmp_path: Path, policy: SyncPolicy) -> None:
    """A process killed right after appending, never having synced its group, kept them all."""
    path = tmp_path / "j.jsonl"
    script = (
        "import os, signal\n"
        "from pathlib import Path\n"
        "from dvfs.measure.journal import Journal, SyncPolicy\n"
        f"j = Journal(Path({str(path)!r}), sync=SyncPolicy(group_s={policy.group_s!r}))\n"
        "j.append({'type': 'header'})\n"
        "for i in range(200):\n"
        f"    j.append({{'type': 'cell', 'key': f'k{{i}}', 'cell': {{**{CELL!r}, 'repeat': i}}, "
        "'status': 'ok'})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([PYTHON, "-c", script], env=subprocess_env(), timeout=60)
    assert done.returncode == -9
    records = read_records(path)
    assert [r["key"] for r in records[1:]] == [f"k{i}" for i in range(200)]


def test_a_twin_sweep_syncs_in_groups_states_it_and_syncs_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsync = FsyncLog()
    monkeypatch.setattr(os, "fsync", fsync)
    # Wall time stands still: no group falls due, whatever the machine's speed.
    monkeypatch.setattr(journal_module, "time", SimpleNamespace(monotonic=lambda: 0.0))
    campaign = load_campaign(write(tmp_path / "tiny.toml", TINY))
    out = tmp_path / "out"
    outcome = run_sweep(campaign, out)
    journal = out / "journal.jsonl"
    records = read_records(journal)
    cells = [r for r in records if r["type"] == "cell"]
    assert len(cells) == outcome.summary.measured == 16
    # The header, the session with the first server (in one write: a run refused at its
    # first server start journals no session) and the second server at once; the 16 cells
    # in one group.
    synced = fsync.of(journal)
    assert len(records) == 20 and len(synced) == 4
    assert synced[-1] == journal.stat().st_size, "the end of the sweep reached the disk"
    cube = out / "cube.nc"
    assert fsync.of(cube) == [cube.stat().st_size], "the cube reached the disk before its rename"
    (session,) = [r for r in records if r["type"] == "session"]
    assert session["journal_sync"] == SyncPolicy.for_clock(virtual=True).describe()


class InterruptAt(NullProgress):
    """Ctrl-C after the n-th cell, as the CLI's signal handler raises it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def advance(self, cell: Cell, status: str) -> None:
        self.n -= 1
        if self.n == 0:
            raise KeyboardInterrupt


def test_an_interrupted_sweep_syncs_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsync = FsyncLog()
    monkeypatch.setattr(os, "fsync", fsync)
    campaign = load_campaign(write(tmp_path / "tiny.toml", TINY))
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(campaign, out, progress=InterruptAt(2))
    journal = out / "journal.jsonl"
    lines = journal.read_bytes().splitlines()
    assert sum(json.loads(line)["type"] == "cell" for line in lines) == 2
    assert fsync.sizes[-1] == journal.stat().st_size, "the signal path synced the last group"


#: TINY_EXACT stepped in flight: eight groups (drafter, batch, repeat) of two levels (the two
#: SM clocks) on the exact twin, whose cells reproduce exactly.
INFLIGHT_TINY = replace_block(TINY_EXACT, "[measurement]\n", '[measurement]\nmode = "in-flight"\n')


def assert_resumed_as_uninterrupted(resumed: Any, out: Path, clean: Path) -> None:
    """A rerun that finished `out` (its CliRunner result `resumed`) made the cube an
    uninterrupted run made in `clean`, by the suite's rule for a resumed cube (energy within
    1e-4: the counter's millijoule steps; a rerun's own server start and idle in `gpu_time_`)."""
    from test_sweep import assert_cubes_equal

    from dvfs.cube import open_cube

    assert resumed.exit_code == 0, resumed.output
    assert_cubes_equal(
        open_cube(out / "cube.nc"),
        open_cube(clean / "cube.nc"),
        energy_rtol=1e-4,
        ignore=("gpu_time_",),
    )


def _signal_after_first_cell_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C right after the run's first cell record reached the OS, as the CLI's handler
    raises it at the next bytecode: the journal notes a record once it is written."""
    note = Journal._note
    seen = {"cells": 0}

    def noted(self: Journal, record: dict[str, Any]) -> None:
        note(self, record)
        if record.get("type") == "cell":
            seen["cells"] += 1
            if seen["cells"] == 1:
                raise KeyboardInterrupt

    monkeypatch.setattr(Journal, "_note", noted)


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")], ids=["one-gpu", "fleet"])
def test_a_signal_between_an_inflight_groups_records_leaves_the_group_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: tuple[str, ...]
) -> None:
    """An in-flight group's levels share their decodes, and its cells were journaled one by
    one: a signal (or a kill) between two of them left some levels in the journal, and the
    resume measured the others as a group of their own, in other decodes (energy per token
    0.5% off, other output tokens and TTFT, on the twin). They are written in one go now (the
    runner's, and a fleet driver's for a worker's shipment), so the resume equals an
    uninterrupted run."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    campaign = write(tmp_path / "inflight.toml", INFLIGHT_TINY)

    def sweep(out: Path) -> Any:
        args = ["sweep", str(campaign), "--out", str(out), "--no-progress", *gpus]
        return CliRunner().invoke(cli, args)

    clean = sweep(tmp_path / "clean")
    assert clean.exit_code == 0, clean.output
    out = tmp_path / "out"
    with monkeypatch.context() as patched:
        _signal_after_first_cell_written(patched)
        stopped = sweep(out)
    assert stopped.exit_code == 130, stopped.output
    cells = [r["cell"] for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    groups = Counter((c["drafter"], c["batch"], c["repeat"]) for c in cells)
    assert groups and set(groups.values()) == {2}, f"a group's two levels, both or none: {groups}"
    if not gpus:  # (a fleet's other worker may ship more on its way out, whole groups too)
        assert len(cells) == 2, "stopped after the first group"
    resumed = sweep(out)
    assert_resumed_as_uninterrupted(resumed, out, tmp_path / "clean")


def _journal_without(source: Path, out: Path, *, drop: int, cut: bool) -> None:
    """`source`'s journal (a finished in-flight sweep's) in a new folder `out`, its first
    group's last `drop` records left out, as an older dvfs (one write per cell) or a power loss
    inside the group's one write left it; `cut`: and every record after them (the run stopped
    there), else the rest kept."""
    lines = (source / "journal.jsonl").read_bytes().splitlines(keepends=True)
    records = [json.loads(line) for line in lines]
    cells = [i for i, r in enumerate(records) if r["type"] == "cell"]
    group = records[cells[0]]["inflight"]["group"]
    mine = [i for i in cells if records[i]["inflight"]["group"] == group]
    assert len(mine) > drop
    kept = (
        lines[: mine[-drop]] if cut else [ln for i, ln in enumerate(lines) if i not in mine[-drop:]]
    )
    out.mkdir()
    (out / "journal.jsonl").write_bytes(b"".join(kept))


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")], ids=["one-gpu", "fleet"])
def test_a_resume_measures_a_partly_journaled_inflight_group_whole(
    tmp_path: Path, gpus: tuple[str, ...]
) -> None:
    """A journal holding only some of an in-flight group's levels (an older dvfs wrote them
    one by one; a power loss can keep part of the group's one write) was resumed by measuring
    the others as a group of their own, in decodes of their own (energy per token 1.2% off an
    uninterrupted run's on the exact twin), and the dry run counted only them left. The whole
    group is measured again now, its new records replacing the old: the cube equals an
    uninterrupted run's, and the dry run counts the group's every level left."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    campaign = write(tmp_path / "inflight.toml", INFLIGHT_TINY)

    def sweep(out: Path, *more: str) -> Any:
        args = ["sweep", str(campaign), "--out", str(out), "--no-progress", *gpus, *more]
        return CliRunner().invoke(cli, args)

    clean = sweep(tmp_path / "clean")
    assert clean.exit_code == 0, clean.output
    out = tmp_path / "out"
    _journal_without(tmp_path / "clean", out, drop=1, cut=False)
    dry = sweep(out, "--dry-run", "--no-estimate", "--json")
    assert dry.exit_code == 0, dry.output
    plan = json.loads(dry.output)
    assert (plan["cells"], plan["already_done"]) == (16, 14), "the group's two levels are left"
    resumed = sweep(out)
    assert "2 cell(s) measured" in resumed.output
    assert_resumed_as_uninterrupted(resumed, out, tmp_path / "clean")


def test_a_partly_journaled_inflight_group_measured_again_counts_once_for_more_repeats(
    tmp_path: Path,
) -> None:
    """With `max_repeats`, the repeats a resume adds are decided on each cell's latest record:
    a level of a group measured whole again (its first record kept, the group's write cut
    short) counted twice in its interval across repeats, and the resume added other repeats
    than an uninterrupted run (here a third repeat it does not take). Its cube equals the
    uninterrupted run's now."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    text = replace_block(INFLIGHT_TINY, "[measurement]\n", "[measurement]\nmax_repeats = 4\n")
    campaign = write(tmp_path / "inflight.toml", text + "precision = 0.01\n")

    def sweep(out: Path) -> Any:
        return CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])

    clean = sweep(tmp_path / "clean")
    assert clean.exit_code == 0, clean.output
    repeats = Counter(
        r["cell"]["repeat"]
        for r in read_records(tmp_path / "clean" / "journal.jsonl")
        if r["type"] == "cell"
    )
    assert 2 in repeats and repeats[2] < 8, f"some groups take more repeats, not all: {repeats}"
    out = tmp_path / "out"
    _journal_without(tmp_path / "clean", out, drop=1, cut=True)
    resumed = sweep(out)
    assert_resumed_as_uninterrupted(resumed, out, tmp_path / "clean")


def test_a_full_disk_inside_an_inflight_groups_write_leaves_none_of_it(tmp_path: Path) -> None:
    """A full disk part-way through an in-flight group's one write (here: the file-size
    limit, which fails the write where a full disk does) left the group's first level whole
    before the torn line, which the next open cut off: the resume took that level as measured
    and the other in decodes of its own (energy per token 1.2% off on the twin). The write is
    cut back off now; the error is one line, and the resume equals an uninterrupted run."""
    from click.testing import CliRunner
    from test_bad_inputs import _run_capped

    from dvfs.cli import cli

    campaign = write(tmp_path / "inflight.toml", INFLIGHT_TINY)

    def argv(out: Path) -> list[str]:
        return ["sweep", str(campaign), "--out", str(out), "--no-progress"]

    clean = CliRunner().invoke(cli, argv(tmp_path / "clean"))
    assert clean.exit_code == 0, clean.output
    ends, at = [], 0
    for line in (tmp_path / "clean" / "journal.jsonl").read_bytes().splitlines(keepends=True):
        at += len(line)
        ends.append((json.loads(line)["type"], at))
    # the second group's two levels, one write: the disk full in its second level
    first, second = [end for kind, end in ends if kind == "cell"][2:4]
    out = tmp_path / "out"
    full = _run_capped(argv(out), (first + second) // 2, tmp_path)
    assert full.returncode == 1, full.stderr
    last = full.stderr.splitlines()[-1]
    assert last == f"Error: cannot write the journal {out / 'journal.jsonl'}: File too large"
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == 2, "the first group whole, none of the second"
    resumed = CliRunner().invoke(cli, argv(out))
    assert_resumed_as_uninterrupted(resumed, out, tmp_path / "clean")


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")], ids=["one-gpu", "fleet"])
def test_a_resume_measures_a_partly_journaled_added_repeats_inflight_group_whole(
    tmp_path: Path, gpus: tuple[str, ...]
) -> None:
    """A group of a repeat `max_repeats` adds, journaled in part (an older dvfs's, a power
    loss inside its one write), was resumed by measuring its other level alone, in decodes of
    its own (energy per token 1.2% off on the exact twin), which then took a repeat the
    uninterrupted run did not; the dry run counted it alone left. The group is measured whole
    again now, as a planned one is: the cube equals the uninterrupted run's."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    text = replace_block(INFLIGHT_TINY, "[measurement]\n", "[measurement]\nmax_repeats = 4\n")
    campaign = write(tmp_path / "inflight.toml", text + "precision = 0.01\n")

    def sweep(out: Path, *more: str) -> Any:
        args = ["sweep", str(campaign), "--out", str(out), "--no-progress", *gpus, *more]
        return CliRunner().invoke(cli, args)

    clean = sweep(tmp_path / "clean")
    assert clean.exit_code == 0, clean.output
    lines = (tmp_path / "clean" / "journal.jsonl").read_bytes().splitlines(keepends=True)
    records = [json.loads(line) for line in lines]
    cells = [i for i, r in enumerate(records) if r["type"] == "cell"]
    added = Counter(records[i]["inflight"]["group"] for i in cells if records[i]["cell"]["repeat"])
    # an added repeat's group of two levels, the run stopped inside its write
    group = next(g for g, n in added.items() if n == 2 and g.endswith(("/r2", "/r3")))
    drop = max(i for i in cells if records[i]["inflight"]["group"] == group)
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.jsonl").write_bytes(b"".join(lines[:drop]))
    kept = sum(i < drop and records[i]["cell"]["repeat"] >= 2 for i in cells)
    dry = sweep(out, "--dry-run", "--no-estimate", "--json")
    assert dry.exit_code == 0, dry.output
    repeats = json.loads(dry.output)["adaptive_repeats"]
    assert repeats["extra_done"] == kept - 1, f"the group's journaled level to run: {repeats}"
    resumed = sweep(out)
    assert_resumed_as_uninterrupted(resumed, out, tmp_path / "clean")
    last = [line for line in resumed.output.splitlines() if "cell(s) measured" in line][-1]
    measured, done = (
        int(n) for n in re.findall(r"(\d+) cell\(s\) measured.* (\d+) already", last)[0]
    )
    assert (measured + done, done) == (len(cells), 16 + kept - 1), last


def test_a_write_cut_back_keeps_the_runs_session_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk in the write of a fleet's first shipment (the run's session with it) lost
    the session: the shipments its workers finished on the way out were journalled without it
    (header, server, cells), and `dvfs cube build` said the journal had no measurement session
    yet. The session is held until a write takes it; the cells stand after it and build."""
    from click.testing import CliRunner
    from fleet_support import FLEET

    from dvfs.cli import cli

    campaign = write(tmp_path / "fleet.toml", FLEET)
    out = tmp_path / "out"
    write_all = Journal._write
    failed: list[bytes] = []

    def full_once(fd: int, data: bytes) -> None:
        if b'"type":"session"' in data and not failed:
            failed.append(data)
            raise OSError(28, "No space left on device")
        write_all(fd, data)

    monkeypatch.setattr(Journal, "_write", staticmethod(full_once))
    argv = ["sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    full = CliRunner().invoke(cli, argv)
    assert full.exit_code == 1 and failed, full.output
    assert f"cannot write the journal {out / 'journal.jsonl'}: No space left" in full.output
    kinds = [r["type"] for r in read_records(out / "journal.jsonl")]
    assert "cell" in kinds, "the workers' last shipments are journalled on the way out"
    assert kinds.count("session") == 1 and kinds.index("session") == 1, kinds
    monkeypatch.undo()
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 0, built.output
