"""Caps records an older dvfs, a refused unlock or a hand edit left doubtful: what `cap apply`
and `cap reset` make of each (the fake NVML of tests/fakes, never a real GPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from nvml_support import installed_root_fake

from dvfs.caps import CapsFile, GpuCap, dump_caps
from dvfs.cli import cli
from dvfs.gpu.knobs import GpuSettings
from dvfs.gpu.safety import StateStore


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    return installed_root_fake(tmp_path, monkeypatch)


def invoke(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == code, result.output
    return " ".join(result.output.split())


def write_caps(path: Path, *caps: GpuCap) -> Path:
    path.write_text(dump_caps(CapsFile(caps)))
    return path


def record_path() -> Path:
    return Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"


def edit_record(uuid: str, **fields: object) -> None:
    """Change one GPU's caps record entry as an older dvfs or a hand edit leaves it."""
    entries = json.loads(record_path().read_text())
    entries[uuid].update(fields)
    record_path().write_text(json.dumps(entries, indent=2))


def _stopped_changing_500_to_450_w(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, Path]:
    """GPU 0 (the operator's 600 W before dvfs) capped at 500 W by `cap apply`, then a SIGTERM
    inside the change to 450 W (the record keeps 500 W as dvfs's earlier cap): its UUID and
    the caps file (450 W)."""
    import signal

    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's, before dvfs
    caps = write_caps(tmp_path / "caps.toml", GpuCap(uuid=uuid, power_limit_w=500.0))
    invoke("cap", "apply", str(caps))
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0))

    def stopped(handle: object, limit_mw: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    real = nvml.nvmlDeviceSetPowerManagementLimit
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "0")
    monkeypatch.setattr(nvml, "nvmlDeviceSetPowerManagementLimit", stopped)
    assert CliRunner().invoke(cli, ["cap", "apply", str(caps)]).exit_code == 143
    monkeypatch.setattr(nvml, "nvmlDeviceSetPowerManagementLimit", real)
    return uuid, caps


def test_an_earlier_cap_an_older_dvfs_left_beside_another_cap_is_not_taken_for_dvfs(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal ending `cap apply`'s change from dvfs's 500 W to 450 W records 500 W as dvfs's
    earlier cap (`power_limit_earlier_mw`). An older dvfs, which does not know the field,
    then capped the GPU at 400 W and carried it along unchanged; the operator set 500 W of
    their own since. `cap reset --applied` took that 500 W for dvfs's earlier cap and put
    back the 600 W dvfs's first cap replaced over the operator's limit. The earlier cap is
    bound to the cap it was recorded beside: beside another, it is stale, and the reset
    leaves the limit as it is, failing in one line that says what to do."""
    uuid, caps = _stopped_changing_500_to_450_w(nvml, tmp_path, monkeypatch)
    assert json.loads(record_path().read_text())[uuid]["power_limit_earlier_mw"] == 500_000
    # an older dvfs's `cap apply` of 400 W: {**entry, power_limit_mw: 400000}, the rest kept
    nvml.fake_update_device(0, power_limit_mw=400_000)
    edit_record(uuid, power_limit_mw=400_000)
    nvml.fake_update_device(0, power_limit_mw=500_000)  # the operator's `nvidia-smi -pl 500`
    said = invoke("cap", "reset", "--applied", code=1)
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000, said
    assert nvml.fake_device_state(0)["locked_clocks"] is None, said
    reset = f"`dvfs cap reset 0 --state-dir {os.environ['DVFS_STATE_DIR']}`"  # (as sudo runs it)
    assert "power_limit_earlier_mw" in said and f"its defaults with {reset}" in said, said
    assert "nvidia-smi -i 0 -pl" in said, said
    # the operator's choice made, the reset goes through: their limit is left be
    nvml.fake_update_device(0, power_limit_mw=550_000)
    said = invoke("cap", "reset", "--applied")
    assert nvml.fake_device_state(0)["power_limit_mw"] == 550_000, said
    assert not record_path().exists()


def _holding_a_stale_earlier_cap(nvml, tmp_path: Path) -> tuple[str, Path]:
    """GPU 0 (the operator's 600 W before dvfs) capped at 450 W, then an older dvfs carried a
    newer one's earlier cap (500 W, written beside 450 W) along to its own 400 W cap, and the
    operator set 500 W since: its UUID and the caps file (450 W)."""
    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)
    caps = write_caps(tmp_path / "caps.toml", GpuCap(uuid=uuid, power_limit_w=450.0))
    invoke("cap", "apply", str(caps))
    edit_record(
        uuid,
        power_limit_mw=400_000,
        power_limit_earlier_mw=500_000,
        power_limit_earlier_for_mw=450_000,
    )
    nvml.fake_update_device(0, power_limit_mw=500_000)  # the operator's since
    return uuid, caps


def test_a_stale_earlier_cap_is_not_taken_for_dvfs_by_the_next_apply(nvml, tmp_path: Path) -> None:
    """The next `cap apply` took the operator's 500 W for dvfs's stale earlier cap too, and
    recorded the 600 W dvfs's first cap replaced as the limit its cap replaced, for `cap
    reset --applied` to put back over the operator's. Whose it is cannot be told: the apply
    is refused in one line, nothing capped, until the operator sets the limit they want."""
    uuid, caps = _holding_a_stale_earlier_cap(nvml, tmp_path)
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500, power_limit_w=420.0))
    for dry_run in (["--dry-run"], []):
        said = invoke("cap", "apply", str(caps), *dry_run, code=1)
        assert "power_limit_earlier_mw" in said and "nvidia-smi -i 0 -pl" in said, said
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    nvml.fake_update_device(0, power_limit_mw=550_000)  # the operator's choice, made
    invoke("cap", "apply", str(caps))
    entry = json.loads(record_path().read_text())[uuid]
    assert entry["power_limit_before_mw"] == 550_000, entry
    said = invoke("cap", "reset", "--applied")
    assert nvml.fake_device_state(0)["power_limit_mw"] == 550_000, said


def test_a_doubtful_limit_refusal_says_how_to_keep_that_limit(nvml, tmp_path: Path) -> None:
    """The refusal said to set the limit the GPU should have with `nvidia-smi -pl`: an
    operator whose limit is the doubtful 500 W set it again, and met the same refusal, for
    ever. It says how to keep that limit (the GPU's defaults first, which drop dvfs's record
    of it), and doing so, the next apply and reset take the 500 W for the operator's."""
    uuid, caps = _holding_a_stale_earlier_cap(nvml, tmp_path)
    invoke("cap", "apply", str(caps), code=1)
    nvml.fake_update_device(0, power_limit_mw=500_000)  # `nvidia-smi -i 0 -pl 500` again
    said = invoke("cap", "apply", str(caps), code=1)
    reset = f"dvfs cap reset 0 --state-dir {record_path().parent}"
    assert "the way to keep 500 W: that reset, then `nvidia-smi -i 0 -pl 500`" in said, said
    assert f"`{reset}`" in said, said
    invoke(*reset.split()[1:])
    nvml.fake_update_device(0, power_limit_mw=500_000)  # then `nvidia-smi -i 0 -pl 500`
    said = invoke("cap", "apply", str(caps))
    assert json.loads(record_path().read_text())[uuid]["power_limit_before_mw"] == 500_000
    said = invoke("cap", "reset", "--applied")
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000, said


def test_a_stale_earlier_cap_on_one_gpu_leaves_the_others_capped(nvml, tmp_path: Path) -> None:
    """A stale earlier cap on GPU 0 refused the whole plan: `cap apply` capped none of the
    host's GPUs, so `systemctl restart dvfs-caps` (whose stop reset the others) left every
    GPU uncapped for one GPU's doubt. That GPU alone is left as it is, the others capped,
    exit 1 naming it, as for a damaged cap; the dry run says so too."""
    uuid0, uuid1 = (nvml.fake_device_state(i)["uuid"] for i in (0, 1))
    nvml.fake_update_device(0, power_limit_mw=600_000)
    caps = write_caps(
        tmp_path / "caps.toml",
        GpuCap(uuid=uuid0, sm_clock_max_mhz=1500, power_limit_w=450.0),
        GpuCap(uuid=uuid1, sm_clock_max_mhz=1500, power_limit_w=450.0),
    )
    invoke("cap", "apply", str(caps))
    edit_record(
        uuid0,
        power_limit_mw=400_000,
        power_limit_earlier_mw=500_000,
        power_limit_earlier_for_mw=450_000,
    )
    nvml.fake_update_device(0, power_limit_mw=500_000)  # the operator's since
    said = invoke("cap", "reset", "--applied", code=1)  # the caps unit's stop
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000, said
    write_caps(
        caps,
        GpuCap(uuid=uuid0, sm_clock_max_mhz=1410, power_limit_w=420.0),
        GpuCap(uuid=uuid1, sm_clock_max_mhz=1410, power_limit_w=420.0),
    )
    said = invoke("cap", "apply", str(caps), "--dry-run", code=1)
    assert "would apply to GPU 1" in said and "would apply to GPU 0" not in said, said
    assert "power_limit_earlier_mw" in said and "nvidia-smi -i 0 -pl" in said, said
    said = invoke("cap", "apply", str(caps), code=1)  # its start
    assert "applied to GPU 1" in said and "applied to GPU 0" not in said, said
    assert "power_limit_earlier_mw" in said and "nvidia-smi -i 0 -pl" in said, said
    assert nvml.fake_device_state(1)["power_limit_mw"] == 420_000, said
    assert nvml.fake_device_state(1)["locked_clocks"] == [210, 1410], said
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000, said
    assert nvml.fake_device_state(0)["locked_clocks"] is None, said
    entries = json.loads(record_path().read_text())
    assert entries[uuid1]["power_limit_mw"] == 420_000, entries
    assert entries[uuid0]["power_limit_mw"] == 400_000, entries  # (left as it was)


@pytest.mark.parametrize("then", ["reset", "apply"])
def test_an_earlier_cap_a_dvfs_before_earlier_for_recorded_is_honoured_after_an_upgrade(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """The dvfs before power_limit_earlier_for_mw (main at 57a0e96) wrote an earlier cap only
    beside the cap it was changing to, as a stop ended `cap apply`'s change from dvfs's 500 W
    to 450 W, and dropped it once a change landed. After a plain upgrade that record, which
    does not say beside which cap, was taken for stale: `cap reset --applied` and `cap apply`
    refused the GPU still at dvfs's 500 W (exit 1), where that dvfs put back the operator's
    600 W (and recorded it as what the next cap replaced). It is taken as written beside the
    cap the entry lists, as that dvfs took it."""
    uuid, caps = _stopped_changing_500_to_450_w(nvml, tmp_path, monkeypatch)
    # the entry as that dvfs wrote it: the earlier cap beside the 450 W, no key saying so
    entries = json.loads(record_path().read_text())
    assert entries[uuid].pop("power_limit_earlier_for_mw") == 450_000
    record_path().write_text(json.dumps(entries, indent=2))
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000  # dvfs's, still
    if then == "apply":
        said = invoke("cap", "apply", str(caps))
        assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000, said
        entry = json.loads(record_path().read_text())[uuid]
        assert entry["power_limit_before_mw"] == 600_000, entry
        assert "power_limit_earlier_mw" not in entry, entry
    said = invoke("cap", "reset", "--applied")
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000, said
    assert not record_path().exists()


def test_an_earlier_cap_beside_a_cap_its_entry_no_longer_lists_is_doubtful(
    nvml, tmp_path: Path
) -> None:
    """An entry whose earlier cap no key binds, beside no cap dvfs set (an older dvfs's reset
    of the limit carried it along): a GPU holding it is not taken for dvfs's, as one beside
    another cap is not, and the refusal says so in one line."""
    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)
    caps = write_caps(
        tmp_path / "caps.toml", GpuCap(uuid=uuid, sm_clock_max_mhz=1500, power_limit_w=450.0)
    )
    invoke("cap", "apply", str(caps))
    edit_record(
        uuid, power_limit_mw=None, power_limit_before_mw=None, power_limit_earlier_mw=500_000
    )
    nvml.fake_update_device(0, power_limit_mw=500_000)  # the operator's since
    said = invoke("cap", "apply", str(caps), code=1)
    assert "beside a cap the entry no longer lists" in said, said
    assert "nvidia-smi -i 0 -pl" in said and "dvfs cap reset 0" in said, said
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000


@pytest.mark.parametrize(("reset", "after"), [(["--applied"], 600_000), ([], 700_000)])
def test_a_refused_unlock_after_a_dead_run_leaves_the_record_beside_its_state_file(
    nvml, tmp_path: Path, reset: list[str], after: int
) -> None:
    """`cap reset --applied` after a killed sweep whose clock unlock NVML refused put back the
    power limit dvfs's cap replaced and dropped that cap from the caps record, but kept the
    sweep's state file (the GPU was not reset whole): the `dvfs gpu reset` it names then put
    back what the sweep found, dvfs's 450 W cap, with no record of it (a later `cap reset
    --applied` left it as "dvfs set none", sweeps took it for the GPU's stock). Where the
    state file stays, the record keeps the caps it would put back, and the failure says so
    (so too for `cap reset`, which puts back the default power limit)."""
    uuid = nvml.fake_device_state(0)["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's
    caps = write_caps(
        tmp_path / "caps.toml", GpuCap(uuid=uuid, sm_clock_max_mhz=1500, power_limit_w=450.0)
    )
    invoke("cap", "apply", str(caps))
    StateStore(state, command="sweep").record(GpuSettings(uuid, (210, 1500), 450_000))
    nvml.fake_update_device(
        0,
        locked_clocks=[210, 900],
        power_limit_mw=300_000,
        errors={"nvmlDeviceResetGpuLockedClocks": nvml.NVML_ERROR_NOT_SUPPORTED},
    )
    said = invoke("cap", "reset", *reset, code=1)
    assert nvml.fake_device_state(0)["power_limit_mw"] == after, said
    assert StateStore(state).pending(), said
    assert "dvfs gpu reset 0" in said and "'sweep'" in said, said
    nvml.fake_update_device(0, errors={})
    invoke("gpu", "reset", "0")
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000  # what the sweep found
    entry = json.loads(record_path().read_text())[uuid]
    assert entry["power_limit_mw"] == 450_000, entry  # dvfs's, so recorded
    said = invoke("cap", "reset", "--applied")
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000, said
    assert nvml.fake_device_state(0)["locked_clocks"] is None, said


def _both_capped(nvml, tmp_path: Path, **cap: object) -> tuple[list[str], Path]:
    """GPU 0 (the operator's 600 W before dvfs) and GPU 1 capped by `cap apply`; their UUIDs
    and the caps file."""
    uuids = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    nvml.fake_update_device(0, power_limit_mw=600_000)
    caps = tmp_path / "caps.toml"
    write_caps(caps, *(GpuCap(uuid=u, **cap) for u in uuids))  # type: ignore[arg-type]
    invoke("cap", "apply", str(caps))
    return uuids, caps


def _line(field: str) -> int:
    """The line of GPU 0's `field` in the caps record (dvfs writes one key a line)."""
    lines = record_path().read_text().splitlines()
    return next(i for i, line in enumerate(lines) if f'"{field}"' in line) + 1


@pytest.mark.parametrize("damaged", ["450 W", 450_000.0, True])
def test_a_damaged_power_limit_spoils_that_knob_alone(
    nvml, tmp_path: Path, damaged: object
) -> None:
    """A caps record entry's power_limit_mw hand-edited ("450 W", 450000.0) refused the whole
    record for `cap show` and `cap apply`, every GPU's caps with it, and `cap reset --applied`
    left dvfs's 450 W cap on the GPU saying "dvfs set none", dropping the entry. The damaged
    value spoils the power limit alone, with a warning naming the key, the file and its line:
    the clock is unlocked (or locked, by an apply), the other GPU honoured, and the power limit,
    whose owner cannot be told, left as it is in one line saying what to do; where the GPU holds
    the limit dvfs's cap replaced, nothing is in doubt."""
    uuids, caps = _both_capped(nvml, tmp_path, sm_clock_max_mhz=1500, power_limit_w=450.0)
    edit_record(uuids[0], power_limit_mw=damaged)
    where = f"{record_path()} line {_line('power_limit_mw')} is damaged for GPU 0 ({uuids[0]})"
    result = CliRunner().invoke(cli, ["cap", "show", "--json"])
    assert result.exit_code == 0, result.output
    assert where in " ".join(result.stderr.split()), result.stderr
    assert [r["sm_clock_lock_mhz"] for r in json.loads(result.stdout)] == [[210, 1500]] * 2
    write_caps(caps, *(GpuCap(uuid=u, sm_clock_max_mhz=1410, power_limit_w=420.0) for u in uuids))
    for dry_run in (["--dry-run"], []):
        said = invoke("cap", "apply", str(caps), *dry_run, code=1)
        assert where in said and "power limit 450 W was left as it is" in said, said
    assert [nvml.fake_device_state(i)["locked_clocks"] for i in (0, 1)] == [[210, 1410]] * 2
    assert [nvml.fake_device_state(i)["power_limit_mw"] for i in (0, 1)] == [450_000, 420_000]
    said = invoke("cap", "reset", "--applied", code=1)
    reset = f"`dvfs cap reset 0 --state-dir {os.environ['DVFS_STATE_DIR']}`"  # (as sudo runs it)
    assert where in said and f"put back its default with {reset}" in said, said
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000, said
    assert nvml.fake_device_state(0)["locked_clocks"] is None, said
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000, said
    assert list(json.loads(record_path().read_text())) == [uuids[0]]  # its doubt kept
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the limit dvfs's cap replaced
    said = invoke("cap", "reset", "--applied")
    assert "power limit 600 W (as before `dvfs cap apply`)" in said, said
    assert not record_path().exists()


@pytest.mark.parametrize("edited", [900_000, 50_000])
def test_a_power_limit_no_gpu_here_takes_in_the_record_is_damaged_too(
    nvml, tmp_path: Path, edited: int
) -> None:
    """A caps record entry's power_limit_mw hand-edited to a limit outside the GPU's range (900
    W above its 700 W top, 50 W below its 200 W floor), a cap dvfs never set, was taken for
    dvfs's cap all the same: the GPU's 450 W (dvfs's real cap) then read as an operator's limit
    set since, so the caps unit's `cap apply` recorded it as the limit its cap replaced (exit
    0), and the unit's stop put that 450 W "back", leaving the cap on the GPU for good. Such a
    value spoils the power limit as a damaged one does: left as it is, in one line naming it
    and what to do (exit 1), the clock done, the other GPU honoured."""
    uuids, caps = _both_capped(nvml, tmp_path, sm_clock_max_mhz=1500, power_limit_w=450.0)
    edit_record(uuids[0], power_limit_mw=edited)
    said = invoke("cap", "apply", str(caps), code=1)
    assert "power limit 450 W was left as it is" in said, said
    assert f"power_limit_mw is {edited}" in said and "outside this GPU's range 200-700 W" in said
    assert [nvml.fake_device_state(i)["power_limit_mw"] for i in (0, 1)] == [450_000] * 2
    assert json.loads(record_path().read_text())[uuids[0]]["power_limit_before_mw"] == 600_000
    said = invoke("cap", "reset", "--applied", code=1)
    reset = f"`dvfs cap reset 0 --state-dir {os.environ['DVFS_STATE_DIR']}`"
    assert "power limit 450 W was left as it is" in said and reset in said, said
    assert nvml.fake_device_state(0)["locked_clocks"] is None, said
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000, said
    assert list(json.loads(record_path().read_text())) == [uuids[0]]  # its doubt kept


@pytest.mark.parametrize("damaged", ["1500", [1500, 210], []])
def test_a_damaged_clock_lock_spoils_that_knob_alone(nvml, tmp_path: Path, damaged: object) -> None:
    """A caps record entry's lock_mhz hand-edited ("1500", the clocks swapped) refused the
    whole record for `cap show` and `cap apply`, and one edited to [] was taken by `cap reset
    --applied` for no lock, leaving dvfs's lock on the GPU. Which lock dvfs set cannot be told,
    but none is needed to unlock it or lock the file's: the apply caps both GPUs (mending the
    entry), and the reset unlocks it, each with a warning naming the key, file and line."""
    uuids, caps = _both_capped(nvml, tmp_path, sm_clock_max_mhz=1500)
    edit_record(uuids[0], lock_mhz=damaged)
    where = f"{record_path()} line {_line('lock_mhz')} is damaged for GPU 0 ({uuids[0]})"
    result = CliRunner().invoke(cli, ["cap", "show"])
    assert result.exit_code == 0, result.output
    assert where in " ".join(result.stderr.split()), result.stderr
    said = invoke("cap", "reset", "--applied")
    assert where in said, said
    assert [nvml.fake_device_state(i)["locked_clocks"] for i in (0, 1)] == [None, None], said
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000, said  # dvfs set none
    # an apply over such a lock: the file's lock, or (power only) the GPU unlocked
    invoke("cap", "apply", str(caps))
    edit_record(uuids[0], lock_mhz=damaged)
    write_caps(caps, *(GpuCap(uuid=u, power_limit_w=450.0) for u in uuids))
    said = invoke("cap", "apply", str(caps))
    assert where in said, said
    assert [nvml.fake_device_state(i)["locked_clocks"] for i in (0, 1)] == [None, None], said
    assert json.loads(record_path().read_text())[uuids[0]]["lock_mhz"] is None
    said = invoke("cap", "reset", "--applied")
    assert [nvml.fake_device_state(i)["power_limit_mw"] for i in (0, 1)] == [600_000, 700_000]


@pytest.mark.parametrize("kind", ["caps record", "state file", "governor record"])
def test_a_record_nested_too_deeply_is_named_in_one_line(nvml, tmp_path: Path, kind: str) -> None:
    """A caps record, state file or governor record holding JSON nested 100,000 deep (well
    under the 1 MiB read) gave `cap show`, `cap reset` and `dvfs gpu reset` "internal error:
    RecursionError". Each is named unreadable in one line, as a file that is no JSON is."""
    uuid = nvml.fake_device_state(0)["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    name = {
        "caps record": "caps-applied.json",
        "state file": f"{uuid}.json",
        "governor record": f"governed-{uuid}.json",
    }[kind]
    (state / name).write_text("[" * 100_000 + "]" * 100_000)
    readers = {  # the commands that read it
        "caps record": [("cap", "show"), ("cap", "reset", "--applied", "0")],
        "state file": [("gpu", "reset", "0")],  # (`cap reset` resets it whole, as asked)
        "governor record": [("cap", "show"), ("gpu", "reset", "0")],
    }[kind]
    for command in [*readers, ("gpu", "reset", "--defaults", "0")]:
        result = CliRunner().invoke(cli, list(command))
        told = " ".join(result.output.split())
        assert result.exit_code != 0 and "nested too deeply" in told, (command, told)
        assert "internal error" not in told and told.count("Error:") == 1, (command, told)


@pytest.mark.parametrize("source", [5, ["caps.toml"], None])
def test_cap_show_shows_an_entry_whose_source_is_no_text(
    nvml, tmp_path: Path, source: object
) -> None:
    """A caps record entry whose `source` (the caps file applied) was hand-edited to a number
    or a list gave `cap show` "internal error: TypeError" (it escaped it as text); shown as
    written, beside the lock the entry holds."""
    uuids, _ = _both_capped(nvml, tmp_path, sm_clock_max_mhz=1500)
    edit_record(uuids[0], source=source)
    said = invoke("cap", "show")
    assert "locked 210-1500 MHz by dvfs cap apply" in said and "internal error" not in said
    assert source is None or f"from {source} at" in said, said


@pytest.mark.parametrize("reset", [["--applied"], []])
def test_a_refused_unlock_beside_an_unwritable_record_says_what_it_did(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reset: list[str]
) -> None:
    """`cap reset` whose clock unlock NVML refused on GPU 0, with the caps record unwritable (a
    full disk, a folder root may not write), put GPU 0's power limit back, then ended "cannot
    use RECORD: permission denied; check permissions or choose another path": nothing said of
    the limit put back, another --state-dir advised (where no `cap show` looks), GPU 1 left
    capped. The refusal is said with what was done and why the record still lists the limit,
    and GPU 1 is reset."""
    import errno

    from dvfs.caps import AppliedCaps

    _both_capped(nvml, tmp_path, sm_clock_max_mhz=1500, power_limit_w=450.0)
    nvml.fake_update_device(
        0, errors={"nvmlDeviceResetGpuLockedClocks": nvml.NVML_ERROR_NOT_SUPPORTED}
    )

    def unwritable(self: AppliedCaps, records: dict) -> None:
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(self.path))

    monkeypatch.setattr(AppliedCaps, "write", unwritable)
    said = invoke("cap", "reset", *reset, code=1)
    back = 600_000 if reset else 700_000
    assert nvml.fake_device_state(0)["power_limit_mw"] == back, said
    assert f"power limit {back // 1000} W" in said and "cannot be written" in said, said
    assert "cannot reset locked SM clocks" in said and "another path" not in said, said
    assert said.count("Error:") == 1, said
    assert nvml.fake_device_state(1)["locked_clocks"] is None, said
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000, said


def test_a_doubtful_limit_beside_an_unwritable_record_is_said_as_it_is(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where `cap reset --applied` leaves a doubtful power limit (a damaged power_limit_mw) and
    the record, which would drop the lock it unlocked, cannot be written, the doubt is said,
    not "cannot use RECORD ... choose another path": the record lists the lock still (more
    than the GPU holds, never less)."""
    import errno

    from dvfs.caps import AppliedCaps

    uuids, _ = _both_capped(nvml, tmp_path, sm_clock_max_mhz=1500, power_limit_w=450.0)
    edit_record(uuids[0], power_limit_mw="450 W")

    def unwritable(self: AppliedCaps, records: dict) -> None:
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(self.path))

    monkeypatch.setattr(AppliedCaps, "write", unwritable)
    said = invoke("cap", "reset", "--applied", "0", code=1)
    assert "power limit 450 W was left as it is" in said and "another path" not in said, said
    assert nvml.fake_device_state(0)["locked_clocks"] is None, said
    assert json.loads(record_path().read_text())[uuids[0]]["lock_mhz"] == [210, 1500]


def test_a_signal_after_the_reset_drops_a_gpus_entry_takes_the_dead_runs_state_file_too(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`systemctl stop dvfs-caps` (`cap reset --applied`) signalled just after it dropped a
    GPU's caps record entry, on a GPU a killed sweep left a state file on, left the state file:
    the `dvfs gpu reset` it names then put back what the sweep found, dvfs's 450 W cap, with
    no record of it (sweeps took it for the GPU's stock, `cap reset --applied` for no cap of
    dvfs's). The entry and the state file go together, the signal raised once both are gone."""
    import signal

    from dvfs.caps import AppliedCaps

    uuid = nvml.fake_device_state(0)["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's
    caps = write_caps(tmp_path / "caps.toml", GpuCap(uuid=uuid, power_limit_w=450.0))
    invoke("cap", "apply", str(caps))
    StateStore(state, command="sweep").record(GpuSettings(uuid, None, 450_000))
    nvml.fake_update_device(0, power_limit_mw=300_000)
    real = AppliedCaps.update

    def then_stopped(self: AppliedCaps, gpu: str, entry: dict | None) -> None:
        real(self, gpu, entry)
        if entry is None:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(AppliedCaps, "update", then_stopped)
    result = CliRunner().invoke(cli, ["cap", "reset", "--applied", "0"])
    monkeypatch.setattr(AppliedCaps, "update", real)
    assert result.exit_code == 143, result.output
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000
    assert not record_path().exists() and not StateStore(state).pending(), result.output
    invoke("gpu", "reset", "0")  # nothing left to put back
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000


def test_cap_show_shows_a_governor_records_pid_and_time_as_written(nvml) -> None:
    """A governor's lock record whose pid or time (damaged, by hand) read like markup ("[/y]")
    gave `cap show` "internal error: MarkupError" (the line naming who set the lock was
    printed as markup); they are shown as written."""
    uuid = nvml.fake_device_state(0)["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    record = {"lock_mhz": [210, 1500], "pid": "[/y]", "since": "[bold]t[/bold]"}
    (state / f"governed-{uuid}.json").write_text(json.dumps(record))
    said = invoke("cap", "show")
    assert "dvfs govern (pid [/y], since [bold]t[/bold]" in said, said


def test_cap_show_says_no_time_for_an_entry_without_one(nvml, tmp_path: Path) -> None:
    """A caps record entry without its `applied` time (a hand edit, or an older dvfs) made
    `cap show` say "from caps.toml at None"; the time is left out where there is none, and
    an entry's time is shown as before."""
    uuids, caps = _both_capped(nvml, tmp_path, sm_clock_max_mhz=1500)
    entries = json.loads(record_path().read_text())
    del entries[uuids[0]]["applied"]
    record_path().write_text(json.dumps(entries, indent=2))
    said = invoke("cap", "show")
    assert "at None" not in said and f"from {caps}" in said, said
    assert f"from {caps} at {entries[uuids[1]]['applied']}" in said, said
