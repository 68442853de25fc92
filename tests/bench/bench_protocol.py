"""Benchmark (not run by the test suite): the naive protocol against dvfs's, in twin virtual time,
both held to the same precision on energy per token.

    python tests/bench/bench_protocol.py [--precision 0.02] [--cap 10] [--grid subset|full]

The demo campaign (`sweeps/demo.toml`, every NVML trap on) is swept through the normal
`run_sweep`, twice, on the grid chosen:

- subset (default): every drafter, batch and corpus, at three SM clocks spanning the range
  (705, 1380, 1980 MHz) and the stock power limit (700 W): 375 cells, a stratified slice of the
  demo's 4,500 that keeps every drafter, batch and corpus. `--grid full` sweeps all 4,500 (12
  times the subset's 1.5 minutes of CPU: over half an hour here, so not the default).
- naive: per cell, a server start, a fixed 2 s settle, a warm-up, and one window of at least
  5 s (rounds stop at the window: precision is not looked at within a cell); repeated until the
  Student-t interval across its repeats reaches the target (at least 3 repeats, at most
  `--cap`). It is swept once with `--cap` fixed repeats, and each cell then keeps its first n
  repeats, n the first count from 3 at which the interval reaches the target (else the cap):
  the repeats are independent, so this is what stopping there would have spent. Its GPU time
  per repeat is the twin's warm-up, prefill, window, drain and retries of that repeat, plus
  one server start (the twin's, `gpu_time_server_start_s`) and the fixed settle; plus the
  session's overhead once.
- dvfs: the demo's measurement at `precision` = the target (measured settle, idle baseline per
  setting, stabilisation, rounds until the interval across them reaches the target), with
  `max_rounds` = `--max-rounds` (128: the demo's 8 leaves a third of the cells short of a 2%
  target, 32 still leaves 55, which would not be the same precision). Its GPU time is the
  cells' `gpu_time_total_s` plus each session's overhead (counter detection, idle baseline,
  settle measurement), which the journal keeps on the session record.

Caps are stated and both are bounded; the cells that end above the target are counted. Printed:
GPU-hours of each, their ratio (target: dvfs at most 1/5 of naive), dvfs's share of
GPU time inside measurement windows (target: at least 85%), overall and leaving out the
per-drafter costs (server starts, stabilisation), the precision each reached (median, 90th
percentile, max) and the cells that hit their cap. It runs whatever protocol the tree has.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np

from dvfs.campaign import Campaign, parse_campaign
from dvfs.cube import open_cube
from dvfs.measure.counter import relative_half_width
from dvfs.sweep import run_sweep

REPO = Path(__file__).resolve().parents[2]
MIN_NAIVE_REPEATS = 3
NAIVE_SETTLE_S = 2.0
SUBSET_CLOCKS = [705, 1380, 1980]
SUBSET_LIMITS = [700]


def demo(measurement: dict[str, Any], grid: str, settle_s: float | None = None) -> Campaign:
    data = tomllib.loads((REPO / "sweeps" / "demo.toml").read_text())
    if grid == "subset":
        data["knobs"]["sm_clock"] = SUBSET_CLOCKS
        data["knobs"]["power_limit"] = SUBSET_LIMITS
    if settle_s is not None:
        data["knobs"]["settle_s"] = settle_s
    data["measurement"] = {**data["measurement"], **measurement}
    return parse_campaign(data, where="bench")


def naive_settings(cap: int) -> dict[str, Any]:
    return {
        "min_window_s": 5.0,
        "precision": 0.99,  # rounds stop at the 5 s window
        "max_rounds": 50,
        "repeats": cap,
        "max_repeats": cap,
        "settle": NAIVE_SETTLE_S,
        "idle_per_setting": False,
        "thermal_max_s": 0.0,
        "round_end": "complete",  # no aborts: every request runs to its end, the drain too
        "warmup_every": "cell",  # a server started per cell warms up per cell
    }


def dvfs_settings(precision: float, max_rounds: int) -> dict[str, Any]:
    return {"precision": precision, "max_rounds": max_rounds}


def session_overhead_s(out: Path) -> float:
    total = 0.0
    for line in (out / "journal.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "session":
            total += float((rec.get("gpu_time_s") or {}).get("total", 0.0))
    return total


def sweep(campaign: Campaign, out: Path) -> tuple[Any, float, float]:
    start = time.process_time()
    run_sweep(campaign, out)
    return open_cube(out / "cube.nc"), session_overhead_s(out), time.process_time() - start


def spread(values: np.ndarray) -> str:
    v = values[np.isfinite(values)]
    if not v.size:
        return "no cells"
    return (
        f"median {np.median(v):.2%}, p90 {np.quantile(v, 0.9):.2%}, max {v.max():.2%} (n={v.size})"
    )


def naive_adaptive(ds: Any, target: float, cap: int) -> dict[str, Any]:
    """Each cell stops at the first repeat count from 3 whose interval reaches `target`."""
    confidence = float(json.loads(ds.attrs["campaign"])["measurement"]["confidence"])
    start = float(np.nanmax(ds["gpu_time_server_start_s"].values))
    parts = ("warmup", "prefill", "window", "drain", "retry")
    per_repeat = sum(ds[f"gpu_time_{p}_s"].fillna(0.0) for p in parts if f"gpu_time_{p}_s" in ds)
    cost = (per_repeat + start + NAIVE_SETTLE_S).transpose(..., "repeat").values
    window = ds["gpu_time_window_s"].fillna(0.0).transpose(..., "repeat").values
    energy = ds["energy_per_token_j"].transpose(..., "repeat").values
    flat_e = energy.reshape(-1, energy.shape[-1])
    flat_c = cost.reshape(-1, cost.shape[-1])
    flat_w = window.reshape(-1, window.shape[-1])
    total = windows = 0.0
    reached, repeats, capped = [], [], 0
    for e, c, w in zip(flat_e, flat_c, flat_w, strict=True):
        if not np.isfinite(e).any():
            continue
        n, ci = cap, math.nan
        for k in range(MIN_NAIVE_REPEATS, cap + 1):
            ci = relative_half_width(list(e[:k]), confidence)
            if ci <= target:
                n = k
                break
        else:
            capped += 1
        total += float(np.sum(c[:n]))
        windows += float(np.sum(w[:n]))
        reached.append(ci)
        repeats.append(n)
    return {
        "gpu_s": total,
        "window_s": windows,
        "reached": np.array(reached),
        "repeats": np.array(repeats),
        "capped": capped,
        "cells": len(reached),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", type=float, default=0.02, help="target (0.02 = ±2%%)")
    parser.add_argument("--cap", type=int, default=10, help="most repeats naive may take")
    parser.add_argument("--max-rounds", type=int, default=128, help="most rounds dvfs may take")
    parser.add_argument("--grid", choices=("subset", "full"), default="subset")
    args = parser.parse_args()
    target = args.precision
    with tempfile.TemporaryDirectory() as tmp:
        naive_ds, naive_session, naive_cpu = sweep(
            demo(naive_settings(args.cap), args.grid, NAIVE_SETTLE_S), Path(tmp) / "naive"
        )
        ours, ours_session, ours_cpu = sweep(
            demo(dvfs_settings(target, args.max_rounds), args.grid), Path(tmp) / "d"
        )
        naive = naive_adaptive(naive_ds, target, args.cap)
        naive_total = naive["gpu_s"] + naive_session

        total = float(ours["gpu_time_total_s"].fillna(0.0).sum()) + ours_session
        window = float(ours["gpu_time_window_s"].fillna(0.0).sum())
        parts = {
            str(v)[9:-2]: float(ours[v].fillna(0.0).sum())
            for v in ours.data_vars
            if str(v).startswith("gpu_time_") and v != "gpu_time_total_s"
        }
        reached = ours["energy_per_token_rel_ci"].values.ravel()
        reached = reached[np.isfinite(reached)]
        rounds = ours["rounds"].values.ravel()
        max_rounds = int(json.loads(ours.attrs["campaign"])["measurement"]["max_rounds"])
        dvfs_capped = int(np.sum(reached > target))
        missed = ours["energy_per_token_rel_ci"] > target
        by = missed.sum([d for d in missed.dims if d not in ("drafter", "batch")])
        where = [
            f"{d}/b{b}: {int(by.sel(drafter=d, batch=b))}"
            for d in by["drafter"].values
            for b in by["batch"].values
            if int(by.sel(drafter=d, batch=b))
        ]
        at_max = int(np.sum(rounds[np.isfinite(rounds)] >= max_rounds))

    print(
        f"grid: {args.grid} ({naive['cells']} cells); target ±{target:.1%} on energy per token "
        f"at {float(json.loads(ours.attrs['campaign'])['measurement']['confidence']):.0%}"
    )
    print(
        f"naive: {naive_total / 3600:.2f} GPU-h ({naive['window_s'] / naive_total:.1%} in "
        f"windows); repeats median {np.median(naive['repeats']):.0f}, mean "
        f"{naive['repeats'].mean():.1f}; reached {spread(naive['reached'])}; "
        f"{naive['capped']} cells hit the cap of {args.cap} repeats "
        f"(swept in {naive_cpu:.0f} s CPU)"
    )
    print(
        f"dvfs:  {total / 3600:.2f} GPU-h; reached {spread(reached)}; {dvfs_capped} cells "
        f"missed the target ({at_max} took max_rounds = {max_rounds}) "
        f"(swept in {ours_cpu:.0f} s CPU)"
    )
    print("  dvfs's cells above the target, by drafter/batch: " + (", ".join(where) or "none"))
    print("  dvfs's GPU time: " + ", ".join(f"{k} {s / total:.1%}" for k, s in parts.items() if s))
    fixed = parts.get("server_start", 0.0) + parts.get("stabilise", 0.0)
    share, share_bare = window / total, window / (total - fixed)
    ratio = total / naive_total
    print(f"GPU time dvfs/naive = {ratio:.3f} (naive needs {1 / ratio:.1f}x dvfs's)")
    print(
        f"dvfs inside windows: {share:.1%} overall, {share_bare:.1%} leaving out server starts "
        "and stabilisation (per-drafter costs)"
    )
    print(f"{'PASS' if ratio <= 0.2 else 'FAIL'}: dvfs needs <= 1/5 of naive's GPU time")
    print(f"{'PASS' if share >= 0.85 else 'FAIL'}: >= 85% of dvfs's GPU time in windows")
    assert math.isfinite(ratio)


if __name__ == "__main__":
    main()
