"""The caps record's format (`record_format` in each entry): old records without it read as
format 1; an entry of a later format (a newer dvfs wrote it) is refused in one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from nvml_support import installed_nvml  # noqa: F401  (this module's `nvml` fixture)

from dvfs.caps import CapsFile, GpuCap, dump_caps
from dvfs.cli import cli


def _applied(tmp_path: Path) -> tuple[str, Path, Path]:
    """`cap apply` of a 450 W cap on GPU 0: its UUID, the caps file and dvfs's caps record."""
    result = CliRunner().invoke(cli, ["gpu", "list", "--json"])
    uuid = json.loads(result.output)[0]["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid=uuid, power_limit_w=450.0),))))
    applied = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert applied.exit_code == 0, applied.output
    return uuid, caps, Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"


def test_the_record_says_its_format_and_one_without_it_still_reads(nvml, tmp_path: Path) -> None:
    """Each entry says its format; a record an older dvfs wrote (no format) is read as
    before: `cap reset --applied` puts back the limit dvfs's cap replaced."""
    uuid, _, record = _applied(tmp_path)
    data = json.loads(record.read_text())
    assert data[uuid]["record_format"] == 1
    del data[uuid]["record_format"]
    record.write_text(json.dumps(data, indent=2))
    result = CliRunner().invoke(cli, ["cap", "reset", "--applied"])
    assert result.exit_code == 0, result.output
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


@pytest.mark.parametrize("command", ["reset", "apply", "show"])
def test_a_record_of_a_newer_format_is_refused_in_one_line(
    nvml, tmp_path: Path, command: str
) -> None:
    """An entry a newer dvfs wrote (format 2): read as this dvfs's format, its keys could be
    misread, or dropped on the next write. It is refused in one line saying what to do, the
    GPU and the record left as they are."""
    uuid, caps, record = _applied(tmp_path)
    data = json.loads(record.read_text())
    data[uuid]["record_format"] = 2
    record.write_text(json.dumps(data, indent=2))
    before = record.read_text()
    args = {"reset": ["reset", "--applied"], "apply": ["apply", str(caps)], "show": ["show"]}
    result = CliRunner().invoke(cli, ["cap", *args[command]])
    assert result.exit_code == 1, result.output
    [line] = [x for x in result.stderr.splitlines() if "format" in x]
    assert f"{record} line " in line and "caps record format 2, written by a newer dvfs" in line
    assert "reads format 1 only: run the newer dvfs again" in line, line
    assert "Traceback" not in result.output
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    assert record.read_text() == before


def test_a_newer_record_says_a_fix_this_dvfs_can_follow(nvml, tmp_path: Path) -> None:
    """The refusal's way out with this dvfs works: the record removed, then `cap reset`
    (which refuses while the record is there, saying only that nothing was reset: not "remove
    it" twice over nor reset first) puts the GPU back to its default."""
    uuid, _, record = _applied(tmp_path)
    data = json.loads(record.read_text())
    data[uuid]["record_format"] = 2
    record.write_text(json.dumps(data, indent=2))
    refused = CliRunner().invoke(cli, ["cap", "reset"])
    assert refused.exit_code == 1, refused.output
    [line] = refused.stderr.splitlines()
    assert "or remove the record, then reset the GPUs with `dvfs cap reset" in line, line
    assert line.endswith("(the limits dvfs's caps replaced are lost with it); nothing was reset")
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    record.unlink()
    reset = CliRunner().invoke(cli, ["cap", "reset"])
    assert reset.exit_code == 0, reset.output
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


@pytest.mark.parametrize("damaged", [None, "1", True, 1.0])
def test_a_format_that_is_no_format_number_is_damaged_for_that_gpu_alone(
    nvml, tmp_path: Path, damaged: object
) -> None:
    """GPU 0's entry's format is no format number (a hand edit): true and 1.0 passed for
    format 1 by Python's 1 == True == 1.0, and null or "1" refused the whole record, the caps
    unit's stop resetting no GPU. It is damaged for GPU 0 alone, as a damaged knob is: `cap
    show` and `cap reset --applied` warn of it in one line naming the GPU, the reset puts back
    both GPUs, and readers that must know its caps (sweeps) refuse the record naming it."""
    from dvfs.caps import AppliedCaps
    from dvfs.errors import CapsRecordError

    listed = CliRunner().invoke(cli, ["gpu", "list", "--json"])
    uuids = [g["uuid"] for g in json.loads(listed.output)]
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile(tuple(GpuCap(uuid=u, power_limit_w=450.0) for u in uuids))))
    applied = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert applied.exit_code == 0, applied.output
    record = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"
    data = json.loads(record.read_text())
    data[uuids[0]]["record_format"] = damaged
    record.write_text(json.dumps(data, indent=2))
    shown = json.dumps(damaged)
    with pytest.raises(CapsRecordError) as refused:
        AppliedCaps(record.parent).read()
    said = str(refused.value)
    assert f"is damaged for GPU {uuids[0]}: record_format is {shown}, expected a format" in said
    assert f"reset that GPU with `dvfs cap reset --state-dir {record.parent} {uuids[0]}`" in said
    show = CliRunner().invoke(cli, ["cap", "show"])
    assert show.exit_code == 0, show.output
    [line] = [x for x in show.stderr.splitlines() if "record_format" in x]
    assert f"is damaged for GPU 0 ({uuids[0]}): record_format is {shown}, " in line, line
    result = CliRunner().invoke(cli, ["cap", "reset", "--applied"])
    assert result.exit_code == 0, result.output
    [line] = [x for x in result.stderr.splitlines() if "record_format" in x]
    assert f"damaged for GPU 0 ({uuids[0]})" in line, line
    assert "Traceback" not in result.output
    assert [nvml.fake_device_state(i)["power_limit_mw"] for i in (0, 1)] == [700_000, 700_000]
    assert not record.exists()
