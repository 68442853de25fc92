"""What the fleet tests of reruns, ports and modes share (issue 12): the campaigns and the
cell-for-cell comparison of two cubes."""

from __future__ import annotations

import numpy as np
from conftest import replace_block
from fleet_support import fleet_campaign

#: Two planned repeats, up to four while the repeats' interval misses a tight precision: on
#: the twin most groups of the fleet campaign need the third and fourth.
ADAPTIVE = replace_block(
    fleet_campaign("adaptive", repeats=2),
    "idle_s = 1.0",
    "idle_s = 1.0\nmax_repeats = 4\nprecision = 0.002",
)
#: In-flight mode: each group's six knob levels stepped inside shared decodes.
INFLIGHT = replace_block(
    fleet_campaign("inflight"), "idle_s = 1.0", 'idle_s = 1.0\nmode = "in-flight"'
)


def assert_same_cells(a, b) -> None:
    """Same grid and values (energy within the counter's 1 mJ quantisation); each worker pays
    its own server starts, so GPU time is left out."""
    assert set(a.data_vars) == set(b.data_vars)
    for dim in a.dims:
        np.testing.assert_array_equal(a[dim].values, b[dim].values)
    for name in a.data_vars:
        if str(name).startswith("gpu_time_"):
            continue
        if a[name].dtype.kind in "OUS":
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
            continue
        if str(name).endswith("_rel_ci"):
            np.testing.assert_allclose(a[name].values, b[name].values, atol=5e-3, equal_nan=True)
            continue
        counted = "energy" in name or "power_mean" in name or "power_max" in name  # (summarise)
        rtol = 1e-4 if counted else 1e-12
        np.testing.assert_allclose(
            a[name].values, b[name].values, rtol=rtol, equal_nan=True, err_msg=name
        )
