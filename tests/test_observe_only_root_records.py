"""An observe-only sweep run without root keeps its records in the user's own state folder;
root's dvfs (a sweep, a governor, `cap apply`) keeps its in /var/lib/dvfs. What root's hold
there (a GPU lock, the caps record) the user's sweep must see: else it measures root's knob
changes as its stock. Reading them needs no root, and nothing is written there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from nvml_support import NVML_CAMPAIGN, installed_root_fake

from dvfs.cli import cli


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    return installed_root_fake(tmp_path, monkeypatch)


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def as_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from dvfs.gpu import safety

    root = Path(os.environ["DVFS_STATE_DIR"])
    monkeypatch.setattr(safety, "ROOT_STATE_DIR", root)
    monkeypatch.delenv("DVFS_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "user-state"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    return root


def test_observe_only_sweep_without_root_refuses_a_gpu_roots_dvfs_holds(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While root's sweep held GPU 0 (its lock in /var/lib/dvfs), stepping its clocks and
    power limit, a user's observe-only sweep of GPU 0 took the lock in the user's own folder,
    found it free and measured root's settings as its 'stock' cells; `doctor --observe-only`
    said 'no other dvfs holds it'. Both now name root's holder, as the sweep as root does."""
    from dvfs.backends import open_gpus
    from dvfs.gpu.safety import GpuLocks

    campaign = tmp_path / "c.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=8, repeats=1))
    root = Path(os.environ["DVFS_STATE_DIR"])
    with open_gpus([0]) as gpus, GpuLocks(root).hold(gpus):  # as root's sweep holds it
        as_user(tmp_path, monkeypatch)
        out = tmp_path / "out"
        result = run("sweep", str(campaign), "--observe-only", "--out", str(out))
        said = " ".join(result.output.split())
        assert result.exit_code == 3, result.output
        assert f"is in use by another dvfs process (pid {os.getpid()})" in said, said
        assert f"its lock is in {root}" in said, said
        assert not (out / "cube.nc").exists()
        result = run("doctor", str(campaign), "--observe-only", "--out", str(out), "--json")
        assert result.exit_code == 1, result.output
        checked = {c["name"]: c for c in json.loads(result.output)}
        assert checked["lock GPU 0"]["status"] == "fail", checked["lock GPU 0"]
        assert f"pid {os.getpid()}" in checked["lock GPU 0"]["detail"], checked["lock GPU 0"]
        # and the dry run says the sweep would stop (its check of the GPUs reads root's locks)
        args = ("--observe-only", "--out", str(out), "--dry-run", "--no-estimate")
        result = run("sweep", str(campaign), *args)
        assert result.exit_code == 0, result.output
        notes = [line for line in result.output.splitlines() if "sweep would stop" in line]
        assert notes and f"pid {os.getpid()}" in " ".join(notes), result.output
    # root's lock let go: the user's observe-only sweep runs, and writes nothing of root's
    before = sorted(p.name for p in root.iterdir())
    result = run("sweep", str(campaign), "--observe-only", "--out", str(tmp_path / "out2"))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in root.iterdir()) == before


def test_doctor_observe_only_without_root_names_the_caps_roots_cap_apply_left(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root's `cap apply` locked GPU 0's clocks and capped its power limit (recorded in
    /var/lib/dvfs); a user's `doctor --observe-only` read the caps record in the user's own
    folder: no caps line (the README: a warning naming each GPU's clock lock and power limit
    `cap apply` left, 'with --observe-only every cell is measured under them'), and dvfs's
    lock taken for one 'set outside dvfs'. It now reads root's record (read-only), as
    `cap show` does, and writes nothing there."""
    from dvfs.caps import CapsFile, GpuCap, dump_caps

    uuid = json.loads(run("gpu", "list", "--json").output)[0]["uuid"]
    caps = tmp_path / "caps.toml"
    cap = GpuCap(uuid=uuid, sm_clock_max_mhz=1410, power_limit_w=500.0)
    caps.write_text(dump_caps(CapsFile((cap,))))
    assert run("cap", "apply", str(caps)).exit_code == 0
    campaign = tmp_path / "c.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=8, repeats=1))
    root = as_user(tmp_path, monkeypatch)
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    out = tmp_path / "out"
    result = run("doctor", str(campaign), "--observe-only", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    checked = {c["name"]: c for c in json.loads(result.output)}
    assert "caps" in checked, sorted(checked)
    said = checked["caps"]["detail"]
    assert "GPU 0 (SM clock locked to 210-1410 MHz, power limit 500 W)" in said, said
    assert "every cell is measured under them" in said, said
    assert checked["held knobs GPU 0"]["status"] == "ok", checked["held knobs GPU 0"]
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before


def test_the_observe_only_dry_run_without_root_reads_the_records_its_sweep_reads(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's observe-only sweep keeps (and reads) its records in the user's own state
    folder; its dry run read root's /var/lib/dvfs for its stock checks (`records_dir`), so
    where the sweep would refuse its resume ('stock settings changed': an operator's 600 W
    since) the dry run stayed silent whenever root's records stop that read (here a damaged
    caps record of root's, which the user's sweep never reads). It now reads what the sweep
    reads, and says the sweep's line."""
    campaign = tmp_path / "c.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=8, repeats=1))
    root = as_user(tmp_path, monkeypatch)
    out = ["--observe-only", "--out", str(tmp_path / "out")]
    assert run("sweep", str(campaign), *out).exit_code == 0
    journal = tmp_path / "out" / "journal.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-1]) + "\n")  # its last cell left to run
    root.mkdir(parents=True, exist_ok=True)
    (root / "caps-applied.json").write_text("{ damaged")
    nvml.fake_update_device(0, power_limit_mw=600_000)
    swept = run("sweep", str(campaign), *out)
    said = " ".join(swept.output.split())
    refusal = "the GPU's stock settings changed since this journal was started"
    assert swept.exit_code == 1 and refusal in said, said
    dry = run("sweep", str(campaign), *out, "--dry-run", "--no-estimate")
    assert dry.exit_code == 0, dry.output
    notes = [" ".join(n.split()) for n in dry.output.splitlines() if "sweep would stop" in n]
    assert len(notes) == 1 and refusal in notes[0], dry.output
    assert said.split("Error: ")[-1] in notes[0], (said, notes)


def test_the_pid_of_roots_lock_not_utf8_is_the_one_its_line_names(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's run refused a GPU root's dvfs holds naming the pid in root's lock as read
    (bytes not UTF-8 replaced), but gave the error's pid as "?" for such a lock: the lock was
    read again, whole and as strict UTF-8. Both are its first bytes, read as `holder` reads
    them."""
    from dvfs.backends import open_gpus
    from dvfs.errors import GpuBusyError
    from dvfs.gpu.safety import GpuLocks, refuse_root_held

    root = Path(os.environ["DVFS_STATE_DIR"])
    with open_gpus([0]) as gpus, GpuLocks(root).hold(gpus):  # as root's sweep holds it
        (root / f"{gpus[0].identity.uuid}.lock").write_bytes(b"12\xff34")
        as_user(tmp_path, monkeypatch)
        with pytest.raises(GpuBusyError) as refused:
            refuse_root_held(gpus, tmp_path / "user-state")
    assert refused.value.pid == "12\ufffd34", refused.value.pid
    assert f"(pid {refused.value.pid})" in str(refused.value), refused.value
