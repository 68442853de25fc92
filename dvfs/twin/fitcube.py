"""Calibrating the twin's GPU from a measured sweep cube (`dvfs twin fit CUBE`).

The free figures of a `GpuProfile` (`CUBE_FIT_PARAMETERS`: each with the bounds the search
keeps it in) are fitted by bounded least squares (`scipy.optimize.least_squares`) so that the
twin's own physics, predicting each measured cell deterministically (`dvfs.twin.predict`),
reproduces the cube's energy per token, time per token and mean power (`predict.OBSERVABLES`).
Residuals are relative (each cell's prediction over its measurement, less one), so a 60 W cell
and a 600 W cell weigh alike. A weak pull towards the base profile (`PRIOR_WEIGHT` per
relative unit) keeps a figure the cube cannot see at all (tensor power when every cell is
memory-bound decode, say) at the base's value; a figure the cube hardly constrains can still
drift far, pushed by a model error or a trade with another figure. The fit says which figures
the cube hardly constrains (`CubeFit.undetermined`): in a note those that stayed within
`NEAR_REL` of the base, in a warning those that moved further (`CubeFit.warnings`).

Figures that lengthen every pass alike trade against each other (host overhead against kernel
cycles and HBM efficiency): a cube tells them apart only through cells that differ in clock,
batch and context, and a residual model error of 0.1% moves them by ~10% (tested on a twin
cube: tests/test_twin_fit_cube.py). The standard errors are statistical only.

A new GpuProfile figure is fitted by appending one `FitParameter` line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dvfs.twin.fit import FitError
from dvfs.twin.predict import OBSERVABLES, CubeCells, predict
from dvfs.twin.profiles import GpuProfile, spelled_key


@dataclass(frozen=True)
class FitParameter:
    """A GpuProfile field the cube fit sets, and the physically sensible range it searches."""

    name: str
    lower: float
    upper: float


#: The figures `dvfs twin fit CUBE` fits, in GpuProfile's units. Append a line to fit another.
CUBE_FIT_PARAMETERS: tuple[FitParameter, ...] = (
    FitParameter("idle_power_w", 10.0, 400.0),
    FitParameter("sm_active_power_w", 0.0, 1000.0),
    FitParameter("tensor_power_w", 0.0, 2000.0),
    FitParameter("memory_power_w", 0.0, 1000.0),
    FitParameter("host_overhead_s", 0.0, 0.01),
    FitParameter("kernel_cycles_per_layer", 0.0, 200_000.0),
    FitParameter("bandwidth_knee_mhz", 100.0, 2500.0),
    FitParameter("gemm_efficiency", 0.05, 1.0),
    FitParameter("hbm_efficiency", 0.05, 1.0),
    # the speculative iteration's terms (physics.time_passes): told apart by the cube's
    # drafters, batches and draft-token counts
    FitParameter("verify_attention_efficiency", 0.05, 1.0),
    FitParameter("spec_host_per_step_s", 0.0, 0.01),
    FitParameter("spec_host_per_request_s", 0.0, 0.001),
    FitParameter("spec_host_per_token_s", 0.0, 0.001),
)

#: Weight of the pull of each fitted figure towards its base value, per relative unit, against
#: residuals that are relative errors per cell and observable: a figure the cells determine
#: moves freely; one they do not stays put.
PRIOR_WEIGHT = 1e-5
#: A figure whose standard error (from the fit's Jacobian, scaled by the residuals) exceeds
#: this share of its value is reported as undetermined by the cube.
UNDETERMINED_REL = 0.5
#: An undetermined figure within this share of its base value (of 1% of its range where the
#: base is 0) is "kept near" the base; one further away moved with nothing in the cube to
#: hold it (the pull towards the base, `PRIOR_WEIGHT`, is far too weak to stop a drift a
#: model error drives), and the fit warns of it: `dvfs twin predict` uses it as fitted.
NEAR_REL = 0.1
#: An eigenvalue of the cells' JᵀJ at or below this share of the largest is a direction the
#: cells do not see (as the pseudo-inverse's cut-off).
NULL_RCOND = 1e-12
#: A figure with more than this share of its unit vector in those directions is undetermined.
NULL_SHARE = 1e-6
#: The relative step of the finite differences: the power limit's clock search is discrete,
#: so the steps must be larger than the jitter it adds.
DIFF_STEP = 1e-3
#: At most this many first fits on the cells judged to have run at their lock.
STAGE_ROUNDS = 3
#: Each first fit stops after this many steps (each one Jacobian: a prediction per figure): a
#: first fit only finds where to start and which cells ran at their lock. One that has not
#: converged by then has stalled on cells the base wrongly judged unthrottled (their residuals
#: jump as the limit's clock search does), and judging again from where it got to is quicker
#: than polishing there (converged first fits take 10-20 steps; on 30 cubes the predictor made
#: from random figures this cut the fit's time by about a half, the figures found the same).
STAGE_MAX_NFEV = 20
#: The relative step of the first fits' finite differences. Their cells ran at their lock, so
#: no clock search jitters their residuals, and `DIFF_STEP`'s coarse differences there stall the
#: search short of the optimum where the figures trade closely (on cells the predictor itself
#: made: residuals of 1e-4 left and host_overhead_s 13% off, tests/test_twin_fit_cube.py).
STAGE_DIFF_STEP = 1e-5


@dataclass(frozen=True)
class CubeFit:
    """A profile fitted to a cube, how well it reproduces each observable, and what it kept."""

    profile: GpuProfile
    base: str
    source: str
    fitted: tuple[str, ...]
    #: Per observable: `<name>_rel_rms`, `<name>_rel_worst`; and the cells and evaluations.
    residuals: dict[str, float]
    #: Per observable, the cell whose relative error is largest.
    worst_cells: dict[str, str]
    base_values: dict[str, float]
    std_errors: dict[str, float]
    undetermined: tuple[str, ...]
    notes: tuple[str, ...]
    #: Figures the cube hardly constrains that moved far from the base all the same.
    warnings: tuple[str, ...] = ()
    #: The roofline fit's extras, empty here (the profile file has the same shape).
    gemm_tokens: tuple[int, ...] = ()
    gemm_efficiency_by_tokens: dict[str, tuple[float, ...]] = dataclasses.field(
        default_factory=dict
    )


def _with(base: GpuProfile, params: tuple[FitParameter, ...], values: np.ndarray) -> GpuProfile:
    return dataclasses.replace(
        base,
        **{p.name: float(v) for p, v in zip(params, values, strict=True)},  # type: ignore[arg-type]
    )


def _residuals(gpu: GpuProfile, cells: CubeCells) -> np.ndarray:
    predicted = predict(gpu, cells).values
    parts = []
    for name in OBSERVABLES:
        measured = cells.measured[name]
        ok = np.isfinite(measured) & (measured > 0)
        parts.append(np.where(ok, predicted[name] / np.where(ok, measured, 1.0) - 1.0, 0.0))
    return np.concatenate(parts)


def fit_cube_cells(
    cells: CubeCells,
    base: GpuProfile,
    *,
    key: str | None = None,
    source: str = "",
    params: tuple[FitParameter, ...] = CUBE_FIT_PARAMETERS,
) -> CubeFit:
    """Fit `params` of `base` to the measured cells (`predict.cube_cells`)."""
    notes = list(cells.notes)
    # an observable no cell records (finite, above 0) has zero residuals everywhere: the fit
    # sees the others alone, and the summary has no line for it
    unread = [
        name
        for name in OBSERVABLES
        if not (np.isfinite(cells.measured[name]) & (cells.measured[name] > 0)).any()
    ]
    if len(unread) == len(OBSERVABLES):
        raise FitError(
            f"{source or 'the cube'}: no cell records {', '.join(OBSERVABLES)} (finite and "
            "above 0): nothing to fit"
        )
    if unread:
        notes.append(
            f"no cell records {' or '.join(unread)} (finite and above 0): fitted on "
            f"{', '.join(n for n in OBSERVABLES if n not in unread)} alone"
        )
    lower = np.array([p.lower for p in params])
    upper = np.array([p.upper for p in params])
    start = np.array([float(getattr(base, p.name)) for p in params])
    clipped = np.clip(start, lower, upper)
    for p, s, c in zip(params, start, clipped, strict=True):
        if s != c:
            notes.append(
                f"{p.name} of {base.key} ({s:g}) is outside the fit's range: starts at {c:g}"
            )
    # Searched in units of the base's value (or of the range where the base is 0), so every
    # figure moves on the same scale and the pull towards the base is relative.
    unit = np.where(clipped > 0, clipped, (upper - lower) * 0.01)
    x0 = clipped / unit
    bounds = (lower / unit, upper / unit)
    # The power limit's clock search is discrete (15-MHz steps): a throttled cell's residual
    # jumps as the figures move, which stalls the search far from the optimum. So the figures
    # are first fitted on the cells that ran at their lock (by the sampled clock where the
    # cube has it, and by the base's prediction), then refined on every cell from there.
    # Which cells ran at their lock is judged again with each first fit's figures, until it
    # stays the same (a few rounds at most).
    x, evaluations = x0, 0
    free = _unthrottled(cells, base)
    for _ in range(STAGE_ROUNDS):
        if int(free.sum()) <= len(params) or free.all():
            break
        first = _solve(
            cells.subset(free),
            base,
            params,
            unit,
            x0,
            x,
            bounds,
            source,
            STAGE_MAX_NFEV,
            diff_step=STAGE_DIFF_STEP,
        )
        x, evaluations = first.x, evaluations + int(first.nfev)
        again = _unthrottled(cells, _with(base, params, x * unit))
        if np.array_equal(again, free):
            break
        free = again
    solution = _solve(cells, base, params, unit, x0, x, bounds, source)
    evaluations += int(solution.nfev)
    values = solution.x * unit
    profile = _with(base, params, values)
    profile = dataclasses.replace(profile, key=key or f"{base.key}-fit")
    if profile.leakage_w_per_c:
        # The cells' powers hold the die's leakage at the temperatures they ran at, and the
        # fitted power figures took it in (the prediction has none): the twin adding its own
        # on top would count it twice.
        profile = dataclasses.replace(profile, leakage_w_per_c=0.0)
        notes.append(
            f"leakage_w_per_c of {base.key} ({base.leakage_w_per_c:g}) set to 0: the fitted "
            "power figures hold the leakage the cells were measured with"
        )
    for p, v in zip(params, values, strict=True):
        if p.name.endswith("_efficiency") and v >= p.upper * (1 - 1e-6):
            # A share of the base's peak cannot pass 1: the cells ran faster than that peak
            # allows, and the figures fitted beside it took up the rest.
            notes.append(
                f"{p.name} stopped at its bound {p.upper:g}: the cells ran at or above "
                f"{base.key}'s peak, so the figures fitted beside it may have absorbed the "
                f"rest; is {base.key} the right base? (a roofline fit raises the peak)"
            )
    n_obs = len(cells) * len(OBSERVABLES)
    std = _std_errors(solution.jac[:n_obs], solution.fun[:n_obs], unit)
    undetermined = tuple(
        p.name
        for p, v, s in zip(params, values, std, strict=True)
        if not math.isfinite(s) or s > UNDETERMINED_REL * max(abs(v), 1e-12)
    )
    kept_note, warnings = _undetermined_figures(
        params, undetermined, clipped, values, unit, base.key
    )
    notes += kept_note
    if not solution.success:
        notes.append(f"the least-squares search stopped early: {solution.message}")
    residual_stats, worst = _summary(profile, cells)
    residual_stats["cells"] = float(len(cells))
    residual_stats["solver_steps"] = float(evaluations)
    return CubeFit(
        profile=profile,
        base=spelled_key(base),
        source=source,
        fitted=tuple(p.name for p in params),
        residuals=residual_stats,
        worst_cells=worst,
        base_values={p.name: float(s) for p, s in zip(params, start, strict=True)},
        std_errors={p.name: float(s) for p, s in zip(params, std, strict=True)},
        undetermined=undetermined,
        notes=tuple(notes),
        warnings=warnings,
    )


def _near(value: float, start: float, unit: float) -> bool:
    """Whether a fitted figure stayed within `NEAR_REL` of where the fit started it."""
    return abs(value - start) <= NEAR_REL * unit


def _undetermined_figures(
    params: tuple[FitParameter, ...],
    undetermined: tuple[str, ...],
    start: np.ndarray,
    values: np.ndarray,
    unit: np.ndarray,
    base: str,
) -> tuple[list[str], tuple[str, ...]]:
    """For the figures the cube hardly constrains: the note naming those that stayed within
    `NEAR_REL` of the base, and the warning naming those that moved beyond it (the cube did
    not put them there: a model error or a trade with another figure did). Each empty when
    it names none."""
    kept: list[str] = []
    far: list[str] = []
    for p, s, v, u in zip(params, start, values, unit, strict=True):
        if p.name not in undetermined:
            continue
        if _near(v, s, u):
            kept.append(p.name)
        else:
            far.append(f"{p.name} ({v:.4g}, was {s:.4g})")
    note = (
        [
            f"the cube hardly constrains {', '.join(kept)}: kept near {base}'s "
            f"(within {NEAR_REL:.0%})"
        ]
        if kept
        else []
    )
    warning = (
        (
            f"the cube hardly constrains {', '.join(far)}, yet the fit moved them more than "
            f"{NEAR_REL:.0%} from {base}'s; the profile holds them as fitted and `dvfs twin "
            "predict` uses them: check them against their standard errors, or fit a cube whose "
            "cells vary clock, batch, context and drafter more",
        )
        if far
        else ()
    )
    return note, warning


def _unthrottled(cells: CubeCells, base: GpuProfile) -> np.ndarray:
    """Cells that ran at their clock lock: the sampled clock within a step of the setting
    (where recorded) and no pass throttled in the base profile's prediction."""
    seen = cells.observed_clock_mhz
    at_lock = ~(np.isfinite(seen) & (seen < cells.sm_clock_mhz - base.sm_clock_step_mhz / 2))
    return at_lock & ~predict(base, cells).capped


def _solve(
    cells: CubeCells,
    base: GpuProfile,
    params: tuple[FitParameter, ...],
    unit: np.ndarray,
    prior: np.ndarray,
    start: np.ndarray,
    bounds: tuple[np.ndarray, np.ndarray],
    source: str,
    max_nfev: int | None = None,
    *,
    diff_step: float = DIFF_STEP,
) -> Any:
    """Bounded least squares from `start` (figures in units of `unit`), pulled weakly to
    `prior`, with at most `max_nfev` steps (default: 200 per figure), its finite differences
    of relative step `diff_step`."""
    from scipy.optimize import least_squares

    def residuals(x: np.ndarray) -> np.ndarray:
        gpu = _with(base, params, x * unit)
        return np.concatenate([_residuals(gpu, cells), PRIOR_WEIGHT * (x - prior)])

    try:
        return least_squares(
            residuals,
            start,
            bounds=bounds,
            diff_step=diff_step,
            xtol=1e-10,
            ftol=1e-10,
            gtol=1e-10,
            max_nfev=max_nfev or 200 * (len(params) + 1),
        )
    except ValueError as exc:  # a prediction went non-finite: the base cannot model these cells
        raise FitError(f"the twin cannot be fitted to {source or 'the cube'}: {exc}") from exc


def _std_errors(jac: np.ndarray, fun: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """Standard errors of the fitted figures from the Jacobian of the cells' residuals (the
    residual variance as the noise); inf where the cells do not determine a figure."""
    dof = max(1, len(fun) - jac.shape[1])
    sigma2 = float(fun @ fun) / dof
    sigma2 = max(sigma2, 1e-12)  # an exact fit: the scale of floating-point noise
    jtj = jac.T @ jac
    try:
        cov = np.linalg.pinv(jtj, rcond=NULL_RCOND, hermitian=True) * sigma2
    except np.linalg.LinAlgError:
        return np.full(jac.shape[1], np.inf)
    diag = np.diag(cov)
    # A direction the Jacobian does not see leaves a zero on the pseudo-inverse's diagonal:
    # a figure no cell moves, or one that moves only with others in a combination no cell
    # sees (fewer measurements than figures, or figures that trade exactly): undetermined.
    eigenvalues, vectors = np.linalg.eigh(jtj)
    null = eigenvalues <= NULL_RCOND * max(float(eigenvalues.max()), 1e-300)
    in_null = np.sum(vectors[:, null] ** 2, axis=1)
    blind = (np.diag(jtj) <= 1e-18) | (in_null > NULL_SHARE)
    return np.where(blind, np.inf, np.sqrt(np.maximum(diag, 0.0)) * unit)


def _summary(gpu: GpuProfile, cells: CubeCells) -> tuple[dict[str, float], dict[str, str]]:
    predicted = predict(gpu, cells).values
    stats: dict[str, float] = {}
    worst: dict[str, str] = {}
    for name in OBSERVABLES:
        measured = cells.measured[name]
        ok = np.isfinite(measured) & (measured > 0)
        if not ok.any():
            continue
        rel = predicted[name][ok] / measured[ok] - 1.0
        at = int(np.argmax(np.abs(rel)))
        stats[f"{name}_rel_rms"] = float(np.sqrt(np.mean(rel**2)))
        stats[f"{name}_rel_worst"] = float(rel[at])
        worst[name] = cells.labels[int(np.flatnonzero(ok)[at])]
    return stats, worst
