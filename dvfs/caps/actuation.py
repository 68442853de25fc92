"""Putting caps on GPUs: plan against this host, apply, reset, and record what was applied.

NVML cannot read a clock lock back, so what `apply_actions` locks is recorded in the state
directory (`AppliedCaps`): the record is how `cap show` and a later sweep know a lock is in
place. Applying and resetting run under the sweep's safety layer (`dvfs.gpu.safety`: per-GPU
locks, state files, signals unwinding), which is why this lives apart from the file format.
Simulated caps are refused unless asked explicitly (`allow_simulated`), and then matched by
model name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from dvfs.caps.files import CapsFile, base_model_name, headroom_again, plan_again
from dvfs.errors import (
    CapsError,
    CapsRecordError,
    GpuBusyError,
    GpuError,
    GpuLockFileError,
    GpuPermissionError,
    GpuStateError,
    GpuUnavailableError,
)
from dvfs.gpu.base import Gpu, mig_off_advice, unsupported_clock
from dvfs.gpu.knobs import (
    REFUSED,
    ChangeLog,
    GatheredFailures,
    KnobController,
    RestoreBugError,
    bug_as_failure,
    power_limit_or_none,
    restore_guarded,
    side_by_side,
)
from dvfs.gpu.safety import before_this_boot, boot_id, record_problem, state_dir_command

if TYPE_CHECKING:
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

APPLIED_NAME = "caps-applied.json"
#: The format of the caps record's entries this dvfs writes and reads, in each entry under
#: `FORMAT_KEY` (in each entry, not beside them: an older dvfs carries an entry's keys it does
#: not know along, so going back to one reads the record still). An entry without it was
#: written before the key was: format 1. One of a later format (a newer dvfs, then a
#: downgrade) is refused, not misread (`AppliedCaps._refuse_newer`).
RECORD_FORMAT = 1
FORMAT_KEY = "record_format"
#: What dvfs's caps record is, in words, for the line of one that is not.
RECORD_SHAPE = "a JSON object of per-GPU objects"


class NewerCapsRecordError(CapsRecordError):
    """dvfs's caps record has an entry of a later format than `RECORD_FORMAT` (a newer dvfs
    wrote it, then a downgrade): its line says what to do itself."""


class CapsPartlyAppliedError(CapsError):
    """Caps were applied to the GPUs the file matches; entries for others matched nothing."""

    exit_code = 5


@dataclass(frozen=True)
class CapAction:
    """What applying a caps file does to one GPU. A knob the file leaves at stock that an
    earlier `cap apply` capped goes back to what it was before dvfs capped it (`unlock`,
    `power_limit_back`): the file says what the GPU holds, so the earlier cap must not stay on
    it unrecorded, and the power limit goes back as `cap reset --applied` puts it back (the
    one that cap replaced, as recorded), not to the default over an operator's own."""

    index: int
    uuid: str
    lock_mhz: tuple[int, int] | None
    power_limit_mw: int | None
    #: None: NVML does not support this GPU's power limit (its entry caps only clocks)
    current_power_limit_mw: int | None
    unlock: bool = False
    #: An earlier apply's power limit this file leaves at stock: the limit put back (None:
    #: left be, one set outside dvfs since) and its words (`_limit_replaced`); None: no such
    power_limit_back: tuple[int | None, str] | None = None
    #: Why the power limit is left as it is, its caps record entry's cap damaged
    #: (`_spoiled_power`): the apply fails on it once the clock is done; "" where not so
    power_doubt: str = ""
    #: Why this GPU is left as it is whole, its power limit one whose owner cannot be told
    #: (`_doubtful_limit`): the apply fails on it, exit 1, once the other GPUs are capped (a
    #: refused plan left every GPU of the host uncapped); "" where not so
    refused: str = ""

    def describe(self) -> str:
        """The GPU and its caps, for "would apply to ..." (a dry run) or "applied to ..."."""
        parts = []
        if self.lock_mhz:
            parts.append(f"SM clock locked to {self.lock_mhz[0]}-{self.lock_mhz[1]} MHz")
        elif self.unlock:
            parts.append("SM clock unlocked (stock in this file; an earlier cap apply locked it)")
        if self.power_limit_back is not None:
            parts.append(
                f"{self.power_limit_back[1]}, none in this file (an earlier cap apply set one)"
            )
        if self.power_limit_mw is not None and not self.power_doubt:
            current = self.current_power_limit_mw  # read (a GPU without one is set aside)
            change = (
                "unchanged"
                if self.power_limit_mw == current
                else f"from {(current or 0) / 1000:g} W"
            )
            parts.append(f"power limit {self.power_limit_mw / 1000:g} W ({change})")
        if self.power_doubt:
            parts.append("power limit left as it is (dvfs's caps record's cap is damaged)")
        return f"GPU {self.index} ({self.uuid}): " + ", ".join(parts)


def record_fix(directory: Path) -> str:
    """What mends a damaged caps record in `directory`, as its error's tail: removed alone, the
    next `cap apply` would take the caps in force (dvfs's own) for the limits they replaced,
    and `cap reset --applied` put those back; so the GPUs are reset first."""
    from dvfs.gpu.safety import state_dir_flag

    return (
        f"; remove it, reset the GPUs with `dvfs cap reset{state_dir_flag(directory)}` (the "
        "limits dvfs's caps replaced are lost with it), then apply again"
    )


class AppliedCaps:
    """dvfs's record of the caps it applied (NVML cannot read a clock lock back)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / APPLIED_NAME

    def read(self) -> dict[str, dict[str, Any]]:
        """The caps in force by dvfs's record: entries applied during an earlier boot are left
        out, since the reboot reset those GPUs (and the next write drops them)."""
        return self._entries(checked=True)

    def entries_as_written(self) -> dict[str, dict[str, Any]]:
        """`read` without checking each entry's knobs: the entries a change to one GPU's
        carries as they are; CapsError where the file is no JSON object of objects."""
        return self._entries(checked=False)

    def _entries(self, *, checked: bool) -> dict[str, dict[str, Any]]:
        """`read`, each entry's knobs checked (`checked`) or carried as they are: a change to
        one GPU's entry (`update`) must not stop at another's damaged one, nor a reset at the
        damaged entry it drops, as `cap reset` (the caps unit's stop) does. A record damaged
        whole that was last written during an earlier boot (`written_before_this_boot`) holds
        no cap in force, the reboot having reset its GPUs: read as none (`damaged_lines` says
        so), the next write replacing it, not refused at every boot until removed by hand."""
        try:
            data = self._load()
        except CapsRecordError:
            if self.written_before_this_boot():
                return {}
            raise
        self._refuse_newer(data, checked=checked)
        for uuid, r in data.items():  # what sweeps, governors and `dvfs doctor` read of each
            spoiled = _spoiled_knobs(r) if checked else {}
            if spoiled and not before_this_boot(r.get("boot"), r.get("applied")):
                key, problem = next(iter(spoiled.items()))
                raise self._damaged(uuid, key, problem, power="power_limit_mw" in spoiled)
        return {
            u: r for u, r in data.items() if not before_this_boot(r.get("boot"), r.get("applied"))
        }

    def written_before_this_boot(self) -> bool:
        """Whether the record is a plain file last written before this boot began, by more
        than a clock step (`BOOT_CLOCK_MARGIN_S`): every entry it holds is an earlier boot's.
        False where that cannot be told."""
        import stat

        from dvfs.gpu.safety import BOOT_CLOCK_MARGIN_S, boot_started

        started = boot_started()
        try:
            status = self.path.lstat()
        except OSError:
            return False
        return (
            started is not None
            and stat.S_ISREG(status.st_mode)
            and status.st_mtime < started - BOOT_CLOCK_MARGIN_S
        )

    def _load(self) -> dict[str, dict[str, Any]]:
        """The record's JSON object of per-GPU objects ({} where there is none); CapsRecordError
        where it is unreadable or no such object."""
        from dvfs.gpu.safety import load_record, record_problem, state_folder_problem

        try:  # (a FIFO is refused, not waited on for ever; a folder or a link in a loop is no
            # record either)
            data = load_record(self.path)
        except FileNotFoundError:  # none, or removed meanwhile (the last GPU's entry reset)
            return {}
        except (ValueError, OSError) as exc:  # UnicodeDecodeError included
            # (a --state-dir under a file: the folder is at fault, and no record is there)
            folder = state_folder_problem(self.path.parent) if isinstance(exc, OSError) else None
            if folder is not None:
                raise CapsRecordError(folder) from exc
            why = record_problem(exc)
            fix = record_fix(self.path.parent)
            raise CapsRecordError(f"{self.path} is unreadable ({why}){fix}") from exc
        if not isinstance(data, dict) or not all(isinstance(r, dict) for r in data.values()):
            raise CapsRecordError(
                f"{self.path} is not a dvfs caps record ({RECORD_SHAPE})"
                + record_fix(self.path.parent)
            )
        return data

    def _refuse_newer(self, data: dict[str, dict[str, Any]], *, checked: bool = True) -> None:
        """Refuse (`CapsRecordError`) a record with an entry of this boot in a format this dvfs
        does not know (`RECORD_FORMAT`): a newer dvfs wrote it, whose keys this one could
        misread or drop on its next write. An earlier boot's entry is dropped unread, as
        ever. An entry whose format is damaged (no format number: null, "1", true or 1.0,
        which Python's 1 == True == 1.0 would pass for format 1; a hand edit, no dvfs's) is
        damaged for that GPU alone, as a damaged knob is (`_spoiled_knobs`): readers that must
        know its caps (`checked`) refuse the record naming it; `cap apply` and `cap reset`
        carry it as it is, its knobs checked each, and `damaged_lines` says so."""
        from dvfs.gpu.safety import state_dir_flag
        from dvfs.version import __version__

        for uuid, r in data.items():
            found = r.get(FORMAT_KEY, 1)
            if before_this_boot(r.get("boot"), r.get("applied")):
                continue
            if _positive_int(found) and found == RECORD_FORMAT:
                continue
            where = f"{self.path} line {self.line_of(uuid, FORMAT_KEY)}"
            if not _positive_int(found):
                if not checked:
                    continue
                raise CapsRecordError(
                    f"{where} is damaged for GPU {uuid[:48]}: {_damaged_format(found)}; this "
                    "command must know the caps dvfs's record holds on that GPU (to put them "
                    "back, or to tell them from the GPU's own), so it refuses the record: write "
                    f"{RECORD_FORMAT} there, or reset that GPU with `dvfs cap reset"
                    f"{state_dir_flag(self.path.parent)} {uuid[:48]}`, which drops its entry "
                    "alone"
                )
            if found > RECORD_FORMAT:
                raise NewerCapsRecordError(
                    f"{where}: GPU {uuid[:48]}'s entry is in caps record format {found}, written "
                    f"by a newer dvfs; this dvfs ({__version__}) reads format {RECORD_FORMAT} "
                    "only: run the newer dvfs again (its `dvfs cap reset --applied"
                    f"{state_dir_flag(self.path.parent)}` puts the GPUs back), or remove the "
                    f"record, then reset the GPUs with `dvfs cap reset"
                    f"{state_dir_flag(self.path.parent)}` (the limits dvfs's caps replaced are "
                    "lost with it)"
                )

    def line_of(self, uuid: str, key: str) -> int:
        """The line of the record that holds `key` of a GPU's entry (dvfs writes one key a
        line), for a warning naming it: the first line holding `key` from the one naming the
        GPU on; 1 where the file cannot be read (or is one line)."""
        from dvfs.gpu.safety import read_record

        try:
            lines = read_record(self.path).splitlines()
        except (ValueError, OSError):
            return 1
        start = next((i for i, line in enumerate(lines) if f'"{uuid}"' in line), 0)
        found = (i for i in range(start, len(lines)) if f'"{key}"' in lines[i])
        return next(found, start) + 1

    def _damaged(self, uuid: str, key: str, problem: str, *, power: bool) -> CapsRecordError:
        """The refusal of a record whose entry's `key` is damaged (`problem`, in words) by a
        reader that must know that knob's value. `power`: its power limit is damaged too."""
        from dvfs.gpu.safety import state_dir_flag

        what = "clock lock" if key == "lock_mhz" else "power limit"
        # (a damaged lock alone: `--applied` unlocks it and puts back the limit dvfs's cap
        # replaced, known still, not the default over an operator's own)
        applied = "" if power else " --applied"
        return CapsRecordError(
            f"{self.path} line {self.line_of(uuid, key)} is damaged for GPU "
            f"{uuid[:48]}: {problem}; this command must know the {what} dvfs's cap "
            "holds on that GPU (to put it back, or to tell it from the GPU's own), so "
            "it refuses the record: write it there, or reset that GPU with `dvfs cap "
            f"reset{applied}{state_dir_flag(self.path.parent)} {uuid[:48]}`, which drops "
            "its entry alone"
        )

    def locks(self) -> dict[str, tuple[int, int]]:
        return {u: tuple(r["lock_mhz"]) for u, r in self.read().items() if r.get("lock_mhz")}

    def locks_on(self, gpus: Sequence[Gpu]) -> dict[str, tuple[int, int]]:
        """`locks`, each of these GPUs' checked against its SM clocks: a lock outside them (a
        hand edit: a clock above the GPU's top one) is no cap dvfs set, and a sweep or a
        governor that took it for the GPU's stock held it as its ceiling and failed to put it
        back at the end ("could not restore"), the GPU left at its last step: refused, as a
        damaged entry is, before any GPU is changed."""
        locks = self.locks()
        for gpu in gpus:
            problem = _lock_outside(gpu, locks.get(gpu.identity.uuid))
            if problem:
                raise self._damaged(gpu.identity.uuid, "lock_mhz", problem, power=False)
        return locks

    def refuse_power_outside(self, gpus: Sequence[Gpu]) -> None:
        """Refuse the record, as a damaged entry is, where its `power_limit_mw` for one of these
        GPUs is outside that GPU's range (a hand edit, a cap dvfs never set there): a
        measurement must know dvfs's cap to measure stock without it, and took the GPU's limit
        (dvfs's real cap) for an operator's own, its stock, so production caps passed as stock
        in a cube. `cap apply` and `cap reset --applied` leave that limit as it is instead
        (`_spoiled_power`)."""
        limits_mw = self.power_limits_mw()
        for gpu in gpus:
            problem = _power_outside(gpu, limits_mw.get(gpu.identity.uuid))
            if problem:
                raise self._damaged(gpu.identity.uuid, "power_limit_mw", problem, power=True)

    def outside_lines(self, gpus: Sequence[Gpu]) -> list[str]:
        """A warning line for each of these GPUs whose entry's clock lock or power limit is
        outside the GPU's range (a hand edit), which sweeps and `dvfs govern` refuse as damaged
        (`locks_on`, `refuse_power_outside`), for `cap show`, which showed it as dvfs's cap.
        [] where the record cannot be read or is damaged otherwise (said as that is)."""
        try:
            locks, limits_mw = self.locks(), self.power_limits_mw()
        except CapsError:
            return []
        lines = []
        for gpu in gpus:
            uuid, number = gpu.identity.uuid, gpu.identity.index
            try:
                lock = _lock_outside(gpu, locks.get(uuid))
                power = _power_outside(gpu, limits_mw.get(uuid))
            except GpuError:  # (what NVML cannot tell of that GPU is said where it is shown)
                continue
            for key, problem in (("lock_mhz", lock), ("power_limit_mw", power)):
                if not problem:
                    continue
                damaged = (
                    f"dvfs's caps record {self.path} line {self.line_of(uuid, key)} is damaged "
                    f"for GPU {number} ({uuid}): {problem}"
                )
                if key == "lock_mhz":
                    unlock = state_dir_command(
                        f"dvfs cap reset --applied {number}", self.path.parent
                    )
                    lines.append(
                        f"{damaged}; sweeps and `dvfs govern` refuse the record, having to put "
                        f"that lock back: write dvfs's lock there, or `{unlock}`"
                    )
                else:
                    default = state_dir_command(f"dvfs cap reset {number}", self.path.parent)
                    lines.append(
                        f"{damaged}; whether the GPU's power limit is dvfs's cap cannot be told, "
                        "and sweeps and `dvfs govern` refuse the record: write dvfs's cap there "
                        f"in mW, or put back the default with `{default}`"
                    )
        return lines

    def damaged_lines(self, index: dict[str, int] | None = None) -> list[str]:
        """A warning line for each damaged limit a GPU's entry names beside its caps
        (`_damaged_before`: the one dvfs's cap replaced, or `EARLIER`), which every reader
        otherwise passes over: the other GPUs' entries, and this one's caps, are honoured, and
        the line says what that means for that key and what to do. `index`: the GPUs' indices
        by UUID, to name them by. [] where the record cannot be read (its readers refuse it,
        saying so)."""
        from dvfs.gpu.safety import state_dir_flag

        try:
            self._load()
        except CapsRecordError as exc:
            if not self.written_before_this_boot():
                return []  # (refused by its readers, saying so)
            told = str(exc).removesuffix(record_fix(self.path.parent))
            told = told.removeprefix(f"{self.path} ")
            # ("dvfs's caps record is not a JSON object ...", not "... is not a dvfs caps record")
            told = told.replace(
                f"is not a dvfs caps record ({RECORD_SHAPE})", f"is not {RECORD_SHAPE}"
            )
            return [
                f"dvfs's caps record {told}: {self.path} was "
                "last written before this boot, whose reboot reset the GPUs it listed, so it "
                "is read as holding no cap; the next `dvfs cap apply` replaces it"
            ]
        try:
            entries = self.entries_as_written()
        except CapsError:
            return []
        reset = f"`dvfs cap reset --applied{state_dir_flag(self.path.parent)}`"
        lines = []
        for uuid, entry in entries.items():
            if before_this_boot(entry.get("boot"), entry.get("applied")):
                continue
            gpu = f"GPU {index[uuid]} ({uuid})" if index and uuid in index else f"GPU {uuid[:48]}"
            number = str(index[uuid]) if index and uuid in index else uuid[:48]
            found = entry.get(FORMAT_KEY, 1)
            if not _positive_int(found):  # (a later format's is refused, by `_refuse_newer`)
                lines.append(
                    f"dvfs's caps record {self.path} line {self.line_of(uuid, FORMAT_KEY)} is "
                    f"damaged for {gpu}: {_damaged_format(found)}; its caps are read as format "
                    f"{RECORD_FORMAT}'s, each checked, by `dvfs cap apply` and {reset}, but "
                    "sweeps and `dvfs govern` refuse the record: write "
                    f"{RECORD_FORMAT} there, or `"
                    + state_dir_command(f"dvfs cap reset {number}", self.path.parent)
                    + "`"
                )
            spoiled = _spoiled_knobs(entry)
            for key, problem in spoiled.items():
                damaged = (
                    f"dvfs's caps record {self.path} line {self.line_of(uuid, key)} is damaged "
                    f"for {gpu}: {problem}"
                )
                if key == "lock_mhz":
                    unlock = state_dir_command(
                        f"dvfs cap reset --applied {number}", self.path.parent
                    )
                    lines.append(
                        f"{damaged}; which clock lock dvfs's cap holds there cannot be told: `dvfs "
                        f"cap apply` locks the file's clock or unlocks it, and {reset} unlocks it "
                        "(its power limit honoured by both), but sweeps and `dvfs govern` refuse "
                        f"the record, having to put that lock back: write it there, or `{unlock}`"
                    )
                else:
                    default = state_dir_command(f"dvfs cap reset {number}", self.path.parent)
                    lines.append(
                        f"{damaged}; whether the GPU's power limit is that cap cannot be told: "
                        f"`dvfs cap apply` and {reset} leave it as it is, failing (exit 1), its "
                        "clock lock honoured by both, and sweeps and `dvfs govern` refuse the "
                        f"record: write dvfs's cap there in mW, or put back the default with "
                        f"`{default}`"
                    )
            if "power_limit_mw" in spoiled:  # (what it replaced is moot beside it)
                continue
            for problem, key in _damaged_before(entry):
                damaged = f"dvfs's caps record {self.path} is damaged for {gpu}: {problem}"
                if not isinstance(entry.get("power_limit_mw"), int):  # (read beside one only)
                    lines.append(
                        f"{damaged}, but it lists no power limit dvfs set on that GPU, so the "
                        "value is not used: write null there"
                    )
                elif key == DEFAULT_THEN:
                    lines.append(
                        f"{damaged}, expected the GPU's default power limit in mW when dvfs's cap "
                        "replaced its limit, or null; its caps are honoured, but whether the "
                        f"driver was reloaded since cannot be told, so {reset} puts back its "
                        "default power limit, not the limit dvfs's cap replaced (perhaps the old "
                        "driver's): to have that put back, write that default in mW there"
                    )
                elif key == EARLIER:
                    lines.append(
                        f"{damaged}, expected the power limit in mW of dvfs's earlier cap, which "
                        "a stopped `dvfs cap apply` may have left on the GPU, or null; its caps "
                        "are honoured, but that earlier cap, where the GPU holds it, is taken for "
                        f"a limit set outside dvfs, which {reset} leaves be: write that earlier "
                        "cap in mW there"
                    )
                else:
                    lines.append(
                        f"{damaged}, expected the power limit in mW that dvfs's cap replaced, or "
                        f"null; its caps are honoured, and {reset} puts back its default power "
                        "limit: to have it put back the limit the GPU had before dvfs capped it, "
                        "write that limit in mW there"
                    )
        return lines

    def power_limits_mw(self) -> dict[str, int]:
        """The power limits dvfs applied, by GPU UUID (a measurement's stock is not these)."""
        return {
            u: int(r["power_limit_mw"])
            for u, r in self.read().items()
            if isinstance(r.get("power_limit_mw"), int)
        }

    def power_limits_held(self, gpus: Sequence[Gpu]) -> dict[str, int]:
        """`power_limits_mw`, but where a GPU holds dvfs's earlier cap that a signal left in
        place (`EARLIER`), that one: dvfs's too, which a measurement lifts (`measuring`) and
        `dvfs doctor` names as dvfs's caps in force, not as the GPU's own stock."""
        applied, entries = self.power_limits_mw(), self.read()
        for gpu in gpus:
            earlier = _earlier_cap(entries.get(gpu.identity.uuid, {}))
            if earlier is not None and power_limit_or_none(gpu) == earlier:
                applied[gpu.identity.uuid] = earlier
        return applied

    def measuring(
        self, gpus: Sequence[Gpu], *, actuation: bool = True, change_log: ChangeLog | None = None
    ) -> KnobController:
        """The knob controller of a measurement (a sweep, a roofline, a settle time): it
        restores the caps recorded here, and measures stock as the GPUs' own stock, not under
        them (unlocked clocks, the default power limit), so production caps never pass as
        stock in a cube."""
        self.refuse_power_outside(gpus)
        return KnobController(
            gpus,
            actuation=actuation,
            change_log=change_log,
            prior_locks=self.locks_on(gpus),
            applied_power_mw=self.power_limits_held(gpus),
            stock_without_caps=True,
        )

    def write(self, records: dict[str, dict[str, Any]]) -> None:
        from dvfs.gpu.safety import ensure_dir, write_json_atomic

        if not records:
            if self.path.exists():
                self.path.unlink()
            return
        ensure_dir(self.path.parent)
        write_json_atomic(
            self.path, {u: {**r, FORMAT_KEY: RECORD_FORMAT} for u, r in records.items()}
        )

    def update(self, uuid: str, entry: dict[str, Any] | None) -> None:
        """Set (or, with None, drop) one GPU's entry, read and written under a lock on the
        record: two dvfs processes capping or resetting different GPUs (each holding only its
        GPUs' locks) never lose each other's entries."""
        import fcntl

        lock = self._open_lock()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            records = self.entries_as_written()
            if entry is None:
                records.pop(uuid, None)
            else:
                records[uuid] = entry
            self.write(records)
        finally:
            os.close(lock)

    def check_writable(self) -> None:
        """Refuse, before any GPU is changed, a record whose lock cannot be opened (a folder in
        its place, a state folder dvfs may not write): else `cap apply` fails on its first
        `update` with that GPU's clocks already locked, a cap no record lists."""
        os.close(self._open_lock())

    def refuse_a_folder_lock(self) -> None:
        """`check_writable`'s refusal of a folder in the lock's place (`CapsRecordError`), or of
        a link to a file in a missing folder (`FileNotFoundError`), read without making
        anything: a dry run's, which may not write the state folder."""
        from dvfs.gpu.safety import broken_lock_link, users_lock_link

        path = self.path.with_name(f"{self.path.name}.lock")
        planted = users_lock_link(path, "caps record lock")  # as root, `_open_lock` refuses it
        if planted is not None:
            raise CapsRecordError(planted)
        if path.is_dir():
            raise CapsRecordError(_a_folder(path))
        if path.is_symlink() and not path.exists():
            try:
                os.stat(path)
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # a link in a loop, which no open gets through
                    raise OSError(exc.errno, exc.strerror, str(path)) from None
            if not Path(os.path.realpath(path)).parent.is_dir():
                # a link to a file in a folder that is not there: the apply's open cannot make it
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
            # a link to a folder's name that is none ("x.lock/"): the apply's open says "is a
            # directory" of it, where no lock file is made
            broken = broken_lock_link(path, "caps record lock")
            if broken is not None:
                raise CapsRecordError(broken)

    def _open_lock(self) -> int:
        """The record's lock file, opened (made if missing) without blocking: a FIFO in its
        place (which no reader may ever open) is locked as the file is, not waited on for ever,
        a GPU capped meanwhile."""
        from dvfs.gpu.safety import broken_lock_link, ensure_dir, users_lock_link

        ensure_dir(self.path.parent)
        path = self.path.with_name(f"{self.path.name}.lock")
        # as root, not through a user's link (a shared state folder): to a file of theirs to
        # be made, they could remove the lock another `cap apply` holds, and two wrote the record
        planted = users_lock_link(path, "caps record lock")
        if planted is not None:
            raise CapsRecordError(planted)
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o666)
        except IsADirectoryError:  # no bad --state-dir: a folder in the lock's place, or a link
            # to a folder's name that is none ("x.lock/"), named as the link it is
            broken = broken_lock_link(path, "caps record lock")
            raise CapsRecordError(broken or _a_folder(path)) from None


def _a_folder(path: Path) -> str:
    """A folder where a caps or governor record (or the caps record's lock) belongs, in the
    words the records' readers use (`read_record`)."""
    return f"{path} is unreadable (no regular file: a folder); remove it"


def _record_problem(record: dict[str, Any]) -> str | None:
    """What is wrong with one GPU's entry of the caps record (a damaged or hand-edited file),
    in words; None when its knobs are a clock lock (two clocks in MHz, low first) or null and a
    power limit (mW) or null. (A damaged limit dvfs's cap replaced is no such problem: the caps
    in force are known still, `_damaged_before` names it.)"""
    return next(iter(_spoiled_knobs(record).values()), None)


def _spoiled_knobs(record: Mapping[str, Any]) -> dict[str, str]:
    """Each knob of a caps record entry whose value is damaged (a hand edit: a lock of one
    clock, text, a float), by key, in words ("lock_mhz is "1500", expected ..."): dvfs set
    that knob (the value is not null), but to what cannot be told. `cap apply` and `cap reset`
    act on such an entry's other knob all the same (`damaged_lines` names the key, file and
    line); readers that must know the value (a sweep puts dvfs's caps back) refuse the record."""
    found = {}
    lock = record.get("lock_mhz")
    if lock is not None and not _is_lock(lock):
        found["lock_mhz"] = (
            f"lock_mhz is {json.dumps(lock)[:40]}, expected two clocks in MHz, low first, or null"
        )
    power = record.get("power_limit_mw")
    if power is not None and not _positive_int(power):
        found["power_limit_mw"] = (
            f"power_limit_mw is {json.dumps(power)[:40]}, expected a power limit in mW or null"
        )
    return found


def _spoiled_power(
    gpu: Gpu, entry: Mapping[str, Any], current: int | None, directory: Path | None = None
) -> str:
    """Why a GPU's power limit `current` is left as it is, where its caps record `entry` says
    dvfs capped it but the cap is damaged (`_spoiled_knobs`): whether the GPU holds dvfs's cap
    or an operator's limit since cannot be told, so neither `cap reset --applied` nor `cap
    apply` may take it for one (the default over an operator's limit, or an operator's taken
    for the limit dvfs's cap replaced). "" where the cap is not damaged, or the GPU holds the
    limit it replaced (nothing to tell), or NVML does not support its power limit."""
    power = entry.get("power_limit_mw")
    before = entry.get("power_limit_before_mw")
    if power is None or current is None:
        return ""
    what = "no power limit in mW"
    if _positive_int(power):  # a limit dvfs set on this GPU, unless no GPU here takes it (a
        # hand edit): the GPU's own limit would then be taken for an operator's set since
        limits = gpu.power_limit_range()
        if limits.outside(power) is None:
            return ""
        what = f"outside this GPU's range {limits.describe_w()}, no cap dvfs set"
    if _positive_int(before) and current == before:
        return ""
    index = gpu.identity.index
    return (
        f"GPU {index}'s power limit {current / 1000:g} W was left as it is: dvfs's caps record "
        f"says dvfs capped it, but its power_limit_mw is {json.dumps(power)[:40]}, {what}, "
        "so whether the GPU holds that cap cannot be told; write dvfs's cap there "
        f"in mW and run this again, or put back its default with `{_reset(index, directory)}`"
    )


def _reset(index: int, directory: Path | None) -> str:
    """The `dvfs cap reset N` that puts back a GPU's defaults, with the --state-dir it needs to
    read `directory`, the caps record's folder, where known."""
    command = f"dvfs cap reset {index}"
    return command if directory is None else state_dir_command(command, directory)


def _lock_outside(gpu: Gpu, lock: tuple[int, int] | None) -> str | None:
    """What is wrong with a caps record's clock lock outside the GPU's SM clocks (a hand edit:
    a clock above its top one), in words; None for none, or one within them."""
    if lock is None:
        return None
    supported = gpu.supported_sm_clocks_mhz()  # (NVML takes any clock within them)
    if lock[0] >= min(supported) and lock[1] <= max(supported):
        return None
    return (
        f"lock_mhz is [{lock[0]}, {lock[1]}], outside GPU {gpu.identity.index}'s SM clocks "
        f"{min(supported)}-{max(supported)} MHz, no cap dvfs set"
    )


def _power_outside(gpu: Gpu, limit: int | None) -> str | None:
    """What is wrong with a caps record's power limit outside the GPU's range (a hand edit),
    in words; None for none, one within it, or a GPU without a power limit."""
    if limit is None or power_limit_or_none(gpu) is None:
        return None
    limits = gpu.power_limit_range()
    if limits.outside(limit) is None:
        return None
    return (
        f"power_limit_mw is {limit}, outside GPU {gpu.identity.index}'s range "
        f"{limits.describe_w()}, no cap dvfs set"
    )


def _damaged_before(record: dict[str, Any]) -> list[tuple[str, str]]:
    """A caps record entry's damaged `power_limit_before_mw` (the limit dvfs's cap replaced),
    `EARLIER` and `DEFAULT_THEN`, each as its key and value ("power_limit_before_mw is "600
    W"") and its key; [] where each is a power limit in mW or absent or null. Such an entry's
    caps are honoured all the same, the damaged value taken as unknown (a damaged replaced
    limit: `cap reset --applied` puts back the default; a damaged earlier cap: none, as
    without one; a damaged default then: whether the driver was reloaded since cannot be
    told, so the default, not the replaced limit, perhaps the old driver's)."""
    found = []
    for key in ("power_limit_before_mw", EARLIER, DEFAULT_THEN):
        value = record.get(key)
        if value is not None and not _positive_int(value):
            found.append((f"{key} is {json.dumps(value)[:40]}", key))
    return found


#: A caps record entry's earlier dvfs power limit the GPU may still hold: a signal (the caps
#: unit's stop) ended the change from it to `power_limit_mw` before the change was known to
#: land, so either is dvfs's cap, and `cap reset --applied` and the next `cap apply` take the
#: GPU's limit for dvfs's, not an operator's, where it is either. Dropped once a change lands.
EARLIER = "power_limit_earlier_mw"
#: The `power_limit_mw` an `EARLIER` cap was recorded beside: an older dvfs, which knows
#: neither key, carries both along when it changes the cap, so an earlier cap beside another
#: (or beside none said, a damaged value) is stale, no longer known to be dvfs's
#: (`_doubtful_limit`). An entry without the key was written by a dvfs before it, which
#: wrote `EARLIER` only beside the cap it was changing to (and dropped it once a change
#: landed): that one is taken as written beside the `power_limit_mw` it lists, as that dvfs
#: took it, so a plain upgrade after a stopped `cap apply` is not refused.
EARLIER_FOR = "power_limit_earlier_for_mw"
#: The GPU's default power limit when dvfs's cap replaced `power_limit_before_mw`: where the
#: default differs now, the driver was reloaded since (in the same boot: rmmod and modprobe, an
#: update without a reboot), which put its own default on the GPU, and the limit the cap
#: replaced is the old driver's, not to be put back (`_limit_replaced`). Absent in a record an
#: older dvfs wrote: the replaced limit is then put back as before.
DEFAULT_THEN = "power_limit_default_then_mw"


def _earlier_cap(entry: Mapping[str, Any]) -> int | None:
    """A caps record entry's `EARLIER` cap where it is a power limit in mW recorded beside the
    entry's `power_limit_mw` (`EARLIER_FOR`); None where absent, null, damaged (a float, a
    string, true: `damaged_lines` says it is taken for none, and 500000.0 or true must not pass
    for the GPU's limit by Python's 500000 == 500000.0 or 1 == True) or stale (recorded beside
    another cap: `_doubtful_limit`)."""
    earlier = entry.get(EARLIER)
    return earlier if _positive_int(earlier) and _earlier_bound(entry) else None


def _earlier_bound(entry: Mapping[str, Any]) -> bool:
    """Whether an entry's `EARLIER` cap was recorded beside the cap the entry lists now (one
    without `EARLIER_FOR`, an older dvfs's, beside the cap it lists)."""
    applied = entry.get("power_limit_mw")
    beside = entry.get(EARLIER_FOR, applied)  # (null there: damaged, not absent)
    return _positive_int(beside) and _positive_int(applied) and beside == applied


class DoubtfulLimitError(GpuError):
    """A GPU holds the power limit its caps record entry names as dvfs's earlier cap, but one
    recorded beside another cap than the entry lists now: whether dvfs set it cannot be told,
    so it is left as it is (`_doubtful_limit`)."""


def _doubtful_limit(
    gpu: Gpu, entry: Mapping[str, Any], current: int | None, directory: Path | None = None
) -> None:
    """Refuse (`DoubtfulLimitError`) to take a GPU's power limit `current` for an operator's or
    for dvfs's where it is the `EARLIER` cap of its caps record `entry` but that cap is stale:
    recorded beside another cap than `power_limit_mw` (or beside none said, or none listed
    now), an older dvfs having changed the cap since and carried the value along. Taken for
    dvfs's, `cap reset --applied` put back the limit dvfs's first cap replaced over an
    operator's; taken for the operator's, dvfs's own earlier cap would stay. Nothing where the
    GPU holds the cap the entry lists, or the limit it replaced."""
    earlier = entry.get(EARLIER)
    if (
        current is None
        or not _positive_int(earlier)
        or _earlier_bound(entry)
        or current != earlier
        or current in (entry.get("power_limit_mw"), entry.get("power_limit_before_mw"))
    ):
        return
    index, beside, applied = gpu.identity.index, entry.get(EARLIER_FOR), entry.get("power_limit_mw")
    now = f"the {applied / 1000:g} W it lists now" if _positive_int(applied) else "none, as now"
    when = (
        f"beside a cap of {beside / 1000:g} W, not {now}"
        if _positive_int(beside)
        else f"beside a cap its {EARLIER_FOR} does not say (damaged), not {now}"
        if EARLIER_FOR in entry
        else "beside a cap the entry no longer lists"
    )
    raise DoubtfulLimitError(
        f"GPU {index}'s power limit {current / 1000:g} W is the one dvfs's caps record names as "
        f"dvfs's earlier cap ({EARLIER}), but that was recorded {when}, and an older dvfs may "
        "have changed the cap since, so whether dvfs or someone else set it cannot be told: it "
        f"is left as it is; set the limit the GPU should have (`nvidia-smi -i {index} -pl "
        f"WATTS`), or its defaults with `{_reset(index, directory)}` (the way to keep "
        f"{current / 1000:g} W: that reset, then `nvidia-smi -i {index} -pl {current / 1000:g}`;"
        " set again alone, it stays doubtful), then run this again"
    )


def _damaged_format(found: Any) -> str:
    """A caps record entry's damaged `FORMAT_KEY` (no format number), in words."""
    return f"{FORMAT_KEY} is {json.dumps(found)[:40]}, expected a format number"


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_lock(lock: Any) -> TypeGuard[list[int]]:
    """Whether a record's `lock_mhz` is a clock lock: two clocks in MHz, low first (one
    written the other way round by hand would be shown as "1500-210 MHz")."""
    return (
        isinstance(lock, list)
        and len(lock) == 2
        and all(_positive_int(x) for x in lock)
        and lock[0] <= lock[1]
    )


class GovernorLocks:
    """The clock lock a running `dvfs govern` holds on each GPU, one file per GPU.

    NVML cannot read a lock back, so without this record `cap show` and `dvfs monitor` would
    see only the static caps while the governor holds a lower lock. A GPU's file is written
    (atomically) only by the process that holds the GPU's lock, so governors of different GPUs
    never race; it is removed when the governor puts the GPU back, and after a crash by
    `dvfs gpu reset` or `dvfs cap reset`, which put it back.
    """

    PREFIX = "governed-"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, uuid: str) -> Path:
        return self.directory / f"{self.PREFIX}{uuid}.json"

    def write(self, uuid: str, lock_mhz: tuple[int, int]) -> None:
        from dvfs.gpu.safety import ensure_dir, write_json_atomic

        ensure_dir(self.directory)
        write_json_atomic(
            self.path(uuid),
            {
                "lock_mhz": list(lock_mhz),
                "pid": os.getpid(),
                "since": datetime.now(UTC).isoformat(timespec="seconds"),
                "boot": boot_id(),
            },
        )

    def clear(self, uuid: str) -> None:
        try:
            self.path(uuid).unlink()
        except FileNotFoundError:
            pass
        except IsADirectoryError:  # no bad --state-dir: a folder in the record's place
            raise CapsRecordError(_a_folder(self.path(uuid))) from None

    def read(self) -> dict[str, dict[str, Any]]:
        """Each governed GPU's record by UUID (a file that vanishes meanwhile: not governed),
        but those written during an earlier boot, which reset the GPUs' locks (a power loss
        while governing leaves the record; `recorded` still lists them, to be cleared)."""
        return {
            u: r
            for u, r in self.recorded().items()
            if not before_this_boot(r.get("boot"), r.get("since"))
        }

    def recorded(self, uuids: Collection[str] | None = None) -> dict[str, dict[str, Any]]:
        """Every record on disk, an earlier boot's included; with `uuids`, only those GPUs'
        (another GPU's damaged record must not stop a reset of these)."""
        if not self.directory.is_dir():
            return {}
        from dvfs.gpu.safety import load_record, record_problem

        found = {}
        for path in sorted(self.directory.glob(f"{self.PREFIX}GPU-*.json")):
            if (
                uuids is not None
                and path.name.removeprefix(self.PREFIX).removesuffix(".json") not in uuids
            ):
                continue
            try:  # (a FIFO is refused, not waited on for ever; a folder is no record either)
                data = load_record(path)
            except FileNotFoundError:
                continue
            except (ValueError, OSError) as exc:  # UnicodeDecodeError included
                raise CapsRecordError(
                    f"{path} is unreadable ({record_problem(exc)}); remove it"
                ) from exc
            lock = data.get("lock_mhz") if isinstance(data, dict) else None
            if lock is None:
                raise CapsRecordError(
                    f"{path} is not a dvfs governor record (no lock_mhz); remove it"
                )
            if not _is_lock(lock):
                raise CapsRecordError(
                    f"{path} is not a dvfs governor record (lock_mhz is {json.dumps(lock)[:40]}, "
                    "expected two clocks in MHz, low first); remove it"
                )
            found[path.name.removeprefix(self.PREFIX).removesuffix(".json")] = data
        return found

    def locks(self) -> dict[str, tuple[int, int]]:
        return {u: (r["lock_mhz"][0], r["lock_mhz"][1]) for u, r in self.read().items()}

    def outside_lines(self, gpus: Sequence[Gpu]) -> list[str]:
        """A warning line for each of these GPUs whose governor record's lock is outside the
        GPU's SM clocks (a hand edit), no lock `dvfs govern` set, as `AppliedCaps.outside_lines`
        says of the caps record's: `cap show` showed it as the lock in force without a word.
        [] where the records cannot be read (refused, saying so, where they are shown)."""
        try:
            records = self.read()
        except CapsError:
            return []
        lines = []
        for gpu in gpus:
            uuid, number = gpu.identity.uuid, gpu.identity.index
            lock = records[uuid]["lock_mhz"] if uuid in records else None
            try:
                problem = _lock_outside(gpu, (lock[0], lock[1]) if lock else None)
            except GpuError:  # (what NVML cannot tell of that GPU is said where it is shown)
                continue
            if not problem:
                continue
            reset = state_dir_command(f"dvfs cap reset {number}", self.directory)
            pid = records[uuid].get("pid")
            which = f" (pid {pid})" if _positive_int(pid) else ""
            lines.append(
                f"dvfs's governor record {self.path(uuid)} is damaged for GPU {number} "
                f"({uuid}): {problem.removesuffix('no cap dvfs set')}no lock dvfs govern set; "
                "the clock lock in force cannot be told from it: stop that governor"
                f"{which} if it runs (it puts the GPU back and removes the record), else "
                f"`{reset}` (the GPU reset whole, the record removed)"
            )
        return lines


@dataclass(frozen=True)
class LockInForce:
    """A clock lock dvfs holds on a GPU, and who set it."""

    lock_mhz: tuple[int, int]
    by_governor: bool
    record: dict[str, Any]

    @property
    def set_by(self) -> str:
        if self.by_governor:
            return f"dvfs govern (pid {self.record.get('pid')}, since {self.record.get('since')})"
        return "dvfs cap apply"


def locks_in_force(directory: Path, *, spoiled_ok: bool = False) -> dict[str, LockInForce]:
    """The clock lock each GPU holds by dvfs's records: a running governor's where it holds
    one (under the static caps), else the one `cap apply` recorded. `spoiled_ok` (`cap
    show`): a caps record entry's damaged lock is passed over (`damaged_lines` names it), not
    the whole record refused."""
    record = AppliedCaps(directory)
    found = {
        uuid: LockInForce((r["lock_mhz"][0], r["lock_mhz"][1]), False, r)
        for uuid, r in (record.entries_as_written() if spoiled_ok else record.read()).items()
        if _is_lock(r.get("lock_mhz"))
    }
    for uuid, r in GovernorLocks(directory).read().items():
        found[uuid] = LockInForce((r["lock_mhz"][0], r["lock_mhz"][1]), True, r)
    return found


@dataclass(frozen=True)
class CapsPlan:
    """What applying a caps file on this host does, and which of its entries match nothing.

    A GPU UUID that is not here means the file was meant for another host or a GPU was
    replaced (`unmatched`); a model that is not here is normal for a fleet file (`unused`).
    GPUs of a model entry that have MIG enabled are left alone (`mig`): caps were measured on
    whole GPUs, and a host that partitions some GPUs still gets the others capped. `lost`: the
    one line naming the GPUs fallen off the bus, planned without (their UUIDs cannot be read,
    so an unmatched UUID may be one of them), "" when none is. `untouched`: this host's GPUs
    that no entry names, by UUID or model (another model than the file's, a GPU the plan did
    not measure), which the apply leaves as they are; one of them with MIG enabled is in
    `mig` instead (no plan caps it). `kept`: those of `untouched` that dvfs's caps record
    says an earlier `cap apply` capped, which keep those caps (index, what they hold).
    `set_aside`: GPUs here that the file names but that are not capped, their power limit one
    NVML does not support (`cap apply` names them, exit 1): their entries are matched, neither
    `unmatched` nor `unused`.
    """

    actions: tuple[CapAction, ...]
    unmatched: tuple[str, ...]
    host: str
    unused: tuple[str, ...] = ()
    mig: tuple[str, ...] = ()
    lost: str = ""
    untouched: tuple[str, ...] = ()
    set_aside: tuple[str, ...] = ()
    kept: tuple[tuple[int, str], ...] = ()
    mig_indices: tuple[int, ...] = ()  # `mig`'s indices, for the command that turns MIG off

    def mig_message(self, *, dry_run: bool = False) -> str:
        one = len(self.mig) == 1
        left = "would be left alone" if dry_run else f"{'was' if one else 'were'} left alone"
        off = mig_off_advice(self.mig_indices)
        return (
            f"{', '.join(self.mig)} {'has' if one else 'have'} MIG enabled and {left}: dvfs "
            f"caps whole GPUs (to cap {'it' if one else 'them'}: {off})"
        )

    def unmatched_message(self, where: str, *, dry_run: bool = False) -> str:
        done = (
            f"`cap apply` would cap the GPUs that match and exit "
            f"{1 if self.lost or self.set_aside else 5}"
            if dry_run
            else "caps went to the GPUs that match"
        )
        if self.lost:  # a lost GPU's UUID cannot be read: it may be one of these
            return (
                f"{where} names GPU(s) {', '.join(self.unmatched)}, which are not among this "
                f"host's GPUs that open ({self.host}), the GPU fallen off the bus perhaps; {done}"
            )
        return (
            f"{where} names GPU(s) {', '.join(self.unmatched)}, which are not on this host "
            f"(it has {self.host}); {done}"
        )

    def untouched_message(
        self,
        where: str,
        *,
        dry_run: bool = False,
        reset: Callable[[str], str] = lambda indices: f"dvfs cap reset --applied {indices}",
    ) -> str:
        """The GPUs no entry names: left as they are, to plan if they are to be capped; those
        an earlier `cap apply` capped are said to keep those caps, with the `reset` (of their
        indices, "1 3") that removes them (those alone: `--applied` leaves an operator's clock
        lock or power limit be), not told to plan caps they hold. (A function, not a
        template to format: a --state-dir of "{x}" in it failed "KeyError: 'x'".)"""
        kept = {text for _, text in self.kept}
        plain = CapsPlan((), (), "", untouched=tuple(u for u in self.untouched if u not in kept))
        parts = [plain._left_message(where, dry_run=dry_run)] if plain.untouched else []
        if self.kept:
            one = len(self.kept) == 1
            keep = "would keep" if dry_run else ("keeps" if one else "keep")
            indices = " ".join(str(index) for index, _ in self.kept)
            parts.append(
                f"{where} has no entry for {'; '.join(text for _, text in self.kept)}: "
                f"{'it' if one else 'they'} {keep} the caps an earlier `dvfs cap apply` put on "
                f"{'it' if one else 'them'} (`{reset(indices)}` removes them)"
            )
        return "; ".join(parts)

    def _left_message(self, where: str, *, dry_run: bool = False) -> str:
        one = len(self.untouched) == 1
        left = "would be left" if dry_run else f"{'was' if one else 'were'} left"
        it, its = ("it", "its") if one else ("them", "their")
        return (
            f"{where} has no entry for {', '.join(self.untouched)}: {'it' if one else 'they'} "
            f"{left} as {'it is' if one else 'they are'} (to cap {it}, `dvfs cap plan` from a "
            f"cube of {its} model, with --gpu UUID or --model NAME)"
        )

    def unused_message(self, where: str, *, dry_run: bool = False) -> str:
        skipped = "would be skipped" if dry_run else "were skipped"
        models = " or ".join(self.unused)
        if self.lost:  # a lost GPU's model cannot be read: it may be one of these
            return (
                f"{where}: none of this host's GPUs that open is a {models}, the GPU fallen off "
                f"the bus perhaps; those entries {skipped}"
            )
        return f"{where}: no GPU here is a {models}; those entries {skipped}"


def describe_host(gpus: Sequence[Gpu]) -> str:
    """The host's GPUs for messages: index, model name and UUID."""
    if not gpus:
        return "no GPUs"
    return "; ".join(f"GPU {g.identity.index} {g.identity.name} ({g.identity.uuid})" for g in gpus)


def plan_actions(
    caps: CapsFile,
    gpus: Sequence[Gpu],
    *,
    where: str = "the caps file",
    allow_simulated: bool = False,
    applied: dict[str, dict[str, Any]] | None = None,
    lost: str = "",
    set_aside: Sequence[Gpu] = (),
    directory: Path | None = None,
) -> CapsPlan:
    """Match caps to this host's GPUs and validate them against each GPU's supported clocks
    and power range, without writing. `applied`: dvfs's record of the caps in force (`AppliedCaps`),
    whose knobs this file leaves at stock go back as `cap reset --applied` puts them back
    (clocks unlocked, the power limit that cap replaced: `CapAction.power_limit_back`).

    Refuses (CapsError) simulated caps unless `allow_simulated`, and a file that matches no
    GPU at all; entries that match nothing are listed in the plan for the caller to report.
    `lost`: the line naming GPUs of this host fallen off the bus (not among `gpus`), for
    whom a file that matches none of `gpus` is refused as a lost GPU (GpuUnavailableError,
    exit 1), not as a file meant for another host: it may name the lost GPU. `set_aside`: GPUs
    of this host that opened but are not among `gpus` (their power limit one NVML does not
    support, which `cap apply` records before a change): the entries naming them are theirs,
    not entries for GPUs elsewhere or fallen off the bus (`CapsPlan.set_aside`).
    """
    host = describe_host(sorted([*gpus, *set_aside], key=lambda g: g.identity.index))
    if caps.simulated and not allow_simulated:
        measured = caps.meta.get("measured_on") or "a digital twin"
        models = sorted({base_model_name(c.name) for c in caps.caps if c.name})
        target = f"GPUs of model {', '.join(models)}" if models else "the GPUs it names"
        raise CapsError(
            f"{where} holds simulated caps, planned from a digital-twin cube ({measured}), not "
            f"from measurements of real GPUs: sweep the real GPUs and plan again, or pass "
            f"--allow-simulated to apply them to {target} anyway"
        )
    actions = []
    problems: list[str] = []  # every GPU's, reported together
    matched: set[int] = set()
    mig: list[str] = []
    mig_indices: list[int] = []
    untouched: list[str] = []
    kept: list[tuple[int, str]] = []
    other_model: list[str] = []  # GPUs whose [[gpu]] entry was measured on another model
    measured = caps.measured_models()
    for gpu in gpus:
        ident = gpu.identity
        cap = caps.for_gpu(ident.uuid, ident.name, twin_models=allow_simulated)
        if cap is None:
            if gpu.mig_enabled():  # no plan caps it while MIG is on: noted as MIG, not "plan it"
                mig.append(f"GPU {ident.index} ({ident.uuid})")
                mig_indices.append(ident.index)
            else:
                untouched.append(f"GPU {ident.index} ({ident.name}, {ident.uuid})")
                held = _recorded_caps((applied or {}).get(ident.uuid))
                if held:  # an earlier file's caps, in force by the record: not "to cap it"
                    kept.append((ident.index, f"{untouched[-1]}, capped to {held}"))
                    untouched[-1] = kept[-1][1]
            continue
        matched.add(id(cap))
        if cap.uuid:  # its model's entry, which its own entry overrides, is for a GPU here too
            model = caps.for_gpu("", ident.name, twin_models=allow_simulated)
            if model is not None:
                matched.add(id(model))
        if cap.uuid and measured and base_model_name(ident.name) not in measured:
            # A [[gpu]] entry names its GPU by UUID only: caps planned on one model (`cap plan
            # --gpu` takes any UUID) must not go to a GPU of another, as a [[model]] entry and
            # `dvfs govern`'s plan never do.
            other_model.append(f"GPU {ident.index} ({ident.uuid}) is a {ident.name}")
            continue
        if gpu.mig_enabled():
            if cap.uuid:
                problems.append(
                    f"GPU {ident.index}: MIG is enabled, and dvfs caps whole GPUs only; disable "
                    f"MIG ({mig_off_advice([ident.index])}) or remove its [[gpu]] entry"
                )
            else:
                mig.append(f"GPU {ident.index} ({ident.uuid})")
                mig_indices.append(ident.index)
            continue
        found = []
        lock = None
        if cap.sm_clock_max_mhz is not None:
            supported = gpu.supported_sm_clocks_mhz()
            low = cap.sm_clock_min_mhz if cap.sm_clock_min_mhz is not None else min(supported)
            found += [unsupported_clock(mhz, supported) for mhz in (low, cap.sm_clock_max_mhz)]
            lock = (low, cap.sm_clock_max_mhz)
        limit = None
        if cap.power_limit_w is not None:
            limit = round(cap.power_limit_w * 1000)
            limits = gpu.power_limit_range()
            found.append(limits.outside(limit) or above_default(limit, limits.default_mw))
        problems += [f"GPU {ident.index}: {p}" for p in dict.fromkeys(found) if p]
        earlier = (applied or {}).get(ident.uuid, {})
        doubt, back, refused = _power_plan(limit, earlier, gpu, directory)
        actions.append(
            CapAction(
                ident.index,
                ident.uuid,
                lock,
                limit,
                power_limit_or_none(gpu),
                unlock=lock is None and earlier.get("lock_mhz") is not None,
                power_limit_back=back,
                power_doubt=doubt,
                refused=refused,
            )
        )
    if other_model:
        one = len(other_model) == 1
        it, its = ("it", "its") if one else ("them", "their")
        entries = "its [[gpu]] entry's" if one else "their [[gpu]] entries'"
        problems.insert(
            0,
            f"{', '.join(other_model)}, but {entries} caps were measured on "
            f"{caps.meta['measured_on']}: plan {it} from a cube of {its} own model, or remove "
            f"{'its entry' if one else 'their entries'} (a file joining plans of several models "
            "lists each in [meta] measured_on, comma-separated, as `cap plan` of a merged cube "
            "writes it; one an older dvfs planned from a merged cube named only its first GPU's "
            "model there: write that cube's headroom again, "
            f"{headroom_again(caps.meta.get('target'))}, then plan again, "
            f"`{plan_again(caps.meta)}`)",
        )
    if problems:
        raise CapsError("; ".join(problems))
    aside: list[str] = []
    for gpu in set_aside:
        ident = gpu.identity
        cap = caps.for_gpu(ident.uuid, ident.name, twin_models=allow_simulated)
        if cap is not None:
            matched.add(id(cap))
            aside.append(f"GPU {ident.index} ({ident.uuid})")
    if not actions and aside:
        one = len(aside) == 1
        raise GpuUnavailableError(
            f"{where} matches only {', '.join(aside)} here, whose power limit NVML does not "
            f"support (its entry sets one): {'it was' if one else 'they were'}"
            " set aside, so nothing was capped" + (f"; {lost}" if lost else "")
        )
    if not actions:
        have = "has" if len(mig) == 1 else "have"
        but = f", but {', '.join(mig)} {have} MIG enabled (dvfs caps whole GPUs)" if mig else ""
        if lost:
            raise GpuUnavailableError(
                f"{where} matches none of this host's GPUs that open, so nothing was capped: "
                f"it names {caps.expected()}; they are {host}{but}; {lost}"
            )
        raise CapsError(
            f"{where} matches no GPU on this host, so nothing was capped: it names "
            f"{caps.expected()}; this host has {host}{but} (`dvfs gpu list`)"
        )
    unmatched = tuple(c.uuid for c in caps.caps if c.uuid and id(c) not in matched)
    unused = tuple(c.name for c in caps.caps if c.name and id(c) not in matched)
    return CapsPlan(
        tuple(actions),
        unmatched,
        host,
        unused,
        tuple(mig),
        lost,
        tuple(untouched),
        tuple(aside),
        tuple(kept),
        mig_indices=tuple(mig_indices),
    )


def _power_plan(
    limit: int | None, earlier: dict[str, Any], gpu: Gpu, directory: Path | None
) -> tuple[str, tuple[int | None, str] | None, str]:
    """What a caps file does with a GPU's power limit by its caps record entry `earlier`:
    `CapAction.power_doubt`, `power_limit_back` and `refused` (a `DoubtfulLimitError`'s
    words: that GPU alone is left as it is, the others capped)."""
    try:
        if limit is not None:  # (the limit it replaces, recorded for `cap reset --applied`)
            _doubtful_limit(gpu, earlier, power_limit_or_none(gpu), directory)
        doubt = _spoiled_power(gpu, earlier, power_limit_or_none(gpu), directory)
        back = None if doubt else _power_limit_back(limit, earlier, gpu, directory)
    except DoubtfulLimitError as exc:
        return "", None, str(exc)
    return doubt, back, ""


def _recorded_caps(entry: dict[str, Any] | None) -> str:
    """The caps dvfs's record says a GPU holds ("SM clock 210-1380 MHz, power limit 400 W"),
    "" where it lists none."""
    if not entry:
        return ""
    parts = []
    lock = entry.get("lock_mhz")
    if _is_lock(lock):
        parts.append(f"SM clock locked {lock[0]}-{lock[1]} MHz")
    elif lock is not None:
        parts.append("SM clock locked (to what, the damaged record does not say)")
    power = entry.get("power_limit_mw")
    if _positive_int(power):
        parts.append(f"power limit {power / 1000:g} W")
    elif power is not None:
        parts.append("a power limit (which, the damaged record does not say)")
    source = entry.get("source")
    return ", ".join(parts) + (f" from {source}" if parts and source else "")


def apply_actions(
    actions: Sequence[CapAction],
    gpus: Sequence[Gpu],
    record: AppliedCaps,
    source: str,
    done: Callable[[CapAction], None] = lambda action: None,
) -> None:
    """Write the caps, recording each applied GPU; failures are gathered and reported together.
    `done` hears each action once it is in place, so only what was applied is reported so.

    The record is written to disk after each change (`AppliedCaps.update`), so a signal, a
    hung call or a SIGKILL between two GPUs still leaves `cap show` and a later sweep knowing
    every lock put in place.
    """
    by_uuid = {g.identity.uuid: g for g in gpus}
    if actions:
        record.check_writable()  # no GPU changed where its change could not be recorded
    applied = record.entries_as_written()  # (a damaged knob: `CapAction.power_doubt`, below)
    failures = GatheredFailures()

    def keep(
        uuid: str, entry: dict[str, Any], undo: Callable[[], None] | None = None, what: str = ""
    ) -> None:
        try:
            record.update(uuid, entry)
        except OSError as exc:
            # Not recorded (a full disk): NVML cannot read a lock back, so a cap left on the
            # GPU would be known to no `cap show`, sweep or reset; the change is taken back.
            if undo is None:
                raise
            index = by_uuid[uuid].identity.index
            why = record_problem(exc)
            unwritten = f"cannot write {record.path}: {why[:1].lower() + why[1:]}"
            try:
                undo()
            except GpuError as failed:
                # Left on the GPU unrecorded: said so (a GPU failure gathered with the
                # others' hid the record's, and a later GPU's full disk hid both), with
                # the one command that clears it; no other GPU is changed.
                raise CapsRecordError(
                    f"{unwritten}, and GPU {index}'s {what} could not be taken back off it "
                    f"({failed}), so the GPU keeps it with no record of it; {_remedy(exc)}, "
                    f"then run `{state_dir_command(f'dvfs cap reset {uuid}', record.path.parent)}`"
                ) from exc
            # Said so, with the way on: "choose another path" (another --state-dir) would
            # record the caps where `cap show`, sweeps and `cap reset` do not look.
            raise CapsRecordError(
                f"{unwritten}, so GPU {index}'s {what} was taken back off it; {_remedy(exc)}, "
                "then apply the caps again"
            ) from exc
        applied[uuid] = entry

    for action in actions:
        if action.refused:  # left as it is whole, said with the others' failures
            failures.add(GpuError(action.refused))
            continue
        gpu = by_uuid[action.uuid]
        stamp = {
            "source": source,
            "applied": datetime.now(UTC).isoformat(timespec="seconds"),
            "boot": boot_id(),
        }
        # What this GPU holds by the record, each knob carried until this file's value is in
        # place: a knob whose write fails (or never comes, a signal between) keeps the earlier
        # apply's value, which the GPU still holds, so a later file leaving it at stock puts
        # it back, and a sweep does not take that cap for the GPU's stock.
        blank: dict[str, Any] = {"lock_mhz": None, "power_limit_mw": None}
        changed: list[str] = []  # what is already changed on the GPU, for a failure's message
        try:
            # An earlier apply's caps this file leaves at stock go first, each recorded
            # gone once it is: the record never lists less than the GPU holds.
            if action.unlock:
                gpu.reset_sm_clock()
                keep(action.uuid, {**applied.get(action.uuid, blank), "lock_mhz": None})
                changed.append("SM clock unlocked")
            if action.power_limit_back is not None:
                back = action.power_limit_back[0]
                if back is not None and back != gpu.power_limit_mw():
                    gpu.set_power_limit_mw(back)
                    changed.append(f"power limit set back to {back / 1000:g} W")
                keep(
                    action.uuid,
                    _without_earlier(
                        {
                            **applied.get(action.uuid, blank),
                            "power_limit_mw": None,
                            "power_limit_before_mw": None,
                            DEFAULT_THEN: None,
                        }
                    ),
                )
            if action.lock_mhz is not None:
                earlier = applied.get(action.uuid, blank).get("lock_mhz")
                lock = action.lock_mhz
                recorded_even_if_signalled(
                    partial(gpu.lock_sm_clock, *lock),
                    partial(
                        keep,  # recorded even if the limit fails
                        action.uuid,
                        {**applied.get(action.uuid, blank), **stamp, "lock_mhz": list(lock)},
                        partial(gpu.lock_sm_clock, *earlier)
                        if _is_lock(earlier)
                        else gpu.reset_sm_clock,
                        f"SM clock lock {lock[0]}-{lock[1]} MHz",
                    ),
                )
                changed.append(f"SM clock locked to {action.lock_mhz[0]}-{action.lock_mhz[1]} MHz")
            if action.power_limit_mw is not None and not action.power_doubt:
                before = gpu.power_limit_mw()
                # The limit this cap replaced, for `cap reset --applied` to put back: the
                # GPU's own, read now, unless it is an earlier apply's cap, still held (then
                # the one that cap replaced, as recorded; none where an older dvfs recorded
                # none); one an operator set over that cap since is theirs, and replaced.
                prior = applied.get(action.uuid, blank)
                dvfs_cap = before in [  # (a damaged 450000.0 is no cap, though == 450000)
                    v
                    for v in (prior.get("power_limit_mw"), _earlier_cap(prior))
                    if _positive_int(v)
                ]
                replaced = prior.get("power_limit_before_mw") if dvfs_cap else before
                limit = action.power_limit_mw
                entry = {
                    **prior,
                    **stamp,
                    "power_limit_mw": limit,
                    "power_limit_before_mw": replaced,
                    # the driver's default beside it: one reloaded since (the same boot)
                    # makes the replaced limit the old driver's (`_limit_replaced`)
                    DEFAULT_THEN: prior.get(DEFAULT_THEN)
                    if dvfs_cap
                    else gpu.power_limit_range().default_mw,
                }
                undo = partial(gpu.set_power_limit_mw, before) if limit != before else None
                what = f"power limit {limit / 1000:g} W"
                recorded_even_if_signalled(
                    partial(gpu.set_power_limit_mw, limit) if limit != before else lambda: None,
                    partial(keep, action.uuid, _without_earlier(entry), undo, what),
                    # a change stopped before it landed may leave dvfs's earlier cap: both
                    # recorded dvfs's, so neither passes for an operator's limit later
                    partial(
                        keep,
                        action.uuid,
                        {**entry, EARLIER: before, EARLIER_FOR: limit},
                        undo,
                        what,
                    )
                    if dvfs_cap and limit != before
                    else None,
                )
            if action.power_doubt:  # the clock done, the power limit left as it is
                raise GpuError(action.power_doubt)
        except GpuError as exc:
            # The GPU is not left changed unsaid: what is in place on it already is named.
            failures.add(
                exc,
                suffix=(
                    f" (GPU {action.index} was changed before that: {', '.join(changed)})"
                    if changed
                    else ""
                ),
            )
            continue
        except (CapsRecordError, OSError) as exc:
            # The record cannot be written (a full disk): no GPU after this one is changed.
            # The failures gathered on the GPUs before it are said first, not hidden by it.
            if isinstance(exc, OSError):  # a change recorded gone (nothing left unrecorded)
                # said with the way on, alone too: "choose another --state-dir" would record
                # the caps where `cap show`, sweeps and `cap reset` do not look
                why = record_problem(exc)
                unwritten = CapsRecordError(
                    f"cannot write {exc.filename or record.path}: {why[:1].lower() + why[1:]}; "
                    f"{_remedy(exc)}, then apply the caps again"
                )
                if not failures.messages:
                    raise unwritten from exc
                exc = unwritten
            elif not failures.messages:
                raise
            raise CapsRecordError(
                "could not apply caps: " + "; ".join([*failures.messages, str(exc)])
            ) from exc
        done(action)
    failures.raise_if_any("could not apply caps: ")


def recorded_even_if_signalled(
    change: Callable[[], None],
    record: Callable[[], None],
    unsure: Callable[[], None] | None = None,
) -> None:
    """`change` a GPU, then `record` it in the caps record, the record written whenever the
    change may have landed: a signal (the caps unit's stop, Ctrl-C) that ends the change's NVML
    call (which a worker thread may finish all the same) or comes before the record is written
    leaves the cap recorded, not on the GPU unknown to `cap show`, sweeps and `cap reset
    --applied`, and is raised then. (The record may list a cap the GPU does not hold, never the
    reverse; the NVML call itself is not held back: a hung one still ends on the signal.)
    `unsure`, where given, records instead a change the signal ended before it returned, which
    may or may not have landed (both what the GPU held and the change recorded). So is one
    whose NVML call overran its deadline (`GpuTimeoutError`, raised then): the driver may
    finish the stuck call once it answers again, the cap landing after dvfs gave up on it."""
    from dvfs.gpu.deadline import GpuTimeoutError
    from dvfs.signals import Interrupted, held_back

    done = changed = False
    try:
        change()
        changed = True
        with held_back():
            record()
            done = True
    except (KeyboardInterrupt, Interrupted, GpuTimeoutError):
        if not done:
            with held_back(), contextlib.suppress(CapsRecordError, OSError):
                # (one that cannot be written takes the change back: the signal wins)
                (record if changed or unsure is None else unsure)()
        raise


def _without_earlier(entry: dict[str, Any]) -> dict[str, Any]:
    """A caps record entry once a power-limit change landed: no `EARLIER` cap left to doubt."""
    return {k: v for k, v in entry.items() if k not in (EARLIER, EARLIER_FOR)}


def _remedy(exc: OSError) -> str:
    """What to do where the caps record cannot be written, by why: "free space there" fits a
    full disk only (it was said whatever the error), "make it writable" neither a failing disk
    (EIO) nor a file where a folder of its path goes (ENOTDIR). Never "choose another
    --state-dir", which would record the caps where `cap show`, sweeps and `cap reset` do not
    look."""
    if exc.errno == errno.ENOSPC:
        return "free space there"
    if exc.errno == errno.EDQUOT:
        return "free space there or raise the disk quota"
    if exc.errno == errno.EPERM:  # refused whatever the permissions: root too
        return (
            "let this user write that folder (check its owner and permissions, and `lsattr "
            "-d` for an immutable or append-only flag: `chattr -i -a` clears it)"
        )
    if exc.errno == errno.EACCES:
        return "let this user write that folder (check its owner and permissions)"
    if exc.errno == errno.EROFS:
        return "its file system is mounted read-only: make it writable"
    if exc.errno == errno.EIO:
        return "the disk or network file system under it failed (see dmesg): check it"
    if exc.errno == errno.ENOTDIR:
        return "part of its path is a file, not a folder: move that file aside"
    return "make it writable"


def state_file_problem(exc: OSError) -> str | None:
    """A file of dvfs's state folder (a GPU's lock, the caps record's lock) that cannot be
    opened or written, in one line with `_remedy`'s way on, or None where it has none (then
    `describe_os_error`). Never "choose another --state-dir": every dvfs holds its GPUs by the
    locks there, and `cap show`, sweeps and `cap reset` read the caps record there."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS):
        return None
    why = record_problem(exc)
    return f"cannot write {exc.filename}: {why[:1].lower() + why[1:]}; {_remedy(exc)}"


def reset_caps(
    gpus: Sequence[Gpu],
    record: AppliedCaps,
    note: Callable[[str], None] = lambda line: None,
    command: str = "dvfs cap reset",
    *,
    applied_only: bool = False,
) -> list[str]:
    """Unlock clocks and restore power limits (the defaults; with `applied_only`, the limits
    dvfs's caps replaced); returns what was done per GPU, and
    `note` hears each GPU's line once it is reset, so that one GPU failing (raised once every
    GPU was tried) does not leave the others' resets unsaid. `applied_only` (`cap reset
    --applied`, the caps unit's stop): on each GPU only the knobs the caps record says `cap
    apply` set, a clock lock or a power limit, go back (an operator's power limit set with
    nvidia-smi where dvfs locked the clock only is left be). On a GPU a dead dvfs run left a
    state file on (this boot's), that run may have changed both knobs: its clocks are unlocked
    (NVML cannot read a lock back, so the one it found, dvfs's caps record's if any, is all
    that is known) and its power limit goes back to the one the state file says it found, or,
    where that was dvfs's cap, the one that cap replaced (`_limit_replaced`); an unreadable
    state file tells nothing, and its GPU is reset whole.

    A state file a dead dvfs run left on a GPU (a governor or sweep killed with SIGKILL) goes
    too: it holds the settings that run found, static caps included, and the GPU is at its
    defaults now, as asked (with `applied_only`, at what that run found, as above). Left behind,
    a later `dvfs gpu reset` would put those settings back on the GPU with no record of them,
    and `cap apply` and sweeps would refuse the GPU."""
    from dvfs.gpu.safety import StateStore
    from dvfs.signals import held_back

    failures = GatheredFailures()
    done = []
    store = StateStore(record.path.parent)
    if gpus:  # a record that is unreadable is refused before any GPU is reset, not after one
        try:
            record.entries_as_written()
        except CapsError as exc:
            told = str(exc).removesuffix(record_fix(record.path.parent))
            # (a newer dvfs's record: its line says what to do, this reset among it)
            fix = "" if isinstance(exc, NewerCapsRecordError) else ": remove it, then reset again"
            raise CapsRecordError(f"{told}; nothing was reset{fix}") from exc
        try:  # and so is its lock that cannot be opened, as `cap apply` refuses it
            record.refuse_a_folder_lock()
        except CapsRecordError as exc:  # a folder in its place
            told = str(exc).removesuffix("; remove it")
            raise CapsRecordError(
                f"{told}; nothing was reset: remove it, then reset again"
            ) from exc
        except FileNotFoundError as exc:  # a link into a missing folder
            raise CapsRecordError(
                f"cannot open {exc.filename}: it links into a folder that is not there; nothing "
                "was reset: remove the link, then reset again"
            ) from exc
        except OSError as exc:  # a link in a loop (`refuse_a_folder_lock` raises no other)
            raise CapsRecordError(
                f"cannot open {exc.filename}: too many levels of symbolic links (a link in a "
                "loop); nothing was reset: remove the link, then reset again"
            ) from exc
    governed = GovernorLocks(store.directory)
    for gpu in gpus:  # so is a folder where a GPU's state file or governor record goes, which
        # no reset removes: refused after resetting the GPUs before it, the others were left
        for path in (store.path(gpu.identity.uuid), governed.path(gpu.identity.uuid)):
            if path.is_dir() and not path.is_symlink():
                raise CapsRecordError(
                    f"{_a_folder(path).removesuffix('; remove it')}; nothing was reset: remove "
                    "it, then reset again"
                )
    solo = len(gpus) < 2  # one GPU: reset in this thread, where a signal lands (`held_back`)
    recording = threading.Lock()  # held by a GPU's thread as it drops its entry and state file
    given_up: list[bool] = []  # the reset ended (a signal): no thread begins dropping them

    def reset_one(gpu: Gpu) -> str | GpuError | _Unrecorded:
        """One GPU reset (its entry dropped once it is, a signal after it or not): its line,
        or what failed on it."""
        ident = gpu.identity
        try:
            unlock, limit = True, True
            recorded: dict[str, Any] = {}
            dead = _found_by_a_dead_run(store, ident.uuid) if applied_only else None
            if applied_only and (dead is not None or _stale_or_none(store, ident.uuid)):
                recorded = record.entries_as_written().get(ident.uuid) or {}
                # (a damaged knob is one dvfs set all the same: `_spoiled_knobs`)
                unlock = dead is not None or recorded.get("lock_mhz") is not None
                limit = dead is not None or recorded.get("power_limit_mw") is not None
            refused: GpuError | None = None
            try:
                if unlock:
                    gpu.reset_sm_clock()
            except REFUSED as exc:  # changed nothing: the power limit goes back still
                refused = exc
            default = _default_or_none(gpu)  # None: not supported, so never capped
            target, power = default, ""
            found = None if dead is None else dead.power_limit_mw
            capped = recorded.get("power_limit_mw")
            try:
                if limit and default is not None and capped is not None:
                    held = gpu.power_limit_mw() if found is None else found
                    spoiled = _spoiled_power(gpu, recorded, held, record.path.parent)
                    if spoiled:  # whether the GPU holds dvfs's cap cannot be told: left be
                        raise DoubtfulLimitError(spoiled)
                if limit and default is not None and found is not None:
                    # `--applied` after a dead run: the limit it found goes back (the
                    # operator's), or, where that was dvfs's cap, the one that cap replaced
                    if _positive_int(capped):
                        target, power = _limit_replaced(
                            gpu, recorded, default, current=found, directory=record.path.parent
                        )
                    if target is None or not power:
                        target = found
                        power = f"power limit {found / 1000:g} W (as the dead dvfs run found it)"
                elif limit and default is not None and _positive_int(capped):
                    # `--applied`: the limit dvfs's cap replaced goes back, where the GPU still
                    # holds that cap; one set outside dvfs since is the operator's, left be.
                    target, power = _limit_replaced(
                        gpu, recorded, default, directory=record.path.parent
                    )
                elif limit and default is not None and capped is not None:
                    # damaged, the GPU holding the limit it replaced (`_spoiled_power`)
                    target = recorded["power_limit_before_mw"]
                    power = f"power limit {target / 1000:g} W (as before `dvfs cap apply`)"
            except DoubtfulLimitError:  # the power limit left as it is, and its entry
                entry = record.entries_as_written().get(ident.uuid)
                if unlock and refused is None and entry and entry.get("lock_mhz") is not None:
                    with contextlib.suppress(OSError):  # (else it lists the lock: never less)
                        record.update(ident.uuid, {**entry, "lock_mhz": None})  # (unlocked)
                raise
            if limit and target is not None and gpu.power_limit_mw() != target:
                gpu.set_power_limit_mw(target)
            if refused is not None:  # the entry stays, for the lock the GPU still holds
                entry = record.entries_as_written().get(ident.uuid)
                if _found_by_a_dead_run(store, ident.uuid) is not None:
                    # A dead run's state file stays (the GPU was not reset): `dvfs gpu reset`
                    # puts back what that run found, dvfs's caps included, which the entry
                    # must list still, whole (the sweeps it refuses meanwhile take nothing
                    # for stock).
                    gpu_reset = state_dir_command(
                        f"dvfs gpu reset {ident.index}", record.path.parent
                    )
                    left = "; ".join(
                        [
                            f"{refused}",
                            f"GPU {ident.index} otherwise reset: "
                            + _power_words(power, default, limit=limit),
                            f"{_left_by(store, ident.uuid)} stays, and dvfs's caps record keeps "
                            "that GPU's caps: once its clock can be unlocked, run "
                            f"`{state_dir_command(command, record.path.parent)}` again, or "
                            f"`{gpu_reset}` to put back what that run found (dvfs's caps "
                            "included, as the record lists them)",
                        ]
                    )
                    raise type(refused)(left) from refused
                if entry is not None and entry.get("power_limit_mw") is not None:
                    # but not the limit, gone: a sweep would take the same limit set outside
                    # dvfs later for dvfs's cap, not for the operator's stock (`measuring`)
                    try:
                        record.update(
                            ident.uuid,
                            _without_earlier(
                                {
                                    **entry,
                                    "power_limit_mw": None,
                                    "power_limit_before_mw": None,
                                    DEFAULT_THEN: None,
                                }
                            ),
                        )
                    except OSError as exc:  # said with the refusal, the GPUs after it reset
                        # still: the record lists a limit the GPU no longer holds (never less)
                        why = record_problem(exc)
                        refused = type(refused)(
                            f"{refused}; {_power_words(power, default, limit=limit)} all the "
                            "same, but "
                            f"{exc.filename or record.path} cannot be written "
                            f"({why[:1].lower() + why[1:]}), so it still lists dvfs's power "
                            f"limit on that GPU: {_remedy(exc)}"
                        )
                raise refused
            power = _power_words(power, default, limit=limit)
            # The entry and a dead run's state file go together, a signal held back between
            # them (in this thread; in a GPU's own, the reset given up on waits for them:
            # `recording`): the file left alone, `dvfs gpu reset` put back what that run found
            # (dvfs's caps) with no record of them.
            with held_back(), recording:
                if given_up:  # (the reset ended: this GPU's entry and file kept, both)
                    return GpuError(f"GPU {ident.index} ({ident.uuid}): its reset was given up")
                try:
                    # (a GPU the record does not list needs no write: an unwritable record must
                    # not keep the GPUs after it capped, said to list caps it never listed)
                    if ident.uuid in record.entries_as_written():
                        record.update(ident.uuid, None)
                except OSError as exc:
                    # The GPU is at its defaults, its caps still recorded (`cap show` and sweeps
                    # take them for in force, never less than the GPU holds): said once every
                    # GPU was tried, with the others' failures (`_unrecorded`).
                    return _Unrecorded(gpu, power, exc)
                GovernorLocks(record.path.parent).clear(ident.uuid)
                clocks = (
                    "clocks unlocked" if unlock else "clocks left as they are (dvfs locked none)"
                )
                line = f"GPU {ident.index} ({ident.uuid}): {clocks}, {power}"
                if os.path.lexists(store.path(ident.uuid)):  # (a link in a loop: unreadable too)
                    now = "the GPU is at its defaults now"
                    if dead is not None:
                        now = "what that run changed is undone, dvfs's caps with it"
                    elif applied_only and _stale_or_none(store, ident.uuid):
                        now = "from before the last reboot, which reset the GPU"
                    line += f"; {_left_by(store, ident.uuid)}: dropped, {now}"
                    store.clear(ident.uuid)
                if solo:
                    note(line)  # (said before a signal held back ends the reset)
                return line
        except GpuError as exc:
            return exc

    # Side by side (`side_by_side`, each GPU's calls on its own NVML worker): one after another,
    # GPUs whose driver hangs cost a deadline each (eight: 80 s of the caps unit's stop, whose
    # SIGKILL came before the last were reset). Said in the GPUs' order, a GPU's line as soon as
    # it and every GPU before it are done; the failures once every GPU was tried.
    # A bug in a GPU's thread (no GPU's error) is kept (`restore_guarded`) and raised once
    # every GPU was tried, after the lines of the GPUs reset: raised from its thread, it was
    # raised alone, those lines (and the other GPUs' failures) unsaid.
    outcomes: dict[int, str | GpuError | _Unrecorded | None] = {}
    bugs: dict[int, Exception] = {}
    resetting = side_by_side(
        gpus,
        restore_guarded(reset_one, bugs),
        named=lambda gpu: f"caps-reset-gpu{gpu.identity.index}",
    )
    taken = 0  # the GPUs, in order, whose outcome is taken (a line said, or a failure kept)
    unrecorded: list[_Unrecorded] = []
    try:
        with contextlib.closing(resetting) as finishing:
            for gpu, outcome in finishing:
                outcomes[id(gpu)] = outcome
                while taken < len(gpus) and id(gpus[taken]) in outcomes:
                    first = outcomes[id(gpus[taken])]
                    taken += 1
                    if isinstance(first, str):
                        done.append(first)
                        if not solo:  # (one GPU's is said in its reset, before a signal held back)
                            note(first)
                    elif isinstance(first, _Unrecorded):
                        unrecorded.append(first)
                    elif first is None:  # a bug (`bugs`): said with the failures
                        bugged = gpus[taken - 1]
                        failures.add(bug_as_failure(bugs[id(bugged)], bugged, of="reset"))
                    else:
                        failures.add(first)
    except BaseException:  # a signal as it waits (the caps unit's stop): a GPU's thread between
        # its entry and its state file finishes both before the command ends, and none begins
        with recording:
            given_up.append(True)
        raise
    if unrecorded:
        failures.messages.append(_unrecorded(unrecorded, record.path, command))
    if bugs:  # an internal error, still naming every GPU's failure
        first_bug = next(bugs[id(g)] for g in gpus if id(g) in bugs)
        raise RestoreBugError(
            "could not reset caps: " + "; ".join(failures.messages)
        ) from first_bug
    if unrecorded:
        raise CapsRecordError("; ".join(failures.messages)) from unrecorded[0].exc
    failures.raise_if_any("could not reset caps: ")
    return done


@dataclass(frozen=True)
class _Unrecorded:
    """A GPU `reset_caps` reset whose entry it could not drop from the caps record: `power`,
    what it did to its power limit; `exc`, why the record cannot be written."""

    gpu: Gpu
    power: str
    exc: OSError


def _unrecorded(unrecorded: Sequence[_Unrecorded], path: Path, command: str) -> str:
    """What `reset_caps` says of the GPUs it reset whose caps the record still lists."""
    first = unrecorded[0].exc
    why = record_problem(first)
    reset = ", ".join(
        f"GPU {u.gpu.identity.index} ({u.gpu.identity.uuid}) was reset (clocks unlocked, {u.power})"
        for u in unrecorded
    )
    which = "that GPU's" if len(unrecorded) == 1 else "those GPUs'"
    return (
        f"{reset}, but {first.filename or path} cannot be written "
        f"({why[:1].lower() + why[1:]}), so it still lists {which} caps: {_remedy(first)}, "
        f"then run `{state_dir_command(command, path.parent)}` again"
    )


def _power_words(power: str, default: int | None, *, limit: bool) -> str:
    """What `reset_caps` did to a GPU's power limit, in its line: `power` where said already,
    else the default put back, or the limit left be (not supported; dvfs set none)."""
    return power or (
        "power limit not supported by NVML (left be)"
        if default is None
        else f"power limit {default / 1000:g} W (default)"
        if limit
        else "power limit left as it is (dvfs set none)"
    )


def _found_by_a_dead_run(store: StateStore, uuid: str) -> GpuSettings | None:
    """What a dead dvfs run's state file on a GPU says it found there (this boot's); None where
    there is none, it is unreadable (nothing can be told from it) or from before the last
    reboot (which reset the GPU since)."""
    try:
        pending = store.pending(uuid)
    except GpuStateError:
        return None
    if not pending or pending[0].before_this_boot:
        return None
    return pending[0].original


def dead_run_left(store: StateStore, uuid: str) -> bool:
    """Whether a dead dvfs run left a state file on a GPU this boot (or one that cannot be
    read, which `dvfs gpu reset` names): not `_stale_or_none`."""
    return not _stale_or_none(store, uuid)


def _stale_or_none(store: StateStore, uuid: str) -> bool:
    """Whether a GPU has no state file, or only one from before the last reboot (which reset
    the GPU: `cap reset --applied` goes by dvfs's caps record alone, as without one)."""
    if not os.path.lexists(store.path(uuid)):
        return True
    try:
        pending = store.pending(uuid)
    except GpuStateError:
        return False
    return bool(pending) and all(p.before_this_boot for p in pending)


def above_default(
    limit_mw: float, default_mw: int, *, plan: str = "the caps", command: str = "dvfs cap plan"
) -> str | None:
    """Why a power cap above the GPU's default limit is none (a driver update lowered the
    default below the stock the file was planned against, or a hand edit): set, it would raise
    the GPU's power above its stock, a setting never measured. None when it is no higher.
    `plan` and `command`: what to plan again and how (a caps file's, or a per-batch plan's
    step, which `dvfs govern` refuses alike)."""
    if limit_mw <= default_mw:
        return None
    return (
        f"power limit {limit_mw / 1000:g} W is above the GPU's default power limit "
        f"{default_mw / 1000:g} W (its stock now, lowered by a driver update perhaps): a cap only "
        f"lowers a knob; plan {plan} again with `{command}` from a cube measured at this "
        "stock, or remove that power_limit_w"
    )


def _limit_replaced(
    gpu: Gpu,
    recorded: dict[str, Any],
    default: int,
    *,
    current: int | None = None,
    directory: Path | None = None,
) -> tuple[int | None, str]:
    """The power limit `cap reset --applied` puts back on a GPU whose caps record entry lists
    one dvfs set, and its words: the limit that cap replaced, as `cap apply` recorded it; None
    (left be) where the GPU holds another than dvfs's now (an operator's `nvidia-smi -pl`
    since); the default where the record, an older dvfs's, does not say which it replaced, or
    names one outside the GPU's range now (a hand-edited record, another driver's range),
    which NVML refuses: the stop failed on it for ever, the GPU left at dvfs's cap."""
    applied = int(recorded["power_limit_mw"])
    if current is None:  # (given: what a dead run found, which it may have changed since)
        current = gpu.power_limit_mw()
    _doubtful_limit(gpu, recorded, current, directory)
    before = recorded.get("power_limit_before_mw")
    known = isinstance(before, int) and _positive_int(before)
    if current == _earlier_cap(recorded):  # dvfs's earlier cap, which a signal left in place
        applied = current
    if current != applied and not (known and current == before):  # (back already: a reset
        # stopped before it dropped the entry)
        return None, (
            f"power limit left at {current / 1000:g} W (set outside dvfs since `dvfs cap "
            f"apply` set {applied / 1000:g} W)"
        )
    then = recorded.get(DEFAULT_THEN)
    if _positive_int(before) and _positive_int(then) and then != default and before != default:
        # the driver reloaded since, its default now on the GPU (equal to dvfs's cap, or the
        # line above left it as an operator's): the old driver's limit is not put back
        return default, (
            f"power limit {default / 1000:g} W (default: the GPU's default power limit was "
            f"{then / 1000:g} W when dvfs's cap replaced {before / 1000:g} W, so the driver "
            "was reloaded since and that limit is not put back)"
        )
    if _positive_int(before) and then is not None and not _positive_int(then) and before != default:
        # damaged (`AppliedCaps.damaged_lines` says so): a reload since cannot be ruled out,
        # and the replaced limit may be the old driver's, above the GPU's default now
        return default, (
            f"power limit {default / 1000:g} W (default: the caps record's {DEFAULT_THEN}, "
            f"{json.dumps(then)[:40]}, is no power limit in mW, so whether the driver was "
            f"reloaded since cannot be told and the {before / 1000:g} W dvfs's cap replaced is "
            "not put back)"
        )
    if before is not None and not known:  # damaged (`AppliedCaps.damaged_lines` says so)
        return default, (
            f"power limit {default / 1000:g} W (default: the caps record's limit dvfs's cap "
            f"replaced, {json.dumps(before)[:40]}, is no power limit in mW)"
        )
    if isinstance(before, int) and known:
        limits = gpu.power_limit_range()
        outside = limits.outside(before)
        if current == before or outside is None:
            return before, f"power limit {before / 1000:g} W (as before `dvfs cap apply`)"
        return default, (
            f"power limit {default / 1000:g} W (default: the limit the caps record says dvfs's "
            f"cap replaced, {before / 1000:g} W, is outside this GPU's range "
            f"{limits.describe_w()} now)"
        )
    return default, (
        f"power limit {default / 1000:g} W (default: the caps record, written by an older dvfs, "
        "does not say which limit dvfs's cap replaced)"
    )


def _default_or_none(gpu: Gpu) -> int | None:
    """The GPU's default power limit, or None where NVML does not support its power limit."""
    if power_limit_or_none(gpu) is None:
        return None
    return gpu.power_limit_range().default_mw


def _left_by(store: StateStore, uuid: str) -> str:
    """Who left a GPU's state file, for the line that says it is dropped (an unreadable one
    is named by its path)."""
    try:
        pending = store.pending(uuid)
    except GpuStateError:
        pending = []
    if not pending:
        return f"the unreadable state file {store.path(uuid)}"
    return (
        f"the state file dvfs {pending[0].command!r} (pid {pending[0].pid}, since "
        f"{pending[0].since}) left unrestored"
    )


def enforce_plan(
    plan: CapsPlan,
    gpus: Sequence[Gpu],
    directory: Path,
    source: str,
    done: Callable[[CapAction], None] = lambda action: None,
) -> None:
    """Apply a plan's actions under the same safety layer as a sweep: each GPU's lock held,
    GPUs with unrestored changes refused, and signals unwinding rather than killing. `done`
    hears each action once applied (`apply_actions`)."""
    from dvfs.gpu.safety import GpuLocks, StateStore
    from dvfs.signals import signals_raise

    wanted = {a.uuid for a in plan.actions}
    targets = [g for g in gpus if g.identity.uuid in wanted]
    with signals_raise(), GpuLocks(directory).hold(targets):
        StateStore(directory).refuse_if_pending(targets)
        record = AppliedCaps(directory)
        # The plan read the record before this process held the GPUs' locks: another `cap
        # apply` (the caps unit beside an operator's) may have capped them since. What this
        # file leaves at stock is put back by the record as it is now, so the GPU holds this
        # file, not a mix of both.
        by_uuid = {g.identity.uuid: g for g in targets}
        recorded = record.entries_as_written() if plan.actions else {}
        actions = [
            _as_recorded(a, recorded.get(a.uuid, {}), by_uuid[a.uuid], directory)
            for a in plan.actions
        ]
        apply_actions(actions, targets, record, source, done)


def _as_recorded(
    action: CapAction, earlier: dict[str, Any], gpu: Gpu, directory: Path | None = None
) -> CapAction:
    """`action` with the knobs its file leaves at stock put back by `earlier`, the GPU's caps
    record entry read under its lock (`plan_actions` read it before), and the power limit it
    changes read under the lock too: "applied to" says the one it was changed from."""
    from dataclasses import replace

    current = action.current_power_limit_mw
    if action.power_limit_mw is not None:
        current = power_limit_or_none(gpu)
    doubt, back, refused = _power_plan(action.power_limit_mw, earlier, gpu, directory)
    return replace(
        action,
        current_power_limit_mw=current,
        unlock=action.lock_mhz is None and earlier.get("lock_mhz") is not None,
        power_limit_back=back,
        power_doubt=doubt,
        refused=refused,
    )


def _power_limit_back(
    limit_mw: int | None, earlier: dict[str, Any], gpu: Gpu, directory: Path | None = None
) -> tuple[int | None, str] | None:
    """Where a caps file sets no power limit on a GPU whose caps record `earlier` lists one
    dvfs set: the limit that goes back and its words, as `cap reset --applied` puts it back
    (`_limit_replaced`: the one dvfs's cap replaced, the operator's own before dvfs; left be
    where one was set outside dvfs since), so the apply, the record it leaves (no power limit
    dvfs's) and a later `cap reset --applied` (which leaves the limit be) agree; None where
    there is none to put back."""
    if limit_mw is not None or earlier.get("power_limit_mw") is None:
        return None
    before = earlier.get("power_limit_before_mw")
    if not _positive_int(earlier["power_limit_mw"]):  # damaged: the GPU holds the limit it
        # replaced (else `_spoiled_power` sets the knob aside), so none is dvfs's now
        if not _positive_int(before):  # (NVML does not support its power limit)
            return None
        return (before, f"power limit {before / 1000:g} W (as before `dvfs cap apply`)")
    return _limit_replaced(gpu, earlier, gpu.power_limit_range().default_mw, directory=directory)


def reset_locked(
    gpus: Sequence[Gpu],
    directory: Path,
    command: str = "dvfs cap reset",
    *,
    applied_only: bool = False,
) -> tuple[
    list[str],
    list[tuple[Gpu, GpuBusyError]],
    GpuError | CapsRecordError | RestoreBugError | None,
]:
    """`reset_caps` with each GPU's lock held, so a running dvfs keeps its GPUs: those it
    holds are left alone and returned (with their refusals) beside what was done on the others, so
    that one running governor does not keep every other GPU capped (`cap reset` at the caps
    unit's stop). The GPUs that failed come back as one error beside what was done on the
    others and the GPUs held, for the caller to say all three. `command`: the reset as typed,
    less --state-dir, said to run again where a file in `directory` cannot be written (its
    DEVICES too: run again without them, it resets every GPU's caps)."""
    from dvfs.gpu.safety import GpuLocks
    from dvfs.signals import signals_raise

    locks = GpuLocks(directory)
    with signals_raise(), contextlib.ExitStack() as held:
        free: list[Gpu] = []
        busy: list[tuple[Gpu, GpuBusyError]] = []
        for gpu in gpus:
            try:
                held.enter_context(locks.hold([gpu]))
            except GpuBusyError as exc:
                busy.append((gpu, exc))
                continue
            except OSError as exc:  # before any GPU is reset
                line = state_file_problem(exc)
                if line is None:
                    raise
                again = state_dir_command(command, directory)
                raise CapsRecordError(
                    f"{line}, then run `{again}` again (no GPU was reset)"
                ) from exc
            free.append(gpu)
        lines: list[str] = []
        try:
            reset_caps(
                free,
                AppliedCaps(directory),
                note=lines.append,
                command=command,
                applied_only=applied_only,
            )
        except (GpuError, CapsRecordError, RestoreBugError) as exc:  # said beside the GPUs
            # reset (a bug in a GPU's reset too: raised, the lines of those reset were lost)
            return lines, busy, exc
        return lines, busy, None


def _set_by(lock: LockInForce, gpu: Gpu, directory: Path) -> str:
    """Who set a lock; for a governor's, that it is gone when no dvfs holds the GPU's lock any
    more (killed with SIGKILL: its lock stays on the GPU, and nothing restores it by itself)."""
    from dvfs.gpu.safety import GpuLocks, reset_command

    if not lock.by_governor:
        return lock.set_by
    path = directory / f"{gpu.identity.uuid}.lock"
    not_a_lock = GpuLocks(directory).not_a_lock(gpu)
    if not_a_lock:  # no lock a governor holds, nor one telling whether it runs
        return (
            f"dvfs govern (pid {lock.record.get('pid')}, since {lock.record.get('since')}; "
            f"whether it runs cannot be told: {not_a_lock})"
        )
    if not os.access(path, os.R_OK) or GpuLocks(directory).holder(gpu) is not None:
        return lock.set_by  # running, or it cannot be told here
    return (
        f"dvfs govern (pid {lock.record.get('pid')}, since {lock.record.get('since')}; no longer "
        f"running: {reset_command(directory)} puts back what it found)"
    )


def caps_status(gpus: Sequence[Gpu], directory: Path) -> list[dict[str, Any]]:
    """What is enforced per GPU now: power limits read from the GPU, clock locks from dvfs's
    records (NVML cannot read a lock back): a running governor's, else `cap apply`'s (whose
    static caps stay in `caps_sm_clock_lock_mhz`)."""
    applied = AppliedCaps(directory).entries_as_written()  # a damaged knob: warned of, unknown
    in_force = locks_in_force(directory, spoiled_ok=True)
    rows = []
    for g in gpus:
        ident = g.identity
        record = applied.get(ident.uuid, {})
        lock = in_force.get(ident.uuid)
        configured = power_limit_or_none(g)  # None: not supported (nor its range)
        default = None if configured is None else g.power_limit_range().default_mw / 1000
        rows.append(
            {
                "index": ident.index,
                "uuid": ident.uuid,
                "name": ident.name,
                "enforced_power_limit_w": g.enforced_power_limit_mw() / 1000,
                "configured_power_limit_w": None if configured is None else configured / 1000,
                "default_power_limit_w": default,
                "sm_clock_lock_mhz": None if lock is None else list(lock.lock_mhz),
                "sm_clock_lock_set_by": (
                    _set_by(lock, g, directory)
                    if lock is not None
                    else "dvfs cap apply (to what, its damaged caps record entry does not say)"
                    if record.get("lock_mhz") is not None
                    else None
                ),
                "caps_sm_clock_lock_mhz": (
                    record["lock_mhz"] if _is_lock(record.get("lock_mhz")) else None
                ),
                "sm_clock_mhz": g.sm_clock_mhz(),
                "caps_source": record.get("source"),
                "applied": record.get("applied"),
            }
        )
    return rows


def reset_gpus(
    gpus: Sequence[Gpu],
    directory: Path,
    *,
    defaults: bool,
    note: Callable[[str], None],
    skip_busy: bool = False,
    command: str = "",
    caps_command: str = "dvfs cap reset",
) -> bool:
    """`dvfs gpu reset`: restore what state files record for these GPUs and, with `defaults`,
    reset the others to driver defaults, holding the lock of each GPU acted on. `note` hears
    each GPU as it is done ("restored ..." / "reset ..."). False when there was nothing to do.

    A GPU another dvfs holds is refused (GpuBusyError); with `skip_busy` (no GPU named) it is
    left to that process, which restores it itself, with a note, and the others are still
    restored: a governor's unit restoring after its crash must not fail because another
    governor runs on another GPU. `command`: the reset as it was typed, less --state-dir (its
    DEVICES too: run again without them, --defaults resets every GPU), said to run again where
    a lock cannot be written in `directory`; `caps_command`, the `cap reset` of the same GPUs,
    where --defaults cannot rewrite the caps record."""
    from dvfs.gpu.safety import GpuLocks, StateStore, bug_advice, restore_pending
    from dvfs.signals import signals_raise

    store = StateStore(directory)
    store.readable()  # a folder that cannot be read: refused once, not once per GPU
    # A GPU whose state file is unreadable (damaged, edited by hand) is left as it is, named
    # once the others are restored: it must not keep them from their recorded settings.
    unreadable: list[GpuError] = []
    readable: list[Gpu] = []
    for gpu in gpus:
        try:
            store.pending(gpu.identity.uuid)
        except GpuStateError as exc:
            unreadable.append(exc)
            continue
        readable.append(gpu)
    governed = GovernorLocks(directory)
    # A governor killed after recording its lock but before changing the GPU left a record
    # with nothing to restore: cleared under the GPU's lock (a live governor holds it). A
    # GPU whose record is damaged is left as it is, named once the others are restored.
    recorded: dict[str, dict[str, Any]] = {}
    damaged: list[CapsRecordError] = []
    gpus = []
    for gpu in readable:
        try:
            recorded.update(governed.recorded({gpu.identity.uuid}))
        except CapsRecordError as exc:
            damaged.append(exc)
            continue
        gpus.append(gpu)
    with_state = [g for g in gpus if store.pending(g.identity.uuid)]
    stale = [g for g in gpus if g.identity.uuid in recorded and g not in with_state]
    if not with_state and not stale and not defaults:
        _raise_all(unreadable, damaged)
        return False
    targets = list(gpus) if defaults else [*with_state, *stale]
    locks = GpuLocks(directory)
    with signals_raise(), contextlib.ExitStack() as held:
        busy = []
        for gpu in targets:
            try:
                held.enter_context(locks.hold([gpu]))
            except GpuBusyError as exc:
                if not skip_busy:
                    raise
                busy.append(gpu)
                note(
                    f"skipped GPU {gpu.identity.index} ({gpu.identity.uuid}): in use by another "
                    f"dvfs process (pid {exc.pid}), which restores it itself"
                )
            except OSError as exc:  # before any GPU is restored: never "another --state-dir",
                # whose reset finds none of the state files this folder keeps
                line = state_file_problem(exc)
                if line is None:
                    raise
                again = state_dir_command(
                    command or "dvfs gpu reset" + (" --defaults" if defaults else ""), directory
                )
                raise GpuLockFileError(
                    f"{line}, then run `{again}` again (no GPU was restored)"
                ) from exc
        with_state = [g for g in with_state if g not in busy]
        stale = [g for g in stale if g not in busy]
        # A file from before the last reboot is dropped, not restored (`restore_pending`): its
        # GPU has no recorded settings to go back to, so --defaults resets it as it resets a
        # GPU without a file (something may have changed it since the reboot).
        rebooted = [
            g for g in with_state if all(p.before_this_boot for p in store.pending(g.identity.uuid))
        ]
        # One GPU failing to restore must not keep the others from their defaults, nor leave
        # what was restored unsaid: each is noted once done, the failures raised at the end.
        failed: list[GpuError] = unreadable
        bug: RestoreBugError | None = None
        try:
            restore_pending(with_state, store, note)
        except GpuError as exc:
            failed.append(exc)
        except RestoreBugError as exc:  # raised once the others are reset, naming them all
            bug = exc
        finally:  # a governor that died left its lock record: gone with what it changed
            for gpu in [*with_state, *stale]:
                if not store.pending(gpu.identity.uuid):
                    governed.clear(gpu.identity.uuid)
        for gpu in stale:
            # One from before the last reboot: that governor may well have changed the GPU,
            # but the reboot put it back (its state file is dropped for the same reason).
            record = recorded[gpu.identity.uuid]
            why = (
                "from before the last reboot, which reset the GPU"
                if before_this_boot(record.get("boot"), record.get("since"))
                else "that died before changing the GPU"
            )
            note(
                f"cleared GPU {gpu.identity.index} ({gpu.identity.uuid}): the lock record of "
                f"a dvfs govern {why} (nothing to restore)"
            )
        if defaults:
            others = [g for g in gpus if (g not in with_state or g in rebooted) and g not in busy]
            try:
                reset_caps(
                    others,
                    AppliedCaps(directory),
                    lambda line: note(f"reset {line}"),
                    command=caps_command,
                )
            except GpuError as exc:
                failed.append(exc)
            except RestoreBugError as exc:  # a bug in a GPU's reset: with the restore's, if any
                if bug is None:
                    bug = exc
                else:
                    failed.append(GpuError(str(exc)))
        if bug is not None:  # the other failures before the advice, which ends the line
            told = [str(e) for e in [*failed, *damaged]]
            advice = bug_advice(store)
            said = str(bug).removesuffix(advice)
            ending = advice if said != str(bug) else ""
            raise RestoreBugError("; ".join([said, *told]) + ending) from bug.__cause__
        _raise_all(failed, damaged)
    return True


def _raise_all(failed: Sequence[GpuError], damaged: Sequence[CapsRecordError]) -> None:
    """`_raise_together` of the GPUs that failed and those whose governor record is damaged
    (one such record alone raised as it is); nothing where there is neither."""
    if len(damaged) == 1 and not failed:
        raise damaged[0]
    if failed or damaged:
        _raise_together([*failed, *(GpuError(str(e)) for e in damaged)])


def _raise_together(failed: Sequence[GpuError]) -> None:
    """One error for every GPU that failed: the one as it is, several in one line."""
    if len(failed) == 1:
        raise failed[0]
    permission = any(isinstance(e, GpuPermissionError) for e in failed)
    raise (GpuPermissionError if permission else GpuError)("; ".join(map(str, failed)))
