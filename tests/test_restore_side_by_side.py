"""The GPUs put back side by side (`dvfs.gpu.knobs.side_by_side`), one thread per GPU: what a
second signal, a `dvfs gpu reset` interrupted, a thread's bug and failures on several GPUs do.
Runs the real NVML backend against the fake pynvml; every wait is on an event or a fake
NVML hang (never a wall-clock bound)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from nvml_support import load_fake, root_fake_env

from dvfs.gpu.nvml import open_nvml_gpus

RESET = "nvmlDeviceResetGpuLockedClocks"
SET_LIMIT = "nvmlDeviceSetPowerManagementLimit"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return root_fake_env(tmp_path, monkeypatch)


@pytest.fixture
def nvml(env):  # type: ignore[no-untyped-def]
    module = load_fake()
    module.fake_reset_state()
    return module


@pytest.fixture
def dispositions() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture
def hang(nvml, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Make fake NVML calls hang until `release` (`hang("nvmlX@1")`: on GPU 1 only)."""

    def start(*calls: str) -> None:
        monkeypatch.setenv("DVFS_FAKE_NVML_HANG", ",".join(f"{c}=inf" for c in calls))

    yield start
    monkeypatch.delenv("DVFS_FAKE_NVML_HANG", raising=False)
    nvml.fake_release_hangs()


def _release(nvml) -> None:  # type: ignore[no-untyped-def]
    os.environ.pop("DVFS_FAKE_NVML_HANG", None)
    nvml.fake_release_hangs()


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 120) -> None:
    """Poll until `condition` holds (the bound only keeps a broken test from hanging)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def _signal_main(signum: int) -> None:
    """`signum` to the main thread itself (a signal to the process may go to another thread,
    which leaves the main thread's wait asleep, the handler not run)."""
    signal.pthread_kill(threading.main_thread().ident or 0, signum)


def _restore_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("restore-gpu")]


def _join_restore_threads() -> None:
    for thread in _restore_threads():
        thread.join()


def test_a_second_signal_stops_the_other_gpus_restores_from_writing_after_it(
    nvml, hang, tmp_path: Path, dispositions, caplog
) -> None:
    """Two GPUs put back side by side, GPU 1's clock reset stuck in the driver; a second
    SIGTERM gives up on the restore (`RestoreAbandoned`: "dvfs stopped restoring them"), and
    the caller goes on to release the GPUs' locks and shut NVML down. GPU 1's thread must not
    go on writing the GPU once its stuck call returns: its power limit stays as the state file
    says (for `dvfs gpu reset`), and nothing is set on it after the give-up."""
    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.gpu.safety import StateStore
    from dvfs.signals import RestoreAbandoned

    store = StateStore(tmp_path / "dvfs-state")
    with open_nvml_gpus([0, 1], nvml=nvml, deadline_s=3600) as gpus:
        uuids = [g.identity.uuid for g in gpus]

        def signal_twice() -> None:
            wait_for(nvml.fake_hangs_started, "GPU 1's restore is stuck in NVML")
            wait_for(lambda: not store.path(uuids[0]).exists(), "GPU 0 is back")
            _signal_main(signal.SIGTERM)
            wait_for(lambda: "while restoring GPU settings" in caplog.text, "the first noted")
            _signal_main(signal.SIGTERM)

        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # handled anyway, while knobs are held
        sender = threading.Thread(target=signal_twice, daemon=True)
        with (
            pytest.raises(RestoreAbandoned),
            KnobController(gpus, change_log=store) as knobs,
        ):
            knobs.apply(KnobSetting(1500, 400))
            hang(f"{RESET}@1")
            sender.start()
        sender.join()
        given_up = len(nvml.fake_calls())
        _release(nvml)  # the stuck call returns
        _join_restore_threads()
        after = nvml.fake_calls()[given_up:]
        assert [c["fn"] for c in after] == [RESET], after  # the stuck call's own, no more
        assert nvml.fake_device_state(1)["power_limit_mw"] == 400_000
        assert store.path(uuids[1]).exists() and not store.path(uuids[0]).exists()
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000


def test_a_restore_given_up_while_it_waits_out_a_call_the_signal_left_begins_no_call_after(
    nvml, hang, tmp_path: Path, dispositions, caplog
) -> None:
    """A stop's SIGTERM lands while GPU 1's energy read hangs in the driver: GPU 1's restore
    thread waits that call out (its deadline) before the clock's reset. Given up on meanwhile
    (two more SIGTERMs), it must not reset the clock and set the power limit once the read
    returns: the GPU stays as its state file says, for `dvfs gpu reset`."""
    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.gpu.safety import StateStore
    from dvfs.signals import Interrupted, RestoreAbandoned

    store = StateStore(tmp_path / "dvfs-state")
    with open_nvml_gpus([0, 1], nvml=nvml, deadline_s=3600) as gpus:
        uuids = [g.identity.uuid for g in gpus]

        def signal_thrice() -> None:
            wait_for(nvml.fake_hangs_started, "GPU 1's energy read is stuck in NVML")
            _signal_main(signal.SIGTERM)  # the stop
            wait_for(lambda: not store.path(uuids[0]).exists(), "GPU 0 is back")
            _signal_main(signal.SIGTERM)
            wait_for(lambda: "while restoring GPU settings" in caplog.text, "the first noted")
            _signal_main(signal.SIGTERM)

        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # handled anyway, while knobs are held
        sender = threading.Thread(target=signal_thrice, daemon=True)
        with (
            pytest.raises(RestoreAbandoned) as caught,
            KnobController(gpus, change_log=store) as knobs,
        ):
            knobs.apply(KnobSetting(1500, 400))
            hang("nvmlDeviceGetTotalEnergyConsumption@1")
            sender.start()
            gpus[1].energy_mj()
        assert isinstance(caught.value.__context__, Interrupted)
        sender.join()
        given_up = len(nvml.fake_calls())
        _release(nvml)  # the stuck read returns
        _join_restore_threads()
        assert nvml.fake_calls()[given_up:] == []
        assert nvml.fake_device_state(1)["locked_clocks"] == [1500, 1500]
        assert nvml.fake_device_state(1)["power_limit_mw"] == 400_000
        assert store.path(uuids[1]).exists() and not store.path(uuids[0]).exists()
    assert nvml.fake_device_state(0)["locked_clocks"] is None


def _left_changed(nvml, store, gpus) -> None:  # type: ignore[no-untyped-def]
    """Both GPUs capped (1500 MHz, 400 W) with a state file each, as a killed run leaves them."""
    from dvfs.gpu.knobs import GpuSettings

    for index, gpu in enumerate(gpus):
        store.record(GpuSettings(gpu.identity.uuid, None, 700_000))
        nvml.fake_update_device(index, locked_clocks=[1500, 1500], power_limit_mw=400_000)


def test_gpu_reset_interrupted_begins_no_restore_call_after(
    nvml, hang, tmp_path: Path, dispositions
) -> None:
    """`dvfs gpu reset` (no restore that holds signals: the first Ctrl-C stops it) with GPU 1's
    clock reset stuck in the driver: interrupted, it goes on to release the GPUs' locks and
    exit, so GPU 1's thread must not set its power limit once the stuck call returns; GPU 1's
    state file stays, GPU 0 is back and said."""
    from dvfs.gpu.safety import StateStore, restore_pending
    from dvfs.signals import signals_raise

    store = StateStore(tmp_path / "dvfs-state")
    said: list[str] = []
    with open_nvml_gpus([0, 1], nvml=nvml, deadline_s=3600) as gpus:
        _left_changed(nvml, store, gpus)
        uuids = [g.identity.uuid for g in gpus]

        def interrupt() -> None:
            wait_for(nvml.fake_hangs_started, "GPU 1's reset is stuck in NVML")
            wait_for(lambda: said, "GPU 0 is back")
            _signal_main(signal.SIGINT)

        hang(f"{RESET}@1")
        sender = threading.Thread(target=interrupt, daemon=True)
        with pytest.raises(KeyboardInterrupt), signals_raise():
            sender.start()
            restore_pending(gpus, store, said.append)
        sender.join()
        given_up = len(nvml.fake_calls())
        _release(nvml)
        _join_restore_threads()
        after = nvml.fake_calls()[given_up:]
        assert [c["fn"] for c in after] == [RESET], after  # the stuck call's own, no more
        assert nvml.fake_device_state(1)["power_limit_mw"] == 400_000
        assert store.path(uuids[1]).exists() and not store.path(uuids[0]).exists()
        assert [line.split(" (")[0] for line in said] == ["restored GPU 0"]


def test_failures_are_said_in_the_gpus_order_whichever_finishes_first(
    nvml, hang, tmp_path: Path
) -> None:
    """GPU 0's restore fails after GPU 1's (its failing call held in the driver until GPU 1's
    thread is done): the line still names GPU 0 first, both files kept, exit as before."""
    from dvfs.errors import GpuError
    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.gpu.safety import StateStore

    store = StateStore(tmp_path / "dvfs-state")
    unknown = {RESET: nvml.NVML_ERROR_UNKNOWN}
    with open_nvml_gpus([0, 1], nvml=nvml, deadline_s=3600) as gpus:

        def release_once_gpu_1_is_done() -> None:
            wait_for(nvml.fake_hangs_started, "GPU 0's reset is stuck in NVML")
            wait_for(
                lambda: not any(t.name == "restore-gpu1" for t in _restore_threads()),
                "GPU 1's restore is done",
            )
            _release(nvml)

        releaser = threading.Thread(target=release_once_gpu_1_is_done, daemon=True)
        with pytest.raises(GpuError) as caught, KnobController(gpus, change_log=store) as knobs:
            knobs.apply(KnobSetting(1500, None))
            for index in (0, 1):
                nvml.fake_update_device(index, errors=unknown)
            hang(f"{RESET}@0")
            releaser.start()
        releaser.join()
        said = str(caught.value)
        first, second = said.index("GPU 0 ("), said.index("GPU 1 (")
        assert said.startswith("could not restore GPU settings: GPU 0 (") and first < second
        assert said.endswith("retries from the state file."), said
        assert all(store.path(g.identity.uuid).exists() for g in gpus)


@pytest.mark.parametrize("bug", [RuntimeError("a bug"), KeyboardInterrupt()])
def test_an_error_in_a_restore_thread_is_raised_and_leaves_its_gpus_state_file(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bug: BaseException
) -> None:
    """A restore thread's own error (a bug, raised as `RestoreBugError` naming every GPU's
    failure: tests/test_restore_leftovers.py; a KeyboardInterrupt, which no signal raises
    there, as it is) is raised in the waiting thread once every GPU is done, never lost: its
    GPU is not taken as back (its state file stays), the other GPU is put back, its file
    removed."""
    from dvfs.gpu.knobs import KnobController, KnobSetting, RestoreBugError
    from dvfs.gpu.safety import StateStore

    store = StateStore(tmp_path / "dvfs-state")
    raised = RestoreBugError if isinstance(bug, Exception) else type(bug)
    with open_nvml_gpus([0, 1], nvml=nvml) as gpus:

        def broken() -> None:
            raise bug

        with pytest.raises(raised), KnobController(gpus, change_log=store) as knobs:
            knobs.apply(KnobSetting(1500, 400))
            monkeypatch.setattr(gpus[0], "reset_sm_clock", broken)
        assert store.path(gpus[0].identity.uuid).exists()
        assert not store.path(gpus[1].identity.uuid).exists()
    assert nvml.fake_device_state(1)["locked_clocks"] is None
    assert nvml.fake_device_state(1)["power_limit_mw"] == 700_000


@pytest.mark.parametrize("fault", ["lost", "limit refused"])
def test_one_gpu_failing_leaves_the_other_back_and_its_own_state_file(
    nvml, tmp_path: Path, fault: str
) -> None:
    """GPU 1 fallen off the bus, or its power limit's restore refused after its clock's went
    back: GPU 0 is put back and its file removed; GPU 1's file stays, the line names GPU 1
    alone (no grouping with one GPU), and a clock put back is known as back."""
    from dvfs.errors import GpuError
    from dvfs.gpu.knobs import KnobController, KnobSetting
    from dvfs.gpu.safety import StateStore

    store = StateStore(tmp_path / "dvfs-state")
    with open_nvml_gpus([0, 1], nvml=nvml) as gpus:
        uuids = [g.identity.uuid for g in gpus]
        with pytest.raises(GpuError) as caught, KnobController(gpus, change_log=store) as knobs:
            knobs.apply(KnobSetting(1500, 400))
            if fault == "lost":
                nvml.fake_update_device(1, lost=True)
            else:
                refused = {SET_LIMIT: nvml.NVML_ERROR_INVALID_ARGUMENT}
                nvml.fake_update_device(1, errors=refused)
        said = str(caught.value)
        assert said.startswith(f"could not restore GPU settings: GPU 1 ({uuids[1]}): "), said
        assert "GPU 0" not in said, said
        assert store.path(uuids[1]).exists() and not store.path(uuids[0]).exists()
        if fault == "limit refused":
            assert knobs.current[uuids[1]].sm_clock_lock_mhz is None
            assert nvml.fake_device_state(1)["locked_clocks"] is None
            assert nvml.fake_device_state(1)["power_limit_mw"] == 400_000
    assert nvml.fake_device_state(0)["locked_clocks"] is None
    assert nvml.fake_device_state(0)["power_limit_mw"] == 700_000
