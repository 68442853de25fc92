"""A governor's record (`governed-<uuid>.json`) whose clock lock is outside the GPU's SM clocks
(a hand edit) is no lock `dvfs govern` set: `cap show` showed it as the lock in force without a
word. It is checked as the caps record's lock is: called damaged in one warning line naming
the file and the reset that clears it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from nvml_support import installed_nvml  # noqa: F401  (this module's `nvml` fixture)

from dvfs.caps import GovernorLocks
from dvfs.cli import cli


def _governed(lock: tuple[int, int]) -> tuple[str, Path]:
    """GPU 0's UUID and its governor record, holding `lock` (this boot's)."""
    uuid = json.loads(CliRunner().invoke(cli, ["gpu", "list", "--json"]).output)[0]["uuid"]
    record = GovernorLocks(Path(os.environ["DVFS_STATE_DIR"]))
    record.write(uuid, lock)
    return uuid, record.path(uuid)


@pytest.mark.parametrize("lock", [(5000, 6000), (100, 1200)])
def test_a_governor_lock_outside_the_gpus_clocks_is_called_damaged(
    nvml, lock: tuple[int, int]
) -> None:
    """[5000, 6000] MHz on an H100 (or a low clock under its lowest): `cap show` says in one
    line that the record is damaged, naming the file, the GPU's clocks and `dvfs cap reset
    0`, which clears it (the GPU reset whole)."""
    uuid, path = _governed(lock)
    result = CliRunner().invoke(cli, ["cap", "show"])
    assert result.exit_code == 0, result.output
    [line] = [x for x in result.stderr.splitlines() if "governor record" in x]
    assert line.startswith(f"warning: dvfs's governor record {path} is damaged for GPU 0 ("), line
    assert f"lock_mhz is [{lock[0]}, {lock[1]}], outside GPU 0's SM clocks " in line, line
    assert "no lock dvfs govern set" in line and "else `dvfs cap reset 0 --state-dir " in line, line
    assert f"stop that governor (pid {os.getpid()}) if it runs" in line, line
    assert "Traceback" not in result.output
    reset = CliRunner().invoke(cli, ["cap", "reset", "0"])
    assert reset.exit_code == 0, reset.output
    assert not path.exists()
    again = CliRunner().invoke(cli, ["cap", "show"])
    assert again.exit_code == 0 and "governor record" not in again.stderr, again.output


def test_a_governor_lock_within_the_gpus_clocks_is_shown_without_a_warning(nvml) -> None:
    """The governor's own lock (within the GPU's clocks) is shown as before, no line."""
    _governed((210, 1200))
    result = CliRunner().invoke(cli, ["cap", "show"])
    assert result.exit_code == 0, result.output
    assert "locked 210-1200 MHz by dvfs govern" in result.output.replace("\n", " ")
    assert "warning" not in result.stderr, result.stderr
