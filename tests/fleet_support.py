"""The reduced demo campaign the fleet tests share (local workers, Ray, shards)."""

from __future__ import annotations

#: Three drafters, so several workers must share or switch servers; the exact twin (no NVML
#: traps), so each GPU's cells reproduce exactly whichever worker runs them.
_FLEET_CAMPAIGN = """
[campaign]
name = "{name}"

[gpu]
backend = "twin"
profile = "h100-sxm:none"  # the exact twin: each GPU's cells reproduce exactly
devices = [0]

[knobs]
sm_clock = [1980, 1410, 1005]
power_limit = [700, 350]
settle_s = 1.0

[engine]
backend = "twin"
model = "llama-3.1-8b"

[drafters.none]
algorithm = "none"

[drafters.eagle3]
algorithm = "EAGLE3"
draft_model = "eagle3-llama-3.1-8b"
num_steps = 3
eagle_topk = 1
num_draft_tokens = 4

[drafters.ngram]
algorithm = "NGRAM"
num_draft_tokens = 8

[workload]
batch = [1, 8]
corpora = ["code", "conversation"]
input_tokens = [16, 2048]
output_tokens = 48

[measurement]
warmup_tokens = 8
min_window_s = 0.2
max_rounds = 2
repeats = {repeats}
sample_period_s = 0.02
idle_s = 1.0
"""


def fleet_campaign(name: str, repeats: int = 1) -> str:
    """The campaign's TOML text under NAME with REPEATS interleaved repeats."""
    return _FLEET_CAMPAIGN.format(name=name, repeats=repeats)
