"""The GPU's ECC mode and VBIOS are invariants of a journal, as its driver is: a resume on a GPU
whose ECC was turned off (`nvidia-smi -e 0` and a reboot) or whose board was reflashed is
refused before it measures; the cube records both, and neither the shards of one run nor the
cubes of different GPUs merge when their ECC modes differ (nor shards their VBIOS)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from click.testing import CliRunner
from nvml_support import NVML_CAMPAIGN, installed_root_fake

from dvfs.cli import cli
from dvfs.cube import open_cube
from dvfs.cube.merge import provenance_differences
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


def _fake_ecc_off_gpu1(nvml: ModuleType, tmp_path: Path) -> tuple[Path, Path]:
    """GPU 1 of the fake's two H100s with ECC off; each GPU swept into its own folder."""
    nvml.fake_update_device(1, ecc=0)
    folders = []
    for gpu in ("0", "1"):
        out = tmp_path / f"gpu{gpu}"
        campaign = tmp_path / "campaign.toml"
        text = NVML_CAMPAIGN.format(output_tokens=8, repeats=1)
        campaign.write_text(text.replace("sm_clock = [1980, 1500]", "sm_clock = [1980]"))
        args = ["sweep", str(campaign), "--gpus", gpu, "--out", str(out), "--no-progress"]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        folders.append(out)
    return folders[0], folders[1]


def test_a_fleet_node_with_ecc_off_is_refused_then_merged_as_its_advice_says(
    nvml: ModuleType, tmp_path: Path
) -> None:
    """One journal holds one ECC mode, but the cubes of GPUs side by side may differ in it, as
    in their driver: the fleet's refusal advises separate folders and `dvfs cube merge`, which
    merges them, keeps each GPU's mode and warns in the report."""
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Paragraph, Table

    campaign = tmp_path / "campaign.toml"
    nvml.fake_update_device(1, ecc=0)
    text = NVML_CAMPAIGN.format(output_tokens=8, repeats=1)
    campaign.write_text(text.replace("sm_clock = [1980, 1500]", "sm_clock = [1980]"))
    args = ["sweep", str(campaign), "--gpus", "0,1", "--out", str(tmp_path / "fleet")]
    fleet = CliRunner().invoke(cli, [*args, "--no-progress"])
    assert fleet.exit_code != 0
    assert "(ECC mode: on -> off)" in fleet.output and "`dvfs cube merge`" in fleet.output
    a, b = _fake_ecc_off_gpu1(nvml, tmp_path)
    merged_path = tmp_path / "merged.nc"
    args = ["cube", "merge", str(a / "cube.nc"), str(b / "cube.nc"), "-o", str(merged_path)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    merged = open_cube(merged_path)
    assert merged.attrs["ecc_mode"] == "off, on"
    sources = json.loads(merged.attrs["merged_from"])
    assert sorted(s["ecc_mode"] for s in sources.values()) == ["off", "on"]
    blocks = measured_section(merged).blocks
    [table] = [b for b in blocks if isinstance(b, Table) and b.title == "Merged from"]
    assert sorted(r[table.header.index("ECC")] for r in table.rows) == ["off", "on"]
    warned = [b.text for b in blocks if isinstance(b, Paragraph) and "ECC modes" in b.text]
    assert len(warned) == 1 and "ECC off: " in warned[0] and "ECC on: " in warned[0], warned
    assert warned[0].startswith("The NVIDIA H100 80GB HBM3 GPUs ran with different ECC modes")
    # GPUs of two models differ in their boards anyway: not warned for
    from dvfs.report.facts import _merged_from

    two = {"a": {"gpu_name": "NVIDIA H100", "ecc_mode": "on"}}
    two["b"] = {"gpu_name": "NVIDIA GeForce RTX 4090", "ecc_mode": "unsupported"}
    assert [type(b) for b in _merged_from({"merged_from": json.dumps(two)})] == [Table]


@pytest.mark.parametrize("odd", [[1], {"a": [2]}, "on\nx\x1b[31m", "E" * 100_000, True, 1])
def test_a_merged_cubes_hand_edited_ecc_mode_tells_no_mode_apart(odd: object) -> None:
    """A merged cube's source whose ecc_mode was hand-edited to no name (a list, an object, a
    newline and a terminal's escape, a page of text) took its repr for an ECC mode: the report
    and `compare` warned of GPUs that "ran with different ECC modes" over it, printing the
    escape or the page in their one line. It is taken as not recorded."""
    from dvfs.report.facts import MISSING, _merged_from, ecc_mode_warnings
    from dvfs.report.model import Table

    sources = {
        "a": {"gpu_name": "NVIDIA H100", "ecc_mode": odd},
        "b": {"gpu_name": "NVIDIA H100", "ecc_mode": "on"},
    }
    attrs = {"merged_from": json.dumps(sources)}
    assert ecc_mode_warnings(attrs) == []
    [table] = _merged_from(attrs)
    assert isinstance(table, Table)
    assert [r[table.header.index("ECC")] for r in table.rows] == [MISSING, "on"]
    # Two recorded modes are still warned of.
    sources["a"]["ecc_mode"] = "off"
    assert len(ecc_mode_warnings({"merged_from": json.dumps(sources)})) == 1


def test_shards_of_one_run_whose_ecc_or_vbios_differ_do_not_merge(
    nvml: ModuleType, tmp_path: Path
) -> None:
    from dvfs.cube.merge import SHARD_GPU_KEYS, merge_cubes

    out = tmp_path / "out"
    code, output = _sweep(tmp_path, out)
    assert code == 0, output
    first = open_cube(out / "cube.nc")
    # an earlier dvfs's cube, which did not read them, still merges
    older = first.copy()
    older.attrs = {k: v for k, v in first.attrs.items() if k not in ("ecc_mode", "vbios_version")}
    older.attrs["gpu_uuids"] = "GPU-older"
    merged = merge_cubes([first, older], ["a", "b"])
    assert merged.attrs["ecc_mode"] == "on"
    assert merged.attrs["vbios_version"] == "96.00.99.00.01"
    # shards of one run compare their ECC mode and VBIOS, where both read them
    off = first.copy()
    off.attrs = {**first.attrs, "ecc_mode": "off"}
    assert provenance_differences(first, off, SHARD_GPU_KEYS) == ["ecc_mode: 'on' -> 'off'"]
    flashed = first.copy()
    flashed.attrs = {**first.attrs, "vbios_version": "96.00.AA.00.02"}
    assert provenance_differences(first, flashed, SHARD_GPU_KEYS) == [
        "vbios_version: '96.00.99.00.01' -> '96.00.AA.00.02'"
    ]
    assert provenance_differences(first, older, SHARD_GPU_KEYS) == []


def test_a_rerun_on_the_gpus_left_is_not_refused_for_a_lost_gpu_that_read_no_vbios(
    nvml: ModuleType, tmp_path: Path
) -> None:
    """A fleet whose GPU 1 NVML reads no VBIOS for (NotSupported: unknown, not compared) is
    cut short, as a node loss leaves it; the rerun on GPU 0 alone, of the same VBIOS, goes on.
    It was refused, "VBIOS version: 96.00.99.00.01, None -> 96.00.99.00.01": the lost GPU's
    unknown compared as a value."""
    nvml.fake_update_device(1, errors={"nvmlDeviceGetVbiosVersion": nvml.NVML_ERROR_NOT_SUPPORTED})
    campaign = tmp_path / "campaign.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=8, repeats=2))
    out = tmp_path / "out"

    def sweep(gpus: str) -> tuple[int, str]:
        args = ["sweep", str(campaign), "--gpus", gpus, "--out", str(out), "--no-progress"]
        result = CliRunner().invoke(cli, args)
        return result.exit_code, result.output

    code, output = sweep("0,1")
    assert code == 0, output
    journal = out / "journal.jsonl"
    [session] = [r for r in read_records(journal) if r["type"] == "session"]
    assert sorted(g["vbios_version"] for g in session["gpus"]) == ["", "96.00.99.00.01"]
    lines = journal.read_text().splitlines(keepends=True)
    cells = [i for i, line in enumerate(lines) if json.loads(line).get("type") == "cell"]
    journal.write_text("".join(lines[: cells[len(cells) // 2]]))
    code, output = sweep("0")
    assert code == 0, output
    assert "VBIOS" not in output

    # known values still compare, where some GPUs of a session did not read them
    def session_of(*vbios: str) -> dict[str, object]:
        return {"gpus": [{"name": "H100", "vbios_version": v} for v in vbios]}

    assert incomparable(session_of("", "A"), session_of("A")) == []
    assert incomparable(session_of("", "A"), session_of("B")) == ["VBIOS version: A -> B"]


def test_a_server_on_gpus_of_other_ecc_modes_is_refused_before_it_measures(
    nvml: ModuleType, tmp_path: Path
) -> None:
    """A tensor-parallel server on GPU 0 (ECC on) and GPU 1 (ECC off): the sweep measured
    every cell, then its cube was refused ("GPUs that do not compare (ECC mode: off, on)"),
    while `dvfs doctor` and the dry run said nothing. Now all three say it first."""
    nvml.fake_update_device(1, ecc=0)
    campaign = tmp_path / "campaign.toml"
    text = NVML_CAMPAIGN.format(output_tokens=8, repeats=1)
    text = text.replace("sm_clock = [1980, 1500]", "sm_clock = [1980]")
    text = text.replace("devices = [0]", "devices = [0, 1]")
    campaign.write_text(
        text.replace('model = "llama-3.1-8b"\n', 'model = "llama-3.1-8b"\ntp_size = 2\n')
    )
    out = tmp_path / "out"
    said = "worker gpu0+1 spans GPUs that differ in their ECC mode (GPU 0: on, GPU 1: off)"
    doctor = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", str(out)])
    assert doctor.exit_code != 0
    assert any(line.startswith("FAIL workers: ") for line in doctor.output.splitlines())
    assert said in " ".join(doctor.output.split()), doctor.output
    args = ["sweep", str(campaign), "--out", str(out), "--no-progress"]
    dry = CliRunner().invoke(cli, [*args, "--dry-run", "--no-estimate"])
    assert f"note: on this machine the sweep would stop: {said}" in dry.output, dry.output
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and said in error[0], result.output
    assert "Traceback" not in result.output
    assert not (out / "journal.jsonl").exists()  # nothing measured


def test_gpu_info_shows_the_ecc_mode_and_vbios_a_resume_compares(nvml: ModuleType) -> None:
    """A resume refused for "ECC mode: on -> off" is checked with `dvfs gpu info`: it showed
    neither the ECC mode nor the VBIOS. The twin reads neither: none shown."""
    nvml.fake_update_device(1, ecc=0, vbios="96.00.AA.00.02")
    text = CliRunner().invoke(cli, ["gpu", "info", "1"])
    assert text.exit_code == 0, text.output
    assert "(ECC off, VBIOS 96.00.AA.00.02)" in " ".join(text.output.split()), text.output
    shown = CliRunner().invoke(cli, ["gpu", "info", "0", "1", "--json"])
    assert shown.exit_code == 0, shown.output
    found = json.loads(shown.output)
    gpus = found if isinstance(found, list) else found["gpus"]
    assert [(g["ecc_mode"], g["vbios_version"]) for g in gpus] == [
        ("on", "96.00.99.00.01"),
        ("off", "96.00.AA.00.02"),
    ]
    twin = CliRunner().invoke(cli, ["gpu", "info", "--twin", "h100-sxm", "--json"])
    assert twin.exit_code == 0, twin.output
    found = json.loads(twin.output)
    [gpu] = found if isinstance(found, list) else found["gpus"]
    assert gpu["ecc_mode"] is None and gpu["vbios_version"] is None


def test_doctor_and_the_dry_run_say_a_fleet_refuses_gpus_of_other_ecc_modes(
    nvml: ModuleType, tmp_path: Path
) -> None:
    """A fleet on GPU 0 (ECC on) and GPU 1 (ECC off) is refused when its workers open their
    sessions; `dvfs doctor` and the dry run said all was well."""
    nvml.fake_update_device(1, ecc=0)
    campaign = tmp_path / "campaign.toml"
    text = NVML_CAMPAIGN.format(output_tokens=8, repeats=1)
    campaign.write_text(text.replace("sm_clock = [1980, 1500]", "sm_clock = [1980]"))
    out = tmp_path / "out"
    said = "GPUs differ in their ECC mode (GPU 0: on, GPU 1: off)"
    doctor = CliRunner().invoke(cli, ["doctor", str(campaign), "--gpus", "0,1", "--out", str(out)])
    assert doctor.exit_code != 0
    [line] = [line for line in doctor.output.splitlines() if line.startswith("FAIL")]
    assert line.startswith("FAIL workers: ")
    assert said in " ".join(doctor.output.split()), doctor.output
    args = ["sweep", str(campaign), "--gpus", "0,1", "--out", str(out), "--no-progress"]
    dry = CliRunner().invoke(cli, [*args, "--dry-run", "--no-estimate"])
    assert "note: on this machine the sweep would stop: " in dry.output, dry.output
    assert said in dry.output and "`dvfs cube merge`" in dry.output, dry.output
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0 and "(ECC mode: on -> off)" in result.output, result.output


def test_an_ecc_or_vbios_read_nvml_fails_is_not_known_and_leaves_the_gpu_usable(
    nvml: ModuleType,
) -> None:
    """An Unknown Error reading the ECC mode or VBIOS (NVML's answer to "any unexpected
    error") refused to open the GPU at all, `dvfs gpu reset` included: neither read is needed
    to restore a GPU's knobs. Now either is "" (not known, not compared, never "unsupported");
    a GPU fallen off the bus still stops, as any call on it would."""
    from dvfs.gpu.nvml import nvml_session, open_device

    unknown = nvml.NVML_ERROR_UNKNOWN
    nvml.fake_update_device(
        0, errors={"nvmlDeviceGetEccMode": unknown, "nvmlDeviceGetVbiosVersion": unknown}
    )
    reset = CliRunner().invoke(cli, ["gpu", "reset", "--defaults", "0"])
    assert reset.exit_code == 0, reset.output
    with nvml_session(nvml):
        identity = open_device(nvml, 0).identity
    assert (identity.ecc_mode, identity.vbios_version) == ("", "")
    nvml.fake_update_device(0, errors={"nvmlDeviceGetEccMode": nvml.NVML_ERROR_GPU_IS_LOST})
    lost = CliRunner().invoke(cli, ["gpu", "info", "0"])
    assert lost.exit_code != 0 and "fallen off the bus" in lost.output, lost.output
    assert "Traceback" not in lost.output


@pytest.mark.parametrize("differ", [None, "vbios", "mig"])
def test_gpu_list_fits_100_columns_and_says_every_gpus_driver_ecc_and_vbios(
    nvml: ModuleType, differ: str | None
) -> None:
    """`dvfs gpu list` was a table of nine columns ~144 characters wide, wider than most
    terminals (and folded or wrapped there). What every GPU listed has alike (its driver,
    ECC mode, VBIOS, MIG mode) is said once under it; a value GPUs differ in keeps its
    column. Every line fits 100 columns, each UUID whole on its GPU's line, nothing lost."""
    if differ == "vbios":
        nvml.fake_update_device(1, vbios="96.00.AA.00.02")
    elif differ == "mig":
        nvml.fake_update_device(1, mig=True)
    result = CliRunner().invoke(cli, ["gpu", "list"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, result.stdout
    gpus = json.loads(CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout)
    for gpu in gpus:
        [line] = [line for line in lines if gpu["uuid"] in line]
        assert line.split()[1] == str(gpu["index"]) and "700 W" in line, line
    *_, said = lines
    [head] = [line for line in lines if " uuid " in line]
    assert said.startswith("every GPU listed: driver 570.133.20, ECC on"), said
    text = " ".join(result.stdout.split())
    if differ == "vbios":
        assert "VBIOS" in head and "VBIOS" not in said, result.stdout
        assert "96.00.99.00.01" in text and "96.00.AA.00.02" in text, result.stdout
    else:
        assert said.split("ECC on, ")[1].startswith("VBIOS 96.00.99.00.01"), said
    if differ == "mig":
        assert "MIG" in head and "on (refused)" in text and "MIG" not in said, text
    else:
        assert said.endswith("MIG off"), said
