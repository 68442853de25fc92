"""The fleet driver's rule for a server beside the fleet journal's servers: one function, so
that the driver and `dvfs doctor` (before a fleet's resume) refuse alike."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dvfs.campaign import Campaign
from dvfs.errors import MAX_MESSAGE_CHARS
from dvfs.records import (
    arm_changes,
    begun_unpinned,
    restart_as_it_was,
    server_changes,
    with_changes,
)
from dvfs.records.session import CHANGES
from dvfs.twin.identity import TWIN_CHANGED, twin_changed


def server_refusal(
    campaign: Campaign,
    path: Path,
    servers: Mapping[str, dict[str, Any]],
    record: dict[str, Any],
    pinned: tuple[str, ...],
    worker: str,
    room: int = MAX_MESSAGE_CHARS,
) -> str | None:
    """Why the driver refuses a server `record` started on `worker` beside `servers` (each
    drafter's first server in the fleet's journal at `path`, begun by a dvfs that pinned
    `pinned`): it differs from its own drafter's in its configuration (`server_changes`), or
    from any drafter's in what arms must share (`arm_changes`). None where it compares. The
    fleet driver's own rule, which `dvfs doctor` applies to an attached server before a
    fleet's resume; its line is bounded (`room`: `MAX_MESSAGE_CHARS`, less what the driver
    adds after it) and ends in its remedy."""
    batches = campaign.workload.batch_sizes
    drafter = str(record.get("drafter"))
    changes = server_changes(servers.get(drafter, record), record)
    whose, own = "the one that measured its cells", bool(changes)
    # The arms must differ only in their drafters: across drafters too (`arm_changes`).
    for other in () if changes else servers.values():
        changes = arm_changes(other, record, batches, pinned)
        if changes:
            # Its own drafter's earlier server (an arg it must share with every arm)
            # is brought back as it was, as one GPU's sweep says (an attached one is
            # restarted: no extra_args reach it).
            own = other.get("drafter") == drafter
            if not own:
                whose = f"drafter {other.get('drafter')!r}'s"
            break
    if not changes:
        return None
    differs = (
        f"the server of drafter {drafter!r} on {worker} differs from {whose} in {path} ({CHANGES})"
    )
    begun = begun_unpinned(pinned, changes)
    engine = campaign.engine
    attached = engine.backend == "sglang" and bool(engine.sglang.url)
    # As the runner's rule says it (`dvfs.measure.runner.server_refusal`): against its own
    # drafter's earlier server, a rerun's other SGLang or flags; else another drafter's.
    served = (
        f"{differs}: its cells would compare more than the knob settings"
        if own
        else f"{differs}: the arms would compare more than their drafters"
    )
    why = (
        f"{differs}: {TWIN_CHANGED}"
        if twin_changed(changes)
        else f"{served}; {path} was {begun}, so this dvfs cannot resume it: rerun with "
        "--fresh (or into another --out folder)"
        if begun
        else f"{served}; {restart_as_it_was(changes, attached)}, or start over with --fresh "
        "(or another --out)"
        if own
        else f"{served}; run every drafter on the same SGLang and flags "
        "(engine.sglang.extra_args), or start over with --fresh (or another --out)"
    )
    # The changes named give way to the remedy, which ends the line whole.
    return with_changes(why, changes, room)
