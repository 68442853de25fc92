"""In-flight stepping: the level order's drift cancellation, the grouping, segment cuts."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.engines.base import RequestTrace
from dvfs.measure.inflight import (
    inflight_groups,
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
