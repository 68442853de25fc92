"""Planning caps: a `dvfs headroom --json` document and the operator's choice in, a caps file out.

Pure: no GPU and no state directory, so `dvfs cap plan` runs anywhere a headroom document is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dvfs.caps.files import TWIN_SUFFIX, CapsFile, GpuCap, is_twin_name
from dvfs.errors import CapsError


def load_headroom(path: Path) -> Any:
    """A `dvfs headroom --json` document from a file (`plan_caps` checks its shape)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CapsError(
            f"{path} is not JSON ({exc}); write it with `dvfs headroom CUBE --json -o FILE`"
        ) from exc


def plan_caps(
    doc: dict[str, Any],
    *,
    batch: int,
    drafter: str,
    corpus: str,
    uuids: Sequence[str] = (),
    model_name: str | None = None,
) -> CapsFile:
    """Caps from a `dvfs.headroom/1` document and the operator's choice.

    corpus may be "worst-case": for each knob the least aggressive choice among the corpora
    (highest clock, highest power limit), which keeps every corpus within its target as long
    as latency does not rise when a knob goes up. A knob left at stock is not capped.
    """
    if uuids and model_name:
        raise CapsError("--gpu and --model exclude each other: cap GPUs by UUID or by model")
    not_uuids = [u for u in uuids if not u.startswith("GPU-")]
    if not_uuids:
        raise CapsError(
            f"--gpu {not_uuids[0]!r} is not a GPU UUID (GPU-...); `dvfs gpu list` shows them"
        )
    if not isinstance(doc, dict) or doc.get("schema") != "dvfs.headroom/1":
        raise CapsError("the input is not `dvfs headroom --json` output (schema dvfs.headroom/1)")
    missing = [k for k in ("rows", "reference", "gpu", "target") if k not in doc]
    if missing or not isinstance(doc.get("rows"), list):
        raise CapsError(
            f"the headroom document is incomplete (missing {', '.join(missing) or 'rows'}); "
            "write it again with `dvfs headroom CUBE --json -o FILE`"
        )
    rows = [r for r in doc["rows"] if r["batch"] == batch and r["drafter"] == drafter]
    if not rows:
        batches = sorted({r["batch"] for r in doc["rows"]})
        drafters = sorted({r["drafter"] for r in doc["rows"]})
        raise CapsError(
            f"no headroom rows for batch {batch} and drafter {drafter!r}; the document "
            f"has batches {batches} and drafters {drafters}"
        )
    if corpus != "worst-case":
        rows = [r for r in rows if r["corpus"] == corpus]
        if not rows:
            raise CapsError(
                f"no headroom rows for corpus {corpus!r}; use one of "
                f"{sorted({r['corpus'] for r in doc['rows']})} or worst-case"
            )
    per_gpu: dict[str | None, list[dict[str, Any]]] = {}
    for r in rows:
        per_gpu.setdefault(r.get("gpu"), []).append(r)
    measured_on = doc["gpu"].get("name")
    simulated = doc["gpu"].get("backend") == "twin" or is_twin_name(measured_on)
    if simulated and not (uuids or model_name):
        if len(per_gpu) > 1:
            raise CapsError(
                "simulated caps from a merged cube of several twin GPUs: plan each GPU's cube "
                "on its own, or pass --model NAME"
            )
        # The twin's UUIDs are made up: name its GPU model instead.
        model_name = str(measured_on or "unknown GPU") + (
            "" if is_twin_name(measured_on) else TWIN_SUFFIX
        )
        per_gpu = {None: rows}
    caps = []
    for gpu_uuid, group in per_gpu.items():
        ref = _reference_for(doc["reference"], gpu_uuid)
        infeasible = [r["corpus"] for r in group if not r["feasible"]]
        if infeasible:
            raise CapsError(
                f"no setting meets the target for corpus {', '.join(infeasible)} at batch {batch} "
                f"with drafter {drafter!r}{f' on {gpu_uuid}' if gpu_uuid else ''}; loosen the "
                "target (--slack) or choose another batch or drafter"
            )
        clock = max(r["chosen"]["sm_clock_mhz"] for r in group)
        limit = max(r["chosen"]["power_limit_w"] for r in group)
        clock_cap = None if clock >= ref["sm_clock_mhz"] else int(clock)
        limit_cap = None if limit >= ref["power_limit_w"] else float(limit)
        if clock_cap is None and limit_cap is None:
            raise CapsError(
                f"the chosen setting is stock ({ref['sm_clock_mhz']} MHz, "
                f"{ref['power_limit_w']:g} W)"
                f" for batch {batch}, drafter {drafter!r}, corpus {corpus}: nothing to cap"
            )
        targets = [gpu_uuid] if gpu_uuid else list(uuids) or list(doc["gpu"]["uuids"])
        if model_name:
            caps.append(
                GpuCap(name=model_name, sm_clock_max_mhz=clock_cap, power_limit_w=limit_cap)
            )
        else:
            if not targets:
                raise CapsError("no GPU UUIDs: pass --gpu UUID (repeatable) or --model NAME")
            caps += [
                GpuCap(uuid=u, sm_clock_max_mhz=clock_cap, power_limit_w=limit_cap) for u in targets
            ]
    meta = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "simulated": True if simulated else None,
        "campaign": doc.get("campaign"),
        "measured_on": measured_on,
        "target": doc["target"]["description"],
        "batch": batch,
        "drafter": drafter,
        "corpus": corpus,
    }
    return CapsFile(tuple(caps), meta)


def _reference_for(reference: dict[str, Any], gpu_uuid: str | None) -> dict[str, Any]:
    """The stock setting a group's chosen setting is compared with: in a merged document
    whose GPUs' stock settings differ, each GPU's own (`reference.per_gpu`)."""
    per_gpu = reference.get("per_gpu") or {}
    if gpu_uuid is not None and gpu_uuid in per_gpu:
        return dict(per_gpu[gpu_uuid])
    if reference.get("sm_clock_mhz") is None or reference.get("power_limit_w") is None:
        raise CapsError(
            "the headroom document has no single stock setting (its GPUs differ) and this "
            "group names no GPU; plan each GPU with --gpu UUID"
        )
    return reference
