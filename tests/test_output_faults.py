"""Outputs that cannot be written: the refusal names what could not be written, and where."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, subprocess_env

FULL = Path("/dev/full")


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full here")
@pytest.mark.parametrize("buffered", [False, True])
@pytest.mark.parametrize(
    "args",
    [
        ["cube", "info", "{cube}"],
        ["cube", "info", "{cube}", "--json"],
        ["headroom", "{cube}", "--json"],
    ],
)
def test_a_full_standard_output_is_said_to_be_standard_output(
    small_sweep: Path, args: list[str], buffered: bool
) -> None:
    """`dvfs cube info CUBE > /dev/full`: "cannot write: no space...; choose another path", no
    path, and the command has none to choose (and, stdout buffered, two lines of the
    interpreter's and exit 120 after it); it now says standard output is full, in one line,
    exit 1."""
    command = [PYTHON, "-m", "dvfs", *(a.format(cube=small_sweep) for a in args)]
    env = subprocess_env(**({} if buffered else {"PYTHONUNBUFFERED": "1"}))
    if buffered:
        env.pop("PYTHONUNBUFFERED", None)
    with FULL.open("w") as full:
        done = subprocess.run(
            command, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=120
        )
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("Error: cannot write to standard output: no space left"), line
    assert "redirect it elsewhere" in line and "choose another path" not in line, line


def test_a_full_file_other_than_standard_output_is_not_said_to_be_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write without a path that fails on another file (a console writing elsewhere) is not
    taken for standard output, nor where the interpreter has none (`sys.__stdout__` None)."""
    import errno
    import io

    from dvfs.cli.common import describe_os_error

    class Full(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    class Console:
        file = None

    def write(handle: io.RawIOBase, console: Console) -> None:
        handle.write(b"x")

    monkeypatch.setattr("sys.__stdout__", None)
    try:
        write(Full(), Console())
    except OSError as exc:
        text = describe_os_error(exc)
    assert "standard output" not in text and "no space left" in text, text


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full here")
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["cube", "--help"]])
def test_click_s_own_output_into_a_full_standard_output_is_one_line(args: list[str]) -> None:
    """`dvfs --help > /dev/full` (and --version, a group's --help: click writes those itself,
    before any command's handler) ended in a traceback of click's echo; it is one line on
    stderr, exit 1."""
    with FULL.open("w") as full:
        done = subprocess.run(
            [PYTHON, "-m", "dvfs", *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
            timeout=120,
        )
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("Error: cannot write to standard output: no space left"), line


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full here")
@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["no-such-command"], 2),  # click's usage error
        (["cube", "info"], 2),  # a missing argument
        (["cube", "info", "{missing}"], 1),  # dvfs's own error
        (["sweep", "{missing}"], 2),  # a missing campaign file
    ],
)
def test_a_standard_error_that_cannot_be_written_keeps_the_exit_code(
    tmp_path: Path, args: list[str], code: int
) -> None:
    """`dvfs COMMAND 2> /dev/full`: the one line cannot be written, so the exit code is all
    that tells; a usage error exited 1 there (the failed write's traceback, itself unwritten),
    not the 2 it exits with otherwise."""
    missing = tmp_path / "missing.toml"
    command = [PYTHON, "-m", "dvfs", *(a.format(missing=missing) for a in args)]
    with FULL.open("w") as full:
        done = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=full, env=subprocess_env(), timeout=120
        )
    assert done.returncode == code
    assert done.stdout == b""


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full here")
@pytest.mark.parametrize("progress", [True, False])
def test_a_standard_error_that_cannot_be_written_does_not_stop_the_work(
    tmp_path: Path, progress: bool
) -> None:
    """`dvfs sweep CAMPAIGN 2> /dev/full` (a cron job's stderr on a full disk): the sweep died
    at its first progress note ("starting twin server"), exit 1, having measured nothing, and
    said nothing. What is said on stderr is lost; the sweep measures, writes its cube, and
    exits 0."""
    from conftest import TINY, write

    campaign = write(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "out"
    command = [PYTHON, "-m", "dvfs", "sweep", str(campaign), "--out", str(out)]
    with FULL.open("w") as full:
        done = subprocess.run(
            [*command, *([] if progress else ["--no-progress"])],
            stdout=subprocess.PIPE,
            stderr=full,
            text=True,
            env=subprocess_env(),
            timeout=300,
        )
    assert done.returncode == 0, done.stdout
    assert (out / "cube.nc").is_file()


@pytest.mark.parametrize(
    "args", [["corpus", "list"], ["gpu", "list", "--twin", "h100-sxm"], ["cube", "info", "{cube}"]]
)
def test_tables_on_a_terminal_narrower_than_120_columns_fit_it(
    small_sweep: Path, args: list[str]
) -> None:
    """On a terminal 80 columns wide, every table was drawn 120 wide (the width a pipe or file
    gets): each of its lines broke in two on the screen, the borders scattered. A terminal
    gets its own width, a value too long for its column folded, not cut short."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = subprocess_env()
    for name in ("COLUMNS", "LINES", "FORCE_TERMINAL", "NO_COLOR", "TERM"):
        env.pop(name, None)
    env["TERM"] = "xterm"
    command = [PYTHON, "-m", "dvfs", *(a.format(cube=small_sweep) for a in args)]
    with subprocess.Popen(command, stdout=follower, stderr=subprocess.DEVNULL, env=env) as proc:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the command closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=120) == 0
    os.close(leader)
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))
    lines = text.replace("\r", "").splitlines()
    assert lines and max(len(line) for line in lines) <= 80, text
    assert "\u2026" not in text, text  # nothing cut short with an ellipsis


@pytest.mark.parametrize("forced", [{"FORCE_COLOR": "1"}, {"TTY_COMPATIBLE": "1"}])
@pytest.mark.parametrize("args", [["corpus", "list"], ["gpu", "list", "--twin", "h100-sxm"]])
def test_forced_colour_keeps_the_width_of_a_pipe(args: list[str], forced: dict[str, str]) -> None:
    """FORCE_COLOR=1 (or TTY_COMPATIBLE=1), as CI jobs often set it, makes rich take a pipe for
    a terminal: its tables were drawn 80 columns wide (rich's guess for a terminal it cannot
    measure), not the 120 a pipe gets, their cells folded. Colour may be forced; the width of
    a pipe is still a pipe's."""
    import re

    from click.testing import CliRunner

    from dvfs.cli import cli

    def lines(env: dict[str, str | None]) -> list[str]:
        done = CliRunner().invoke(cli, args, env={"COLUMNS": None, "LINES": None, **env})
        assert done.exit_code == 0, done.output
        return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout).splitlines()

    plain = lines({"FORCE_COLOR": None, "TTY_COMPATIBLE": None, "NO_COLOR": None})
    assert max(len(line) for line in plain) > 80
    assert lines({**forced, "NO_COLOR": None}) == plain


@pytest.mark.parametrize("forced", [{"FORCE_COLOR": "1"}, {"TTY_COMPATIBLE": "1"}])
@pytest.mark.parametrize("command", ["headroom", "compare"])
def test_forced_colour_keeps_an_analysis_table_whole_in_a_pipe(
    small_sweep: Path, command: str, forced: dict[str, str]
) -> None:
    """The headroom and compare tables (and their notes) into a pipe keep their natural width,
    as the README says of every table written to a pipe or file; they asked rich's
    `is_terminal`, which FORCE_COLOR or TTY_COMPATIBLE make true of a pipe, so under either
    the table was fitted to 120 columns, its cells folded ('conversati' over 'on') and its
    notes wrapped."""
    import re

    from click.testing import CliRunner

    from dvfs.cli import cli

    def lines(env: dict[str, str | None]) -> list[str]:
        done = CliRunner().invoke(
            cli, [command, str(small_sweep)], env={"COLUMNS": None, "LINES": None, **env}
        )
        assert done.exit_code == 0, done.output
        return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout).splitlines()

    plain = lines({"FORCE_COLOR": None, "TTY_COMPATIBLE": None, "NO_COLOR": None})
    assert max(len(line) for line in plain) > 120
    assert lines({**forced, "NO_COLOR": None}) == plain


@pytest.mark.parametrize("forced", [{"FORCE_COLOR": "1"}, {"TTY_COMPATIBLE": "1"}])
def test_forced_colour_draws_no_progress_bar_into_a_log(
    monkeypatch: pytest.MonkeyPatch, forced: dict[str, str]
) -> None:
    """A sweep's progress bars (one GPU's and a fleet's) are drawn on a terminal only, as the
    README says: off one a log gets the notes and summary lines. They asked rich's
    `is_terminal`, which FORCE_COLOR or TTY_COMPATIBLE make true of a file, so a CI log (or
    `2> sweep.log`) got the bar's redraws and cursor codes, cut to 80 columns ('868/...')."""
    import io
    import sys

    from dvfs.cli.fleet_progress import RichFleetProgress
    from dvfs.cli.progress import RichProgress

    monkeypatch.delenv("NO_COLOR", raising=False)
    for key, value in forced.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a file, no terminal
    for bar in (RichProgress("one"), RichFleetProgress("fleet")):
        assert bar._progress.disable, type(bar).__name__


@pytest.mark.parametrize("argv", [["--bogus-option"], ["corpus", "show", "nosuch"]])
def test_an_interrupt_while_a_usage_error_is_said_keeps_its_exit_code(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    """click's own main, standalone, holds one policy for an interrupt that arrives while it
    writes its last message (Ctrl-C as the usage error is shown): the message may be lost, the
    exit code stands (2). `dvfs`'s entry, which runs click with standalone_mode=False and shows
    its errors itself, let that KeyboardInterrupt out: a traceback, and death by SIGINT."""
    import sys

    import click

    from dvfs.cli import cli
    from dvfs.cli.common import run_main

    def interrupted(self: click.ClickException, file: object = None) -> None:
        raise KeyboardInterrupt

    for kind in (click.ClickException, click.UsageError, click.BadParameter):
        monkeypatch.setattr(kind, "show", interrupted)
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # run_main wraps it: put back after
    monkeypatch.setattr(sys, "argv", ["dvfs", *argv])
    with pytest.raises(SystemExit) as standalone:
        cli.main(prog_name="dvfs")  # click's own standalone main
    assert standalone.value.code == 2
    try:
        run_main(cli, "dvfs")
    except KeyboardInterrupt:
        pytest.fail("the interrupt left dvfs's entry (a traceback)")
    except SystemExit as exc:
        assert exc.code == 2
    else:
        pytest.fail("run_main returned")
