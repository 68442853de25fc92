"""Hand-built cubes for known-answer tests of the analyses (same schema as dvfs sweeps)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xarray as xr

from dvfs.cube import CELL_DIMS
from dvfs.measure.meter import QUANTILES


def make_cube(
    *,
    clocks: list[int],
    limits: list[float] | None = None,
    batches: list[int] | None = None,
    drafters: list[str] | None = None,
    corpora: list[str] | None = None,
    repeats: int = 1,
    latency: Callable[..., float] | np.ndarray | None = None,
    energy: Callable[..., float] | np.ndarray | None = None,
    valid: Callable[..., bool] | None = None,
    power_max: Callable[..., float] | None = None,
    quality: Callable[..., int] | None = None,
    stock_clock: int | None = None,
    stock_limit: float | None = None,
) -> xr.Dataset:
    """A cube whose TPOT/ITL/TTFT (all quantiles) and energy come from the given functions.

    Functions take (sm_clock, power_limit, batch, drafter, corpus, repeat) and return a value;
    NaN means a missing cell. `power_max` (peak power, W) and `quality` (flag bits) are left
    out of the cube unless given, as in a cube that does not record them.
    """
    limits = limits or [700.0]
    batches = batches or [1]
    drafters = drafters or ["none"]
    corpora = corpora or ["code"]
    coords = {
        "sm_clock": clocks,
        "power_limit": limits,
        "batch": batches,
        "drafter": drafters,
        "corpus": corpora,
        "repeat": list(range(repeats)),
    }
    shape = tuple(len(coords[d]) for d in CELL_DIMS)

    def fill(source) -> np.ndarray:
        if isinstance(source, np.ndarray):
            return source.reshape(shape).astype(float)
        out = np.empty(shape)
        for idx in np.ndindex(shape):
            args = [coords[d][i] for d, i in zip(CELL_DIMS, idx, strict=True)]
            out[idx] = source(*args)
        return out

    # (`is None`, not `or`: an array given has no truth value)
    lat = fill((lambda *a: 10.0) if latency is None else latency)
    en = fill((lambda *a: 1.0) if energy is None else energy)
    ok = fill((lambda *a: True) if valid is None else valid)
    status = np.where(np.isnan(lat) | np.isnan(en), 0, 1).astype(np.int8)
    ok = np.where(status == 1, ok, np.nan)
    q = np.stack([lat] * len(QUANTILES), axis=-1)
    ds = xr.Dataset(
        {
            "tpot_ms": ((*CELL_DIMS, "quantile"), q),
            "itl_ms": ((*CELL_DIMS, "quantile"), q),
            "ttft_ms": ((*CELL_DIMS, "quantile"), q * 10),
            "energy_per_token_j": (CELL_DIMS, en),
            "valid": (CELL_DIMS, ok),
            "cell_status": (CELL_DIMS, status),
            "accept_length": (CELL_DIMS, np.full(shape, np.nan)),
        },
        coords={**coords, "quantile": list(QUANTILES)},
        attrs={
            "dvfs_schema": 1,
            "stock_sm_clock_mhz": stock_clock if stock_clock is not None else max(clocks),
            "stock_power_limit_w": stock_limit if stock_limit is not None else max(limits),
        },
    )
    if power_max is not None:
        ds["power_max_w"] = (CELL_DIMS, fill(power_max))
    if quality is not None:
        ds["quality"] = (CELL_DIMS, fill(quality))
    return ds


def as_twin_sweep(ds: xr.Dataset, *, uuid: str, gpu_name: str, campaign: str) -> xr.Dataset:
    """`ds` with the attributes a one-GPU twin sweep's cube carries (its GPU, model, engine and
    campaign), so that `cube merge`, headroom documents and caps read it as one."""
    import json

    ds.attrs.update(
        gpu_uuids=uuid,
        gpu_name=gpu_name,
        gpu_backend="twin",
        model="m",
        engine_backend="twin",
        tp_size=1,
        measurement_method="x",
        campaign=json.dumps({"name": campaign, "workload": {"batch": [1]}}),
    )
    return ds


def one_usable_stock_repeat_cube() -> xr.Dataset:
    """Three clocks and three repeats, TPOT 10 ms x 2000 MHz / clock (20, 13.3 and 10 ms:
    1500 MHz meets a 16 ms target) and energy 0.5 + (clock / 2000)^2 J, only the first repeat
    at stock (2000 MHz) usable: an answer to `--slo tpot_p50<=16ms` whose saving is unknown."""
    return make_cube(
        clocks=[1000, 1500, 2000],
        repeats=3,
        latency=lambda c, *_: 10.0 * 2000 / c,
        energy=lambda c, *_: 0.5 + (c / 2000) ** 2,
        valid=lambda c, p, b, d, k, r: not (c == 2000 and r >= 1),
    )
