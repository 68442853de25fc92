"""Termination signals during GPU-changing work: unwind to restore the GPU, never hang restoring.

`signals_raise` makes SIGINT raise KeyboardInterrupt and SIGTERM/SIGHUP raise `Interrupted` for
the block, whatever dispositions the process inherited: a shell starts background jobs with
SIGINT ignored, and Python then installs no KeyboardInterrupt handler, so without this
`kill -INT` would do nothing. `restoring` holds signals back while settings are put back: the
first is remembered and delivered after the restore, the next gives up on the restore
(`RestoreAbandoned`, naming `dvfs gpu reset`), so a stuck restore cannot swallow signals forever.
Both act in the main thread only (Python runs signal handlers there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

#: The signals dvfs turns into exceptions while it changes GPU settings.
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):  # noqa: N818  (like KeyboardInterrupt, not an error)
    """A termination signal arrived; unwinding restores state before the process exits."""

    def __init__(self, signum: int, message: str | None = None) -> None:
        super().__init__(message or f"received {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class RestoreAbandoned(Interrupted):
    """A signal arrived again while settings were being restored, and dvfs stopped restoring."""

    def __init__(self, signum: int, reset: str = "`dvfs gpu reset`") -> None:
        super().__init__(
            signum,
            f"received {signal.Signals(signum).name} again while restoring GPU settings, so "
            f"dvfs stopped restoring them; some may still be changed: run {reset}",
        )


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def raise_for(signum: int) -> None:
    """The exception a handled signal becomes: KeyboardInterrupt for SIGINT, else Interrupted."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(signum)


@contextlib.contextmanager
def _handled_by(
    handler: Callable[[int, FrameType | None], None], signums: tuple[int, ...] = HANDLED
) -> Iterator[dict[int, Any]]:
    """`handler` installed for `signums` within the block (which gets the handlers it
    replaced), and those put back after it, however it ends."""
    previous: dict[int, Any] = {s: signal.signal(s, handler) for s in signums}
    try:
        yield previous
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextlib.contextmanager
def signals_raise(*signums: int) -> Iterator[None]:
    """Within the block, the given signals (default: SIGINT, SIGTERM, SIGHUP) raise in the main
    thread, whatever their inherited disposition (SIG_IGN included); the previous handlers come
    back afterwards. Outside the main thread this does nothing."""
    if not _on_main_thread():
        yield
        return
    wanted = signums or HANDLED

    def handler(signum: int, frame: FrameType | None) -> None:
        raise_for(signum)

    with _handled_by(handler, wanted):
        yield


#: Signals received during a restore before it is abandoned (the first only waits).
GIVE_UP_AFTER = 2


@contextlib.contextmanager
def lock_left_unheld_is_the_interruption() -> Iterator[None]:
    """Around a wait on a lock-based condition (a `queue.Queue`'s get, a `threading.Event`'s
    wait) in the thread `signals_raise` raises in: a signal's exception that lands while the
    wait takes its lock back leaves the lock unheld, and the wait's own `with` then fails
    "release unlocked lock" (RuntimeError), hiding the interruption: it is raised instead, as
    the signal meant (else an internal error, or a cell failed and the sweep going on)."""
    try:
        yield
    except RuntimeError as exc:
        behind = exc.__context__
        if isinstance(behind, (KeyboardInterrupt, Interrupted)):
            raise behind from None
        raise


@contextlib.contextmanager
def restoring(
    notify: Callable[[str], None] | None = None,
    *,
    give_up_after: int = GIVE_UP_AFTER,
    reset: str = "`dvfs gpu reset`",
) -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while settings are restored, and deliver them after.

    The first signal only prints a notice; the `give_up_after`-th raises `RestoreAbandoned`
    from wherever the restore is waiting (NVML calls wait interruptibly, see
    `dvfs.gpu.deadline`). A held signal is delivered when the block ends normally, to the
    handler that was installed before; when the block raises, its error wins, and carries the
    signal held (`held_signal`) for the line that reports it. `reset`: the command that puts
    back what a restore given up on leaves (the `dvfs gpu reset` that reads its state files).
    """
    if not _on_main_thread():
        yield
        return
    say = notify or log.warning
    received: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if len(received) >= give_up_after:
            raise RestoreAbandoned(signum, reset)
        say(
            f"received {signal.Signals(signum).name} while restoring GPU settings: finishing "
            f"the restore first; send it again to give up (then run {reset})"
        )

    with _handled_by(hold) as previous:
        try:
            yield
        except BaseException as exc:
            if received and not isinstance(exc, RestoreAbandoned):
                # the block's error wins, but the signal held meanwhile is not forgotten
                with contextlib.suppress(AttributeError, TypeError):
                    exc.held_signal = received[0]  # type: ignore[attr-defined]
            raise
    if received:
        _deliver(received[0], previous[received[0]])


@contextlib.contextmanager
def held_back() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held back while the block runs, and the first delivered after
    it, to the handler installed before (main thread only). For a netCDF write: a signal's
    exception raised while xarray held one of its locks left that lock held, and the write's
    clean-up (closing the file) then waited for it for ever."""
    if not _on_main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    try:
        with _handled_by(hold) as previous:
            yield
    finally:
        if received:
            _deliver(received[0], previous[received[0]])


def held_signal(exc: BaseException) -> int | None:
    """The signal `restoring` held while the block that raised `exc` ran, if one came."""
    signum = getattr(exc, "held_signal", None)
    return signum if isinstance(signum, int) else None


def _deliver(signum: int, handler: Any) -> None:
    """Handle `signum` now as `handler` (the one installed before the restore) would have."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)  # the default action: usually terminate
    # SIG_IGN (or None: installed outside Python): ignored, as it would have been


def interrupted_while(exc: BaseException, what: str) -> Interrupted:
    """The `Interrupted` that ends a command a signal stopped (`exc`: its `Interrupted`, or the
    KeyboardInterrupt SIGINT raises), its one line saying what the command was doing and what
    that left: "received SIGTERM {what}"."""
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    return Interrupted(signum, f"received {signal.Signals(signum).name} {what}")
