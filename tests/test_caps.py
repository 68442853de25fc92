"""Production caps: plan from headroom, apply to GPUs, show, reset."""

from __future__ import annotations

import json
import os
import re
import shlex
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner, Result
from nvml_support import NVML_CAMPAIGN, installed_root_fake

from dvfs.caps import CapsFile, GpuCap, dump_caps, load_caps, parse_caps, plan_caps
from dvfs.cli import cli
from dvfs.errors import CapsError
from dvfs.gpu.safety import StateStore

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    return installed_root_fake(tmp_path, monkeypatch)


def write_caps(path: Path, *caps: GpuCap) -> Path:
    """A caps file at `path` holding `caps`, as `dvfs cap plan` writes one."""
    path.write_text(dump_caps(CapsFile(caps)))
    return path


def invoke(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == code, result.output
    return result.output


def apply_caps(tmp_path: Path, clock_mhz: int, limit_w: float) -> str:
    """`dvfs cap apply` of a clock cap and a power limit on the first fake GPU; its UUID."""
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(
        dump_caps(CapsFile((GpuCap(uuid=uuid, sm_clock_max_mhz=clock_mhz, power_limit_w=limit_w),)))
    )
    invoke("cap", "apply", str(caps))
    return uuid


def doc(rows: list[dict], uuids: list[str] | None = None) -> dict:
    return {
        "schema": "dvfs.headroom/1",
        "campaign": "t",
        "gpu": {"name": "NVIDIA H100 80GB HBM3", "uuids": uuids or ["GPU-aaaa"]},
        "target": {"description": "TPOT p50 <= stock + 5%"},
        "reference": {"sm_clock_mhz": 1980, "power_limit_w": 700.0, "is_stock": True},
        "rows": rows,
    }


def row(corpus: str, clock: int, limit: float, feasible: bool = True) -> dict:
    return {
        "batch": 16,
        "drafter": "eagle3",
        "corpus": corpus,
        "feasible": feasible,
        "chosen": {"sm_clock_mhz": clock, "power_limit_w": limit},
    }


@pytest.mark.parametrize(
    ("key", "per_batch"), [("campaign", False), ("campaign", True), ("batch", True)]
)
def test_a_plan_of_an_integer_beyond_64_bits_is_refused_writing_nothing(
    tmp_path: Path, key: str, per_batch: bool
) -> None:
    """A headroom document holding an integer beyond 64 bits (its campaign, a row's batch: a
    hand-edited or damaged file) was written into the caps file or plan as it was: TOML's
    integers are 64-bit, so every reader but Python's refuses the file. `dvfs cap plan`
    refuses it in one line naming the key, writing nothing."""
    big = 2**70
    rows = [{**row("code", 1305, 450.0), **({"batch": big} if key == "batch" else {})}]
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps({**doc(rows), **({"campaign": big} if key != "batch" else {})}))
    out = tmp_path / "caps.toml"
    how = ["--per-batch"] if per_batch else ["--batch", "16"]
    result = CliRunner().invoke(
        cli, ["cap", "plan", str(headroom), *how, "--drafter", "eagle3", "-o", str(out)]
    )
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith(f"Error: cannot write {key} into a TOML file: {big} is beyond"), line
    assert "64-bit" in line and "correct the value" in line, line
    assert not out.exists()


def test_plan_worst_case_takes_the_least_aggressive_knob_per_corpus() -> None:
    caps = plan_caps(
        doc([row("code", 1305, 400.0), row("math", 1455, 300.0)]),
        batch=16,
        drafter="eagle3",
        corpus="worst-case",
    )
    [cap] = caps.caps
    assert (cap.uuid, cap.sm_clock_max_mhz, cap.power_limit_w) == ("GPU-aaaa", 1455, 400.0)
    one = plan_caps(
        doc([row("code", 1305, 700.0), row("math", 1455, 300.0)]),
        batch=16,
        drafter="eagle3",
        corpus="code",
    )
    assert (one.caps[0].sm_clock_max_mhz, one.caps[0].power_limit_w) == (1305, None)
    fleet = plan_caps(
        {**doc([row("code", 1305, 400.0)]), "gpu": {"name": "NVIDIA H100 80GB HBM3", "uuids": []}},
        batch=16,
        drafter="eagle3",
        corpus="code",
        model_name="NVIDIA H100 80GB HBM3",
    )
    assert fleet.caps[0].name == "NVIDIA H100 80GB HBM3" and fleet.caps[0].uuid is None


def test_plan_caps_no_answer_whose_saving_is_unknown() -> None:
    """An --slo answer (math: 1455 MHz meets the limit) whose stock has too few usable
    repeats for an energy: the headroom table's saving is "-", yet `dvfs cap plan` wrote the
    cap and the report recommended it, where a saving within the noise is no cap, and one
    unknown may spend more than stock. Refused, saying why and what to do; a known saving
    (code) and a document older than the saving still plan."""
    unknown = {**row("math", 1455, 700.0), "saving": None, "stock_energy_per_token_j": None}
    known = {**row("code", 1305, 700.0), "saving": 0.2}
    for corpus in ("worst-case", "math"):
        with pytest.raises(CapsError) as caught:
            plan_caps(doc([known, unknown]), batch=16, drafter="eagle3", corpus=corpus)
        said = str(caught.value)
        assert said.startswith("no cap at batch 16 with drafter 'eagle3': saving unknown for ")
        assert "corpus math: stock has too few usable repeats" in said, said
        assert "code" not in said.split("unknown for ", 1)[1].split(":", 1)[0], said
    planned = plan_caps(doc([known, unknown]), batch=16, drafter="eagle3", corpus="code")
    assert planned.caps[0].sm_clock_max_mhz == 1305
    older = plan_caps(doc([row("math", 1455, 700.0)]), batch=16, drafter="eagle3", corpus="math")
    assert older.caps[0].sm_clock_max_mhz == 1455
    # --vs-baseline: known against the baseline, unknown against the drafter's own stock
    versus = doc([{**unknown, "saving_vs_baseline": 0.3}])
    versus["target"]["mode"] = "vs-baseline"
    with pytest.raises(CapsError, match="math: the drafter's own stock has too few usable"):
        plan_caps(versus, batch=16, drafter="eagle3", corpus="math")


def test_plan_refuses_what_it_cannot_do() -> None:
    with pytest.raises(CapsError, match="no setting meets the target for corpus math"):
        plan_caps(
            doc([row("code", 1305, 400.0), row("math", 0, 0, feasible=False)]),
            batch=16,
            drafter="eagle3",
            corpus="worst-case",
        )
    with pytest.raises(CapsError, match="nothing to cap"):
        plan_caps(doc([row("code", 1980, 700.0)]), batch=16, drafter="eagle3", corpus="code")
    with pytest.raises(CapsError, match="has batches \\[16\\]"):
        plan_caps(doc([row("code", 1305, 400.0)]), batch=4, drafter="eagle3", corpus="code")
    with pytest.raises(CapsError, match="schema dvfs.headroom/1"):
        plan_caps({"rows": []}, batch=4, drafter="eagle3", corpus="code")


def test_caps_file_round_trip_and_validation(tmp_path: Path) -> None:
    caps = CapsFile(
        (
            GpuCap(uuid="GPU-1234", sm_clock_max_mhz=1410, power_limit_w=450.0),
            GpuCap(name="NVIDIA H200", power_limit_w=500.0),
        ),
        {"batch": 16},
    )
    path = tmp_path / "caps.toml"
    path.write_text(dump_caps(caps))
    assert load_caps(path).caps == caps.caps
    with pytest.raises(CapsError, match="unknown key\\(s\\) power_w"):
        parse_caps({"gpu": [{"uuid": "GPU-1", "power_w": 300}]}, where="x")
    with pytest.raises(CapsError, match="not a GPU UUID"):
        parse_caps({"gpu": [{"uuid": "0", "power_limit_w": 300}]}, where="x")
    with pytest.raises(CapsError, match="sets neither"):
        parse_caps({"gpu": [{"uuid": "GPU-1"}]}, where="x")


@pytest.mark.skipif(os.geteuid() != 0, reason="the world-writable check applies to root only")
def test_root_refuses_a_world_writable_caps_file(tmp_path: Path) -> None:
    path = tmp_path / "caps.toml"
    write_caps(path, GpuCap(uuid="GPU-1", power_limit_w=400.0))
    path.chmod(0o666)
    with pytest.raises(CapsError, match="world-writable"):
        load_caps(path)


def test_root_refuses_a_device_as_a_caps_file_without_advising_chmod(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caps file that is a link to /dev/zero (mode 0666): as root it was refused as
    "world-writable ... (chmod o-w caps.toml)", advice that, followed, changes /dev/zero."""
    path = tmp_path / "caps.toml"
    path.symlink_to("/dev/zero")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    result = CliRunner().invoke(cli, ["cap", "apply", str(path), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        f"Error: {path} is a device, not a file: give the file `dvfs cap plan` wrote"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="the folder check applies to root only")
def test_root_refuses_a_caps_file_or_plan_in_a_folder_others_may_write(tmp_path: Path) -> None:
    """A root-owned 0644 caps file (or plan) in a folder others may write was accepted: any of
    them could replace it (their own file renamed over it between the check and the read, or
    a link to any root-owned file). Refused, naming the folder: one everyone may write (without
    the sticky bit, as /tmp has), one a group but root's may write, one a user owns, and the
    folder of a link's target as well as the link's own."""
    from dvfs.govern.plan import load_plan

    text = dump_caps(CapsFile((GpuCap(uuid="GPU-1", power_limit_w=400.0),)))
    plan_text = (
        'dvfs_batch_plan = 1\n[meta]\nmeasured_on = "NVIDIA H100 80GB HBM3"\ndrafter = "none"\n'
        "[[batch]]\nbatch = 1\nsm_clock_mhz = 1200\n"
    )
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o755)
    (safe / "caps.toml").write_text(text)
    (safe / "plan.toml").write_text(plan_text)
    assert load_caps(safe / "caps.toml").caps[0].power_limit_w == 400.0
    assert load_plan(safe / "plan.toml").steps
    for name, mode, owner, who in (
        ("everyone", 0o777, (0, 0), "everyone"),
        ("group", 0o775, (0, 1), "group "),
        ("user", 0o755, (1, 0), "its owner "),
    ):
        folder = tmp_path / name
        folder.mkdir()
        for file, content in (("caps.toml", text), ("plan.toml", plan_text)):
            (folder / file).write_text(content)
            (folder / file).chmod(0o644)
        os.chown(folder, *owner)
        folder.chmod(mode)
        for load, file in ((load_caps, "caps.toml"), (load_plan, "plan.toml")):
            with pytest.raises(CapsError, match=f"is in {folder}, which {who}") as caught:
                load(folder / file)
            assert "/etc/dvfs" in str(caught.value)
    link = safe / "link.toml"
    link.symlink_to(tmp_path / "everyone" / "caps.toml")  # a safe folder, an unsafe target
    with pytest.raises(CapsError, match=f"links to a file in {tmp_path / 'everyone'}, which"):
        load_caps(link)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    (sticky / "caps.toml").write_text(text)
    sticky.chmod(0o1777)  # as /tmp: others cannot replace root's file there
    assert load_caps(sticky / "caps.toml").caps[0].power_limit_w == 400.0


@pytest.mark.skipif(os.geteuid() != 0, reason="the folder check applies to root only")
def test_root_names_the_folder_of_a_users_file_not_a_chown_that_would_not_do(
    tmp_path: Path,
) -> None:
    """A user's caps file or plan in the user's own folder (where their `dvfs cap plan -o`
    writes it) was refused as root with 'not owned by root (chown root FILE)'; once chowned it
    was refused again for its folder, which no change to the file makes safe. The one error
    names the folder and the fix that does: a folder only root can write."""
    from dvfs.govern.plan import load_plan

    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    files = {
        "caps.toml": dump_caps(CapsFile((GpuCap(uuid="GPU-1", power_limit_w=400.0),))),
        "plan.toml": 'dvfs_batch_plan = 1\n[meta]\nmeasured_on = "NVIDIA H100 80GB HBM3"\n'
        'drafter = "none"\n[[batch]]\nbatch = 1\nsm_clock_mhz = 1200\n',
    }
    for name, text in files.items():
        (home / name).write_text(text)
        os.chown(home / name, 1, 1)  # the user's file, in the user's folder
    os.chown(home, 1, 1)
    for load, name in ((load_caps, "caps.toml"), (load_plan, "plan.toml")):
        with pytest.raises(CapsError) as caught:
            load(home / name)
        message = str(caught.value)
        assert f"is in {home}, which its owner" in message and "/etc/dvfs" in message
        assert "chown" not in message


@pytest.mark.skipif(os.geteuid() != 0, reason="the ownership check applies to root only")
def test_root_reads_the_caps_file_it_checked(tmp_path: Path, monkeypatch) -> None:
    """The caps file was checked by its path, then opened by its path again: a file put there
    in between (another user's, renamed over it) was read, unchecked. The checks are now made
    on the file opened, which is the one read."""
    import dvfs.caps.files as files

    path = tmp_path / "caps.toml"
    write_caps(path, GpuCap(uuid="GPU-1", power_limit_w=400.0))
    theirs = tmp_path / "theirs.toml"
    write_caps(theirs, GpuCap(uuid="GPU-1", power_limit_w=100.0))
    os.chown(theirs, 1, 1)
    check = files.check_file_safety

    def check_then_swap(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        check(*args, **kwargs)
        if theirs.exists():
            os.replace(theirs, path)  # another user's file, in place once the check passed

    monkeypatch.setattr(files, "check_file_safety", check_then_swap)
    assert load_caps(path).caps[0].power_limit_w == 400.0  # the file checked, not theirs
    with pytest.raises(CapsError, match="not owned by root"):
        load_caps(path)  # theirs, checked


def test_apply_show_reset_round_trip(nvml, tmp_path: Path) -> None:
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    headroom = tmp_path / "headroom.json"
    headroom.write_text(
        json.dumps(doc([row("code", 1305, 450.0), row("math", 1230, 400.0)], uuids=[uuid]))
    )
    caps = tmp_path / "caps.toml"
    invoke("cap", "plan", str(headroom), "--batch", "16", "--drafter", "eagle3", "-o", str(caps))
    before = len(nvml.fake_calls())
    dry = invoke("cap", "apply", str(caps), "--dry-run")
    assert "dry run, nothing changed: would apply to GPU 0 (GPU-" in dry
    assert "SM clock locked to 210-1305 MHz" in dry
    assert "power limit 450 W (from 700 W)" in dry
    assert len(nvml.fake_calls()) == before  # a dry run writes nothing
    invoke("cap", "apply", str(caps))
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] == [210, 1305] and device["power_limit_mw"] == 450_000
    assert nvml.fake_device_state(1)["locked_clocks"] is None  # only the named GPU
    [shown, other] = json.loads(invoke("cap", "show", "--json"))
    assert shown["enforced_power_limit_w"] == 450 and shown["sm_clock_lock_mhz"] == [210, 1305]
    assert shown["caps_source"] == str(caps.resolve()) and other["sm_clock_lock_mhz"] is None
    invoke("cap", "reset")
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] is None and device["power_limit_mw"] == 700_000
    assert json.loads(invoke("cap", "show", "--json"))[0]["sm_clock_lock_mhz"] is None


def test_a_gpu_uuid_pasted_upper_cased_names_that_gpu(nvml, tmp_path: Path) -> None:
    """NVML's UUIDs are lower-case hex, but tools upper-case them: `gpu info GPU-ABC...` and
    `cap reset GPU-ABC...` were refused ('no GPU', exit 2), a caps file's [[gpu]] entry so
    written capped nothing (its UUID 'not here') and `cap plan --gpu` refused it as not
    measured. Each takes it for the GPU it names, case aside."""
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    upper = uuid.upper()
    assert upper != uuid
    assert f"GPU 0 NVIDIA H100 80GB HBM3 ({uuid})" in invoke("gpu", "info", upper)
    assert "is named twice" in invoke("gpu", "info", "0", upper, code=2)
    caps = tmp_path / "caps.toml"
    caps.write_text(
        dump_caps(CapsFile((GpuCap(uuid=upper, sm_clock_max_mhz=1305, power_limit_w=450.0),)))
    )
    invoke("cap", "apply", str(caps))
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] == [210, 1305] and device["power_limit_mw"] == 450_000
    assert f"GPU 0 ({uuid}): clocks unlocked" in invoke("cap", "reset", upper)
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    headroom = doc([row("code", 1305, 450.0)], uuids=[uuid])
    headroom["rows"][0]["gpu"] = uuid
    headroom["gpu"]["names"] = {uuid: "NVIDIA H100 80GB HBM3"}  # a merged document names it
    [cap] = plan_caps(headroom, batch=16, drafter="eagle3", corpus="code", uuids=[upper]).caps
    assert cap.uuid == uuid


def test_cap_plan_refuses_a_gpu_named_twice_case_aside(tmp_path: Path) -> None:
    """`cap plan --gpu UUID --gpu uuid` (one GPU, pasted once upper-cased) wrote a caps file
    with the GPU's [[gpu]] entry twice, exit 0, which the `cap apply` it printed refuses ('a
    GPU UUID appears twice'). It is refused in one line, exit 2, as --gpus refuses a GPU named
    twice; named once, in either case, the file applies."""
    uuid = "GPU-181a77a6-cf28-5d94-961e-2f4faa57402f"
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(doc([row("code", 1305, 450.0)], uuids=[uuid])))
    plan = ["cap", "plan", str(headroom), "--batch", "16", "--drafter", "eagle3"]
    result = CliRunner().invoke(cli, [*plan, "--gpu", uuid.upper(), "--gpu", uuid])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"Error: --gpu names {uuid} twice (case aside): name each GPU once\n"
    caps = tmp_path / "caps.toml"
    invoke(*plan, "--gpu", uuid.upper(), "-o", str(caps))
    assert [c.uuid for c in load_caps(caps).caps] == [uuid]


def test_cap_reset_resets_every_gpu_beside_one_fallen_off_the_bus(nvml, monkeypatch) -> None:
    """`dvfs cap reset` with no GPU named (the caps unit's ExecStop) stopped at a GPU fallen off
    the bus before resetting any: the others kept their caps. It now resets every GPU it can
    open, then names the lost one in one line (exit 1); held to CUDA_VISIBLE_DEVICES, a lost
    GPU the job was not given is none of its business (exit 0)."""

    def capped() -> None:
        for index in (0, 1):
            nvml.fake_update_device(index, locked_clocks=[210, 1200], power_limit_mw=450_000)

    def reset_here(index: int) -> bool:
        device = nvml.fake_device_state(index)
        return device["locked_clocks"] is None and device["power_limit_mw"] == 700_000

    uuid = nvml.fake_device_state(1)["uuid"]
    capped()
    nvml.fake_update_device(0, lost=True)  # the first: the others come after it
    result = CliRunner().invoke(cli, ["cap", "reset"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
    assert f"GPU 1 ({uuid}): clocks unlocked, power limit 700 W (default)" in result.stdout
    [line] = result.stderr.splitlines()
    assert "GPU 0" in line and "fallen off the bus" in line, line
    assert reset_here(1)
    for given, code in (("0,1", 1), ("1", 0), (uuid, 0)):
        capped()
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", given)
        result = CliRunner().invoke(cli, ["cap", "reset"])
        assert result.exit_code == code, (given, result.output)
        assert reset_here(1) and ("fallen off the bus" in result.stderr) == bool(code), given


def _h100_caps_file(tmp_path: Path) -> Path:
    """A caps file capping every H100 at 1500 MHz and 500 W."""
    caps = tmp_path / "caps.toml"
    cap = GpuCap(name="NVIDIA H100 80GB HBM3", sm_clock_max_mhz=1500, power_limit_w=500)
    write_caps(caps, cap)
    return caps


def test_cap_reset_resets_every_gpu_beside_one_a_running_dvfs_holds(nvml, tmp_path) -> None:
    """`dvfs cap reset` (the caps unit's ExecStop) with a running governor holding GPU 0 reset
    no GPU at all (exit 3), leaving GPU 1 capped, where `dvfs gpu reset` skips a busy GPU. It
    now resets every GPU it can, leaves the held one to its process (which puts back what it
    found when it stops) and names it in one line with the command that resets it later, exit
    3; GPUs named are treated so too."""
    from dvfs.caps import AppliedCaps
    from dvfs.gpu.nvml import open_nvml_gpus
    from dvfs.gpu.safety import GpuLocks

    caps = _h100_caps_file(tmp_path)
    state = Path(os.environ["DVFS_STATE_DIR"])
    for named in ((), ("0", "1")):
        invoke("cap", "apply", str(caps))
        with open_nvml_gpus([0], nvml=nvml) as (gpu,), GpuLocks(state).hold([gpu]):
            result = CliRunner().invoke(cli, ["cap", "reset", *named])
        assert result.exit_code == 3, (named, result.output)
        assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
        uuid = nvml.fake_device_state(1)["uuid"]
        assert f"GPU 1 ({uuid}): clocks unlocked" in result.stdout, named
        assert "GPU 0" not in result.stdout, named
        [error] = [line for line in result.stderr.splitlines() if line.strip()]
        assert "GPU 0 (" in error and "in use by another dvfs process" in error, error
        # with the state folder: $DVFS_STATE_DIR chose it, which `sudo` drops, and a reset
        # run in another left this one's caps record claiming GPU 0's caps in force
        advised = f"dvfs cap reset --state-dir {state} 0"
        assert f"`{advised}`" in error, error
        assert nvml.fake_device_state(1)["locked_clocks"] is None
        assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000
        assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]  # left to its holder
        # once the holder is gone, followed as root runs it (the variable names another folder)
        sudo = {"DVFS_STATE_DIR": str(tmp_path / "elsewhere")}
        followed = CliRunner().invoke(cli, shlex.split(advised)[1:], env=sudo)
        assert followed.exit_code == 0, followed.output
        assert nvml.fake_device_state(0)["locked_clocks"] is None
        assert AppliedCaps(state).read() == {}, "the caps record still claims GPU 0's caps"


def test_cap_reset_names_what_it_reset_and_the_held_gpu_beside_one_that_fails(
    nvml, tmp_path: Path
) -> None:
    """`dvfs cap reset` with GPU 1 failing its reset (an NVML error) reset GPU 2, uncapped,
    without a word, and said nothing of GPU 0, which a running governor holds and which was
    not reset: the one line named GPU 1 alone. What was reset is printed, and the error names
    the failed GPU and the held one with the command that resets it later."""
    from dvfs.gpu.nvml import open_nvml_gpus
    from dvfs.gpu.safety import GpuLocks

    nvml.fake_reset_state("h100-sxm,h100-sxm,h100-sxm")
    caps = _h100_caps_file(tmp_path)
    invoke("cap", "apply", str(caps))
    nvml.fake_update_device(1, errors={"nvmlDeviceResetGpuLockedClocks": nvml.NVML_ERROR_UNKNOWN})
    state = Path(os.environ["DVFS_STATE_DIR"])
    with open_nvml_gpus([0], nvml=nvml) as (gpu,), GpuLocks(state).hold([gpu]):
        result = CliRunner().invoke(cli, ["cap", "reset"])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
    uuid = nvml.fake_device_state(2)["uuid"]
    assert f"GPU 2 ({uuid}): clocks unlocked" in result.stdout, result.output
    [error] = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert "GPU 1: cannot reset locked SM clocks" in error, error
    assert "GPU 0 (" in error and f"`dvfs cap reset --state-dir {state} 0`" in error, error
    assert nvml.fake_device_state(2)["power_limit_mw"] == 700_000
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]  # left to its holder


@pytest.mark.parametrize(
    ("error", "code"), [("NVML_ERROR_NOT_SUPPORTED", 1), ("NVML_ERROR_NO_PERMISSION", 4)]
)
def test_cap_reset_puts_the_power_limit_back_past_a_refused_clock_reset(
    nvml, tmp_path: Path, error: str, code: int
) -> None:
    """NVML refusing a GPU's clock reset (which changed nothing) stopped `dvfs cap reset` (and
    `gpu reset --defaults`) there: the power limit stayed capped at 500 W, as the sweep's and
    `gpu reset`'s restores left it before they learnt to go on. It is reset to the default
    still; the error names the clock, whose lock and record entry stay."""
    invoke("cap", "apply", str(_h100_caps_file(tmp_path)))
    reset = {"nvmlDeviceResetGpuLockedClocks": getattr(nvml, error)}
    nvml.fake_update_device(0, errors=reset)
    for command in (["cap", "reset", "0"], ["gpu", "reset", "--defaults", "0"]):
        nvml.fake_update_device(0, power_limit_mw=500_000)
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == code, (command, result.output)
        assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
        [line] = [line for line in result.stderr.splitlines() if line.strip()]
        assert "GPU 0: cannot reset locked SM clocks" in line, line
        device = nvml.fake_device_state(0)
        assert device["power_limit_mw"] == 700_000, command
        assert device["locked_clocks"] == [210, 1500], command
    shown = json.loads(invoke("cap", "show", "--json"))[0]
    assert shown["sm_clock_lock_mhz"] == [210, 1500]  # still recorded: the GPU holds it


def _stock_campaign(tmp_path: Path) -> Path:
    """The NVML campaign at the GPU's stock only (no clock, no limit swept), as TMP/stock.toml."""
    campaign = tmp_path / "stock.toml"
    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    text = text.replace("sm_clock = [1980, 1500]", 'sm_clock = "stock"')
    campaign.write_text(text.replace("power_limit = [700, 400]", 'power_limit = "stock"'))
    return campaign


def test_a_limit_set_by_hand_after_a_partial_cap_reset_is_the_sweeps_stock(
    nvml, tmp_path: Path
) -> None:
    """A `cap reset` whose clock reset NVML refused puts the power limit back to the default
    but kept the record's 450 W cap: the same limit set by hand afterwards (the operator's
    stock) was taken for dvfs's cap, and a sweep measured its stock cells at 700 W. The record
    keeps the lock the GPU still holds, and no longer the limit it does not."""
    from dvfs.cube import open_cube

    apply_caps(tmp_path, 1200, 450.0)
    nvml.fake_update_device(
        0, errors={"nvmlDeviceResetGpuLockedClocks": nvml.NVML_ERROR_NOT_SUPPORTED}
    )
    invoke("cap", "reset", "0", code=1)
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000
    shown = json.loads(invoke("cap", "show", "--json"))[0]
    assert shown["sm_clock_lock_mhz"] == [210, 1200]  # the GPU still holds it
    nvml.fake_update_device(0, errors={}, power_limit_mw=450_000)  # `nvidia-smi -pl 450`
    campaign = _stock_campaign(tmp_path)
    out = tmp_path / "out"
    invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    assert open_cube(out / "cube.nc").attrs["stock_power_limit_w"] == 450.0
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000


def test_cap_reset_resets_the_named_gpus_beside_one_fallen_off_the_bus(nvml) -> None:
    """`dvfs cap reset 0 1` with GPU 1 fallen off the bus stopped at it and left GPU 0 capped,
    where the same reset with no GPU named resets GPU 0: the operator resetting GPUs wants every
    one that answers reset. It now resets the named GPUs that open, then names the lost one in
    the line the no-GPU-named reset gives (exit 1), by index or UUID; a GPU that is not on the
    machine at all is still refused (a typo), nothing reset."""
    nvml.fake_update_device(1, locked_clocks=[210, 1200], power_limit_mw=450_000)
    nvml.fake_update_device(1, lost=True)
    [uuid, lost_uuid] = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    every = CliRunner().invoke(cli, ["cap", "reset"])
    for named in (("0", "1"), ("1", uuid), (lost_uuid, "0")):
        nvml.fake_update_device(0, locked_clocks=[210, 1200], power_limit_mw=450_000)
        result = CliRunner().invoke(cli, ["cap", "reset", *named])
        assert result.exit_code == 1, (named, result.output)
        assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
        assert f"GPU 0 ({uuid}): clocks unlocked, power limit 700 W (default)" in result.stdout
        # the line of the every-GPU reset, naming the lost GPU as it was named
        line = every.stderr.replace("GPU 1", lost_uuid) if lost_uuid in named else every.stderr
        assert every.exit_code == 1 and result.stderr == line, named
        device = nvml.fake_device_state(0)
        assert device["locked_clocks"] is None and device["power_limit_mw"] == 700_000, named
    nvml.fake_update_device(0, locked_clocks=[210, 1200], power_limit_mw=450_000)
    typo = CliRunner().invoke(cli, ["cap", "reset", "0", "9"])
    assert typo.exit_code == 2 and "no GPU 9: this machine has 2 GPU(s)" in typo.stderr
    assert typo.stdout == "" and nvml.fake_device_state(0)["locked_clocks"] == [210, 1200]


def test_cap_apply_caps_every_gpu_beside_one_fallen_off_the_bus(nvml, tmp_path: Path) -> None:
    """`dvfs cap apply` (the caps unit at boot) exited 1 at a GPU fallen off the bus before
    capping any: the healthy GPUs kept the stock power limit. It now caps every GPU it can
    open and records them (for `cap reset`), then names the lost one in one line, exit 1 (the
    unit fails, to be seen, and its caps stay), --skip-missing or not: an unmatched UUID may
    be the lost GPU's. A file matching none of the others is the lost GPU's fault (exit 1, not
    2), nothing capped."""
    [lost_uuid, uuid] = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        dump_caps(
            CapsFile(
                (GpuCap(name="NVIDIA H100 80GB HBM3", sm_clock_max_mhz=1500, power_limit_w=450),)
            )
        )
    )
    both = tmp_path / "both.toml"
    both.write_text(
        dump_caps(CapsFile(tuple(GpuCap(uuid=u, power_limit_w=450.0) for u in (lost_uuid, uuid))))
    )
    nvml.fake_update_device(0, lost=True)
    state = Path(os.environ["DVFS_STATE_DIR"])

    def lost_line(result) -> str:
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
        [line] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
        assert "GPU 0" in line and "fallen off the bus" in line, line
        return line

    dry = CliRunner().invoke(cli, ["cap", "apply", str(fleet), "--dry-run"])
    assert "dry run, nothing changed: cannot open GPU 0" in lost_line(dry)
    assert f"would apply to GPU 1 ({uuid})" in dry.stdout
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000
    result = CliRunner().invoke(cli, ["cap", "apply", str(fleet)])
    assert "caps were applied to the other GPUs" in lost_line(result)
    assert f"applied to GPU 1 ({uuid}): SM clock locked to " in result.stdout
    device = nvml.fake_device_state(1)
    assert device["power_limit_mw"] == 450_000 and device["locked_clocks"][1] == 1500
    record = json.loads((state / "caps-applied.json").read_text())
    assert list(record) == [uuid] and record[uuid]["power_limit_mw"] == 450_000
    for extra in ((), ("--skip-missing",)):
        result = CliRunner().invoke(cli, ["cap", "apply", str(both), *extra])
        lost_line(result)
        assert lost_uuid in " ".join(result.stderr.split())  # noted, not the exit
        assert nvml.fake_device_state(1)["power_limit_mw"] == 450_000
    only_lost = tmp_path / "lost.toml"
    write_caps(only_lost, GpuCap(uuid=lost_uuid, power_limit_w=400.0))
    refused = CliRunner().invoke(cli, ["cap", "apply", str(only_lost)])
    line = lost_line(refused)
    assert "matches none of this host's GPUs that open, so nothing was capped" in line
    assert nvml.fake_device_state(1)["power_limit_mw"] == 450_000
    reset = CliRunner().invoke(cli, ["cap", "reset"])  # what the apply recorded goes
    assert reset.exit_code == 1 and f"GPU 1 ({uuid}): clocks unlocked" in reset.stdout
    assert not (state / "caps-applied.json").exists()
    nvml.fake_update_device(1, lost=True)  # none opens: nothing to cap, the lost named
    assert "GPU 1" in lost_line(CliRunner().invoke(cli, ["cap", "apply", str(fleet)]))


def test_cap_apply_refused_as_held_still_names_the_gpu_fallen_off_the_bus(
    nvml, tmp_path: Path
) -> None:
    """GPU 0 fallen off the bus and GPU 1 held by a running dvfs: `cap apply` (and its dry
    run) was refused as held, exit 3, in a line that said nothing of GPU 0, which needs
    seeing to as much (a failed write names it beside the failure). The held refusal, still
    exit 3 with nothing changed, names the lost GPU too."""
    from dvfs.gpu.nvml import open_nvml_gpus
    from dvfs.gpu.safety import GpuLocks

    caps = _h100_caps_file(tmp_path)
    state = Path(os.environ["DVFS_STATE_DIR"])
    uuid = nvml.fake_device_state(1)["uuid"]
    with open_nvml_gpus([1], nvml=nvml) as (gpu,), GpuLocks(state).hold([gpu]):
        nvml.fake_update_device(0, lost=True)
        results = [
            CliRunner().invoke(cli, ["cap", "apply", str(caps), *dry])
            for dry in (("--dry-run",), ())
        ]
    for result in results:
        assert result.exit_code == 3, result.output
        assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
        [line] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
        assert f"GPU 1 ({uuid})" in line and "in use by another dvfs process" in line, line
        assert "GPU 0" in line and "fallen off the bus" in line, line
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000


def test_cap_apply_does_not_say_no_gpu_is_the_lost_gpus_model(nvml, tmp_path: Path) -> None:
    """A fleet file's [[model]] that matched none of the GPUs that open was noted as "no GPU
    here is a NVIDIA H200" while the GPU fallen off the bus, whose model cannot be read, was
    that H200: the note now says it is none of the GPUs that open, the lost one perhaps."""
    nvml.fake_reset_state(["h200-sxm", "h100-sxm"])
    [lost, healthy] = [nvml.FAKE_PROFILES[p]["name"] for p in ("h200-sxm", "h100-sxm")]
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        dump_caps(CapsFile(tuple(GpuCap(name=n, power_limit_w=450.0) for n in (lost, healthy))))
    )
    nvml.fake_update_device(0, lost=True)
    for extra in (("--dry-run",), ()):
        result = CliRunner().invoke(cli, ["cap", "apply", str(fleet), *extra])
        assert result.exit_code == 1, result.output
        told = " ".join(result.stderr.split())
        assert f"no GPU here is a {lost}" not in told, told
        assert f"none of this host's GPUs that open is a {lost}, the GPU fallen off" in told
    assert nvml.fake_device_state(1)["power_limit_mw"] == 450_000


def test_cap_show_shows_every_gpu_beside_one_fallen_off_the_bus(nvml, tmp_path: Path) -> None:
    """`dvfs cap show` failed whole on a GPU fallen off the bus, showing no GPU's caps. It now
    shows every GPU it can open (as text or --json), then names the lost one in one line, exit
    1. Its --json gives the lost GPU the row `gpu list --json` gives it (its index and error)."""
    uuid = nvml.fake_device_state(1)["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    invoke("cap", "apply", str(caps))
    nvml.fake_update_device(0, lost=True)
    for extra in ((), ("--json",)):
        result = CliRunner().invoke(cli, ["cap", "show", *extra])
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
        [line] = result.stderr.splitlines()
        assert "GPU 0" in line and "fallen off the bus" in line, line
        if extra:
            [lost, row] = json.loads(result.stdout)
            listed = json.loads(CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout)
            assert lost == listed[0] and set(lost) == {"index", "error"}, lost
            assert (row["index"], row["uuid"], row["caps_source"]) == (1, uuid, str(caps))
            assert row["sm_clock_lock_mhz"][1] == 1500
        else:
            shown = " ".join(result.stdout.split())
            assert f"GPU 1 ({uuid}): power limit 700 W" in shown and "-1500 MHz" in shown
            assert "GPU 0" not in result.stdout
    nvml.fake_update_device(1, lost=True)  # none opens: --json still gives each its row
    result = CliRunner().invoke(cli, ["cap", "show", "--json"])
    listed = json.loads(CliRunner().invoke(cli, ["gpu", "list", "--json"]).stdout)
    assert result.exit_code == 1 and json.loads(result.stdout) == listed, result.output
    assert [r["index"] for r in listed] == [0, 1] and all("error" in r for r in listed)


def test_the_caps_commands_go_on_beside_a_gpu_that_opens_but_reads_nothing(
    nvml, tmp_path: Path
) -> None:
    """A GPU needing a reset may still give its UUID (so it opens) while every reading fails
    (NVML_ERROR_RESET_REQUIRED). Every-GPU commands set aside only a GPU that did not open:
    `cap apply` (the caps unit at boot) then stopped at its power limit with no GPU capped,
    and `cap show` / `gpu info` showed no other GPU. Each now acts on the others and names it
    in one line, exit 1, as it does a GPU fallen off the bus."""
    uuid = nvml.fake_device_state(0)["uuid"]
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        dump_caps(CapsFile((GpuCap(name="NVIDIA H100 80GB HBM3", power_limit_w=450),)))
    )
    failing = ("nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetEnforcedPowerLimit")
    nvml.fake_update_device(1, errors={f: nvml.NVML_ERROR_RESET_REQUIRED for f in failing})
    said = str(nvml.NVMLError(nvml.NVML_ERROR_RESET_REQUIRED))
    for args in (("cap", "apply", str(fleet)), ("cap", "show"), ("gpu", "info")):
        result = CliRunner().invoke(cli, list(args))
        assert result.exit_code == 1, (args, result.output)
        assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
        [line] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
        assert "GPU 1" in line and said in line, (args, line)
        assert uuid in " ".join(result.stdout.split()), (args, result.output)
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000


def _gpu_1_set_aside(args: tuple[str, ...], uuid: str) -> None:
    """`dvfs ARGS` went on beside GPU 1, whose readings NVML does not support: exit 1, one
    error line naming GPU 1 and NVML's answer, GPU 0 (`uuid`) shown."""
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 1, (args, result.output)
    assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
    [line] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert "GPU 1" in line and "Not Supported" in line, (args, line)
    assert uuid in " ".join(result.stdout.split()), (args, result.output)


def test_the_caps_commands_go_on_beside_a_gpu_whose_power_limit_nvml_does_not_support(
    nvml, tmp_path: Path
) -> None:
    """A GPU whose power-limit reads NVML answers NOT_SUPPORTED passed the every-GPU commands'
    check of a GPU that opens ('not supported is fine'), then failed each of them on the
    reads they make: `cap apply` (the caps unit at boot) capped no GPU, not even with a
    clock-only file, and `cap show` and `gpu info` showed none of the others. A clock-only
    file caps it now as any GPU (its power limit neither read nor recorded); `cap show` and
    `gpu info`, which cannot read the enforced limit they show, set it aside as one needing a
    reset is: the others shown, it named in one line, exit 1."""
    uuid = nvml.fake_device_state(0)["uuid"]
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        dump_caps(CapsFile((GpuCap(name="NVIDIA H100 80GB HBM3", sm_clock_max_mhz=1500),)))
    )
    failing = (
        "nvmlDeviceGetPowerManagementLimit",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetPowerManagementLimitConstraints",
        "nvmlDeviceGetPowerManagementDefaultLimit",
    )
    nvml.fake_update_device(1, errors={f: nvml.NVML_ERROR_NOT_SUPPORTED for f in failing})
    result = CliRunner().invoke(cli, ["cap", "apply", str(fleet)])
    assert result.exit_code == 0, result.output
    for args in (("cap", "show"), ("gpu", "info")):
        _gpu_1_set_aside(args, uuid)
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
    assert nvml.fake_device_state(1)["locked_clocks"] == [210, 1500]


@pytest.mark.parametrize("failing", ["nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetClockInfo"])
def test_cap_show_and_gpu_info_go_on_beside_a_gpu_whose_readings_nvml_does_not_support(
    nvml, failing: str
) -> None:
    """A GPU whose power limit reads, but whose enforced limit or SM clock NVML answers
    NOT_SUPPORTED, passed the every-GPU commands' check, then failed `cap show` and `gpu info`
    on it: neither showed any GPU, exit 1. It is set aside as one whose power limit is not
    supported: the others shown, it named in one line, exit 1."""
    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(1, errors={failing: nvml.NVML_ERROR_NOT_SUPPORTED})
    for args in (("cap", "show"), ("gpu", "info"), ("gpu", "info", "0", "1")):
        _gpu_1_set_aside(args, uuid)


def test_a_gpu_whose_power_limit_nvml_does_not_support_fails_no_command_that_leaves_it_be(
    nvml, tmp_path: Path
) -> None:
    """Set aside by every every-GPU command, a GPU whose power limit NVML does not support
    failed, exit 1, a `cap apply` of a file with no entry for it (the caps unit at each boot:
    a lasting property of the GPU, not a fault) and `gpu reset` with nothing recorded for it
    (the governor unit's ExecStopPost), each of which reads that power limit only on a GPU it
    changes: as before it was set aside, the apply caps the GPU it names and notes the other
    (exit 0), the reset finds nothing to restore (exit 0)."""
    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    nvml.fake_update_device(
        1, errors={"nvmlDeviceGetPowerManagementLimit": nvml.NVML_ERROR_NOT_SUPPORTED}
    )
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert result.exit_code == 0, result.output
    assert "has no entry for GPU 1" in " ".join(result.stderr.split()), result.output
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
    for args in (("gpu", "reset"), ("gpu", "reset", "1")):
        result = CliRunner().invoke(cli, list(args))
        assert result.exit_code == 0, (args, result.output)
        assert "nothing to restore" in result.stdout, (args, result.output)
    result = CliRunner().invoke(cli, ["gpu", "reset", "--defaults"])  # GPU 1's clocks too
    assert result.exit_code == 0, result.output
    assert "clocks unlocked, power limit not supported by NVML (left be)" in result.stdout
    assert nvml.fake_device_state(0)["locked_clocks"] is None


def test_a_gpu_named_by_uuid_and_set_aside_for_its_power_limit_is_not_said_to_be_lost(
    nvml, tmp_path: Path
) -> None:
    """`cap apply` of a file naming by UUID, with a power limit, a GPU whose power limit NVML
    does not support sets that GPU aside (named, exit 1), yet its note said the file "names
    GPU(s) UUID, which are not among this host's GPUs that open (...), the GPU fallen off the
    bus perhaps": it opened, and is here. Its entry is its own now: no such note, the error
    line saying why it was not capped; a UUID that is on no GPU here is "not on this host",
    which lists the set-aside GPU too; and a file naming only that GPU says it was set aside,
    not that it matches none of the GPUs that open."""
    u0, u1 = (nvml.fake_device_state(i)["uuid"] for i in (0, 1))
    elsewhere = "GPU-00000000-0000-0000-0000-000000000000"
    nvml.fake_update_device(
        1, errors={"nvmlDeviceGetPowerManagementLimit": nvml.NVML_ERROR_NOT_SUPPORTED}
    )
    caps = tmp_path / "caps.toml"
    unsupported = "GPU 1: cannot read the power limit: NVML says Not Supported"

    def apply(uuids: tuple[str, ...], *extra: str) -> tuple[str, str]:
        entries = tuple(GpuCap(uuid=u, sm_clock_max_mhz=1500, power_limit_w=400) for u in uuids)
        caps.write_text(dump_caps(CapsFile(entries)))
        result = CliRunner().invoke(cli, ["cap", "apply", str(caps), *extra])
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
        out = " ".join(result.output.split())
        assert "fallen off the bus" not in out and "not among" not in out, out
        [error] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
        return out, error

    for extra in ((), ("--dry-run",)):
        out, error = apply((u0, u1), *extra)
        assert unsupported in error and "note:" not in out, out
        out, error = apply((u0, u1, elsewhere), *extra)
        assert unsupported in error, out
        assert f"names GPU(s) {elsewhere}, which are not on this host (it has GPU 0" in out
        assert f"GPU 1 NVIDIA H100 80GB HBM3 ({u1}))" in out
        if extra:
            assert "`cap apply` would cap the GPUs that match and exit 1" in out
        out, error = apply((u1,), *extra)
        assert error == (
            f"Error: {caps} matches only GPU 1 ({u1}) here, whose power limit NVML does not "
            "support (its entry sets one): it was set aside, so nothing was capped"
        )
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
    assert nvml.fake_device_state(1)["locked_clocks"] is None


def test_monitor_exports_the_enforced_limit_of_a_gpu_whose_power_limit_is_not_supported(
    nvml,
) -> None:
    """The README said `dvfs monitor` exports a GPU whose power limit NVML answers "not
    supported" "with its power limit NaN"; the metric is the enforced limit, which such a GPU
    may still give (what an operator needs: what the driver holds it to), NaN only where that
    read is not supported either. The README now says what is exported."""
    import re

    def limits() -> dict[str, str]:
        page = invoke("monitor", "--once")
        found = re.findall(r'^dvfs_gpu_power_limit_watts\{gpu="(\d)",[^}]*\} (\S+)$', page, re.M)
        assert 'gpu="1"' in page and 'dvfs_gpu_up{gpu="1"' in page
        return dict(found)

    unsupported = {"nvmlDeviceGetPowerManagementLimit": nvml.NVML_ERROR_NOT_SUPPORTED}
    nvml.fake_update_device(1, errors=unsupported)
    assert limits() == {"0": "700.0", "1": "700.0"}
    unsupported["nvmlDeviceGetEnforcedPowerLimit"] = nvml.NVML_ERROR_NOT_SUPPORTED
    nvml.fake_update_device(1, errors=unsupported)
    assert limits() == {"0": "700.0", "1": "NaN"}
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "the second with its power limit NaN" not in readme
    assert (
        "the second as up with the power limit it exports, the enforced one "
        "(`dvfs_gpu_power_limit_watts`, what the driver holds the GPU to), still read: NaN only "
        "where NVML does not support that read either"
    ) in readme


def test_apply_errors_are_clear(nvml, tmp_path: Path, monkeypatch) -> None:
    caps = tmp_path / "caps.toml"
    elsewhere = "GPU-00000000-0000-0000-0000-000000000000"
    write_caps(caps, GpuCap(uuid=elsewhere, power_limit_w=400.0))
    missing = invoke("cap", "apply", str(caps), code=2)
    assert "matches no GPU on this host" in missing and elsewhere in missing
    assert "GPU 0 NVIDIA H100 80GB HBM3 (GPU-" in missing  # what the host has
    assert nvml.fake_calls() == []
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1507))
    assert "1507 MHz is not a supported SM clock" in invoke("cap", "apply", str(caps), code=2)
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=400.0))
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")
    denied = invoke("cap", "apply", str(caps), code=4)
    assert "permission denied" in denied and "systemd" in denied


def test_a_caps_file_matching_no_gpu_fails_even_with_skip_missing(nvml, tmp_path: Path) -> None:
    """The boot unit must not report success having capped nothing."""
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(name="NVIDIA H200", power_limit_w=400.0))
    for extra in ((), ("--skip-missing",), ("--dry-run",)):
        out = invoke("cap", "apply", str(caps), *extra, code=2)
        assert "matches no GPU on this host" in out and "model 'NVIDIA H200'" in out
        assert "NVIDIA H100 80GB HBM3" in out
    assert nvml.fake_calls() == []


def test_a_partial_match_applies_what_matches_and_says_what_did_not(nvml, tmp_path: Path) -> None:
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    gone = "GPU-11111111-1111-1111-1111-111111111111"
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0), GpuCap(uuid=gone, power_limit_w=450.0))
    dry = " ".join(invoke("cap", "apply", str(caps), "--dry-run", code=5).split())
    assert "dry run, nothing changed:" in dry and gone in dry and "not on this host" in dry
    assert "`cap apply` would cap the GPUs that match and exit 5" in dry
    assert "caps went to" not in dry and "applied" not in dry  # nothing was
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000
    out = invoke("cap", "apply", str(caps), code=5)
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000  # applied what matched
    assert f"applied to GPU 0 ({uuid}): power limit 450 W (from 700 W)" in out
    assert "caps went to the GPUs that match" in " ".join(out.split())
    assert gone in out and "not on this host" in out and "--skip-missing" in out
    assert "applied caps to 1 GPU(s)" in out
    invoke("cap", "reset")
    accepted = invoke("cap", "apply", str(caps), "--skip-missing")
    assert "note:" in accepted and gone in accepted
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000


def test_a_fleet_file_notes_models_this_host_lacks(nvml, tmp_path: Path) -> None:
    caps = tmp_path / "caps.toml"
    write_caps(
        caps,
        GpuCap(name="NVIDIA H100 80GB HBM3", power_limit_w=450.0),
        GpuCap(name="NVIDIA H200", power_limit_w=500.0),
    )
    out = invoke("cap", "apply", str(caps))  # exit 0: a fleet file names every model
    assert "applied caps to 2 GPU(s)" in out and "note:" in out and "NVIDIA H200" in out


def test_a_merged_cubes_caps_an_older_dvfs_planned_say_how_to_plan_them_again(
    nvml, tmp_path: Path
) -> None:
    """A merged cube of an H100 and an H200, planned by a dvfs older than the documents naming
    each GPU's model: its headroom named the first GPU's model only, and its caps file's
    measured_on too, so `cap apply` (the caps unit at boot, exit 2) refuses the H200's entry,
    saying only to plan it from a cube of its own model or remove it. It now says how to plan
    again from that cube; and `cap plan` of that older headroom document, which wrote the same
    refused file again, asks for the document anew."""
    nvml.fake_reset_state(["h100-sxm", "h200-sxm"])
    gpus = json.loads(invoke("gpu", "list", "--json"))
    (h100, h200), uuids = [g["name"] for g in gpus], [g["uuid"] for g in gpus]
    rows = [
        {**row("code", clock, 700.0), "gpu": u}
        for u, clock in zip(uuids, (1500, 1005), strict=True)
    ]
    older = doc(rows, uuids=uuids)
    older["gpu"]["name"] = h100  # as an older dvfs named a merged cube: by its first GPU
    with pytest.raises(CapsError) as refused:
        plan_caps(older, batch=16, drafter="eagle3", corpus="worst-case")
    assert "write it again with `dvfs headroom CUBE --json -o FILE`" in str(refused.value)
    caps = tmp_path / "caps.toml"  # what the older dvfs planned from it
    meta = {"measured_on": h100, "batch": 16, "drafter": "eagle3", "corpus": "worst-case"}
    entries = (
        GpuCap(uuid=uuids[0], sm_clock_max_mhz=1500),
        GpuCap(uuid=uuids[1], sm_clock_max_mhz=1005),
    )
    caps.write_text(dump_caps(CapsFile(entries, meta)))
    for extra in (("--dry-run",), ()):
        told = " ".join(invoke("cap", "apply", str(caps), *extra, code=2).split())
        assert f"GPU 1 ({uuids[1]}) is a {h200}" in told, told
        again = (
            "write that cube's headroom again, `dvfs headroom CUBE --json -o headroom.json`, then "
            "plan again, `dvfs cap plan headroom.json --batch 16 --drafter eagle3 -o caps.toml`"
        )
        assert again in told, told
    assert nvml.fake_calls() == []
    # planned again so, from the document written again, both GPUs are capped
    anew = doc(rows, uuids=uuids)
    anew["gpu"].update(name=f"{h100}, {h200}", names=dict(zip(uuids, (h100, h200), strict=True)))
    caps.write_text(dump_caps(plan_caps(anew, batch=16, drafter="eagle3", corpus="worst-case")))
    assert "applied caps to 2 GPU(s)" in invoke("cap", "apply", str(caps))
    assert [nvml.fake_device_state(i)["locked_clocks"][1] for i in (0, 1)] == [1500, 1005]


def test_planning_an_older_merged_cube_again_keeps_its_target(nvml, tmp_path: Path) -> None:
    """The refusals of an older merged cube's caps (and of its headroom document) said to
    write the headroom again with `dvfs headroom CUBE --json -o ...`: its default target (each
    drafter's stock TPOT p50 + 5%), where the caps were planned for another (an SLO), so the
    caps planned again held another target. Each names the target to ask for again."""
    slo = "TPOT p99 <= 40 ms"
    nvml.fake_reset_state(["h100-sxm", "h200-sxm"])
    gpus = json.loads(invoke("gpu", "list", "--json"))
    (h100, _), uuids = [g["name"] for g in gpus], [g["uuid"] for g in gpus]
    older = doc([{**row("code", 1500, 700.0), "gpu": u} for u in uuids], uuids=uuids)
    older["target"]["description"] = slo
    with pytest.raises(CapsError) as refused:
        plan_caps(older, batch=16, drafter="eagle3", corpus="worst-case")
    again = f"`dvfs headroom CUBE --json -o FILE` with the options of its target, {slo}"
    assert again in str(refused.value), refused.value
    meta = {"measured_on": h100, "target": slo, "batch": 16, "drafter": "eagle3"}
    caps = tmp_path / "caps.toml"
    entries = tuple(GpuCap(uuid=u, sm_clock_max_mhz=1500) for u in uuids)
    caps.write_text(dump_caps(CapsFile(entries, meta)))
    told = " ".join(invoke("cap", "apply", str(caps), code=2).split())
    again = f"`dvfs headroom CUBE --json -o headroom.json` with the options of its target, {slo},"
    assert again in told, told
    twice = tmp_path / "twice.toml"
    twice.write_text(
        f'dvfs_caps = 1\n[meta]\ntarget = "{slo}"\nbatch = 16\ndrafter = "eagle3"\n'
        f'[[model]]\nname = "{h100}"\nsm_clock_max_mhz = 1500\n'
        f'[[model]]\nname = "{h100}"\nsm_clock_max_mhz = 1005\n'
    )
    with pytest.raises(CapsError) as refused:
        load_caps(twice)
    assert again in str(refused.value), refused.value
    assert nvml.fake_calls() == []


def test_caps_measured_on_one_model_are_not_applied_to_a_gpu_of_another(
    nvml, tmp_path: Path
) -> None:
    """`cap plan --gpu` takes any UUID, and a [[gpu]] entry names its GPU by UUID only: caps
    measured on an H100 planned for both GPUs of a host with an H100 and an H200 locked the
    H200 at the H100's clock, exit 0. Now the H200's entry is an invalid cap (exit 2, nothing
    applied), as `dvfs govern` refuses a plan of another model; a file of both models' caps
    (a merged cube's) still caps both."""
    nvml.fake_reset_state(["h100-sxm", "h200-sxm"])
    h100, h200 = [g["name"] for g in json.loads(invoke("gpu", "list", "--json"))]
    uuids = [g["uuid"] for g in json.loads(invoke("gpu", "list", "--json"))]
    measured = doc([row("code", 1305, 700.0)], uuids=uuids[:1])
    measured["gpu"]["name"] = h100
    caps = tmp_path / "caps.toml"
    caps.write_text(
        dump_caps(
            plan_caps(measured, batch=16, drafter="eagle3", corpus="code", uuids=uuids),
        )
    )
    for extra in (("--dry-run",), ()):
        told = " ".join(invoke("cap", "apply", str(caps), *extra, code=2).split())
        assert f"GPU 1 ({uuids[1]}) is a {h200}" in told and f"measured on {h100}" in told, told
        # the way out for a file joined by hand from each model's plan (applied below)
        assert "lists each in [meta] measured_on, comma-separated" in told, told
        assert "GPU 0" not in told and "applied" not in told
    assert nvml.fake_calls() == []  # nothing applied, the H100 included
    both = load_caps(caps)
    both = CapsFile(both.caps, {**both.meta, "measured_on": f"{h100}, {h200}"})
    caps.write_text(dump_caps(both))
    assert "applied caps to 2 GPU(s)" in invoke("cap", "apply", str(caps))
    assert [nvml.fake_device_state(i)["locked_clocks"][1] for i in (0, 1)] == [1305, 1305]


def test_apply_names_the_gpus_here_that_the_file_has_no_entry_for(nvml, tmp_path: Path) -> None:
    """A fleet file of H100 caps on a host with an H100 and an H200, or caps planned for the
    one GPU a cube measured on a host of two: the other GPU was left at stock with nothing said
    but "applied caps to 1 GPU(s)". It is named in a note (exit 0: the file may mean it)."""
    nvml.fake_reset_state(["h100-sxm", "h200-sxm"])
    gpus = json.loads(invoke("gpu", "list", "--json"))
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(name=gpus[0]["name"], power_limit_w=450.0))
    for extra, left in (
        (("--dry-run",), "it would be left as it is"),
        ((), "it was left as it is"),
    ):
        told = " ".join(invoke("cap", "apply", str(caps), *extra).split())
        assert (
            f"note: {caps} has no entry for GPU 1 ({gpus[1]['name']}, {gpus[1]['uuid']}): {left}"
        ) in told, told
        assert "no entry for GPU 0" not in told
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000
    nvml.fake_reset_state(["h100-sxm", "h100-sxm"])
    gpus = json.loads(invoke("gpu", "list", "--json"))
    write_caps(caps, GpuCap(uuid=gpus[0]["uuid"], power_limit_w=450.0))
    assert f"no entry for GPU 1 ({gpus[1]['name']}" in " ".join(
        invoke("cap", "apply", str(caps)).split()
    )
    write_caps(caps, GpuCap(name=gpus[0]["name"], power_limit_w=450.0))
    assert "no entry" not in invoke("cap", "apply", str(caps))  # every GPU here has its caps
    # One with MIG enabled no plan can cap (dvfs refuses MIG GPUs): told so, not to plan it.
    nvml.fake_reset_state(["h100-sxm", "h200-sxm"])
    nvml.fake_update_device(1, mig=True)
    gpus = json.loads(invoke("gpu", "list", "--json"))
    told = " ".join(invoke("cap", "apply", str(caps)).split())
    assert f"GPU 1 ({gpus[1]['uuid']}) has MIG enabled and was left alone" in told, told
    assert "no entry" not in told and "dvfs cap plan" not in told, told


def twin_doc() -> dict:
    """`dvfs headroom --json` of a cube swept on the twin (its UUIDs are made up)."""
    d = doc([row("code", 1305, 450.0)], uuids=["GPU-7717a9f2-twin-0000-0000-000000000000"])
    d["gpu"] = {
        "name": "NVIDIA H100 80GB HBM3 (twin)",
        "uuids": d["gpu"]["uuids"],
        "backend": "twin",
    }
    return d


def test_caps_planned_from_the_twin_are_marked_simulated() -> None:
    caps = plan_caps(twin_doc(), batch=16, drafter="eagle3", corpus="code")
    [cap] = caps.caps
    assert cap.uuid is None and cap.name == "NVIDIA H100 80GB HBM3 (twin)"
    assert caps.simulated and caps.meta["simulated"] is True
    text = dump_caps(caps)
    assert "# SIMULATED" in text and "simulated = true" in text
    loaded = parse_caps(tomllib.loads(text), where="x")
    assert loaded.simulated and loaded.caps == caps.caps
    assert not plan_caps(
        doc([row("code", 1305, 450.0)]), batch=16, drafter="eagle3", corpus="code"
    ).simulated


def test_simulated_caps_are_refused_on_real_gpus_unless_allowed(nvml, tmp_path: Path) -> None:
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(twin_doc()))
    caps = tmp_path / "caps.toml"
    planned = CliRunner().invoke(
        cli,
        ["cap", "plan", str(headroom), "--batch", "16", "--drafter", "eagle3", "-o", str(caps)],
    )
    assert planned.exit_code == 0, planned.output
    assert "simulated" in planned.output and "NVIDIA H100 80GB HBM3 (twin)" in planned.output
    assert "GPU-7717a9f2" not in caps.read_text()  # the twin's made-up UUID is not a target
    refused = invoke("cap", "apply", str(caps), code=2)
    assert "simulated caps" in refused and "--allow-simulated" in refused
    assert nvml.fake_calls() == []
    invoke("cap", "apply", str(caps), "--allow-simulated")
    for index in (0, 1):  # both H100s, matched by model name
        device = nvml.fake_device_state(index)
        assert device["locked_clocks"] == [210, 1305] and device["power_limit_mw"] == 450_000


#: What `dvfs cap plan HEADROOM --batch 16 --drafter eagle3 --model "NVIDIA H100 80GB HBM3"` of a
#: twin cube's headroom wrote before caps were marked simulated (dvfs at 9a2fd4c): the twin's
#: model only in `measured_on`, the entry naming the real model.
OLDER_TWIN_CAPS = """\
# GPU caps written by `dvfs cap plan`; apply with `dvfs cap apply FILE`
# (or at boot through systemd/dvfs-caps.service).
dvfs_caps = 1

[meta]
created = "2026-12-02T23:02:01+00:00"
campaign = "demo"
measured_on = "NVIDIA H100 80GB HBM3 (twin)"
target = "TPOT p50 <= each drafter's own stock TPOT p50 + 5%"
batch = 16
drafter = "eagle3"
corpus = "worst-case"

[[model]]
name = "NVIDIA H100 80GB HBM3"
sm_clock_max_mhz = 1380
"""


def test_twin_caps_an_older_dvfs_wrote_are_refused_on_real_gpus_unless_allowed(
    nvml, tmp_path: Path
) -> None:
    """A caps file an older dvfs planned from a twin cube, with `--model` naming the real
    model, says so only in `[meta] measured_on`: `cap apply` capped the real GPUs with it,
    exit 0, where simulated caps are refused without --allow-simulated (as `dvfs govern`
    refuses a plan measured on a twin)."""
    caps = tmp_path / "caps.toml"
    caps.write_text(OLDER_TWIN_CAPS)
    assert load_caps(caps).simulated
    refused = " ".join(invoke("cap", "apply", str(caps), code=2).split())
    assert "simulated caps" in refused and "--allow-simulated" in refused, refused
    assert nvml.fake_calls() == []
    invoke("cap", "apply", str(caps), "--allow-simulated")
    assert [nvml.fake_device_state(i)["locked_clocks"] for i in (0, 1)] == [[210, 1380]] * 2
    merged = OLDER_TWIN_CAPS.replace(
        '"NVIDIA H100 80GB HBM3 (twin)"', '"NVIDIA H200 (twin), NVIDIA H100 80GB HBM3 (twin)"'
    )
    assert parse_caps(tomllib.loads(merged), where="x").simulated
    by_uuid = OLDER_TWIN_CAPS.replace(  # `--gpu UUID`: a real GPU's UUID, as typed
        '[[model]]\nname = "NVIDIA H100 80GB HBM3"', '[[gpu]]\nuuid = "GPU-0123abcd"'
    )
    assert parse_caps(tomllib.loads(by_uuid), where="x").simulated
    real = OLDER_TWIN_CAPS.replace(" (twin)", "")
    assert not parse_caps(tomllib.loads(real), where="x").simulated


def test_the_check_cap_plan_suggests_runs_on_simulated_caps(nvml, tmp_path: Path) -> None:
    """`cap plan -o FILE` ends by suggesting the dry run that checks FILE; for caps planned
    from the twin it left out --allow-simulated, so the command it gave was refused (exit 2),
    where the per-batch plan's suggestion carries it."""
    import re
    import shlex

    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(twin_doc()))
    caps = tmp_path / "caps.toml"
    args = ("cap", "plan", str(headroom), "--batch", "16", "--drafter", "eagle3", "-o", str(caps))
    told = invoke(*args)
    [suggested] = re.findall(r"^  dvfs (cap apply .*)$", told, re.M)
    ran = invoke(*shlex.split(suggested))  # exit 0: the check it suggests runs
    assert "dry run, nothing changed: would apply to GPU 0" in ran
    assert nvml.fake_calls() == []


@pytest.mark.parametrize("how", [("--batch", "16", "--drafter", "eagle3"), ("--per-batch",)])
def test_a_cap_plan_that_cannot_write_its_file_prints_only_the_error(
    tmp_path: Path, how: tuple[str, ...]
) -> None:
    """`cap plan -o FILE` printed its notes (simulated caps, the plan's batches) before the
    write failed, as if the file had been made: the file is written first, its failure the
    one line printed."""
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(twin_doc()))
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "caps.toml"
    told = invoke("cap", "plan", str(headroom), *how, "-o", str(out), code=1)
    assert told.startswith("Error: cannot use"), told
    assert len(told.splitlines()) == 1, told


def test_the_check_cap_plan_suggests_says_it_runs_where_the_gpus_are(tmp_path: Path) -> None:
    """`cap plan -o FILE` of a twin cube's headroom, on a machine without a GPU driver, said
    "check it with: dvfs cap apply FILE --dry-run", which there fails on the missing driver:
    the dry run matches the file to the GPUs it caps through their driver, so the line says to
    run it on their host."""
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(twin_doc()))
    caps = tmp_path / "caps.toml"
    args = ("cap", "plan", str(headroom), "--batch", "16", "--drafter", "eagle3", "-o", str(caps))
    told = " ".join(invoke(*args).split())
    assert "check it on the host of the GPUs it caps" in told, told


def test_the_check_cap_plan_suggests_can_be_pasted(nvml, tmp_path: Path) -> None:
    """`cap plan -o FILE` suggested `dvfs cap apply FILE --dry-run` inside a sentence the
    console wrapped, FILE unquoted: in a folder with spaces in its name, the command printed
    was split over lines and its path into several arguments. It is one line, however long,
    its path quoted, as `cap plan --per-batch`'s suggestion is."""
    import shlex

    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(doc([row("code", 1005, 300.0)])))
    folder = tmp_path / ("a folder with a long name " * 3).strip()
    folder.mkdir()
    caps = folder / "caps.toml"
    args = ("cap", "plan", str(headroom), "--batch", "16", "--drafter", "eagle3", "-o", str(caps))
    told = invoke(*args)
    [line] = [x for x in told.splitlines() if "dvfs cap apply" in x]
    assert shlex.split(line) == ["dvfs", "cap", "apply", str(caps), "--dry-run"], told


def test_the_check_cap_plan_suggests_takes_a_file_named_like_an_option(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cap plan -o -caps.toml` suggested `dvfs cap apply -caps.toml --dry-run`, which reads
    the file's name as an option ("No such option '-c'"); the path is given as ./-caps.toml."""
    import shlex

    monkeypatch.chdir(tmp_path)
    headroom = tmp_path / "headroom.json"
    uuid = nvml.fake_device_state(0)["uuid"]
    headroom.write_text(json.dumps(doc([row("code", 1005, 300.0)], uuids=[uuid])))
    args = ("cap", "plan", str(headroom), "--batch", "16", "--drafter", "eagle3", "-o")
    told = invoke(*args, "-caps.toml")
    [line] = [x for x in told.splitlines() if "dvfs cap apply" in x]
    ran = invoke(*shlex.split(line)[1:])  # exit 0: the check it suggests runs
    assert "dry run, nothing changed" in ran, ran


def test_an_interrupted_apply_still_records_the_locks_it_set(nvml, tmp_path: Path) -> None:
    from dvfs.caps import AppliedCaps, CapAction, apply_actions
    from dvfs.gpu.nvml import open_nvml_gpus

    record = AppliedCaps(tmp_path / "state")
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):

        def interrupted(limit_mw: int) -> None:
            raise KeyboardInterrupt

        gpu.set_power_limit_mw = interrupted  # type: ignore[method-assign]
        action = CapAction(0, gpu.identity.uuid, (210, 1410), 400_000, 700_000)
        with pytest.raises(KeyboardInterrupt):
            apply_actions([action], [gpu], record, "caps.toml")
    assert record.locks() == {gpu.identity.uuid: (210, 1410)}


@pytest.mark.parametrize("fails_at", [1, 2])
def test_a_cap_that_cannot_be_recorded_is_taken_back(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails_at: int
) -> None:
    """A full disk under the state folder: a lock or limit put on the GPU could not be
    recorded, and NVML cannot read a lock back, so `cap apply` failing must not leave it on
    the GPU unrecorded (unknown to `cap show`, a sweep and `cap reset`)."""
    import errno

    from dvfs.caps import AppliedCaps, CapAction, apply_actions
    from dvfs.errors import CapsRecordError
    from dvfs.gpu.nvml import open_nvml_gpus

    record = AppliedCaps(tmp_path / "state")
    real_write, writes = record.write, []

    def full_at_last(records: dict) -> None:
        writes.append(records)
        if len(writes) == fails_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(record.path))
        real_write(records)

    monkeypatch.setattr(record, "write", full_at_last)
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        stock_mw = gpu.power_limit_mw()
        action = CapAction(0, gpu.identity.uuid, (210, 1410), 400_000, 700_000)
        with pytest.raises(CapsRecordError) as raised:
            apply_actions([action], [gpu], record, "caps.toml")
        assert gpu.power_limit_mw() == stock_mw  # the limit's record failed, or it never came
    # what was taken back, and the way on: not "choose another path", a --state-dir where
    # `cap show`, sweeps and `cap reset` would not find the caps
    what = "SM clock lock 210-1410 MHz" if fails_at == 1 else "power limit 400 W"
    assert str(raised.value) == (
        f"cannot write {record.path}: no space left on device, so GPU 0's {what} was taken "
        "back off it; free space there, then apply the caps again"
    )
    held = nvml.fake_state()["devices"][0]["locked_clocks"]
    recorded = AppliedCaps(tmp_path / "state").locks()
    if fails_at == 1:  # the lock's record failed: the lock is taken back
        assert (held, recorded) == (None, {})
    else:  # the limit's record failed: the lock stays, recorded
        assert (held, recorded) == ([210, 1410], {gpu.identity.uuid: (210, 1410)})


@pytest.mark.parametrize(
    ("code", "remedy"),
    [
        ("ENOSPC", "free space there"),
        ("EDQUOT", "free space there or raise the disk quota"),
        ("EACCES", "let this user write that folder (check its owner and permissions)"),
        ("EROFS", "its file system is mounted read-only: make it writable"),
        ("EIO", "the disk or network file system under it failed (see dmesg): check it"),
        ("ENOTDIR", "part of its path is a file, not a folder: move that file aside"),
    ],
)
@pytest.mark.parametrize("undone", ["taken back", "unchanged limit", "not taken back"])
def test_an_unwritable_record_is_told_its_own_remedy(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, remedy: str, undone: str
) -> None:
    """The caps record not written said "free space there" whatever the error: a folder this
    user may not write (the caps unit's root keeps no CAP_DAC_OVERRIDE), a read-only file
    system or a disk quota each get their own way on, the change taken back or not; a failing
    disk (EIO) and a file in the place of a folder of its path (ENOTDIR), told "make it
    writable", which mends neither, too."""
    import errno

    from dvfs.caps import AppliedCaps, CapAction, apply_actions
    from dvfs.errors import CapsRecordError
    from dvfs.gpu.nvml import open_nvml_gpus

    number = getattr(errno, code)
    record = AppliedCaps(tmp_path / "state")

    def unwritable(records: dict) -> None:
        raise OSError(number, os.strerror(number), str(record.path))

    monkeypatch.setattr(record, "write", unwritable)
    with open_nvml_gpus([0], nvml=nvml) as (gpu,):
        if undone == "not taken back":
            gpu.reset_sm_clock = lambda: nvml_failure()  # type: ignore[method-assign]
        if undone == "unchanged limit":
            action = CapAction(0, gpu.identity.uuid, None, 700_000, 700_000)
        else:
            action = CapAction(0, gpu.identity.uuid, (210, 1410), None, 700_000)
        with pytest.raises(CapsRecordError) as raised:
            apply_actions([action], [gpu], record, "caps.toml")
    message = str(raised.value)
    assert f"cannot write {record.path}: {os.strerror(number).lower()}" in message, message
    then = "then run `dvfs cap reset" if undone == "not taken back" else "then apply the caps"
    assert f"; {remedy}, {then}" in message, message
    assert ("free space" in message) == (code in ("ENOSPC", "EDQUOT")), message


def nvml_failure() -> None:
    from dvfs.errors import GpuError

    raise GpuError("GPU 0: cannot reset the SM clock (NVML: Unknown Error)")


def test_an_unchanged_limit_whose_record_fails_says_the_way_on_alone_too(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caps file setting the power limit a GPU holds already (nothing to take back), the
    record unwritable (a full disk), and no earlier GPU failing: `cap apply` said 'free space
    or choose another --state-dir', a state folder where `cap show`, sweeps and `cap reset` do
    not look, as it said beside an earlier GPU's failure and for a change taken back: free
    space there, then apply the caps again."""
    import errno

    from dvfs.caps import AppliedCaps

    def full(self: AppliedCaps, records: dict) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    monkeypatch.setattr(AppliedCaps, "write", full)
    held = nvml.fake_device_state(0)
    caps = tmp_path / "caps.toml"
    limit_w = held["power_limit_mw"] / 1000
    write_caps(caps, GpuCap(uuid=held["uuid"], power_limit_w=limit_w))
    state = tmp_path / "state"
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps), "--state-dir", str(state)])
    assert result.exit_code == 1, result.output
    [error] = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert error == (
        f"Error: cannot write {state / 'caps-applied.json'}: no space left on device; free "
        "space there, then apply the caps again"
    ), result.stderr
    assert nvml.fake_device_state(0)["power_limit_mw"] == held["power_limit_mw"]


def test_a_cap_neither_recorded_nor_taken_back_is_said_and_stops_the_apply(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk under the state folder, and the take-back of the lock failing too: the GPU
    keeps a lock no record lists. That was gathered as a plain GPU failure ('cannot reset
    locked SM clocks', the record's failure unsaid), and the next GPU's full disk then hid it
    altogether: it is said, with the command that clears it, and no other GPU is changed."""
    import errno

    from dvfs.caps import AppliedCaps, CapAction, apply_actions
    from dvfs.errors import CapsRecordError
    from dvfs.gpu.nvml import open_nvml_gpus

    record = AppliedCaps(tmp_path / "state")

    def full(records: dict) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(record.path))

    monkeypatch.setattr(record, "write", full)
    nvml.fake_update_device(0, errors={"nvmlDeviceResetGpuLockedClocks": 999})
    with open_nvml_gpus([0, 1], nvml=nvml) as gpus:
        actions = [
            CapAction(g.identity.index, g.identity.uuid, (210, 1410), None, 700_000) for g in gpus
        ]
        with pytest.raises(CapsRecordError) as raised:
            apply_actions(actions, gpus, record, "caps.toml")
        uuid = gpus[0].identity.uuid
    message = str(raised.value)
    assert "\n" not in message
    assert f"cannot write {record.path}: no space left on device" in message
    assert "GPU 0's SM clock lock 210-1410 MHz could not be taken back" in message
    assert f"`dvfs cap reset {uuid} --state-dir {tmp_path / 'state'}`" in message
    held = [d["locked_clocks"] for d in nvml.fake_state()["devices"][:2]]
    assert held == [[210, 1410], None]  # the next GPU was not changed


def _driver_caps(tmp_path: Path, nvml) -> Path:
    caps = tmp_path / "caps.toml"
    uuid = nvml.fake_device_state(0)["uuid"]
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0))
    return caps


NOT_LOADED = "cannot initialise NVML: the NVIDIA driver is installed but its kernel module is not"
WAITING = "the NVIDIA kernel module is not loaded yet (NVML says so): waiting up to"


def test_cap_apply_waits_for_the_driver_until_it_loads(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caps unit at boot, the driver not loaded yet: `--wait-for-driver` tries NVML again
    (the unit's Restart= could not: systemd before 244 refuses it on a oneshot unit), saying
    once that it waits, and applies the caps once the driver is there."""
    import dvfs.gpu.nvml

    caps = _driver_caps(tmp_path, nvml)
    monkeypatch.setenv("DVFS_FAKE_NVML_INIT_ERROR", str(nvml.NVML_ERROR_DRIVER_NOT_LOADED))
    slept: list[float] = []

    def driver_loads_at_the_second_try(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 2:  # the module is loaded now
            monkeypatch.delenv("DVFS_FAKE_NVML_INIT_ERROR")

    monkeypatch.setattr(dvfs.gpu.nvml, "_sleep", driver_loads_at_the_second_try)
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps), "--wait-for-driver", "300"])
    assert result.exit_code == 0, result.output
    assert slept == [dvfs.gpu.nvml.DRIVER_POLL_S] * 2
    [said] = [line for line in result.stderr.splitlines() if "waiting" in line]
    assert said.startswith(f"{WAITING} 300 s for it, trying again every "), said
    assert "applied caps to 1 GPU(s)" in result.output
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000


def test_cap_apply_takes_a_wait_for_the_driver_of_any_length(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--wait-for-driver` with more digits than a float holds (an "until it loads" written
    as 1 and 400 zeros) failed "internal error: OverflowError: int too large to convert to
    float; please report it"; it is waited as a wait for ever, the caps applied once the
    driver loads."""
    import dvfs.gpu.nvml

    caps = _driver_caps(tmp_path, nvml)
    monkeypatch.setenv("DVFS_FAKE_NVML_INIT_ERROR", str(nvml.NVML_ERROR_DRIVER_NOT_LOADED))
    slept: list[float] = []

    def driver_loads(seconds: float) -> None:
        slept.append(seconds)
        monkeypatch.delenv("DVFS_FAKE_NVML_INIT_ERROR")

    monkeypatch.setattr(dvfs.gpu.nvml, "_sleep", driver_loads)
    huge = "1" + "0" * 400
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps), "--wait-for-driver", huge])
    assert result.exit_code == 0, result.output
    assert slept == [dvfs.gpu.nvml.DRIVER_POLL_S]
    assert "applied caps to 1 GPU(s)" in result.output
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000


@pytest.mark.parametrize("wait", ["300", "1" + "0" * 400])
def test_a_dry_run_waits_for_no_driver_and_says_what_the_apply_would(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait: str
) -> None:
    """`cap apply --dry-run --wait-for-driver N` slept N s (5 s at a time) while the kernel
    module was not loaded, though a dry run changes nothing; it fails at once, saying what the
    apply would wait for. A wait of 1 and 400 zeros was said with all its digits: it is a wait
    with no time limit, said so, whether waited (the apply) or not (a dry run). The line lacked
    the "dry run, nothing changed:" its other refusals begin with; it has it."""
    import dvfs.gpu.nvml

    caps = _driver_caps(tmp_path, nvml)
    monkeypatch.setenv("DVFS_FAKE_NVML_INIT_ERROR", str(nvml.NVML_ERROR_DRIVER_NOT_LOADED))
    slept: list[float] = []

    def never(seconds: float) -> None:  # (raised out of the wait: the test ends at once)
        raise AssertionError(f"a dry run waited {seconds} s")

    monkeypatch.setattr(dvfs.gpu.nvml, "_sleep", never)
    args = ["cap", "apply", str(caps), "--wait-for-driver", wait]
    result = CliRunner().invoke(cli, [*args, "--dry-run"])
    assert result.exit_code == 1, result.output
    assert WAITING not in result.stderr
    [line] = result.stderr.splitlines()
    span = "up to 300 s" if wait == "300" else "with no time limit"
    assert line.startswith(
        f"Error: dry run, nothing changed: {NOT_LOADED} loaded (a dry run does not wait; the "
        f"apply would wait {span} for it): load it"
    ), line
    if wait != "300":  # the apply waits, and says so in a line of words, not 401 digits

        def driver_loads(seconds: float) -> None:
            slept.append(seconds)
            monkeypatch.delenv("DVFS_FAKE_NVML_INIT_ERROR")

        monkeypatch.setattr(dvfs.gpu.nvml, "_sleep", driver_loads)
        applied = CliRunner().invoke(cli, args)
        assert applied.exit_code == 0, applied.output
        [said] = [x for x in applied.stderr.splitlines() if x.startswith(WAITING.split(":")[0])]
        assert said.startswith(f"{WAITING.removesuffix(' up to')} {span} for it, trying"), said
    assert nvml.fake_device_state(0)["power_limit_mw"] == (700_000 if wait == "300" else 450_000)


def test_a_dry_run_without_the_driver_says_it_changed_nothing(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cap apply --dry-run` (no --wait-for-driver), the kernel module not loaded: its line
    lacked the "dry run, nothing changed:" that its other refusals, and its line with
    --wait-for-driver, begin with; it has it, and the apply's own line does not."""
    caps = _driver_caps(tmp_path, nvml)
    monkeypatch.setenv("DVFS_FAKE_NVML_INIT_ERROR", str(nvml.NVML_ERROR_DRIVER_NOT_LOADED))
    dry = CliRunner().invoke(cli, ["cap", "apply", str(caps), "--dry-run"])
    assert dry.exit_code == 1, dry.output
    [line] = dry.stderr.splitlines()
    assert line.startswith(f"Error: dry run, nothing changed: {NOT_LOADED} loaded: load it"), line
    applied = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert applied.exit_code == 1, applied.output
    assert "dry run" not in applied.stderr, applied.stderr


@pytest.mark.parametrize("wait", ["0", "1", "5", "6"])
def test_cap_apply_fails_as_before_without_the_driver(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait: str
) -> None:
    """No --wait-for-driver (0): no wait, today's line. A wait whose time is spent: the same
    line, once it said it waits, saying it waited (it said "not loaded: load it" as if it
    had not). The line saying it waits says how it tries again: `--wait-for-driver 1` said
    "trying again every 5 s", though it tries once more, after 1 s."""
    import dvfs.gpu.nvml

    caps = _driver_caps(tmp_path, nvml)
    monkeypatch.setenv("DVFS_FAKE_NVML_INIT_ERROR", str(nvml.NVML_ERROR_DRIVER_NOT_LOADED))
    slept: list[float] = []
    # The wait's clock moves only as it sleeps: on the machine's, a first NVML try slower
    # than the 1 s wait (a loaded host) spent it before any wait was said.
    now = [0.0]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(dvfs.gpu.nvml, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(dvfs.gpu.nvml, "_sleep", sleep)
    extra = [] if wait == "0" else ["--wait-for-driver", wait]
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps), *extra])
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    waited = "" if wait == "0" else f" after waiting {wait} s"
    assert lines[-1].startswith(f"Error: {NOT_LOADED} loaded{waited}: load it"), lines
    assert "Traceback" not in result.stderr and len(lines) == (1 if wait == "0" else 2), lines
    waits = [line for line in lines if line.startswith(WAITING)]
    assert len(waits) == (0 if wait == "0" else 1), lines
    assert (slept == []) == (wait == "0"), slept
    if wait != "0":
        again = "every 5 s" if wait == "6" else f"once, in {wait} s"
        assert waits[0] == f"{WAITING} {wait} s for it, trying again {again}", waits
        assert slept == ([5.0, 1.0] if wait == "6" else [float(wait)]), slept
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


@pytest.mark.parametrize("refusal", ["no permission", "no GPU it names", "no driver"])
def test_cap_apply_waits_for_nothing_but_the_driver(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """A refusal waiting does not fix is said at once, --wait-for-driver or not."""
    import dvfs.gpu.nvml

    caps = _driver_caps(tmp_path, nvml)
    code = {"no permission": 4, "no GPU it names": 2, "no driver": 1}[refusal]
    if refusal == "no permission":
        monkeypatch.setenv("DVFS_FAKE_NVML_INIT_ERROR", str(nvml.NVML_ERROR_NO_PERMISSION))
    elif refusal == "no driver":
        monkeypatch.setenv("DVFS_FAKE_NVML_MISSING", "1")
    else:
        write_caps(caps, GpuCap(uuid="GPU-elsewhere", power_limit_w=450.0))

    def never(seconds: float) -> None:
        raise AssertionError(f"waited {seconds} s on {refusal}")

    monkeypatch.setattr(dvfs.gpu.nvml, "_sleep", never)
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps), "--wait-for-driver", "300"])
    assert result.exit_code == code, result.output
    assert WAITING not in result.stderr
    assert result.stderr.splitlines()[-1].startswith("Error: "), result.stderr


@pytest.mark.parametrize("second", ["lock", "unchanged limit"])
def test_a_later_gpus_full_disk_says_the_earlier_gpus_failures_too(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second: str
) -> None:
    """GPU 0's power limit failed (its lock kept, and recorded), then the disk filled up
    under GPU 1's record write: the user saw only "no space left", GPU 0's failure (and the
    lock it keeps) unsaid. Every failure is said in one line, GPU 0's first."""
    import errno

    from dvfs.caps import AppliedCaps, CapAction, apply_actions
    from dvfs.errors import CapsRecordError
    from dvfs.gpu.nvml import open_nvml_gpus

    record = AppliedCaps(tmp_path / "state")
    real_write, writes = record.write, []

    def full_after_the_first(records: dict) -> None:
        writes.append(records)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(record.path))
        real_write(records)

    monkeypatch.setattr(record, "write", full_after_the_first)
    nvml.fake_update_device(0, errors={"nvmlDeviceSetPowerManagementLimit": 999})
    with open_nvml_gpus([0, 1], nvml=nvml) as (first, other):
        stock_mw = other.power_limit_mw()
        actions = [CapAction(0, first.identity.uuid, (210, 1410), 400_000, stock_mw)]
        if second == "lock":  # its record fails: the lock is taken back off it
            actions.append(CapAction(1, other.identity.uuid, (210, 1410), 400_000, stock_mw))
        else:  # a limit it holds already: nothing to take back, the record's write fails
            actions.append(CapAction(1, other.identity.uuid, None, stock_mw, stock_mw))
        with pytest.raises(CapsRecordError) as raised:
            apply_actions(actions, [first, other], record, "caps.toml")
    message = str(raised.value)
    assert "\n" not in message
    gpu0 = message.index("GPU 0: cannot set the power limit")
    assert "(GPU 0 was changed before that: SM clock locked to 210-1410 MHz)" in message
    disk = message.index(f"cannot write {record.path}: no space left on device")
    assert gpu0 < disk  # the earlier GPU's first, then the disk's
    assert message.endswith("; free space there, then apply the caps again"), message
    assert raised.value.exit_code == 1
    held = [d["locked_clocks"] for d in nvml.fake_state()["devices"][:2]]
    assert held == [[210, 1410], None]
    assert AppliedCaps(tmp_path / "state").locks() == {first.identity.uuid: (210, 1410)}


def _another_apply_between_plan_and_lock(monkeypatch: pytest.MonkeyPatch, caps: Path) -> None:
    """The next `cap apply` has `caps` applied by another `cap apply` between its plan and its
    taking the GPU's lock (a millisecond race, made certain)."""
    import dvfs.caps

    real = dvfs.caps.enforce_plan

    def the_other_apply_first(*args, **kwargs) -> None:
        monkeypatch.setattr(dvfs.caps, "enforce_plan", real)
        assert "applied to GPU 0" in invoke("cap", "apply", str(caps))
        real(*args, **kwargs)

    monkeypatch.setattr(dvfs.caps, "enforce_plan", the_other_apply_first)


def test_an_apply_planned_before_another_capped_the_gpu_holds_its_own_file(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `cap apply` a moment apart (the caps unit and an operator): the later one planned
    what its file leaves at stock from the caps record read before it held the GPU's lock, so
    the earlier one's clock lock, set meanwhile, stayed on the GPU beside the later file's
    power limit, the later apply saying its file applied (the GPU held neither file). What to
    put back to stock is read from the record once the GPU's lock is held: the GPU holds the
    later file, and the record says so."""

    uuid = nvml.fake_device_state(0)["uuid"]
    clock, limit = tmp_path / "clock.toml", tmp_path / "limit.toml"
    write_caps(clock, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    write_caps(limit, GpuCap(uuid=uuid, power_limit_w=500))
    _another_apply_between_plan_and_lock(monkeypatch, clock)
    said = invoke("cap", "apply", str(limit))
    device = nvml.fake_device_state(0)
    assert (device["locked_clocks"], device["power_limit_mw"]) == (None, 500_000), said
    assert "SM clock unlocked" in said, said
    from dvfs.caps import AppliedCaps

    [entry] = AppliedCaps(Path(os.environ["DVFS_STATE_DIR"])).read().values()
    assert (entry["lock_mhz"], entry["power_limit_mw"]) == (None, 500_000)


@pytest.mark.parametrize(("later_w", "said"), [(450, "(from 500 W)"), (700, "(from 500 W)")])
def test_an_apply_planned_before_another_capped_the_gpu_says_the_limit_it_changed(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, later_w: int, said: str
) -> None:
    """Two `cap apply` a moment apart: the later one read the GPU's power limit before it held
    the GPU's lock, so where the earlier one set 500 W meanwhile, the later one said "power
    limit 450 W (from 700 W)", or "700 W (unchanged)" as it put 700 W back: the limit it
    changed is read once the GPU's lock is held, as what to put back to stock is."""

    uuid = nvml.fake_device_state(0)["uuid"]
    earlier, later = tmp_path / "earlier.toml", tmp_path / "later.toml"
    write_caps(earlier, GpuCap(uuid=uuid, power_limit_w=500))
    write_caps(later, GpuCap(uuid=uuid, power_limit_w=later_w))
    _another_apply_between_plan_and_lock(monkeypatch, earlier)
    out = invoke("cap", "apply", str(later))
    assert f"power limit {later_w} W {said}" in out, out
    assert nvml.fake_device_state(0)["power_limit_mw"] == later_w * 1000


def _reset_with_the_record_unwritable(monkeypatch: pytest.MonkeyPatch) -> Result:
    """`dvfs cap reset` with every write of the caps record denied (EACCES), exit 1, no
    traceback."""
    import errno

    from dvfs.caps import AppliedCaps

    def unwritable(self, records: dict) -> None:
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(self.path))

    monkeypatch.setattr(AppliedCaps, "write", unwritable)
    result = CliRunner().invoke(cli, ["cap", "reset"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    return result


def test_a_reset_whose_record_cannot_be_written_says_what_it_reset(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cap reset` (the caps unit's stop) with the caps record unwritable (a folder root
    without CAP_DAC_OVERRIDE may not write, a full disk): GPU 0 was reset, its caps still
    recorded, and the reset failed "cannot use RECORD: permission denied; check permissions or
    choose another path", naming no GPU (GPU 0 reset, GPU 1 not: `cap show` said both capped).
    It says what it reset and that the record still lists it. The GPUs are reset side by side
    (one whose driver hangs must not hold the others' resets), so both are reset, and both
    named: the record lists caps the GPUs no longer hold, never fewer than they hold."""

    uuids = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    caps = tmp_path / "caps.toml"
    entries = tuple(GpuCap(uuid=u, sm_clock_max_mhz=1500) for u in uuids)
    caps.write_text(dump_caps(CapsFile(entries)))
    invoke("cap", "apply", str(caps))
    result = _reset_with_the_record_unwritable(monkeypatch)
    [line] = result.stderr.splitlines()
    record = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"
    assert line.startswith(
        f"Error: GPU 0 ({uuids[0]}) was reset (clocks unlocked, power limit 700 W (default)), "
        f"GPU 1 ({uuids[1]}) was reset (clocks unlocked, power limit 700 W (default)), "
        f"but {record} cannot be written (permission denied), so it still lists those GPUs' "
        "caps: let this user write that folder"
    ), line
    held = [nvml.fake_device_state(i)["locked_clocks"] for i in (0, 1)]
    assert held == [None, None]
    assert set(json.loads(record.read_text())) == set(uuids)


def test_a_reset_whose_record_cannot_be_written_goes_past_a_gpu_it_never_listed(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cap reset` with the caps record unwritable stops at the first GPU whose entry it cannot
    drop; it stopped at GPU 0, which the record never listed (the file capped GPU 1 only),
    saying the record "still lists that GPU's caps" and leaving GPU 1, the capped one, capped.
    A GPU the record does not list needs no write: the reset goes on to GPU 1."""

    uuids = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuids[1], sm_clock_max_mhz=1500))
    invoke("cap", "apply", str(caps))
    result = _reset_with_the_record_unwritable(monkeypatch)
    assert f"GPU 0 ({uuids[0]}): clocks unlocked" in result.stdout, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith(f"Error: GPU 1 ({uuids[1]}) was reset (clocks unlocked"), line
    assert [nvml.fake_device_state(i)["locked_clocks"] for i in (0, 1)] == [None, None]


def test_a_reset_refuses_a_record_lock_linked_into_a_missing_folder_before_any_reset(
    nvml, tmp_path: Path
) -> None:
    """The caps record's lock linked into a missing folder (which `cap apply` refuses before
    any change): `cap reset` reset GPU 0, then said the lock "cannot be written (no such file
    or directory), so it still lists that GPU's caps ... make it writable", which the lock
    never did and no write mends, GPU 1 left capped. It is refused before any reset, saying
    what to remove."""
    uuids = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    caps = tmp_path / "caps.toml"
    entries = tuple(GpuCap(uuid=u, sm_clock_max_mhz=1500) for u in uuids)
    caps.write_text(dump_caps(CapsFile(entries)))
    invoke("cap", "apply", str(caps))
    lock = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json.lock"
    lock.unlink()
    lock.symlink_to(tmp_path / "gone" / "caps.lock")
    result = CliRunner().invoke(cli, ["cap", "reset"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    [line] = result.stderr.splitlines()
    assert line == (
        f"Error: cannot open {lock}: it links into a folder that is not there; nothing was "
        "reset: remove the link, then reset again"
    ), line
    held = [nvml.fake_device_state(i)["locked_clocks"] for i in (0, 1)]
    assert held == [[210, 1500], [210, 1500]]
    lock.unlink()
    assert "GPU 1" in invoke("cap", "reset")
    assert [nvml.fake_device_state(i)["locked_clocks"] for i in (0, 1)] == [None, None]


@pytest.mark.parametrize("command", ["apply", "dry-run", "reset"])
def test_a_record_lock_linked_to_a_folders_name_that_is_none_is_named_as_the_gpu_locks_is(
    nvml, tmp_path: Path, command: str
) -> None:
    """The caps record's lock a link to a folder's name that is none ("x.lock/"), refused so
    for a GPU's lock (`broken_lock_link`): its dry run said "would apply", and the apply and
    reset "is unreadable (no regular file: a folder)" of a link to no folder. Each names the
    link, with what to do, exit 1, the GPU unchanged."""
    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    if command == "reset":
        invoke("cap", "apply", str(caps))
    before = nvml.fake_device_state(0)["locked_clocks"]
    lock = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.unlink(missing_ok=True)
    lock.symlink_to("x.lock/")
    args = {"apply": ["apply", str(caps)], "dry-run": ["apply", str(caps), "--dry-run"]}
    result = CliRunner().invoke(cli, ["cap", *args.get(command, ["reset"])])
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    said = f"caps record lock {lock} is a symbolic link to x.lock/, a folder's name that is no"
    assert said in line and "remove the link" in line and "Traceback" not in line, line
    assert nvml.fake_device_state(0)["locked_clocks"] == before


def test_the_record_on_disk_keeps_up_with_each_change(nvml, tmp_path: Path) -> None:
    """A SIGKILL between two GPUs (no `finally` runs) must not leave GPUs locked that the
    record, and so `cap show`, a sweep and `dvfs monitor`, does not know about: what is on disk
    when the second GPU's power limit is being set already holds every change before it."""
    from dvfs.caps import AppliedCaps, CapAction, apply_actions
    from dvfs.gpu.nvml import open_nvml_gpus

    record = AppliedCaps(tmp_path / "state")
    seen: list[dict] = []
    with open_nvml_gpus([0, 1], nvml=nvml) as (first, second):

        def killed(limit_mw: int) -> None:
            seen.append(AppliedCaps(tmp_path / "state").read())  # what a SIGKILL now leaves
            raise KeyboardInterrupt

        second.set_power_limit_mw = killed  # type: ignore[method-assign]
        actions = [
            CapAction(g.identity.index, g.identity.uuid, (210, 1410), 400_000, 700_000)
            for g in (first, second)
        ]
        with pytest.raises(KeyboardInterrupt):
            apply_actions(actions, [first, second], record, "caps.toml")
    [on_disk] = seen
    assert on_disk[first.identity.uuid]["lock_mhz"] == [210, 1410]
    assert on_disk[first.identity.uuid]["power_limit_mw"] == 400_000
    assert on_disk[second.identity.uuid]["lock_mhz"] == [210, 1410]


def test_a_knob_the_new_file_leaves_at_stock_goes_back_to_stock(nvml, tmp_path: Path) -> None:
    """Applying a new caps file must leave the GPU holding what the file says: a clock lock or
    power limit an earlier `cap apply` set, which this file leaves at stock, is undone, never
    left on the GPU while the record (and `cap show`) forgets it."""
    uuid = apply_caps(tmp_path, 1410, 500.0)
    power_only = tmp_path / "power.toml"
    write_caps(power_only, GpuCap(uuid=uuid, power_limit_w=450.0))
    dry = invoke("cap", "apply", str(power_only), "--dry-run")
    assert "SM clock unlocked" in dry and nvml.fake_device_state(0)["locked_clocks"] == [210, 1410]
    invoke("cap", "apply", str(power_only))
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] is None and device["power_limit_mw"] == 450_000
    assert json.loads(invoke("cap", "show", "--json"))[0]["sm_clock_lock_mhz"] is None
    clock_only = tmp_path / "clock.toml"
    write_caps(clock_only, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    assert "power limit 700 W (as before" in invoke("cap", "apply", str(clock_only))
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] == [210, 1500] and device["power_limit_mw"] == 700_000
    [shown, _] = json.loads(invoke("cap", "show", "--json"))
    assert shown["sm_clock_lock_mhz"] == [210, 1500] and shown["caps_source"] == str(clock_only)
    before = len(nvml.fake_calls())
    invoke("cap", "apply", str(clock_only))  # again: the same state, nothing to undo
    assert [c["fn"] for c in nvml.fake_calls()[before:]] == ["nvmlDeviceSetGpuLockedClocks"]
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]


def test_cap_reset_after_a_crashed_governor_leaves_nothing_to_put_back(
    nvml, tmp_path: Path
) -> None:
    """A governor SIGKILLed under static caps leaves a state file holding those caps (what it
    found) and its lock record. `cap reset` puts the GPU at driver defaults, as asked: it must
    not leave that state file behind, for a later `dvfs gpu reset` (the governor unit's
    ExecStopPost, or the fix `cap apply` and sweeps ask for) would put the caps back on the GPU
    with no record of them, where `cap show` and `dvfs monitor` say it holds no lock."""
    from dvfs.caps import GovernorLocks
    from dvfs.gpu.knobs import GpuSettings

    uuid = apply_caps(tmp_path, 1410, 500.0)
    state = Path(os.environ["DVFS_STATE_DIR"])
    # What a governor killed after its first change leaves (dvfs.govern.loop.guarded).
    StateStore(state, command="govern").record(GpuSettings(uuid, (210, 1410), 500_000))
    GovernorLocks(state).write(uuid, (210, 1200))
    nvml.fake_update_device(0, locked_clocks=[210, 1200])
    out = " ".join(invoke("cap", "reset").split())
    assert "clocks unlocked, power limit 700 W (default)" in out, out
    assert "'govern'" in out, out  # says what it dropped
    invoke("gpu", "reset")
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] is None and device["power_limit_mw"] == 700_000
    [shown, _] = json.loads(invoke("cap", "show", "--json"))
    assert shown["sm_clock_lock_mhz"] is None and shown["enforced_power_limit_w"] == 700
    apply_caps(tmp_path, 1500, 600.0)  # not refused as holding an earlier run's changes
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]


def test_show_says_when_the_governor_holding_a_lock_is_gone(nvml, tmp_path: Path) -> None:
    """A governor killed with SIGKILL leaves its lock on the GPU and its record: `cap show`
    says the lock is the governor's, and must not let it pass for a running governor's (whose
    GPU `cap apply` and a sweep would refuse as busy, and which restores it itself) but say
    it is gone and what puts the GPU back. The GPU's dvfs lock tells whether it runs."""
    from dvfs.caps import GovernorLocks
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.nvml import open_nvml_gpus
    from dvfs.gpu.safety import GpuLocks, StateStore

    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    with open_nvml_gpus([0], nvml=nvml) as (gpu,), GpuLocks(state).hold([gpu]):
        # A running governor: it holds the GPU's lock, its state file and its record.
        StateStore(state, command="govern").record(GpuSettings(uuid, None, 700_000))
        GovernorLocks(state).write(uuid, (210, 1200))
        nvml.fake_update_device(0, locked_clocks=[210, 1200])
        running = " ".join(invoke("cap", "show").split())
        assert "locked 210-1200 MHz by dvfs govern (pid" in running, running
        assert "no longer running" not in running, running
    gone = " ".join(invoke("cap", "show").split())  # the lock let go: the governor died
    assert "locked 210-1200 MHz by dvfs govern (pid" in gone, gone
    assert "no longer running" in gone and "dvfs gpu reset" in gone, gone
    [row, _] = json.loads(invoke("cap", "show", "--json"))
    assert (
        row["sm_clock_lock_mhz"] == [210, 1200]
        and "no longer running" in row["sm_clock_lock_set_by"]
    )


def test_show_over_another_state_dir_names_the_reset_that_puts_a_gone_governor_back(
    nvml, tmp_path: Path
) -> None:
    """`cap show --state-dir DIR` of a GPU a killed governor (run with that --state-dir) left
    locked said "`dvfs gpu reset` puts back what it found": that looks in the default state
    folder, where there is nothing to restore. It names `dvfs gpu reset --state-dir DIR`."""
    from dvfs.caps import GovernorLocks
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.nvml import open_nvml_gpus
    from dvfs.gpu.safety import GpuLocks, StateStore

    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    state = tmp_path / "governor state"  # not DVFS_STATE_DIR
    with open_nvml_gpus([0], nvml=nvml) as (gpu,), GpuLocks(state).hold([gpu]):
        # The governor, running: then killed, its lock let go and its state file left.
        StateStore(state, command="govern").record(GpuSettings(uuid, None, 700_000))
        GovernorLocks(state).write(uuid, (210, 1200))
        nvml.fake_update_device(0, locked_clocks=[210, 1200])
    gone = " ".join(invoke("cap", "show", "--state-dir", str(state)).split())
    assert "no longer running" in gone, gone
    advice = gone.split("no longer running: `", 1)[1].split("`", 1)[0]
    followed = invoke(*shlex.split(advice)[1:])
    assert "restored GPU 0" in followed, followed
    assert nvml.fake_device_state(0)["locked_clocks"] is None


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_show_does_not_call_a_governor_running_for_a_gpu_lock_that_is_no_file(
    nvml, kind: str
) -> None:
    """A GPU lock file that is no regular file (a FIFO, a folder) is no lock a running dvfs
    holds, yet `cap show` read `holder`'s complaint about it as a running governor and gave
    the lock as a live governor's. It says what the lock file is now."""
    from dvfs.caps import GovernorLocks

    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    GovernorLocks(state).write(uuid, (210, 1200))
    nvml.fake_update_device(0, locked_clocks=[210, 1200])
    lock = state / f"{uuid}.lock"
    os.mkfifo(lock) if kind == "fifo" else lock.mkdir()
    [row, _] = json.loads(invoke("cap", "show", "--json"))
    said = row["sm_clock_lock_set_by"]
    assert said.startswith("dvfs govern (pid") and "no regular file" in said, said
    assert str(lock) in said, said


@pytest.mark.parametrize("lock", [[1500, 210], [0, 1500], [-210, 1500]])
def test_a_governor_record_with_no_lock_dvfs_sets_is_refused_in_one_line(
    nvml, lock: list[int]
) -> None:
    """A governor record edited by hand (or damaged) to a lock high first was shown by `cap
    show` as 'locked 1500-210 MHz by dvfs govern', a lock no GPU holds (NVML refuses one);
    it is refused in one line naming the file and the lock, exit 1, as a caps record's is."""
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    record = Path(os.environ["DVFS_STATE_DIR"]) / f"governed-{uuid}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"lock_mhz": lock, "pid": 1, "since": "x", "boot": None}))
    result = CliRunner().invoke(cli, ["cap", "show"])
    assert result.exit_code == 1, result.output
    assert result.stderr == (
        f"Error: {record} is not a dvfs governor record (lock_mhz is {json.dumps(lock)}, "
        "expected two clocks in MHz, low first); remove it\n"
    )
    assert "MHz by dvfs govern" not in result.stdout


#: `--listen off`: the default metrics port (127.0.0.1:9435) is a running governor's, or another
#: test's at the same time; taken, the governor failed on it before it read any record.
GOVERN = ["govern", "--plan", "{tmp}/plan.toml", "--url", "http://127.0.0.1:1", "--listen", "off"]


@pytest.mark.parametrize(
    ("record", "argv"),
    [
        *(
            (record, argv)
            for record in ("caps-applied.json", "governed-{uuid}.json")
            for argv in (["monitor", "--once", "--interval", "0.01"], ["cap", "show"])
        ),
        # The governor reads the caps record for the static caps (its own it writes).
        ("caps-applied.json", [*GOVERN, "--interval", "0.01", "--max-intervals", "1"]),
    ],
)
def test_a_damaged_record_is_a_failure_not_a_bad_option(
    nvml, tmp_path: Path, record: str, argv: list[str]
) -> None:
    """A damaged caps or governor record made `dvfs monitor`, `cap show` and `govern` exit 2,
    which the README gives bad usage and the monitor and governor units a bad option, not
    restarted (RestartPreventExitStatus=2), where a failure is restarted: a record is no
    option, and removing it mends it. It fails as an error does, exit 1, in one line naming
    the file."""
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    path = Path(os.environ["DVFS_STATE_DIR"]) / record.format(uuid=uuid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"lock_mhz": "x"')
    (tmp_path / "plan.toml").write_text(
        'dvfs_batch_plan = 1\n[meta]\nmeasured_on = "NVIDIA H100 80GB HBM3"\ndrafter = "none"\n'
        "[[batch]]\nbatch = 1\nsm_clock_mhz = 1200\n"
    )
    result = CliRunner().invoke(cli, [a.format(tmp=tmp_path) for a in argv])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
    [line] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert str(path) in line and "unreadable" in line, line


def test_the_units_say_a_damaged_caps_record_is_removed_not_rewritten_by_cap_apply(
    nvml, tmp_path: Path
) -> None:
    """The governor's and the monitor's units said their restarts on a damaged caps record
    would last "until a `dvfs cap apply` rewrites it": `cap apply` refuses the record as it
    is (exit 1, nothing changed, the record left), as its error says: remove it, then apply
    again. The units say that."""
    uuid = apply_caps(tmp_path, 1500, 600.0)
    record = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"
    record.write_text('{"GPU-')
    told = " ".join(invoke("cap", "apply", str(tmp_path / "caps.toml"), code=1).split())
    assert f"{record} is unreadable" in told and "remove it, reset the GPUs" in told, told
    assert record.read_text() == '{"GPU-'  # not rewritten
    record.unlink()  # what mends it, with the reset its error names
    invoke("cap", "reset")
    invoke("cap", "apply", str(tmp_path / "caps.toml"))
    assert json.loads(record.read_text())[uuid]["lock_mhz"] == [210, 1500]
    units = Path(__file__).resolve().parents[1] / "systemd"
    for unit in ("dvfs-govern.service", "dvfs-monitor.service"):
        comments = " ".join(
            " ".join(line.lstrip("# ") for line in (units / unit).read_text().splitlines()).split()
        )
        assert "cap apply` rewrites it" not in comments, unit
        assert "cap apply` or the governor rewrites it" not in comments, unit
        assert "damaged: named in the journal, to remove" in comments, unit


def test_a_damaged_caps_record_mended_as_told_leaves_no_cap_taken_for_the_stock(
    nvml, tmp_path: Path
) -> None:
    """A damaged caps record is refused, "remove it and re-apply": done so, the apply found
    its own cap in force, recorded it as the limit it replaced, and the caps unit's stop
    (`cap reset --applied`) then kept the cap on the GPU as "as before". The error names the
    reset that comes between; followed as written, the stop leaves the GPU at its stock."""
    uuid = apply_caps(tmp_path, 1500, 450.0)
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    record = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"
    record.write_text('{"GPU-')
    told = " ".join(invoke("cap", "apply", str(tmp_path / "caps.toml"), code=1).split())
    [command] = re.findall(r"reset the GPUs with `(dvfs [^`]*)`", told)
    record.unlink()
    invoke(*shlex.split(command)[1:])
    invoke("cap", "apply", str(tmp_path / "caps.toml"))
    assert json.loads(record.read_text())[uuid]["lock_mhz"] == [210, 1500]
    invoke("cap", "reset", "--applied")
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


def test_a_dry_run_is_refused_where_the_apply_would_be(nvml, tmp_path: Path) -> None:
    """A dry run exits as the apply would: a GPU another dvfs holds (a running governor) or
    one holding an earlier run's unrestored changes refuses the apply, exit 3, so the dry run
    must not say "would apply" and exit 0 for it."""
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.nvml import open_nvml_gpus
    from dvfs.gpu.safety import GpuLocks, StateStore

    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    state = Path(os.environ["DVFS_STATE_DIR"])
    with open_nvml_gpus([0], nvml=nvml) as (gpu,), GpuLocks(state).hold([gpu]):
        assert "in use by another dvfs process" in invoke("cap", "apply", str(caps), code=3)
        dry = " ".join(invoke("cap", "apply", str(caps), "--dry-run", code=3).split())
        assert "dry run, nothing changed" in dry and "in use by another dvfs process" in dry, dry
        assert "would apply" not in dry
    StateStore(state, command="govern").record(GpuSettings(uuid, None, 700_000))
    assert "not restored" in invoke("cap", "apply", str(caps), code=3)
    dry = " ".join(invoke("cap", "apply", str(caps), "--dry-run", code=3).split())
    assert "dry run, nothing changed" in dry and "not restored" in dry, dry
    assert nvml.fake_device_state(0)["locked_clocks"] is None


def test_apply_warns_when_the_driver_may_drop_the_caps(nvml, tmp_path: Path) -> None:
    """Without persistence mode the driver resets clock locks and power limits when it unloads
    (once no process holds the GPU): caps applied then, at boot by the oneshot unit included,
    may be gone as soon as dvfs exits, so the apply says so and how to fix it."""
    nvml.fake_update_device(1, persistence_mode=False)
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(name="NVIDIA H100 80GB HBM3", power_limit_w=450))
    for extra in ((), ("--dry-run",)):
        out = invoke("cap", "apply", str(caps), *extra)
        assert "persistence mode is off on GPU 1:" in out and "nvidia-smi -pm 1" in out, out
        assert "GPU 0:" not in out.split("persistence mode is off on")[1]
    nvml.fake_update_device(1, persistence_mode=True)
    assert "persistence mode" not in invoke("cap", "apply", str(caps))


def test_a_mig_gpu_on_the_host_does_not_stop_the_others_being_capped(nvml, tmp_path: Path) -> None:
    """One GPU partitioned with MIG must not fail the boot unit's apply (and its reset) for
    every GPU: a model entry leaves the MIG GPU alone with a note; an entry naming it by UUID
    is an invalid cap, refused before anything changes."""
    nvml.fake_update_device(1, mig=True)
    [first, second] = [g["uuid"] for g in json.loads(invoke("gpu", "list", "--json"))]
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        dump_caps(CapsFile((GpuCap(name="NVIDIA H100 80GB HBM3", power_limit_w=450),)))
    )
    out = " ".join(invoke("cap", "apply", str(fleet)).split())
    assert f"applied to GPU 0 ({first})" in out and "applied caps to 1 GPU(s)" in out, out
    assert f"GPU 1 ({second}) has MIG enabled and was left alone" in out, out
    # the command it gives turns MIG off on that GPU alone (without -i: on every GPU here)
    assert "(to cap it: `sudo nvidia-smi -i 1 -mig 0`)" in out, out
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000
    named = tmp_path / "named.toml"
    write_caps(named, GpuCap(uuid=second, power_limit_w=450))
    before = len(nvml.fake_calls())
    refused = " ".join(invoke("cap", "apply", str(named), code=2).split())
    assert "GPU 1: MIG is enabled, and dvfs caps whole GPUs only" in refused, refused
    assert "disable MIG (`sudo nvidia-smi -i 1 -mig 0`)" in refused, refused
    assert len(nvml.fake_calls()) == before
    out = " ".join(invoke("cap", "reset").split())
    assert f"GPU 0 ({first}): clocks unlocked" in out and "GPU 1 (" not in out.split("note")[0]
    assert "has MIG enabled and was left alone" in out, out
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


def test_caps_recorded_before_a_reboot_are_not_reported_after_it(nvml, tmp_path: Path) -> None:
    """A reboot resets every GPU's clock locks and power limits, but the record under the state
    directory stays: an entry from an earlier boot must not make `cap show` (and `dvfs
    monitor`, a governor's ceiling, a sweep's restore) report a lock the GPU no longer holds."""
    if not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("the kernel gives no boot id here")
    uuid = apply_caps(tmp_path, 1410, 500.0)
    path = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"
    record = json.loads(path.read_text())
    assert json.loads(invoke("cap", "show", "--json"))[0]["sm_clock_lock_mhz"] == [210, 1410]
    record[uuid]["boot"] = "an-earlier-boot"
    path.write_text(json.dumps(record))
    nvml.fake_reset_state()  # what the reboot did to the GPUs
    [shown, _] = json.loads(invoke("cap", "show", "--json"))
    assert shown["sm_clock_lock_mhz"] is None and shown["caps_source"] is None
    assert "1.41e+09" not in invoke("monitor", "--once", "--interval", "0.01")


def test_a_governors_lock_recorded_before_a_reboot_is_not_reported_after_it(
    nvml, tmp_path: Path
) -> None:
    """The governor's lock record outlives a power loss as the caps record does, and the
    reboot reset the GPU's lock as it reset the caps: `cap show` and `dvfs monitor` must not
    report the lock of a governor from an earlier boot either."""
    if not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("the kernel gives no boot id here")
    from dvfs.caps import GovernorLocks

    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    GovernorLocks(state).write(uuid, (210, 1200))
    nvml.fake_update_device(0, locked_clocks=[210, 1200])
    assert json.loads(invoke("cap", "show", "--json"))[0]["sm_clock_lock_mhz"] == [210, 1200]
    path = GovernorLocks(state).path(uuid)
    record = json.loads(path.read_text())
    record["boot"] = "an-earlier-boot"
    path.write_text(json.dumps(record))
    nvml.fake_reset_state()  # what the reboot did to the GPUs
    [shown, _] = json.loads(invoke("cap", "show", "--json"))
    assert shown["sm_clock_lock_mhz"] is None, shown
    assert "1.2e+09" not in invoke("monitor", "--once", "--interval", "0.01")


def _governed_before_a_reboot(tmp_path: Path) -> tuple[str, StateStore, str]:
    """Static caps applied (1410 MHz, 500 W) and a governor's state file, both marked as
    written in an earlier boot (a power loss while governing): (GPU 0's UUID, the state
    store, this boot's id as the file had it)."""
    from dvfs.gpu.knobs import GpuSettings

    uuid = apply_caps(tmp_path, 1410, 500.0)
    state = Path(os.environ["DVFS_STATE_DIR"])
    store = StateStore(state, command="govern")
    store.record(GpuSettings(uuid, (210, 1410), 500_000))
    left = json.loads(store.path(uuid).read_text())
    store.path(uuid).write_text(json.dumps({**left, "boot": "an-earlier-boot"}))
    caps_record = json.loads((state / "caps-applied.json").read_text())
    caps_record[uuid]["boot"] = "an-earlier-boot"
    (state / "caps-applied.json").write_text(json.dumps(caps_record))
    return uuid, store, str(left["boot"])


def test_gpu_reset_after_a_reboot_puts_back_nothing_the_reboot_reset(nvml, tmp_path: Path) -> None:
    """A power loss while a governor ran under static caps leaves its state file (what it
    found: the caps) and the caps record; the reboot reset the GPU, and the record's entry
    from that boot is ignored. `dvfs gpu reset` (the governor unit's ExecStopPost, at boot)
    must not put the earlier boot's caps back on the GPU, where no record says they are
    (`cap show`: no lock): it drops the file, saying why. In the same boot it restores."""
    if not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("the kernel gives no boot id here")
    from dvfs.gpu.knobs import GpuSettings

    uuid, store, this_boot = _governed_before_a_reboot(tmp_path)
    nvml.fake_reset_state()  # what the reboot did to the GPUs
    out = " ".join(invoke("gpu", "reset").split())
    assert "reboot" in out, out
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] is None and device["power_limit_mw"] == 700_000
    assert not store.pending()
    [shown, _] = json.loads(invoke("cap", "show", "--json"))
    assert shown["sm_clock_lock_mhz"] is None
    # In the boot that wrote it, the file is restored as ever.
    store.record(GpuSettings(uuid, (210, 1410), 500_000))
    assert json.loads(store.path(uuid).read_text())["boot"] == this_boot != "an-earlier-boot"
    invoke("gpu", "reset")
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] == [210, 1410] and device["power_limit_mw"] == 500_000


def test_gpu_reset_defaults_after_a_reboot_resets_the_gpu_whose_file_it_drops(
    nvml, tmp_path: Path
) -> None:
    """`gpu reset --defaults` resets every GPU it restores nothing on to driver defaults. A
    state file from before the last reboot is dropped, not restored: its GPU must then be reset
    as one without a file is, not left with whatever was set on it since the reboot (an
    operator's lock and power limit here), under a line saying it was reset to defaults."""
    if not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("the kernel gives no boot id here")
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    store = StateStore(Path(os.environ["DVFS_STATE_DIR"]), command="govern")
    store.record(GpuSettings(uuid, (210, 1410), 500_000))
    left = json.loads(store.path(uuid).read_text())
    store.path(uuid).write_text(json.dumps({**left, "boot": "an-earlier-boot"}))
    nvml.fake_reset_state()  # what the reboot did to the GPUs
    nvml.fake_update_device(0, locked_clocks=[210, 900], power_limit_mw=450_000)  # set since
    out = " ".join(invoke("gpu", "reset", "--defaults").split())
    assert "dropped the state file of GPU 0" in out, out
    assert not store.pending()
    default_mw = nvml.FAKE_PROFILES["h100-sxm"]["power_default_mw"]
    for index in (0, 1):
        device = nvml.fake_device_state(index)
        assert device["locked_clocks"] is None, (index, out)
        assert device["power_limit_mw"] == default_mw, (index, out)


def test_a_state_file_from_before_a_reboot_refuses_nothing_after_it(nvml, tmp_path: Path) -> None:
    """A power loss while a governor ran under static caps leaves its state file; the reboot
    reset the GPU, so the file holds no unrestored change (`gpu reset` drops it). At boot the
    caps unit's `cap apply` and then the governor must take the GPU, not be refused (exit 3,
    which leaves both units failed and the GPUs uncapped) with a message that `gpu reset` would
    restore the recorded settings, which it does not. A dry run says what the apply does. A
    file from this boot is still refused."""
    if not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("the kernel gives no boot id here")
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.nvml import open_nvml_gpus

    uuid, store, _ = _governed_before_a_reboot(tmp_path)
    state = Path(os.environ["DVFS_STATE_DIR"])
    nvml.fake_reset_state()  # what the reboot did to the GPUs
    caps = str(tmp_path / "caps.toml")
    dry = invoke("cap", "apply", caps, "--dry-run")
    assert "would apply to GPU 0" in dry, dry
    assert store.pending(), "a dry run changes nothing"
    invoke("cap", "apply", caps)  # dvfs-caps.service at boot
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] == [210, 1410] and device["power_limit_mw"] == 500_000
    assert not store.pending()
    # The governor at boot (dvfs-govern.service) takes the GPU as well.
    store.record(GpuSettings(uuid, (210, 1410), 500_000))
    store.path(uuid).write_text(
        json.dumps({**json.loads(store.path(uuid).read_text()), "boot": "an-earlier-boot"})
    )
    from dvfs.govern.loop import guarded

    with open_nvml_gpus([0], nvml=nvml) as gpus, guarded(gpus, state) as knobs:
        assert knobs.original[uuid].sm_clock_lock_mhz == (210, 1410)
        assert not store.pending()
    # In the boot that wrote it, a file still refuses the GPU; so does one an older dvfs
    # wrote, without the boot id, which `gpu reset` restores as ever.
    store.record(GpuSettings(uuid, (210, 1410), 500_000))
    assert "not restored" in invoke("cap", "apply", caps, code=3)
    older = json.loads(store.path(uuid).read_text())
    del older["boot"]
    store.path(uuid).write_text(json.dumps(older))
    assert "not restored" in invoke("cap", "apply", caps, code=3)
    nvml.fake_update_device(0, locked_clocks=[210, 900])  # what the dead run set
    assert "restored GPU 0" in invoke("gpu", "reset")
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1410]


def test_records_an_older_dvfs_wrote_before_a_reboot_are_not_taken_for_this_boots(
    nvml, tmp_path: Path
) -> None:
    """A dvfs older than the boot id wrote its records without one (the caps record's entry
    with its `applied` time, a state file with its `since`, in their formats then); after a
    reboot, which reset the GPUs, they were taken for this boot's: a sweep put the earlier
    boot's cap back on the GPU as it finished, `gpu reset` (the governor unit's ExecStopPost)
    put back the earlier boot's settings, and `cap apply` at boot (the caps unit) was refused,
    exit 3. Their time, before this boot began, tells: ignored and dropped as a record with an
    earlier boot's id is. One written in this boot still counts."""
    from datetime import UTC, datetime

    from dvfs.caps import GovernorLocks
    from dvfs.gpu.safety import boot_started

    started = boot_started()
    if started is None:
        pytest.skip("the kernel does not say when this boot began")
    earlier = datetime.fromtimestamp(started - 3600, UTC)
    [uuid, _] = [g["uuid"] for g in json.loads(invoke("gpu", "list", "--json"))]
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    caps_record = {
        uuid: {
            "lock_mhz": [210, 1410],
            "power_limit_mw": 500_000,
            "source": "/etc/dvfs/caps.toml",
            "applied": earlier.isoformat(timespec="seconds"),
        }
    }
    (state / "caps-applied.json").write_text(json.dumps(caps_record))
    (state / f"governed-{uuid}.json").write_text(
        json.dumps({"lock_mhz": [210, 1200], "pid": 4242, "since": earlier.isoformat()})
    )
    state_file = {
        "original": {"uuid": uuid, "sm_clock_lock_mhz": [210, 1410], "power_limit_mw": 500_000},
        "pid": 4242,
        "host": "node1",
        "since": earlier.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": "govern",
    }
    StateStore(state).path(uuid).write_text(json.dumps(state_file))
    # the GPUs as the reboot left them (nvml: fresh)
    [shown, _] = json.loads(invoke("cap", "show", "--json"))
    assert shown["sm_clock_lock_mhz"] is None and shown["caps_source"] is None, shown
    assert GovernorLocks(state).read() == {}
    out = " ".join(invoke("gpu", "reset").split())
    assert "dropped the state file of GPU 0" in out, out
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] is None and device["power_limit_mw"] == 700_000
    StateStore(state).path(uuid).write_text(json.dumps(state_file))
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    invoke("cap", "apply", str(caps))  # dvfs-caps.service at boot
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
    invoke("cap", "reset")
    # A sweep puts back the caps in force as it found them, not the earlier boot's.
    (state / "caps-applied.json").write_text(json.dumps(caps_record))
    from dvfs.caps import AppliedCaps

    assert AppliedCaps(state).locks() == {}
    # Written in this boot, without the boot id, a record still counts.
    now = datetime.now(UTC)
    caps_record[uuid]["applied"] = now.isoformat(timespec="seconds")
    (state / "caps-applied.json").write_text(json.dumps(caps_record))
    assert AppliedCaps(state).locks() == {uuid: (210, 1410)}
    StateStore(state).path(uuid).write_text(
        json.dumps({**state_file, "since": now.strftime("%Y-%m-%dT%H:%M:%S%z")})
    )
    assert "not restored" in invoke("cap", "apply", str(caps), code=3)


def test_a_model_entry_every_gpu_here_overrides_is_not_noted_as_another_hosts(
    nvml, tmp_path: Path
) -> None:
    """A fleet file with a [[model]] default and [[gpu]] entries for this host's GPUs: each GPU
    takes its own entry. The model entry was noted as for a model the host lacks ("no GPU
    here is a NVIDIA H100 80GB HBM3; those entries were skipped") on a host of two H100s."""
    uuids = [g["uuid"] for g in json.loads(invoke("gpu", "list", "--json"))]
    name = json.loads(invoke("gpu", "list", "--json"))[0]["name"]
    caps = tmp_path / "caps.toml"
    entries = [GpuCap(uuid=u, sm_clock_max_mhz=1500) for u in uuids]
    others = (
        GpuCap(name=name, sm_clock_max_mhz=1200),
        GpuCap(name="NVIDIA H200", power_limit_w=500),
    )
    write_caps(caps, *entries, *others)
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert result.exit_code == 0, result.output
    told = " ".join(result.output.split())
    assert f"no GPU here is a {name}" not in told, told
    assert "no GPU here is a NVIDIA H200" in told, told  # a model the host lacks still is
    assert [nvml.fake_device_state(i)["locked_clocks"] for i in (0, 1)] == [[210, 1500]] * 2


def test_two_applies_on_different_gpus_keep_each_others_record(nvml, tmp_path: Path) -> None:
    """Each `cap apply` holds only its own GPUs' locks, so another may cap other GPUs
    meanwhile: neither may write back a stale copy of the shared record over the other's."""
    from dvfs.caps import AppliedCaps, CapAction, apply_actions
    from dvfs.gpu.nvml import open_nvml_gpus

    record = AppliedCaps(tmp_path / "state")
    with open_nvml_gpus([0, 1], nvml=nvml) as (first, second):
        real = first.set_power_limit_mw

        def meanwhile(limit_mw: int) -> None:  # another dvfs caps GPU 1 now
            other = CapAction(1, second.identity.uuid, (210, 1500), None, 700_000)
            apply_actions([other], [second], AppliedCaps(tmp_path / "state"), "other.toml")
            real(limit_mw)

        first.set_power_limit_mw = meanwhile  # type: ignore[method-assign]
        action = CapAction(0, first.identity.uuid, (210, 1410), 400_000, 700_000)
        apply_actions([action], [first], record, "caps.toml")
    assert record.locks() == {
        first.identity.uuid: (210, 1410),
        second.identity.uuid: (210, 1500),
    }
    assert nvml.fake_device_state(1)["locked_clocks"] == [210, 1500]


def test_show_and_monitor_without_root_see_the_caps_root_applied(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caps are applied as root and recorded in /var/lib/dvfs; `dvfs cap show` and `dvfs
    monitor` are meant to run without root (the README runs `dvfs cap show` so), where the
    default state directory is the user's own, which holds no record of them."""
    from dvfs.gpu import safety

    uuid = apply_caps(tmp_path, 1410, 500.0)  # as root, into $DVFS_STATE_DIR
    monkeypatch.setattr(safety, "ROOT_STATE_DIR", Path(os.environ["DVFS_STATE_DIR"]))
    monkeypatch.delenv("DVFS_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "user-state"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    [shown, _] = json.loads(invoke("cap", "show", "--json"))
    assert shown["uuid"] == uuid and shown["sm_clock_lock_mhz"] == [210, 1410]
    power_only = tmp_path / "power.toml"
    write_caps(power_only, GpuCap(uuid=uuid, power_limit_w=450.0))
    assert "SM clock unlocked" in invoke("cap", "apply", str(power_only), "--dry-run")
    page = invoke("monitor", "--once", "--interval", "0.01")
    assert f'dvfs_gpu_sm_clock_lock_max_hertz{{gpu="0",uuid="{uuid}"}} 1.41e+09' in page
    # `dvfs govern --dry-run` needs no root either, and previews under the same static caps.
    from dvfs.govern.metrics import ServerReader, ServerSample

    monkeypatch.setattr(
        ServerReader, "__call__", lambda self, timeout_s=None: ServerSample(1, 0.0, None)
    )
    plan = tmp_path / "plan.toml"
    plan.write_text(
        'dvfs_batch_plan = 1\n[meta]\nmeasured_on = "NVIDIA H100 80GB HBM3"\ndrafter = "none"\n'
        "[[batch]]\nbatch = 1\nsm_clock_mhz = 1200\n"
    )
    dry = invoke(
        *("govern", "--plan", str(plan), "--gpu", "0", "--dry-run", "--listen", "off"),
        *("--max-intervals", "1"),
    )
    assert "GPU 0: SM clock locked 210-1410 MHz, power limit 500 W" in dry, dry


def _apply_under_hardened_umask(tmp_path: Path) -> None:
    """`apply_caps` (1410 MHz, 500 W) as a hardened root would run it: umask 027."""
    old = os.umask(0o027)
    try:
        apply_caps(tmp_path, 1410, 500.0)
    finally:
        os.umask(old)


def test_the_state_folder_root_makes_is_readable_by_all_whatever_its_umask(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cap show`, `monitor` and the dry runs run without root read the caps record where
    root's `cap apply` made it (/var/lib/dvfs), which the state folder is made readable by
    all for. Its mode was mkdir's 0755 masked by the umask: a hardened root's 027 made it
    0750, and every user's `dvfs cap show` then failed 'permission denied' (the GPU locks
    0640: a dry run without root took a GPU a governor holds for free)."""
    state = tmp_path / "fresh-state"
    monkeypatch.setenv("DVFS_STATE_DIR", str(state))
    _apply_under_hardened_umask(tmp_path)
    assert state.stat().st_mode & 0o777 == 0o755
    assert (state / "caps-applied.json").stat().st_mode & 0o777 == 0o644
    # and each GPU's lock, by which a dry run without root tells a GPU another dvfs holds (a
    # running governor: the apply would be refused); one it cannot read passed for free
    locks = list(state.glob("GPU-*.lock"))
    assert locks and all(p.stat().st_mode & 0o777 == 0o644 for p in locks)
    made = tmp_path / "made-by-hand"  # a folder that exists keeps its mode
    made.mkdir(mode=0o700)
    monkeypatch.setenv("DVFS_STATE_DIR", str(made))
    invoke("cap", "reset")
    assert made.stat().st_mode & 0o777 == 0o700


def test_the_folders_root_makes_above_the_state_folder_are_readable_by_all_too(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With $DVFS_STATE_DIR naming a folder below others not made yet (/srv/dvfs/state), the
    state folder was made 0755 under a hardened root umask (027) but the folders above it,
    made by mkdir's parents, 0750: every user's `cap show` with the same $DVFS_STATE_DIR
    failed 'permission denied' all the same. Each folder dvfs makes is 0755."""
    top = tmp_path / "srv"
    top.mkdir()
    top.chmod(0o711)  # one that exists keeps its mode
    nested = top / "dvfs" / "state" / "dvfs"
    monkeypatch.setenv("DVFS_STATE_DIR", str(nested))
    _apply_under_hardened_umask(tmp_path)
    for folder in (nested, nested.parent, nested.parent.parent):
        assert folder.stat().st_mode & 0o777 == 0o755, folder
    assert top.stat().st_mode & 0o777 == 0o711


def test_a_sweep_puts_applied_caps_back(nvml, tmp_path: Path) -> None:
    """NVML cannot read a clock lock back; dvfs's caps record tells the sweep what to restore."""
    from dvfs.campaign import load_campaign
    from dvfs.sweep import run_sweep

    apply_caps(tmp_path, 1410, 500.0)
    campaign = tmp_path / "c.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=8, repeats=1))
    run_sweep(load_campaign(campaign), tmp_path / "out", nvml=nvml)
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] == [210, 1410] and device["power_limit_mw"] == 500_000


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("gpu = [1, 2]\n", "must be a table"),
        ('[[model]]\nname = "X"\npower_limit_w = nan\n', "power_limit_w must be a positive"),
        ('[[model]]\nname = "X"\npower_limit_w = inf\n', "power_limit_w must be a positive"),
        (b"\xff\xfe caps", "not UTF-8"),
        # The first entry would cap every GPU of the model, the second nothing, and the apply
        # would note that no GPU here is of that model.
        (
            '[[model]]\nname = "X"\nsm_clock_max_mhz = 1500\n'
            '[[model]]\nname = "X"\npower_limit_w = 400\n',
            "GPU model 'X' appears twice",
        ),
        (
            '[[model]]\nname = "X"\nsm_clock_max_mhz = 1500\n'
            '[[model]]\nname = "X (twin)"\nsm_clock_max_mhz = 1200\n',
            "GPU model 'X' appears twice",
        ),
    ],
    ids=["entry-not-table", "nan-watts", "inf-watts", "not-utf8", "model-twice", "twin-twice"],
)
def test_malformed_caps_files_are_caps_errors(tmp_path: Path, content, says: str) -> None:
    path = tmp_path / "caps.toml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(CapsError, match=says):
        load_caps(path)


def test_a_model_named_twice_by_an_older_cap_plan_says_how_to_plan_it_again(
    tmp_path: Path,
) -> None:
    """`cap plan --model` of a merged cube, by a dvfs older than the fix that takes the least
    aggressive setting over the model's GPUs, wrote one [[model]] entry per GPU, each its own
    GPU's setting; `cap apply` (the caps unit at boot) refuses it, saying only to keep one
    entry, where keeping the wrong one locks every GPU at another GPU's lower clock. It says
    how to plan it again, the command with the file's batch, drafter and model."""
    path = tmp_path / "caps.toml"
    path.write_text(
        'dvfs_caps = 1\n[meta]\nmeasured_on = "NVIDIA H100 80GB HBM3"\nbatch = 16\n'
        'drafter = "eagle3"\ncorpus = "worst-case"\n'
        '[[model]]\nname = "NVIDIA H100 80GB HBM3"\nsm_clock_max_mhz = 1500\n'
        '[[model]]\nname = "NVIDIA H100 80GB HBM3"\nsm_clock_max_mhz = 1005\n'
    )
    with pytest.raises(CapsError) as refused:
        load_caps(path)
    told = str(refused.value)
    assert "keep one [[model]] entry per model" in told and "\n" not in told
    assert (
        "write that cube's headroom again, `dvfs headroom CUBE --json -o headroom.json`, then "
        "plan again, `dvfs cap plan headroom.json --batch 16 --drafter eagle3 --model "
        "'NVIDIA H100 80GB HBM3' -o caps.toml`, which takes the least aggressive setting"
    ) in told, told


def test_a_per_batch_plan_given_to_cap_apply_is_named_as_one(nvml, tmp_path: Path) -> None:
    """/etc/dvfs holds a caps file and a governor's plan: the plan given to `cap apply` (or
    installed as caps.toml) was refused as "unknown key(s) batch, dvfs_batch_plan", which
    does not say what the file is; it is named as the plan it is, as `dvfs govern` names a
    caps file given to it."""
    headroom = tmp_path / "headroom.json"
    headroom.write_text(json.dumps(doc([row("code", 1305, 700.0)])))
    plan = tmp_path / "govern-plan.toml"
    invoke("cap", "plan", str(headroom), "--per-batch", "-o", str(plan))
    for extra in (("--dry-run",), ()):
        told = " ".join(invoke("cap", "apply", str(plan), *extra, code=2).split())
        assert f"{plan} is a per-batch plan (for `dvfs govern --plan`), not a caps file" in told
        assert "unknown key" not in told and told.count("Error:") == 1, told
    assert nvml.fake_calls() == []


def test_a_caps_record_that_is_not_an_object_is_a_caps_error(tmp_path: Path) -> None:
    from dvfs.caps import AppliedCaps

    record = AppliedCaps(tmp_path)
    record.path.write_text("[1, 2]")
    with pytest.raises(CapsError, match="not a dvfs caps record"):
        record.read()


@pytest.mark.parametrize(
    "entry",
    [
        {"lock_mhz": [1500]},
        {"lock_mhz": "1500"},
        {"lock_mhz": [210, "1500"]},
        {"lock_mhz": [1500, 210]},
        {"lock_mhz": None, "power_limit_mw": "500000"},
    ],
)
def test_a_caps_record_with_a_damaged_entry_is_named_in_one_line(
    nvml, tmp_path: Path, entry: dict
) -> None:
    """A caps record whose entry holds a lock of one clock (or text) gave `cap show` "internal
    error: IndexError", or showed the text as a lock (and a sweep took it for one). `cap show`
    names the record, its line and the entry in a warning and shows the rest (the damaged knob
    unknown); a sweep, which must put dvfs's caps back, refuses it in one line, exit 1 (dvfs's
    own record damaged: a failure, not bad usage), saying why."""
    uuid = nvml.fake_device_state(0)["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    (state / "caps-applied.json").write_text(json.dumps({uuid: entry}))
    for args in (("cap", "show"), ("cap", "show", "--json")):
        result = CliRunner().invoke(cli, list(args))
        assert result.exit_code == 0, result.output
        told = " ".join(result.stderr.split())
        assert f"caps-applied.json line 1 is damaged for GPU 0 ({uuid})" in told, told
        assert "internal error" not in result.output and "Error" not in result.output, told
    campaign = _stock_campaign(tmp_path)
    told = " ".join(invoke("sweep", str(campaign), "--out", str(tmp_path / "out"), code=1).split())
    assert "caps-applied.json line 1 is damaged for GPU" in told and uuid in told, told
    assert "this command must know" in told and told.count("Error:") == 1, told


@pytest.mark.parametrize("command", [("cap", "reset"), ("gpu", "reset", "--defaults")])
def test_a_reset_drops_a_damaged_caps_entry_and_resets_every_gpu(
    nvml, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """A caps record with a damaged entry (a lock of one clock) made `cap reset`, the caps
    unit's stop, reset GPU 0 without a word and then refuse, exit 2, telling to remove the
    record and re-apply, with GPUs 1 and 2 left capped; `gpu reset --defaults` alike. A reset
    drops the entries it resets, damaged or not, as it did before entries were checked: every
    GPU is reset and said so."""
    nvml.fake_reset_state("h100-sxm,h100-sxm,h100-sxm")
    caps = _h100_caps_file(tmp_path)
    invoke("cap", "apply", str(caps))
    record = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"
    entries = json.loads(record.read_text())
    entries[nvml.fake_device_state(2)["uuid"]]["lock_mhz"] = [1500]
    record.write_text(json.dumps(entries))
    said = " ".join(invoke(*command).split())
    for index in range(3):
        assert f"GPU {index} ({nvml.fake_device_state(index)['uuid']}): clocks unlocked" in said
        assert nvml.fake_device_state(index)["locked_clocks"] is None, index
        assert nvml.fake_device_state(index)["power_limit_mw"] == 700_000, index
    assert not record.exists()


def test_cap_reset_refuses_an_unreadable_caps_record_before_resetting_any_gpu(
    nvml, tmp_path: Path
) -> None:
    """`cap reset` with a caps record that is no JSON reset GPU 0 and only then refused, exit
    2, telling to remove the record and re-apply: GPU 0's reset went unsaid and GPUs 1 and 2
    stayed capped. The record is read before any GPU is reset: refused with nothing changed,
    and said so (exit 1: dvfs's own record damaged is a failure, not bad usage)."""
    nvml.fake_reset_state("h100-sxm,h100-sxm,h100-sxm")
    caps = tmp_path / "caps.toml"
    caps.write_text(
        dump_caps(CapsFile((GpuCap(name="NVIDIA H100 80GB HBM3", sm_clock_max_mhz=1500),)))
    )
    invoke("cap", "apply", str(caps))
    (Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json").write_text('{"GPU-')
    told = " ".join(invoke("cap", "reset", code=1).split())
    assert "caps-applied.json is unreadable" in told and "nothing was reset" in told, told
    assert "clocks unlocked" not in told, told
    for index in range(3):
        assert nvml.fake_device_state(index)["locked_clocks"] == [210, 1500], index


def test_cap_apply_and_reset_do_not_wait_on_a_fifo_as_the_caps_records_lock(
    nvml, tmp_path: Path
) -> None:
    """The caps record's lock file (caps-applied.json.lock) opened for writing as a FIFO: `cap
    apply` locked GPU 0's clocks and then waited for ever for a reader, its GPU capped and its
    record unwritten, and `cap reset` (the caps unit's stop) hung alike. The lock is opened
    without blocking and only locked: both run, and the record says what the GPU holds."""
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    os.mkfifo(state / "caps-applied.json.lock")  # no reader: a writer that opens it waits
    uuid = apply_caps(tmp_path, 1500, 450)
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
    record = json.loads((state / "caps-applied.json").read_text())
    assert record[uuid]["lock_mhz"] == [210, 1500], record
    assert "clocks unlocked" in invoke("cap", "reset")
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert not (state / "caps-applied.json").exists()


def test_plan_refuses_bad_gpu_choices() -> None:
    d = doc([row("code", 1305, 450.0)])
    with pytest.raises(CapsError, match="--gpu '0' is not a GPU UUID"):
        plan_caps(d, batch=16, drafter="eagle3", corpus="code", uuids=["0"])
    with pytest.raises(CapsError, match="--gpu and --model exclude each other"):
        plan_caps(
            d, batch=16, drafter="eagle3", corpus="code", uuids=["GPU-1"], model_name="NVIDIA H200"
        )


def test_plan_from_a_merged_cube_uses_each_gpus_own_stock() -> None:
    """GPUs whose stock power limits differ: the document has no single reference, and each
    GPU's chosen setting is compared with its own stock (a TypeError on the old code)."""
    from cubes import make_cube

    from dvfs.analysis.headroom import headroom
    from dvfs.analysis.targets import Target
    from dvfs.cube import merge_cubes
    from dvfs.report import headroom_document

    tpot = {1000: 12.0, 1500: 10.5, 2000: 10.0}
    energy = {1000: 0.8, 1500: 0.7, 2000: 1.0}
    parts = []
    for uuid, limits in (("GPU-a", [600.0, 700.0]), ("GPU-b", [600.0, 650.0])):
        ds = make_cube(
            clocks=[1000, 1500, 2000],
            limits=limits,
            latency=lambda c, *_: tpot[c],
            energy=lambda c, *_: energy[c],
        )
        ds.attrs.update(
            gpu_uuids=uuid,
            model="m",
            engine_backend="nvml",
            tp_size=1,
            measurement_method="x",
            gpu_name="NVIDIA H100 80GB HBM3",
            campaign=json.dumps({"name": "merged", "workload": {"batch": [1]}}),
        )
        parts.append(ds)
    merged = merge_cubes(parts)
    doc = headroom_document(headroom(merged, target=Target("preserve", slack=0.10)), merged)
    assert doc["reference"]["power_limit_w"] is None  # no single stock setting
    caps = plan_caps(doc, batch=1, drafter="none", corpus="code")
    by_uuid = {c.uuid: c for c in caps.caps}
    assert set(by_uuid) == {"GPU-a", "GPU-b"}
    assert all(c.sm_clock_max_mhz == 1500 for c in by_uuid.values())


def test_an_entry_error_names_its_place_once() -> None:
    with pytest.raises(CapsError) as err:
        parse_caps(
            {"model": [{"name": "NVIDIA H100 80GB HBM3", "sm_clock_max_mhz": 0}]}, where="c.toml"
        )
    assert str(err.value).count("c.toml: [[model]] #1") == 1


def test_a_sweep_measures_stock_without_the_applied_caps_and_puts_them_back(
    nvml, tmp_path: Path
) -> None:
    """Caps `dvfs cap apply` put on a GPU (a clock lock, a power cap) are production settings,
    not its stock: a later sweep runs its stock cells unlocked at the default power limit, as
    its cube says, and the caps are back when it ends."""
    from dvfs.cube import open_cube

    apply_caps(tmp_path, 1200, 450.0)
    campaign = _stock_campaign(tmp_path)
    out = tmp_path / "out"
    invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] == [210, 1200] and device["power_limit_mw"] == 450_000
    calls = [(c["fn"].removeprefix("nvmlDevice"), c["args"]) for c in nvml.fake_calls()]
    applied = [("SetGpuLockedClocks", [210, 1200]), ("SetPowerManagementLimit", [450_000])]
    measured = [("ResetGpuLockedClocks", []), ("SetPowerManagementLimit", [700_000])]
    assert calls == applied + measured + applied  # the caps, stock to measure, the caps back
    assert open_cube(out / "cube.nc").attrs["stock_power_limit_w"] == 700.0


def test_a_clock_only_sweep_on_capped_gpus_says_its_stock_limit_is_not_the_one_found(
    nvml, tmp_path: Path
) -> None:
    """A clock-only sweep on a GPU `dvfs cap apply` had capped at 450 W runs its cells at the
    default 700 W (a cap is no stock), yet the report's facts said "Power limits: not set: as
    found at start (700 W)" and `cube info` "stock power limit as found at start": it was 450
    W at start. The journal's session and the cube now record the cap found and lifted
    (`power_limit_found_w`), and both say the stock is the GPU's default, not the 450 W found;
    a limit set outside dvfs is still the stock as found, and said so."""
    from dvfs.cube import open_cube
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Facts

    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0))
    invoke("cap", "apply", str(caps))
    campaign = tmp_path / "clock.toml"
    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    campaign.write_text(text.replace("power_limit = [700, 400]", 'power_limit = "stock"'))
    lifted = (
        "the GPU's default (700 W), not the 450 W found at start: a cap dvfs applied, lifted "
        "while measuring and put back after"
    )
    for name, expected in (("capped", lifted), ("by-hand", "as found at start (450 W)")):
        out = tmp_path / name
        invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
        assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
        cube = open_cube(out / "cube.nc")
        info = " ".join(invoke("cube", "info", str(out / "cube.nc")).split())
        # The report's facts (its section, not the whole report: whether the fake's short
        # cells are valid depends on the machine's speed)
        [block, *_] = measured_section(cube).blocks
        assert isinstance(block, Facts)
        facts = dict(block.pairs)
        assert facts["Power limits"] == f"not set: {expected}"
        assert f"power_limit 1: not set: {expected}" in info  # the axis row says the same
        if name == "capped":
            assert cube.attrs["stock_power_limit_w"] == 700.0
            assert float(cube.attrs["power_limit_found_w"]) == 450.0
            assert "stock power limit the GPU's default, not the 450 W found at start" in info
            [session] = [
                json.loads(x)
                for x in (out / "journal.jsonl").read_text().splitlines()
                if '"type":"session"' in x
            ]
            assert session["power_limit_found_w"] == {uuid: 450.0}
            invoke("cap", "reset")
            nvml.fake_update_device(0, power_limit_mw=450_000)  # `nvidia-smi -pl 450`
        else:
            assert cube.attrs["stock_power_limit_w"] == 450.0
            assert "power_limit_found_w" not in cube.attrs
            assert "stock power limit as found at start" in info


def test_a_merge_keeps_the_cap_each_source_found_and_lifted(nvml, tmp_path: Path) -> None:
    """`dvfs cube merge` dropped `power_limit_found_w`: a clock-only campaign's shards (the
    first on an uncapped GPU, the second on one `cap apply` had capped at 450 W), and the
    whole sweeps of both GPUs merged across GPUs, said "power_limit: not set: as found at
    start (700 W)", though the capped GPU's sweep found 450 W there and lifted it (its own
    cube says so). The merged cube records each source's lifted cap, as a sweep's sessions."""
    from dvfs.cube import open_cube

    u0 = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=u0, power_limit_w=450.0))
    invoke("cap", "apply", str(caps))
    campaign = tmp_path / "clock.toml"
    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    text = text.replace("power_limit = [700, 400]", 'power_limit = "stock"')
    campaign.write_text(text.replace("batch = [1]", "batch = [1, 2]"))
    for name, args in (
        ("shard-0", ("--shard", "0/2", "--gpus", "1")),
        ("shard-1", ("--shard", "1/2", "--gpus", "0")),
        ("gpu-1", ("--gpus", "1")),
        ("gpu-0", ("--gpus", "0")),
    ):
        invoke("sweep", str(campaign), *args, "--out", str(tmp_path / name), "--no-progress")
    invoke(
        "cube",
        "merge",
        *(str(tmp_path / f"shard-{i}") for i in (0, 1)),
        "-o",
        str(tmp_path / "s.nc"),
    )
    invoke(
        "cube",
        "merge",
        *(str(tmp_path / f"gpu-{i}" / "cube.nc") for i in (1, 0)),
        "-o",
        str(tmp_path / "g.nc"),
    )
    lifted = (
        "power_limit 1: not set: the GPUs' defaults (700 W), not the 450 W found at start on "
        f"{u0[:12]}: a cap dvfs applied, lifted while measuring and put back after"
    )
    for merged in (tmp_path / "s.nc", tmp_path / "g.nc"):
        assert float(open_cube(merged).attrs["power_limit_found_w"]) == 450.0
        assert json.loads(open_cube(merged).attrs["power_limit_found_gpus"]) == {u0: [450.0]}
        assert lifted in " ".join(invoke("cube", "info", str(merged)).split())


@pytest.mark.parametrize("how", ["fleet", "tensor-parallel"])
def test_each_gpus_cap_found_and_lifted_is_kept_and_said(nvml, tmp_path: Path, how: str) -> None:
    """Two GPUs `cap apply` had capped at 450 W and 500 W, swept together (a fleet of two
    workers, `--gpus 0,1`; one tensor-parallel server over both): the journal and the cube
    kept one number (the first worker's, or the first GPU's), so `cube info` and the report
    said "not the 450 W found at start" and the 500 W GPU's cap was lost. Each GPU's is kept
    now, by UUID, and said with its GPU."""
    from dvfs.cube import open_cube
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Facts

    uuids = [g["uuid"] for g in json.loads(invoke("gpu", "list", "--json"))][:2]
    caps = tmp_path / "caps.toml"
    write_caps(
        caps, GpuCap(uuid=uuids[0], power_limit_w=450.0), GpuCap(uuid=uuids[1], power_limit_w=500.0)
    )
    invoke("cap", "apply", str(caps))
    campaign = tmp_path / "clock.toml"
    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    text = text.replace("power_limit = [700, 400]", 'power_limit = "stock"')
    args: tuple[str, ...] = ("--gpus", "0,1")
    if how == "fleet":  # a comparison group each: a GPU that measured no cell is not the cube's
        text = text.replace("batch = [1]\n", "batch = [1, 2]\n")
    if how == "tensor-parallel":
        text = text.replace("devices = [0]", "devices = [0, 1]")
        text = text.replace('model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\ntp_size = 2')
        args = ()
    campaign.write_text(text)
    out = tmp_path / "out"
    invoke("sweep", str(campaign), *args, "--out", str(out), "--no-progress")
    [session] = [
        json.loads(x)
        for x in (out / "journal.jsonl").read_text().splitlines()
        if '"type":"session"' in x
    ]
    assert session["power_limit_found_w"] == {uuids[0]: 450.0, uuids[1]: 500.0}
    cube = open_cube(out / "cube.nc")
    assert json.loads(cube.attrs["power_limit_found_gpus"]) == {
        uuids[0]: [450.0],
        uuids[1]: [500.0],
    }
    said = (
        f"not the caps found at start (450 W on {uuids[0][:12]}, 500 W on {uuids[1][:12]}): "
        "caps dvfs applied, lifted while measuring and put back after"
    )
    info = " ".join(invoke("cube", "info", str(out / "cube.nc")).split())
    # Two GPUs, each at its default (a cube of one said "the GPU's default"): plural.
    assert f"power_limit 1: not set: the GPUs' defaults (700 W), {said}" in info
    assert f"stock power limit the GPUs' defaults, {said}" in info
    [block, *_] = measured_section(cube).blocks
    assert isinstance(block, Facts)
    assert dict(block.pairs)["Power limits"] == f"not set: the GPUs' defaults (700 W), {said}"


def test_an_earlier_dvfs_journals_one_found_cap_still_reads(nvml, tmp_path: Path) -> None:
    """A journal whose session recorded the cap found as one number (an earlier dvfs's, its
    GPU unnamed) still builds a cube that says it."""
    from dvfs.cube import open_cube

    apply_caps(tmp_path, 1200, 450.0)
    out = tmp_path / "out"
    invoke("sweep", str(_stock_campaign(tmp_path)), "--out", str(out), "--no-progress")
    journal = out / "journal.jsonl"
    lines = []
    for line in journal.read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "session":
            assert list(record["power_limit_found_w"].values()) == [450.0]
            record["power_limit_found_w"] = 450.0
            line = json.dumps(record)
        lines.append(line)
    journal.write_text("\n".join(lines) + "\n")
    invoke("cube", "build", str(out))
    cube = open_cube(out / "cube.nc")
    assert float(cube.attrs["power_limit_found_w"]) == 450.0
    assert "power_limit_found_gpus" not in cube.attrs
    assert "not the 450 W found at start" in " ".join(
        invoke("cube", "info", str(out / "cube.nc")).split()
    )


def test_a_merge_keeps_an_earlier_dvfs_cubes_cap_with_its_gpu(nvml, tmp_path: Path) -> None:
    """Both GPUs capped at 450 W, each swept alone; the first GPU's cube an earlier dvfs's
    (its cap found, not which GPU found it). Merged across GPUs, its 450 W was taken for the
    other GPU's alone: "not the 450 W found at start on GPU-e3afe299", as if GPU-181a77a6's
    stock cells had run at the limit found. A one-GPU cube's caps are that GPU's."""
    from dvfs.cube import open_cube

    uuids = [g["uuid"] for g in json.loads(invoke("gpu", "list", "--json"))][:2]
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile(tuple(GpuCap(uuid=u, power_limit_w=450.0) for u in uuids))))
    invoke("cap", "apply", str(caps))
    campaign = tmp_path / "clock.toml"
    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    campaign.write_text(text.replace("power_limit = [700, 400]", 'power_limit = "stock"'))
    for i in (0, 1):
        out = tmp_path / f"gpu-{i}"
        invoke("sweep", str(campaign), "--gpus", str(i), "--out", str(out), "--no-progress")
    earlier = open_cube(tmp_path / "gpu-0" / "cube.nc").load()
    del earlier.attrs["power_limit_found_gpus"]  # an earlier dvfs's
    earlier.to_netcdf(tmp_path / "earlier.nc")
    merged = tmp_path / "g.nc"
    invoke(
        "cube",
        "merge",
        str(tmp_path / "earlier.nc"),
        str(tmp_path / "gpu-1" / "cube.nc"),
        "-o",
        str(merged),
    )
    assert json.loads(open_cube(merged).attrs["power_limit_found_gpus"]) == {
        uuids[0]: [450.0],
        uuids[1]: [450.0],
    }
    assert (
        f"not the caps found at start (450 W on {uuids[0][:12]}, 450 W on {uuids[1][:12]})"
        in " ".join(invoke("cube", "info", str(merged)).split())
    )


def test_every_gpus_invalid_cap_is_reported_together(nvml, tmp_path: Path) -> None:
    """100 W on GPU 0 and 900 W on GPU 1: both named in one error, nothing applied."""
    uuids = [g["uuid"] for g in json.loads(invoke("gpu", "list", "--json"))]
    caps = tmp_path / "caps.toml"
    write_caps(
        caps,
        GpuCap(uuid=uuids[0], power_limit_w=100.0),
        GpuCap(uuid=uuids[1], sm_clock_max_mhz=1507, power_limit_w=900.0),
    )
    for extra in ((), ("--dry-run",)):
        out = " ".join(invoke("cap", "apply", str(caps), *extra, code=2).split())
        assert "GPU 0: power limit 100 W is outside" in out and "GPU 1: 1507 MHz" in out, out
        assert "GPU 1: power limit 900 W is outside" in out
    assert nvml.fake_calls() == []


def test_a_power_cap_above_the_gpus_default_now_is_refused(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver update lowered the GPU's default power limit (700 W to 400 W) below the caps
    file's 450 W, planned against the old stock. `cap apply` (the caps unit at boot) set 450 W
    "from 400 W", exit 0: a "cap" that raised the GPU's power above its stock, a setting never
    measured. It is refused with the other invalid caps, exit 2, naming the default now and
    changing nothing; a cap at the default still applies."""
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    monkeypatch.setitem(nvml.FAKE_PROFILES["h100-sxm"], "power_default_mw", 400_000)
    for index in (0, 1):  # what the new driver's default is at boot
        nvml.fake_update_device(index, power_limit_mw=400_000)
    caps = write_caps(
        tmp_path / "caps.toml", GpuCap(uuid, sm_clock_max_mhz=1410, power_limit_w=450)
    )
    for extra in ((), ("--dry-run",)):
        result = CliRunner().invoke(cli, ["cap", "apply", str(caps), *extra])
        assert result.exit_code == 2, result.output
        [line] = result.stderr.splitlines()
        assert "GPU 0: power limit 450 W is above the GPU's default power limit 400 W" in line
        assert "cap plan" in line, line
    assert nvml.fake_device_state(0)["power_limit_mw"] == 400_000
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    write_caps(caps, GpuCap(uuid, sm_clock_max_mhz=1410, power_limit_w=400))
    invoke("cap", "apply", str(caps))
    assert nvml.fake_device_state(0)["power_limit_mw"] == 400_000


def test_a_refused_apply_does_not_print_the_change_as_done(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without permission (4) or with a GPU holding unrestored changes (3), no GPU is said to
    get caps it did not get."""
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid, sm_clock_max_mhz=1500, power_limit_w=500))
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "0")
    denied = invoke("cap", "apply", str(caps), code=4)
    assert "permission" in denied and "SM clock locked" not in denied, denied
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "1")
    StateStore(Path(os.environ["DVFS_STATE_DIR"])).record(GpuSettings(uuid, None, 700_000))
    busy = invoke("cap", "apply", str(caps), code=3)
    assert "dvfs gpu reset" in busy and "SM clock locked" not in busy, busy
    assert nvml.fake_device_state(0)["locked_clocks"] is None


def test_an_apply_failing_half_way_names_what_it_changed_and_keeps_the_earlier_cap(
    nvml, tmp_path: Path
) -> None:
    """A GPU whose new clock lock went on but whose new power limit failed was named only by
    its failure: the lock it now held went unsaid. And its record lost the earlier apply's power
    limit, still on the GPU, so a later file leaving the power limit at stock did not put it
    back (and a sweep would take that cap for the GPU's stock). The failure now names what is
    in place, and the record keeps the earlier limit until the new one is."""
    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"

    def write(clock: int, limit: float | None) -> None:
        caps.write_text(
            dump_caps(CapsFile((GpuCap(uuid=uuid, sm_clock_max_mhz=clock, power_limit_w=limit),)))
        )

    write(1500, 500.0)
    invoke("cap", "apply", str(caps))
    nvml.fake_update_device(
        0, errors={"nvmlDeviceSetPowerManagementLimit": nvml.NVML_ERROR_UNKNOWN}
    )
    write(1200, 400.0)
    failed = " ".join(invoke("cap", "apply", str(caps), code=1).split())
    assert "cannot set the power limit" in failed, failed
    assert "GPU 0 was changed before that: SM clock locked to 210-1200 MHz" in failed, failed
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000  # the earlier cap, still on
    nvml.fake_update_device(0, errors={})
    write(1200, None)  # the power limit at stock: the earlier cap goes
    invoke("cap", "apply", str(caps))
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


def test_gpu_info_says_unknown_where_nvml_cannot_read_event_reasons_or_temperature(
    nvml,
) -> None:
    """A GPU whose NVML does not support reading clock-event reasons was shown with "event
    reasons: none" (--json: []), as if no reason were set, and its temperature as "None C".
    The reasons are unknown (--json: null), the temperature "-" as an unread power is."""
    unsupported = nvml.NVML_ERROR_NOT_SUPPORTED
    nvml.fake_update_device(
        0,
        errors={
            "nvmlDeviceGetCurrentClocksEventReasons": unsupported,
            "nvmlDeviceGetCurrentClocksThrottleReasons": unsupported,
            "nvmlDeviceGetTemperatureV": unsupported,
            "nvmlDeviceGetTemperature": unsupported,
        },
    )
    [row] = json.loads(invoke("gpu", "info", "0", "--json"))
    assert row["event_reasons"] is None and row["temperature_c"] is None, row
    shown = " ".join(invoke("gpu", "info", "0").split())
    assert "event reasons: unknown" in shown and "None C" not in shown, shown
    [other] = json.loads(invoke("gpu", "info", "1", "--json"))
    assert other["event_reasons"] == ["GpuIdle"]  # read where NVML can


def test_cap_apply_names_a_lost_gpu_beside_one_whose_caps_failed(nvml, tmp_path: Path) -> None:
    """`cap apply` with GPU 0's clock lock failing and GPU 2 fallen off the bus named GPU 0
    alone: the lost GPU, which the README says is named, exit 1, once the others are capped,
    went unsaid. The one error names both."""
    nvml.fake_reset_state("h100-sxm,h200-sxm,h100-sxm")
    caps = tmp_path / "caps.toml"
    caps.write_text(
        dump_caps(CapsFile((GpuCap(name="NVIDIA H100 80GB HBM3", sm_clock_max_mhz=1500),)))
    )
    nvml.fake_update_device(0, errors={"nvmlDeviceSetGpuLockedClocks": nvml.NVML_ERROR_UNKNOWN})
    nvml.fake_update_device(2, lost=True)
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
    [error] = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert "GPU 0: cannot lock SM clocks" in error and "GPU 2" in error, error
    assert "fallen off the bus" in error, error


def test_cap_apply_names_a_lost_gpu_beside_a_full_disk(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cap apply` with GPU 0 fallen off the bus and the caps record unwritable (a full disk)
    said only the disk's line: the lost GPU, which the README says is named, went unsaid.
    The one error names both, the disk's first."""
    import errno

    from dvfs.caps import AppliedCaps

    def full(self: AppliedCaps, records: dict) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    monkeypatch.setattr(AppliedCaps, "write", full)
    caps = tmp_path / "caps.toml"
    caps.write_text(
        dump_caps(CapsFile((GpuCap(name="NVIDIA H100 80GB HBM3", sm_clock_max_mhz=1500),)))
    )
    nvml.fake_update_device(0, lost=True)
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # an error told, not a traceback
    [error] = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    disk = error.index("no space left on device, so GPU 1's SM clock lock")
    assert disk < error.index("GPU 0") and "fallen off the bus" in error, error
    assert nvml.fake_device_state(1)["locked_clocks"] is None  # taken back, as before


def test_an_apply_failing_on_one_gpu_still_warns_of_the_others_and_notes_them(
    nvml, tmp_path: Path
) -> None:
    """`cap apply` with GPU 0's clock lock failing capped GPU 1, whose persistence mode is off,
    without the warning that the driver may drop its caps when dvfs exits, and said nothing of
    GPU 2, left alone for its MIG: the failure's line alone came out. The warning (for the GPU
    capped, not the one that failed) and the notes come before the failure, exit 1 still."""
    nvml.fake_reset_state("h100-sxm,h100-sxm,h100-sxm")
    caps = tmp_path / "caps.toml"
    caps.write_text(
        dump_caps(CapsFile((GpuCap(name="NVIDIA H100 80GB HBM3", sm_clock_max_mhz=1500),)))
    )
    nvml.fake_update_device(0, errors={"nvmlDeviceSetGpuLockedClocks": nvml.NVML_ERROR_UNKNOWN})
    for index in (0, 1):
        nvml.fake_update_device(index, persistence_mode=False)
    nvml.fake_update_device(2, mig=True)
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert result.exit_code == 1, result.output
    told = " ".join(result.stderr.split())
    assert "persistence mode is off on GPU 1:" in told, told
    assert "GPU 0" not in told.split("persistence mode is off on")[1].split(":")[0], told
    assert "has MIG enabled and was left alone" in told, told
    [error] = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert "GPU 0: cannot lock SM clocks" in error, error
    assert nvml.fake_device_state(1)["locked_clocks"] == [210, 1500]


def _readme_shell_lines() -> list[list[str]]:
    """Every command of the README's bash blocks, in order, as argv (comments dropped)."""
    import re
    import shlex

    text = (REPO / "README.md").read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            for command in line.split("&&"):
                argv = shlex.split(command, comments=True)
                if argv:
                    found.append(argv)
    return found


def test_the_readmes_root_commands_read_caps_and_plans_root_installed() -> None:
    """As root, `cap apply` and `govern` refuse a caps file or plan not owned by root or in a
    folder another user may write (`check_file_safety`), yet the README's recipes ran `sudo
    dvfs cap apply caps.toml` and `sudo dvfs govern --plan plan.toml` on the file the user's
    own `dvfs cap plan -o` had just written in their folder: refused, exit 2, as written. Each
    file a README command reads as root is one `sudo install -o root` put in /etc/dvfs; the
    dry runs, which need no root, read the user's own."""
    installed: set[str] = set()
    read_as_root = []
    for argv in _readme_shell_lines():
        sudo = argv[0] == "sudo"
        words = argv[1:] if sudo else argv
        if sudo and words[0] == "install" and "-o" in words:
            assert words[words.index("-o") + 1] == "root", argv
            installed.add(words[-1])
            continue
        if words[:3] == ["dvfs", "cap", "apply"]:
            path = next(w for w in words[3:] if not w.startswith("-"))
        elif words[:2] == ["dvfs", "govern"]:
            path = words[words.index("--plan") + 1]
        else:
            continue
        if sudo:
            read_as_root.append(path)
        else:
            assert "--dry-run" in words, argv  # only a dry run runs without root
    assert len(read_as_root) >= 2  # the caps recipe's and the governor's
    for path in read_as_root:
        assert path in installed and path.startswith("/etc/dvfs/"), path


def test_the_readme_says_how_to_run_a_virtualenvs_dvfs_with_sudo_where_it_first_does() -> None:
    """The README's `sudo dvfs ...` fails "sudo: dvfs: command not found" with dvfs in a
    virtualenv, as its own `pip install` puts it (sudo searches its secure_path, not PATH), and
    it never said so. Before the section of its first `sudo dvfs` ends, it says why and how:
    `sudo "$(command -v dvfs)" ...` or the venv's full path."""
    text = (REPO / "README.md").read_text()
    first = text.index("sudo dvfs ")
    start = text.rindex("\n## ", 0, first)
    end = text.index("\n## ", first)
    section = " ".join(text[start:end].split())
    assert "secure_path" in section and "command not found" in section, section[:200]
    assert 'sudo "$(command -v dvfs)" sweep' in section
    assert "sudo .venv/bin/dvfs" in section


def test_a_dry_run_refuses_a_folder_in_place_of_the_caps_records_lock_as_the_apply_does(
    nvml, tmp_path: Path
) -> None:
    """`cap apply` refuses (exit 1, changing nothing) a folder where the caps record's lock
    belongs; its dry run exited 0, saying it would apply. It refuses it too, in the apply's
    words, creating nothing."""
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    folder = state / "caps-applied.json.lock"
    folder.mkdir(parents=True)
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    real = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert real.exit_code == 1, real.output
    before = sorted(state.rglob("*"))
    dry = CliRunner().invoke(cli, ["cap", "apply", str(caps), "--dry-run"])
    said = " ".join(dry.output.split())
    assert dry.exit_code == 1, said
    assert said.startswith("Error: dry run, nothing changed: the apply would be refused: ")
    assert f"{folder} is unreadable (no regular file: a folder); remove it" in said
    assert "would apply" not in said
    assert sorted(state.rglob("*")) == before
    assert nvml.fake_device_state(0)["locked_clocks"] is None


def test_a_dry_run_refuses_a_lock_linked_into_a_missing_folder_as_the_apply_does(
    nvml, tmp_path: Path
) -> None:
    """A symlink in the place of the caps record's lock, to a file in a folder that is not
    there: the apply cannot make the lock and refuses (exit 1, changing nothing); its dry run
    exited 0, saying it would apply. It refuses it too, in the apply's words."""
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    lock = state / "caps-applied.json.lock"
    lock.symlink_to(tmp_path / "gone" / "caps.lock")
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    real = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    refusal = " ".join(real.output.split()).removeprefix("Error: ")
    assert real.exit_code == 1 and f"cannot open {lock}: no such file" in refusal, refusal
    dry = CliRunner().invoke(cli, ["cap", "apply", str(caps), "--dry-run"])
    said = " ".join(dry.output.split())
    assert dry.exit_code == 1, said
    assert said == "Error: dry run, nothing changed: the apply would be refused: " + refusal
    assert not (tmp_path / "gone").exists()
    assert nvml.fake_device_state(0)["locked_clocks"] is None


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("lock", ["link into a missing folder", "folder"])
def test_a_caps_record_lock_that_cannot_be_opened_names_a_gpu_fallen_off_the_bus_too(
    nvml, tmp_path: Path, lock: str, dry_run: bool
) -> None:
    """The caps record's lock that cannot be opened refuses the apply before any change: the
    refusal of a link into a missing folder (an OSError, said as it was raised) named no GPU
    fallen off the bus, nor did a dry run's of either, where the apply's of a folder did (the
    caps unit's journal said nothing of the lost GPU). Each names it now."""
    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(1, lost=True)
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    path = state / "caps-applied.json.lock"
    if lock == "folder":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "gone" / "caps.lock")
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps), *(["--dry-run"] * dry_run)])
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and said.startswith("Error: "), said
    assert "Traceback" not in said and f"{path}" in said, said
    assert said.endswith(
        "cannot open GPU 1: the GPU has fallen off the bus (NVML: GPU is lost); "
        "it needs a reset or a reboot before it can be used"
    ), said
    assert nvml.fake_device_state(0)["locked_clocks"] is None


@pytest.mark.parametrize("command", ["apply", "reset"])
@pytest.mark.parametrize(
    ("code", "remedy"),
    [
        ("EACCES", "let this user write that folder (check its owner and permissions)"),
        ("EROFS", "its file system is mounted read-only: make it writable"),
    ],
)
def test_a_gpu_lock_that_cannot_be_written_is_told_no_other_state_dir(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, code: str, remedy: str
) -> None:
    """A GPU's lock file in the state folder that cannot be written (a folder the caps unit's
    root without CAP_DAC_OVERRIDE may not write, a read-only file system) refused `cap apply`
    and `cap reset` with "check permissions or choose another --state-dir" ("another path"
    without --state-dir): another folder holds no other dvfs's locks, and `cap show`, sweeps
    and `cap reset` do not read the caps recorded there. Each now says the way on, in one line,
    nothing changed."""
    import errno

    uuid = nvml.fake_device_state(0)["uuid"]
    state = tmp_path / "state"
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    if command == "reset":
        invoke("cap", "apply", str(caps), "--state-dir", str(state))
    before = nvml.fake_device_state(0)["locked_clocks"]
    number, real = getattr(errno, code), os.open

    def unwritable(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).endswith(f"{uuid}.lock"):
            raise OSError(number, os.strerror(number), str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", unwritable)
    args = ["apply", str(caps)] if command == "apply" else ["reset"]
    result = CliRunner().invoke(cli, ["cap", *args, "--state-dir", str(state)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    [line] = result.stderr.splitlines()
    assert "choose another" not in line, line
    then = "then apply the caps again" if command == "apply" else "then run `dvfs cap reset"
    assert line.startswith(
        f"Error: cannot write {state / f'{uuid}.lock'}: {os.strerror(number).lower()}; "
        f"{remedy}, {then}"
    ), line
    assert nvml.fake_device_state(0)["locked_clocks"] == before


@pytest.mark.parametrize("lock", ["unwritable", "folder"])
def test_a_reset_refused_by_a_gpus_lock_names_a_gpu_fallen_off_the_bus_too(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lock: str
) -> None:
    """`cap reset` (the caps unit's stop) refused before any reset by a GPU's lock file (one it
    may not write, a folder in its place) named no GPU fallen off the bus, where `cap apply`
    refused by such a lock names it: it now does."""
    import errno

    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    invoke("cap", "apply", str(caps))
    nvml.fake_update_device(1, lost=True)
    path = Path(os.environ["DVFS_STATE_DIR"]) / f"{uuid}.lock"
    if lock == "folder":
        path.unlink()
        path.mkdir()
    else:
        real = os.open

        def unwritable(name, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(name) == str(path):
                raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(name))
            return real(name, *args, **kwargs)

        monkeypatch.setattr(os, "open", unwritable)
    result = CliRunner().invoke(cli, ["cap", "reset"])
    said = " ".join(result.output.split())
    assert result.exit_code in (1, 3) and "Traceback" not in said, said
    assert str(path) in said and said.endswith(
        "cannot open GPU 1: the GPU has fallen off the bus (NVML: GPU is lost); "
        "it needs a reset or a reboot before it can be used"
    ), said
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]


@pytest.mark.parametrize("name", ["caps-applied.json.lock", "governed-{uuid}.json"])
def test_a_folder_in_place_of_a_state_record_is_named_not_taken_for_a_bad_state_dir(
    nvml, tmp_path: Path, name: str
) -> None:
    """A folder where the caps record's lock or a governor record belongs was told "it is a
    folder, not a file; give a file's path for --state-dir", though --state-dir takes a
    folder: it is named as unreadable, to remove, as the records are. And it exits 1, as a
    damaged record does (README's exit codes): `cap apply`, `cap reset` and `govern` exited 2
    on it, bad usage, which the governor's unit is left failed on at once
    (RestartPreventExitStatus=2, "a bad plan"), while `cap show`, `monitor` and `gpu reset`
    exited 1 on the same folder in the same words."""
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    folder = state / name.format(uuid=uuid)
    folder.mkdir(parents=True)
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    (tmp_path / "plan.toml").write_text(
        'dvfs_batch_plan = 1\n[meta]\nmeasured_on = "NVIDIA H100 80GB HBM3"\ndrafter = "none"\n'
        "[[batch]]\nbatch = 1\nsm_clock_mhz = 1200\n"
    )
    governs = [a.format(tmp=tmp_path) for a in GOVERN] + ["--interval", "0.01"]
    failed = []
    for command in (
        ["cap", "apply", str(caps)],
        ["cap", "reset"],
        ["gpu", "reset"],
        [*governs, "--max-intervals", "1"],
    ):
        result = CliRunner().invoke(cli, command)
        said = " ".join(result.output.split())
        assert "give a file's path" not in said, (command, said)
        if result.exit_code:
            failed.append(command[:2])
            assert result.exit_code == 1, (command, said)
            assert isinstance(result.exception, SystemExit), (command, said)
            assert f"{folder} is unreadable (" in said, (command, said)
            assert "remove it" in said, (command, said)
        if command[1] == "apply" and name.startswith("caps-applied"):
            # and it changed no GPU it could not record (it had locked GPU 0's clocks first)
            assert nvml.fake_device_state(0)["locked_clocks"] is None
    # (the caps record's lock is opened by what writes the record; a governor record is
    # cleared by `cap reset` and the governor, read by `gpu reset`)
    assert failed == (
        [["cap", "apply"], ["cap", "reset"]]
        if name.startswith("caps-applied")
        else [["cap", "reset"], ["gpu", "reset"], ["govern", "--plan"]]
    ), failed


@pytest.mark.parametrize("clock_mhz", [None, 1500])
def test_doctor_says_what_the_sweep_does_with_a_power_cap_too(
    nvml, tmp_path: Path, clock_mhz: int | None
) -> None:
    """doctor's caps warning named only GPUs whose clocks `cap apply` locked, saying nothing of
    a power limit it left in force, and said the sweep's 'stock' then meant the capped
    setting, when the sweep measures its stock cells at unlocked clocks and the default power
    limit (the GPU's own stock). It now names each GPU's caps, power limit alone too, and says
    what the sweep does with them; observe-only, which changes nothing, measures under them."""
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    caps = tmp_path / "caps.toml"
    cap = GpuCap(uuid=uuid, sm_clock_max_mhz=clock_mhz, power_limit_w=500.0)
    write_caps(caps, cap)
    invoke("cap", "apply", str(caps))
    campaign = tmp_path / "c.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=8, repeats=1))
    out = tmp_path / "out"
    for extra in ([], ["--observe-only"]):
        checked = json.loads(invoke("doctor", str(campaign), "--out", str(out), "--json", *extra))
        said = {c["name"]: c for c in checked}["caps"]
        assert said["status"] == "warn", said
        assert "power limit 500 W" in said["detail"], said
        assert ("SM clock locked to 210-1500 MHz" in said["detail"]) == bool(clock_mhz), said
        if extra:
            assert "measured under them" in said["detail"], said
        else:
            assert "'stock' then means the capped setting" not in said["detail"], said
            assert "default power limit" in said["detail"], said
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000, "doctor changes nothing"


def test_doctor_without_root_reads_the_caps_record_the_sweep_reads(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep that changes knobs runs as root, reading dvfs's records in /var/lib/dvfs (the
    dry run without root reads those too, `records_dir`); doctor without root read the user's
    own state folder, which holds none: on a server of two GPUs, one under a power limit root's
    `cap apply` set, it failed 'stock' (500 W and 700 W), which the sweep and its dry run pass
    (a cap dvfs applied counts as the default), took dvfs's clock lock for one set outside
    dvfs, and named no caps. It now reads the records the sweep reads."""
    from dvfs.gpu import safety

    apply_caps(tmp_path, 1500, 500.0)  # as root, into $DVFS_STATE_DIR
    monkeypatch.setattr(safety, "ROOT_STATE_DIR", Path(os.environ["DVFS_STATE_DIR"]))
    monkeypatch.delenv("DVFS_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "user-state"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    campaign = tmp_path / "c.toml"
    text = NVML_CAMPAIGN.format(output_tokens=8, repeats=1)
    campaign.write_text(text.replace("devices = [0]", "devices = [0, 1]"))
    out = tmp_path / "out"
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate")
    assert "would stop" not in " ".join(dry.split()), dry
    # (exit 1: changing knobs needs root, the permissions check says)
    listed = json.loads(invoke("doctor", str(campaign), "--out", str(out), "--json", code=1))
    checked = {c["name"]: c for c in listed}
    assert checked["stock"]["status"] == "ok", checked["stock"]
    assert checked["held knobs GPU 0"]["status"] == "ok", checked["held knobs GPU 0"]
    assert "GPU 0 (SM clock locked to 210-1500 MHz" in checked["caps"]["detail"], checked
    failed = [c["name"] for c in listed if c["status"] == "fail"]
    assert failed == ["permissions"], failed


def test_a_state_file_in_a_symlink_loop_is_refused_not_taken_for_none(nvml, tmp_path: Path) -> None:
    """A GPU's state file that is a link in a loop was taken for no state file (`exists()` is
    False for it): `gpu reset` said "nothing to restore", exit 0, and `cap apply` capped the GPU,
    where any other unreadable state file refuses both, exit 3. It is refused alike now, and
    `cap reset` drops it as it drops any unreadable one."""
    uuid = json.loads(invoke("gpu", "list", "--json"))[0]["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    loop = state / f"{uuid}.json"
    loop.symlink_to(loop)
    result = CliRunner().invoke(cli, ["gpu", "reset"])
    assert result.exit_code == 3, result.output
    assert str(loop) in result.stderr and "symbolic links" in result.stderr, result.stderr
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert result.exit_code == 3, result.output
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert "the unreadable state" in invoke("cap", "reset")
    assert not loop.is_symlink()


def test_a_caps_record_in_a_symlink_loop_is_refused_not_taken_for_none(nvml) -> None:
    """The caps record (caps-applied.json) as a link in a loop: `cap show` said "no dvfs clock
    lock" for every GPU, exit 0, as if dvfs had capped none; it is unreadable, exit 1, as a
    damaged record is."""
    state = Path(os.environ["DVFS_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    loop = state / "caps-applied.json"
    loop.symlink_to(loop)
    result = CliRunner().invoke(cli, ["cap", "show"])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"Error: {loop} is unreadable"), result.stderr


@pytest.mark.parametrize("record", ["state file", "governor record"])
def test_cap_reset_refuses_a_folder_in_a_gpus_record_place_before_resetting_any(
    nvml, tmp_path: Path, record: str
) -> None:
    """A folder where GPU 1's state file (or governor record) goes: `cap reset` unlocked GPU 0,
    then stopped at GPU 1 ("give a file's path for path", or "remove it") with GPU 1 still
    capped and GPU 0's reset unsaid. As for an unreadable caps record, nothing is reset: one
    line names the folder, exit 1."""
    uuid = apply_caps(tmp_path, 1500, 450)
    other = json.loads(invoke("gpu", "list", "--json"))[1]["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    folder = state / (f"{other}.json" if record == "state file" else f"governed-{other}.json")
    folder.mkdir(parents=True)
    result = CliRunner().invoke(cli, ["cap", "reset"])
    assert result.exit_code == 1, result.output
    assert result.stderr == (
        f"Error: {folder} is unreadable (no regular file: a folder); nothing was reset: remove "
        "it, then reset again\n"
    )
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
    assert uuid in json.loads((state / "caps-applied.json").read_text())


@pytest.mark.parametrize("where", ["loop", "file"])
def test_gpu_reset_refuses_a_state_folder_it_cannot_reach_not_taken_for_none(
    nvml, tmp_path: Path, where: str
) -> None:
    """A state folder that is a link in a loop, or below a file, was taken for none (`exists()`
    is False for it): `gpu reset --state-dir DIR` said "nothing to restore", exit 0, as a
    state file in a loop did before 8885967. It is refused in one line naming the folder,
    before any GPU is touched, exit 1 as `cap show` and `monitor` refuse it (3 says a GPU
    holds changes or another dvfs uses it)."""
    if where == "loop":
        link = tmp_path / "state-link"
        link.symlink_to(link)
        folder = link / "dvfs"
    else:
        (tmp_path / "a-file").write_text("x")
        folder = tmp_path / "a-file" / "dvfs"
    for args in ((), ("0",)):
        result = CliRunner().invoke(cli, ["gpu", "reset", *args, "--state-dir", str(folder)])
        assert result.exit_code == 1, result.output
        [line] = result.stderr.splitlines()
        assert f"state folder {folder} is unreadable" in line, line
        assert "nothing to restore" not in result.output


@pytest.mark.parametrize("command", ["apply", "dry-run", "reset"])
def test_a_folder_in_place_of_a_gpus_lock_exits_1_not_as_a_gpu_in_use(
    nvml, tmp_path: Path, command: str
) -> None:
    """A folder in the place of a GPU's lock file in the state folder, which no running dvfs
    holds: `cap apply` (its dry run too) and `cap reset` exited 3, README's "another dvfs
    process uses it", though none does; a fault of the state folder, as a caps record's lock
    that is a folder is, it exits 1 in its own line, the GPU unchanged."""
    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    if command == "reset":
        invoke("cap", "apply", str(caps))
    before = nvml.fake_device_state(0)["locked_clocks"]
    path = Path(os.environ["DVFS_STATE_DIR"]) / f"{uuid}.lock"
    path.unlink(missing_ok=True)
    path.mkdir(parents=True)
    args = {"apply": ["apply", str(caps)], "dry-run": ["apply", str(caps), "--dry-run"]}
    result = CliRunner().invoke(cli, ["cap", *args.get(command, ["reset"])])
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert f"{path} is no regular file (a folder, a FIFO, a device), so no GPU lock" in line, line
    assert "in use by another dvfs" not in line and "Traceback" not in line, line
    # another --state-dir holds none of this folder's saved settings: the GPUs would stay capped
    assert "move it aside" in line and "another --state-dir" not in line, line
    assert nvml.fake_device_state(0)["locked_clocks"] == before


@pytest.mark.parametrize("command", ["apply", "dry-run", "reset"])
@pytest.mark.parametrize("link", ["dangling", "loop", "folder-name"])
def test_a_broken_link_in_place_of_a_gpus_lock_is_named_with_what_to_do(
    nvml, tmp_path: Path, command: str, link: str
) -> None:
    """A GPU's lock file that is a symbolic link to no file (its target gone) made `cap apply`
    say "cannot open X.lock: no such file or folder; check the path (does its folder
    exist?)", of a folder that exists, and its dry run "would apply"; a link in a loop "too
    many levels of symbolic links"; a link to a folder's name that is none ("x.lock/"), where
    the open makes no file, was "would apply" in the dry run. Each is named as the link it
    is, with what to do (remove it), exit 1 as a folder in the lock's place, the GPU
    unchanged."""
    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    if command == "reset":
        invoke("cap", "apply", str(caps))
    before = nvml.fake_device_state(0)["locked_clocks"]
    path = Path(os.environ["DVFS_STATE_DIR"]) / f"{uuid}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    targets = {"loop": path, "dangling": tmp_path / "gone" / "x.lock", "folder-name": "x.lock/"}
    path.symlink_to(targets[link])
    args = {"apply": ["apply", str(caps)], "dry-run": ["apply", str(caps), "--dry-run"]}
    result = CliRunner().invoke(cli, ["cap", *args.get(command, ["reset"])])
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert f"GPU lock file {path} is a symbolic link " in line, line
    said = {
        "loop": "in a loop",
        "dangling": "in a folder that does not exist",
        "folder-name": "to x.lock/, a folder's name that is no folder",
    }
    assert said[link] in line, line
    assert "remove the link" in line and "Traceback" not in line, line
    assert nvml.fake_device_state(0)["locked_clocks"] == before


@pytest.mark.parametrize("command", ["apply", "dry-run"])
def test_a_gpus_lock_linked_to_a_file_to_make_in_a_folder_there_is_used(
    nvml, tmp_path: Path, command: str
) -> None:
    """A GPU lock file that is a link to a file not there yet, in a folder that is: the apply
    makes the lock there (as it always did), so its dry run says it would apply, not that a
    link to no file refuses it."""
    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    path = Path(os.environ["DVFS_STATE_DIR"]) / f"{uuid}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "locks").mkdir()
    path.symlink_to(tmp_path / "locks" / "gpu0.lock")
    told = invoke("cap", "apply", str(caps), *(["--dry-run"] if command == "dry-run" else []))
    said = "dry run, nothing changed: would apply to GPU 0" if command == "dry-run" else "applied"
    assert said in told, told


@pytest.mark.skipif(os.geteuid() != 0, reason="the link check applies to root only")
@pytest.mark.parametrize("command", ["apply", "dry-run"])
def test_as_root_a_users_link_in_place_of_a_gpus_lock_is_refused_not_written_through(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """A shared state folder (1777, as /tmp) where a user put a link in place of a GPU's lock
    file: root's `cap apply` opened its target to lock it, made it 0644, cut it and wrote its
    pid there (any root file: /etc/shadow made readable by all), and its dry run said "would
    apply". Both refuse it in one line, exit 1, as a lock in a loop, the target and the GPU
    unchanged."""
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    state = tmp_path / "shared-state"
    state.mkdir()
    state.chmod(0o1777)
    monkeypatch.setenv("DVFS_STATE_DIR", str(state))
    secret = tmp_path / "shadow"
    secret.write_text("root's\n")
    secret.chmod(0o600)
    lock = state / f"{uuid}.lock"
    lock.symlink_to(secret)
    os.chown(lock, nobody, nobody, follow_symlinks=False)
    before = nvml.fake_device_state(0)["locked_clocks"]
    dry = ["--dry-run"] if command == "dry-run" else []
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps), *dry])
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert f"GPU lock file {lock} goes through the symbolic link {lock}, owned by nobody" in line
    assert "remove the link" in line and "Traceback" not in line, line
    assert secret.read_text() == "root's\n" and secret.stat().st_mode & 0o7777 == 0o600
    assert nvml.fake_device_state(0)["locked_clocks"] == before


@pytest.mark.skipif(os.geteuid() != 0, reason="the link check applies to root only")
@pytest.mark.parametrize("command", ["apply", "dry-run"])
def test_as_root_a_users_link_in_place_of_the_caps_records_lock_is_refused(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """A user's link in a shared state folder (1777) in place of the caps record's lock, to a
    file to be made in a folder of theirs: root's `cap apply` made the lock there (theirs to
    remove while held, so that two applies wrote the record at once) and its dry run said
    "would apply". Both refuse it in one line, exit 1, before any GPU is changed."""
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    state, theirs = tmp_path / "shared-state", tmp_path / "theirs"
    state.mkdir()
    state.chmod(0o1777)
    theirs.mkdir()
    os.chown(theirs, nobody, nobody)
    monkeypatch.setenv("DVFS_STATE_DIR", str(state))
    lock = state / "caps-applied.json.lock"
    lock.symlink_to(theirs / "record.lock")
    os.chown(lock, nobody, nobody, follow_symlinks=False)
    before = nvml.fake_device_state(0)["locked_clocks"]
    dry = ["--dry-run"] if command == "dry-run" else []
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps), *dry])
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert f"caps record lock {lock} goes through the symbolic link {lock}, owned by nobody" in line
    assert "remove the link" in line and "Traceback" not in line, line
    assert not (theirs / "record.lock").exists()
    assert nvml.fake_device_state(0)["locked_clocks"] == before


@pytest.mark.parametrize(
    ("written", "said"),
    [('"1"', 'dvfs_caps = "1"'), ("2", "dvfs_caps = 2"), ("true", "dvfs_caps = true")],
)
def test_a_caps_file_of_another_schema_is_refused_as_written_with_the_way_on(
    nvml, tmp_path: Path, written: str, said: str
) -> None:
    """`dvfs_caps = "1"` (quoted by hand) was refused "caps schema 1 is not 1", a line that
    contradicts itself, and any other schema with no way on; `dvfs_caps = true` was taken for
    schema 1. Each is refused, exit 2, in one line that quotes the value as written and says to
    plan the file again with this dvfs."""
    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(f'dvfs_caps = {written}\n[[gpu]]\nuuid = "{uuid}"\nsm_clock_max_mhz = 1500\n')
    for args in (("--dry-run",), ()):
        result = CliRunner().invoke(cli, ["cap", "apply", str(caps), *args])
        assert result.exit_code == 2, result.output
        [line] = result.stderr.strip().splitlines()
        assert f"caps schema {said} is not 1; write it again with this dvfs's `dvfs cap plan" in (
            line
        ), line
    assert nvml.fake_device_state(0)["locked_clocks"] is None


def test_a_gpu_a_new_caps_file_leaves_out_is_said_to_keep_an_earlier_files_caps(
    nvml, tmp_path: Path
) -> None:
    """/etc/dvfs/caps.toml edited to cap GPU 0 only, then applied again: GPU 1 keeps the caps
    the earlier file put on it (by dvfs's record, as `cap show` says), but the note said "it was
    left as it is (to cap it, `dvfs cap plan` ...)", as of a GPU never capped: the operator who
    dropped its entry to uncap it was told to plan caps it holds. The note says it keeps them
    and the `dvfs cap reset N` that removes them, which does, pasted as printed."""
    [first, second] = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    caps = tmp_path / "caps.toml"
    write_caps(
        caps,
        GpuCap(uuid=first, sm_clock_max_mhz=1500),
        GpuCap(uuid=second, sm_clock_max_mhz=1200, power_limit_w=450.0),
    )
    invoke("cap", "apply", str(caps))
    write_caps(caps, GpuCap(uuid=first, sm_clock_max_mhz=1500))
    for args in (("--dry-run",), ()):
        result = CliRunner().invoke(cli, ["cap", "apply", str(caps), *args])
        assert result.exit_code == 0, result.output
        said = " ".join(result.stderr.split())
        assert f"has no entry for GPU 1 (NVIDIA H100 80GB HBM3, {second}), capped to SM" in said
        assert "SM clock locked 210-1200 MHz, power limit 450 W from" in said, said
        keeps = "would keep" if args else "keeps"
        assert f"it {keeps} the caps an earlier `dvfs cap apply` put on it (`dvfs cap reset " in (
            said
        ), said
        assert "to cap it" not in said, said
    assert nvml.fake_device_state(1)["locked_clocks"] == [210, 1200]
    [reset] = re.findall(r"`(dvfs cap reset --applied 1[^`]*)`", said)
    invoke(*shlex.split(reset)[1:])
    assert nvml.fake_device_state(1)["locked_clocks"] is None
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]  # the file's, kept
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])  # nothing recorded on it now
    assert "it was left as it is (to cap it, `dvfs cap plan`" in " ".join(result.stderr.split())


def test_cap_reset_of_a_gpu_with_mig_says_why_it_is_left_and_how_to_reset_it(
    nvml, tmp_path: Path
) -> None:
    """`dvfs cap reset 1`, GPU 1 with MIG enabled, was refused in the sweep's words ("NVML
    measures energy and power per GPU, not per MIG slice ... choose another GPU"), though a
    reset measures nothing and `dvfs gpu reset --defaults 1` resets it. The line says `cap
    apply` never caps such a GPU, so `cap reset` leaves it (no GPU reset, exit 2, as a GPU not
    here), and gives the `dvfs gpu reset --defaults` that resets it, which does, pasted."""
    nvml.fake_update_device(0, locked_clocks=[210, 1500])
    nvml.fake_update_device(1, mig=True, locked_clocks=[210, 1200], power_limit_mw=500_000)
    for named in (["1"], ["0", "1"]):
        result = CliRunner().invoke(cli, ["cap", "reset", *named])
        assert result.exit_code == 2, result.output
        [line] = result.stderr.strip().splitlines()
        said = " ".join(line.split())
        assert said.startswith(f"Error: GPU 1 ({nvml.fake_device_state(1)['uuid']}) has MIG"), said
        assert "never caps a GPU with MIG enabled" in said and "reset no GPU" in said, said
        assert "per MIG slice" not in said and "choose another GPU" not in said, said
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]  # as said: none reset
    [command] = re.findall(r"`(dvfs gpu reset --defaults[^`]*)`", said)
    assert command.endswith(" 1"), command
    invoke(*shlex.split(command)[1:])
    assert nvml.fake_device_state(1)["locked_clocks"] is None
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000


def test_the_caps_units_stop_resets_only_what_its_start_applied(nvml, tmp_path: Path) -> None:
    """dvfs-caps.service's `ExecStop=dvfs cap reset` reset every GPU: `systemctl restart
    dvfs-caps` (the README's way to apply an edited file) undid a clock lock and power limit
    an operator set with nvidia-smi on a GPU the caps file never names, and the power limit
    they set on a GPU whose clock alone the file caps. The unit's stop, `cap reset --applied`,
    puts back only what dvfs's caps record says `cap apply` set, and names the GPU it left."""
    unit = (REPO / "systemd" / "dvfs-caps.service").read_text()
    [start] = re.findall(r"^ExecStart=/usr/local/bin/dvfs (.*)$", unit, re.M)
    [stop] = re.findall(r"^ExecStop=/usr/local/bin/dvfs (.*)$", unit, re.M)
    [first, second] = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's, on the capped GPU
    nvml.fake_update_device(1, power_limit_mw=500_000, locked_clocks=[210, 1600])
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=first, sm_clock_max_mhz=1500))
    invoke(*shlex.split(start.replace("/etc/dvfs/caps.toml", str(caps))))
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
    result = CliRunner().invoke(cli, shlex.split(stop))
    assert result.exit_code == 0, result.output
    assert nvml.fake_device_state(0)["locked_clocks"] is None  # dvfs's lock: gone
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000
    assert nvml.fake_device_state(1)["locked_clocks"] == [210, 1600]
    assert nvml.fake_device_state(1)["power_limit_mw"] == 500_000
    assert f"GPU 0 ({first}): clocks unlocked, power limit left as it is" in result.output
    said = " ".join(result.stderr.split())
    assert f"GPU 1 ({second}) holds no caps dvfs's caps record lists: left as it is" in said
    # a power limit dvfs set goes back to the one it replaced; a plain reset resets every GPU
    write_caps(caps, GpuCap(uuid=first, power_limit_w=450.0))
    invoke(*shlex.split(start.replace("/etc/dvfs/caps.toml", str(caps))))
    invoke(*shlex.split(stop))
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000
    assert nvml.fake_device_state(1)["power_limit_mw"] == 500_000
    invoke("cap", "reset")
    assert nvml.fake_device_state(1)["locked_clocks"] is None
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000


def test_a_state_folder_with_braces_in_its_name_is_named_in_the_kept_caps_note(
    nvml, tmp_path: Path
) -> None:
    """`cap apply --state-dir 'st{x}'` with a GPU that keeps an earlier file's caps failed
    "internal error: KeyError: 'x'" once the caps were applied (the note's reset command was a
    template formatted with the folder in it): the note names the folder as it is, pasted."""
    [first, second] = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    state = tmp_path / "st{x}"
    caps = tmp_path / "caps.toml"
    write_caps(
        caps, GpuCap(uuid=first, sm_clock_max_mhz=1500), GpuCap(uuid=second, power_limit_w=450.0)
    )
    invoke("cap", "apply", str(caps), "--state-dir", str(state))
    write_caps(caps, GpuCap(uuid=first, sm_clock_max_mhz=1500))
    for args in (("--dry-run",), ()):
        result = CliRunner().invoke(
            cli, ["cap", "apply", str(caps), "--state-dir", str(state), *args]
        )
        assert result.exit_code == 0, result.output
        said = " ".join(result.stderr.split())
        [reset] = re.findall(r"`(dvfs cap reset --applied 1[^`]*)`", said)
    assert shlex.split(reset)[-2:] == ["--state-dir", str(state)], reset
    invoke(*shlex.split(reset)[1:])
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000


def test_the_reset_a_kept_caps_note_names_removes_dvfs_caps_alone(nvml, tmp_path: Path) -> None:
    """A GPU an earlier caps file capped to a power limit only, whose clock an operator locked
    with nvidia-smi, keeps that power limit once a new file leaves it out; the note's `dvfs cap
    reset 1` removed it and the operator's clock lock too. The reset it names, pasted, removes
    the caps dvfs's record lists alone."""
    [first, second] = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    nvml.fake_update_device(1, locked_clocks=[210, 1600])  # the operator's
    caps = tmp_path / "caps.toml"
    write_caps(
        caps, GpuCap(uuid=first, sm_clock_max_mhz=1500), GpuCap(uuid=second, power_limit_w=450.0)
    )
    invoke("cap", "apply", str(caps))
    write_caps(caps, GpuCap(uuid=first, sm_clock_max_mhz=1500))
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert result.exit_code == 0, result.output
    [reset] = re.findall(r"`(dvfs cap reset[^`]*)`", " ".join(result.stderr.split()))
    invoke(*shlex.split(reset)[1:])
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000  # dvfs's cap: gone
    assert nvml.fake_device_state(1)["locked_clocks"] == [210, 1600]
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]


def test_the_caps_units_stop_puts_back_the_power_limit_dvfs_replaced(nvml, tmp_path: Path) -> None:
    """`cap reset --applied` (the caps unit's stop) put a power limit dvfs set back to the
    GPU's default, 700 W, not to the 600 W an operator had set before `cap apply` capped it to
    450 W: `systemctl restart dvfs-caps` raised the operator's limit. `cap apply` records the
    limit each cap replaces (an earlier apply's cap's own replaced one, re-applying), and the
    stop puts that back; a limit set outside dvfs since the cap is left be, said so; a record an
    older dvfs wrote, without it, still goes back to the default, saying why."""
    unit = (REPO / "systemd" / "dvfs-caps.service").read_text()
    [start] = re.findall(r"^ExecStart=/usr/local/bin/dvfs (.*)$", unit, re.M)
    [stop] = re.findall(r"^ExecStop=/usr/local/bin/dvfs (.*)$", unit, re.M)
    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's, before dvfs
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0))
    started = shlex.split(start.replace("/etc/dvfs/caps.toml", str(caps)))
    invoke(*started)
    invoke(*started)  # applied again over its own cap: 600 W is still the one it replaced
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    for _ in range(2):  # `systemctl restart dvfs-caps`, then its stop
        said = invoke(*shlex.split(stop))
        assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000, said
        assert f"GPU 0 ({uuid}): clocks left as they are (dvfs locked none), power limit " in said
        assert "power limit 600 W (as before `dvfs cap apply`)" in said, said
        invoke(*started)
    nvml.fake_update_device(0, power_limit_mw=550_000)  # the operator's, over dvfs's cap
    said = " ".join(invoke(*shlex.split(stop)).split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 550_000
    assert "power limit left at 550 W (set outside dvfs since `dvfs cap apply` set 450 W)" in said
    invoke(*started)
    nvml.fake_update_device(0, power_limit_mw=500_000)  # the operator's again, then applied over
    invoke(*started)
    said = invoke(*shlex.split(stop))
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000, said  # theirs, not 550 W
    invoke(*started)
    # a reset that put the limit back and stopped before it dropped the entry: said as put back
    nvml.fake_update_device(0, power_limit_mw=500_000)
    said = " ".join(invoke(*shlex.split(stop)).split())
    assert "power limit 500 W (as before `dvfs cap apply`)" in said, said
    invoke(*started)
    record = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"
    entries = json.loads(record.read_text())
    del entries[uuid]["power_limit_before_mw"]  # as an older dvfs wrote it
    record.write_text(json.dumps(entries))
    said = " ".join(invoke(*shlex.split(stop)).split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000
    older = "power limit 700 W (default: the caps record, written by an older dvfs, does not say"
    assert older in said, said


def test_a_signal_between_a_cap_and_its_record_leaves_the_cap_recorded(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`systemctl stop dvfs-caps` (SIGTERM) landing in `cap apply` after NVML set a GPU's
    power limit but before the caps record listed it left the cap on the GPU unrecorded: the
    stop's `cap reset --applied` then said "power limit left as it is (dvfs set none)" and left
    450 W on it, and `cap show` did not count it dvfs's. A signal there is held until the record
    is written: the apply stops (exit 143), its cap recorded, and the reset puts back 600 W."""
    import signal

    from dvfs.caps import AppliedCaps

    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0))
    update = AppliedCaps.update

    def signalled(self: AppliedCaps, gpu: str, entry: dict | None) -> None:
        if entry and entry.get("power_limit_mw"):
            os.kill(os.getpid(), signal.SIGTERM)  # the stop, just after the limit was set
        update(self, gpu, entry)

    monkeypatch.setattr(AppliedCaps, "update", signalled)
    stopped = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    monkeypatch.setattr(AppliedCaps, "update", update)
    assert stopped.exit_code == 143, stopped.output
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    said = " ".join(invoke("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000, said
    assert "power limit 600 W (as before `dvfs cap apply`)" in said, said


def test_the_caps_units_stop_puts_back_the_default_for_a_replaced_limit_out_of_range(
    nvml, tmp_path: Path
) -> None:
    """A caps record naming a replaced power limit outside the GPU's range now (edited by hand,
    or another driver's range) made `cap reset --applied`, the caps unit's stop, ask NVML for it:
    refused, exit 1, on every stop, the GPU left at dvfs's cap. It puts back the default, said
    why."""
    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0))
    invoke("cap", "apply", str(caps))
    record = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"
    entries = json.loads(record.read_text())
    entries[uuid]["power_limit_before_mw"] = 100_000  # below the fake H100's 200 W minimum
    record.write_text(json.dumps(entries))
    said = " ".join(invoke("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000, said
    assert (
        "power limit 700 W (default: the limit the caps record says dvfs's cap replaced, 100 W, "
        "is outside this GPU's range 200-700 W now)"
    ) in said, said
    assert not record.exists() or uuid not in json.loads(record.read_text())  # dropped


def test_a_file_leaving_the_power_limit_at_stock_puts_back_the_one_dvfs_replaced(
    nvml, tmp_path: Path
) -> None:
    """A caps file with no power limit for a GPU, applied over an earlier dvfs cap of 450 W
    that replaced an operator's 600 W, set the GPU's default, 700 W, and dropped the record's
    600 W: the operator's limit was lost, and `cap reset --applied` left 700 W. The apply puts
    back the limit dvfs's cap replaced, as `cap reset --applied` does, so the two agree; one
    set outside dvfs since the cap is left be, as the reset leaves it."""
    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's, before dvfs
    caps = tmp_path / "caps.toml"
    capped = dump_caps(CapsFile((GpuCap(uuid=uuid, sm_clock_max_mhz=1500, power_limit_w=450.0),)))
    caps.write_text(capped)
    invoke("cap", "apply", str(caps))
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    dry = " ".join(invoke("cap", "apply", str(caps), "--dry-run").split())
    assert "power limit 600 W (as before `dvfs cap apply`), none in this file" in dry, dry
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    said = " ".join(invoke("cap", "apply", str(caps)).split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000, said
    assert "power limit 600 W (as before `dvfs cap apply`), none in this file" in said, said
    said = " ".join(invoke("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000, said
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    # one the operator set over dvfs's cap since is theirs: left be, by both
    caps.write_text(capped)
    invoke("cap", "apply", str(caps))
    nvml.fake_update_device(0, power_limit_mw=550_000)
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    said = " ".join(invoke("cap", "apply", str(caps)).split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 550_000, said
    assert "power limit left at 550 W (set outside dvfs since `dvfs cap apply` set 450 W)" in said
    invoke("cap", "reset", "--applied")
    assert nvml.fake_device_state(0)["power_limit_mw"] == 550_000


def test_a_signal_stopping_a_limit_change_over_dvfs_cap_keeps_that_cap_dvfs(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`systemctl stop dvfs-caps` (SIGTERM) ending `cap apply`'s change of a GPU's power limit
    from dvfs's earlier cap, 500 W, to 450 W before it landed recorded 450 W alone: the GPU
    kept 500 W, which `cap reset --applied` then took for an operator's ("set outside dvfs
    since") and left on it, and the next apply took for the limit before dvfs. The record names
    both dvfs's (`power_limit_earlier_mw`), so the reset puts back the operator's 600 W, and a
    sweep measures stock at the default, not at the earlier cap."""
    import signal

    from dvfs.caps import AppliedCaps
    from dvfs.gpu.nvml import open_nvml_gpus

    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's, before dvfs
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=500.0))
    invoke("cap", "apply", str(caps))
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0))

    def stopped(handle: object, limit_mw: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the stop, in NVML's call: it never lands

    real = nvml.nvmlDeviceSetPowerManagementLimit
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "0")  # NVML called in this thread, which the
    # signal interrupts
    monkeypatch.setattr(nvml, "nvmlDeviceSetPowerManagementLimit", stopped)
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    monkeypatch.setattr(nvml, "nvmlDeviceSetPowerManagementLimit", real)
    assert result.exit_code == 143, result.output
    assert nvml.fake_device_state(0)["power_limit_mw"] == 500_000  # dvfs's earlier cap
    # a sweep meanwhile takes it for dvfs's cap too, not for the operator's stock
    with open_nvml_gpus([0], nvml=nvml) as gpus:
        knobs = AppliedCaps(Path(os.environ["DVFS_STATE_DIR"])).measuring(gpus)
        assert knobs.read_stock()[uuid].power_limit_mw == 700_000  # the GPU's own stock
    said = " ".join(invoke("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000, said
    assert "power limit 600 W (as before `dvfs cap apply`)" in said, said


def test_a_damaged_replaced_limit_names_its_gpu_and_honours_the_rest_of_the_record(
    nvml, tmp_path: Path
) -> None:
    """A caps record whose power_limit_before_mw for one GPU was damaged ("600 W", by hand)
    refused the whole record: `cap show`, `cap apply` and sweeps failed for every GPU, telling
    the operator to remove it (losing the other GPUs' replaced limits too). The other GPUs'
    entries, and that GPU's caps, are honoured; the damaged one is named in a warning with
    what to do, and `cap reset --applied` puts back its default, saying why."""
    [first, second] = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    nvml.fake_update_device(0, power_limit_mw=600_000)
    nvml.fake_update_device(1, power_limit_mw=650_000)
    caps = tmp_path / "caps.toml"
    both = tuple(
        GpuCap(uuid=u, sm_clock_max_mhz=1500, power_limit_w=450.0) for u in (first, second)
    )
    caps.write_text(dump_caps(CapsFile(both)))
    invoke("cap", "apply", str(caps))
    record = Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json"
    entries = json.loads(record.read_text())
    entries[first]["power_limit_before_mw"] = "600 W"
    record.write_text(json.dumps(entries))
    warning = (
        f"warning: dvfs's caps record {record} is damaged for GPU 0 ({first}): "
        'power_limit_before_mw is "600 W", expected the power limit in mW'
    )
    for command in (["cap", "show", "--json"], ["cap", "apply", str(caps), "--dry-run"]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 0, result.output
        assert warning in result.stderr and "write that limit in mW there" in result.stderr
        assert "Error" not in result.output
    shown = json.loads(CliRunner().invoke(cli, ["cap", "show", "--json"]).stdout)
    assert [r["sm_clock_lock_mhz"] for r in shown] == [[210, 1500], [210, 1500]]
    said = " ".join(invoke("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(1)["power_limit_mw"] == 650_000, said  # honoured
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000, said
    assert (
        "power limit 700 W (default: the caps record's limit dvfs's cap replaced, \"600 W\", "
        "is no power limit in mW)"
    ) in said, said
    assert not record.exists()


def test_the_caps_units_stop_after_a_dead_sweep_puts_back_what_that_sweep_found(
    nvml, tmp_path: Path
) -> None:
    """`cap reset --applied` (the caps unit's stop) on a GPU a killed `dvfs sweep` left a state
    file on reset it whole: the default power limit, 700 W, over the operator's 600 W, which the
    state file says the sweep found and which dvfs never capped (it locked the clock only).
    The power limit goes back to what the sweep found, or, where that was dvfs's cap, to the
    one that cap replaced; the clock is unlocked (NVML cannot read back a lock the sweep may
    have set, and the one it found was dvfs's)."""
    from dvfs.gpu.knobs import GpuSettings

    uuid = nvml.fake_device_state(0)["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    invoke("cap", "apply", str(caps))
    # a `dvfs sweep` killed with SIGKILL: its state file holds what it found, the GPU its cell
    StateStore(state, command="sweep").record(GpuSettings(uuid, (210, 1500), 600_000))
    nvml.fake_update_device(0, locked_clocks=[210, 900], power_limit_mw=400_000)
    said = " ".join(invoke("cap", "reset", "--applied").split())
    device = nvml.fake_device_state(0)
    assert device["power_limit_mw"] == 600_000, said
    assert device["locked_clocks"] is None, said
    assert "clocks unlocked, power limit 600 W (as the dead dvfs run found it)" in said, said
    assert "'sweep'" in said and not StateStore(state).pending()
    # dvfs's own power cap, found by the sweep: the limit that cap replaced goes back
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0))
    invoke("cap", "apply", str(caps))
    StateStore(state, command="sweep").record(GpuSettings(uuid, None, 450_000))
    nvml.fake_update_device(0, locked_clocks=[210, 900], power_limit_mw=300_000)
    said = " ".join(invoke("cap", "reset", "--applied").split())
    device = nvml.fake_device_state(0)
    assert device["power_limit_mw"] == 600_000, said
    assert device["locked_clocks"] is None, said
    assert "power limit 600 W (as before `dvfs cap apply`)" in said, said


def test_the_caps_units_stop_names_the_gpu_reset_a_dead_runs_gpu_without_caps_needs(
    nvml, tmp_path: Path
) -> None:
    """`cap reset --applied` leaves a GPU the caps record lists no caps on, as it should (not
    dvfs's), but one a killed `dvfs sweep` left changed, its state file beside the record, was
    only said to "hold no caps", its advice `dvfs cap reset N` (every knob to the default, not
    what that run found). The note names the `dvfs gpu reset N` that puts that back."""
    from dvfs.gpu.knobs import GpuSettings

    [first, second] = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    state = Path(os.environ["DVFS_STATE_DIR"])
    write_caps(tmp_path / "caps.toml", GpuCap(uuid=first, sm_clock_max_mhz=1500))
    invoke("cap", "apply", str(tmp_path / "caps.toml"))
    StateStore(state, command="sweep").record(GpuSettings(second, None, 600_000))
    nvml.fake_update_device(1, locked_clocks=[210, 900], power_limit_mw=400_000)
    said = " ".join(invoke("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(1)["power_limit_mw"] == 400_000, said  # left, not dvfs's cap
    reset = f"dvfs gpu reset 1 --state-dir {shlex.quote(str(state))}"
    assert f"GPU 1 holds a state file a dead dvfs run left: `{reset}`" in said, said
    invoke(*shlex.split(reset)[1:])  # as advised
    assert nvml.fake_device_state(1)["power_limit_mw"] == 600_000
    assert nvml.fake_device_state(1)["locked_clocks"] is None


def test_the_caps_units_stop_after_a_dead_run_that_read_no_power_limit(
    nvml, tmp_path: Path
) -> None:
    """A dead run's state file with no power limit (null: none read when it started) on a GPU
    dvfs locked the clock of only: `cap reset --applied` failed on the record's null power
    limit (a TypeError); the state file telling no limit, the default goes back, as `cap reset`
    puts it."""
    from dvfs.gpu.knobs import GpuSettings

    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    invoke("cap", "apply", str(caps))
    StateStore(Path(os.environ["DVFS_STATE_DIR"]), command="sweep").record(
        GpuSettings(uuid, (210, 1500), None)
    )
    nvml.fake_update_device(0, locked_clocks=[210, 900], power_limit_mw=400_000)
    said = " ".join(invoke("cap", "reset", "--applied").split())
    assert "clocks unlocked, power limit 700 W (default)" in said, said
    device = nvml.fake_device_state(0)
    assert device["locked_clocks"] is None and device["power_limit_mw"] == 700_000


def test_the_caps_units_stop_goes_by_the_record_beside_an_earlier_boots_state_file(
    nvml, tmp_path: Path
) -> None:
    """A state file from before the last reboot (which reset the GPU) on a GPU dvfs locked the
    clock of only made `cap reset --applied` reset it whole, to the default power limit over
    the operator's 600 W set since the boot: the file tells nothing of this boot's GPU, so the
    reset goes by dvfs's caps record alone, and drops it, saying why."""
    from dvfs.gpu.knobs import GpuSettings

    uuid = nvml.fake_device_state(0)["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's, this boot
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, sm_clock_max_mhz=1500))
    invoke("cap", "apply", str(caps))
    store = StateStore(state, command="sweep")
    store.record(GpuSettings(uuid, None, 300_000))
    earlier = {**json.loads(store.path(uuid).read_text()), "boot": "an-earlier-boot"}
    store.path(uuid).write_text(json.dumps(earlier))
    said = " ".join(invoke("cap", "reset", "--applied").split())
    device = nvml.fake_device_state(0)
    assert device["power_limit_mw"] == 600_000 and device["locked_clocks"] is None, said
    assert "clocks unlocked, power limit left as it is (dvfs set none)" in said, said
    assert "dropped, from before the last reboot, which reset the GPU" in said, said
    assert not store.path(uuid).exists()


def test_a_damaged_earlier_cap_is_warned_of_as_what_it_is(nvml, tmp_path: Path) -> None:
    """A damaged power_limit_earlier_mw ("500 W", by hand) was warned of as the limit dvfs's
    cap replaced, saying `cap reset --applied` puts back the default and to write there the
    limit the GPU had before dvfs (which would make that limit pass for dvfs's cap): the reset
    puts back the replaced 600 W all the same. Each damaged key is warned of as what it is, a
    damaged value next to no power limit dvfs set as unused, and the reset named runs on the
    record's folder (--state-dir, which `sudo` needs: it drops $DVFS_STATE_DIR)."""
    [first, second] = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    state = Path(os.environ["DVFS_STATE_DIR"])
    nvml.fake_update_device(0, power_limit_mw=600_000)
    caps = tmp_path / "caps.toml"
    write_caps(
        caps, GpuCap(uuid=first, power_limit_w=450.0), GpuCap(uuid=second, sm_clock_max_mhz=1500)
    )
    invoke("cap", "apply", str(caps))
    record = state / "caps-applied.json"
    entries = json.loads(record.read_text())
    entries[first]["power_limit_earlier_mw"] = "500 W"
    entries[second]["power_limit_before_mw"] = "650 W"  # beside no power limit dvfs set
    record.write_text(json.dumps(entries))
    result = CliRunner().invoke(cli, ["cap", "show"])
    assert result.exit_code == 0, result.output
    warned = " ".join(result.stderr.split())
    reset = f"`dvfs cap reset --applied --state-dir {state}`"
    assert (
        f'damaged for GPU 0 ({first}): power_limit_earlier_mw is "500 W", expected the power '
        "limit in mW of dvfs's earlier cap, which a stopped `dvfs cap apply` may have left on "
        "the GPU, or null; its caps are honoured, but that earlier cap, where the GPU holds it, "
        f"is taken for a limit set outside dvfs, which {reset} leaves be: write that earlier "
        "cap in mW there"
    ) in warned, warned
    assert (
        f'damaged for GPU 1 ({second}): power_limit_before_mw is "650 W", but it lists no power '
        "limit dvfs set on that GPU, so the value is not used: write null there"
    ) in warned, warned
    assert "puts back its default" not in warned, warned
    said = " ".join(invoke("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000, said  # not the default
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000, said
    assert "GPU 1" in said and "power limit left as it is (dvfs set none)" in said, said


@pytest.mark.parametrize("damaged", [500_000.0, True, [500_000]])
def test_a_damaged_earlier_cap_equal_to_the_gpus_limit_is_left_be_as_warned(
    nvml, tmp_path: Path, damaged: object
) -> None:
    """A power_limit_earlier_mw hand-edited to 500000.0 (or true, on a GPU whose limit read
    1 mW) is warned of as damaged, "taken for a limit set outside dvfs, which reset leaves be",
    yet it passed for dvfs's earlier cap by Python's 500000 == 500000.0: `cap reset --applied`
    put back the replaced 600 W over the GPU's 500 W. It is left be, as warned."""
    uuid = nvml.fake_device_state(0)["uuid"]
    state = Path(os.environ["DVFS_STATE_DIR"])
    nvml.fake_update_device(0, power_limit_mw=600_000)
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0))
    invoke("cap", "apply", str(caps))
    record = state / "caps-applied.json"
    entries = json.loads(record.read_text())
    entries[uuid]["power_limit_earlier_mw"] = damaged
    record.write_text(json.dumps(entries))
    held = 1 if damaged is True else 500_000
    nvml.fake_update_device(0, power_limit_mw=held)
    result = CliRunner().invoke(cli, ["cap", "show"])
    assert result.exit_code == 0, result.output
    assert "is taken for a limit set outside dvfs" in " ".join(result.stderr.split())
    said = " ".join(invoke("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == held, said
    assert "set outside dvfs since" in said, said


def test_a_limit_change_past_its_deadline_is_recorded_as_one_that_may_land(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cap apply`'s power-limit change whose NVML call overran its deadline (a driver not
    responding) was not recorded, yet the driver may finish the stuck call once it answers
    again (`dvfs.gpu.deadline`): the GPU then held dvfs's 450 W with no record of it, which
    `cap reset --applied` (the caps unit's stop) left on it as a limit dvfs never set, and
    sweeps took for the GPU's stock. It is recorded as one a signal ended: the reset puts back
    the operator's 600 W, whether the call landed or not."""
    import threading

    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's, before dvfs
    caps = tmp_path / "caps.toml"
    write_caps(caps, GpuCap(uuid=uuid, power_limit_w=450.0))
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "0.2")
    monkeypatch.setenv("DVFS_FAKE_NVML_HANG", "nvmlDeviceSetPowerManagementLimit=inf")
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert result.exit_code == 1, result.output
    assert "nvmlDeviceSetPowerManagementLimit on GPU 0" in result.output, result.output
    monkeypatch.delenv("DVFS_FAKE_NVML_HANG")
    nvml.fake_release_hangs()
    for worker in threading.enumerate():  # the stuck call let go, and ended, before going on
        if worker.name.startswith("nvml-"):
            worker.join()
    entry = json.loads((Path(os.environ["DVFS_STATE_DIR"]) / "caps-applied.json").read_text())
    assert entry[uuid]["power_limit_mw"] == 450_000, entry
    assert entry[uuid]["power_limit_before_mw"] == 600_000, entry
    nvml.fake_update_device(0, power_limit_mw=450_000)  # the driver finished the stuck call
    said = " ".join(invoke("cap", "reset", "--applied").split())
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000, said
    assert "power limit 600 W (as before `dvfs cap apply`)" in said, said


def test_a_sweeps_refusal_of_a_damaged_clock_lock_names_the_reset_that_keeps_the_limit(
    nvml, tmp_path: Path
) -> None:
    """A sweep refuses a caps record whose clock lock is damaged, naming the reset that drops
    that GPU's entry alone: it named `dvfs cap reset UUID`, which puts back the default power
    limit (700 W) over the operator's 600 W that dvfs's 450 W cap replaced, though the limit
    is known. It names `dvfs cap reset --applied UUID`, as `cap show`'s warning does: the
    clock unlocked, the 600 W put back, the entry dropped, and the sweep runs."""
    uuid = nvml.fake_device_state(0)["uuid"]
    nvml.fake_update_device(0, power_limit_mw=600_000)  # the operator's, before dvfs
    apply_caps(tmp_path, 1500, 450.0)
    state = Path(os.environ["DVFS_STATE_DIR"])
    entries = json.loads((state / "caps-applied.json").read_text())
    entries[uuid]["lock_mhz"] = "1500"  # a hand edit
    (state / "caps-applied.json").write_text(json.dumps(entries, indent=2))
    campaign = _stock_campaign(tmp_path)
    told = " ".join(invoke("sweep", str(campaign), "--out", str(tmp_path / "out"), code=1).split())
    reset = f"dvfs cap reset --applied --state-dir {state} {uuid}"
    assert f"`{reset}`" in told, told
    invoke(*shlex.split(reset)[1:])
    assert nvml.fake_device_state(0)["power_limit_mw"] == 600_000
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert not (state / "caps-applied.json").exists()


def test_a_sweep_refuses_a_clock_lock_outside_the_gpus_clocks_in_the_caps_record(
    nvml, tmp_path: Path
) -> None:
    """A caps record whose lock_mhz was hand-edited to 210-5000 MHz (above the GPU's 1980 MHz
    top, a cap dvfs never set) passed as dvfs's cap: the sweep measured, then failed to put
    back 210-5000 MHz ("could not restore"), the GPU left at its last setting and the
    record's lock in a state file. Refused as a damaged lock is, before any GPU is changed,
    naming the line and the `cap reset --applied` that drops the entry; the sweep then runs."""
    uuid = nvml.fake_device_state(0)["uuid"]
    apply_caps(tmp_path, 1500, None)
    state = Path(os.environ["DVFS_STATE_DIR"])
    entries = json.loads((state / "caps-applied.json").read_text())
    entries[uuid]["lock_mhz"] = [210, 5000]  # a hand edit
    (state / "caps-applied.json").write_text(json.dumps(entries, indent=2))
    calls = len(nvml.fake_calls())
    campaign = _stock_campaign(tmp_path)
    told = " ".join(invoke("sweep", str(campaign), "--out", str(tmp_path / "out"), code=1).split())
    assert "lock_mhz is [210, 5000], outside GPU 0's SM clocks 210-1980 MHz" in told, told
    reset = f"dvfs cap reset --applied --state-dir {state} {uuid}"
    assert f"`{reset}`" in told, told
    assert not [c for c in nvml.fake_calls()[calls:] if "Set" in c["fn"] or "Reset" in c["fn"]]
    assert not list(state.glob("GPU-*.json"))
    invoke(*shlex.split(reset)[1:])
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    invoke("sweep", str(campaign), "--out", str(tmp_path / "out2"), "--no-progress")


def test_a_sweep_refuses_a_power_limit_outside_the_gpus_range_in_the_caps_record(
    nvml, tmp_path: Path
) -> None:
    """A caps record whose power_limit_mw was hand-edited to 900 W (above the GPU's 700 W top,
    a cap dvfs never set) hid dvfs's real 450 W cap from the sweep: the GPU's 450 W read as an
    operator's limit, its stock, so the cube's stock was measured under dvfs's production cap.
    Refused as a damaged power limit is, naming the line and the `cap reset` that drops the
    entry, before any GPU is changed; the sweep then runs."""
    uuid = apply_caps(tmp_path, 1500, 450.0)
    state = Path(os.environ["DVFS_STATE_DIR"])
    entries = json.loads((state / "caps-applied.json").read_text())
    entries[uuid]["power_limit_mw"] = 900_000  # a hand edit
    (state / "caps-applied.json").write_text(json.dumps(entries, indent=2))
    calls = len(nvml.fake_calls())
    campaign = _stock_campaign(tmp_path)
    told = " ".join(invoke("sweep", str(campaign), "--out", str(tmp_path / "out"), code=1).split())
    assert "power_limit_mw is 900000, outside GPU 0's range 200-700 W" in told, told
    reset = f"dvfs cap reset --state-dir {state} {uuid}"
    assert f"`{reset}`" in told, told
    assert not [c for c in nvml.fake_calls()[calls:] if "Set" in c["fn"] or "Reset" in c["fn"]]
    assert nvml.fake_device_state(0)["power_limit_mw"] == 450_000
    invoke(*shlex.split(reset)[1:])
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000
    invoke("sweep", str(campaign), "--out", str(tmp_path / "out2"), "--no-progress")


@pytest.mark.parametrize(
    ("key", "value", "said", "reset"),
    [
        (
            "lock_mhz",
            [210, 5000],
            "lock_mhz is [210, 5000], outside GPU 0's SM clocks 210-1980 MHz",
            "dvfs cap reset --applied",
        ),
        (
            "power_limit_mw",
            900_000,
            "power_limit_mw is 900000, outside GPU 0's range 200-700 W",
            "dvfs cap reset",
        ),
    ],
)
def test_cap_show_warns_of_a_caps_record_knob_outside_the_gpus_range(
    nvml, tmp_path: Path, key: str, value: object, said: str, reset: str
) -> None:
    """A caps record hand-edited to a clock lock (or power limit) outside the GPU's range, which
    sweeps and `dvfs govern` refuse as damaged: `cap show` showed "locked 210-5000 MHz by dvfs
    cap apply" with no word of it. It warns, as it warns of a damaged entry, naming the line
    and the reset that drops the entry, and still shows the GPU."""
    uuid = apply_caps(tmp_path, 1500, 450.0)
    state = Path(os.environ["DVFS_STATE_DIR"])
    entries = json.loads((state / "caps-applied.json").read_text())
    entries[uuid][key] = value  # a hand edit
    (state / "caps-applied.json").write_text(json.dumps(entries, indent=2))
    told = " ".join(invoke("cap", "show").split())
    assert f"warning: dvfs's caps record {state / 'caps-applied.json'} line" in told, told
    assert said in told, told
    command = f"{reset} 0 --state-dir {state}"
    assert f"`{command}`" in told, told
    assert f"GPU 0 ({uuid}): power limit" in told, told  # still shown
    invoke(*shlex.split(command)[1:])  # the advice followed: the entry dropped, no warning
    assert "warning" not in invoke("cap", "show"), told
