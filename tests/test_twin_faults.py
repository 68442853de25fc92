"""Physics faults of the twin measured on its own output (issue 13): each test fails on the
twin before its fix."""

from __future__ import annotations

from dvfs.campaign.model import DrafterSpec
from dvfs.clock import VirtualClock
from dvfs.corpora import load_corpus, sample_prompts
from dvfs.engines.base import Workload
from dvfs.engines.twin import TwinEngine
from dvfs.twin import traps
from dvfs.twin.device import TwinDevice, TwinNode
from dvfs.twin.profiles import gpu_profile, model_profile

H100 = gpu_profile("h100-sxm")
LLAMA8B = model_profile("llama-3.1-8b")
EAGLE3 = DrafterSpec("eagle3", "EAGLE3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 5, 4, 8)


def run_round(drafter: DrafterSpec, batch: int, limit_w: float, clock_mhz: int | None = None):
    """One round on a trap-free twin H100 (leakage does not move the limit); its device."""
    device = TwinDevice(traps.without(H100), VirtualClock(), 0)
    device.locked_mhz = None if clock_mhz is None else (clock_mhz, clock_mhz)
    device.power_limit_w = limit_w
    engine = TwinEngine(TwinNode([device]), LLAMA8B)
    engine.start(drafter)
    prompts = sample_prompts(load_corpus("code"), batch, input_tokens=(16, 2048), seed=5)
    engine.run(Workload(batch, prompts, "code", 128, 0.0, True, "fixed", seed=5))
    return device


def test_every_pass_holds_the_power_limit_not_only_each_phase_average() -> None:
    """A verify pass at batch 64 draws more than 700 W at the top clock while the draft passes
    around it draw far less: the limit throttles the verify passes themselves."""
    limit_w = 700.0
    work = run_round(EAGLE3, 64, limit_w).timeline.work
    assert work is not None
    assert work.dynamic_w.max() <= limit_w * (1 + 1e-12)
    throttled = work.sm_clock_mhz < H100.max_sm_clock_mhz
    assert throttled.any() and not throttled.all()  # the limit binds, on some passes only
