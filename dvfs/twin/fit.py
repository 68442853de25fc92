"""Calibrating the twin's GPU from measurements: today from a roofline file (`dvfs gpu roofline`).

From the roofline the fit sets what the twin's physics uses for one GPU:
- `gemm_efficiency`: the fastest compute-bound GEMM's FLOP/s (its memory time's share and its
  tile and wave quantisation at its M taken off: the large-M figure, `_gemm_peaks`) over the
  datasheet peak, least squares over the clocks (the twin's compute time scales as 1/f); the
  M-dependent efficiency is kept beside it;
- `hbm_efficiency` and `bandwidth_knee_mhz`: the bandwidth curve of `physics.bandwidth_bytes_s`
  over the clocks (the knee by a 1-D search, the efficiency in closed form; with one clock the
  base profile's knee is kept);
- `idle_power_w`, `sm_active_power_w`, `tensor_power_w`, `memory_power_w`: non-negative least
  squares of each kernel's power against the physics' power model, when energy was measured;
  the idle power is the one read at the idle clock (a reading at a raised clock has the base's
  idle-clock power taken off), and `idle_clock_power_w` comes from the idle power read right
  after the kernels, at the clock they left behind;
- the die's leakage: each reading's power holds the leakage of the temperature it was read at.
  Where the file records the temperatures, the base's `leakage_w_per_c` times each reading's
  rise over the idle temperature is taken off before the power fit, and the twin adds its own
  leakage back as its die heats; where it does not (an earlier dvfs), the fitted power figures
  take the leakage in, so `leakage_w_per_c` is set to 0 rather than counted twice.
So the fitted twin measures the file's roofline again: its achievable (large-M) ridge point
(`achievable_ridge_point`) is that of the compute-bound GEMM's large-M FLOP/s.
A sweep cube is the other input kind (`dvfs.twin.fitcube`); `fit_input_kind` says which a file
is. Both write the same profile file (`profile_toml`, read back by `load_profile`), which
`registered_profile` lets a campaign run on (`dvfs twin predict`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dvfs.errors import CampaignError, DvfsError
from dvfs.toml_text import refuse_beyond_64_bits, toml_value
from dvfs.twin import physics
from dvfs.twin.profiles import GpuProfile, spelled_key

if TYPE_CHECKING:
    import xarray as xr

PROFILE_SCHEMA = "dvfs.twin-profile/1"


class FitError(DvfsError):
    """The measurements cannot calibrate the twin (nothing measured, no clock, ...)."""

    exit_code = 2


def fit_input_kind(path: Path) -> str | None:
    """What `dvfs twin fit` was given: "roofline", "cube" (a cube file or a sweep folder), or
    None for neither, read from the file's schema attribute."""
    import xarray as xr

    from dvfs.roofline.store import SCHEMA

    if path.is_dir():
        return "cube" if (path / "cube.nc").is_file() else None
    if not path.is_file():  # a FIFO would be waited on for ever, and is neither
        return None
    from dvfs.errors import NetcdfPathError
    from dvfs.outputs import netcdf_path_problem

    problem = netcdf_path_problem(path, writing=False)
    if problem:  # exit 1, as every reader of a cube or roofline file refuses it
        raise NetcdfPathError(problem)
    try:
        with xr.open_dataset(path) as ds:
            attrs = dict(ds.attrs)
    except (OSError, ValueError):
        return None
    if attrs.get("schema") == SCHEMA:
        return "roofline"
    return "cube" if "dvfs_schema" in attrs else None


def datasheet_flops(gpu: GpuProfile, sm_clock_mhz: Any) -> Any:
    """Dense tensor FLOP/s at a clock with no efficiency applied."""
    return gpu.sm_count * gpu.flop_per_clk_per_sm * np.asarray(sm_clock_mhz, dtype=float) * 1e6


def achievable_ridge_point(gpu: GpuProfile, sm_clock_mhz: float) -> float:
    """The ridge the twin's physics runs into: its achievable FLOP/s over its achievable
    bandwidth at this clock (efficiencies and bandwidth knee applied), the quantity a measured
    roofline reports."""
    f = float(sm_clock_mhz)
    return float(gpu.peak_flops(f) / physics.bandwidth_bytes_s(gpu, f))


@dataclass(frozen=True)
class RooflineFit:
    """A fitted profile, how well it reproduces the file, and what was kept from the base."""

    profile: GpuProfile
    base: str
    source: str
    fitted: tuple[str, ...]
    residuals: dict[str, float]
    gemm_tokens: tuple[int, ...]
    gemm_efficiency_by_tokens: dict[str, tuple[float, ...]]
    notes: tuple[str, ...]


def _clocks(ds: xr.Dataset, base: GpuProfile, notes: list[str]) -> np.ndarray:
    clocks = ds["sm_clock_mhz"].values.astype(float)
    if np.isnan(clocks).any():
        notes.append(
            f"no SM clock recorded (a run without a GPU): taken as {base.key}'s top clock "
            f"{base.max_sm_clock_mhz} MHz"
        )
        clocks = np.where(np.isnan(clocks), float(base.max_sm_clock_mhz), clocks)
    return clocks


def _seen_clocks(ds: xr.Dataset, clocks: np.ndarray) -> np.ndarray:
    """Per (setting, kernel), the SM clock read while the kernel ran, else the setting's:
    a power cap pulls a big GEMM below its lock, and its FLOP/s follow the clock it ran at."""
    grid = np.broadcast_to(clocks[:, None], (len(clocks), ds.sizes["kernel"]))
    if "observed_sm_clock_mhz" not in ds:
        return grid
    seen = ds["observed_sm_clock_mhz"].transpose("setting", "kernel").values.astype(float)
    return np.where(np.isfinite(seen), seen, grid)


#: A GEMM whose compute time (its time less its memory time, as the physics' soft maximum
#: adds the two) is below this share of its time is too memory-bound to tell the GEMM
#: efficiency.
COMPUTE_BOUND_SHARE = 0.5


def _gemm_peaks(
    ds: xr.Dataset, base: GpuProfile, seen: np.ndarray, bandwidth: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per setting: the large-M FLOP/s of its fastest compute-bound GEMM (its memory
    time taken off and its tile and wave quantisation, `physics.gemm_efficiency`, undone: the
    profile's figure is the large-M one, which the twin quantises again), the clock that GEMM
    ran at, and whether the setting had one (NaN FLOP/s where not)."""
    dims = ("setting", "kernel")
    seconds = ds["seconds"].transpose(*dims).values.astype(float)
    flops = ds["flops"].values.astype(float)[None, :]
    memory_s = ds["bytes"].values.astype(float)[None, :] / bandwidth[:, None]
    rows = physics.gemm_efficiency(
        dataclasses.replace(base, gemm_efficiency=1.0), ds["m"].values.astype(float)
    )[None, :]
    p = physics.ROOFLINE_BLEND
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        compute_s = np.power(np.maximum(seconds**p - memory_s**p, 0.0), 1.0 / p)
        rate = flops / compute_s / rows
        eff = rate / datasheet_flops(base, seen)
    usable = (
        (ds["kind"].values == "gemm")[None, :]
        & np.isfinite(eff)
        & (eff > 0)
        & (compute_s >= COMPUTE_BOUND_SHARE * seconds)
    )
    # the fastest (not the one its quantisation flatters most: few rows, large corrections)
    best = np.where(usable, flops / seconds, -1.0).argmax(axis=1)
    at = np.arange(len(best))
    bound = usable[at, best]
    return np.where(bound, rate[at, best], math.nan), seen[at, best], bound


def _bandwidth(
    base: GpuProfile, clocks: np.ndarray, measured: np.ndarray
) -> tuple[float, float, float]:
    """(hbm_efficiency, knee, relative RMS) minimising the relative error of the physics'
    bandwidth curve; the knee is searched only when there are several clocks."""

    def solve(knee: float) -> tuple[float, float]:
        unit = dataclasses.replace(base, hbm_efficiency=1.0, bandwidth_knee_mhz=knee)
        g = np.asarray(physics.bandwidth_bytes_s(unit, clocks)) / measured
        eff = float(np.sum(g) / np.sum(g * g))
        return eff, float(np.sqrt(np.mean((eff * g - 1.0) ** 2)))

    if len(np.unique(clocks)) < 2:
        eff, rms = solve(base.bandwidth_knee_mhz)
        return eff, base.bandwidth_knee_mhz, rms
    knees = np.arange(50.0, float(base.max_sm_clock_mhz) + 1.0, 5.0)
    scored = [(solve(k)[1], k) for k in knees]
    _, knee = min(scored)
    eff, rms = solve(float(knee))
    return eff, float(knee), rms


def _leakage_rise(ds: xr.Dataset, base: GpuProfile) -> tuple[np.ndarray, float] | None:
    """The base's leakage above the idle temperature in each kernel's power (setting x kernel)
    and in the raised idle reading, from the temperatures the file records; None where it
    records none for a kernel with power (the leakage then cannot be told apart)."""
    k = base.leakage_w_per_c
    dims = ("setting", "kernel")
    power = ds["power_w"].transpose(*dims).values
    if not k:
        return np.zeros(power.shape), 0.0
    idle_c = float(ds.attrs.get("idle_temperature_c", math.nan))
    if "temperature_c" not in ds.variables or not math.isfinite(idle_c):
        return None
    hot = ds["temperature_c"].transpose(*dims).values.astype(float)
    if not np.isfinite(hot[np.isfinite(power)]).all():
        return None
    raised_c = float(ds.attrs.get("raised_idle_temperature_c", math.nan))
    raised = k * (raised_c - idle_c) if math.isfinite(raised_c) else 0.0
    return np.where(np.isfinite(hot), k * (hot - idle_c), 0.0), raised


def _power(
    ds: xr.Dataset, base: GpuProfile, seen: np.ndarray, gemm_eff: float, notes: list[str]
) -> tuple[dict[str, float], float, bool] | None:
    """Power coefficients by non-negative least squares, and whether the leakage was taken
    off the readings (`_leakage_rise`); None without energy."""
    from scipy.optimize import nnls

    dims = ("setting", "kernel")
    power = ds["power_w"].transpose(*dims).values
    idle = float(ds.attrs.get("idle_power_w", math.nan))
    if not np.isfinite(power).any() or not math.isfinite(idle):
        return None
    rise = _leakage_rise(ds, base)
    if rise is not None:
        power = power - rise[0]
        most = float(np.nanmax(np.abs(rise[0]))) if rise[0].size else 0.0
        if most > 0:
            notes.append(
                f"the kernels' leakage off the idle temperature (up to {most:.1f} W at "
                f"{base.key}'s {base.leakage_w_per_c:g} W/degC) taken off before the power fit: "
                "the twin adds its own as its die heats"
            )
    idle, idle_figures = _idle_figures(ds, base, idle, notes, 0.0 if rise is None else rise[1])
    scale = np.asarray(physics.dynamic_scale(base, seen))
    peak = datasheet_flops(base, seen) * gemm_eff
    tensor_util = np.minimum(ds["flop_s"].transpose(*dims).values / peak, 1.0)
    memory_util = ds["bytes_s"].transpose(*dims).values / (base.hbm_bandwidth_gb_s * 1e9)
    ok = np.isfinite(power) & np.isfinite(tensor_util) & np.isfinite(memory_util)
    if not ok.any():
        return None
    a = np.column_stack([scale[ok], (tensor_util * scale)[ok], memory_util[ok]])
    coef, _ = nnls(a, power[ok] - idle)
    rms = float(np.sqrt(np.mean((a @ coef - (power[ok] - idle)) ** 2)))
    names = ("sm_active_power_w", "tensor_power_w", "memory_power_w")
    figures = {**idle_figures, **dict(zip(names, map(float, coef), strict=True))}
    return figures, rms, rise is not None


#: MHz above the profile's idle clock at which an idle reading counts as at a raised clock.
IDLE_CLOCK_TOLERANCE_MHZ = 15.0


def _raised_fraction(base: GpuProfile, mhz: float) -> float:
    """How much of the idle-clock power an idle GPU at `mhz` draws (0 at the idle clock, 1 at
    the top clock), as `traps.idle_power_w` scales it."""
    low = float(physics.dynamic_scale(base, base.idle_sm_clock_mhz))
    return (float(physics.dynamic_scale(base, mhz)) - low) / (1.0 - low)


def _idle_figures(
    ds: xr.Dataset, base: GpuProfile, idle: float, notes: list[str], raised_leakage_w: float
) -> tuple[float, dict[str, float]]:
    """The idle power at the idle clock (the kernels' baseline) and the idle figures fitted;
    `raised_leakage_w`: the leakage the raised reading holds over the idle one's."""
    from dvfs.twin import traps

    raised_at = base.idle_sm_clock_mhz + IDLE_CLOCK_TOLERANCE_MHZ
    clock = float(ds.attrs.get("idle_sm_clock_mhz", math.nan))
    if not math.isfinite(clock):
        notes.append(
            "the roofline does not say at which SM clock its idle power was read (an earlier "
            "dvfs read it after the kernels' warm-up, the clock still raised): idle_power_w "
            "may hold a raised clock's idle power; measure again with this dvfs"
        )
    elif clock > raised_at:
        extra = traps.idle_power_w(base, clock) - base.idle_power_w
        idle -= extra
        notes.append(
            f"the idle power was read at {clock:.0f} MHz, above the idle clock "
            f"({base.idle_sm_clock_mhz} MHz): {base.key}'s idle-clock power there "
            f"({extra:.1f} W) is taken off"
        )
    figures = {"idle_power_w": idle}
    raised = float(ds.attrs.get("raised_idle_power_w", math.nan)) - raised_leakage_w
    raised_clock = float(ds.attrs.get("raised_idle_sm_clock_mhz", math.nan))
    if math.isfinite(raised) and math.isfinite(raised_clock) and raised_clock > raised_at:
        share = _raised_fraction(base, raised_clock)
        figures["idle_clock_power_w"] = max(0.0, (raised - idle) / share)
    else:
        notes.append(
            f"no idle power read at a raised clock: idle_clock_power_w kept from {base.key}"
        )
    return idle, figures


def _raise_peaks(
    base: GpuProfile, gemm_eff: float, hbm_eff: float, notes: list[str]
) -> tuple[GpuProfile, dict[str, Any]]:
    """`base` with the peak a measurement outran raised to it, and the figures raised: an
    efficiency above 1 (a GPU faster than the base, as a `--base` of another model fits it)
    is no share of a peak, and `load_profile` refuses it. The base's FLOP/s per clock per SM
    (a whole number: rounded up, the GEMM efficiency just under 1) or its HBM bandwidth (the
    efficiency 1) becomes the measured one; the twin's achievable FLOP/s and bandwidth (peak
    times efficiency) are the fit's either way."""
    raised: dict[str, Any] = {}
    if gemm_eff > 1.0:
        per_sm = math.ceil(base.flop_per_clk_per_sm * gemm_eff)
        raised["flop_per_clk_per_sm"] = per_sm
        notes.append(
            f"the GEMMs ran at {gemm_eff:.3f} times {base.key}'s peak FLOP/s, a faster GPU "
            f"(an efficiency is at most 1): flop_per_clk_per_sm is raised from "
            f"{base.flop_per_clk_per_sm} to {per_sm}; is {base.key} the right base?"
        )
    if hbm_eff > 1.0:
        bandwidth = base.hbm_bandwidth_gb_s * hbm_eff
        raised["hbm_bandwidth_gb_s"] = bandwidth
        notes.append(
            f"the bandwidth kernels ran at {hbm_eff:.3f} times {base.key}'s HBM bandwidth, a "
            f"faster memory (an efficiency is at most 1): hbm_bandwidth_gb_s is raised from "
            f"{base.hbm_bandwidth_gb_s:g} to {bandwidth:.6g}, hbm_efficiency 1; is {base.key} "
            "the right base?"
        )
    return (dataclasses.replace(base, **raised) if raised else base), raised


def fit_roofline(
    ds: xr.Dataset, base: GpuProfile, *, key: str | None = None, source: str = ""
) -> RooflineFit:
    """Fit `base`'s compute, memory and power figures to a roofline dataset (`store.read`)."""
    notes: list[str] = []
    clocks = _clocks(ds, base, notes)
    peak = ds["peak_flop_s"].values.astype(float)
    bandwidth = ds["bandwidth_bytes_s"].values.astype(float)
    if not (np.isfinite(peak).all() and np.isfinite(bandwidth).all()) or (peak <= 0).any():
        raise FitError(f"{source or 'the roofline'} has no positive FLOP/s or bandwidth to fit")
    if not (ds["kind"] == "bandwidth").any():
        raise FitError(
            f"{source or 'the roofline'} has no bandwidth kernel (triad or copy): measure again "
            "with `dvfs gpu roofline -o FILE`"
        )
    seen = _seen_clocks(ds, clocks)
    compute_peak, compute_clocks, bound = _gemm_peaks(ds, base, seen, bandwidth)
    capped = bound & (compute_clocks < clocks - 1)
    if capped.any():
        notes.append(
            f"the best GEMM ran below the setting's clock at {int(capped.sum())} setting(s) "
            "(power limit): its FLOP/s are fitted at the clock it ran at"
        )
    d = datasheet_flops(base, compute_clocks[bound])
    if bound.any():
        gemm_eff = float(np.sum(compute_peak[bound] * d) / np.sum(d * d))
    else:
        gemm_eff = base.gemm_efficiency
        gemm_m = ds["m"].values[ds["kind"].values == "gemm"]
        notes.append(
            (
                f"no GEMM ran compute-bound (the largest M is {int(gemm_m.max())})"
                if len(gemm_m)
                else "no GEMM measured"
            )
            + f": gemm_efficiency kept from {base.key}; measure with larger --tokens"
        )
    hbm_eff, knee, bw_rms = _bandwidth(base, clocks, bandwidth)
    base, raised = _raise_peaks(base, gemm_eff, hbm_eff, notes)
    if "flop_per_clk_per_sm" in raised:  # the same FLOP/s, a share of the raised peak
        d = datasheet_flops(base, compute_clocks[bound])
        gemm_eff = min(1.0, float(np.sum(compute_peak[bound] * d) / np.sum(d * d)))
    hbm_eff = min(hbm_eff, 1.0)
    changes: dict[str, Any] = {
        "gemm_efficiency": gemm_eff,
        "hbm_efficiency": hbm_eff,
        "bandwidth_knee_mhz": knee,
        **raised,
    }
    residuals = {
        "peak_flop_s_rel_rms": (
            float(np.sqrt(np.mean((gemm_eff * d / compute_peak[bound] - 1.0) ** 2)))
            if bound.any()
            else math.nan
        ),
        "bandwidth_rel_rms": bw_rms,
    }
    if len(np.unique(clocks)) < 2:
        notes.append(f"one clock measured: bandwidth knee kept from {base.key} ({knee:g} MHz)")
    power = _power(ds, base, seen, gemm_eff, notes)
    if power is None:
        notes.append(f"no energy in the roofline: power coefficients kept from {base.key}")
    else:
        changes.update(power[0])
        residuals["power_rms_w"] = power[1]
    profile = dataclasses.replace(base, key=key or f"{base.key}-fit", **changes)
    if power is not None and not power[2]:
        # The readings' leakage is in the fitted power figures: the twin adding the base's
        # on top as its die heats would count it twice.
        profile = dataclasses.replace(profile, leakage_w_per_c=0.0)
        notes.append(
            "the roofline records no temperatures (an earlier dvfs, or a GPU that cannot report "
            "them): its powers hold the die's leakage, which the fitted power figures take in, "
            f"so leakage_w_per_c of {base.key} ({base.leakage_w_per_c:g}) is set to 0"
        )
    # Where a power cap held the best GEMM below its lock, its FLOP/s are the capped clock's.
    # The ridge of the compute-bound GEMMs' large-M FLOP/s, as the twin's physics runs into it
    ridge = np.array(
        [
            achievable_ridge_point(profile, f) * fc / f
            for f, fc in zip(clocks[bound], compute_clocks[bound], strict=True)
        ]
    )
    measured_ridge = compute_peak[bound] / bandwidth[bound]
    residuals["ridge_rel_max"] = (
        float(np.max(np.abs(ridge / measured_ridge - 1.0))) if bound.any() else math.nan
    )
    tokens, by_shape = _gemm_curve(ds, base, clocks, seen)
    base_key = spelled_key(base)
    return RooflineFit(
        profile, base_key, source, tuple(changes), residuals, tokens, by_shape, tuple(notes)
    )


def _gemm_curve(
    ds: xr.Dataset, base: GpuProfile, clocks: np.ndarray, seen: np.ndarray
) -> tuple[tuple[int, ...], dict[str, tuple[float, ...]]]:
    """GEMM efficiency against the datasheet (at the clock each GEMM ran at) by token count M,
    per shape, at the top setting."""
    top = int(np.argmax(clocks))
    at = ds.isel(setting=top)
    gemm = at["kind"].values == "gemm"
    names = [str(n) for n in at["kernel"].values[gemm]]
    shapes = sorted({n.split("-")[1] for n in names})
    tokens = tuple(sorted({int(m) for m in at["m"].values[gemm]}))
    peaks = datasheet_flops(base, seen[top][gemm])
    rate = dict(zip(names, at["flop_s"].values[gemm] / peaks, strict=True))
    curve = {s: tuple(float(rate.get(f"gemm-{s}-m{m}", math.nan)) for m in tokens) for s in shapes}
    return tokens, curve


# -- the profile file ------------------------------------------------------------------------


def profile_toml(fit: Any) -> str:
    """The fitted profile (a `RooflineFit` or a `fitcube.CubeFit`) as TOML: `[gpu.<key>]` holds
    exactly the twin's GPU fields (as in dvfs/twin/data/gpus.toml), `[fit]` the provenance and
    residuals, with the M-dependence of a roofline fit or, for a cube fit, each figure's base
    value and standard error and each observable's worst cell."""
    lines = [
        f"# Twin GPU profile fitted by `dvfs twin fit` from {fit.source or 'measurements'}",
        f"# (base profile {fit.base}). Fitted: {', '.join(fit.fitted)}; the rest is the base's.",
        "",
        "[fit]",
        f"schema = {toml_value(PROFILE_SCHEMA)}",
        f"source = {toml_value(fit.source)}",
        f"base = {toml_value(fit.base)}",
        f"fitted = {toml_value(list(fit.fitted))}",
        f"notes = {toml_value(list(fit.notes))}",
        *(
            [f"undetermined = {toml_value(list(fit.undetermined))}"]
            if hasattr(fit, "undetermined")
            else []
        ),
        *([f"warnings = {toml_value(list(fit.warnings))}"] if getattr(fit, "warnings", ()) else []),
        "",
        "[fit.residuals]",
        *(f"{k} = {toml_value(v)}" for k, v in fit.residuals.items()),
        "",
    ]
    worst = getattr(fit, "worst_cells", None)
    if worst is not None:  # a cube fit
        lines += [
            "[fit.worst_cells]  # per observable, the cell with the largest relative error",
            *(f"{k} = {toml_value(v)}" for k, v in worst.items()),
            "",
            "[fit.base_values]  # each fitted figure before the fit",
            *(f"{k} = {toml_value(v)}" for k, v in fit.base_values.items()),
            "",
            "[fit.std_errors]  # from the fit's Jacobian, scaled by its residuals",
            *(f"{k} = {toml_value(v)}" for k, v in fit.std_errors.items()),
            "",
        ]
    if fit.gemm_tokens:
        lines += [
            "[fit.gemm_efficiency_by_tokens]  # FLOP/s over the datasheet peak, at the top clock",
            f"tokens = {toml_value(list(fit.gemm_tokens))}",
            *(f"{s} = {toml_value(list(v))}" for s, v in fit.gemm_efficiency_by_tokens.items()),
            "",
        ]
    lines.append(f'[gpu."{fit.profile.key}"]')
    for f in fields(GpuProfile):
        if f.name != "key":
            lines.append(f"{f.name} = {toml_value(getattr(fit.profile, f.name))}")
    return "\n".join(lines) + "\n"


def load_profile(path: Path) -> GpuProfile:
    """The GPU profile of a file `profile_toml` wrote (one `[gpu.<key>]` table)."""
    import tomllib

    from dvfs.inputs import MAX_SETTINGS_BYTES, TOO_DEEP, read_text_limited

    try:
        data = tomllib.loads(
            read_text_limited(path, MAX_SETTINGS_BYTES, CampaignError, "twin profile")
        )
    except (OSError, ValueError) as exc:
        raise CampaignError(f"{path} is not a readable TOML profile ({exc})") from exc
    except RecursionError as exc:
        raise CampaignError(f"{path} is not a readable TOML profile ({TOO_DEEP})") from exc
    refuse_beyond_64_bits(data, str(path), CampaignError)
    tables = data.get("gpu")
    if not isinstance(tables, dict) or len(tables) != 1:
        raise CampaignError(f"{path} holds no single [gpu.<name>] table (a `dvfs twin fit` file)")
    [(key, table)] = tables.items()
    known = {f.name for f in fields(GpuProfile)} - {"key"}
    if not isinstance(table, dict):  # `[gpu] x = 1`: a value where the table should be
        raise CampaignError(
            f"{path}: gpu.{key} holds {table!r}, not the [gpu.{key}] table of a "
            "`dvfs twin fit` file"
        )
    if set(table) != known:
        missing, extra = sorted(known - set(table)), sorted(set(table) - known)
        raise CampaignError(f"{path} [gpu.{key}]: missing {missing}, unknown {extra}")
    for f in fields(GpuProfile):
        if f.name == "key":
            continue
        value = table[f.name]
        if f.type == "str":
            ok = isinstance(value, str)
        elif f.type == "int":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            ok = ok and math.isfinite(value) and value >= 0
        positive = f.name in _POSITIVE
        if ok and positive:
            ok = value > 0
        if f.name in _SHARES:
            if not (ok and value <= 1):
                raise CampaignError(
                    f"{path} [gpu.{key}]: {f.name} = {value!r} is not in (0, 1], " + _SHARES[f.name]
                )
            continue
        if not ok:
            kind = {"str": "a string", "int": "an integer"}.get(str(f.type), "a number")
            kind += "" if kind == "a string" else " > 0" if positive else " >= 0"
            raise CampaignError(
                f"{path} [gpu.{key}]: {f.name} = {value!r} is not {kind}; write the profile "
                "again with `dvfs twin fit`"
            )
    _refuse_far_beyond_shipped(path, key, table)
    for low, high in _ORDERED:
        if table[low] > table[high]:
            raise CampaignError(
                f"{path} [gpu.{key}]: {low} = {table[low]!r} is above {high} = {table[high]!r}"
            )
    # The die's leakage heats it, which leaks more: a loop gain of 1 or more never settles.
    gain = table["thermal_c_per_w"] * table["leakage_w_per_c"]
    if gain >= 1.0:
        raise CampaignError(
            f"{path} [gpu.{key}]: thermal_c_per_w x leakage_w_per_c = {gain:g} is not below 1 "
            "(the die would heat without bound): lower one of them"
        )
    return GpuProfile(key=key, **table)


#: A profile file's figure may be at most this many times the largest the twin's shipped GPUs
#: state: further is no GPU (a typo, a unit slip), and there the twin's arithmetic breaks down
#: (times past int64 nanoseconds, a sweep that never ends, an exp that overflows).
BEYOND_SHIPPED = 1000.0


def _refuse_far_beyond_shipped(path: Path, key: str, table: dict[str, Any]) -> None:
    """A figure `BEYOND_SHIPPED` times the shipped GPUs' largest is refused in one line (a
    host overhead of 1e6 s ran a prediction out of memory; a settle time or a counter period
    of 1e300 s, a bandwidth knee of 1e300 MHz, were internal errors)."""
    from dvfs.twin import profiles

    shipped = list(profiles.gpu_profiles().values())
    for f in fields(GpuProfile):
        value = table.get(f.name)
        if f.type == "str" or not isinstance(value, int | float):
            continue
        most = max(float(getattr(p, f.name)) for p in shipped)
        if most > 0 and value > BEYOND_SHIPPED * most:
            raise CampaignError(
                f"{path} [gpu.{key}]: {f.name} = {value!r} is over {BEYOND_SHIPPED:g} times the "
                f"twin's own GPUs' ({most:g}), beyond any GPU: write the profile again with "
                "`dvfs twin fit`"
            )


#: Profile figures the twin divides by or steps with: zero is no GPU.
_POSITIVE = frozenset(
    {
        "sm_count",
        "flop_per_clk_per_sm",
        "gemm_efficiency",
        "hbm_bandwidth_gb_s",
        "hbm_efficiency",
        "memory_clock_mhz",
        "memory_gb",
        "max_sm_clock_mhz",
        "min_sm_clock_mhz",
        "sm_clock_step_mhz",
        "idle_sm_clock_mhz",
        "power_limit_min_w",
        "power_limit_max_w",
        "power_limit_default_w",
        "voltage_min_v",
        "voltage_max_v",
        "nvlink_gb_s",
    }
)
#: Efficiencies: shares of a peak, in (0, 1]; above 1 the twin's GPU would outrun its own
#: datasheet figures. Each with what it is a share of (and where a faster GPU's figure goes).
_SHARES = {
    "gemm_efficiency": "a share of the profile's peak FLOP/s (for a faster GPU raise sm_count "
    "or flop_per_clk_per_sm)",
    "hbm_efficiency": "a share of hbm_bandwidth_gb_s (for a faster memory raise that)",
    "verify_attention_efficiency": "a share of plain decode attention's bandwidth",
}
#: Pairs (low, high) a profile must keep in order.
_ORDERED = (
    ("min_sm_clock_mhz", "max_sm_clock_mhz"),
    # NVML's idle clock may lie below the lowest lockable clock, never above the highest.
    ("idle_sm_clock_mhz", "max_sm_clock_mhz"),
    ("power_limit_min_w", "power_limit_default_w"),
    ("power_limit_default_w", "power_limit_max_w"),
    ("voltage_min_v", "voltage_max_v"),
)


@contextlib.contextmanager
def registered_profile(profile: GpuProfile) -> Iterator[str]:
    """Let `profiles.gpu_profile(profile.key)` (and so a campaign's `gpu.profile`, with a trap
    list after a colon too) find a profile read from a file, until the block ends; yields
    its key. A key the twin ships is refused unless the profile is that one."""
    from dvfs.twin import profiles

    known = profiles.gpu_profiles()
    shipped = known.get(profile.key)
    if shipped is not None and shipped != profile:
        raise CampaignError(
            f"profile {profile.key!r} has the name of a profile the twin ships but other figures: "
            "give it another name (`dvfs twin fit --name`)"
        )
    known[profile.key] = profile
    profiles.gpu_profile.cache_clear()
    try:
        yield profile.key
    finally:
        if shipped is None:
            known.pop(profile.key, None)
        profiles.gpu_profile.cache_clear()


def profile_digest(profile: GpuProfile) -> str:
    """What a journal binds of a profile read from a file (`GpuConfig.profile_digest`): a
    digest of its figures, key included, so a sweep refuses to resume with another fit's
    numbers under the same key. Empty for a profile the twin ships, unchanged: its key names
    its figures, and a campaign swept on it keeps the hash it has with `--twin`. Call it
    before `registered_profile` lends the profile (a lent one looks shipped)."""
    import hashlib
    import json

    from dvfs.twin import profiles

    if profiles.gpu_profiles().get(profile.key) == profile:
        return ""
    blob = json.dumps(dataclasses.asdict(profile), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
