"""A cube's quality flags: how many measured cells raised each, which make a cell invalid, what
a warning means where a cube raises it, and what to change in the campaign where cells came
out invalid.

`dvfs cube info`, the sweep's closing line, the report and every analysis's reasons say the
flags in these words; the flags themselves are the meter's (`dvfs.measure.meter`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dvfs.cube.schema import STATUS_OK
from dvfs.measure.meter import THROTTLE_VIOLATION_SHARE, describe_quality

if TYPE_CHECKING:
    import xarray as xr


def quality_counts(ds: xr.Dataset) -> dict[str, int]:
    """How many measured cells raised each quality flag, by flag name (sorted)."""
    if "quality" not in ds:
        return {}
    quality = ds["quality"].values
    flags: dict[str, int] = {}
    for value in quality[quality == quality].astype(int).ravel():  # NaN: not measured
        for name in describe_quality(int(value)):
            flags[name] = flags.get(name, 0) + 1
    return dict(sorted(flags.items()))


def invalidates(flag: str) -> bool:
    """Whether a quality flag (by name) makes its cell invalid, never chosen by an analysis;
    the others are warnings."""
    from dvfs.measure.meter import INVALIDATING, QUALITY_FLAGS

    return any(name == flag and bit & INVALIDATING for bit, name in QUALITY_FLAGS.items())


#: What a warning flag (one that leaves the cell valid) means where a cube raises it, for
#: `dvfs cube info` (the invalidating flags' advice: `INVALID_ADVICE`); and `throttled`, whose
#: cause a cell's clock_event_reasons may not show.
FLAG_NOTES = {
    "throttled": "a GPU slowed down for heat or a hardware brake in these cells: at a sampled "
    "instant (their clock_event_reasons hold HwSlowdown, SwThermalSlowdown, HwThermalSlowdown "
    "or HwPowerBrakeSlowdown), or between two samples, which no sampled reason shows: NVML's "
    "thermal and board-limit violation counters, read at each round's start and end (in each "
    "round the one of any GPU that grew the most, never their sum: they may count the same "
    "throttle), grew "
    f"by more than {THROTTLE_VIOLATION_SHARE:.0%} of the cells' steady windows (less flags "
    "nothing; throttle_violation_s holds the seconds either way, NaN where the driver cannot "
    "tell). Check the "
    "GPUs' cooling and what else runs on them",
    "idle_baseline_foreign": "another tenant's compute process was on a metered GPU right "
    "before or after the idle baseline these cells' above-idle energy subtracts (measured "
    "again, a bounded number of times, while it stayed), so their "
    "energy_per_token_above_idle_j is wrong; their energy_per_token_j does not use the idle "
    "and stands. The journal's session record (the opening idle measurement) or cell records "
    "(a setting's) name it; sweep on GPUs nothing else uses",
    "idle_from_power_readings": "an energy counter updated less than twice while the idle "
    "baseline these cells' above-idle energy subtracts was measured (or measurement.idle_s = 0 "
    "read the power once for the opening one), so that baseline is the mean of the instant "
    "power readings, not the counter's energy over its window: their "
    "energy_per_token_above_idle_j is less exact; their energy_per_token_j does not use the "
    "idle and stands. Raise measurement.idle_s (a setting's baseline spans a fifth of it) or "
    "check the counter with `dvfs doctor`",
}


#: What to change when measured cells come out invalid, per invalidating quality flag (what
#: each means: dvfs.measure.meter.summarise and the README's cube section).
INVALID_ADVICE = {
    "few_counter_updates": "the energy counter updated too rarely in the windows for the "
    "precision asked: raise workload.output_tokens (a round's window cannot outlast its "
    "decode) or measurement.max_rounds with measurement.min_window_s (more rounds add up), "
    "or loosen measurement.precision",
    "few_samples": "fewer than three power samples taken while decoding: lower "
    "measurement.sample_period_s, or raise measurement.min_window_s with "
    "workload.output_tokens (a round's window cannot outlast its decode)",
    "clock_not_reached": "the observed clock missed the lock: set measurement.settle to a "
    'longer wait in seconds (time it with `dvfs gpu settle`; "measured" times one change at '
    "session start) or drop clocks the GPU cannot hold; a GPU above it lost its lock "
    "outside dvfs (`nvidia-smi -rgc`, a GPU reset): keep other tools off the GPUs",
    "throttled": "the GPU slowed down for heat or a hardware brake, at a sampled instant (a "
    "clock-event reason) or between two (NVML's thermal or board-limit violation time grew "
    f"past {THROTTLE_VIOLATION_SHARE:.0%} of the cell's steady windows: the cube's "
    "throttle_violation_s): check its cooling and what else runs "
    "on it",
    "counter_stalled": "the energy counter did not advance over a window, or went backwards "
    "in it: a window shorter than the counter's update period (the cube's "
    "counter_update_period_s) sees no update, so raise workload.output_tokens (a round's "
    "window cannot outlast its decode); with longer windows, or a counter reset (a driver "
    "reload or GPU reset), check the driver and GPU with `dvfs doctor`",
    "no_steady_window": "no steady-state decode window was found: raise workload.output_tokens",
    "drift_not_cancelled": "every in-flight decode ended before the levels' second visits, "
    "each level at its own place along the decode (its drift neither cancelled nor fitted): "
    "raise engine.sglang.request_timeout_s, lower measurement.min_window_s, or measure them "
    'with measurement.mode = "per-level"',
    "power_limit_not_held": "the GPU's power limit was not the cell's: something outside dvfs "
    "changed it (`nvidia-smi -pl`, a GPU reset) or enforces a lower one (a BMC or rack cap; "
    "`dvfs gpu info` shows the enforced limit): remove it or drop the limits above it",
    "clock_held_low": "a stock-clock cell ran below the maximum clock with no power, thermal "
    "or hardware reason: a clock lock or applications clocks set outside dvfs (NVML "
    "cannot read them back); unlock them "
    "(`nvidia-smi -rgc`, `-rac`) before sweeping; or a sync-boost group (SyncBoost) held it "
    "to another GPU's clock: take the GPU out of the group",
    "foreign_process": "another tenant's compute process was on a metered GPU (its energy is "
    "in the cell's, and it competed for the GPU): the journal's cell records name it; sweep "
    "on GPUs nothing else uses (`dvfs doctor` warns of what runs on them)",
}


def invalid_reasons(ds: xr.Dataset) -> tuple[int, list[tuple[str, int]]]:
    """How many measured cells are invalid, and the invalidating flags they raised, most
    frequent first (a cell may raise several)."""
    from dvfs.measure.meter import INVALIDATING

    status = ds["cell_status"].values
    bad = (ds["valid"].values == 0) & (status == STATUS_OK)
    flags: dict[str, int] = {}
    if "quality" in ds:
        for value in ds["quality"].values[bad]:
            if value == value:  # NaN: no quality recorded
                for name in describe_quality(int(value) & INVALIDATING):
                    flags[name] = flags.get(name, 0) + 1
    return int(bad.sum()), sorted(flags.items(), key=lambda kv: (-kv[1], kv[0]))


def invalid_summary(ds: xr.Dataset, *, top: int = 2) -> str | None:
    """One line on a cube's invalid cells and what to change for the commonest reasons (None:
    none invalid): invalid cells are never chosen by an analysis, so a sweep that leaves many
    has not finished its job even though nothing failed."""
    count, flags = invalid_reasons(ds)
    if not count:
        return None
    shown = flags[:top]
    reasons = "; ".join(
        f"{name} x{n}: {INVALID_ADVICE.get(name, 'see `dvfs cube info`')}" for name, n in shown
    )
    more = f"; {len(flags) - top} more flag(s) in `dvfs cube info`" if len(flags) > top else ""
    return (
        f"{count} of {int((ds['cell_status'].values == STATUS_OK).sum())} measured cell(s) are "
        f"invalid, so no analysis will choose them ({reasons}{more}); after changing the "
        "campaign, sweep again with --fresh or into another --out folder"
    )
