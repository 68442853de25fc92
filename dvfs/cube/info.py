"""`dvfs cube info`: a cube's dimensions, coverage and provenance as plain data (`info_text`,
which the report's measured section reads too), and the rows its text shows them in.

What the summary says of the stock setting (`dvfs.cube.knobs`), the cells left
(`dvfs.cube.cells_left`), the idle power (`dvfs.cube.idle`), the GPU pinning
(`dvfs.cube.pinning`) and the quality flags (`dvfs.cube.quality`) each has its own module, which
every other command that says it imports alike; this one gathers them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.cube.arms import arm_differences
from dvfs.cube.attrs import gpu_uuids, json_attr, merged_sources
from dvfs.cube.cells_left import models_left, resume_note, shard_label, shards_of, unfit_left
from dvfs.cube.idle import (
    idle_foreign_per_gpu,
    idle_foreign_processes,
    idle_power_per_gpu,
    idle_readings_per_gpu,
)
from dvfs.cube.knobs import knobs_not_set, stock_text
from dvfs.cube.pinning import gpu_pinning
from dvfs.cube.precision import missed_count
from dvfs.cube.quality import FLAG_NOTES, INVALID_ADVICE, quality_counts
from dvfs.cube.schema import CELL_DIMS, STATUS_FAILED, STATUS_MISSING, STATUS_OK
from dvfs.records import ARMS_PINNED, corpus_hashes, measurement_mode

if TYPE_CHECKING:
    import xarray as xr


#: What an in-flight measurement is, beside the measurement method (which says how a window's
#: energy is taken): the README's "In-flight stepping".
INFLIGHT_TEXT = (
    "each knob level a segment of one fixed-batch decode stepping through the levels, its "
    "settle discarded; decodes added until every level reaches the precision; each level "
    "carried back to a per-level cell's context along a drift fitted across the segments"
)


def mode_text(mode: str | None) -> str | None:
    """The measurement mode in words (None: not recorded)."""
    if mode is None or not mode.startswith("in-flight"):
        return mode
    return f"{mode}: {INFLIGHT_TEXT}"


def info_text(ds: xr.Dataset) -> dict[str, Any]:
    """A summary for `dvfs cube info`: dimensions, coverage, quality, provenance. `missing`
    leaves out the adaptive repeats the campaign does not ask for (`not_needed`: a cell that
    reached its precision in fewer than `max_repeats` repeats). In a merged cube the cells
    count each GPU's own grid, not another GPU's stock settings on the merged axes
    (`grid_cells`), which no sweep measures."""
    from dvfs.analysis.headroom import grid_cells, unasked_repeats

    status = ds["cell_status"].values
    in_grid = grid_cells(ds)
    total = int(in_grid.sum())
    not_needed = unasked_repeats(ds).transpose(*ds["cell_status"].dims).values & in_grid
    flags = quality_counts(ds)
    gpu: str | None
    if "gpu" in ds.dims:
        names = json.loads(ds.attrs.get("gpu_names", "[]"))
        shown = ", ".join(map(str, names)) if names else "their models not recorded"
        # A label of shards of one model on several GPUs is all of their UUIDs: count each GPU.
        count = len({u for label in ds["gpu"].values for u in str(label).split(",")})
        gpu = f"merged cube of {count} GPUs: {shown}"
    else:
        gpu = _gpu_text(ds.attrs)
    engine = [ds.attrs.get(k) for k in ("engine_backend", "engine_version")]
    missing = int(((status == STATUS_MISSING) & ~not_needed & in_grid).sum())
    failed = int((status == STATUS_FAILED).sum())
    shards = shards_of(ds)
    # the GPU models whose GPUs the sweep's --gpus must name to measure the cells left
    waiting = models_left(ds) if missing or failed else {}
    # the drafters whose failed cells a rerun fails again (SGLang would not start their server)
    waiting |= unfit_left(ds) if failed else {}
    return {
        "campaign": ds.attrs.get("campaign_name", ds.attrs.get("title")),
        "schema": int(ds.attrs.get("dvfs_schema", 0)),
        "gpu": gpu,
        "driver": _driver_text(ds.attrs),
        "engine": " ".join(str(e) for e in engine if e is not None) or None,
        "model": ds.attrs.get("model"),
        # Which runs and GPUs the cells came from: the sweep's sessions (each run of `dvfs
        # sweep` that measured; a merge sums its cubes'), and the GPUs that measured.
        "sessions": _sessions(ds),
        "gpu_uuids": gpu_uuids(ds),
        "dims": {d: int(ds.sizes[d]) for d in ("gpu", *CELL_DIMS) if d in ds.sizes},
        # Numbers as numbers (as text, "980" sorted after "1980"), the string axes as text.
        "coords": {
            d: [
                v.item() if isinstance(v, np.generic) and not isinstance(v, np.str_) else str(v)
                for v in ds[d].values
            ]
            for d in ("gpu", *CELL_DIMS)
            if d in ds.coords
        },
        # The knob axes the campaign never set: their one value is the stock it files the
        # cells under, not a setting (the report's facts say so alike).
        "knobs_not_set": knobs_not_set(ds),
        "cells": total,
        "measured": int((status == STATUS_OK).sum()),
        "failed": failed,
        "missing": missing,
        "not_needed": int(not_needed.sum()),
        "repeats": _repeats_text(ds),
        "measurement_mode": measurement_mode(ds.attrs.get("campaign")),
        "invalid": int(((ds["valid"].values == 0) & (status == STATUS_OK)).sum()),
        # the measured cells that stopped at max_rounds short of the precision (valid, less
        # certain than asked: `dvfs.cube.precision`); None where the cube cannot say
        "precision_missed": missed_count(ds),
        "idle_power_w": float(ds.attrs.get("idle_power_w", math.nan)),
        "idle_power_per_gpu": idle_power_per_gpu(ds),
        "idle_foreign_per_gpu": idle_foreign_per_gpu(ds),
        "idle_from_power_readings": bool(int(ds.attrs.get("idle_from_power_readings") or 0)),
        "idle_readings_per_gpu": idle_readings_per_gpu(ds),
        "shard": shard_label(ds),
        "merged_shards": shards.get("merged_shards", {}),
        # What measures the cells left (failed ones are retried), as `dvfs headroom` advises
        # (`resume_note`); None when none is left. A shard's cube says it in `shard_note`.
        "resume": (
            resume_note({**shards, **waiting})
            if (missing or failed) and not shards.get("shard")
            else None
        ),
        **waiting,
        "stock": stock_text(ds),
        "energy_per_token_j": _valid_range(ds, status),
        "quality_flags": flags,
        # what each flag means where it needs saying, and for an invalidating flag what to
        # change (the sweep's closing line names the commonest and leaves the others here)
        "flag_notes": {
            name: FLAG_NOTES.get(name) or INVALID_ADVICE[name]
            for name in flags
            if name in FLAG_NOTES or name in INVALID_ADVICE
        },
        "idle_foreign_processes": idle_foreign_processes(ds),
        "gpu_pinning": gpu_pinning(ds),
        "invariants": invariants(ds),
        "failed_cells": json.loads(ds.attrs.get("failed_cells", "[]")),
        "variables": sorted(str(v) for v in ds.data_vars),
        "created": ds.attrs.get("created"),
    }


def _sessions(ds: xr.Dataset) -> int | None:
    """The runs of `dvfs sweep` that measured the cube: its own count, or, for a cube merged
    across GPUs (which keeps each source's in `merged_from`), the sum of its sources'; None
    where a source records none."""
    own = _count(ds.attrs.get("sessions"))
    sources = merged_sources(ds)
    if own is not None or not sources:
        return own
    counts = [_count(source.get("sessions")) for source in sources.values()]
    return None if None in counts else sum(c for c in counts if c is not None)


def _count(value: Any) -> int | None:
    """A whole-number attribute; None where the cube has none or not a number (hand-edited)."""
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def invariants(ds: xr.Dataset) -> dict[str, Any]:
    """What the cube's arms were held alike in, as the sweep checked it at each server start
    and `dvfs cube build` (or `cube merge`) again (`dvfs.records.session`): whether each
    comparison group ran on one GPU (`arms_on_one_gpu`) and how many groups' valid cells span
    GPUs after all (`groups_across_gpus`: a resume elsewhere, a lost worker), the attention
    kernels, what dvfs gave every drafter's server alike (`arms_pinned`), the servers'
    environment (`server_env`: None where not recorded, the twin's), and the prompts (each
    corpus's content hash, how tokens were counted, the prompt format). Each None (or empty)
    where the cube records none (an older dvfs's)."""
    on_one = _count(ds.attrs.get("arms_on_one_gpu"))
    across = _count(ds.attrs.get("groups_across_gpus"))
    kernels: list[str] = []
    if "attention_backend" in ds:
        kernels = sorted({str(k) for k in np.ravel(ds["attention_backend"].values) if str(k)})
    pinned = [k for k in str(ds.attrs.get("arms_pinned") or "").split(",") if k]
    env = json_attr(ds, "server_env")
    return {
        "arms_on_one_gpu": None if on_one is None else bool(on_one),
        "groups_across_gpus": across,
        # What the drafters' servers differ in beyond their drafters (a cube an earlier dvfs
        # built, or one edited): every analysis refuses such a cube, so nothing is "alike"
        "arms_differ": arm_differences(ds),
        "attention_kernels": kernels,
        "arms_pinned": [ARMS_PINNED[k][0] if k in ARMS_PINNED else k for k in pinned],
        "server_env": env if isinstance(env, dict) else None,
        "corpora": corpus_hashes(json_attr(ds, "corpora")),
        "token_count_method": ds.attrs.get("token_count_method") or None,
        "prompt_format": ds.attrs.get("prompt_format") or None,
    }


def precision_text(count: dict[str, Any] | None) -> str:
    """`cube info`'s precision row: how many measured cells stopped at
    `measurement.max_rounds` with an interval wider than `measurement.precision` (valid, but
    less certain than asked), and what would measure them to it."""
    if count is None:
        return "not recorded (the cube states no intervals or no precision)"
    precision, rounds = count["precision"], count["max_rounds"]
    asked = "the precision" if precision is None else f"the precision (±{precision * 100:g}%)"
    if not count["measured"]:
        return "nothing measured yet"  # not "every measured cell reached it": there is none
    if not count["cells"]:
        return f"every measured cell reached {asked}"
    cap = "measurement.max_rounds" if rounds is None else f"measurement.max_rounds ({rounds})"
    return (
        f"{count['cells']} of {count['measured']} measured cell(s) stopped at {cap} with an "
        f"interval on energy per token or median TPOT wider than {asked} (precision_missed: "
        "valid, less certain than asked); raise measurement.max_rounds or loosen "
        "measurement.precision, and sweep again with --fresh (or into another --out folder)"
    )


def invariant_rows(held: dict[str, Any]) -> list[tuple[str, str]]:
    """`invariants` as `dvfs cube info` shows them: one line each for the arms, the servers'
    environment (where recorded) and the prompts; what the cube does not record is said so."""
    on_one, across = held["arms_on_one_gpu"], held["groups_across_gpus"]
    if across:  # counted whether or not the pairing is recorded (a merge with an older cube)
        gpus = f"{across} comparison group(s) measured on more than one GPU (different_gpus)"
    elif on_one is None:
        gpus = "whether each comparison group ran on one GPU not recorded"
    elif on_one:
        gpus = "each comparison group on one GPU"
    else:
        gpus = "comparison groups not kept to one GPU (an earlier dvfs's fleet)"
    alike = ["engine version and flags"]
    if held["attention_kernels"]:
        alike.append("attention kernels " + ", ".join(held["attention_kernels"]))
    alike += held["arms_pinned"]
    differ = held.get("arms_differ") or []
    if differ:
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        held_text = (
            f"served differently beyond the drafter: {'; '.join(differ[:3])}{more} (every "
            "analysis refuses this cube: sweep again with --fresh)"
        )
    else:
        held_text = f"alike but the drafter: {', '.join(alike)}"
    rows = [("arms", f"{gpus}; {held_text}")]
    env = held["server_env"]
    if env is not None:
        rows.append(
            ("server env", "alike: " + (", ".join(sorted(env)) or "none of its variables set"))
        )
    prompts = [f"{name} {digest}" for name, digest in held["corpora"].items()]
    if held["token_count_method"]:
        prompts.append(f"tokens counted by {held['token_count_method']}")
    if held["prompt_format"]:
        prompts.append(f"format {held['prompt_format']}")
    rows.append(("prompts", "alike: " + "; ".join(prompts) if prompts else "not recorded"))
    return rows


def sessions_text(sessions: int | None, uuids: Sequence[str], shown: int = 4) -> str:
    """`cube info`'s sessions row: how many runs of the sweep measured the cube and on which
    GPUs (the first `shown` of them, and how many more)."""
    text = "not recorded" if sessions is None else f"{sessions} run(s) of dvfs sweep"
    if not uuids:
        return text
    named = ", ".join(uuids[:shown]) + (
        f" and {len(uuids) - shown} more" if len(uuids) > shown else ""
    )
    return f"{text}, on {len(uuids)} GPU(s): {named}"


def _driver_text(attrs: Mapping[str, Any]) -> Any:
    """The cube's driver version, with its GPUs' ECC mode and VBIOS where it recorded them (the
    GPU invariants besides the model: "570.133.20 (ECC on, VBIOS 96.00.99.00.01)")."""
    driver = attrs.get("driver_version")
    said = [
        f"{what} {attrs[key]}"
        for key, what in (("ecc_mode", "ECC"), ("vbios_version", "VBIOS"))
        if attrs.get(key) not in (None, "")
    ]
    if driver is None or not said:
        return driver
    return f"{driver} ({', '.join(said)})"


def _gpu_text(attrs: dict[Any, Any]) -> str | None:
    """One GPU model's cube's GPU: name, count and backend, each as far as the cube records it
    (a hand-built cube may record none: None, never the text "None")."""
    name, count, backend = (attrs.get(k) for k in ("gpu_name", "gpu_count", "gpu_backend"))
    if name is None:
        return None
    text = str(name) + ("" if count is None else f" x{count}")
    # a twin's GPU name says "(twin)" already: the backend is not said twice
    if backend is not None and not str(name).endswith(f"({backend})"):
        text += f" ({backend})"
    return text


def failed_cell_label(cell: Any, gpu: Any = None) -> str:
    """A failed cell (as `failed_cells` records it) as the sweep named it ("none/code/b4/r0 @
    1980 MHz, stock limit"), with the GPUs it failed on in a merged cube (`gpu`: their label);
    as recorded where it cannot be read so."""
    from dvfs.measure.plan import Cell, cell_label

    on = "" if not gpu else " on " + ",".join(u[:12] for u in str(gpu).split(","))
    try:
        return cell_label(Cell.from_dict(cell)) + on
    except (KeyError, TypeError, ValueError, AttributeError):
        return str(cell) + on


def _repeats_text(ds: xr.Dataset) -> str:
    """The repeats a cell takes: the repeat axis's length, or with adaptive repeats the
    campaign's range and the fewest and most a measured cell took."""
    from dvfs.records import repeat_rule

    size = int(ds.sizes.get("repeat", 1))
    rule = repeat_rule(ds.attrs.get("campaign"))
    if rule is None or not rule.adaptive or "repeat" not in ds["cell_status"].dims:
        return str(size)
    seen = ds["cell_status"] != STATUS_MISSING
    taken = (seen * (ds["repeat"] + 1)).max("repeat").values[seen.any("repeat").values]
    lo, hi = (int(taken.min()), int(taken.max())) if taken.size else (0, 0)
    used = "" if not hi else f"; cells took {lo}" + (f"-{hi}" if hi > lo else "")
    return f"{rule.repeats}-{rule.max_repeats} (adaptive{used})"


def _valid_range(ds: xr.Dataset, status: np.ndarray) -> list[float]:
    """Least and most energy per token over the valid measured cells (NaN, NaN: none): an
    invalid cell's number is not a measurement to quote."""
    ok = (status == STATUS_OK) & (ds["valid"].values > 0)
    values = ds["energy_per_token_j"].values[ok]
    values = values[np.isfinite(values)]
    if not len(values):
        return [math.nan, math.nan]
    return [float(values.min()), float(values.max())]
