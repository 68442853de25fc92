"""The journal's record format in one place: the runner writes through it, the cube reads
through it, and `dvfs.measure.journal` only stores the lines.

A measured quantity has one name: the `CellMeasurement` field, the journal key and, where the
cube holds it, the cube variable are all spelt as the fields of `MeasurementRecord` (listed in
`QUANTITIES`). `version` keeps the record version and its history, `header`, `session` and
`cell` the typed records with their `to_json`/`from_json`, and this module decodes a journal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dvfs.records.cell import GPU_TIME_KEYS, QUANTITIES, CellRecord, MeasurementRecord
from dvfs.records.header import (
    CampaignFacts,
    Grid,
    Header,
    RepeatRule,
    knobs_set,
    measurement_mode,
    repeat_rule,
)
from dvfs.records.session import (
    ADMISSION_HOLD_ALGORITHMS,
    ARM_ARGS,
    ARMS_PINNED,
    GPU_INVARIANTS,
    PROMPT_INVARIANTS,
    SERVER_ENV_ADVICE,
    SERVER_ENV_PREFIXES,
    SERVER_INVARIANTS,
    SESSION_INVARIANTS,
    Server,
    Session,
    Stock,
    admission_hold,
    arm_changes,
    begun_unpinned,
    corpus_changes,
    corpus_hashes,
    decode_graph,
    env_changes,
    incomparable,
    journal_prompts,
    listed_changes,
    mixed_within,
    only_env_changed,
    prompt_changes,
    recorded_env_prefixes,
    recorded_stock,
    restart_as_it_was,
    server_changes,
    server_env_of,
    what_differs,
    with_changes,
)
from dvfs.records.version import JOURNAL_SCHEMA, OLDEST_SCHEMA, check_version, now_iso

__all__ = [
    "ARMS_PINNED",
    "ADMISSION_HOLD_ALGORITHMS",
    "ARM_ARGS",
    "GPU_INVARIANTS",
    "GPU_TIME_KEYS",
    "JOURNAL_SCHEMA",
    "OLDEST_SCHEMA",
    "PROMPT_INVARIANTS",
    "QUANTITIES",
    "SERVER_ENV_ADVICE",
    "SERVER_ENV_PREFIXES",
    "SERVER_INVARIANTS",
    "SESSION_INVARIANTS",
    "CampaignFacts",
    "knobs_set",
    "measurement_mode",
    "repeat_rule",
    "CellRecord",
    "Grid",
    "Header",
    "RepeatRule",
    "JournalContents",
    "MeasurementRecord",
    "Server",
    "Session",
    "Stock",
    "admission_hold",
    "arm_changes",
    "begun_unpinned",
    "check_version",
    "corpus_changes",
    "corpus_hashes",
    "decode_graph",
    "decode_journal",
    "env_changes",
    "incomparable",
    "journal_prompts",
    "mixed_within",
    "now_iso",
    "only_env_changed",
    "prompt_changes",
    "recorded_stock",
    "restart_as_it_was",
    "server_changes",
    "recorded_env_prefixes",
    "server_env_of",
    "what_differs",
    "listed_changes",
    "with_changes",
]


@dataclass(frozen=True)
class JournalContents:
    """A journal decoded: its header, sessions, servers and the latest record per cell."""

    header: Header
    sessions: tuple[Session, ...]
    servers: tuple[Server, ...]
    cells: dict[str, CellRecord]


def decode_journal(records: Sequence[dict[str, Any]], where: str | Path) -> JournalContents:
    """Decode a journal's records (the first is its header), each in the version its session
    wrote it in; a newer version is a `JournalError`, a malformed record a KeyError,
    TypeError or ValueError for the caller to word."""
    header = Header.from_json(records[0])
    version = first = check_version(where, header.journal_schema)
    sessions: list[Session] = []
    servers: list[Server] = []
    cells: dict[str, CellRecord] = {}
    for record in records[1:]:
        kind = record.get("type")
        if kind == "session":
            version = check_version(where, record.get("journal_schema", first))
            sessions.append(Session.from_json(record, version=version))
        elif kind == "server":
            servers.append(Server.from_json(record))
        elif kind == "cell":
            cell = CellRecord.from_json(record, version=version)
            cells[cell.key] = cell
    return JournalContents(header, tuple(sessions), tuple(servers), cells)
