"""CallWorker under signals: a call whose wait a signal interrupted is left behind, the next
call waits for it only until its own deadline ends. These drive the worker directly, with
events and a fake clock (never a wall-clock upper bound): the signal is sent to the main
thread by the NVML call itself, once it runs in the worker, so it lands in the wait."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from dvfs.gpu import deadline
from dvfs.gpu.deadline import CallWorker, DeadlineExceeded

FAR = 3600.0  # a deadline no test reaches on the wall clock


#: Set by `_interrupt_main` until its SIGINT has raised in the main thread (`_raise_armed`);
#: `_SENDING` held while one is sent, and by the fixture as it puts the handler back.
_ARMED, _RAISED = threading.Event(), threading.Event()
_SENDING = threading.Lock()


def _raise_armed(signum: int, frame: object) -> None:
    """KeyboardInterrupt once for each `_interrupt_main`; a SIGINT sent again after it is
    ignored."""
    if _ARMED.is_set():
        _ARMED.clear()
        _RAISED.set()
        raise KeyboardInterrupt


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    previous = signal.signal(signal.SIGINT, _raise_armed)
    try:
        yield
    finally:
        with _SENDING:  # no SIGINT of a thread still sending reaches the handler put back
            _ARMED.clear()
            signal.signal(signal.SIGINT, previous)


@pytest.fixture
def later(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Seconds the worker's clock runs ahead of the real one (set it to pass a deadline)."""
    import time

    ahead = [0.0]
    monkeypatch.setattr(
        deadline, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + ahead[0])
    )
    return ahead


def _interrupt_main() -> None:
    """SIGINT to the main thread until it has raised there: a signal landing just before the
    main thread's wait blocks wakes no wait (the handler runs only once the wait ends, here
    an hour on), so it is sent again (ignored once one has raised)."""
    _RAISED.clear()
    _ARMED.set()
    while True:
        with _SENDING:
            if not _ARMED.is_set():  # raised, or the test is over
                return
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        if _RAISED.wait(0.2):
            return


class Stuck:
    """An NVML call that interrupts its caller's wait, then stays "in the driver" until let go."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.returned = threading.Event()

    def nvmlStuck(self) -> str:  # noqa: N802  (named like the NVML call it stands for)
        _interrupt_main()
        self.gate.wait()
        self.returned.set()
        return "late"


def _interrupted(worker: CallWorker, stuck: Stuck) -> None:
    with pytest.raises(KeyboardInterrupt):
        worker.call(stuck.nvmlStuck, (), FAR)


def test_a_slow_call_no_signal_interrupts_is_waited_for_fully() -> None:
    worker = CallWorker("t")
    started, gate = threading.Event(), threading.Event()

    def slow() -> int:
        started.set()
        gate.wait()
        return 7

    opener = threading.Thread(target=lambda: (started.wait(), gate.set()), daemon=True)
    opener.start()
    assert worker.call(slow, (), FAR) == 7
    opener.join()
    assert worker.call(lambda: 8, (), FAR) == 8


def test_an_interrupted_call_that_returned_leaves_the_next_call_to_run(sigint_raises) -> None:
    worker = CallWorker("t")
    stuck = Stuck()
    _interrupted(worker, stuck)
    stuck.gate.set()
    stuck.returned.wait()
    ran: list[int] = []
    assert worker.call(lambda: ran.append(1) or 1, (), FAR) == 1
    assert ran == [1]
    assert worker.call(lambda: 2, (), FAR) == 2  # the mark is gone, not just stepped over


def test_an_interrupted_call_returning_while_the_next_waits_lets_it_run(sigint_raises) -> None:
    """The restore after a signal during a slow (not hung) read: it waits for the read, then
    runs; whichever comes first, the read returning or the restore starting to wait."""
    worker = CallWorker("t")
    stuck = Stuck()
    _interrupted(worker, stuck)
    opener = threading.Thread(target=stuck.gate.set, daemon=True)
    opener.start()
    assert worker.call(lambda: "restored", (), FAR) == "restored"
    opener.join()


def test_an_interrupted_call_still_in_the_driver_at_its_deadline_fails_the_next_at_once(
    sigint_raises, later: list[float]
) -> None:
    worker = CallWorker("t")
    stuck = Stuck()
    _interrupted(worker, stuck)
    later[0] = FAR + 1  # its deadline has passed
    ran: list[int] = []
    for _ in range(2):  # and every call after, until it returns
        with pytest.raises(DeadlineExceeded) as caught:
            worker.call(lambda: ran.append(1), (), FAR)
        assert caught.value.hung == "nvmlStuck"
    assert ran == []
    stuck.gate.set()
    stuck.returned.wait()
    assert worker.call(lambda: "runs", (), FAR) == "runs"


def test_a_call_returning_as_its_interrupted_wait_is_marked_never_blocks_the_next(
    sigint_raises,
) -> None:
    """The worker finishing the call just as the signal's exception marks it (either order):
    the next call runs, at once or after the call, never failing."""
    for _ in range(50):
        worker = CallWorker("t")

        def quick() -> str:
            _interrupt_main()
            return "done"

        with contextlib.suppress(KeyboardInterrupt):  # (the usual case: the wait woke first)
            worker.call(quick, (), FAR)
        assert worker.call(lambda: "next", (), FAR) == "next"


def test_a_second_signal_while_the_next_call_waits_out_the_stuck_one(
    sigint_raises, later: list[float]
) -> None:
    """Ctrl-C twice: the restore's wait for the stuck call is interrupted too; the mark stays,
    and a call after the deadline still fails at once, naming the stuck call."""
    worker = CallWorker("t")
    stuck = Stuck()
    _interrupted(worker, stuck)
    waiting = threading.Event()

    class Sentinel(threading.Thread):
        def run(self) -> None:
            waiting.wait()
            _interrupt_main()

    original = deadline.lock_left_unheld_is_the_interruption

    def noticing():  # type: ignore[no-untyped-def]
        waiting.set()
        return original()

    sentinel = Sentinel(daemon=True)
    sentinel.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(deadline, "lock_left_unheld_is_the_interruption", noticing)
        with pytest.raises(KeyboardInterrupt):
            worker.call(lambda: "restore", (), FAR)
    sentinel.join()
    later[0] = FAR + 1
    with pytest.raises(DeadlineExceeded) as caught:
        worker.call(lambda: "restore", (), FAR)
    assert caught.value.hung == "nvmlStuck"
    stuck.gate.set()
    stuck.returned.wait()
    assert worker.call(lambda: "restore", (), FAR) == "restore"


def test_a_signal_landing_as_a_call_overruns_its_deadline_still_marks_it(
    sigint_raises,
) -> None:
    """A signal whose exception lands just after the wait ran out (before the overrun is
    marked) left the call in the driver unmarked: the restore queued behind it and waited a
    deadline of its own. Here the signal lands as the worker's lock is taken to mark it."""
    worker = CallWorker("t")
    gate = threading.Event()

    def hung() -> str:
        gate.wait()
        return "late"

    class SignalOnThirdTake:
        """The worker's lock, with a signal's exception as the main thread's third take
        begins (the one that marks an overrun: after the left-behind check and the queue)."""

        def __init__(self) -> None:
            self.lock, self.takes = threading.Lock(), 0

        def __enter__(self) -> None:
            if threading.current_thread() is threading.main_thread():
                self.takes += 1
                if self.takes == 3:
                    raise KeyboardInterrupt
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    worker._lock = SignalOnThirdTake()  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        worker.call(hung, (), 0.0)  # a deadline already over: the wait runs out at once
    worker._lock = threading.Lock()
    # (unmarked, the next call would queue behind the hung one until it returns: let it go
    # at last, so that such a run ends, and fails)
    release = threading.Timer(30, gate.set)
    release.start()
    ran: list[int] = []
    try:
        with pytest.raises(DeadlineExceeded) as caught:
            worker.call(lambda: ran.append(1), (), FAR)
    finally:
        release.cancel()
    assert caught.value.hung == "hung"
    assert ran == []
    gate.set()


def test_an_interrupted_call_queued_behind_another_threads_slow_call_lets_the_restore_run(
    sigint_raises,
) -> None:
    """A sampler thread's slow read in the driver, the main thread's call queued behind it
    and interrupted there (never started): once the read returns, the queued call runs, then
    the restore, in that order, none failing."""
    worker = CallWorker("t")
    gate, in_driver = threading.Event(), threading.Event()
    order: list[str] = []

    def slow_read() -> str:
        in_driver.set()
        gate.wait()
        order.append("read")
        return "read"

    sampler = threading.Thread(target=lambda: worker.call(slow_read, (), FAR), daemon=True)
    sampler.start()
    in_driver.wait()

    def queued_setter() -> str:
        order.append("setter")
        return "set"

    with pytest.MonkeyPatch.context() as mp:
        original = deadline.lock_left_unheld_is_the_interruption

        def interrupting():  # type: ignore[no-untyped-def]
            _interrupt_main()  # (the call is queued: it lands as its wait begins)
            return original()

        mp.setattr(deadline, "lock_left_unheld_is_the_interruption", interrupting)
        with pytest.raises(KeyboardInterrupt):
            worker.call(queued_setter, (), FAR)
    opener = threading.Thread(target=gate.set, daemon=True)
    opener.start()
    assert worker.call(lambda: order.append("restore") or "restored", (), FAR) == "restored"
    opener.join()
    sampler.join()
    assert order == ["read", "setter", "restore"]
