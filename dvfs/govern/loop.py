"""The governor and the monitor: read every interval, decide, apply, publish.

The governor changes GPUs only through the sweep's safety layer (`dvfs.gpu.safety`,
`dvfs.gpu.knobs`), as `dvfs cap apply` does: each GPU's lock held for the whole run (another
dvfs is refused), a GPU with an earlier run's unrestored changes refused, the original settings
written to a state file before the first change, and restored on exit, on an error and on
SIGINT/SIGTERM/SIGHUP (after SIGKILL, `dvfs gpu reset` restores from the state file). A clock
step is a cap, as in a caps file: the SM clock is locked to [lowest supported, step], so an idle
GPU may still clock down. `--dry-run` builds none of this and calls no setter.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dvfs.errors import CapsError
from dvfs.govern.exporter import GpuRow, LiveMetrics, Snapshot
from dvfs.govern.metrics import (
    GpuReading,
    ScrapeError,
    ServerDownError,
    ServerSample,
    energy_per_token,
    read_gpu,
    server_energy_per_token,
)
from dvfs.govern.plan import STOCK, BatchPlan
from dvfs.govern.policy import PolicyParams, PolicyState, decide
from dvfs.gpu.base import Gpu, unsupported_clock
from dvfs.gpu.knobs import GpuSettings, KnobController, KnobSetting

Note = Callable[[str], None]
Scraper = Callable[[], ServerSample]


class CappedKnobs(KnobController):
    """The sweep's knob controller, with a clock step applied as a cap ([lowest, step] MHz)
    rather than a fixed clock, as `dvfs cap apply` locks it."""

    def target(self, gpu: Gpu, setting: KnobSetting) -> GpuSettings:
        want = super().target(gpu, setting)
        if setting.sm_clock_mhz is None:
            return want
        lowest = min(gpu.supported_sm_clocks_mhz())
        return replace(want, sm_clock_lock_mhz=(lowest, setting.sm_clock_mhz))


def check_plan_against(
    plan: BatchPlan, gpus: Sequence[Gpu], *, where: str, allow_simulated: bool
) -> None:
    """Refuse a plan this host's GPUs cannot follow, before anything is changed."""
    if not gpus:
        raise CapsError("no GPUs to govern")
    if plan.simulated and not allow_simulated:
        raise CapsError(
            f"{where} is simulated, planned from a digital-twin cube ({plan.measured_on}), not "
            "from measurements of real GPUs: sweep the real GPUs and plan again, or pass "
            "--allow-simulated to follow it anyway"
        )
    for gpu in gpus:
        ident = gpu.identity
        if not plan.matches_model(ident.name, twin_models=allow_simulated):
            raise CapsError(
                f"{where} was measured on {plan.measured_on}, but GPU {ident.index} is a "
                f"{ident.name}: plan from a cube of this GPU model"
            )
        supported = gpu.supported_sm_clocks_mhz()
        limits = gpu.power_limit_range()
        for step in plan.steps:
            clock, limit = step.setting.sm_clock_mhz, step.setting.power_limit_w
            of = f" of GPU {ident.index}"
            problem = None if clock is None else unsupported_clock(clock, supported, of=of)
            if problem is None and limit is not None:
                problem = limits.outside(limit * 1000)
            if problem:
                raise CapsError(f"{where}: step batch {step.batch}: {problem}")


def check_server_for_dry_run(scraper: Scraper, url: str, gpus: Sequence[Gpu]) -> None:
    """A dry run previews what the plan does with the server's load. With a server that does
    not answer there is no load to preview, so say so once, with what the governor would do
    and the fix, rather than print a fallback to stock as if it were a decision (exit 1)."""
    try:
        scraper()
    except ScrapeError as exc:
        names = ", ".join(f"GPU {g.identity.index}" for g in gpus)
        would = f"the governor would hold {names} at stock ({STOCK.describe()})"
        if isinstance(exc, ServerDownError):
            raise ScrapeError(
                f"dry run: the server at {url} is not answering ({exc}); {would} until it "
                "answers. Start SGLang there with --enable-metrics, or point --url at it"
            ) from exc
        raise ScrapeError(f"dry run: {exc}; {would} until it can read the batch") from exc


@dataclass
class Watch:
    """Reads GPUs and server each interval and turns two reads into live numbers."""

    gpus: Sequence[Gpu]
    scraper: Scraper | None
    note: Note
    previous: tuple[GpuReading, ...] = ()
    previous_tokens: float | None = None
    last_error: str | None = None

    def server(self) -> ServerSample | None:
        """This interval's server sample; None (after one note per outage) when unreadable."""
        if self.scraper is None:
            return None
        try:
            sample = self.scraper()
        except ScrapeError as exc:
            if str(exc) != self.last_error:
                self.note(f"server: {exc}")
            self.last_error = str(exc)
            return None
        if self.last_error is not None:
            self.note("server: /metrics answers again")
        self.last_error = None
        return sample

    def snapshot(self, sample: ServerSample | None, locks: dict[str, int | None]) -> Snapshot:
        """This interval's numbers; energy per token over the interval since the last call."""
        readings = tuple(read_gpu(g) for g in self.gpus)
        tokens = None if sample is None else sample.generated_tokens
        before = {r.uuid: r for r in self.previous}
        rows = []
        for r in readings:
            old = before.get(r.uuid)
            ept = energy_per_token(
                None if old is None else old.energy_j, r.energy_j, self.previous_tokens, tokens
            )
            rows.append(GpuRow(r, ept, locks.get(r.uuid)))
        server_ept = (
            server_energy_per_token(self.previous, readings, self.previous_tokens, tokens)
            if self.previous
            else float("nan")
        )
        self.previous, self.previous_tokens = readings, tokens
        return Snapshot(
            gpus=tuple(rows),
            server_up=None if self.scraper is None else sample is not None,
            running=None if sample is None else sample.running,
            generated_tokens=tokens,
            accept_length=None if sample is None else sample.accept_length,
            energy_per_token_j=server_ept,
        )


@dataclass
class Ticker:
    """Intervals on a fixed grid (a slow read does not shift later ones), a bounded count."""

    interval_s: float
    max_intervals: int | None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    count: int = field(default=0, init=False)

    def __iter__(self) -> Iterator[float]:
        start = self.clock()
        while self.max_intervals is None or self.count < self.max_intervals:
            if self.count:
                self.sleep(max(0.0, start + self.count * self.interval_s - self.clock()))
            self.count += 1
            yield self.clock()


@contextlib.contextmanager
def guarded(gpus: Sequence[Gpu], state_dir: Path) -> Iterator[KnobController]:
    """The safety layer around a governor run (see the module docstring)."""
    from dvfs.caps.actuation import AppliedCaps
    from dvfs.gpu.safety import GpuLocks, StateStore

    store = StateStore(state_dir, command="govern")
    with GpuLocks(state_dir).hold(gpus):
        store.refuse_if_pending(gpus)
        controller = CappedKnobs(gpus, change_log=store, prior_locks=AppliedCaps(state_dir).locks())
        with controller as knobs:
            yield knobs


def _speculation_note(plan: BatchPlan, sample: ServerSample) -> str | None:
    speculating = sample.accept_length is not None
    if plan.drafter == "none" and speculating:
        return "the plan is for no drafter, but the server reports a speculative accept length"
    if plan.drafter != "none" and not speculating:
        return (
            f"the plan is for drafter {plan.drafter!r}, but the server reports no speculative "
            "accept length (is it serving without speculation?)"
        )
    return None


def govern(
    plan: BatchPlan,
    gpus: Sequence[Gpu],
    scraper: Scraper,
    params: PolicyParams,
    ticker: Ticker,
    *,
    live: LiveMetrics,
    note: Note,
    dry_run: bool = False,
    state_dir: Path | None = None,
) -> int:
    """Follow the plan until the ticker ends (or a signal); returns the number of changes."""
    from dvfs.signals import signals_raise

    watch = Watch(gpus, scraper, note)
    state = PolicyState()
    changes = 0
    warned = False
    if dry_run or state_dir is None:
        context: contextlib.AbstractContextManager[KnobController | None] = signals_raise()
    else:
        context = guarded(gpus, state_dir)
    start: float | None = None
    with context as knobs:
        for now in ticker:
            start = now if start is None else start
            sample = watch.server()
            if sample is not None and not warned:
                warning = _speculation_note(plan, sample)
                if warning:
                    note(f"warning: {warning}")
                warned = True
            batch = None if sample is None else sample.running
            decision = decide(plan, state, batch, now, params)
            if decision.changed and decision.state.band is not None:
                band = decision.state.band
                setting = plan.band_setting(band)
                if batch is None:  # unknown batch: stock (`band_for`), not a planned band
                    line = f"{setting.describe()} while the server's batch cannot be read"
                else:
                    line = f"running batch {batch} -> {plan.band_label(band)}: {setting.describe()}"
                line += f" (at {now - start:.3f} s)"
                if knobs is None:
                    note(f"dry run, nothing changed: would set {line}")
                else:
                    knobs.apply(KnobSetting(setting.sm_clock_mhz, setting.power_limit_w))
                    note(f"set {line}")
                changes += 1
            state = decision.state
            snapshot = watch.snapshot(sample, _locks(gpus, plan, state, knobs))
            live.publish(
                replace(
                    snapshot, governed=True, changes=changes, plan_batch=_plan_batch(plan, state)
                )
            )
    return changes


def _locks(
    gpus: Sequence[Gpu], plan: BatchPlan, state: PolicyState, knobs: KnobController | None
) -> dict[str, int | None]:
    """The top of each GPU's clock lock as the controller applied it (a lock from `dvfs cap
    apply` included: a step at stock clock keeps it); none in a dry run."""
    if knobs is None or state.band is None:
        return {}
    setting = plan.band_setting(state.band)
    wanted = KnobSetting(setting.sm_clock_mhz, setting.power_limit_w)
    locks: dict[str, int | None] = {}
    for gpu in gpus:
        lock = knobs.target(gpu, wanted).sm_clock_lock_mhz
        locks[gpu.identity.uuid] = None if lock is None else lock[1]
    return locks


def _plan_batch(plan: BatchPlan, state: PolicyState) -> int:
    return 0 if state.band is None else plan.bucket_batch(state.band[1])


def monitor(
    gpus: Sequence[Gpu],
    scraper: Scraper | None,
    ticker: Ticker,
    *,
    live: LiveMetrics,
    note: Note,
    locks: Callable[[], dict[str, int | None]] = dict,
) -> None:
    """Publish live numbers every interval until the ticker ends (or a signal); read-only."""
    from dvfs.signals import signals_raise

    watch = Watch(gpus, scraper, note)
    with signals_raise():
        for _ in ticker:
            live.publish(watch.snapshot(watch.server(), locks()))
