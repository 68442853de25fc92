"""Benchmark (not run by the test suite): the naive protocol against dvfs's, in twin virtual time.

    python tests/bench/bench_protocol.py

A reduced demo grid (2 drafters x 2 batches x 3 clocks x 1 power limit x 2 corpora) is swept
on the twin with every NVML trap on, twice, through the normal `run_sweep`:

- naive: a fixed 2 s settle, windows of at least 5 s per cell (precision loose, so rounds stop
  at the window), 3 fixed repeats, one idle baseline per session, no thermal stabilisation. A
  naive protocol also starts the server for every cell; the sweep starts it once per drafter,
  so one start's GPU time (`gpu_time_server_start_s` as the twin accounts it) is added for
  every other cell. Its precision is the interval across the 3 repeats of each cell.
- dvfs: the demo's measurement with `precision = 0.01` (measured settle, idle baseline per
  setting, stabilisation, adaptive rounds and repeats).

GPU time is the sum of the cells' `gpu_time_total_s` plus each session's overhead (counter
detection, idle baseline, settle measurement), which the journal keeps on the session record.
"""

from __future__ import annotations

import json
import math
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

from dvfs.campaign import Campaign, parse_campaign
from dvfs.cube import open_cube
from dvfs.measure.counter import relative_half_width
from dvfs.sweep import run_sweep

REPO = Path(__file__).resolve().parents[2]


def reduced_demo(measurement: dict[str, Any], settle_s: float = 2.0) -> Campaign:
    data = tomllib.loads((REPO / "sweeps" / "demo.toml").read_text())
    data["knobs"] = {"sm_clock": [1080, 1530, 1980], "power_limit": [700], "settle_s": settle_s}
    data["drafters"] = {k: v for k, v in data["drafters"].items() if k in ("none", "eagle3")}
    data["workload"]["batch"] = [4, 32]
    data["workload"]["corpora"] = ["code", "english"]
    data["measurement"] = {**data["measurement"], **measurement}
    return parse_campaign(data, where="bench")


NAIVE = {
    "min_window_s": 5.0,
    "precision": 0.99,
    "max_rounds": 50,
    "repeats": 3,
    "max_repeats": 3,
    "settle": 2.0,
    "idle_per_setting": False,
    "thermal_max_s": 0.0,
}
DVFS = {"precision": 0.01, "max_rounds": 8}


def session_overhead_s(out: Path) -> float:
    total = 0.0
    for line in (out / "journal.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "session":
            total += float((rec.get("gpu_time_s") or {}).get("total", 0.0))
    return total


def run(campaign: Campaign, out: Path) -> tuple[Any, float]:
    run_sweep(campaign, out)
    return open_cube(out / "cube.nc"), session_overhead_s(out)


def quantiles(values: np.ndarray) -> str:
    v = values[np.isfinite(values)]
    return f"median {np.median(v):.2%}, p90 {np.quantile(v, 0.9):.2%} (n={v.size})"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        naive, naive_session = run(reduced_demo(NAIVE), Path(tmp) / "naive")
        ours, ours_session = run(reduced_demo(DVFS), Path(tmp) / "dvfs")

    rows = {}
    for name, ds, session in (("naive", naive, naive_session), ("dvfs", ours, ours_session)):
        total = float(ds["gpu_time_total_s"].sum()) + session
        window = float(ds["gpu_time_window_s"].sum())
        starts = ds["gpu_time_server_start_s"].values
        measured = int(np.isfinite(ds["energy_per_token_j"].values).sum())
        added = 0.0
        if name == "naive":
            one_start = float(np.nanmax(starts))
            performed = int((np.nan_to_num(starts) > 0).sum())
            added = one_start * (measured - performed)
            total += added
            reps = ds["energy_per_token_j"].transpose(..., "repeat").values
            flat = reps.reshape(-1, reps.shape[-1])
            ci = np.array([relative_half_width(list(r[np.isfinite(r)]), 0.95) for r in flat])
            within = ds["energy_per_token_rel_ci"].values.ravel()
            precision = f"across 3 repeats: {quantiles(ci)}; within a repeat: {quantiles(within)}"
        else:
            precision = quantiles(ds["energy_per_token_rel_ci"].values.ravel())
        rows[name] = (total, window, measured, added, precision)
        print(
            f"{name}: {measured} cell-measurements, GPU time {total / 3600:.3f} h"
            f" (session overhead {session:.0f} s"
            + (f", per-cell server starts added {added:.0f} s" if added else "")
            + ")"
        )
        print(f"  inside windows {window / total:.1%}; energy/token interval {precision}")
        parts = {
            str(v)[9:-2]: float(ds[v].sum())
            for v in ds.data_vars
            if str(v).startswith("gpu_time_") and v != "gpu_time_total_s"
        }
        parts["server_start"] += added
        print("  " + ", ".join(f"{k} {s / total:.1%}" for k, s in parts.items() if s > 0))
        fixed = parts["server_start"] + parts.get("stabilise", 0.0)
        print(
            f"  inside windows leaving out server starts and stabilisation: "
            f"{window / (total - fixed):.1%} (costs per drafter, amortised on a full grid)"
        )

    ratio = rows["dvfs"][0] / rows["naive"][0]
    share = rows["dvfs"][1] / rows["dvfs"][0]
    print(f"GPU time dvfs/naive = {ratio:.3f}")
    bare = rows["dvfs"][0] / (rows["naive"][0] - rows["naive"][3])
    print(f"  (without the per-cell server starts added to naive: {bare:.3f})")
    print(
        f"{'PASS' if ratio <= 0.2 else 'FAIL'}: dvfs needs <= 1/5 of naive's GPU time ({ratio:.3f})"
    )
    print(
        f"{'PASS' if share >= 0.85 else 'FAIL'}: >= 85% of dvfs's GPU time in windows ({share:.1%})"
    )
    assert math.isfinite(ratio)


if __name__ == "__main__":
    main()
