"""Speculation against no speculation: at equal clock, at equal latency, and where it stops paying.

Every drafter's energy per token is compared with the baseline drafter's (no speculation):
  * at equal clock: both at the same knob setting;
  * at equal latency: each at its least-energy setting whose latency stays within the
    baseline's stock latency (the baseline itself may also move its clock to get there);
  * the break-even batch: the smallest measured batch at which the drafter no longer saves
    energy (NaN: no batch where it was compared and stopped saving), with a one-line summary
    of what happened at every batch: it saves at every batch, saves up to or from a batch,
    never saves, or was never within the baseline's latency (or never measured) at all. NaN
    alone cannot tell "saves everywhere" from "never got there", so read the summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dvfs.analysis.headroom import (
    gpu_set,
    gpu_text,
    headroom,
    measured_on,
    reference_per_gpu,
    reference_setting,
    valid_mask,
)
from dvfs.analysis.targets import Target
from dvfs.errors import AnalysisError

if TYPE_CHECKING:
    import xarray as xr


SAVES, LOSES, NOT_WITHIN, NO_DATA = "saves", "loses", "not within target", "no data"


def _batches(values: Sequence[int]) -> str:
    return ("batch " if len(values) == 1 else "batches ") + ", ".join(str(v) for v in values)


def break_even_summary(states: Sequence[tuple[int, str]]) -> str:
    """What a drafter did across batches, in words: `states` pairs each batch with SAVES,
    LOSES (energy per token at or above the baseline's), NOT_WITHIN (no setting met the
    baseline's latency) or NO_DATA (nothing valid measured).

    "saves at every batch", "saves up to batch 16", "saves from batch 32", "never saves",
    "never within target", "no data", or the batches where it saves, followed by the batches
    that could not be compared and why.
    """
    ordered = sorted(states)
    of = {kind: [b for b, s in ordered if s == kind] for kind in (SAVES, LOSES, NOT_WITHIN)}
    missing = [b for b, s in ordered if s == NO_DATA]
    saves, loses, slow = of[SAVES], of[LOSES], of[NOT_WITHIN]
    if not saves and not loses:
        if not slow:
            return NO_DATA
        head, slow = "never within target", []
    elif not saves:
        head = "never saves"
    elif not loses and not slow and not missing:
        return "saves at every batch"
    elif not loses:
        head = f"saves at {_batches(saves)}"
    elif max(saves) < min(loses):
        head = f"saves up to batch {max(saves)}"
    elif max(loses) < min(saves):
        head = f"saves from batch {min(saves)}"
    else:
        head = f"saves at {_batches(saves)}"
    parts = [head]
    if slow:
        parts.append(f"not within target at {_batches(slow)}")
    if missing:
        parts.append(f"no data at {_batches(missing)}")
    return "; ".join(parts)


def compare(
    cube: xr.Dataset,
    *,
    baseline: str = "none",
    metric: str = "tpot",
    quantile: float = 0.5,
    confidence: float = 0.95,
) -> xr.Dataset:
    """Energy of each drafter relative to `baseline`, per batch and corpus."""
    import xarray as xr

    if "gpu" in cube.dims:  # merged cube: each GPU against its own stock setting
        from dvfs.analysis.headroom import single_gpu

        parts = [
            compare(
                single_gpu(cube, g),
                baseline=baseline,
                metric=metric,
                quantile=quantile,
                confidence=confidence,
            )
            for g in cube["gpu"].values
        ]
        merged = xr.concat(parts, dim="gpu", join="outer", combine_attrs="drop_conflicts")
        merged.attrs["reference_per_gpu"] = reference_per_gpu(cube["gpu"].values, parts)
        return merged.assign_coords(gpu=cube["gpu"].values)
    drafters = [str(d) for d in cube["drafter"].values]
    if baseline not in drafters:
        raise AnalysisError(
            f"baseline drafter {baseline!r} is not in the cube (drafters: {', '.join(drafters)})"
        )
    if drafters == [baseline]:
        raise AnalysisError(
            f"the cube has no drafter besides the baseline {baseline!r}: nothing to compare; "
            "sweep a speculative drafter too, or pick another --baseline"
        )
    ref = reference_setting(cube)
    energy = cube["energy_per_token_j"].where(valid_mask(cube)).mean("repeat")
    base_energy = energy.sel(drafter=baseline, drop=True)
    ratio_clock = energy / base_energy
    ratio_clock.attrs = {
        "units": "1",
        "long_name": "energy per token over the baseline's, same setting",
    }
    at_stock = ratio_clock.sel(sm_clock=ref.sm_clock, power_limit=ref.power_limit, drop=True)

    drafter_best = headroom(
        cube,
        target=Target("vs-baseline", metric, quantile, baseline=baseline),
        confidence=confidence,
    )
    baseline_best = headroom(
        cube, target=Target("preserve", metric, quantile), confidence=confidence
    )
    base_best_energy = baseline_best["chosen_energy_per_token_j"].sel(drafter=baseline, drop=True)
    ratio_latency = drafter_best["chosen_energy_per_token_j"] / base_best_energy
    ratio_latency.attrs = {
        "units": "1",
        "long_name": "least energy per token within the baseline's stock latency, over the "
        "baseline's least energy within the same latency",
    }

    def break_even(ratio: xr.DataArray) -> xr.DataArray:
        batches = ratio["batch"].values
        values = ratio.transpose(..., "batch").values
        out = np.full(values.shape[:-1], np.nan)
        for idx in np.ndindex(values.shape[:-1]):
            row = values[idx]
            losing = np.where(row >= 1.0)[0]
            if len(losing):
                out[idx] = batches[losing[0]]
        dims = [d for d in ratio.transpose(..., "batch").dims if d != "batch"]
        return xr.DataArray(out, dims=dims, coords={d: ratio[d].values for d in dims})

    def summary(ratio: xr.DataArray, not_within: xr.DataArray | None) -> xr.DataArray:
        order = ("drafter", "corpus", "batch")
        values = ratio.transpose(*order).values
        slow = None if not_within is None else not_within.transpose(*order).values
        batches = [int(b) for b in ratio["batch"].values]
        out = np.empty(values.shape[:-1], dtype=object)
        for idx in np.ndindex(out.shape):
            states = []
            for k, batch in enumerate(batches):
                value = values[idx + (k,)]
                if np.isfinite(value):
                    state = SAVES if value < 1.0 else LOSES
                else:
                    state = NOT_WITHIN if slow is not None and slow[idx + (k,)] else NO_DATA
                states.append((batch, state))
            out[idx] = break_even_summary(states)
        return xr.DataArray(out, dims=order[:-1], coords={d: ratio[d].values for d in order[:-1]})

    # Equal latency is undefined either because no setting of the drafter met the baseline's
    # stock latency (not within target) or because there was nothing valid to compare.
    measured = valid_mask(cube).any(["sm_clock", "power_limit", "repeat"])
    not_within = (
        ~drafter_best["feasible"].astype(bool)
        & measured
        & np.isfinite(drafter_best["reference_latency_ms"])
        & np.isfinite(base_best_energy)
    )

    on_text, different = arms_gpus(cube, baseline)
    accept = cube["accept_length"].where(valid_mask(cube)) if "accept_length" in cube else None
    data = {
        "energy_ratio_at_stock": at_stock.assign_attrs(
            units="1", long_name="energy per token over the baseline's, both at the stock setting"
        ),
        "energy_ratio_equal_clock": ratio_clock,
        "energy_ratio_equal_latency": ratio_latency,
        "break_even_batch_equal_clock": break_even(at_stock).assign_attrs(
            units="1",
            long_name="smallest batch where the drafter stops saving energy (stock); NaN: none, "
            "see break_even_equal_clock",
        ),
        "break_even_batch_equal_latency": break_even(ratio_latency).assign_attrs(
            units="1",
            long_name="smallest batch where the drafter stops saving energy (equal latency); "
            "NaN: none, see break_even_equal_latency",
        ),
        "break_even_equal_clock": summary(at_stock, None).assign_attrs(
            long_name="where the drafter saves energy against the baseline, same setting"
        ),
        "break_even_equal_latency": summary(ratio_latency, not_within).assign_attrs(
            long_name="where the drafter saves energy against the baseline, equal latency"
        ),
        "energy_per_token_at_stock_j": energy.sel(
            sm_clock=ref.sm_clock, power_limit=ref.power_limit, drop=True
        ).assign_attrs(units="J", long_name="energy per token at the reference setting"),
        "measured_on": on_text,
        "different_gpus": different,
    }
    if accept is not None:
        data["accept_length"] = accept.mean(
            [d for d in accept.dims if d not in ("drafter", "corpus", "gpu")]
        ).assign_attrs(units="1", long_name="mean accept length (tokens per verify pass)")
    # Arrays taken from the headroom results carry its `measured_on` coordinates (the GPUs
    # of a chosen setting): dropped, so `measured_on` here is the arms' own (`arms_gpus`).
    result = xr.Dataset(
        {
            name: value.drop_vars(["measured_on", "reference_measured_on"], errors="ignore")
            for name, value in data.items()
        }
    )
    result.attrs.update(
        baseline=baseline,
        latency=f"{metric.upper()} p{int(quantile * 100)}",
        reference_sm_clock_mhz=ref.sm_clock,
        reference_power_limit_w=ref.power_limit,
        reference_is_stock=int(ref.is_stock),
        stock_sm_clock_mhz=ref.stock_sm_clock if ref.stock_sm_clock is not None else ref.sm_clock,
        stock_power_limit_w=(
            ref.stock_power_limit if ref.stock_power_limit is not None else ref.power_limit
        ),
    )
    return result


def arms_gpus(cube: xr.Dataset, baseline: str) -> tuple[xr.DataArray, xr.DataArray]:
    """Per (batch, drafter, corpus): the GPUs that measured the drafter's valid cells
    (comma-joined), and whether they differ from those that measured the baseline's at the
    same batch and corpus: then GPU-to-GPU spread is part of every ratio between the two."""
    import xarray as xr

    order = ("batch", "drafter", "corpus", "sm_clock", "power_limit", "repeat")
    labels = measured_on(cube).transpose(*order).values
    ok = valid_mask(cube).transpose(*order).values
    drafters = [str(d) for d in cube["drafter"].values]
    b = drafters.index(baseline)
    shape = labels.shape[:3]
    text = np.full(shape, "", dtype=object)
    different = np.zeros(shape, dtype=bool)
    for idx in np.ndindex(shape):
        mine = gpu_set(labels[idx], ok[idx])
        theirs = gpu_set(labels[idx[0], b, idx[2]], ok[idx[0], b, idx[2]])
        text[idx] = gpu_text(mine)
        different[idx] = bool(mine) and bool(theirs) and mine != theirs
    coords = {d: cube[d].values for d in order[:3]}
    return (
        xr.DataArray(
            text,
            dims=order[:3],
            coords=coords,
            attrs={"units": "1", "long_name": "GPUs that measured the drafter's valid cells"},
        ),
        xr.DataArray(
            different,
            dims=order[:3],
            coords=coords,
            attrs={
                "units": "1",
                "long_name": "the drafter and the baseline were measured on different GPUs",
            },
        ),
    )
