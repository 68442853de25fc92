"""Speculation against no speculation: at equal clock, at equal latency, and where it stops paying.

Every drafter's energy per token is compared with the baseline drafter's (no speculation):
  * at equal clock: both at the same knob setting;
  * at equal latency: each at its least-energy setting whose latency stays within the
    baseline's stock latency (the baseline itself may also move its clock to get there);
  * the break-even batch: the smallest measured batch at which the drafter no longer saves
    energy at the stock setting (NaN: it saves at every batch measured).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dvfs.analysis.headroom import _valid_mask, headroom, reference_setting
from dvfs.analysis.targets import Target
from dvfs.errors import AnalysisError

if TYPE_CHECKING:
    import xarray as xr


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
        return merged.assign_coords(gpu=cube["gpu"].values)
    drafters = [str(d) for d in cube["drafter"].values]
    if baseline not in drafters:
        raise AnalysisError(
            f"baseline drafter {baseline!r} is not in the cube (drafters: {', '.join(drafters)})"
        )
    ref = reference_setting(cube)
    energy = cube["energy_per_token_j"].where(_valid_mask(cube)).mean("repeat")
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

    accept = cube["accept_length"].where(_valid_mask(cube)) if "accept_length" in cube else None
    data = {
        "energy_ratio_at_stock": at_stock.assign_attrs(
            units="1", long_name="energy per token over the baseline's, both at the stock setting"
        ),
        "energy_ratio_equal_clock": ratio_clock,
        "energy_ratio_equal_latency": ratio_latency,
        "break_even_batch_equal_clock": break_even(at_stock).assign_attrs(
            units="1", long_name="smallest batch where the drafter stops saving energy (stock)"
        ),
        "break_even_batch_equal_latency": break_even(ratio_latency).assign_attrs(
            units="1",
            long_name="smallest batch where the drafter stops saving energy (equal latency)",
        ),
        "energy_per_token_at_stock_j": energy.sel(
            sm_clock=ref.sm_clock, power_limit=ref.power_limit, drop=True
        ).assign_attrs(units="J", long_name="energy per token at the stock setting"),
    }
    if accept is not None:
        data["accept_length"] = accept.mean(
            [d for d in accept.dims if d not in ("drafter", "corpus", "gpu")]
        ).assign_attrs(units="1", long_name="mean accept length (tokens per verify pass)")
    result = xr.Dataset(data)
    result.attrs.update(
        baseline=baseline,
        latency=f"{metric.upper()} p{int(quantile * 100)}",
        reference_sm_clock_mhz=ref.sm_clock,
        reference_power_limit_w=ref.power_limit,
    )
    return result
