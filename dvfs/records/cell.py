"""Cell records, and the vocabulary: `MeasurementRecord`'s fields name every measured
quantity as the meter, the journal and the cube all spell it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.engines.base import SPLIT_PARTS
from dvfs.measure.plan import Cell
from dvfs.records.version import now_iso, stored_float, stored_floats, stored_int

if TYPE_CHECKING:
    from dvfs.engines.base import PassLedger
    from dvfs.measure.counter import RoundEnergy
    from dvfs.measure.meter import CellMeasurement, PowerLimitRead
    from dvfs.measure.tenants import ForeignProcess


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
    #: Relative half-width of the Student-t interval (at measurement.confidence) over the
    #: cell's rounds on energy per token and on median TPOT; NaN with one round.
    energy_per_token_rel_ci: float = float("nan")
    latency_rel_ci: float = float("nan")
    #: Distinct energy-counter updates inside the cell's windows (the fewest over its GPUs,
    #: summed over rounds); None before version 3.
    counter_updates: int | None = None
    #: The hottest GPU's temperature at the start of the cell's first round.
    temperature_start_c: float = float("nan")
    #: The tokens energy per token divides by: over the windows' intervals between counter
    #: updates, each decode step's tokens spread over the step (a fraction).
    window_tokens: float = float("nan")
    #: Mean input tokens of the prompts the cell's rounds sent (by the session's token count
    #: method); NaN in an older journal.
    prompt_tokens: float = float("nan")
    #: Seconds a throttle policy (thermal, board limit) held a GPU below its clocks during the
    #: cell's rounds, by NVML's violation counters read at each round's start and end; NaN
    #: where no GPU could tell, and in an older journal.
    throttle_violation_s: float = float("nan")
    timeline_t_s: tuple[float, ...] = ()
    timeline_power_w: tuple[float, ...] = ()
    timeline_sm_clock_mhz: tuple[float, ...] = ()

    @classmethod
    def of(cls, m: CellMeasurement) -> MeasurementRecord:
        """Read off the measurement by name: a field renamed on one side fails here, loudly."""
        parts = (m, m.latency, m.accept)
        key = (cls, type(m), type(m.latency), type(m.accept))
        plan = _OF_PLANS.get(key)
        if plan is None:  # where each quantity is, worked out once for these types
            plan = _OF_PLANS[key] = tuple(
                (name, _part_of(parts, name)) for name in _field_names(cls)
            )
        return cls(**{name: getattr(parts[i], name) for name, i in plan})

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _field_names(type(self))}

    @classmethod
    def from_json(cls, data: dict[str, Any], *, version: int) -> MeasurementRecord:
        """Scalars and the timeline may be absent (NaN, empty); the latency quantiles may not."""
        d = _upgrade(data, version)
        kwargs: dict[str, Any] = {}
        for name, kind in _reading_plan(cls):
            if kind == _QUANTILE:
                kwargs[name] = stored_floats(d[name])
            elif kind == _TIMELINE:
                kwargs[name] = stored_floats(d.get(name) or ())
            elif kind == _VALID:
                kwargs[name] = None if d.get(name) is None else bool(d[name])
            elif kind == _INTEGER:
                kwargs[name] = stored_int(d.get(name))
            else:
                kwargs[name] = stored_float(d.get(name))
        return cls(**kwargs)


_QUANTILE, _TIMELINE, _VALID, _INTEGER, _FLOAT = range(5)


_PLANS: dict[type, tuple[tuple[str, int], ...]] = {}


def _reading_plan(cls: type) -> tuple[tuple[str, int], ...]:
    """How `MeasurementRecord.from_json` reads each field (worked out once, not per record)."""
    known = _PLANS.get(cls)
    if known is not None:
        return known
    plan = []
    for f in fields(cls):
        if f.name in _QUANTILE_KEYS:
            kind = _QUANTILE
        elif f.name in _TIMELINE_KEYS:
            kind = _TIMELINE
        elif f.name == "valid":
            kind = _VALID
        elif f.name in _INTEGER_KEYS:
            kind = _INTEGER
        else:
            kind = _FLOAT
        plan.append((f.name, kind))
    known = _PLANS[cls] = tuple(plan)
    return known


def _part_of(parts: tuple[Any, ...], name: str) -> int:
    """Which of a measurement's parts (itself, its latency, its acceptance) holds a quantity,
    the first that has it: the same for every measurement of the same types."""
    for i, part in enumerate(parts):
        if hasattr(part, name):
            return i
    raise AttributeError(f"a CellMeasurement has no quantity {name!r}")


#: `MeasurementRecord.of`'s plans, by the record's and the measurement's parts' types.
_OF_PLANS: dict[tuple[type, ...], tuple[tuple[str, int], ...]] = {}
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names in order (`fields`, asked once a class)."""
    known = _FIELD_NAMES.get(cls)
    if known is None:
        known = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return known


#: Every measured quantity's name: journal key, `CellMeasurement` field and cube variable.
QUANTITIES = tuple(f.name for f in fields(MeasurementRecord))
_QUANTILE_KEYS = ("ttft_ms", "tpot_ms", "itl_ms")
_TIMELINE_KEYS = ("timeline_t_s", "timeline_power_w", "timeline_sm_clock_mhz")
_INTEGER_KEYS = (
    "output_tokens",
    "rounds",
    "requests",
    "clock_event_reasons",
    "quality",
    "counter_updates",
)
#: Where a cell's GPU time went (seconds, `CellRecord.gpu_time_s`): its knob settle, warm-up,
#: the prefill before and the drain after each steady window, the windows, the idle baseline
#: at its setting, the server start and the thermal stabilisation before it, failed attempts.
GPU_TIME_KEYS = (
    "settle",
    "warmup",
    "prefill",
    "window",
    "drain",
    "idle_baseline",
    "server_start",
    "stabilise",
    "retry",
)

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


#: How a cell's energy split was obtained, as the cube's `energy_split_method` codes it: none
#: (a real server: `dvfs.analysis.split` estimates one from the cube), exact (the twin knows
#: its passes), estimated (`dvfs.analysis.split`).
SPLIT_METHODS = ("none", "exact", "estimated")


@dataclass(frozen=True)
class EnergySplit:
    """Where a cell's measured energy and time went, one entry per `SPLIT_PARTS` entry
    (prefill, draft, verify, overhead): over the same intervals as the cell's `energy_j` and
    `decode_time_s` (each round's steady window between energy-counter updates), to whose
    values the parts add up."""

    energy_j: tuple[float, ...]
    time_s: tuple[float, ...]
    method: str = "exact"

    def __post_init__(self) -> None:
        if len(self.energy_j) != len(SPLIT_PARTS) or len(self.time_s) != len(SPLIT_PARTS):
            raise ValueError(f"an energy split has one value per part of {SPLIT_PARTS}")
        if self.method not in SPLIT_METHODS:
            raise ValueError(f"unknown energy split method {self.method!r}")

    @classmethod
    def exact(
        cls, rounds: Iterable[tuple[PassLedger | None, tuple[int, int] | None, RoundEnergy | None]]
    ) -> EnergySplit | None:
        """The split of a cell's rounds (ledger, steady window, measured energy), each
        round's measured energy and counted seconds shared out as its engine's passes share
        the steady window (`PassLedger.split`: exact on the twin, up to the counter's
        edges inside the window); None when a measured round has no ledger (a real server)
        or no round was measured."""
        energy = [0.0] * len(SPLIT_PARTS)
        time = [0.0] * len(SPLIT_PARTS)
        measured = False
        for ledger, window, counted in rounds:
            if window is None or counted is None:
                continue
            if ledger is None:
                return None
            measured = True
            share_j, share_s = ledger.split(*window)
            # (np.add.reduce is what ndarray.sum calls, without its dispatch)
            total_j, total_s = float(np.add.reduce(share_j)), float(np.add.reduce(share_s))
            joules = max(counted.energy_mj, 0.0) / 1000
            seconds = counted.seconds
            # plain floats, part by part (numpy's float64 arithmetic, without its scalars)
            for i, (part_j, part_s) in enumerate(
                zip(share_j.tolist(), share_s.tolist(), strict=True)
            ):
                energy[i] += joules * part_j / total_j if total_j > 0 else 0.0
                time[i] += seconds * part_s / total_s if total_s > 0 else 0.0
        return cls(tuple(energy), tuple(time)) if measured else None

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "energy_j": dict(zip(SPLIT_PARTS, self.energy_j, strict=True)),
            "time_s": dict(zip(SPLIT_PARTS, self.time_s, strict=True)),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> EnergySplit | None:
        """None for a record without one (older journals, real servers)."""
        if not data:
            return None
        energy, time = data.get("energy_j") or {}, data.get("time_s") or {}
        return cls(
            tuple(stored_float(energy.get(p)) for p in SPLIT_PARTS),
            tuple(stored_float(time.get(p)) for p in SPLIT_PARTS),
            str(data.get("method") or "exact"),
        )

    @property
    def energy_total_j(self) -> float:
        return math.fsum(self.energy_j)


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
    #: In-flight provenance (`dvfs.measure.inflight`): the group, its segments, what is
    #: shared across its levels; empty for a cell measured on its own.
    inflight: dict[str, Any] = field(default_factory=dict)
    #: Seconds of GPU time per `GPU_TIME_KEYS` entry; empty before version 3.
    gpu_time_s: dict[str, float] = field(default_factory=dict)
    #: The fleet worker that ran the cell ("" for a sweep on one GPU group).
    worker: str = ""
    #: The UUIDs of the GPUs that measured the cell (empty: its session's GPUs).
    gpus: tuple[str, ...] = ()
    #: Where the measured energy and time went (`EnergySplit`); None: not known (a real
    #: server, in-flight stepping, a record older than the split).
    energy_split: EnergySplit | None = None
    #: Each GPU's power limits read at the cell's start and end (mW: the label's, configured,
    #: enforced; `dvfs.measure.meter.PowerLimitRead`), for an in-flight cell its group's
    #: (against the lowest level's limit, "group": true); empty where not read (older
    #: journals, in-flight cells before these reads).
    power_limits: tuple[dict[str, Any], ...] = ()
    #: Other tenants' compute processes seen on the metered GPUs at the cell's start and end
    #: (`dvfs.measure.tenants.ForeignProcess`: GPU index, pid, name, when); empty where none
    #: was seen or none could be told from the server's.
    foreign_processes: tuple[dict[str, Any], ...] = ()
    #: Those seen right before or after the idle baseline its above-idle energy subtracts
    #: (the session's opening one, or its setting's), which flag it idle_baseline_foreign.
    idle_foreign_processes: tuple[dict[str, Any], ...] = ()

    @classmethod
    def measured(
        cls,
        cell: Cell,
        m: CellMeasurement,
        *,
        attempts: int,
        warmup: dict[str, Any],
        errors: Sequence[str],
        gpu_time_s: dict[str, float] | None = None,
        energy_split: EnergySplit | None = None,
        power_limits: Sequence[PowerLimitRead] = (),
        foreign_processes: Sequence[ForeignProcess] = (),
        idle_foreign_processes: Sequence[ForeignProcess] = (),
    ) -> CellRecord:
        return cls(
            cell,
            "ok",
            attempts,
            tuple(errors),
            MeasurementRecord.of(m),
            warmup,
            now_iso(),
            gpu_time_s=dict(gpu_time_s or {}),
            energy_split=energy_split,
            power_limits=tuple(r.to_json() for r in power_limits),
            foreign_processes=tuple(p.to_json() for p in foreign_processes),
            idle_foreign_processes=tuple(p.to_json() for p in idle_foreign_processes),
        )

    @classmethod
    def failed(
        cls,
        cell: Cell,
        *,
        attempts: int,
        errors: Sequence[str],
        gpu_time_s: dict[str, float] | None = None,
    ) -> CellRecord:
        return cls(
            cell,
            "failed",
            attempts,
            tuple(errors),
            finished=now_iso(),
            gpu_time_s=dict(gpu_time_s or {}),
        )

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
            "cell": {name: getattr(self.cell, name) for name in _field_names(type(self.cell))},
            "status": self.status,
            "attempts": self.attempts,
            "finished": self.finished,
            **({"gpu_time_s": self.gpu_time_s} if self.gpu_time_s else {}),
            **({"worker": self.worker} if self.worker else {}),
            **({"gpus": list(self.gpus)} if self.gpus else {}),
        }
        if self.measurement is not None:
            return {
                **head,
                "measurement": self.measurement.to_json(),
                **({"energy_split": self.energy_split.to_json()} if self.energy_split else {}),
                "warmup": self.warmup,
                "errors": list(self.errors),
                **({"inflight": self.inflight} if self.inflight else {}),
                **({"power_limits": list(self.power_limits)} if self.power_limits else {}),
                **(
                    {"foreign_processes": list(self.foreign_processes)}
                    if self.foreign_processes
                    else {}
                ),
                **(
                    {"idle_foreign_processes": list(self.idle_foreign_processes)}
                    if self.idle_foreign_processes
                    else {}
                ),
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
            inflight=record.get("inflight") or {},
            gpu_time_s={str(k): float(v) for k, v in (record.get("gpu_time_s") or {}).items()},
            worker=str(record.get("worker") or ""),
            gpus=tuple(str(u) for u in record.get("gpus") or ()),
            energy_split=EnergySplit.from_json(record.get("energy_split"))
            if measurement is not None
            else None,
            power_limits=tuple(dict(r) for r in record.get("power_limits") or ()),
            foreign_processes=tuple(dict(r) for r in record.get("foreign_processes") or ()),
            idle_foreign_processes=tuple(
                dict(r) for r in record.get("idle_foreign_processes") or ()
            ),
        )
