"""What the fleet tests of reruns, ports and modes share (issue 12): the campaigns and the
cell-for-cell comparison of two cubes."""

from __future__ import annotations

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
