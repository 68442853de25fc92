"""The journal: one JSON line per event, flushed and fsynced, so no finished cell is ever lost.

Line 1 is a header naming the campaign (and its hash); later lines are `session` (who ran,
on which GPUs), `server` (a started server's info) and `cell` records. A rerun reads the
journal, skips finished cells and appends. A line cut short by a crash is dropped on open.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dvfs import __version__
from dvfs.campaign import Campaign
from dvfs.errors import JournalError

JOURNAL_SCHEMA = 1
JOURNAL_NAME = "journal.jsonl"


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become null (strict JSON has no NaN), tuples become lists."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _clean(value.item())
    return value


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


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
            journal.append(
                {
                    "type": "header",
                    "journal_schema": JOURNAL_SCHEMA,
                    "campaign_name": campaign.name,
                    "campaign_hash": campaign.hash,
                    "campaign": campaign.semantic_dict(),
                    "campaign_source": campaign.source,
                    "dvfs_version": __version__,
                    "created": now_iso(),
                }
            )
            return journal
        header = records[0]
        if header.get("type") != "header":
            raise JournalError(f"{path} does not start with a dvfs journal header")
        if header.get("campaign_hash") != campaign.hash:
            raise JournalError(
                f"{path} belongs to campaign {header.get('campaign_name')!r} "
                f"(hash {header.get('campaign_hash')}), not to this campaign "
                f"(hash {campaign.hash}): "
                "the campaign changed since the journal was started (its file, or an option "
                "such as --observe-only). Use another --out directory, or --fresh to move the "
                "old journal aside and start over."
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
        line = json.dumps(_clean(record), separators=(",", ":"), allow_nan=False)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
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
    when `repair` is set so appends start on a fresh line; a bad line elsewhere is an error."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    records = []
    good_bytes = 0
    for i, raw in enumerate(lines):
        if not raw.strip():
            good_bytes += len(raw) + (1 if i < len(lines) - 1 else 0)
            continue
        last = i >= len(lines) - 2 and not any(x.strip() for x in lines[i + 1 :])
        try:
            records.append(json.loads(raw))
        except json.JSONDecodeError as exc:
            if last:
                if repair:
                    with open(path, "r+b") as f:
                        f.truncate(good_bytes)
                break
            raise JournalError(f"{path}, line {i + 1}: not valid JSON ({exc.msg})") from exc
        if i == len(lines) - 1 and repair:
            # A complete record without its newline: finish the line so the next append is clean.
            with open(path, "ab") as f:
                f.write(b"\n")
        good_bytes += len(raw) + 1
    return records
