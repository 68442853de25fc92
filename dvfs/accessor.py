"""`ds.dvfs`: a thin accessor that checks a cube's shape and delegates to the analyses.

import dvfs
ds = dvfs.open_cube("out/demo/cube.nc")
ds.dvfs.headroom(slack=0.05)            # preserve each drafter's own latency within 5%
ds.dvfs.headroom(mode="vs-baseline")    # trade speculation's latency win for energy
ds.dvfs.headroom(slo="tpot_p90<=20ms")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xarray as xr

from dvfs.analysis.targets import (
    QUANTILE_NAMES,
    SLACK_WITH_SLO,
    Target,
    parse_slack,
    parse_slo,
)
from dvfs.cube import check_cube
from dvfs.errors import AnalysisError


def _slack(slack: float | str | None) -> float:
    """A slack given as a number or as the CLI's text ("5%", "0.05"), checked as the CLI
    checks it (`parse_slack`: finite, not negative, a bare 1 or more is ambiguous)."""
    if slack is None:
        return 0.0
    if isinstance(slack, str):
        return parse_slack(slack)
    if isinstance(slack, bool) or not isinstance(slack, int | float):
        raise AnalysisError(
            f"slack must be a number or text such as '5%', got {type(slack).__name__}"
        )
    return parse_slack(repr(float(slack)))


def _target(
    mode: str, slo: str | None, metric: str, quantile: str, slack: float | str | None, baseline: str
) -> Target:
    """The latency target of `headroom` and `plot`, read as `dvfs headroom` reads its options:
    a slack with an SLO is refused, as the CLI refuses it."""
    if slo and slack is not None:
        raise AnalysisError(SLACK_WITH_SLO)
    if slo:
        return parse_slo(slo)
    return Target(mode, metric, QUANTILE_NAMES[quantile], _slack(slack), None, baseline)


@xr.register_dataset_accessor("dvfs")
class DvfsAccessor:
    """Analyses of a dvfs cube; every method returns new objects and never mutates the cube."""

    def __init__(self, ds: xr.Dataset) -> None:
        self._ds = check_cube(ds)

    @property
    def stock(self) -> dict[str, Any]:
        """The reference setting: the unlocked clock (max SM clock) at the stock power limit."""
        from dvfs.analysis.headroom import reference_setting

        ref = reference_setting(self._ds)
        return {"sm_clock": ref.sm_clock, "power_limit": ref.power_limit, "is_stock": ref.is_stock}

    def headroom(
        self,
        *,
        mode: str = "preserve",
        slo: str | None = None,
        metric: str = "tpot",
        quantile: str = "p50",
        slack: float | str | None = None,
        baseline: str = "none",
        knob: str = "both",
        confidence: float = 0.95,
    ) -> xr.Dataset:
        """See `dvfs.analysis.headroom.headroom`. `slack` as `dvfs headroom --slack` reads it
        (a fraction such as 0.05, or "5%"); with `slo` it is refused, as the CLI refuses it."""
        from dvfs.analysis.headroom import headroom

        target = _target(mode, slo, metric, quantile, slack, baseline)
        return headroom(self._ds, target=target, knob=knob, confidence=confidence)

    def compare(
        self,
        *,
        baseline: str = "none",
        metric: str = "tpot",
        quantile: str = "p50",
        confidence: float = 0.95,
    ) -> xr.Dataset:
        """See `dvfs.analysis.compare.compare`."""
        from dvfs.analysis.compare import compare

        return compare(
            self._ds,
            baseline=baseline,
            metric=metric,
            quantile=QUANTILE_NAMES[quantile],
            confidence=confidence,
        )

    def roofline(self, *, context_tokens: float | None = None) -> xr.Dataset:
        """See `dvfs.analysis.roofline.roofline`."""
        from dvfs.analysis.roofline import roofline

        return roofline(self._ds, context_tokens=context_tokens)

    def plot(
        self,
        out_dir: str | Path,
        *,
        fmt: str = "png",
        mode: str = "preserve",
        slo: str | None = None,
        metric: str = "tpot",
        quantile: str = "p50",
        slack: float | str | None = None,
        baseline: str = "none",
        knob: str = "both",
        confidence: float = 0.95,
    ) -> list[Path]:
        """Write every figure into `out_dir`; returns the paths. The settings they mark are
        `headroom`'s for the same arguments (as `dvfs plot` takes them)."""
        from dvfs.plots import plot_all

        target = _target(mode, slo, metric, quantile, slack, baseline)
        return plot_all(self._ds, out_dir, fmt=fmt, target=target, knob=knob, confidence=confidence)
