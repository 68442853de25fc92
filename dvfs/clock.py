"""Time behind one protocol, so the twin can sweep a week in seconds and hardware runs in real time.

Durations come from monotonic nanoseconds; wall-clock time is only ever metadata.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np


class Ticker(Protocol):
    """A periodic callback that runs until stopped."""

    def stop(self) -> None: ...


class Clock(Protocol):
    """Monotonic time, sleeping, and periodic callbacks (used by the power sampler)."""

    @property
    def virtual(self) -> bool: ...

    def now_ns(self) -> int: ...

    def sleep(self, seconds: float) -> None: ...

    def every(self, period_s: float, callback: Callable[[], None]) -> Ticker: ...


@runtime_checkable
class BatchClock(Protocol):
    """A clock that can hand a periodic callback all its due instants at once (virtual time,
    where nothing happens between ticks but the callbacks themselves)."""

    def every_batch(self, period_s: float, callback: Callable[[np.ndarray], None]) -> Ticker: ...


class _ThreadTicker:
    def __init__(self, period_s: float, callback: Callable[[], None]) -> None:
        self._period_s = period_s
        self._callback = callback
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dvfs-ticker", daemon=True)
        self.error: BaseException | None = None
        self._thread.start()

    def _loop(self) -> None:
        next_s = time.monotonic()
        while not self._stopped.is_set():
            try:
                self._callback()
            except BaseException as exc:  # reported by stop(), never lost in a thread
                self.error = exc
                return
            next_s += self._period_s
            self._stopped.wait(max(0.0, next_s - time.monotonic()))

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5.0)
        if self.error is not None:
            raise self.error


class MonotonicClock:
    """Real time: `time.monotonic_ns`, real sleeps, callbacks on a background thread."""

    virtual = False

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def every(self, period_s: float, callback: Callable[[], None]) -> Ticker:
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        return _ThreadTicker(period_s, callback)


@dataclass(order=True)
class _Timer:
    due_ns: int
    seq: int
    period_ns: int = field(compare=False)
    callback: Callable[[], None] | None = field(compare=False)
    batch: Callable[[np.ndarray], None] | None = field(default=None, compare=False)
    active: bool = field(default=True, compare=False)

    def stop(self) -> None:
        """Stop, and let go of the callback: an owner that keeps its ticker (a sampler) would
        otherwise sit in a reference cycle that only the cyclic collector frees."""
        self.active = False
        self.callback = self.batch = None


class VirtualClock:
    """Discrete-event time for the twin: `sleep` jumps ahead, firing due callbacks in order.

    While a callback runs, `now_ns()` reads its due time, as if a sampler thread had woken then.
    A batch callback (`every_batch`) gets every instant due before the target, or before the
    next other timer, in one call, with `now_ns()` at the last of them: the same instants, in
    the same order relative to other timers, without a Python call and heap push per tick.
    """

    virtual = True

    def __init__(self, start_ns: int = 0) -> None:
        self._now_ns = start_ns
        self._timers: list[_Timer] = []
        self._seq = itertools.count()

    def now_ns(self) -> int:
        return self._now_ns

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot sleep a negative time ({seconds} s)")
        self.advance_to(self._now_ns + round(seconds * 1e9))

    def advance_to(self, target_ns: int) -> None:
        """Move time forward to `target_ns`, firing every callback due on the way."""
        while self._timers and self._timers[0].due_ns <= target_ns:
            timer = heapq.heappop(self._timers)
            if not timer.active:
                continue
            if timer.batch is not None:
                last_ns = self._fire_batch(timer, target_ns)
            else:
                assert timer.callback is not None
                self._now_ns = max(self._now_ns, timer.due_ns)
                timer.callback()
                last_ns = timer.due_ns
            if timer.active:
                timer.due_ns = last_ns + timer.period_ns
                timer.seq = next(self._seq)
                heapq.heappush(self._timers, timer)
        self._now_ns = max(self._now_ns, target_ns)

    def _fire_batch(self, timer: _Timer, target_ns: int) -> int:
        """Call a batch timer with its instants up to the target, stopping before the next
        other timer's due time (that one fires first at a tie, as it would tick by tick)."""
        limit_ns = target_ns
        if self._timers:
            limit_ns = min(limit_ns, self._timers[0].due_ns - 1)
        count = max(1, (limit_ns - timer.due_ns) // timer.period_ns + 1)
        instants = timer.due_ns + timer.period_ns * np.arange(count, dtype=np.int64)
        last_ns = int(instants[-1])
        self._now_ns = max(self._now_ns, last_ns)
        assert timer.batch is not None
        timer.batch(instants)
        return last_ns

    def every(self, period_s: float, callback: Callable[[], None]) -> Ticker:
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        period_ns = max(1, round(period_s * 1e9))
        timer = _Timer(self._now_ns + period_ns, next(self._seq), period_ns, callback)
        heapq.heappush(self._timers, timer)
        return timer

    def every_batch(self, period_s: float, callback: Callable[[np.ndarray], None]) -> Ticker:
        """Like `every`, but `callback` receives the due instants (int64 ns) in batches."""
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, got {period_s}")
        period_ns = max(1, round(period_s * 1e9))
        timer = _Timer(self._now_ns + period_ns, next(self._seq), period_ns, None, callback)
        heapq.heappush(self._timers, timer)
        return timer
