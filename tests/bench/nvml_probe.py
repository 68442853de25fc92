"""Read NVML's traps off a real GPU, read-only: the energy counter's update period, the lag of
the averaged power reading behind the instant field, and what the counter says of power.

    python tests/bench/nvml_probe.py --gpu 0 --out probe.json [--load-s 3] [--after-s 20]

It samples one GPU as fast as NVML answers (energy counter, `nvmlDeviceGetPowerUsage`, the
instant and average power fields, SM clock, clock-event reasons, temperature) for an idle
second, then while a torch GEMM loop (a child process, `--load-s` seconds) loads the GPU, then
for `--after-s` seconds as it falls idle again (how long it stays clocked up). No setter is
ever called: safe on a shared GPU (the load is a few
seconds of matrix products). Prints a summary and writes every sample to `--out` (JSON).
Not a test: it needs a GPU, torch and the real nvidia-ml-py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dvfs.measure.counter import update_period_s

FI_POWER_AVERAGE = 185
FI_POWER_INSTANT = 186
BURN = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print("burning", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
"""


def sample(nv, handle, seconds: float, phase: str, rows: list[dict]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic_ns()
        energy = nv.nvmlDeviceGetTotalEnergyConsumption(handle)
        fields = nv.nvmlDeviceGetFieldValues(handle, [FI_POWER_INSTANT, FI_POWER_AVERAGE])
        rows.append(
            {
                "phase": phase,
                "t_ns": t,
                "energy_mj": int(energy),
                "power_usage_mw": int(nv.nvmlDeviceGetPowerUsage(handle)),
                "instant_mw": int(fields[0].value.uiVal) if fields[0].nvmlReturn == 0 else None,
                "average_mw": int(fields[1].value.uiVal) if fields[1].nvmlReturn == 0 else None,
                "sm_mhz": int(nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)),
                "reasons": int(nv.nvmlDeviceGetCurrentClocksEventReasons(handle)),
                "temp_c": int(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)),
            }
        )
        time.sleep(0.001)


def first_time_above(t: np.ndarray, y: np.ndarray, level: float, after: float) -> float | None:
    hit = np.nonzero((t >= after) & (y >= level))[0]
    return float(t[hit[0]]) if hit.size else None


def idle_again(rows: list[dict], since_s: float) -> float | None:
    """Seconds from the load's end to the first reading with NVML's GpuIdle reason (0x1)."""
    t0 = rows[0]["t_ns"]
    for r in rows:
        at = (r["t_ns"] - t0) * 1e-9
        if at >= since_s and r["reasons"] & 0x1:
            return at - since_s
    return None


def summarise(rows: list[dict], burn_started_s: float | None) -> dict:
    t = np.array([r["t_ns"] for r in rows], dtype=np.int64)
    e = np.array([r["energy_mj"] for r in rows], dtype=np.int64)
    ts = (t - t[0]) * 1e-9
    out: dict = {"samples": len(rows), "sample_period_ms": float(np.median(np.diff(ts)) * 1e3)}
    changes = np.nonzero(np.diff(e))[0] + 1
    gaps = np.diff(ts[changes])
    out["counter_changes"] = int(changes.size)
    if gaps.size:
        out["counter_gap_ms"] = {f"p{p}": float(np.percentile(gaps, p) * 1e3) for p in (10, 50, 90)}
    for phase in ("idle", "load", "after"):
        keep = np.array([r["phase"] == phase for r in rows])
        if keep.sum() < 3:
            continue
        period = update_period_s(t[keep], e[keep])
        span = (t[keep][-1] - t[keep][0]) * 1e-9
        picked = [r for r, k in zip(rows, keep, strict=True) if k]
        inst = [r["instant_mw"] for r in picked if r["instant_mw"]]
        out[phase] = {
            "dvfs_detected_period_s": period,
            "counter_power_w": float((e[keep][-1] - e[keep][0]) / span / 1e3),
            "instant_power_w_mean": float(np.mean(inst) / 1e3) if inst else None,
            "power_usage_w_mean": float(np.mean([r["power_usage_mw"] for r in picked]) / 1e3),
            "sm_mhz_median": float(np.median([r["sm_mhz"] for r in picked])),
            "reasons_seen": sorted({hex(r["reasons"]) for r in picked}),
        }
    if burn_started_s is not None and "idle" in out and "load" in out:
        idle_w = out["idle"]["instant_power_w_mean"] or out["idle"]["power_usage_w_mean"]
        load_w = out["load"]["instant_power_w_mean"] or out["load"]["power_usage_w_mean"]
        half = idle_w + 0.5 * (load_w - idle_w)
        lags = {}
        for key in ("instant_mw", "power_usage_mw", "average_mw"):
            y = np.array([r[key] if r[key] is not None else np.nan for r in rows]) / 1e3
            hit = first_time_above(ts, y, half, burn_started_s)
            lags[key] = None if hit is None else hit - burn_started_s
        out["half_step_after_burn_start_s"] = lags
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--load-s", type=float, default=3.0)
    parser.add_argument("--after-s", type=float, default=2.0)
    args = parser.parse_args()
    import pynvml as nv

    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(args.gpu)
    rows: list[dict] = []
    sample(nv, handle, 1.5, "idle", rows)
    burner = subprocess.Popen(
        [sys.executable, "-c", BURN, str(args.load_s)], stdout=subprocess.PIPE, text=True
    )
    assert burner.stdout is not None
    burner.stdout.readline()  # the operands are on the GPU: the GEMMs start now
    burn_started = (time.monotonic_ns() - rows[0]["t_ns"]) * 1e-9
    procs = [int(p.pid) for p in nv.nvmlDeviceGetComputeRunningProcesses(handle)]
    sample(nv, handle, args.load_s, "load", rows)
    if burner.wait(timeout=60) != 0:
        print(f"the GEMM loop failed (exit {burner.returncode})", file=sys.stderr)
    burn_ended = (time.monotonic_ns() - rows[0]["t_ns"]) * 1e-9
    sample(nv, handle, args.after_s, "after", rows)
    nv.nvmlShutdown()
    summary = summarise(rows, burn_started)
    summary["idle_again_after_load_s"] = idle_again(rows, burn_ended)
    summary["burner_pid"] = burner.pid
    summary["compute_pids_during_load"] = procs
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
