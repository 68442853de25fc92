"""A deadline for every NVML call: a hung driver call becomes an error, not a hung dvfs.

A call into the driver cannot be interrupted from Python, so each GPU's calls run in order on
one worker thread and the caller waits at most the deadline. Waiting on a lock keeps the main
thread responsive to signals even while the driver is stuck. A call that overruns leaves the
worker stuck in the driver (a daemon thread: it does not keep the process alive); until it
returns, further calls on that GPU fail at once instead of queueing behind it, so a late
setter can never land after a later restore. A call whose wait a signal interrupted (Ctrl-C,
`systemctl stop`) is still in the driver: the next call on that GPU (the restore) waits for it
only until that call's own deadline ends, then fails at once as after an overrun, so a signal
during a hung call ends the run within the deadline instead of queueing the restore behind
the stuck call for a deadline of its own. The hop costs tens of microseconds per call.

The deadline comes from $DVFS_NVML_DEADLINE_S (seconds, default 10; 0 turns it off).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from dvfs.errors import GpuError, GpuValueError
from dvfs.signals import lock_left_unheld_is_the_interruption

T = TypeVar("T")

DEFAULT_DEADLINE_S = 10.0
DEADLINE_ENV = "DVFS_NVML_DEADLINE_S"
#: An idle worker thread exits after this long; the next call starts a new one.
IDLE_EXIT_S = 2.0


#: What a hung call's error (`DeadlineExceeded.describe`) ends with, after "; ": said once in a
#: line naming several GPUs' (`dvfs.backends.lost_gpus`).
NOT_RESPONDING = (
    "the driver is not responding (see `nvidia-smi` and the kernel log for Xid errors; "
    f"${DEADLINE_ENV} sets the deadline)"
)


class GpuTimeoutError(GpuError):
    """An NVML call did not return within its deadline: the driver or the GPU is not responding."""


def default_deadline_s() -> float | None:
    """The deadline from $DVFS_NVML_DEADLINE_S (None when 0: calls run directly, unbounded)."""
    raw = os.environ.get(DEADLINE_ENV, "").strip()
    if not raw:
        return DEFAULT_DEADLINE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise GpuValueError(
            f"{DEADLINE_ENV}={raw!r} is not a number of seconds (>= 0; 0 turns the deadline off)"
        )
    return value or None


class CallGivenUpError(GpuError):
    """A call not begun: the work of the thread that asked for it was given up on meanwhile
    (`given_up_with`)."""


#: The event that gives up on this thread's calls (`given_up_with`), where one does.
_given_up = threading.local()


@contextlib.contextmanager
def given_up_with(stop: threading.Event) -> Iterator[None]:
    """Within the block, every call this thread makes through a `CallWorker` fails at once
    (`CallGivenUpError`) once `stop` is set, instead of being begun: a GPU's restore on its own
    thread (`dvfs.gpu.knobs.side_by_side`) given up on (a second signal, a `gpu reset`
    interrupted) starts no NVML call after, nor once the one it waits out (a call a signal
    left in the driver) returns, while the command releases the GPUs' locks and shuts NVML
    down."""
    _given_up.stop = stop
    try:
        yield
    finally:
        _given_up.stop = None


def _refuse_if_given_up(name: str) -> None:
    stop: threading.Event | None = getattr(_given_up, "stop", None)
    if stop is not None and stop.is_set():
        raise CallGivenUpError(f"{name} was not attempted: the restore was given up on")


class DeadlineExceeded(Exception):  # noqa: N818  (internal; callers raise GpuTimeoutError)
    """A call overran its deadline, or was not attempted because an earlier one still hangs."""

    def __init__(self, name: str, deadline_s: float, hung: str | None, hung_for_s: float) -> None:
        super().__init__(name)
        self.name = name
        self.deadline_s = deadline_s
        self.hung = hung
        self.hung_for_s = hung_for_s

    def describe(self, where: str) -> str:
        """One sentence naming the call and the GPU (`where`, e.g. "GPU 0 (GPU-...)")."""
        if self.hung is None:
            what = f"{self.name} on {where} did not return within {self.deadline_s:g} s"
        else:
            what = (
                f"{self.name} on {where} was not attempted: {self.hung} has not returned for "
                f"{self.hung_for_s:.0f} s"
            )
        return f"{what}; {NOT_RESPONDING}"


class _Job:
    __slots__ = ("fn", "args", "name", "done", "result", "error", "since", "until")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], name: str, deadline_s: float
    ) -> None:
        self.fn, self.args, self.name = fn, args, name
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.since = time.monotonic()
        #: When its deadline ends: a call an interrupted wait left behind is waited for until
        #: then, no longer (`CallWorker._wait_out_left_behind`).
        self.until = self.since + deadline_s


class CallWorker:
    """Runs one GPU's calls in order on a worker thread, each with a deadline."""

    def __init__(self, name: str, *, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self.name = name
        self.idle_exit_s = idle_exit_s
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job | None] | None = None
        self._hung: _Job | None = None

    def call(self, fn: Callable[..., T], args: tuple[Any, ...], deadline_s: float | None) -> T:
        """`fn(*args)` within `deadline_s` seconds (None: directly, in this thread)."""
        name = getattr(fn, "__name__", repr(fn))
        _refuse_if_given_up(name)
        if deadline_s is None:
            return fn(*args)
        self._wait_out_left_behind()
        _refuse_if_given_up(name)  # (given up on while it waited)
        job = _Job(fn, args, name, deadline_s)
        queued = False
        try:
            with self._lock:
                hung = self._hung
                if hung is not None and not hung.done.is_set():
                    since = time.monotonic() - hung.since
                    raise DeadlineExceeded(name, deadline_s, hung.name, since)
                self._hung = None
                if self._queue is None:
                    self._queue = queue.SimpleQueue()
                    threading.Thread(
                        target=self._serve,
                        args=(self._queue,),
                        name=f"nvml-{self.name}",
                        daemon=True,
                    ).start()
                self._queue.put(job)
                queued = True
            with lock_left_unheld_is_the_interruption():  # a Ctrl-C as the wait wakes
                finished = job.done.wait(deadline_s)
            if not finished:  # (in the `try`: a signal landing as it is marked marks it too)
                with self._lock:
                    if not job.done.is_set():
                        self._hung = job
                        raise DeadlineExceeded(name, deadline_s, None, 0.0)
        except BaseException:
            # A signal's exception, the restore next, and the call still in the driver: left
            # as it was, the restore queued behind it and waited a deadline of its own (with
            # the driver stuck, one more deadline per GPU, past a unit's stop timeout)
            if queued:
                with self._lock:
                    if not job.done.is_set():
                        self._hung = job
            raise
        if job.error is not None:
            raise job.error
        return job.result

    def _wait_out_left_behind(self) -> None:
        """Before a call: a call an interrupted wait left in the driver is given the rest of
        its own deadline to return (a slow call is no hung one); one still there after is
        hung, and the call that follows fails at once, naming it (`call`)."""
        with self._lock:
            hung = self._hung
        if hung is None or hung.done.is_set():
            return
        left = hung.until - time.monotonic()
        if left > 0:
            with lock_left_unheld_is_the_interruption():
                hung.done.wait(left)

    def _serve(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        while True:
            try:
                job = jobs.get(timeout=self.idle_exit_s)
            except queue.Empty:
                with self._lock:
                    if jobs.empty():  # a caller puts under the lock: none can be on its way
                        if self._queue is jobs:
                            self._queue = None
                        return
                continue
            if job is None:
                return
            try:
                job.result = job.fn(*job.args)
            except BaseException as exc:  # handed to the caller, never lost in the thread
                job.error = exc
            job.done.set()

    def close(self) -> None:
        """Let the worker thread exit once its queue is done (it would after being idle anyway)."""
        with self._lock:
            if self._queue is not None:
                self._queue.put(None)
                self._queue = None
