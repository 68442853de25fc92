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
