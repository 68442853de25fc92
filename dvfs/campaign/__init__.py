"""Campaign files: what to sweep, on which GPU and engine, and how to measure.

`model` holds the frozen configuration and its hash (a leaf: engines and the twin import their
types from there); `validate` loads a file and checks it whole, with `table` (typed TOML access
and error messages) and `serving` (the [engine] and [drafters.*] tables). Callers use this
package: `from dvfs.campaign import load_campaign, Campaign`.
"""

from __future__ import annotations

from dvfs.campaign.model import (
    EAGLE_TRIPLE,
    MODES,
    NAME_RE,
    NEEDS_DRAFT_MODEL,
    OPERATIONAL,
    SPECULATIVE_ALGORITHMS,
    TOML_NAMES,
    UNMEASURED,
    Campaign,
    CorpusRef,
    DrafterSpec,
    EngineConfig,
    GpuConfig,
    KnobConfig,
    MeasurementConfig,
    SglangConfig,
    WorkloadConfig,
    measured_differences,
    measured_part,
)
from dvfs.campaign.validate import TOP_LEVEL, load_campaign, parse_campaign

__all__ = [
    "EAGLE_TRIPLE",
    "MODES",
    "NAME_RE",
    "NEEDS_DRAFT_MODEL",
    "OPERATIONAL",
    "SPECULATIVE_ALGORITHMS",
    "TOML_NAMES",
    "TOP_LEVEL",
    "UNMEASURED",
    "Campaign",
    "CorpusRef",
    "DrafterSpec",
    "EngineConfig",
    "GpuConfig",
    "KnobConfig",
    "MeasurementConfig",
    "SglangConfig",
    "WorkloadConfig",
    "load_campaign",
    "measured_differences",
    "measured_part",
    "parse_campaign",
]
