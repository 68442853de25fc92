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
