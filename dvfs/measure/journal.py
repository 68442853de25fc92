"""The journal: one JSON line per event, written through to the OS at once, so no finished
cell is ever lost when the process dies.

Line 1 is a header naming the campaign; later lines are `session`, `server` and `cell`
records, whose format `dvfs.records` owns: this module only stores and reads lines. A rerun
reads the journal, skips finished cells, retries failed ones and appends. A line cut short by
a crash is dropped on open; any other bad line is an error naming the file and line, and so
is a second header (another journal appended to this one).

Each record is handed to the kernel before `append` returns (a killed process loses nothing);
when it reaches the disk (fsync, what a power loss needs) is the `SyncPolicy`: every record on
real hardware, where a cell takes seconds, and in groups on the twin, where cells take
milliseconds and one fsync each cost a sixth of the sweep. Reading streams line by line, and
an open journal keeps only what a resume needs (the finished cells' keys and the sessions).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shlex
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from dvfs.campaign import Campaign
from dvfs.errors import JournalError
from dvfs.records import Header, check_version
from dvfs.report import json_safe

JOURNAL_NAME = "journal.jsonl"

log = logging.getLogger(__name__)


def describe_os_error(exc: OSError, doing: str, *, show_file: bool = True) -> str:
    """One line saying what failed on disk and what to do about it, each thing once (a
    read-only file system was "Read-only file system; the filesystem is read-only")."""
    where = f" ({exc.filename})" if exc.filename and show_file else ""
    reason = exc.strerror or str(exc)
    hints = {
        errno.ENOSPC: "free some space on that filesystem and run the command again",
        errno.EDQUOT: "free some space (disk quota) and run the command again",
        errno.EACCES: "choose a folder you can write to with --out",
        errno.EPERM: "choose a folder you can write to with --out",
        errno.ENOTDIR: "part of that path is a file, not a folder: choose another --out",
        errno.EEXIST: "a file is in the way of that folder: choose another --out",
        errno.EISDIR: "a folder is in the way of that file: move it aside, or choose another --out",
        errno.ENAMETOOLONG: "use a shorter path",
        errno.EIO: (
            "the disk or network file system under it failed (see dmesg): check it, then run "
            "the command again"
        ),
        errno.ELOOP: (
            "a symbolic link there leads back to itself (a loop): remove it or point it at a "
            "file, or choose another --out"
        ),
    }
    if exc.errno == errno.EROFS:  # its strerror and a hint said it twice
        return (
            f"cannot {doing}{where}: its file system is mounted read-only: choose another "
            "folder with --out"
        )
    hint = hints.get(exc.errno or 0)
    return f"cannot {doing}{where}: {reason}" + (f"; {hint}" if hint else "")


def journal_differences(header: dict[str, Any], campaign: Campaign) -> list[str]:
    """The measured settings in which `campaign` differs from the one a raw header was written
    for (empty: the journal may be resumed)."""
    return Header.from_json(header).differences(campaign)


#: How in-flight stepping carries each level's energy per token to a per-level cell's context
#: (`dvfs.measure.inflight.context_slope`), as its cell records say (`inflight.context`'s
#: `energy_per_token_drift`; absent: an earlier dvfs, exponential or not carried at all).
INFLIGHT_ENERGY_DRIFT = "linear"


#: How a refusal of a damaged journal says to start over: the sweep's own command with
#: --fresh, its --out kept (without it, the campaign is swept into out/<name> and the damaged
#: journal stays where it is) and a shard's `--shard I/N` (without it, the whole campaign
#: would be swept into the shard's folder).
FRESH = (
    "`dvfs sweep CAMPAIGN --out DIR --fresh` (DIR the folder it was swept into, a shard's with "
    "its `--shard I/N`)"
)


def renamed_note(header: dict[str, Any], campaign: Campaign) -> str | None:
    """What a resume of a journal started under another campaign name says (None where the
    names agree): the name is no part of the campaign's hash, so the journal resumes and its
    cube keeps the name (and campaign file) of the run that started it."""
    name = header.get("campaign_name")
    if name is None or name == campaign.name:
        return None
    return (
        f"resuming campaign {name!r}'s journal: campaign.name is now {campaign.name!r}, but the "
        f"cube keeps {name!r}, the journal's (the name changes no measurement); to take the new "
        "name, sweep with --fresh or into another --out folder"
    )


def resume_advice(fresh: bool) -> str:
    """How a sweep (a fleet) whose GPUs were lost with cells left resumes: its command again,
    less --fresh (which would move the journal aside, unread, and start over)."""
    if fresh:
        return "rerun the same command without --fresh to resume (with it, it starts over)"
    return "rerun the same command to resume"


def fresh_is_the_sweeps(text: str, out_dir: Path) -> str:
    """`text` (a refusal of a journal in `out_dir`, said by a command that has no --fresh:
    `dvfs doctor`, `dvfs cube build`) whose advice is the sweep's --fresh ("rerun with
    --fresh", "use --fresh to move the old journal aside"), with the sweep's command that
    takes it named: its user, told so, adds it to that command, which refuses it ("No such
    option"). As it is where the sweep's command is named already."""
    if "--fresh" not in text or "`dvfs sweep" in text:
        return text
    sweep = shlex.join(["dvfs", "sweep", "CAMPAIGN", "--out", str(out_dir), "--fresh"])
    return f"{text} (--fresh is the sweep's: `{sweep}`, with the --shard and --gpus it runs with)"


def check_resumable(
    path: Path,
    first: dict[str, Any],
    campaign: Campaign,
    sessions: Iterable[dict[str, Any]] = (),
) -> None:
    """Refuse (`JournalError`) to resume `campaign` from the journal at `path` whose first
    record is `first` and whose session records are `sessions`: not a header, another schema
    (the header's, or a later session's: a newer dvfs resumed the journal), or another
    campaign or settings."""
    if first.get("type") != "header":
        raise JournalError(
            f"{path} does not start with a dvfs journal header: move it aside, or start "
            f"over with {FRESH}, which renames it"
        )
    header = Header.from_json(first)
    check_version(path, header.journal_schema)
    for session in sessions:
        # A session's records follow its own version: one a newer dvfs wrote would be read
        # as this dvfs's, and its cube refused only once the cells left were measured.
        check_version(path, session.get("journal_schema", header.journal_schema))
    changes = header.differences(campaign)
    if not changes:
        return
    remedy = "use --fresh to move the old journal aside and start over, or another --out folder"
    if header.campaign_name != campaign.name:
        raise JournalError(
            f"{path} belongs to another campaign, {header.campaign_name!r} (hash "
            f"{header.campaign_hash}), not {campaign.name!r}: {remedy}"
        )
    more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
    shown = "; ".join(changes[:3]) + more
    observe = (
        " (--observe-only sets gpu.actuation to false and the knobs to stock)"
        if any(c.startswith("gpu.actuation") for c in changes)
        else ""
    )
    raise JournalError(
        f"{path} belongs to campaign {header.campaign_name!r} "
        f"(hash {header.campaign_hash}) measured with other settings: {shown}"
        f"{observe}. Cells measured under different settings cannot share a cube: {remedy} "
        "(retries, timeouts, the server command, its environment and URL may change "
        "between runs)."
    )


def check_journal_link(path: Path) -> None:
    """Refuse (`JournalError`) a journal at `path` that is a symbolic link the sweep cannot open
    to write: one in a loop, or one to a file in a folder that does not exist (a link to a file
    not made yet, in a folder that is there, is followed: the sweep makes that file). The
    sweep's refusal, said before it opens the journal, and as it says it by `dvfs doctor` and
    the dry run, whose `path.exists()` denies such a link is there."""
    if not os.path.islink(path):
        return
    try:
        os.stat(path)
    except OSError as exc:
        missing = exc.errno == errno.ENOENT
        if missing and Path(os.path.realpath(path)).parent.is_dir():
            return
        text = describe_os_error(exc, f"write the journal {path}", show_file=False)
        if missing:
            text += (
                f"; it is a symbolic link to {os.readlink(path)}, in a folder that does not "
                "exist: point it at a file in one that does, remove it, or choose another --out"
            )
        raise JournalError(text) from exc


def check_journal(path: Path, campaign: Campaign) -> None:
    """What `Journal.open` would refuse about the journal at `path` for `campaign`: a link it
    cannot open (`check_journal_link`), its header, then (once that is sound) every session
    record, writing nothing (`dvfs doctor`); no file is no refusal."""
    check_journal_link(path)
    if not path.exists():
        return
    records = iter_records(path)
    first = next(records, None)
    if first is not None:  # the sessions read on only once the header is found sound
        sessions = (r for r in records if r.get("type") == "session")
        check_resumable(path, first, campaign, sessions)


#: A journal line's JSON: compact and strict (NaN is `json_safe`'s null). One encoder for
#: every line, and no check for circular containers: `json_safe` hands it a fresh tree (it
#: copies every container, and recurses forever on a cyclic record before any is written).
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False, check_circular=False)


#: Longest a record may wait for its fsync on the twin (seconds of wall time), as long as
#: the sweep goes on; closing the journal (normal end, error, signal) always syncs.
GROUP_SYNC_S = 1.0


@dataclass(frozen=True)
class SyncPolicy:
    """When the journal's writes are forced to disk. `group_s` 0: after every record (real
    hardware); above 0: cells at the first written `group_s` or more after the last sync, any
    other record at once, and on close (the twin, in virtual time)."""

    group_s: float = 0.0

    @classmethod
    def for_clock(cls, virtual: bool) -> SyncPolicy:
        return cls(GROUP_SYNC_S) if virtual else cls()

    @property
    def grouped(self) -> bool:
        return self.group_s > 0

    def due(self, *, cell: bool, waited_s: float) -> bool:
        """Whether to sync after writing a record, `waited_s` after the last sync. Only cells
        are grouped: the header, sessions and servers are a handful per run."""
        return not self.grouped or not cell or waited_s >= self.group_s

    def describe(self) -> str:
        """How the session record states it."""
        if not self.grouped:
            return "fsync after every record"
        return (
            f"cells fsynced in groups, at the first cell {self.group_s:g} s of wall time or "
            "more after the last fsync; other records and the journal's close at once"
        )


class Journal:
    """Append-only, crash-safe record of a campaign's progress.

    Holds the finished cells' keys and the session records, never the cells' records; close it
    (or use it as a context manager) so the last group reaches the disk."""

    def __init__(
        self,
        path: Path,
        records: Iterable[dict[str, Any]] = (),
        *,
        sync: SyncPolicy | None = None,
        fsync: Callable[[int], None] | None = None,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        self.path = path
        self.sync_policy = sync or SyncPolicy()
        self._fsync = fsync  # None: os.fsync, looked up when called
        self._monotonic = monotonic or (lambda: time.monotonic())  # looked up when called
        self._fd: int | None = None
        self._dirty = False
        self._synced_at = self._monotonic()
        self._first: dict[str, Any] | None = None  # the header, in a sound journal
        self._sessions: list[dict[str, Any]] = []
        #: A run's session, held until the run journals another record (`defer`).
        self._deferred: dict[str, Any] | None = None
        #: Records held with it, written after it (`follow`).
        self._following: list[dict[str, Any]] = []
        self._ok: set[str] = set()
        #: Keys of in-flight cells whose energy per token was carried to a per-level cell's
        #: context otherwise than this dvfs carries it (`INFLIGHT_ENERGY_DRIFT`).
        self._drift_otherwise: set[str] = set()
        for record in records:
            self._note(record)

    def _note(self, record: dict[str, Any]) -> None:
        """Keep what a resume needs from one record."""
        kind = record.get("type")
        if self._first is None:
            self._first = record
        if kind == "session":
            self._sessions.append(record)
        elif kind == "cell":
            if record.get("status") == "ok":
                self._ok.add(record["key"])
            else:  # a later record replaces an earlier one
                self._ok.discard(record["key"])
            inflight = record.get("inflight")
            context = inflight.get("context") if isinstance(inflight, dict) else None
            drift = context.get("energy_per_token_drift") if isinstance(context, dict) else None
            if record.get("status") == "ok" and inflight and drift != INFLIGHT_ENERGY_DRIFT:
                self._drift_otherwise.add(record["key"])
            else:
                self._drift_otherwise.discard(record["key"])

    @classmethod
    def open(
        cls, path: str | Path, campaign: Campaign, *, sync: SyncPolicy | None = None
    ) -> Journal:
        """Open (creating if needed) the journal for `campaign`; refuse another campaign's.
        As root, a journal path through another user's link is refused (`check_links`)."""
        from dvfs.outputs import check_links

        path = Path(path)
        check_links(path)  # else its torn line cut, its records appended, wherever it points
        check_journal_link(path)  # a link in a loop or to no folder: refused before its use
        records = iter_records(path, repair=True) if path.exists() else iter(())
        journal = cls(path, records, sync=sync)
        first = journal._first
        if first is None:
            journal.append(Header.for_campaign(campaign).to_json())
            return journal
        check_resumable(path, first, campaign, journal.sessions)
        return journal

    @property
    def header(self) -> dict[str, Any]:
        if self._first is None or self._first.get("type") != "header":
            raise JournalError(f"{self.path} does not start with a dvfs journal header")
        return self._first

    @property
    def sessions(self) -> tuple[dict[str, Any], ...]:
        """The session records, oldest first (one per run of `dvfs sweep` that measured)."""
        return tuple(self._sessions)

    def finished(self) -> set[str]:
        """Keys of cells measured successfully: a rerun skips these."""
        return set(self._ok)

    def check_inflight_drift(self, keys: Iterable[str]) -> None:
        """Refuse to measure the cells `keys` names that are not finished where the journal
        holds in-flight cells an earlier dvfs carried to a per-level cell's context along
        another drift (an exponential one, or none): the cells measured now, carried along
        `INFLIGHT_ENERGY_DRIFT`'s, would not compare with them."""
        if not self._drift_otherwise or not set(keys) - self._ok:
            return
        raise JournalError(
            f"{self.path} holds {len(self._drift_otherwise)} in-flight cell(s) whose energy per "
            "token an earlier dvfs carried to a per-level cell's context along another drift "
            f"than this dvfs's ({INFLIGHT_ENERGY_DRIFT} in the tokens decoded): the cells "
            "measured now would not compare with them (up to 2% apart at large batches); "
            "finish the journal with the dvfs that began it, or start over with "
            f"{FRESH}, which renames it"
        )

    def defer(self, record: dict[str, Any]) -> None:
        """Hold `record` (a run's session) until the run journals another, then write it just
        before that one, in the same write: a run that journals nothing (refused at its first
        server start, every fleet worker retired or lost before a unit came in) leaves the
        journal as it found it."""
        self._deferred = record
        self._following = []

    def follow(self, record: dict[str, Any]) -> None:
        """Journal `record` (a Ray worker's `worker_lost`), which tells of the run but measured
        nothing: at once where the run's session is written, else held with it and written
        after it with the run's first other record, or dropped with it where the run
        journals none (its reset advice is in the run's error line), so that a journal holds
        no session that measured nothing."""
        if self._deferred is None:
            self.append(record)
        else:
            self._following.append(record)

    def append(self, record: dict[str, Any]) -> None:
        """Write one record through to the OS (a killed process keeps it), and to disk as the
        sync policy says."""
        self.append_all([record])

    def append_all(self, records: Sequence[dict[str, Any]]) -> None:
        """Write records that stand or fall together (an in-flight group's cells, a fleet
        worker's shipment) through to the OS in one write, so that no signal lands between
        two of them: a resume that found only some of them would measure the others apart,
        an in-flight group's remaining levels in decodes of their own. To disk as the sync
        policy says, once for them all."""
        if not records:
            return
        if self._deferred is not None:
            records = [self._deferred, *self._following, *records]
        lines = [_ENCODER.encode(json_safe(record)) for record in records]
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        try:
            if self._fd is None:
                from dvfs.outputs import check_links

                check_links(self.path)  # as root, not appended through another user's link
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            self._write(self._fd, data)
            # Held until written: a write cut back off (a full disk) keeps it for the next
            # one (a fleet journals what its workers finish on its way out), else their
            # records would stand in the journal without their run's session.
            self._deferred = None
            self._following = []
            self._dirty = True
            if self.sync_policy.due(
                cell=all(record.get("type") == "cell" for record in records),
                waited_s=self._monotonic() - self._synced_at,
            ):
                self.sync()
        except OSError as exc:
            # A write cut short is cut back off (`_write`), or its torn last line the next
            # open drops.
            raise JournalError(
                describe_os_error(exc, f"write the journal {self.path}", show_file=False)
            ) from exc
        # A cell is noted by its key and status; the rare others as stored (JSON types).
        for record, line in zip(records, lines, strict=True):
            self._note(record if record.get("type") == "cell" else json.loads(line))

    @staticmethod
    def _write(fd: int, data: bytes) -> None:
        """Write `data` at the end of the journal, all of it or none: a write that fails
        part-way (a full disk) is cut back off, else its whole records (some levels of an
        in-flight group) would stand before its torn last line and a resume would measure the
        others apart."""
        start = os.fstat(fd).st_size  # where O_APPEND writes (the sweep's lock: one writer)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            if len(view) < len(data):
                with contextlib.suppress(OSError):  # else the next open drops the torn line
                    os.ftruncate(fd, start)
            raise

    def sync(self) -> None:
        """Force what was written to disk (nothing to do when nothing was)."""
        if self._fd is not None and self._dirty:
            try:
                (self._fsync or os.fsync)(self._fd)
            except OSError as exc:
                raise JournalError(
                    describe_os_error(exc, f"write the journal {self.path}", show_file=False)
                ) from exc
            self._dirty = False
        self._synced_at = self._monotonic()

    def close(self) -> None:
        """Sync the last group and let the file go; appending again reopens it."""
        if self._fd is None:
            return
        try:
            self.sync()
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            self.close()
            return
        try:  # the error or signal on its way out is the one to report
            self.close()
        except JournalError as error:
            log.warning("%s", error)


def read_records(path: str | Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """Every record of a journal in a list (for small journals and tests; see `iter_records`)."""
    return list(iter_records(path, repair=repair))


def session_records(path: str | Path) -> list[dict[str, Any]]:
    """A journal's session records, oldest first, read without opening it for writing (as
    `Journal.sessions` holds them): what `dvfs doctor` and the dry run compare a resume by."""
    return [r for r in iter_records(path) if r.get("type") == "session"]


#: The longest journal line read (a header, with its campaign text and corpora, runs to tens of
#: KiB; a cell record to a few). A longer one is damage or no journal at all (a symlink to
#: /dev/zero, a binary file without newlines): reading it whole could take all the memory.
MAX_LINE_BYTES = 64 << 20


def iter_records(path: str | Path, *, repair: bool = False) -> Iterator[dict[str, Any]]:
    """Parse a journal line by line. A torn last line (a crash mid-write) is dropped, and cut
    off the file when `repair` is set so appends start on a fresh line; a bad line elsewhere,
    or a file that does not start with a record, is a `JournalError` naming the file and the
    line. The repairs happen when the iteration reaches the end."""
    path = Path(path)
    f = _open_journal(path)
    with f:
        good_bytes = 0  # where the line being read starts
        count = 0
        number = 0
        while True:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as exc:
                raise _os_error(exc, "read the journal", path) from exc
            if not raw:
                return
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                why = f"longer than {MAX_LINE_BYTES >> 20} MiB, which no dvfs record is"
                raise _bad_line(path, number, why, first=not count, raw=raw)
            if not raw.strip():
                good_bytes += len(raw)
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except ValueError as exc:  # not UTF-8, or not JSON
                rest = f.readline(MAX_LINE_BYTES + 1)
                last = not rest.endswith(b"\n") and not rest.strip()
                if last and count:
                    if repair:
                        _truncate(path, good_bytes)
                    return
                why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else "not valid JSON"
                raise _bad_line(path, number, why, first=not count, raw=raw) from exc
            problem = _record_problem(record)
            if problem:
                raise _bad_line(path, number, problem, first=not count, raw=raw)
            if count and record["type"] == "header":
                raise _appended_journal(path, number, record)
            count += 1
            if repair and not raw.endswith(b"\n"):
                # A complete record without its newline: finish the line so the next append is
                # clean.
                try:
                    with open(path, "ab") as out:
                        out.write(b"\n")
                except OSError as exc:
                    raise _os_error(exc, "repair the journal", path, write=True) from exc
            good_bytes += len(raw)
            yield record


def _open_journal(path: Path) -> BinaryIO:
    """`path` opened for reading: a regular file, else a `JournalError`. Opened without
    blocking, so that a FIFO (which no writer may ever open) is refused, not waited on for
    ever, and a device (/dev/zero) is refused unread."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise _os_error(exc, "read the journal", path) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "no regular file (a FIFO, a device)"
            raise JournalError(
                f"{path} is {what}, so no dvfs journal: move it aside, or start over with "
                f"{FRESH}, which renames it"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except OSError as exc:
        os.close(fd)
        raise _os_error(exc, "read the journal", path) from exc
    except BaseException:
        os.close(fd)
        raise


#: What to do about a journal this user may not read (EACCES, EPERM): not a folder to write
#: to, which `describe_os_error` advises for those, nor another --out, which is no journal's
#: folder for `dvfs cube build` (its cube's path).
UNREADABLE_HINT = (
    "this user may not read it (or search its folder): make it readable to this user "
    "(chmod, chown), or run as the user who swept it"
)

#: What to do about a journal this user may not write (EACCES, EPERM) where a resume repairs
#: it (cuts its torn last line, ends its last line): its reading was never the matter.
UNWRITABLE_HINT = (
    "this user may not write it: make it writable to this user (chmod, chown), or run as "
    "the user who swept it"
)


def _os_error(exc: OSError, doing: str, path: Path, *, write: bool = False) -> JournalError:
    """`describe_os_error`'s line for the journal at `path`, named where the failing call
    carries no file name (a read, an fstat of the opened file): else the line names none.
    Denied: what makes it readable (or writable, for a `write`), not a folder to write to."""
    line = describe_os_error(exc, doing if exc.filename else f"{doing} {path}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        line = f"{line.rpartition('; ')[0]}; {UNWRITABLE_HINT if write else UNREADABLE_HINT}"
    return JournalError(line)


def _truncate(path: Path, size: int) -> None:
    try:
        with open(path, "r+b") as f:
            f.truncate(size)
    except OSError as exc:
        raise _os_error(exc, "cut the torn last line off the journal", path, write=True) from exc


def _record_problem(record: Any) -> str | None:
    """Why a parsed line is not a journal record (None if it is one)."""
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return "not a journal record (a JSON object with a type)"
    if record["type"] == "cell" and not (
        isinstance(record.get("key"), str) and isinstance(record.get("cell"), dict)
    ):
        return "a cell record without its key"
    if record["type"] == "cell":
        return _cell_problem(record["cell"])
    if record["type"] == "session":
        return _gpu_text_problem(record.get("gpus"))
    return None


#: The GPU identity a session reads as text where NVML gives it ("": not read), which a cube
#: records as an attribute and `cube info`, the report and `compare` print in a line.
GPU_TEXT_KEYS = ("ecc_mode", "vbios_version")


def _gpu_text_problem(gpus: Any) -> str | None:
    """Why a session record's GPUs' `GPU_TEXT_KEYS` are not text (None if they are, or absent):
    a hand-edited list or number went into the cube as its repr, and a name longer than a
    cube's attribute may hold made a cube that `cube info` called damaged, to be rebuilt from
    this same journal."""
    from dvfs.cube.schema import MAX_NAME_CHARS

    for gpu in gpus if isinstance(gpus, list) else ():
        for key in GPU_TEXT_KEYS:
            value = gpu.get(key) if isinstance(gpu, dict) else None
            if value is None:
                continue
            if not isinstance(value, str) or len(value) > MAX_NAME_CHARS or not value.isprintable():
                return (
                    f"a session record whose GPU {_shown(gpu.get('index'))}'s {key} is "
                    f"{_shown(value)}, not a one-line name of at most {MAX_NAME_CHARS} "
                    'characters (or "")'
                )
    return None


def _whole(value: Any) -> bool:
    """An integer as JSON holds one (a float with no fraction passes, as `Cell.from_dict`
    reads it; true and false do not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or value.is_integer()


#: A cell coordinate the record lacks.
_MISSING = object()


def _shown(value: Any) -> str:
    """A coordinate as the journal's line has it (JSON: null, "x"), cut short."""
    text = "missing" if value is _MISSING else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _cell_problem(cell: dict[str, Any]) -> str | None:
    """Why a cell record's coordinates are not a cell's (None if they are): caught as the line
    is read, so an edited record is named by its line before a resume measures anything."""
    for name in ("drafter", "corpus"):
        value = cell.get(name, _MISSING)
        if not isinstance(value, str):
            return f"a cell record whose {name} is {_shown(value)}, not a name"
    for name, least in (("repeat", 0), ("batch", 1)):
        value = cell.get(name, _MISSING)
        if not _whole(value) or value < least:
            return f"a cell record whose {name} is {_shown(value)}, not a whole number from {least}"
    clock = cell.get("sm_clock_mhz", _MISSING)
    if clock is not None and not (_whole(clock) and clock > 0):
        return f"a cell record whose sm_clock_mhz is {_shown(clock)}, not a clock in MHz or null"
    limit = cell.get("power_limit_w", _MISSING)
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int | float) or not limit > 0
    ):
        return f"a cell record whose power_limit_w is {_shown(limit)}, not a limit in W or null"
    return None


def _appended_journal(path: Path, line: int, header: dict[str, Any]) -> JournalError:
    """A header after line 1: another journal appended to this one (`cat`), whose cells would
    pass for this journal's campaign and settings, or replace this journal's own."""
    name, digest = header.get("campaign_name"), header.get("campaign_hash")
    return JournalError(
        f"{path}, line {line}: a second journal header (campaign {name!r}, hash {digest}): "
        "another journal was appended to this one, and its cells would be taken for this "
        f"journal's campaign and settings: cut the file before line {line} to keep this "
        f"journal's own records, or start over with {FRESH}, which renames it"
    )


def _bad_line(path: Path, line: int, why: str, *, first: bool, raw: bytes = b"") -> JournalError:
    if first:
        return JournalError(
            f"{path} is not a dvfs journal (line {line}: {why}): move it aside, or start over "
            f"with {FRESH}, which renames it"
        )
    damaged = f"{path}, line {line}: {why}. The journal is damaged: start over with {FRESH} (it "
    kind = _line_type(raw)
    end, cells = _session_span(path, line) if kind in ("session", None) else (line, 0)
    if end == line:  # a cell (measured again), a server's start, or nothing after it
        again = " (the sweep measures that cell again)" if kind == "cell" else ""
        return JournalError(f"{damaged}moves the journal aside), or delete line {line}{again}")
    # A session's cells are read as measured in the session before them: deleting its line
    # alone left them with none (a first session: "no measurement session yet", to which a
    # rerun, skipping them as done, said the same), or took them for another's GPUs.
    span = (
        f"lines {line}-{end} (the session and the {cells} cell record(s) measured in it, "
        "which the sweep measures again)"
    )
    if kind == "session":
        how = f"delete {span}: deleting line {line} alone leaves its cells without their session"
    else:
        how = f"delete line {line} if it is no session record, else {span}"
    return JournalError(f"{damaged}moves the journal aside), or {how}")


def _line_type(raw: bytes) -> str | None:
    """The record type a journal line begins with (dvfs writes it first), read from its text,
    damaged or not; None where it cannot be read there."""
    import re

    found = re.match(rb'\s*\{\s*"type"\s*:\s*"([a-z_]+)"', raw[:200])
    return found[1].decode() if found else None


def _session_span(path: Path, line: int) -> tuple[int, int]:
    """The last line of the session record at `line`'s span (the lines after it up to the next
    session's, or the file's end), and the cell records in it; (line, 0) where the file cannot
    be read again. A line too long to hold ends the span there: what follows it is not read
    (a journal's records followed by gigabytes of zero bytes and no newline, a file extended but
    never written, took minutes to read to its end)."""
    end = cells = number = 0
    try:
        with open(path, "rb") as f:
            while raw := f.readline(MAX_LINE_BYTES):
                if len(raw) == MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    break  # no record is that long: damage, and no line after it is told
                number += 1
                if number <= line or not raw.strip():
                    continue
                kind = _line_type(raw)
                if kind in ("session", "header"):
                    break
                end, cells = number, cells + (kind == "cell")
    except OSError:
        return line, 0
    return max(end, line), cells
