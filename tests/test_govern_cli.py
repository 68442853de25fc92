"""`dvfs govern` and `dvfs monitor` end to end against the stub SGLang server on loopback and
the fake NVML: subprocesses, or this process where no signal or hang must reach the command.
Every wait has a generous deadline for a stuck run (never a speed requirement) and every process
is bounded (--max-intervals, the stub's max_lifetime_s)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
from nvml_support import dvfs_in_process, fake_env, load_fake
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
STUB = REPO / "tests" / "fakes" / "sglang_stub_main.py"  # the stub, as sglang_support.STUB
STUCK_S = 60.0  # a run that takes this long is stuck, not slow
STUB_LIFETIME_S, STUB_TPOT_S = 300, 0.05
STUB_STEPS = round(STUB_LIFETIME_S / STUB_TPOT_S)  # the most decode steps the stub lives

PLAN = """dvfs_batch_plan = 1
[meta]
measured_on = "NVIDIA H100 80GB HBM3"
drafter = "none"
[[batch]]
batch = 1
sm_clock_mhz = 1200
power_limit_w = 400
[[batch]]
batch = 4
sm_clock_mhz = 1500
"""

pytestmark = pytest.mark.slow


def wait_for(check: Callable[[], bool], what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + STUCK_S
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-3000:] if log else ""
    pytest.fail(f"{what}: not within {STUCK_S:g}s\n{tail}")


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[str]:
    """A stub SGLang server with --enable-metrics on an ephemeral loopback port: its URL."""
    with launch_stub(tmp_path) as url:
        yield url


@contextlib.contextmanager
def launch_stub(
    tmp_path: Path, *argv: str, metrics: bool = True, extra_env: dict[str, str] | None = None
) -> Iterator[str]:
    """The stub on an ephemeral loopback port: its URL. `extra_env`: e.g. the fake NVML's state
    and CUDA_VISIBLE_DEVICES, to list the stub as a compute process on those fake GPUs."""
    config = tmp_path / "stub.json"
    config.write_text(
        json.dumps(
            {
                "startup_s": 0.05,
                "ttft_s": 0.01,
                "tpot_s": STUB_TPOT_S,
                "max_lifetime_s": STUB_LIFETIME_S,
            }
        )
    )
    log = tmp_path / "stub.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(STUB), "--model-path", "m", "--port", "0"]
            + (["--enable-metrics"] if metrics else [])
            + list(argv),
            env={
                "SGLANG_STUB_CONFIG": str(config),
                "PATH": os.environ.get("PATH", ""),
                **(extra_env or {}),
            },
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    found: list[str] = []

    def listening() -> bool:
        found[:] = re.findall(r"http://127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))
        return bool(found)

    try:
        wait_for(listening, "the stub to listen", log)
        url = f"http://127.0.0.1:{found[0]}"
        wait_for(lambda: _ok(url + "/health"), "the stub to be ready", log)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def held_batch(url: str, size: int, tokens_per_step: int = 1) -> Iterator[None]:
    """`size` running requests on the stub for the life of the block (a stream longer than the
    stub's life, then dropped: the stub stops counting it at its next decode step).
    `tokens_per_step`: the most one decode step yields (3 with speculation, at the stub's
    accept length of 2.5). Not longer: the stub plans every token of a request on arrival."""
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {
        "text": [f"prompt {i}" for i in range(size)],
        "sampling_params": {
            "max_new_tokens": (STUB_STEPS + 1) * tokens_per_step,
            "ignore_eos": True,
        },
        "stream": True,
    }
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    try:
        yield
    finally:
        if conn.sock is not None:
            conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()


def running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "sglang:num_running_reqs"
    )


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return fake_env(tmp_path)


@pytest.fixture
def nvml(env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_STATE_DIR"):
        monkeypatch.setenv(key, env[key])
    module = load_fake()
    module.fake_reset_state()
    return module


def start_governor(
    tmp_path: Path, env: dict[str, str], url: str, *extra: str
) -> tuple[subprocess.Popen[bytes], Path]:
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    log = tmp_path / f"govern-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dvfs", "govern", "--plan", str(plan), "--url", url]
            + ["--gpu", "0", "--interval", "0.1", "--listen", "127.0.0.1:0", *extra],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, log


def lines(log: Path, marker: str) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if marker in line]


def governor_killed_at_its_first_setting(
    tmp_path: Path, env: dict[str, str], url: str, *extra: str
) -> Path:
    """A governor started (`start_governor`), SIGKILLed once it has set its first batch's
    settings, as systemd's kill or a crash would leave it; its log."""
    proc, log = start_governor(tmp_path, env, url, *extra)
    try:
        wait_for(lambda: bool(lines(log, "set running batch")), "the first setting", log)
        proc.kill()
        proc.wait(timeout=STUCK_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return log


def test_the_governor_follows_the_load_and_sigterm_restores(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    proc, log = start_governor(tmp_path, env, stub, "--dwell", "0.5", "--max-intervals", "3000")
    try:
        wait_for(lambda: len(lines(log, "set running batch")) >= 1, "the idle setting", log)
        assert "plan batch 1: SM clock <= 1200 MHz, power limit 400 W" in lines(log, "set ")[0]
        with held_batch(stub, 3):
            wait_for(lambda: running(stub) == 3, "3 running requests on the stub")
            wait_for(lambda: len(lines(log, "set running batch")) >= 2, "the load step", log)
            # Within the dwell of the first setting the band widens (from plan batch 1), after
            # it it is batch 3's own: the same setting either way.
            assert re.search(
                r"running batch 3 -> (between plan batches 1 and 4|plan batch 1) to plan batch 4: "
                "SM clock <= 1500 MHz, power limit stock",
                lines(log, "set ")[1],
            )
            exported = re.findall(r"serving metrics on (\S+)", log.read_text())[0]

            def metered() -> bool:
                """An interval's energy per token while no request finishes: SGLang counts
                a request's generated tokens as it ends, its decoded ones every iteration."""
                page = httpx.get(exported, timeout=10).text
                return any(
                    s.name == "dvfs_gpu_energy_per_token_joules" and math.isfinite(s.value)
                    for f in text_string_to_metric_families(page)
                    for s in f.samples
                    if s.labels.get("gpu") == "0"
                )

            wait_for(metered, "energy per token while requests run", log)
            text = httpx.get(exported, timeout=10).text
        samples = {
            (s.name, s.labels.get("gpu")): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }
        assert samples[("dvfs_gpu_sm_clock_lock_max_hertz", "0")] == 1.5e9
        assert samples[("dvfs_server_running_requests", None)] == 3
        assert ("dvfs_gpu_energy_per_token_joules", "0") in samples
        wait_for(lambda: len(lines(log, "set running batch")) >= 3, "the step down", log)
        assert "running batch 0 -> plan batch 1" in lines(log, "set ")[2]
        assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1200]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STUCK_S) == 143, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    state = nvml.fake_device_state(0)
    assert state["locked_clocks"] is None and state["power_limit_mw"] == 700_000
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("GPU-*.json"))
    # The journal of a `systemctl stop` says the GPUs are back, as a stop after
    # --max-intervals does.
    assert lines(log, "stopped (received SIGTERM); GPU settings restored"), log.read_text()
    # a server without a drafter exports its accept length gauge at 0: no speculation
    assert "speculative accept length" not in log.read_text()
    # Only a looser setting (batch 3's) may come within the dwell of the change before.
    at = re.findall(r"\(at ([0-9.]+) s(, within the dwell)?", log.read_text())
    gaps = [(float(b) - float(a), early) for (a, _), (b, early) in zip(at, at[1:], strict=False)]
    # (the log prints each instant to the millisecond: a gap of the dwell exactly may read as
    # 0.499, or as 0.7 - 0.2, one float below 0.5)
    assert all(gap >= 0.5 - 1e-3 for gap, early in gaps if not early), at
    locks = [c["args"] for c in nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")]
    assert locks[:3] == [[210, 1200], [210, 1500], [210, 1200]]
    assert not any(c["index"] == 1 for c in nvml.fake_calls())  # GPU 1 is not governed


def test_sigkill_leaves_a_state_file_that_gpu_reset_restores(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    governor_killed_at_its_first_setting(tmp_path, env, stub, "--max-intervals", "3000")
    assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1200]
    assert list(Path(env["DVFS_STATE_DIR"]).glob("GPU-*.json"))
    assert "locked 210-1200 MHz by dvfs govern" in cap_show(env)  # still in force: shown
    # After the kill, in this process: no signal or hang needs to reach these two.
    again = dvfs_in_process(
        *("govern", "--plan", str(tmp_path / "plan.toml"), "--url", stub, "--gpu", "0"),
        *("--listen", "off", "--max-intervals", "1"),
        env=env,
    )
    assert again.returncode == 3 and "dvfs gpu reset" in again.stderr
    reset = dvfs_in_process("gpu", "reset", env=env)
    assert reset.returncode == 0, reset.stderr
    state = nvml.fake_device_state(0)
    assert state["locked_clocks"] is None and state["power_limit_mw"] == 700_000
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("GPU-*.json"))
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("governed-*"))
    assert "GPU 0 (" in cap_show(env) and "by dvfs govern" not in cap_show(env)


def test_gpu_reset_clears_a_lock_record_with_nothing_to_restore(env: dict[str, str], nvml) -> None:
    """A governor killed after recording its lock but before changing the GPU leaves a record
    and no state file: `cap show` must not keep naming a lock that is not in force, and `gpu
    reset` clears the record (it said "nothing to do" and left it)."""
    from dvfs.caps.actuation import GovernorLocks

    uuid = nvml.fake_device_state(0)["uuid"]
    GovernorLocks(Path(env["DVFS_STATE_DIR"])).write(uuid, (210, 1200))
    assert "by dvfs govern" in cap_show(env)
    reset = dvfs_in_process("gpu", "reset", env=env)
    assert reset.returncode == 0, reset.stderr
    assert "nothing to restore" in reset.stdout
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("governed-*"))
    assert "by dvfs govern" not in cap_show(env)
    assert nvml.fake_device_state(0)["locked_clocks"] is None  # the GPU was never touched
    assert not nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")


def test_gpu_reset_says_a_lock_record_from_before_the_reboot_is_cleared_as_such(
    env: dict[str, str], nvml
) -> None:
    """A governor killed with SIGKILL, then a reboot: its state file is dropped (the reboot
    reset the GPU) and its lock record is left for `gpu reset` (the governor unit's
    ExecStopPost) to clear. It said the governor "died before changing the GPU", which it had
    not: the journal told the operator a false story of the crash."""
    from dvfs.caps.actuation import GovernorLocks

    uuid = nvml.fake_device_state(0)["uuid"]
    locks = GovernorLocks(Path(env["DVFS_STATE_DIR"]))
    locks.write(uuid, (210, 1200))
    record = json.loads(locks.path(uuid).read_text())
    locks.path(uuid).write_text(json.dumps({**record, "boot": "an-earlier-boot"}))
    reset = dvfs_in_process("gpu", "reset", env=env)
    assert reset.returncode == 0, reset.stderr
    said = " ".join(reset.stdout.split())
    assert "from before the last reboot, which reset the GPU (nothing to restore)" in said, said
    assert "died before changing" not in said
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("governed-*"))


def test_dry_run_prints_and_calls_no_setter(
    tmp_path: Path, env: dict[str, str], nvml, stub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dvfs.cli.govern

    # each interval's read gets 5 s, not the 0.5 s of a 0.1 s interval: a loaded machine's
    # slow stub would read as a server not answering, and the change counted would differ
    monkeypatch.setattr(dvfs.cli.govern, "_timeout", lambda interval: 5.0)
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    result = dvfs_in_process(
        *("govern", "--plan", str(plan), "--url", stub, "--gpu", "0", "--interval", "0.1"),
        *("--listen", "127.0.0.1:0", "--dry-run", "--max-intervals", "3"),
        env=env,
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout + result.stderr
    assert "dry run, nothing changed: would set running batch 0 -> plan batch 1" in printed
    assert "dry run stopped: 1 change(s) would have been made, none was" in printed
    assert nvml.fake_calls() == []
    assert not Path(env["DVFS_STATE_DIR"]).exists() or not list(
        Path(env["DVFS_STATE_DIR"]).glob("GPU-*")
    )


def _dry_run_args(tmp_path: Path, command: str) -> tuple[str, ...]:
    """The argv (less --dry-run) of `dvfs govern` on a plan, or `dvfs cap apply` on a caps
    file capping GPU-1, both written in `tmp_path`."""
    from dvfs.caps import CapsFile, GpuCap, dump_caps

    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid="GPU-1", sm_clock_max_mhz=1500),))))
    if command == "govern":
        return ("govern", "--plan", str(plan), "--url", "http://127.0.0.1:9", "--gpu", "0")
    return ("cap", "apply", str(caps))


@pytest.mark.parametrize("command", ["govern", "cap"])
def test_a_dry_run_without_nvml_says_it_reads_the_gpus_not_to_use_the_twin(
    tmp_path: Path, command: str
) -> None:
    """`dvfs govern --dry-run` and `dvfs cap apply --dry-run` where NVML is missing said "or
    run on the digital twin (... `--twin h100-sxm` for `dvfs gpu list`, ...)": neither takes
    --twin, and a dry run still matches the plan to the GPUs here. The one line says so; the
    apply itself says what to do about the driver alone (`test_commands_without_a_twin_...`)."""
    args = _dry_run_args(tmp_path, command)
    env = fake_env(tmp_path, DVFS_FAKE_NVML_MISSING="1")
    dry = dvfs_in_process(*args, "--dry-run", env=env)
    said = " ".join(dry.stderr.split())
    assert dry.returncode == 1 and len(dry.stderr.strip().splitlines()) == 1, dry.stderr
    shown = "dvfs govern --dry-run" if command == "govern" else "dvfs cap apply --dry-run"
    assert "NVML is missing" in said and f"`{shown}` reads the GPUs it would" in said, said
    assert "(it has no --twin): run it on their host" in said and "`dvfs gpu list`" not in said


@pytest.mark.parametrize("command", ["govern", "cap"])
@pytest.mark.parametrize("wait", ["0", "5"])
def test_a_dry_run_with_the_module_not_loaded_says_to_load_it_here(
    tmp_path: Path, command: str, wait: str
) -> None:
    """`dvfs govern --dry-run` (and `cap apply --dry-run`) where the NVIDIA driver is installed
    but its kernel module not loaded ended "(it has no --twin): run it on their host", wrong on
    the GPUs' host, which a driver installed here says this is: the line says to load the module
    (`sudo modprobe nvidia`: dvfs runs as a user there) and run it again; where NVML is missing
    it still says to run it on their host."""
    args = _dry_run_args(tmp_path, command)
    for failure, ends in (
        (
            {"DVFS_FAKE_NVML_INIT_ERROR": "9"},
            "(it has no --twin): load the module, then run it again",
        ),
        ({"DVFS_FAKE_NVML_MISSING": "1"}, "(it has no --twin): run it on their host"),
    ):
        env = fake_env(tmp_path, **failure)
        dry = dvfs_in_process(*args, "--dry-run", "--wait-for-driver", wait, env=env)
        said = " ".join(dry.stderr.split())
        assert dry.returncode == 1 and len(dry.stderr.strip().splitlines()) == 1, dry.stderr
        assert said.endswith(ends), said
        if "DVFS_FAKE_NVML_INIT_ERROR" in failure:
            assert "load it (sudo modprobe nvidia, or reboot" in said, said


@pytest.mark.parametrize(
    "args",
    [
        ("cap", "apply", "CAPS", "--wait-for-driver", "0"),
        ("cap", "show"),
        ("cap", "reset"),
        ("gpu", "reset", "--defaults"),
        ("govern", "--plan", "PLAN", "--url", "http://127.0.0.1:9", "--gpu", "0"),
        ("monitor", "--once", "--listen", "off"),
    ],
)
@pytest.mark.parametrize("init_error", ["missing", "not-loaded"])
def test_commands_without_a_twin_say_what_to_do_about_the_driver_alone(
    tmp_path: Path, args: tuple[str, ...], init_error: str
) -> None:
    """The commands that read or change the GPUs here through NVML only (the caps unit's
    `cap apply --wait-for-driver` and `cap reset`, the governor unit's `govern` and `gpu reset`,
    the monitor unit's `monitor`, `cap show`) said, where NVML is missing or its kernel module
    not loaded, "or run on the digital twin (gpu.backend = "twin" in a campaign; `--twin
    h100-sxm` for `dvfs gpu list`, ...)": none of them can, so the line in the unit's journal
    pointed the operator at another tool. The one line now says what to do about the driver."""
    from dvfs.caps import CapsFile, GpuCap, dump_caps

    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid="GPU-1", sm_clock_max_mhz=1500),))))
    argv = [{"CAPS": str(caps), "PLAN": str(plan)}.get(a, a) for a in args]
    failure = (
        {"DVFS_FAKE_NVML_MISSING": "1"}
        if init_error == "missing"
        else {"DVFS_FAKE_NVML_INIT_ERROR": "9"}  # NVML_ERROR_DRIVER_NOT_LOADED
    )
    result = dvfs_in_process(*argv, env=fake_env(tmp_path, **failure))
    said = " ".join(result.stderr.split())
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, said
    fix = (
        "install the NVIDIA driver on a GPU machine"
        if init_error == "missing"
        else "load it (sudo modprobe nvidia, or reboot after a driver update"
    )
    assert fix in said, said
    assert "digital twin" not in said and "--twin" not in said, said


def test_a_dry_run_beside_a_running_governor_needs_no_metrics_port(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    """The README's `dvfs govern --dry-run` took the governor's default metrics port, 9435,
    so beside a running dvfs-govern.service it failed "Address already in use", previewing
    nothing. A dry run serves no metrics unless given --listen; given it, it serves there."""
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    argv = ("govern", "--plan", str(plan), "--url", stub, "--gpu", "0", "--interval", "0.1")
    with contextlib.ExitStack() as stack:
        taken = stack.enter_context(socket.socket())
        # the governor's port, as a running governor holds it (already held: as good)
        with contextlib.suppress(OSError):
            taken.bind(("127.0.0.1", 9435))
            taken.listen()
        result = dvfs_in_process(*argv, "--dry-run", "--max-intervals", "2", env=env)
    printed = result.stdout + result.stderr
    assert result.returncode == 0, printed
    assert "dry run stopped" in printed and "serving metrics" not in printed, printed
    given = dvfs_in_process(
        *argv, "--dry-run", "--max-intervals", "2", "--listen", "127.0.0.1:0", env=env
    )
    assert given.returncode == 0, given.stderr
    assert "serving metrics on http://127.0.0.1:" in given.stderr, given.stderr
    assert nvml.fake_calls() == []


def test_a_plan_for_another_gpu_model_or_a_twin_is_refused(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    plan = tmp_path / "plan.toml"
    for text, message in [
        (PLAN.replace("H100 80GB HBM3", "H200"), "measured on NVIDIA H200, but GPU 0 is a"),
        (PLAN.replace("HBM3", "HBM3 (twin)"), "is simulated"),
        (PLAN.replace("1500", "1501"), "1501 MHz is not a supported SM clock of GPU 0"),
        ("dvfs_caps = 1\n", "is a caps file"),
    ]:
        plan.write_text(text)
        result = dvfs_in_process(
            *("govern", "--plan", str(plan), "--gpu", "0", "--listen", "off"),
            *("--max-intervals", "1"),
            env=env,
        )
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert nvml.fake_calls() == []


def test_monitor_exports_parseable_per_gpu_metrics(env: dict[str, str], nvml, stub: str) -> None:
    result = dvfs_in_process("monitor", "--url", stub, "--interval", "0.2", "--once", env=env)
    assert result.returncode == 0, result.stderr
    samples = [s for f in text_string_to_metric_families(result.stdout) for s in f.samples]
    names = {(s.name, s.labels.get("gpu")) for s in samples}
    for gpu in ("0", "1"):
        for name in (
            "dvfs_gpu_power_watts",
            "dvfs_gpu_energy_joules_total",
            "dvfs_gpu_sm_clock_hertz",
            "dvfs_gpu_power_limit_watts",
            "dvfs_gpu_sm_clock_lock_max_hertz",
            "dvfs_gpu_energy_per_token_joules",
        ):
            assert (name, gpu) in names
    assert ("dvfs_server_up", None) in names and nvml.fake_calls() == []
    down = dvfs_in_process(
        *("monitor", "--url", "http://127.0.0.1:9", "--once", "--interval", "0.1", "--gpu", "0"),
        env=env,
    )
    assert down.returncode == 0 and "dvfs_server_up 0.0" in down.stdout
    assert "server: cannot read http://127.0.0.1:9/metrics" in down.stderr


def server_stub_on_gpu(tmp_path: Path, env: dict[str, str], nvml, index: int):
    """The stub listed by the fake NVML as a compute process on GPU `index` (as SGLang's
    scheduler is once it has loaded its weights), as CUDA_VISIBLE_DEVICES puts it there."""
    uuid = nvml.fake_state()["devices"][index]["uuid"]
    keys = ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES")
    extra = {key: env[key] for key in keys} | {"CUDA_VISIBLE_DEVICES": uuid}
    return launch_stub(tmp_path, extra_env=extra)


def page_values(text: str) -> dict[tuple[str, str | None], float]:
    return {
        (s.name, s.labels.get("gpu")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_monitor_without_gpu_counts_only_the_gpus_its_server_runs_on(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    """Without --gpu (as the monitor's unit runs it), the server's energy per token summed every
    GPU of the node over one server's tokens: on a node with a server per GPU, the node's energy
    over one server's, overstated. The server's GPUs (the process on its port, by NVML's compute
    processes) count now, said in one line; another server's GPU has no energy per token."""
    runs: list[subprocess.CompletedProcess] = []

    def tokens_in_an_interval() -> bool:  # a loaded machine may starve the stub for a while
        runs.append(
            dvfs_in_process("monitor", "--url", url, "--once", "--interval", "0.5", env=env)
        )
        values = page_values(runs[-1].stdout)
        return not math.isnan(values.get(("dvfs_server_energy_per_token_joules", None), 0.0))

    with server_stub_on_gpu(tmp_path, env, nvml, 1) as url, held_batch(url, 4):
        wait_for(lambda: running(url) == 4, "the batch to run")
        wait_for(tokens_in_an_interval, "a monitor interval with tokens")
    result = runs[-1]
    assert result.returncode == 0, result.stderr
    values = page_values(result.stdout)
    server = values[("dvfs_server_energy_per_token_joules", None)]
    ours = values[("dvfs_gpu_energy_per_token_joules", "1")]
    assert ours > 0 and server == pytest.approx(ours, rel=1e-9)
    assert math.isnan(values[("dvfs_gpu_energy_per_token_joules", "0")])
    assert values[("dvfs_gpu_power_watts", "0")] > 0  # still exported: only not counted
    said = lines_of(result.stderr, "energy per token counts")
    assert len(said) == 1 and "counts GPU 1, the server's GPU(s) at" in said[0]
    assert "warning" not in result.stderr


def lines_of(text: str, marker: str) -> list[str]:
    return [line for line in text.splitlines() if marker in line]


def test_monitor_without_gpu_warns_once_where_the_servers_gpus_cannot_be_found(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    """A server NVML lists on no GPU (still loading; here the stub, not on the fake's GPUs) and
    one on another machine: every GPU counts, as before, said in one warning line naming --gpu."""
    result = dvfs_in_process(
        *("monitor", "--url", stub, "--interval", "0.05", "--listen", "off"),
        *("--max-intervals", "5"),
        env=env,
    )
    assert result.returncode == 0, result.stderr
    [warning] = lines_of(result.stderr, "warning:")
    assert "dvfs_server_energy_per_token_joules counts every GPU (GPU 0, GPU 1)" in warning
    assert "NVML lists none of the server's" in warning and "pass --gpu" in warning
    remote = dvfs_in_process(
        *("monitor", "--url", "http://192.0.2.1:30000", "--once", "--interval", "0.05"),
        env=env,
    )
    assert remote.returncode == 0, remote.stderr
    [warning] = lines_of(remote.stderr, "warning:")
    assert "the server at http://192.0.2.1:30000 is not on this machine" in warning
    named = dvfs_in_process(
        *("monitor", "--url", stub, "--once", "--interval", "0.05", "--gpu", "0"), env=env
    )
    assert named.returncode == 0 and "energy per token" not in named.stderr  # --gpu: as named


def test_govern_without_gpu_names_the_servers_gpus_and_how_to_govern_only_them(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    with server_stub_on_gpu(tmp_path, env, nvml, 1) as url:
        result = dvfs_in_process(
            *("govern", "--plan", str(plan), "--url", url, "--interval", "0.05"),
            *("--listen", "off", "--dry-run", "--max-intervals", "2"),
            env=env,
        )
    assert result.returncode == 0, result.stderr
    [said] = lines_of(result.stderr, "energy per token counts")
    assert "counts GPU 1, the server's GPU(s)" in said
    assert "governs every GPU all the same (GPU 0, GPU 1): pass --gpu 1" in said


@pytest.mark.parametrize("fault", ["lost", "reset required"])
def test_monitor_exports_the_gpus_beside_one_fallen_off_the_bus(
    env: dict[str, str], nvml, fault: str
) -> None:
    """One GPU of the node lost (GPU_IS_LOST) made `dvfs monitor` fail whole, `--once` printing
    no page and the service exporting nothing. It now exports the other GPUs and names the lost
    one in one line: after `--once`'s page (exit 1); as a warning when it starts serving. So
    for another NVML error on that GPU alone (one needing a reset), which still failed it
    whole."""
    if fault == "lost":
        nvml.fake_update_device(0, lost=True)
        said = "fallen off the bus"
    else:
        nvml.fake_update_device(0, errors={"nvmlDeviceGetUUID": nvml.NVML_ERROR_RESET_REQUIRED})
        said = "NVML says GPU requires restart"
    once = dvfs_in_process("monitor", "--once", "--interval", "0.05", env=env)
    assert once.returncode == 1, once.stdout + once.stderr
    samples = [s for f in text_string_to_metric_families(once.stdout) for s in f.samples]
    power = {s.labels["gpu"]: s.labels["uuid"] for s in samples if s.name == "dvfs_gpu_power_watts"}
    assert power == {"1": nvml.fake_device_state(1)["uuid"]}, once.stdout
    # Not left out of dvfs_gpu_up: an alert on it must not clear when the monitor restarts
    # while the GPU is still down (its UUID unread: empty)
    up = {(s.labels["gpu"], s.labels["uuid"]): s.value for s in samples if s.name == "dvfs_gpu_up"}
    assert up == {("0", ""): 0.0, ("1", nvml.fake_device_state(1)["uuid"]): 1.0}, once.stdout
    [line] = once.stderr.splitlines()
    assert "GPU 0" in line and said in line, line
    served = dvfs_in_process(
        *("monitor", "--interval", "0.05", "--listen", "127.0.0.1:0", "--max-intervals", "2"),
        env=env,
    )
    assert served.returncode == 1, served.stderr
    assert "serving metrics on http://127.0.0.1:" in served.stderr
    assert "exporting the other GPUs' metrics" in served.stderr
    assert "Traceback" not in served.stderr and nvml.fake_calls() == []
    # Named with --gpu, as every GPU: the other exported, the lost one named (it failed whole)
    named = dvfs_in_process(
        *("monitor", "--once", "--interval", "0.05", "--gpu", "0", "--gpu", "1"), env=env
    )
    assert named.returncode == 1 and named.stderr == once.stderr, named.stdout + named.stderr
    samples = [s for f in text_string_to_metric_families(named.stdout) for s in f.samples]
    assert {s.labels["gpu"] for s in samples if s.name == "dvfs_gpu_power_watts"} == {"1"}
    up = {(s.labels["gpu"], s.labels["uuid"]): s.value for s in samples if s.name == "dvfs_gpu_up"}
    assert up == {("0", ""): 0.0, ("1", nvml.fake_device_state(1)["uuid"]): 1.0}, named.stdout
    # Named by its UUID, the lost GPU was left out of dvfs_gpu_up altogether (its index
    # unread), so an alert on dvfs_gpu_up == 0 never fired for a GPU the monitor was told to
    # watch: it is exported as not up under the UUID it was named by (its index unknown)
    lost_uuid = nvml.fake_device_state(0)["uuid"]
    by_uuid = dvfs_in_process(
        *("monitor", "--once", "--interval", "0.05", "--gpu", lost_uuid, "--gpu", "1"), env=env
    )
    assert by_uuid.returncode == 1 and said in by_uuid.stderr, by_uuid.stderr
    samples = [s for f in text_string_to_metric_families(by_uuid.stdout) for s in f.samples]
    up = {(s.labels["gpu"], s.labels["uuid"]): s.value for s in samples if s.name == "dvfs_gpu_up"}
    assert up == {("", lost_uuid): 0.0, ("1", nvml.fake_device_state(1)["uuid"]): 1.0}, up


class CountingMetrics(http.server.ThreadingHTTPServer):
    """A loopback /metrics page over HTTP/1.1 keep-alive that counts the connections made to
    it and the requests read through them; `page` is what each read answers."""

    daemon_threads = True

    def __init__(self) -> None:
        self.connections = 0
        self.requests = 0
        self.paths: list[str] = []  # each request's path and query, as read
        server = self

        class Page(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                server.connections += 1
                super().setup()

            def do_GET(self) -> None:  # noqa: N802 - http.server naming
                server.requests += 1
                server.paths.append(self.path)
                body = server.page()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                server.send(self.wfile, body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Page)

    def page(self) -> bytes:
        return b"sglang:num_running_reqs 2\nsglang:generation_tokens_total 10\n"

    def send(self, out: BinaryIO, body: bytes) -> None:
        out.write(body)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @contextlib.contextmanager
    def serving(self) -> Iterator[str]:
        """Serve in a thread for the block: the page's URL. (The serving loop looks for the
        shutdown at its end every 10 ms, not every 0.5 s, the default, which each use waited.)"""
        thread = threading.Thread(target=self.serve_forever, args=(0.01,), daemon=True)
        thread.start()
        try:
            yield self.url
        finally:
            self.shutdown()
            self.server_close()


class GeneratingMetrics(CountingMetrics):
    """A loopback /metrics page whose server generated 10 tokens more at every read."""

    def __init__(self) -> None:
        self.tokens = 0
        super().__init__()

    def page(self) -> bytes:
        self.tokens += 10
        return f"sglang:num_running_reqs 2\nsglang:generation_tokens_total {self.tokens}\n".encode()


def test_a_server_gpu_that_did_not_open_leaves_the_servers_energy_per_token_unknown(
    env: dict[str, str], nvml
) -> None:
    """`monitor --gpu 0 --gpu 1` (the server's GPUs) with GPU 0 fallen off the bus exported
    the server's energy per token as GPU 1's energy alone over the server's tokens: a number
    that hid GPU 0's energy (half the server's, on two alike GPUs). That energy is unknown, so
    the figure is NaN, as for a GPU that stops answering while the monitor runs; GPU 1's own
    figure stays, and a server that runs on GPU 1 alone keeps its own."""
    nvml.fake_update_device(0, lost=True)
    nvml.fake_set_load(1, 0.5)
    # Each read of the page must come within the interval (at least 0.5 s): 2 s, so that a
    # loaded machine's slow answer from the page's thread is not a page not read (NaN).
    args = ("monitor", "--once", "--interval", "2")
    with GeneratingMetrics().serving() as url:
        both = dvfs_in_process(*args, "--url", url, "--gpu", "0", "--gpu", "1", env=env)
        alone = dvfs_in_process(*args, "--url", url, "--gpu", "1", env=env)
    assert both.returncode == 1 and "fallen off the bus" in both.stderr, both.stderr
    values = page_values(both.stdout)
    assert values[("dvfs_gpu_up", "0")] == 0.0
    assert values[("dvfs_gpu_energy_per_token_joules", "1")] >= 0
    assert math.isnan(values[("dvfs_server_energy_per_token_joules", None)]), both.stdout
    assert alone.returncode == 0, alone.stderr
    values = page_values(alone.stdout)
    server = values[("dvfs_server_energy_per_token_joules", None)]
    assert server >= 0 and server == values[("dvfs_gpu_energy_per_token_joules", "1")]


def test_govern_with_no_gpu_named_refuses_one_fallen_off_the_bus_naming_the_others(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    """`dvfs govern` with no --gpu governs every GPU, the server's. With one fallen off the bus
    it governs none (the server spanning it is broken, and governing the rest would govern
    other GPUs than meant): one line names the lost GPU and says to name the server's GPUs
    with --gpu, listing those that open; nothing changes. Named, the others are governed."""
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    nvml.fake_update_device(0, lost=True)
    args = ("govern", "--plan", str(plan), "--url", f"http://127.0.0.1:{closed_port()}")
    args += ("--interval", "0.05", "--listen", "off", "--max-intervals", "1")
    refused = dvfs_in_process(*args, env=env)
    assert refused.returncode == 1, refused.stderr
    [line] = (refused.stdout + refused.stderr).splitlines()
    assert "GPU 0" in line and "fallen off the bus" in line, line
    assert "name the GPUs the server runs on with --gpu (those that open: GPU 1)" in line
    assert nvml.fake_calls() == []
    both = dvfs_in_process(*args, "--gpu", "0", "--gpu", "1", env=env)  # named: still refused
    assert both.returncode == 1 and "fallen off the bus" in both.stderr, both.stderr
    assert "governing" not in both.stderr and nvml.fake_calls() == []
    named = dvfs_in_process(*args, "--gpu", "1", env=env)
    assert named.returncode == 0, named.stderr
    assert "governing GPU 1 from" in named.stderr


def test_govern_with_no_gpu_named_refuses_a_gpu_nvml_may_not_talk_to(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    """Every GPU leaves out one NVML refuses with NO_PERMISSION (62e301d): `dvfs govern` with
    no --gpu, which governs every GPU as the server's, then governed GPU 0 alone, exit 0,
    without a word of GPU 1 (it was refused, exit 4, before). As with a GPU fallen off the
    bus, it governs none, in one line naming the withheld GPU and those it may talk to, exit
    4, nothing changed; named with --gpu, the others are governed."""
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    args = ("govern", "--plan", str(plan), "--url", f"http://127.0.0.1:{closed_port()}")
    args += ("--interval", "0.05", "--listen", "off", "--max-intervals", "1")
    for extra in ((), ("--dry-run",)):
        refused = dvfs_in_process(*args, *extra, env=env)
        assert refused.returncode == 4, (extra, refused.stderr)
        [line] = (refused.stdout + refused.stderr).splitlines()
        assert "GPU 1 (NVML: no permission)" in line and "(those it may talk to: GPU 0)" in line
        assert nvml.fake_calls() == []
    named = dvfs_in_process(*args, "--gpu", "0", env=env)
    assert named.returncode == 0, named.stderr
    assert "governing GPU 0 from" in named.stderr


def test_monitor_with_no_gpu_named_says_a_gpu_nvml_may_not_talk_to_is_left_out(
    env: dict[str, str], nvml
) -> None:
    """Every GPU leaves out one NVML refuses with NO_PERMISSION (62e301d): `dvfs monitor`
    with no --gpu exported GPU 0 alone, without a word (before, it was refused, exit 4), its
    page read as the whole node's and the server's energy per token as every GPU's. One line
    now names the GPU left out; the other GPUs are exported as before. Named GPUs: no line."""
    nvml.fake_update_device(1, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    args = ("monitor", "--once", "--interval", "0.05")
    shown = dvfs_in_process(*args, env=env)
    assert shown.returncode == 0, shown.stderr
    [line] = [x for x in shown.stderr.splitlines() if "warning" in x]
    assert "GPU 1 (NVML: no permission): not exported" in line, line
    values = page_values(shown.stdout)
    assert values[("dvfs_gpu_up", "0")] == 1.0 and ("dvfs_gpu_up", "1") not in values
    named = dvfs_in_process(*args, "--gpu", "0", env=env)
    assert named.returncode == 0 and "warning" not in named.stderr, named.stderr


def gpu_series(url: str, gpu: str) -> dict[str, float]:
    """The exported series of GPU `gpu` by name, from one scrape of the exporter at `url`."""
    text = httpx.get(url, timeout=10).text
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.labels.get("gpu") == gpu
    }


def test_the_monitor_logs_a_gpu_lost_while_it_serves_once_and_once_back(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    """A GPU lost while the monitor served went silent: NaN series, no log line. It is now
    logged once (naming it and NVML's error) and once when it answers again, exported
    meanwhile with dvfs_gpu_up 0 and no readings, the other GPU's as before."""
    log = tmp_path / "monitor.log"
    args = ["monitor", "--interval", "0.05", "--listen", "127.0.0.1:0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dvfs", *args, "--max-intervals", "100000"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: bool(lines(log, "serving metrics on")), "the exporter", log)
        url = re.findall(r"serving metrics on (\S+)", log.read_text())[0]
        wait_for(lambda: gpu_series(url, "0").get("dvfs_gpu_up") == 1.0, "GPU 0 up", log)
        nvml.fake_update_device(0, lost=True)
        wait_for(lambda: bool(lines(log, "stopped answering")), "the line saying so", log)
        wait_for(lambda: gpu_series(url, "0").get("dvfs_gpu_up") == 0.0, "GPU 0 not up", log)
        silent = gpu_series(url, "0")
        assert "dvfs_gpu_power_watts" not in silent and "dvfs_gpu_energy_joules_total" not in silent
        assert gpu_series(url, "1")["dvfs_gpu_up"] == 1.0
        assert not math.isnan(gpu_series(url, "1")["dvfs_gpu_power_watts"])
        nvml.fake_update_device(0, lost=False)
        wait_for(lambda: bool(lines(log, "answers again")), "the line saying it is back", log)
        wait_for(lambda: "dvfs_gpu_power_watts" in gpu_series(url, "0"), "GPU 0 back", log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STUCK_S) == 143, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    [lost] = lines(log, "stopped answering")
    uuid = nvml.fake_device_state(0)["uuid"]
    assert f"GPU 0 ({uuid}) stopped answering: " in lost and "GPU is lost" in lost, lost
    assert len(lines(log, "answers again")) == 1 and "Traceback" not in log.read_text()


def test_a_governed_gpu_lost_mid_run_stops_the_governor_in_one_line(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    """A GPU lost while governed: the governor ran on silently, then failed on restoring it
    with a line that hid why it stopped and what it put back. It now stops in one line
    naming the GPU and NVML's error, having put the other GPU back; exit 1."""
    proc, log = start_governor(tmp_path, env, stub, "--gpu", "1", "--max-intervals", "100000")
    try:
        wait_for(lambda: bool(lines(log, "set running batch")), "the first setting", log)
        nvml.fake_update_device(0, lost=True)
        assert proc.wait(timeout=STUCK_S) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    [line] = lines(log, "Error:")
    uuid = nvml.fake_device_state(0)["uuid"]
    assert line.startswith(f"Error: GPU 0 ({uuid}) stopped answering while governed: "), line
    assert "GPU is lost" in line and "put GPU 1 back as found" in line, line
    assert "Traceback" not in log.read_text()
    healthy = nvml.fake_device_state(1)
    assert healthy["locked_clocks"] is None and healthy["power_limit_mw"] == 700_000


def test_sigterm_while_a_governed_gpus_nvml_call_hangs_ends_within_its_deadline(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    """`systemctl stop` while a read of GPU 0 hangs in the driver: the restore of GPU 0 queued
    behind the stuck read and waited a deadline of its own (one more per GPU where the driver
    is stuck: past TimeoutStopSec, SIGKILL), then failed blaming its own call, which never
    ran, in a line that did not say the governor was stopped. The restore now waits for the
    stuck read only to its deadline, and the line says the signal, the GPU put back (GPU 1),
    what failed on GPU 0 (the read that hangs) and the `dvfs gpu reset 0` to run; exit 1."""
    hung = {
        # The signal is sent once the read is stuck, well within its deadline however loaded
        # the machine (the stop then waits out the rest of it: the test's cost).
        "DVFS_NVML_DEADLINE_S": "15",
        "DVFS_FAKE_NVML_HANG": "nvmlDeviceGetTotalEnergyConsumption@0=inf",
    }
    proc, log = start_governor(tmp_path, {**env, **hung}, stub, "--gpu", "1")
    try:
        wait_for(lambda: bool(nvml.fake_hangs_started()), "GPU 0's read to hang", log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STUCK_S) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    [line] = lines(log, "Error:")
    uuid = nvml.fake_device_state(0)["uuid"]
    assert line.startswith("Error: stopped (received SIGTERM); put GPU 1 back as found; "), line
    assert f"nvmlDeviceResetGpuLockedClocks on GPU 0 ({uuid}) was not attempted: " in line, line
    assert "nvmlDeviceGetTotalEnergyConsumption has not returned" in line, line
    state = Path(env["DVFS_STATE_DIR"])
    assert f"`dvfs gpu reset 0 --state-dir {state}` puts back" in line, line
    assert "Traceback" not in text
    healthy = nvml.fake_device_state(1)
    assert healthy["locked_clocks"] is None and healthy["power_limit_mw"] == 700_000
    assert (state / f"{uuid}.json").exists()  # for that reset


def _eight_gpus_whose_resets_hang_on_0_to_5(
    nvml, monkeypatch: pytest.MonkeyPatch, deadline_s: str
) -> dict[str, str]:
    """Eight fake GPUs, where nvmlDeviceResetGpuLockedClocks (the clock's restore) hangs in
    the driver on GPUs 0-5, each call `deadline_s` at most: the governor's environment."""
    eight = ",".join(["h100-sxm"] * 8)
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", eight)
    nvml.fake_reset_state()
    return {
        "DVFS_FAKE_NVML_DEVICES": eight,
        "DVFS_NVML_DEADLINE_S": deadline_s,
        "DVFS_FAKE_NVML_HANG": ",".join(
            f"nvmlDeviceResetGpuLockedClocks@{i}=inf" for i in range(6)
        ),
    }


def _put_back(nvml, index: int) -> bool:
    found = nvml.fake_device_state(index)
    return found["locked_clocks"] is None and found["power_limit_mw"] == 700_000


def test_a_stop_puts_back_the_gpus_that_answer_while_others_restores_hang(
    tmp_path: Path, env: dict[str, str], nvml, stub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`systemctl stop` of a governor of 8 GPUs whose driver calls hang on GPUs 0-5: the
    restore went one GPU after another, each hung one costing its deadline (10 s: a minute for
    six, dvfs-govern.service's TimeoutStopSec), so systemd's SIGKILL came before GPUs 6 and 7
    were put back, and all eight kept the governor's caps. The GPUs are now put back side by
    side: GPUs 6 and 7 are back (their state files gone) while the restores of 0-5 are still
    in the driver (here for an hour: their deadline), and the SIGKILL leaves 0-5 as the state
    files say, for `dvfs gpu reset` (ExecStopPost) once they answer; a restart is refused."""
    hung = _eight_gpus_whose_resets_hang_on_0_to_5(nvml, monkeypatch, "3600")  # outlasts it
    gpus = [f"--gpu={i}" for i in range(1, 8)]
    proc, log = start_governor(tmp_path, {**env, **hung}, stub, *gpus)
    state = Path(env["DVFS_STATE_DIR"])
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(8)]
    try:
        wait_for(lambda: bool(lines(log, "set running batch")), "the first setting", log)
        assert all(nvml.fake_device_state(i)["locked_clocks"] == [210, 1200] for i in range(8))
        proc.send_signal(signal.SIGTERM)
        wait_for(
            lambda: (
                _put_back(nvml, 6) and _put_back(nvml, 7) and len(nvml.fake_hangs_started()) == 6
            ),
            "GPUs 6 and 7 put back while the restores of GPUs 0-5 hang",
            log,
        )
        wait_for(
            lambda: not any((state / f"{uuids[i]}.json").exists() for i in (6, 7)),
            "the state files of GPUs 6 and 7 removed",
            log,
        )
        assert proc.poll() is None, log.read_text()  # GPUs 0-5's restores: still in the driver
        proc.kill()  # systemd, at TimeoutStopSec
        proc.wait(timeout=STUCK_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    started = nvml.fake_hangs_started()
    assert sorted(h["index"] for h in started) == list(range(6))
    assert {h["fn"] for h in started} == {"nvmlDeviceResetGpuLockedClocks"}
    # what the fake NVML saw: the resets of GPUs 6 and 7 (those of 0-5 never returned)
    resets = nvml.fake_calls("nvmlDeviceResetGpuLockedClocks")
    assert sorted(c["index"] for c in resets) == [6, 7] and all(c["ok"] for c in resets)
    for i in range(6):  # still capped, as their state files say
        found = nvml.fake_device_state(i)
        assert found["locked_clocks"] == [210, 1200] and found["power_limit_mw"] == 400_000
        assert (state / f"{uuids[i]}.json").exists()
    assert "Traceback" not in log.read_text()
    again = dvfs_in_process(
        *("govern", "--plan", str(tmp_path / "plan.toml"), "--url", stub, "--gpu", "6"),
        *("--listen", "off", "--max-intervals", "1", "--gpu", "0"),
        env=env,
    )
    assert again.returncode == 3 and "dvfs gpu reset" in again.stderr, again.stderr


def test_a_stop_whose_restores_hang_on_several_gpus_says_which_and_the_reset_in_one_line(
    tmp_path: Path, env: dict[str, str], nvml, stub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop whose restores hang on GPUs 0-5 of 8, each to its deadline: the line named each
    GPU's failure whole (its UUID twice, the driver's advice each time), past the bound of an
    error line, which cut it off before the GPUs that keep the governor's caps and the `dvfs
    gpu reset` to run. GPUs failing alike are now named once, and the line ends with both;
    GPUs 6 and 7 are back, GPUs 0-5's state files kept; exit 1."""
    # a deadline a healthy call keeps however loaded the machine (the stop waits it out)
    hung = _eight_gpus_whose_resets_hang_on_0_to_5(nvml, monkeypatch, "5")
    proc, log = start_governor(
        tmp_path, {**env, **hung}, stub, *(f"--gpu={i}" for i in range(1, 8))
    )
    try:
        wait_for(lambda: bool(lines(log, "set running batch")), "the first setting", log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STUCK_S) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    [line] = lines(log, "Error:")
    state = Path(env["DVFS_STATE_DIR"])
    assert line.startswith("Error: stopped (received SIGTERM); put GPU 6, GPU 7 back as found; ")
    six = "GPU 0, GPU 1, GPU 2, GPU 3, GPU 4, GPU 5"
    assert (
        f"could not restore GPU settings: {six}: nvmlDeviceResetGpuLockedClocks on each did not "
        "return within 5 s; the driver is not responding" in line
    ), line
    assert line.endswith(
        f"; {six} keep the governor's settings: once they answer again (after a GPU reset or a "
        f"reboot), `dvfs gpu reset 0 1 2 3 4 5 --state-dir {state}` puts back what the state "
        "files recorded"
    ), line
    assert _put_back(nvml, 6) and _put_back(nvml, 7) and "Traceback" not in log.read_text()
    kept = {p.name for p in state.glob("GPU-*.json")}
    assert kept == {f"{nvml.fake_device_state(i)['uuid']}.json" for i in range(6)}


def test_gpu_reset_after_a_sigkill_puts_back_the_gpus_that_answer_while_others_hang(
    tmp_path: Path, env: dict[str, str], nvml, stub: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The governor unit's ExecStopPost (`dvfs gpu reset`) after a SIGKILL left eight GPUs'
    state files, with the driver's calls hanging on GPUs 0-5: it restored one GPU after another,
    a deadline each (10 s: a minute for six, the unit's stop timeout again), so systemd killed
    it before GPUs 6 and 7. It now puts them back side by side: GPUs 6 and 7 are back, said,
    their state files gone, while 0-5's resets are still in the driver (an hour here); 0-5's
    state files stay for the reset that runs once they answer, which puts them back."""
    hung = _eight_gpus_whose_resets_hang_on_0_to_5(nvml, monkeypatch, "3600")  # outlasts it
    governor_killed_at_its_first_setting(tmp_path, env, stub, *(f"--gpu={i}" for i in range(1, 8)))
    state = Path(env["DVFS_STATE_DIR"])
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(8)]
    assert all((state / f"{u}.json").exists() for u in uuids)
    said = tmp_path / "reset.log"
    with said.open("wb") as out:
        reset = subprocess.Popen(
            [sys.executable, "-m", "dvfs", "gpu", "reset"],
            env={**env, **hung},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(
            lambda: (
                all(_put_back(nvml, i) for i in (6, 7))
                and not any((state / f"{uuids[i]}.json").exists() for i in (6, 7))
                and len(lines(said, "restored GPU")) == 2
            ),
            "GPUs 6 and 7 put back while the resets of GPUs 0-5 hang",
            said,
        )
        assert reset.poll() is None, said.read_text()  # GPUs 0-5's resets: still in the driver
        reset.kill()  # systemd, at the stop timeout
        reset.wait(timeout=STUCK_S)
    finally:
        if reset.poll() is None:
            reset.kill()
    assert sorted(h["index"] for h in nvml.fake_hangs_started()) == list(range(6))
    assert {line.split(" (")[0] for line in lines(said, "restored GPU")} == {
        "restored GPU 6",
        "restored GPU 7",
    }
    for i in range(6):
        assert nvml.fake_device_state(i)["locked_clocks"] == [210, 1200]
        assert (state / f"{uuids[i]}.json").exists()
    # once the driver answers again
    again = dvfs_in_process("gpu", "reset", env=env)
    assert again.returncode == 0, again.stderr
    assert all(_put_back(nvml, i) for i in range(8)) and not list(state.glob("GPU-*.json"))


def test_a_hung_read_stops_the_governor_at_its_deadline_in_one_line(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    """A read of a governed GPU that hangs in the driver: the governor does not wait on it for
    ever but stops at the call's deadline, as for a GPU that stopped answering: one line naming
    the call and the GPU, the other GPU put back, the hung one's state file kept; exit 1."""
    hung = {
        "DVFS_NVML_DEADLINE_S": "0.5",
        "DVFS_FAKE_NVML_HANG": "nvmlDeviceGetTotalEnergyConsumption@0=inf",
    }
    proc, log = start_governor(tmp_path, {**env, **hung}, stub, "--gpu", "1")
    try:
        assert proc.wait(timeout=STUCK_S) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    [line] = lines(log, "Error:")
    uuid = nvml.fake_device_state(0)["uuid"]
    assert line.startswith(f"Error: GPU 0 ({uuid}) stopped answering while governed: "), line
    assert "nvmlDeviceGetTotalEnergyConsumption on GPU 0" in line, line
    assert "did not return within 0.5 s" in line and "put GPU 1 back as found" in line, line
    assert "dvfs gpu reset" in line and "Traceback" not in log.read_text()
    healthy = nvml.fake_device_state(1)
    assert healthy["locked_clocks"] is None and healthy["power_limit_mw"] == 700_000
    assert (Path(env["DVFS_STATE_DIR"]) / f"{uuid}.json").exists()


def test_the_monitor_exports_a_gpu_whose_read_hangs_as_not_up_and_goes_on(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    """A read of GPU 0 that hangs in the driver: at its deadline the monitor logs GPU 0 as not
    answering, exports it with dvfs_gpu_up 0, and goes on reading GPU 1 every interval (its
    last-read time advancing); a SIGTERM then stops it, exit 143."""
    hung = {
        "DVFS_NVML_DEADLINE_S": "0.5",
        "DVFS_FAKE_NVML_HANG": "nvmlDeviceGetTotalEnergyConsumption@0=inf",
    }
    log = tmp_path / "monitor.log"
    args = ["monitor", "--interval", "0.05", "--listen", "127.0.0.1:0"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dvfs", *args, "--max-intervals", "100000"],
            env={**env, **hung},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: bool(lines(log, "serving metrics on")), "the exporter", log)
        url = re.findall(r"serving metrics on (\S+)", log.read_text())[0]
        wait_for(lambda: gpu_series(url, "0").get("dvfs_gpu_up") == 0.0, "GPU 0 not up", log)
        assert "dvfs_gpu_power_watts" not in gpu_series(url, "0")
        assert gpu_series(url, "1")["dvfs_gpu_up"] == 1.0

        def read_at() -> float:
            page = httpx.get(url, timeout=10).text
            return page_values(page)[("dvfs_last_read_timestamp_seconds", None)]

        first = read_at()
        wait_for(lambda: read_at() > first, "the reads going on", log)
        assert gpu_series(url, "1")["dvfs_gpu_up"] == 1.0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STUCK_S) == 143, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    [silent] = lines(log, "stopped answering")
    assert "nvmlDeviceGetTotalEnergyConsumption on GPU 0" in silent, silent
    assert "did not return within 0.5 s" in silent and "Traceback" not in log.read_text()


@pytest.mark.parametrize(
    ("command", "reads"),
    [
        (("govern", "--plan", "plan.toml", "--dry-run", "--listen", "off"), 1 + 5),
        (("monitor", "--once"), 2),
    ],
)
def test_a_run_reads_the_server_every_interval_over_one_connection(
    tmp_path: Path,
    env: dict[str, str],
    nvml,
    monkeypatch: pytest.MonkeyPatch,
    command: tuple[str, ...],
    reads: int,
) -> None:
    """Each interval's read of /metrics goes through the one client of the run: a client per
    read built a TLS context and a connection every interval (most of a governor's CPU). The
    dry run reads once to check the server, then once per interval; `monitor --once` twice."""
    import dvfs.cli.govern

    # a read timed out on a loaded machine would open a second connection: 5 s each
    monkeypatch.setattr(dvfs.cli.govern, "_timeout", lambda interval: 5.0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.toml").write_text(PLAN)
    server = CountingMetrics()
    with server.serving() as url:
        result = dvfs_in_process(
            *command,
            *("--url", url, "--gpu", "0", "--interval", "0.01", "--max-intervals", "5"),
            env=env,
        )
    assert result.returncode == 0, result.stderr
    assert server.requests == reads, result.stderr
    assert server.connections == 1


class TricklingMetrics(CountingMetrics):
    """A loopback /metrics page sent a byte at a time, `delay_s` apart (a server too busy to
    send it whole), every byte sooner than an HTTP read times out."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        super().__init__()

    def send(self, out: BinaryIO, body: bytes) -> None:
        with contextlib.suppress(OSError):  # the reader gave up: it hung up
            for byte in body:
                out.write(bytes([byte]))
                out.flush()
                time.sleep(self.delay_s)


#: The two commands that read a server's /metrics page: `monitor` once, and a governor's dry
#: run with no listener.
EITHER_READER = pytest.mark.parametrize(
    "command",
    [("monitor", "--once"), ("govern", "--plan", "plan.toml", "--dry-run", "--listen", "off")],
)


@EITHER_READER
def test_a_page_that_trickles_in_is_a_server_not_answering(
    tmp_path: Path,
    env: dict[str, str],
    nvml,
    monkeypatch: pytest.MonkeyPatch,
    command: tuple[str, ...],
) -> None:
    """A /metrics page that came a byte at a time held each read for as long as it trickled
    (the HTTP client's timeout bounds each wait for bytes, not the page): here 6 s a read
    against an interval of 0.2 s and a timeout of 0.5 s, a governor kept at a cap the load
    may have outgrown all the while, the page then read as a server answering. The whole
    page must now come within the timeout, else the server is not answering."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.toml").write_text(PLAN)
    with TricklingMetrics(delay_s=0.1).serving() as url:
        result = dvfs_in_process(
            *command,
            *("--url", url, "--gpu", "0", "--interval", "0.2", "--max-intervals", "1"),
            env=env,
        )
    # (a dry run's first read, whether there is a server at all, is given 5 s: the page's
    # 6 s are still too long)
    within = "0.5 s" if command[0] == "monitor" else "5 s"
    said = f"cannot read {url}/metrics: its page did not come within {within}"
    assert said in result.stderr, result.stderr
    if command[0] == "monitor":
        assert result.returncode == 0 and "dvfs_server_up 0.0" in result.stdout, result.stdout
    else:  # a dry run with no load to preview
        assert result.returncode == 1 and "is not answering" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


class SlowFirstMetrics(CountingMetrics):
    """A loopback /metrics page whose first answer comes `delay_s` late (a healthy server on a
    loaded machine, slow to answer at first), every later one at once."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        super().__init__()

    def page(self) -> bytes:
        if self.requests == 1:
            time.sleep(self.delay_s)
        return super().page()


def test_a_dry_run_waits_for_a_server_slow_to_answer_its_first_read(
    tmp_path: Path, env: dict[str, str], nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run's first read decides whether there is a server to preview: it got the
    interval's deadline (0.5 s for an --interval of 0.1 s), so a healthy server slower than
    that to answer (a loaded machine) was "not answering", exit 1, with advice to start SGLang
    there. That read now gets the longest deadline of any (5 s): here a first answer 1 s late
    is previewed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.toml").write_text(PLAN)
    server = SlowFirstMetrics(delay_s=1.0)
    with server.serving() as url:
        result = dvfs_in_process(
            *("govern", "--plan", "plan.toml", "--dry-run", "--listen", "off"),
            *("--url", url, "--gpu", "0", "--interval", "0.1", "--max-intervals", "1"),
            env=env,
        )
    assert result.returncode == 0, result.stderr
    assert "not answering" not in result.stderr, result.stderr
    assert "would set running batch 2 -> " in result.stderr, result.stderr  # the page's batch
    assert server.requests >= 2  # the first read, then the interval's
    assert nvml.fake_calls() == []


class OneReadHangsMetrics(CountingMetrics):
    """A loopback /metrics page whose read number `hung` is not answered until `release` is
    set (a server stalled past the reader's deadline), every other read at once."""

    def __init__(self, hung: int) -> None:
        self.hung = hung
        self.release = threading.Event()
        super().__init__()

    def page(self) -> bytes:
        if self.requests == self.hung:
            self.release.wait(STUCK_S)
        return super().page()

    def send(self, out: BinaryIO, body: bytes) -> None:
        with contextlib.suppress(OSError):  # the reader gave up: it hung up
            out.write(body)

    def handle_error(self, request: object, client_address: object) -> None:
        pass


def test_a_read_past_its_deadline_keeps_the_governors_setting(
    tmp_path: Path, env: dict[str, str], nvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A governor at --interval 0.05 gives each read of /metrics 0.5 s; one that missed it (a
    loaded machine) put the GPUs at stock at once ("while the server's batch cannot be read",
    within the dwell), and the dwell held them there for 10 s: a change each way, the caps
    lost, for one late read. The setting in force is now held, the miss said once. (The grace,
    5 s after the last answered read, is made endless: no stall of a loaded machine outlasts
    it.)"""
    import dvfs.govern.loop

    monkeypatch.setattr(dvfs.govern.loop, "SERVER_GRACE_S", math.inf, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.toml").write_text(PLAN)
    server = OneReadHangsMetrics(hung=2)
    try:
        with server.serving() as url:
            result = dvfs_in_process(
                *("govern", "--plan", "plan.toml", "--listen", "off", "--gpu", "0"),
                *("--url", url, "--interval", "0.05", "--max-intervals", "4"),
                env=env,
            )
    finally:
        server.release.set()
    assert result.returncode == 0, result.stderr
    assert "timed out; the setting in force is held (stock if it does not answer" in (
        result.stderr
    ), result.stderr
    assert "cannot be read" not in result.stderr, result.stderr
    assert len(re.findall(r" dvfs: set ", result.stderr)) == 1, result.stderr
    assert server.requests >= 3  # the answered read, the one that hung, one answered after
    assert [c["args"] for c in nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")] == [[210, 1500]]


class HugeMetrics(CountingMetrics):
    """A loopback /metrics page of SGLang's lines after a comment of 17 MiB (a wrong --url, a
    broken server: one without end was read whole until the timeout, gigabytes a second)."""

    def page(self) -> bytes:
        return b"# " + b"x" * (17 << 20) + b"\n" + super().page()

    def send(self, out: BinaryIO, body: bytes) -> None:
        with contextlib.suppress(OSError):  # the reader gave up: it hung up
            out.write(body)

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the reader hung up mid-page, as it should: no traceback in its stderr


@EITHER_READER
def test_a_page_far_larger_than_sglangs_is_not_read_whole(
    tmp_path: Path,
    env: dict[str, str],
    nvml,
    monkeypatch: pytest.MonkeyPatch,
    command: tuple[str, ...],
) -> None:
    """A /metrics page was read whole, however large, into memory and parsed: one without end
    took gigabytes within the timeout. Past 16 MiB the read stops, one line naming the page.
    The read gets the longest timeout there is (5 s, that of an --interval of 5 s or more: the
    17 MiB come well within it, however loaded the machine), but a short --interval, the wait
    between `monitor --once`'s two reads."""
    import dvfs.cli.govern

    monkeypatch.setattr(dvfs.cli.govern, "_timeout", lambda interval: 5.0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.toml").write_text(PLAN)
    with HugeMetrics().serving() as url:
        result = dvfs_in_process(
            *command,
            *("--url", url, "--gpu", "0", "--interval", "0.2", "--max-intervals", "1"),
            env=env,
        )
    said = f"{url}/metrics: its page holds more than 16 MiB, far more than SGLang's /metrics"
    assert said in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_server_is_read_at_the_url_given_and_a_port_out_of_range_is_refused(
    env: dict[str, str], nvml
) -> None:
    """`--url` with a query or a fragment had /metrics appended to them, so the page read was
    the server's / (a 404 blamed on --enable-metrics, or another page); and a port above 65535
    passed, the socket layer taking it modulo 65536: another port's server read, silently. The
    query stays (after /metrics), the fragment goes, and a port outside 1-65535 is a usage
    error, exit 2, its credentials not shown."""
    server = CountingMetrics()
    port = server.server_address[1]
    with server.serving():
        for url, path in (
            (f"{server.url}/?x=1", "/metrics?x=1"),
            (f"{server.url}/metrics/?x=1", "/metrics?x=1"),
            (f"{server.url}#top", "/metrics"),
        ):
            server.paths.clear()
            result = dvfs_in_process(
                *("monitor", "--once", "--url", url, "--gpu", "0", "--interval", "0.01"),
                env=env,
            )
            assert result.returncode == 0, result.stderr
            assert server.paths == [path, path], (url, server.paths)
            assert "dvfs_server_running_requests 2.0" in result.stdout
        server.paths.clear()
        for url in (
            f"http://127.0.0.1:{port + 65536}",
            f"http://alice:pw-1@127.0.0.1:{port + 65536}",
        ):
            result = dvfs_in_process(
                *("monitor", "--once", "--url", url, "--gpu", "0", "--interval", "0.01"), env=env
            )
            printed = result.stdout + result.stderr
            assert result.returncode == 2, printed
            assert f"has port {port + 65536}, not one from 1 to 65535" in printed, printed
            assert "pw-1" not in printed and "Traceback" not in printed, printed
        assert server.paths == []  # nothing read at the port it wraps around to


def _refused_by_monitor_and_govern(
    tmp_path: Path, env: dict[str, str], urls: tuple[str, str], listen: bool = False
) -> list[str]:
    """Run `monitor` with the first value and `govern --dry-run` with the second, as --url (or
    --listen): each must end in exit 2 with one error line naming that option. Returns what
    each printed."""
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    option = "--listen" if listen else "--url"
    once = [] if listen else ["--once"]
    dry = [] if listen else ["--dry-run"]
    said = []
    for argv in (
        ["monitor", *once, option, urls[0], "--gpu", "0", "--interval", "0.01"],
        ["govern", "--plan", str(plan), option, urls[1], "--gpu", "0", *dry],
    ):
        result = dvfs_in_process(*argv, "--max-intervals", "1", env=env)
        printed = result.stdout + result.stderr
        assert result.returncode == 2, printed
        [line] = [line for line in printed.splitlines() if "Error:" in line]
        assert f"Invalid value for {option}" in line, printed
        said.append(printed)
    return said


@pytest.mark.parametrize("host", ["gpu-node..local", "xn--a", "a" * 64 + ".local"])
def test_a_url_whose_host_name_cannot_be_encoded_is_a_usage_error(
    tmp_path: Path, env: dict[str, str], nvml, host: str
) -> None:
    """A --url host name with an empty or overlong label, or punycode that does not decode,
    passed the URL check and ended the run at its first read in a UnicodeError, reported as
    "cannot handle text in an input file" (exit 1: the units restart on it). It is a bad
    --url, exit 2 in one line, before any GPU is opened."""
    url = f"http://{host}:30000"
    for printed in _refused_by_monitor_and_govern(tmp_path, env, (url, url)):
        assert "is not a URL" in printed, printed
    assert nvml.fake_calls() == []


def test_a_listen_host_that_cannot_be_encoded_is_a_usage_error(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    """`--listen gpu-node..local:9436` passed the check and ended the run as it started
    serving, in a UnicodeError reported as "cannot handle text in an input file" (exit 1). It
    is a bad --listen, exit 2 in one line, before any GPU is opened."""
    hosts = ("gpu-node..local:9436", "gpu-node..local:9435")
    for printed in _refused_by_monitor_and_govern(tmp_path, env, hosts, listen=True):
        assert "names no host" in printed, printed
    assert nvml.fake_calls() == []


@pytest.mark.parametrize("prefix", ["/a%2Fb/", "/a%3Fb", "/a%23b/metrics/"])
def test_a_url_path_with_escaped_characters_is_read_as_written(
    env: dict[str, str], nvml, prefix: str
) -> None:
    """A --url whose path holds an escaped "/", "?" or "#" (a reverse proxy's prefix, as
    written): the path was decoded before /metrics was put into it, so %2F became a separator
    (another page read, silently) and %3F or %23 ended the run in "internal error:
    InvalidURL", exit 1. The page read is the prefix as written, then /metrics."""
    server = CountingMetrics()
    with server.serving() as url:
        result = dvfs_in_process(
            *("monitor", "--once", "--url", url + prefix, "--gpu", "0"),
            *("--interval", "0.01"),
            env=env,
        )
    assert result.returncode == 0, result.stdout + result.stderr
    path = prefix.removesuffix("/").removesuffix("/metrics") + "/metrics"
    assert server.paths == [path, path], server.paths


@pytest.mark.parametrize(
    "url", ["http://alice:pw-1@[::1:30000", "http://alice:pw-1@[gpu-node]:30000/?token=tk-1"]
)
def test_a_bad_url_s_credentials_are_not_shown(
    tmp_path: Path, env: dict[str, str], nvml, url
) -> None:
    """A --url whose bracketed host is no IPv6 address (one "]" short, a name) was refused
    with its user and password, and a secret query parameter, printed as given: the URL
    could not be taken apart to hide them. It is refused, exit 2, without them."""
    for printed in _refused_by_monitor_and_govern(tmp_path, env, (url, url)):
        assert "is not a URL" in printed, printed
        assert "pw-1" not in printed and "tk-1" not in printed, printed
        assert "alice" not in printed, printed
    assert nvml.fake_calls() == []


def closed_port() -> int:
    """A loopback port nothing listens on: bound by the kernel's choice, then released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("user", ["", "alice:pw-1@"])
def test_a_dry_run_whose_server_is_down_says_so_in_one_line(
    tmp_path: Path, env: dict[str, str], nvml, user: str
) -> None:
    """Nothing listens at --url: the dry run has no load to preview. One line says the server
    is not answering, what the governor would do meanwhile and what to fix; exit 1; no GPU
    setter called and no metrics served. A password in the URL is not in it (the service's
    log keeps the line)."""
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    port = closed_port()
    url = f"http://{user}127.0.0.1:{port}"
    shown = f"http://{'(not recorded)@' if user else ''}127.0.0.1:{port}"
    result = dvfs_in_process(
        *("govern", "--plan", str(plan), "--url", url, "--gpu", "0", "--interval", "0.1"),
        *("--listen", "127.0.0.1:0", "--dry-run", "--max-intervals", "3"),
        env=env,
    )
    assert result.returncode == 1, result.stderr
    printed = (result.stdout + result.stderr).strip().splitlines()
    assert len(printed) == 1, printed
    [line] = printed
    assert line.startswith(
        f"Error: dry run: the server at {shown} is not answering (cannot read {shown}/metrics: "
    )
    assert "pw-1" not in line
    assert (
        "the governor would hold GPU 0 at stock, the static caps in force (GPU 0: SM clock "
        "unlocked, power limit 700 W)"
    ) in line
    assert line.endswith("Start SGLang there with --enable-metrics, or point --url at it")
    assert nvml.fake_calls() == []


def test_a_dry_run_whose_server_has_no_metrics_names_the_flag(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    """A server that answers but without --enable-metrics: the same one line, its own cause."""
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    with launch_stub(tmp_path, metrics=False) as url:
        result = dvfs_in_process(
            *("govern", "--plan", str(plan), "--url", url, "--gpu", "0", "--listen", "off"),
            *("--dry-run", "--max-intervals", "1"),
            env=env,
        )
    assert result.returncode == 1, result.stderr
    [line] = (result.stdout + result.stderr).strip().splitlines()
    assert line.startswith(f"Error: dry run: {url}/metrics answered 404: start SGLang with ")
    assert "--enable-metrics; the governor would hold GPU 0 at stock" in line
    assert nvml.fake_calls() == []


def unit_argv(unit: str, tmp_path: Path, stub: str) -> tuple[str, list[str]]:
    """A unit file's text and its ExecStart as dvfs's argv, run as written but for the paths
    and ports: the test plan (written to `tmp_path`), free ports and the stub server."""
    text = (REPO / "systemd" / unit).read_text()
    [start] = [
        line[len("ExecStart=") :] for line in text.splitlines() if line.startswith("ExecStart=")
    ]
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    argv = (
        start.replace("/usr/local/bin/dvfs", "")
        .replace("/etc/dvfs/govern-plan.toml", str(plan))
        .replace("127.0.0.1:9435", "127.0.0.1:0")
        .replace("127.0.0.1:9436", "127.0.0.1:0")
        .replace("http://127.0.0.1:30000", stub)
        .split()
    )
    return text, argv


def test_the_systemd_units_command_line_runs(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    """ExecStart of systemd/dvfs-govern.service, pointed at a test plan, a free port, the stub
    and a dry run: every option it passes exists and parses."""
    _, argv = unit_argv("dvfs-govern.service", tmp_path, stub)
    result = dvfs_in_process(*argv, "--dry-run", "--max-intervals", "1", "--gpu", "0", env=env)
    assert result.returncode == 0, result.stderr
    assert "would set running batch 0 -> plan batch 1" in result.stderr
    assert nvml.fake_calls() == []


def test_the_monitor_units_command_line_runs(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    """ExecStart of systemd/dvfs-monitor.service, pointed at the stub and a free port, for two
    intervals: every option it passes exists, and it serves the server's metrics too."""
    _, argv = unit_argv("dvfs-monitor.service", tmp_path, stub)
    result = dvfs_in_process(*argv, "--max-intervals", "2", env=env)
    assert result.returncode == 0, result.stderr
    assert "serving metrics on http://127.0.0.1:" in result.stderr
    assert "server:" not in result.stderr  # the stub answered
    assert nvml.fake_calls() == []  # read-only


@pytest.mark.parametrize("unit", ["dvfs-govern.service", "dvfs-monitor.service"])
def test_the_governor_and_monitor_units_wait_for_a_driver_loading_late(
    tmp_path: Path, env: dict[str, str], nvml, stub: str, monkeypatch: pytest.MonkeyPatch, unit: str
) -> None:
    """At boot the NVIDIA driver may not be loaded yet (a DKMS build takes minutes). The
    governor and monitor units ran `govern` / `monitor` without waiting: exit 1 at once, a
    restart every RestartSec=10, and after the fifth start in ten minutes (StartLimitBurst=5)
    the unit failed for good, well before the driver loaded (the governor waits on the caps
    unit only where /etc/dvfs/caps.toml is there). Their ExecStart, run as written but for the
    paths and ports, now waits for the driver, then runs."""
    import dvfs.gpu.nvml

    text, argv = unit_argv(unit, tmp_path, stub)
    argv += ["--max-intervals", "1"] + (["--gpu", "0"] if "govern" in argv else [])
    restarts = re.search(r"^RestartSec=(\d+)$", text, re.M)
    burst = re.search(r"^StartLimitBurst=(\d+)$", text, re.M)
    assert restarts and burst and "Restart=on-failure" in text  # what a failure at once met
    assert "--wait-for-driver" in argv, argv
    wait_s = int(argv[argv.index("--wait-for-driver") + 1])
    assert wait_s > int(restarts[1]) * int(burst[1]), "the wait outlasts the restarts it replaces"
    not_loaded = {**env, "DVFS_FAKE_NVML_INIT_ERROR": str(nvml.NVML_ERROR_DRIVER_NOT_LOADED)}
    slept: list[float] = []

    def driver_loads_at_the_second_try(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 2:  # the module is loaded now
            os.environ.pop("DVFS_FAKE_NVML_INIT_ERROR")

    monkeypatch.setattr(dvfs.gpu.nvml, "_sleep", driver_loads_at_the_second_try)
    result = dvfs_in_process(*argv, env=not_loaded)
    assert result.returncode == 0, result.stderr
    assert slept == [dvfs.gpu.nvml.DRIVER_POLL_S] * 2
    [said] = [line for line in result.stderr.splitlines() if "waiting up to" in line]
    assert said.endswith(f"waiting up to {wait_s} s for it, trying again every 5 s"), said
    assert ("governing GPU 0" if "govern" in argv else "serving metrics on") in result.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--plan", "nope.toml"], 2, "per-batch plan nope.toml does not exist"),
        # said "cannot read the per-batch plan ...: Not a directory", with no way on
        (["--plan", "p.toml/plan.toml"], 2, "per-batch plan p.toml/plan.toml does not exist"),
        # said "does not exist (or is not a file)" of a device that is there
        (
            ["--plan", "/dev/null"],
            2,
            "per-batch plan /dev/null is a device or socket, not a regular file: give the file "
            "`dvfs cap plan HEADROOM_JSON --per-batch` wrote",
        ),
        (["--plan", "p.toml", "--interval", "0"], 2, "--interval: must be more than 0"),
        (["--plan", "p.toml", "--interval", "1x"], 2, "is not a duration such as 500ms"),
        # an internal OverflowError (a wait past time_t) once; a day is the longest span taken
        (["--plan", "p.toml", "--interval", "200000000m"], 2, "is longer than a day"),
        (["--plan", "p.toml", "--dwell", "86401"], 2, "is longer than a day"),
        (["--plan", "p.toml", "--listen", "9435"], 2, "must be HOST:PORT"),
        (["--plan", "p.toml", "--url", "http://127.0.0.1:port"], 2, "is not a URL"),
        (["--plan", "p.toml", "--url", "localhost:30000"], 2, "is not an http(s)://HOST:PORT"),
        (["--plan", "p.toml", "--hysteresis", "-1"], 2, "--hysteresis must be between 0 and 10"),
    ],
)
def test_bad_govern_options_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], code: int, message: str
) -> None:
    from click.testing import CliRunner

    from dvfs.cli import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.toml").write_text(PLAN)
    result = CliRunner().invoke(cli, ["govern", *args, "--dry-run", "--max-intervals", "1"])
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output


def test_a_gpu_named_twice_is_refused_in_one_line(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    """`--gpu 0 --gpu <GPU 0's UUID>` names one GPU twice: the governor refused it as in use by
    another dvfs process (its own pid, exit 3), and the monitor exported each of its series
    twice (a page Prometheus rejects) and summed its energy twice into the server's energy per
    token. Each is a usage error (exit 2), as a campaign listing a GPU twice is."""
    uuid = json.loads(dvfs_in_process("gpu", "list", "--json", env=env).stdout)[0]["uuid"]
    closed = f"http://127.0.0.1:{closed_port()}"
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    for argv in (
        ["monitor", "--once", "--interval", "0.01", "--gpu", "0", "--gpu", uuid],
        ["govern", "--plan", str(plan), "--url", closed, "--gpu", "0", "--gpu", uuid],
        ["cap", "reset", "0", "0"],
    ):
        result = dvfs_in_process(*argv, env=env)
        printed = result.stdout + result.stderr
        assert result.returncode == 2, printed
        assert "GPU 0" in printed and "named twice" in printed, printed
        assert len([line for line in printed.splitlines() if "Error:" in line]) == 1, printed
    assert not nvml.fake_calls()


def test_a_gpu_not_on_the_host_is_a_usage_error_the_units_do_not_restart_on(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    """`dvfs govern --gpu 5` on a host of two GPUs (a typo in the unit's ExecStart) exited 1,
    so dvfs-govern.service restarted it five times before failing, and dvfs-monitor.service
    likewise: an error no restart fixes. It is a usage error, exit 2, which each unit that
    restarts lists in RestartPreventExitStatus; nothing is changed on the GPUs."""
    closed = f"http://127.0.0.1:{closed_port()}"
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    for argv in (
        ["govern", "--plan", str(plan), "--url", closed, "--gpu", "5"],
        ["govern", "--plan", str(plan), "--url", closed, "--gpu", "0", "--gpu", "GPU-nothere"],
        ["monitor", "--once", "--interval", "0.01", "--gpu", "5"],
        ["cap", "reset", "5"],
    ):
        result = dvfs_in_process(*argv, env=env)
        printed = result.stdout + result.stderr
        assert result.returncode == 2, (argv, printed)
        assert "this machine has 2 GPU(s)" in printed and "Traceback" not in printed, printed
        assert len([line for line in printed.splitlines() if "Error:" in line]) == 1, printed
    assert not nvml.fake_calls()
    for unit in ("dvfs-govern.service", "dvfs-monitor.service"):
        text = (REPO / "systemd" / unit).read_text()
        [prevent] = re.findall(r"^RestartPreventExitStatus=(.*)$", text, re.M)
        assert "2" in prevent.split(), unit


def test_a_gpu_with_mig_enabled_is_an_error_the_governor_unit_does_not_restart_on(
    tmp_path: Path, env: dict[str, str], nvml
) -> None:
    """`dvfs govern` on a GPU with MIG enabled (named by --gpu, or one of every GPU) exited 1,
    so dvfs-govern.service restarted it five times before failing: MIG stays on through any
    restart. It exits 2, which the unit lists in RestartPreventExitStatus; nothing changed."""
    nvml.fake_update_device(1, mig=True)
    closed = f"http://127.0.0.1:{closed_port()}"
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    for gpu in (("--gpu", "1"), ()):
        for dry in ((), ("--dry-run",)):
            result = dvfs_in_process(
                "govern", "--plan", str(plan), "--url", closed, *gpu, *dry, env=env
            )
            printed = result.stdout + result.stderr
            assert result.returncode == 2, (gpu, dry, printed)
            assert "GPU 1 (" in printed and "has MIG enabled" in printed, printed
            assert "`sudo nvidia-smi -i 1 -mig 0`" in " ".join(printed.split()), printed
            assert len([line for line in printed.splitlines() if "Error:" in line]) == 1
    assert not nvml.fake_calls()
    text = (REPO / "systemd" / "dvfs-govern.service").read_text()
    [prevent] = re.findall(r"^RestartPreventExitStatus=(.*)$", text, re.M)
    assert "2" in prevent.split()


def test_the_stubs_metrics_follow_its_requests_with_sglangs_names(tmp_path: Path) -> None:
    from dvfs.govern.metrics import scrape

    with launch_stub(tmp_path, "--speculative-algorithm", "EAGLE") as url:
        idle = scrape(url, 10)
        assert idle.running == 0 and idle.generated_tokens == 0 == idle.decoded_tokens
        with held_batch(url, 5, tokens_per_step=3):
            wait_for(lambda: scrape(url, 10).running == 5, "5 running requests")
            wait_for(lambda: (scrape(url, 10).decoded_tokens or 0) > 20, "tokens decoded")
            # SGLang counts a request's generated tokens as it finishes: none has yet
            assert scrape(url, 10).generated_tokens == 0
        wait_for(lambda: scrape(url, 10).running == 0, "the dropped stream to end")
        busy = scrape(url, 10)
        assert busy.accept_length is not None and busy.accept_length > 1  # EAGLE: several/step
        # the dropped requests, aborted, counted with every token they made (a prefill's too)
        assert busy.generated_tokens is not None and busy.decoded_tokens is not None
        assert busy.generated_tokens == busy.decoded_tokens + 5
    (tmp_path / "plain").mkdir()
    with launch_stub(tmp_path / "plain") as plain:
        # no drafter, no accept length: SGLang's gauge is there, at 0
        assert "sglang:spec_accept_length" in httpx.get(plain + "/metrics", timeout=10).text
        assert scrape(plain, 10).accept_length is None


def test_without_permission_the_governor_exits_4_and_leaves_nothing(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN)
    result = dvfs_in_process(
        *("govern", "--plan", str(plan), "--url", stub, "--gpu", "0", "--interval", "0.1"),
        *("--listen", "127.0.0.1:0", "--max-intervals", "50"),
        env={**env, "DVFS_FAKE_NVML_ROOT": "0"},
    )
    assert result.returncode == 4, result.stderr
    printed = result.stdout + result.stderr
    errors = [line for line in printed.splitlines() if "Error:" in line]
    assert len(errors) == 1 and "permission" in errors[0].lower(), printed
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("GPU-*.json"))
    assert nvml.fake_device_state(0)["locked_clocks"] is None


@pytest.mark.parametrize("unsafe", ["world-writable", "group-writable", "not owned by root"])
def test_as_root_a_plan_others_can_write_is_refused_as_a_caps_file_is(
    tmp_path: Path, env: dict[str, str], nvml, monkeypatch: pytest.MonkeyPatch, unsafe: str
) -> None:
    """A plan sets GPU caps as a caps file does: as root, the same check refuses both (the
    effective uid is faked to root; a real root hands the files to another owner). A file its
    group (not root's) may write was let through: that group's members could set GPU caps."""
    from dvfs.caps import CapsFile, GpuCap, dump_caps

    plan, caps = tmp_path / "plan.toml", tmp_path / "caps.toml"
    plan.write_text(PLAN)
    caps.write_text(dump_caps(CapsFile((GpuCap(name="NVIDIA H100 80GB HBM3", power_limit_w=400),))))
    for path in (plan, caps):
        if unsafe == "world-writable":
            path.chmod(0o666)
        elif unsafe == "group-writable":
            path.chmod(0o664)
            if os.getegid() == 0:  # else the file's group is already the runner's own
                os.chown(path, -1, 1)
        elif os.geteuid() == 0:
            os.chown(path, 1, -1)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    for args in (
        ("govern", "--plan", str(plan), "--gpu", "0", "--listen", "off", "--max-intervals", "1"),
        ("cap", "apply", str(caps)),
    ):
        result = dvfs_in_process(*args, env=env)
        assert result.returncode == 2, result.stderr
        assert f"is {unsafe}; as root dvfs refuses it" in result.stderr, result.stderr
    assert nvml.fake_calls() == []


CAPPED_PLAN = PLAN.split("[[batch]]")[0] + "".join(
    f"[[batch]]\nbatch = {batch}\nsm_clock_mhz = {mhz}\n"
    for batch, mhz in ((1, 1230), (8, 1380), (32, 1680))
)


def cap_show(env: dict[str, str]) -> str:
    """`dvfs cap show`'s text as one line (the console wraps it at its width)."""
    result = dvfs_in_process("cap", "show", env=env)
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split())


def metric(text: str, name: str, gpu: str) -> float:
    return next(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and s.labels.get("gpu") == gpu
    )


def test_the_governor_stays_under_the_static_caps_shows_its_lock_and_puts_them_back(
    tmp_path: Path, env: dict[str, str], nvml, stub: str
) -> None:
    """After `cap apply` (GPU 0 at 210-1500 MHz, 500 W) the governor's stock is those caps and
    a step above them is held at them; while it holds a lower lock, `cap show` and `monitor`
    show that lock as the governor's; on exit the caps are back as they were."""
    from dvfs.caps import CapsFile, GpuCap, dump_caps

    uuid = json.loads(dvfs_in_process("gpu", "list", "--json", env=env).stdout)[0]["uuid"]
    caps = tmp_path / "caps.toml"
    caps.write_text(dump_caps(CapsFile((GpuCap(uuid, sm_clock_max_mhz=1500, power_limit_w=500),))))
    assert dvfs_in_process("cap", "apply", str(caps), env=env).returncode == 0
    applied = len(nvml.fake_calls())
    plan = tmp_path / "capped-plan.toml"
    plan.write_text(CAPPED_PLAN)
    log = tmp_path / "govern.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dvfs", "govern", "--plan", str(plan), "--url", stub]
            + ["--gpu", "0", "--interval", "0.1", "--listen", "off", "--dwell", "0.3"]
            + ["--max-intervals", "3000"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def said(marker: str) -> Callable[[], bool]:
        return lambda: bool(lines(log, marker))

    try:
        wait_for(said("running batch 0 ->"), "the idle setting", log)
        assert (
            "plan batch 1: SM clock <= 1230 MHz, power limit stock; GPU 0: SM clock locked "
            "210-1230 MHz, power limit 500 W (stock: the limit in force at start)"
        ) in lines(log, "running batch 0 ->")[0]
        assert (
            "static caps in force, the ceiling of every step and what the plan calls stock "
            "(restored on exit): GPU 0: SM clock locked 210-1500 MHz, power limit 500 W"
        ) in log.read_text()
        shown = cap_show(env)
        assert "locked 210-1230 MHz by dvfs govern (pid" in shown, shown
        assert "under the static cap 210-1500 MHz" in shown
        [row, _] = json.loads(dvfs_in_process("cap", "show", "--json", env=env).stdout)
        assert row["sm_clock_lock_mhz"] == [210, 1230] and row["caps_sm_clock_lock_mhz"] == [
            210,
            1500,
        ]
        page = dvfs_in_process("monitor", "--once", "--gpu", "0", "--interval", "0.1", env=env)
        assert metric(page.stdout, "dvfs_gpu_sm_clock_lock_max_hertz", "0") == 1.23e9
        assert metric(page.stdout, "dvfs_gpu_sm_clock_lock_by_governor", "0") == 1
        with held_batch(stub, 40):
            wait_for(said("running batch 40 ->"), "the step above the plan", log)
            assert (
                "above plan batch 32 (stock): SM clock stock, power limit stock; GPU 0: SM "
                "clock locked 210-1500 MHz (stock: the static cap in force), power limit 500 W "
                "(stock: the limit in force at start)"
            ) in lines(log, "running batch 40 ->")[0]
            assert nvml.fake_device_state(0)["locked_clocks"] == [210, 1500]
            shown = cap_show(env)
            assert "locked 210-1500 MHz by dvfs cap apply" in shown, shown
        with held_batch(stub, 8):
            wait_for(said("running batch 8 ->"), "the step to plan batch 8", log)
            assert (
                "SM clock <= 1680 MHz, power limit stock; GPU 0: SM clock locked 210-1500 MHz "
                "(the static cap in force: the plan's 1680 MHz is above it), power limit 500 W"
            ) in lines(log, "running batch 8 ->")[0]
            state = nvml.fake_device_state(0)
            assert state["locked_clocks"] == [210, 1500] and state["power_limit_mw"] == 500_000
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STUCK_S) == 143, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    governed = nvml.fake_calls()[applied:]
    assert all(c["args"][1] <= 1500 for c in governed if c["fn"] == "nvmlDeviceSetGpuLockedClocks")
    assert not any(c["fn"] == "nvmlDeviceSetPowerManagementLimit" for c in governed)
    assert not any(c["fn"] == "nvmlDeviceResetGpuLockedClocks" for c in governed)
    state = nvml.fake_device_state(0)
    assert state["locked_clocks"] == [210, 1500] and state["power_limit_mw"] == 500_000
    assert not list(Path(env["DVFS_STATE_DIR"]).glob("governed-*"))
    shown = cap_show(env)
    assert "locked 210-1500 MHz by dvfs cap apply" in shown
    page = dvfs_in_process("monitor", "--once", "--gpu", "0", "--interval", "0.1", env=env)
    assert metric(page.stdout, "dvfs_gpu_sm_clock_lock_max_hertz", "0") == 1.5e9
    assert metric(page.stdout, "dvfs_gpu_sm_clock_lock_by_governor", "0") == 0


def test_a_plan_given_through_a_pipe_is_read(tmp_path: Path) -> None:
    """`govern --plan <(...)`, a pipe: refused as a plan that "does not exist (or is not a
    file)"; it is read, as a caps file given so is (here: text that is no TOML, said so)."""
    import os

    from click.testing import CliRunner

    from dvfs.cli import cli

    read, written = os.pipe()
    try:
        os.write(written, b"not [toml\n")
        os.close(written)
        result = CliRunner().invoke(cli, ["govern", "--plan", f"/dev/fd/{read}"])
    finally:
        os.close(read)
    assert result.exit_code == 2, result.output
    assert f"/dev/fd/{read}: not valid TOML" in result.output, result.output
