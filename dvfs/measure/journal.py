"""The journal: one JSON line per event, flushed and fsynced, so no finished cell is ever lost.

Line 1 is a header naming the campaign; later lines are `session`, `server` and `cell`
records, whose format `dvfs.records` owns: this module only stores and reads lines. A rerun
reads the journal, skips finished cells, retries failed ones and appends. A line cut short by
a crash is dropped on open; any other bad line is an error naming the file and line.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dvfs.campaign import Campaign
from dvfs.errors import JournalError
from dvfs.records import Header, check_version
from dvfs.report import json_safe

JOURNAL_NAME = "journal.jsonl"


def describe_os_error(exc: OSError, doing: str, *, show_file: bool = True) -> str:
    """One line saying what failed on disk and what to do about it."""
    where = f" ({exc.filename})" if exc.filename and show_file else ""
    reason = exc.strerror or str(exc)
    hints = {
        errno.ENOSPC: "free some space on that filesystem and run the command again",
        errno.EDQUOT: "free some space (disk quota) and run the command again",
        errno.EACCES: "choose a folder you can write to with --out",
        errno.EPERM: "choose a folder you can write to with --out",
        errno.EROFS: "the filesystem is read-only: choose another folder with --out",
        errno.ENOTDIR: "part of that path is a file, not a folder: choose another --out",
        errno.EEXIST: "a file is in the way of that folder: choose another --out",
        errno.ENAMETOOLONG: "use a shorter path",
    }
    hint = hints.get(exc.errno or 0)
    return f"cannot {doing}{where}: {reason}" + (f"; {hint}" if hint else "")


def journal_differences(header: dict[str, Any], campaign: Campaign) -> list[str]:
    """The measured settings in which `campaign` differs from the one a raw header was written
    for (empty: the journal may be resumed)."""
    return Header.from_json(header).differences(campaign)


class Journal:
    """Append-only, crash-safe record of a campaign's progress."""

    def __init__(self, path: Path, records: list[dict[str, Any]]) -> None:
        self.path = path
        self._records = records

    @classmethod
    def open(cls, path: str | Path, campaign: Campaign) -> Journal:
        """Open (creating if needed) the journal for `campaign`; refuse another campaign's."""
        path = Path(path)
        records = read_records(path, repair=True) if path.exists() else []
        journal = cls(path, records)
        if not records:
            journal.append(Header.for_campaign(campaign).to_json())
            return journal
        if records[0].get("type") != "header":
            raise JournalError(
                f"{path} does not start with a dvfs journal header: move it aside, or start "
                "over with `dvfs sweep --fresh`, which renames it"
            )
        header = Header.from_json(records[0])
        check_version(path, header.journal_schema)
        changes = header.differences(campaign)
        if changes:
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
                f"{observe}. Cells measured under different settings cannot share a cube: use "
                "--fresh to move the old journal aside and start over, or another --out folder "
                "(retries, timeouts, the server command, its environment and URL may change "
                "between runs)."
            )
        return journal

    @property
    def records(self) -> list[dict[str, Any]]:
        return list(self._records)

    @property
    def header(self) -> dict[str, Any]:
        return self._records[0]

    def append(self, record: dict[str, Any]) -> None:
        """Write one record and make it durable before returning."""
        line = json.dumps(json_safe(record), separators=(",", ":"), allow_nan=False)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            # A line half written stays the torn last line, which the next open drops.
            raise JournalError(describe_os_error(exc, "write the journal")) from exc
        self._records.append(json.loads(line))

    def cells(self) -> dict[str, dict[str, Any]]:
        """The latest cell record per cell key (a retry replaces an earlier failure)."""
        latest: dict[str, dict[str, Any]] = {}
        for record in self._records:
            if record.get("type") == "cell":
                latest[record["key"]] = record
        return latest

    def finished(self) -> set[str]:
        """Keys of cells measured successfully: a rerun skips these."""
        return {k for k, r in self.cells().items() if r.get("status") == "ok"}

    def of_type(self, kind: str) -> Iterator[dict[str, Any]]:
        return (r for r in self._records if r.get("type") == kind)


def read_records(path: str | Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """Parse a journal. A torn last line (a crash mid-write) is dropped, and cut off the file
    when `repair` is set so appends start on a fresh line; a bad line elsewhere, or a file that
    does not start with a record, is a `JournalError` naming the file and the line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise JournalError(describe_os_error(exc, "read the journal")) from exc
    lines = data.split(b"\n")
    records: list[dict[str, Any]] = []
    good_bytes = 0
    for i, raw in enumerate(lines):
        if not raw.strip():
            good_bytes += len(raw) + (1 if i < len(lines) - 1 else 0)
            continue
        last = i >= len(lines) - 2 and not any(x.strip() for x in lines[i + 1 :])
        try:
            record = json.loads(raw.decode("utf-8"))
        except ValueError as exc:  # not UTF-8, or not JSON
            if last and records:
                if repair:
                    try:
                        with open(path, "r+b") as f:
                            f.truncate(good_bytes)
                    except OSError as os_exc:
                        raise JournalError(
                            describe_os_error(os_exc, "cut the torn last line off the journal")
                        ) from os_exc
                break
            why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else "not valid JSON"
            raise _bad_line(path, i + 1, why, first=not records) from exc
        problem = _record_problem(record)
        if problem:
            raise _bad_line(path, i + 1, problem, first=not records)
        records.append(record)
        if i == len(lines) - 1 and repair:
            # A complete record without its newline: finish the line so the next append is clean.
            try:
                with open(path, "ab") as f:
                    f.write(b"\n")
            except OSError as exc:
                raise JournalError(describe_os_error(exc, "repair the journal")) from exc
        good_bytes += len(raw) + 1
    return records


def _record_problem(record: Any) -> str | None:
    """Why a parsed line is not a journal record (None if it is one)."""
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return "not a journal record (a JSON object with a type)"
    if record["type"] == "cell" and not (
        isinstance(record.get("key"), str) and isinstance(record.get("cell"), dict)
    ):
        return "a cell record without its key"
    return None


def _bad_line(path: Path, line: int, why: str, *, first: bool) -> JournalError:
    if first:
        return JournalError(
            f"{path} is not a dvfs journal (line {line}: {why}): move it aside, or start over "
            "with `dvfs sweep --fresh`, which renames it"
        )
    return JournalError(
        f"{path}, line {line}: {why}. The journal is damaged: start over with `dvfs sweep "
        f"--fresh` (it moves the journal aside), or delete line {line} to keep the rest"
    )
