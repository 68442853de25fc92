"""Latency targets: what "keeps latency within a target" means, parsed from the command line."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dvfs.errors import AnalysisError

METRICS = ("tpot", "itl", "ttft")
QUANTILE_NAMES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
MODES = ("preserve", "vs-baseline", "slo")


@dataclass(frozen=True)
class Target:
    """A latency target for the headroom search.

    preserve:     each drafter's own latency at the stock setting, times (1 + slack)
    vs-baseline:  the baseline drafter's (no speculation) stock latency, times (1 + slack)
    slo:          an absolute limit in ms
    """

    mode: str = "preserve"
    metric: str = "tpot"
    quantile: float = 0.5
    slack: float = 0.0
    limit_ms: float | None = None
    baseline: str = "none"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise AnalysisError(f"unknown target mode {self.mode!r}; choose {', '.join(MODES)}")
        if self.metric not in METRICS:
            raise AnalysisError(
                f"unknown latency metric {self.metric!r}; choose {', '.join(METRICS)}"
            )
        if self.quantile not in QUANTILE_NAMES.values():
            raise AnalysisError(f"quantile {self.quantile} is not stored; choose p50, p90 or p99")
        if self.slack < 0:
            raise AnalysisError(f"slack must be >= 0, got {self.slack}")
        if self.mode == "slo" and (self.limit_ms is None or self.limit_ms <= 0):
            raise AnalysisError("an SLO target needs a positive limit")

    @property
    def variable(self) -> str:
        return f"{self.metric}_ms"

    @property
    def quantile_name(self) -> str:
        return next(k for k, v in QUANTILE_NAMES.items() if v == self.quantile)

    def describe(self) -> str:
        what = f"{self.metric.upper()} {self.quantile_name}"
        slack = f" + {self.slack * 100:g}%" if self.slack else ""
        if self.mode == "preserve":
            return f"{what} <= each drafter's own stock {what}{slack}"
        if self.mode == "vs-baseline":
            return f"{what} <= the {self.baseline!r} drafter's stock {what}{slack}"
        return f"{what} <= {self.limit_ms:g} ms"

    def loosened(self, factor: float) -> Target:
        """The same target made looser (for property tests and sensitivity tables)."""
        if self.mode == "slo":
            assert self.limit_ms is not None
            return Target(
                self.mode,
                self.metric,
                self.quantile,
                self.slack,
                self.limit_ms * factor,
                self.baseline,
            )
        return Target(
            self.mode,
            self.metric,
            self.quantile,
            (1 + self.slack) * factor - 1,
            None,
            self.baseline,
        )


_SLO = re.compile(
    r"^\s*(?P<metric>tpot|itl|ttft)_(?P<q>p50|p90|p99)\s*<=?\s*"
    r"(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>ms|s)\s*$",
    re.IGNORECASE,
)


def parse_slo(text: str) -> Target:
    """`tpot_p90<=50ms` or `ttft_p99<=1s` -> an SLO target."""
    match = _SLO.match(text)
    if not match:
        raise AnalysisError(
            f"cannot read SLO {text!r}; write METRIC_QUANTILE<=VALUE UNIT, e.g. tpot_p90<=50ms "
            "or ttft_p99<=1s (metrics tpot, itl, ttft; quantiles p50, p90, p99)"
        )
    value = float(match["value"]) * (1000.0 if match["unit"].lower() == "s" else 1.0)
    return Target("slo", match["metric"].lower(), QUANTILE_NAMES[match["q"].lower()], 0.0, value)


def parse_slack(text: str) -> float:
    """`5%` or a fraction such as `0.05`; a bare number of 1 or more is refused as ambiguous."""
    raw = text.strip()
    try:
        if raw.endswith("%"):
            value = float(raw[:-1]) / 100
        else:
            value = float(raw)
            if value >= 1:
                raise AnalysisError(
                    f"slack {text!r} is ambiguous: write {raw}% or a fraction "
                    f"such as {value / 100:g}"
                )
    except ValueError as exc:
        raise AnalysisError(f"cannot read slack {text!r}; write e.g. 5% or 0.05") from exc
    if value < 0:
        raise AnalysisError(f"slack must not be negative, got {text!r}")
    return value
