"""The header record (line 1): the campaign a journal measures, and the facts a cube reads
from the campaign it stores."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dvfs.records.session import ARMS_PINNED
from dvfs.records.version import JOURNAL_SCHEMA, OLDEST_SCHEMA, now_iso
from dvfs.version import __version__

if TYPE_CHECKING:
    from dvfs.campaign import Campaign


@dataclass(frozen=True)
class Grid:
    """A campaign's axes; a knob axis of None (or empty) is the stock setting."""

    sm_clocks_mhz: tuple[int, ...] | None
    power_limits_w: tuple[float, ...] | None
    batch_sizes: tuple[int, ...]
    drafters: tuple[str, ...]
    corpora: tuple[str, ...]
    repeats: int


#: More than any campaign asks of a count (repeats, tensor-parallel GPUs): a stored value past
#: it is an edited one, which would overflow the arrays sized from it.
_MOST = 1 << 20


def _count(value: Any, name: str, least: int = 0) -> int:
    """A stored campaign's count (repeats, tp_size): a whole number from `least` to `_MOST`;
    anything else (an edited line: 1e308, Infinity, true, text) a ValueError naming it, which
    the callers word."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise ValueError(f"the stored campaign's {name} is {value!r:.40}, not a whole number")
    if not least <= value <= _MOST:
        raise ValueError(f"the stored campaign's {name} is {value!r:.40}, out of range")
    return int(value)


@dataclass(frozen=True)
class RepeatRule:
    """How many repeats a campaign asks of a cell: `repeats` always, then one more at a time
    while the interval across them misses `precision` at `confidence`, up to `max_repeats`
    (`dvfs.measure.runner.next_repeats`). A cube's repeat axis holds `max_repeats`, so the
    analyses need the rule to tell a repeat not asked for from one not measured yet."""

    repeats: int
    max_repeats: int
    precision: float
    confidence: float

    @property
    def adaptive(self) -> bool:
        return self.max_repeats > self.repeats

    @classmethod
    def from_json(cls, measurement: dict[str, Any]) -> RepeatRule:
        """From a stored campaign's measurement table; one without the adaptive keys (before
        version 3) asked for `repeats`, no more."""
        repeats = _count(measurement["repeats"], "repeats")
        if not {"max_repeats", "precision", "confidence"} <= measurement.keys():
            return cls(repeats, repeats, math.nan, math.nan)
        return cls(
            repeats,
            max(repeats, _count(measurement["max_repeats"] or 0, "max_repeats")),
            float(measurement["precision"]),
            float(measurement["confidence"]),
        )


@dataclass(frozen=True)
class CampaignFacts:
    """What a cube needs from a stored campaign (`Campaign.semantic_dict`, in a journal header
    or a cube's attributes): the only reader of that dict's layout."""

    grid: Grid
    model: str
    twin_model: str
    tp_size: int
    twin_profile: str
    repeat_rule: RepeatRule

    @classmethod
    def from_json(cls, campaign: dict[str, Any]) -> CampaignFacts:
        knobs, workload = campaign["knobs"], campaign["workload"]
        rule = RepeatRule.from_json(campaign["measurement"])
        clocks, limits = knobs["sm_clocks_mhz"], knobs["power_limits_w"]
        grid = Grid(
            sm_clocks_mhz=None if clocks is None else tuple(int(c) for c in clocks),
            power_limits_w=None if limits is None else tuple(float(p) for p in limits),
            batch_sizes=tuple(int(b) for b in workload["batch_sizes"]),
            drafters=tuple(d["name"] for d in campaign["drafters"]),
            corpora=tuple(c["name"] for c in workload["corpora"]),
            # the repeat axis holds the adaptive repeats too (max_repeats, from version 3);
            # those a cell did not need stay missing (`repeat_rule` tells them apart)
            repeats=max(rule.max_repeats, int(campaign["measurement"].get("max_repeats") or 0)),
        )
        engine = campaign["engine"]
        model, twin_model = engine["model"], engine.get("twin_model") or ""
        # (a cube keeps them as attributes, which netCDF takes as text only)
        for name, value in (("model", model), ("twin_model", twin_model)):
            if not isinstance(value, str):
                raise ValueError(f"the stored campaign's engine {name} is {value!r:.40}")
        return cls(
            grid=grid,
            model=model,
            twin_model=twin_model,
            tp_size=_count(engine["tp_size"], "tp_size", least=1),
            twin_profile=campaign["gpu"].get("profile") or "",
            repeat_rule=rule,
        )


#: The campaign keys a resume may change: which GPUs measure (the GPU model, driver, memory
#: and top SM clock are the sessions' `GPU_INVARIANTS`; the GPUs per server, engine.tp_size).
RESUME_MAY_DIFFER = ("gpu.devices", "gpu.groups")


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
    #: What the dvfs that began the journal gave every drafter's server alike (`ARMS_PINNED`
    #: keys); empty: an earlier dvfs, which did not.
    arms_pinned: tuple[str, ...] = ()

    @classmethod
    def for_campaign(cls, campaign: Campaign) -> Header:
        return cls(
            campaign_name=campaign.name,
            campaign_hash=campaign.hash,
            campaign=campaign.semantic_dict(),
            campaign_source=campaign.recorded_source(),
            dvfs_version=__version__,
            created=now_iso(),
            journal_schema=JOURNAL_SCHEMA,
            arms_pinned=tuple(ARMS_PINNED),
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
            "arms_pinned": list(self.arms_pinned),
        }

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Header:
        stored = record.get("campaign")
        pinned = record.get("arms_pinned")
        return cls(
            campaign_name=_text(record.get("campaign_name")),
            campaign_hash=_text(record.get("campaign_hash")),
            campaign=stored if isinstance(stored, dict) else {},
            campaign_source=_text(record.get("campaign_source")) or "",
            dvfs_version=_text(record.get("dvfs_version")) or "",
            created=_text(record.get("created")) or "",
            journal_schema=record.get("journal_schema", OLDEST_SCHEMA),
            arms_pinned=tuple(str(k) for k in pinned) if isinstance(pinned, list) else (),
        )

    def facts(self) -> CampaignFacts:
        return CampaignFacts.from_json(self.campaign)

    def differences(self, campaign: Campaign) -> list[str]:
        """The measured settings in which `campaign` differs from this journal's (empty: it may
        be resumed). Headers written before the hash left out operational settings match
        through their stored campaign. Which GPUs (`RESUME_MAY_DIFFER`) is not compared: a
        resume may run on any GPUs of the model (`--gpus 1` as `--gpus 1-2` does), which the
        sessions' GPU invariants check; the hash, which names them, is kept as it was."""
        from dvfs.campaign import measured_differences

        if self.campaign_hash == campaign.hash:
            return []
        if not self.campaign:
            return ["the journal does not record its campaign"]
        return measured_differences(
            self.campaign, campaign.semantic_dict(), ignore=RESUME_MAY_DIFFER
        )


def _text(value: Any) -> str | None:
    """A header's text field, or None where an edited line holds anything else (which the
    cube, keeping it as an attribute, could not write): read as a missing one."""
    return value if isinstance(value, str) else None


def knobs_set(campaign_json: str | None) -> tuple[bool, bool]:
    """Whether a stored campaign (a cube's `campaign` attribute) set (SM clock, power limit) or
    left each at stock: an unset knob's coordinate holds the stock value, which is not a
    setting dvfs applied. Both True when no campaign can be read (a hand-built cube)."""
    try:
        grid = CampaignFacts.from_json(json.loads(campaign_json or "{}")).grid
    except (KeyError, ValueError, TypeError, AttributeError):
        return True, True
    return bool(grid.sm_clocks_mhz), bool(grid.power_limits_w)


def repeat_rule(campaign_json: str | None) -> RepeatRule | None:
    """The repeat rule of a stored campaign (a cube's `campaign` attribute); None when no
    campaign can be read (a hand-built cube)."""
    try:
        return RepeatRule.from_json(json.loads(campaign_json or "{}")["measurement"])
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


def measurement_mode(campaign_json: str | None) -> str | None:
    """How a stored campaign stepped its knobs: "per-level", or "in-flight" with its order
    ("in-flight, abba"); None when no campaign can be read (a hand-built cube)."""
    try:
        measurement = json.loads(campaign_json or "{}")["measurement"]
        mode = str(measurement.get("mode") or "per-level")
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    if mode != "in-flight":
        return mode
    # absent: "abba", what in-flight campaigns used before the key existed
    return f"{mode}, {measurement.get('inflight_order') or 'abba'}"
