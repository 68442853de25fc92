"""What the GPUs' side-by-side restore left to fix (`dvfs.gpu.knobs.KnobController.restore`,
`dvfs.gpu.safety.restore_pending`, `dvfs gpu reset`): a bug in one GPU's restore thread hid the
other GPUs' failures; a state file that could not be removed stopped the GPUs after it; the
reset said its GPUs in the order their threads finished. Runs the real NVML backend against
the fake pynvml; every wait is on an event or a fake NVML hang (never a wall-clock bound)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from nvml_support import dvfs_in_process, load_fake, root_fake_env

from dvfs.gpu.nvml import open_nvml_gpus

RESET = "nvmlDeviceResetGpuLockedClocks"
THREE = "h100-sxm,h100-sxm,h100-sxm"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    environment = root_fake_env(tmp_path, monkeypatch)
    environment["DVFS_FAKE_NVML_DEVICES"] = THREE
    monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", THREE)
    return environment


@pytest.fixture
def nvml(env: dict[str, str]) -> ModuleType:
    module = load_fake()
    module.fake_reset_state()
    return module


@pytest.fixture
def hang(nvml: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Make fake NVML calls hang until released (`hang("nvmlX@1")`: on GPU 1 only)."""

    def start(*calls: str) -> None:
        monkeypatch.setenv("DVFS_FAKE_NVML_HANG", ",".join(f"{c}=inf" for c in calls))

    yield start
    _release(nvml)


def _release(nvml: ModuleType) -> None:
    os.environ.pop("DVFS_FAKE_NVML_HANG", None)
    nvml.fake_release_hangs()


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 120) -> None:
    """Poll until `condition` holds (the bound only keeps a broken test from hanging)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def released_once(
    nvml: ModuleType, condition: Callable[[], object], what: str
) -> Iterator[list[bool]]:
    """Within the block, the fake's hung calls are released once `condition` holds (or the
    wait gives up); yields a list that holds True if the condition was met before release."""
    met: list[bool] = []

    def release() -> None:
        try:
            # (inside the suite's per-test timeout, to say what failed)
            wait_for(condition, what, timeout_s=60)
            met.append(True)
        finally:
            _release(nvml)

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    yield met
    releaser.join()


def _bug_in_the_restore_of(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    """`dvfs gpu reset`'s put-back of GPU `index` raises a KeyError (a bug in dvfs, no NVML
    error); the other GPUs' are as they are."""
    import dvfs.gpu.safety as safety

    put_back = safety._put_back_recorded

    def buggy(gpu: Any, original: Any) -> None:
        if gpu.identity.index == index:
            raise KeyError("a bug")
        put_back(gpu, original)

    monkeypatch.setattr(safety, "_put_back_recorded", buggy)


def _left_changed(nvml: ModuleType, store: Any, gpus: list[Any]) -> None:
    """Every GPU capped (1500 MHz, 400 W) with a state file each, as a killed run leaves them."""
    from dvfs.gpu.knobs import GpuSettings

    for index, gpu in enumerate(gpus):
        store.record(GpuSettings(gpu.identity.uuid, None, 700_000))
        nvml.fake_update_device(index, locked_clocks=[1500, 1500], power_limit_mw=400_000)


def _back(nvml: ModuleType, index: int) -> bool:
    state = nvml.fake_device_state(index)
    return state["locked_clocks"] is None and state["power_limit_mw"] == 700_000


# -- a bug in one GPU's restore thread -------------------------------------------------------


def test_a_bug_in_one_restore_thread_still_names_the_other_gpus_failures(
    nvml: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three GPUs put back side by side: GPU 0's restore thread hits a bug (a RuntimeError, no
    NVML error), GPU 1 has fallen off the bus, GPU 2 goes back. The bug was raised alone:
    GPU 1's failure went unsaid, its state file kept without a word. Now one internal error
    names GPU 0's bug and GPU 1's failure, in the GPUs' order, and the reset that retries;
    the state files of GPUs 0 and 1 stay, GPU 2's is gone."""
    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.gpu.safety import StateStore

    store = StateStore(tmp_path / "dvfs-state")
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        uuids = [g.identity.uuid for g in gpus]

        def broken() -> None:
            raise RuntimeError("a bug")

        with (
            pytest.raises(Exception) as caught,
            KnobController(gpus, change_log=store) as knobs,
        ):
            knobs.apply(KnobSetting(1500, 400))
            monkeypatch.setattr(gpus[0], "reset_sm_clock", broken)
            nvml.fake_update_device(1, lost=True)
        # no DvfsError: an internal error, said as such
        assert type(caught.value).__name__ == "RestoreBugError", repr(caught.value)
        said = str(caught.value)
        assert said.startswith(
            f"could not restore GPU settings: GPU 0 ({uuids[0]}): its restore stopped on a bug "
            "in dvfs (RuntimeError: a bug); "
            f"GPU 1 ({uuids[1]}): GPU 1: cannot reset locked SM clocks: the GPU has fallen off "
            "the bus"
        ), said
        assert said.endswith(f". {store.reset_command()} retries from the state file."), said
        assert "GPU 2" not in said, said
        assert isinstance(caught.value.__cause__, RuntimeError)  # its traceback, with -vv
        assert [store.path(u).exists() for u in uuids] == [True, True, False]
    assert _back(nvml, 2)


def test_gpu_reset_with_a_bug_in_one_restore_names_every_gpu_and_the_reset(
    nvml: ModuleType, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs gpu reset` on three GPUs with state files: GPU 0's restore hits a bug, GPU 1's
    clock reset fails (an NVML error), GPU 2 goes back. The bug was an internal error naming
    the bug alone, GPU 1's failure unsaid. Now: GPU 2 said restored, then one internal-error
    line naming GPU 0's bug, GPU 1's failure and the reset to run again; exit 1; the state
    files of GPUs 0 and 1 stay."""
    from dvfs.gpu.safety import StateStore

    store = StateStore(Path(env["DVFS_STATE_DIR"]))
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
        uuids = [g.identity.uuid for g in gpus]
    nvml.fake_update_device(1, errors={RESET: nvml.NVML_ERROR_UNKNOWN})
    _bug_in_the_restore_of(monkeypatch, 0)
    result = dvfs_in_process("gpu", "reset", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    assert error.startswith(
        "Error: internal error: RestoreBugError: could not restore: GPU 0 "
        f"({uuids[0]}): its restore stopped on a bug in dvfs (KeyError: 'a bug'); "
        "GPU 1: cannot reset locked SM clocks"
    ), error
    assert f"keep their state files: {store.reset_command()} retries; please report" in error
    said = " ".join(result.stdout.split())
    assert f"restored GPU 2 ({uuids[2]})" in said and "restored GPU 0" not in said, said
    assert [store.path(u).exists() for u in uuids] == [True, True, False]
    assert _back(nvml, 2) and not _back(nvml, 1)


# -- a state file that cannot be removed -----------------------------------------------------


def _unremovable(
    monkeypatch: pytest.MonkeyPatch, uuid: str, code: int, then: Callable[[], None] = lambda: None
) -> list[str]:
    """`StateStore.clear` of `uuid`'s file fails with `code` (a read-only folder, a busy file),
    `then` run first; returns the UUIDs whose clear was tried."""
    from dvfs.gpu.safety import StateStore

    tried: list[str] = []
    clear = StateStore.clear

    def failing(self: StateStore, which: str) -> None:
        tried.append(which)
        if which == uuid:
            then()
            raise OSError(code, os.strerror(code), str(self.path(which)))
        clear(self, which)

    monkeypatch.setattr(StateStore, "clear", failing)
    return tried


def test_a_stale_state_file_that_cannot_be_removed_does_not_stop_the_other_restores(
    nvml: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 0's state file is from before the last reboot (dropped, not restored) and its
    folder refuses the removal (EBUSY); GPUs 1 and 2 hold this boot's. The OSError stopped
    `restore_pending` before any GPU: GPUs 1 and 2 stayed capped. Now both are put back, their
    files removed, and one line names GPU 0's file and what to do (exit 1)."""
    from dvfs.errors import StateFolderError
    from dvfs.gpu.safety import StateStore, restore_pending

    store = StateStore(tmp_path / "dvfs-state")
    said: list[str] = []
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
        uuids = [g.identity.uuid for g in gpus]
        stale = json.loads(store.path(uuids[0]).read_text())
        stale["boot"] = "an-earlier-boot"
        store.path(uuids[0]).write_text(json.dumps(stale))
        _unremovable(monkeypatch, uuids[0], errno.EBUSY)
        with pytest.raises(StateFolderError) as caught:
            restore_pending(gpus, store, said.append)
    assert _back(nvml, 1) and _back(nvml, 2)
    assert [store.path(u).exists() for u in uuids] == [True, False, False]
    line = str(caught.value)
    assert line.startswith(
        f"cannot remove the state file of GPU 0 ({uuids[0]}) in {store.directory} "
        "(Device or resource busy)"
    ), line
    assert line.endswith(f"run {store.reset_command()} again, or remove the file"), line
    assert [x.split(" (")[0] for x in said] == [
        "dropped the state file of GPU 0",
        "restored GPU 1",
        "restored GPU 2",
    ]


def test_a_restored_gpus_state_file_that_cannot_be_removed_does_not_stop_the_others(
    nvml: ModuleType, hang: Callable[..., None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPU 0 is put back first (GPU 1's clock reset held in the driver meanwhile) and its
    state file cannot be removed (a read-only folder). The OSError gave the restore up:
    GPU 1's thread, its held call back, began no call after and stayed capped. Now GPU 1 is
    put back too, its file removed, and GPU 0's named in one line with what to do."""
    from dvfs.errors import StateFolderError
    from dvfs.gpu.safety import StateStore, restore_pending

    store = StateStore(tmp_path / "dvfs-state")
    with open_nvml_gpus([0, 1], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
        uuids = [g.identity.uuid for g in gpus]
        hang(f"{RESET}@1")
        tried = _unremovable(monkeypatch, uuids[0], errno.EROFS)
        releaser = threading.Thread(
            target=lambda: (wait_for(lambda: uuids[0] in tried, "GPU 0's file"), _release(nvml)),
            daemon=True,
        )
        releaser.start()
        with pytest.raises(StateFolderError) as caught:
            restore_pending(gpus, store)
        releaser.join()
        for thread in [t for t in threading.enumerate() if t.name.startswith("restore-gpu")]:
            thread.join()
    assert _back(nvml, 0) and _back(nvml, 1)
    assert [store.path(u).exists() for u in uuids] == [True, False]
    assert "Read-only file system" in str(caught.value), caught.value


# -- the reset's lines in the GPUs' order ----------------------------------------------------


def test_gpu_reset_says_its_gpus_in_their_order_whichever_is_back_first(
    nvml: ModuleType, hang: Callable[..., None], tmp_path: Path
) -> None:
    """GPU 0's clock reset is held in the driver until GPUs 1 and 2 are back (their state
    files removed at once): the lines came in the order the threads finished (GPU 1, GPU 2,
    GPU 0). Now in the GPUs' order, as the list returned (lines held for as long as GPU 0
    takes here: `hold_s`)."""
    from dvfs.gpu.safety import StateStore, restore_pending

    store = StateStore(tmp_path / "dvfs-state")
    said: list[str] = []
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
        uuids = [g.identity.uuid for g in gpus]
        hang(f"{RESET}@0")

        def release_once_the_others_are_back() -> None:
            wait_for(nvml.fake_hangs_started, "GPU 0's reset is stuck in NVML")
            wait_for(
                lambda: not any(store.path(u).exists() for u in uuids[1:]), "GPUs 1, 2 are back"
            )
            _release(nvml)

        releaser = threading.Thread(target=release_once_the_others_are_back, daemon=True)
        releaser.start()
        done = restore_pending(gpus, store, said.append, hold_s=3600)
        releaser.join()
    order = ["restored GPU 0", "restored GPU 1", "restored GPU 2"]
    assert [x.split(" (")[0] for x in said] == order, said
    assert done == said
    assert all(_back(nvml, i) for i in range(3))


def test_gpu_reset_says_the_gpus_back_while_one_before_them_hangs(
    nvml: ModuleType, hang: Callable[..., None], tmp_path: Path
) -> None:
    """GPU 1's clock reset hangs: GPU 2's line, held back for GPU 1, is said all the same once
    GPU 1 outlasts `hold_s` (0 here), while it still hangs, as GPU 0's: a unit's SIGKILL then
    finds both said. GPU 1's comes once it is back. (`dvfs gpu reset` killed so:
    tests/test_govern_cli.py, `test_gpu_reset_after_a_sigkill_puts_back_the_gpus_that_answer_
    while_others_hang`.)"""
    from dvfs.gpu.safety import StateStore, restore_pending

    store = StateStore(tmp_path / "dvfs-state")
    said: list[str] = []
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
        hang(f"{RESET}@1")
        seen: list[list[str]] = []

        def release_once_the_others_are_said() -> None:
            wait_for(lambda: len(said) == 2, "GPU 0's and GPU 2's lines")
            seen.append(list(said))  # GPU 1 still held in the driver
            _release(nvml)

        releaser = threading.Thread(target=release_once_the_others_are_said, daemon=True)
        releaser.start()
        restore_pending(gpus, store, said.append, hold_s=0)
        releaser.join()
    # (GPU 0 and GPU 2 in either order: at `hold_s` 0, whichever is back first is said)
    assert [sorted(x.split(" (")[0] for x in s) for s in seen] == [
        ["restored GPU 0", "restored GPU 2"]
    ]
    assert said[2].startswith("restored GPU 1 ("), said
    assert all(_back(nvml, i) for i in range(3))


def test_a_signal_while_lines_are_held_says_the_gpus_back_before_it_ends_the_reset(
    nvml: ModuleType, hang: Callable[..., None], tmp_path: Path
) -> None:
    """GPU 0's clock reset hangs; GPUs 1 and 2 are back, their state files gone, their lines
    held for GPU 0 (`hold_s`). A SIGTERM then (`dvfs gpu reset` raises on the first one:
    Ctrl-C, a unit's stop) ended the reset with their lines never said: nothing told that
    GPUs 1 and 2 were put back, and no state file is left to. They are said before it ends
    the reset, in the GPUs' order."""
    import signal

    from dvfs.gpu.safety import StateStore, restore_pending
    from dvfs.signals import Interrupted, signals_raise

    store = StateStore(tmp_path / "dvfs-state")
    said: list[str] = []
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
        uuids = [g.identity.uuid for g in gpus]
        hang(f"{RESET}@0")

        def signal_once_the_others_are_back() -> None:
            wait_for(nvml.fake_hangs_started, "GPU 0's reset is stuck in NVML")
            wait_for(
                lambda: not any(store.path(u).exists() for u in uuids[1:]), "GPUs 1, 2 are back"
            )
            os.kill(os.getpid(), signal.SIGTERM)

        signaller = threading.Thread(target=signal_once_the_others_are_back, daemon=True)
        try:
            with signals_raise(), pytest.raises(Interrupted):
                signaller.start()
                restore_pending(gpus, store, said.append, hold_s=3600)
        finally:
            signaller.join()
            _release(nvml)
            for thread in [t for t in threading.enumerate() if t.name.startswith("restore-gpu")]:
                thread.join()
    assert [x.split(" (")[0] for x in said] == ["restored GPU 1", "restored GPU 2"], said
    assert store.path(uuids[0]).exists()


# -- `dvfs gpu list` and `permitted` beside a hung GPU ---------------------------------------

STUCK_S = 120.0  # a run that takes this long is stuck, not slow
HANDLE = "nvmlDeviceGetHandleByIndex"


def test_permitted_asks_every_gpu_beside_one_whose_handle_hangs(
    nvml: ModuleType, hang: Callable[..., None]
) -> None:
    """GPU 0's handle hangs in the driver, and NVML has no permission to talk to GPU 2 (a
    job's device cgroup withholds it). On one worker, GPU 2 was "not attempted" after GPU 0's
    overrun and kept, as if this process's. Now each GPU is asked on its own: GPU 0 kept (its
    opening names it), GPU 1 kept, GPU 2 left out."""
    from dvfs.gpu.nvml import nvml_session, permitted

    nvml.fake_update_device(2, errors={HANDLE: nvml.NVML_ERROR_NO_PERMISSION})
    hang(f"{HANDLE}@0")
    with nvml_session(nvml, deadline_s=5) as module:
        assert permitted(module, [0, 1, 2], deadline_s=5) == [0, 1]
    assert [h["index"] for h in nvml.fake_hangs_started()] == [0]


def test_gpu_list_lists_the_gpus_beside_a_hung_one_and_one_it_may_not_talk_to(
    nvml: ModuleType, env: dict[str, str]
) -> None:
    """`dvfs gpu list` with GPU 0's handle hanging in the driver and GPU 2 withheld (NO
    PERMISSION): GPU 2 was kept among "every GPU" (see above), and its opening's permission
    refusal failed the whole list, exit 4, GPU 1 unlisted. Now GPU 1 is listed, GPU 0 named as
    hung, exit 1, and GPU 2 is no GPU of this process. (A child process: the hung call never
    returns, and the child exits with it.)"""
    nvml.fake_update_device(2, errors={HANDLE: nvml.NVML_ERROR_NO_PERMISSION})
    child = {**env, "DVFS_NVML_DEADLINE_S": "5", "DVFS_FAKE_NVML_HANG": f"{HANDLE}@0=inf"}
    result = subprocess.run(
        [sys.executable, "-m", "dvfs", "gpu", "list", "--json"],
        env=child,
        capture_output=True,
        text=True,
        timeout=STUCK_S,
    )
    assert result.returncode == 1, result.stderr
    rows = json.loads(result.stdout)
    assert [r["index"] for r in rows] == [0, 1], rows
    assert rows[1]["uuid"] == nvml.fake_device_state(1)["uuid"]
    assert rows[0]["error"].startswith(f"{HANDLE} on GPU 0 did not return within 5 s"), rows
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    assert error.startswith(f"Error: {HANDLE} on GPU 0 did not return within 5 s"), error


def _run_with_gpu1_handle_hung(
    nvml: ModuleType, env: dict[str, str], argv: list[str], code: int = 1
) -> list[str]:
    """`dvfs ARGV` in a child process (the hung call never returns, and the child exits with
    it) with GPU 1's handle hanging in the driver for good, at a 1 s deadline: it must exit 1
    (`code`) having asked that handle once. Its standard error's non-blank lines."""
    child = {**env, "DVFS_NVML_DEADLINE_S": "1", "DVFS_FAKE_NVML_HANG": f"{HANDLE}@1=inf"}
    result = subprocess.run(
        [sys.executable, "-m", "dvfs", *argv],
        env=child,
        capture_output=True,
        text=True,
        timeout=STUCK_S,
    )
    assert result.returncode == code, result.stderr
    asked = [h for h in nvml.fake_hangs_started() if h["fn"] == HANDLE and h["index"] == 1]
    assert len(asked) == 1, asked
    return [x for x in result.stderr.splitlines() if x.strip()]


@pytest.mark.parametrize("command", [["gpu", "list"], ["gpu", "reset"], ["cap", "reset"]])
def test_a_gpu_whose_handle_hangs_is_asked_once_by_a_command_over_every_gpu(
    nvml: ModuleType, env: dict[str, str], command: list[str]
) -> None:
    """`dvfs gpu list`, `gpu reset`, `cap reset` over every GPU with GPU 1's handle hanging in
    the driver: listing every GPU (`permitted`) waited its deadline for that handle, then
    opening GPU 1 asked for it again, a deadline more (two before `gpu reset`, the governor
    unit's ExecStopPost, named the GPU). Now its handle is asked once: GPU 1 named with the
    first call's error, the others acted on, exit 1. (A child process: the hung call never
    returns, and the child exits with it.)"""
    [error] = _run_with_gpu1_handle_hung(nvml, env, command)
    assert error.startswith(f"Error: {HANDLE} on GPU 1 did not return within 1 s"), error


@pytest.mark.parametrize("defaults", [[], ["--defaults"]])
def test_gpu_reset_asks_a_hung_gpu_with_a_state_file_once(
    nvml: ModuleType, env: dict[str, str], defaults: list[str]
) -> None:
    """As above, `dvfs gpu reset` over every GPU with GPU 1's handle hanging, but every GPU
    left changed with a state file (a killed run's). GPU 1's file, none of the GPUs opened,
    sent the reset to ask which GPUs NVML withholds (`withheld_gpus`, `permitted`), which asked
    GPU 1's handle again: a deadline more before the command ended. Now GPU 1 is asked once:
    named with its error, GPUs 0 and 2 restored, exit 1."""
    from dvfs.gpu.safety import StateStore

    store = StateStore(Path(env["DVFS_STATE_DIR"]))
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
    [error] = _run_with_gpu1_handle_hung(nvml, env, ["gpu", "reset", *defaults])
    assert error.startswith(f"Error: {HANDLE} on GPU 1 did not return within 1 s"), error
    assert _back(nvml, 0) and _back(nvml, 2)


@pytest.mark.parametrize("command", ["monitor", "cap-apply", "cap-apply-dry-run"])
def test_a_hung_gpu_is_asked_once_by_a_command_that_names_gpus_nvml_withholds(
    nvml: ModuleType, env: dict[str, str], tmp_path: Path, command: str
) -> None:
    """`dvfs monitor` and `dvfs cap apply` (a [[model]] entry) over every GPU with GPU 1's
    handle hanging: once every GPU was opened, each asked which GPUs NVML withholds
    (`withheld_gpus`, `permitted`), which asked GPU 1's handle again: a deadline more before
    the command named the GPU. Now GPU 1 is asked once (`known_hung`): named with its error,
    exit 1. (A child process: the hung call never returns, and the child exits with it.)"""
    caps = tmp_path / "caps.toml"
    caps.write_text('[[model]]\nname = "NVIDIA H100 80GB HBM3"\nsm_clock_max_mhz = 1500\n')
    argv = {
        "monitor": ["monitor", "--once"],
        "cap-apply": ["cap", "apply", str(caps)],
        "cap-apply-dry-run": ["cap", "apply", str(caps), "--dry-run"],
    }[command]
    error = _run_with_gpu1_handle_hung(nvml, env, argv)[-1]
    assert f"{HANDLE} on GPU 1 did not return within 1 s" in error, error


def test_gpu_reset_defaults_asks_which_gpus_nvml_withholds_once(
    nvml: ModuleType, env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs gpu reset --defaults` over every GPU with GPU 1's handle hanging and a state file
    and caps on every GPU: GPU 1's state file, then its caps, each asked which GPUs NVML
    withholds (`refused_gpus`: every other GPU's handle asked again). Now it is asked once:
    GPU 0's handle (its every call logged by the fake, none held) asked as often as by the
    reset without --defaults, which asks it for the state files alone."""
    from dvfs.gpu.safety import StateStore

    def asked_of_gpu_0(*flags: str) -> int:
        import shutil

        shutil.rmtree(env["DVFS_STATE_DIR"], ignore_errors=True)  # the run before's records
        nvml.fake_reset_state()
        _capped(nvml, tmp_path, monkeypatch)
        store = StateStore(Path(env["DVFS_STATE_DIR"]))
        with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
            _left_changed(nvml, store, gpus)
        before = len(nvml.fake_hangs_started())
        hangs = f"{HANDLE}@1=inf,{HANDLE}@0=0"  # GPU 0's: logged, returning at once
        child = {**env, "DVFS_NVML_DEADLINE_S": "1", "DVFS_FAKE_NVML_HANG": hangs}
        result = subprocess.run(
            [sys.executable, "-m", "dvfs", "gpu", "reset", *flags],
            env=child,
            capture_output=True,
            text=True,
            timeout=STUCK_S,
        )
        assert result.returncode == 1, result.stderr
        error = [x for x in result.stderr.splitlines() if x.strip()][-1]
        assert f"{HANDLE} on GPU 1 did not return within 1 s" in error, error
        assert _back(nvml, 0) and _back(nvml, 2)
        started = nvml.fake_hangs_started()[before:]
        assert len([h for h in started if h["index"] == 1]) == 1, started
        return len([h for h in started if h["fn"] == HANDLE and h["index"] == 0])

    assert asked_of_gpu_0("--defaults") == asked_of_gpu_0()


def test_gpu_list_reads_the_gpus_side_by_side(
    nvml: ModuleType, hang: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs gpu list` with GPU 0's and GPU 1's UUID reads held in the driver: one after
    another, GPU 1 was asked only once GPU 0's call returned or overran its deadline (GPUs
    whose driver hangs cost a deadline each before the list was shown). Now both calls are in
    the driver at once; released, every GPU is listed."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    hang("nvmlDeviceGetUUID@0", "nvmlDeviceGetUUID@1")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # the fake whose hangs the test releases
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "3600")
    with released_once(
        nvml,
        lambda: {h["index"] for h in nvml.fake_hangs_started()} == {0, 1},
        "GPU 0's and GPU 1's reads in the driver at once",
    ) as both:
        result = CliRunner().invoke(cli, ["gpu", "list", "--json"])
    assert both == [True]
    assert result.exit_code == 0, result.output
    assert [r["index"] for r in json.loads(result.stdout)] == [0, 1, 2]


# -- `dvfs cap reset` side by side ----------------------------------------------------------


def _capped(nvml: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`dvfs cap apply` of a 1500 MHz clock cap and a 400 W limit on every fake GPU (in this
    process, the fake installed as `pynvml`); their UUIDs."""
    from click.testing import CliRunner

    from dvfs.caps import CapsFile, GpuCap, dump_caps
    from dvfs.cli import cli

    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # the fake whose hangs the test releases
    uuids = [nvml.fake_device_state(i)["uuid"] for i in range(3)]
    caps = tmp_path / "caps.toml"
    entries = (GpuCap(uuid=u, sm_clock_max_mhz=1500, power_limit_w=400) for u in uuids)
    caps.write_text(dump_caps(CapsFile(tuple(entries))))
    result = CliRunner().invoke(cli, ["cap", "apply", str(caps)])
    assert result.exit_code == 0, result.output
    assert all(nvml.fake_device_state(i)["locked_clocks"] is not None for i in range(3))
    return uuids


def _recorded(env: dict[str, str]) -> set[str]:
    """The GPUs dvfs's caps record lists (none where it is gone)."""
    path = Path(env["DVFS_STATE_DIR"]) / "caps-applied.json"
    return set(json.loads(path.read_text())) if path.exists() else set()


def test_cap_reset_resets_the_gpus_side_by_side(
    nvml: ModuleType,
    env: dict[str, str],
    hang: Callable[..., None],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`dvfs cap reset --applied` (the caps unit's ExecStop) with GPU 0's and GPU 1's clock
    resets held in the driver: one after another, GPU 1 was reset only once GPU 0's call
    returned or overran its deadline (eight hung GPUs: eight deadlines, past the unit's stop
    timeout, whose SIGKILL left the last GPUs capped). Now both calls are in the driver at
    once; released, every GPU is reset, said in the GPUs' order, and the record is gone."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    _capped(nvml, tmp_path, monkeypatch)
    hang(f"{RESET}@0", f"{RESET}@1")
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "3600")
    with released_once(
        nvml,
        lambda: {h["index"] for h in nvml.fake_hangs_started()} == {0, 1},
        "GPU 0's and GPU 1's clock resets in the driver at once",
    ) as both:
        result = CliRunner().invoke(cli, ["cap", "reset", "--applied"])
    assert both == [True]
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [x.split(" (")[0] for x in lines] == ["GPU 0", "GPU 1", "GPU 2"], lines
    assert all(_back(nvml, i) for i in range(3))
    assert _recorded(env) == set()


def test_cap_reset_says_the_gpus_in_order_and_keeps_only_the_failed_ones_recorded(
    nvml: ModuleType,
    env: dict[str, str],
    hang: Callable[..., None],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPU 0's clock reset held in the driver until GPU 2 is reset, GPU 1's refused by the
    driver (an unknown error): GPU 0's line comes before GPU 2's though GPU 2 was back first,
    GPU 1 is named once every GPU was tried (exit 1), and the caps record keeps exactly GPU 1,
    the one not reset."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    uuids = _capped(nvml, tmp_path, monkeypatch)
    nvml.fake_update_device(1, errors={RESET: nvml.NVML_ERROR_UNKNOWN})
    hang(f"{RESET}@0")
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "3600")
    with released_once(
        nvml,
        lambda: uuids[2] not in _recorded(env) and nvml.fake_hangs_started(),
        "GPU 2 reset while GPU 0 hangs",
    ) as first:
        result = CliRunner().invoke(cli, ["cap", "reset", "--applied"])
    assert first == [True]  # GPU 2 was back while GPU 0 was still in the driver
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert [x.split(" (")[0] for x in lines] == ["GPU 0", "GPU 2"], lines
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    assert error.startswith("Error: could not reset caps: GPU 1: "), error
    assert "Traceback" not in result.output
    assert _back(nvml, 0) and _back(nvml, 2) and not _back(nvml, 1)
    assert _recorded(env) == {uuids[1]}


def test_cap_reset_resets_the_others_beside_a_gpu_whose_mig_read_hangs(
    nvml: ModuleType,
    env: dict[str, str],
    hang: Callable[..., None],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPU 0's MIG mode read (`cap reset` leaves MIG GPUs alone) hangs in the driver past its
    deadline: it was read one GPU after another before any reset, and its overrun failed the
    whole reset (exit 1, "nvmlDeviceGetMigMode on GPU 0 did not return"), every GPU left
    capped. Now the GPUs are read side by side and one that cannot be read is reset with the
    others, its failure named: GPUs 1 and 2 reset, the record keeping GPU 0 alone."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    uuids = _capped(nvml, tmp_path, monkeypatch)
    hang("nvmlDeviceGetMigMode@0")
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "5")
    result = CliRunner().invoke(cli, ["cap", "reset", "--applied"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stdout.splitlines()
    assert [x.split(" (")[0] for x in lines] == ["GPU 1", "GPU 2"], lines
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    assert error.startswith("Error: ") and "GPU 0" in error, error
    assert _back(nvml, 1) and _back(nvml, 2) and not _back(nvml, 0)
    assert _recorded(env) == {uuids[0]}


def test_a_signal_during_cap_reset_leaves_no_gpu_with_its_entry_gone_and_its_state_file_kept(
    nvml: ModuleType,
    env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead dvfs run's state file on GPU 1, whose caps record entry and state file a reset
    drops together (one GPU after another, a signal held back between them). With the GPUs
    reset side by side, a SIGTERM (the caps unit's stop) raised at once in the waiting thread
    while GPU 1's thread was between the two: the command ended with GPU 1's entry gone and
    its state file kept, for `dvfs gpu reset` to put back what that run found (dvfs's caps)
    with no record of them. The reset now ends once that GPU's are both done."""
    import signal

    from dvfs.caps import AppliedCaps, GovernorLocks, reset_caps
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore
    from dvfs.signals import Interrupted, signals_raise

    uuids = _capped(nvml, tmp_path, monkeypatch)
    directory = Path(env["DVFS_STATE_DIR"])
    store = StateStore(directory)
    store.record(GpuSettings(uuids[1], None, 700_000))  # as a run killed with SIGKILL left it
    between, checked = threading.Event(), threading.Event()
    clear = GovernorLocks.clear

    def clear_after_the_signal(self: Any, uuid: str) -> None:
        if uuid == uuids[1]:  # GPU 1's entry dropped, its state file not yet
            between.set()
            checked.wait(5)  # (the test's look, after the signal: none where the reset waits)
        clear(self, uuid)

    monkeypatch.setattr(GovernorLocks, "clear", clear_after_the_signal)

    def signal_once_between() -> None:
        wait_for(between.is_set, "GPU 1 between its entry and its state file")
        os.kill(os.getpid(), signal.SIGTERM)

    signaller = threading.Thread(target=signal_once_between, daemon=True)
    try:
        with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
            with signals_raise(), pytest.raises(Interrupted):
                signaller.start()
                reset_caps(gpus, AppliedCaps(directory))
            # as the command ends: both gone, or both kept
            entry, file = uuids[1] in _recorded(env), store.path(uuids[1]).exists()
            checked.set()
            for thread in threading.enumerate():
                if thread.name.startswith("caps-reset-gpu"):
                    thread.join()
    finally:
        checked.set()
        signaller.join()
    assert entry == file, (entry, file)


# -- second round: opening side by side, lines and files never dropped -----------------------


def _after_the_probe(monkeypatch: pytest.MonkeyPatch, then: Callable[[], None]) -> None:
    """`reachable_gpus` as it is, `then` run once it has probed every GPU: a GPU that begins
    hanging, or falls off the bus, between its probe and its opening."""
    import dvfs.backends as backends

    probe = backends.reachable_gpus

    def probed(*args: Any, **kwargs: Any) -> Any:
        found = probe(*args, **kwargs)
        then()
        return found

    monkeypatch.setattr(backends, "reachable_gpus", probed)


def test_gpu_reset_opens_the_gpus_side_by_side_and_restores_beside_one_lost_since_its_probe(
    nvml: ModuleType,
    env: dict[str, str],
    hang: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`dvfs gpu reset` on three GPUs with state files: once they are probed, GPU 0's and GPU
    2's handles begin hanging in the driver and GPU 1 falls off the bus. They were opened one
    after another (GPU 2 only once GPU 0's call returned: a deadline each, past a unit's stop
    timeout), and GPU 1's failure to open failed the whole reset, nothing restored. Now both
    handles are asked at once; released, GPUs 0 and 2 are restored and said, GPU 1 is named
    (exit 1), its state file kept."""
    from click.testing import CliRunner

    from dvfs.cli import cli
    from dvfs.gpu.safety import StateStore

    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # the fake whose hangs the test releases
    monkeypatch.setenv("DVFS_NVML_DEADLINE_S", "3600")

    store = StateStore(Path(env["DVFS_STATE_DIR"]))
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
        uuids = [g.identity.uuid for g in gpus]

    def fail() -> None:
        nvml.fake_update_device(1, errors={HANDLE: nvml.NVML_ERROR_GPU_IS_LOST})
        hang(f"{HANDLE}@0", f"{HANDLE}@2")

    _after_the_probe(monkeypatch, fail)
    with released_once(
        nvml,
        lambda: {h["index"] for h in nvml.fake_hangs_started()} == {0, 2},
        "GPU 0's and GPU 2's handles in the driver at once",
    ) as both:
        result = CliRunner().invoke(cli, ["gpu", "reset"])
    assert both == [True]
    assert result.exit_code == 1, result.output
    said = " ".join(result.stdout.split())  # (a line wrapped at the terminal's width)
    assert said.count("restored GPU") == 2, said
    assert said.index(f"restored GPU 0 ({uuids[0]})") < said.index(f"restored GPU 2 ({uuids[2]})")
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    assert error.startswith("Error: ") and "GPU 1" in error and "GPU is lost" in error, error
    assert [store.path(u).exists() for u in uuids] == [False, True, False]
    assert _back(nvml, 0) and _back(nvml, 2) and not _back(nvml, 1)


def test_cap_reset_resets_the_others_beside_a_gpu_lost_between_its_probe_and_its_opening(
    nvml: ModuleType, env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs cap reset` with GPU 1 fallen off the bus once the GPUs are probed: its failure to
    open failed the whole reset, every GPU left capped. Now GPUs 0 and 2 are reset and said,
    GPU 1 named (exit 1), the caps record keeping GPU 1 alone."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    uuids = _capped(nvml, tmp_path, monkeypatch)
    _after_the_probe(
        monkeypatch,
        lambda: nvml.fake_update_device(1, errors={HANDLE: nvml.NVML_ERROR_GPU_IS_LOST}),
    )
    result = CliRunner().invoke(cli, ["cap", "reset"])
    assert result.exit_code == 1, result.output
    assert [x.split(" (")[0] for x in result.stdout.splitlines()] == ["GPU 0", "GPU 2"]
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    assert error.startswith("Error: ") and "GPU 1" in error and "GPU is lost" in error, error
    assert "Traceback" not in result.output
    assert _back(nvml, 0) and _back(nvml, 2) and not _back(nvml, 1)
    assert _recorded(env) == {uuids[1]}


@pytest.mark.parametrize("failing", ["a GPU error", "a bug"])
def test_gpu_reset_failing_still_names_the_state_files_of_gpus_nvml_withholds(
    nvml: ModuleType, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """`dvfs gpu reset` with state files on three GPUs, NVML withholding GPU 2 (no permission)
    and GPU 1's restore failing (an NVML error, or a bug in its restore). The line naming GPU
    2's state file (it may be a GPU's this process may not talk to) was dropped: only GPU 1's
    failure was said. Now both, in one line; exit 4 for a GPU error (as without it), GPU 0
    restored all the same."""
    from dvfs.gpu.safety import StateStore

    store = StateStore(Path(env["DVFS_STATE_DIR"]))
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
        uuids = [g.identity.uuid for g in gpus]
    nvml.fake_update_device(2, errors={HANDLE: nvml.NVML_ERROR_NO_PERMISSION})
    if failing == "a GPU error":
        nvml.fake_update_device(1, errors={RESET: nvml.NVML_ERROR_UNKNOWN})
    else:
        _bug_in_the_restore_of(monkeypatch, 1)
    result = dvfs_in_process("gpu", "reset", env=env)
    assert result.returncode == (4 if failing == "a GPU error" else 1), result.stderr
    said = " ".join(result.stdout.split())  # (a line wrapped at the terminal's width)
    assert said.startswith(f"restored GPU 0 ({uuids[0]})") and said.count("restored") == 1, said
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    failure = "cannot reset locked SM clocks" if failing == "a GPU error" else "KeyError"
    assert failure in error, error
    assert f"record {uuids[2]}, none of the GPUs this process may talk to" in error, error
    assert [store.path(u).exists() for u in uuids] == [False, True, True]


def test_a_restore_failing_on_one_gpu_names_the_state_file_it_could_not_remove(
    nvml: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep's restore: GPU 1 has fallen off the bus, GPU 0 is put back but its state file
    cannot be removed (a read-only folder). Only GPU 1's failure was said: GPU 0's file, kept,
    went unmentioned. Now the same line names it too."""
    from dvfs.errors import GpuError
    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.gpu.safety import StateStore

    store = StateStore(tmp_path / "dvfs-state")
    with open_nvml_gpus([0, 1], nvml=nvml) as gpus:
        uuids = [g.identity.uuid for g in gpus]
        with (
            pytest.raises(GpuError) as caught,
            KnobController(gpus, change_log=store) as knobs,
        ):
            knobs.apply(KnobSetting(1500, 400))
            _unremovable(monkeypatch, uuids[0], errno.EROFS)
            nvml.fake_update_device(1, lost=True)
    said = str(caught.value)
    assert said.startswith(f"could not restore GPU settings: GPU 1 ({uuids[1]}): "), said
    assert (
        f"GPU 0 ({uuids[0]}) is back as found, but its state file {store.path(uuids[0])} "
        "cannot be removed (Read-only file system)"
    ) in said, said
    assert said.endswith(f". {store.reset_command()} retries from the state file."), said
    assert _back(nvml, 0)
    assert [store.path(u).exists() for u in uuids] == [True, True]


def test_a_bug_in_one_cap_reset_thread_says_the_gpus_reset_first(
    nvml: ModuleType, env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs cap reset` on three capped GPUs, GPU 0's reset hitting a bug (no GPU's error):
    raised once every GPU was done, the lines of GPUs 1 and 2, reset, were lost. Now they are
    said, then one internal-error line names GPU 0's bug; the record keeps GPU 0 alone."""
    from click.testing import CliRunner

    import dvfs.caps.actuation as actuation
    from dvfs.cli import cli

    uuids = _capped(nvml, tmp_path, monkeypatch)
    default = actuation._default_or_none

    def buggy(gpu: Any) -> Any:
        if gpu.identity.index == 0:
            raise KeyError("a bug")
        return default(gpu)

    monkeypatch.setattr(actuation, "_default_or_none", buggy)
    result = CliRunner().invoke(cli, ["cap", "reset"])
    assert result.exit_code == 1, result.output
    assert [x.split(" (")[0] for x in result.stdout.splitlines()] == ["GPU 1", "GPU 2"]
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    assert error.startswith(
        "Error: internal error: RestoreBugError: could not reset caps: GPU 0 "
        f"({uuids[0]}): its reset stopped on a bug in dvfs (KeyError: 'a bug')"
    ), error
    assert _back(nvml, 1) and _back(nvml, 2)
    assert _recorded(env) == {uuids[0]}


def test_gpu_reset_with_a_bug_says_the_reset_that_retries_at_the_end_of_its_line(
    nvml: ModuleType, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs gpu reset`: GPU 0's restore hits a bug and GPU 2's state file is unreadable
    (damaged). "`dvfs gpu reset` retries" came mid-line, GPU 2's failure after it. Now GPU 2's
    failure comes before it, the advice ending the line (before the report request)."""
    from dvfs.gpu.safety import StateStore

    store = StateStore(Path(env["DVFS_STATE_DIR"]))
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
        uuids = [g.identity.uuid for g in gpus]
    store.path(uuids[2]).write_text("{not json")
    _bug_in_the_restore_of(monkeypatch, 0)
    result = dvfs_in_process("gpu", "reset", env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    advice = f"keep their state files: {store.reset_command()} retries"
    assert f"{advice}; please report" in error, error
    assert error.count(advice) == 1 and error.index(uuids[2]) < error.index(advice), error
    assert [store.path(u).exists() for u in uuids] == [True, False, True]


def test_cap_reset_with_a_bug_beside_a_lost_gpu_shows_the_bugs_traceback_with_vv(
    nvml: ModuleType, env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs -vv cap reset`: GPU 0's reset hits a bug, GPU 1 fell off the bus since its probe.
    The bug's line, joined with GPU 1's, was raised anew without its cause: -vv printed a
    traceback ending in the CLI, the bug's own frames (what a report needs) gone. Now the
    joined line keeps the bug as its cause, its traceback shown as without a lost GPU."""
    from click.testing import CliRunner

    import dvfs.caps.actuation as actuation
    from dvfs.cli import cli

    _capped(nvml, tmp_path, monkeypatch)
    default = actuation._default_or_none

    def buggy_reset_of_gpu_0(gpu: Any) -> Any:
        if gpu.identity.index == 0:
            raise KeyError("a bug")
        return default(gpu)

    monkeypatch.setattr(actuation, "_default_or_none", buggy_reset_of_gpu_0)
    _after_the_probe(
        monkeypatch,
        lambda: nvml.fake_update_device(1, errors={HANDLE: nvml.NVML_ERROR_GPU_IS_LOST}),
    )
    result = CliRunner().invoke(cli, ["-vv", "cap", "reset"])
    assert result.exit_code == 1, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: internal error: RestoreBugError: could not reset caps"), error
    assert "GPU 1" in error and "GPU is lost" in error, error
    assert "in buggy_reset_of_gpu_0" in result.stderr, result.stderr  # the bug's own frame
    assert "KeyError: 'a bug'" in result.stderr, result.stderr


# -- a lost GPU's record, and the line of records NVML may withhold ----------------------------


def _lost_and_withheld(nvml: ModuleType) -> None:
    """GPU 1 falls off the bus after its UUID is read (its power limit read fails), NVML
    withholds GPU 2 (no permission): GPU 1's UUID is known, GPU 2's is not."""
    nvml.fake_update_device(2, errors={HANDLE: nvml.NVML_ERROR_NO_PERMISSION})
    lost = {"nvmlDeviceGetPowerManagementLimit": nvml.NVML_ERROR_GPU_IS_LOST}
    nvml.fake_update_device(1, errors=lost)


def test_gpu_reset_names_a_lost_gpus_state_file_once_not_with_the_withheld_ones(
    nvml: ModuleType, env: dict[str, str]
) -> None:
    """`dvfs gpu reset` with state files on three GPUs, GPU 1 fallen off the bus (its UUID
    read) and GPU 2 withheld by NVML. GPU 1's state file was named twice: among the files of
    "none of the GPUs this process may talk to" (run with sudo) and as a GPU fallen off the
    bus (a reset or reboot). Now the withheld line names GPU 2's file alone; GPU 1 is named
    once, as lost; exit 4 (GPU 2's file) as before; GPU 0 restored."""
    from dvfs.gpu.safety import StateStore

    store = StateStore(Path(env["DVFS_STATE_DIR"]))
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
        uuids = [g.identity.uuid for g in gpus]
    _lost_and_withheld(nvml)
    result = dvfs_in_process("gpu", "reset", env=env)
    assert result.returncode == 4, result.stdout + result.stderr
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    assert f"record {uuids[2]}, none of the GPUs this process may talk to" in error, error
    assert uuids[1] not in error, error
    assert "GPU 1: cannot read the power limit: the GPU has fallen off the bus" in error, error
    assert [store.path(u).exists() for u in uuids] == [False, True, True]


def test_cap_reset_names_a_lost_gpus_caps_once_not_with_the_withheld_ones(
    nvml: ModuleType, env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs cap reset` with caps on three GPUs, GPU 1 fallen off the bus (its UUID read) and
    GPU 2 withheld by NVML: GPU 1's caps were named among those of "none of the GPUs this
    process may talk to" (run with sudo) beside GPU 1 named fallen off the bus. Now GPU 1 is
    named once, as lost; GPU 2's caps in the withheld line; exit 4."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    uuids = _capped(nvml, tmp_path, monkeypatch)
    _lost_and_withheld(nvml)
    result = CliRunner().invoke(cli, ["cap", "reset"])
    assert result.exit_code == 4, result.output
    [error] = [x for x in result.stderr.splitlines() if x.strip()]
    assert f"holds caps for {uuids[2]}, none of the GPUs this process may talk to" in error
    assert uuids[1] not in error, error
    assert "GPU 1: cannot read the power limit: the GPU has fallen off the bus" in error, error
    assert _back(nvml, 0) and not _back(nvml, 1)


def test_cap_show_warns_of_withheld_caps_without_a_lost_gpus_own(
    nvml: ModuleType, env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs cap show` with caps on three GPUs, GPU 1 fallen off the bus (its UUID read) and
    GPU 2 withheld by NVML: the warning of caps "none of the GPUs this process may talk to"
    named GPU 1's too, beside GPU 1 named fallen off the bus. Now GPU 2's alone; exit 1."""
    from click.testing import CliRunner

    from dvfs.cli import cli

    uuids = _capped(nvml, tmp_path, monkeypatch)
    _lost_and_withheld(nvml)
    result = CliRunner().invoke(cli, ["cap", "show"])
    assert result.exit_code == 1, result.output
    [warning] = [x for x in result.stderr.splitlines() if x.startswith("warning: ")]
    assert f"holds caps for {uuids[2]}, none of the GPUs this process may talk to" in warning
    assert uuids[1] not in warning, warning
    assert "GPU 1: cannot read the power limit" in result.stderr.splitlines()[-1], result.stderr


def test_refused_gpus_beside_a_gpu_known_hung_still_names_those_nvml_refuses() -> None:
    """`refused_gpus` with GPU 1 known to hang (not asked again) and NVML refusing GPU 0, the
    only GPU asked: GPU 0 is refused, as when GPU 1 was asked and kept for its hang. (Left out
    of the GPUs asked, GPU 1 made GPU 0 "every GPU asked refused", a permission problem of the
    whole machine, and nothing was named.)"""
    import types

    from dvfs.gpu.nvml import refused_gpus

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

    asked: list[int] = []

    def handle(index: int) -> object:
        asked.append(index)
        raise NVMLError(4)  # NoPermission

    module = types.SimpleNamespace(
        NVML_ERROR_NO_PERMISSION=4,
        NVMLError=NVMLError,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetCount_v2=lambda: 2,
    )
    assert refused_gpus(module, hung=[1]) == [0]
    assert asked == [0]


def test_gpu_reset_with_a_hung_gpu_and_a_withheld_one_gives_the_records_one_advice(
    nvml: ModuleType, env: dict[str, str]
) -> None:
    """`dvfs gpu reset` with state files on three GPUs, GPU 1's handle hanging and GPU 2
    withheld by NVML (no permission). GPU 1's file (its UUID unreadable, its calls hung) was
    named among the withheld GPUs' with "run it as a user the GPUs admit (root, with sudo)",
    beside GPU 1 named as hung: for GPU 1, advice that cannot help (sudo does not make its
    driver answer). The records' line says they may be the hung GPU's too, to run the reset
    once it answers."""
    from dvfs.gpu.safety import StateStore

    store = StateStore(Path(env["DVFS_STATE_DIR"]))
    with open_nvml_gpus([0, 1, 2], nvml=nvml) as gpus:
        _left_changed(nvml, store, gpus)
    nvml.fake_update_device(2, errors={HANDLE: nvml.NVML_ERROR_NO_PERMISSION})
    [error] = _run_with_gpu1_handle_hung(nvml, env, ["gpu", "reset"], code=4)
    said = " ".join(error.split())
    assert "GPU 1 (its calls did not return)" in said, said
    assert "once GPU 1 answers again" in said, said
    assert _back(nvml, 0)
