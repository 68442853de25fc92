"""The governor's rule: which setting a running batch gets, and when it may change (pure).

The rule works on the plan's buckets (ordered by batch, see `BatchPlan.bucket`). When a batch is
seen outside the band in force, the governor takes a new band around it: the buckets of every
batch within `hysteresis` of it (a fraction of the batch, at least one request) either way, and
applies the least aggressive setting over that band (`BatchPlan.band_setting`). While the batch
stays inside the band nothing changes, so a load hovering at a step boundary does not flap. An
unknown batch (the server does not answer) counts as above the plan: stock, the setting that
never costs latency.

The dwell (`dwell_s`) holds back only what saves energy: no change comes sooner than `dwell_s`
after the last one, unless the setting in force does not cover what the running batch needs (a
load that rose into a step planned at a higher clock, a server that stopped answering), which
would cost latency for as long as it waited. That batch gets a looser setting at once: the band
in force widened to the hull of it and the batch's band, which covers both; once the dwell has
passed, the hull narrows to the band it was widened for (or, if the batch has left that, to the
batch's own). A band holds its batch's bucket and a hull holds both, so the setting in force
covers the running batch after every decision, whichever way the needed clock runs with the
batch.

A change is a new setting: a band that moves with the batch but keeps the setting in force
changes nothing on the GPUs, so it is not applied, logged or counted, and it does not restart the
dwell.

So the governor cannot oscillate: under a constant batch it changes at most twice (at most once
when the dwell is over), a batch alternating between two values within each other's hysteresis
changes it at most twice (once when both are inside the plan), and the changes closer than a
dwell to the one before only ever widen the band, which has finitely many buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from dvfs.errors import CapsError
from dvfs.govern.plan import BatchPlan, Setting

Band = tuple[int, int]


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
    """The band of buckets in force (None before the first decision) and when it was chosen;
    for a hull widened before the dwell was over, the band it narrows to once it is over."""

    band: Band | None = None
    changed_at: float | None = None
    target: Band | None = None


@dataclass(frozen=True)
class Decision:
    state: PolicyState
    changed: bool
    #: The band the load asks for; differs from state.band while the dwell holds it back.
    wanted: Band | None
    #: A looser setting applied before the dwell was over, because the one in force did not
    #: cover the running batch.
    early: bool = False


def margin(batch: int, hysteresis: float) -> int:
    """How far around a batch its band reaches (at least one request)."""
    return max(1, math.ceil(hysteresis * batch))


def band_for(plan: BatchPlan, batch: int | None, hysteresis: float) -> Band:
    """The buckets of every batch within the margin of `batch` (stock alone when unknown).

    A batch the plan covers gets a band that stops at the plan's last step: reaching past it
    would put a planned load at stock only because a larger one was not measured.
    """
    if batch is None:
        return (plan.stock_bucket, plan.stock_bucket)
    m = margin(batch, hysteresis)
    low = plan.bucket(max(0, batch - m))
    if plan.bucket(batch) == plan.stock_bucket:
        return (low, plan.stock_bucket)
    return (low, min(plan.bucket(batch + m), plan.stock_bucket - 1))


def decide(
    plan: BatchPlan, state: PolicyState, batch: int | None, now: float, params: PolicyParams
) -> Decision:
    """The band for `batch` observed at `now` (seconds, monotone), given the current state."""
    seen = plan.bucket(batch)
    band = state.band
    dwelling = state.changed_at is not None and now - state.changed_at < params.dwell_s
    if band is not None and state.target is not None and not dwelling:
        # The dwell is over: a hull narrows to the band it was widened for, if the batch is
        # still inside that, else to the batch's own.
        target = state.target
        if not target[0] <= seen <= target[1]:
            target = band_for(plan, batch, params.hysteresis)
        if plan.band_setting(target) == plan.band_setting(band):
            return Decision(PolicyState(target, state.changed_at), False, target)
        return Decision(PolicyState(target, now), True, target)
    if band is not None and band[0] <= seen <= band[1]:
        return Decision(state, False, band)
    wanted = band_for(plan, batch, params.hysteresis)
    if band is not None and not dwelling and plan.band_setting(wanted) == plan.band_setting(band):
        # The band follows the batch, but the GPUs keep their setting: no change to apply,
        # log or count, and the dwell runs on from the last one.
        return Decision(PolicyState(wanted, state.changed_at), False, wanted)
    if band is None and plan.band_setting(wanted).is_stock:
        # A first setting of stock changes nothing (the GPUs are at stock): no dwell runs
        # from it, and the first cap is set as soon as the load calls for one.
        return Decision(PolicyState(wanted), True, wanted)
    if band is None or not dwelling:
        return Decision(PolicyState(wanted, now), True, wanted)
    if covers(plan.band_setting(band), plan.setting(seen)):
        return Decision(state, False, wanted)  # tighter (or no looser): waits for the dwell
    # The batch needs a looser setting than the one in force: at once, the hull of both bands.
    hull = (min(band[0], wanted[0]), max(band[1], wanted[1]))
    return Decision(PolicyState(hull, now, wanted), True, wanted, early=True)


def covers(setting: Setting, needed: Setting) -> bool:
    """`setting` is at least as loose as `needed` on every knob (stock is the loosest)."""
    return setting.join(needed) == setting


def follow(
    plan: BatchPlan, trace: Iterable[tuple[float, int | None]], params: PolicyParams
) -> list[Band]:
    """The band in force after each (time, batch) observation of a trace, from a fresh start:
    what the governor would do to a recorded or synthetic load (a replay or a benchmark runs
    this very rule)."""
    state, bands = PolicyState(), []
    for now, batch in trace:
        state = decide(plan, state, batch, now, params).state
        if state.band is None:  # cannot happen: the first observation always sets a band
            raise AssertionError("no band after a decision")
        bands.append(state.band)
    return bands
