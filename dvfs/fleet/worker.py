"""One worker: a GPU group's backends, knobs and server, running the units it is handed (a
cell, or an in-flight group of knob levels).

The worker opens its own GPUs (their locks and state files on real hardware, so its own exit
path restores them), its own engine (SGLang pinned to the group's UUIDs, on its own block of
loopback ports, moved to another should another program take one: `dvfs.fleet.ports`) and
clock, and drives a `Runner` whose journal ships records instead of writing them: every record
a unit produces (a server start, its cells, each stamped with the worker and its GPUs' UUIDs)
goes back to the driver, which keeps the one journal. The same class runs in a thread of the
driver and inside a Ray actor.
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dvfs.campaign import Campaign
from dvfs.corpora import Corpus
from dvfs.fleet.devices import Group, for_group, group_label
from dvfs.measure.journal import Journal
from dvfs.measure.plan import Cell

if TYPE_CHECKING:
    from dvfs.fleet.ports import PortBlock


class ShippingJournal(Journal):
    """A journal that keeps records for the driver instead of writing them: the runner's
    view of the driver's journal (its earlier sessions), plus an outbox."""

    def __init__(self, path: Path, sessions: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(path, sessions)
        self.outbox: list[dict[str, Any]] = []

    def append(self, record: dict[str, Any]) -> None:
        self.outbox.append(record)

    def append_all(self, records: Sequence[dict[str, Any]]) -> None:
        self.outbox.extend(records)

    def defer(self, record: dict[str, Any]) -> None:
        """The worker's session: for the driver at once (its journal defers it)."""
        self.outbox.append(record)

    def drain(self) -> list[dict[str, Any]]:
        out, self.outbox = self.outbox, []
        return out


class _Notes:
    """The runner's progress inside a worker: notes go back with the cell; the driver draws.
    With `live` (a worker in the driver's process), each note goes to it as it is made: a
    line that says what is about to take a while (the counters' probe, a long idle baseline,
    the thermal stabilisation) must come before it, not with the cell measured after it."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.live: Callable[[str], None] | None = None

    def start(self, total: int, done: int) -> None:
        pass

    def advance(self, cell: Cell, status: str) -> None:
        pass

    def note(self, message: str) -> None:
        if self.live is not None:
            self.live(message)
        else:
            self.messages.append(message)


@dataclass
class Shipment:
    """What a worker sends back for one cell: its records in order (a server record before
    the cell when the cell started one), notes, and the worker's GPU time so far."""

    cell: Cell
    records: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    gpu_time_s: float = 0.0
    #: Every cell of the unit it measured (an in-flight group); empty: just `cell`.
    cells: tuple[Cell, ...] = ()

    @property
    def all_cells(self) -> tuple[Cell, ...]:
        return self.cells or (self.cell,)

    @property
    def status(self) -> str:
        return str(self.records[-1].get("status", "failed")) if self.records else "failed"


class Worker:
    """Runs cells on one GPU group. `open` measures the idle baseline and returns the session
    record; `run` one cell; `close` restores the GPUs and stops the server."""

    def __init__(
        self,
        campaign: Campaign,
        group: Group,
        *,
        out_dir: Path,
        sessions: Sequence[dict[str, Any]] = (),
        corpora: tuple[dict[str, Corpus], str] | None = None,
        state_dir: Path | None = None,
        nvml: ModuleType | None = None,
        label: str | None = None,
        slot: int = 0,
    ) -> None:
        self.campaign = for_group(campaign, group)
        self.group = tuple(group)
        self.label = label or group_label(self.group)
        self.out_dir = out_dir
        self.sessions = tuple(sessions)
        self.corpora = corpora
        self.state_dir = state_dir
        self.nvml = nvml
        self.host = platform.node()
        self._stack = contextlib.ExitStack()
        self._notes = _Notes()
        self._runner: Any = None
        self._journal: ShippingJournal | None = None
        self._clock: Any = None
        self._t0_ns = 0
        self._drafter: str | None = None
        self._uuids: list[str] = []
        #: The worker's number in its fleet: where its search for a block of ports starts.
        self.slot = slot
        #: Its block of ports, when the engine starts servers of its own.
        self._block: PortBlock | None = None
        #: What the close an open that failed ran raised (a restore of what the open set,
        #: refused): the open's error is the one raised, what stopped the worker; this is
        #: kept for the executor, which says it with the GPUs left changed.
        self.open_close_error: BaseException | None = None

    def open(self) -> dict[str, Any]:
        """Open the group's backends and knobs, measure idle power; the session record (its
        GPUs, stock settings, idle power) for the driver."""
        from dvfs.backends import open_backends
        from dvfs.corpora.prepare import counted_corpora
        from dvfs.measure.journal import JOURNAL_NAME
        from dvfs.measure.runner import Runner
        from dvfs.sweep import guarded_knobs

        try:
            corpora, method = self.corpora or counted_corpora(self.campaign)
            logs = self.out_dir / "workers" / self.label
            self._claim_ports()  # before the engine: released after its server has stopped
            b = self._stack.enter_context(
                open_backends(self.campaign, out_dir=logs, nvml=self.nvml)
            )
            knobs = self._stack.enter_context(
                guarded_knobs(self.campaign, b.gpus, state_dir=self.state_dir)
            )
            if self._block is not None and hasattr(b.engine, "block"):
                b.engine.block = self._block
            self._journal = ShippingJournal(self.out_dir / JOURNAL_NAME, self.sessions)
            self._clock = b.clock
            self._t0_ns = b.clock.now_ns()
            self._runner = Runner(
                self.campaign,
                gpus=b.gpus,
                engine=b.engine,
                clock=b.clock,
                journal=self._journal,
                knobs=knobs,
                corpora=corpora,
                progress=self._notes,
                token_count_method=method,
            )
            self._runner.open_session()
        except BaseException:
            # The open's error goes on, not the close's after it (which replaced it: the
            # run's line said a restore, not what stopped the worker); that is kept.
            try:
                self.close()
            except BaseException as closing:  # noqa: BLE001
                self.open_close_error = closing
            raise
        session = self._journal.drain()[0]
        session["worker"] = self.label
        self._uuids = [str(g["uuid"]) for g in session["gpus"]]
        if self._block is not None:  # the block it starts on; each server record, its own
            session["ports"] = self._block.ports.to_json()
        return session

    def _claim_ports(self) -> None:
        """For an engine that starts its own servers (SGLang, not attached to a URL): a block
        of ports no other worker on this node holds (`dvfs.fleet.ports`), for the worker's
        life (or another, should another program take one of its ports: said in a note); its
        slot in the fleet is where the search starts."""
        from dvfs.fleet.ports import PortBlock

        sglang = self.campaign.engine.sglang
        if self.campaign.engine.backend != "sglang" or sglang.url:
            return
        self._block = self._stack.enter_context(
            PortBlock(sglang.host, self.slot, note=self._notes.note)
        )

    def notes_live(self, sink: Callable[[str], None]) -> None:
        """Send each note to `sink` as it is made instead of with the next shipment."""
        self._notes.live = sink

    def gpu_time_s(self) -> float:
        """Seconds of the group's time (virtual on the twin) since `open`."""
        return 0.0 if self._clock is None else (self._clock.now_ns() - self._t0_ns) * 1e-9

    def run_unit(self, unit: Sequence[Cell]) -> Shipment:
        """Measure a unit of work: an in-flight group's levels inside shared decodes (as one
        runner steps them), else its one cell."""
        if self.campaign.measurement.mode != "in-flight":
            return self.run(unit[0])
        assert self._runner is not None, "open() first"
        self._runner.run_inflight_group(tuple(unit))
        self._drafter = unit[0].drafter
        return self._ship(unit[0], tuple(unit))

    def run(self, cell: Cell) -> Shipment:
        """Measure one cell (starting the drafter's server when it changes)."""
        assert self._runner is not None, "open() first"
        self._runner.run_cell(cell)
        self._drafter = cell.drafter
        return self._ship(cell)

    def _ship(self, cell: Cell, cells: tuple[Cell, ...] = ()) -> Shipment:
        """What the runner journalled since the last shipment, stamped with this worker."""
        assert self._journal is not None
        notes, self._notes.messages = self._notes.messages, []
        records = self._journal.drain()
        for record in records:
            record["worker"] = self.label
            record["gpus"] = list(self._uuids)  # the cube's `measured_on`
            if record.get("type") == "server" and self._block is not None:
                from dvfs.engines.sglang_args import ServerPorts, check_ports_resolved

                ports = ServerPorts.from_json(record.get("ports") or self._block.ports.to_json())
                check_ports_resolved(str(record["drafter"]), record.get("args") or {}, ports)
        return Shipment(cell, records, notes, self.gpu_time_s(), cells)

    @property
    def drafter(self) -> str | None:
        """The drafter whose server is up (None before the first cell)."""
        return self._drafter

    def close(self) -> None:
        """Stop the server and restore the group's GPUs (idempotent)."""
        self._stack.close()
