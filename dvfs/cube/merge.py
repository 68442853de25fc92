"""Merging cubes: of one campaign measured on different GPUs, along a new `gpu` dimension;
or the shards of one campaign's run (`dvfs sweep --shard i/n`) back into the whole."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.cube.arms import drafter_servers
from dvfs.cube.build import MEASURED_ON, MEASURED_ON_ATTRS, found_limits_attrs
from dvfs.cube.schema import COORD_ATTRS, MERGE_MAY_DIFFER, SPLIT_METHOD_VAR, STATUS_MISSING
from dvfs.errors import CubeError, MergeRefusedError, capped_failed
from dvfs.records import now_iso
from dvfs.version import __version__

if TYPE_CHECKING:
    import xarray as xr

    from dvfs.fleet.shard import Shard


def _campaign_attr(ds: xr.Dataset, name: str) -> dict[str, Any]:
    try:
        campaign = json.loads(ds.attrs.get("campaign", ""))
    except ValueError:
        campaign = None
    if not isinstance(campaign, dict) or not campaign:
        raise MergeRefusedError(
            f"cannot merge: {name} does not record its campaign, so its workload cannot be "
            "checked; rebuild it with `dvfs cube build`"
        )
    return campaign


def _check_same_workload(first: xr.Dataset, ds: xr.Dataset, first_name: str, name: str) -> None:
    """Refuse cubes of different campaigns (output tokens, clock grid, batches, drafters...):
    their union would be a half-empty cube whose arms measured different things."""
    from dvfs.campaign import measured_differences

    changes = measured_differences(
        _campaign_attr(first, first_name), _campaign_attr(ds, name), ignore=MERGE_MAY_DIFFER
    )
    if changes:
        more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
        raise MergeRefusedError(
            f"cannot merge: the campaign differs ({first_name} -> {name}: "
            f"{'; '.join(changes[:3])}{more}); only cubes of one campaign measured on "
            "different GPUs merge"
        )


class SameGpuError(MergeRefusedError):
    """Two cubes to merge measured on a common GPU."""


def _check_distinct_gpus(labels: list[str], names: list[str]) -> None:
    """Refuse cubes sharing a GPU: each label is a cube's comma-joined GPU UUIDs (a fleet
    cube has several), and one GPU in two cubes would be two rows under one name."""
    seen: dict[str, str] = {}
    for label, name in zip(labels, names, strict=True):
        for uuid in dict.fromkeys(u.strip() for u in label.split(",") if u.strip()):
            if uuid in seen:
                raise SameGpuError(
                    f"cannot merge: GPU {uuid} is in both {seen[uuid]} and {name} (the same "
                    "GPU twice); merge cubes of different GPUs"
                )
            seen[uuid] = name


def _json(ds: xr.Dataset, key: str, empty: Any) -> Any:
    try:
        return json.loads(str(ds.attrs.get(key, "")) or "null") or empty
    except ValueError:
        return empty


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: What the shards of one run, and the cubes of one campaign on different GPUs, must share
#: besides the campaign: cubes that differ here compare software or prompts, not GPUs or
#: settings (with the corpora's content and each drafter's server, `provenance_differences`).
SHARED = (
    "engine_version",
    "measurement_method",
    "token_count_method",
    "prompt_format",
    "server_env",
)


#: Resolved server args SGLang derives from the GPU it starts on when neither the campaign nor
#: dvfs sets them: the same campaign gets other values on another GPU model, so cubes of
#: different GPUs are not compared in them (the shards of one run, on one GPU model, are).
#: SGLang's ServerArgs fills them from the GPU's memory when they are unset (its server_args.py):
#: - chunked_prefill_size: 2048 below 35 GiB, 8192 below 160 GiB, else 16384;
#: - mem_fraction_static: from the GPU's memory less what activations, CUDA graphs and a draft
#:   model reserve;
#: - 0.5.9's piecewise prefill graphs' token limit and sizes: the chunked prefill size's
#:   (server_args.py lines 1006-1018);
#: and from its architecture or platform, for some models (the `ARM_ARGS` the arms of one
#: journal, on one GPU model, share):
#: - the MoE kernels and with them shared-expert fusion (0.5.9 lines 1307-1624 and 2155,
#:   FlashInfer TRT-LLM MoE on Blackwell; 0.5.23 model_overrides/*.py on SM100 and
#:   overrides.py `_moe_runner_fusion_disable`), FP8 and FP4 GEMM kernels (0.5.23 overrides.py
#:   line 838, model_overrides/deepseek_v4.py, muse_glimmer.py on SM100 or SM120), FlashInfer's
#:   fused all-reduce (0.5.9 line 1697: Hopper or Blackwell, not an H20);
#: - hybrid models' linear-attention decode kernels (0.5.23 attention_hook.py line 299 and
#:   kimi_k3_hook.py on SM100) and GLM-5-Next's speculative verify kernels (0.5.23
#:   glm5_next_hook.py on SM100; one drafter's servers are compared in them, `DRAFTER_ARGS`),
#:   DeepSeek's sparse-attention kernels (0.5.9 `_set_default_nsa_backends` by compute
#:   capability, 0.5.23 overrides.py `_dsa_split_backend_resolution`) and its KV cache
#:   dtype, left "auto" (FP8 on SM100 and later, bfloat16 before: 0.5.9
#:   `_set_default_nsa_kv_cache_dtype` line 1143, 0.5.23 overrides.py line 534), Triton
#:   attention's KV splits (16 on ROCm: 0.5.9 line 2061, 0.5.23 platform_hook.py line 54);
#: - Qwen3-VL's radix eviction policy and prefill/decode interval on a large Hopper GPU (0.5.23
#:   model_overrides/qwen3_vl.py).
#: The campaign, compared with the cubes, gives every GPU the same flags: a value it sets
#: SGLang keeps on each.
#: Not here, as dvfs pins them for every arm (`dvfs.engines.sglang_args.launch_argv`):
#: cuda_graph_max_bs (and its 0.5.23 split) and the decode graphs' batch sizes,
#: max_running_requests, random_seed; the model, parallelism and the drafter's speculative
#: args come from the campaign.
GPU_DERIVED_ARGS = (
    "chunked_prefill_size",
    "mem_fraction_static",
    "piecewise_cuda_graph_max_tokens",
    "piecewise_cuda_graph_tokens",
    "moe_runner_backend",
    "disable_shared_experts_fusion",
    "fp8_gemm_runner_backend",
    "fp4_gemm_runner_backend",
    "enable_flashinfer_allreduce_fusion",
    "linear_attn_decode_backend",
    "linear_attn_verify_backend",
    "nsa_prefill_backend",
    "nsa_decode_backend",
    "dsa_prefill_backend",
    "dsa_decode_backend",
    "kv_cache_dtype",
    "triton_attention_num_kv_splits",
    "radix_eviction_policy",
    "prefill_decode_interval",
)
#: What follows the attention kernels, which SGLang picks from the GPU's architecture when the
#: campaign leaves them to it (engine.sglang.attention_backend = "auto": fa3 on Hopper,
#: flashinfer elsewhere): the backends, the draft's, the KV page size some backends set, and
#: 0.5.9's hybrid SWA pool, which it turns off for GPT-OSS under trtllm_mha (its pick on
#: Blackwell, fa3 on Hopper: server_args.py lines 1333-1361).
#: Compared across GPUs only when the campaign pins the kernels.
AUTO_KERNEL_ARGS = (
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "speculative_draft_attention_backend",
    "page_size",
    "disable_hybrid_swa_memory",
)


#: What the shards of one run, on one GPU model, share besides `SHARED` (compared only where
#: both record them, as the `WHEN_KNOWN`: an earlier dvfs's shard does not): their GPUs'
#: identity (`dvfs.records.GPU_INVARIANTS`), which a journal's sessions share too. Cubes of
#: different GPUs may differ in it (a fleet's node with ECC off, run into its own folder as
#: the fleet's refusal advises): their merge keeps each GPU's (`merged_from`) and the report
#: and `dvfs compare` say where their ECC modes differ.
#: Their sessions' power-limit range and SM clock range too (`SESSION_INVARIANTS`, the top SM
#: clock of `GPU_INVARIANTS`), which a journal's sessions share.
SHARD_GPU_KEYS = (
    "driver_version",
    "memory_clock_mhz",
    "ecc_mode",
    "vbios_version",
    "power_limit_range_w",
    "sm_clock_range_mhz",
)
#: The `SHARD_GPU_KEYS` an earlier dvfs's cube does not record.
GPU_WHEN_KNOWN = ("ecc_mode", "vbios_version")
#: The `SHARD_GPU_KEYS` that hold numbers, compared as numbers (netCDF gives them back as
#: arrays) where both cubes know them: NaN is a range not known (a power limit NVML does not
#: support, whose stock is compared apart, `stock_power_limit_enforced`; an SM clock range an
#: earlier dvfs did not record).
_RANGES = ("power_limit_range_w", "sm_clock_range_mhz")


def _ranges_differ(a: Any, b: Any) -> bool:
    """Whether two cubes' `_RANGES` attribute differs, both known."""
    try:
        x, y = (np.atleast_1d(np.asarray(v, dtype=float)).ravel() for v in (a, b))
    except (TypeError, ValueError):  # a hand-edited cube's text: compared as text
        return str(a) != str(b)
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        return False
    return x.shape != y.shape or not np.array_equal(x, y)


def _kernels_pinned(ds: xr.Dataset) -> bool:
    """Whether the cube's campaign names the attention backend (not "auto")."""
    try:
        campaign = json.loads(str(ds.attrs.get("campaign", "")) or "{}")
        backend = campaign["engine"]["sglang"]["attention_backend"]
    except (ValueError, KeyError, TypeError):
        return True  # not said: compared, as within one journal
    return backend != "auto"


def _gpu_neutral(
    servers: dict[str, dict[str, Any]], kernels_pinned: bool
) -> dict[str, dict[str, Any]]:
    """Each drafter's server record without what SGLang derives from the GPU
    (`GPU_DERIVED_ARGS`, and `AUTO_KERNEL_ARGS` unless the campaign pins the kernels)."""
    dropped = GPU_DERIVED_ARGS if kernels_pinned else (*GPU_DERIVED_ARGS, *AUTO_KERNEL_ARGS)
    neutral = {}
    for drafter, record in servers.items():
        record = dict(record)
        if isinstance(record.get("args"), dict):
            record["args"] = {k: v for k, v in record["args"].items() if k not in dropped}
        if not kernels_pinned:
            record["attention_backend"] = None
        neutral[drafter] = record
    return neutral


def provenance_differences(
    first: xr.Dataset, ds: xr.Dataset, keys: Iterable[str] = SHARED, *, across_gpus: bool = False
) -> list[str]:
    """What two cubes differ in among `keys` (those `WHEN_KNOWN` only where both record them),
    their corpora's content hashes, and each drafter's server (`arm_changes` and, drafter for
    drafter, `server_changes`: engine version, attention kernels, the args arms share, the
    decode CUDA graphs at the grid's batch sizes). `across_gpus`: cubes of different GPU
    models, whose servers are not compared in what SGLang derives from the GPU
    (`_gpu_neutral`)."""
    from dvfs.provenance import WHEN_KNOWN
    from dvfs.records import arm_changes, corpus_changes, env_changes, server_changes

    changes = []
    for key in keys:
        a, b = first.attrs.get(key), ds.attrs.get(key)
        if key in (*WHEN_KNOWN, *GPU_WHEN_KNOWN) and (a in (None, "") or b in (None, "")):
            continue
        if key == "server_env" and str(a) != str(b):  # each variable that differs, named
            changes += env_changes(
                {
                    "server_env": _json(first, key, {}),
                    "server_env_prefixes": first.attrs.get("server_env_prefixes"),
                },
                {
                    "server_env": _json(ds, key, {}),
                    "server_env_prefixes": ds.attrs.get("server_env_prefixes"),
                },
            )
        elif key in _RANGES:
            if _ranges_differ(a, b):
                changes.append(f"{key}: {_source_value(key, a)} -> {_source_value(key, b)}")
        elif str(a) != str(b):
            changes.append(f"{key}: {_short(a)} -> {_short(b)}")
    changes += corpus_changes(_json(first, "corpora", {}), _json(ds, "corpora", {}))
    pinned = set(str(first.attrs.get("arms_pinned", "")).split(",")) & set(
        str(ds.attrs.get("arms_pinned", "")).split(",")
    )
    batches = [int(b) for b in first["batch"].values] if "batch" in first.coords else []
    mine_all, theirs = drafter_servers(first), drafter_servers(ds)
    if across_gpus:
        pinned_kernels = _kernels_pinned(first) and _kernels_pinned(ds)
        mine_all = _gpu_neutral(mine_all, pinned_kernels)
        theirs = _gpu_neutral(theirs, pinned_kernels)
    for drafter, mine in mine_all.items():
        if drafter not in theirs:
            continue
        found = arm_changes(mine, theirs[drafter], batches, pinned - {""})
        found += [c for c in server_changes(mine, theirs[drafter]) if c not in found]
        changes += [f"drafter {drafter!r} {c}" for c in found]
    return changes


def _listed(changes: list[str]) -> str:
    more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
    return "; ".join(changes[:3]) + more


#: Each source cube's provenance a merged cube keeps in `merged_from`, by its GPUs' label.
SOURCE_KEYS = (
    "campaign_name",
    "campaign_hash",
    "campaign_dir",
    "gpu_name",
    "gpu_backend",
    "driver_version",
    "memory_clock_mhz",
    "ecc_mode",
    "vbios_version",
    "twin_profile",
    "engine_version",
    "created",
    "stock_sm_clock_mhz",
    "stock_power_limit_w",
    "actuation",
    "clock",
    "idle_power_w",
    "idle_foreign_processes",
    "idle_from_power_readings",
    "sessions",
    "measurement_method",
    "token_count_method",
    "prompt_format",
    "corpora",
    "server_args",
    "server_env",
    "gpu_pinning",
    "arms_pinned",
    "gpu_count",
    "power_limit_range_w",
    "sm_clock_range_mhz",
    "counter_update_period_s",
)


#: Each source cube's knob axes, as `merged_from` keeps them (`dvfs.analysis.headroom`
#: cuts each GPU of the merge to its own grid by them).
SOURCE_GRIDS = {"sm_clock": "grid_sm_clock_mhz", "power_limit": "grid_power_limit_w"}


def _axis(ds: xr.Dataset, dim: str) -> list[float] | None:
    """A source cube's `dim` axis as a list of numbers; None where it has none."""
    if dim not in ds.coords:
        return None
    return [float(v) for v in np.ravel(ds[dim].values)]


#: The `SOURCE_KEYS` that hold numbers per GPU (or a range): kept as JSON lists.
SOURCE_LISTS = ("power_limit_range_w", "sm_clock_range_mhz", "counter_update_period_s")


def _source_value(key: str, value: Any) -> str | None:
    """A source cube's attribute as `merged_from` keeps it: text; None (JSON null, not the
    text "None") where the source records none; each GPU's counter update period and the
    power-limit range as a JSON list (NaN as null), where `str` would write numpy's
    "[200. 700. 700.]", which no JSON reader parses, and netCDF gives one GPU's period back as
    a number, not a list of one."""
    if value is None:
        return None
    if key in SOURCE_LISTS:
        try:
            numbers = np.atleast_1d(np.asarray(value, dtype=float)).ravel().tolist()
        except (TypeError, ValueError):  # a hand-edited cube's text: kept as it is
            return str(value)
        return json.dumps([v if math.isfinite(v) else None for v in numbers])
    return str(value)


def merge_cubes(cubes: list[xr.Dataset], names: list[str] | None = None) -> xr.Dataset:
    """Cubes from different GPUs as one, along a new `gpu` dimension (its GPU UUIDs); or, when
    every cube is a shard (`attrs["shard"]`), the shards of one run as its whole cube
    (`combine_shards`).

    Refused when a provenance key that must match differs (model, engine, method, schema...)
    or when two cubes come from the same GPU; what SGLang derives from the GPU is compared
    only between cubes of one GPU model (`gpu_name`). Grids may differ: missing cells are NaN.
    """
    import xarray as xr

    from dvfs.provenance import CHECKED, WHEN_KNOWN

    names = names or [f"cube {i + 1}" for i in range(len(cubes))]
    sharded = [label for label, ds in zip(names, cubes, strict=True) if "shard" in ds.attrs]
    if sharded and len(sharded) < len(cubes):
        whole = next(
            label for label, ds in zip(names, cubes, strict=True) if "shard" not in ds.attrs
        )
        raise MergeRefusedError(
            f"cannot merge: {sharded[0]} is a shard but {whole} is not; merge a run's shards "
            "on their own first, then merge the whole cubes of different GPUs"
        )
    if sharded:
        return combine_shards(cubes, names)
    if len(cubes) < 2:
        raise MergeRefusedError("merging needs at least two cubes")
    first = cubes[0]
    for label, ds in zip(names, cubes, strict=True):
        if "gpu" in ds.dims:
            raise MergeRefusedError(f"{label} is already a merged cube; merge the single-GPU cubes")
    _check_one_twin(cubes, names)  # before the provenance: its own advice
    for k, (label, ds) in enumerate(zip(names, cubes, strict=True)):
        if k == 0:
            continue
        for key in CHECKED:
            if key in WHEN_KNOWN:  # with the corpora and servers, below
                continue
            if str(ds.attrs.get(key)) != str(first.attrs.get(key)):
                raise MergeRefusedError(
                    f"cannot merge: {key} differs ({names[0]}: {first.attrs.get(key)!r}, "
                    f"{label}: {ds.attrs.get(key)!r}); cubes must measure the same thing"
                )
        _check_same_workload(first, ds, names[0], label)
        # Compared with each earlier cube, not the first alone: what a cube records only where
        # known (an earlier dvfs's: no engine version...) is compared among every cube that
        # records it. Two runs on one GPU model (two H100s) get the same from SGLang: compared
        # in it all; cubes of two models, not in what SGLang derives from the GPU.
        changes, first_label = [], names[0]
        for other, other_label in zip(cubes[:k], names[:k], strict=True):
            same_model = str(other.attrs.get("gpu_name")) == str(ds.attrs.get("gpu_name"))
            changes = provenance_differences(other, ds, across_gpus=not same_model)
            if changes:
                first_label = other_label
                break
        if changes:
            raise MergeRefusedError(
                f"cannot merge: {first_label} and {label} were not measured alike "
                f"({_listed(changes)}): their GPUs would compare software or prompts too; "
                "measure every GPU with one engine version, flags and server environment, the "
                "same corpora and tokenizer"
            )
    _check_same_traps(cubes, names)  # after the model and campaign: those come first
    labels = [str(ds.attrs.get("gpu_uuids", f"gpu-{i}")) for i, ds in enumerate(cubes)]
    _check_distinct_gpus(labels, names)
    # Which GPUs measured each cell differs per cube: a variable along `gpu` while they join.
    cubes = _told_precision_missed(cubes)  # an older dvfs's cube: its cells' told too
    stripped = [_measured_on_as_variable(ds.drop_attrs(deep=False)) for ds in cubes]
    merged = xr.concat(
        stripped,
        dim="gpu",
        join="outer",
        combine_attrs="drop",
        data_vars="all",
        coords="minimal",
        compat="override",
    )
    merged = merged.assign_coords(gpu=labels)
    # Each variable's attributes from the first cube that has it: a later variable (the
    # intervals, the energy split...) is absent from an older dvfs's cube, which may come first.
    for name in merged.data_vars:
        merged[name].attrs = dict(next(ds[name].attrs for ds in cubes if name in ds.variables))
    for name in merged.coords:
        if name in first.coords:
            merged[name].attrs = dict(first[name].attrs)
    merged["gpu"].attrs.update(units=COORD_ATTRS["gpu"][0], long_name=COORD_ATTRS["gpu"][1])
    _every_flag(merged, cubes)
    shared = (*CHECKED, "Conventions", "corpora", "arms_pinned")
    attrs = {k: first.attrs[k] for k in shared if k in first.attrs}
    attrs.update(_first_known(cubes, WHEN_KNOWN))
    # The campaign file and its folder where every cube was swept from the same (a fleet's
    # run): what its corpora are read again by (the twin's cube fit; the roofline's mean
    # context where cubes of an earlier dvfs record no `prompt_tokens`). A folder alone (two
    # campaign files in it) names no campaign: neither is kept.
    files = {
        (str(ds.attrs.get("campaign_source") or ""), str(ds.attrs.get("campaign_dir") or ""))
        for ds in cubes
    }
    if len(files) == 1 and first.attrs.get("campaign_source"):
        for key in ("campaign_source", "campaign_dir"):
            if first.attrs.get(key):
                attrs[key] = first.attrs[key]
    attrs.pop("arms_on_one_gpu", None)
    paired = _on_one_gpu(cubes)
    if paired is not None:  # not recorded where a cube of an earlier dvfs does not say
        attrs["arms_on_one_gpu"] = paired
    attrs.update(
        title="dvfs merged cube",
        dvfs_version=__version__,
        gpu_names=json.dumps([str(ds.attrs.get("gpu_name")) for ds in cubes]),
        gpu_name=str(first.attrs.get("gpu_name")),
        # Each GPU's cube keeps its own comparisons along `gpu`: the merged arms were paired
        # where every cube's were, and the groups split across GPUs add up.
        groups_across_gpus=sum(int(ds.attrs.get("groups_across_gpus", 0)) for ds in cubes),
        # Each GPU's cube's own provenance: its corpora, token counts, servers, pinning...
        merged_from=json.dumps(
            {
                label: {
                    **{k: _source_value(k, ds.attrs.get(k)) for k in SOURCE_KEYS},
                    # its own grid: the merged axes are the union, where another GPU's
                    # settings are no cells of this one's (its reference is on its own grid)
                    **{key: _axis(ds, dim) for dim, key in SOURCE_GRIDS.items()},
                }
                for label, ds in zip(labels, cubes, strict=True)
            }
        ),
        stock_sm_clock_mhz=max(int(ds.attrs.get("stock_sm_clock_mhz", 0)) for ds in cubes),
        stock_power_limit_w=max(float(ds.attrs.get("stock_power_limit_w", 0)) for ds in cubes),
        campaign=first.attrs.get("campaign", "{}"),
        **{
            key: _each_known(cubes, key)
            for key in ("gpu_backend", "driver_version", "engine_version", "campaign_name")
        },
        server_args=first.attrs.get("server_args", "{}"),
        # Each GPU's ECC mode and VBIOS where its cube read them (GPUs of other cubes may run
        # another mode, or have other boards): each cube's in `merged_from`.
        **{k: v for k in GPU_WHEN_KNOWN if (v := _each_known(cubes, k))},
        **_found_limits(cubes),
        **_enforced_stock(cubes),
        **_idle_foreign(cubes),
        **_idle_readings(cubes),
        **_failed_on_each(cubes, labels),
        history=f"{now_iso()} merged {len(cubes)} cubes by dvfs {__version__}",
        created=now_iso(),
    )
    merged.attrs = attrs
    # Cells absent from one GPU's grid: cell_status 0 (missing), integer flags NaN.
    merged["cell_status"] = merged["cell_status"].fillna(STATUS_MISSING).astype(np.int8)
    if SPLIT_METHOD_VAR in merged.data_vars:  # none in an older dvfs's cube: method 0, none
        merged[SPLIT_METHOD_VAR] = merged[SPLIT_METHOD_VAR].fillna(0).astype(np.int8)
    if MEASURED_ON in merged.data_vars:
        on = merged[MEASURED_ON]
        merged[MEASURED_ON] = on.where(on.notnull(), "").astype(object)
        merged[MEASURED_ON].attrs = dict(MEASURED_ON_ATTRS)
        merged = merged.set_coords(MEASURED_ON)
    return merged


def _told_precision_missed(cubes: list[xr.Dataset]) -> list[xr.Dataset]:
    """The cubes, each with `precision_missed` where any records it: one an earlier dvfs built
    (without it) has it told from its intervals and campaign, else its measured cells would be
    missing there in the merged cube, counted as not measured and never named."""
    from dvfs.cube.precision import PRECISION_MISSED, with_precision_missed

    if not any(PRECISION_MISSED in ds.data_vars for ds in cubes):
        return cubes
    return [with_precision_missed(ds) for ds in cubes]


def _every_flag(merged: xr.Dataset, cubes: list[xr.Dataset]) -> None:
    """The bit flags' `flag_masks` / `flag_meanings` of `merged` list every bit its cells may
    carry: this dvfs's table and each source's (an older dvfs's cube, merged first, lacks the
    bits added since, which another source's cells may carry)."""
    from dvfs.gpu.base import EVENT_NAMES
    from dvfs.measure.meter import QUALITY_FLAGS

    for name, table in (("quality", QUALITY_FLAGS), ("clock_event_reasons", EVENT_NAMES)):
        if name not in merged.data_vars:
            continue
        known: dict[int, str] = {}
        for ds in cubes:
            if name in ds.variables and "flag_masks" in ds[name].attrs:
                masks = np.atleast_1d(ds[name].attrs["flag_masks"])
                meanings = str(ds[name].attrs.get("flag_meanings", "")).split()
                known.update(zip((int(m) for m in masks), meanings, strict=False))
        known.update(table)
        merged[name].attrs.update(
            flag_masks=np.array(sorted(known), dtype=np.int32),
            flag_meanings=" ".join(known[m] for m in sorted(known)),
        )


def _each_known(cubes: list[xr.Dataset], key: str) -> str:
    """The cubes' distinct values of `key`, comma-joined and sorted; those that do not say
    (absent or empty) left out."""
    return ", ".join(sorted({str(ds.attrs.get(key) or "") for ds in cubes} - {""}))


def _first_known(cubes: list[xr.Dataset], keys: Iterable[str]) -> dict[str, Any]:
    """Each of `keys` as the first cube that records it has it (a cube that does not, an older
    dvfs's, would otherwise blank what the others agree on: they were compared where known);
    `server_env` with the prefixes that cube recorded it under."""
    known = {}
    for key in keys:
        ds = next((ds for ds in cubes if ds.attrs.get(key) not in (None, "")), None)
        if ds is not None:
            known[key] = ds.attrs[key]
            if key == "server_env":
                known["server_env_prefixes"] = ds.attrs.get("server_env_prefixes", "")
    return known


def _measured_on_as_variable(ds: xr.Dataset) -> xr.Dataset:
    return ds.reset_coords(MEASURED_ON) if MEASURED_ON in ds.coords else ds


#: What the shards of one run may differ in: which GPUs each ran on (`--gpus` in a job array).
SHARD_MAY_DIFFER = ("gpu.devices", "gpu.groups")


def _parse_shard(ds: xr.Dataset, name: str) -> Shard:
    from dvfs.fleet.shard import cube_shard

    try:
        shard = cube_shard(ds)
    except ValueError as exc:
        raise CubeError(f"cannot merge: {name} has a damaged shard attribute ({exc})") from None
    assert shard is not None  # only shards' cubes come here
    return shard


def _models(ds: xr.Dataset, name: str) -> list[str]:
    """The GPU model of each entry along a shard's `gpu` axis (its fleet mixed models: one
    entry per model, `gpu_names` in the axis's order), else its one model."""
    if "gpu" not in ds.dims:
        return [str(ds.attrs.get("gpu_name"))]
    try:
        models = [str(m) for m in json.loads(str(ds.attrs.get("gpu_names", "")))]
    except (TypeError, ValueError):
        models = []
    if len(models) != ds.sizes["gpu"] or len(set(models)) != len(models):
        raise CubeError(
            f"cannot merge: {name} has a gpu axis without one GPU model per entry (its "
            "gpu_names attribute); merge the folders of the shards' runs"
        )
    return models


def _check_one_twin(cubes: list[xr.Dataset], names: list[str]) -> None:
    """Cubes of two twins (`dvfs.twin.identity`) do not compare, whatever GPU each simulates."""
    from dvfs.twin.identity import mixed_twins

    for key in ("driver_version", "engine_version"):
        mixed = mixed_twins({n: ds.attrs.get(key) for n, ds in zip(names, cubes, strict=True)})
        if mixed:
            raise MergeRefusedError(
                f"cannot merge cubes of two twins ({key}: {mixed}): the twin changed between "
                "them, and cells of two twins do not compare; rerun the older cube's sweep "
                "with --fresh"
            )


def _check_same_traps(cubes: list[xr.Dataset], names: list[str]) -> None:
    """Twin cubes simulating different NVML traps (`twin_profile` `h100-sxm`, every trap,
    against `h200-sxm:none`, none) do not compare: their GPUs would differ in the measurement's
    simulated flaws too, which a fleet refuses (`--gpus h200-sxm:leakage:0` on an
    `h100-sxm:none` campaign). A profile that is no shipped one (lent from a file to `twin
    predict`) is not compared."""
    from dvfs.errors import DvfsError
    from dvfs.twin.profiles import active, gpu_profile

    first: tuple[str, str, tuple[str, ...]] | None = None
    for name, ds in zip(names, cubes, strict=True):
        profile = str(ds.attrs.get("twin_profile") or "")
        if str(ds.attrs.get("gpu_backend")) != "twin" or not profile:
            continue
        try:
            traps = active(gpu_profile(profile))
        except (DvfsError, ValueError):
            continue
        if first is None:
            first = (name, profile, traps)
        elif traps != first[2]:
            shown = [", ".join(t) or "none" for t in (first[2], traps)]
            raise MergeRefusedError(
                f"cannot merge: {first[0]} and {name} simulate different NVML traps (twin "
                f"profiles {first[1]!r}: {shown[0]}; {profile!r}: {shown[1]}): their GPUs "
                "would compare the twin's traps too; sweep every GPU with one trap list "
                "(gpu.profile, or --gpus PROFILE:INDEX with the campaign's)"
            )


def _check_shards(cubes: list[xr.Dataset], names: list[str]) -> None:
    """One clear line for the first reason these cubes (in shard order) are not the shards of
    one run."""
    from dvfs.campaign import measured_differences

    first, first_name = cubes[0], names[0]
    shards = [_parse_shard(ds, name) for ds, name in zip(cubes, names, strict=True)]
    models = _models(first, first_name)
    for k, (ds, name, shard) in enumerate(zip(cubes, names, shards, strict=True)):
        changes = measured_differences(
            _campaign_attr(first, first_name), _campaign_attr(ds, name), ignore=SHARD_MAY_DIFFER
        )
        if changes:
            why = "; ".join(changes[:3])
            raise MergeRefusedError(
                f"cannot merge shards of different campaigns ({first_name} -> {name}: {why}); "
                "every shard must run the same campaign file"
            )
        if shard.deal != shards[0].deal:
            raise MergeRefusedError(
                f"cannot merge: the shards were dealt differently ({first_name}: "
                f"{shards[0].dealt_as}; {name}: {shard.dealt_as}), so their cells are not "
                "shares of one deal; run every shard with one dvfs (the whole array again "
                "with --fresh)"
            )
        if shard.count != shards[0].count:
            raise MergeRefusedError(
                f"cannot merge: {first_name} is shard {shards[0].label} but {name} is shard "
                f"{shard.label}; the shards of one run share their count"
            )
        theirs = _models(ds, name)
        if sorted(theirs) != sorted(models):
            raise MergeRefusedError(
                f"cannot merge: the shards ran on different GPU models ({first_name}: "
                f"{' and '.join(models)}; {name}: {' and '.join(theirs)}); run every shard on "
                "the same models, or the whole campaign once per model and merge those cubes"
            )
        # Each earlier shard, not the first alone: what a shard records only where known (an
        # earlier dvfs's: no ECC mode, VBIOS, engine version...) is compared among every
        # shard that records it, so two later shards that differ there are not merged.
        for other, other_name in zip(cubes[:k], names[:k], strict=True):
            changes = provenance_differences(other, ds, (*SHARD_GPU_KEYS, *SHARED))
            if changes:
                raise MergeRefusedError(
                    f"cannot merge: the shards {other_name} and {name} were not run alike "
                    f"({_listed(changes)}): their cells would compare GPUs, software or "
                    "prompts too; rerun the odd shard with --fresh on GPUs like the others' "
                    "(driver, VBIOS, ECC, power-limit and clock ranges), their engine, server "
                    "environment, corpora and tokenizer"
                )
        for dim in first.dims:
            if dim == "gpu":  # each shard's own GPUs of each model: lined up by model
                continue
            if dim in ds.dims and not np.array_equal(first[dim].values, ds[dim].values):
                raise MergeRefusedError(
                    f"cannot merge: the {dim} axis differs between {first_name} and {name} "
                    "(a stock setting found on another GPU?); shards must share the grid"
                )
    seen: dict[int, str] = {}
    for name, shard in zip(names, shards, strict=True):
        if shard.index in seen:
            raise MergeRefusedError(
                f"cannot merge: shard {shard.label} is given twice ({seen[shard.index]}, {name})"
            )
        seen[shard.index] = name
    count = shards[0].count
    missing = [f"{i}/{count}" for i in range(count) if i not in seen]
    if missing:
        raise MergeRefusedError(
            f"cannot merge: shard(s) {', '.join(missing)} missing; merge all {count} shards of "
            "the run (a shard still running can be merged once it has finished)"
        )


def _joined(labels: Iterable[str]) -> str:
    """Comma-joined GPU UUIDs, each once, in the order first met."""
    values: list[str] = []
    for label in labels:
        for part in str(label).split(","):
            part = part.strip()
            if part and part not in values:
                values.append(part)
    return ",".join(values)


def _lined_up(
    cubes: list[xr.Dataset], names: list[str]
) -> tuple[list[xr.Dataset], list[list[str]]]:
    """Shards whose fleets mixed GPU models (a `gpu` axis, one entry per model), each in the
    first's order of models and under its labels, so that their cells line up; and each
    model's label in each shard (shards on other nodes have other GPUs)."""
    order = _models(cubes[0], names[0])
    lined: list[xr.Dataset] = []
    per_model: list[list[str]] = [[] for _ in order]
    for ds, name in zip(cubes, names, strict=True):
        models = _models(ds, name)
        ds = ds.isel(gpu=[models.index(m) for m in order])
        for labels, label in zip(per_model, ds["gpu"].values, strict=True):
            labels.append(str(label))
        lined.append(ds.assign_coords(gpu=cubes[0]["gpu"].values))
    return lined, per_model


def combine_shards(cubes: list[xr.Dataset], names: list[str] | None = None) -> xr.Dataset:
    """The shards of one run (`dvfs sweep --shard i/n`, every i of one n) as the whole cube.

    Refused, naming the reason, when they measure different campaigns (hash), were dealt
    differently (an earlier dvfs cut contiguous slices), have different counts, repeat or miss
    a shard, ran on different GPU models, or when a cell was measured (or failed) in two of
    them. Shards each run on a fleet mixing models (a `gpu` axis, one entry per model) combine
    per model. Whether the arms of each comparison shared a GPU is worked out for the whole
    (`_pairing`).
    """
    given = names or [f"shard cube {i + 1}" for i in range(len(cubes))]
    # In shard order, whatever the order given: a refusal names the shards as 0/n, 1/n, ...,
    # and the GPU lists and attributes come out the same.
    order = sorted(range(len(cubes)), key=lambda k: _parse_shard(cubes[k], given[k]).index)
    cubes, names = [cubes[k] for k in order], [given[k] for k in order]
    _check_one_twin(cubes, names)  # before the shards' provenance: its own advice
    _check_shards(cubes, names)
    sources, per_model = cubes, None
    if "gpu" in cubes[0].dims:  # each shard ran a fleet mixing GPU models
        cubes, per_model = _lined_up(cubes, names)
    cubes = _told_precision_missed(cubes)  # an older dvfs's shard: its cells' told too
    first = cubes[0]
    combined = first.copy(deep=True)
    status = combined["cell_status"].values
    owner = np.full(status.shape, -1)
    owner[status != STATUS_MISSING] = 0
    # Every shard's cell variables: a shard an older dvfs wrote lacks the later ones (the
    # intervals, the energy split...), whichever shard it is; its cells hold none of them.
    cell_vars = list(
        dict.fromkeys(
            n
            for ds in cubes
            for n in ds.data_vars
            if set(ds["cell_status"].dims) <= set(ds[n].dims)
        )
    )
    for name in cell_vars:
        if name not in combined.data_vars:  # none in the first shard: as its missing cells
            template = next(ds[name] for ds in cubes if name in ds.data_vars)
            none = 0 if name == SPLIT_METHOD_VAR else np.nan
            combined[name] = template.copy(data=np.full(template.shape, none, template.dtype))
    told = [ds["attention_backend"] for ds in cubes if "attention_backend" in ds.data_vars]
    if told and "attention_backend" not in combined.data_vars:  # an older first shard: unsaid
        combined["attention_backend"] = told[0].copy(data=np.full(told[0].shape, "", object))
    for k, ds in enumerate(cubes[1:], start=1):
        here = ds["cell_status"].values != STATUS_MISSING
        both = here & (owner >= 0)
        if both.any():
            at = tuple(int(i[0]) for i in np.nonzero(both))
            cell = {
                d: combined[d].values[i].item()
                for d, i in zip(ds["cell_status"].dims, at, strict=True)
            }
            raise MergeRefusedError(
                f"cannot merge: cell {cell} is in both {names[int(owner[at])]} and {names[k]}; "
                "the shards of one run never overlap, so a shard holds cells of another run "
                "(rerun it with --fresh)"
            )
        owner[here] = k
        if MEASURED_ON in combined.coords and MEASURED_ON in ds.coords:
            on = np.where(here, ds[MEASURED_ON].values, combined[MEASURED_ON].values)
            combined = combined.assign_coords(
                {MEASURED_ON: (ds[MEASURED_ON].dims, on.astype(object), dict(MEASURED_ON_ATTRS))}
            )
        for name in cell_vars:
            if name in ds.data_vars:  # else its cells stay as they are: missing until here
                mask = ds["cell_status"] != STATUS_MISSING
                combined[name] = combined[name].where(~mask, ds[name])
        if "attention_backend" in ds:
            mine = combined["attention_backend"].values.astype(object)
            theirs = ds["attention_backend"].values.astype(object)
            combined["attention_backend"] = (
                combined["attention_backend"].dims,
                np.where(mine == "", theirs, mine).astype(str),
                dict(told[0].attrs),
            )
    for name in cell_vars:
        holder = next(ds for ds in cubes if name in ds.data_vars)
        combined[name].attrs = dict(holder[name].attrs)
        combined[name].encoding = dict(holder[name].encoding)
    combined["cell_status"] = combined["cell_status"].astype(np.int8)
    _every_flag(combined, cubes)
    combined.attrs = _combined_attrs(cubes, names)
    combined.attrs.pop("arms_on_one_gpu", None)  # the whole run's, where every shard says
    combined.attrs.update(_pairing(combined, cubes, owner))
    if per_model is not None:
        combined = _relabel_gpus(combined, sources, per_model)
    return combined


def _relabel_gpus(
    combined: xr.Dataset, shards: list[xr.Dataset], per_model: list[list[str]]
) -> xr.Dataset:
    """The combined cube of fleets mixing models labelled with each model's GPUs in all the
    shards (`per_model`: each model's label in each shard), and its `merged_from` (where
    `single_gpu` finds a GPU's stock setting) keyed by those labels, from the first shard."""
    labels = [_joined(labels) for labels in per_model]
    merged_from: dict[str, Any] = {}
    for label, theirs in zip(labels, per_model, strict=True):
        found = [
            source
            for ds, own in zip(shards, theirs, strict=True)
            if (source := json.loads(str(ds.attrs.get("merged_from", "{}")) or "{}").get(own))
            is not None
        ]
        if found:
            merged_from[label] = {
                **found[0],
                **_any_readings(found),
                **_mean_idle(found),
                **_every_tenant(found),
                **_every_session(found),
            }
    attrs = dict(combined["gpu"].attrs)
    combined = combined.assign_coords(gpu=labels)
    combined["gpu"].attrs = attrs
    combined.attrs["merged_from"] = json.dumps(merged_from)
    return combined


def _mean_idle(sources: list[dict[str, Any]]) -> dict[str, str]:
    """A model's `idle_power_w` over its sources in every shard: their mean, as the shards of
    one model combine (the first shard's alone was said for every shard's GPUs of the model);
    nothing where none records one (the first shard's kept)."""
    idle = []
    for source in sources:
        try:
            idle.append(float(str(source.get("idle_power_w"))))
        except ValueError:  # "None": a source that recorded none
            continue
    measured = [w for w in idle if math.isfinite(w)]
    return {"idle_power_w": str(float(np.mean(measured)))} if measured else {}


def _every_tenant(sources: list[dict[str, Any]]) -> dict[str, str]:
    """A model's `idle_foreign_processes` over its sources in every shard, together: another
    shard's tenants, seen around its opening idle (whose work its idle counts), were lost
    with the first shard's alone; nothing where no source records them (an older dvfs)."""
    seen: list[Any] = []
    known = False
    for source in sources:
        try:
            listed = json.loads(str(source.get("idle_foreign_processes")))
        except ValueError:  # "None": not recorded
            continue
        if isinstance(listed, list):
            known = True
            seen.extend(listed)
    return {"idle_foreign_processes": json.dumps(seen)} if known else {}


def _every_session(sources: list[dict[str, Any]]) -> dict[str, str | None]:
    """A model's `sessions` over its sources in every shard: their sum (the first shard's
    alone was counted for the whole run); None where a source records none (an older dvfs)."""
    try:
        counts = [int(str(source.get("sessions"))) for source in sources]
    except ValueError:  # "None": a shard that recorded none, so the whole run's is not known
        return {"sessions": None}
    return {"sessions": str(sum(counts))}


def _any_readings(sources: list[dict[str, Any]]) -> dict[str, str]:
    """A model's `idle_from_power_readings` over its sources in every shard: "1" where any
    shard's opening idle came from the instant power readings (the first shard's alone hid
    another's), else "0"; nothing where no source records it (an older dvfs)."""
    said = [s.get("idle_from_power_readings") for s in sources]
    known = [str(v) for v in said if v not in (None, "None", "")]
    if not known:
        return {}
    try:
        return {"idle_from_power_readings": str(int(any(int(float(v)) for v in known)))}
    except ValueError:  # a hand-edited cube's text: the first shard's kept
        return {}


def _on_one_gpu(cubes: list[xr.Dataset], split: bool = False) -> int | None:
    """The merged `arms_on_one_gpu`: 0 where a cube's arms were not kept to one GPU (or
    `split`: a comparison group's cells are in two cubes), 1 where every cube's were, None
    (not recorded) where a cube of a dvfs before the attribute does not say."""
    recorded = [ds.attrs.get("arms_on_one_gpu") for ds in cubes]
    if split or any(value is not None and int(value) != 1 for value in recorded):
        return 0
    return None if any(value is None for value in recorded) else 1


def _pairing(combined: xr.Dataset, cubes: list[xr.Dataset], owner: np.ndarray) -> dict[str, int]:
    """The whole run's `arms_on_one_gpu` and `groups_across_gpus`, not the first shard's: the
    arms were paired when every shard paired its own and no comparison group (batch, corpus,
    repeat) has cells from two shards (shards on other GPUs; `owner` is each cell's shard, -1
    none), and the groups whose valid cells span GPU groups are counted over all the cells.
    Shards of fleets mixing GPU models hold each model's comparisons apart along `gpu`: a
    group is counted in each model's slice, never as split between models."""
    from dvfs.cube.build import groups_across_gpus
    from dvfs.cube.schema import CELL_DIMS

    dims = combined["cell_status"].dims
    keep = [dims.index(d) for d in ("gpu", "batch", "corpus", "repeat") if d in dims]
    by_group = np.moveaxis(owner, keep, range(len(keep)))
    by_group = by_group.reshape(math.prod(by_group.shape[: len(keep)]), -1)  # a row per group
    split = any(np.unique(cells[cells >= 0]).size > 1 for cells in by_group)
    paired = _on_one_gpu(cubes, split)
    if MEASURED_ON in combined.coords:
        models = (
            [combined.isel(gpu=i) for i in range(combined.sizes["gpu"])]
            if "gpu" in combined.dims
            else [combined]
        )
        across = sum(
            groups_across_gpus(
                *(
                    one[n].transpose(*CELL_DIMS).values
                    for n in (MEASURED_ON, "cell_status", "valid")
                )
            )
            for one in models
        )
    else:  # a cube from before measured_on: each shard's own count
        across = sum(int(ds.attrs.get("groups_across_gpus", 0)) for ds in cubes)
    if paired is None:  # a cube of an earlier dvfs: not recorded (the caller drops it)
        return {"groups_across_gpus": across}
    return {"arms_on_one_gpu": paired, "groups_across_gpus": across}


def _failed_on_each(cubes: list[xr.Dataset], labels: list[str]) -> dict[str, str]:
    """The cubes' failed cells, each with its error and the GPUs (`labels`) it failed on, as
    `dvfs cube info` and the report list them (absent where no cube records any)."""
    if not any("failed_cells" in ds.attrs for ds in cubes):
        return {}
    failed = [
        {**item, "gpu": label}
        for label, ds in zip(labels, cubes, strict=True)
        for item in _json(ds, "failed_cells", [])
        if isinstance(item, dict)
    ]
    return {"failed_cells": json.dumps(capped_failed(failed))}


def _found_limits(cubes: list[xr.Dataset]) -> dict[str, Any]:
    """`power_limit_found_w` (and `power_limit_found_gpus`, by GPU) of the merged cube: every
    source's caps dvfs applied that it found at start and lifted to measure stock, each once
    (as a sweep's sessions'), with the GPU each was found on where the source names it;
    nothing where no source lifted one. Else a merge of a capped GPU's cube with others said
    its stock limit was "as found at start", or a shard merge kept the first shard's alone."""
    from dvfs.cube.attrs import gpu_uuids
    from dvfs.cube.knobs import lifted_caps_by_gpu, lifted_caps_w

    found: list[tuple[str, float]] = []
    for ds in cubes:
        by_gpu = lifted_caps_by_gpu(ds)
        found.extend((uuid, w) for uuid, caps in by_gpu.items() for w in caps)
        named = {w for caps in by_gpu.values() for w in caps}
        # An earlier dvfs's cube did not say which GPU found its caps: one GPU's are that
        # GPU's (else another source's GPU lifting the same watts took them for its own alone).
        own = gpu_uuids(ds)
        gpu = own[0] if len(own) == 1 else ""
        found.extend((gpu, w) for w in lifted_caps_w(ds) if w not in named)
    return found_limits_attrs(found)


def _enforced_stock(cubes: list[xr.Dataset]) -> dict[str, str]:
    """`stock_power_limit_enforced` of the merged cube: every source's GPUs whose power limit
    NVML does not support, whose stock limit is the one enforced, each once; nothing where no
    source names one. Else a merge dropped them (and a shard merge kept the first shard's
    alone), and `cube info` and the report said such a GPU's stock limit was "as found at
    start", a configured limit NVML never read."""
    uuids = [
        u
        for ds in cubes
        for u in str(ds.attrs.get("stock_power_limit_enforced") or "").split(",")
        if u
    ]
    return {"stock_power_limit_enforced": ",".join(dict.fromkeys(uuids))} if uuids else {}


def _idle_readings(cubes: list[xr.Dataset]) -> dict[str, int]:
    """1 where a cube's opening idle measurement is the mean of the instant power readings
    (`idle_from_power_readings`), else 0; absent where no cube records it (an older dvfs)."""
    if not any("idle_from_power_readings" in ds.attrs for ds in cubes):
        return {}
    return {
        "idle_from_power_readings": int(
            any(int(ds.attrs.get("idle_from_power_readings") or 0) for ds in cubes)
        )
    }


def _idle_foreign(cubes: list[xr.Dataset]) -> dict[str, str]:
    """The cubes' `idle_foreign_processes`, together (absent where none records them)."""
    if not any("idle_foreign_processes" in ds.attrs for ds in cubes):
        return {}
    seen = [p for ds in cubes for p in _json(ds, "idle_foreign_processes", [])]
    return {"idle_foreign_processes": json.dumps(seen)}


def _combined_attrs(cubes: list[xr.Dataset], names: list[str]) -> dict[str, Any]:
    """The whole run's attributes: the first shard's, with what each shard adds (GPUs, server
    arguments, failed cells, sessions) gathered. Shards of fleets mixing models carry only
    what their merged cubes carry (no single GPU list, idle power or session count)."""
    from dvfs.fleet.shard import DEAL_ATTR, SHARD_ATTR
    from dvfs.provenance import WHEN_KNOWN

    first = cubes[0]
    attrs = {k: v for k, v in first.attrs.items() if k not in (SHARD_ATTR, DEAL_ATTR)}
    servers: dict[str, Any] = {}
    failed: list[Any] = []
    pinning: dict[str, list[str]] = {}  # per drafter, each shard's distinct outcome
    for ds in cubes:
        # The first shard's server of each drafter (the shards' compare: `_check_shards`);
        # each shard's own in `shard_provenance`.
        for drafter, server in _json(ds, "server_args", {}).items():
            servers.setdefault(drafter, server)
        failed.extend(json.loads(str(ds.attrs.get("failed_cells", "[]")) or "[]"))
        for drafter, outcome in json.loads(str(ds.attrs.get("gpu_pinning", "{}")) or "{}").items():
            seen = pinning.setdefault(drafter, [])
            if outcome not in seen:
                seen.append(outcome)
    if pinning:
        attrs["gpu_pinning"] = json.dumps(
            {drafter: "; ".join(outcomes) for drafter, outcomes in pinning.items()}, sort_keys=True
        )
    attrs.update(_first_known(cubes, (*WHEN_KNOWN, *GPU_WHEN_KNOWN)))
    attrs.update(
        engine_version=_each_known(cubes, "engine_version"),
        server_args=json.dumps(servers, sort_keys=True),
        combined_from=json.dumps(
            {name: str(ds.attrs.get(SHARD_ATTR)) for name, ds in zip(names, cubes, strict=True)}
        ),
        # Each shard's own provenance (its GPUs, driver, servers, corpora...), by its name.
        shard_provenance=json.dumps(
            {
                name: {k: _source_value(k, ds.attrs.get(k)) for k in ("gpu_uuids", *SOURCE_KEYS)}
                for name, ds in zip(names, cubes, strict=True)
            }
        ),
        history=f"{now_iso()} {len(cubes)} shards combined by dvfs {__version__}",
        created=now_iso(),
    )
    uuids = _joined(str(ds.attrs.get("gpu_uuids", "")) for ds in cubes)
    if "gpu_uuids" in first.attrs:
        attrs["gpu_uuids"] = uuids
    if "gpu_count" in first.attrs and uuids:  # the GPUs every shard's cells ran on, as a sweep
        attrs["gpu_count"] = len(uuids.split(","))  # on a fleet counts its workers' (not one's)
    if "idle_power_w" in first.attrs:  # the shards' mean; NaN where none measured one
        idle = [float(ds.attrs.get("idle_power_w", math.nan)) for ds in cubes]
        measured = [w for w in idle if math.isfinite(w)]
        attrs["idle_power_w"] = float(np.mean(measured)) if measured else math.nan
    attrs.update(_idle_foreign(cubes))
    attrs.update(_idle_readings(cubes))
    attrs.pop("power_limit_found_w", None)  # the first shard's: each shard's now
    attrs.pop("power_limit_found_gpus", None)
    attrs.update(_found_limits(cubes))
    attrs.pop("stock_power_limit_enforced", None)  # the first shard's: each shard's now
    attrs.update(_enforced_stock(cubes))
    attrs.pop("sessions", None)
    if all("sessions" in ds.attrs for ds in cubes):  # a shard an older dvfs wrote: not known
        attrs["sessions"] = sum(int(ds.attrs["sessions"]) for ds in cubes)
    if "failed_cells" in first.attrs:
        attrs["failed_cells"] = json.dumps(failed)
    if "counter_update_period_s" in first.attrs:  # per GPU, in the order of gpu_uuids
        period: dict[str, float] = {}
        for ds in cubes:
            own = [u for u in str(ds.attrs.get("gpu_uuids", "")).split(",") if u]
            values = np.atleast_1d(ds.attrs.get("counter_update_period_s", [])).tolist()
            for uuid, value in zip(own, values, strict=False):
                period.setdefault(uuid, float(value))
        attrs["counter_update_period_s"] = [period.get(u, np.nan) for u in uuids.split(",")]
    return attrs
