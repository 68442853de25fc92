"""The GPU's ECC mode and VBIOS are invariants of a journal, as its driver is: a resume on a GPU
whose ECC was turned off (`nvidia-smi -e 0` and a reboot) or whose board was reflashed is
refused before it measures; the cube records both, and neither the shards of one run nor the
cubes of different GPUs merge when their ECC modes differ (nor shards their VBIOS)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from click.testing import CliRunner
from nvml_support import NVML_CAMPAIGN, installed_root_fake

from dvfs.cli import cli
from dvfs.cube import open_cube
from dvfs.cube.merge import provenance_differences
from dvfs.errors import MergeRefusedError
from dvfs.measure.journal import read_records
from dvfs.records import incomparable, mixed_within


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return installed_root_fake(tmp_path, monkeypatch)


def _sweep(tmp_path: Path, out: Path) -> tuple[int, str]:
    campaign = tmp_path / "campaign.toml"
    text = NVML_CAMPAIGN.format(output_tokens=8, repeats=1)
    campaign.write_text(text.replace("sm_clock = [1980, 1500]", "sm_clock = [1980]"))
    result = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"ecc": 0}, "ECC mode: on -> off"),
        ({"vbios": "96.00.AA.00.02"}, "VBIOS version: 96.00.99.00.01 -> 96.00.AA.00.02"),
    ],
)
def test_a_resume_on_a_gpu_whose_ecc_or_vbios_changed_is_refused(
    nvml: ModuleType, tmp_path: Path, change: dict[str, object], said: str
) -> None:
    out = tmp_path / "out"
    code, output = _sweep(tmp_path, out)
    assert code == 0, output
    [session] = [r for r in read_records(out / "journal.jsonl") if r["type"] == "session"]
    assert session["gpus"][0]["ecc_mode"] == "on"
    assert session["gpus"][0]["vbios_version"] == "96.00.99.00.01"
    cube = open_cube(out / "cube.nc")
    assert cube.attrs["ecc_mode"] == "on"
    assert cube.attrs["vbios_version"] == "96.00.99.00.01"
    info = CliRunner().invoke(cli, ["cube", "info", str(out)])
    assert "(ECC on, VBIOS 96.00.99.00.01)" in info.output, info.output
    lines = (out / "journal.jsonl").read_text()
    nvml.fake_update_device(0, **change)
    code, output = _sweep(tmp_path, out)
    assert code != 0, output
    error = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and said in error[0], output
    assert "Traceback" not in output
    assert (out / "journal.jsonl").read_text() == lines  # nothing measured


def test_unknown_ecc_and_vbios_are_not_compared_but_known_ones_are() -> None:
    def session(**gpu: object) -> dict[str, object]:
        base = {"name": "H100", "driver_version": "570", "memory_clock_mhz": 2619}
        return {"gpus": [{**base, **gpu}]}

    on, off = session(ecc_mode="on"), session(ecc_mode="off")
    assert incomparable(on, off) == ["ECC mode: on -> off"]
    # an earlier dvfs's session, the twin's, or a GPU NVML could not read: not known
    assert incomparable(session(), off) == []
    assert incomparable(session(ecc_mode="", vbios_version=""), on) == []
    fleet = {"gpus": [*on["gpus"], *off["gpus"]]}
    assert mixed_within(fleet) == ["ECC mode: off, on"]
    assert mixed_within({"gpus": [*on["gpus"], *session()["gpus"]]}) == []


def test_cubes_whose_gpus_ran_other_ecc_modes_do_not_merge(
    nvml: ModuleType, tmp_path: Path
) -> None:
    from dvfs.cube.merge import merge_cubes

    out = tmp_path / "out"
    code, output = _sweep(tmp_path, out)
    assert code == 0, output
    first = open_cube(out / "cube.nc")
    other = first.copy()
    other.attrs = {**first.attrs, "gpu_uuids": "GPU-other", "ecc_mode": "off"}
    with pytest.raises(MergeRefusedError, match=r"ecc_mode: 'on' -> 'off'"):
        merge_cubes([first, other], ["a", "b"])
    # an earlier dvfs's cube, which did not read it, still merges
    older = first.copy()
    older.attrs = {k: v for k, v in first.attrs.items() if k not in ("ecc_mode", "vbios_version")}
    older.attrs["gpu_uuids"] = "GPU-older"
    merged = merge_cubes([first, older], ["a", "b"])
    assert merged.attrs["ecc_mode"] == "on"
    assert merged.attrs["vbios_version"] == "96.00.99.00.01"
    # shards of one run compare their VBIOS too, where both read it
    shard_keys = ("driver_version", "memory_clock_mhz", "vbios_version")
    flashed = first.copy()
    flashed.attrs = {**first.attrs, "vbios_version": "96.00.AA.00.02"}
    assert provenance_differences(first, flashed, shard_keys) == [
        "vbios_version: '96.00.99.00.01' -> '96.00.AA.00.02'"
    ]
    assert provenance_differences(first, older, shard_keys) == []
