"""What the stated confidence promises, checked against cubes of known truth: seeded
replicas laid along the batch axis (each batch an independent group), so one headroom or
compare call judges hundreds, and the bands are wide enough that the fixed seeds cannot flake."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from cubes import make_cube

from dvfs.analysis.headroom import headroom
from dvfs.analysis.targets import Target
from dvfs.report.document import ReportOptions, build_document

CLOCKS = [1200, 1300, 1400, 1500, 1600, 1700, 1800, 1900, 1980]


def _replicas(truth: dict[int, float], n: int, repeats: int, seed: int):
    """A cube of `n` replica groups (batches): TPOT 10 ms x the true ratio per clock, a
    repeat effect shared by the clocks (2%) and 1% noise per cell; energy falls with the
    clock, so the least-energy feasible setting is the lowest one that passed."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(0, 0.01, size=(len(CLOCKS), n, repeats))
    shared = rng.normal(0, 0.02, size=(n, repeats))

    def latency(c: int, p: float, b: int, d: str, co: str, r: int) -> float:
        return 10.0 * truth[c] * math.exp(shared[b, r] + noise[CLOCKS.index(c), b, r])

    return make_cube(
        clocks=CLOCKS,
        batches=list(range(n)),
        repeats=repeats,
        latency=latency,
        energy=lambda c, *a: 0.5 + c / 1980,
    )


def test_the_bound_keeps_its_level_per_setting() -> None:
    """A clock whose true latency is exactly the target passes no more than 1 - confidence of
    the time (95%: 5%; measured 4.6% over 500 runs while writing this)."""
    truth = {c: 1.0 for c in CLOCKS}
    cube = _replicas(truth, 400, 3, seed=5)
    one = cube.sel(sm_clock=[1500, 1980])
    r = headroom(one, target=Target("preserve")).isel(drafter=0, corpus=0)
    passed = float((r["lowest_feasible_sm_clock"] == 1500).mean())
    assert passed <= 0.09, passed  # 5% nominal; 99% binomial band for 400 runs tops at 8.3%


def test_the_report_says_its_confidence_holds_per_setting_not_for_the_answer() -> None:
    """Eight clocks each 0.5% over a --slack 0 target: each passes at most 5% of the time, but
    the answer, the least-energy of those that passed, misses the target in about 12% of runs
    (three repeats): the report may not say each listed setting meets it at 95%."""
    truth = {c: (1.0 if c == 1980 else 1.005) for c in CLOCKS}
    r = headroom(_replicas(truth, 400, 3, seed=7), target=Target("preserve")).isel(
        drafter=0, corpus=0
    )
    chosen = r["chosen_sm_clock"].values
    missed = float(np.mean([truth[int(c)] > 1.0 for c in chosen if np.isfinite(c)]))
    assert missed > 0.08, missed  # well above the 5% a per-setting level allows
    small = make_cube(clocks=[1000, 2000], repeats=3, latency=lambda c, *a: 10.0 * 2000 / c)
    doc = build_document(small, ReportOptions(Target("preserve")), [], generated="now")
    text = doc.sections[1].blocks[1].text  # type: ignore[union-attr]
    assert text.startswith("Confidence: 95%, one-sided. It holds per setting"), text
    assert "listed at most 5% of the time" in text
    assert "with at least that confidence" not in text
    assert "just over the target" in text
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "That confidence holds per setting" in readme


def test_compare_says_its_equal_latency_interval_leans_to_saves() -> None:
    """Arms of equal true energy, the drafter's six slowest clocks spending alike and all
    within the baseline's stock latency (the baseline's only its stock): the drafter's
    least-energy setting is picked on the repeats its ratio then uses, so "saves" comes out
    in about 7% of runs at 95% (2.5% allowed). The verdict line says so, as the README does."""
    from dvfs.analysis.compare import compare

    n, repeats = 400, 3
    rng = np.random.default_rng(63)
    drafters = ["eagle", "none"]
    noise = rng.normal(0, 0.01, size=(len(CLOCKS), 2, n, repeats))
    shared = rng.normal(0, 0.02, size=(n, repeats))
    alike = set(CLOCKS[:6])

    def energy(c: int, p: float, b: int, d: str, co: str, r: int) -> float:
        true = 1.0 if d == "none" or c in alike else 1.0 + 0.05 * (c - max(alike)) / 100
        return true * math.exp(shared[b, r] + noise[CLOCKS.index(c), drafters.index(d), b, r])

    def latency(c: int, p: float, b: int, d: str, co: str, r: int) -> float:
        return 10.0 * (0.7 if d == "eagle" else 1.0) * (1980 / c) ** 0.5

    cube = make_cube(
        clocks=CLOCKS,
        batches=list(range(n)),
        drafters=drafters,
        repeats=repeats,
        energy=energy,
        latency=latency,
    )
    result = compare(cube)
    verdicts = result["verdict_equal_latency"].sel(drafter="eagle", corpus="code").values
    saves = float(np.mean(verdicts == "saves"))
    assert saves > 0.05, saves  # twice what the level allows
    assert "picked on the same repeats" in result.attrs["interval"]
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "Nor is the choice at equal latency" in readme
