"""The sweep runner: for each cell apply the knob, settle, warm up, measure, journal.

Side effects live at the edges: the runner gets its GPUs, engine, clock, journal and knob
controller as arguments and owns none of their lifetimes, so tests hand it twins and fakes.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from dvfs.campaign import Campaign
from dvfs.clock import Clock
from dvfs.corpora import Corpus, sample_prompts
from dvfs.corpora.sampling import eligible_prompts, stable_seed
from dvfs.engines.base import Engine, RoundResult, ServerInfo, Workload
from dvfs.errors import CorpusError, EngineCrashedError, EngineError, JournalError
from dvfs.gpu.base import Gpu
from dvfs.gpu.knobs import KnobController
from dvfs.measure.journal import Journal
from dvfs.measure.meter import CellMeasurement, WindowPart, steady_window_ns, summarise
from dvfs.measure.plan import Cell
from dvfs.measure.sampler import Sampler, measure_idle_power_w
from dvfs.records import JOURNAL_SCHEMA, CellRecord, Server, Session, Stock, now_iso, recorded_stock
from dvfs.version import __version__

log = logging.getLogger(__name__)

MEASUREMENT_METHOD = (
    "energy: NVML total-energy counter (mJ) sampled every sample_period_s and interpolated at the "
    "steady-state window's edges; window: fixed batch = last first token to first finish, "
    "closed loop = batch requests running until the pool drains below batch; latency: TTFT = "
    "first chunk, ITL = chunk gap / tokens in chunk, TPOT = (last - first) / (tokens - 1)"
)


class Progress(Protocol):
    """Where the runner reports progress (the CLI draws a rich progress bar)."""

    def start(self, total: int, done: int) -> None: ...

    def advance(self, cell: Cell, status: str) -> None: ...

    def note(self, message: str) -> None: ...


class NullProgress:
    def start(self, total: int, done: int) -> None:
        pass

    def advance(self, cell: Cell, status: str) -> None:
        pass

    def note(self, message: str) -> None:
        log.info(message)


@dataclass(frozen=True)
class RunSummary:
    total: int
    skipped: int
    measured: int
    failed: int
    #: Labels of the cells that failed in this run (a rerun retries them).
    failed_cells: tuple[str, ...] = ()


class Runner:
    """Runs a campaign's cells against injected backends, journaling each one."""

    def __init__(
        self,
        campaign: Campaign,
        *,
        gpus: Sequence[Gpu],
        engine: Engine,
        clock: Clock,
        journal: Journal,
        knobs: KnobController,
        corpora: dict[str, Corpus],
        progress: Progress | None = None,
        token_count_method: str = "estimate",
    ) -> None:
        self.campaign = campaign
        self.gpus = list(gpus)
        self.engine = engine
        self.clock = clock
        self.journal = journal
        self.knobs = knobs
        self.corpora = corpora
        self.progress = progress or NullProgress()
        self.token_count_method = token_count_method
        self.idle_power_w = float("nan")
        self._drafter: str | None = None
        self._setting: Any = None
        self._session_open = False
        self._start_failures: dict[str, str] = {}

    # -- session ------------------------------------------------------------------------------
    def _record_session(self) -> None:
        m = self.campaign.measurement
        self.idle_power_w = measure_idle_power_w(self.gpus, self.clock, m.idle_s)
        ranges = [g.power_limit_range() for g in self.gpus]
        original = self.knobs.original
        stock = Stock(
            sm_clock_mhz=max(g.identity.max_sm_clock_mhz for g in self.gpus),
            power_limit_w=original[self.gpus[0].identity.uuid].power_limit_mw / 1000,
        )
        for earlier in self.journal.sessions:
            then = recorded_stock(earlier)
            if then != stock:
                raise JournalError(
                    f"the GPU's stock settings changed since this journal was started "
                    f"({asdict(then) if then else None} then, {asdict(stock)} now): the stock "
                    "cells would no longer compare. Restore the earlier settings, or start a new "
                    "--out folder"
                )
        from dvfs.backends import corpus_texts

        texts = corpus_texts(self.campaign, self.corpora)
        session = Session(
            started=now_iso(),
            dvfs_version=__version__,
            host=platform.node(),
            # Retries, timeouts, server command, environment, URL: free to change between
            # sessions (they are outside the campaign hash), so each session says its own.
            settings=self.campaign.operational_dict(),
            gpu_backend=self.campaign.gpu.backend,
            engine_backend=self.engine.name,
            actuation=self.knobs.actuation,
            clock="virtual" if self.clock.virtual else "monotonic",
            gpus=tuple(asdict(g.identity) for g in self.gpus),
            stock=stock,
            power_limit_range_w=(
                ranges[0].min_mw / 1000,
                ranges[0].max_mw / 1000,
                ranges[0].default_mw / 1000,
            ),
            idle_power_w=self.idle_power_w,
            measurement_method=MEASUREMENT_METHOD,
            token_count_method=self.token_count_method,
            corpora={
                name: {
                    "source": c.source,
                    "content_hash": c.content_hash,
                    "prompts": len(c.prompts),
                    # What the twin's acceptance reads from the text.
                    "text": texts[name].provenance() if name in texts else None,
                }
                for name, c in self.corpora.items()
            },
            journal_schema=JOURNAL_SCHEMA,
            journal_sync=self.journal.sync_policy.describe(),
        )
        self.journal.append(session.to_json())

    def _start_server(self, drafter_name: str) -> None:
        drafter = self.campaign.drafter(drafter_name)
        self.progress.note(f"starting {self.engine.name} server with drafter {drafter_name!r}")
        info: ServerInfo = self.engine.start(drafter)
        self._drafter = drafter_name
        server = Server(
            started=now_iso(),
            drafter=drafter_name,
            engine=info.engine,
            version=info.version,
            args=info.args,
            log_path=info.log_path,
            attention_backend=info.attention_backend,
        )
        self.journal.append(server.to_json())

    # -- one cell -----------------------------------------------------------------------------
    def _prompts_for(self, cell: Cell, label: object) -> tuple:
        w = self.campaign.workload
        corpus = self.corpora[cell.corpus]
        count = cell.batch
        if w.mode == "closed-loop":
            available = len(eligible_prompts(corpus, w.input_tokens))
            count = w.pool_size or min(4 * cell.batch, available)
            if count <= cell.batch:
                raise CorpusError(
                    f"corpus {cell.corpus!r} has {available} usable prompts; a closed-loop pool "
                    f"for batch {cell.batch} needs more than {cell.batch}"
                )
        return sample_prompts(
            corpus,
            count,
            input_tokens=w.input_tokens,
            seed=self.campaign.measurement.seed,
            key=(cell.batch, cell.repeat, label),
        )

    def _workload(self, cell: Cell, label: object, max_new_tokens: int) -> Workload:
        w = self.campaign.workload
        return Workload(
            batch=cell.batch,
            prompts=self._prompts_for(cell, label),
            corpus=cell.corpus,
            max_new_tokens=max_new_tokens,
            temperature=w.temperature,
            ignore_eos=w.ignore_eos,
            mode=w.mode,
            seed=stable_seed(
                self.campaign.measurement.seed, cell.corpus, cell.batch, cell.repeat, label
            ),
        )

    def measure(self, cell: Cell) -> tuple[CellMeasurement, dict[str, Any]]:
        """Warm up, then measure rounds until the steady windows add up to min_window_s."""
        m = self.campaign.measurement
        warmup: dict[str, Any] = {}
        if m.warmup_tokens:
            t0 = self.clock.now_ns()
            warm = self.engine.run(self._workload(cell, "warmup", m.warmup_tokens))
            warmup = {
                "duration_s": (self.clock.now_ns() - t0) * 1e-9,
                "tokens": sum(r.completion_tokens for r in warm.requests),
            }
        parts: list[WindowPart] = []
        total_ns = 0
        for round_index in range(m.max_rounds):
            workload = self._workload(cell, round_index, self.campaign.workload.output_tokens)
            with Sampler(self.gpus, self.clock, m.sample_period_s) as sampler:
                result: RoundResult = self.engine.run(workload)
            errors = [r.error for r in result.requests if r.error]
            if errors:
                raise EngineError(f"{len(errors)} request(s) failed; first: {errors[0]}")
            window = steady_window_ns(result, workload.mode)
            parts.append(WindowPart(result, window, sampler.samples.arrays()))
            if window is not None:
                total_ns += window[1] - window[0]
            if total_ns * 1e-9 >= m.min_window_s:
                break
        requested = cell.sm_clock_mhz if self.knobs.actuation else None
        measurement = summarise(
            parts,
            requested_clock_mhz=requested,
            min_window_s=m.min_window_s,
            sample_period_s=m.sample_period_s,
            idle_power_w=self.idle_power_w,
        )
        return measurement, warmup

    def _run_cell(self, cell: Cell) -> CellRecord:
        """Measure with bounded retries; a crashed server is restarted before retrying."""
        retries = self.campaign.measurement.retries
        errors: list[str] = []
        attempts = 0
        for attempt in range(1, retries + 2):
            attempts = attempt
            try:
                measurement, warmup = self.measure(cell)
                return CellRecord.measured(
                    cell, measurement, attempts=attempt, warmup=warmup, errors=errors
                )
            except EngineCrashedError as exc:
                errors.append(f"attempt {attempt}: {exc}")
                self.progress.note(f"server crashed during {cell_label(cell)}: {exc}")
                # Whatever happens next, the dead server must not serve another cell.
                self._drafter = None
                if attempt <= retries:
                    try:
                        self._start_server(cell.drafter)
                    except EngineError as restart_exc:
                        errors.append(f"restart failed: {restart_exc}")
                        break
            except EngineError as exc:
                errors.append(f"attempt {attempt}: {exc}")
                self.progress.note(f"{cell_label(cell)} failed: {exc}")
        return CellRecord.failed(cell, attempts=attempts, errors=errors)

    # -- the sweep ----------------------------------------------------------------------------
    def open_session(self) -> None:
        """Measure the idle baseline and journal the session record (once per runner)."""
        if not self._session_open:
            self._record_session()
            self._session_open = True

    def run_cell(self, cell: Cell) -> CellRecord:
        """Run one cell and journal its record: the session opened, the drafter's server
        started and the knob applied first, as needed. A drafter whose server failed to start
        fails its cells without another try until `run` starts over."""
        self.open_session()
        if cell.drafter != self._drafter and cell.drafter not in self._start_failures:
            try:
                self._start_server(cell.drafter)
            except EngineError as exc:
                self._start_failures[cell.drafter] = f"server start failed: {exc}"
                self._drafter = None
                self.progress.note(f"drafter {cell.drafter!r}: {exc}")
        if cell.drafter in self._start_failures:
            # One failed start fails the drafter's cells for this run; a rerun retries them.
            failure = self._start_failures[cell.drafter]
            record = CellRecord.failed(cell, attempts=0, errors=[failure])
            self.journal.append(record.to_json())
            self.progress.advance(cell, "failed")
            return record
        if cell.setting != self._setting:
            if self.knobs.apply(cell.setting):
                self.clock.sleep(self.campaign.knobs.settle_s)
            self._setting = cell.setting
        record = self._run_cell(cell)
        self.journal.append(record.to_json())
        self.progress.advance(cell, record.status)
        return record

    def run(self, cells: Sequence[Cell]) -> RunSummary:
        done = self.journal.finished()
        todo = [c for c in cells if c.key not in done]
        self.progress.start(len(cells), len(cells) - len(todo))
        if not todo:
            return RunSummary(len(cells), len(cells), 0, 0)
        self._start_failures = {}
        measured = 0
        failed: list[str] = []
        for cell in todo:
            record = self.run_cell(cell)
            if record.ok:
                measured += 1
            else:
                failed.append(cell_label(cell))
        return RunSummary(len(cells), len(cells) - len(todo), measured, len(failed), tuple(failed))


def cell_label(cell: Cell) -> str:
    clock = f"{cell.sm_clock_mhz} MHz" if cell.sm_clock_mhz is not None else "stock clock"
    limit = f"{cell.power_limit_w:g} W" if cell.power_limit_w is not None else "stock limit"
    return f"{cell.drafter}/{cell.corpus}/b{cell.batch}/r{cell.repeat} @ {clock}, {limit}"
