"""Applying knob settings to a server's GPUs, and always putting back what was there.

A `KnobController` snapshots each GPU's settings before the first change, compares before
writing, and restores the snapshot on exit (normal, exception or signal). Failures while
restoring are gathered and reported together, so one stubborn GPU does not hide the others.
For its whole life SIGINT, SIGTERM and SIGHUP unwind the process (whatever dispositions it
inherited), and during a restore they are held but not forever (`dvfs.signals`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from dvfs.errors import (
    GpuError,
    GpuNotSupportedError,
    GpuPermissionError,
    GpuValueError,
    JournalError,
)
from dvfs.gpu.base import Gpu
from dvfs.gpu.deadline import given_up_with
from dvfs.signals import restoring, signals_raise

#: What `side_by_side` runs one thread each for (a GPU), and what each thread gives back.
Item = TypeVar("Item")
Done = TypeVar("Done")

log = logging.getLogger(__name__)


#: How a restore's error ends (`KnobController.restore`): ". RESET" and this, RESET the
#: `dvfs gpu reset` that reads its state files.
RETRIES = " retries from the state file."


def restore_error_parts(text: str) -> tuple[str, str]:
    """A restore's error (`KnobController.restore`) as what failed and the reset it names
    (`RETRIES`), for a line naming several GPUs' to name the reset once; `text` and "" where
    it names none."""
    if not text.endswith(RETRIES):
        return text, ""
    body = text[: -len(RETRIES)]
    cut = body.rfind(". `")
    if cut < 0 or not body.endswith("`"):
        return text, ""
    return body[:cut], body[cut + 2 :]


class GatheredFailures:
    """GPU failures collected across GPUs and raised together once every GPU was tried, so one
    stubborn GPU does not hide the others; any permission failure makes the whole a
    `GpuPermissionError` (exit 4, one "needs root" hint)."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.needs_root = False

    def add(self, exc: GpuError, prefix: str = "", suffix: str = "") -> None:
        self.needs_root |= isinstance(exc, GpuPermissionError)
        self.messages.append(f"{prefix}{exc}{suffix}")

    def add_per_gpu(self, failed: Sequence[tuple[Gpu, GpuError]], *, named: bool = True) -> None:
        """Each GPU's failure as "GPU N (UUID): what failed" (with `named`; else as it reads),
        but GPUs that failed alike (the same call hung on each, its text naming its own GPU)
        in one: "GPU 0, GPU 1: what failed on each". Eight GPUs' whole texts overran the line's
        bound (`MAX_MESSAGE_CHARS`), and its end, which GPUs keep what and the reset to run,
        was cut off."""
        groups: dict[str, list[tuple[Gpu, GpuError]]] = {}
        for gpu, exc in failed:
            name = f"GPU {gpu.identity.index} ({gpu.identity.uuid})"
            text = str(exc).removeprefix(f"{name}: ").replace(name, "each")
            groups.setdefault(text, []).append((gpu, exc))
        for text, alike in groups.items():
            if len(alike) == 1:
                gpu, exc = alike[0]
                self.add(exc, f"GPU {gpu.identity.index} ({gpu.identity.uuid}): " if named else "")
                continue
            self.needs_root |= any(isinstance(exc, GpuPermissionError) for _, exc in alike)
            names = ", ".join(f"GPU {gpu.identity.index}" for gpu, _ in alike)
            self.messages.append(f"{names}: {text}")

    def raise_if_any(self, head: str, tail: str = "") -> None:
        """Raise `head` + every message + `tail` as one error, if anything failed."""
        if self.messages:
            cls = GpuPermissionError if self.needs_root else GpuError
            raise cls(head + "; ".join(self.messages) + tail)


class RestoreBugError(Exception):
    """A bug (an error other than a GPU's) in one GPU's restore thread, raised once every GPU
    was tried, its line naming every GPU's outcome (the others' failures too) and the reset to
    run: no `DvfsError`, so the command reports it as an internal error, one line.
    `needs_root`: another GPU's restore was refused for want of root (named in the line)."""

    needs_root = False


def _unremoved(unremoved: Sequence[tuple[Gpu, OSError]]) -> str:
    """What `KnobController.restore` says, beside other GPUs' failures, of the state files it
    could not remove, their GPUs back as found."""
    lines = []
    for gpu, exc in unremoved:
        path = f" {exc.filename}" if exc.filename else ""
        lines.append(
            f"GPU {gpu.identity.index} ({gpu.identity.uuid}) is back as found, but its state "
            f"file{path} cannot be removed ({exc.strerror or exc}): it stays"
        )
    return "; ".join(lines)


def restore_guarded(
    restore_one: Callable[[Item], Done], bugs: dict[int, Exception]
) -> Callable[[Item], Done | None]:
    """`restore_one`, whose own error other than a GPU's (a bug) is kept in `bugs` (by the
    item's id) and gives None: raised from its thread, it was raised alone once every GPU was
    done (`side_by_side`), and the other GPUs' failures, gathered meanwhile, were lost with
    it, their state files kept without a word of why."""

    def guarded(item: Item) -> Done | None:
        try:
            return restore_one(item)
        except GpuError:
            raise
        except Exception as exc:  # its GPU not known to be back: its state file stays
            bugs[id(item)] = exc
            return None

    return guarded


def bug_as_failure(bug: Exception, gpu: Gpu | None = None, *, of: str = "restore") -> GpuError:
    """A restore thread's bug as the failure `GatheredFailures` says of its GPU (`gpu`: named
    in it, for a line whose GPUs' failures name their own)."""
    said = str(bug).strip().splitlines()
    what = f"{type(bug).__name__}: {said[0]}" if said else type(bug).__name__
    named = "" if gpu is None else f"GPU {gpu.identity.index} ({gpu.identity.uuid}): "
    return GpuError(f"{named}its {of} stopped on a bug in dvfs ({what})")


@dataclass(frozen=True)
class GpuSettings:
    """What dvfs may change on one GPU: an SM clock lock (None = unlocked) and the power limit
    (None: NVML does not support this GPU's power limit, so it is neither read nor written)."""

    uuid: str
    sm_clock_lock_mhz: tuple[int, int] | None
    power_limit_mw: int | None


def power_limit_or_none(gpu: Gpu) -> int | None:
    """The GPU's configured power limit, or None where NVML does not support it (some boards,
    MIG, a VM's restricted passthrough: a lasting trait of the GPU, not a fault). Such a GPU
    can still have its clocks locked: what changes only clocks neither reads nor restores it."""
    try:
        return gpu.power_limit_mw()
    except GpuNotSupportedError:
        return None


def limit_mw_of(settings: GpuSettings) -> int:
    """`settings`' power limit, where a command needs one (a sweep records each cell's): a GPU
    without one (NVML does not support it) is refused in one line."""
    if settings.power_limit_mw is None:
        raise GpuNotSupportedError(
            f"GPU {settings.uuid}: NVML does not support its power limit (NOT_SUPPORTED), "
            "which this command reads"
        )
    return settings.power_limit_mw


def stock_limit_mw(gpu: Gpu, settings: GpuSettings) -> int:
    """The power limit `settings` (a GPU's stock, or a cell's target) run `gpu` at, where a
    sweep records it (its session's and cube's stock limit, each cell's limit check): the
    configured limit; where NVML does not support that one (`power_limit_mw` None), the
    limit in force, NVML's enforced limit, which such GPUs usually still report, and which
    nothing changes (`stock_limit_is_enforced` says which). A GPU that reports neither is
    refused in one line."""
    if settings.power_limit_mw is not None:
        return settings.power_limit_mw
    try:
        return gpu.enforced_power_limit_mw()
    except GpuNotSupportedError as exc:
        ident = gpu.identity
        raise GpuNotSupportedError(
            f"GPU {ident.index} ({ident.uuid}): NVML supports neither its power limit nor its "
            f"enforced power limit ({exc}), so the stock power limit a sweep records is "
            "unknown"
        ) from exc


def stock_limit_is_enforced(settings: GpuSettings) -> bool:
    """Whether `stock_limit_mw` of `settings` is NVML's enforced limit, not a configured one
    (NVML does not support this GPU's power limit)."""
    return settings.power_limit_mw is None


def no_power_limit(gpu: Gpu, why: str) -> GpuNotSupportedError:
    """The one line refusing a power-limit change on a GPU whose power limit NVML does not
    support (`why`: what needed it)."""
    ident = gpu.identity
    return GpuNotSupportedError(
        f"GPU {ident.index} ({ident.uuid}): {why} sets a power limit, which NVML does not "
        "support on this GPU (NOT_SUPPORTED): set only SM clocks on it"
    )


class ChangeLog(Protocol):
    """Where the controller records what it is about to change (a state file, for crash safety)."""

    def record(self, original: GpuSettings) -> None: ...

    def clear(self, uuid: str) -> None: ...


@dataclass(frozen=True)
class KnobSetting:
    """One point of the sweep: None leaves the GPU's stock value."""

    sm_clock_mhz: int | None
    power_limit_w: float | None


class KnobController:
    """Applies `KnobSetting`s to every GPU of a server; a context manager that restores."""

    def __init__(
        self,
        gpus: Sequence[Gpu],
        *,
        actuation: bool = True,
        change_log: ChangeLog | None = None,
        prior_locks: dict[str, tuple[int, int]] | None = None,
        applied_power_mw: dict[str, int] | None = None,
        stock_without_caps: bool = False,
    ) -> None:
        self.gpus = list(gpus)
        self.actuation = actuation
        self.change_log = change_log
        self._prior_locks = prior_locks or {}
        self._applied_power_mw = applied_power_mw or {}
        #: A measurement's stock is the GPU's own (`stock`), not the caps dvfs applied.
        self.stock_without_caps = stock_without_caps
        self._snapshot: dict[str, GpuSettings] = {}
        self._stock: dict[str, GpuSettings] = {}
        self._current: dict[str, GpuSettings] = {}
        self._signals = contextlib.ExitStack()

    # -- snapshot and restore ---------------------------------------------------------------
    def snapshot(self) -> dict[str, GpuSettings]:
        """Read what each GPU holds now. NVML cannot read a clock lock back, so a lock is known
        only from dvfs's own records (`prior_locks`, from an applied caps file)."""
        snap = {}
        for gpu in self.gpus:
            uuid = gpu.identity.uuid
            snap[uuid] = GpuSettings(uuid, self._prior_locks.get(uuid), power_limit_or_none(gpu))
        return snap

    def __enter__(self) -> KnobController:
        self._signals.enter_context(signals_raise())
        try:
            self._snapshot = self.snapshot()
        except BaseException:
            self._signals.close()
            raise
        self._current = dict(self._snapshot)
        self._stock = self._stock_of(self._snapshot)
        return self

    def read_stock(self) -> dict[str, GpuSettings]:
        """What `stock` is once the controller is entered, read now without entering it (no
        signal handlers, nothing written or put back): for the checks before a sweep
        (`dvfs doctor`, the dry run, a fleet's driver) to take the stock the sweep takes."""
        return self._stock_of(self.snapshot())

    def _stock_of(self, snapshot: dict[str, GpuSettings]) -> dict[str, GpuSettings]:
        own = self.stock_without_caps and self.actuation  # observe-only changes nothing
        return self._own_stock(snapshot) if own else dict(snapshot)

    def _own_stock(self, snapshot: dict[str, GpuSettings]) -> dict[str, GpuSettings]:
        """The GPUs' own stock settings under the caps dvfs applied (its caps record): clocks
        unlocked, and the default power limit where the limit found is the one dvfs applied.
        A limit set outside dvfs is the operator's stock and is kept."""
        stock = {}
        for gpu in self.gpus:
            uuid = gpu.identity.uuid
            found = snapshot[uuid]
            limit = found.power_limit_mw
            if limit is not None and self._applied_power_mw.get(uuid) == limit:
                limit = gpu.power_limit_range().default_mw
            stock[uuid] = GpuSettings(uuid, None, limit)
        return stock

    def __exit__(self, *exc: object) -> None:
        with self._signals:
            self.restore()

    @property
    def original(self) -> dict[str, GpuSettings]:
        """What each GPU held when found: what a restore puts back."""
        return dict(self._snapshot)

    @property
    def current(self) -> dict[str, GpuSettings]:
        """What each GPU holds now, as far as this controller wrote it (a knob whose setter did
        not finish reads `UNKNOWN_LOCK` / `UNKNOWN_POWER`)."""
        return dict(self._current)

    @property
    def stock(self) -> dict[str, GpuSettings]:
        """What a setting that leaves a knob stock applies: as found, or with
        `stock_without_caps` the GPU's own stock under dvfs's caps (`_own_stock`)."""
        return dict(self._stock)

    def restore(self) -> None:
        """Put every changed GPU back to its snapshot; raise one error listing all failures.

        Termination signals are held back while restoring (and delivered after), so one more
        Ctrl-C cannot leave a GPU half restored; the one after that gives up on the restore
        (`RestoreAbandoned`), and a hung NVML call ends at its deadline, so a restore never
        holds signals forever. The GPUs are put back side by side (`side_by_side`), each state
        file removed as its GPU is back: GPUs whose driver calls hang cost one deadline in all,
        not one each, so the GPUs that answer are back within it (before a unit's stop timeout
        and its SIGKILL). What was not restored stays in the state file for `dvfs gpu reset`.
        """
        with restoring(reset=self.reset_advice()):  # the reset that reads its state files
            changed = []
            for gpu in self.gpus:
                uuid = gpu.identity.uuid
                original = self._snapshot.get(uuid)
                current = self._current.get(uuid)
                if original is not None and current is not None and current != original:
                    changed.append(gpu)
            failed: dict[str, list[GpuError]] = {}
            # A state file that cannot be removed (its folder remounted read-only) stays for
            # `dvfs gpu reset`, its GPU put back: raised once every GPU is, not before the
            # next GPU's restore (which it skipped, leaving that GPU capped)
            unremoved: list[tuple[Gpu, OSError]] = []
            bugs: dict[int, Exception] = {}
            restore_one = restore_guarded(self._restore_one, bugs)
            restoring_all = side_by_side(changed, restore_one, named=restore_thread)
            with contextlib.closing(restoring_all) as finishing:
                for gpu, errors in finishing:
                    uuid = gpu.identity.uuid
                    if errors is None:  # a bug (`bugs`): not known to be back, its file stays
                        continue
                    if errors:
                        failed[uuid] = errors
                    elif self.change_log is not None:
                        try:
                            self.change_log.clear(uuid)
                        except OSError as exc:
                            unremoved.append((gpu, exc))
            failures = GatheredFailures()
            # said in the GPUs' order, whichever failed first, GPUs failing alike named once
            failures.add_per_gpu(
                [
                    (g, e)
                    for g in changed
                    for e in (
                        [bug_as_failure(bugs[id(g)])]
                        if id(g) in bugs
                        else failed.get(g.identity.uuid, [])
                    )
                ]
            )
            if unremoved and (bugs or failures.messages):  # named with them, never left unsaid
                failures.messages.append(_unremoved(unremoved))
            head, tail = "could not restore GPU settings: ", f". {self.reset_advice()}{RETRIES}"
            if bugs:  # an internal error, still naming every GPU's failure and the reset
                first = next(bugs[id(g)] for g in changed if id(g) in bugs)
                bug = RestoreBugError(head + "; ".join(failures.messages) + tail)
                bug.needs_root = failures.needs_root
                raise bug from first
            failures.raise_if_any(head, tail)
            if unremoved:
                raise unremoved[0][1]

    def _restore_one(self, gpu: Gpu) -> list[GpuError]:
        """Put one GPU back to its snapshot; what failed (none: it is back as found)."""
        uuid = gpu.identity.uuid
        original = self._snapshot[uuid]
        try:
            self._write(gpu, uuid, self._current[uuid], original)
        except GpuError as exc:
            again = self._restore_limit_alone(gpu, uuid, original, exc)
            return [exc] if again is None else [exc, again]
        log.info("restored GPU %s to %s", gpu.identity.index, original)
        return []

    def reset_advice(self) -> str:
        """The `dvfs gpu reset` that reads this controller's state files (with --state-dir
        where they are not in the default folder): the change log's own word where it keeps
        state files (`StateStore.reset_command`; asked, not imported, as safety imports this
        module)."""
        told = getattr(self.change_log, "reset_command", None)
        return told() if callable(told) else "`dvfs gpu reset`"

    def _restore_limit_alone(
        self, gpu: Gpu, uuid: str, original: GpuSettings, exc: GpuError
    ) -> GpuError | None:
        """After NVML refused the clock's restore (which changed nothing and says nothing of
        the power limit), the power limit is put back still: it was left capped, and so by
        `dvfs gpu reset` too while the clock's reset kept failing. Returns its own failure."""
        held = self._current.get(uuid)
        if (
            not isinstance(exc, REFUSED)
            or held is None
            or held.sm_clock_lock_mhz == original.sm_clock_lock_mhz
            or held.power_limit_mw == original.power_limit_mw
        ):
            return None
        try:
            self._write(gpu, uuid, held, replace(held, power_limit_mw=original.power_limit_mw))
        except GpuError as again:
            return again
        log.info("restored GPU %s's power limit, not its clock", gpu.identity.index)
        return None

    # -- applying -----------------------------------------------------------------------------
    def target(self, gpu: Gpu, setting: KnobSetting) -> GpuSettings:
        """The settings a GPU should hold for a sweep point (a knob left stock: `stock`)."""
        uuid = gpu.identity.uuid
        original = self._stock[uuid]
        lock = original.sm_clock_lock_mhz
        if setting.sm_clock_mhz is not None:
            lock = (setting.sm_clock_mhz, setting.sm_clock_mhz)
        limit = original.power_limit_mw
        if setting.power_limit_w is not None:
            if limit is None:
                raise no_power_limit(gpu, f"the setting of {setting.power_limit_w:g} W")
            limit = round(setting.power_limit_w * 1000)
        return GpuSettings(uuid, lock, limit)

    def stock_clock_mhz(self, setting: KnobSetting) -> int | None:
        """The clock a setting that leaves the clock stock should run at under load: the
        GPUs' maximum, where dvfs knows of no lock in its stock (its caps record); None for a
        locked setting, where a lock dvfs applied as a cap is the stock, and in observe-only
        mode, whose stock is whatever the GPU runs at (an operator's lock included)."""
        if setting.sm_clock_mhz is not None or not self.gpus or not self.actuation:
            return None
        if any(self._stock[g.identity.uuid].sm_clock_lock_mhz is not None for g in self.gpus):
            return None
        return max(g.identity.max_sm_clock_mhz for g in self.gpus)

    def apply(self, setting: KnobSetting) -> bool:
        """Bring every GPU to `setting`; returns whether anything was written. The power limit
        is compared with what the GPU reports, not with what dvfs last wrote, so a limit
        changed outside dvfs is set again."""
        if not self._snapshot:
            raise RuntimeError("KnobController.apply() outside its `with` block")
        if not self.actuation:
            if setting.sm_clock_mhz is not None or setting.power_limit_w is not None:
                raise GpuError("observe-only mode: refusing to change GPU settings")
            return False
        changed = False
        for gpu in self.gpus:
            uuid = gpu.identity.uuid
            want = self.target(gpu, setting)
            have = self._held(gpu, uuid)
            if want == have:
                continue
            if self.change_log is not None:
                self.change_log.record(self._snapshot[uuid])
            try:
                self._write(gpu, uuid, have, want)
            except GpuError:
                # A refused setter changed nothing: if the GPU is still as found, its state
                # file would only block the next run.
                if self._current[uuid] == self._snapshot[uuid] and self.change_log is not None:
                    self.change_log.clear(uuid)
                raise
            changed = True
            if self._current[uuid] == self._snapshot[uuid] and self.change_log is not None:
                self.change_log.clear(uuid)  # back as found: nothing left for a crash to undo
        return changed

    def _held(self, gpu: Gpu, uuid: str) -> GpuSettings:
        """What the GPU holds now: the configured power limit read back from it (an admin's
        `nvidia-smi -pl` or a GPU reset changes it behind dvfs's back), the lock as this
        controller last wrote it (NVML cannot read a lock back)."""
        have = self._current[uuid]
        if self._snapshot[uuid].power_limit_mw is None:
            return have  # a power limit NVML does not support: never read, never written
        limit_mw = gpu.power_limit_mw()
        last = have.power_limit_mw
        if limit_mw != last:
            if last is not None and last != UNKNOWN_POWER:
                log.warning(
                    "GPU %s: power limit is %g W, not the %g W dvfs last set: changed outside "
                    "dvfs; setting it again",
                    gpu.identity.index,
                    limit_mw / 1000,
                    last / 1000,
                )
            have = replace(have, power_limit_mw=limit_mw)
            self._current[uuid] = have
        return have

    def _write(self, gpu: Gpu, uuid: str, have: GpuSettings, want: GpuSettings) -> None:
        """Write knob by knob, tracking what the GPU holds after each step.

        A knob is marked unknown while its setter runs, so a crash mid-write still restores it;
        a setter NVML refused (no permission, invalid value, a knob this GPU lacks) changed nothing
        and is rolled back.
        """
        current = have
        if want.sm_clock_lock_mhz != current.sm_clock_lock_mhz:
            self._current[uuid] = replace(current, sm_clock_lock_mhz=UNKNOWN_LOCK)
            try:
                if want.sm_clock_lock_mhz is None:
                    gpu.reset_sm_clock()
                else:
                    gpu.lock_sm_clock(*want.sm_clock_lock_mhz)
            except REFUSED:
                self._current[uuid] = current
                raise
            current = replace(current, sm_clock_lock_mhz=want.sm_clock_lock_mhz)
            self._current[uuid] = current
        if want.power_limit_mw is not None and want.power_limit_mw != current.power_limit_mw:
            self._current[uuid] = replace(current, power_limit_mw=UNKNOWN_POWER)
            try:
                gpu.set_power_limit_mw(want.power_limit_mw)
            except REFUSED:
                self._current[uuid] = current
                raise
            current = replace(current, power_limit_mw=want.power_limit_mw)
            self._current[uuid] = current


def side_by_side(
    gpus: Sequence[Item],
    restore_one: Callable[[Item], Done],
    *,
    named: Callable[[Item], str],
    stalled: Callable[[], None] | None = None,
    stall_s: float = 1.0,
) -> Generator[tuple[Item, Done], None, None]:
    """`restore_one` run on every GPU of `gpus` at once, one thread each (`named`; one GPU: in
    this thread), each GPU with what failed on it as soon as it is done, in the order they
    finish. `dvfs.backends.reachable_gpus` probes GPUs not yet opened so (`gpus` their names).
    Every GPU's calls run on its own NVML worker with a deadline each (`dvfs.gpu.deadline`):
    one after another, GPUs whose driver calls hang cost a deadline each before the next GPU
    was tried (six at 10 s: a minute, a unit's stop timeout, its SIGKILL before the GPUs that
    answer were put back); side by side, one deadline in all. The wait here is the main
    thread's, where a signal lands (`restoring`: a second one gives up on the restore, the
    threads left behind as a hung call's worker is); an error other than a GPU's (a bug) is
    raised once every GPU is done. Given up on (a signal raising as it waits, the caller's
    error, the generator closed early: use it in `contextlib.closing`), the threads begin no
    NVML call after (`given_up_with`): the command goes on to release the GPUs' locks and shut
    NVML down, and a GPU's state file, kept, says it is not put back. `stalled`, where given,
    is called once in each wait for the next GPU that outlasts `stall_s` (a GPU still in its
    driver: a caller holding back what it says of the GPUs done, to say them in the GPUs'
    order, says them then)."""
    if len(gpus) < 2:
        for gpu in gpus:
            yield gpu, restore_one(gpu)
        return
    # (a GPU, what `restore_one` gave back, or the error it raised instead)
    done: queue.SimpleQueue[tuple[Item, Any, BaseException | None]] = queue.SimpleQueue()
    stop = threading.Event()

    def run(gpu: Item) -> None:
        try:
            with given_up_with(stop):
                restored = restore_one(gpu)
            done.put((gpu, restored, None))
        except BaseException as exc:  # handed to the waiting thread, never lost in this one
            done.put((gpu, None, exc))

    try:
        for gpu in gpus:
            threading.Thread(target=run, args=(gpu,), name=named(gpu), daemon=True).start()
        crashed: BaseException | None = None
        for _ in gpus:
            try:  # a signal's handler runs (and may raise) as it waits
                gpu, errors, crash = done.get(timeout=None if stalled is None else stall_s)
            except queue.Empty:  # (only a wait with a timeout, where `stalled` is given)
                if stalled is not None:
                    stalled()
                gpu, errors, crash = done.get()
            if crash is not None:
                crashed = crashed or crash
                continue
            yield gpu, errors
        if crashed is not None:
            raise crashed
    finally:
        stop.set()  # every thread is done, or the restore was given up on: none goes on


def restore_thread(gpu: Gpu) -> str:
    """The name of the thread `side_by_side` puts `gpu` back in."""
    return f"restore-gpu{gpu.identity.index}"


def check_one_stock_limit(
    gpus: Sequence[Gpu], stock: Mapping[str, GpuSettings], *, of: str, leave_out: str
) -> None:
    """Refuse GPUs measured as one stock setting (a tensor-parallel server's, a fleet's of one
    GPU model) whose stock power limits differ (an operator's limit on one of them): the cube
    has one stock limit, while a cell that leaves the limit stock runs each GPU at its own,
    and a cell at one GPU's limit raises or lowers the others to it, so their stock cells
    would not compare. `stock`: each GPU's as the sweep takes it (`KnobController.stock`, or
    `read_stock` before the sweep: a cap dvfs applied counts as the default; a power limit
    NVML does not support, the enforced one: `stock_limit_mw`). `of` names the
    GPUs, `leave_out` the other way out. The one rule of the sweep and of its checks before."""
    limits = {g: stock_limit_mw(g, stock[g.identity.uuid]) for g in gpus}
    if len(set(limits.values())) > 1:
        said = ", ".join(
            f"GPU {g.identity.index} ({g.identity.uuid}) at {mw / 1000:g} W"
            + (" enforced" if stock_limit_is_enforced(stock[g.identity.uuid]) else "")
            for g, mw in limits.items()
        )
        fixed = [g for g in gpus if stock_limit_is_enforced(stock[g.identity.uuid])]
        # (`gpu reset --defaults` leaves a power limit NVML does not support be)
        how = (
            "give them one power limit (`dvfs gpu reset --defaults` sets the default) or "
            if not fixed
            else "NVML cannot set the power limit of "
            + ", ".join(f"GPU {g.identity.index}" for g in fixed)
            + " (what it enforces is set outside NVML): "
        )
        raise JournalError(
            f"{of} start from other stock power limits ({said}): the cube has one stock "
            f"setting, so their stock cells would not compare; {how}{leave_out}"
        )


#: NVML's refusals of a setter, which changed nothing (no permission, an invalid value, a knob
#: this GPU lacks).
REFUSED = (GpuPermissionError, GpuValueError, GpuNotSupportedError)

#: Placeholders for a knob whose setter did not finish: differ from any real setting.
UNKNOWN_LOCK = (0, 0)
UNKNOWN_POWER = -1
