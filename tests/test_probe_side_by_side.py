"""The GPUs a command acts on are probed side by side (`dvfs.backends.reachable_gpus`, one
thread per GPU, `dvfs.gpu.knobs.side_by_side` as the restores are): GPUs whose driver hangs
whole cost one NVML deadline in all, not one each, before `dvfs gpu reset` (the governor
unit's ExecStopPost, under its stop timeout) puts any GPU back. Runs `dvfs` against the fake
pynvml in a child process; every wait is on the fake's hangs or the child's exit, bounded only
so that a broken test does not hang."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import default_dispositions
from nvml_support import fake_env, load_fake

STUCK_S = 60.0  # a run that takes this long is stuck, not slow
EIGHT = ",".join(["h100-sxm"] * 8)
RESET = "nvmlDeviceResetGpuLockedClocks"
SET_LIMIT = "nvmlDeviceSetPowerManagementLimit"
#: Every call dvfs makes on a GPU past its handle, from its opening to its restore: a GPU on
#: which each hangs is one whose driver hangs whole.
WHOLE = (
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetSupportedMemoryClocks",
    "nvmlDeviceGetPowerManagementLimit",
    RESET,
    SET_LIMIT,
)


def hung_whole(gpus: range) -> str:
    """A `DVFS_FAKE_NVML_HANG` under which every call on `gpus` hangs until released."""
    return ",".join(f"{fn}@{i}=inf" for i in gpus for fn in WHOLE)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Eight fake GPUs run as root, each capped (1500 MHz, 400 W) with a state file that says
    it was at 700 W unlocked: as a governor killed at its stop timeout leaves them."""
    environment = fake_env(tmp_path, DVFS_FAKE_NVML_DEVICES=EIGHT, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_STATE_DIR"):
        monkeypatch.setenv(key, environment[key])
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "1")
    return environment


@pytest.fixture
def nvml(env: dict[str, str]) -> Iterator:  # type: ignore[type-arg]
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    module = load_fake()
    module.fake_reset_state()
    store = StateStore(Path(env["DVFS_STATE_DIR"]))
    for index in range(8):
        store.record(GpuSettings(module.fake_device_state(index)["uuid"], None, 700_000))
        module.fake_update_device(index, locked_clocks=[1500, 1500], power_limit_mw=400_000)
    yield module


def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + STUCK_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dvfs", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_dispositions,  # SIGINT as a foreground shell gives it
    )


def state_files(env: dict[str, str], nvml) -> list[int]:  # type: ignore[no-untyped-def]
    """The GPUs (by index) whose state file is still there."""
    folder = Path(env["DVFS_STATE_DIR"])
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(8)]
    return [i for i, uuid in enumerate(uuids) if (folder / f"{uuid}.json").exists()]


def as_found(nvml, index: int) -> bool:  # type: ignore[no-untyped-def]
    found = nvml.fake_device_state(index)
    return found["locked_clocks"] is None and found["power_limit_mw"] == 700_000


def test_gpu_reset_probes_gpus_hanging_whole_side_by_side_and_a_ctrl_c_there_changes_nothing(
    env: dict[str, str], nvml
) -> None:
    """`dvfs gpu reset` on 8 GPUs whose driver hangs whole on GPUs 0-5: it probed them one
    after another, each hung GPU costing its NVML deadline before the next was tried (six at
    10 s: a minute, past the governor unit's stop timeout, before GPUs 6 and 7 were put back).
    Probed side by side, all six are in the driver at once, no deadline waited (here an hour:
    one after another, GPU 1's probe waits for GPU 0's hour). A Ctrl-C there stops the reset
    as it did: exit 130, "Interrupted.", no GPU set (not GPUs 6 and 7 either), every state
    file kept."""
    hung = {**env, "DVFS_NVML_DEADLINE_S": "3600", "DVFS_FAKE_NVML_HANG": hung_whole(range(6))}
    proc = start(hung, "gpu", "reset")
    try:
        wait_for(lambda: len(nvml.fake_hangs_started()) == 6, "GPUs 0-5 probed at once")
        started = nvml.fake_hangs_started()
        assert sorted(h["index"] for h in started) == list(range(6)), started
        assert {h["fn"] for h in started} == {"nvmlDeviceGetUUID"}, started  # their opening
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=STUCK_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert out == "" and err.strip() == "Interrupted.", (out, err)
    assert nvml.fake_calls() == []  # no setter: nothing half done
    assert len(nvml.fake_hangs_started()) == 6  # and no probe hung after the Ctrl-C
    assert not any(as_found(nvml, i) for i in range(8))
    assert state_files(env, nvml) == list(range(8))


def test_gpu_reset_puts_back_the_gpus_that_answer_and_names_the_others_in_their_order(
    env: dict[str, str], nvml
) -> None:
    """`dvfs gpu reset` with GPUs 0-4 hanging whole to their deadline and GPU 5 fallen off the
    bus (its probe fails at once, before theirs end): GPUs 6 and 7 are put back (said, their
    state files removed, their clocks reset and power limits set and nothing else set), GPUs
    0-5 keep their state files, and the one line names them in their order, GPU 5 last
    whichever probe ended first, as one after another (GPUs 0-4, which failed alike, and the
    driver's advice said once); each hung GPU's probe began one call (its UUID's read) and
    none of their restores began; exit 1."""
    # a deadline a healthy call keeps however loaded the machine (the reset waits it out)
    hung = {**env, "DVFS_NVML_DEADLINE_S": "5", "DVFS_FAKE_NVML_HANG": hung_whole(range(5))}
    nvml.fake_update_device(5, lost=True)
    proc = start(hung, "gpu", "reset")
    try:
        out, err = proc.communicate(timeout=STUCK_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err
    said = " ".join(out.split())
    for index in (6, 7):
        uuid = nvml.fake_device_state(index)["uuid"]
        assert f"restored GPU {index} ({uuid}): clocks unlocked, power limit 700 W" in said, said
        assert as_found(nvml, index)
    [line] = [line for line in err.splitlines() if line.strip()]
    five = ", ".join(f"GPU {i}" for i in range(5))  # failed alike: said once, the advice too
    hung = f"Error: {five}: nvmlDeviceGetUUID on each did not return within 5 s; the driver is "
    assert line.startswith(hung) and line.count("the driver is not responding") == 1, line
    assert line.index("GPU 5") > len(hung) and "GPU is lost" in line, line
    assert line.endswith("it needs a reset or a reboot before it can be used"), line  # not cut
    calls = nvml.fake_calls()
    assert sorted((c["fn"], c["index"]) for c in calls) == [
        (RESET, 6),
        (RESET, 7),
        (SET_LIMIT, 6),
        (SET_LIMIT, 7),
    ], calls
    assert all(c["ok"] for c in calls), calls
    started = nvml.fake_hangs_started()
    assert sorted((h["fn"], h["index"]) for h in started) == [
        ("nvmlDeviceGetUUID", i) for i in range(5)
    ]
    assert state_files(env, nvml) == list(range(6))
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    ("named", "code", "said"),
    [
        (("0", "1", "2"), 4, "cannot open GPU 2: the driver does not let this process talk to it"),
        (("0", "1", "9"), 2, "no GPU 9: this machine has 8 GPU(s)"),
    ],
)
def test_a_named_gpu_refused_or_not_found_still_stops_the_reset_while_another_hangs(
    env: dict[str, str], nvml, named: tuple[str, ...], code: int, said: str
) -> None:
    """GPUs named side by side with GPU 0 hanging whole to its deadline: GPU 2 refusing this
    process (NVML: no permission), or a GPU 9 this machine lacks (a typo), is known before
    GPU 0's probe ends; the reset stops all the same, as one after another (exit 4, exit 2),
    in one line, and GPU 1, which answers, is not put back."""
    hung = {**env, "DVFS_NVML_DEADLINE_S": "5", "DVFS_FAKE_NVML_HANG": hung_whole(range(1))}
    nvml.fake_update_device(2, errors={"nvmlDeviceGetHandleByIndex": nvml.NVML_ERROR_NO_PERMISSION})
    proc = start(hung, "gpu", "reset", *named)
    try:
        out, err = proc.communicate(timeout=STUCK_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    [line] = [line for line in err.splitlines() if line.strip()]
    assert line.startswith("Error: ") and said in line, line
    assert out == "" and nvml.fake_calls() == []
    assert state_files(env, nvml) == list(range(8))
    assert "Traceback" not in err


def test_warnings_of_gpus_probed_side_by_side_are_logged_in_the_gpus_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two GPUs whose ECC mode the driver will not read (a warning each, "taken as not known")
    probed side by side, GPU 0's read held in the driver until GPU 1's probe has warned and is
    in its power limit's read: the warnings are said GPU 0 first, as one after another, not in
    the order the probes warned (which changes from run to run: GPU 1's first here)."""
    import logging
    import threading

    from nvml_support import fresh_fake

    from dvfs.backends import reachable_gpus

    nvml = fresh_fake(tmp_path, monkeypatch, "h100-sxm,h100-sxm")
    for index in (0, 1):
        nvml.fake_update_device(
            index, errors={"nvmlDeviceGetEccMode": nvml.NVML_ERROR_NO_PERMISSION}
        )
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "3600")
    monkeypatch.setenv(
        "DVFS_FAKE_NVML_HANG", "nvmlDeviceGetEccMode@0=inf,nvmlDeviceGetPowerManagementLimit@1=inf"
    )
    finished = threading.Event()

    def release() -> None:
        # both in the driver: GPU 1 past its ECC read (warned), GPU 0 before its own
        deadline = time.monotonic() + STUCK_S
        while len(nvml.fake_hangs_started()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        monkeypatch.setenv("DVFS_FAKE_NVML_HANG", "")
        while not finished.is_set():  # (a hang begun after one release waits for the next)
            nvml.fake_release_hangs()
            finished.wait(0.05)

    releasing = threading.Thread(target=release, daemon=True)
    releasing.start()
    try:
        with caplog.at_level(logging.WARNING, logger="dvfs"):
            openable, lost = reachable_gpus(nvml=nvml)
    finally:
        finished.set()
        releasing.join()
    assert sorted((h["fn"], h["index"]) for h in nvml.fake_hangs_started()) == [
        ("nvmlDeviceGetEccMode", 0),
        ("nvmlDeviceGetPowerManagementLimit", 1),
    ]
    assert (openable, lost) == ([0, 1], [])
    said = [r.getMessage() for r in caplog.records if "taken as not known" in r.getMessage()]
    assert [m.split(":")[0] for m in said] == ["GPU 0", "GPU 1"], said


def test_a_ctrl_c_while_gpus_are_probed_shuts_nvml_down_once_and_the_probes_begin_nothing_after(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    """A SIGINT to the main thread while GPUs 0 and 1 hang in their opening (GPU 2 answers):
    the probe raises KeyboardInterrupt at once (no deadline waited: an hour here), NVML is
    shut down once (its reference count back to 0, no "nvmlShutdown failed"), and the hung
    probes, once their calls return, begin no NVML call after (the calls of GPU 0's and 1's
    opening that follow would hang too, and none began: `given_up_with`); their threads end."""
    import logging
    import threading

    from nvml_support import fresh_fake

    from dvfs.backends import reachable_gpus

    nvml = fresh_fake(tmp_path, monkeypatch, "h100-sxm,h100-sxm,h100-sxm")
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "3600")
    monkeypatch.setenv("DVFS_FAKE_NVML_HANG", "nvmlDeviceGetUUID@0=inf,nvmlDeviceGetUUID@1=inf")
    main = threading.main_thread().ident
    assert main == threading.get_ident()
    # the SIGINT below raises KeyboardInterrupt whatever disposition the runner left (a job
    # started in a shell's background ignores SIGINT, and Python then keeps it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    nvml.nvmlInit()  # another user of NVML in this process: the hung calls, released, succeed

    def interrupt() -> None:
        wait_for(lambda: len(nvml.fake_hangs_started()) == 2, "GPUs 0 and 1 hung")
        signal.pthread_kill(main, signal.SIGINT)  # type: ignore[arg-type]

    interrupting = threading.Thread(target=interrupt, daemon=True)
    interrupting.start()
    with caplog.at_level(logging.WARNING, logger="dvfs"), pytest.raises(KeyboardInterrupt):
        reachable_gpus(nvml=nvml)
    interrupting.join()
    assert nvml.fake_init_count() == 1  # dvfs's own reference dropped, once
    probes = [t for t in threading.enumerate() if t.name.startswith("probe-gpu")]
    assert sorted(t.name for t in probes) == ["probe-gpu0", "probe-gpu1"]
    # every call on GPUs 0 and 1 from here would hang and be recorded
    monkeypatch.setenv(
        "DVFS_FAKE_NVML_HANG",
        ",".join(f"{fn}@{i}=inf" for i in (0, 1) for fn in WHOLE if fn != "nvmlDeviceGetUUID"),
    )
    while any(t.is_alive() for t in probes):
        nvml.fake_release_hangs()
        for t in probes:
            t.join(0.05)
    assert [h["fn"] for h in nvml.fake_hangs_started()] == ["nvmlDeviceGetUUID"] * 2
    nvml.nvmlShutdown()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
