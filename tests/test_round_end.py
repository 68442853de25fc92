"""Rounds that end where their steady window ends, and warm-ups once per server and shape.

A fixed batch's steady window ends when its first request finishes; a closed loop's when
concurrency drops below the batch after the pool's last request was sent. The rounds stop
there: on the twin the drain is never simulated (its virtual time stops), on SGLang the client
aborts the requests still running (POST /abort_request, or a disconnect), as the stub sees.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from sglang_support import stub_campaign
from test_protocol import GROUND_TRUTH_CAMPAIGN, _records, _sweep_with_truth

from dvfs.campaign.model import DrafterSpec
from dvfs.cli import cli
from dvfs.clock import VirtualClock
from dvfs.engines.base import ABORTED, ROUND_END, RoundResult, Workload
from dvfs.engines.twin import TwinEngine
from dvfs.measure.meter import latency_stats, steady_window_ns

SPECULATIVE = DrafterSpec(
    name="eagle3",
    algorithm="EAGLE3",
    draft_model="eagle3-llama-3.1-8b",
    num_steps=3,
    eagle_topk=1,
    num_draft_tokens=4,
)


def _twin_engine() -> TwinEngine:
    from dvfs.twin.device import FreeRunningNode
    from dvfs.twin.profiles import gpu_profile, model_profile

    node = FreeRunningNode(gpu_profile("h100-sxm"), VirtualClock())
    return TwinEngine(node, model_profile("llama-3.1-8b"), startup_s=0.0)


def _workload(batch: int, *, mode: str = "fixed", end: bool, pool: int = 0) -> Workload:
    from dvfs.corpora import load_corpus, sample_prompts

    prompts = sample_prompts(
        load_corpus("code"), pool or batch, input_tokens=(16, 2048), seed=0, key=(batch,)
    )
    return Workload(
        batch=batch,
        prompts=prompts,
        corpus="code",
        max_new_tokens=128,
        temperature=0.0,
        ignore_eos=mode == "fixed",
        mode=mode,
        seed=7,
        end_at_window=end,
    )


def _run(workload: Workload) -> RoundResult:
    engine = _twin_engine()
    engine.start(SPECULATIVE)
    return engine.run(workload)


# -- the twin engine ---------------------------------------------------------------------------


def test_a_fixed_round_stops_at_its_first_finish_and_keeps_the_window_as_it_was() -> None:
    """Speculation makes requests finish at different iterations. Ended at the window, the
    round stops at the first finish: the finisher ran to length, the rest are aborted with
    the tokens they had; the steady window, and every chunk up to its end, are those of the
    round run to completion."""
    full = _run(_workload(8, end=False))
    ended = _run(_workload(8, end=True))
    window = steady_window_ns(full, "fixed")
    assert window is not None and steady_window_ns(ended, "fixed") == window
    reasons = [r.finish_reason for r in ended.requests]
    assert "length" in reasons and ABORTED in reasons
    assert all(r.finish_reason == "length" for r in full.requests)
    assert ended.ended_ns - ended.started_ns < full.ended_ns - full.started_ns
    assert max(int(r.chunk_ns[-1]) for r in ended.requests) == window[1]
    for whole, cut in zip(full.requests, ended.requests, strict=True):
        kept = whole.chunk_ns <= window[1]
        assert np.array_equal(cut.chunk_ns, whole.chunk_ns[kept])
        assert np.array_equal(cut.chunk_tokens, whole.chunk_tokens[kept])
        assert cut.completion_tokens == int(cut.chunk_tokens.sum())
        assert cut.aborted is (cut.completion_tokens < 128)
        # draft statistics count what the request did before the round ended
        assert cut.spec_verify_ct == len(cut.chunk_ns) - 1
    # the server's accept length is the round's own over its whole blocks of 40 decode
    # iterations, as SGLang counts it (request i's chunk k > 0 is iteration k)
    iterations = max(len(r.chunk_ns) for r in ended.requests) - 1
    covered = iterations - iterations % 40
    if covered:
        tokens = sum(int(r.chunk_tokens[1 : covered + 1].sum()) for r in ended.requests)
        passes = sum(min(len(r.chunk_ns) - 1, covered) for r in ended.requests)
        assert ended.server_accept_length == pytest.approx(tokens / passes)
        assert ended.server_accept_covers == covered / iterations
    else:  # (tests/test_server_accept.py runs rounds of several blocks)
        assert ended.server_accept_length is None and ended.server_accept_covers == 0.0
    # latency from the tokens received: TPOT of an aborted request is over its own tokens
    stats = latency_stats(ended.requests)
    assert all(math.isfinite(q) for q in stats.tpot_ms)


def test_a_round_without_speculation_is_unchanged() -> None:
    engine = _twin_engine()
    engine.start(DrafterSpec(name="none", algorithm=None))
    ended = engine.run(_workload(4, end=True))
    assert all(r.finish_reason == "length" and r.completion_tokens == 128 for r in ended.requests)


def test_a_closed_loop_stops_when_concurrency_drops_after_the_last_send() -> None:
    full = _run(_workload(4, mode="closed-loop", end=False, pool=12))
    ended = _run(_workload(4, mode="closed-loop", end=True, pool=12))
    assert len(ended.requests) == 12  # every prompt of the pool was sent
    window = steady_window_ns(full, "closed-loop")
    assert window is not None and steady_window_ns(ended, "closed-loop") == window
    aborted = [r for r in ended.requests if r.aborted]
    assert aborted and len(aborted) < 4  # the finisher's slot is the one that dropped
    # nothing was decoded past the first finish after the last send
    assert max(int(r.chunk_ns[-1]) for r in ended.requests) == window[1]
    assert ended.ended_ns < full.ended_ns
    for r, whole in zip(ended.requests, full.requests, strict=True):  # the pool's order
        if not r.aborted:
            assert np.array_equal(r.chunk_ns, whole.chunk_ns)
            continue
        assert r.completion_tokens < whole.completion_tokens
        assert np.array_equal(r.chunk_ns, whole.chunk_ns[: len(r.chunk_ns)])


# -- a sweep on the twin ----------------------------------------------------------------------


def test_a_twin_sweep_ends_rounds_at_the_window_within_one_percent_of_the_truth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CLI: no GPU time drains after a window, energy per token stays within 1%
    of the twin's exact energy where the interval reached 1% (within the interval elsewhere),
    the journal and the cube say that rounds end at the window, and each server warms up
    once per (batch, input length) shape, not at each knob setting."""
    import dvfs.engines.twin as twin_module

    seen: list[tuple[str, int, list[str | None]]] = []
    run = twin_module.TwinEngine.run

    def spy(self: Any, workload: Workload, timeline: Any = None) -> RoundResult:
        result = run(self, workload, timeline)
        drafter = self._drafter.name if self._drafter else "?"
        seen.append((drafter, workload.batch, [r.finish_reason for r in result.requests]))
        return result

    monkeypatch.setattr(twin_module.TwinEngine, "run", spy)
    cube, truth = _sweep_with_truth(tmp_path, monkeypatch, GROUND_TRUTH_CAMPAIGN)
    records = _records(tmp_path / "out" / "journal.jsonl")
    assert len(records) == 8
    for record in records:
        m, spent = record["measurement"], record["gpu_time_s"]
        assert record["status"] == "ok" and m["valid"], record
        assert record["warmup"]["round_end"] == ROUND_END
        # the rest of the last iteration at most: a few passes, never a drain
        assert spent["drain"] < 0.01 * spent["window"], record["cell"]
        rounds = truth[record["key"]]
        exact = sum(r[0] for r in rounds) / sum(r[1] for r in rounds)
        error = abs(m["energy_per_token_j"] / exact - 1)
        assert error < max(0.01, m["energy_per_token_rel_ci"]), (record["cell"], error)
    assert any(ABORTED in reasons for drafter, batch, reasons in seen if batch == 16)
    assert not any(ABORTED in reasons for drafter, _, reasons in seen if drafter == "none")
    assert f"round_end = {ROUND_END}" in cube.attrs["measurement_method"]
    # warm-ups: once per server and shape; the second clock's cells need none
    warmed = [
        (r["cell"]["drafter"], *r["warmup"]["shape"]) for r in records if r["warmup"]["warmed_up"]
    ]
    assert len(warmed) == len(set(warmed))
    for r in records:
        w = r["warmup"]
        assert (r["gpu_time_s"]["warmup"] > 0) is w["warmed_up"]
        if r["cell"]["sm_clock_mhz"] == 1200:  # the second setting: shapes already warm
            assert not w["warmed_up"] and r["gpu_time_s"]["warmup"] == 0
    # every shape a cell measured was warmed on its server, by a warm-up or the stabilising load
    shapes = {(r["cell"]["drafter"], *r["warmup"]["shape"]) for r in records}
    stabilised = {r["cell"]["drafter"] for r in records if "stabilised" in r["warmup"]}
    assert stabilised == {"none", "eagle3"}
    assert set(warmed) <= shapes and len(shapes - set(warmed)) <= len(stabilised)


def test_rounds_run_to_completion_and_warm_up_per_cell_when_the_campaign_asks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """measurement.round_end = "complete" and warmup_every = "cell" (the protocol of a server
    started per cell, as the naive bench runs it): no request is aborted, speculative cells
    drain after their window, every cell warms up, the energy is still the truth's, and the
    keys change the campaign's hash while their defaults keep it."""
    import tomllib

    import dvfs.engines.twin as twin_module
    from dvfs.campaign import parse_campaign

    def parse_campaign_text(text: str) -> Any:
        return parse_campaign(tomllib.loads(text))

    aborted: list[bool] = []
    run = twin_module.TwinEngine.run

    def spy(self: Any, workload: Workload, timeline: Any = None) -> RoundResult:
        result = run(self, workload, timeline)
        aborted.append(any(r.finish_reason == ABORTED for r in result.requests))
        return result

    monkeypatch.setattr(twin_module.TwinEngine, "run", spy)
    text = GROUND_TRUTH_CAMPAIGN + '[measurement]\nround_end = "complete"\nwarmup_every = "cell"\n'
    cube, truth = _sweep_with_truth(tmp_path, monkeypatch, text)
    records = _records(tmp_path / "out" / "journal.jsonl")
    assert len(records) == 8 and aborted and not any(aborted)
    drained = 0
    for record in records:
        m, spent = record["measurement"], record["gpu_time_s"]
        assert record["status"] == "ok" and m["valid"], record
        assert record["warmup"]["round_end"] == "complete"
        assert record["warmup"]["warmed_up"] and spent["warmup"] > 0
        drained += record["cell"]["drafter"] == "eagle3" and spent["drain"] > 0
        rounds = truth[record["key"]]
        exact = sum(r[0] for r in rounds) / sum(r[1] for r in rounds)
        error = abs(m["energy_per_token_j"] / exact - 1)
        assert error < max(0.01, m["energy_per_token_rel_ci"]), (record["cell"], error)
    assert drained >= 1  # a speculative batch's requests finish apart: the drain is run
    assert json.loads(cube.attrs["campaign"])["measurement"]["round_end"] == "complete"
    assert "round_end = complete" in cube.attrs["measurement_method"]
    assert "warm-up before every cell" in cube.attrs["measurement_method"]
    defaults = (
        GROUND_TRUTH_CAMPAIGN + '[measurement]\nround_end = "window"\nwarmup_every = "shape"\n'
    )
    plain = parse_campaign_text(GROUND_TRUTH_CAMPAIGN)
    assert parse_campaign_text(defaults).hash == plain.hash
    assert parse_campaign_text(text).hash != plain.hash


def test_a_bad_round_end_is_one_line(tmp_path: Path) -> None:
    bad = GROUND_TRUTH_CAMPAIGN + '[measurement]\nround_end = "early"\n'
    path = tmp_path / "bad.toml"
    path.write_text(bad)
    result = CliRunner().invoke(cli, ["sweep", str(path), "-o", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "round_end" in result.output and "complete" in result.output
    assert "Traceback" not in result.output


# -- SGLang (the stub) ------------------------------------------------------------------------


def _server_logs(out: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((out / "logs").glob("server-*.log")))


@pytest.mark.parametrize("abort_route", [True, False])
def test_sglang_rounds_end_at_the_window_and_the_server_sees_the_aborts(
    tmp_path: Path, abort_route: bool
) -> None:
    """Through the CLI on the stub: speculative requests finish at different steps; at the
    first finish the others are aborted by POST /abort_request (or, where the server has no
    such route, by disconnecting), the server logs each one, and the cells measure. Each
    server warms up once for the batch, not again at the second clock."""
    path, _ = stub_campaign(
        tmp_path,
        # hold_unfinished: once a round's first request finished, the stub keeps the others
        # before their last step until they are aborted, so that an abort always has a
        # request to stop however slow the machine (without it, a loaded machine let the
        # others finish by themselves before the abort landed); the aborts end the round at once
        stub={
            "tpot_s": 0.02,
            "plain_tpot_s": 0.002,
            "abort_route": abort_route,
            "hold_unfinished": True,
        },
        batch="[4]",
        output_tokens=32,
        knobs="sm_clock = [1980, 1500]\nsettle_s = 0.0",
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    logs = _server_logs(out)
    records = _records(out / "journal.jsonl")
    assert {r["cell"]["drafter"] for r in records} == {"none", "eagle3"} and len(records) == 4
    for r in records:
        assert r["status"] == "ok", r
        assert r["warmup"]["round_end"] == ROUND_END
        assert r["warmup"]["warmed_up"] is (r["cell"]["sm_clock_mhz"] == 1980)
    for drafter, name in (("none", "server-none-1.log"), ("eagle3", "server-eagle3-2.log")):
        # four requests a round, and one warm-up round per server
        rounds = sum(r["measurement"]["rounds"] for r in records if r["cell"]["drafter"] == drafter)
        sent = (out / "logs" / name).read_text().count('"POST /generate HTTP/1.1" 200')
        assert sent == 4 * (rounds + 1)
    # acceptance pools every request where the aborted ones carried their counters; a
    # disconnected request's never arrive, so the speculative cells' acceptance is unknown
    for r in records:
        accept = r["measurement"]["accept_length"]
        known = accept is not None and math.isfinite(accept)
        assert known is (abort_route and r["cell"]["drafter"] == "eagle3"), r["measurement"]
    if abort_route:
        # the stub stopped each aborted request at its next step, and said so
        assert logs.count("abort_request rid=") >= 1
        assert logs.count("aborted rid=") >= 1
        assert "client went away" not in logs
    else:
        assert "abort_request rid=" not in logs
        assert "client went away during POST /generate" in logs
    # every round of each server (the warm-up too) ended at its first finish: that request
    # alone ran to its length (32 tokens; 4 in the warm-up), the three others were aborted
    # (or disconnected) before their last step, held there if they got that far
    for drafter, name in (("none", "server-none-1.log"), ("eagle3", "server-eagle3-2.log")):
        log = (out / "logs" / name).read_text()
        rounds = sum(r["measurement"]["rounds"] for r in records if r["cell"]["drafter"] == drafter)
        finished = re.findall(r"generate #\d+: 1 seq, (\d+) tokens", log)
        assert finished.count("32") == rounds and "4" in finished, log
        if abort_route:  # each abort is logged before the stream's final chunk is sent
            assert log.count("aborted rid=") == 3 * (rounds + 1), log
        else:  # the last round's disconnects may be seen after the server was stopped
            assert log.count("client went away during POST /generate") >= 3 * rounds, log


def test_sglang_closed_loop_ends_when_concurrency_drops_after_the_last_send(
    tmp_path: Path,
) -> None:
    """Closed loop on the stub (natural lengths): the pool is sent in full, and at the first
    finish after the last send the requests still running are aborted."""
    path, _ = stub_campaign(
        tmp_path,
        # hold_unfinished once the pool's nine requests arrived: the first finish after the
        # last send leaves the others before their last step until they are aborted, so an
        # abort has a request to stop however slow the machine
        stub={
            "tpot_s": 0.01,
            "natural_stop": True,
            "hold_unfinished": True,
            "hold_after_requests": 9,
        },
        drafters='[drafters.none]\nalgorithm = "none"\n',
        batch="[3]",
        output_tokens=48,
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        workload_extra='mode = "closed-loop"\npool_size = 9\nignore_eos = false',
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    (record,) = _records(out / "journal.jsonl")
    assert record["status"] == "ok" and record["measurement"]["requests"] == 9
    log = (out / "logs" / "server-none-1.log").read_text()
    # the measured round: nine requests sent, the last ones cut at the window's end
    assert log.count("abort_request rid=") >= 1 and log.count("aborted rid=") >= 1


def test_an_abort_the_server_ignores_is_cut_off_by_a_disconnect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that answers /abort_request but keeps streaming: after ABORT_GRACE_S the
    client disconnects the stream, and the cell still measures."""
    import dvfs.engines.sglang_client as client_module

    monkeypatch.setattr(client_module, "ABORT_GRACE_S", 0.0)
    path, _ = stub_campaign(
        tmp_path,
        # hold_unfinished: the round's other requests wait before their last step until the
        # client disconnects them, however slow the machine
        stub={"tpot_s": 0.005, "abort_ignored": True, "hold_unfinished": True},
        drafters=(
            '[drafters.eagle3]\nalgorithm = "EAGLE3"\ndraft_model = "draft/eagle3"\n'
            "num_steps = 3\neagle_topk = 1\nnum_draft_tokens = 4\n"
        ),
        batch="[4]",
        output_tokens=32,
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    (record,) = _records(out / "journal.jsonl")
    assert record["status"] == "ok"
    log = (out / "logs" / "server-eagle3-1.log").read_text()
    assert "abort_request rid=" in log and "aborted rid=" not in log
    # the warm-up's and the measured round's three other requests, each disconnected
    assert log.count("client went away during POST /generate") == 6, log


# -- acceptance of a round ended at its window, on the stub ---------------------------------------

_SPEC_LINE = re.compile(
    r"spec rid=(\S+) tokens=(\d+) verify_ct=(\d+) correct_drafts=(\d+) (finished|aborted|cut)"
)


def _stub_round(
    tmp_path: Path,
    *,
    abort_route: bool,
    requests: int = 4,
    keys: tuple[str, str] | None = None,
) -> tuple[RoundResult, dict[str, tuple[int, int, int, str]]]:
    """One fixed batch of `requests` EAGLE-3 requests (48 tokens, 2 or 3 a verify pass,
    seeded) through dvfs's SGLang client against the stub on loopback, ended at its first
    finish; and what the stub generated for each request (by rid): (tokens, verify passes,
    accepted drafts, how it ended), from its log once it logged them all (bounded wait).
    `keys`: the server's --api-key and --admin-api-key, which the client is given."""
    import os
    import subprocess
    import sys
    import time

    from sglang_support import STUB

    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang_client import SamplingParams, SglangClient

    config = tmp_path / "stub.json"
    config.write_text(
        json.dumps(
            {
                "version": "0.5.23",
                "max_lifetime_s": 60,
                "startup_s": 0.02,
                "ttft_s": 0.01,
                "tpot_s": 0.005,
                "accept_length": 2.5,
                "seed": 3,
                "abort_route": abort_route,
                # once the first request finished, the others wait before their last step
                # until they are aborted or disconnected: none finishes by itself, however
                # slow the machine
                "hold_unfinished": True,
            }
        )
    )
    log_path = tmp_path / "stub.log"
    argv = [sys.executable, str(STUB), "--model-path", "stub-model", "--port", "0",
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "draft",
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", "4", "--decode-log-interval", "4"]  # fmt: skip
    if keys is not None:
        argv += ["--api-key", keys[0], "--admin-api-key", keys[1]]
    with log_path.open("w") as log_file:
        server = subprocess.Popen(
            argv,
            env={**os.environ, "SGLANG_STUB_CONFIG": str(config)},
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        deadline = time.monotonic() + 30
        port = None
        while port is None and time.monotonic() < deadline and server.poll() is None:
            found = re.search(r"running on http://127\.0\.0\.1:(\d+)", log_path.read_text())
            port = int(found.group(1)) if found else time.sleep(0.01)
        assert port is not None, log_path.read_text()
        api_key, admin_api_key = keys or (None, None)
        client = SglangClient(
            f"http://127.0.0.1:{port}",
            clock=MonotonicClock(),
            api_key=api_key,
            admin_api_key=admin_api_key,
        )
        client.wait_healthy(30)
        client.flush_cache()  # hold_unfinished counts finishes since the last flush
        started = time.monotonic_ns()
        traces = client.run_batch(
            [f"prompt number {i}" for i in range(requests)],
            SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True),
            "acc",
            end_at_window=True,
        )
        result = RoundResult(tuple(traces), started, time.monotonic_ns(), client.accept_length())
        counts: dict[str, tuple[int, int, int, str]] = {}
        while len(counts) < requests and time.monotonic() < deadline:
            counts = {
                m[1]: (int(m[2]), int(m[3]), int(m[4]), m[5])
                for m in _SPEC_LINE.finditer(log_path.read_text())
            }
            time.sleep(0.01)
        assert len(counts) == requests, log_path.read_text()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return result, counts


def test_a_round_ended_by_aborts_pools_every_request_as_the_server_ran_it(
    tmp_path: Path,
) -> None:
    """POST /abort_request: each aborted request's final chunk carries its counters so far,
    so the pooled acceptance is the server's truth over all four requests, not only over
    the one that finished (the best-accepted, having needed the fewest verify passes)."""
    from dvfs.measure.meter import acceptance

    result, counts = _stub_round(tmp_path, abort_route=True)
    assert sorted(how for *_, how in counts.values()) == ["aborted"] * 3 + ["finished"]
    for i, r in enumerate(result.requests):
        tokens, verify, correct, how = counts[f"acc-{i}"]
        assert not r.final_lost and r.aborted is (how == "aborted")
        assert (r.completion_tokens, r.spec_verify_ct, r.spec_accepted_drafts) == (
            tokens,
            verify,
            correct,
        )
    tokens, verify, correct = (sum(c[k] for c in counts.values()) for k in range(3))
    got = acceptance([result])
    assert got.accept_length == tokens / verify
    assert got.decode_accept_length == (tokens - 4) / verify
    assert got.accept_rate == correct / (verify * 3)  # three drafts a pass


def test_a_server_with_an_admin_key_takes_the_round_ends_aborts_with_that_key(
    tmp_path: Path,
) -> None:
    """SGLang marks /abort_request ADMIN_OPTIONAL, as /flush_cache (0.5.9 and 0.5.23
    http_server.py): a server started with --admin-api-key refuses it the API key (401). The
    client aborts with the admin key it was given, so each aborted request ends with its final
    chunk and counters, not cut off by a disconnect that loses them (the cell's acceptance
    then unknown)."""
    from dvfs.measure.meter import acceptance

    result, counts = _stub_round(tmp_path, abort_route=True, keys=("key-1", "admin-2"))
    assert sorted(how for *_, how in counts.values()) == ["aborted"] * 3 + ["finished"]
    assert not any(r.final_lost for r in result.requests)
    tokens, verify = (sum(c[k] for c in counts.values()) for k in range(2))
    assert acceptance([result]).accept_length == tokens / verify


def test_a_rounds_rids_are_prefix_free_so_each_abort_takes_its_own_request(
    tmp_path: Path,
) -> None:
    """SGLang aborts every request whose rid starts with the rid it is given: with twelve
    requests "acc-1" would also take "acc-10" and "acc-11". The rids the server saw begin
    none of the others, and each request ended once, as the round's end said."""
    result, counts = _stub_round(tmp_path, abort_route=True, requests=12)
    rids = sorted(counts)
    assert len(rids) == len(result.requests) == 12
    assert [b for a in rids for b in rids if a != b and b.startswith(a)] == []
    assert sorted(how for *_, how in counts.values()) == ["aborted"] * 11 + ["finished"]


def _prefix_pairs(rids: list[str]) -> list[tuple[str, str]]:
    """Pairs (a, b) of distinct rids where a begins b (sorted: a begins the next ones)."""
    ordered = sorted(rids)
    pairs = []
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if not b.startswith(a):
                break
            pairs.append((a, b))
    return pairs


# Up to 1200 requests a round: one- to four-digit indices, each width's boundary crossed.
@given(
    count=st.integers(1, 1200),
    other=st.integers(1, 1200),
    rounds=st.tuples(st.integers(1, 10**6), st.integers(1, 10**6)),
)
def test_no_rid_of_a_round_begins_another(count: int, other: int, rounds: tuple[int, int]) -> None:
    """Whatever the round's size (a batch, or a closed loop's pool), and across two rounds of
    one dvfs (their tags as `SglangEngine.run` makes them), no rid begins another: an abort
    of one (SGLang matches by prefix) takes no other request."""
    from dvfs.engines.sglang_client import request_ids

    ids = request_ids(f"dvfs-4242-{rounds[0]}", count)
    assert len(set(ids)) == count
    assert _prefix_pairs(ids) == []
    if rounds[0] != rounds[1]:
        both = ids + request_ids(f"dvfs-4242-{rounds[1]}", other)
        assert _prefix_pairs(both) == []


def test_a_round_ended_by_disconnects_has_no_acceptance_rather_than_a_biased_one(
    tmp_path: Path,
) -> None:
    """A server without /abort_request: the client disconnects the running requests, whose
    counters SGLang sends in the final chunk only, so they never arrive. Pooling the request
    that finished alone would report its acceptance, above the round's truth; the pooled
    acceptance is unknown instead (the server's average still covers the passes of the
    round's whole blocks of decode iterations: 4 a block here)."""
    from dvfs.measure.meter import acceptance

    result, counts = _stub_round(tmp_path, abort_route=False)
    assert sorted(how for *_, how in counts.values()) == ["cut"] * 3 + ["finished"]
    for i, r in enumerate(result.requests):
        tokens, verify, correct, how = counts[f"acc-{i}"]
        if how == "finished":
            assert not r.final_lost and (r.spec_verify_ct, r.spec_accepted_drafts) == (
                verify,
                correct,
            )
        else:  # cut: the stub may have run one more step than the client read
            assert r.final_lost and r.aborted and r.spec_verify_ct is None
            assert r.completion_tokens <= tokens
    (finisher,) = (c for c in counts.values() if c[3] == "finished")
    tokens, verify = (sum(c[k] for c in counts.values()) for k in range(2))
    assert finisher[0] / finisher[1] != tokens / verify  # what the request that finished says
    got = acceptance([result])
    assert math.isnan(got.accept_length) and math.isnan(got.accept_rate)
    assert math.isnan(got.decode_accept_length)
    assert got.server_accept_length > 1  # the server's average, over its whole blocks


def test_requests_finishing_in_the_same_tick_end_the_round_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two requests of a batch whose final chunks arrive before the event loop runs the round
    end: the round ends once, each still-running request is aborted by one POST
    /abort_request, and no round-end task is left unawaited (an in-memory transport, no
    socket)."""
    import asyncio

    import httpx

    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang_client import SamplingParams, SglangClient

    aborts: list[str] = []
    released: dict[str, asyncio.Event] = {}

    def chunk(tokens: int, finish: Any = None) -> bytes:
        meta = {"completion_tokens": tokens, "prompt_tokens": 3, "finish_reason": finish}
        return f"data: {json.dumps({'meta_info': meta})}\n\n".encode()

    async def held(rid: str) -> Any:
        yield chunk(1)
        await released.setdefault(rid, asyncio.Event()).wait()
        yield chunk(1, {"type": "abort"})
        yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        rid = body["rid"]
        if request.url.path == "/abort_request":
            aborts.append(rid)
            released.setdefault(rid, asyncio.Event()).set()
            return httpx.Response(200, json={})
        if rid.endswith("-2"):  # the third request runs until it is aborted
            return httpx.Response(200, content=held(rid))
        # the first two finish at once: their whole streams arrive together
        done = chunk(1) + chunk(2, {"type": "length"}) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=done)

    client = SglangClient("http://127.0.0.1:9", clock=MonotonicClock())
    client.abort_route = True
    monkeypatch.setattr(
        client,
        "_async_client",
        lambda connections: httpx.AsyncClient(transport=httpx.MockTransport(handler)),
    )
    traces = client.run_batch(
        ["a", "b", "c"],
        SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True),
        "tick",
        end_at_window=True,
    )
    assert [t.aborted for t in traces] == [False, False, True]
    assert len(aborts) == 1, aborts  # one abort for the one request still running
