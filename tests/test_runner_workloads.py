"""A runner's round workloads are remembered (issue 15): the one asked again is the one made
the first time, equal to one made afresh, and a campaign or corpus swapped in makes new ones.
A round with a failed request still fails its attempt (checked before its traces are read)."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from dvfs.campaign import load_campaign
from dvfs.corpora.prepare import load_corpora
from dvfs.engines.base import RoundResult
from dvfs.errors import EngineError
from dvfs.measure.plan import plan_cells
from dvfs.measure.runner import Runner
from tests.test_inflight import twin_runner

DEMO = Path(__file__).resolve().parent.parent / "dvfs" / "campaigns" / "demo.toml"


def bare_runner() -> Runner:
    campaign = load_campaign(DEMO)
    none: Any = None
    return Runner(
        campaign,
        gpus=[],
        engine=none,
        clock=none,
        journal=none,
        knobs=none,
        corpora=load_corpora(campaign),
    )


def test_a_remembered_workload_is_the_one_made_afresh() -> None:
    runner = bare_runner()
    cells = plan_cells(runner.campaign)[::37]
    labels: list[object] = [0, 1, True, "1", "t", ("inflight", 2), ("inflight", True)]
    for cell in cells:
        for label in labels:
            for tokens, end in ((256, True), (16, False)):
                first = runner._workload(cell, label, tokens, end_at_window=end)
                fresh = runner._new_workload(cell, label, tokens, end_at_window=end)
                assert first == fresh
                assert runner._workload(cell, label, tokens, end_at_window=end) is first
    # a label that compares equal but reads otherwise (1 and True) has its own workload
    cell = cells[0]
    assert runner._workload(cell, 1, 256) == runner._new_workload(cell, 1, 256, end_at_window=False)
    assert runner._workload(cell, True, 256).seed != runner._workload(cell, 1, 256).seed


def test_another_campaign_or_corpus_makes_new_workloads() -> None:
    runner = bare_runner()
    cell = plan_cells(runner.campaign)[0]
    before = runner._workload(cell, 0, 256)
    runner.campaign = replace(
        runner.campaign, measurement=replace(runner.campaign.measurement, seed=7)
    )
    after = runner._workload(cell, 0, 256)
    assert after == runner._new_workload(cell, 0, 256, end_at_window=False)
    assert after.seed != before.seed
    # the same texts in another object
    runner.corpora = {name: copy.copy(c) for name, c in runner.corpora.items()}
    again = runner._workload(cell, 0, 256)
    assert again == after and again is not after


def test_a_round_with_a_failed_request_fails_the_attempt(tmp_path: Path) -> None:
    with twin_runner(tmp_path, DEMO.read_text()) as runner:
        cell = plan_cells(runner.campaign)[0]
        run = runner.engine.run

        def failing(workload: Any, timeline: Any = None) -> RoundResult:
            result = run(workload, timeline)
            first, *rest = result.requests
            return replace(result, requests=(replace(first, error="boom"), *rest))

        runner.engine = cast(Any, SimpleNamespace(run=failing))
        with pytest.raises(EngineError, match=r"^1 request\(s\) failed; first: boom$"):
            runner.measure(cell)
