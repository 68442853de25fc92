"""The local executor: one worker thread per GPU group of this machine.

Each thread opens its worker (its GPUs, knobs, server, clock), then pulls units of work (a
cell, or an in-flight group) from the driver's queue until none is left for it (then it waits
while others hold cells, for a group to steal or one a lost worker leaves); everything it
finishes travels to the driver's thread through one event queue, and only the driver's thread
writes the journal. A worker that fails is lost: its unit goes back to the queue. On Ctrl-C or
SIGTERM (raised on the driver's thread) the workers stop after their current unit, restore
their GPUs on their way out, and the driver journals what they finished before the
interruption goes on.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from dvfs.campaign import Campaign
from dvfs.errors import ServerReplacedError
from dvfs.fleet.devices import Group
from dvfs.fleet.driver import Fleet
from dvfs.fleet.worker import Worker

#: Seconds the driver waits on its event queue before looking again (signals land between);
#: also the longest a worker out of cells waits before looking at the queue again, though the
#: driver wakes it at once when what it waits for may have changed.
POLL_S = 0.2
#: Seconds a fleet's workers have to open their GPUs, from the start (a Ray actor's open is
#: given up after it: `dvfs.fleet.ray_executor`).
OPEN_TIMEOUT_S = 1800.0
#: Seconds the workers still opening as the run fails are waited for past the opens' own
#: bound (`OPEN_TIMEOUT_S` from the start), so that they close, their GPUs restored, rather
#: than be left inside `open` (Ray's actors killed there): after the opens' bound, which
#: waited that long already, no further half hour.
OPENING_GRACE_S = 60.0
#: Seconds that wait runs before its note is said: workers that finish opening in that time
#: leave the run's failure its one line (on the twin and at most real opens they do).
OPENING_QUIET_S = 10.0


def opening_wait_note(workers: str, bound: float, opening: int) -> str:
    """The one note a fleet whose run failed as its `workers` opened says as it waits up to
    `bound` s for the `opening` still opening: the local fleet's and Ray's alike."""
    return (
        f"the run failed as the {workers} opened: waiting up to {bound:g} s for the {opening} "
        "still opening their GPUs to finish, to close them (Ctrl-C stops waiting: their GPUs "
        "are then named for `dvfs gpu reset`)"
    )


class VirtualPacer:
    """On the twin, the workers' GPU time is virtual and their threads share one interpreter:
    left alone, whichever thread the CPU favours would take the most cells. The pacer lets a
    worker take its next cell only at its turn in GPU time (a conservative discrete-event
    schedule): no other worker is free earlier, and none busy started before it could be
    free. Cells then go where real GPUs would have taken them, whatever this machine does."""

    def __init__(self, labels: Sequence[str], lanes: dict[str, object] | None = None) -> None:
        self._cv = threading.Condition()
        self._rank = {label: i for i, label in enumerate(labels)}
        #: Workers of different lanes (GPU models: queues of their own) never wait on each other.
        self._lane = lanes or {}
        self._free: dict[str, float] = dict.fromkeys(labels, 0.0)
        self._busy: dict[str, float] = {}

    def turn(self, label: str, stop: threading.Event) -> None:
        """Wait until `label` (free since its GPU time) is next; mark it busy."""
        with self._cv:
            while not stop.is_set() and not self._next(label):
                self._cv.wait(POLL_S)
            self._busy[label] = self._free.pop(label)

    def claim(self, label: str) -> bool:
        """Mark `label` busy if it is its turn now (for a single-threaded driver)."""
        with self._cv:
            if label not in self._free or not self._next(label):
                return False
            self._busy[label] = self._free.pop(label)
            return True

    def _next(self, label: str) -> bool:
        mine = (self._free[label], self._rank[label])
        lane = self._lane.get(label)
        for v, t in self._free.items():
            if v != label and self._lane.get(v) == lane and (t, self._rank[v]) < mine:
                return False
        return all(since >= mine[0] for v, since in self._busy.items() if self._lane.get(v) == lane)

    def free(self, label: str, gpu_time_s: float) -> None:
        with self._cv:
            self._busy.pop(label, None)
            self._free[label] = gpu_time_s
            self._cv.notify_all()

    def leave(self, label: str) -> None:
        with self._cv:
            self._busy.pop(label, None)
            self._free.pop(label, None)
            self._cv.notify_all()


class LocalExecutor:
    """Threads of this process, one per GPU group (an `Executor`)."""

    #: Its workers' servers start in this process's environment, so a resume whose servers
    #: would start in another is refused before a worker opens a GPU (`run_fleet`); a Ray
    #: worker's environment is its node's, compared once its session opens.
    shares_environment = True

    def __init__(
        self,
        out_dir: Path,
        *,
        state_dir: Path | None = None,
        nvml: ModuleType | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.state_dir = state_dir
        self.nvml = nvml
        #: What each worker's close raised (a restore of its GPUs that NVML refused, or whose
        #: GPU was lost), by worker: the sweep's error line where a GPU was left changed.
        self.close_errors: dict[str, BaseException] = {}
        #: The GPUs left changed that the line the run failed in names (`_reset_first`).
        self._said: list[str] = []
        #: The clock the wait for workers still opening as the run fails is bounded by.
        self.clock = time.monotonic
        #: The workers still inside `open` once that wait was given up (their GPUs answer:
        #: the line naming those left changed says to reset them now, as Ray's).
        self.left_opening: list[str] = []

    def check_gpus(self, campaign: Campaign, groups: Sequence[Group]) -> None:
        """Refuse, before any worker opens its GPUs, what the workers' sessions would refuse
        only once each has timed its counters and measured its idle power: this machine's
        GPUs of a server, or of one model across the workers, at other stock power limits,
        or at other stock settings than the journals they resume were started with
        (`dvfs.preflight.check_fleet_stock`, read-only)."""
        from dvfs.preflight import check_fleet_stock

        check_fleet_stock(
            campaign, groups, nvml=self.nvml, state_dir=self.state_dir, out_dir=self.out_dir
        )

    def __call__(self, fleet: Fleet, groups: Sequence[Group]) -> None:
        campaign: Campaign = fleet.campaign
        events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        go = threading.Event()
        stop = threading.Event()
        #: Notified by the driver's thread whenever the queue or the campaign's state may have
        #: changed, for the workers that wait out of cells.
        news = threading.Condition()
        workers = [
            Worker(
                campaign,
                group,
                out_dir=self.out_dir,
                corpora=fleet.corpora,
                state_dir=self.state_dir,
                nvml=self.nvml,
                slot=slot,
            )
            for slot, group in enumerate(groups)
        ]

        from dvfs.backends import virtual_time

        paced: dict[str, VirtualPacer] = {}  # "pacer", set once the fleet is open (twin only)
        #: The workers still inside `open`: waited for, within a bound, where the run fails.
        opening = {w.label for w in workers}
        opens_due = self.clock() + OPEN_TIMEOUT_S

        def body(worker: Worker) -> None:
            unit = None  # the cells in hand: one, or an in-flight group
            pacer: VirtualPacer | None = None
            gpu_time = 0.0
            # Each note as it is made (not with the cell after it): said before what it
            # announces takes its time.
            worker.notes_live(lambda message: events.put(("note", worker.label, message)))
            try:
                try:
                    session = worker.open()
                finally:
                    opening.discard(worker.label)
                events.put(("session", worker.label, session))
                go.wait()
                pacer = paced.get("pacer")
                while not stop.is_set():
                    if pacer is not None:
                        pacer.turn(worker.label, stop)
                    unit = fleet.take(worker.label, worker.drafter)
                    if unit is None:
                        # Out of cells; wait while others still hold some: a lost worker's
                        # cell comes back to the queue for whoever is free.
                        if pacer is not None:
                            pacer.leave(worker.label)
                        with news:
                            while not (
                                fleet.done_for(worker.label)
                                or stop.is_set()
                                or fleet.has_cells(worker.label)
                            ):
                                news.wait(POLL_S)
                        if fleet.done_for(worker.label) or stop.is_set():
                            break
                        if pacer is not None:
                            pacer.free(worker.label, gpu_time)
                        continue
                    events.put(("start", worker.label, unit))
                    shipment = worker.run_unit(unit)
                    unit = None
                    events.put(("shipment", worker.label, shipment))
                    gpu_time = shipment.gpu_time_s
                    if pacer is not None:
                        pacer.free(worker.label, gpu_time)
            except BaseException as exc:  # noqa: BLE001  (reported on the driver's thread)
                events.put(("error", worker.label, exc, unit))
            finally:
                if pacer is not None:
                    pacer.leave(worker.label)
                try:
                    worker.close()
                except BaseException as exc:  # noqa: BLE001
                    self.close_errors[worker.label] = exc
                    events.put(("error", worker.label, exc, None))
                else:
                    # A failed open closed it, and that close failed: its error (the open's
                    # was raised) names why a GPU was left changed, as a close's does.
                    closing = getattr(worker, "open_close_error", None)
                    if closing is not None:
                        self.close_errors[worker.label] = closing
                events.put(("exit", worker.label))

        threads = [
            threading.Thread(target=body, args=(w,), name=f"dvfs-{w.label}", daemon=True)
            for w in workers
        ]
        for thread in threads:
            thread.start()
        try:
            labels = [w.label for w in workers]
            pacing = virtual_time(campaign)
            self._drive(fleet, events, go, labels, paced if pacing else None, news)
        except BaseException as exc:
            failed_opening = not go.is_set()
            stop.set()
            go.set()
            with news:
                news.notify_all()
            # Journal what the workers finish on their way out, then let the error go on.
            # Where the run failed as they opened (not a signal), those still opening are
            # waited for as Ray's actors are: in one note, within the opens' own bound (a
            # minute past it at least); a signal then stops the wait, and is what the run
            # ends in (130 or 143), the GPUs left changed named, as Ray's.
            due = None
            said: tuple[float, float] | None = None
            if failed_opening and not _signal(exc):
                bound = max(OPENING_GRACE_S, opens_due - self.clock())
                due = self.clock() + bound
                said = (self.clock() + min(OPENING_QUIET_S, bound), bound)
            self._drain(
                fleet, events, threads, opening=opening, due=due, clock=self.clock, said=said
            )
            self.left_opening = [w.label for w in workers if w.label in opening]
            raise

    def _drive(
        self,
        fleet: Fleet,
        events: queue.Queue[tuple[Any, ...]],
        go: threading.Event,
        labels: list[str],
        paced: dict[str, VirtualPacer] | None,
        news: threading.Condition,
    ) -> None:
        sessions: dict[str, dict[str, Any]] = {}
        alive = len(labels)
        first_error: BaseException | None = None
        errors: list[BaseException] = []
        while alive:
            event = next_event(events)
            if event is None:
                continue
            kind, label = event[0], event[1]
            if kind == "session":
                sessions[label] = event[2]
                if len(sessions) == len(labels):  # in the groups' order, whoever opened first
                    fleet.open([sessions[w] for w in labels])
                    if paced is not None:
                        paced["pacer"] = VirtualPacer(labels, fleet.lanes())
                    go.set()
            elif kind == "note":
                fleet.note(f"{label}: {event[2]}")
            elif kind == "start":
                fleet.started(label, event[2])
            elif kind == "shipment":
                fleet.shipped(label, event[2])
            elif kind == "error":
                error = event[2]
                first_error = first_error or error
                errors.append(error)
                if not go.is_set():  # a worker that cannot open stops the whole run
                    raise error
                fleet.lost(label, event[3], f"{type(error).__name__}: {error}")
            elif kind == "exit":
                alive -= 1
            with news:  # a worker waiting out of cells looks again
                news.notify_all()
        if not fleet.finished and first_error is not None:
            # A refusal a rerun would meet again (GPUs that need root, a GPU held) keeps its
            # own line and exit code; else every worker was lost: the cells left and how to
            # resume (less --fresh where the run had it), as a Ray fleet's driver says it.
            refusal = next((e for e in errors if _refusal(e)), None)
            if refusal is not None:
                raise refusal
            reset = self._reset_first(fleet.campaign)
            replaced = next((e for e in errors if isinstance(e, ServerReplacedError)), None)
            if replaced is not None and not reset:
                # An attached server replaced: its own line says what to restart (a rerun on
                # that server would meet it again), as one GPU's sweep says it.
                raise replaced
            fleet.check_finished(reset)
            raise first_error

    def _reset_first(self, campaign: Campaign) -> str:
        """Where the workers left GPUs' settings unrestored (a GPU lost before it could be
        put back): those GPUs and the `dvfs gpu reset` that reads their state files, to run
        before the run resumes; "" where none was left (or on the twin)."""
        from dvfs.backends import real_gpus

        if not real_gpus(campaign):
            return ""
        from dvfs.gpu.safety import StateStore

        store = StateStore(self.state_dir)
        kept = [p.original.uuid for p in store.pending() if p.pid == os.getpid()]
        if not kept:
            return ""
        self._said = kept
        # Their count where several (the line names each worker's GPU already, and must
        # stay within an error line's bound with the reset and the resume in it).
        whose = kept[0] if len(kept) == 1 else f"{len(kept)} GPUs"
        they = "it answers" if len(kept) == 1 else "they answer"
        root, bug, lost = self._restores_refused(kept)
        if root or bug:  # not (only) GPUs lost: "once it answers again" waited for nothing
            why = ["for want of root"] if root else []
            if bug:
                why.append("a bug in dvfs stopped the restore, said above: please report it")
            when = f"once {they} again, " if lost else ""
            return (
                f"the settings of {whose} could not be restored ({'; '.join(why)}): {when}run "
                f"{store.reset_command()}{' as root' if root else ''}"
            )
        return (
            f"the settings of {whose} could not be restored: once {they} again, run "
            f"{store.reset_command()}"
        )

    def _restores_refused(self, kept: Sequence[str]) -> tuple[bool, bool, bool]:
        """Whether the workers' restores that left `kept` changed were refused for want of
        root, whether one stopped on a bug in dvfs (their lines name the GPUs), and whether
        a GPU of `kept` neither names was lost (reset once it answers again)."""
        from dvfs.errors import GpuPermissionError
        from dvfs.gpu.knobs import RestoreBugError

        def is_root(e: BaseException) -> bool:
            return isinstance(e, GpuPermissionError) or bool(getattr(e, "needs_root", False))

        errors = [
            e for e in self.close_errors.values() if is_root(e) or isinstance(e, RestoreBugError)
        ]
        errors = [e for e in errors if any(u in str(e) for u in kept)]
        lost = any(not any(u in str(e) for e in errors) for u in kept)
        bug = any(isinstance(e, RestoreBugError) for e in errors)
        return any(is_root(e) for e in errors), bug, lost

    def unsaid(self, campaign: Campaign) -> tuple[list[str], Path | None]:
        """The GPUs this process left changed (their state files kept) that no line of the run
        named, with their state folder: those the workers' closes left changed where the run
        failed in a worker's own line (a refusal, one that could not open); the sweep names
        them beside it. None on the twin."""
        from dvfs.backends import real_gpus

        if not real_gpus(campaign):
            return [], None
        from dvfs.gpu.safety import StateStore

        store = StateStore(self.state_dir)
        kept = [uuid for uuid in store.left_by_this_process() if uuid not in self._said]
        return kept, store.directory

    @staticmethod
    def _drain(
        fleet: Fleet,
        events: queue.Queue[tuple[Any, ...]],
        threads: list[threading.Thread],
        *,
        opening: set[str] | frozenset[str] = frozenset(),
        due: float | None = None,
        clock: Any = time.monotonic,
        said: tuple[float, float] | None = None,
    ) -> None:
        """Journal what the workers (`threads`) finish on their way out, until each has
        closed; past `due` (of `clock`), those still inside `open` (`opening`) are no longer
        waited for (the run fails in its line; their GPUs kept in their state files). `said`:
        (when, bound): from `when` on, while some are still opening, the wait's one note."""

        def label(thread: threading.Thread) -> str:
            return thread.name[len("dvfs-") :]

        def waited(thread: threading.Thread) -> bool:
            if not thread.is_alive():
                return False
            return due is None or clock() < due or label(thread) not in opening

        def say_the_wait() -> None:
            nonlocal said
            if said is not None and clock() >= said[0]:
                still = [t for t in threads if t.is_alive() and label(t) in opening]
                if still:
                    fleet.note(opening_wait_note("workers", said[1], len(still)))
                said = None

        while any(waited(t) for t in threads) or not events.empty():
            say_the_wait()
            event = next_event(events)
            if event is None:
                continue
            if event[0] == "shipment":
                fleet.shipped(event[1], event[2])
            elif event[0] == "note":
                fleet.note(f"{event[1]}: {event[2]}")
        say_the_wait()  # a wait given up past its quiet time (a clock that jumped) says it


def next_event(events: queue.Queue[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    """The workers' next event, None after POLL_S without one; a signal that lands as the
    queue takes its lock back is the interruption (`lock_left_unheld_is_the_interruption`),
    not an internal error, exit 1, as it was."""
    from dvfs.signals import lock_left_unheld_is_the_interruption

    try:
        with lock_left_unheld_is_the_interruption():
            return events.get(timeout=POLL_S)
    except queue.Empty:
        return None


def _signal(error: BaseException) -> bool:
    """Whether `error` is a signal's (Ctrl-C, SIGTERM), not the run's failure."""
    from dvfs.signals import Interrupted

    return isinstance(error, KeyboardInterrupt | Interrupted)


def _refusal(error: BaseException) -> bool:
    """Whether a worker's error refuses the run (a dvfs error of an exit code other than 1:
    permission, a GPU held, a campaign the engine refuses), which a rerun would meet again,
    rather than a worker lost (a GPU fallen off the bus, a server that died)."""
    from dvfs.errors import DvfsError

    return isinstance(error, DvfsError) and error.exit_code != 1
