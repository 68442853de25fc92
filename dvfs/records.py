"""The journal's record format in one place: the runner writes through it, the cube reads
through it, and `journal.py` only stores the lines.

A measured quantity has one name: the `CellMeasurement` field, the journal key and, where the
cube holds it, the cube variable are all spelt as the fields of `MeasurementRecord`.

Versions (`journal_schema`, on the header and on each session; the records after a session
follow that session's version, so a journal resumed by a newer dvfs may mix versions):
  1 - measurement keys window_s, sm_clock_mhz and event_reasons, and a nested timeline
      {t_s, power_w, sm_clock_mhz}.
  2 - measurement keys are the quantities' names: decode_time_s, sm_clock_observed_mhz,
      clock_event_reasons, timeline_t_s, timeline_power_w, timeline_sm_clock_mhz.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dvfs import __version__
from dvfs.errors import JournalError
from dvfs.plan import Cell

if TYPE_CHECKING:
    from dvfs.campaign import Campaign
    from dvfs.meter import CellMeasurement

JOURNAL_SCHEMA = 2
#: The version of a header that names none (journals older than the field).
OLDEST_SCHEMA = 1


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def check_version(where: str | Path, version: object) -> int:
    """The record version, refused when a newer dvfs wrote it (its records may mean else)."""
    if isinstance(version, bool) or not isinstance(version, int) or version > JOURNAL_SCHEMA:
        raise JournalError(
            f"{where} has journal schema {version!r}; this dvfs ({__version__}) reads up to "
            f"{JOURNAL_SCHEMA}: upgrade dvfs, or start over with `dvfs sweep --fresh`"
        )
    return version


def _float(value: Any) -> float:
    """A stored number; null (how strict JSON keeps NaN) and absence read as NaN."""
    return math.nan if value is None else float(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _floats(values: Any) -> tuple[float, ...]:
    return tuple(_float(v) for v in values)


# -- header -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grid:
    """A campaign's axes; a knob axis of None (or empty) is the stock setting."""

    sm_clocks_mhz: tuple[int, ...] | None
    power_limits_w: tuple[float, ...] | None
    batch_sizes: tuple[int, ...]
    drafters: tuple[str, ...]
    corpora: tuple[str, ...]
    repeats: int


@dataclass(frozen=True)
class CampaignFacts:
    """What a cube needs from a stored campaign (`Campaign.semantic_dict`, in a journal header
    or a cube's attributes): the only reader of that dict's layout."""

    grid: Grid
    model: str
    twin_model: str
    tp_size: int
    twin_profile: str

    @classmethod
    def from_json(cls, campaign: dict[str, Any]) -> CampaignFacts:
        knobs, workload = campaign["knobs"], campaign["workload"]
        clocks, limits = knobs["sm_clocks_mhz"], knobs["power_limits_w"]
        grid = Grid(
            sm_clocks_mhz=None if clocks is None else tuple(int(c) for c in clocks),
            power_limits_w=None if limits is None else tuple(float(p) for p in limits),
            batch_sizes=tuple(int(b) for b in workload["batch_sizes"]),
            drafters=tuple(d["name"] for d in campaign["drafters"]),
            corpora=tuple(c["name"] for c in workload["corpora"]),
            repeats=int(campaign["measurement"]["repeats"]),
        )
        engine = campaign["engine"]
        return cls(
            grid=grid,
            model=engine["model"],
            twin_model=engine.get("twin_model") or "",
            tp_size=int(engine["tp_size"]),
            twin_profile=campaign["gpu"].get("profile") or "",
        )


@dataclass(frozen=True)
class Header:
    """Line 1: the campaign a journal measures. Read leniently, so a damaged header is refused
    with a message rather than a traceback; `facts()` is where a bad campaign shows."""

    campaign_name: str | None
    campaign_hash: str | None
    campaign: dict[str, Any]
    campaign_source: str = ""
    dvfs_version: str = ""
    created: str = ""
    journal_schema: object = OLDEST_SCHEMA

    @classmethod
    def for_campaign(cls, campaign: Campaign) -> Header:
        return cls(
            campaign_name=campaign.name,
            campaign_hash=campaign.hash,
            campaign=campaign.semantic_dict(),
            campaign_source=campaign.source,
            dvfs_version=__version__,
            created=now_iso(),
            journal_schema=JOURNAL_SCHEMA,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "header",
            "journal_schema": self.journal_schema,
            "campaign_name": self.campaign_name,
            "campaign_hash": self.campaign_hash,
            "campaign": self.campaign,
            "campaign_source": self.campaign_source,
            "dvfs_version": self.dvfs_version,
            "created": self.created,
        }

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Header:
        stored = record.get("campaign")
        return cls(
            campaign_name=record.get("campaign_name"),
            campaign_hash=record.get("campaign_hash"),
            campaign=stored if isinstance(stored, dict) else {},
            campaign_source=record.get("campaign_source") or "",
            dvfs_version=record.get("dvfs_version") or "",
            created=record.get("created") or "",
            journal_schema=record.get("journal_schema", OLDEST_SCHEMA),
        )

    def facts(self) -> CampaignFacts:
        return CampaignFacts.from_json(self.campaign)

    def differences(self, campaign: Campaign) -> list[str]:
        """The measured settings in which `campaign` differs from this journal's (empty: it may
        be resumed). Headers written before the hash left out operational settings match
        through their stored campaign."""
        from dvfs.campaign import measured_differences

        if self.campaign_hash == campaign.hash:
            return []
        if not self.campaign:
            return ["the journal does not record its campaign"]
        return measured_differences(self.campaign, campaign.semantic_dict())


# -- session and server -----------------------------------------------------------------------


@dataclass(frozen=True)
class Stock:
    """The GPU's settings as found: where the cube shows a cell the campaign left stock."""

    sm_clock_mhz: int
    power_limit_w: float

    @classmethod
    def from_json(cls, data: Any) -> Stock | None:
        """None for anything that is not a stock record (a damaged line)."""
        try:
            return cls(int(data["sm_clock_mhz"]), float(data["power_limit_w"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Session:
    """One run of `dvfs sweep`: who ran, on which GPUs, with which operational settings
    (retries, timeouts, server command: free to change between sessions)."""

    gpus: tuple[dict[str, Any], ...]  # `GpuIdentity` as a dict: the gpu module owns its shape
    stock: Stock
    gpu_backend: str
    engine_backend: str
    actuation: bool
    clock: str
    power_limit_range_w: tuple[float, float, float]  # min, max, default
    idle_power_w: float
    measurement_method: str
    token_count_method: str = ""
    corpora: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    host: str = ""
    started: str = ""
    dvfs_version: str = ""
    journal_schema: int = JOURNAL_SCHEMA

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "session",
            "journal_schema": self.journal_schema,
            "started": self.started,
            "dvfs_version": self.dvfs_version,
            "host": self.host,
            "settings": self.settings,
            "gpu_backend": self.gpu_backend,
            "engine_backend": self.engine_backend,
            "actuation": self.actuation,
            "clock": self.clock,
            "gpus": list(self.gpus),
            "stock": asdict(self.stock),
            "power_limit_range_w": list(self.power_limit_range_w),
            "idle_power_w": self.idle_power_w,
            "measurement_method": self.measurement_method,
            "token_count_method": self.token_count_method,
            "corpora": self.corpora,
        }

    @classmethod
    def from_json(cls, record: dict[str, Any], *, version: int) -> Session:
        stock = Stock.from_json(record["stock"])
        if stock is None:
            raise ValueError(f"a session's stock settings are unreadable: {record['stock']!r}")
        low, high, default = (float(w) for w in record["power_limit_range_w"])
        return cls(
            gpus=tuple(dict(g) for g in record["gpus"]),
            stock=stock,
            gpu_backend=record["gpu_backend"],
            engine_backend=record["engine_backend"],
            actuation=bool(record["actuation"]),
            clock=record["clock"],
            power_limit_range_w=(low, high, default),
            idle_power_w=_float(record["idle_power_w"]),
            measurement_method=record["measurement_method"],
            token_count_method=record.get("token_count_method") or "",
            corpora=record.get("corpora") or {},
            settings=record.get("settings") or {},
            host=record.get("host") or "",
            started=record.get("started") or "",
            dvfs_version=record.get("dvfs_version") or "",
            journal_schema=version,
        )

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(g["uuid"] for g in self.gpus)


def recorded_stock(record: dict[str, Any]) -> Stock | None:
    """The stock settings a raw session record names, None if it names none."""
    return Stock.from_json(record.get("stock"))


@dataclass(frozen=True)
class Server:
    """A started server: which engine and version served a drafter, and with what."""

    drafter: str
    engine: str
    version: str
    args: Any
    attention_backend: str | None = None  # None: the server did not say (e.g. the twin)
    log_path: str | None = None
    started: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "server",
            "started": self.started,
            "drafter": self.drafter,
            "engine": self.engine,
            "version": self.version,
            "args": self.args,
            "log_path": self.log_path,
            "attention_backend": self.attention_backend,
        }

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Server:
        return cls(
            drafter=record["drafter"],
            engine=record["engine"],
            version=record["version"],
            args=record["args"],
            attention_backend=record.get("attention_backend"),
            log_path=record.get("log_path"),
            started=record.get("started") or "",
        )


# -- cells ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasurementRecord:
    """A cell's measurement as the journal stores it. The field names are the vocabulary: the
    `CellMeasurement` fields (latency and acceptance flattened), the journal keys and the cube
    variables share them. Integers are None where an older journal did not record them."""

    energy_j: float
    decode_time_s: float
    output_tokens: int | None
    rounds: int | None
    requests: int | None
    energy_per_token_j: float
    energy_per_token_above_idle_j: float
    throughput_tok_s: float
    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]
    itl_ms: tuple[float, ...]
    accept_length: float
    accept_rate: float
    server_accept_length: float
    power_mean_w: float
    power_max_w: float
    sm_clock_observed_mhz: float
    temperature_max_c: float
    clock_event_reasons: int | None
    quality: int | None
    valid: bool | None
    idle_power_w: float
    timeline_t_s: tuple[float, ...] = ()
    timeline_power_w: tuple[float, ...] = ()
    timeline_sm_clock_mhz: tuple[float, ...] = ()

    @classmethod
    def of(cls, m: CellMeasurement) -> MeasurementRecord:
        return cls(
            energy_j=m.energy_j,
            decode_time_s=m.decode_time_s,
            output_tokens=m.output_tokens,
            rounds=m.rounds,
            requests=m.requests,
            energy_per_token_j=m.energy_per_token_j,
            energy_per_token_above_idle_j=m.energy_per_token_above_idle_j,
            throughput_tok_s=m.throughput_tok_s,
            ttft_ms=m.latency.ttft_ms,
            tpot_ms=m.latency.tpot_ms,
            itl_ms=m.latency.itl_ms,
            accept_length=m.accept.accept_length,
            accept_rate=m.accept.accept_rate,
            server_accept_length=m.accept.server_accept_length,
            power_mean_w=m.power_mean_w,
            power_max_w=m.power_max_w,
            sm_clock_observed_mhz=m.sm_clock_observed_mhz,
            temperature_max_c=m.temperature_max_c,
            clock_event_reasons=m.clock_event_reasons,
            quality=m.quality,
            valid=m.valid,
            idle_power_w=m.idle_power_w,
            timeline_t_s=m.timeline_t_s,
            timeline_power_w=m.timeline_power_w,
            timeline_sm_clock_mhz=m.timeline_sm_clock_mhz,
        )

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], *, version: int) -> MeasurementRecord:
        """Scalars and the timeline may be absent (NaN, empty); the latency quantiles may not."""
        d = _upgrade(data, version)
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in _QUANTILE_KEYS:
                kwargs[f.name] = _floats(d[f.name])
            elif f.name in _TIMELINE_KEYS:
                kwargs[f.name] = _floats(d.get(f.name) or ())
            elif f.name == "valid":
                kwargs[f.name] = None if d.get(f.name) is None else bool(d[f.name])
            elif f.name in _INTEGER_KEYS:
                kwargs[f.name] = _int(d.get(f.name))
            else:
                kwargs[f.name] = _float(d.get(f.name))
        return cls(**kwargs)


#: Every measured quantity's name: journal key, `CellMeasurement` field and cube variable.
QUANTITIES = tuple(f.name for f in fields(MeasurementRecord))
_QUANTILE_KEYS = ("ttft_ms", "tpot_ms", "itl_ms")
_TIMELINE_KEYS = ("timeline_t_s", "timeline_power_w", "timeline_sm_clock_mhz")
_INTEGER_KEYS = ("output_tokens", "rounds", "requests", "clock_event_reasons", "quality")

#: Version 1's measurement keys that now carry their quantity's name.
_V1_RENAMED = {
    "window_s": "decode_time_s",
    "sm_clock_mhz": "sm_clock_observed_mhz",
    "event_reasons": "clock_event_reasons",
}
#: Version 1 nested the timeline under "timeline" with these keys.
_V1_TIMELINE = {
    "t_s": "timeline_t_s",
    "power_w": "timeline_power_w",
    "sm_clock_mhz": "timeline_sm_clock_mhz",
}


def _upgrade(data: dict[str, Any], version: int) -> dict[str, Any]:
    """A stored measurement in the current version's keys: the one place old keys are known."""
    if version >= 2:
        return data
    out = {_V1_RENAMED.get(k, k): v for k, v in data.items() if k != "timeline"}
    timeline = data.get("timeline", {})
    for old, new in _V1_TIMELINE.items():
        out[new] = timeline.get(old, [])
    return out


@dataclass(frozen=True)
class CellRecord:
    """One attempt at a cell: measured ("ok", with its measurement and warm-up) or failed
    (with its errors); a later record for the same key replaces an earlier one."""

    cell: Cell
    status: str
    attempts: int
    errors: tuple[str, ...] = ()
    measurement: MeasurementRecord | None = None
    warmup: dict[str, Any] = field(default_factory=dict)
    finished: str = ""
    key: str = ""

    @classmethod
    def measured(
        cls,
        cell: Cell,
        m: CellMeasurement,
        *,
        attempts: int,
        warmup: dict[str, Any],
        errors: Sequence[str],
    ) -> CellRecord:
        return cls(cell, "ok", attempts, tuple(errors), MeasurementRecord.of(m), warmup, now_iso())

    @classmethod
    def failed(cls, cell: Cell, *, attempts: int, errors: Sequence[str]) -> CellRecord:
        return cls(cell, "failed", attempts, tuple(errors), finished=now_iso())

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def error(self) -> str:
        """The last error: the one a failed cell reports."""
        return self.errors[-1] if self.errors else ""

    def to_json(self) -> dict[str, Any]:
        head = {
            "type": "cell",
            "key": self.key or self.cell.key,
            "cell": asdict(self.cell),
            "status": self.status,
            "attempts": self.attempts,
            "finished": self.finished,
        }
        if self.measurement is not None:
            return {
                **head,
                "measurement": self.measurement.to_json(),
                "warmup": self.warmup,
                "errors": list(self.errors),
            }
        return {**head, "error": self.error, "errors": list(self.errors)}

    @classmethod
    def from_json(cls, record: dict[str, Any], *, version: int) -> CellRecord:
        """Only a measured cell's measurement is read: a failed one has none."""
        status = record.get("status") or ""
        measurement = (
            MeasurementRecord.from_json(record["measurement"], version=version)
            if status == "ok"
            else None
        )
        errors = record.get("errors") or []
        if not errors and record.get("error"):
            errors = [record["error"]]
        return cls(
            cell=Cell.from_dict(record["cell"]),
            status=status,
            attempts=int(record.get("attempts") or 0),
            errors=tuple(str(e) for e in errors),
            measurement=measurement,
            warmup=record.get("warmup") or {},
            finished=record.get("finished") or "",
            key=record["key"],
        )


# -- a whole journal --------------------------------------------------------------------------


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
