"""Python's cyclic garbage collector, run less often where dvfs makes hundreds of thousands of
small objects that reference counting frees by itself: a twin sweep's traces and readings,
a figure's artists, transforms and paths. At Python's default first threshold (700) the
collector ran thousands of times (~7% of the demo sweep's CPU) and each full run went over
every object numpy, pandas, xarray and matplotlib hold (0.2-0.25 s of the demo's `dvfs
plot`). What is in no cycle is still freed at once, and the runs still come."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: The collector's first threshold inside `few_collections` (at least: a higher one is kept).
GC_THRESHOLD_0 = 10_000

#: How many `few_collections` are open, and the thresholds found when the first opened: a local
#: fleet's workers are threads that open and close theirs in any order, and only the last to
#: close may put the collector back as it was.
_open = 0
_found: tuple[int, ...] = ()
_open_lock = threading.Lock()


@contextmanager
def few_collections(*, freeze: bool = False) -> Iterator[None]:
    """The collector's first threshold raised to `GC_THRESHOLD_0`, and with `freeze` the
    objects that exist on entry kept out of its runs (`gc.freeze`, unless something else froze
    objects before: those are left be); both as they were on exit, whatever happened. Open in
    several threads at once, the thresholds go back when the last one closes."""
    global _open, _found
    with _open_lock:
        if _open == 0:
            _found = gc.get_threshold()
            first, *rest = _found
            gc.set_threshold(max(first, GC_THRESHOLD_0), *rest)
        _open += 1
    freeze = freeze and gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        with _open_lock:
            _open -= 1
            if _open == 0:
                gc.set_threshold(*_found)
        if freeze:
            gc.unfreeze()
