"""The governor and the monitor: read every interval, decide, apply, publish.

The governor changes GPUs only through the sweep's safety layer (`dvfs.gpu.safety`,
`dvfs.gpu.knobs`), as `dvfs cap apply` does: each GPU's lock held for the whole run (another
dvfs is refused), a GPU with an earlier run's unrestored changes refused, the original settings
written to a state file before the first change, and restored on exit, on an error and on
SIGINT/SIGTERM/SIGHUP (after SIGKILL, `dvfs gpu reset` restores from the state file). A clock
step is a cap, as in a caps file: the SM clock is locked to [lowest supported, step], so an idle
GPU may still clock down. The static caps in force at start are a ceiling and the governor's
stock (`Ceiling`), and the lock it holds is recorded for `cap show` and `dvfs monitor`
(`GovernorLocks`). `--dry-run` builds none of this and calls no setter. A GPU that stops
answering NVML (`GpuReading.error`) stops the governor (`GpuSilentError`, the others restored);
the monitor notes it once, and once when it is back, and exports it as not up. A read of the
server that fails within `SERVER_GRACE_S` of the last one answered keeps the setting in force;
past it the batch is unknown, and the governor holds stock (`dvfs.govern.policy`).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from dvfs.caps.actuation import GovernorLocks, LockInForce, above_default
from dvfs.errors import (
    CapsError,
    DvfsError,
    GpuError,
    GpuNotSupportedError,
    GpuPermissionError,
    GpuUnavailableError,
)
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
from dvfs.govern.plan import BatchPlan, Setting
from dvfs.govern.policy import Decision, PolicyParams, PolicyState, decide
from dvfs.govern.servergpus import ServerGpus
from dvfs.gpu.base import Gpu, gpu_names, unsupported_clock
from dvfs.gpu.knobs import (
    UNKNOWN_LOCK,
    ChangeLog,
    GpuSettings,
    KnobController,
    KnobSetting,
    power_limit_or_none,
)
from dvfs.redact import redact_url

Note = Callable[[str], None]
Scraper = Callable[[], ServerSample]


@dataclass(frozen=True)
class Ceiling:
    """What one GPU held when the governor started: the clock lock dvfs recorded (NVML cannot
    read one back) and the power limit read from the GPU. These static caps are the governor's
    stock and its ceiling: a step applies, knob by knob, the lower of the step and these, so
    the governor never loosens a cap the operator put in force."""

    uuid: str
    lock_mhz: tuple[int, int] | None
    #: None: NVML does not support this GPU's power limit (a plan with a power step is refused)
    power_limit_mw: int | None
    lowest_mhz: int

    @classmethod
    def of(cls, gpu: Gpu, lock_mhz: tuple[int, int] | None, power_limit_mw: int | None) -> Ceiling:
        lowest = min(gpu.supported_sm_clocks_mhz())
        return cls(gpu.identity.uuid, lock_mhz, power_limit_mw, lowest)

    def applied(self, clock_mhz: int | None, limit_w: float | None) -> GpuSettings:
        """A clock step is a cap ([lowest, step] MHz, as `dvfs cap apply` locks it), held under
        the static lock, whose floor it keeps where the floor is below the step (a floor above
        it would pin one clock: the step's cap wins, and an idle GPU may still clock down); a
        power step no higher than the limit in force; a stock knob as found."""
        lock = self.lock_mhz
        if clock_mhz is not None:
            top = clock_mhz if lock is None else min(clock_mhz, lock[1])
            lock = (lock[0] if lock is not None and lock[0] < top else self.lowest_mhz, top)
        limit = self.power_limit_mw
        if limit_w is not None and limit is not None:
            limit = min(round(limit_w * 1000), limit)
        return GpuSettings(self.uuid, lock, limit)

    def describe(self) -> str:
        """The static caps, for the log."""
        return f"{_lock_text(self.lock_mhz)}, {_limit_text(self.power_limit_mw)}"

    def describe_applied(self, setting: Setting) -> str:
        """What a plan setting puts on this GPU, saying where the static caps decide."""
        applied = self.applied(setting.sm_clock_mhz, setting.power_limit_w)
        clock = _lock_text(applied.sm_clock_lock_mhz)
        if setting.sm_clock_mhz is None:
            clock += (
                " (stock: the static cap in force)"
                if self.lock_mhz
                else " (stock: no static clock cap in force)"
            )
        elif applied.sm_clock_lock_mhz and applied.sm_clock_lock_mhz[1] < setting.sm_clock_mhz:
            clock += (
                f" (the static cap in force: the plan's {setting.sm_clock_mhz} MHz is above it)"
            )
        elif self.lock_mhz and self.lock_mhz[0] >= setting.sm_clock_mhz:
            clock += f" (the static lock's floor of {self.lock_mhz[0]} MHz is left out below it)"
        power = _limit_text(applied.power_limit_mw)
        if applied.power_limit_mw is None:
            pass
        elif setting.power_limit_w is None:
            power += " (stock: the limit in force at start)"
        elif applied.power_limit_mw < round(setting.power_limit_w * 1000):
            power += (
                f" (the limit in force at start: the plan's {setting.power_limit_w:g} W is "
                "above it)"
            )
        return f"{clock}, {power}"


def _lock_text(lock: tuple[int, int] | None) -> str:
    return "SM clock unlocked" if lock is None else f"SM clock locked {lock[0]}-{lock[1]} MHz"


def _limit_text(limit_mw: int | None) -> str:
    if limit_mw is None:
        return "power limit not supported by NVML (left be)"
    return f"power limit {limit_mw / 1000:g} W"


def per_gpu(gpus: Sequence[Gpu], texts: dict[str, str]) -> str:
    """One description per GPU (`texts` by UUID), GPUs that read the same named together."""
    groups: dict[str, list[str]] = {}
    for gpu in gpus:
        groups.setdefault(texts[gpu.identity.uuid], []).append(f"GPU {gpu.identity.index}")
    return "; ".join(f"{', '.join(names)}: {line}" for line, names in groups.items())


class CappedKnobs(KnobController):
    """The sweep's knob controller for the governor: each step held under the static caps in
    force when it started (`Ceiling`), and the clock lock it holds recorded in dvfs's state
    (`GovernorLocks`) for `cap show` and `dvfs monitor`, removed once a GPU is put back."""

    def __init__(
        self,
        gpus: Sequence[Gpu],
        *,
        change_log: ChangeLog | None = None,
        prior_locks: dict[str, tuple[int, int]] | None = None,
        record: GovernorLocks | None = None,
    ) -> None:
        super().__init__(gpus, change_log=change_log, prior_locks=prior_locks)
        self.record = record
        self._ceilings: dict[str, Ceiling] = {}
        self._recorded: dict[str, tuple[int, int] | None] = {}

    def ceiling(self, gpu: Gpu) -> Ceiling:
        uuid = gpu.identity.uuid
        if uuid not in self._ceilings:
            found = self.original[uuid]
            self._ceilings[uuid] = Ceiling.of(gpu, found.sm_clock_lock_mhz, found.power_limit_mw)
        return self._ceilings[uuid]

    def target(self, gpu: Gpu, setting: KnobSetting) -> GpuSettings:
        return self.ceiling(gpu).applied(setting.sm_clock_mhz, setting.power_limit_w)

    def apply(self, setting: KnobSetting) -> bool:
        for gpu in self.gpus:  # recorded before it is set: a crash mid-write still shows it
            lock = self.target(gpu, setting).sm_clock_lock_mhz
            if lock != self.current[gpu.identity.uuid].sm_clock_lock_mhz:
                self._record(gpu.identity.uuid, lock)
        try:
            return super().apply(setting)
        finally:
            self._sync()

    def restore(self) -> None:
        try:
            super().restore()
        finally:
            self._sync()

    def _sync(self) -> None:
        """The record follows what each GPU holds (a lock being set stays as recorded)."""
        for uuid, have in self.current.items():
            if have.sm_clock_lock_mhz != UNKNOWN_LOCK:
                self._record(uuid, have.sm_clock_lock_mhz)

    def _record(self, uuid: str, lock: tuple[int, int] | None) -> None:
        if self.record is None:
            return
        if lock == self.original[uuid].sm_clock_lock_mhz:
            lock = None  # as found: the static caps' own record says it
        if self._recorded.get(uuid) == lock:
            return
        if lock is None:
            self.record.clear(uuid)
        else:
            self.record.write(uuid, lock)
        self._recorded[uuid] = lock


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
        powered = [s for s in plan.steps if s.setting.power_limit_w is not None]
        limits = None
        if powered:  # a clocks-only plan needs no power limit (NVML may not support one)
            try:
                limits = gpu.power_limit_range()
            except GpuNotSupportedError as exc:
                raise CapsError(
                    f"{where}: step batch {powered[0].batch} sets a power limit, which NVML "
                    f"does not support on GPU {ident.index} ({ident.uuid}): plan SM clocks only "
                    f"for it ({exc})"
                ) from exc
        for step in plan.steps:
            clock, limit = step.setting.sm_clock_mhz, step.setting.power_limit_w
            of = f" of GPU {ident.index}"
            problem = None if clock is None else unsupported_clock(clock, supported, of=of)
            if problem is None and limit is not None and limits is not None:
                # (a step above the default now is refused as `cap apply` refuses such a cap:
                # under a limit in force above that default, the ceiling let it through)
                problem = limits.outside(limit * 1000)
                above = above_default(
                    limit * 1000,
                    limits.default_mw,
                    plan="the batches",
                    command="dvfs cap plan HEADROOM_JSON --per-batch",
                )
                if problem is None and above is not None:
                    problem = f"GPU {ident.index}: {above}"
            if problem:
                raise CapsError(f"{where}: step batch {step.batch}: {problem}")


def check_server_for_dry_run(
    scraper: Scraper, url: str, gpus: Sequence[Gpu], state_dir: Path | None
) -> None:
    """A dry run previews what the plan does with the server's load. With a server that does
    not answer there is no load to preview, so say so once, with what the governor would do
    (hold its stock: the static caps in force, as dvfs's records in `state_dir` and the GPUs
    say them) and the fix, rather than print a fallback to stock as if it were a decision
    (exit 1)."""
    try:
        scraper()
    except ScrapeError as exc:
        names = gpu_names(gpus)
        ceilings = static_caps(gpus, None, state_dir)
        caps = per_gpu(gpus, {u: c.describe() for u, c in ceilings.items()})
        would = f"the governor would hold {names} at stock, the static caps in force ({caps})"
        if isinstance(exc, ServerDownError):
            raise ScrapeError(
                f"dry run: the server at {redact_url(url)} is not answering ({exc}); {would} "
                "until it answers. Start SGLang there with --enable-metrics, or point --url at it"
            ) from exc
        raise ScrapeError(f"dry run: {exc}; {would} until it can read the batch") from exc


@dataclass
class Watch:
    """Reads GPUs and server each interval and turns two reads into live numbers."""

    gpus: Sequence[Gpu]
    scraper: Scraper | None
    note: Note
    previous: tuple[GpuReading, ...] = ()
    #: the last interval's token counter and its value (`ServerSample.token_count`)
    previous_count: tuple[str, float] | None = None
    last_error: str | None = None
    #: GPUs that did not answer their last read, by UUID: why.
    silent: dict[str, GpuReading] = field(default_factory=dict)
    #: GPUs whose outage was noted and whose return is not yet (`STEADY_INTERVALS`), by UUID:
    #: their name and how many intervals in a row they have answered since.
    outage: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: Whether to note a GPU that stops answering, and answers again (the monitor); the
    #: governor stops instead (`GpuSilentError`).
    gpu_notes: bool = True
    #: The server's GPUs, where no --gpu named them: only theirs count in its energy per
    #: token (None: every GPU read).
    server_gpus: ServerGpus | None = None
    #: A GPU to count did not open (the monitor exports it as not up): where every GPU counts
    #: (named with --gpu, or the server's not found), the server's energy is unknown.
    unopened: bool = False
    #: Reads of the server that failed since the start (dvfs_server_read_failures_total).
    failed_reads: int = 0
    #: The server's outage noted and its return not yet (`STEADY_INTERVALS`, as a GPU's): the
    #: reads that failed in it, and how many answered in a row since the last that failed.
    server_outage: tuple[int, int] | None = None

    def server(self, held: Callable[[], str] = str) -> ServerSample | None:
        """This interval's server sample; None when unreadable. `held` is called as a read
        fails: what the governor does meanwhile, added to its note. An outage is noted once,
        and again only where a read fails otherwise than the read noted last; its end once the
        server has answered `STEADY_INTERVALS` reads in a row (or at the end, `settle`), with
        the reads that failed in it: a server that flaps is one outage, not two lines a missed
        read."""
        if self.scraper is None:
            return None
        try:
            sample = self.scraper()
        except ScrapeError as exc:
            self.failed_reads += 1
            meanwhile = held()
            failed = 0 if self.server_outage is None else self.server_outage[0]
            if failed == 0 or str(exc) != self.last_error:
                self.note(f"server: {exc}{meanwhile}")
                self.last_error = str(exc)
            self.server_outage = (failed + 1, 0)
            return None
        if self.server_outage is not None:
            failed, steady = self.server_outage
            self.server_outage = (failed, steady + 1)
            if steady + 1 >= STEADY_INTERVALS:
                self._server_back()
        return sample

    def _server_back(self) -> None:
        if self.server_outage is None:
            return
        failed, _ = self.server_outage
        self.server_outage = None
        self.last_error = None
        reads = "read" if failed == 1 else "reads"
        self.note(f"server: /metrics answers again ({failed} {reads} of it failed meanwhile)")

    def snapshot(
        self,
        sample: ServerSample | None,
        locks: dict[str, int | None],
        governed: Collection[str] = (),
    ) -> Snapshot:
        """This interval's numbers; energy per token over the interval since the last call.
        `locks`: the top of each GPU's clock lock; `governed`: the GPUs whose lock the governor
        set (the others' are `cap apply`'s)."""
        readings = tuple(read_gpu(g) for g in self.gpus)
        self._follow(readings)
        counted: frozenset[str] | None = None  # the server's GPUs (None: every GPU read)
        if self.server_gpus is not None:
            self.server_gpus.refresh()
            counted = self.server_gpus.uuids

        def counts(r: GpuReading) -> bool:
            return counted is None or r.uuid in counted

        count = None if sample is None else sample.token_count()
        tokens = None if count is None else count[1]
        # an interval's tokens from one counter: none where the server's changed (its decode
        # counter appears with its first decode iteration)
        tokens_before = (
            self.previous_count[1]
            if count is not None
            and self.previous_count is not None
            and self.previous_count[0] == count[0]
            else None
        )
        before = {r.uuid: r for r in self.previous}
        rows = []
        for r in readings:
            old = before.get(r.uuid)
            ept = (
                energy_per_token(
                    None if old is None else old.energy_j, r.energy_j, tokens_before, tokens
                )
                if counts(r)
                else math.nan  # another server's GPU: not this server's tokens
            )
            rows.append(GpuRow(r, ept, locks.get(r.uuid), r.uuid in governed))
        server_ept = (
            server_energy_per_token(
                [r for r in self.previous if counts(r)],
                [r for r in readings if counts(r)],
                tokens_before,
                tokens,
            )
            # every GPU counts, one that did not open among them: its energy is unknown
            if self.previous and not (counted is None and self.unopened)
            else math.nan
        )
        self.previous, self.previous_count = readings, count
        return Snapshot(
            gpus=tuple(rows),
            server_up=None if self.scraper is None else sample is not None,
            running=None if sample is None else sample.running,
            generated_tokens=None if sample is None else sample.generated_tokens,
            accept_length=None if sample is None else sample.accept_length,
            energy_per_token_j=server_ept,
            server_read_failures=self.failed_reads,
        )

    def _follow(self, readings: Sequence[GpuReading]) -> None:
        """Note a GPU that stops answering, once, and once when it answers again: after
        `STEADY_INTERVALS` in a row (or at the end, `settle`), so that a GPU that flaps is
        one outage, not two lines an interval."""
        for r in readings:
            if r.error is not None:
                self.silent[r.uuid] = r
                if r.uuid not in self.outage and self.gpu_notes:
                    self.note(
                        f"{_named(r)} stopped answering: {r.error}; its readings are left out "
                        "of the metrics (dvfs_gpu_up 0) until it is back"
                    )
                self.outage[r.uuid] = (_named(r), 0)
            else:
                self.silent.pop(r.uuid, None)
                if r.uuid in self.outage:
                    name, steady = self.outage[r.uuid]
                    self.outage[r.uuid] = (name, steady + 1)
                    if steady + 1 >= STEADY_INTERVALS:
                        self._back(r.uuid)

    def settle(self) -> None:
        """At the end of a run: note each GPU whose outage is open but that answered its
        last read as answering again, and the server likewise."""
        for uuid in [u for u in self.outage if u not in self.silent]:
            self._back(uuid)
        if self.server_outage is not None and self.server_outage[1] > 0:
            self._server_back()

    def _back(self, uuid: str) -> None:
        name, _ = self.outage.pop(uuid)
        if self.gpu_notes:
            self.note(f"{name} answers again")


#: How long after the server's last answered read the governor keeps the setting in force while
#: its reads fail (a read timed out on a loaded machine, a server restarting): as old as a 5 s
#: --interval's batch always is. Past it the batch is unknown, and the GPUs go to stock.
SERVER_GRACE_S = 5.0

#: Intervals in a row a GPU that stopped answering must answer before the monitor says it is
#: back (`Watch`): one that keeps stopping and answering is one outage in the log.
STEADY_INTERVALS = 10


def _named(reading: GpuReading) -> str:
    return f"GPU {reading.index} ({reading.uuid})"


class GpuSilentError(GpuUnavailableError):
    """A GPU the governor holds did not answer NVML (`silent`: its readings): the governor
    stops, putting back the others (`govern`)."""

    def __init__(self, message: str, silent: Sequence[GpuReading]) -> None:
        super().__init__(message)
        self.silent = tuple(silent)


def stopped_answering(silent: Sequence[GpuReading]) -> GpuSilentError:
    """The error naming every GPU of `silent` (that did not answer) and why."""
    return GpuSilentError(
        "; ".join(f"{_named(r)} stopped answering while governed: {r.error}" for r in silent),
        silent,
    )


def _stopped_cause(exc: BaseException) -> GpuSilentError | None:
    """The `GpuSilentError` that stopped the governor, where `exc` is it or the error of
    the restore that followed it (raised while it unwound)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, GpuSilentError):
            return seen
        seen = seen.__context__
    return None


def _signal_behind(raised: BaseException) -> int | None:
    """The signal the governor stopped with, if any: Ctrl-C, a signal raised as an exception
    (it carries `signum`), or one held while a failed restore raised a GPU error."""
    from dvfs.signals import held_signal

    if isinstance(raised, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(raised, GpuError):
        return held_signal(raised)
    signum = getattr(raised, "signum", None)
    return signum if isinstance(signum, int) else None


def _stopped_line(
    stopped: GpuSilentError,
    raised: BaseException,
    gpus: Sequence[Gpu],
    knobs: KnobController | None,
) -> str:
    """One line: which GPU stopped answering and why, that the governor stopped, and what it
    put back (every other GPU, as found) and what it could not; `raised`, what it stopped
    with: `stopped`, a failed restore, or a signal (SIGTERM: `systemctl stop`) that came
    while it put the GPUs back (delivered after, held while the restore failed, or landing as
    its error unwound) or before (the restore then did not run), said once at the end."""
    signum = _signal_behind(raised)
    why = None if signum is None else f"received {signal.Signals(signum).name}"
    if knobs is None:
        line = f"{stopped}; the governor stopped (it had changed nothing)"
        return line if why is None else f"{line}; {why}"
    lost = {r.uuid for r in stopped.silent}
    current, original = knobs.current, knobs.original
    found = [g for g in gpus if current.get(g.identity.uuid) == original.get(g.identity.uuid)]
    stuck = [g for g in gpus if g not in found]
    # a silent GPU the governor had not changed was not put back: nothing was done to it
    back = [g for g in found if g.identity.uuid not in lost]
    untouched = [g for g in found if g.identity.uuid in lost]
    reset = knobs.reset_advice()  # with the governor's --state-dir where it is not the default
    line = f"{stopped}; the governor stopped"
    if back:
        line += f" and put {gpu_names(back)} back as found"
    if untouched:
        line += f"; it had not changed {gpu_names(untouched)}"
    if any(g.identity.uuid in lost for g in stuck):
        line += (
            f"; {gpu_names([g for g in stuck if g.identity.uuid in lost])} could not be put back: "
            f"once it answers again (after a GPU reset or a reboot), {reset} puts back what "
            "its state file recorded"
        )
    healthy = [g for g in stuck if g.identity.uuid not in lost]
    failed = _failed_restore(raised, stopped)
    if failed is not None and healthy:
        line += f"; {str(failed).rstrip('.')}"  # the failed restore, with `dvfs gpu reset`
    elif healthy and why is not None:  # a signal first: the restore did not run
        line += (
            f"; {why} before it put {gpu_names(healthy)} back, which keeps the governor's "
            f"settings: {reset} puts back what its state file recorded"
        )
        return line
    if why is not None:
        line += f"; {why} as it put them back"
    return line


def _signal_restore_line(
    failed: GpuError, gpus: Sequence[Gpu], knobs: KnobController
) -> str | None:
    """One line for a governor a signal stopped (SIGTERM: `systemctl stop`) whose restore then
    failed on some GPU (its NVML call hung: the signal came while it was in the driver), or
    None where no signal came first: the signal, the GPUs put back, what failed on the
    others, and the `dvfs gpu reset` naming them, which puts them back once they answer."""
    from dvfs.gpu.knobs import restore_error_parts

    signum = None
    seen = failed.__context__
    while seen is not None and signum is None:
        signum = _signal_behind(seen) if not isinstance(seen, GpuError) else None
        seen = seen.__context__
    if signum is None:
        return None
    current, original = knobs.current, knobs.original
    back = [g for g in gpus if current.get(g.identity.uuid) == original.get(g.identity.uuid)]
    stuck = [g for g in gpus if g not in back]
    what, _ = restore_error_parts(str(failed))
    line = f"stopped (received {signal.Signals(signum).name})"
    if back:
        line += f"; put {gpu_names(back)} back as found"
    line += f"; {what.rstrip('.')}"
    if stuck:
        indices = " ".join(str(g.identity.index) for g in stuck)
        reset = knobs.reset_advice().replace("dvfs gpu reset", f"dvfs gpu reset {indices}", 1)
        keeps, answers = ("keeps", "it answers") if len(stuck) == 1 else ("keep", "they answer")
        line += (
            f"; {gpu_names(stuck)} {keeps} the governor's settings: once {answers} again (after "
            f"a GPU reset or a reboot), {reset} puts back what the state files recorded"
        )
    return line


def _failed_restore(raised: BaseException, stopped: GpuSilentError) -> GpuError | None:
    """The error of the restore that followed `stopped`, where it ran and failed: `raised`
    itself, or what a signal landing as that error unwound replaced (its context)."""
    seen: BaseException | None = raised
    while seen is not None and seen is not stopped:
        if isinstance(seen, GpuError):
            return seen
        seen = seen.__context__
    return None


@dataclass
class Ticker:
    """Intervals on a grid (a read shorter than half an interval does not shift later ones),
    a bounded count.

    The next interval starts no sooner than half an interval after the last one's reads end,
    so a read that outlasted its interval (a stalled server or driver call) is not followed by
    the intervals it missed back to back, each over milliseconds in which a GPU's energy
    counter had not stepped (energy per token 0, or NaN). The grid goes on from there."""

    interval_s: float
    max_intervals: int | None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    count: int = field(default=0, init=False)

    def __iter__(self) -> Iterator[float]:
        due = self.clock()
        while self.max_intervals is None or self.count < self.max_intervals:
            if self.count:
                now = self.clock()
                due = max(due + self.interval_s, now + self.interval_s / 2)
                self.sleep(max(0.0, due - now))
            self.count += 1
            yield self.clock()


@contextlib.contextmanager
def guarded(gpus: Sequence[Gpu], state_dir: Path) -> Iterator[KnobController]:
    """The safety layer around a governor run (see the module docstring)."""
    from dvfs.caps.actuation import AppliedCaps, state_file_problem
    from dvfs.errors import GpuLockFileError
    from dvfs.gpu.safety import GpuLocks, StateStore

    store = StateStore(state_dir, command="govern")
    record = GovernorLocks(state_dir)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(GpuLocks(state_dir).hold(gpus))
        except OSError as exc:  # before any GPU is changed: never "choose another --state-dir",
            # where `cap show`, sweeps and `gpu reset` would not look, nor another dvfs's
            # locks keep it off these GPUs
            line = state_file_problem(exc)
            if line is None:
                raise
            raise GpuLockFileError(
                f"{line}, then start the governor again (no GPU was changed)"
            ) from exc
        store.refuse_if_pending(gpus)
        for gpu in gpus:  # no unrestored change, no governor: a record left is stale
            record.clear(gpu.identity.uuid)
        controller = CappedKnobs(
            gpus, change_log=store, prior_locks=AppliedCaps(state_dir).locks_on(gpus), record=record
        )
        with controller as knobs:
            yield knobs


def static_caps(
    gpus: Sequence[Gpu], knobs: KnobController | None, state_dir: Path | None
) -> dict[str, Ceiling]:
    """Each GPU's static caps: as the governor's controller found them, or, in a dry run,
    as dvfs's caps record and the GPUs say now."""
    if isinstance(knobs, CappedKnobs):
        return {g.identity.uuid: knobs.ceiling(g) for g in gpus}
    from dvfs.caps.actuation import AppliedCaps

    locks = {} if state_dir is None else AppliedCaps(state_dir).locks_on(gpus)
    return {
        g.identity.uuid: Ceiling.of(g, locks.get(g.identity.uuid), power_limit_or_none(g))
        for g in gpus
    }


def speculation_warning(plan: BatchPlan, sample: ServerSample) -> tuple[bool, str | None]:
    """Whether `sample` can tell if the server speculates, and the warning where it does not do
    as the plan was measured. SGLang exports its accept length gauge at 0 without a speculative
    algorithm and, a speculating server's too, until its scheduler's first periodic decode
    log (every `--decode-log-interval` decode iterations, 40 unless set), while its decode
    counter grows every iteration: a sample tells once the server reports a length or has
    decoded tokens and logged a decode interval (`ServerSample.decode_logged`; where the page
    does not say, decoded tokens alone)."""
    speculating = sample.accept_length is not None
    tokens = sample.token_count()
    if not speculating and (tokens is None or tokens[1] <= 0 or sample.decode_logged is False):
        return False, None
    if plan.drafter == "none" and speculating:
        return True, (
            "the plan is for no drafter, but the server reports a speculative accept length"
        )
    if plan.drafter != "none" and not speculating:
        return True, (
            f"the plan is for drafter {plan.drafter!r}, but the server reports no speculative "
            "accept length (is it serving without speculation?)"
        )
    return True, None


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
    server_gpus: ServerGpus | None = None,
) -> int:
    """Follow the plan until the ticker ends (or a signal); returns the number of changes.
    `server_gpus`: as for `monitor` (energy per token only: every GPU of `gpus` is governed)."""
    from dvfs.signals import Interrupted, RestoreAbandoned, signals_raise

    # a GPU gone silent stops it
    watch = Watch(gpus, scraper, note, gpu_notes=False, server_gpus=server_gpus)
    state = PolicyState()
    changes = 0
    warned = False
    if dry_run or state_dir is None:
        context: contextlib.AbstractContextManager[KnobController | None] = signals_raise()
    else:
        context = guarded(gpus, state_dir)
    start: float | None = None
    answered_at: float | None = None  # the interval of the server's last answered read
    held: list[KnobController] = []
    try:
        with context as knobs:
            if knobs is not None:
                held.append(knobs)
            ceilings = static_caps(gpus, knobs, state_dir)
            note(
                "static caps in force, the ceiling of every step and what the plan calls stock"
                + ("" if knobs is None else " (restored on exit)")
                + ": "
                + per_gpu(gpus, {u: c.describe() for u, c in ceilings.items()})
            )
            holding = False  # this interval's failed read keeps the setting in force

            def grace() -> str:
                """As a read of the server fails: whether it keeps the setting in force, and
                how the note of an outage says it.

                A read that fails soon after one that answered (a read timed out on a loaded
                machine) keeps the setting in force: the batch it read is recent still. Each
                such read went to stock at once and the dwell held stock after it: a 0.05 s
                governor whose read missed its 0.5 s lost its caps for the dwell. Judged as
                the read fails, not as it started: a read that hung for its timeout (the
                interval's) would hold the setting until the next one failed, past the grace
                by an interval and two timeouts. At an --interval of the grace or more no
                answered read is recent: a failed one goes to stock, as before (one that woke
                late put the next, on time, under the grace after it)."""
                nonlocal holding
                holding = (
                    state.band is not None
                    and answered_at is not None
                    and ticker.interval_s < SERVER_GRACE_S
                    and ticker.clock() - answered_at < SERVER_GRACE_S
                )
                if not holding:
                    return ""
                return (
                    "; the setting in force is held (stock if it does not answer within "
                    f"{SERVER_GRACE_S:g} s of its last answer)"
                )

            for now in ticker:
                start = now if start is None else start
                holding = False
                sample = watch.server(grace)
                if sample is not None:
                    answered_at = now
                    if not warned:
                        warned, warning = speculation_warning(plan, sample)
                        if warning:
                            note(f"warning: {warning}")
                batch = None if sample is None else sample.running
                decision = (
                    Decision(state, False, state.band)
                    if sample is None and holding
                    else decide(plan, state, batch, now, params)
                )
                # A setting the static caps make what the GPUs hold already (a first setting
                # of stock; a step above the static cap while one at or above it is in force)
                # changes nothing, to log as set or count.
                holds = decision.state.band is not None and _on_gpus(
                    ceilings, plan, decision.state.band
                ) == _on_gpus(ceilings, plan, state.band)
                if decision.changed and decision.state.band is not None:
                    band = decision.state.band
                    setting = plan.band_setting(band)
                    if batch is None:  # unknown batch: stock (`band_for`), not a planned band
                        line = f"{setting.describe()} while the server's batch cannot be read"
                    else:
                        label = plan.band_label(band)
                        line = f"running batch {batch} -> {label}: {setting.describe()}"
                    applied = {u: c.describe_applied(setting) for u, c in ceilings.items()}
                    line += "; " + per_gpu(gpus, applied)
                    line += f" (at {now - start:.3f} s"
                    if decision.early:
                        line += ", within the dwell: the setting in force did not cover the batch"
                    line += ")"
                    if knobs is None:
                        note(
                            f"dry run: {_held(state)} {line}"
                            if holds
                            else f"dry run, nothing changed: would set {line}"
                        )
                    else:
                        try:
                            wrote = knobs.apply(
                                KnobSetting(setting.sm_clock_mhz, setting.power_limit_w)
                            )
                        except GpuError as exc:  # a GPU gone silent, or a setter refused
                            silent = [r for r in map(read_gpu, gpus) if r.error is not None]
                            if not silent:
                                raise
                            raise stopped_answering(silent) from exc
                        # What the GPUs report decides, not the prediction: a limit changed
                        # outside dvfs since the last step is written back, a change.
                        holds = not wrote
                        note(f"{_held(state)} {line}" if holds else f"set {line}")
                    changes += 0 if holds else 1
                # The dwell runs from the last change: a step that changed no GPU keeps the
                # time of the one before (none at the start).
                held_only = decision.changed and holds
                state = (
                    replace(decision.state, changed_at=state.changed_at)
                    if held_only
                    else decision.state
                )
                locks = _locks(gpus, plan, state, knobs, ceilings)
                governed = {u for u, lock in locks.items() if lock != ceilings[u].lock_mhz}
                snapshot = watch.snapshot(sample, _tops(locks), governed)
                live.publish(
                    replace(
                        snapshot,
                        governed=True,
                        changes=changes,
                        plan_batch=_plan_batch(plan, state),
                    )
                )
                silent = [row.reading for row in snapshot.gpus if row.reading.error is not None]
                if silent:
                    raise stopped_answering(silent)
    except (GpuError, Interrupted, KeyboardInterrupt) as exc:
        # A signal held while the GPUs were put back after one went silent is delivered once
        # they are: the silent GPU stays the reason, said with the signal (a second signal,
        # which gave up on the restore, is its own message).
        stopped = _stopped_cause(exc)
        if stopped is None and held and isinstance(exc, GpuError):
            told = _signal_restore_line(exc, gpus, held[0])
            if told is not None:  # a signal, then a restore that failed (a hung NVML call)
                kind = GpuPermissionError if isinstance(exc, GpuPermissionError) else GpuError
                raise kind(told) from exc
        if stopped is None or isinstance(exc, RestoreAbandoned):
            raise
        raise GpuSilentError(
            _stopped_line(stopped, exc, gpus, held[0] if held else None), stopped.silent
        ) from exc
    except OSError as exc:
        # A record of the state folder that cannot be written (a disk filled, remounted
        # read-only since the locks were taken), the GPUs put back on the way out: the folder
        # to mend, never "choose another --state-dir", where `gpu reset` would not look
        fault = _state_folder_fault(exc, state_dir)
        if fault is None or state_dir is None:
            raise
        raise DvfsError(_state_folder_line(fault, gpus, state_dir)) from exc
    finally:
        watch.settle()  # a server outage still open whose last read answered: said back
    return changes


def _state_folder_fault(exc: OSError, state_dir: Path | None) -> str | None:
    """`state_file_problem`'s line for `exc` where it is a write to a file of `state_dir`
    failing, else None."""
    from dvfs.caps.actuation import state_file_problem

    if state_dir is None or not exc.filename:
        return None
    path = Path(os.fsdecode(exc.filename)).absolute()
    if not path.is_relative_to(state_dir.absolute()):
        return None
    return state_file_problem(exc)


def _state_folder_line(fault: str, gpus: Sequence[Gpu], state_dir: Path) -> str:
    """What to do about a state folder the governor could not write mid-run (`fault`, with
    how to mend it), the GPUs put back: where a GPU's state file could not be removed either
    (a read-only folder), the governor refuses to start on that GPU (exit 3) until the `dvfs
    gpu reset` that reads it runs, so the line names it."""
    from dvfs.gpu.safety import StateStore, reset_command

    try:
        left = set(StateStore(state_dir).left_by_this_process())
    except DvfsError:  # a folder that cannot be read any more: nothing more to tell
        left = set()
    stuck = [g for g in gpus if g.identity.uuid in left]
    if not stuck:
        return f"{fault}, then start the governor again"
    return (
        f"{fault}, then run {reset_command(state_dir)}, which removes the state files the "
        f"governor could not ({gpu_names(stuck)} put back as found; a restart is refused "
        "until then), and start the governor again"
    )


def _held(state: PolicyState) -> str:
    """How a step that changes no GPU is said (not "set"): where the governor starts, or a
    step the static caps keep the GPUs from."""
    return "starts at" if state.band is None else "no change at"


def _on_gpus(
    ceilings: dict[str, Ceiling], plan: BatchPlan, band: tuple[int, int] | None
) -> dict[str, GpuSettings]:
    """What each GPU holds under the plan's setting for `band`: the static caps decide where
    they are lower (`Ceiling.applied`); with no band yet, the static caps as found."""
    setting = None if band is None else plan.band_setting(band)
    return {
        uuid: ceiling.applied(
            None if setting is None else setting.sm_clock_mhz,
            None if setting is None else setting.power_limit_w,
        )
        for uuid, ceiling in ceilings.items()
    }


def _locks(
    gpus: Sequence[Gpu],
    plan: BatchPlan,
    state: PolicyState,
    knobs: KnobController | None,
    ceilings: dict[str, Ceiling],
) -> dict[str, tuple[int, int] | None]:
    """Each GPU's clock lock as the controller applied it (a lock from `dvfs cap apply`
    included: a step at stock clock keeps it); in a dry run, which sets none, the static
    caps' lock the GPUs hold."""
    if knobs is None:
        return {uuid: ceiling.lock_mhz for uuid, ceiling in ceilings.items()}
    if state.band is None:
        return {}
    setting = plan.band_setting(state.band)
    wanted = KnobSetting(setting.sm_clock_mhz, setting.power_limit_w)
    return {g.identity.uuid: knobs.target(g, wanted).sm_clock_lock_mhz for g in gpus}


def _tops(locks: dict[str, tuple[int, int] | None]) -> dict[str, int | None]:
    return {uuid: None if lock is None else lock[1] for uuid, lock in locks.items()}


def _plan_batch(plan: BatchPlan, state: PolicyState) -> int:
    return 0 if state.band is None else plan.bucket_batch(state.band[1])


def monitor(
    gpus: Sequence[Gpu],
    scraper: Scraper | None,
    ticker: Ticker,
    *,
    live: LiveMetrics,
    note: Note,
    locks: Callable[[], dict[str, LockInForce]] = dict,
    server_gpus: ServerGpus | None = None,
) -> list[GpuUnavailableError]:
    """Publish live numbers every interval until the ticker ends (or a signal); read-only.
    `locks`: the clock locks dvfs's records say each GPU holds, read every interval. A GPU
    that stops answering is noted once (and once when it answers again, `STEADY_INTERVALS`
    in a row or at the end) and exported as not up; returns an error naming each GPU that had
    not answered again by the end. `server_gpus`: the server's GPUs, followed, where no
    --gpu named them (only theirs count in its energy per token)."""
    from dvfs.signals import signals_raise

    watch = Watch(gpus, scraper, note, server_gpus=server_gpus, unopened=bool(live.unopened))
    try:
        with signals_raise():
            for _ in ticker:
                now = locks()
                tops: dict[str, int | None] = {u: lock.lock_mhz[1] for u, lock in now.items()}
                governed = {u for u, lock in now.items() if lock.by_governor}
                live.publish(watch.snapshot(watch.server(), tops, governed))
    finally:
        watch.settle()
    return [
        GpuUnavailableError(f"{_named(r)} stopped answering: {r.error}")
        for r in watch.silent.values()
    ]
