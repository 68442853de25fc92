"""The server's accept length (/server_info avg_spec_accept_length) and dvfs's cross-check.

Why: SGLang adds to that average only once per --decode-log-interval (40) decode iterations
(0.5.9 log_decode_stats, 0.5.23 report_decode_stats), so it covers a round's whole blocks of
40 iterations and leaves out the last partial one; a round of fewer has no figure at all. The
cross-check must compare only where that tail cannot explain a difference, and the twin must
report what the server would.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dvfs.engines.base import (
    DECODE_LOG_INTERVAL,
    RequestTrace,
    RoundResult,
    server_accept_covers,
)
from dvfs.measure.meter import (
    Q_ACCEPT_MISMATCH,
    SERVER_COVER_MIN,
    WindowPart,
    acceptance,
    summarise,
)

MS = 1_000_000


def _request(passes: int, tokens_per_pass: int) -> RequestTrace:
    """A request of its prefill token then `passes` verify passes of `tokens_per_pass`."""
    tokens = np.array([1] + [tokens_per_pass] * passes, dtype=np.int64)
    times = np.arange(1, passes + 2, dtype=np.int64) * MS
    drafts = tokens_per_pass - 1
    return RequestTrace(0, times, tokens, 10, int(tokens.sum()), "length",
                        spec_verify_ct=passes, spec_accepted_drafts=passes * drafts,
                        spec_proposed_drafts=passes * 3)  # fmt: skip


def _part(passes: int, server: float, *, covers: bool) -> WindowPart:
    """A fixed batch of four requests (3 tokens a pass), the server saying `server`, sampled
    throughout at 1 W."""
    requests = tuple(_request(passes, 3) for _ in range(4))
    end = (passes + 1) * MS
    cover = server_accept_covers(requests, 4) if covers else 0.0
    result = RoundResult(requests, 0, end, server, server_accept_covers=cover)
    times = np.linspace(0, end, 50).astype(np.int64)
    samples = {
        "t_ns": times,
        "energy_mj": times / MS,
        "power_mw": np.full(50, 1000),
        "sm_clock_mhz": np.full(50, 1500),
        "temperature_c": np.full(50, 60),
        "reasons": np.zeros(50, dtype=np.int64),
    }
    return WindowPart(result, (MS, end), samples)


def _quality(part: WindowPart) -> int:
    return summarise(
        [part],
        requested_clock_mhz=None,
        min_window_s=0.0,
        sample_period_s=0.001,
        idle_power_w=0.0,
        precision=1.0,
    ).quality


def test_a_round_longer_than_one_block_is_not_flagged_for_its_left_out_tail() -> None:
    """60 iterations: the server's figure covers the first 40 only (it may say 2.5 while the
    whole round pooled 3.0, its last 20 iterations accepting more); dvfs cannot compare the
    two, so it does not flag a mismatch."""
    part = _part(60, 2.5, covers=True)
    assert part.result.server_accept_covers < SERVER_COVER_MIN
    assert not _quality(part) & Q_ACCEPT_MISMATCH
    # (a server figure whose cover is unknown is never compared either)
    assert not _quality(_part(60, 2.5, covers=False)) & Q_ACCEPT_MISMATCH


def test_a_round_the_server_covers_is_still_cross_checked() -> None:
    """400 iterations: at most 39 left out, so a 2.5 against the pool's 3.0 is a mismatch,
    and an agreeing figure is not."""
    assert _quality(_part(400, 2.5, covers=True)) & Q_ACCEPT_MISMATCH
    assert not _quality(_part(400, 3.0, covers=True)) & Q_ACCEPT_MISMATCH


def test_the_server_figure_of_a_round_is_kept_whatever_it_covers() -> None:
    """The cube still records what the server said; only the comparison is skipped."""
    got = acceptance([_part(60, 2.5, covers=True).result])
    assert got.server_accept_length == 2.5 and got.decode_accept_length == 3.0
    assert 0 < got.server_covers < SERVER_COVER_MIN


@given(
    iterations=st.integers(1, 2000),
    interval=st.integers(1, 100),
    batch=st.integers(1, 64),
    data=st.data(),
)
def test_the_cover_is_a_lower_bound_on_what_the_server_counted(
    iterations: int, interval: int, batch: int, data: st.DataObject
) -> None:
    """Whatever the round's true iteration count N (at least each request's verify passes,
    and at least all of them over the batch), the bound never exceeds the share of the N
    iterations in whole blocks: floor(N / interval) * interval / N."""
    passes = data.draw(st.lists(st.integers(0, iterations), min_size=1, max_size=batch))
    if sum(passes) > iterations * batch:
        return  # not a round of N iterations at this batch
    requests = [_request(p, 2) for p in passes]
    bound = server_accept_covers(requests, batch, interval)
    truth = (iterations - iterations % interval) / iterations
    assert 0.0 <= bound <= truth + 1e-12


def test_the_default_interval_is_sglangs() -> None:
    assert DECODE_LOG_INTERVAL == 40
    assert server_accept_covers([_request(39, 2)], 1) == 0.0
    assert math.isclose(server_accept_covers([_request(390, 2)], 1), 0.9)


@pytest.mark.parametrize("mode", ["fixed", "closed-loop"])
@pytest.mark.parametrize("end", [False, True])
def test_the_twin_reports_what_the_server_would(mode: str, end: bool) -> None:
    """The twin's server figure pools the request steps of the round's whole blocks of 40
    decode iterations only (iterations read back from its chunks: each request's chunk after
    its first is one iteration), and says which share it covers."""
    from test_round_end import SPECULATIVE, _twin_engine, _workload

    engine = _twin_engine()
    engine.start(SPECULATIVE)
    pool = 12 if mode == "closed-loop" else 0
    workload = replace(_workload(4, mode=mode, end=end, pool=pool), max_new_tokens=600)
    result = engine.run(workload)
    assert result.server_accept_length is not None
    if mode == "fixed":
        iterations = max(len(r.chunk_ns) for r in result.requests) - 1
        covered = iterations - iterations % DECODE_LOG_INTERVAL
        assert covered
        tokens = sum(int(r.chunk_tokens[1 : covered + 1].sum()) for r in result.requests)
        passes = sum(min(len(r.chunk_ns) - 1, covered) for r in result.requests)
        assert result.server_accept_length == tokens / passes
        assert result.server_accept_covers == covered / iterations
    # never above what dvfs's bound would allow from the traces
    assert server_accept_covers(result.requests, 4) <= result.server_accept_covers + 1e-12
    assert 0 < result.server_accept_covers <= 1


def test_a_twin_round_shorter_than_a_block_has_no_server_figure() -> None:
    from test_round_end import SPECULATIVE, _twin_engine, _workload

    engine = _twin_engine()
    engine.start(SPECULATIVE)
    result = engine.run(replace(_workload(4, end=True), max_new_tokens=40))
    assert result.server_accept_length is None and result.server_accept_covers == 0.0
