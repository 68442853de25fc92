"""A GPU whose power limit NVML does not support (NOT_SUPPORTED on reading it, its range and
setting it: some boards, MIG, a VM's restricted passthrough) but whose SM clocks lock: what only
sets clocks works on it, reading and putting back only what it changes, and what needs its power
limit is refused in one line. End to end on the fake NVML and the stub SGLang server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nvml_support import (
    NVML_CAMPAIGN,
    cube_as_on_an_idle_machine,
    dvfs_in_process,
    fake_env,
    load_fake,
)
from test_govern_cli import launch_stub, lines, wait_for

#: What NVML answers NOT_SUPPORTED on such a GPU.
NO_POWER_LIMIT = (
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetPowerManagementLimitConstraints",
    "nvmlDeviceSetPowerManagementLimit",
)

CLOCKS_PLAN = """dvfs_batch_plan = 1
[meta]
measured_on = "NVIDIA H100 80GB HBM3"
drafter = "none"
[[batch]]
batch = 1
sm_clock_mhz = 1200
[[batch]]
batch = 4
sm_clock_mhz = 1500
"""

pytestmark = pytest.mark.slow


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return fake_env(tmp_path)


@pytest.fixture
def nvml(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake NVML, as root, its GPU 0 without a power limit NVML supports."""
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_STATE_DIR"):
        monkeypatch.setenv(key, env[key])
    module = load_fake()
    module.fake_reset_state()
    module.fake_update_device(
        0, errors={f: module.NVML_ERROR_NOT_SUPPORTED for f in NO_POWER_LIMIT}
    )
    return module


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[str]:
    with launch_stub(tmp_path) as url:
        yield url


def power_limit_calls(nvml: Any) -> list[dict[str, Any]]:
    return [c for c in nvml.fake_calls() if "PowerManagementLimit" in c["fn"]]


def govern_args(plan: Path, url: str, *extra: str) -> tuple[str, ...]:
    return (
        *("govern", "--plan", str(plan), "--url", url, "--gpu", "0", "--interval", "0.1"),
        *("--listen", "off", *extra),
    )


def test_govern_follows_a_clocks_only_plan_on_a_gpu_without_a_power_limit(
    tmp_path: Path, env: dict[str, str], nvml: Any, stub: str
) -> None:
    """`dvfs govern` (and `--dry-run`) read every GPU's power limit at start, so a per-batch
    plan that sets only clocks stopped at once, exit 1 ("cannot read the power-limit range:
    NVML says Not Supported"). It governs the clocks now, the power limit left be, and puts the
    clock back on exit."""
    plan = tmp_path / "plan.toml"
    plan.write_text(CLOCKS_PLAN)
    dry = dvfs_in_process(*govern_args(plan, stub, "--dry-run", "--max-intervals", "3"), env=env)
    assert dry.returncode == 0, dry.stderr
    assert "would set running batch 0 -> plan batch 1: SM clock <= 1200 MHz" in dry.stderr
    assert "SM clock locked 210-1200 MHz, power limit not supported by NVML" in dry.stderr
    assert nvml.fake_calls() == []
    run = dvfs_in_process(
        *govern_args(plan, stub, "--dwell", "0.1", "--max-intervals", "3"), env=env
    )
    assert run.returncode == 0, run.stderr
    assert "stopped after 1 change(s); GPU settings restored" in run.stderr
    assert [(c["fn"], c["args"], c["ok"]) for c in nvml.fake_calls()] == [
        ("nvmlDeviceSetGpuLockedClocks", [210, 1200], True),
        ("nvmlDeviceResetGpuLockedClocks", [], True),
    ]
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("GPU-*.json"))


def test_a_plan_with_a_power_step_is_refused_in_one_line_on_such_a_gpu(
    tmp_path: Path, env: dict[str, str], nvml: Any, stub: str
) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(
        CLOCKS_PLAN.replace("sm_clock_mhz = 1500", "sm_clock_mhz = 1500\npower_limit_w = 400")
    )
    uuid = nvml.fake_device_state(0)["uuid"]
    for extra in (("--dry-run",), ()):
        result = dvfs_in_process(*govern_args(plan, stub, *extra, "--max-intervals", "3"), env=env)
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines() == [
            f"Error: {plan}: step batch 4 sets a power limit, which NVML does not support on "
            f"GPU 0 ({uuid}): plan SM clocks only for it (GPU 0: cannot read the power-limit "
            "range: NVML says Not Supported)"
        ]
    assert nvml.fake_calls() == []


def test_gpu_reset_restores_a_killed_governors_clocks_on_such_a_gpu(
    tmp_path: Path, env: dict[str, str], nvml: Any, stub: str
) -> None:
    """After a SIGKILL the state file records the clocks and no power limit; `dvfs gpu reset`
    (the governor unit's ExecStopPost) unlocks the clock and sets no power limit."""
    plan = tmp_path / "plan.toml"
    plan.write_text(CLOCKS_PLAN)
    log = tmp_path / "govern.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dvfs", *govern_args(plan, stub, "--max-intervals", "3000")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: len(lines(log, "set running batch")) >= 1, "the first setting", log)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1200]
    [state] = Path(env["DVFS_STATE_DIR"]).glob("GPU-*.json")
    assert json.loads(state.read_text())["original"]["power_limit_mw"] is None
    deadline = time.monotonic() + 60  # the killed governor's lock is released with its process
    while True:
        result = dvfs_in_process("gpu", "reset", env=env)
        if "in use by another dvfs process" not in result.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "restored GPU 0" in result.stdout and "clocks unlocked" in result.stdout
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert power_limit_calls(nvml) == []


def unit_command(unit: str, key: str = "ExecStart", **replaced: str) -> list[str]:
    """KEY (ExecStart, ExecStop) of `systemd/UNIT` without its dvfs path, each of `replaced`
    put in."""
    text = (Path(__file__).resolve().parent.parent / "systemd" / unit).read_text()
    [start] = [line[len(key) + 1 :] for line in text.splitlines() if line.startswith(f"{key}=")]
    for old, new in replaced.items():
        start = start.replace(old, new)
    return start.replace("/usr/local/bin/dvfs", "").split()


def test_the_govern_units_command_governs_such_a_gpu_with_no_gpu_named(
    tmp_path: Path, env: dict[str, str], nvml: Any, stub: str
) -> None:
    """`dvfs-govern.service` names no --gpu: every GPU had to read its power limit, so a GPU
    without one was taken for lost ("governs none while one does not open"), exit 1."""
    plan = tmp_path / "plan.toml"
    plan.write_text(CLOCKS_PLAN)
    argv = unit_command(
        "dvfs-govern.service",
        **{
            "/etc/dvfs/govern-plan.toml": str(plan),
            "http://127.0.0.1:30000": stub,
            "127.0.0.1:9435": "127.0.0.1:0",
        },
    )
    assert "--gpu" not in argv
    result = dvfs_in_process(*argv, "--dry-run", "--max-intervals", "1", env=env)
    assert result.returncode == 0, result.stderr
    assert "GPU 0: SM clock locked 210-1200 MHz, power limit not supported" in result.stderr
    assert nvml.fake_calls() == []


def test_the_caps_commands_cap_such_a_gpus_clock_and_leave_its_power_limit_be(
    tmp_path: Path, env: dict[str, str], nvml: Any
) -> None:
    """`cap apply` set aside a GPU without a power limit NVML supports wherever the file named
    it, a clock-only file too ("whose power limit NVML does not support (`cap apply` records it
    before a change): it was set aside, so nothing was capped", exit 1: the caps unit failed at
    every boot), `cap show` named it and showed nothing of it (exit 1), and `cap reset` (the
    unit's ExecStop) reset nothing (exit 1). A clock-only file caps it now, its power limit
    neither read nor recorded; `cap show` shows it; `cap reset` unlocks its clock."""
    uuid = nvml.fake_device_state(0)["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(f'[[gpu]]\nuuid = "{uuid}"\nsm_clock_max_mhz = 1500\n')
    start = unit_command("dvfs-caps.service", **{"/etc/dvfs/caps.toml": str(caps)})
    stop = unit_command("dvfs-caps.service", "ExecStop")
    dry = dvfs_in_process(*start, "--dry-run", env=env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert f"would apply to GPU 0 ({uuid}): SM clock locked to 210-1500 MHz" in dry.stdout
    assert nvml.fake_calls() == []
    applied = dvfs_in_process(*start, env=env)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert f"applied to GPU 0 ({uuid}): SM clock locked to 210-1500 MHz" in applied.stdout
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
    shown = dvfs_in_process("cap", "show", env=env)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    said = " ".join(shown.stdout.split())
    assert f"GPU 0 ({uuid}): power limit 700 W enforced (NVML does not support setting it" in said
    assert "locked 210-1500 MHz by dvfs cap apply" in said
    rows = json.loads(dvfs_in_process("cap", "show", "--json", env=env).stdout)
    [row] = [r for r in rows if r["index"] == 0]
    assert row["configured_power_limit_w"] is None and row["default_power_limit_w"] is None
    reset = dvfs_in_process(*stop, "0", env=env)
    assert reset.returncode == 0, reset.stdout + reset.stderr
    assert "clocks unlocked, power limit not supported by NVML (left be)" in reset.stdout
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert power_limit_calls(nvml) == []
    # a file that caps its power limit is refused for it in one line, nothing capped
    caps.write_text(f'[[gpu]]\nuuid = "{uuid}"\nsm_clock_max_mhz = 1500\npower_limit_w = 400\n')
    refused = dvfs_in_process(*start, env=env)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr.splitlines() == [
        f"Error: {caps} matches only GPU 0 ({uuid}) here, whose power limit NVML does not "
        "support (its entry sets one): it was set aside, so nothing was capped"
    ]
    assert nvml.fake_device_state(0)["locked_clocks"] is None


def test_gpu_list_and_info_show_such_a_gpu_with_its_power_limit_not_supported(
    env: dict[str, str], nvml: Any
) -> None:
    """`gpu list` and `gpu info` read-only: they named such a GPU as if it had fallen off the
    bus ("cannot read the power limit: NVML says Not Supported", nothing else of it shown,
    exit 1). They show it now, its power limit not supported (null in --json), exit 0."""
    uuid = nvml.fake_device_state(0)["uuid"]
    listed = dvfs_in_process("gpu", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    row = json.loads(listed.stdout)[0]
    assert (row["uuid"], row["power_limit_w"], row["sm_clock_mhz"]) == (uuid, None, 345)
    table = dvfs_in_process("gpu", "list", env=env)
    assert table.returncode == 0 and "not supported" in table.stdout, table.stdout + table.stderr
    for args in (("gpu", "info", "--json"), ("gpu", "info", "0", "--json")):
        info = dvfs_in_process(*args, env=env)
        assert info.returncode == 0, info.stdout + info.stderr
        limits = json.loads(info.stdout)[0]["power_limit_w"]
        assert limits == {
            "min": None,
            "max": None,
            "default": None,
            "current": None,
            "enforced": 700.0,
        }
    text = dvfs_in_process("gpu", "info", "0", env=env)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "power limit: not supported by NVML, not settable (enforced 700 W)" in text.stdout
    assert nvml.fake_calls() == []


def test_gpu_reset_defaults_unlocks_such_a_gpus_clocks(env: dict[str, str], nvml: Any) -> None:
    """`gpu reset --defaults` ("unlock clocks, default power limit") set such a GPU aside,
    exit 1, its clocks left locked, as it could not read the power limit it would reset: it
    unlocks the clocks now and leaves the power limit, which nothing changed, be."""
    nvml.fake_update_device(0, locked_clocks=[210, 1200])  # left by a tool, or a lost record
    for args in (("gpu", "reset", "--defaults"), ("gpu", "reset", "0", "--defaults")):
        result = dvfs_in_process(*args, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        said = " ".join(result.stdout.split())
        assert "reset GPU 0" in said, said
        assert "clocks unlocked, power limit not supported by NVML (left be)" in said
        assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert power_limit_calls(nvml) == []


def test_gpu_settle_times_such_a_gpus_clocks_and_refuses_its_power_limit(
    env: dict[str, str], nvml: Any
) -> None:
    """`gpu settle` read every GPU's power limit to snapshot it before a change, so timing
    only clock locks on such a GPU stopped at once ("cannot read the power limit", exit 1). It
    times them now and puts the clock back; timing power limits is refused in one line."""
    result = dvfs_in_process("gpu", "settle", "--gpu", "0", "--clocks", "1980,1200", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1980 MHz -> 1200 MHz" in result.stdout
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("GPU-*.json"))
    args = ("gpu", "settle", "--gpu", "0", "--power-limits", "700,300", "--load")
    refused = dvfs_in_process(*args, "--load-device", "cpu", env=env)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr.splitlines() == [
        "Error: GPU 0: cannot read the power-limit range: NVML says Not Supported"
    ]
    assert power_limit_calls(nvml) == []


def test_doctor_and_an_observe_only_sweep_agree_on_such_a_gpu(
    tmp_path: Path, env: dict[str, str], nvml: Any
) -> None:
    """An observe-only sweep on such a GPU once stopped ("cannot read the power-limit range",
    exit 1) while `dvfs doctor`, skipping that read for observe-only, passed it; now the sweep
    runs (its stock limit the enforced one) and doctor passes it: the two agree, and nothing
    reads or writes the power limit NVML does not support."""
    campaign = tmp_path / "observe.toml"
    campaign.write_text(
        NVML_CAMPAIGN.format(output_tokens=8, repeats=1)
        .replace("devices = [0]", 'devices = [0]\nactuation = "off"')
        .replace("sm_clock = [1980, 1500]", 'sm_clock = "stock"')
        .replace("power_limit = [700, 400]", 'power_limit = "stock"')
    )
    doctor = dvfs_in_process("doctor", str(campaign), "--out", str(tmp_path / "out"), env=env)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "FAIL" not in doctor.stdout, doctor.stdout
    swept = dvfs_in_process("sweep", str(campaign), "--out", str(tmp_path / "out"), env=env)
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert power_limit_calls(nvml) == []


def test_gpu_roofline_measures_such_a_gpus_clocks_its_power_limit_nan(
    env: dict[str, str], nvml: Any
) -> None:
    """`gpu roofline --gpu 0` read such a GPU's power limit once its stock setting was
    measured (every kernel, minutes on a GPU), and stopped there ("cannot read the power
    limit", exit 1), the measurement lost; before the knob controller took such a GPU it
    stopped at start. It measures every setting now, the power limit NaN (null in --json), and
    puts the clock back."""
    pytest.importorskip("torch")
    tiny = (
        *("--device", "cpu", "--hidden", "64", "--intermediate", "256", "--tokens", "1,256"),
        *("--bandwidth-mib", "1", "--min-time", "0.02", "--settle", "0"),
    )
    result = dvfs_in_process(
        "gpu", "roofline", *tiny, "--gpu", "0", "--clocks", "1500,1200", "--json", env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    settings = json.loads(result.stdout)["settings"]
    assert [(s["setting"], s["power_limit_w"]) for s in settings] == [
        ("stock", None),
        ("1500", None),
        ("1200", None),
    ]
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("GPU-*.json"))


def clocks_campaign(tmp_path: Path, *, limits: bool = False, output_tokens: int = 128) -> Path:
    """The NVML campaign on GPU 0, sweeping SM clocks only (`limits`: power limits too).
    128 output tokens make windows long enough for valid cells on the fake's 20 ms energy
    counter; a test that reads no cell's measurement (only what the session and cube record
    of the GPUs) asks for fewer: each token is played out in real time."""
    from nvml_support import NVML_CAMPAIGN

    text = NVML_CAMPAIGN.format(output_tokens=output_tokens, repeats=1)
    text = text.replace("[measurement]\n", "[measurement]\nprecision = 0.05\n")
    if not limits:
        text = text.replace("power_limit = [700, 400]\n", "")
    path = tmp_path / ("limits.toml" if limits else "clocks.toml")
    path.write_text(text)
    return path


def session_of(out: Path) -> dict[str, Any]:
    [session] = [
        r
        for r in map(json.loads, (out / "journal.jsonl").read_text().splitlines())
        if r.get("type") == "session"
    ]
    return session


@pytest.mark.parametrize("observe", [False, True], ids=["actuating", "observe-only"])
def test_a_clocks_only_sweep_records_the_enforced_power_limit_as_stock(
    tmp_path: Path, env: dict[str, str], nvml: Any, observe: bool
) -> None:
    """`dvfs sweep` of a grid of SM clocks alone (and `--observe-only`) read the power-limit
    range and the configured limit of every GPU, so on such a GPU it stopped at once, exit 1
    ("GPU 0: cannot read the power-limit range: NVML says Not Supported"). It sweeps now, its
    stock power limit (the session's, the cube's `stock_power_limit_w` and `power_limit`
    coordinate, each cell's limit check) the limit NVML enforces, said so in the journal and
    the cube; no power limit is ever set, and the clock is put back."""
    from dvfs.cube import open_cube

    nvml.fake_update_device(0, oob_power_limit_mw=600_000)  # enforced: not the 700 W default
    uuid = nvml.fake_device_state(0)["uuid"]
    out = tmp_path / "out"
    args = ("sweep", str(clocks_campaign(tmp_path)), "--out", str(out), "--no-progress")
    result = dvfs_in_process(*args, *(("--observe-only",) if observe else ()), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    session = session_of(out)
    assert session["stock"] == {"sm_clock_mhz": 1980, "power_limit_w": 600.0}
    assert session["stock_power_limit_enforced"] == [uuid]
    assert session["power_limit_range_w"] == [None, None, None]  # not supported, nor its range
    cells = [
        r
        for r in map(json.loads, (out / "journal.jsonl").read_text().splitlines())
        if r.get("type") == "cell"
    ]
    assert cells and all(
        c["power_limits"]
        == [{"target_mw": 600_000, "configured_mw": [], "enforced_mw": [600_000, 600_000]}]
        for c in cells
    )
    cube = open_cube(cube_as_on_an_idle_machine(out, env))  # (valid cells: the load's flags off)
    assert cube.attrs["stock_power_limit_w"] == 600.0
    assert cube["power_limit"].values.tolist() == [600.0]
    assert cube.attrs["stock_power_limit_enforced"] == uuid
    info = dvfs_in_process("cube", "info", str(out), env=env)
    assert info.returncode == 0, info.stdout + info.stderr
    assert "stock power limit as enforced at start: NVML does not support the power limit" in (
        " ".join(info.stdout.split())
    )
    headroom = dvfs_in_process("headroom", str(out), "--json", env=env)
    assert headroom.returncode == 0, headroom.stdout + headroom.stderr
    reference = json.loads(headroom.stdout)["reference"]
    assert (reference["power_limit_w"], reference["stock_power_limit_w"]) == (600.0, 600.0)
    assert power_limit_calls(nvml) == []
    calls = [c["fn"] for c in nvml.fake_calls()]
    locks = ["nvmlDeviceSetGpuLockedClocks"] * 2 + ["nvmlDeviceResetGpuLockedClocks"]
    assert calls == ([] if observe else locks)
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("GPU-*.json"))


def test_the_dry_run_of_a_clocks_only_sweep_on_such_a_gpu_says_it_would_run(
    tmp_path: Path, env: dict[str, str], nvml: Any
) -> None:
    """The dry run said "on this machine the sweep would stop: GPU 0: cannot read the
    power-limit range"; it says nothing of the kind now, and changes nothing."""
    campaign = clocks_campaign(tmp_path)
    for extra in ((), ("--observe-only",)):
        args = ("sweep", str(campaign), "--out", str(tmp_path / "out"), "--dry-run")
        result = dvfs_in_process(*args, "--no-estimate", *extra, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "would stop" not in result.stdout + result.stderr, extra
    assert nvml.fake_calls() == []
    assert not (tmp_path / "out").exists()


def test_a_sweep_is_refused_in_one_line_where_no_power_limit_reads_at_all(
    tmp_path: Path, env: dict[str, str], nvml: Any
) -> None:
    """Where NVML reports not even the enforced limit, the stock power limit a cube records
    is unknown: the sweep (and observe-only) refuses in one line, the dry run says it would,
    nothing is set."""
    errors = {f: nvml.NVML_ERROR_NOT_SUPPORTED for f in NO_POWER_LIMIT}
    nvml.fake_update_device(0, errors={**errors, "nvmlDeviceGetEnforcedPowerLimit": 3})
    uuid = nvml.fake_device_state(0)["uuid"]
    campaign = clocks_campaign(tmp_path)
    line = (
        f"GPU 0 ({uuid}): NVML supports neither its power limit nor its enforced power limit "
        "(GPU 0: cannot read the enforced power limit: NVML says Not Supported), so the stock "
        "power limit a sweep records is unknown"
    )
    out = tmp_path / "out"
    for extra in ((), ("--observe-only",)):
        result = dvfs_in_process("sweep", str(campaign), "--out", str(out), *extra, env=env)
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stderr.splitlines()[-1] == f"Error: {line}", extra
    dry = dvfs_in_process(
        "sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate", env=env
    )
    assert f"note: on this machine the sweep would stop: {line}" in dry.stderr
    assert nvml.fake_calls() == []
    assert not out.exists()


def test_a_sweep_setting_power_limits_on_such_a_gpu_is_refused_naming_the_knob(
    tmp_path: Path, env: dict[str, str], nvml: Any
) -> None:
    """A campaign stepping power limits cannot run on such a GPU: it was refused in NVML's
    words alone ("GPU 0: cannot read the power-limit range: NVML says Not Supported"), which
    named neither the knob nor the way out. It is refused in one line naming both (exit 2, an
    invalid campaign for this GPU, as a clock it does not support), by the sweep, its dry run
    and `dvfs doctor`; nothing is set."""
    uuid = nvml.fake_device_state(0)["uuid"]
    campaign = clocks_campaign(tmp_path, limits=True)
    line = (
        f"knobs.power_limit: GPU 0 ({uuid}): NVML does not support its power limit (GPU 0: "
        "cannot read the power-limit range: NVML says Not Supported), so the campaign's power "
        'limits cannot be set: sweep only SM clocks on it (knobs.power_limit left out, or "stock")'
    )
    out = tmp_path / "out"
    result = dvfs_in_process("sweep", str(campaign), "--out", str(out), env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"Error: {line}"]
    dry = dvfs_in_process(
        "sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate", env=env
    )
    assert f"note: on this machine the sweep would stop: {line}" in dry.stderr
    doctor = dvfs_in_process("doctor", str(campaign), "--out", str(out), env=env)
    assert doctor.returncode == 2, doctor.stdout + doctor.stderr
    assert f"FAIL knobs: {line}" in " ".join(doctor.stdout.split())
    assert nvml.fake_calls() == []
    assert not out.exists()


def doctor_lines(result: subprocess.CompletedProcess) -> dict[str, str]:
    """`dvfs doctor`'s checks by name: status and text (lines unwrapped)."""
    said: dict[str, str] = {}
    name = ""
    for line in result.stdout.splitlines():
        if line[:5] in ("ok   ", "warn ", "FAIL "):
            name, _, text = line[5:].partition(": ")
            said[name] = f"{line[:4].strip()} {text}"
        elif name:
            said[name] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in said.items()}


def test_doctor_passes_a_clocks_only_campaign_on_such_a_gpu(
    tmp_path: Path, env: dict[str, str], nvml: Any
) -> None:
    """`dvfs doctor` failed a clocks-only campaign on such a GPU ("FAIL knobs: GPU 0: cannot
    read the power-limit range", exit 1) and could not read its held knobs; it passes it now
    and says the sweep records the enforced limit as stock. Where not even that reads, it
    fails in the sweep's own line."""
    nvml.fake_update_device(0, oob_power_limit_mw=600_000)
    campaign = clocks_campaign(tmp_path)
    out = str(tmp_path / "out")
    for extra in ((), ("--observe-only",)):
        result = dvfs_in_process("doctor", str(campaign), "--out", out, *extra, env=env)
        said = doctor_lines(result)
        assert result.returncode == 0, result.stdout + result.stderr
        assert said["knobs"].startswith("ok "), said
        assert said["held knobs GPU 0"] == (
            "ok power limit not supported by NVML (not settable): the sweep records the 600 W "
            "it enforces as the stock power limit"
        )
    # a tensor-parallel server's two such GPUs: their stock compared as enforced (the check
    # failed on the first: "NVML does not support its power limit (NOT_SUPPORTED), which
    # this command reads")
    errors = {f: nvml.NVML_ERROR_NOT_SUPPORTED for f in NO_POWER_LIMIT}
    nvml.fake_update_device(1, errors=errors, oob_power_limit_mw=600_000)
    two = tmp_path / "two.toml"
    two.write_text(campaign.read_text().replace("devices = [0]", "devices = [0, 1]"))
    result = dvfs_in_process("doctor", str(two), "--out", out, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert doctor_lines(result)["stock"] == "ok the GPUs start from one stock power limit, 600 W"
    nvml.fake_update_device(0, errors={**errors, "nvmlDeviceGetEnforcedPowerLimit": 3})
    result = dvfs_in_process("doctor", str(campaign), "--out", out, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    uuid = nvml.fake_device_state(0)["uuid"]
    assert doctor_lines(result)["held knobs GPU 0"].startswith(
        f"FAIL GPU 0 ({uuid}): NVML supports neither its power limit nor its enforced power limit"
    )
    assert nvml.fake_calls() == []


def test_a_server_on_such_gpus_enforcing_other_limits_is_refused_without_a_useless_way_out(
    tmp_path: Path, env: dict[str, str], nvml: Any
) -> None:
    """A tensor-parallel server's GPUs that enforce other limits are refused as any GPUs of
    other stock limits are, but the way out offered was `dvfs gpu reset --defaults`, which
    leaves a power limit NVML does not support be: the line says NVML cannot set theirs."""
    errors = {f: nvml.NVML_ERROR_NOT_SUPPORTED for f in NO_POWER_LIMIT}
    nvml.fake_update_device(0, errors=errors)
    nvml.fake_update_device(1, errors=errors, oob_power_limit_mw=600_000)
    uuids = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    campaign = tmp_path / "two.toml"
    campaign.write_text(clocks_campaign(tmp_path).read_text().replace("[0]", "[0, 1]"))
    out = tmp_path / "out"
    result = dvfs_in_process("sweep", str(campaign), "--out", str(out), env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"Error: the GPUs of one server start from other stock power limits (GPU 0 ({uuids[0]}) "
        f"at 700 W enforced, GPU 1 ({uuids[1]}) at 600 W enforced): the cube has one stock "
        "setting, so their stock cells would not compare; NVML cannot set the power limit of "
        "GPU 0, GPU 1 (what it enforces is set outside NVML): leave one out of the server's GPUs"
    ]
    assert power_limit_calls(nvml) == []
    assert nvml.fake_device_state(0)["locked_clocks"] is None


def test_a_fleet_of_such_gpus_names_each_one_whose_stock_limit_is_enforced(
    tmp_path: Path, env: dict[str, str], nvml: Any
) -> None:
    """A fleet's journal keeps one session for its workers (the first worker's record, each
    worker's parts added): the GPUs whose stock power limit is the enforced one were the first
    worker's alone, so the cube named GPU 0 and not GPU 1, measured the same way."""
    from dvfs.cube import open_cube

    errors = {f: nvml.NVML_ERROR_NOT_SUPPORTED for f in NO_POWER_LIMIT}
    nvml.fake_update_device(1, errors=errors)
    uuids = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    out = tmp_path / "out"
    campaign = clocks_campaign(tmp_path, output_tokens=16)
    # a comparison group each: a GPU that measured no cell is not the cube's
    campaign.write_text(campaign.read_text().replace("batch = [1]\n", "batch = [1, 2]\n"))
    args = ("sweep", str(campaign), "--gpus", "0,1", "--out", str(out))
    result = dvfs_in_process(*args, "--no-progress", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert session_of(out)["stock_power_limit_enforced"] == uuids
    cube = open_cube(out / "cube.nc")
    assert cube.attrs["stock_power_limit_enforced"] == ",".join(uuids)
    assert cube.attrs["stock_power_limit_w"] == 700.0
    assert power_limit_calls(nvml) == []


@pytest.mark.parametrize("how", ["gpus", "shards"])
def test_a_merge_keeps_which_gpus_stock_limit_is_the_enforced_one(
    tmp_path: Path, env: dict[str, str], nvml: Any, how: str
) -> None:
    """`dvfs cube merge` of such a GPU's cube with an ordinary GPU's dropped the attribute
    `stock_power_limit_enforced` (a shard merge kept the first shard's alone), so `cube info`
    and the report said the merged cube's stock limits were all "as found at start", the
    limit NVML enforced on GPU 0 taken for a configured one. Every source's GPUs are named."""
    from dvfs.cube import open_cube

    nvml.fake_update_device(0, oob_power_limit_mw=600_000 if how == "gpus" else 700_000)
    uuid = nvml.fake_device_state(0)["uuid"]
    campaign = clocks_campaign(tmp_path, output_tokens=16)
    if how == "shards":  # two comparison groups, one per shard
        campaign.write_text(campaign.read_text().replace("batch = [1]\n", "batch = [1, 2]\n"))
    cubes = []
    for gpu in ("1", "0"):  # the ordinary GPU's cube first
        out = tmp_path / f"gpu{gpu}"
        share = ("--shard", f"{1 - int(gpu)}/2") if how == "shards" else ()
        args = ("sweep", str(campaign), "--gpus", gpu, "--out", str(out), "--no-progress")
        result = dvfs_in_process(*args, *share, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        cubes.append(str(out / "cube.nc"))
    merged = tmp_path / "merged.nc"
    result = dvfs_in_process("cube", "merge", *cubes, "-o", str(merged), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert open_cube(merged).attrs["stock_power_limit_enforced"] == uuid
    info = dvfs_in_process("cube", "info", str(merged), env=env)
    assert info.returncode == 0, info.stdout + info.stderr
    said = " ".join(info.stdout.split())
    assert f"NVML does not support the power limit of {uuid[:12]}" in said, said


def test_a_fleet_mixing_such_a_gpu_with_an_ordinary_one_is_refused_before_it_measures(
    tmp_path: Path, env: dict[str, str], nvml: Any
) -> None:
    """A fleet of such a GPU (its session's power-limit range NaN) and an ordinary one of the
    same model: `dvfs doctor` passed it, and the sweep refused it only once each worker had
    timed its counters and measured its idle power (minutes on real GPUs), when the driver
    compared their sessions. The sweep refuses it before any worker opens its GPUs now, in one
    line naming both; doctor fails `stock` in that line."""
    campaign = str(clocks_campaign(tmp_path))
    out = tmp_path / "out"
    uuids = [nvml.fake_device_state(i)["uuid"] for i in (0, 1)]
    line = f"NVML does not support the power limit of GPU 0 ({uuids[0]}), nor then its range"
    args = ("sweep", campaign, "--gpus", "0,1", "--out", str(out), "--no-progress")
    result = dvfs_in_process(*args, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    [error] = result.stderr.splitlines()
    assert error.startswith(f"Error: {line}, but supports that of GPU 1 ({uuids[1]})"), error
    assert "timing" not in result.stdout + result.stderr, "no worker opened its session"
    assert not out.exists()
    doctor = dvfs_in_process("doctor", campaign, "--gpus", "0,1", env=env)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert "FAIL stock: " + line in " ".join(doctor.stdout.split()), doctor.stdout
