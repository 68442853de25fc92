"""Handing cells to workers so that the arms of every comparison run on one GPU.

A comparison group is the cells that share a batch, a corpus and a repeat: every drafter and
every knob setting of them, the arms `dvfs compare` and headroom set against each other. The
queue gives each group to one worker, whole, so that two arms never differ by the GPU that
measured them. When the workers join, the groups are dealt out: each worker gets as many as
the others (fewest cells first, then in measuring order), and those left over wait in a pool
for whichever worker runs out first. A worker runs the groups it holds drafter-major (all its
groups' cells of its server's drafter, in measuring order, then the next drafter's), so it
starts each drafter's server about once. A worker out of cells takes a group from the pool,
else steals a whole group that another worker holds but has not started (from the back of the
busiest one's); a group is never split between workers. Groups that arrive later (the further
repeats the driver adds: each repeat is a new group) are dealt out in the same way.

A run resuming a journal keeps each group its earlier run began with the worker now on the
GPUs that began it (`keep`), where those GPUs are in the run, up to that worker's share of the
cells left.

The one exception is a lost worker: every group it holds goes back to the pool, whole, but
cells it finished stay finished, so a group it had started is finished elsewhere and its arms
then span two GPUs (`dvfs compare` and headroom flag those rows: `different_gpus`).

Thread-safe: local workers call it from their threads; the Ray driver from one thread.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from dvfs.measure.plan import Cell

#: A comparison group: (batch, corpus, repeat), the coordinates that do not depend on the GPU.
GroupKey = tuple[int, str, int]


def group_of(cell: Cell) -> GroupKey:
    """The comparison group a cell belongs to."""
    return (cell.batch, cell.corpus, cell.repeat)


class _Group:
    """A comparison group's cells not handed out yet: each drafter's in measuring order."""

    def __init__(self, rank: Callable[[Cell], int]) -> None:
        self._rank = rank
        self.by_drafter: dict[str, deque[Cell]] = {}
        # The cells queued, for `add` to tell one already there in constant time (a look
        # through the deque made building the queue of a 25,000-cell fleet take 15 s).
        self._queued: set[Cell] = set()
        self.size = 0

    def __bool__(self) -> bool:
        return self.size > 0

    def queued(self, cell: Cell) -> bool:
        return cell in self._queued

    def add(self, cell: Cell) -> bool:
        """Queue `cell` (False: it was queued already)."""
        queue = self.by_drafter.setdefault(cell.drafter, deque())
        if cell in self._queued:
            return False
        self._queued.add(cell)
        if queue and self._rank(queue[-1]) > self._rank(cell):
            queue.append(cell)
            ordered = sorted(queue, key=self._rank)
            queue.clear()
            queue.extend(ordered)
        else:
            queue.append(cell)
        self.size += 1
        return True

    def head(self, drafter: str | None = None) -> Cell | None:
        """The first cell of `drafter` (None: of any drafter), None when it has none."""
        if drafter is not None:
            queue = self.by_drafter.get(drafter)
            return queue[0] if queue else None
        return min((q[0] for q in self.by_drafter.values() if q), key=self._rank, default=None)

    def pop(self, drafter: str) -> Cell:
        self.size -= 1
        cell = self.by_drafter[drafter].popleft()
        self._queued.discard(cell)
        return cell


class CellQueue:
    def __init__(self, cells: Sequence[Cell], workers: Sequence[str] = ()) -> None:
        self._order = {c.key: i for i, c in enumerate(cells)}
        self._cells: dict[GroupKey, _Group] = {}  # each group's cells not handed out yet
        self._holder: dict[GroupKey, str] = {}  # group -> the worker that holds (held) it
        self._started: set[GroupKey] = set()  # groups some cell of which was handed out
        self._pool: list[GroupKey] = []  # groups no worker holds, in measuring order
        self._live: list[str] = []  # the workers that joined and are not lost
        self._left: set[str] = set()  # the workers that left (`leave`): never live again
        # Each worker's groups (those with cells left), and each worker's queued cells of
        # them by drafter as heaps by measuring order (entries of cells handed out or of
        # groups gone to another worker are dropped when met): a `take` finds a worker's next
        # cell without looking through every group it holds (the dry run of a fleet with
        # 12,000 groups took a minute to count its starts).
        self._mine: dict[str, dict[GroupKey, None]] = {}
        self._heaps: dict[str, dict[str, list[tuple[int, int, Cell]]]] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()
        for cell in cells:
            self._group(group_of(cell)).add(cell)
        self._pool = list(self._cells)
        if workers:
            self.join(workers)

    def __len__(self) -> int:
        with self._lock:
            return sum(g.size for g in self._cells.values())

    def join(self, workers: Sequence[str]) -> None:
        """The fleet's workers, in their order: the pool's groups are dealt out to them."""
        with self._lock:
            for worker in workers:
                if worker not in self._live:
                    self._live.append(worker)
            self._deal()

    def keep(self, begun: Mapping[GroupKey, str], workers: Sequence[str]) -> None:
        """Groups an earlier run began (`begun`: each with the worker now on the GPUs that
        began it), before `workers` (the fleet's) join: each stays with that worker, whole,
        and is never stolen, so that a comparison resumed on the same GPUs keeps its arms on
        one. A worker keeps no more of them than its share of the cells left (at least one
        group): the rest are dealt as any other (their arms then span two GPUs, flagged), so
        that a GPU added on resume is not left idle while the others finish the groups their
        earlier run began (a 2-GPU run resumed on 3 took 30% longer, the third idle)."""
        with self._lock:
            share = sum(g.size for g in self._cells.values()) / max(
                len(set(workers) | set(begun.values())), 1
            )
            kept: dict[str, int] = {}
            for group in sorted(begun, key=self._group_rank):
                worker, size = begun[group], self._cells[group].size
                if group not in self._pool or not size:
                    continue
                if kept.get(worker, 0) and kept[worker] + size > share:
                    continue  # beyond its share: dealt out below
                kept[worker] = kept.get(worker, 0) + size
                self._pool.remove(group)
                self._hold(group, worker)
                self._started.add(group)
            if not kept:
                return
            # The pool's groups to the workers with the fewest cells, up to their share (a
            # worker that kept its share gets none), in measuring order; those left wait in the
            # pool (`join` deals them as ever).
            load = {w: kept.get(w, 0) for w in workers}
            for group in list(self._pool):
                size = self._cells[group].size
                open_ = [w for w in workers if load[w] + size <= share]
                if not open_:
                    continue
                worker = min(open_, key=lambda w: (load[w], workers.index(w)))
                load[worker] += size
                self._pool.remove(group)
                self._hold(group, worker)

    def holder(self, group: GroupKey) -> str | None:
        """The worker a group went to (None while it waits in the pool)."""
        with self._lock:
            return self._holder.get(group)

    def take(self, worker: str, drafter: str | None = None) -> Cell | None:
        """The next cell for `worker`, whose server runs `drafter` (None: no server yet), or
        None when none is left for it (other workers may still hold groups), or when it left
        (its thread may ask after the driver retired or lost it)."""
        with self._lock:
            if worker in self._left:
                return None
            if worker not in self._live:
                self._live.append(worker)
            first = self._first(worker)
            if first is None:
                if self._claim(worker) is None:
                    return None
                first = self._first(worker)
                assert first is not None
            # its server's drafter's next cell, else the next drafter's: its earliest cell's
            cell = (self._first(worker, drafter) if drafter is not None else None) or first
            group = group_of(cell)
            popped = self._cells[group].pop(cell.drafter)
            assert popped == cell
            self._started.add(group)
            if not self._cells[group]:
                self._mine[worker].pop(group, None)
            return cell

    def available(self, worker: str) -> bool:
        """Whether a `take` by `worker` now would hand it a cell."""
        with self._lock:
            if worker not in self._live:
                return False
            return bool(self._held(worker) or self._pool or self._victim(worker))

    def give_back(self, cells: Iterable[Cell]) -> None:
        """Cells back in the queue: a lost worker's, or new ones (further repeats). A cell of
        a group some live worker holds goes back to it; new groups are dealt out."""
        with self._lock:
            new = False
            for cell in cells:
                self._order.setdefault(cell.key, len(self._order))
                group = group_of(cell)
                added = self._group(group).add(cell)
                holder = self._holder.get(group)
                if group not in self._pool and holder not in self._live:
                    self._unhold(group)
                    self._pool.append(group)
                    new = True
                elif added and holder is not None and group not in self._pool:
                    self._mine[holder][group] = None
                    self._push(holder, cell)
            if new:
                self._pool.sort(key=self._group_rank)
                self._deal()

    def live(self) -> tuple[str, ...]:
        """The workers that joined and have not left (`leave`)."""
        with self._lock:
            return tuple(self._live)

    def leave(self, worker: str) -> None:
        """`worker` is gone: the groups it holds go back to the pool, whole, for the others.
        (Cells of them it finished stay finished: such a group's arms span two GPUs.)"""
        with self._lock:
            self._left.add(worker)
            if worker in self._live:
                self._live.remove(worker)
            back = [g for g, w in self._holder.items() if w == worker and self._cells[g]]
            for group in back:
                self._unhold(group)
                self._pool.append(group)
            self._pool.sort(key=self._group_rank)
            self._deal()

    # -- under the lock --

    def _rank(self, cell: Cell) -> int:
        return self._order.get(cell.key, len(self._order))

    def _head_rank(self, cell: Cell | None) -> int:
        return len(self._order) if cell is None else self._rank(cell)

    def _group(self, group: GroupKey) -> _Group:
        if group not in self._cells:
            self._cells[group] = _Group(self._rank)
        return self._cells[group]

    def _group_rank(self, group: GroupKey) -> tuple[int, int, str, int]:
        return (self._head_rank(self._cells[group].head()), *group)

    def _held(self, worker: str) -> list[GroupKey]:
        return [g for g in self._mine.get(worker, {}) if self._cells[g]]

    def _hold(self, group: GroupKey, worker: str) -> None:
        """`group` to `worker` (from the pool or another worker)."""
        self._unhold(group)
        self._holder[group] = worker
        self._mine.setdefault(worker, {})[group] = None
        for queue in self._cells[group].by_drafter.values():
            for cell in queue:
                self._push(worker, cell)

    def _unhold(self, group: GroupKey) -> None:
        worker = self._holder.pop(group, None)
        if worker is not None:
            self._mine[worker].pop(group, None)

    def _push(self, worker: str, cell: Cell) -> None:
        heap = self._heaps.setdefault(worker, {}).setdefault(cell.drafter, [])
        heapq.heappush(heap, (self._rank(cell), next(self._seq), cell))

    def _first(self, worker: str, drafter: str | None = None) -> Cell | None:
        """The earliest cell queued of `worker`'s groups, of `drafter` (None: of any)."""
        heaps = self._heaps.get(worker, {})
        if drafter is None:
            firsts = [self._first(worker, d) for d in list(heaps)]
            return min((c for c in firsts if c is not None), key=self._rank, default=None)
        heap = heaps.get(drafter)
        while heap:
            cell = heap[0][2]
            group = group_of(cell)
            if self._holder.get(group) == worker and self._cells[group].queued(cell):
                return cell
            heapq.heappop(heap)  # handed out, or its group another's
        return None

    def _load(self, worker: str) -> int:
        return sum(self._cells[g].size for g in self._held(worker))

    def _deal(self) -> None:
        """Deal the pool's groups out to the live workers: as many to each (a group at a time
        to the worker with the fewest cells waiting), the rest left in the pool for whoever
        runs out first."""
        if not self._live:
            return
        each = len(self._pool) // len(self._live)
        if not each:
            return
        count = dict.fromkeys(self._live, 0)
        load = {w: self._load(w) for w in self._live}
        rank = {w: i for i, w in enumerate(self._live)}
        dealt = []
        for group in self._pool:
            open_ = [w for w in self._live if count[w] < each]
            if not open_:
                break
            worker = min(open_, key=lambda w: (load[w], rank[w]))
            self._hold(group, worker)
            count[worker] += 1
            load[worker] += self._cells[group].size
            dealt.append(group)
        gone = set(dealt)
        self._pool = [g for g in self._pool if g not in gone]

    def _victim(self, worker: str) -> GroupKey | None:
        """A group another worker holds but has not started: from the back of the one with
        the most cells waiting, when it has more than the group's own."""
        best: tuple[int, GroupKey] | None = None
        for other in self._live:
            if other == worker:
                continue
            held = self._held(other)
            fresh = [g for g in held if g not in self._started]
            if not fresh:
                continue
            load = sum(self._cells[g].size for g in held)
            group = max(fresh, key=self._group_rank)
            if load > self._cells[group].size and (best is None or load > best[0]):
                best = (load, group)
        return None if best is None else best[1]

    def _claim(self, worker: str) -> GroupKey | None:
        """A whole group for a worker out of cells: the pool's first, else a stolen one."""
        group = self._pool.pop(0) if self._pool else self._victim(worker)
        if group is not None:
            self._hold(group, worker)
        return group


def simulated_starts(cells: Sequence[Cell], workers: int) -> list[int]:
    """The server starts each of `workers` equally fast workers makes running `cells` (in
    measuring order) through a `CellQueue` (`simulated_run`'s first counts)."""
    return [starts for starts, _ in simulated_run(cells, workers)]


def simulated_run(cells: Sequence[Cell], workers: int) -> list[tuple[int, int]]:
    """The server starts and knob changes each of `workers` equally fast workers makes running
    `cells` (in measuring order) through a `CellQueue` (`simulated_loads`' counts)."""
    return [(load.starts, load.changes) for load in simulated_loads(cells, workers)]


@dataclass(frozen=True)
class WorkerLoad:
    """What one worker of a fleet does (`simulated_loads`): its server starts, its knob
    changes, the knob settings it visits (each one's idle baseline is taken once a session,
    stock apart) and the cells it runs, in its order."""

    starts: int
    changes: int
    settings: int
    cells: tuple[Cell, ...]


def simulated_loads(
    cells: Sequence[Cell],
    workers: int,
    *,
    cell_s: Mapping[str, float] | None = None,
    start_s: float = 0.0,
    change_s: float = 0.0,
    setting_s: float = 0.0,
) -> list[WorkerLoad]:
    """What each of `workers` equally fast workers does running `cells` (in measuring order)
    through a `CellQueue`: a start each time the drafter of the cell it takes differs from its
    server's, a knob change each time the cell's knob setting differs from the one its GPU was
    left at (stock knobs count none, as in the plan of one GPU's sweep), and the settings it
    visits. The dry run's count of a fleet's; a resumed run keeps the groups its GPUs began,
    which this does not know. One worker runs them as one GPU's sweep does. Without `cell_s`
    the workers take a cell each in turn; with it (each cell's own GPU time, by key, and
    `start_s`, `change_s`, `setting_s`: what a start, a knob change and a new setting's idle
    baseline cost), the worker that has spent the least so far takes the next cell, as the
    first to finish takes a group left over on a real fleet."""
    names = [f"w{i}" for i in range(max(workers, 1))]
    queue = CellQueue(cells, names)
    server: dict[str, str | None] = dict.fromkeys(names)
    knobs: dict[str, tuple[int | None, float | None] | None] = dict.fromkeys(names)
    starts = dict.fromkeys(names, 0)
    changes = dict.fromkeys(names, 0)
    settings: dict[str, set[tuple[int | None, float | None]]] = {w: set() for w in names}
    ran: dict[str, list[Cell]] = {w: [] for w in names}
    spent = dict.fromkeys(names, 0.0)

    def take(worker: str) -> bool:
        cell = queue.take(worker, server[worker])
        if cell is None:
            return False
        ran[worker].append(cell)
        if cell.drafter != server[worker]:
            starts[worker] += 1
            server[worker] = cell.drafter
            spent[worker] += start_s
        here = (cell.sm_clock_mhz, cell.power_limit_w)
        if here != knobs[worker] and here != (None, None):
            changes[worker] += 1
            spent[worker] += change_s
        if here != (None, None) and here not in settings[worker]:
            settings[worker].add(here)
            spent[worker] += setting_s
        knobs[worker] = here
        if cell_s is not None:
            spent[worker] += cell_s.get(cell.key, 0.0)
        return True

    alive = list(names)
    if cell_s is None:
        while alive:  # the workers take turns, a cell each, as equally fast GPUs would
            for worker in list(alive):
                if not take(worker):
                    alive.remove(worker)
    else:
        order = {w: i for i, w in enumerate(names)}
        # The one that has spent the least takes the next cell; of those tied, the one that has
        # taken the fewest (every GPU takes a group at the start, also where the costs `run`
        # gives are nought: cells it measured nothing of).
        while alive:
            worker = min(alive, key=lambda w: (spent[w], len(ran[w]), order[w]))
            if not take(worker):
                alive.remove(worker)
    return [WorkerLoad(starts[w], changes[w], len(settings[w]), tuple(ran[w])) for w in names]
