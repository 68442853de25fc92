"""The governor's parts without subprocesses: the policy (property-tested), the /metrics parse,
the energy-per-token join, the exporter's text, and the loop on the fake NVML in virtual time."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nvml_support import fake_env, load_fake
from prometheus_client.parser import text_string_to_metric_families

from dvfs.errors import CapsError, GpuStateError
from dvfs.govern.exporter import LiveMetrics, parse_listen, render, start_exporter
from dvfs.govern.loop import (
    STEADY_INTERVALS,
    Ceiling,
    Ticker,
    Watch,
    check_plan_against,
    check_server_for_dry_run,
    govern,
    speculation_warning,
)
from dvfs.govern.metrics import (
    DECODED,
    GENERATED,
    ScrapeError,
    ServerDownError,
    ServerSample,
    energy_per_token,
    parse_server_metrics,
)
from dvfs.govern.plan import BatchPlan, BatchStep, Setting
from dvfs.govern.policy import PolicyParams, PolicyState, band_for, decide, follow, margin
from dvfs.govern.replay import Decode, compare
from dvfs.gpu.base import GpuIdentity
from dvfs.twin.profiles import gpu_profile, model_profile

PLAN = BatchPlan(
    (
        BatchStep(1, Setting(1200, 400.0)),
        BatchStep(4, Setting(1500, None)),
        BatchStep(16, Setting(1800, None)),
        BatchStep(64, Setting(None, 600.0)),
    ),
    "NVIDIA H100 80GB HBM3",
    "none",
    {"measured_on": "NVIDIA H100 80GB HBM3", "drafter": "none"},
)
batches = st.none() | st.integers(0, 100)
params = st.builds(PolicyParams, st.floats(0, 30), st.floats(0, 1))


def run_policy(
    seq: list[tuple[float, int | None]], p: PolicyParams, state: PolicyState | None = None
) -> tuple[PolicyState, list[float]]:
    """Feed (time step, batch) pairs, from the time of the last change on; returns the last
    state and the times of changes."""
    state = state or PolicyState()
    now, changes = state.changed_at or 0.0, []
    for dt, batch in seq:
        now += dt
        decision = decide(PLAN, state, batch, now, p)
        if decision.changed:
            changes.append(now)
        state = decision.state
    return state, changes


def covers(a: Setting, b: Setting) -> bool:
    """`a` is at least as high as `b` on every knob (None, stock, is the highest)."""
    return all(
        x is None or (y is not None and x >= y)
        for x, y in ((a.sm_clock_mhz, b.sm_clock_mhz), (a.power_limit_w, b.power_limit_w))
    )


@given(st.lists(st.tuples(st.floats(0, 20), batches), max_size=60), params)
def test_only_a_looser_setting_comes_sooner_than_the_dwell(seq, p) -> None:
    """Within the dwell of the last change the band only widens (a setting covering the one
    before), and only for a batch the setting in force did not cover."""
    state, now = PolicyState(), 0.0
    for dt, batch in seq:
        now += dt
        decision = decide(PLAN, state, batch, now, p)
        early = state.changed_at is not None and now - state.changed_at < p.dwell_s
        if decision.changed and early:
            old, new = state.band, decision.state.band
            assert decision.early and old is not None and new is not None
            assert not covers(PLAN.band_setting(old), PLAN.setting(PLAN.bucket(batch)))
            assert new[0] <= old[0] <= old[1] <= new[1]
            assert covers(PLAN.band_setting(new), PLAN.band_setting(old))
        else:
            assert not decision.early
        state = decision.state


def test_a_rising_load_gets_a_looser_setting_at_once_and_a_falling_one_waits() -> None:
    """Batch 16 is planned at 1800 MHz: arriving 1 s after a change to 1500 MHz, it must not
    run capped at 1500 MHz for the rest of the 10 s dwell. Back at batch 1, the tighter
    setting waits for the dwell after that change."""
    p = PolicyParams(dwell_s=10.0, hysteresis=0.25)
    state, _ = run_policy([(0.0, 1)], p)
    assert PLAN.band_setting(state.band) == Setting(1500, None)
    decision = decide(PLAN, state, 16, 1.0, p)
    assert decision.changed and decision.early
    assert covers(PLAN.band_setting(decision.state.band), Setting(1800, None))
    state = decision.state
    for now in (2.0, 6.0, 10.9):  # back to batch 1 within the dwell of t=1: held
        held = decide(PLAN, state, 1, now, p)
        assert not held.changed and held.state == state
    tightened = decide(PLAN, state, 1, 11.0, p)
    assert tightened.changed and not tightened.early
    assert PLAN.band_setting(tightened.state.band) == Setting(1500, None)
    # A server that stops answering within the dwell: stock at once.
    down = decide(PLAN, tightened.state, None, 12.0, p)
    assert down.changed and PLAN.band_setting(down.state.band).is_stock


def test_a_first_setting_of_stock_starts_no_dwell() -> None:
    """The server down at start (or its batch above the plan): the governor starts at stock,
    which is no change, so no dwell runs from it; batch 1 seen a second later is capped at
    once (it waited the whole 10 s dwell at stock). After that first cap the dwell holds."""
    p = PolicyParams(dwell_s=10.0, hysteresis=0.25)
    for first in (None, 100):
        start = decide(PLAN, PolicyState(), first, 0.0, p)
        assert start.changed and PLAN.band_setting(start.state.band).is_stock
        capped = decide(PLAN, start.state, 1, 1.0, p)
        assert capped.changed and not capped.early, first
        assert PLAN.band_setting(capped.state.band) == Setting(1500, None)
        held = decide(PLAN, capped.state, 16, 2.0, p)
        assert held.early  # looser at once, within the dwell of t=1
        assert not decide(PLAN, held.state, 1, 5.0, p).changed  # tighter waits


@given(st.lists(st.tuples(st.floats(0, 20), batches), max_size=60), params)
def test_every_change_changes_the_setting(seq, p) -> None:
    """A change is what the governor applies, logs ("set ...") and counts
    (dvfs_govern_changes_total): a band that moves with the batch but keeps the setting in
    force is none of these."""
    state, now = PolicyState(), 0.0
    for dt, batch in seq:
        now += dt
        decision = decide(PLAN, state, batch, now, p)
        if decision.changed and state.band is not None:
            assert decision.state.band is not None
            assert PLAN.band_setting(decision.state.band) != PLAN.band_setting(state.band)
        state = decision.state


def test_a_band_that_moves_without_changing_the_setting_is_no_change() -> None:
    """Batch 3 takes buckets 1..2, batch 1 later buckets 0..1: both at 1500 MHz, stock power
    (between plan batches 1 and 4 the less aggressive neighbour). The band follows the batch;
    the GPUs keep their setting, so nothing is set, and the dwell runs from the last change."""
    p = PolicyParams(dwell_s=10.0, hysteresis=0.25)
    first = decide(PLAN, PolicyState(), 3, 0.0, p)
    moved = decide(PLAN, first.state, 1, 20.0, p)
    assert first.state.band == (1, 2) and moved.state.band == (0, 1)
    assert PLAN.band_setting(moved.state.band) == PLAN.band_setting(first.state.band)
    assert not moved.changed and moved.state.changed_at == 0.0


@given(st.lists(st.tuples(st.floats(0, 20), batches), max_size=30), batches, params)
def test_a_steady_load_changes_the_setting_at_most_once_and_is_served(prefix, batch, p) -> None:
    state, _ = run_policy(prefix, p)
    tail = [(p.dwell_s + 0.001, batch)] * 8
    final, changes = run_policy(tail, p, state)
    assert len(changes) <= 1
    assert final.band is not None
    assert covers(PLAN.band_setting(final.band), PLAN.setting(PLAN.bucket(batch)))


@given(
    st.lists(st.tuples(st.floats(0, 20), st.booleans()), max_size=60), st.integers(0, 80), params
)
def test_a_load_hovering_within_the_hysteresis_changes_at_most_twice(seq, low, p) -> None:
    high = low + margin(low, p.hysteresis)
    if high - low > margin(high, p.hysteresis):
        return  # not within each other's hysteresis
    _, changes = run_policy([(dt, high if up else low) for dt, up in seq], p)
    assert len(changes) <= 2
    if PLAN.bucket(high) != PLAN.stock_bucket:  # both inside the plan: one change at most
        assert len(changes) <= 1


@given(st.lists(st.tuples(st.floats(0, 20), batches), max_size=60), params)
def test_the_load_is_never_underserved_dwell_or_not(seq, p) -> None:
    state, now = PolicyState(), 0.0
    for dt, batch in seq:
        now += dt
        state = decide(PLAN, state, batch, now, p).state
        assert state.band is not None
        assert covers(PLAN.band_setting(state.band), PLAN.setting(PLAN.bucket(batch)))


@given(st.integers(0, 100), st.integers(0, 100))
def test_buckets_rise_with_the_batch_and_between_steps_take_the_safer_neighbour(a, b) -> None:
    low, high = sorted((a, b))
    assert PLAN.bucket(low) <= PLAN.bucket(high)
    bucket = PLAN.bucket(a)
    if 1 < a < 64 and a not in PLAN.batches:
        below = [s for s in PLAN.steps if s.batch < a][-1].setting
        above = [s for s in PLAN.steps if s.batch > a][0].setting
        assert covers(PLAN.setting(bucket), below) and covers(PLAN.setting(bucket), above)


@given(st.lists(st.tuples(st.floats(0, 20), batches), min_size=1, max_size=40), params)
def test_follow_replays_the_same_rule(seq, p) -> None:
    times = [sum(dt for dt, _ in seq[: i + 1]) for i in range(len(seq))]
    state, expected = PolicyState(), []
    for now, (_, batch) in zip(times, seq, strict=True):
        state = decide(PLAN, state, batch, now, p).state
        expected.append(state.band)
    assert follow(PLAN, zip(times, [b for _, b in seq], strict=True), p) == expected


def test_the_buckets_and_the_band_on_a_known_sequence() -> None:
    p = PolicyParams(dwell_s=0, hysteresis=0.25)
    got = [PLAN.bucket(b) for b in (0, 1, 2, 3, 4, 5, 15, 16, 17, 64, 65, None)]
    assert got == [0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 7]
    assert PLAN.setting(1) == Setting(1500, None)  # between 1 (1200, 400 W) and 4 (1500, stock)
    assert PLAN.setting(5).is_stock  # between 16 (1800) and 64 (stock clock, 600 W)
    state, seen = PolicyState(), []
    for batch in (3, 5, 4, 3, 2, 1, 0, 70, None, 60):
        state = decide(PLAN, state, batch, 0.0, p).state
        seen.append(state.band)
    # 3: band 2..4; 5 leaves it: 3..7; 4, 3 and 2 stay inside; 1: 0..2; 0 stays; 70 (above
    # the plan): 52..stock; unknown (stock) and 60 stay inside.
    assert seen == [(1, 2), (1, 3), (1, 3), (1, 3), (1, 3), (0, 1), (0, 1), (5, 7), (5, 7), (5, 7)]
    assert PLAN.band_setting((1, 3)) == Setting(1800, None)
    assert PLAN.band_label((7, 7)).endswith("(stock)") and PLAN.band_setting((5, 7)).is_stock
    assert band_for(PLAN, 60, 0.25) == (5, 6)  # a planned batch's band stops at the plan's top
    assert PLAN.band_label((0, 1)) == "plan batch 1 to between plan batches 1 and 4"
    with pytest.raises(CapsError, match="--dwell"):
        PolicyParams(dwell_s=-1)


SGLANG_PAGE = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",dp="0"} 5.0
sglang:num_running_reqs{model_name="m",dp="1"} 7.0
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m",dp="0"} 1000.0
sglang:generation_tokens_total{model_name="m",dp="1"} 500.0
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="m",dp="0"} 2.0
sglang:spec_accept_length{model_name="m",dp="1"} 3.0
"""


def test_the_server_page_is_summed_over_schedulers() -> None:
    assert parse_server_metrics(SGLANG_PAGE) == ServerSample(12, 1500.0, 2.5)
    no_spec = "\n".join(SGLANG_PAGE.splitlines()[:8]) + "\n"
    assert parse_server_metrics(no_spec).accept_length is None
    with pytest.raises(ScrapeError, match="--enable-metrics"):
        parse_server_metrics("# TYPE x gauge\nx 1\n")
    with pytest.raises(ScrapeError, match="not Prometheus text"):
        parse_server_metrics("sglang:num_running_reqs{ 1 2 3\n")


@pytest.mark.parametrize(
    "rows",
    [
        'sglang:num_running_reqs{dp_rank="0"} 1e308\nsglang:num_running_reqs{dp_rank="1"} 1e308\n',
        "sglang:num_running_reqs 3\n"
        + "".join(
            f'sglang:realtime_tokens_total{{mode="decode",dp_rank="{dp}"}} 1e308\n' for dp in (0, 1)
        ),
        'sglang:num_running_reqs 3\nsglang:generation_tokens_total{a="0"} 1.5e308\n'
        'sglang:generation_tokens_total{a="1"} 1.5e308\n',
    ],
    ids=["batch", "decoded", "generated"],
)
def test_values_that_add_up_past_the_largest_number_are_a_page_not_read(rows: str) -> None:
    """Each finite, a damaged page's values can add up to infinity: no batch (round() raised
    OverflowError, which ended the governor, and the monitor, with an internal error) and no
    token count (an infinite counter exported). The page is one the server did not answer
    with: the governor holds stock, and both say so once."""
    with pytest.raises(ScrapeError, match="too large"):
        parse_server_metrics(rows)
    notes: list[str] = []
    watch = Watch([], lambda: parse_server_metrics(rows), note=notes.append)
    assert watch.server() is None and watch.server() is None
    assert len(notes) == 1 and "too large" in notes[0]


def test_a_running_batch_no_server_holds_is_a_page_not_read() -> None:
    """A finite batch of 1e300 (a damaged page, another program at --url) reached the
    governor's log line as a 301-digit batch: the page is one the server did not answer with
    (the governor holds stock), said once, in one short line."""
    from dvfs.govern.metrics import MAX_RUNNING

    page = "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 1e300\n"
    with pytest.raises(ScrapeError, match="is --url an SGLang server") as caught:
        parse_server_metrics(page)
    assert len(str(caught.value)) < 200 and "\n" not in str(caught.value)
    notes: list[str] = []
    watch = Watch([], lambda: parse_server_metrics(page), note=notes.append)
    assert watch.server() is None and watch.server() is None
    assert len(notes) == 1 and "1e+300" in notes[0], notes
    # The most a server runs is still read.
    most = f"sglang:num_running_reqs {MAX_RUNNING}\n"
    assert parse_server_metrics(most).running == MAX_RUNNING


@pytest.mark.parametrize(
    "page",
    [
        '{"status": "' + "y" * 4_000_000 + '"}',  # a JSON page on one line: not SGLang's
        "sglang:num_running_reqs 2\n\x1b[2J\x00bad\x7f line\n",  # control characters
    ],
    ids=["long-line", "control-characters"],
)
def test_a_page_that_is_not_prometheus_text_is_said_in_one_short_printable_line(page: str) -> None:
    """The parser's complaint quotes the page's line it stopped at, which went into the
    journal whole: a page on one line of megabytes (a JSON endpoint at --url: up to the 16 MiB
    read) was a note of megabytes, each time it changed, and a control character in it made
    journalctl show the note as "blob data". The line is quoted short and escaped."""
    with pytest.raises(ScrapeError) as caught:
        parse_server_metrics(page)
    said = str(caught.value)
    assert said.startswith("the server's /metrics is not Prometheus text ("), said
    assert len(said) <= 300, said[:400]
    assert said.isprintable(), said


@pytest.mark.parametrize("charset", ["base64", "rot13", "idna", "punycode", "undefined", "utf-8"])
def test_a_page_in_a_charset_that_is_no_text_encoding_is_read_as_utf8(charset: str) -> None:
    """A Content-Type naming a bytes codec (base64, rot13) or one that cannot decode with
    replacement (idna, punycode, undefined) raised LookupError or UnicodeError out of the
    read, which ended the governor: the page is read as Prometheus text is, UTF-8."""
    from dvfs.govern.metrics import ServerReader

    page = b"sglang:num_running_reqs 3\n# caf\xc3\xa9, and a byte no UTF-8 has: \xff\n"

    def answer(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": f"text/plain; version=0.0.4; charset={charset}"}
        return httpx.Response(200, headers=headers, content=page)

    with ServerReader("http://127.0.0.1:1", 1.0, transport=httpx.MockTransport(answer)) as read:
        assert read().running == 3


def test_the_ranks_of_one_tensor_parallel_group_count_their_batch_once() -> None:
    """With --enable-metrics-for-all-schedulers every rank of a tensor-parallel group reports
    the batch they share (labelled by tp_rank): summed, a TP-4 server running 16 read as 64,
    and the governor applied batch 64's caps. Data-parallel groups' batches still add up."""
    rows = "".join(
        f'sglang:num_running_reqs{{model_name="m",engine_type="unified",tp_rank="{tp}",'
        f'pp_rank="0",dp_rank="{dp}"}} {batch}.0\n'
        for dp, batch in ((0, 16), (1, 5))
        for tp in range(4)
    )
    page = "# TYPE sglang:num_running_reqs gauge\n" + rows
    assert parse_server_metrics(page).running == 21
    one_group = "".join(line + "\n" for line in page.splitlines() if 'dp_rank="0"' in line)
    assert parse_server_metrics("# TYPE sglang:num_running_reqs gauge\n" + one_group).running == 16


def test_the_ranks_of_an_expert_parallel_group_count_their_batch_once() -> None:
    """SGLang labels each scheduler with its moe_ep_rank too, tp_rank // (tp_size // ep_size):
    under --ep-size 4 (or a DeepEP backend, which sets it to tp_size) every rank of a TP-4
    group has its own, and the group's 16 read as 64 with --enable-metrics-for-all-schedulers."""
    page = "# TYPE sglang:num_running_reqs gauge\n" + "".join(
        f'sglang:num_running_reqs{{model_name="m",engine_type="unified",tp_rank="{tp}",'
        f'pp_rank="0",moe_ep_rank="{tp}"}} 16.0\n'
        for tp in range(4)
    )
    assert parse_server_metrics(page).running == 16


def test_a_page_as_sglang_0_5_23_writes_it_reads_the_running_batch_and_no_speculation() -> None:
    """Laid out as 0.5.23's collectors write it (metrics_collector.py): with
    --enable-priority-scheduling, `num_running_reqs` holds the total under priority="" beside
    one series per priority (its parts: summed with it, 8 running read as 16), and
    `spec_accept_length` is exported at 0 by a server with no speculative algorithm (read as an
    accept length, the governor warned that a no-drafter plan met a speculative server)."""
    labels = 'model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
    page = (
        "# TYPE sglang:num_running_reqs gauge\n"
        f'sglang:num_running_reqs{{{labels},priority=""}} 8.0\n'
        f'sglang:num_running_reqs{{{labels},priority="0"}} 5.0\n'
        f'sglang:num_running_reqs{{{labels},priority="1"}} 3.0\n'
        "# TYPE sglang:spec_accept_length gauge\n"
        f'sglang:spec_accept_length{{{labels},priority=""}} 0.0\n'
        "# TYPE sglang:generation_tokens counter\n"
        'sglang:generation_tokens_total{model_name="m",priority="0"} 3000.0\n'
        'sglang:generation_tokens_total{model_name="m",priority="1"} 1096.0\n'
    )
    sample = parse_server_metrics(page)
    assert (sample.running, sample.accept_length) == (8, None)
    assert sample.generated_tokens == 4096.0 and sample.decoded_tokens is None
    # a speculating data-parallel pair, one rank idle (its gauge 0): the other's length
    spec = (
        "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 1\n"
        "# TYPE sglang:spec_accept_length gauge\n"
        'sglang:spec_accept_length{dp_rank="0"} 3.0\nsglang:spec_accept_length{dp_rank="1"} 0.0\n'
    )
    assert parse_server_metrics(spec).accept_length == 3.0


def test_an_intervals_tokens_are_the_decode_counter_each_group_once() -> None:
    """`generation_tokens_total` grows only as requests finish, by their whole output
    (0.5.23's tokenizer_manager.collect_metrics): an interval's energy over it was NaN while
    long requests ran, then a spike. The tokens decoded each iteration
    (`realtime_tokens_total{mode="decode"}`, one series per scheduler) are read instead, the
    ranks of a tensor-parallel group once, data-parallel groups summed."""
    rows = "".join(
        f'sglang:realtime_tokens_total{{model_name="m",tp_rank="{tp}",pp_rank="0",'
        f'dp_rank="{dp}",mode="{mode}"}} {tokens}.0\n'
        for dp, tokens in ((0, 700), (1, 300))
        for tp in range(2)
        for mode in ("decode", "prefill_compute")
    )
    page = (
        "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 3\n"
        "# TYPE sglang:realtime_tokens counter\n"
        + rows
        + "# TYPE sglang:generation_tokens counter\nsglang:generation_tokens_total 40.0\n"
    )
    sample = parse_server_metrics(page)
    assert (sample.decoded_tokens, sample.generated_tokens) == (1000.0, 40.0)
    assert sample.token_count() == (DECODED, 1000.0)
    assert ServerSample(0, 40.0, None).token_count() == (GENERATED, 40.0)
    assert ServerSample(0, None, None).token_count() is None


def test_the_speculation_warning_waits_for_a_sample_that_can_tell() -> None:
    """SGLang exports `spec_accept_length` at 0 with no speculative algorithm and before a
    speculating server's first verify pass alike (read as no length): the warning that the
    server does not serve as the plan was measured waits for decoded tokens. Read at a
    governor's start, a drafter plan beside an idle speculating server was warned of no
    speculation, and 0.5.23's 0 read as a length warned a no-drafter plan of speculation."""
    eagle = dataclasses.replace(PLAN, drafter="eagle3")
    idle = parse_server_metrics(
        "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0\n"
        "# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length 0.0\n"
    )
    assert speculation_warning(eagle, idle) == (False, None)
    assert speculation_warning(PLAN, idle) == (False, None)
    plain = dataclasses.replace(idle, decoded_tokens=50.0)
    assert speculation_warning(PLAN, plain) == (True, None)
    told, warning = speculation_warning(eagle, plain)
    assert told and warning is not None and "no speculative accept length" in warning
    speculating = dataclasses.replace(plain, accept_length=2.7)
    assert speculation_warning(eagle, speculating) == (True, None)
    told, warning = speculation_warning(PLAN, speculating)
    assert told and warning is not None and "no drafter" in warning


def test_the_speculation_warning_waits_for_the_servers_first_decode_log() -> None:
    """SGLang's scheduler grows its decode counter every decode iteration but sets its gauges
    (spec_accept_length, gen_throughput) only at its periodic decode log, every
    --decode-log-interval iterations (40): a speculating server's page in its first
    iterations reads decoded tokens beside an accept length of 0, and the governor of a
    drafter plan warned, once, that the server serves without speculation. It waits for the
    first decode log (gen_throughput above 0) now; a page without that gauge is read as
    before."""
    eagle = dataclasses.replace(PLAN, drafter="eagle3")

    def page(accept: float, throughput: float) -> str:
        return (
            "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 4\n"
            "# TYPE sglang:realtime_tokens counter\n"
            'sglang:realtime_tokens_total{mode="decode"} 60.0\n'
            f"# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length {accept}\n"
            f"# TYPE sglang:gen_throughput gauge\nsglang:gen_throughput {throughput}\n"
        )

    early = parse_server_metrics(page(0.0, 0.0))  # 20 iterations in: no decode log yet
    assert speculation_warning(eagle, early) == (False, None)
    assert speculation_warning(PLAN, early) == (False, None)
    logged = parse_server_metrics(page(2.9, 310.0))
    assert speculation_warning(eagle, logged) == (True, None)
    plain = parse_server_metrics(page(0.0, 310.0))  # logged, no speculation: it tells
    told, warning = speculation_warning(eagle, plain)
    assert told and warning is not None and "no speculative accept length" in warning
    assert speculation_warning(PLAN, plain) == (True, None)
    bare = dataclasses.replace(early, decode_logged=None)  # no gen_throughput on the page
    told, warning = speculation_warning(eagle, bare)
    assert told and warning is not None


finite = st.floats(0, 1e9, allow_nan=False)


@given(finite, finite, finite, finite)
def test_energy_per_token_is_energy_delta_over_token_delta(e0, e1, t0, t1) -> None:
    value = energy_per_token(e0, e1, t0, t1)
    if t1 > t0 and e1 >= e0:
        assert value == pytest.approx((e1 - e0) / (t1 - t0))
    else:
        assert math.isnan(value)
    assert math.isnan(energy_per_token(None, e1, t0, t1))


@dataclass
class MeterGpu:
    """A GPU with scripted meters (the reading side of the Gpu protocol)."""

    index: int
    energy: int = 0
    power: int = 300_000

    @property
    def identity(self) -> GpuIdentity:
        return GpuIdentity(self.index, f"GPU-{self.index:04d}", "X", "1", "nvml", 2619, 1980)

    def energy_mj(self) -> int:
        return self.energy

    def power_mw(self) -> int:
        return self.power

    def sm_clock_mhz(self) -> int:
        return 1500

    def enforced_power_limit_mw(self) -> int:
        return 700_000


def series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_export_parses_and_joins_each_gpus_energy_with_the_servers_tokens() -> None:
    gpus = [MeterGpu(0, 1_000_000), MeterGpu(1, 5_000_000)]
    samples = iter([ServerSample(3, 100.0, None), ServerSample(4, 150.0, None)])
    watch = Watch(gpus, lambda: next(samples), note=print)  # type: ignore[arg-type]
    live = LiveMetrics()
    live.publish(watch.snapshot(watch.server(), {}))
    gpus[0].energy += 40_000  # 40 J over 50 tokens
    gpus[1].energy += 10_000  # 10 J
    live.publish(watch.snapshot(watch.server(), {"GPU-0000": 1500}))
    got = series(render(live))
    g0 = (("gpu", "0"), ("uuid", "GPU-0000"))
    g1 = (("gpu", "1"), ("uuid", "GPU-0001"))
    assert got[("dvfs_gpu_energy_per_token_joules", g0)] == pytest.approx(40 / 50)
    assert got[("dvfs_gpu_energy_per_token_joules", g1)] == pytest.approx(10 / 50)
    assert got[("dvfs_server_energy_per_token_joules", ())] == pytest.approx(50 / 50)
    assert got[("dvfs_gpu_energy_joules_total", g0)] == pytest.approx(1040.0)
    assert got[("dvfs_gpu_power_watts", g1)] == 300.0
    assert got[("dvfs_gpu_sm_clock_hertz", g0)] == 1.5e9
    assert got[("dvfs_gpu_power_limit_watts", g0)] == 700.0
    assert got[("dvfs_gpu_sm_clock_lock_max_hertz", g0)] == 1.5e9
    assert got[("dvfs_gpu_sm_clock_lock_max_hertz", g1)] == 0.0
    assert got[("dvfs_server_running_requests", ())] == 4
    assert got[("dvfs_server_generated_tokens_total", ())] == 150


def test_a_gpu_without_an_energy_counter_exports_no_nan_counter() -> None:
    """NVML reports no energy counter on some GPUs (older than Volta, some virtual GPUs): its
    counter series is left out, not NaN (a NaN counter carries into every rate() and sum()
    over it, the other GPUs' included), while its other readings and the other GPU's counter
    are exported."""
    from dvfs.errors import GpuNotSupportedError

    class NoEnergyCounter(MeterGpu):
        def energy_mj(self) -> int:
            raise GpuNotSupportedError("GPU 0: energy counter: Not Supported")

    gpus = [NoEnergyCounter(0), MeterGpu(1, 5_000_000)]
    samples = iter([ServerSample(3, 100.0, None), ServerSample(4, 150.0, None)])
    watch = Watch(gpus, lambda: next(samples), note=print)  # type: ignore[arg-type]
    live = LiveMetrics()
    for _ in range(2):
        live.publish(watch.snapshot(watch.server(), {}))
    text = render(live)
    got = series(text)
    g0 = (("gpu", "0"), ("uuid", "GPU-0000"))
    g1 = (("gpu", "1"), ("uuid", "GPU-0001"))
    assert ("dvfs_gpu_energy_joules_total", g0) not in got
    assert got[("dvfs_gpu_energy_joules_total", g1)] == 5000.0
    assert got[("dvfs_gpu_power_watts", g0)] == 300.0
    assert math.isnan(got[("dvfs_gpu_energy_per_token_joules", g0)])
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            assert all(math.isfinite(s.value) for s in family.samples), family.name


def test_an_intervals_tokens_come_from_one_counter() -> None:
    """The decode counter first appears with a server's first decode iteration: the interval
    in which the count moves from the generated-token counter to it has no energy per token
    (not joules over the difference of two counters), the next one has, over decoded tokens
    while the generated-token counter stands still (no request finished)."""
    gpu = MeterGpu(0, 1_000_000)
    samples = iter(
        [
            ServerSample(0, 0.0, None),
            ServerSample(2, 0.0, None, decoded_tokens=30.0),
            ServerSample(2, 0.0, None, decoded_tokens=80.0),
        ]
    )
    watch = Watch([gpu], lambda: next(samples), note=print)  # type: ignore[list-item]
    watch.snapshot(watch.server(), {})
    readings = []
    for _ in range(2):
        gpu.energy += 40_000
        readings.append(watch.snapshot(watch.server(), {}))
    assert math.isnan(readings[0].energy_per_token_j)
    assert math.isnan(readings[0].gpus[0].energy_per_token_j)
    assert readings[1].energy_per_token_j == pytest.approx(40 / 50)
    assert readings[1].generated_tokens == 0.0


def test_the_servers_gpus_are_found_when_it_comes_and_again_when_it_restarts() -> None:
    """Without --gpu only the server's GPUs count in its energy per token. Not found (nothing
    listens yet): every GPU, one warning, tried again after RETRY_S, not every interval. Found:
    one line, and not looked for again while the same process listens; once that process is
    gone (the server restarted), found again, here on the other GPU."""
    from dvfs.govern.servergpus import RETRY_S, Attribution, ServerGpus
    from dvfs.procfs import start_ticks

    old_server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = (os.getpid(), start_ticks(os.getpid()))
        answers = iter(
            [
                Attribution(None, "nothing listens on port 30000 here yet"),
                Attribution(
                    frozenset({"GPU-0001"}),
                    "found",
                    ((old_server.pid, start_ticks(old_server.pid)),),
                ),
                Attribution(frozenset({"GPU-0000"}), "found again", (me,)),
            ]
        )
        looked: list[float] = []
        now = [0.0]

        def find(url: str, gpus: object, proc: Path) -> Attribution:
            looked.append(now[0])
            return next(answers)

        gpus = [MeterGpu(0, 1_000_000), MeterGpu(1, 5_000_000)]
        notes: list[str] = []
        tracker = ServerGpus(
            "http://127.0.0.1:30000",
            gpus,
            notes.append,
            clock=lambda: now[0],
            find=find,  # type: ignore[arg-type]
        )
        tokens = iter(range(100, 10_000, 50))
        watch = Watch(
            gpus,  # type: ignore[arg-type]
            lambda: ServerSample(1, float(next(tokens)), None),
            note=notes.append,
            server_gpus=tracker,
        )

        def interval(at: float) -> dict[str, float]:
            now[0] = at
            gpus[0].energy += 40_000  # 40 J over 50 tokens
            gpus[1].energy += 10_000  # 10 J
            snap = watch.snapshot(watch.server(), {})
            return {"server": snap.energy_per_token_j} | {
                row.reading.uuid: row.energy_per_token_j for row in snap.gpus
            }

        interval(0.0)
        assert interval(1.0)["server"] == pytest.approx(50 / 50)  # every GPU
        assert looked == [0.0] and len(notes) == 1
        assert "counts every GPU (GPU 0, GPU 1): nothing listens on port 30000" in notes[0]
        got = interval(RETRY_S)
        assert looked == [0.0, RETRY_S]
        assert got["server"] == pytest.approx(10 / 50) and math.isnan(got["GPU-0000"])
        assert "energy per token counts GPU 1, the server's GPU(s)" in notes[-1]
        interval(RETRY_S + 1)
        assert looked == [0.0, RETRY_S]  # the same process listens: not looked for again
        old_server.kill()
        old_server.wait(timeout=30)
        got = interval(RETRY_S + 2)
        assert looked == [0.0, RETRY_S, RETRY_S + 2]
        assert got["server"] == pytest.approx(40 / 50) and math.isnan(got["GPU-0001"])
        assert "energy per token counts GPU 0, the server's GPU(s)" in notes[-1]
        assert len(notes) == 3
    finally:
        old_server.kill()
        old_server.wait(timeout=30)


def test_every_series_exported_is_the_readmes_with_help_type_and_base_units() -> None:
    """A full page (a governor's, a server with speculation, a GPU that did not open): each
    family has HELP and TYPE, counters end in _total and gauges do not, quantities carry a
    base unit (watts, joules, hertz), and the series are those the README lists, no more."""
    import re

    from dvfs.govern.exporter import GpuRow, Snapshot
    from dvfs.govern.metrics import GpuReading

    reading = GpuReading(0, 'GPU-a"b\\c', 300.0, 1040.0, 1500, 700.0)  # label escaping too
    live = LiveMetrics(unopened=(1,))
    live.publish(
        Snapshot((GpuRow(reading, 0.8, 1500, True),), True, 4, 150.0, 2.5, 1.0, True, 3, 16)
    )
    text = render(live)
    families = list(text_string_to_metric_families(text))
    typed = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    helped = dict(re.findall(r"^# HELP (\S+) (.+)$", text, re.M))
    assert set(typed) == set(helped) and all(helped.values())
    for name, kind in typed.items():
        assert kind in ("counter", "gauge"), name
        assert name.endswith("_total") == (kind == "counter"), name
    for quantity, unit in (("power", "watts"), ("energy", "joules"), ("clock", "hertz")):
        for name in typed:
            if quantity in name and "by_governor" not in name:
                assert unit in name, name
    labels = {s.labels.get("uuid") for f in families for s in f.samples}
    assert 'GPU-a"b\\c' in labels  # escaped in the text, read back as exported
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("### Caps that follow the load") :]
    section = section[: section.index("\n## ")]
    assert set(typed) == set(re.findall(r"`(dvfs_[a-z_]+)`", section))


def test_the_exporter_serves_the_text_on_loopback() -> None:
    live = LiveMetrics()
    live.publish(Watch([MeterGpu(0)], None, note=print).snapshot(None, {}))  # type: ignore[list-item]
    exporter = start_exporter(live, "127.0.0.1", 0)
    try:
        text = httpx.get(exporter.url, timeout=10).text
    finally:
        exporter.close()
    assert ("dvfs_gpu_power_watts", (("gpu", "0"), ("uuid", "GPU-0000"))) in series(text)
    assert parse_listen("off") is None and parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(Exception, match="HOST:PORT"):
        parse_listen("9435")


@pytest.fixture
def nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    env = fake_env(tmp_path)
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_STATE_DIR"):
        monkeypatch.setenv(key, env[key])
    module = load_fake()
    module.fake_reset_state()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


LISTENER_WITH_A_CHILD = """
import socket, subprocess, sys
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
children = [subprocess.Popen(sleeper) for _ in range(int(sys.argv[1]) if sys.argv[1:] else 1)]
print(server.getsockname()[1], *(child.pid for child in children), flush=True)
sys.stdin.read()
for child in children:
    child.kill()
"""


@contextlib.contextmanager
def _listener_with_children(children: int = 1) -> Iterator[tuple[int, list[int]]]:
    """A loopback listener whose children (SGLang's schedulers) would hold the GPUs: its pid,
    and the port and children's pids it prints; stopped (its stdin closed) on the way out."""
    listener = subprocess.Popen(
        [sys.executable, "-c", LISTENER_WITH_A_CHILD, str(children)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout is not None
        yield listener.pid, [int(v) for v in listener.stdout.readline().split()]
    finally:
        listener.communicate("", timeout=30)


def test_the_gpus_of_the_listeners_child_are_the_servers_and_a_remote_url_none(nvml) -> None:
    """As SGLang runs: the process on the port serves HTTP, a child (the scheduler) holds the
    GPU. Read from this machine's /proc and the fake NVML's compute processes."""
    from dvfs.backends import open_gpus
    from dvfs.govern.servergpus import find_server_gpus

    with _listener_with_children() as (pid, (port, child)):
        url = f"http://localhost:{port}"
        with open_gpus([0, 1]) as gpus:
            nothing = find_server_gpus(url, gpus)
            assert nothing.uuids is None and not nothing.lasting
            assert "NVML lists none of the server's 2 process(es)" in nothing.why
            nvml.fake_add_process(1, child)
            found = find_server_gpus(url, gpus)
            assert found.uuids == {gpus[1].identity.uuid}
            assert f"pid {pid}, listening on port {port}" in found.why
            remote = find_server_gpus("http://192.0.2.1:30000", gpus)
            assert remote.uuids is None and remote.lasting
            assert "not on this machine" in remote.why


def test_a_tensor_parallel_server_found_while_its_ranks_start_counts_every_rank(nvml) -> None:
    """A tensor-parallel server's scheduler processes (one per GPU) take their GPUs one by one
    as they start. Found between the two, the server's GPUs were its first rank's alone, and
    not looked for again while the same process listened: its energy per token counted half
    its GPUs for as long as it ran. Now a finding is looked at again RETRY_S on, until the
    same GPUs are found twice in a row."""
    from dvfs.backends import open_gpus
    from dvfs.govern.servergpus import RETRY_S, Attribution, ServerGpus, find_server_gpus

    looked: list[float] = []

    def find(url: str, gpus: Any, proc: Path) -> Attribution:
        looked.append(now[0])
        return find_server_gpus(url, gpus, proc)

    with _listener_with_children(2) as (pid, (port, rank0, rank1)):
        now = [0.0]
        notes: list[str] = []
        with open_gpus([0, 1]) as gpus:
            uuids = [g.identity.uuid for g in gpus]
            tracker = ServerGpus(
                f"http://127.0.0.1:{port}", gpus, notes.append, clock=lambda: now[0], find=find
            )
            nvml.fake_add_process(0, rank0)
            tracker.refresh()
            assert tracker.uuids == {uuids[0]}
            nvml.fake_add_process(1, rank1)
            for now[0] in (1.0, RETRY_S, 2 * RETRY_S, 3 * RETRY_S):
                tracker.refresh()
            assert tracker.uuids == {uuids[0], uuids[1]}
            assert "energy per token counts GPU 0, GPU 1, the server's" in notes[-1]
            assert looked == [0.0, RETRY_S, 2 * RETRY_S]  # found the same twice: settled


FIND_AS_GIVEN = """
import sys
from types import SimpleNamespace
from dvfs.govern.servergpus import find_server_gpus
port, child = map(int, sys.argv[1:])
gpu = SimpleNamespace(
    identity=SimpleNamespace(index=0, uuid="GPU-0000"), compute_pids=lambda: frozenset({child})
)
print(find_server_gpus(f"http://127.0.0.1:{port}", [gpu]).why)
"""


def _capabilities() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("CapEff:")), 16)


@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or not shutil.which("setpriv"),
    reason="needs root and setpriv to drop capabilities",
)
def test_root_without_capabilities_is_told_why_it_cannot_read_a_root_server() -> None:
    """dvfs-monitor.service runs dvfs as root with no capability: Linux then refuses it the
    fds of a server run as root (which holds capabilities), so no listener is found. The
    reason said it was another user's and to run dvfs as root, which it was."""
    if not _capabilities():
        pytest.skip("this root holds no capability to drop")
    with _listener_with_children() as (pid, (port, child)):
        find = [sys.executable, "-c", FIND_AS_GIVEN, str(port), str(child)]
        env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        as_root = subprocess.run(find, env=env, capture_output=True, text=True, timeout=60)
        assert as_root.stdout.startswith("NVML lists the server's processes"), as_root
        drop = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--"]
        bare = subprocess.run(drop + find, env=env, capture_output=True, text=True, timeout=60)
        assert f"listening on port {port} cannot be read" in bare.stdout, bare
        assert "without CAP_SYS_PTRACE" in bare.stdout and "another user's" not in bare.stdout


class VirtualTime:
    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_after_a_stalled_read_the_monitor_does_not_run_the_missed_intervals_back_to_back() -> None:
    """A server read that hangs for 5 s (SGLang's /metrics stuck behind its event loop): the
    ticker ran the intervals it missed back to back, each over milliseconds, in which a GPU
    energy counter (updated every 100 ms here) had not moved while tokens had: the monitor
    published 0 J/token (or NaN), where the GPU spent 0.3 J a token throughout. Now the next
    interval starts at least half an interval after the stalled read ends."""
    from dvfs.govern.loop import monitor

    time = VirtualTime()
    power_w, tokens_per_s = 300.0, 1000.0

    class CountingGpu(MeterGpu):
        def energy_mj(self) -> int:
            time.sleep(0.002)  # each NVML read takes a little time
            return int(power_w * 1000 * (time.now // 0.1) * 0.1)  # the counter's 100 ms steps

    reads = iter(range(1000))

    def scrape() -> ServerSample:
        if next(reads) == 3:
            time.sleep(5.0)  # the stalled read
        time.sleep(0.005)
        return ServerSample(1, tokens_per_s * time.now, None)

    published: list[float] = []

    class Recording(LiveMetrics):
        def publish(self, snapshot) -> None:  # type: ignore[no-untyped-def]
            published.append(snapshot.gpus[0].energy_per_token_j)
            super().publish(snapshot)

    monitor(
        [CountingGpu(0)],  # type: ignore[list-item]
        scrape,
        Ticker(1.0, 12, clock=time.clock, sleep=time.sleep),
        live=Recording(),
        note=print,
    )
    assert math.isnan(published[0])  # no interval before the first read
    for value in published[1:]:
        assert value == pytest.approx(power_w / tokens_per_s, rel=0.25), published


def test_while_an_nvml_read_hangs_the_page_says_when_its_numbers_were_read() -> None:
    """An NVML call that does not return (a GPU in a bad state) holds the loop in it, and the
    page keeps serving the last interval's numbers, dvfs_gpu_up 1 among them: nothing on it
    told a stale page from a fresh one, and an alert on dvfs_gpu_up == 0 never fired. The
    page says when the reads it holds ended, which stops advancing while one hangs."""
    from dvfs.govern.loop import monitor

    time = VirtualTime()
    pages: list[str] = []
    live = LiveMetrics()
    live.clock = lambda: 1_700_000_000.0 + time.now

    class HangingGpu(MeterGpu):
        reads = 0

        def power_mw(self) -> int:
            self.reads += 1
            if self.reads == 3:  # the third interval's read hangs for an hour: scraped then
                time.sleep(3600.0)
                pages.append(render(live))
            return self.power

    monitor(
        [HangingGpu(0)],  # type: ignore[list-item]
        None,
        Ticker(1.0, 4, clock=time.clock, sleep=time.sleep),
        live=live,
        note=print,
    )
    during, after = series(pages[0]), series(render(live))
    read_at = during[("dvfs_last_read_timestamp_seconds", ())]
    assert read_at == pytest.approx(1_700_000_001.0, abs=0.01)  # the second interval's reads
    assert during[("dvfs_gpu_up", (("gpu", "0"), ("uuid", "GPU-0000")))] == 1.0
    assert after[("dvfs_last_read_timestamp_seconds", ())] > read_at + 3600


def test_the_loop_follows_a_scripted_load_and_restores(nvml, tmp_path: Path) -> None:
    from dvfs.backends import open_gpus

    load = [0, 0, 3, 3, 3, 3, 10, 10, 10, 2, 2, 2, 2, 0, 0, 0, 70, 1, 1, 1, 1]
    script = iter(load)
    time, lines, live = VirtualTime(), [], LiveMetrics()
    with open_gpus([0]) as gpus:
        check_plan_against(PLAN, gpus, where="p", allow_simulated=False)
        changes = govern(
            PLAN,
            gpus,
            lambda: ServerSample(next(script), None, None),
            PolicyParams(dwell_s=2.0, hysteresis=0.25),
            Ticker(1.0, len(load), clock=time.clock, sleep=time.sleep),
            live=live,
            note=lines.append,
            state_dir=tmp_path / "state",
        )
        locks = [c["args"] for c in nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")]
        # t=0: 0 -> 1200 MHz, 400 W; t=2: 3 (band 2..4) -> 1500, stock limit; t=6: 10 (band
        # 7..13) -> 1800; t=9: 2 (band 1..3) -> 1500; t=13: 0 is inside that band: no change;
        # t=16: 70 -> stock; 1 at t=17 is within the dwell of t=16, so it waits until t=18.
        assert locks == [[210, 1200], [210, 1500], [210, 1800], [210, 1500], [210, 1500]]
        limits = [c["args"] for c in nvml.fake_calls("nvmlDeviceSetPowerManagementLimit")]
        assert limits == [[400_000], [700_000]]
        assert lines[0] == (
            "static caps in force, the ceiling of every step and what the plan calls stock "
            "(restored on exit): GPU 0: SM clock unlocked, power limit 700 W"
        )
        lines = lines[1:]
        assert changes == 6 and all("set running batch" in line for line in lines)
        at = [float(line.split("(at ")[1].split(" s)")[0]) for line in lines]
        assert at == [0, 2, 6, 9, 16, 18]
        last = live.latest()  # what the exporter shows after the last interval
        assert (last.governed, last.changes, last.plan_batch) == (True, 6, 4)
        assert last.gpus[0].lock_max_mhz == 1500 and last.server_up and last.running == 1
        assert nvml.fake_calls("nvmlDeviceResetGpuLockedClocks")  # restored at the end
        state = nvml.fake_device_state(0)
        assert state["locked_clocks"] is None and state["power_limit_mw"] == 700_000
        assert not list((tmp_path / "state").glob("GPU-*.json"))  # state file cleared


def test_every_gpu_change_of_the_governor_is_made_under_its_sigterm_handler(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM before the governor's handler is in place (its start-up: plan, server,
    NVML, the exporter) ends it by the signal, which is safe only while no GPU setting has
    been changed: every setter call must find SIGTERM handled by Python (raising, so the
    unwinding restores), not at the default (die, leaving the cap). The test starts from
    the default disposition, as a service does."""
    import signal

    from dvfs.backends import open_gpus

    seen: list[tuple[str, object]] = []

    def recording(name: str) -> object:
        real = getattr(nvml, name)

        def setter(*args: object) -> object:
            seen.append((name, signal.getsignal(signal.SIGTERM)))
            return real(*args)

        return setter

    for name in ("nvmlDeviceSetGpuLockedClocks", "nvmlDeviceSetPowerManagementLimit"):
        monkeypatch.setattr(nvml, name, recording(name))
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        load = [0, 3, 3, 3, 10, 10, 10, 70]
        script = iter(load)
        time = VirtualTime()
        with open_gpus([0]) as gpus:
            govern(
                PLAN,
                gpus,
                lambda: ServerSample(next(script), None, None),
                PolicyParams(dwell_s=2.0, hysteresis=0.25),
                Ticker(1.0, len(load), clock=time.clock, sleep=time.sleep),
                live=LiveMetrics(),
                note=lambda line: None,
                state_dir=tmp_path / "state",
            )
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert {name for name, _ in seen} == {
        "nvmlDeviceSetGpuLockedClocks",
        "nvmlDeviceSetPowerManagementLimit",
    }
    assert all(callable(handler) for _, handler in seen), seen
    assert after == signal.SIG_DFL  # put back once the GPU was restored


def test_the_loop_loosens_at_once_and_says_so(nvml, tmp_path: Path) -> None:
    """A load rising within the dwell gets its looser lock at the very interval it is seen, the
    log saying why it did not wait; the step back down waits for the dwell."""
    from dvfs.backends import open_gpus

    load = [1, 1, 16, 16, 1, 1, 1, 1, 1, 1]
    script = iter(load)
    time, lines = VirtualTime(), []
    with open_gpus([0]) as gpus:
        changes = govern(
            PLAN,
            gpus,
            lambda: ServerSample(next(script), None, None),
            PolicyParams(dwell_s=4.0, hysteresis=0.25),
            Ticker(1.0, len(load), clock=time.clock, sleep=time.sleep),
            live=LiveMetrics(),
            note=lines.append,
            state_dir=tmp_path / "state",
        )
        locks = [c["args"] for c in nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")]
    sets = [line for line in lines if line.startswith("set ")]
    assert changes == 3 and len(sets) == 3
    # t=0: batch 1 -> 1500 MHz; t=2: batch 16 (1800 MHz planned) -> stock at once, not at
    # t=4; t=6: back to batch 1's 1500 MHz, 4 s (the dwell) after t=2, not at t=4.
    assert sets[1].startswith("set running batch 16 -> ")
    assert sets[1].endswith(
        "(at 2.000 s, within the dwell: the setting in force did not cover the batch)"
    )
    assert "within the dwell" not in sets[0] + sets[2] and sets[2].endswith("(at 6.000 s)")
    assert locks[0] == [210, 1500] and locks[-1] == [210, 1500]
    assert nvml.fake_calls("nvmlDeviceResetGpuLockedClocks")  # batch 16: the clock unlocked


def _scripted(batches: list[int | None]) -> Callable[[], ServerSample]:
    """A scraper reading the server's running batch from BATCHES in turn, None a server that
    does not answer."""
    script = iter(batches)

    def scraper() -> ServerSample:
        batch = next(script)
        if batch is None:
            raise ServerDownError("cannot read http://127.0.0.1:1/metrics: refused")
        return ServerSample(batch, None, None)

    return scraper


def test_a_dry_run_says_stock_while_the_server_cannot_be_read(nvml) -> None:
    """The server drops out mid-run for longer than the grace (`SERVER_GRACE_S`, 5 s): the
    setting in force is held until 5 s after its last answer, then the fallback to stock is
    named as that, not as a batch above the plan; its return, and the dry run's calls (none),
    as they are."""
    from dvfs.backends import open_gpus

    scraper = _scripted([0, *[None] * 6, 0])

    time, lines, live = VirtualTime(), [], LiveMetrics()
    with open_gpus([0]) as gpus:
        changes = govern(
            PLAN,
            gpus,
            scraper,
            PolicyParams(dwell_s=0.0),
            Ticker(1.0, 8, clock=time.clock, sleep=time.sleep),
            live=live,
            note=lines.append,
            dry_run=True,
        )
    assert changes == 3
    planned = (
        "dry run, nothing changed: would set running batch 0 -> plan batch 1: SM clock <= "
        "1200 MHz, power limit 400 W; GPU 0: SM clock locked 210-1200 MHz, power limit 400 W"
    )
    assert lines == [
        "static caps in force, the ceiling of every step and what the plan calls stock: "
        "GPU 0: SM clock unlocked, power limit 700 W",
        f"{planned} (at 0.000 s)",
        "server: cannot read http://127.0.0.1:1/metrics: refused; the setting in force is "
        "held (stock if it does not answer within 5 s of its last answer)",
        "dry run, nothing changed: would set SM clock stock, power limit stock while the "
        "server's batch cannot be read; GPU 0: SM clock unlocked (stock: no static clock cap "
        "in force), power limit 700 W (stock: the limit in force at start) (at 5.000 s)",
        f"{planned} (at 7.000 s)",
        # back for one read as the run ends (`STEADY_INTERVALS`: one outage however it flaps)
        "server: /metrics answers again (6 reads of it failed meanwhile)",
    ]
    assert nvml.fake_calls() == []
    assert live.latest().server_read_failures == 6


def test_a_read_that_fails_between_answered_ones_keeps_the_setting_in_force(
    nvml, tmp_path: Path
) -> None:
    """A read of the server that failed (one timed out on a loaded machine: a 0.05 s
    --interval's reads get 0.5 s) counted as a server gone: the governor went to stock at
    once, within the dwell, and the dwell then held stock for 10 s, a change each way, every
    time one read missed. A read that fails within 5 s of the last answered one keeps the
    setting in force, said once in the log, each failure counted in
    dvfs_server_read_failures_total; the server's return is said (one outage while it flaps,
    `STEADY_INTERVALS`: here as the run ends), nothing set."""
    from dvfs.backends import open_gpus

    scraper = _scripted([0, None, 0, None, None, 0, 0])
    time, lines, live = VirtualTime(), [], LiveMetrics()
    with open_gpus([0]) as gpus:
        changes = govern(
            PLAN,
            gpus,
            scraper,
            PolicyParams(dwell_s=10.0),
            Ticker(1.0, 7, clock=time.clock, sleep=time.sleep),
            live=live,
            note=lines.append,
            state_dir=tmp_path / "state",
        )
        locks = [c["args"] for c in nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")]
        assert nvml.fake_device_state(0)["locked_clocks"] is None  # restored at the end
    assert changes == 1, lines
    assert locks == [[210, 1200]], lines
    assert not nvml.fake_calls("nvmlDeviceResetGpuLockedClocks")[:-1], lines
    assert not [line for line in lines if "cannot be read" in line], lines
    assert lines[2:] == [
        "server: cannot read http://127.0.0.1:1/metrics: refused; the setting in force is "
        "held (stock if it does not answer within 5 s of its last answer)",
        "server: /metrics answers again (3 reads of it failed meanwhile)",
    ]
    last = live.latest()
    assert (last.server_read_failures, last.plan_batch, last.changes) == (3, 1, 1)
    page = series(render(live))
    assert page[("dvfs_server_read_failures_total", ())] == 3.0


def test_at_an_interval_of_the_grace_or_more_a_failed_read_goes_to_stock(nvml) -> None:
    """At --interval 5 s (SERVER_GRACE_S) or more, a read that fails goes to stock at once, as
    before the grace: no answered read is recent. The grace was measured between the reads'
    wake-ups, so one answered read that woke late (a loaded machine: a sleep overran by
    10 ms) put the next, on time, less than 5 s after it: its failure held the setting in
    force for a whole interval more, 10 s without a reading."""
    from dvfs.backends import open_gpus

    time, lines = VirtualTime(), []
    late = iter([0.01])

    def sleep(seconds: float) -> None:  # the first sleep overruns by 10 ms, no other
        time.sleep(seconds + next(late, 0.0))

    with open_gpus([0]) as gpus:
        govern(
            PLAN,
            gpus,
            _scripted([0, 0, None]),
            PolicyParams(dwell_s=0.0),
            Ticker(5.0, 3, clock=time.clock, sleep=sleep),
            live=LiveMetrics(),
            note=lines.append,
            dry_run=True,
        )
    assert lines[2] == "server: cannot read http://127.0.0.1:1/metrics: refused", lines
    assert "cannot be read" in lines[3] and lines[3].endswith("(at 10.000 s)"), lines


@pytest.mark.parametrize(("interval", "stock_at"), [(4.0, 4.0), (0.7, 4.9)])
def test_a_read_that_hangs_past_the_grace_goes_to_stock(
    nvml, interval: float, stock_at: float
) -> None:
    """A server that hangs (its reads time out, the interval's time each, 4 s at --interval
    4): the grace was judged as each read started, so a read starting 4 s after the last
    answered one kept the setting in force when it failed, at 8 s, and the next, starting
    at 10 s, went to stock as it failed, at 14 s: the grace of 5 s held the setting 14 s
    without a reading, 6 s more than before it. A failed read is judged as it fails: no
    setting is held past 5 s after the last answered read but for the read that ends there
    (at --interval 0.7 the read started at 4.9 s fails at 5.6 s and goes to stock; it held,
    and the next read, started at 5.95 s, went to stock at 6.65 s). The line says the
    interval the read started."""
    from dvfs.backends import open_gpus

    time, lines = VirtualTime(), []
    script = iter([0, *[None] * 20])

    def scraper() -> ServerSample:  # a read that hangs until it times out
        if next(script) is None:
            time.sleep(max(0.5, interval))
            raise ServerDownError("cannot read http://127.0.0.1:1/metrics: timed out")
        return ServerSample(0, None, None)

    with open_gpus([0]) as gpus:
        govern(
            PLAN,
            gpus,
            scraper,
            PolicyParams(dwell_s=0.0),
            Ticker(interval, 20, clock=time.clock, sleep=time.sleep),
            live=LiveMetrics(),
            note=lines.append,
            dry_run=True,
        )
    stock = [line for line in lines if "cannot be read" in line]
    assert len(stock) == 1 and stock[0].endswith(f"(at {stock_at:.3f} s)"), lines


def test_a_flapping_server_is_one_outage_in_the_log(nvml, tmp_path: Path) -> None:
    """A server whose reads failed one in two (a loaded machine's reads missing their
    deadline) logged two lines a missed read, the monitor's and the governor's alike: a
    journal filling at the interval's pace. It is one outage, said once, and back once it has
    answered STEADY_INTERVALS reads in a row (or as the run ends), with the reads that failed
    in it; a read failing otherwise than the one noted is said; the counter counts each."""
    from dvfs.backends import open_gpus
    from dvfs.govern.loop import monitor

    refused = "server: cannot read http://127.0.0.1:1/metrics: refused"
    flaps = [None, 0] * 5
    script = [0, *flaps, *[0] * STEADY_INTERVALS, *flaps]
    time, lines, live = VirtualTime(), [], LiveMetrics()
    failures: list[int] = []

    def locks() -> dict:  # called at the start of every interval
        failures.append(live.latest().server_read_failures)
        return {}

    with open_gpus([0]) as gpus:
        ticker = Ticker(1.0, len(script), clock=time.clock, sleep=time.sleep)
        monitor(gpus, _scripted(script), ticker, live=live, note=lines.append, locks=locks)
    back = "server: /metrics answers again (5 reads of it failed meanwhile)"
    assert lines == [refused, back, refused, back], lines
    failures.append(live.latest().server_read_failures)
    assert failures == sorted(failures) and failures[-1] == 10, failures

    # The governor: the same, the first line saying the setting in force is held.
    lines = []
    with open_gpus([0]) as gpus:
        govern(
            PLAN,
            gpus,
            _scripted(script),
            PolicyParams(dwell_s=10.0),
            Ticker(1.0, len(script), clock=time.clock, sleep=time.sleep),
            live=live,
            note=lines.append,
            state_dir=tmp_path / "state",
        )
    held = (
        "; the setting in force is held (stock if it does not answer within 5 s of its last answer)"
    )
    assert lines[2:] == [refused + held, back, refused + held, back], lines

    # A read failing otherwise than the one noted, within one outage, is said.
    def otherwise() -> ServerSample:
        raise ScrapeError("http://127.0.0.1:1/metrics answered 404: start SGLang with ...")

    first = _scripted([None, 0, None])
    order = iter([first, first, first, otherwise, _scripted([0])])
    lines = []
    with open_gpus([0]) as gpus:
        ticker = Ticker(1.0, 5, clock=time.clock, sleep=time.sleep)
        monitor(gpus, lambda: next(order)(), ticker, live=live, note=lines.append)
    assert lines == [
        refused,
        "server: http://127.0.0.1:1/metrics answered 404: start SGLang with ...",
        "server: /metrics answers again (3 reads of it failed meanwhile)",
    ], lines


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_first_setting_of_stock_is_no_change(nvml, tmp_path: Path, dry_run: bool) -> None:
    """The server down at start: the governor holds the GPUs at what the plan calls stock,
    which they are at already. That was logged "set ..." and counted in
    dvfs_govern_changes_total; it is said as where the governor starts, and not counted."""
    from dvfs.backends import open_gpus

    scraper = _scripted([None, 0])

    time, lines, live = VirtualTime(), [], LiveMetrics()
    with open_gpus([0]) as gpus:
        changes = govern(
            PLAN,
            gpus,
            scraper,
            PolicyParams(dwell_s=0.0),
            Ticker(1.0, 2, clock=time.clock, sleep=time.sleep),
            live=live,
            note=lines.append,
            dry_run=dry_run,
            state_dir=None if dry_run else tmp_path / "state",
        )
    assert changes == 1, lines
    [start] = [line for line in lines if "starts at SM clock stock" in line]
    assert "while the server's batch cannot be read" in start
    assert sum("set running batch 0" in line for line in lines) == 1, lines


def _govern_capped(
    nvml: Any,
    tmp_path: Path,
    scraper: Any,
    steps: int,
    params: PolicyParams,
    *,
    dry_run: bool = False,
    live: LiveMetrics | None = None,
) -> tuple[int, list[str]]:
    """`govern` of GPU 0 under a static clock cap of 1200 MHz (locked, and in `cap apply`'s
    record) for `steps` intervals of a second of virtual time: its changes and its lines."""
    from dvfs.backends import open_gpus
    from dvfs.caps.actuation import AppliedCaps

    state = tmp_path / "state"
    time, lines = VirtualTime(), []
    with open_gpus([0]) as gpus:
        nvml.fake_update_device(0, locked_clocks=[210, 1200])
        AppliedCaps(state).update(gpus[0].identity.uuid, {"lock_mhz": [210, 1200]})
        changes = govern(
            PLAN,
            gpus,
            scraper,
            params,
            Ticker(1.0, steps, clock=time.clock, sleep=time.sleep),
            live=live or LiveMetrics(),
            note=lines.append,
            dry_run=dry_run,
            state_dir=state,
        )
    return changes, lines


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_static_lock_outside_the_gpus_clocks_in_the_caps_record_is_refused(
    nvml, tmp_path: Path, dry_run: bool
) -> None:
    """A caps record whose lock_mhz was hand-edited to 210-5000 MHz (above the GPU's 1980 MHz
    top clock, a cap dvfs never set) was the governor's static cap and stock: "SM clock locked
    210-5000 MHz", its steps held under it, and at the end the restore of 210-5000 MHz failed
    ("could not restore"), the GPU left at its last step (210-1200 MHz, 400 W). It is refused
    as a damaged record is, in one line naming the line and the reset that drops the entry,
    before any GPU is changed; `dvfs cap reset --applied` then lets the governor start."""
    from dvfs.backends import open_gpus
    from dvfs.caps.actuation import AppliedCaps

    state = tmp_path / "state"
    time, lines = VirtualTime(), []
    with open_gpus([0]) as gpus:
        uuid = gpus[0].identity.uuid
        AppliedCaps(state).update(uuid, {"lock_mhz": [210, 5000]})
        with pytest.raises(CapsError) as refused:
            govern(
                PLAN,
                gpus,
                _scripted([0, 0]),
                PolicyParams(dwell_s=0.0),
                Ticker(1.0, 2, clock=time.clock, sleep=time.sleep),
                live=LiveMetrics(),
                note=lines.append,
                dry_run=dry_run,
                state_dir=state,
            )
    said = str(refused.value)
    assert "\n" not in said and "caps-applied.json line " in said, said
    assert f"is damaged for GPU {uuid}: lock_mhz is [210, 5000], outside GPU 0's SM clocks" in said
    assert f"`dvfs cap reset --applied --state-dir {state} {uuid}`" in said, said
    assert nvml.fake_calls("nvmlDeviceSetGpuLockedClocks") == []
    assert nvml.fake_calls("nvmlDeviceSetPowerManagementLimit") == []
    assert not list(state.glob("GPU-*.json")) and not list(state.glob("governed-*"))


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_step_the_static_caps_hold_already_is_no_change(
    nvml, tmp_path: Path, dry_run: bool
) -> None:
    """Under a static clock cap of 1200 MHz, the plan's 1800 MHz (batch 4) and stock (batch
    16) both leave the GPU at 1200 MHz and its power limit: each was logged "set ..." and
    counted in dvfs_govern_changes_total ("Settings the governor changed"), with no setting
    changed. Only plan batch 1's 400 W (batch 0) changes the GPU: one change, one "set"."""
    script = iter([4, 16, 0])
    changes, lines = _govern_capped(
        nvml,
        tmp_path,
        lambda: ServerSample(next(script), None, None),
        3,
        PolicyParams(dwell_s=0.0),
        dry_run=dry_run,
    )
    assert changes == 1, lines
    sets = [line for line in lines if " set " in f" {line}"]
    assert len(sets) == 1 and "running batch 0 -> plan batch 1: " in sets[0], lines
    assert sets[0].endswith("GPU 0: SM clock locked 210-1200 MHz, power limit 400 W (at 2.000 s)")
    [start] = [line for line in lines if "starts at running batch 4" in line]
    assert "SM clock locked 210-1200 MHz (the static cap in force" in start, start
    [held] = [line for line in lines if "running batch 16 -> " in line]
    assert held.startswith(("no change at", "dry run: no change at")), held


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_step_that_changes_nothing_does_not_restart_the_dwell(
    nvml, tmp_path: Path, dry_run: bool
) -> None:
    """The dwell runs from the last change (README: "never sooner than --dwell after the last
    change"). Under a static clock cap of 1200 MHz the governor starts at stock (t=0) and
    batch 4's 1800 MHz (t=1) leaves the GPU as it is ("no change at"); batch 0's 400 W at t=2
    is the first change, and nothing changed within a dwell before it: it is set at once, not
    at t=5, a whole dwell after the step that changed nothing."""
    load = [100, 4, 0, 0, 0, 0, 0]
    changes, lines = _govern_capped(
        nvml,
        tmp_path,
        _scripted(list(load)),
        len(load),
        PolicyParams(dwell_s=4.0, hysteresis=0.25),
        dry_run=dry_run,
    )
    assert changes == 1, lines
    [held] = [line for line in lines if "running batch 4 -> " in line]
    assert held.startswith(("no change at", "dry run: no change at")), held
    [change] = [line for line in lines if "running batch 0 -> " in line]
    assert "power limit 400 W" in change and change.endswith("(at 2.000 s)"), lines


def test_a_step_that_sets_a_limit_changed_outside_dvfs_again_is_a_change(
    nvml, tmp_path: Path
) -> None:
    """Under a static clock cap of 1200 MHz, batch 4's 1800 MHz leaves the GPU as the governor
    left it; but an admin set the power limit to 500 W since the step before, and the step puts
    the limit in force at start (700 W) back. That write was logged "no change at" and not
    counted in dvfs_govern_changes_total: it is a change, said "set" and counted."""
    load = iter([100, 4])

    def scraper() -> ServerSample:
        batch = next(load)
        if batch == 4:  # changed outside dvfs since the governor's last step
            nvml.fake_update_device(0, power_limit_mw=500_000)
        return ServerSample(batch, None, None)

    live = LiveMetrics()
    changes, lines = _govern_capped(
        nvml, tmp_path, scraper, 2, PolicyParams(dwell_s=0.0), live=live
    )
    # (the first write is the step's; the GPUs' restore at the end comes after it)
    limits = [c["args"] for c in nvml.fake_calls("nvmlDeviceSetPowerManagementLimit")]
    assert limits[0] == [700_000], limits  # the step wrote the limit back
    [step] = [line for line in lines if "running batch 4 -> " in line]
    assert step.startswith("set running batch 4 -> "), lines
    assert changes == 1 and live.latest().changes == 1, lines


def test_a_dry_run_refuses_a_server_that_does_not_answer_in_one_line(nvml, tmp_path: Path) -> None:
    """With no load to preview, one line says what the governor would hold the GPUs at
    meanwhile: its stock, the static caps in force (a lock `cap apply` recorded included),
    named with their values, never as the GPUs' own stock when a cap holds them lower."""
    from dvfs.backends import open_gpus
    from dvfs.caps.actuation import AppliedCaps

    def down() -> ServerSample:
        raise ServerDownError("cannot read http://127.0.0.1:1/metrics: refused")

    def bare() -> ServerSample:
        raise ScrapeError("http://127.0.0.1:1/metrics answered 404: start SGLang with X")

    state = tmp_path / "state"
    with open_gpus([0, 1]) as gpus:
        check_server_for_dry_run(lambda: ServerSample(0, None, None), "http://h:1", gpus, state)
        with pytest.raises(ScrapeError) as refused:
            check_server_for_dry_run(down, "http://127.0.0.1:1", gpus, state)
        assert refused.value.exit_code == 1
        assert str(refused.value) == (
            "dry run: the server at http://127.0.0.1:1 is not answering (cannot read "
            "http://127.0.0.1:1/metrics: refused); the governor would hold GPU 0, GPU 1 at "
            "stock, the static caps in force (GPU 0, GPU 1: SM clock unlocked, power limit "
            "700 W) until it answers. Start SGLang there with --enable-metrics, or point --url "
            "at it"
        )
        with pytest.raises(ScrapeError, match=r"answered 404: start SGLang with X; the gov"):
            check_server_for_dry_run(bare, "http://127.0.0.1:1", gpus, state)
        AppliedCaps(state).update(gpus[0].identity.uuid, {"lock_mhz": [210, 1500]})
        with pytest.raises(ScrapeError) as capped:
            check_server_for_dry_run(down, "http://127.0.0.1:1", gpus, state)
        assert (
            "the governor would hold GPU 0, GPU 1 at stock, the static caps in force (GPU 0: "
            "SM clock locked 210-1500 MHz, power limit 700 W; GPU 1: SM clock unlocked, power "
            "limit 700 W) until it answers"
        ) in str(capped.value)
    assert nvml.fake_calls() == []


def test_the_loop_refuses_a_gpu_with_unrestored_changes(nvml, tmp_path: Path) -> None:
    from dvfs.backends import open_gpus
    from dvfs.gpu.knobs import GpuSettings
    from dvfs.gpu.safety import StateStore

    with open_gpus([0]) as gpus:
        StateStore(tmp_path / "state").record(GpuSettings(gpus[0].identity.uuid, None, 700_000))
        with pytest.raises(GpuStateError, match="dvfs gpu reset"):
            govern(
                PLAN,
                gpus,
                lambda: ServerSample(0, None, None),
                PolicyParams(),
                Ticker(1.0, 1, clock=VirtualTime().clock, sleep=VirtualTime().sleep),
                live=LiveMetrics(),
                note=print,
                state_dir=tmp_path / "state",
            )
        with pytest.raises(CapsError, match="measured on NVIDIA H200"):
            other = BatchPlan(PLAN.steps, "NVIDIA H200", "none")
            check_plan_against(other, gpus, where="p", allow_simulated=False)
        with pytest.raises(CapsError, match="simulated"):
            twin = BatchPlan(PLAN.steps, "NVIDIA H100 80GB HBM3 (twin)", "none")
            check_plan_against(twin, gpus, where="p", allow_simulated=False)
        check_plan_against(twin, gpus, where="p", allow_simulated=True)
        with pytest.raises(CapsError, match="1234 MHz is not a supported SM clock of GPU 0"):
            odd = BatchPlan((BatchStep(1, Setting(1234, None)),), PLAN.measured_on, "none")
            check_plan_against(odd, gpus, where="p", allow_simulated=False)
    assert not nvml.fake_calls()


def test_a_plans_power_step_above_the_gpus_default_now_is_refused(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver update lowered the GPU's default power limit (700 W to 400 W) below a plan's
    420 W step, planned against the old stock; the GPU held 450 W (a cap set above the new
    default before `cap apply` refused one), so the governor's ceiling let the step through
    and it set 420 W, above the GPU's stock, a setting never measured, where `cap apply`
    refuses the same cap. The plan is refused before any change in `cap apply`'s words,
    naming the step; a step at the default is followed."""
    from dvfs.backends import open_gpus

    monkeypatch.setitem(nvml.FAKE_PROFILES["h100-sxm"], "power_default_mw", 400_000)
    nvml.fake_update_device(0, power_limit_mw=450_000)
    above = BatchPlan(
        (BatchStep(1, Setting(1200, 420.0)), BatchStep(4, Setting(1500, None))),
        PLAN.measured_on,
        "none",
    )
    with open_gpus([0]) as gpus:
        with pytest.raises(CapsError) as refused:
            check_plan_against(above, gpus, where="p", allow_simulated=False)
        said = str(refused.value)
        assert "\n" not in said and said.startswith("p: step batch 1: "), said
        assert "power limit 420 W is above the GPU's default power limit 400 W" in said, said
        assert "GPU 0" in said and "dvfs cap plan" in said, said
        at = BatchPlan((BatchStep(1, Setting(1200, 400.0)),), PLAN.measured_on, "none")
        check_plan_against(at, gpus, where="p", allow_simulated=False)
    assert not nvml.fake_calls("nvmlDeviceSetPowerManagementLimit")


def test_a_gpu_that_stops_answering_is_logged_once_and_exported_as_not_up(nvml) -> None:
    """A GPU lost while `dvfs monitor` ran went silent: its series turned NaN (a counter's
    among them) with no log line. One line names it and NVML's error when it stops
    answering, one when it answers again, none in between; meanwhile it is exported with
    dvfs_gpu_up 0 and no readings, the other GPU as before. Still silent at the end, the run
    names it."""
    from dvfs.backends import open_gpus
    from dvfs.govern.loop import monitor

    def run(script: list[bool]) -> tuple[list[str], list[dict], list]:
        lost = iter(script)
        lines: list[str] = []
        pages: list[dict] = []
        live = LiveMetrics()

        def locks() -> dict:  # called at the start of every interval: the script's hook
            if live.latest().gpus:
                pages.append(series(render(live)))
            nvml.fake_update_device(0, lost=next(lost))
            return {}

        time = VirtualTime()
        with open_gpus([0, 1]) as gpus:
            ticker = Ticker(1.0, len(script), clock=time.clock, sleep=time.sleep)
            left = monitor(gpus, None, ticker, live=live, note=lines.append, locks=locks)
        pages.append(series(render(live)))
        nvml.fake_update_device(0, lost=False)
        return lines, pages, left

    lines, pages, left = run([False, True, True, True, False, False])
    uuid = nvml.fake_device_state(0)["uuid"]
    g0 = (("gpu", "0"), ("uuid", uuid))
    g1 = (("gpu", "1"), ("uuid", nvml.fake_device_state(1)["uuid"]))
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"GPU 0 ({uuid}) stopped answering: ") and "GPU is lost" in lines[0]
    assert lines[1] == f"GPU 0 ({uuid}) answers again" and left == []
    ups = [page[("dvfs_gpu_up", g0)] for page in pages]
    assert ups == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    readings = ("power_watts", "energy_joules_total", "sm_clock_hertz", "power_limit_watts")
    for page, up in zip(pages, ups, strict=True):
        for name in readings + ("energy_per_token_joules",):
            assert ((f"dvfs_gpu_{name}", g0) in page) == bool(up), (name, page)
            assert (f"dvfs_gpu_{name}", g1) in page and page[("dvfs_gpu_up", g1)] == 1.0
        assert ("dvfs_gpu_sm_clock_lock_max_hertz", g0) in page  # dvfs's record, not NVML's
        assert not math.isnan(page[("dvfs_gpu_power_watts", g1)])
    lines, pages, left = run([False, False, True])
    assert len(lines) == 1 and [str(e) for e in left] == [lines[0].split("; its readings")[0]]
    assert "GPU 0 (" in str(left[0]) and "GPU is lost" in str(left[0])
    # A GPU that flaps (answering one interval in two) logged two lines an interval: it is
    # one outage, said back once it has answered STEADY_INTERVALS in a row (or at the end).
    flaps = [True, False] * 5
    script = [False, *flaps, *[False] * STEADY_INTERVALS, *flaps]
    lines, pages, left = run(script)
    said = ["back" if x.endswith(" answers again") else x.split(": ")[0] for x in lines]
    assert said == [f"GPU 0 ({uuid}) stopped answering", "back"] * 2, lines
    ups = [page[("dvfs_gpu_up", g0)] for page in pages]
    assert ups == [0.0 if lost else 1.0 for lost in script] and left == []


def _governed_until_one_is_silent(
    scraper: Callable[[], ServerSample],
    intervals: int,
    state: Path,
    note: Callable[[str], None],
) -> BaseException:
    """What the governor of GPUs 0 and 1 (PLAN, no dwell, in virtual time) stopped with, for
    the tests whose `scraper` makes one of them stop answering."""
    from dvfs.backends import open_gpus

    time = VirtualTime()
    with open_gpus([0, 1]) as gpus, pytest.raises(BaseException) as stopped:
        govern(
            PLAN,
            gpus,
            scraper,
            PolicyParams(dwell_s=0.0),
            Ticker(1.0, intervals, clock=time.clock, sleep=time.sleep),
            live=LiveMetrics(),
            note=note,
            state_dir=state,
        )
    return stopped.value


@pytest.mark.parametrize("load", ["steady", "rising", "held"])
def test_a_governed_gpu_that_stops_answering_stops_the_governor_restoring_the_other(
    nvml, tmp_path: Path, load: str
) -> None:
    """A GPU lost while governed: the governor ran on silently (its readings NaN) until its
    next change, whose failure to set the lost GPU was then hidden behind the restore's
    failure on it, the other GPU's restore unsaid. It now stops at the interval the GPU does
    not answer (a read, or a change), in one error naming the GPU and NVML's error, the other
    GPU put back as found, and how the lost one is put back; its state file is kept. So too
    while a failed read of the server holds the setting in force (`SERVER_GRACE_S`)."""
    from dvfs.errors import GpuError

    scripts = {"steady": [1, 1, 1, 1], "rising": [1, 1, 20, 20], "held": [1, 1, None, None]}
    batches = iter(scripts[load])
    count = [0]

    def scraper() -> ServerSample:
        count[0] += 1
        if count[0] == 3:  # lost before this interval's change (rising) or read (steady)
            nvml.fake_update_device(0, lost=True)
        batch = next(batches)
        if batch is None:  # within the grace: the setting in force held
            raise ServerDownError("cannot read http://127.0.0.1:1/metrics: timed out")
        return ServerSample(batch, None, None)

    lines: list[str] = []
    state = tmp_path / "state"
    stopped = _governed_until_one_is_silent(scraper, 4, state, lines.append)
    assert isinstance(stopped, GpuError)
    uuid = nvml.fake_device_state(0)["uuid"]
    line = str(stopped)
    assert "\n" not in line and stopped.exit_code == 1
    assert line.startswith(f"GPU 0 ({uuid}) stopped answering while governed: "), line
    assert "GPU is lost" in line and "the governor stopped and put GPU 1 back as found" in line
    assert "GPU 0 could not be put back" in line
    assert f"`dvfs gpu reset --state-dir {state}` puts back" in line, line  # the governor's
    assert count[0] == 3 and not any("stopped answering" in x for x in lines)  # said once
    assert (load == "held") == ("the setting in force is held" in lines[-1]), lines
    healthy = nvml.fake_device_state(1)
    assert healthy["locked_clocks"] is None and healthy["power_limit_mw"] == 700_000
    assert [p.name for p in state.glob("GPU-*.json")] == [f"{uuid}.json"]


def test_a_gpu_silent_before_the_governor_changed_it_is_not_said_put_back(
    nvml, tmp_path: Path
) -> None:
    """A governed GPU lost before the governor's first change was said to be "put back as
    found" with the healthy one, as if the governor had reached it: the line now says only
    the healthy GPU was put back, and that the silent one had not been changed."""
    from dvfs.errors import GpuError

    def scraper() -> ServerSample:
        nvml.fake_update_device(0, lost=True)  # before the first interval's change
        return ServerSample(1, None, None)

    state = tmp_path / "state"
    stopped = _governed_until_one_is_silent(scraper, 2, state, lambda line: None)
    assert isinstance(stopped, GpuError)
    line = str(stopped)
    assert "GPU 0" in line and "GPU is lost" in line, line
    assert "put GPU 1 back as found; it had not changed GPU 0" in line, line
    assert "GPU 0, GPU 1" not in line and not list(state.glob("GPU-*.json"))


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_while_the_governor_puts_gpus_back_after_one_went_silent_keeps_why(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: str
) -> None:
    """A GPU going silent stops the governor; a SIGTERM (`systemctl stop`) arriving while it
    put the other GPU back was held and delivered after the restore, so the run ended as
    interrupted (exit 143, "GPU settings restored") and the line naming the silent GPU was
    never said. The reason is now kept: the one line names the silent GPU, what was put back,
    and the signal that came meanwhile (exit 1)."""
    import os
    import signal

    from dvfs.govern.loop import GpuSilentError

    def scraper() -> ServerSample:
        nvml.fake_update_device(1, lost=True)  # as the first change reaches it, GPU 0 changed
        return ServerSample(1, None, None)

    real = nvml.nvmlDeviceResetGpuLockedClocks
    sent: list[int] = []

    def reset_with_a_signal(handle: object) -> object:  # the restore of GPU 0
        sent.append(getattr(signal, signum))
        os.kill(os.getpid(), getattr(signal, signum))
        return real(handle)

    monkeypatch.setattr(nvml, "nvmlDeviceResetGpuLockedClocks", reset_with_a_signal)
    # the default disposition, whatever this worker inherited: only the governor's handler
    # may turn the signal into what it stops with
    number = getattr(signal, signum)
    previous = signal.signal(
        number, signal.SIG_DFL if signum == "SIGTERM" else signal.default_int_handler
    )
    try:
        stopped = _governed_until_one_is_silent(scraper, 2, tmp_path / "state", lambda line: None)
    finally:
        signal.signal(number, previous)
    assert sent, "the restore reset no clock lock"
    assert isinstance(stopped, GpuSilentError), repr(stopped)
    line = str(stopped)
    assert "\n" not in line and stopped.exit_code == 1
    assert line.startswith("GPU 1 (") and "stopped answering while governed" in line, line
    assert "put GPU 0 back as found" in line and f"received {signum}" in line, line
    healthy = nvml.fake_device_state(0)
    assert healthy["locked_clocks"] is None and healthy["power_limit_mw"] == 700_000


@pytest.mark.parametrize(
    "when", ["before the restore", "as the restore fails", "after the restore failed"]
)
def test_a_sigterm_beside_a_restore_that_does_not_put_the_healthy_gpu_back_is_said_once(
    nvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A GPU going silent stops the governor, which puts the healthy one back. A SIGTERM that
    landed before that restore held signals (so it never ran) made the line say "received
    SIGTERM; received SIGTERM as it put them back", and not that GPU 0 keeps the governor's
    settings; one held while GPU 0's restore failed was not named at all. The line now names
    the signal once, at its end, and what was not put back and how to put it back. One that
    lands once the failed restore is over (as the error unwinds) was said to have come before
    it, and the restore's failure was dropped: it is the failed restore's line too."""
    import contextlib
    import os
    import signal

    import dvfs.gpu.knobs as knobs_module
    from dvfs.govern.loop import GpuSilentError

    def scraper() -> ServerSample:
        nvml.fake_update_device(1, lost=True)  # as the first change reaches it, GPU 0 changed
        return ServerSample(1, None, None)

    real = knobs_module.restoring

    @contextlib.contextmanager
    def signalled(*args: object, **kwargs: object) -> Iterator[None]:
        if when == "before the restore":
            os.kill(os.getpid(), signal.SIGTERM)  # raised before signals are held
        try:
            with real(*args, **kwargs):  # type: ignore[arg-type]
                if when != "after the restore failed":
                    os.kill(os.getpid(), signal.SIGTERM)  # held
                yield
        finally:
            if when == "after the restore failed":
                os.kill(os.getpid(), signal.SIGTERM)  # raised as the restore's error unwinds

    def fails(handle: object) -> object:
        raise nvml.NVMLError(nvml.NVML_ERROR_UNKNOWN)

    unlock = nvml.nvmlDeviceResetGpuLockedClocks
    monkeypatch.setattr(knobs_module, "restoring", signalled)
    monkeypatch.setattr(nvml, "nvmlDeviceResetGpuLockedClocks", fails)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    state = tmp_path / "state"  # the governor's --state-dir, not the default
    try:
        stopped = _governed_until_one_is_silent(scraper, 2, state, lambda line: None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert isinstance(stopped, GpuSilentError), repr(stopped)
    line = str(stopped)
    assert "\n" not in line and stopped.exit_code == 1
    assert line.startswith("GPU 1 (") and "stopped answering while governed" in line, line
    assert line.count("received SIGTERM") == 1 and "put GPU 0 back as found" not in line, line
    # `dvfs gpu reset` alone looked in the default state folder: nothing to restore there
    reset = f"`dvfs gpu reset --state-dir {state}`"
    assert reset in line and ".;" not in line, line
    if when == "before the restore":
        assert line.endswith(
            "received SIGTERM before it put GPU 0 back, which keeps the governor's settings: "
            f"{reset} puts back what its state file recorded"
        ), line
    else:
        assert "could not restore GPU settings: GPU 0 (" in line, line
        assert line.endswith("; received SIGTERM as it put them back"), line
    assert nvml.fake_device_state(0)["locked_clocks"] is not None
    assert f"{nvml.fake_device_state(0)['uuid']}.json" in [p.name for p in state.glob("GPU-*")]
    # followed as said (NVML takes the reset again; GPU 1 is still off the bus: exit 1)
    monkeypatch.setattr(knobs_module, "restoring", real)
    monkeypatch.setattr(nvml, "nvmlDeviceResetGpuLockedClocks", unlock)
    from click.testing import CliRunner

    from dvfs.cli import cli

    followed = CliRunner().invoke(cli, shlex.split(reset.strip("`"))[1:])
    assert "restored GPU 0" in followed.output, followed.output
    assert nvml.fake_device_state(0)["locked_clocks"] is None


def test_a_day_on_the_twin_the_governor_beats_the_best_static_cap_at_equal_compliance() -> None:
    from dvfs.govern.replay import PLAN_BATCHES, day_trace, twin_plan

    trace = day_trace()
    assert min(trace) == 1 and max(trace) == 64 and len(trace) == 8640  # a day, 10 s apart
    stock, static, governed = compare()
    assert stock.within_target == 1.0  # the target is stock's own step time + 5%
    assert static.within_target >= stock.within_target and governed.within_target >= 1.0
    assert governed.energy_per_token_j < static.energy_per_token_j < stock.energy_per_token_j
    assert 0 < governed.changes < len(trace) / 10  # follows the load, does not chatter
    assert twin_plan(
        Decode(gpu_profile("h100-sxm"), model_profile("llama-3.1-8b")), 0.05
    ).batches == (PLAN_BATCHES)


def test_the_replay_prints_the_table_the_readme_cites(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m dvfs.govern.replay` printed the savings unsigned ("22.4% vs stock", read as
    22.4% more than stock) where the README cites it from gives "-22.4%": each README row's
    figures are on its printed line, the change in energy per token signed."""
    from dvfs.govern.replay import main

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme.split("`python -m dvfs.govern.replay` replays", 1)[1].split("\n\n", 2)[1]
    rows = [line.split("|")[1:-1] for line in table.splitlines()[2:]]
    assert len(rows) == 3, table
    main()
    printed = capsys.readouterr().out.splitlines()[1:]
    assert len(printed) == len(rows), printed
    for (name, energy, change, within, clock), line in zip(rows, printed, strict=True):
        words = line.split()
        assert energy.split()[0] in words and within.strip() in words, (name, line)
        assert clock.split()[0] in words, (name, line)
        assert (change.strip() or "+0.0%") in words, (name, line)
        if "changes" in name:  # "governor (12 changes a day)"
            assert name.split("(")[1].split()[0] == words[-2], (name, line)


clocks = st.integers(210, 1980)


@given(
    clocks,
    clocks,
    st.none() | clocks,
    st.integers(200_000, 700_000),
    st.none() | st.floats(200, 700),
)
def test_a_step_is_held_under_the_static_caps_knob_by_knob(
    a: int, b: int, clock: int | None, limit_mw: int, limit_w: float | None
) -> None:
    """The static caps in force at start are a ceiling (min of step and cap per knob) and
    the governor's stock (a knob the step leaves alone keeps them)."""
    for static in ((min(a, b), max(a, b)), None):
        got = Ceiling("GPU-x", static, limit_mw, 210).applied(clock, limit_w)
        if limit_w is None:
            assert got.power_limit_mw == limit_mw
        else:
            assert got.power_limit_mw == min(limit_mw, round(limit_w * 1000))
        if clock is None:
            assert got.sm_clock_lock_mhz == static
            continue
        assert got.sm_clock_lock_mhz is not None
        low, high = got.sm_clock_lock_mhz
        assert low <= high == (clock if static is None else min(clock, static[1]))
        # the static floor where it lies below the step's cap; else the lowest clock, never
        # one pinned clock the plan did not ask for
        kept = static is not None and static[0] < high
        assert low == (static[0] if kept else 210)
        assert low < high or high == 210


def test_a_step_below_the_static_floor_is_a_cap_not_a_fixed_clock() -> None:
    """A static lock of 1500-1980 MHz and a plan step of 1200 MHz: the GPU is capped at
    1200 MHz from its lowest clock (idle may clock down), not pinned at 1200, and the log
    says the floor was left out."""
    from dvfs.govern.plan import Setting

    ceiling = Ceiling("GPU-x", (1500, 1980), 700_000, 345)
    assert ceiling.applied(1200, None).sm_clock_lock_mhz == (345, 1200)
    assert ceiling.applied(1800, None).sm_clock_lock_mhz == (1500, 1800)
    assert "floor of 1500 MHz is left out" in ceiling.describe_applied(Setting(1200, None))


def test_a_dry_run_previews_the_steps_under_the_recorded_caps(nvml, tmp_path: Path) -> None:
    """A dry run reads the caps `cap apply` recorded, so what it says it would set is what
    the governor would set: no step above them."""
    from dvfs.backends import open_gpus
    from dvfs.caps import AppliedCaps

    state = tmp_path / "state"
    with open_gpus([0]) as gpus:
        uuid = gpus[0].identity.uuid
        AppliedCaps(state).write({uuid: {"lock_mhz": [210, 1110], "power_limit_mw": 350_000}})
        gpus[0].set_power_limit_mw(350_000)
        calls = len(nvml.fake_calls())
        lines: list[str] = []
        live = LiveMetrics()
        govern(
            PLAN,
            gpus,
            lambda: ServerSample(0, None, None),
            PolicyParams(dwell_s=0.0),
            Ticker(1.0, 1),
            live=live,
            note=lines.append,
            dry_run=True,
            state_dir=state,
        )
    # What its exporter shows is what the GPU holds: the static lock (a dry run sets none),
    # not "no lock" (0), which `dvfs monitor` beside it would contradict.
    [row] = live.latest().gpus
    assert (row.lock_max_mhz, row.lock_by_governor) == (1110, False)
    assert lines[0].endswith("GPU 0: SM clock locked 210-1110 MHz, power limit 350 W")
    # both knobs of the step are above the static caps: the GPU would stay as it is, so the
    # step is where the governor starts, not a setting it would make
    assert lines[1] == (
        "dry run: starts at running batch 0 -> plan batch 1: SM clock <= "
        "1200 MHz, power limit 400 W; GPU 0: SM clock locked 210-1110 MHz (the static cap in "
        "force: the plan's 1200 MHz is above it), power limit 350 W (the limit in force at "
        "start: the plan's 400 W is above it) (at 0.000 s)"
    )
    assert len(nvml.fake_calls()) == calls


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "0.0.0.0"])
def test_the_exporter_stops_without_waiting_for_its_serving_loop_to_look(
    host: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The exporter's serving loop (prometheus_client's) looks for a shutdown only between its
    waits for a connection, 0.5 s each, which every `dvfs govern` and `dvfs monitor` waited out
    as it exited. Here it waits an hour: closing still stops it (before, the close waited the
    hour), its port no longer answers, and the connections that woke it printed nothing."""
    import socket
    import socketserver

    from prometheus_client import exposition

    def hourly(self: socketserver.BaseServer, poll_interval: float = 0.5) -> None:
        socketserver.BaseServer.serve_forever(self, poll_interval=3600)

    monkeypatch.setattr(exposition.ThreadingWSGIServer, "serve_forever", hourly)
    live = LiveMetrics()
    live.publish(Watch([MeterGpu(0)], None, note=print).snapshot(None, {}))  # type: ignore[list-item]
    try:
        exporter = start_exporter(live, host, 0)
    except Exception as exc:  # noqa: BLE001  (no IPv6 here)
        pytest.skip(f"cannot listen on {host}: {exc}")
    url = exporter.url.replace("0.0.0.0", "127.0.0.1")
    assert "dvfs_gpu_power_watts" in httpx.get(url, timeout=10).text
    exporter.close()
    assert not exporter.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=10)
    with pytest.raises(OSError), socket.socket(exporter.server.address_family) as s:
        s.connect(exporter.server.server_address)
    assert capfd.readouterr().err == ""
