"""A caps record damaged whole (unreadable, or no JSON object of per-GPU objects) and last
written during an earlier boot: the reboot reset every GPU it listed, so it holds no cap in
force. The caps unit at boot warns of it in one line and applies the caps, replacing it, where
it failed at every boot until the record was removed by hand. One damaged during this boot is
still refused, naming the file and the `dvfs cap reset` that mends it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from nvml_support import installed_nvml  # noqa: F401  (this module's `nvml` fixture)

from dvfs.caps import CapsFile, GpuCap, dump_caps
from dvfs.cli import cli

DAMAGED = {"unreadable": '{"GPU-0": {"lock_mhz": nu', "not an object": "[1, 2]"}


def _damaged_after_apply(tmp_path: Path, text: str) -> tuple[Path, Path]:
    """`cap apply` of a 450 W cap on GPU 0, its caps record then damaged: the caps file and
    the record."""
    uuid = json.loads(CliRunner().invoke(cli, ["gpu", "list", "--json"]).output)[0]["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid=uuid, power_limit_w=450.0),))))
    applied = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert applied.exit_code == 0, applied.output
    record = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"
    record.write_text(text)
    return caps, record


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_record_damaged_in_an_earlier_boot_does_not_fail_every_boot(
    nvml, tmp_path: Path, damage: str
) -> None:
    """Last written in 2020 (before this boot), the GPU at its default again (the reboot):
    `cap apply --wait-for-driver` (the unit's start) warns of the record in one line naming
    it, caps the GPU and writes a sound record in its place; the next start says nothing."""
    from dvfs.gpu.safety import boot_started

    if boot_started() is None:
        pytest.skip("the kernel does not say when this boot began")
    caps, record = _damaged_after_apply(tmp_path, DAMAGED[damage])
    os.utime(record, (1_577_836_800, 1_577_836_800))  # 2020-01-01
    nvml.fake_update_device(0, power_limit_mw=700_000)  # the reboot's reset
    start = ["cap", "apply", str(caps), "--wait-for-driver", "300"]
    result = CliRunner().invoke(cli, start)
    assert result.exit_code == 0, result.output
    [line] = [x for x in result.stderr.splitlines() if "caps record" in x]
    assert line.startswith("warning: dvfs's caps record "), line
    assert f"{record} was last written before this boot" in line, line
    said = {
        "unreadable": "warning: dvfs's caps record is unreadable (",
        "not an object": "warning: dvfs's caps record is not a JSON object of per-GPU objects: ",
    }
    assert line.startswith(said[damage]) and "not a dvfs caps record" not in line, line
    assert "Traceback" not in result.output
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    entry = next(iter(json.loads(record.read_text()).values()))
    assert entry["power_limit_mw"] == 450_000 and entry["power_limit_before_mw"] == 700_000
    again = CliRunner().invoke(cli, start)
    assert again.exit_code == 0 and "caps record" not in again.stderr, again.output
    reset = CliRunner().invoke(cli, ["cap", "reset", "--applied"])
    assert reset.exit_code == 0, reset.output
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_record_damaged_in_this_boot_is_refused_naming_the_file_and_the_fix(
    nvml, tmp_path: Path, damage: str
) -> None:
    """Damaged during this boot, the record may list caps in force: refused, exit 1, in one
    line naming the file and the `dvfs cap reset` that mends it; the GPU left capped."""
    caps, record = _damaged_after_apply(tmp_path, DAMAGED[damage])
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps), "--wait-for-driver", "300"])
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith(f"Error: {record} is "), line
    assert "; remove it, reset the GPUs with `dvfs cap reset --state-dir " in line, line
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    assert record.read_text() == DAMAGED[damage]
