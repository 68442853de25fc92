"""The sweep runner: for each cell apply the knob, settle, warm up, measure, journal.

Side effects live at the edges: the runner gets its GPUs, engine, clock, journal and knob
controller as arguments and owns none of their lifetimes, so tests hand it twins and fakes.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import platform
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dvfs.campaign import Campaign, MeasurementConfig
from dvfs.clock import Clock
from dvfs.corpora import Corpus, sample_prompts
from dvfs.corpora.sampling import eligible_prompts, pool_hash, stable_seed
from dvfs.engines.base import ROUND_END, Engine, RoundResult, ServerInfo, Workload, load_of
from dvfs.errors import (
    MAX_MESSAGE_CHARS,
    START_UNFIT,
    CorpusError,
    EngineCrashedError,
    EngineError,
    EngineHungError,
    GpuNotSupportedError,
    IncomparableCellsError,
    JournalError,
    ServerRefusedError,
    ServerUnfitError,
    unfit_fix,
)
from dvfs.gpu.base import EVENT_APPLICATIONS_CLOCKS, Gpu
from dvfs.gpu.knobs import (
    GpuSettings,
    KnobController,
    KnobSetting,
    check_one_stock_limit,
    limit_mw_of,
    stock_limit_is_enforced,
    stock_limit_mw,
)
from dvfs.measure.counter import (
    RoundEnergy,
    counter_update_period,
    length_uncertainty,
    relative_half_width,
    repeats_precise,
    round_energy,
    sampling_period_s,
    within_precision,
)
from dvfs.measure.journal import Journal, iter_records
from dvfs.measure.meter import (
    Q_IDLE_POWER_READINGS,
    CellMeasurement,
    PowerLimitRead,
    WindowPart,
    latency_stats,
    mean_prompt_tokens,
    power_limit_quality,
    round_chunks,
    steady_window_ns,
    summarise,
    throttle_violation_delta,
    throttle_violation_reads,
)
from dvfs.measure.plan import Cell, cell_label
from dvfs.measure.sampler import Sampler, measure_idle_power_w
from dvfs.measure.tenants import (
    ForeignProcess,
    TenantCheck,
    foreign_quality,
    idle_quality,
    named,
)
from dvfs.records import (
    ARMS_PINNED,
    GPU_TIME_KEYS,
    JOURNAL_SCHEMA,
    CellRecord,
    Header,
    Server,
    Session,
    Stock,
    arm_changes,
    begun_unpinned,
    journal_prompts,
    now_iso,
    recorded_stock,
    restart_as_it_was,
    server_changes,
    with_changes,
)
from dvfs.records.cell import EnergySplit
from dvfs.records.session import CHANGES
from dvfs.twin.identity import TWIN_CHANGED, twin_changed
from dvfs.version import __version__

if TYPE_CHECKING:
    from dvfs.measure.baseline import IdleBaseline

log = logging.getLogger(__name__)

#: What a cell's error says ahead of why its drafter's server did not start (`START_UNFIT`, in
#: `dvfs.errors`, where SGLang would not start it for the campaign as it is).
START_FAILED = "server start failed: "


def _listed(line: str, changes: Sequence[str], before: str = "") -> str:
    """A refusal's `line` with its `changes` named where it says CHANGES, as many as fit: they
    give way to the remedy, which ends the line whole within an error line's bound
    (`MAX_MESSAGE_CHARS`), `before` (what is said ahead of the line) counted."""
    return with_changes(line, changes, MAX_MESSAGE_CHARS - len(before))


def measurement_method(m: MeasurementConfig) -> str:
    """How this campaign measures, in words, for the session record and the cube's
    `measurement_method` attribute (the round end and warm-up it was run with included)."""
    round_end = (
        "round_end = window: a round ends where its window ends, the requests still running "
        "aborted with the tokens they received"
        if m.round_end == ROUND_END
        else "round_end = complete: every request runs to its end"
    )
    warmup = (
        "warm-up once per server start and (batch, input length) shape"
        if m.warmup_every == "shape"
        else "warm-up before every cell"
    )
    return (
        "energy: NVML total-energy counter (mJ) sampled every sample_period_s, taken between "
        "its first and last update inside the steady-state window (instants fitted to the "
        "update period detected at session start), tokens counted over the same interval "
        "(linear within a decode step); the counter interpolated at the window's edges when it "
        "updated less than twice; rounds until the Student-t interval on energy per token and "
        "median TPOT reaches the precision; window: fixed batch = last first token to first "
        "finish, closed loop = batch requests running until the pool drains below batch; "
        f"{round_end}; {warmup}; latency: TTFT = first chunk, ITL = chunk gap / tokens in "
        "chunk, TPOT = (last - first) / (tokens - 1) over the tokens received"
    )


#: How many times an idle baseline is measured while another tenant's compute process is seen
#: on a metered GPU around it (a passing job may be gone the next time), before the last one
#: is kept and the cells subtracting it are flagged idle_baseline_foreign.
IDLE_TENANT_TRIES = 3
T = TypeVar("T")

#: The fewest counter updates the session's opening idle measurement spans as two counter reads
#: (`Runner._opening_idle_w`): each read may lag the counter by one update.
OPENING_IDLE_MIN_UPDATES = 10
#: How long, as a multiple of the span it asks for (`idle_s`; a setting's baseline's, `idle_s`
#: / 5), an idle measurement between counter updates may wait for them (at least
#: IDLE_BASELINE_MAX_S): its window runs from one update to another, so the span itself would
#: end before the window spans it.
OPENING_IDLE_MAX_FACTOR = 2.0
#: An idle baseline asked to span this long or more is said on the sweep's output as it
#: starts (idle_s = 1000 idles 1000 s before the bar starts, and 200 s at each setting).
LONG_IDLE_NOTE_S = 10.0
#: How fast and how long the energy counter is read at session start to find its update period.
COUNTER_PROBE_PERIOD_S = 0.002
COUNTER_PROBE_S = 0.5
_ERROR = operator.attrgetter("error")
#: Rounds' workloads a runner remembers (`Runner._workload`): a sweep asks for the same few
#: hundred at every knob setting and drafter.
WORKLOAD_MEMO_SIZE = 4096


class Progress(Protocol):
    """Where the runner reports progress (the CLI draws a rich progress bar). One that also
    has `more(cells)` is told when the campaign grows (the further repeats `max_repeats` asks
    for), so that its total and ETA count them (`grow`)."""

    def start(self, total: int, done: int) -> None: ...

    def advance(self, cell: Cell, status: str) -> None: ...

    def note(self, message: str) -> None: ...


def server_lost(exc: EngineCrashedError, cell: Cell, *, retry: bool) -> str:
    """The note for a server lost during `cell`: dead, or alive but answering nothing (then
    stopped by dvfs, and restarted when the cell is retried)."""
    if isinstance(exc, EngineHungError):
        then = " and restarts it to retry the cell" if retry else ""
        return f"server stopped answering during {cell_label(cell)}; dvfs stopped it{then}: {exc}"
    return f"server crashed during {cell_label(cell)}: {exc}"


def grow(progress: Progress, cells: int) -> None:
    """Tell `progress` the campaign has `cells` more cells to measure, if it counts them."""
    more = getattr(progress, "more", None)
    if more is not None:
        more(cells)


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
    #: How many of them failed as their drafter's server was refused (`ServerRefusedError`),
    #: which a rerun alone does not retry, and what would make those servers compare (each
    #: refusal's `fix`, said once).
    refused: int = 0
    refused_fixes: tuple[str, ...] = ()
    #: How many failed as SGLang would not start their drafter's server for the campaign as it
    #: is (`ServerUnfitError`), which a rerun fails again; those drafters, and what each
    #: distinct refusal says to change in the campaign.
    unfit: int = 0
    unfit_drafters: tuple[str, ...] = ()
    unfit_fixes: tuple[str, ...] = ()


class GpuTime:
    """Where a cell's GPU time went, in seconds per `GPU_TIME_KEYS` entry, read off the runner's
    clock (virtual on the twin, monotonic on hardware) at each boundary. Overheads paid before
    a cell (its server start, knob settle, idle baseline, stabilisation) are charged to it."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(GPU_TIME_KEYS, 0.0)

    def add(self, key: str, seconds: float) -> None:
        self.seconds[key] += max(0.0, seconds)

    def merge(self, other: GpuTime) -> None:
        for key, value in other.seconds.items():
            self.seconds[key] += value

    def total(self) -> float:
        return math.fsum(self.seconds.values())

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self.seconds.items()}


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
        #: The idle power at the knob setting in force (per-setting baselines), else the
        #: session's.
        self.setting_idle_power_w = float("nan")
        #: Each GPU's energy-counter update period (s), detected at session start.
        self.counter_periods_s: list[float | None] = []
        #: What to wait after a knob change: measured at session start, or the campaign's.
        self.settle_s = campaign.knobs.settle_s
        self._drafter: str | None = None
        self._setting: Any = None
        self._session_open = False
        self._start_failures: dict[str, str] = {}
        #: Of those, the drafters whose server was refused: what would make it compare.
        self._refusals: dict[str, str] = {}
        #: The journal's server records (`_earlier_servers`), read at the first server start.
        self._servers: list[dict[str, Any]] = []
        self._servers_read = False
        self._pending = GpuTime()  # overheads waiting to be charged to the next cell
        self._stabilise_due = True
        self._idle_by_setting: dict[KnobSetting, float] = {}
        #: Other tenants' processes seen around the session's opening idle measurement, and
        #: around each setting's baseline; those around the baseline in force
        #: (`setting_idle_power_w`'s), which flag a cell idle_baseline_foreign.
        self.idle_foreign: tuple[ForeignProcess, ...] = ()
        self._idle_foreign_by_setting: dict[KnobSetting, tuple[ForeignProcess, ...]] = {}
        self.setting_idle_foreign: tuple[ForeignProcess, ...] = ()
        #: The quality flags of the session's opening idle measurement, of each setting's
        #: baseline, and of the one in force: idle_from_power_readings where a counter
        #: updated less than twice in it (the mean of the instant power instead).
        self.idle_flags = 0
        self._idle_flags_by_setting: dict[KnobSetting, int] = {}
        self.setting_idle_flags = 0
        self._attempt_time = GpuTime()
        #: The last thermal stabilisation (start and end temperature, seconds, reached), for
        #: the next cell's record.
        self._stabilised: dict[str, Any] | None = None
        #: The (batch, input length) shapes the running server has warmed up for.
        self._warmed: set[tuple[int, int]] = set()
        #: Where the last `measure`'s energy went, when its engine knows (the twin).
        self.last_split: EnergySplit | None = None
        #: The stock power limit (mW) of each GPU whose power limit NVML does not support: the
        #: one enforced at the session's start (`stock_limit_mw`), by UUID.
        self._enforced_stock_mw: dict[str, int] = {}
        #: The power limits the last `measure` read at its start and end, per GPU.
        self.last_power_limits: tuple[PowerLimitRead, ...] = ()
        #: Tells other tenants' compute processes from the running server's (`_start_server`).
        self.tenants = TenantCheck(None)
        #: The foreign processes the last `measure` saw at its start and end.
        self.last_foreign: tuple[ForeignProcess, ...] = ()
        #: (GPU index, pid) of the tenants said already (`note_tenants`).
        self._tenants_noted: set[tuple[int, int]] = set()
        #: The rounds' workloads made so far (`_workload`), oldest first.
        self._workloads: dict[tuple[object, ...], tuple[Campaign, object, Workload]] = {}

    # -- session ------------------------------------------------------------------------------
    def _elapsed_s(self, since_ns: int) -> float:
        return (self.clock.now_ns() - since_ns) * 1e-9

    def _detect_counter_periods(self) -> tuple[list[float | None], float]:
        """Read the energy counters fast for a moment (the GPUs idle) and take each one's update
        period; returns the periods and the seconds it took."""
        t0 = self.clock.now_ns()
        with Sampler(self.gpus, self.clock, COUNTER_PROBE_PERIOD_S) as sampler:
            self.clock.sleep(COUNTER_PROBE_S)
        return counter_update_period(sampler.samples.arrays()), self._elapsed_s(t0)

    def _supported_clocks(self) -> tuple[int, ...]:
        """The SM clocks every metered GPU supports (one model: a tensor-parallel group's, a
        session's), empty where one cannot list them."""
        try:
            common = set.intersection(*(set(g.supported_sm_clocks_mhz()) for g in self.gpus))
        except (GpuNotSupportedError, TypeError):  # (TypeError: no GPU)
            return ()
        return tuple(sorted(common))

    def _opening_idle_w(self, seconds: float) -> float:
        """The session's opening idle power: two counter reads `seconds` apart
        (`measure_idle_power_w`), each of which may lag the counter by up to one update. Where
        `seconds` spans fewer than OPENING_IDLE_MIN_UPDATES of the slowest counter's updates,
        or a counter's period is unknown (it moved too rarely to time), those lags could be
        most of the difference (0 W, or one update's energy over less than its period): the
        idle power is then taken between counter updates (`idle_baseline`) instead, over at
        least `seconds` as asked (OPENING_IDLE_MAX_FACTOR times that at most, for a counter
        that does not move)."""
        periods = self.fit_periods_s
        slowest = max((p for p in periods if p), default=None)
        short = slowest is not None and seconds < OPENING_IDLE_MIN_UPDATES * slowest
        self.idle_flags = 0
        if seconds <= 0:
            # one instant power reading (`measure_idle_power_w`), no counter: flagged as a
            # baseline of the power readings is (the session and the cells said it was not)
            self.idle_flags = Q_IDLE_POWER_READINGS
            return measure_idle_power_w(self.gpus, self.clock, seconds)
        if not (short or None in periods):
            return measure_idle_power_w(self.gpus, self.clock, seconds)
        from dvfs.measure.baseline import IDLE_BASELINE_MAX_S, idle_baseline

        base = idle_baseline(
            self.gpus,
            self.clock,
            min_s=seconds,
            sample_period_s=min(self.campaign.measurement.sample_period_s, 0.01),
            counter_period_s=slowest,
            min_updates=OPENING_IDLE_MIN_UPDATES,
            max_s=max(IDLE_BASELINE_MAX_S, OPENING_IDLE_MAX_FACTOR * seconds),
        )
        self.idle_flags = self._readings_flag(base, "the session's opening idle measurement")
        return base.power_w

    def _readings_flag(self, base: IdleBaseline, what: str) -> int:
        """idle_from_power_readings where the baseline `base` fell back to the instant power
        readings (a counter updated less than twice in it), said on the sweep's output; else 0."""
        if base.source == "energy counter":
            return 0
        self.progress.note(
            f"{what}: {base.note}; the cells whose above-idle energy subtracts it are flagged "
            "idle_from_power_readings (their energy per token stands)"
        )
        return Q_IDLE_POWER_READINGS

    def _measured_settle(self) -> dict[str, Any]:
        """The settle time measured on these GPUs (`dvfs.measure.settle`) for the campaign's
        widest knob change, when `measurement.settle = "measured"` and there are knobs to
        change; else the fixed settle. Returns what the session records."""
        m = self.campaign.measurement
        if not isinstance(m.settle, str):
            self.settle_s = float(m.settle)
            return {"settle_s": self.settle_s, "source": "measurement.settle"}
        settings = [KnobSetting(c, p) for c, p in self.campaign.knobs.settings]
        if not self.knobs.actuation or settings == [KnobSetting(None, None)]:
            return {"settle_s": self.settle_s, "source": "knobs.settle_s (no knob to change)"}
        from dvfs.measure.settle import measure_settle

        high = max(settings, key=_setting_order)
        low = min(settings, key=_setting_order)
        before, after = (KnobSetting(None, None), high) if high == low else (high, low)
        timed = measure_settle(
            self.gpus,
            self.knobs,
            self.clock,
            before=before,
            after=after,
            timeout_s=max(self.campaign.knobs.settle_s, 10.0),
        )
        self._setting = None  # the GPUs are at `after` now
        if timed.observed:
            self.settle_s = timed.settle_s
        return {
            **timed.as_dict(),
            "settle_s": self.settle_s,
            "source": "measured" if timed.observed else "knobs.settle_s (not observed)",
        }

    def _refuse_mixed_stock(self) -> None:
        """Refuse a server's GPUs (tensor parallel) whose stock power limits differ
        (`check_one_stock_limit`): the session, and so the cube, has one stock limit, the
        first GPU's, and its stock would be neither."""
        check_one_stock_limit(
            self.gpus,
            self.knobs.stock,
            of="the GPUs of one server",
            leave_out="leave one out of the server's GPUs",
        )

    def _note_foreign_locks(self) -> None:
        """Say so when a GPU reports ApplicationsClocksSetting with no lock dvfs knows of: a
        clock lock (or applications clocks) set outside dvfs, which NVML cannot read back, so
        dvfs can neither keep it nor measure stock under it (its stock-clock cells are flagged
        clock_held_low), and a restore after locked cells unlocks to the driver default."""
        for gpu in self.gpus:
            if self.knobs.original[gpu.identity.uuid].sm_clock_lock_mhz is not None:
                continue
            if gpu.clock_event_reasons() & EVENT_APPLICATIONS_CLOCKS:
                said = (
                    f"GPU {gpu.identity.index} reports ApplicationsClocksSetting (0x2): its "
                    "clocks may be locked or set outside dvfs (nvidia-smi -lgc/-ac?), which NVML "
                    "cannot read back; "
                )
                if not self.knobs.actuation:
                    # Observe-only measures the GPU as it finds it: nothing is flagged for it
                    # (`KnobController.stock_clock_mhz` is None) and nothing is restored.
                    message = said + (
                        "observe-only measures the GPU as it is set, so the cells are not "
                        "flagged clock_held_low but record the clock it ran at "
                        "(sm_clock_observed_mhz). Unlock them (nvidia-smi -rgc) to observe stock"
                    )
                else:
                    message = said + (
                        "a stock-clock cell held below the maximum clock will be flagged "
                        "clock_held_low, and after locked cells dvfs restores the clocks "
                        "unlocked (the driver default). Unlock them (nvidia-smi -rgc) for a stock "
                        "reference"
                    )
                log.info(message)
                self.progress.note(message)

    def _record_session(self) -> None:
        m = self.campaign.measurement
        self._refuse_mixed_stock()
        # Before the counters are timed and the idle power measured (minutes on real GPUs).
        stock = session_stock(self.gpus, self.knobs.stock)
        refusal = stock_change_refusal(self.journal.sessions, stock)
        if refusal is not None:
            raise refusal
        # The stock limit of a GPU whose power limit NVML does not support is the one enforced
        # now, which each stock cell's limit check holds it to (`_power_limit_reads`).
        self._enforced_stock_mw = {
            g.identity.uuid: stock_limit_mw(g, self.knobs.stock[g.identity.uuid])
            for g in self.gpus
            if stock_limit_is_enforced(self.knobs.stock[g.identity.uuid])
        }
        self._note_foreign_locks()
        t0 = self.clock.now_ns()
        if not self.clock.virtual:  # real time passes before the first server's line
            self.progress.note(
                f"timing the GPUs' energy counter updates ({COUNTER_PROBE_S:g} s), then the "
                "session's opening idle power and settle time, before any server starts"
            )
        self.counter_periods_s, counter_s = self._detect_counter_periods()
        t1 = self.clock.now_ns()
        if m.idle_s >= LONG_IDLE_NOTE_S:
            from dvfs.measure.baseline import IDLE_BASELINE_MAX_S

            longest = max(IDLE_BASELINE_MAX_S, OPENING_IDLE_MAX_FACTOR * m.idle_s)
            self.progress.note(
                f"measuring the session's opening idle power over {m.idle_s:g} s (idle_s; up "
                f"to {longest:g} s where the energy counters update slowly), before any server "
                "starts"
            )
        self.idle_power_w, self.idle_foreign = self._idle_checked(
            lambda: self._opening_idle_w(m.idle_s),
            self._opening_tenants(),
            lambda power_w: power_w,
            "the session's opening idle measurement (before any server started)",
        )
        self.setting_idle_power_w = self.idle_power_w
        self.setting_idle_foreign = self.idle_foreign
        self.setting_idle_flags = self.idle_flags
        idle_s = self._elapsed_s(t1)
        t2 = self.clock.now_ns()
        settle = self._measured_settle()
        settle_gpu_s = self._elapsed_s(t2)
        overhead = {
            "start_s": round(t0 * 1e-9, 9),
            "counter_detect": round(counter_s, 6),
            "idle_baseline": round(idle_s, 6),
            "settle_measure": round(settle_gpu_s, 6),
            "total": round(self._elapsed_s(t0), 6),
        }
        # (NaN: NVML does not support the GPU's power limit, nor then its range)
        ranges = [
            None
            if stock_limit_is_enforced(self.knobs.original[g.identity.uuid])
            else g.power_limit_range()
            for g in self.gpus
        ]
        # Each GPU's limit found at start, where it is not its stock: a cap dvfs applied, which
        # the stock cells run without (`AppliedCaps.measuring`) and which is put back at the
        # end. Each GPU's own: GPUs of one session (tensor parallel) may each have their cap.
        found_w = {
            g.identity.uuid: limit_mw_of(self.knobs.original[g.identity.uuid]) / 1000
            for g in self.gpus
            if self.knobs.original[g.identity.uuid].power_limit_mw
            != self.knobs.stock[g.identity.uuid].power_limit_mw
        }
        from dvfs.backends import corpus_texts
        from dvfs.engines.sglang_args import recorded_server_env
        from dvfs.records import SERVER_ENV_PREFIXES

        texts = corpus_texts(self.campaign, self.corpora)
        # (NaN: the GPU could not list them: the headroom's grid edge is then the grid's)
        clocks = self._supported_clocks()
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
                (math.nan, math.nan, math.nan)
                if ranges[0] is None
                else (
                    ranges[0].min_mw / 1000,
                    ranges[0].max_mw / 1000,
                    ranges[0].default_mw / 1000,
                )
            ),
            sm_clock_range_mhz=(min(clocks), max(clocks)) if clocks else (math.nan, math.nan),
            idle_power_w=self.idle_power_w,
            measurement_method=measurement_method(self.campaign.measurement),
            token_count_method=self.token_count_method,
            corpora={
                name: {
                    "source": c.source,
                    "content_hash": c.content_hash,
                    "pool_hash": pool_hash(c, self.campaign.workload.input_tokens),
                    "prompts": len(c.prompts),
                    # What the twin's acceptance reads from the text.
                    "text": texts[name].provenance() if name in texts else None,
                }
                for name, c in self.corpora.items()
            },
            journal_schema=JOURNAL_SCHEMA,
            journal_sync=self.journal.sync_policy.describe(),
            counter_update_period_s=tuple(self.counter_periods_s),
            settle=settle,
            gpu_time_s=overhead,
            server_env=recorded_server_env(self.campaign),
            server_env_prefixes=tuple(SERVER_ENV_PREFIXES),
            idle_foreign_processes=tuple(p.to_json() for p in self.idle_foreign),
            idle_from_power_readings=bool(self.idle_flags & Q_IDLE_POWER_READINGS),
            campaign_dir=str(Path(self.campaign.base_dir).absolute()),
            power_limit_found_w=found_w,
            stock_power_limit_enforced=tuple(self._enforced_stock_mw),
        )
        # Journalled with the run's first record (a server's, a cell's): a resume refused at
        # its first server start (its prompts formatted otherwise) journals nothing.
        self.journal.defer(session.to_json())

    def _opening_tenants(self) -> TenantCheck:
        """What tells other tenants' processes at the opening idle measurement: before dvfs
        starts a server every compute process on a metered GPU is another tenant's (one whose
        PID a container cannot see too); an attached server's own would be among them, and is
        not dvfs's to tell apart, so then nothing is checked."""
        engine = self.campaign.engine
        attached = engine.backend == "sglang" and bool(engine.sglang.url)
        return TenantCheck(None) if attached else TenantCheck.none_ours()

    def _idle_checked(
        self,
        measure: Callable[[], T],
        tenants: TenantCheck,
        power_of: Callable[[T], float],
        what: str,
    ) -> tuple[T, tuple[ForeignProcess, ...]]:
        """An idle baseline (`measure`), with the metered GPUs' compute processes listed right
        before and after it: one seen that is not ours (`tenants`) had its work counted as
        idle, so the baseline is measured again, up to IDLE_TENANT_TRIES times. Returns the
        last one and the foreign processes seen around it (empty: none); says so on the
        sweep's output when one was seen."""
        for attempt in range(1, IDLE_TENANT_TRIES + 1):
            seen = tenants.seen(self.gpus, "start")
            value = measure()
            seen += tenants.seen(self.gpus, "end")
            if not seen:
                if attempt > 1:
                    self.progress.note(
                        f"the other tenant seen during {what} is gone: measured again, "
                        f"{power_of(value):.1f} W"
                    )
                return value, ()
            if attempt < IDLE_TENANT_TRIES:
                self.progress.note(
                    f"{what}: another tenant on {named(seen)}; measuring it again (try "
                    f"{attempt + 1} of {IDLE_TENANT_TRIES})"
                )
                continue
            self.progress.note(
                f"another tenant on {named(seen)} during {what}, each of {attempt} tries: "
                f"its {power_of(value):.1f} W is not idle power; the cells whose above-idle "
                "energy subtracts it are flagged idle_baseline_foreign (their energy per token "
                "stands): stop it or sweep another GPU"
            )
        return value, seen

    def _start_server(self, drafter_name: str) -> None:
        drafter = self.campaign.drafter(drafter_name)
        attached = getattr(self.engine, "attached_to", None)  # a server dvfs does not start
        what = f"attaching to {attached}" if attached else f"starting {self.engine.name} server"
        self.progress.note(f"{what} with drafter {drafter_name!r}")
        recorded = self._journal_prompt_format()
        keep = getattr(self.engine, "keep_prompt_format", None)
        if recorded and keep is not None:
            keep(recorded)  # a resume sends its prompts as the journal's sessions did
        t0 = self.clock.now_ns()
        try:
            info: ServerInfo = self.engine.start(drafter)
        finally:
            self._pending.add("server_start", self._elapsed_s(t0))
        server = Server(
            started=now_iso(),
            drafter=drafter_name,
            engine=info.engine,
            version=info.version,
            args=info.args,
            log_path=info.log_path,
            attention_backend=info.attention_backend,
            gpu_pinning=info.gpu_pinning,
            prompt_format=info.prompt_format,
            ports=info.ports,
            model_commit=info.model_commit,
            model_files=dict(info.model_files or {}),
            running_caps=list(info.running_caps) if info.running_caps else None,
        )
        record = server.to_json()
        try:
            self._check_prompt_format(info.prompt_format, recorded)
            self._check_arms(record)
        except (EngineError, IncomparableCellsError, JournalError):
            self.engine.stop()  # a server that would not compare must not linger
            raise
        self._drafter = drafter_name
        self.tenants = TenantCheck(info.own_pids)
        if info.gpu_pinning and info.own_pids is None:
            self.progress.note(
                f"the {drafter_name!r} server's GPU pinning is {info.gpu_pinning}: other "
                "tenants' processes on the metered GPUs cannot be told from the server's, so "
                "no cell is checked for them (foreign_process)"
            )
        self._stabilise_due = True  # the GPU cooled while the server started
        self._warmed = set()  # a new server has compiled and captured nothing yet
        self.journal.append(record)
        self._servers.append(json.loads(json.dumps(record, default=str)))

    def _earlier_servers(self) -> list[dict[str, Any]]:
        """The server records of this journal so far: its file's (read once, at the first
        start) and this run's. A fleet worker's journal ships its records to the driver instead
        of writing them (it overrides `append`): the driver compares those servers, and its
        file is not the worker's to read."""
        if self._servers_read:
            return self._servers
        self._servers_read = True
        if type(self.journal).append is Journal.append and self.journal.path.is_file():
            self._servers[:0] = [
                r for r in iter_records(self.journal.path) if r.get("type") == "server"
            ]
        return self._servers

    def _journal_prompt_format(self) -> str:
        """The prompt format this journal's sessions (as an earlier dvfs recorded it) or
        servers recorded, "" where none did."""
        return journal_prompts([*self.journal.sessions, *self._earlier_servers()])[1]

    def _check_prompt_format(self, now: str, recorded: str) -> None:
        """Refuse a server whose prompts would go out otherwise than the journal's did (kept
        by `keep_prompt_format`, so only a chat template that changed or went missing)."""
        if not now or not recorded or now == recorded:
            return
        from dvfs.corpora.tokens import download_hint

        model = self.campaign.engine.model
        raise JournalError(
            f"the prompts of {self.journal.path} went out as {recorded}, this run's as {now} "
            f"(prompt format: {recorded} -> {now}): its cells would not compare with this "
            f"run's; put the model's tokenizer it was measured with in the local cache "
            f"({download_hint(model)}), or rerun with --fresh (or into another --out folder)"
        )

    def _check_arms(self, record: dict[str, Any]) -> None:
        """Refuse a server that differs from this journal's servers (`server_refusal`)."""
        refusal = server_refusal(
            self.campaign, self.journal.path, self._earlier_servers(), record, self._arms_pinned()
        )
        if refusal is not None:
            raise refusal

    def _arms_pinned(self) -> tuple[str, ...]:
        """What the dvfs that began the journal gave every drafter alike (its header's
        `arms_pinned`); this dvfs's own for a fleet worker's journal, which holds no header (its
        servers are this run's, and the driver compares them with the journal's)."""
        try:
            header = self.journal.header
        except JournalError:
            return tuple(ARMS_PINNED)
        return Header.from_json(header).arms_pinned

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

    def _workload(
        self, cell: Cell, label: object, max_new_tokens: int, *, end_at_window: bool = False
    ) -> Workload:
        """The round's workload: its prompts and seed follow from the cell's corpus, batch and
        repeat and the round's label (as text), never from the knobs or the drafter, so it is
        made once and remembered (a frozen value) for the campaign and corpus it came from."""
        corpus = self.corpora.get(cell.corpus)
        key = (cell.corpus, cell.batch, cell.repeat, str(label), max_new_tokens, end_at_window)
        known = self._workloads.get(key)
        if known is not None and known[0] is self.campaign and known[1] is corpus:
            return known[2]
        load = self._new_workload(cell, label, max_new_tokens, end_at_window=end_at_window)
        self._workloads[key] = (self.campaign, corpus, load)
        if len(self._workloads) > WORKLOAD_MEMO_SIZE:
            del self._workloads[next(iter(self._workloads))]  # the oldest
        return load

    def _new_workload(
        self, cell: Cell, label: object, max_new_tokens: int, *, end_at_window: bool
    ) -> Workload:
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
            end_at_window=end_at_window,
        )

    def _warm_up(self, cell: Cell, time: GpuTime) -> dict[str, Any]:
        """Warm the server up for the cell's shape (its batch and input length,
        `warmup_shape`) once per server start: a knob change needs none, since nothing the
        server compiles or captures depends on the clock. Returns what the cell records:
        whether it warmed up, the shape, and the warm-up's seconds and tokens when it did."""
        m = self.campaign.measurement
        if not m.warmup_tokens:
            return {"warmed_up": False}
        # The first round's prompts, cut short: the warm-up has the shape the rounds have.
        load = self._workload(cell, 0, m.warmup_tokens, end_at_window=m.round_end == ROUND_END)
        shape = warmup_shape(load)
        if shape in self._warmed and m.warmup_every == "shape":
            return {"warmed_up": False, "shape": list(shape)}
        t0 = self.clock.now_ns()
        warm = self.engine.run(load)
        self._warmed.add(shape)
        seconds = self._elapsed_s(t0)
        time.add("warmup", seconds)
        return {
            "warmed_up": True,
            "shape": list(shape),
            "duration_s": seconds,
            "tokens": int(warm.arrays.completion.sum())
            if warm.arrays is not None
            else sum(r.completion_tokens for r in warm.requests),
        }

    @property
    def fit_periods_s(self) -> list[float | None]:
        """The counters' update periods as the window arithmetic takes them: 0 for a counter
        that moved at every read of the fast probe (continuous: read values are exact)."""
        return [
            0.0 if p is not None and p <= 1.5 * COUNTER_PROBE_PERIOD_S else p
            for p in self.counter_periods_s
        ]

    @property
    def round_sample_period_s(self) -> float:
        """The sampler's period in a round: `sample_period_s`, nudged off the counters'
        update period (`counter.sampling_period_s`)."""
        stepping = [p for p in self.fit_periods_s if p]
        period = self.campaign.measurement.sample_period_s
        return sampling_period_s(period, max(stepping)) if stepping else period

    def measure(self, cell: Cell) -> tuple[CellMeasurement, dict[str, Any]]:
        """Warm up (once per server and shape, `_warm_up`), then measure rounds until the
        cell's interval on energy per token and on median TPOT reaches the precision (with at
        least min_window_s of steady windows whose length between counter updates is known to
        the precision), at most max_rounds. Each round ends where its steady window ends
        (`Workload.end_at_window`): the requests still running then are aborted."""
        m = self.campaign.measurement
        time = self._attempt_time  # where this attempt's GPU time goes
        limits_start = self._power_limits()
        foreign_start = self.tenants.seen(self.gpus, "start")
        warmup = {**self._warm_up(cell, time), "round_end": m.round_end}
        end_at_window = m.round_end == ROUND_END
        parts: list[WindowPart] = []
        # the counters' periods do not change while a cell is measured: asked once a cell
        fit_periods_s = self.fit_periods_s
        sample_period_s = self.round_sample_period_s
        window_s = 0.0
        energies: list[RoundEnergy] = []
        per_token: list[float] = []
        latency: list[float] = []
        sent: list[Workload] = []
        for round_index in range(m.max_rounds):
            workload = self._workload(
                cell,
                round_index,
                self.campaign.workload.output_tokens,
                end_at_window=end_at_window,
            )
            sent.append(workload)
            # the throttle counters around the round: a throttle between two samples shows
            # in none of the sampled reasons (`summarise`)
            violation_start = throttle_violation_reads(self.gpus)
            started = self.clock.now_ns()
            with Sampler(self.gpus, self.clock, sample_period_s) as sampler:
                result: RoundResult = self.engine.run(workload)
            ended = self.clock.now_ns()
            violation = throttle_violation_delta(
                violation_start, throttle_violation_reads(self.gpus)
            )
            # (a round as arrays had no failed request: `RoundArrays`)
            if result.arrays is None and any(map(_ERROR, result.requests)):
                errors = [r.error for r in result.requests if r.error]
                raise EngineError(f"{len(errors)} request(s) failed; first: {errors[0]}")
            window = steady_window_ns(result, workload.mode)
            samples = sampler.samples.arrays()
            energy = None
            if window is not None:
                # the requests with chunks (no errors), gathered once for the round
                curve = round_chunks(result).curve()
                energy = round_energy(samples, curve, window, fit_periods_s)
                time.add("prefill", (window[0] - started) * 1e-9)
                time.add("window", (window[1] - window[0]) * 1e-9)
                time.add("drain", (ended - window[1]) * 1e-9)
                window_s += (window[1] - window[0]) * 1e-9
                energies.append(energy)
                per_token.append(energy.energy_per_token_j)
                latency.append(latency_stats(result).tpot_ms[0])
            else:
                time.add("prefill", (ended - started) * 1e-9)
            parts.append(WindowPart(result, window, samples, energy, violation))
            if self._precise(window_s, energies, per_token, latency):
                break
        requested = cell.sm_clock_mhz if self.knobs.actuation else None
        measurement = summarise(
            parts,
            requested_clock_mhz=requested,
            stock_clock_mhz=self.knobs.stock_clock_mhz(cell.setting),
            min_window_s=m.min_window_s,
            sample_period_s=m.sample_period_s,
            idle_power_w=self.setting_idle_power_w,
            counter_periods_s=fit_periods_s,
            precision=m.precision,
            confidence=m.confidence,
            prompt_tokens=mean_prompt_tokens(sent),
        )
        reads = self._power_limit_reads(cell, limits_start, self._power_limits())
        self.last_power_limits = reads
        self.last_foreign = foreign_start + self.tenants.seen(self.gpus, "end")
        self.note_tenants(self.last_foreign)
        held = power_limit_quality(reads) | foreign_quality(self.last_foreign)
        held |= idle_quality(self.setting_idle_foreign) | self.setting_idle_flags
        if held:
            measurement = replace(measurement, quality=measurement.quality | held)
        self.last_split = EnergySplit.exact((p.result.ledger, p.window, p.energy) for p in parts)
        return measurement, warmup

    def note_tenants(self, seen: Sequence[ForeignProcess]) -> None:
        """Say so when another tenant's process is first seen on a metered GPU: it invalidates
        every cell it overlaps, and a sweep of hours should not tell only at its end."""
        for process in seen:
            if (process.gpu, process.pid) in self._tenants_noted:
                continue
            self._tenants_noted.add((process.gpu, process.pid))
            name = f" ({process.name})" if process.name else ""
            self.progress.note(
                f"another tenant on GPU {process.gpu}: process {process.pid}{name} is not the "
                "server's; the cells it overlaps are flagged foreign_process (invalid): stop it "
                "or sweep another GPU"
            )

    def _power_limits(self) -> list[tuple[int | None, int | None]]:
        """Each GPU's configured and enforced power limit (mW) now; None where the GPU cannot
        report it (a configured limit NVML does not support is not read: it never changes).
        Reading changes nothing (the twin's clock does not move)."""
        out: list[tuple[int | None, int | None]] = []
        for gpu in self.gpus:
            try:
                enforced: int | None = gpu.enforced_power_limit_mw()
            except GpuNotSupportedError:
                enforced = None
            unsupported = stock_limit_is_enforced(self.knobs.original[gpu.identity.uuid])
            out.append((None if unsupported else gpu.power_limit_mw(), enforced))
        return out

    def _target_mw(self, gpu: Gpu, setting: KnobSetting) -> int:
        """The power limit a cell of `setting` runs `gpu` at: its own, or the stock one; on a
        GPU whose power limit NVML does not support, the limit enforced at the session's start
        (its stock limit as recorded), so a limit enforced lower since flags the cell."""
        target = self.knobs.target(gpu, setting)
        if target.power_limit_mw is not None:
            return target.power_limit_mw
        uuid = gpu.identity.uuid
        if uuid not in self._enforced_stock_mw:
            self._enforced_stock_mw[uuid] = stock_limit_mw(gpu, target)
        return self._enforced_stock_mw[uuid]

    def _power_limit_reads(
        self,
        cells: Cell | Sequence[Cell],
        start: Sequence[tuple[int | None, int | None]],
        end: Sequence[tuple[int | None, int | None]],
    ) -> tuple[PowerLimitRead, ...]:
        """The limits read at a cell's start and end against the one it is labelled with (its
        own, or the stock limit), per GPU: what the journal keeps and the quality check reads.
        For an in-flight group (a sequence of cells): against the lowest of its levels'."""
        group = not isinstance(cells, Cell)
        levels = list(cells) if not isinstance(cells, Cell) else [cells]
        reads = []
        for gpu, first, last in zip(self.gpus, start, end, strict=True):
            reads.append(
                PowerLimitRead(
                    target_mw=min(self._target_mw(gpu, c.setting) for c in levels),
                    configured_mw=tuple(c for c in (first[0], last[0]) if c is not None),
                    enforced_mw=tuple(e for e in (first[1], last[1]) if e is not None),
                    group=group,
                )
            )
        return tuple(reads)

    def _precise(
        self,
        window_s: float,
        energies: Sequence[RoundEnergy],
        per_token: Sequence[float],
        latency: Sequence[float],
    ) -> bool:
        """Whether a cell has measured enough: its steady windows reach min_window_s and their
        length between counter updates is known to the precision, and the interval on energy
        per token and on median TPOT over its rounds is within the precision (which takes two
        rounds)."""
        m = self.campaign.measurement
        if window_s < m.min_window_s or length_uncertainty(energies) > m.precision:
            return False
        if m.max_rounds == 1:
            return True
        energy_ci = relative_half_width(per_token, m.confidence)
        latency_ci = relative_half_width(latency, m.confidence)
        if math.isnan(latency_ci) and not all(math.isnan(v) for v in latency):
            latency_ci = math.inf  # TPOT measured, too few rounds yet for its interval
        return bool(within_precision(energy_ci, latency_ci, m.precision))

    def _run_cell(self, cell: Cell, time: GpuTime) -> CellRecord:
        """Measure with bounded retries; a crashed server is restarted before retrying. The
        GPU time of a failed attempt is charged as "retry"."""
        retries = self.campaign.measurement.retries
        errors: list[str] = []
        attempts = 0
        for attempt in range(1, retries + 2):
            attempts = attempt
            self._attempt_time = attempt_time = GpuTime()
            t0 = self.clock.now_ns()
            try:
                measurement, warmup = self.measure(cell)
                time.merge(attempt_time)
                return CellRecord.measured(
                    cell,
                    measurement,
                    attempts=attempt,
                    warmup=warmup,
                    errors=errors,
                    gpu_time_s=time.as_dict(),
                    energy_split=self.last_split,
                    power_limits=self.last_power_limits,
                    foreign_processes=self.last_foreign,
                    idle_foreign_processes=self.setting_idle_foreign,
                )
            except EngineCrashedError as exc:
                time.add("retry", self._elapsed_s(t0))
                errors.append(f"attempt {attempt}: {exc}")
                self.progress.note(server_lost(exc, cell, retry=attempt <= retries))
                # Whatever happens next, the dead server must not serve another cell.
                self._drafter = None
                if attempt <= retries:
                    try:
                        self._start_server(cell.drafter)
                    except EngineError as restart_exc:
                        errors.append(f"restart failed: {restart_exc}")
                        break
                    finally:
                        time.merge(self._take_pending())
            except EngineError as exc:
                time.add("retry", self._elapsed_s(t0))
                errors.append(f"attempt {attempt}: {exc}")
                self.progress.note(f"{cell_label(cell)} failed: {exc}")
        return replace(
            CellRecord.failed(cell, attempts=attempts, errors=errors), gpu_time_s=time.as_dict()
        )

    def _take_pending(self) -> GpuTime:
        pending, self._pending = self._pending, GpuTime()
        return pending

    def _apply_setting(self, setting: KnobSetting) -> None:
        """Apply a knob setting; settle for the measured time; take the idle baseline at it
        when the campaign asks for one per setting."""
        m = self.campaign.measurement
        if self.knobs.apply(setting):
            self.clock.sleep(self.settle_s)
            self._pending.add("settle", self.settle_s)
        self._setting = setting
        if not (m.idle_per_setting and self.knobs.actuation) or setting == KnobSetting(None, None):
            self.setting_idle_power_w = self.idle_power_w
            self.setting_idle_foreign = self.idle_foreign
            self.setting_idle_flags = self.idle_flags
            return
        if setting not in self._idle_by_setting:  # once per session and setting
            from dvfs.measure.baseline import IDLE_BASELINE_MAX_S, idle_baseline

            known = [p for p in self.counter_periods_s if p]
            spent: list[float] = []  # each try's GPU time
            span_s = max(m.idle_s / 5, 0.5)
            longest = max(IDLE_BASELINE_MAX_S, OPENING_IDLE_MAX_FACTOR * span_s)

            def measure_once() -> IdleBaseline:
                base = idle_baseline(
                    self.gpus,
                    self.clock,
                    min_s=span_s,
                    sample_period_s=min(m.sample_period_s, 0.01),
                    counter_period_s=max(known) if known else None,
                    max_s=longest,
                )
                spent.append(base.gpu_time_s)
                return base

            if span_s >= LONG_IDLE_NOTE_S:
                self.progress.note(
                    f"measuring the idle baseline at {_setting_text(setting)} over "
                    f"{span_s:g} s (idle_s / 5; up to {longest:g} s where the energy counters "
                    "update slowly)"
                )
            base, foreign = self._idle_checked(
                measure_once,
                self.tenants,
                lambda b: b.power_w,
                f"the idle baseline at {_setting_text(setting)}",
            )
            self._pending.add("idle_baseline", math.fsum(spent))
            self._idle_by_setting[setting] = base.power_w
            self._idle_foreign_by_setting[setting] = foreign
            self._idle_flags_by_setting[setting] = self._readings_flag(
                base, f"the idle baseline at {_setting_text(setting)}"
            )
        self.setting_idle_power_w = self._idle_by_setting[setting]
        self.setting_idle_foreign = self._idle_foreign_by_setting[setting]
        self.setting_idle_flags = self._idle_flags_by_setting[setting]

    def idle_at(self, setting: KnobSetting) -> tuple[float, tuple[ForeignProcess, ...], int] | None:
        """The idle power `_apply_setting` would leave for `setting`, the other tenants seen
        around it and its quality flags (`setting_idle_flags`), where known without applying it
        (None: its baseline is not taken yet)."""
        m = self.campaign.measurement
        if not (m.idle_per_setting and self.knobs.actuation) or setting == KnobSetting(None, None):
            return self.idle_power_w, self.idle_foreign, self.idle_flags
        if setting not in self._idle_by_setting:
            return None
        return (
            self._idle_by_setting[setting],
            self._idle_foreign_by_setting[setting],
            self._idle_flags_by_setting[setting],
        )

    def _stabilise(self, cell: Cell) -> None:
        """Thermal stabilisation after a server start: run the cell's warm-up load until the
        temperature's slope falls below the threshold (bounded)."""
        m = self.campaign.measurement
        self._stabilise_due = False
        if m.thermal_max_s <= 0:
            return
        from dvfs.measure.baseline import stabilise

        # The first round's prompts: the load the cell then measures, at its shape.
        load = self._workload(
            cell, 0, max(m.warmup_tokens, 64), end_at_window=m.round_end == ROUND_END
        )
        run_load = load_of(self.engine, load)
        if not self.clock.virtual:  # minutes of real time, with no cell to show for them
            self.progress.note(
                "stabilising the GPU temperature under the next cell's load: until it drifts "
                f"less than {m.thermal_slope_c_per_min:g} C/min, about {m.thermal_max_s:g} s "
                "at most (thermal_max_s)"
            )
        done = stabilise(
            self.gpus,
            self.clock,
            run_load=run_load,
            slope_c_per_min=m.thermal_slope_c_per_min,
            max_s=m.thermal_max_s,
        )
        self._pending.add("stabilise", done.gpu_time_s)
        self._stabilised = done.as_dict()
        if done.loads:  # the stabilising load warmed the server up for its shape
            self._warmed.add(warmup_shape(load))

    # -- the sweep ----------------------------------------------------------------------------
    def open_session(self) -> None:
        """Detect the counters' update period, measure the idle baseline and the settle time,
        and journal the session record (once per runner)."""
        if not self._session_open:
            self._record_session()
            self._session_open = True

    def _server_for(self, drafter: str) -> str | None:
        """Start `drafter`'s server unless it is the one running or failed to start in this
        run; returns that failure (it fails the drafter's cells until `run` starts over: a
        rerun retries them), else None."""
        if drafter != self._drafter and drafter not in self._start_failures:
            try:
                self._start_server(drafter)
            except EngineError as exc:
                unfit = isinstance(exc, ServerUnfitError)  # a rerun would fail it again too
                self._start_failures[drafter] = f"{START_UNFIT if unfit else START_FAILED}{exc}"
                if isinstance(exc, ServerRefusedError):  # a rerun alone would be refused again
                    self._refusals[drafter] = exc.fix
                self._drafter = None
                self.progress.note(f"drafter {drafter!r}: {exc}")
        return self._start_failures.get(drafter)

    def run_cell(self, cell: Cell) -> CellRecord:
        """Run one cell and journal its record: the session opened, the drafter's server
        started and the knob applied first, as needed. A drafter whose server failed to start
        fails its cells without another try until `run` starts over."""
        self.open_session()
        failure = self._server_for(cell.drafter)
        if failure is not None:
            record = replace(
                CellRecord.failed(cell, attempts=0, errors=[failure]),
                gpu_time_s=self._take_pending().as_dict(),
            )
            self.journal.append(record.to_json())
            self.progress.advance(cell, "failed")
            return record
        # Every cell, not only on a change of setting: `apply` reads the power limit back
        # and sets it again where something outside dvfs changed it since the last cell.
        self._apply_setting(cell.setting)
        if self._stabilise_due:
            self._stabilise(cell)
        record = self._run_cell(cell, self._take_pending())
        if self._stabilised is not None and record.ok:
            record = replace(record, warmup={**record.warmup, "stabilised": self._stabilised})
            self._stabilised = None
        self.journal.append(record.to_json())
        self.progress.advance(cell, record.status)
        return record

    def run(self, cells: Sequence[Cell], *, adaptive: bool = True) -> RunSummary:
        """Run the cells not yet journaled, then (`adaptive`) the extra repeats of those whose
        interval across repeats misses the precision (up to max_repeats)."""
        from dvfs.measure.inflight import whole_groups_done

        # An in-flight group the journal holds only part of is measured whole again.
        done = whole_groups_done(self.campaign.measurement.mode, cells, self.journal.finished())
        todo = [c for c in cells if c.key not in done]
        if adaptive:  # an added repeat's group journaled in part is measured whole again
            done -= {c.key for c in self.extra_repeats(cells)}
        # The extra repeats an earlier run journalled count as done, as the planned ones do.
        total = len(cells) + len(journaled_repeats(self.campaign.measurement, cells, done))
        skipped = total - len(todo)
        self.progress.start(total, skipped)
        self._start_failures = {}
        self._refusals = {}
        measured = refused = 0
        failed: list[str] = []
        unfit: list[str] = []  # per failed cell SGLang would not start: what to change
        while True:
            for record in self._run_cells(todo):
                if record.ok:
                    measured += 1
                else:
                    failed.append(cell_label(record.cell))
                    refused += record.cell.drafter in self._refusals
                    fix = unfit_fix(record.error)
                    if fix is not None:
                        unfit.append(fix)
            # (never a finished cell but a partly journaled in-flight group's, asked whole)
            todo = self.extra_repeats(cells) if adaptive else []
            if not todo:
                break
            target = self.campaign.measurement.precision
            self.progress.note(f"{len(todo)} cell(s) need another repeat to reach ±{target:.1%}")
            grow(self.progress, len(todo))
            total += len(todo)
        fixes = tuple(dict.fromkeys(self._refusals.values()))
        unfit_drafters = tuple(d for d, e in self._start_failures.items() if unfit_fix(e))
        return RunSummary(
            total,
            skipped,
            measured,
            len(failed),
            tuple(failed),
            refused,
            fixes,
            len(unfit),
            unfit_drafters,
            tuple(dict.fromkeys(unfit)),
        )

    def _run_cells(self, cells: Sequence[Cell]) -> Iterator[CellRecord]:
        """Each cell's record, per level (`run_cell`), or stepped in flight by group."""
        if self.campaign.measurement.mode != "in-flight":
            for cell in cells:
                yield self.run_cell(cell)
            return
        from dvfs.measure.inflight import inflight_groups

        for group in inflight_groups(cells):
            yield from self.run_inflight_group(group)

    def run_inflight_group(self, group: Sequence[Cell]) -> list[CellRecord]:
        """Measure one group's knob levels inside shared decodes (`dvfs.measure.inflight`) and
        journal a record per cell; the group's GPU time is shared equally among its cells, the
        overheads before it charged to its first."""
        from dvfs.measure.inflight import run_inflight

        first = group[0]
        self.open_session()
        failure = self._server_for(first.drafter)
        if failure is not None:
            records = [CellRecord.failed(c, attempts=0, errors=[failure]) for c in group]
        else:
            if self._stabilise_due:
                # At the group's first level, as a per-level cell stabilises at its own: the
                # GPUs were at whatever the session's settle timing applied last (its lowest
                # clock), and the die stabilised there at 40 C against a per-level sweep's 47
                # (batch 8, 1005 against 1980 MHz on the twin): the group's levels ran cooler,
                # their leakage and energy per token 0.3-0.5% lower. Every level's idle
                # baseline first (the group takes them before its warm-up, first level last):
                # taken after, the GPUs idled through them and the die the group started on
                # was 2 C below the stabilised one (47 against 45 C, four levels at batch 8 on
                # the twin, idle_s = 5), where a per-level cell starts where it stabilised
                for cell in (*group[1:], first):
                    self._apply_setting(cell.setting)
                self._stabilise(first)
            before = self._take_pending()
            t0 = self.clock.now_ns()
            try:
                records = run_inflight(self, group, settle_s=self.settle_s)
            finally:
                self._setting = None  # the GPUs are at the group's last level
            spent = self._elapsed_s(t0)
            inside = self._take_pending()  # the levels' settles and idle baselines
            before.merge(inside)
            shared: dict[str, float] = {}
            for record in records:
                shared = record.inflight.get("gpu_time_s") or shared
            accounted = math.fsum(shared.values()) if shared else 0.0
            accounted += math.fsum(inside.seconds.values())
            split = GpuTime()
            for key, value in shared.items():
                if key in split.seconds:
                    split.add(key, value / len(group))
            split.add("retry", max(0.0, spent - accounted) / len(group))
            timed = []
            for index, record in enumerate(records):
                time = GpuTime()
                time.merge(split)
                if index == 0:
                    time.merge(before)
                timed.append(replace(record, gpu_time_s=time.as_dict()))
            records = timed
            if self._stabilised is not None and records[0].ok:
                # the first level's record says where the die was brought, as a cell's does
                warm = {**records[0].warmup, "stabilised": self._stabilised}
                records[0] = replace(records[0], warmup=warm)
                self._stabilised = None
        # One write: a resume that found some of the group's levels would measure the others
        # in decodes of their own, not those the levels share.
        self.journal.append_all([record.to_json() for record in records])
        for record in records:
            self.progress.advance(record.cell, record.status)
        return records

    def server_crashed(self, drafter: str, *, restart: bool, hung: bool = False) -> None:
        """The server died (or, `hung`, stopped answering and was stopped) inside an in-flight
        group: forget it, so that no group runs on it again, and start a fresh one to retry on
        when `restart` (the next group starts one otherwise); a failed start raises
        EngineError."""
        then = "restarting it to retry the group" if restart else "the next group gets a fresh one"
        what = "stopped answering, and dvfs stopped it" if hung else "crashed"
        self.progress.note(f"the server with drafter {drafter!r} {what}: {then}")
        self._drafter = None
        if restart:
            self._start_server(drafter)

    def extra_repeats(self, cells: Sequence[Cell]) -> list[Cell]:
        """The repeats `next_repeats` asks for, from this runner's journal."""
        m = self.campaign.measurement
        if m.max_repeats <= m.repeats:
            return []
        return next_repeats(m, self._journaled_cells(), cells)

    def _journaled_cells(self) -> Iterator[CellRecord]:
        """The journal's cell records, in the version their session wrote them (read back
        from the file: the journal keeps only keys)."""
        self.journal.sync()
        version = JOURNAL_SCHEMA
        for record in iter_records(self.journal.path):
            if record.get("type") == "session":
                version = int(record.get("journal_schema", JOURNAL_SCHEMA))
            elif record.get("type") == "cell":
                yield CellRecord.from_json(record, version=version)


def session_stock(gpus: Sequence[Gpu], stock: dict[str, GpuSettings]) -> Stock:
    """The stock settings a session over `gpus` records, each GPU's stock (`GpuSettings`, by
    UUID) as its knob controller takes it: the top SM clock, the first GPU's stock limit."""
    return Stock(
        sm_clock_mhz=max(g.identity.max_sm_clock_mhz for g in gpus),
        # (a GPU whose power limit NVML does not support: the limit enforced now)
        power_limit_w=stock_limit_mw(gpus[0], stock[gpus[0].identity.uuid]) / 1000,
    )


def server_refusal(
    campaign: Campaign,
    path: Path,
    earlier_servers: Iterable[dict[str, Any]],
    record: dict[str, Any],
    pinned: tuple[str, ...],
) -> IncomparableCellsError | ServerRefusedError | None:
    """Why a server (its journal `record`) is refused beside the `earlier_servers` of the
    journal at `path` (begun by a dvfs that pinned `pinned`, its header's `arms_pinned`): it
    differs from another drafter's server (or one of its own drafter's) in what arms must share
    (`arm_changes`): its engine version, its attention kernels, the resolved args SGLang does
    not adjust for speculation, the decode CUDA graph at each of the campaign's batch sizes;
    and, against its own drafter's, its resolved speculative args (`server_changes`). None
    where it compares. The runner's own rule at each server start, which `dvfs doctor` applies
    to an attached server before a resume."""
    batches = campaign.workload.batch_sizes
    for earlier in earlier_servers:
        changes = arm_changes(earlier, record, batches, pinned)
        if earlier.get("drafter") == record["drafter"]:  # and its own configuration
            changes += [c for c in server_changes(earlier, record) if c not in changes]
        if not changes:
            continue
        drafter, other = record["drafter"], earlier.get("drafter")
        own = drafter == other  # its own earlier server: a resume's other SGLang or flags
        served = (
            f"the {drafter!r} server differs from the one that measured its cells in {path} "
            f"({CHANGES}): its cells would compare more than the knob settings"
            if own
            else f"the {drafter!r} server differs from the {other!r} server of {path} "
            f"({CHANGES}): the arms would compare more than their drafters"
        )
        if twin_changed(changes):  # nor here: another twin measured the journal's cells
            return IncomparableCellsError(_listed(f"{served}; {TWIN_CHANGED}", changes))
        begun = begun_unpinned(pinned, changes)
        if begun:  # nothing this run could do: the whole sweep stops, as a fleet's does
            return IncomparableCellsError(
                _listed(
                    f"{served}; {path} was {begun}, so this dvfs cannot resume it: rerun "
                    "with --fresh (or into another --out folder)",
                    changes,
                )
            )
        engine = campaign.engine
        attached = engine.backend == "sglang" and bool(engine.sglang.url)
        fix = (
            restart_as_it_was(changes, attached)
            if own
            else "run every drafter on the same SGLang and flags (engine.sglang.extra_args)"
        )
        # The line is each of the drafter's cells' error (`_server_for`), after its prefix.
        line = f"{served}; {fix}, or start over with --fresh (or another --out)"
        return ServerRefusedError(_listed(line, changes, START_FAILED), fix)
    return None


def stock_change_refusal(sessions: Iterable[dict[str, Any]], stock: Stock) -> JournalError | None:
    """Why a sweep refuses to resume a journal whose earlier `sessions` recorded other stock
    settings than `stock` (`session_stock`, now): its stock cells would no longer compare
    (observe-only: a power limit changed outside dvfs since). None where none did. The
    sweep's own rule, which `dvfs doctor` and the dry run apply too."""
    for earlier in sessions:
        then = recorded_stock(earlier)
        if then != stock:
            return JournalError(
                f"the GPU's stock settings changed since this journal was started "
                f"({Stock.describe(then)} then; {Stock.describe(stock)} now): the stock "
                "cells would no longer compare. Restore the earlier settings, or start a new "
                "--out folder"
            )
    return None


def next_repeats(
    m: MeasurementConfig, records: Iterable[CellRecord], cells: Sequence[Cell]
) -> list[Cell]:
    """The next repeat of each planned cell (all but the repeat alike) whose measured repeats'
    interval on energy per token or median TPOT misses the precision, while it has fewer than
    max_repeats; none when max_repeats is repeats. In the planned order, reversed on odd
    repeats (the plan's serpentine). The one rule a single runner and a fleet's driver follow,
    each reading its own journal's cell records.

    In flight, an added repeat's group journaled in part (an older dvfs's, a power loss inside
    its one write) is asked for whole: its journaled levels again beside the others (which
    the same earlier repeats ask for again), not the others alone in decodes of their own
    (energy per token 1.2% off on the twin), as `whole_groups_done` has a planned one
    measured whole; their new records replace the old."""
    if m.max_repeats <= m.repeats:
        return []
    # A cell's latest record: an in-flight group measured whole again replaces its records.
    latest = {record.cell.key: record for record in records}
    extra = _next_repeats(m, latest.values(), cells)
    if m.mode == "in-flight" and extra:
        from dvfs.measure.inflight import group_key

        asked = {group_key(cell) for cell in extra}
        part = {key for key, record in latest.items() if group_key(record.cell) in asked}
        if part:
            kept = [record for key, record in latest.items() if key not in part]
            extra = _next_repeats(m, kept, cells)
    return extra


def _next_repeats(
    m: MeasurementConfig, latest: Iterable[CellRecord], cells: Sequence[Cell]
) -> list[Cell]:
    """`next_repeats` from each cell's latest record."""
    groups: dict[tuple, list[tuple[float, float]]] = {}
    taken: dict[tuple, int] = {}
    for record in latest:
        key = _group(record.cell)
        taken[key] = max(taken.get(key, 0), record.cell.repeat + 1)
        if record.ok and record.measurement is not None and record.measurement.valid:
            groups.setdefault(key, []).append(
                (record.measurement.energy_per_token_j, record.measurement.tpot_ms[0])
            )
    extra: list[Cell] = []
    seen: set[tuple] = set()
    for cell in cells:
        key = _group(cell)
        if key in seen or cell.repeat != 0:
            continue
        seen.add(key)
        n = taken.get(key, 0)
        if n < m.repeats or n >= m.max_repeats:
            continue
        values = groups.get(key, [])
        energies, latencies = [v[0] for v in values], [v[1] for v in values]
        if not repeats_precise(energies, latencies, precision=m.precision, confidence=m.confidence):
            extra.append(replace(cell, repeat=n))
    if extra and extra[0].repeat % 2:
        extra.reverse()
    return extra


def journaled_repeats(m: MeasurementConfig, cells: Sequence[Cell], done: set[str]) -> list[Cell]:
    """The repeats beyond the planned ones (those `next_repeats` added, up to max_repeats) of
    the planned `cells`' groups that a journal holds finished (`done`, its finished keys): a
    resumed run counts them done, beside the planned cells it skips."""
    if m.max_repeats <= m.repeats:
        return []
    # Read off the finished keys (each an extra repeat of a planned group or not), not
    # walked over every repeat a group may take: max_repeats = 1048576 made the dry run and
    # the sweep's start work out 2**20 keys a group, minutes for an empty journal.
    planned = {_group(cell): (i, cell) for i, cell in enumerate(cells) if cell.repeat == 0}
    found = []
    for key in done:
        try:
            fields = json.loads(key)
            repeat = fields["repeat"]
            at = planned.get(tuple(fields[name] for name in _GROUP_FIELDS))
        except (ValueError, TypeError, KeyError):  # no cell's key (a list unhashable)
            continue
        # (a JSON true is no repeat, though Python's True is an int)
        if type(repeat) is not int or not m.repeats <= repeat < m.max_repeats:
            continue
        if at is not None and (more := replace(at[1], repeat=repeat)).key == key:
            found.append((at[0], repeat, more))
    return [cell for _, _, cell in sorted(found, key=operator.itemgetter(0, 1))]


#: The fields of a cell `_group` keeps, in its order.
_GROUP_FIELDS = ("drafter", "sm_clock_mhz", "power_limit_w", "batch", "corpus")


def _group(cell: Cell) -> tuple:
    """A cell without its repeat: what the repeats of one measurement share."""
    return (cell.drafter, cell.sm_clock_mhz, cell.power_limit_w, cell.batch, cell.corpus)


def _setting_order(setting: KnobSetting) -> tuple[float, float]:
    """Higher clocks and limits first (stock counts as the highest)."""
    return (
        math.inf if setting.power_limit_w is None else setting.power_limit_w,
        math.inf if setting.sm_clock_mhz is None else setting.sm_clock_mhz,
    )


def warmup_shape(workload: Workload) -> tuple[int, int]:
    """What a warm-up is for: the batch, and the longest prompt rounded up to a power of two
    (the buckets a server compiles and captures for; longer prompts take more prefill
    chunks)."""
    longest = max((p.input_tokens for p in workload.prompts), default=1)
    return workload.batch, 1 << max(0, int(longest) - 1).bit_length()


def _setting_text(setting: KnobSetting) -> str:
    """A knob setting as a note says it: "1500 MHz, stock limit"."""
    clock = f"{setting.sm_clock_mhz} MHz" if setting.sm_clock_mhz is not None else "stock clock"
    limit = f"{setting.power_limit_w:g} W" if setting.power_limit_w is not None else "stock limit"
    return f"{clock}, {limit}"
