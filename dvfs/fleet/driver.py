"""The driver of a campaign on many GPU groups: its journals, written as the cells arrive.

`run_fleet` holds the output folder's lock and plans the cells (a shard's, when sharded). An
executor (`local.py`: threads of this process; `ray_executor.py`: Ray actors) opens one
`Worker` per GPU group and calls back here. `Fleet.open` takes every worker's session: the
workers of one GPU model share a `Driver`, that is a journal, one session over all their GPUs
and a `CellQueue` of the unfinished cells, which gives each comparison group (the cells of one
batch, corpus and repeat) to one worker whole, so that the arms of a comparison share a GPU.
One model journals in the folder itself; a fleet mixing models measures the campaign once per
model, each in `gpu-<model>/`, and the cube merges them along a `gpu` dimension. Each finished
cell is journalled as it arrives (`shipped`), so the journals alone resume the campaign, on
these GPUs or on any others of the same model and driver (`dvfs.records.incomparable`: fewer
after a node loss); a lost worker's groups go back to its queue (`lost`). Only the driver's
thread writes.

A worker is handed units of work: one cell, or in in-flight mode one group of knob levels
measured inside shared decodes. With `max_repeats` above `repeats` the driver decides the
further repeats from its journal once the planned cells are in (`extra_repeats`), as one
runner does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dvfs.campaign import Campaign
from dvfs.errors import (
    MAX_MESSAGE_CHARS,
    CampaignError,
    EngineError,
    JournalError,
    OutputRefusedError,
    unfit_fix,
)
from dvfs.fleet.cubes import write_cubes
from dvfs.fleet.devices import Group, group_label, one_model
from dvfs.fleet.folders import (
    extra_repeats,
    journals_done,
    model_journals,
    other_gpus,
    stock_changed,
)
from dvfs.fleet.queue import CellQueue
from dvfs.fleet.refusal import server_refusal
from dvfs.fleet.shard import Shard, planned_cells
from dvfs.fleet.shard_journal import (
    check_shard,
    folder_journals,
    has_sessions,
    model_folder_journals,
)
from dvfs.fleet.worker import Shipment
from dvfs.measure.journal import Journal, check_journal_link, resume_advice
from dvfs.measure.plan import Cell, cell_label
from dvfs.measure.runner import Progress, RunSummary, grow, journaled_repeats

#: A unit of work handed to one worker: a cell, or an in-flight group's cells (its knob
#: levels, measured inside shared decodes).
Unit = tuple[Cell, ...]


def as_unit(unit: Unit | Cell) -> Unit:
    return unit if isinstance(unit, tuple) else (unit,)


def unit_label(unit: Unit | Cell) -> str:
    """A unit as progress names it: its cell, or its group and how many levels it steps."""
    cells = as_unit(unit)
    if len(cells) == 1:
        return cell_label(cells[0])
    c = cells[0]
    return f"{c.drafter}/{c.corpus}/b{c.batch}/r{c.repeat} in flight, {len(cells)} levels"


@dataclass
class WorkerStats:
    """One worker as progress shows it."""

    label: str
    host: str = ""
    done: int = 0
    failed: int = 0
    current: str = ""
    gpu_time_s: float = 0.0
    busy_wall_s: float = 0.0
    lost: str | None = None
    #: Its `lost` is a refusal of its server (the driver retired it), not a loss.
    refused: bool = False
    _since: float = field(default=0.0, repr=False)

    @property
    def gone(self) -> str:
        """How it left the fleet, as its `lost` is said: lost, or retired for its server."""
        return "retired, its server refused" if self.refused else "lost"

    def eta_s(self, remaining_per_worker: float) -> float | None:
        """Wall seconds this worker needs for its share of what is left, at its pace."""
        if not self.done:
            return None
        return remaining_per_worker * self.busy_wall_s / self.done


class FleetProgress(Progress, Protocol):
    """Progress for many workers: the whole campaign (as `Progress`), and each worker."""

    def worker(self, stats: WorkerStats, eta_s: float | None) -> None: ...


@dataclass(frozen=True)
class FleetOutcome:
    summary: RunSummary
    #: The folder of the journal(s): `journal.jsonl`, or `gpu-<model>/journal.jsonl` each.
    journal_path: Path
    cube_path: Path | None
    moved_journal: Path | None
    workers: tuple[WorkerStats, ...]
    wall_s: float
    #: The cube written to `cube_path`, in memory (the report reads it there).
    cube: Any = None

    @property
    def makespan_gpu_s(self) -> float:
        """The campaign's length in GPU time: its slowest worker's (virtual on the twin)."""
        return max((w.gpu_time_s for w in self.workers), default=0.0)


#: What each worker's session adds to the fleet session's `workers` entry for it.
WORKER_KEYS = (
    "idle_power_w",
    "idle_foreign_processes",
    "idle_from_power_readings",
    "settle",
    "gpu_time_s",
    "ports",
)


def combine_sessions(sessions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The sessions of one model's workers as its journal's one session: every GPU, the mean
    idle power of a group, and each worker's own part. Refuses workers whose GPUs differ in
    stock settings: their cells would not compare within one cube."""
    from dvfs.records import incomparable, only_env_changed
    from dvfs.records.session import found_limits

    first = sessions[0]
    for s in sessions[1:]:
        changes = incomparable(first, s)
        if only_env_changed(changes):
            raise JournalError(
                f"worker {s.get('worker')} on {s.get('host') or 'this node'} would start its "
                f"SGLang servers with another environment than worker {first.get('worker')} "
                f"on {first.get('host') or 'this node'} ({'; '.join(changes)}): their arms "
                "would be served differently; give every worker the same values "
                "(engine.sglang.env sets them for all), or leave one of them out (--gpus, or "
                "the Ray cluster's nodes)"
            )
        if changes:
            raise JournalError(
                f"worker {s.get('worker')} on {s.get('host') or 'this node'} differs from worker "
                f"{first.get('worker')} on {first.get('host') or 'this node'} in what makes "
                f"cells compare ({'; '.join(changes)}): their cells cannot share one journal; "
                "leave one of them out (--gpus, or the Ray cluster's nodes), or run them into "
                "separate --out folders and `dvfs cube merge` the cubes"
            )
        if s["stock"] != first["stock"]:
            raise JournalError(
                f"worker {s.get('worker')}'s GPUs start from other stock settings "
                f"({s['stock']}) than worker {first.get('worker')}'s ({first['stock']}): "
                "their stock cells would not compare; give them one power limit (`dvfs gpu "
                "reset --defaults` sets the default) or leave them out of --gpus"
            )
    combined = {k: v for k, v in first.items() if k != "worker"}
    idle = [float(s["idle_power_w"]) for s in sessions]
    combined.update(
        gpus=[g for s in sessions for g in s["gpus"]],
        idle_power_w=sum(idle) / len(idle),
        host=", ".join(dict.fromkeys(str(s.get("host", "")) for s in sessions)),
        workers=[
            {
                "worker": s.get("worker"),
                "host": s.get("host", ""),
                "gpus": [g["uuid"] for g in s["gpus"]],
                **{k: s[k] for k in WORKER_KEYS if k in s},
            }
            for s in sessions
        ],
    )
    # The power caps dvfs applied that the workers found at start and lifted to measure
    # stock: each worker's GPUs' own (by UUID), not the first worker's alone.
    combined.pop("power_limit_found_w", None)
    lifted = {
        uuid: watts
        for s in sessions
        for uuid, watts in found_limits(s.get("power_limit_found_w")).items()
    }
    if lifted:
        combined["power_limit_found_w"] = lifted
    # The GPUs whose stock power limit is the one enforced (NVML does not support theirs):
    # each worker's, not the first worker's alone.
    combined.pop("stock_power_limit_enforced", None)
    enforced = [u for s in sessions for u in s.get("stock_power_limit_enforced") or ()]
    if enforced:
        combined["stock_power_limit_enforced"] = list(dict.fromkeys(enforced))
    # Each worker's tenants seen around its opening idle measurement (GPU indexes its node's).
    combined.pop("idle_foreign_processes", None)
    foreign = [p for s in sessions for p in s.get("idle_foreign_processes") or ()]
    if foreign:
        combined["idle_foreign_processes"] = foreign
    # A worker's opening idle from the instant power readings: the mean idle counts it.
    combined.pop("idle_from_power_readings", None)
    if any(s.get("idle_from_power_readings") for s in sessions):
        combined["idle_from_power_readings"] = True
    if "counter_update_period_s" in first:  # per GPU: in the order of `gpus`
        combined["counter_update_period_s"] = [
            p
            for s in sessions
            for p in (s.get("counter_update_period_s") or [None] * len(s["gpus"]))
        ]
    if isinstance(first.get("gpu_time_s"), dict):  # the GPU time all the workers spent
        keys = dict.fromkeys(k for s in sessions for k in (s.get("gpu_time_s") or {}))
        combined["gpu_time_s"] = {
            k: sum(float((s.get("gpu_time_s") or {}).get(k, 0.0)) for s in sessions) for k in keys
        }
    return combined


def bounded_why(why: str, chars: int = 200) -> str:
    """A lost worker's error for the line that names three of them (and for a Ray worker's
    loss as it comes): without its last full stop (clauses follow it), and cut short where
    long, at a word and marked "…", so the line keeps, within an error line's bound, the
    reset and the resume that end it."""
    why = why.rstrip(".")
    if len(why) <= chars:
        return why
    cut = why[: chars - 1]
    if not why[chars - 1].isspace() and " " in cut.strip():
        cut = cut.rsplit(" ", 1)[0]  # the word it fell in left out whole
    return cut.rstrip(" ,;:") + "…"


def every_worker_lost(
    head: str,
    stats: Iterable[WorkerStats],
    fresh: bool = False,
    reset: str = "",
    kept: str = "the journal keeps",
) -> str:
    """The line of a fleet whose workers (`stats`) were all lost with cells left (`head` says
    how many): each named with what lost it (three, and how many more), then where the
    finished cells are (`kept`: the journal, or a fleet mixing models' journals), the reset
    to run first where they left GPUs' settings unrestored (`reset`), then how to resume
    (less --fresh where the run had it: `fresh`)."""
    lost = [f"{s.label}: {bounded_why(s.lost)}" for s in stats if s.lost]
    tail = (
        f": {kept} every finished cell; "
        + (f"{reset}, then " if reset else "")
        + resume_advice(fresh)
    )
    # The losses named give way to the reset and the resume, which end the line whole
    # within an error line's bound (Ray's labels and resets name each node).
    room = MAX_MESSAGE_CHARS - len(head) - len(tail) - len(" ()")
    named = ""
    for shown in range(min(3, len(lost)), 0, -1):
        more = len(lost) - shown
        named = "; ".join(lost[:shown]) + (f"; and {more} more" if more else "")
        if len(named) <= room:
            break
    if len(named) > room:
        named = named[: room - 3] + "..." if room > 3 else ""
    return head + (f" ({named})" if named else "") + tail


class Driver:
    """The executors' callbacks: journal, queue and progress, all on the driver's thread."""

    def __init__(
        self,
        campaign: Campaign,
        journal: Journal,
        cells: Sequence[Cell],
        progress: Progress | None = None,
        corpora: tuple[dict[str, Any], str] | None = None,
    ) -> None:
        from dvfs.measure.runner import NullProgress

        self.campaign = campaign
        self.journal = journal
        #: The corpora, loaded and counted once (local workers share them).
        self.corpora = corpora
        from dvfs.measure.inflight import whole_groups_done

        # An in-flight group the journal holds only part of is measured whole again.
        done = whole_groups_done(campaign.measurement.mode, cells, journal.finished())
        self.cells = list(cells)
        # (and an added repeat's group journaled in part: `next_repeats` asks for it whole)
        done -= {c.key for c in self._more_repeats(set())}
        self.todo = [c for c in cells if c.key not in done]
        # The extra repeats an earlier run journalled count as done, as the planned ones do.
        self.total = len(cells) + len(journaled_repeats(campaign.measurement, cells, done))
        if not self.todo:  # the planned repeats are in: those the precision still asks for
            self.todo = self._more_repeats(done)
            self.total += len(self.todo)
        #: Each unit of work by its first cell's key: a cell, or an in-flight group's cells
        #: (measured together, so handed to one worker whole).
        self.units: dict[str, Unit] = {}
        self.queue = CellQueue(self._register(self.todo))
        self.progress: Progress = progress or NullProgress()
        self.stats: dict[str, WorkerStats] = {}
        self.measured = 0
        self.failed: list[str] = []
        #: Of those, each one SGLang would not start the server of for the campaign as it is
        #: (`unfit_fix`, which a rerun fails again): its drafter and what to change.
        self.unfit: list[tuple[str, str]] = []
        self._outstanding = {c.key for c in self.todo}
        #: Each drafter's first server in the journal: every later one must match it
        #: (`SERVER_INVARIANTS`), else the worker is retired and its unit is not journalled.
        self.servers: dict[str, dict[str, Any]] = {}
        if journal.path.is_file():
            from dvfs.measure.journal import iter_records

            for record in iter_records(journal.path):
                if record.get("type") == "server":
                    self.servers.setdefault(str(record.get("drafter")), record)
        self.retired: set[str] = set()
        #: Why the run cannot finish here (a server that does not compare), for the one line.
        self.refused: str | None = None
        #: That refusal said again within fewer characters (room for the reset after it).
        self._refused_in: Callable[[int], str | None] | None = None

    @property
    def finished(self) -> bool:
        return not self._outstanding

    def note(self, message: str) -> None:
        self.progress.note(message)

    def open_session(self, sessions: Sequence[dict[str, Any]]) -> None:
        """Journal one session over every worker's GPUs. The journal's earlier sessions may
        have run on other GPUs (more, fewer, other nodes: a rerun after a node loss), but of
        the same model, driver and settings (`incomparable`): their finished cells stand."""
        from dvfs.records import (
            SERVER_ENV_ADVICE,
            incomparable,
            only_env_changed,
            recorded_stock,
        )

        combined = combine_sessions(sessions)
        combined["journal_sync"] = self.journal.sync_policy.describe()  # the driver's, not theirs
        current = [g["uuid"] for g in combined["gpus"]]
        for earlier in self.journal.sessions:
            changes = incomparable(earlier, combined)
            if only_env_changed(changes):
                raise JournalError(
                    f"this run's SGLang servers would start with another environment than "
                    f"those of {self.journal.path} ({'; '.join(changes)}): its cells would not "
                    f"compare with this run's; {SERVER_ENV_ADVICE}"
                )
            if changes:
                raise JournalError(other_gpus(self.journal.path, changes))
        refusal = stock_changed(self.journal.path, self.journal.sessions, recorded_stock(combined))
        if refusal is not None:
            raise refusal
        if self.journal.sessions:
            before = [g["uuid"] for g in self.journal.sessions[-1]["gpus"]]
            if before != current:
                self.note(
                    f"resuming a {len(before)}-GPU run on {len(current)} GPU(s) of the same "
                    f"model and driver: its {self.total - len(self.todo)} finished cell(s) "
                    "stand, the rest run here"
                )
        # The queue gives each comparison group (batch, corpus, repeat) to one worker: its
        # arms ran on one GPU group (`dvfs.fleet.queue`); the cube says so.
        combined["arms_on_one_gpu"] = 1
        # Journalled with the run's first records (`Journal.defer`): a run that journals
        # nothing (its workers retired for their refused servers, or lost, before any unit
        # came in) leaves the journal as it found it, as a run refused before its workers
        # open does.
        self.journal.defer(combined)
        workers = [str(s.get("worker")) for s in sessions]
        self.queue.keep(self._begun_on(sessions), workers)
        self.queue.join(workers)
        for s in sessions:
            label = str(s.get("worker"))
            self.stats[label] = WorkerStats(label, host=str(s.get("host", "")))

    def _begun_on(self, sessions: Sequence[dict[str, Any]]) -> dict[tuple[int, str, int], str]:
        """The comparison groups left to run that the journal's finished cells began, each
        with this run's worker on the GPUs that began it (`CellQueue.keep`); a group begun on
        GPUs not in this run (a node lost) is dealt as any other."""
        from dvfs.fleet.queue import group_of
        from dvfs.measure.journal import iter_records

        left = {group_of(c) for c in self.todo}
        if not left or not self.journal.path.is_file():
            return {}
        workers = {
            tuple(str(g.get("uuid")) for g in s.get("gpus", ())): str(s.get("worker"))
            for s in sessions
        }
        done = self.journal.finished()
        begun: dict[tuple[int, str, int], str] = {}
        for record in iter_records(self.journal.path):
            if record.get("type") != "cell" or record.get("key") not in done:
                continue
            cell = record.get("cell") or {}
            try:
                group = (int(cell["batch"]), str(cell["corpus"]), int(cell["repeat"]))
            except (KeyError, TypeError, ValueError):
                continue
            worker = workers.get(tuple(str(u) for u in record.get("gpus") or ()))
            if group in left and worker is not None:
                begun.setdefault(group, worker)
        return begun

    def _register(self, cells: Sequence[Cell]) -> list[Cell]:
        """Cut `cells` into units of work (in-flight groups, as one runner cuts them, or single
        cells) and keep them; each unit's first cell, which the queue hands out."""
        if self.campaign.measurement.mode == "in-flight":
            from dvfs.measure.inflight import inflight_groups

            units = inflight_groups(cells)
        else:
            units = [(cell,) for cell in cells]
        self.units.update((unit[0].key, unit) for unit in units)
        return [unit[0] for unit in units]

    def unit(self, lead: Cell) -> Unit:
        """The unit of work a cell from the queue stands for."""
        return self.units.get(lead.key, (lead,))

    def started(self, worker: str, unit: Unit | Cell) -> None:
        stats = self.stats.setdefault(worker, WorkerStats(worker))
        stats.current = unit_label(unit)
        stats._since = time.monotonic()
        self._show(stats)

    def _refuse_servers(self, worker: str, shipment: Shipment) -> bool:
        """Whether the unit's server differs from the journal's for its drafter (another
        engine version or attention kernel); if so the worker is retired, nothing of the unit
        is journalled and the unit goes back to the queue."""
        from dvfs.records import Header

        if worker in self.retired:  # a unit it took before the driver retired it
            cells = shipment.all_cells
            if any(cell.key in self._outstanding for cell in cells):
                self.queue.give_back([cells[0]])
            return True
        pinned = Header.from_json(self.journal.header).arms_pinned
        for record in shipment.records:
            if record.get("type") != "server":
                continue
            why = server_refusal(
                self.campaign, self.journal.path, self.servers, record, pinned, worker
            )
            if why is not None:
                if self.refused is None:
                    self.refused = why
                    self._refused_in = functools.partial(
                        server_refusal,
                        self.campaign,
                        self.journal.path,
                        dict(self.servers),
                        record,
                        pinned,
                        worker,
                    )
                self.retired.add(worker)
                self.lost(worker, shipment.all_cells, why, refused=True)
                return True
            self.servers.setdefault(str(record.get("drafter")), record)
        return False

    def shipped(self, worker: str, shipment: Shipment) -> None:
        """Journal a finished unit's records at once, then count its cells."""
        # What the worker said as it ran the unit (a Ray worker's notes come with it: "starting
        # ... server"), also for a unit refused for its server: said before the refusal.
        for message in shipment.notes:
            self.note(f"{worker}: {message}")
        if self._refuse_servers(worker, shipment):
            return
        # In one write: an in-flight group's levels are journaled all or none.
        self.journal.append_all(shipment.records)
        stats = self.stats.setdefault(worker, WorkerStats(worker))
        cells = shipment.all_cells
        stats.done += len(cells)
        stats.gpu_time_s = shipment.gpu_time_s
        if stats._since:
            stats.busy_wall_s += time.monotonic() - stats._since
        stats.current = ""
        keys = {cell.key for cell in cells}
        if self._outstanding and self._outstanding <= keys:  # the last: more repeats?
            self._add(self._more_repeats(set()))
        statuses = {
            str(r.get("key")): str(r.get("status", "failed"))
            for r in shipment.records
            if r.get("type") == "cell"
        }
        errors = {
            str(r.get("key")): str(r.get("error") or "")
            for r in shipment.records
            if r.get("type") == "cell"
        }
        for cell in cells:
            self._outstanding.discard(cell.key)
            status = statuses.get(cell.key, "failed")
            if status == "ok":
                self.measured += 1
            else:
                stats.failed += 1
                self.failed.append(cell_label(cell))
                fix = unfit_fix(errors.get(cell.key, ""))
                if fix is not None:
                    self.unfit.append((cell.drafter, fix))
            self.progress.advance(cell, status)
        self._show(stats)

    def _more_repeats(self, done: set[str]) -> list[Cell]:
        """The next repeats the journal's cells ask for (`extra_repeats`), none in `done`
        (a partly journaled in-flight group's levels are not: `next_repeats` asks for it
        whole)."""
        if self.campaign.measurement.max_repeats <= self.campaign.measurement.repeats:
            return []
        self.journal.sync()
        more = extra_repeats(self.campaign, self.journal.path, self.cells)
        return [c for c in more if c.key not in done]

    def _add(self, cells: Sequence[Cell]) -> None:
        """More cells for the workers (before the last outstanding one is counted done, so no
        worker sees the campaign finished in between)."""
        if not cells:
            return
        self.note(
            f"{len(cells)} cell(s) need another repeat to reach "
            f"±{self.campaign.measurement.precision:.1%}"
        )
        grow(self.progress, len(cells))
        self.total += len(cells)
        self.todo.extend(cells)
        self._outstanding.update(c.key for c in cells)
        self.queue.give_back(self._register(cells))

    def lost(
        self, worker: str, unit: Unit | Cell | None, why: str, *, refused: bool = False
    ) -> None:
        """A worker died (`refused`: was retired, its server refused): its unfinished unit
        goes back to the queue for the others, where any is left."""
        stats = self.stats.setdefault(worker, WorkerStats(worker))
        again = stats.lost is not None
        # What lost it (its GPU fallen off the bus), not what failed after (the restore of
        # that GPU as the worker closed), which is said as it comes.
        if not stats.lost:
            stats.lost, stats.refused = why, refused
        stats.current = ""
        cells = as_unit(unit) if unit is not None else ()
        if any(cell.key in self._outstanding for cell in cells):
            self.queue.give_back([cells[0]])
        self.queue.leave(worker)
        if again:
            self.note(f"worker {worker}, {stats.gone}, then: {why}")
        elif not self.queue.live():  # the run stops, in a line that says why (`check_finished`)
            what = "retired, its server refused" if refused else f"lost ({why})"
            self.note(f"worker {worker} {what}: no other worker is left to measure its cells")
        else:
            what = f"retired, its server refused ({why})" if refused else f"lost ({why})"
            self.note(
                f"worker {worker} {what}; its unfinished cells go to the others, a comparison "
                "group at a time"
            )
        self._show(stats)

    def _show(self, stats: WorkerStats) -> None:
        show = getattr(self.progress, "worker", None)
        if show is None:
            return
        alive = sum(1 for s in self.stats.values() if s.lost is None) or 1
        show(stats, stats.eta_s(len(self._outstanding) / alive))

    def check_finished(self, fresh: bool = False, reset: str = "", model: str = "") -> None:
        """After the executor returns: cells left over mean every worker was lost, each named
        with what lost it (three, and how many more). `fresh`: the run was started with
        --fresh, which its command again would start over. `reset`: what to run first, where
        the workers left GPUs' settings unrestored (their GPUs lost). `model`: this driver's
        GPU model, in a fleet mixing models (whose other models' workers may have finished)."""
        if self.finished:
            return
        if self.refused is not None:
            raise JournalError(self._refusal_line(reset))
        left = len(self._outstanding)
        head = (
            f"every worker on the {model} GPUs was lost with {left} cell(s) of that model left"
            if model
            else f"every worker was lost with {left} cell(s) left"
        )
        # a fleet mixing models: this model's cells are in its own journal (gpu-<model>/), the
        # folder holding none of its own
        kept = f"its journal {self.journal.path} keeps" if model else "the journal keeps"
        raise JournalError(every_worker_lost(head, self.stats.values(), fresh, reset, kept))

    @property
    def left(self) -> int:
        """How many cells are not finished."""
        return len(self._outstanding)

    def _refusal_line(self, reset: str) -> str:
        """The refusal's line, and where workers lost GPUs with their settings unrestored
        (`reset`), the reset to run first, after it: the changes it names give way to the
        remedy and the reset, which end the line whole."""
        refused = str(self.refused)
        if not reset:
            return refused
        first = f"; and {reset} first"
        room = MAX_MESSAGE_CHARS - len(first)
        if len(refused) > room and self._refused_in is not None:
            refused = self._refused_in(room) or refused
        if len(refused) > room:
            refused = refused[: room - 3] + "..."
        return refused + first

    def summary(self) -> RunSummary:
        return RunSummary(
            self.total,
            self.total - len(self.todo),
            self.measured,
            len(self.failed),
            tuple(self.failed),
            unfit=len(self.unfit),
            unfit_drafters=tuple(dict.fromkeys(d for d, _ in self.unfit)),
            unfit_fixes=tuple(dict.fromkeys(f for _, f in self.unfit)),
        )


class Fleet:
    """What the executors call: the workers' sessions open one `Driver` per GPU model (its
    journal, queue and session), and each worker's calls go to its model's driver."""

    def __init__(
        self,
        campaign: Campaign,
        out_dir: Path,
        cells: Sequence[Cell],
        journals: contextlib.ExitStack,
        *,
        shard: Shard | None = None,
        progress: Progress | None = None,
        corpora: tuple[dict[str, Any], str] | None = None,
        fresh: bool = False,
    ) -> None:
        from dvfs.measure.runner import NullProgress

        self.campaign = campaign
        self.out_dir = out_dir
        #: The run was started with --fresh: its command again would start over.
        self.fresh = fresh
        self.cells = list(cells)
        self.journals = journals
        self.shard = shard
        self.progress: Progress = progress or NullProgress()
        #: The corpora, loaded and counted once (local workers share them).
        self.corpora = corpora
        self.drivers: dict[str, Driver] = {}  # GPU model -> its driver
        self._lanes: dict[str, Driver] = {}  # worker -> its model's driver

    def open(self, sessions: Sequence[dict[str, Any]]) -> None:
        """Every worker's session, in the workers' order: one journal per GPU model."""
        from dvfs.backends import virtual_time
        from dvfs.engines.sglang_args import ServerPorts, check_distinct_ports
        from dvfs.fleet.shard_journal import claim_shard
        from dvfs.measure.journal import SyncPolicy

        # Before any server starts: no two of one node's servers may share a port.
        check_distinct_ports(
            [
                (str(s.get("worker")), str(s.get("host", "")), ServerPorts.from_json(s["ports"]))
                for s in sessions
                if s.get("ports")
            ]
        )
        by_model: dict[str, list[dict[str, Any]]] = {}
        for session in sessions:
            gpus = [(int(g["index"]), str(g["name"])) for g in session["gpus"]]
            by_model.setdefault(one_model(str(session.get("worker")), gpus), []).append(session)
        paths = model_journals(self.out_dir, by_model)
        mixed = paths[0].parent != self.out_dir
        for model, path in zip(sorted(by_model), paths, strict=True):
            journal = self.journals.enter_context(Journal.open(path, self.campaign))
            claim_shard(journal, self.shard)
            journal.sync_policy = SyncPolicy.for_clock(virtual_time(self.campaign))
            driver = Driver(self.campaign, journal, self.cells, self.progress, self.corpora)
            driver.open_session(by_model[model])
            self.drivers[model] = driver
            for session in by_model[model]:
                self._lanes[str(session["worker"])] = driver
        if mixed:
            self.note(
                f"GPU models {', '.join(sorted(by_model))}: the campaign runs once on each, "
                f"journalled in {self.out_dir}/gpu-*/"
            )
        total = sum(d.total for d in self.drivers.values())
        todo = sum(len(d.todo) for d in self.drivers.values())
        self.progress.start(total, total - todo)

    def take(self, worker: str, drafter: str | None) -> Unit | None:
        """`worker`'s next unit of work (one cell, or an in-flight group), None when none is
        left in its model's queue."""
        driver = self._lanes[worker]
        if worker in driver.retired:
            return None
        lead = driver.queue.take(worker, drafter)
        return None if lead is None else driver.unit(lead)

    def has_cells(self, worker: str) -> bool:
        """Whether `worker`'s model's queue has cells for it now (a group of its own, one in
        the pool, or one it may steal)."""
        driver = self._lanes[worker]
        return worker not in driver.retired and driver.queue.available(worker)

    def done_for(self, worker: str) -> bool:
        """Whether `worker` has nothing more to do: its GPU model's cells are finished (a
        fleet mixing models: the others' are not its to run), or the driver retired it (its
        server does not compare with the journal's)."""
        driver = self._lanes.get(worker)
        if driver is None:
            return self.finished
        return driver.finished or worker in driver.retired

    def lanes(self) -> dict[str, object]:
        """Each worker's GPU model (its queue)."""
        return {w: id(d) for w, d in self._lanes.items()}

    def started(self, worker: str, unit: Unit | Cell) -> None:
        self._lanes[worker].started(worker, unit)

    def shipped(self, worker: str, shipment: Shipment) -> None:
        self._lanes[worker].shipped(worker, shipment)

    def lost(
        self,
        worker: str,
        cell: Unit | Cell | None,
        why: str,
        record: dict[str, Any] | None = None,
    ) -> None:
        driver = self._lanes.get(worker)
        if driver is None:  # lost before its session was in: nothing of it to undo
            self.note(f"worker {worker} lost ({why})")
            return
        if record is not None:  # with the run's session, where that is journalled
            driver.journal.follow(record)
        driver.lost(worker, cell, why)

    def note(self, message: str) -> None:
        self.progress.note(message)

    @property
    def finished(self) -> bool:
        return all(d.finished for d in self.drivers.values())

    def check_finished(self, reset: str = "") -> None:
        """Cells left over: a refusal's line first, whichever model's (a rerun meets it again,
        as within one model); else every worker was lost, of one model (named, in a fleet
        mixing models: the others' cells are in) or of several (one line over them all)."""
        left = [(model, d) for model, d in self.drivers.items() if not d.finished]
        for _model, driver in left:
            if driver.refused is not None:
                driver.check_finished(self.fresh, reset)
        if len(left) == 1:
            model, driver = left[0]
            driver.check_finished(self.fresh, reset, model if len(self.drivers) > 1 else "")
        if left:
            head = f"every worker was lost with {sum(d.left for _, d in left)} cell(s) left"
            stats = [s for _, d in left for s in d.stats.values()]
            # several models' cells, each model's in its own journal (as `open` said)
            kept = f"the journals in {self.out_dir}/gpu-*/ keep"
            raise JournalError(every_worker_lost(head, stats, self.fresh, reset, kept))

    @property
    def stats(self) -> list[WorkerStats]:
        return [w for d in self.drivers.values() for w in d.stats.values()]

    def summary(self) -> RunSummary:
        parts = [d.summary() for d in self.drivers.values()]
        return RunSummary(
            sum(p.total for p in parts),
            sum(p.skipped for p in parts),
            sum(p.measured for p in parts),
            sum(p.failed for p in parts),
            tuple(c for p in parts for c in p.failed_cells),
            unfit=sum(p.unfit for p in parts),
            unfit_drafters=tuple(dict.fromkeys(d for p in parts for d in p.unfit_drafters)),
            unfit_fixes=tuple(dict.fromkeys(f for p in parts for f in p.unfit_fixes)),
        )


def _precheck(out_dir: Path, campaign: Campaign, shard: Shard | None) -> list[str]:
    """Refuse now what `Fleet.open` would refuse once the workers are up: a journal of other
    settings, or of another shard. Returns what a resume of a journal started under another
    campaign name says (`renamed_note`), once however many GPU models' journals say it."""
    from dvfs.measure.journal import iter_records, renamed_note

    notes: list[str] = []
    from dvfs.preflight import check_inflight_resume

    for path in folder_journals(out_dir):
        # A link the sweep cannot open (in a loop, into a missing folder) is refused in the
        # sweep's words, and a journal that is no regular file (a folder, a FIFO) read, for its
        # reader to refuse, as `dvfs cube build`, the dry run and the doctor refuse them: skipped,
        # a rerun on the other models' GPUs left that model out of the merged cube, exit 0.
        check_journal_link(path)
        if not path.exists():
            continue
        first = next(iter_records(path), None)
        if first is None:
            continue
        with Journal.open(path, campaign) as journal:  # its own refusal: other settings, ...
            check_inflight_resume(journal, campaign, planned_cells(campaign, shard))
            renamed = renamed_note(journal.header, campaign)
        check_shard(path, shard)
        if renamed is not None and renamed not in notes:
            notes.append(renamed)
    return notes


#: An executor runs the fleet's queues on its workers: (fleet, groups) -> None.
Executor = Callable[["Fleet", Sequence[Group]], None]


def run_fleet(
    campaign: Campaign,
    out_dir: Path,
    groups: Sequence[Group],
    executor: Executor,
    *,
    fresh: bool = False,
    progress: Progress | None = None,
    shard: Shard | None = None,
    models: Callable[[], Sequence[str] | None] | None = None,
) -> FleetOutcome:
    """Run every unfinished cell of `campaign` (or of its `shard`) on one worker per GPU
    group, through `executor`, into the journals in `out_dir`; then write the cube (one per
    GPU model, merged along `gpu` when the fleet mixes models). `models`: the groups' GPU
    models (`dvfs.preflight.fleet_models`, or those of the GPUs Ray places the workers on:
    `RayExecutor.models`), asked for where the folder holds every cell, so that a model it
    never measured is not taken for done; it returns None where they cannot be read."""
    from dvfs.backends import check_twin_context
    from dvfs.corpora.prepare import (
        check_corpora,
        counted_corpora,
        estimate_note,
        recorded_count_method,
    )
    from dvfs.cube import write_cube
    from dvfs.heap import release_free_memory
    from dvfs.measure.inflight import whole_groups_done
    from dvfs.measure.journal import iter_records
    from dvfs.out_folder import fresh_start, out_dir_lock
    from dvfs.preflight import check_same_prompts, check_same_server_env

    labels = [group_label(g) for g in groups]
    if len(set(labels)) != len(labels):
        raise CampaignError("a GPU appears in two worker groups")
    wall0 = time.monotonic()
    with out_dir_lock(out_dir, progress, fresh=fresh) as folder:
        moved = fresh_start(out_dir, folder.moves) if fresh else None
        if moved is not None and progress is not None:
            progress.note(f"moved the previous journal to {moved}")
        # A resume chooses its prompts by the token count its journals chose them by.
        journals_here = [out_dir / "journal.jsonl", *sorted(out_dir.glob("gpu-*/journal.jsonl"))]
        recorded = recorded_count_method(journals_here)
        corpora = counted_corpora(campaign, recorded)
        check_corpora(campaign, corpora[0])  # before any GPU is touched
        check_twin_context(campaign, corpora[0])
        if getattr(executor, "shares_environment", False):  # its servers start from this Python
            from dvfs.engines.sglang_args import not_installed

            uninstalled = not_installed(campaign)  # as a single run refuses it
            if uninstalled is not None:
                raise EngineError(uninstalled)
        cells = planned_cells(campaign, shard)
        renamed = _precheck(out_dir, campaign, shard)  # before a worker opens a GPU
        if progress is not None:
            for line in renamed:  # as a single run says it, whether or not cells are left
                progress.note(line)
        fleet: Fleet | None = None
        done = journals_done(out_dir, campaign, cells)
        names = models() if done is not None and models is not None else None
        if names is not None:  # a model the folder never measured runs (or is refused) below
            done = journals_done(out_dir, campaign, cells, names)
        with contextlib.ExitStack() as journals:
            if done is None:
                # Other prompts (a corpus edited, another tokenizer revision) refused as a
                # single run refuses them, before a worker opens a GPU (`Fleet.open` would
                # say the GPUs differ, and send the run into another folder).
                for path in journals_here:
                    if path.is_file():
                        journal = Journal(path, iter_records(path))
                        check_same_prompts(journal, corpora[0], corpora[1], campaign)
                        if getattr(executor, "shares_environment", False):
                            # as a single run refuses it, before the workers probe their GPUs
                            check_same_server_env(journal, campaign)
                # GPUs whose stock the workers' sessions would refuse to pool, refused
                # before the workers open them where the executor's GPUs are this machine's.
                check_gpus = getattr(executor, "check_gpus", None)
                if check_gpus is not None:
                    check_gpus(campaign, groups)
                fleet = Fleet(
                    campaign,
                    out_dir,
                    cells,
                    journals,
                    shard=shard,
                    progress=progress,
                    corpora=corpora,
                    fresh=fresh,
                )
                executor(fleet, groups)
                # Said once the workers have run: a campaign their engine refused left none.
                note = estimate_note(campaign, corpora[1], recorded)
                if note and progress is not None:
                    progress.note(note)
                fleet.check_finished()
                done = [d.journal.path for d in fleet.drivers.values()]
                # A fleet of several models rerun on some of them (a node lost): the others'
                # journals keep their cells, and their cubes still join the merged one; one
                # that holds no session yet (its model's worker lost before its first cell),
                # or is missing from its model's folder, has every cell left, said too, and
                # no cube to join.
                others = [
                    path
                    for path in model_folder_journals(out_dir)
                    if path not in done and (path.is_file() or not os.path.lexists(path))
                ]
                for path in others:
                    finished = whole_groups_done(
                        campaign.measurement.mode,
                        cells,
                        Journal(path, iter_records(path)).finished() if path.is_file() else set(),
                    )
                    left = sum(c.key not in finished for c in cells)
                    if left and progress is not None:
                        progress.note(
                            f"{path.parent.name}: {left} cell(s) left for GPUs of that model "
                            "(none in this run); rerun with them to finish"
                        )
                done += [path for path in others if has_sessions(path)]
        written: dict[Path, Any] = {}

        def write(ds: Any, path: Path) -> Path:
            written[path] = ds
            return write_cube(ds, path)

        release_free_memory()  # what the workers' measurements left, before the cubes
        try:
            cube_path = write_cubes(out_dir, done, write=write)
        except OutputRefusedError as exc:  # a pipe no program reads from where a cube goes
            raise OutputRefusedError(
                f"{exc} (every measured cell is in the journals in {out_dir}: `dvfs cube "
                f"build {out_dir}` writes the cubes once that is fixed)"
            ) from exc
    if fleet is None:
        total = len(cells) * len(done)
        summary, stats = RunSummary(total, total, 0, 0), []
    else:
        summary, stats = fleet.summary(), fleet.stats
    journal_path = done[0] if len(done) == 1 else out_dir
    return FleetOutcome(
        summary,
        journal_path,
        cube_path,
        moved,
        tuple(stats),
        time.monotonic() - wall0,
        cube=written.get(cube_path),
    )
