"""A day of load replayed on the digital twin: stock, the best static cap and the governor.

Why: the governor's claim is that following the batch saves energy over the best single cap
without costing latency. This replays a day-shaped load (batch rising and falling between 1 and
64) against the twin's physics and scores each strategy the same way: energy per generated token
over the day, and the share of time a decode step is within the latency target (the step time
at stock clock for that batch, plus `slack`). The governor runs the very policy `dvfs govern`
runs (`dvfs.govern.policy.follow`) on a per-batch plan made the way `dvfs cap plan --per-batch`
makes one from a headroom document: for each planned batch, the clock with the least energy per
token whose step time meets that batch's target. The best static cap is the clock with the least
energy over the day among those at least as compliant as stock.

Modelled: plain decode (no drafter) at a fixed context length, the SM clock as the only knob
(power limit at its default; the replay checks that no setting draws more), the governor
deciding once per trace point (10 s; dwell 30 s, hysteresis 25%). Not modelled: prefill,
queueing, clock-change latency. `python -m dvfs.govern.replay` prints the comparison.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dvfs.govern.plan import BatchPlan, BatchStep, Setting
from dvfs.govern.policy import PolicyParams, follow
from dvfs.twin.passes import count_passes
from dvfs.twin.physics import Passes, time_passes
from dvfs.twin.profiles import GpuProfile, ModelProfile, gpu_profile, model_profile

DAY_S = 86_400
PLAN_BATCHES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Decode:
    """One decode step of a batch on the twin: its duration (s) and mean power (W)."""

    gpu: GpuProfile
    model: ModelProfile
    context_tokens: int = 2048

    @functools.cache  # noqa: B019  (a handful of frozen instances live for one replay)
    def step(self, batch: int, clock_mhz: int) -> tuple[float, float]:
        tokens = np.array([float(batch)])
        passes = Passes(
            *count_passes(
                self.model,
                1,
                tokens,
                np.array([batch * float(self.model.kv_bytes_read(self.context_tokens))]),
                self.model.attention_flops_per_token(float(self.context_tokens)) * tokens,
                tokens,
            )
        )
        timing = time_passes(self.gpu, passes, clock_mhz)
        return timing.total_s, timing.mean_power_w

    @property
    def stock_mhz(self) -> int:
        return self.gpu.max_sm_clock_mhz

    def target_s(self, batch: int, slack: float) -> float:
        return self.step(batch, self.stock_mhz)[0] * (1 + slack)

    def joules_per_token(self, batch: int, clock_mhz: int) -> float:
        seconds, watts = self.step(batch, clock_mhz)
        return seconds * watts / batch


def day_trace(step_s: float = 10.0, low: int = 1, high: int = 64, seed: int = 0) -> list[int]:
    """Running batch every `step_s` over a day: a night trough, a day peak, and gusts."""
    t = np.arange(0.0, DAY_S, step_s)
    shape = 0.5 - 0.5 * np.cos(2 * math.pi * t / DAY_S)  # 0 at midnight, 1 at noon
    gusts = np.random.default_rng(seed).normal(0.0, 0.08, size=len(t))
    smooth = np.convolve(gusts, np.ones(6) / 6, mode="same")  # gusts last about a minute
    level = np.clip(shape + smooth, 0.0, 1.0)
    return [int(b) for b in np.rint(low + (high - low) * level)]


def twin_plan(decode: Decode, slack: float, batches: Sequence[int] = PLAN_BATCHES) -> BatchPlan:
    """The per-batch plan a headroom decision on a twin cube gives: per batch, the feasible
    clock with the least energy per token (ties to the higher clock)."""
    clocks = decode.gpu.supported_sm_clocks_mhz()
    steps = []
    for batch in batches:
        target = decode.target_s(batch, slack)
        feasible = [c for c in clocks if decode.step(batch, c)[0] <= target]
        best = min(feasible, key=lambda c: (decode.joules_per_token(batch, c), -c))
        steps.append(BatchStep(batch, Setting(None if best >= decode.stock_mhz else best)))
    name = decode.gpu.nvml_name
    return BatchPlan(tuple(steps), name, "none", {"measured_on": name, "drafter": "none"})


@dataclass(frozen=True)
class Outcome:
    name: str
    energy_per_token_j: float
    within_target: float  # share of the day
    mean_clock_mhz: float
    changes: int

    def row(self, stock: Outcome) -> str:
        # signed, as the README's table gives it: a saving is a fall in energy per token
        change = self.energy_per_token_j / stock.energy_per_token_j - 1
        return (
            f"{self.name:<18} {self.energy_per_token_j * 1000:9.2f} mJ/token "
            f"{change:+7.1%} vs stock  {self.within_target:7.2%} within target  "
            f"mean clock {self.mean_clock_mhz:6.0f} MHz  {self.changes} changes"
        )


def score(
    decode: Decode, name: str, trace: Sequence[int], clocks: Sequence[int], slack: float
) -> Outcome:
    """Energy per token and compliance of running each trace point's batch at its clock."""
    energy = tokens = within = 0.0
    # Looked up here, not through decode's cache, which hashes its profiles on every call.
    steps: dict[tuple[int, int], tuple[float, float, bool]] = {}
    for batch, clock in zip(trace, clocks, strict=True):
        known = steps.get((batch, clock))
        if known is None:
            seconds, watts = decode.step(batch, clock)
            known = steps[batch, clock] = (seconds, watts, seconds <= decode.target_s(batch, slack))
        seconds, watts, on_time = known
        if watts > decode.gpu.power_limit_default_w:
            raise ValueError(f"{name}: {watts:.0f} W is above the default power limit")
        energy += watts  # per second of trace
        tokens += batch / seconds
        within += on_time
    changes = sum(a != b for a, b in zip(clocks, clocks[1:], strict=False))
    return Outcome(name, energy / tokens, within / len(trace), float(np.mean(clocks)), changes)


def compare(
    gpu: str = "h100-sxm",
    model: str = "llama-3.1-8b",
    *,
    slack: float = 0.05,
    step_s: float = 10.0,
    params: PolicyParams | None = None,
) -> list[Outcome]:
    """Stock, the best static cap and the governor on one day-shaped trace, side by side."""
    decode = Decode(gpu_profile(gpu), model_profile(model))
    params = params or PolicyParams(dwell_s=30.0, hysteresis=0.25)
    trace = day_trace(step_s)
    stock = score(decode, "stock", trace, [decode.stock_mhz] * len(trace), slack)
    statics = [
        score(decode, f"static {c} MHz", trace, [c] * len(trace), slack)
        for c in decode.gpu.supported_sm_clocks_mhz()
    ]
    compliant = [s for s in statics if s.within_target >= stock.within_target]
    best = min(compliant, key=lambda s: s.energy_per_token_j)
    plan = twin_plan(decode, slack)
    bands = follow(plan, [(i * step_s, b) for i, b in enumerate(trace)], params)
    clocks = [plan.band_setting(band).sm_clock_mhz or decode.stock_mhz for band in bands]
    governed = score(decode, "governor", trace, clocks, slack)
    return [stock, best, governed]


def main() -> None:
    outcomes = compare()
    print("A day on the twin (h100-sxm, llama-3.1-8b decode, target: stock step time + 5%):")
    for outcome in outcomes:
        print("  " + outcome.row(outcomes[0]))


if __name__ == "__main__":
    main()
