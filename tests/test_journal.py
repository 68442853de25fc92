"""A damaged journal is one clear line naming the file, the line and what to do; never a
traceback, and never silently rewritten."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from conftest import TINY, copy_sweep, replace_block, write
from hypothesis import given, settings

from dvfs.cli import cli
from dvfs.errors import JournalError
from dvfs.measure.journal import read_records


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def assert_one_line_error(
    result: Result, code: int, *fragments: str, notes: tuple[str, ...] = ()
) -> str:
    """Exit `code`, no traceback, exactly one line on stderr holding every fragment (besides
    progress notes starting with one of `notes`, printed before the failure)."""
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output
    lines = [
        line for line in result.stderr.strip().splitlines() if not line.startswith(notes or "\0")
    ]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture
def swept(tiny_sweep: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A finished sweep of TINY, this test's own copy of the session's: (campaign, folder)."""
    return write(tmp_path / "tiny.toml", TINY), copy_sweep(tiny_sweep, tmp_path / "out")


def _lines(journal: Path) -> list[bytes]:
    return journal.read_bytes().split(b"\n")


def _replace_line(journal: Path, index: int, raw: bytes) -> None:
    lines = _lines(journal)
    lines[index] = raw
    journal.write_bytes(b"\n".join(lines))


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(b"\xff\xfe\x00\x01garbage", id="not-utf8"),
        pytest.param(b'{"type":"cell","key":"x","cel', id="torn"),
        pytest.param(b"[1, 2, 3]", id="not-an-object"),
        pytest.param(b'{"type":"cell","status":"ok"}', id="cell-without-key"),
    ],
)
def test_a_bad_middle_line_names_the_line_and_the_way_out(
    swept: tuple[Path, Path], bad: bytes
) -> None:
    campaign, out = swept
    journal = out / "journal.jsonl"
    _replace_line(journal, 4, bad)
    before = journal.read_bytes()
    for result in (
        invoke("sweep", str(campaign), "--out", str(out), "--no-progress"),
        invoke("sweep", str(campaign), "--out", str(out), "--dry-run"),
        invoke("cube", "build", str(out)),
    ):
        line = assert_one_line_error(result, 1, str(journal), "line 5", "--fresh")
        assert "delete line 5" in line
        # the sweep's command, a shard's with its --shard (not `dvfs sweep --fresh` alone)
        assert "(DIR the folder it was swept into, a shard's with its `--shard I/N`)" in line
    assert journal.read_bytes() == before, "a damaged journal must not be rewritten"
    # The advice followed, CAMPAIGN and DIR named: it moves the journal aside intact and starts
    # over there (without --out, it swept into out/<name> and left the damaged one as it was).
    advice = line.split("start over with `", 1)[1].split("`", 1)[0]
    argv = [{"CAMPAIGN": str(campaign), "DIR": str(out)}.get(a, a) for a in shlex.split(advice)]
    assert argv[:2] == ["dvfs", "sweep"], advice
    fresh = invoke(*argv[1:], "--no-progress")
    assert fresh.exit_code == 0, fresh.output
    assert (out / "journal.jsonl.1").read_bytes() == before
    assert invoke("cube", "build", str(out)).exit_code == 0


@pytest.mark.parametrize("damage", ["ecc-mode-a-number", "torn", "second-session"])
def test_a_damaged_session_lines_advice_followed_lets_the_sweep_measure_its_cells_again(
    swept: tuple[Path, Path], damage: str
) -> None:
    """A damaged session record said "or delete line N to keep the rest": followed, the cells
    after it had no session (a first session's: `cube build` said "no measurement session
    yet", and the rerun it advised skipped them as done and said the same, for ever), or
    were taken for the session's before them (another run's GPUs). It names the session's
    lines, up to the next session's, which followed let the sweep measure those cells again;
    a damaged cell's line is still the one line to delete."""
    campaign, out = swept
    journal = out / "journal.jsonl"
    lines = _lines(journal)
    kinds = [json.loads(raw)["type"] if raw.strip() else None for raw in lines]
    cells = kinds.count("cell")
    if damage == "second-session":  # a resumed sweep's: its session after the first cell
        first = kinds.index("cell")
        lines.insert(first + 1, lines[kinds.index("session")])
        kinds.insert(first + 1, "session")
        journal.write_bytes(b"\n".join(lines))
    index = len(kinds) - 1 - kinds[::-1].index("session")
    record = json.loads(lines[index])
    if damage == "torn":
        raw = lines[index][:200]
    else:
        record["gpus"][0]["ecc_mode"] = 5
        raw = json.dumps(record).encode()
    _replace_line(journal, index, raw)
    end = max(i for i, kind in enumerate(kinds) if kind is not None)  # the session is the last
    remeasured = kinds[index:].count("cell")
    line = assert_one_line_error(invoke("cube", "build", str(out)), 1, f"line {index + 1}: ")
    said = f"delete lines {index + 1}-{end + 1} (the session and the {remeasured} cell record(s)"
    assert said in line and "alone leaves its cells without their session" in line, line
    kept = [raw for i, raw in enumerate(_lines(journal)) if not index <= i <= end]
    journal.write_bytes(b"\n".join(kept))
    resumed = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    assert f"{remeasured} cell(s) measured, 0 failed, {cells - remeasured} already done" in (
        resumed.output
    )
    assert invoke("cube", "build", str(out)).exit_code == 0
    # a cell's line: that one, measured again
    lines = _lines(journal)
    index = max(i for i, raw in enumerate(lines) if raw.startswith(b'{"type":"cell"'))
    _replace_line(journal, index, lines[index][:100])
    lines = _lines(journal)
    journal.write_bytes(b"\n".join([*lines, lines[0]]))  # (a torn line is not the last)
    line = assert_one_line_error(invoke("cube", "build", str(out)), 1)
    assert line.endswith(f"delete line {index + 1} (the sweep measures that cell again)"), line


@pytest.mark.parametrize(
    ("coordinate", "value", "said"),
    [
        pytest.param("repeat", "x", 'repeat is "x"', id="repeat-text"),
        pytest.param("repeat", -1, "repeat is -1", id="repeat-negative"),
        pytest.param("batch", None, "batch is missing", id="batch-missing"),
        pytest.param("batch", 2.5, "batch is 2.5", id="batch-fraction"),
        pytest.param("corpus", 7, "corpus is 7", id="corpus-number"),
        pytest.param("sm_clock_mhz", "fast", 'sm_clock_mhz is "fast"', id="clock-text"),
        pytest.param("power_limit_w", True, "power_limit_w is true", id="limit-bool"),
    ],
)
def test_an_edited_cell_coordinate_is_named_by_its_line_before_a_resume_measures(
    swept: tuple[Path, Path], coordinate: str, value: Any, said: str
) -> None:
    """A cell record whose coordinates are not a cell's was read as far as the cube build, after
    the resume had measured the cells left (an unnamed record, 'rerun with --fresh'); it is
    named by its line as the journal is read, as a damaged line is."""
    campaign, out = swept
    journal = out / "journal.jsonl"
    lines = _lines(journal)
    cells = [i for i, raw in enumerate(lines) if raw.startswith(b'{"type":"cell"')]
    record = json.loads(lines[cells[0]])
    if value is None:
        del record["cell"][coordinate]
    else:
        record["cell"][coordinate] = value
    lines[cells[0]] = json.dumps(record).encode()
    # the last cell left to measure, so a resume has work to do
    del lines[cells[-1]]
    journal.write_bytes(b"\n".join(lines))
    before = journal.read_bytes()
    for result in (
        invoke("sweep", str(campaign), "--out", str(out), "--no-progress"),
        invoke("sweep", str(campaign), "--out", str(out), "--dry-run"),
        invoke("cube", "build", str(out)),
    ):
        line = f"line {cells[0] + 1}"
        text = assert_one_line_error(result, 1, str(journal), line, said, f"delete {line}")
        assert "--fresh" in text
    assert journal.read_bytes() == before, "nothing measured, nothing rewritten"


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(bytes(range(256)) * 4, id="binary"),
        pytest.param(b"\x89HDF\r\n\x1a\n\x00\x00", id="hdf5-magic"),
        pytest.param(b"just some notes, no newline", id="text-one-line"),
        pytest.param(b'{"type":"cell","key":"k","cell":{}}\n', id="no-header"),
    ],
)
def test_a_file_that_is_not_a_journal_is_refused_and_left_alone(
    tmp_path: Path, content: bytes
) -> None:
    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    out.mkdir()
    journal = out / "journal.jsonl"
    journal.write_bytes(content)
    result = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    assert_one_line_error(result, 1, str(journal), "--fresh")
    # A one-line file used to pass for a torn last line and be truncated to nothing.
    assert journal.read_bytes() == content
    # The way out the message names: --fresh moves it aside intact (it once read the file
    # first, to see whether a fleet had begun the folder, and was refused alike).
    fresh = invoke("sweep", str(campaign), "--out", str(out), "--no-progress", "--fresh")
    assert fresh.exit_code == 0, fresh.output
    assert (out / "journal.jsonl.1").read_bytes() == content


def test_a_torn_last_line_is_still_dropped_and_the_sweep_resumes(swept: tuple[Path, Path]) -> None:
    campaign, out = swept
    journal = out / "journal.jsonl"
    records = read_records(journal)
    cells = [r for r in records if r["type"] == "cell"]
    kept = [r for r in records if r["type"] != "cell"] + cells[:-1]
    torn = json.dumps(cells[-1])[:40]
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept) + torn)
    result = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    assert result.exit_code == 0, result.output
    assert "1 cell(s) measured" in result.output
    assert all(line.strip() for line in journal.read_text().splitlines())


def test_a_journal_with_another_appended_is_refused_naming_the_second_header(
    swept: tuple[Path, Path],
) -> None:
    """Another sweep's journal appended to this one (`cat a b > journal.jsonl`): its header
    was passed over, and its cells built into this campaign's cube (another output_tokens
    under this one's name) or replaced this journal's own, while a resume found every cell
    done. A header after line 1 is refused, the file left as it is."""
    campaign, out = swept
    journal = out / "journal.jsonl"
    records = read_records(journal)
    other = json.loads(json.dumps(records))
    other[0]["campaign"]["workload"]["output_tokens"] = 32
    other[0]["campaign_hash"] = "0123456789abcdef"
    journal.write_text("".join(json.dumps(r) + "\n" for r in records + other))
    before = journal.read_bytes()
    second = len(records) + 1
    for result in (
        invoke("sweep", str(campaign), "--out", str(out), "--no-progress"),
        invoke("sweep", str(campaign), "--out", str(out), "--dry-run"),
        invoke("cube", "build", str(out)),
    ):
        assert_one_line_error(
            result, 1, f"line {second}", "second journal header", "0123456789abcdef", "--fresh"
        )
    assert journal.read_bytes() == before


def test_another_campaigns_journal_is_still_refused(swept: tuple[Path, Path], tmp_path) -> None:
    _, out = swept
    other = write(tmp_path / "other.toml", replace_block(TINY, "batch = [1, 8]", "batch = [2]"))
    result = invoke("sweep", str(other), "--out", str(out), "--no-progress")
    assert_one_line_error(result, 1, "belongs to campaign", "workload.batch", "--fresh")


def test_a_journal_from_a_newer_dvfs_is_refused(swept: tuple[Path, Path]) -> None:
    campaign, out = swept
    journal = out / "journal.jsonl"
    records = read_records(journal)
    records[0]["journal_schema"] = 99
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    for result in (
        invoke("sweep", str(campaign), "--out", str(out), "--no-progress"),
        invoke("cube", "build", str(out)),
    ):
        assert_one_line_error(result, 1, "journal schema 99", "upgrade dvfs")


def test_a_journal_a_newer_dvfs_resumed_is_refused_before_anything_is_measured(
    swept: tuple[Path, Path],
) -> None:
    """A newer dvfs resumed the journal (its session says its schema), then this one is given
    it: only the header's schema was checked, so the sweep measured the cells left and was
    refused at the cube, advising --fresh, which drops them."""
    campaign, out = swept
    journal = out / "journal.jsonl"
    records = read_records(journal)
    cells = [i for i, r in enumerate(records) if r["type"] == "cell"]
    kept = records[: cells[4]]  # the first session's first four cells
    newer = {**next(r for r in records if r["type"] == "session"), "journal_schema": 99}
    kept += [newer, *(records[i] for i in cells[4:8])]
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    before = journal.read_bytes()
    result = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    assert_one_line_error(result, 1, "journal schema 99", "upgrade dvfs")
    assert journal.read_bytes() == before, "nothing may be measured into it"
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run")
    assert "journal schema 99" in " ".join(dry.output.split())  # the console wraps


def test_a_record_with_missing_numbers_is_written_as_strict_json(tmp_path: Path) -> None:
    """NaN and infinities become null wherever they sit (scalars, quantile lists, nested
    dicts, numpy scalars); everything else is written as given."""
    import math

    import numpy as np

    from dvfs.measure.journal import Journal

    journal = Journal(tmp_path / "j.jsonl")
    record = {
        "type": "cell",
        "key": "k",
        "cell": {"batch": np.int64(4)},
        "status": "failed",
        "values": [1.5, math.nan, np.float64(2.0), np.float32("nan"), True, None, "x"],
        "nested": {"inf": -math.inf, "pair": (0.25, math.inf), 3: [np.float64("nan")]},
    }
    journal.append(record)
    journal.close()
    line = (tmp_path / "j.jsonl").read_text().strip()
    assert json.loads(line) == {
        "type": "cell",
        "key": "k",
        "cell": {"batch": 4},
        "status": "failed",
        "values": [1.5, None, 2.0, None, True, None, "x"],
        "nested": {"inf": None, "pair": [0.25, None], "3": [None]},
    }
    assert "NaN" not in line and "Infinity" not in line


def test_a_journal_line_is_json_safes_compact_strict_json(tmp_path: Path) -> None:
    """`Journal.append` writes with one shared encoder: each line is byte for byte
    `json.dumps(json_safe(record), separators=(",", ":"), allow_nan=False)`, keys `json_safe`
    turns into strings included (True -> "True", where JSON's own would be "true"), and a
    record that contains itself is still refused before anything is written."""
    import math

    import numpy as np

    from dvfs.measure.journal import Journal
    from dvfs.report import json_safe

    shared = [0.1, 2.0]
    records: list[dict[str, Any]] = [
        {"type": "session", "nested": {True: 1, None: 2, 3: 3.5, 2.5: "x"}, "t": (1, "a")},
        {"type": "cell", "key": "k", "a": shared, "b": shared, "c": [np.int64(7), math.nan]},
        {"type": "server", "u": 'é\u2028"\\', "f": [1e300, -0.0, 5e-324, np.float64(0.1)]},
    ]
    journal = Journal(tmp_path / "j.jsonl")
    for record in records:
        journal.append(record)
    cyclic: dict = {"type": "server"}
    cyclic["self"] = cyclic
    with pytest.raises(RecursionError):
        journal.append(cyclic)
    journal.close()
    expected = "".join(
        json.dumps(json_safe(r), separators=(",", ":"), allow_nan=False) + "\n" for r in records
    )
    assert (tmp_path / "j.jsonl").read_text(encoding="utf-8") == expected
    assert '"True":1,"None":2,"3":3.5,"2.5":"x"' in expected


def _json_safe_as_it_was(value: Any) -> Any:
    """`json_safe` before its fast paths for exact dicts, lists, tuples and floats: the
    reference its results must equal."""
    import math

    plain = frozenset({str, int, bool, type(None)})
    if type(value) in plain:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe_as_it_was(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [
            (v if math.isfinite(v) else None) if type(v) is float else _json_safe_as_it_was(v)
            for v in value
        ]
    if hasattr(value, "item") and callable(value.item):
        return _json_safe_as_it_was(value.item())
    return value


class _Dict(dict[Any, Any]):
    pass


class _List(list[Any]):
    pass


def _json_values() -> Any:
    import numpy as np
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(),
        st.booleans(),
        st.none(),
        st.text(max_size=4),
        st.floats(allow_nan=True).map(np.float64),
        st.floats(width=32, allow_nan=True).map(np.float32),
        st.integers(-(2**40), 2**40).map(np.int64),
    )
    keys = st.one_of(st.text(max_size=3), st.integers(), st.booleans(), st.none(), st.floats())
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=5),
            st.lists(inner, max_size=5).map(tuple),
            st.lists(inner, max_size=5).map(_List),
            st.dictionaries(keys, inner, max_size=5),
            st.dictionaries(keys, inner, max_size=5).map(_Dict),
        ),
        max_leaves=30,
    )


@settings(max_examples=300, deadline=None)
@given(_json_values())
def test_json_safe_equals_what_it_was_before_its_fast_paths(value: Any) -> None:
    """`json_safe` (every journal line's and --json output's) takes exact dicts, lists,
    tuples and floats without a call per value: its results are the earlier ones, type for
    type (`repr`: True is not 1, 1.0 not 1, a numpy scalar not a float), key order kept."""
    from dvfs.report import json_safe

    assert repr(json_safe(value)) == repr(_json_safe_as_it_was(value))


def _demo_sweeps_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dvfs demo` sweeps the tiny campaign in place of the demo's, and stops once it is swept
    (the demo's tables are not these tests')."""
    import dvfs.cli.sweep
    from dvfs.campaign import load_campaign

    tiny = load_campaign(write(tmp_path / "tiny.toml", TINY))
    real = dvfs.cli.sweep.run

    def tiny_run(campaign: Any, out_dir: Path, **kwargs: Any) -> Any:
        real(tiny, out_dir, **kwargs)
        raise SystemExit(0)

    monkeypatch.setattr(dvfs.cli.sweep, "run", tiny_run)


def test_a_demos_damaged_journal_says_to_start_over_with_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs demo` into a folder whose journal is damaged said to start over with `dvfs sweep
    CAMPAIGN --fresh`: the demo's user wrote no campaign, and that command (without the
    demo's --out) leaves the folder as it is. It names the demo's own command, whose run
    moves the journal aside and starts over (the sweep stands in for the demo's here: its
    campaign is TINY, and the demo's tables after it are not drawn)."""

    out = tmp_path / "my demo"
    out.mkdir()
    journal = out / "journal.jsonl"
    journal.write_text('{"type":"cell"}\n')
    refused = invoke("demo", "--out", str(out), "--no-progress")
    said = assert_one_line_error(refused, 1, str(journal), "which renames it")
    assert "dvfs sweep" not in said and "CAMPAIGN" not in said, said
    advice = said.split("start over with `", 1)[1].split("`", 1)[0]
    _demo_sweeps_tiny(tmp_path, monkeypatch)
    argv = shlex.split(advice)
    assert argv[:2] == ["dvfs", "demo"], advice
    followed = invoke(*argv[1:], "--no-progress")
    assert followed.exit_code == 0, followed.output
    assert (out / "journal.jsonl.1").read_text() == '{"type":"cell"}\n'  # moved aside
    assert any(r["type"] == "cell" for r in read_records(journal))


def test_a_demo_whose_cube_is_a_device_is_refused_before_it_sweeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs demo --out X` whose X/cube.nc is a link to /dev/null swept every cell, wrote the
    cube into the device, then failed reading it back (exit 1), saying to give "the cube.nc a
    sweep wrote". It is refused before the sweep, exit 2, saying to remove it; one --fresh
    moves aside with its journal is not refused."""

    out = tmp_path / "demo"
    out.mkdir()
    (out / "cube.nc").symlink_to(os.devnull)
    refused = invoke("demo", "--out", str(out), "--no-progress")
    assert_one_line_error(refused, 2, f"{out / 'cube.nc'} is a device", "remove it")
    assert sorted(p.name for p in out.iterdir()) == ["cube.nc"]  # nothing swept
    (out / "journal.jsonl").write_text('{"type":"cell"}\n')
    _demo_sweeps_tiny(tmp_path, monkeypatch)
    fresh = invoke("demo", "--out", str(out), "--fresh", "--no-progress")
    assert fresh.exit_code == 0, fresh.output
    assert os.readlink(out / "cube.nc.1") == os.devnull  # moved aside with its journal
    assert (out / "cube.nc").is_file()


def test_cube_builds_fresh_advice_names_the_sweeps_command(swept: tuple[Path, Path]) -> None:
    """A journal `cube build` refuses with the sweep's advice ("rerun the sweep with --fresh",
    "rerun with --fresh"): `dvfs cube build` has no --fresh, and added to its command, as its
    user reads the line, it is refused ("No such option"), as `dvfs doctor`'s was (fe71ca8).
    It names the sweep's command, which, followed, starts over and lets the cube be built."""
    campaign, out = swept
    journal = out / "journal.jsonl"
    lines = _lines(journal)
    session = json.loads(lines[1])
    assert session["type"] == "session"
    session["gpus"][0]["memory_clock_mhz"] = None  # an edit: refused as a damaged record
    _replace_line(journal, 1, json.dumps(session).encode())
    line = assert_one_line_error(invoke("cube", "build", str(out)), 1, "--fresh")
    advice = line.split("(--fresh is the sweep's: `", 1)[1].split("`", 1)[0]
    argv = [str(campaign) if a == "CAMPAIGN" else a for a in shlex.split(advice)]
    assert argv[:2] == ["dvfs", "sweep"] and argv[argv.index("--out") + 1] == str(out), advice
    fresh = invoke(*argv[1:], "--no-progress")
    assert fresh.exit_code == 0, fresh.output
    assert invoke("cube", "build", str(out)).exit_code == 0


def test_a_sweep_whose_journal_is_a_symbolic_link_in_a_loop_says_what_to_do(
    tmp_path: Path,
) -> None:
    """`ln -s journal.jsonl journal.jsonl` in a sweep's --out: the sweep said "cannot write the
    journal ...: Too many levels of symbolic links" and no more; it now says the link is in a
    loop and what to do, in one line."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.jsonl").symlink_to("journal.jsonl")
    campaign = write(tmp_path / "c.toml", TINY)
    result = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    assert result.exit_code == 1, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: cannot write the journal {out / 'journal.jsonl'}: "), last
    assert "leads back to itself (a loop): remove it" in last, last


def _said(text: str) -> str:
    """A command's output with its lines' wrapping undone (doctor wraps to the console)."""
    return " ".join(text.split())


@pytest.mark.parametrize("where", ["single", "mixed fleet", "fleet of one model"])
@pytest.mark.parametrize("shape", ["loop", "to no folder"])
def test_doctor_and_the_dry_run_say_the_sweeps_refusal_of_a_journal_link_it_cannot_open(
    tmp_path: Path, where: str, shape: str
) -> None:
    """A journal that is a symbolic link in a loop (`ln -s journal.jsonl journal.jsonl`) or to
    a file in a folder that does not exist, a sweep's own or a fleet GPU model's: the sweep
    refused it, but `dvfs doctor` said "output folder: OUT: usable" and the dry run (text and
    --json) planned every cell, for `path.exists()` denies such a link is there; a fleet of one
    model passed such a link of a GPU model's by and started the folder over beside it. Each
    now says the sweep's line."""
    from conftest import MIXED_FLEET, TINY_EXACT

    campaign = write(tmp_path / "c.toml", TINY_EXACT)
    out = tmp_path / "out"
    gpus: tuple[str, ...] = ()
    journal = out / "journal.jsonl"
    if where == "mixed fleet":
        gpus = MIXED_FLEET
        journal = out / "gpu-nvidia-h200-twin" / "journal.jsonl"
    elif where == "fleet of one model":  # a GPU model's journal of a fleet that mixed them
        gpus = ("--gpus", "0-1")
        journal = out / "gpu-nvidia-h100-80gb-hbm3-twin" / "journal.jsonl"
    journal.parent.mkdir(parents=True)
    journal.symlink_to("journal.jsonl" if shape == "loop" else "gone/journal.jsonl")
    argv = ["sweep", str(campaign), "--out", str(out), *gpus]
    swept = CliRunner().invoke(cli, [*argv, "--no-progress"])
    assert swept.exit_code == 1, swept.output
    [line] = swept.stderr.strip().splitlines()[-1:]
    assert line.startswith(f"Error: cannot write the journal {journal}: "), line
    refusal = line.removeprefix("Error: ")
    assert ("(a loop)" if shape == "loop" else "in a folder that does not exist") in refusal
    assert not (out / "cube.nc").exists()
    doctor = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", str(out), *gpus])
    assert doctor.exit_code == 1, doctor.output
    # doctor wraps to the console's width, a long path mid-word too: compared without spaces
    said = "".join(doctor.output.split())
    assert "".join(f"FAIL output folder: {refusal}".split()) in said, doctor.output
    for json_flag in ((), ("--json",)):
        dry = CliRunner().invoke(cli, [*argv, "--dry-run", "--no-estimate", *json_flag])
        assert dry.exit_code == 1, dry.output
        assert _said(dry.stderr) == _said(line), dry.output


def test_a_journal_read_that_fails_names_the_journal(tmp_path: Path) -> None:
    """A journal whose read fails where the failing call carries no file name (a read of
    /proc/self/mem, linked as the journal, fails with EIO): the sweep, `dvfs doctor` and `dvfs
    cube build` said "cannot read the journal: Input/output error", naming no file; each now
    names the journal."""
    out = tmp_path / "out"
    out.mkdir()
    journal = out / "journal.jsonl"
    journal.symlink_to("/proc/self/mem")
    with pytest.raises(JournalError) as raised:
        read_records(journal)
    assert str(raised.value).startswith(f"cannot read the journal {journal}: "), raised.value
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 1, built.output
    assert built.stderr.startswith(f"Error: cannot read the journal {journal}: "), built.output


def test_a_journal_read_failing_with_eio_says_what_to_do(tmp_path: Path) -> None:
    """A journal whose read fails with EIO (a failing disk or network file system; played by
    /proc/self/mem, linked as the journal): `dvfs cube build` said "Input/output error" and no
    remedy. It says to check the disk or file system and run the command again."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.jsonl").symlink_to("/proc/self/mem")
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 1, built.output
    [line] = built.stderr.strip().splitlines()
    assert "Input/output error; " in line, line
    assert "network file system" in line and "run the command again" in line, line


def test_fresh_moves_a_journal_linked_in_a_loop_aside_as_its_dry_run_says(
    tmp_path: Path,
) -> None:
    """`dvfs sweep --fresh --dry-run` into a folder whose journal is a symbolic link in a loop
    said "--fresh: no journal to move aside" and planned the sweep, which then refused the
    link; --fresh now moves it aside, as it moves a journal that is a folder or a FIFO, and
    its dry run says so."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.jsonl").symlink_to("journal.jsonl")
    argv = ["sweep", str(write(tmp_path / "c.toml", TINY)), "--out", str(out), "--fresh"]
    dry = CliRunner().invoke(cli, [*argv, "--dry-run", "--no-estimate"])
    assert dry.exit_code == 0, dry.output
    assert f"--fresh would move aside {out / 'journal.jsonl'}" in _said(dry.output), dry.output
    swept = CliRunner().invoke(cli, [*argv, "--no-progress"])
    assert swept.exit_code == 0, swept.output
    assert (out / "journal.jsonl").is_file() and (out / "journal.jsonl.1").is_symlink()
    assert (out / "cube.nc").is_file()


def test_fresh_moves_a_relative_link_aside_pointing_where_it_did(tmp_path: Path) -> None:
    """--fresh renamed a relative loop link `journal.jsonl -> journal.jsonl` to journal.jsonl.1,
    which then pointed at the new run's live journal: a reader of journal.jsonl.1 read the new
    run. The moved link points where it did (at itself, a loop still), never followed; a
    refused sweep's undoing of the move puts it back as it was."""
    import os

    from dvfs.out_folder import _leave_as_found, fresh_start

    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.jsonl").symlink_to("journal.jsonl")
    argv = ["sweep", str(write(tmp_path / "c.toml", TINY)), "--out", str(out), "--fresh"]
    swept = CliRunner().invoke(cli, [*argv, "--no-progress"])
    assert swept.exit_code == 0, swept.output
    assert (out / "journal.jsonl").is_file()
    assert os.readlink(out / "journal.jsonl.1") == "journal.jsonl.1"
    # undone (a sweep refused before it measured): the link as it was found
    again = tmp_path / "again"
    again.mkdir()
    (again / "journal.jsonl").symlink_to("journal.jsonl")
    moves: list[tuple[Path, Path]] = []
    fresh_start(again, moves)
    assert os.readlink(again / "journal.jsonl.1") == "journal.jsonl.1"
    assert _leave_as_found(again, {}, set(), None, [], moves)
    assert os.readlink(again / "journal.jsonl") == "journal.jsonl"
    assert not os.path.lexists(again / "journal.jsonl.1")


@pytest.mark.parametrize("target", ["gone/cube.nc", "cube-elsewhere.nc"])
def test_fresh_moves_a_cube_linked_to_nothing_aside_with_its_journal(
    tiny_sweep: Path, tmp_path: Path, target: str
) -> None:
    """A finished folder whose cube.nc is a link to nothing: `dvfs sweep --fresh` moved the
    journal aside but not the link (`exists()` follows it), then refused the link to a file
    in a missing folder, or wrote the new cube through it, out of the folder. The link is
    moved aside with its journal, as a live one is, never followed, and the new cube is the
    folder's own file."""
    import os

    out = copy_sweep(tiny_sweep, tmp_path / "out")
    (out / "cube.nc").unlink()
    (out / "cube.nc").symlink_to(tmp_path / target)
    argv = ["sweep", str(write(tmp_path / "c.toml", TINY)), "--out", str(out), "--fresh"]
    dry = CliRunner().invoke(cli, [*argv, "--dry-run", "--no-estimate"])
    assert dry.exit_code == 0, dry.output
    assert f"{out / 'cube.nc'} (to cube.nc.1)" in _said(dry.output), dry.output
    swept = CliRunner().invoke(cli, [*argv, "--no-progress"])
    assert swept.exit_code == 0, swept.output
    assert (out / "cube.nc").is_file() and not (out / "cube.nc").is_symlink()
    assert os.readlink(out / "cube.nc.1") == str(tmp_path / target)
    assert not os.path.lexists(tmp_path / target)


def test_a_journal_this_user_may_not_read_is_said_so(
    tiny_sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal that cannot be read (EACCES, as a user without read permission gets it: played
    here, as root ignores modes): the line advised "choose a folder you can write to with
    --out", which does not fit a read. It says this user may not read it, and what to do."""
    import errno
    import os

    out = copy_sweep(tiny_sweep, tmp_path / "out")
    journal = out / "journal.jsonl"
    real_open = os.open

    def denied(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(path) == journal and not flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    campaign = str(write(tmp_path / "c.toml", TINY))
    checked = CliRunner().invoke(cli, ["doctor", campaign, "--out", str(out)])
    for result, code in ((built, 1), (checked, 1)):
        said = _said(result.output)
        assert result.exit_code == code, result.output
        assert f"cannot read the journal ({journal})" in said, said
        assert "this user may not read it" in said, said
        assert "a folder you can write to" not in said and "Traceback" not in said, said
    # `dvfs cube build`'s --out is the cube's path, not a folder holding the journal: the line
    # ended "or choose another --out", no remedy for a journal this user may not read
    assert "--out" not in _said(built.output), built.output


@pytest.mark.parametrize("torn", [True, False], ids=["torn-line-cut", "newline-ended"])
def test_a_journal_this_user_may_not_write_is_not_called_unreadable(
    swept: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, torn: bool
) -> None:
    """A resume that repairs the journal (cuts its torn last line, or ends its last record's
    line) and is denied the write (EACCES, played here, as root ignores modes): the line said
    "this user may not read it ... make it readable", untrue of a journal it had just read. It
    says this user may not write it, and how to make it writable."""
    import builtins
    import errno
    import os

    import dvfs.measure.journal as journal_module

    campaign, out = swept
    journal = out / "journal.jsonl"
    text = journal.read_bytes().rstrip(b"\n")
    journal.write_bytes(text + b"\n" + b'{"type":"cell","key":"x","cel' if torn else text)
    real_open = builtins.open

    def denied(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if Path(path) == journal and mode != "rb":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(journal_module, "open", denied, raising=False)
    result = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    said = _said(result.output)
    assert result.exit_code == 1, result.output
    assert f"off the journal ({journal})" in said or f"repair the journal ({journal})" in said
    assert "this user may not write it" in said and "make it writable" in said, said
    assert "may not read" not in said and "readable" not in said, said
    assert "Traceback" not in said, said


@pytest.mark.parametrize("fleet", [False, True], ids=["one-gpu", "mixed-fleet"])
def test_the_sweeps_closing_line_is_one_line_for_a_long_journal_path(
    tiny_sweep: Path, tiny_exact_run: Any, tmp_path: Path, fleet: bool
) -> None:
    """The sweep's closing line ("N cell(s) measured, ...; journal PATH", a fleet's "...;
    journals PATH") was printed wrapped to the console's width, so a long --out split it over
    two lines (a script reading it by line got half), and a path with brackets was read as
    markup. It is one line, the path as given."""
    from conftest import MIXED_FLEET, TINY_EXACT

    campaign = write(tmp_path / "tiny.toml", TINY_EXACT if fleet else TINY)
    done = tiny_exact_run("mixed") if fleet else tiny_sweep
    out = copy_sweep(done, tmp_path / ("[deep]" + "d" * 150) / "out")
    gpus = MIXED_FLEET if fleet else ()
    result = invoke("sweep", str(campaign), *gpus, "--out", str(out), "--no-progress")
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.stderr.splitlines() if "cell(s) measured" in line]
    where = (
        f"journals {out / 'gpu-*' / 'journal.jsonl'}" if fleet else f"journal {out}/journal.jsonl"
    )
    assert line.endswith(f"; {where}"), result.stderr
