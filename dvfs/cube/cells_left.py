"""What measures a cube's cells left (not measured yet, or failed), in the one wording every
command that counts them uses: `dvfs cube info`, headroom, compare, the report, the sweep's
and the merge's closing lines.

The sweep's own command again, resumed; for one shard's cube, or a cube merged from shards or
from sweeps run apart, the parts' commands and the merge again (`shards_of`); the GPU models
whose GPUs a rerun must name where the cells left are on some models only (`models_left`);
and for the drafters whose server SGLang would not start, a changed campaign instead, as the
same command fails them again (`unfit_left`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.cube.attrs import json_attr
from dvfs.cube.schema import STATUS_FAILED, STATUS_MISSING

if TYPE_CHECKING:
    import xarray as xr


def shard_label(ds: xr.Dataset) -> str | None:
    """The shard ("I/N") a shard's cube holds (`dvfs sweep --shard`); None for a whole cube."""
    from dvfs.fleet.shard import SHARD_ATTR

    label = ds.attrs.get(SHARD_ATTR)
    return None if label is None else str(label)


def shard_note(label: str | None, doc: dict[str, Any] | None = None) -> str | None:
    """What a shard's cube does not hold, for every command that counts its cells: the other
    shards' cells are missing from it, and sweeping this shard again does not measure them.
    `doc`: the analysis document, whose `models_left` (a shard of a fleet mixing GPU models
    whose own cells left are on some models only) the shard's command must name GPUs of."""
    if label is None:
        return None
    return (
        f"this is shard {label}'s cube: the other shards' cells count as missing here (and "
        f"any of its own not measured yet, which its `dvfs sweep CAMPAIGN --shard {label}` "
        f"command measures when run again without --fresh{models_left_advice(doc or {})}); merge "
        "every shard (`dvfs cube merge SHARD_DIRS -o cube.nc`) for the whole campaign"
    )


def merged_shards(ds: xr.Dataset) -> dict[str, str]:
    """A cube merged from shards (`dvfs cube merge` of `--shard` runs): each shard's folder
    (as the merge was given it) -> its `I/N`; empty for any other cube."""
    try:
        sources = json.loads(str(ds.attrs.get("combined_from") or "{}"))
    except ValueError:
        return {}
    if not isinstance(sources, dict):
        return {}
    folders = {}
    for name, label in sources.items():
        path = str(name)
        for tail in ("/journal.jsonl", "/cube.nc"):
            path = path.removesuffix(tail)
        folders[path] = str(label)
    return folders


def resume_advice(what: str, doc: dict[str, Any] | None = None) -> str:
    """The command that measures `what` (cells a cube lacks), for an analysis document `doc`
    of the cube (its `shard`, or `merged_shards`): the sweep's own command again; for one
    shard's cube, the shards' `dvfs sweep --shard` commands and `dvfs cube merge` (another
    shard may hold them: this shard's command never measures them); for a cube merged from
    shards, the unfinished shards' commands and the merge again (resuming a shard does not
    change the merged cube); for a cube `dvfs cube merge` merged from sweeps run apart
    (`merged_cubes`), the unfinished sweeps' commands and the merge again alike."""
    doc = doc or {}
    shard = doc.get("shard")
    if shard:
        count = str(shard).rpartition("/")[2]
        return (
            f"this is shard {shard}'s cube, and another shard may hold {what}: run each shard's "
            f"`dvfs sweep CAMPAIGN --shard I/{count}` (shard {shard}'s again for its own "
            f"cells left{models_left_advice(doc)}), then `dvfs cube merge SHARD_DIRS -o "
            "cube.nc` and analyse the merged cube"
        )
    merged = doc.get("merged_shards")
    if merged:
        count = str(next(iter(merged.values()))).partition("/")[2]
        each = ", ".join(f"--shard {label} --out {folder}" for folder, label in merged.items())
        gpus = models_left_advice(doc)
        return (
            f"this cube is merged from {len(merged)} shards: rerun the unfinished shards' "
            f"`dvfs sweep CAMPAIGN --shard I/{count} --out SHARD_DIR` ({each}){gpus}"
            f"{',' if gpus else ''} to measure {what}, then `dvfs cube merge` them again"
        )
    folders = doc.get("merged_cubes")
    if folders:
        return (
            f"this cube is merged from {len(folders)} sweeps' cubes ({', '.join(folders)}): "
            f"run each unfinished sweep's `dvfs sweep` command again without --fresh to measure "
            f"{what}, then `dvfs cube merge` them again (a resumed sweep rebuilds its own "
            "cube, not this one)"
        )
    # without --fresh: the same command with it moves the journal aside and starts over
    return (
        "resume the sweep: run the same `dvfs sweep` command again without --fresh (which "
        f"starts over) to measure {what}{models_left_advice(doc)}"
    )


def unfit_left(ds: xr.Dataset) -> dict[str, Any]:
    """For an analysis document: `unfit`, where the cube's failed cells include some whose
    drafter's server SGLang would not start for the campaign as it is (`START_UNFIT`, which a
    rerun of the same command fails again): those drafters, what each refusal says to change,
    in a merged cube the GPUs (labels) each failed so on (`on`), and how many cells left
    (`_cells_left`) are not theirs (`others`, which a rerun retries). {} where none failed so."""
    import xarray as xr

    from dvfs.errors import unfit_fix

    failed = json_attr(ds, "failed_cells")
    on: dict[str, dict[str, None]] = {}  # drafter -> the GPU labels ("" where not said)
    fixes: dict[str, None] = {}
    for item in failed if isinstance(failed, list) else ():
        cell = item.get("cell") if isinstance(item, dict) else None
        if not isinstance(cell, dict):
            continue
        fix = unfit_fix(str(item.get("error") or ""))
        if fix is not None:
            on.setdefault(str(cell.get("drafter")), {})[str(item.get("gpu") or "")] = None
            fixes[fix] = None
    status = ds.get("cell_status")
    if not on or status is None or "drafter" not in status.dims:
        return {}
    by_gpu = "gpu" in status.dims and all("" not in gpus for gpus in on.values())
    drafters = [str(d) for d in ds["drafter"].values]
    if by_gpu:
        gpus = [str(g) for g in ds["gpu"].values]
        # a shard's record names its own GPU, the merged shards' label all of that model's
        on = {d: {_label_of(g, gpus): None for g in on_gpus} for d, on_gpus in on.items()}
        theirs = xr.DataArray(
            [[g in on.get(d, {}) for d in drafters] for g in gpus], dims=("gpu", "drafter")
        )
    else:
        theirs = xr.DataArray([d in on for d in drafters], dims=("drafter",))
    mask = theirs.broadcast_like(status).transpose(*status.dims).values
    others = int((_cells_left(ds) & ~mask).sum())
    unfit: dict[str, Any] = {"drafters": list(on), "fixes": list(fixes), "others": others}
    if by_gpu:
        unfit["on"] = {d: list(gpus) for d, gpus in on.items()}
    return {"unfit": unfit}


def _label_of(gpu: str, labels: list[str]) -> str:
    """The cube's `gpu` label among `labels` holding the GPU (UUIDs) a failed cell's record
    names (a label of shards of one model on several GPUs is all of their UUIDs); `gpu`
    itself where none does."""
    own = set(gpu.split(","))
    return next((label for label in labels if own & set(label.split(","))), gpu)


def unfit_advice(doc: dict[str, Any]) -> str:
    """What measures the cells of the drafters SGLang would not start the server of for the
    campaign as it is (`unfit_left`), as the sweep's closing line says it: not the same command
    (it fails them again) but a changed campaign, swept again with --fresh or into another --out
    folder; "" where the document names none."""
    unfit = doc.get("unfit") or {}
    drafters = [str(d) for d in unfit.get("drafters") or ()]
    if not drafters:
        return ""
    fixes = "; ".join(str(f) for f in unfit.get("fixes") or ())
    which = ", ".join(repr(d) for d in drafters)
    # `dvfs cube merge` merges the shards (or sweeps' cubes) of one campaign alone: a changed
    # campaign is swept again on every one, not only where the cells failed
    apart = "shard" if doc.get("shard") or doc.get("merged_shards") else "sweep"
    merged = bool(doc.get("shard") or doc.get("merged_shards") or doc.get("merged_cubes"))
    again = (
        f"run every {apart} again with --fresh or into other --out folders (a changed campaign "
        f"needs it on each {apart}, not only where the cells failed: `dvfs cube merge` merges "
        f"the {apart}s of one campaign alone)"
        if merged
        else "sweep again with --fresh or into another --out folder"
    )
    advice = (
        f"the cells of drafter{'' if len(drafters) == 1 else 's'} {which} failed as SGLang would "
        "not start their server for the campaign as it is, which the same command meets again: "
        f"change the campaign ({fixes}), then {again}"
    )
    if "engine.sglang.env" in fixes:  # the server's environment may change between runs
        advice += " (a change to engine.sglang.env alone resumes the journal by the same command)"
    if merged:
        advice += ", then `dvfs cube merge` the cubes again"  # as `resume_advice` says
    return advice


def _with_unfit(doc: dict[str, Any], rest: str) -> str:
    """`rest` (what measures the cells left), led by `unfit_advice` where some failed cells'
    server SGLang would not start: `rest` then for the other cells alone, if any are left."""
    unfit = unfit_advice(doc)
    if not unfit:
        return rest
    others = int((doc.get("unfit") or {}).get("others") or 0)
    return f"{unfit}; for the other {others} cell(s) left: {rest}" if others else unfit


def resume_note(doc: dict[str, Any]) -> str:
    """What measures a partial cube's cells not measured yet, for an analysis document `doc`
    of it: `shard_note` for one shard's cube, the shards' (or sweeps') commands and the merge
    again for a cube merged from shards or from sweeps run apart (`resume_advice`), else the
    sweep's own command again."""
    if doc.get("shard"):
        return _with_unfit(doc, str(shard_note(str(doc["shard"]), doc)))
    if doc.get("merged_shards") or doc.get("merged_cubes"):
        return _with_unfit(doc, resume_advice("them", doc))
    return _with_unfit(
        doc,
        "run the same `dvfs sweep` command again without --fresh (which starts over) to resume "
        f"it{models_left_advice(doc)}",
    )


def models_left_advice(doc: dict[str, Any]) -> str:
    """What the sweep's (or a shard's) command again needs where the cells left are on some
    GPU models only (`models_left` of the document): its --gpus naming GPUs of them, as "the
    same command" rerun on the other models alone (after a node of one model was lost)
    measures none. The one wording of it, for every advice that names a command."""
    waiting = doc.get("models_left")
    if not waiting:
        return ""
    return (
        f", its --gpus naming GPUs of {', '.join(waiting)}: the cells left are on "
        f"{'that model' if len(waiting) == 1 else 'those models'} alone (a run on the other "
        "models' GPUs measures none of them)"
    )


#: A cube's attribute marking it as one GPU model's own cube of a fleet mixing GPU models (the
#: `gpu-<model>/cube.nc` beside the fleet's merged cube): that model's name. Its cells left
#: are on that model alone: the sweep's command again measures them only with its --gpus
#: naming GPUs of that model (`models_left`), not after a rerun on the other models alone.
FLEET_MODEL_ATTR = "fleet_model"


def models_left(ds: xr.Dataset) -> dict[str, Any]:
    """For an analysis document: `models_left`, the GPU models whose GPUs the sweep's --gpus
    must name to measure the cells left, where the cube a fleet mixing GPU models wrote has
    cells left (missing, or failed) on some of its models only, or one such model's own cube
    (`FLEET_MODEL_ATTR`) has cells left: also a shard's (its own cells left, not the other
    shards') and one merged from shards, whose advice names the shards' commands. {}
    otherwise (no cell left, every model's, one model's run, a cube merged from sweeps run
    apart: each its own command, or a shard's whose cells this dvfs cannot tell)."""
    shards = shards_of(ds)
    if "cell_status" not in ds or shards.get("merged_cubes"):
        return {}
    own = ds.attrs.get(FLEET_MODEL_ATTR)
    names: list[str] = []
    if "gpu" in ds["cell_status"].dims:
        try:
            names = [str(m) for m in json.loads(str(ds.attrs.get("gpu_names", "")))]
        except ValueError:
            return {}
        if len(names) != ds.sizes["gpu"] or len(set(names)) < 2:
            return {}
    elif not own:
        return {}
    left = _cells_left(ds)
    if shards.get("shard"):
        # the other shards' cells count as missing in a shard's cube: its own are left
        mine = shard_cells(ds)
        if mine is None:
            return {}
        left &= mine
    if not names:
        return {"models_left": [str(own)]} if left.any() else {}
    axis = ds["cell_status"].dims.index("gpu")
    on = np.asarray(np.moveaxis(left, axis, 0).reshape(len(names), -1).any(axis=1), dtype=bool)
    waiting = sorted({m for i, m in enumerate(names) if on[i]})
    if not waiting or len(waiting) == len(set(names)):
        return {}
    return {"models_left": waiting}


def shard_cells(ds: xr.Dataset) -> np.ndarray | None:
    """Which of a shard's cube's cells (along `cell_status`'s dimensions) are the shard's own
    (`cube_shard_groups`); None where the cube cannot say."""
    import xarray as xr

    from dvfs.fleet.shard import cube_shard_groups

    groups = cube_shard_groups(ds)
    if groups is None:
        return None
    status = ds["cell_status"]
    batches, corpora, repeats = (ds[d].values for d in ("batch", "corpus", "repeat"))
    own = [
        [[(int(b), str(c), int(r)) in groups for r in repeats] for c in corpora] for b in batches
    ]
    table = xr.DataArray(np.array(own, dtype=bool), dims=("batch", "corpus", "repeat"))
    return np.asarray(table.broadcast_like(status).transpose(*status.dims).values, dtype=bool)


def _cells_left(ds: xr.Dataset) -> np.ndarray:
    """Which of the cube's cells (along `cell_status`'s dimensions) are left to measure: not
    measured yet where the grid asks for them, or failed (a rerun retries them)."""
    from dvfs.analysis.headroom import grid_cells, unasked_repeats

    status = ds["cell_status"].values
    in_grid = grid_cells(ds)
    not_needed = unasked_repeats(ds).transpose(*ds["cell_status"].dims).values & in_grid
    return np.asarray(
        ((status == STATUS_MISSING) & ~not_needed & in_grid) | (status == STATUS_FAILED),
        dtype=bool,
    )


def shards_of(ds: xr.Dataset) -> dict[str, Any]:
    """What an analysis document records of a cube's shards: `shard` (one shard's cube: its
    `I/N`), `merged_shards` (a cube merged from shards: each shard's folder -> `I/N`) or
    `merged_cubes` (a cube merged from sweeps run apart: their folders, `merged_cubes`)."""
    if ds.attrs.get("shard"):
        return {"shard": str(ds.attrs["shard"])}
    merged = merged_shards(ds)
    if merged:
        return {"merged_shards": merged}
    folders = merged_cubes(ds)
    return {"merged_cubes": folders} if folders else {}


#: A cube's attribute naming the cubes `dvfs cube merge` merged it from (JSON: their folders,
#: as the merge was given them), where they were swept apart (not the shards of one run, nor
#: the GPU models of one fleet, whose sweep writes its merged cube itself).
MERGED_CUBES_ATTR = "merged_cubes"


def merged_cubes(ds: xr.Dataset) -> list[str]:
    """The folders of the cubes `dvfs cube merge` merged `ds` from, where they were swept
    apart: resuming one of them rebuilds its own cube only, so the merge is run again too.
    Empty for any other cube."""
    try:
        folders = json.loads(str(ds.attrs.get(MERGED_CUBES_ATTR) or "[]"))
    except ValueError:
        return []
    return [str(f) for f in folders] if isinstance(folders, list) else []
