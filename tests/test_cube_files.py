"""Cube files and output folders: unreadable cubes and disk faults are one line that says what
to do; cubes are as readable as the journal, follow CF on disk, and merge only within a campaign."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import netCDF4
import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner, Result
from conftest import TINY, copy_sweep, pipe_output, replace_block, write
from test_journal import assert_one_line_error

import dvfs.cube.files
from dvfs.cli import cli
from dvfs.cube import STATUS_OK, open_cube
from dvfs.errors import CubeError


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def sweep(campaign: Path, out: Path, *extra: str) -> Result:
    return invoke("sweep", str(campaign), "--out", str(out), "--no-progress", *extra)


@pytest.fixture
def swept(tiny_sweep: Path, tmp_path: Path) -> Path:
    """This test's own copy of the session's TINY sweep."""
    return copy_sweep(tiny_sweep, tmp_path / "out")


def _commands(out: Path) -> list[tuple[str, ...]]:
    """Every command that opens a cube."""
    return [
        ("cube", "info", str(out)),
        ("headroom", str(out)),
        ("compare", str(out)),
        ("plot", str(out), "--out", str(out / "plots")),
        ("cube", "merge", str(out), str(out), "--out", str(out / "merged.nc")),
    ]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def _not_netcdf(path: Path) -> None:
    path.write_text("this is not a cube\n")


def _foreign_netcdf(path: Path) -> None:
    xr.Dataset({"t": ("x", np.arange(3.0))}).to_netcdf(path)


def _dvfs_attr_without_variables(path: Path) -> None:
    ds = xr.Dataset(
        {"t": ("x", np.arange(3.0))},
        coords={d: [1] for d in ("sm_clock", "power_limit", "batch", "repeat")}
        | {"drafter": ["none"], "corpus": ["code"]},
        attrs={"dvfs_schema": 1},
    )
    ds.to_netcdf(path)


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_truncate, "not a readable netCDF cube"),
        (_not_netcdf, "not a readable netCDF cube"),
        (_foreign_netcdf, "is not a dvfs cube"),
        (_dvfs_attr_without_variables, "lacks"),
    ],
)
def test_a_damaged_cube_says_how_to_rebuild_it(swept: Path, damage, says: str) -> None:
    cube = swept / "cube.nc"
    damage(cube)
    for command in _commands(swept):
        result = invoke(*command)
        assert_one_line_error(result, 1, str(cube), says, f"dvfs cube build {swept}")
    # ... and the advice works.
    assert invoke("cube", "build", str(swept)).exit_code == 0
    assert invoke("cube", "info", str(swept)).exit_code == 0


def test_a_journal_or_a_campaign_given_for_a_cube_is_said_to_be_one(
    swept: Path, tmp_path: Path
) -> None:
    """`dvfs headroom OUT/journal.jsonl` (the tab key's slip): "is not a readable netCDF cube
    ... rebuild it from its journal with `dvfs cube build OUT`", which, followed, left the
    journal given and refused again; a campaign file was told to be rebuilt from a journal
    too. Each is said as what it is, and what to give; given so, the command runs."""
    import shlex

    journal = swept / "journal.jsonl"
    campaign = tmp_path / "mine.toml"
    campaign.write_text('[campaign]\nname = "mine"\n')
    for command in _commands(swept):
        name = command[1] if command[0] == "cube" else command[0]
        at = command.index(str(swept), 1)
        for given, says in (
            (journal, f"is a sweep's journal, not a cube: give its folder ({swept})"),
            (campaign, f"is a campaign file, not a cube: sweep it (`dvfs sweep {campaign}`)"),
        ):
            argv = [*command[:at], str(given), *command[at + 1 :]]
            if name == "merge":
                continue  # `cube merge` reads a journal it is given, as a folder's
            result = invoke(*argv)
            line = assert_one_line_error(result, 1, f"{given} {says}")
            assert "rebuild" not in line, line
    result = invoke("cube", "info", str(journal))
    said = result.stderr.split("give its folder (", 1)[1].split(")", 1)[0]
    followed = invoke("cube", "info", *shlex.split(said))
    assert followed.exit_code == 0, followed.output


@pytest.mark.parametrize("given", ["folder", "cube.nc"])
@pytest.mark.parametrize("journal", [True, False])
def test_a_folder_named_cube_nc_is_said_to_be_in_the_cube_files_place(
    swept: Path, tmp_path: Path, given: str, journal: bool
) -> None:
    """A folder named cube.nc where a sweep folder's cube goes: every command that opens a
    cube said "no cube at DIR/cube.nc/cube.nc" (the folder taken for a sweep folder, the
    name joined again). It names DIR/cube.nc as a folder in the cube file's place, and says
    to move it aside, then rebuild the cube from the journal where there is one."""
    (swept / "cube.nc").unlink()
    (swept / "cube.nc").mkdir()
    if not journal:
        (swept / "journal.jsonl").unlink()
    cube = swept / "cube.nc"
    path = swept if given == "folder" else cube
    then = f"rebuild the cube from its journal with `dvfs cube build {swept}`"
    for command in [
        ("cube", "info", str(path)),
        ("cube", "info", str(path), "--json"),
        ("headroom", str(path)),
        ("compare", str(path)),
        ("report", str(path), "-o", str(tmp_path / "r.md")),
        ("plot", str(path), "--out", str(tmp_path / "plots")),
    ]:
        result = invoke(*command)
        line = assert_one_line_error(
            result, 1, f"{cube} is a folder, where the cube file should be: move it aside"
        )
        assert "cube.nc/cube.nc" not in line, line
        assert (then in line) is journal, line


def test_a_cube_file_given_as_a_folder_is_not_said_to_be_a_folder(swept: Path) -> None:
    """`RUN/cube.nc/cube.nc`, RUN/cube.nc the cube file (its name joined twice): it was said
    "RUN/cube.nc is a folder, where the cube file should be: move it aside, then rebuild",
    advice that moves a good cube aside. It says that file is no folder, to check the path."""
    cube = swept / "cube.nc"
    before = cube.read_bytes()
    for command in _commands(cube / "cube.nc"):
        line = assert_one_line_error(
            invoke(*command), 1, f"no cube at {cube / 'cube.nc'}: {cube} is a file, not a folder"
        )
        assert "is a folder" not in line and "move it aside" not in line, line
    assert cube.read_bytes() == before


@pytest.mark.parametrize("fault", ["damaged", "a-folder"])
def test_the_cube_build_said_for_a_folder_with_a_space_runs_pasted(
    tiny_sweep: Path, tmp_path: Path, fault: str
) -> None:
    """A sweep folder whose name has a space ("my run"), its cube damaged or a folder in its
    place: the rebuild said was `dvfs cube build /.../my run`, which pasted into a shell is
    two folders ("Got unexpected extra argument"). It is quoted, and runs as said."""
    import shlex
    import subprocess
    import sys

    swept = copy_sweep(tiny_sweep, tmp_path / "my run")
    cube = swept / "cube.nc"
    if fault == "damaged":
        _truncate(cube)
    else:
        cube.unlink()
        cube.mkdir()
    line = assert_one_line_error(invoke("cube", "info", str(swept)), 1, "`dvfs cube build ")
    said = line.split("`dvfs cube build ", 1)[1].split("`", 1)[0]
    assert shlex.split(said) == [str(swept)], line
    if fault == "a-folder":
        cube.rename(swept / "cube.nc.aside")  # "move it aside"
    build = [sys.executable, "-m", "dvfs", "cube", "build", *shlex.split(said)]
    done = subprocess.run(build, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert invoke("cube", "info", str(swept)).exit_code == 0


@pytest.mark.parametrize("fleet", [False, True])
def test_cube_build_into_a_folder_named_cube_nc_says_to_move_it_aside(
    tiny_sweep: Path, tiny_exact_run, tmp_path: Path, fleet: bool
) -> None:
    """`dvfs cube build DIR` where DIR/cube.nc is a folder, no --out given: "it is a folder,
    not a file; give a file's path for --out", as if the user had named that folder. The
    folder is where the command writes by default: move it aside, or choose another --out."""
    out = copy_sweep(tiny_exact_run("mixed") if fleet else tiny_sweep, tmp_path / "out")
    (out / "cube.nc").unlink()
    (out / "cube.nc").mkdir()
    line = assert_one_line_error(
        invoke("cube", "build", str(out)),
        1,
        f"cannot use {out / 'cube.nc'}: it is a folder, not a file; move that folder aside, or "
        "choose another --out",
    )
    assert "give a file's path" not in line, line


def test_a_roofline_file_given_as_a_cube_names_what_reads_it(tmp_path: Path) -> None:
    """A roofline file (netCDF, no cube schema) where a cube is asked for: one line naming
    what it is and what reads it, not advice to rebuild a cube from a journal it never had."""
    roofline = tmp_path / "roofline.nc"
    made = invoke(
        "gpu", "roofline", "--twin", "h100-sxm", "--tokens", "1,4096", "-o", str(roofline)
    )
    assert made.exit_code == 0, made.output
    for command in (
        ("cube", "info", str(roofline)),
        ("headroom", str(roofline)),
        ("report", str(roofline), "-o", str(tmp_path / "r.html")),
        ("plot", str(roofline), "--out", str(tmp_path / "plots")),
    ):
        result = invoke(*command)
        assert_one_line_error(
            result, 1, "is a roofline file", f"dvfs twin fit {roofline} -o PROFILE.toml"
        )
        assert "cube build" not in result.output, command
    # The advice runs as written (without -o, twin fit stopped at its missing option).
    profile = tmp_path / "PROFILE.toml"
    fitted = invoke("twin", "fit", str(roofline), "-o", str(profile))
    assert fitted.exit_code == 0 and profile.is_file(), fitted.output


def test_a_cube_is_as_readable_as_the_journal(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        out = tmp_path / "out"
        assert sweep(write(tmp_path / "tiny.toml", TINY), out).exit_code == 0
    finally:
        os.umask(previous)
    cube_mode = stat.S_IMODE((out / "cube.nc").stat().st_mode)
    journal_mode = stat.S_IMODE((out / "journal.jsonl").stat().st_mode)
    assert cube_mode == journal_mode == 0o640


def test_the_cube_follows_cf_on_disk_and_indexes_by_label(swept: Path) -> None:
    with netCDF4.Dataset(swept / "cube.nc") as nc:
        for name, var in nc.variables.items():
            if name in nc.dimensions:  # a coordinate variable: numeric, never a fill value
                assert "_FillValue" not in var.ncattrs(), name
                assert np.dtype(var.dtype).kind in "iuf", name
                assert var.getncattr("units") and var.getncattr("long_name"), name
        assert "drafter" not in nc.variables and "corpus" not in nc.variables
        for dim in ("drafter", "corpus"):
            label = nc.variables[f"{dim}_label"]
            assert label.dimensions == (dim,)
            assert label.dtype is str
            assert label.getncattr("long_name")
            assert "_FillValue" not in label.ncattrs()
        assert list(nc.variables["drafter_label"][:]) == ["none", "eagle3"]
        assert "drafter_label" in nc.variables["energy_j"].getncattr("coordinates").split()
    ds = open_cube(swept / "cube.nc")
    assert ds["drafter"].values.tolist() == ["none", "eagle3"]
    assert ds.sel(drafter="eagle3", corpus="code")["energy_j"].notnull().all()
    assert "drafter_label" not in ds.variables


def test_a_merged_cube_labels_its_gpus(tiny_sweep: Path, tmp_path: Path) -> None:
    a, b = tiny_sweep, tmp_path / "b"
    h200 = replace_block(TINY, 'profile = "h100-sxm"', 'profile = "h200-sxm"')
    assert sweep(write(tmp_path / "b.toml", h200), b).exit_code == 0
    merged = tmp_path / "m.nc"
    result = invoke("cube", "merge", str(a), str(b), "--out", str(merged))
    assert result.exit_code == 0, result.output
    with netCDF4.Dataset(merged) as nc:
        assert "gpu" not in nc.variables
        assert nc.variables["gpu_label"].dimensions == ("gpu",)
        assert "_FillValue" not in nc.variables["power_limit"].ncattrs()
    ds = open_cube(merged)
    first = str(ds["gpu"].values[0])
    assert ds.sel(gpu=first, drafter="none")["energy_j"].notnull().any()
    # An --out under a regular file: the one line every analysis command's output gives.
    under_file = merged / "m.nc"
    result = invoke("cube", "merge", str(a), str(b), "--out", str(under_file))
    assert_one_line_error(
        result, 1, str(under_file), "not a folder", "choose a path inside a folder for --out"
    )


def test_a_cube_to_stdout_is_the_cube_alone(tiny_sweep: Path, tmp_path: Path) -> None:
    """`dvfs cube build SWEEP -o /dev/stdout | ssh host 'cat > cube.nc'`: the stream holds
    the netCDF file and nothing else; its "cube: /dev/stdout" line followed the file's last
    byte in the same stream (18 bytes not of the cube)."""
    import subprocess

    from conftest import PYTHON, subprocess_env

    args = ["build", str(copy_sweep(tiny_sweep, tmp_path / "out"))]
    done = subprocess.run(
        [PYTHON, "-m", "dvfs", "cube", *args, "-o", "/dev/stdout"],
        capture_output=True,
        env=subprocess_env(),
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.startswith(b"\x89HDF"), done.stdout[:16]
    assert b"cube:" not in done.stdout[-200:], done.stdout[-80:]
    assert done.stderr.decode().startswith("cube: /dev/stdout"), done.stderr.decode()
    (tmp_path / "piped.nc").write_bytes(done.stdout)
    assert open_cube(tmp_path / "piped.nc")["energy_j"].notnull().any()


def test_a_merged_cube_to_a_pipe_is_the_cube_alone(tiny_sweep: Path, tmp_path: Path) -> None:
    """`dvfs cube merge A B -o /dev/stdout | ...`, as `test_a_cube_to_stdout_is_the_cube_alone`
    (whose process of its own shows the stream a script gets), in this process: `-o` a pipe's
    /dev/fd path takes the netCDF file alone, and the "cube:" line goes to stderr, not stdout
    (the stream that line shared with the file)."""
    h200 = replace_block(TINY, 'profile = "h100-sxm"', 'profile = "h200-sxm"')
    assert sweep(write(tmp_path / "b.toml", h200), tmp_path / "b").exit_code == 0
    with pipe_output() as (stream, got):
        done = CliRunner().invoke(
            cli, ["cube", "merge", str(tiny_sweep), str(tmp_path / "b"), "-o", stream]
        )
    assert done.exit_code == 0, done.output
    piped = b"".join(got)
    assert piped.startswith(b"\x89HDF"), piped[:16]
    assert done.stdout == "", done.stdout
    assert done.stderr.startswith(f"cube: {stream}"), done.stderr
    (tmp_path / "piped.nc").write_bytes(piped)
    assert open_cube(tmp_path / "piped.nc")["energy_j"].notnull().any()


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("output_tokens = 64", "output_tokens = 32", "workload.output_tokens: 64 -> 32"),
        ("sm_clock = [1980, 1005]", "sm_clock = [1980, 1500]", "knobs.sm_clock"),
        ("input_tokens = [16, 2048]", "input_tokens = [16, 512]", "workload.input_tokens"),
        ("batch = [1, 8]", "batch = [1, 4]", "workload.batch"),
        ("repeats = 2", "repeats = 1", "measurement.repeats: 2 -> 1"),
    ],
)
def test_merge_refuses_cubes_of_different_workloads(
    tiny_sweep: Path, tmp_path: Path, old: str, new: str, named: str
) -> None:
    a, b = tiny_sweep, tmp_path / "b"
    other = replace_block(
        replace_block(TINY, old, new), 'profile = "h100-sxm"', 'profile = "h200-sxm"'
    )
    assert sweep(write(tmp_path / "b.toml", other), b).exit_code == 0
    result = invoke("cube", "merge", str(a), str(b), "--out", str(tmp_path / "m.nc"))
    assert_one_line_error(result, 2, "cannot merge", named)
    assert not (tmp_path / "m.nc").exists()


# -- output-folder faults ---------------------------------------------------------------------


def _no_temp_files(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_a_full_disk_while_writing_the_cube(tmp_path: Path, monkeypatch) -> None:
    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"

    def full(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        Path(path).write_bytes(b"\x89HDF half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(dvfs.cube.files, "_write_netcdf4", full)
    result = sweep(campaign, out)
    assert_one_line_error(
        result,
        1,
        f"cannot write the cube {out / 'cube.nc'}: No space left on device",
        "free some space",
        f"dvfs cube build {out}",
        notes=("starting twin server",),
    )
    _no_temp_files(out)
    assert not (out / "cube.nc").exists()
    monkeypatch.undo()
    again = sweep(campaign, out)  # nothing left behind blocks the rerun; no cell is measured twice
    assert again.exit_code == 0, again.output
    assert "0 cell(s) measured" in again.output
    assert (open_cube(out / "cube.nc")["cell_status"].values == STATUS_OK).all()


def test_a_full_disk_while_writing_the_journal(tmp_path: Path, monkeypatch) -> None:
    import dvfs.measure.journal

    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    journal = out / "journal.jsonl"
    real_write = os.write
    writes = {"n": 0, "cells": 0}

    def write_fd(fd: int, data) -> int:
        # Only writes to the journal count (however many fsyncs the sync policy makes): the
        # second cell's meets a full disk (a refusal before the first cell would leave no
        # journal: a sweep that measured nothing leaves its folder as it found it).
        if journal.exists() and os.path.samestat(os.fstat(fd), os.stat(journal)):
            writes["n"] += 1
            writes["cells"] += bytes(data).count(b'"type":"cell"')
            if writes["cells"] >= 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(dvfs.measure.journal.os, "write", write_fd)
    result = sweep(campaign, out)
    monkeypatch.undo()
    assert writes["cells"] >= 2, "the journal was not written through os.write"
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    # One line says what happened (after the progress lines), nothing else is an error.
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if "rror" in line] == [lines[-1]], result.stderr
    # naming the journal: an os.write's error has no path (`dvfs demo` on a full disk said
    # "cannot write the journal: No space left on device", not where)
    assert lines[-1].startswith(f"Error: cannot write the journal {journal}: No space left on")
    # What a full disk may leave: half a line at the end.
    with open(journal, "a") as f:
        f.write('{"type":"cell","key":"{\\"batch')
    again = sweep(campaign, out)
    assert again.exit_code == 0, again.output
    assert (open_cube(out / "cube.nc")["cell_status"].values == STATUS_OK).all()


def test_out_under_a_regular_file(tmp_path: Path) -> None:
    campaign = write(tmp_path / "tiny.toml", TINY)
    (tmp_path / "somefile").write_text("x")
    result = sweep(campaign, tmp_path / "somefile" / "x")
    assert_one_line_error(result, 1, "somefile", "not a folder", "--out")
    # A missing parent is created.
    assert sweep(campaign, tmp_path / "new" / "deeper" / "out").exit_code == 0


@pytest.mark.parametrize(
    ("command", "option"),
    [
        (["headroom", "{cube}", "-o", "{out}"], "--output"),
        (["cube", "build", "{cube}", "-o", "{out}"], "--out"),
        (["plot", "{cube}", "--out", "{out}"], "--out"),
        (["report", "{cube}", "-o", "{out}"], "--output"),
    ],
)
def test_an_analysis_output_under_a_regular_file_names_the_option(
    small_sweep: Path, tmp_path: Path, command: list[str], option: str
) -> None:
    """Every analysis command's output path under a regular file: the same one line, naming
    the path and the option to change (README: file-system faults exit 1)."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "result.json"
    args = [a.format(cube=small_sweep, out=out) for a in command]
    result = CliRunner().invoke(cli, args)
    assert_one_line_error(
        result, 1, str(out), "not a folder", f"choose a path inside a folder for {option}"
    )


def test_a_read_only_output_folder(tmp_path: Path, monkeypatch) -> None:
    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "ro" / "out"
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if self == out:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    result = sweep(campaign, out)
    line = assert_one_line_error(result, 1, str(out), "file system is mounted read-only", "--out")
    assert line.lower().count("read-only") == 1, line  # not "Read-only ...; ... read-only"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_folder_without_write_permission(tmp_path: Path) -> None:
    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    try:
        result = sweep(campaign, out)
        assert_one_line_error(result, 1, "Permission denied", "--out")
    finally:
        out.chmod(0o755)


def test_an_output_over_a_file_the_command_reads_is_refused_and_nothing_is_lost(
    swept: Path,
) -> None:
    """`-o` naming the journal or the cube the command reads would replace the measurements
    with its output: refused (exit 2) before anything is written; the cube's own place stays
    a legal output for `cube build`, which reads only the journal."""
    journal, cube = swept / "journal.jsonl", swept / "cube.nc"
    before = {path: path.read_bytes() for path in (journal, cube)}
    refused = [
        ("cube", "build", str(swept), "-o", str(journal)),
        ("headroom", str(swept), "-o", str(cube)),
        ("headroom", str(cube), "-o", str(cube)),
        ("report", str(swept), "-o", str(cube)),
        ("cube", "merge", str(swept), str(cube), "-o", str(cube)),
    ]
    for args in refused:
        result = invoke(*args)
        assert_one_line_error(result, 2)
        assert "which this command reads" in result.output and "another output" in result.output
    assert {path: path.read_bytes() for path in before} == before
    sizes = open_cube(cube).sizes
    rebuilt = invoke("cube", "build", str(swept), "-o", str(cube))
    assert rebuilt.exit_code == 0, rebuilt.output
    assert open_cube(cube).sizes == sizes


def test_cube_info_quotes_energy_of_valid_cells_only(small_sweep: Path, tmp_path: Path) -> None:
    """An invalid cell's energy is not a measurement: `cube info` gives the range over the
    valid measured cells, and says so when there is none."""
    import json

    ds = open_cube(small_sweep / "cube.nc")
    energy = ds["energy_per_token_j"].values.copy()
    valid = ds["valid"].values.copy()
    first = np.unravel_index(np.nanargmax(energy), energy.shape)
    energy[first], valid[first] = 1e6, 0  # an outlier the cell's flags invalidated
    flagged = ds.assign(
        energy_per_token_j=(ds["energy_per_token_j"].dims, energy),
        valid=(ds["valid"].dims, valid),
    )
    from dvfs.cube import write_cube

    write_cube(flagged, tmp_path / "flagged.nc")
    lo, hi = json.loads(invoke("cube", "info", str(tmp_path / "flagged.nc"), "--json").output)[
        "energy_per_token_j"
    ]
    assert hi < 1e6 and lo <= hi
    none_valid = flagged.assign(valid=(ds["valid"].dims, np.zeros_like(valid)))
    write_cube(none_valid, tmp_path / "none.nc")
    shown = invoke("cube", "info", str(tmp_path / "none.nc"))
    assert shown.exit_code == 0 and "no valid cell" in shown.output
    assert json.loads(invoke("cube", "info", str(tmp_path / "none.nc"), "--json").output)[
        "energy_per_token_j"
    ] == [None, None]


def test_cube_info_json_gives_the_axes_numbers_as_numbers(small_sweep: Path) -> None:
    """`cube info --json`'s coordinates are the cube's: numbers as JSON numbers (they were
    text, and a reader's max() of the demo's clocks, 705 to 1980 MHz, was "930"), the string
    axes as text; the text output shows them as before."""
    import json

    ds = open_cube(small_sweep / "cube.nc")
    result = invoke("cube", "info", str(small_sweep), "--json")
    assert result.exit_code == 0, result.output
    coords = json.loads(result.output)["coords"]
    for dim in ("sm_clock", "power_limit", "batch", "repeat", "drafter", "corpus"):
        assert coords[dim] == ds[dim].values.tolist(), dim
    assert max(coords["sm_clock"]) == int(ds["sm_clock"].max())
    assert all(type(v) is int for v in coords["sm_clock"] + coords["batch"])
    assert all(type(v) is str for v in coords["drafter"] + coords["corpus"])
    text = " ".join(invoke("cube", "info", str(small_sweep)).output.split())
    shown = ", ".join(str(v) for v in ds["power_limit"].values.tolist())
    assert f"power_limit {ds.sizes['power_limit']}: {shown}" in text, text


def test_cube_info_says_twin_once_and_open_cube_takes_a_folder(tiny_sweep: Path) -> None:
    """A twin's GPU name carries "(twin)": `cube info` does not add the backend again; and
    `dvfs.open_cube` takes a sweep folder, as every command does."""
    import dvfs

    result = invoke("cube", "info", str(tiny_sweep))
    assert result.exit_code == 0, result.output
    [line] = [ln for ln in result.output.splitlines() if " GPU " in f" {ln.strip()}"[:5]]
    assert line.count("(twin)") == 1 and "(twin) x1" in line, line
    ds = dvfs.open_cube(str(tiny_sweep))
    assert ds.identical(dvfs.open_cube(str(tiny_sweep / "cube.nc")))
    assert ds.dvfs.stock["sm_clock"] > 0


@pytest.mark.parametrize("fails", [False, True])
def test_a_cube_is_written_with_no_chunk_cache_and_the_process_keeps_its_own(
    tiny_sweep: Path, tmp_path: Path, monkeypatch, fails: bool
) -> None:
    """The cube goes out with HDF5's chunk cache off (its chunks are not held until the file
    closes), compressed as before; the process's default is back afterwards, also when the
    write fails."""
    from dvfs.cube import write_cube

    ds = open_cube(tiny_sweep)
    before = netCDF4.get_chunk_cache()
    seen: list[tuple[int, int, float]] = []
    real = dvfs.cube.files._write_netcdf4

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(netCDF4.get_chunk_cache())
        if fails:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(dvfs.cube.files, "_write_netcdf4", spy)
    path = tmp_path / "cube.nc"
    if fails:
        with pytest.raises(CubeError, match="No space left on device"):
            write_cube(ds, path)
    else:
        write_cube(ds, path)
    assert netCDF4.get_chunk_cache() == before
    assert [size for size, _, _ in seen] == [0]
    assert before[0] > 0
    if fails:
        return
    with netCDF4.Dataset(path) as nc:
        energy = nc["energy_per_token_j"]
        assert energy.chunking() == "contiguous"  # too small to compress (the next test)
        assert np.isnan(energy.getncattr("_FillValue"))
    xr.testing.assert_identical(open_cube(path), ds)


def _netcdf_content(path: Path) -> list[object]:
    """What `ncdump` shows of a netCDF-4 file, in its order: the format, dimensions, global
    attributes (values and types), and each variable's type, dimensions, attributes, fill
    value, filters, chunking, byte order and raw data (no masking or scaling)."""

    def attr(value: object) -> object:
        if isinstance(value, np.ndarray):
            return (value.dtype.str, value.tolist())
        return (type(value).__name__, repr(value))

    with netCDF4.Dataset(path) as nc:
        nc.set_auto_maskandscale(False)
        content: list[object] = [
            (nc.data_model, nc.disk_format, list(nc.groups)),
            [(d.name, d.size, d.isunlimited()) for d in nc.dimensions.values()],
            [(k, attr(nc.getncattr(k))) for k in nc.ncattrs()],
        ]
        for name, var in nc.variables.items():
            data = var[...]
            is_str = var.dtype is str
            content.append(
                (
                    name,
                    var.datatype.name if is_str else var.datatype.str,
                    var.dimensions,
                    [(k, attr(var.getncattr(k))) for k in var.ncattrs()],
                    var.filters(),
                    var.chunking(),
                    var.endian(),
                    np.asarray(data, dtype=object).tolist() if is_str else data.tobytes(),
                )
            )
    return content


def test_a_cube_file_is_the_one_xarray_writes(tiny_sweep: Path, tmp_path: Path) -> None:
    """`write_cube` defines every variable before it fills any (netCDF-C flushed HDF5's
    metadata each time a variable's data took it out of define mode): its file holds what
    `to_netcdf` with the same encoding writes, dimensions, attributes, types, fill values,
    compression and data alike: for a swept cube, one whose variables are compressed, and a
    hand-built one (no cube file behind it: the sweep's was written by `write_cube`)."""
    from cubes import make_cube

    from dvfs.cube import write_cube
    from dvfs.cube.files import COMPRESS_FROM_BYTES, _encoding, _labels_to_cf

    tiny = open_cube(tiny_sweep)
    copies = -(-COMPRESS_FROM_BYTES // tiny["energy_per_token_j"].nbytes)
    big = xr.concat([tiny] * copies, dim="repeat", data_vars="minimal", coords="minimal")
    big = big.assign_coords(repeat=np.arange(big.sizes["repeat"]))
    made = make_cube(
        clocks=[1980, 1005],
        drafters=["none", "eagle3"],
        corpora=["code", "math"],
        energy=lambda clock, *_: np.nan if clock == 1005 else 1.0,
        valid=lambda clock, limit, batch, drafter, *_: drafter == "none",
    )
    for name, ds in (("tiny", tiny), ("big", big), ("made", made)):
        ours = write_cube(ds, tmp_path / f"{name}.nc")
        on_disk = _labels_to_cf(ds)
        theirs = tmp_path / f"{name}-xarray.nc"
        on_disk.to_netcdf(theirs, format="NETCDF4", engine="netcdf4", encoding=_encoding(on_disk))
        assert _netcdf_content(ours) == _netcdf_content(theirs), name
        with netCDF4.Dataset(ours) as nc:  # the comparison saw both layouts and strings
            contiguous = {nc[v].chunking() == "contiguous" for v in nc.variables}
            assert contiguous == ({True, False} if name == "big" else {True}), name
            assert nc["drafter_label"].dtype is str


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_a_signal_while_a_cube_is_written_waits_for_the_file(
    tiny_sweep: Path, tmp_path: Path, signum: str
) -> None:
    """Ctrl-C (or SIGTERM under `signals_raise`, as a sweep has) arriving while xarray held
    one of its locks raised there, the lock stayed held and closing the file waited for it:
    `write_cube` hung for ever, a temp file beside the cube. The signal now waits until the
    cube is whole and in place, then acts (run in a child, bounded; the signal is sent as
    xarray takes its lock for the tenth time, mid-write, where most of a write's time is
    spent)."""
    import subprocess

    from conftest import PYTHON, subprocess_env

    code = (
        "import os, signal, sys\n"
        "import xarray.backends.locks as locks\n"
        "from dvfs.cube import open_cube, write_cube\n"
        "from dvfs.signals import signals_raise\n"
        "ds = open_cube(sys.argv[1])\n"
        "real, taken = locks.CombinedLock.acquire, []\n"
        "def acquire(self, *args, **kwargs):\n"
        "    got = real(self, *args, **kwargs)\n"
        "    taken.append(got)\n"
        "    if len(taken) == 10:  # mid-write: the file is open, variables are written\n"
        "        os.kill(os.getpid(), getattr(signal, sys.argv[3]))\n"
        "    return got\n"
        "locks.CombinedLock.acquire = acquire\n"
        "try:\n"
        "    with signals_raise():\n"
        "        write_cube(ds, sys.argv[2])\n"
        "except BaseException as exc:\n"
        "    print('stopped by', type(exc).__name__)\n"
    )
    out = tmp_path / "cube.nc"
    argv = [PYTHON, "-c", code, str(tiny_sweep / "cube.nc"), str(out), signum]
    done = subprocess.run(argv, capture_output=True, text=True, env=subprocess_env(), timeout=60)
    stopped = "KeyboardInterrupt" if signum == "SIGINT" else "Interrupted"
    assert done.stdout.splitlines() == [f"stopped by {stopped}"], done.stdout + done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["cube.nc"]
    xr.testing.assert_identical(open_cube(out), open_cube(tiny_sweep))


def test_a_cube_held_in_dask_chunks_is_written(tiny_sweep: Path, tmp_path: Path) -> None:
    """`write_cube` (dvfs.cube's API) writes a cube whose variables are dask arrays as
    `to_netcdf` does: one chunked in memory (filled after every variable was defined, its
    label strings were refused as a dask array: IndexError) and one opened lazily from its
    file (each variable was computed under the lock the write holds, where reading the file
    waits for that lock: the write hung for ever, so it runs in a child, bounded)."""
    import subprocess
    import sys

    pytest.importorskip("dask")
    from dvfs.cube import write_cube

    tiny = open_cube(tiny_sweep)
    write_cube(tiny.chunk(), tmp_path / "chunked.nc")
    xr.testing.assert_identical(open_cube(tmp_path / "chunked.nc"), tiny)
    code = (
        "import sys, xarray as xr\n"
        "from dvfs.cube import write_cube\n"
        "from dvfs.cube.files import _labels_from_cf\n"
        "with xr.open_dataset(sys.argv[1], chunks={}) as ds:\n"
        "    write_cube(_labels_from_cf(ds), sys.argv[2])\n"
    )
    lazy = tmp_path / "lazy.nc"
    argv = [sys.executable, "-c", code, str(tiny_sweep / "cube.nc"), str(lazy)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    xr.testing.assert_identical(open_cube(lazy), tiny)


def test_variables_are_compressed_where_it_pays(tiny_sweep: Path, tmp_path: Path) -> None:
    """Compression needs HDF5's chunked layout, whose index costs more than a tiny cube's
    variables hold: those from COMPRESS_FROM_BYTES up are compressed, smaller ones stored as
    they are, and a cube reads back the same either way and is smaller for it."""
    from dvfs.cube import write_cube
    from dvfs.cube.files import COMPRESS_FROM_BYTES

    tiny = open_cube(tiny_sweep)
    copies = -(-COMPRESS_FROM_BYTES // tiny["energy_per_token_j"].nbytes)  # to just past it
    big = xr.concat([tiny] * copies, dim="repeat", data_vars="minimal", coords="minimal")
    big = big.assign_coords(repeat=np.arange(big.sizes["repeat"]))
    for name, ds in (("tiny", tiny), ("big", big)):
        path = write_cube(ds, tmp_path / f"{name}.nc")
        with netCDF4.Dataset(path) as nc:
            for var in ("energy_per_token_j", "valid", "cell_status", "tpot_ms"):
                filters = nc[var].filters()
                compressed = ds[var].nbytes >= COMPRESS_FROM_BYTES
                assert bool(filters["zlib"]) == compressed, (name, var)
                assert filters["complevel"] == (4 if compressed else 0), (name, var)
        xr.testing.assert_identical(open_cube(path), ds)
    assert big["tpot_ms"].nbytes >= COMPRESS_FROM_BYTES > tiny["tpot_ms"].nbytes
    # a tiny cube's file: smaller uncompressed than its variables' chunk indexes would make it
    assert (tmp_path / "tiny.nc").stat().st_size < 200_000


def test_cube_writes_from_two_threads_take_turns_and_leave_the_chunk_cache_as_it_was(
    tiny_sweep: Path, tmp_path: Path, monkeypatch
) -> None:
    """The chunk-cache setting is the process's: a write that began while another was under
    way would have restored the other's 0 for good. Writes take turns (netCDF-C is not
    thread-safe either): the second starts only once the first has put the setting back."""
    import threading

    from dvfs.cube import write_cube

    ds = open_cube(tiny_sweep)
    before = netCDF4.get_chunk_cache()
    first_inside = threading.Event()
    release_first = threading.Event()
    seen: list[tuple[str, tuple[int, int, float]]] = []
    real = dvfs.cube.files._write_netcdf4

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        name = threading.current_thread().name
        seen.append((name, netCDF4.get_chunk_cache()))
        if name == "first":
            first_inside.set()
            release_first.wait()  # (the suite's timeout bounds a hang)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(dvfs.cube.files, "_write_netcdf4", spy)
    first = threading.Thread(target=write_cube, args=(ds, tmp_path / "a.nc"), name="first")
    second = threading.Thread(target=write_cube, args=(ds, tmp_path / "b.nc"), name="second")
    first.start()
    try:
        first_inside.wait()
        second.start()
        second.join(0.3)  # time to get in, had it not had to wait
        assert [name for name, _ in seen] == ["first"]
    finally:  # a failed check must not leave the first write waiting
        release_first.set()
        first.join()
        if second.ident is not None:  # started
            second.join()
    assert [name for name, _ in seen] == ["first", "second"]
    assert all(setting[0] == 0 for _, setting in seen)
    assert netCDF4.get_chunk_cache() == before
    xr.testing.assert_identical(open_cube(tmp_path / "b.nc"), ds)


def test_a_built_cube_lists_its_variables_in_the_order_it_always_has(tiny_sweep: Path) -> None:
    """`build_cube` makes its Dataset in one step (setting the split method and the GPUs that
    measured each cell afterwards cost a merge of the whole cube each): the variables, the
    coordinates and their attributes are where and as they were, in memory and on disk
    (`ncdump` and every reader list them in that order)."""
    from dvfs.cube import build_cube
    from dvfs.cube.build import MEASURED_ON, MEASURED_ON_ATTRS, split_method_attrs
    from dvfs.cube.precision import PRECISION_MISSED
    from dvfs.cube.schema import (
        CELL_DIMS,
        COORD_ATTRS,
        GPU_TIME,
        SPLIT,
        SPLIT_METHOD_VAR,
        TIMELINE,
        VARIABLES,
    )

    ds = build_cube(tiny_sweep / "journal.jsonl")
    measured = [s.name for s in (*VARIABLES, *TIMELINE, *GPU_TIME, *SPLIT)]
    axes = [*CELL_DIMS, "quantile", "sample"]
    expected = [*measured, "attention_backend", "cell_status", *axes, SPLIT_METHOD_VAR]
    # (a later addition, made with the rest: `dvfs.cube.precision`)
    expected += [PRECISION_MISSED, MEASURED_ON]
    assert list(ds.variables) == expected
    assert list(ds.coords) == [*axes, MEASURED_ON] and list(ds.indexes) == axes
    assert ds[MEASURED_ON].dims == CELL_DIMS and ds[MEASURED_ON].attrs == MEASURED_ON_ATTRS
    split = ds[SPLIT_METHOD_VAR]
    assert split.dims == CELL_DIMS and split.dtype == np.int8
    assert list(split.attrs) == list(split_method_attrs())
    assert np.array_equal(split.attrs["flag_values"], split_method_attrs()["flag_values"])
    for name in axes:
        units, long_name = COORD_ATTRS[name]
        assert ds[name].attrs == {"units": units, "long_name": long_name}, name
    with netCDF4.Dataset(tiny_sweep / "cube.nc") as nc:
        on_disk = [n for n in nc.variables if not n.endswith("_label")]
    assert on_disk == [n for n in expected if n not in ("drafter", "corpus")]


@pytest.mark.usefixtures("unsaved_figures")
def test_cube_info_and_report_say_not_recorded_for_a_hand_built_cubes_missing_attributes(
    tmp_path: Path,
) -> None:
    """A cube made with xarray holding the cube's variables but not the attributes a sweep
    records (GPU, driver, engine, model, campaign, date): `cube info` and the report say "not
    recorded" for each, never "None" (they printed "None xNone (None)" for the GPU); --json
    gives null."""
    import json

    from cubes import make_cube

    cube = tmp_path / "hand.nc"
    make_cube(clocks=[1980, 1500]).to_netcdf(cube)
    shown = invoke("cube", "info", str(cube))
    assert shown.exit_code == 0, shown.output
    assert "None" not in shown.output, shown.output
    rows = {ln.split()[0]: ln.split(maxsplit=1)[1].strip() for ln in shown.output.splitlines()[1:5]}
    assert rows == dict.fromkeys(("GPU", "driver", "engine", "model"), "not recorded"), rows
    summary = json.loads(invoke("cube", "info", str(cube), "--json").output)
    assert [summary[k] for k in ("gpu", "driver", "engine", "model", "campaign")] == [None] * 5
    report = invoke("report", str(cube), "-o", str(tmp_path / "r.md"))
    assert report.exit_code == 0, report.output
    text = (tmp_path / "r.md").read_text()
    assert "None" not in text and "**GPU:** not recorded" in text
    # Two such cubes along `gpu` without `gpu_names`: the GPUs' models are said not recorded
    # (the line ended "2 GPUs: ", naming nothing).
    one = make_cube(clocks=[1980, 1500])
    merged = xr.concat([one, one], dim=xr.DataArray(["g0", "g1"], dims="gpu", name="gpu"))
    merged.attrs = dict(one.attrs)
    merged.to_netcdf(tmp_path / "merged.nc")
    shown = invoke("cube", "info", str(tmp_path / "merged.nc"))
    assert shown.exit_code == 0, shown.output
    assert "merged cube of 2 GPUs: their models not recorded" in shown.output, shown.output


@pytest.mark.parametrize("changed", [ImportError, AttributeError, TypeError])
def test_a_cube_is_written_alike_where_xarrays_internals_differ(
    tiny_sweep: Path, tmp_path: Path, monkeypatch, changed: type[Exception]
) -> None:
    """`write_cube`'s define-then-fill write leans on xarray's internals (a name imported, a
    method's arguments); on an xarray where they differ, after a part of the file was written,
    it writes the same file whole the documented way, never a traceback."""
    import dvfs.cube.files
    from dvfs.cube import write_cube

    tiny = open_cube(tiny_sweep)
    expected = _netcdf_content(write_cube(tiny, tmp_path / "now.nc"))

    def other_xarray(ds: xr.Dataset, path: Path, encoding: dict) -> None:
        path.write_bytes(b"\x89HDF\r\n partly written")
        raise changed("xarray's internals differ here")

    monkeypatch.setattr(dvfs.cube.files, "_define_then_fill", other_xarray)
    assert _netcdf_content(write_cube(tiny, tmp_path / "other.nc")) == expected
    xr.testing.assert_identical(open_cube(tmp_path / "other.nc"), tiny)


@pytest.mark.parametrize("target", ["journal", "cube"])
def test_a_read_only_file_system_mid_run_is_said_once(
    tmp_path: Path, monkeypatch, target: str
) -> None:
    """A journal or cube write that meets a read-only file system mid-run says so once: it
    was "Read-only file system; the filesystem is read-only" (as an --out folder's now is)."""
    import dvfs.measure.journal

    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    journal = out / "journal.jsonl"
    read_only = OSError(errno.EROFS, os.strerror(errno.EROFS))
    if target == "journal":
        real_write = os.write

        def write_fd(fd: int, data) -> int:  # type: ignore[no-untyped-def]
            cell = b'"type":"cell"' in bytes(data)
            if cell and journal.exists() and os.path.samestat(os.fstat(fd), os.stat(journal)):
                raise read_only
            return real_write(fd, data)

        monkeypatch.setattr(dvfs.measure.journal.os, "write", write_fd)
        doing = f"cannot write the journal {journal}"
    else:

        def fail(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise read_only

        monkeypatch.setattr(dvfs.cube.files, "_write_netcdf4", fail)
        doing = f"cannot write the cube {out / 'cube.nc'}"
    result = sweep(campaign, out)
    monkeypatch.undo()
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"Error: {doing}: its file system is mounted read-only: choose another folder with --out"
    ), line
    assert line.lower().count("read-only") == 1, line
