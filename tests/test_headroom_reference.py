"""The headroom search against a plain re-statement of its rules, cell by cell in Python loops:
for random small cubes (missing cells, one to three repeats, ties, every knob and mode), the
chosen setting, the lowest feasible clock and limit, the number of feasible settings and the
bound behind the choice are what the README's rules give. No quality flags and no peak power
here (`test_headroom_binding.py`, `test_headroom.py` hold those)."""

from __future__ import annotations

import math
import warnings

import numpy as np
from cubes import make_cube
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.analysis.bounds import t_quantile
from dvfs.analysis.headroom import headroom
from dvfs.analysis.targets import Target

CLOCKS = [900, 1500, 1980]
LIMITS = [400.0, 700.0]
DRAFTERS = ["none", "eagle"]
#: Latencies (ms) and energies (J) with many repeats of a few values: ties and exact hits.
LATENCY = st.one_of(st.sampled_from([math.nan, 10.0, 10.0, 11.0, 8.0]), st.floats(5, 20))
ENERGY = st.one_of(st.sampled_from([1.0, 1.0, 0.5]), st.floats(0.1, 2))


def upper(xs: list[float], confidence: float) -> float:
    n = len(xs)
    mean = sum(xs) / n
    if n == 1:
        return mean
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean + t_quantile(confidence, n - 1) * sd / math.sqrt(n)


def expected(lat, en, repeats, target, confidence, knob, d):  # type: ignore[no-untyped-def]
    """(chosen clock, chosen limit, lowest feasible clock, lowest feasible limit, feasible
    settings, bound) of drafter `d`, or None where nothing is feasible."""
    top_c, top_p = len(CLOCKS) - 1, len(LIMITS) - 1  # stock: the top of the grid

    def ok(c: int, p: int, dd: int, r: int) -> bool:
        return not (math.isnan(lat[c, p, dd, r]) or math.isnan(en[c, p, dd, r]))

    need = min(2, repeats)
    threshold = target.limit_ms if target.mode == "slo" else 1 + target.slack
    feasible = []
    for c, clock in enumerate(CLOCKS):
        for p, limit in enumerate(LIMITS):
            if (knob == "sm_clock" and p != top_p) or (knob == "power_limit" and c != top_c):
                continue
            if target.mode == "vs-baseline" and d != 0:  # unpaired, against none's stock
                mine = [lat[c, p, d, r] for r in range(repeats) if ok(c, p, d, r)]
                base = [lat[top_c, top_p, 0, r] for r in range(repeats) if ok(top_c, top_p, 0, r)]
                if len(mine) < need or len(base) < need:
                    continue
                side = (1 + confidence) / 2
                bottom = 2 * sum(base) / len(base) - upper(base, side)
                bound = upper(mine, side) / bottom if bottom > 0 else math.inf
            else:
                if target.mode == "slo":
                    xs = [lat[c, p, d, r] for r in range(repeats) if ok(c, p, d, r)]
                else:  # paired by repeat with the drafter's own stock
                    xs = [
                        lat[c, p, d, r] / lat[top_c, top_p, d, r]
                        for r in range(repeats)
                        if ok(c, p, d, r) and ok(top_c, top_p, d, r)
                    ]
                if len(xs) < need:
                    continue
                bound = upper(xs, confidence)
            if bound <= threshold * (1 + 1e-9):
                energies = [en[c, p, d, r] for r in range(repeats) if ok(c, p, d, r)]
                feasible.append((sum(energies) / len(energies), clock, limit, bound, c, p))
    if not feasible:
        return None

    def least_energy(settings: list) -> tuple:  # type: ignore[type-arg]
        least = min(f[0] for f in settings)
        ties = [f for f in settings if f[0] <= least * (1 + 1e-4)]  # towards the highest
        return max(ties, key=lambda f: (f[1], f[2]))

    # A saving not told apart from zero is none: with two or more paired repeats, by the
    # two-sided Student-t interval of the mean log ratio; with fewer the cells' intervals,
    # which this cube does not state, so the ratio of the means is its own interval.
    stock = [en[top_c, top_p, d, r] for r in range(repeats) if ok(top_c, top_p, d, r)]

    def saves(f: tuple) -> bool:  # type: ignore[type-arg]
        c, p = f[4], f[5]
        if (c, p) == (top_c, top_p):
            return True
        logs = [
            math.log(en[c, p, d, r] / en[top_c, top_p, d, r])
            for r in range(repeats)
            if ok(c, p, d, r) and ok(top_c, top_p, d, r)
        ]
        if len(logs) >= 2:
            return math.exp(upper(logs, (1 + confidence) / 2)) < 1
        mine = [en[c, p, d, r] for r in range(repeats) if ok(c, p, d, r)]
        return (sum(mine) / len(mine)) / (sum(stock) / len(stock)) < 1

    chosen = least_energy(feasible)
    if stock and (chosen[4], chosen[5]) != (top_c, top_p):
        beyond = [f for f in feasible if saves(f)]
        chosen = least_energy(beyond) if beyond else chosen
    lowest_clock, lowest_limit = min(f[1] for f in feasible), min(f[2] for f in feasible)
    return chosen[1], chosen[2], lowest_clock, lowest_limit, len(feasible), chosen[3]


def per_cell(values: np.ndarray):  # type: ignore[no-untyped-def]
    """`make_cube`'s function of a cell for values over (clock, limit, drafter, repeat)."""
    return lambda c, p, b, d, k, r: values[CLOCKS.index(c), LIMITS.index(p), DRAFTERS.index(d), r]


@settings(max_examples=150, deadline=None)
@given(
    repeats=st.integers(1, 3),
    data=st.data(),
    mode=st.sampled_from(["preserve", "slo", "vs-baseline"]),
    slack=st.floats(0, 0.3),
    confidence=st.sampled_from([0.5, 0.8, 0.95]),
    knob=st.sampled_from(["both", "sm_clock", "power_limit"]),
)
def test_the_search_is_its_rules(repeats, data, mode, slack, confidence, knob) -> None:  # type: ignore[no-untyped-def]
    shape = (len(CLOCKS), len(LIMITS), len(DRAFTERS), repeats)
    n = int(np.prod(shape))
    lat = np.array(data.draw(st.lists(LATENCY, min_size=n, max_size=n))).reshape(shape)
    en = np.array(data.draw(st.lists(ENERGY, min_size=n, max_size=n))).reshape(shape)
    cube = make_cube(
        clocks=CLOCKS,
        limits=LIMITS,
        drafters=DRAFTERS,
        repeats=repeats,
        latency=per_cell(lat),
        energy=per_cell(en),
    )
    target = (
        Target("slo", limit_ms=10 * (1 + slack)) if mode == "slo" else Target(mode, slack=slack)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # means of all-NaN settings
        result = headroom(cube, target=target, confidence=confidence, knob=knob)
    for d in range(len(DRAFTERS)):
        row = result.isel(batch=0, drafter=d, corpus=0)
        want = expected(lat, en, repeats, target, confidence, knob, d)
        if want is None:
            assert not bool(row["feasible"]), d
            continue
        got = (
            float(row["chosen_sm_clock"]),
            float(row["chosen_power_limit"]),
            float(row["lowest_feasible_sm_clock"]),
            float(row["lowest_feasible_power_limit"]),
            int(row["feasible_settings"]),
        )
        assert got == want[:5], (d, got, want)
        bound = float(row["latency_bound"])
        assert bound == want[5] or math.isclose(bound, want[5], rel_tol=1e-12), (d, bound, want)
