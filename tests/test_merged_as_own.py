"""Each GPU of a merged cube answers as its own cube does: the merge only puts the GPUs side
by side. A campaign that leaves the power limit at stock, on GPUs whose stock limits differ,
gives a merged axis of every GPU's stock limit, one of them in each GPU's grid; the others
are no settings of that GPU, neither swept nor waiting to be measured."""

from __future__ import annotations

import json
import math

import numpy as np
import xarray as xr
from cubes import as_twin_sweep, make_cube
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.analysis.compare import compare
from dvfs.analysis.headroom import headroom
from dvfs.analysis.targets import Target
from dvfs.cube import merge_cubes

GPUS = (("GPU-aaaaaaaa", "NVIDIA H100 80GB HBM3", 700.0), ("GPU-bbbbbbbb", "NVIDIA H200", 600.0))
DRAFTERS = ["none", "eagle3"]
HEADROOM = (
    "feasible",
    "chosen_sm_clock",
    "chosen_power_limit",
    "headroom_mhz",
    "headroom_w",
    "saving",
    "headroom_mhz_is_lower_bound",
    "headroom_w_is_lower_bound",
    "chosen_at_grid_edge",
    "headroom_mhz_unmeasured_below",
    "headroom_w_unmeasured_below",
    "chosen_unmeasured_below",
    "unmeasured_settings",
)
COMPARE = (
    "energy_ratio_equal_latency",
    "verdict_equal_latency",
    "equal_latency_drafter_at_grid_edge",
    "equal_latency_baseline_at_grid_edge",
)


@st.composite
def gpu_cube(draw: st.DrawFn, clocks: list[int], repeats: int, watts: float) -> xr.Dataset:
    """One GPU's cube at its own stock limit: latencies and energies drawn per cell, a few
    cells not measured (NaN)."""
    cells = [(c, d, r) for c in clocks for d in DRAFTERS for r in range(repeats)]
    latency = {
        cell: draw(st.sampled_from([8.0, 10.0, 11.0, 14.0, 20.0, math.nan])) for cell in cells
    }
    energy = {cell: draw(st.sampled_from([0.6, 0.8, 1.0, 1.2])) for cell in cells}
    return make_cube(
        clocks=clocks,
        limits=[watts],
        drafters=DRAFTERS,
        repeats=repeats,
        latency=lambda clock, _p, _b, drafter, _c, r: latency[clock, drafter, r],
        energy=lambda clock, _p, _b, drafter, _c, r: energy[clock, drafter, r],
    )


def _campaign(clocks: list[int], repeats: int) -> dict[str, object]:
    """The campaign's grid: the clocks listed, the power limit left at stock."""
    return {
        "name": "m",
        "knobs": {"sm_clocks_mhz": clocks, "power_limits_w": None},
        "workload": {"batch_sizes": [1], "corpora": [{"name": "code"}]},
        "measurement": {"repeats": repeats},
        "drafters": [{"name": d} for d in DRAFTERS],
        "engine": {"model": "m", "tp_size": 1},
        "gpu": {},
    }


@st.composite
def gpu_cubes(draw: st.DrawFn) -> list[xr.Dataset]:
    clocks = sorted(draw(st.sets(st.sampled_from([1000, 1500, 1980]), min_size=2)) | {1980})
    repeats = draw(st.integers(min_value=1, max_value=3))
    campaign = _campaign(clocks, repeats)
    cubes = []
    for uuid, name, watts in GPUS:
        ds = as_twin_sweep(
            draw(gpu_cube(clocks, repeats, watts)), uuid=uuid, gpu_name=name, campaign="m"
        )
        cubes.append(ds.assign_attrs(campaign=json.dumps(campaign)))
    return cubes


def same(got: xr.DataArray, want: xr.DataArray) -> bool:
    a, b = got.values, want.values
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        return bool(np.allclose(a.astype(float), b.astype(float), rtol=1e-12, equal_nan=True))
    return bool((a == b).all())


@settings(max_examples=10, deadline=None, report_multiple_bugs=False)
@given(gpu_cubes(), st.sampled_from([0.0, 0.1, 0.5]))
def test_each_gpu_of_a_merge_answers_as_its_own_cube(cubes: list[xr.Dataset], slack: float) -> None:
    merged = merge_cubes(cubes)
    target = Target(slack=slack)
    together = headroom(merged, target=target)
    compared = compare(merged)
    for (uuid, _, _), own in zip(GPUS, cubes, strict=True):
        gpu = next(g for g in merged["gpu"].values if str(g).startswith(uuid))
        alone = headroom(own, target=target)
        for name in HEADROOM:
            got = together[name].sel(gpu=gpu, drop=True)
            assert same(got, alone[name]), (name, got.values, alone[name].values)
        assert together.attrs["power_limit_swept"] == alone.attrs["power_limit_swept"] == 0
        by_itself = compare(own)
        for name in COMPARE:
            got = compared[name].sel(gpu=gpu, drop=True).sel(drafter=by_itself["drafter"])
            assert same(got, by_itself[name]), (name, got.values, by_itself[name].values)


def test_a_gpu_that_measured_nothing_yet_waits_at_its_own_stock_limit_in_a_merge() -> None:
    """The second GPU has not measured a cell: its stock power limit, on the merged axis beside
    the first GPU's, is its grid waiting for its sweep (both clocks), as its own cube says; not
    another GPU's setting outside it (hypothesis found this once in a full run)."""
    clocks, repeats = [1000, 1980], 1
    campaign = _campaign(clocks, repeats)
    cubes = []
    for (uuid, name, watts), latency in zip(GPUS, (10.0, math.nan), strict=True):
        cube = make_cube(
            clocks=clocks,
            limits=[watts],
            drafters=DRAFTERS,
            repeats=repeats,
            latency=lambda *_cell, ms=latency: ms,
            energy=lambda *_cell: 0.6,
        )
        cube = as_twin_sweep(cube, uuid=uuid, gpu_name=name, campaign="m")
        cubes.append(cube.assign_attrs(campaign=json.dumps(campaign)))
    together = headroom(merge_cubes(cubes), target=Target())
    for (uuid, _, _), own in zip(GPUS, cubes, strict=True):
        gpu = next(g for g in together["gpu"].values if str(g).startswith(uuid))
        alone = headroom(own, target=Target())
        for name in ("unmeasured_settings", "feasible", "chosen_unmeasured_below"):
            got = together[name].sel(gpu=gpu, drop=True)
            assert same(got, alone[name]), (uuid, name, got.values, alone[name].values)
    waiting = together["unmeasured_settings"].sel(gpu=together["gpu"].values[1])
    assert (waiting == len(clocks)).all()
