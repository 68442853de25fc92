"""A sweep on the real NVML backend (the fake pynvml) measures energy from the GPU's counter:
its cells' energy must agree with the power the same GPU reported, not merely exist."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fresh_nvml, root_env  # noqa: F401


def test_an_nvml_sweeps_energy_is_the_counters_and_agrees_with_its_power(
    nvml, env: dict[str, str], tmp_path: Path
) -> None:
    """Each measured cell's mean power from the energy counter (energy over its windows) lies
    within its instant power readings' range, and the idle baseline is the fake's idle power:
    an energy read that returned a constant (0, or a stale value) passed every NVML test."""
    from dvfs.cube import open_cube

    campaign = tmp_path / "c.toml"
    campaign.write_text(NVML_CAMPAIGN.format(output_tokens=64, repeats=1))
    out = tmp_path / "out"
    result = dvfs_in_process("sweep", str(campaign), "--out", str(out), "--no-progress", env=env)
    assert result.returncode == 0, result.stderr
    cube = open_cube(out / "cube.nc")
    mean = cube["power_mean_w"].values.ravel()
    peak = cube["power_max_w"].values.ravel()
    per_token = cube["energy_per_token_j"].values.ravel()
    measured = np.isfinite(peak)
    assert measured.sum() >= 2, cube["power_max_w"]
    # mean power over a window cannot exceed the highest instant reading in it (5% for the
    # counter's quantisation and the window's edges), and a working GPU draws power
    assert (mean[measured] > 0).all() and (mean[measured] <= 1.05 * peak[measured]).all(), (
        mean,
        peak,
    )
    assert (per_token[measured] > 0).all()
    idle = float(cube.attrs["idle_power_w"])
    # the fake's board power at idle (its H100 SXM profile), read from the counter's growth
    assert math.isclose(idle, nvml.FAKE_PROFILES["h100-sxm"]["idle_w"], rel_tol=0.1), idle
