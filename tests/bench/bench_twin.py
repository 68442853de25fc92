"""Benchmarks (not run by the test suite): ratios measured side by side in one run.

    python tests/bench/bench_twin.py

1. The twin's vectorised fixed-batch path against its step-by-step path (the closed-loop
   simulator given the same workload: a pool of exactly `batch` prompts run to full length),
   per measurement round. Both produce the same tokens; the ratio is what vectorising buys.
2. A full sweep's cost per cell, and the cube's size against the journal's.

Absolute times depend on the machine; the ratios are what to compare across changes.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import tomllib
from dataclasses import replace
from pathlib import Path

from dvfs.campaign import DrafterSpec, parse_campaign
from dvfs.clock import VirtualClock
from dvfs.corpora import load_corpus, sample_prompts
from dvfs.engines.base import Workload
from dvfs.engines.twin import TwinEngine
from dvfs.sweep import run_sweep
from dvfs.twin.device import TwinDevice, TwinNode
from dvfs.twin.profiles import gpu_profile, model_profile

REPO = Path(__file__).resolve().parents[2]


def engine() -> TwinEngine:
    clock = VirtualClock()
    node = TwinNode([TwinDevice(gpu_profile("h100-sxm"), clock)])
    return TwinEngine(node, model_profile("llama-3.1-8b"))


def time_rounds(
    mode: str, drafter: DrafterSpec, batch: int, repeats: int = 20
) -> tuple[float, int]:
    eng = engine()
    eng.start(drafter)
    prompts = sample_prompts(load_corpus("code"), batch, input_tokens=(16, 2048), seed=0)
    workload = Workload(batch, prompts, "code", 256, 0.0, True, "fixed", seed=1)
    if mode == "step":
        workload = replace(workload, mode="closed-loop")
    times, tokens = [], 0
    for i in range(repeats):
        start = time.perf_counter()
        result = eng.run(replace(workload, seed=i))
        times.append(time.perf_counter() - start)
        tokens = sum(r.completion_tokens for r in result.requests)
    return statistics.median(times), tokens


def main() -> None:
    print("1. twin round: vectorised vs step-by-step (median of 20 rounds, 256 tokens/request)")
    print(f"{'drafter':<8} {'batch':>5} {'vector ms':>10} {'step ms':>9} {'speed-up':>9}")
    for drafter in (
        DrafterSpec("none"),
        DrafterSpec("eagle3", "EAGLE3", "eagle3-llama-3.1-8b", 5, 4, 8),
    ):
        for batch in (1, 16, 64):
            vec, tokens_v = time_rounds("vector", drafter, batch)
            step, tokens_s = time_rounds("step", drafter, batch)
            assert tokens_v == tokens_s == batch * 256
            print(
                f"{drafter.name:<8} {batch:>5} {vec * 1e3:>10.2f} {step * 1e3:>9.2f} "
                f"{step / vec:>8.1f}x"
            )

    print("\n2. demo-shaped sweep (one corpus): cost per cell, cube vs journal size")
    data = tomllib.loads((REPO / "dvfs" / "campaigns" / "demo.toml").read_text())
    data["workload"]["corpora"] = ["code"]
    campaign = parse_campaign(data, where="bench")
    out = Path(tempfile.mkdtemp(prefix="dvfs-bench-"))
    try:
        start = time.perf_counter()
        outcome = run_sweep(campaign, out)
        elapsed = time.perf_counter() - start
        cells = outcome.summary.measured
        journal = outcome.journal_path.stat().st_size
        cube = outcome.cube_path.stat().st_size
        print(
            f"{cells} cells in {elapsed:.1f} s: {elapsed / cells * 1e3:.2f} ms per cell "
            "(sweep, journal and cube included)"
        )
        print(
            f"journal {journal / 1e6:.2f} MB, cube {cube / 1e6:.2f} MB: "
            f"cube / journal = {cube / journal:.2f}"
        )
    finally:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
