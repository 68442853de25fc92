"""The governor's rule: which plan step a running batch gets, and when it may change (pure).

Steps are ordered by batch, so the rule works on step indices ("buckets", see
`BatchPlan.bucket`). Going up follows the load at once: a batch above the current step's gets
its own step. Going down needs the batch to have fallen by a margin (`hysteresis` of the batch,
at least one request) below the current step: a batch hovering at a step boundary therefore
sits in the band between the two thresholds and changes nothing. On top, no two changes come
closer than `dwell_s`, whatever the load does. An unknown batch (the server does not answer)
counts as above the plan: stock, the setting that never costs latency.

Together these make the governor unable to oscillate: under a constant batch it changes at most
once, and a batch alternating within the hysteresis band changes it at most twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from dvfs.errors import CapsError
from dvfs.govern.plan import BatchPlan


@dataclass(frozen=True)
class PolicyParams:
    dwell_s: float = 10.0
    hysteresis: float = 0.25

    def __post_init__(self) -> None:
        if not math.isfinite(self.dwell_s) or self.dwell_s < 0:
            raise CapsError(f"--dwell must be a non-negative time, got {self.dwell_s!r}")
        if not math.isfinite(self.hysteresis) or not 0 <= self.hysteresis <= 10:
            raise CapsError(f"--hysteresis must be between 0 and 10, got {self.hysteresis!r}")


@dataclass(frozen=True)
class PolicyState:
    """The step in force (None before the first decision) and when it was chosen."""

    bucket: int | None = None
    changed_at: float | None = None


@dataclass(frozen=True)
class Decision:
    state: PolicyState
    changed: bool
    #: The step the load asks for; differs from state.bucket while the dwell holds it back.
    wanted: int


def margin(batch: int, hysteresis: float) -> int:
    """How far a batch must fall below a step before the governor steps down."""
    return max(1, math.ceil(hysteresis * batch))


def decide(
    plan: BatchPlan, state: PolicyState, batch: int | None, now: float, params: PolicyParams
) -> Decision:
    """The step for `batch` observed at `now` (seconds, monotone), given the current state."""
    up = plan.bucket(batch)
    current = state.bucket
    if current is None or up > current:
        wanted = up
    else:
        down = plan.bucket(None if batch is None else batch + margin(batch, params.hysteresis))
        wanted = down if down < current else current
    if wanted == current:
        return Decision(state, False, wanted)
    if state.changed_at is not None and now - state.changed_at < params.dwell_s:
        return Decision(state, False, wanted)
    return Decision(PolicyState(wanted, now), True, wanted)


def follow(
    plan: BatchPlan, trace: Iterable[tuple[float, int | None]], params: PolicyParams
) -> list[int]:
    """The step in force after each (time, batch) observation of a trace, from a fresh start:
    what the governor would do to a recorded or synthetic load (a replay or a benchmark runs
    this very rule)."""
    state, steps = PolicyState(), []
    for now, batch in trace:
        state = decide(plan, state, batch, now, params).state
        assert state.bucket is not None  # the first observation always sets a step
        steps.append(state.bucket)
    return steps
