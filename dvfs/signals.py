"""Turning SIGTERM and SIGHUP into an exception, so `with` blocks restore the GPU on the way out.

SIGINT already raises KeyboardInterrupt; the others would kill the process without unwinding.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType


class Interrupted(BaseException):  # noqa: N818  (like KeyboardInterrupt, not an error)
    """A termination signal arrived; unwinding restores state before the process exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def signals_raise(*signums: int) -> Iterator[None]:
    """Within the block, the given signals raise `Interrupted` in the main thread."""
    wanted = signums or (signal.SIGTERM, signal.SIGHUP)
    previous = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        # Ignore repeats while we unwind: a second SIGTERM must not abort the restore.
        for s in wanted:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    for s in wanted:
        previous[s] = signal.signal(s, handler)
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
