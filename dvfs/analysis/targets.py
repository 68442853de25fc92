"""Latency targets: what "keeps latency within a target" means, parsed from the command line."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from dvfs.errors import AnalysisError

METRICS = ("tpot", "itl", "ttft")
QUANTILE_NAMES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
MODES = ("preserve", "vs-baseline", "slo")


@dataclass(frozen=True)
class Target:
    """A latency target for the headroom search.

    preserve:     each drafter's own latency at the stock setting, times (1 + slack)
    vs-baseline:  the baseline drafter's (no speculation) stock latency, times (1 + slack)
    slo:          an absolute limit in ms; `strict` makes it `<` (a bound exactly on the
                  limit fails) instead of `<=`
    """

    mode: str = "preserve"
    metric: str = "tpot"
    quantile: float = 0.5
    slack: float = 0.0
    limit_ms: float | None = None
    baseline: str = "none"
    strict: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise AnalysisError(f"unknown target mode {self.mode!r}; choose {', '.join(MODES)}")
        if self.metric not in METRICS:
            raise AnalysisError(
                f"unknown latency metric {self.metric!r}; choose {', '.join(METRICS)}"
            )
        if self.quantile not in QUANTILE_NAMES.values():
            raise AnalysisError(f"quantile {self.quantile} is not stored; choose p50, p90 or p99")
        if not (math.isfinite(self.slack) and self.slack >= 0):
            raise AnalysisError(f"slack must be a finite number >= 0, got {self.slack}")
        if self.mode == "slo" and not (
            self.limit_ms is not None and math.isfinite(self.limit_ms) and self.limit_ms > 0
        ):
            raise AnalysisError(
                f"an SLO target needs a positive, finite limit, got {self.limit_ms}"
            )
        if self.strict and self.mode != "slo":
            raise AnalysisError("only an SLO target can be strict (<)")

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
        return f"{what} {'<' if self.strict else '<='} {self.limit_ms:g} ms"

    def loosened(self, factor: float) -> Target:
        """The same target made looser (for property tests and sensitivity tables)."""
        if self.mode == "slo":
            assert self.limit_ms is not None
            return replace(self, limit_ms=self.limit_ms * factor)
        return replace(self, slack=(1 + self.slack) * factor - 1)


SLO_FORM = (
    "write METRIC_QUANTILE<=VALUE UNIT, e.g. tpot_p90<=50ms or ttft_p99<1s (metrics tpot, itl, "
    "ttft; quantiles p50, p90, p99; <= or < for a strict limit; a positive VALUE in ms or s)"
)
_SLO = re.compile(r"^\s*(?P<name>[^<>=!\s]*)\s*(?P<op>[<>=!]*)\s*(?P<rhs>.*?)\s*$")
_VALUE = re.compile(
    r"^(?P<number>[-+]?(?:nan|inf(?:inity)?)|[-+]?[0-9.]*(?:[eE][-+]?[0-9]+)?)"
    r"\s*(?P<unit>\S*)$",
    re.IGNORECASE,
)
_UNITS_MS = {"ms": 1.0, "s": 1000.0}


def parse_slo(text: str) -> Target:
    """`tpot_p90<=50ms`, `ttft_p99<=1s`, or strict `tpot_p90<50ms` -> an SLO target.

    Every way of getting it wrong gets its own one-line message that names what is allowed.
    """

    def refuse(why: str) -> AnalysisError:
        return AnalysisError(f"cannot read SLO {text!r}: {why}; {SLO_FORM}")

    match = _SLO.match(text)
    if not match or not match["name"]:
        raise refuse("no latency named")
    name, op, rhs = match["name"].lower(), match["op"], match["rhs"]
    metric, _, quantile = name.partition("_")
    if metric in METRICS and quantile not in QUANTILE_NAMES:
        # a known metric: the quantile is what is wrong ("itl" alone read as an unknown latency)
        given = f"quantile {quantile!r}" if quantile else "no quantile"
        raise refuse(f"{given} for {metric}: use {metric}_p50, {metric}_p90 or {metric}_p99")
    if metric not in METRICS or quantile not in QUANTILE_NAMES:
        raise refuse(f"unknown latency {match['name']!r}")
    if op not in ("<=", "<"):
        raise refuse(f"the comparison must be <= or <, not {op!r}" if op else "no <= or <")
    if not rhs:
        raise refuse("no limit after " + op)
    value = _VALUE.match(rhs)
    try:
        number = float(value["number"]) if value else None
    except ValueError:
        number = None
    if value is None or number is None:
        raise refuse(f"cannot read the limit {rhs!r}")
    if not (math.isfinite(number) and number > 0):
        raise refuse(f"the limit must be a positive, finite number, got {value['number']}")
    unit = value["unit"].lower()
    if not unit:
        raise refuse("the limit has no unit")
    if unit not in _UNITS_MS:
        raise refuse(f"unknown unit {value['unit']!r}")
    return Target(
        "slo",
        metric,
        QUANTILE_NAMES[quantile],
        0.0,
        number * _UNITS_MS[unit],
        strict=op == "<",
    )


#: Why a slack and an SLO are refused together (`dvfs headroom` and `ds.dvfs.headroom` alike).
SLACK_WITH_SLO = (
    "--slack loosens --preserve and --vs-baseline targets; an --slo is its own limit: "
    "drop --slack, or raise the SLO's limit"
)


def parse_slack(text: str) -> float:
    """`5%` or a fraction such as `0.05`; a bare number of 1 or more is refused as ambiguous.

    NaN, infinities and negative values are refused: none of them is a latency allowance.
    """
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        number = float(raw[:-1] if percent else raw)
    except ValueError as exc:
        raise AnalysisError(
            f"cannot read slack {text!r}; write a percentage such as 5% or a fraction such as 0.05"
        ) from exc
    value = number / 100 if percent else number
    if not math.isfinite(value):
        raise AnalysisError(f"slack must be a finite number, got {text!r}; write e.g. 5% or 0.05")
    if value < 0:
        raise AnalysisError(f"slack must not be negative, got {text!r}; write e.g. 5% or 0.05")
    if not percent and value >= 1:
        raise AnalysisError(
            f"slack {text!r} is ambiguous: write {raw}% or a fraction such as {value / 100:g}"
        )
    return value
