"""The figures say what the cube says: each GPU of a merged cube under its own name, no
average over corpora or over invalid repeats, "stock" only where the reference is stock, and
no legend entry or bar for what was not measured. Small hand-built cubes; the assertions read
the data and text a figure draws, not its pixels."""

from __future__ import annotations

import json
from pathlib import Path

import xarray as xr
from test_plots import TARGET, small_cube

from dvfs.plots import figures, per_gpu, plot_all

H100 = "NVIDIA H100 80GB HBM3 (twin)"
H200 = "NVIDIA H200 (twin)"
UUIDS = ["GPU-47dfcd23-120e-9eab-3043-5d0ea1215572", "GPU-f39e88b9-d087-92fe-fa29-3ee2861654ce"]


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(match=lambda a: hasattr(a, "get_text"))]


def test_each_gpu_of_a_merged_cube_is_drawn_under_its_own_name(tmp_path: Path) -> None:
    one = small_cube([1, 8], corpora=("code",))
    merged = xr.concat([one, one], dim=xr.DataArray(UUIDS, dims="gpu"))
    merged.attrs.update(gpu_name=H100, gpu_names=json.dumps([H100, H200]))
    parts = per_gpu(merged)
    assert [folder for folder, _ in parts] == [
        "nvidia-h100-80gb-hbm3-twin-GPU-47dfcd23",
        "nvidia-h200-twin-GPU-f39e88b9",
    ]
    for (_, cube), mine, other in zip(parts, (H100, H200), (H200, H100), strict=True):
        titles = {name: fig.get_suptitle() for name, fig in figures(cube, TARGET)}
        assert mine in titles["energy_vs_clock_code"] and mine in titles["energy_vs_batch"]
        assert not any(other in t for t in titles.values())
    paths = plot_all(merged, tmp_path, fmt="svg", target=TARGET)
    assert {p.parent.name for p in paths} == {folder for folder, _ in parts}
