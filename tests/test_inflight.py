"""In-flight stepping: the level order's drift cancellation, the grouping, segment cuts."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.engines.base import RequestTrace
from dvfs.measure.inflight import (
    inflight_groups,
    level_estimates,
    level_order,
    mean_positions,
    rounds_step,
    segment_order,
    segment_requests,
    segments_per_round,
)
from dvfs.measure.meter import tokens_in_window
from dvfs.measure.plan import Cell

schemes = st.sampled_from(["abba", "serpentine"])


@given(levels=st.integers(1, 9), scheme=schemes, pairs=st.integers(1, 4))
def test_every_level_has_the_same_mean_position(levels: int, scheme: str, pairs: int) -> None:
    rounds = pairs * rounds_step(scheme)
    segments = segment_order(levels, scheme, rounds)
    per_round = segments_per_round(levels, scheme)
    assert len(segments) == rounds * per_round
    means = mean_positions(segments, per_round)
    assert sorted(means) == list(range(levels))
    assert len(set(means.values())) == 1
    # each decode visits every level, in the order level_order gives
    for r in range(rounds):
        visited = [s.level for s in segments if s.round == r]
        assert visited == level_order(range(levels), scheme, r)


@settings(max_examples=200)
@given(
    truth=st.lists(st.fractions(-100, 100), min_size=1, max_size=7),
    offset=st.fractions(-50, 50),
    slope=st.fractions(-10, 10),
    scheme=schemes,
    pairs=st.integers(1, 3),
)
def test_a_linear_drift_cancels_exactly(
    truth: list[Fraction], offset: Fraction, slope: Fraction, scheme: str, pairs: int
) -> None:
    """Equal segments, a drift linear in time: every level's mean is off by the same amount,
    so the differences between levels are exact (rational arithmetic, no rounding)."""
    rounds = pairs * rounds_step(scheme)
    per_round = segments_per_round(len(truth), scheme)
    seen: dict[int, list[Fraction]] = {}
    for s in segment_order(len(truth), scheme, rounds):
        t = s.round * per_round + s.position
        seen.setdefault(s.level, []).append(truth[s.level] + offset + slope * t)
    means = [sum(v, Fraction(0)) / len(v) for _, v in sorted(seen.items())]
    bias = means[0] - truth[0]
    assert all(m - v == bias for m, v in zip(means, truth, strict=True))


def test_an_odd_serpentine_does_not_cancel() -> None:
    """The property is not vacuous: one serpentine round alone puts the levels in order."""
    means = mean_positions(segment_order(3, "serpentine", 1), 3)
    assert means == {0: 0.0, 1: 1.0, 2: 2.0}


cells = st.builds(
    Cell,
    drafter=st.sampled_from(["none", "eagle"]),
    repeat=st.integers(0, 2),
    sm_clock_mhz=st.sampled_from([None, 1005, 1500, 1980]),
    power_limit_w=st.sampled_from([None, 300.0, 700.0]),
    batch=st.sampled_from([1, 8]),
    corpus=st.sampled_from(["code", "chat"]),
)


@given(st.lists(cells, unique=True, max_size=40))
def test_groups_share_all_but_the_knob(plan: list[Cell]) -> None:
    groups = inflight_groups(plan)
    flat = [c for g in groups for c in g]
    assert len(flat) == len(plan) and set(flat) == set(plan)
    keys = []
    for g in groups:
        key = {(c.drafter, c.repeat, c.batch, c.corpus) for c in g}
        assert len(key) == 1
        assert len({c.setting for c in g}) == len(g)
        assert [c for c in plan if c in g] == list(g)  # plan order kept inside a group
        keys.append(key.pop())
    assert len(set(keys)) == len(keys)
    # groups come in the order their first cells appear
    firsts = [plan.index(g[0]) for g in groups]
    assert firsts == sorted(firsts)


@given(
    gaps=st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=30), min_size=1, max_size=5),
    tokens=st.integers(1, 4),
    a=st.integers(0, 800),
    length=st.integers(1, 800),
)
def test_a_segment_keeps_exactly_its_tokens(
    gaps: list[list[int]], tokens: int, a: int, length: int
) -> None:
    requests = []
    for g in gaps:
        ns = np.cumsum(np.array(g, dtype=np.int64))
        per = np.full(len(ns), tokens, dtype=np.int64)
        requests.append(RequestTrace(0, ns, per, 10, int(per.sum())))
    b = a + length
    cut = segment_requests(requests, a, b)
    assert tokens_in_window(cut, a, b) == tokens_in_window(requests, a, b)
    for r in cut:
        inside = (r.chunk_ns > a) & (r.chunk_ns <= b)
        assert inside[1:].all()  # only the leading anchor may lie before the segment
        if not inside[0]:
            assert r.chunk_tokens[0] == 1


@settings(max_examples=100, deadline=None)
@given(
    truth=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=6),
    slope=st.floats(-0.01, 0.01),
    offsets=st.lists(st.floats(-0.05, 0.05), min_size=4, max_size=4),
    scheme=schemes,
    pairs=st.integers(1, 2),
)
def test_level_estimates_see_through_drift_and_round_offsets(
    truth: list[float], slope: float, offsets: list[float], scheme: str, pairs: int
) -> None:
    """Levels plus a drift along each decode plus an offset per round: the fit returns the
    levels, and with no noise left the intervals are (numerically) empty."""
    rounds = pairs * rounds_step(scheme)
    segments = segment_order(len(truth), scheme, rounds)
    values = [truth[s.level] + slope * s.position + offsets[s.round] for s in segments]
    value, half = level_estimates(values, segments, len(truth), 0.95)
    # each level's value is relative to the first round's offset (the fit's reference)
    assert np.allclose(value, np.array(truth) + offsets[0], rtol=0, atol=1e-9)
    finite = np.isfinite(half)
    assert np.all(half[finite] < 1e-6)


def test_level_estimates_widen_with_noise_and_need_degrees_of_freedom() -> None:
    segments = segment_order(3, "abba", 2)
    rng = np.random.default_rng(0)
    values = [1.0 + 0.1 * s.level + rng.normal(0, 0.01) for s in segments]
    _, half = level_estimates(values, segments, 3, 0.95)
    assert np.all((half > 0) & np.isfinite(half))
    # one level in one abba round: two segments, a level and a drift: nothing left over
    _, none_left = level_estimates([1.0, 1.1], segment_order(1, "abba", 1), 1, 0.95)
    assert np.isinf(none_left).all()
