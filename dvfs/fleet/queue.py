"""Handing cells to workers so that each keeps its drafter's server as long as it can.

A worker asks for its next cell naming the drafter its server runs. It gets that drafter's
next cell while there is one; otherwise the drafter with the most cells left that no worker is
on; otherwise it joins the busiest drafter, taking cells from the back of its list so the two
servers do not interleave their knob settings. Cells of a lost worker go back in measuring
order. Thread-safe: local workers call it from their threads; the Ray driver from one thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence

from dvfs.measure.plan import Cell


class CellQueue:
    def __init__(self, cells: Sequence[Cell]) -> None:
        self._order = {c.key: i for i, c in enumerate(cells)}
        self._lists: dict[str, deque[Cell]] = {}
        for cell in cells:
            self._lists.setdefault(cell.drafter, deque()).append(cell)
        self._on: dict[str, str | None] = {}  # worker -> the drafter its server runs
        self._lead: dict[str, str] = {}  # drafter -> the worker taking from its front
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._lists.values())

    def take(self, worker: str, drafter: str | None = None) -> Cell | None:
        """The next cell for `worker`, whose server runs `drafter` (None: no server yet), or
        None when no cell is left."""
        with self._lock:
            if drafter is not None and self._lists.get(drafter):
                return self._from(worker, drafter)
            left = {d: len(q) for d, q in self._lists.items() if q}
            if not left:
                self._move(worker, None)
                return None
            busy = {d for w, d in self._on.items() if w != worker and d is not None}
            free = [d for d in left if d not in busy]
            pick = max(free or left, key=lambda d: left[d])  # ties: the first in order
            return self._from(worker, pick)

    def _from(self, worker: str, drafter: str) -> Cell:
        """The first on a drafter takes from the front of its list, a helper from the back."""
        self._move(worker, drafter)
        lead = self._lead.setdefault(drafter, worker)
        queue = self._lists[drafter]
        return queue.popleft() if lead == worker else queue.pop()

    def _move(self, worker: str, drafter: str | None) -> None:
        before = self._on.get(worker)
        if before is not None and before != drafter and self._lead.get(before) == worker:
            del self._lead[before]
        self._on[worker] = drafter

    def give_back(self, cells: Iterable[Cell]) -> None:
        """Return cells (a lost worker's) to their drafters' lists, in measuring order."""
        with self._lock:
            for cell in cells:
                queue = self._lists.setdefault(cell.drafter, deque())
                queue.append(cell)
                ordered = sorted(queue, key=lambda c: self._order.get(c.key, len(self._order)))
                queue.clear()
                queue.extend(ordered)

    def leave(self, worker: str) -> None:
        """`worker` is gone: it no longer holds a drafter."""
        with self._lock:
            self._move(worker, None)
            self._on.pop(worker, None)
