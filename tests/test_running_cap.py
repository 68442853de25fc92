"""The scheduler's own cap on running requests: SGLang 0.5.23 lowers --max-running-requests to
what the KV pool or a hybrid model's Mamba state cache holds (mem_cache/
kv_cache_configurator.py `resolve_max_num_reqs`) and reports the result only in /server_info's
`internal_states[i].effective_max_running_requests_per_dp`, its args still saying what was
asked. A drafter's server whose scheduler runs fewer requests than the largest batch would
queue the rest of each batch, in that arm alone (a draft takes memory a plain arm has): refused
at start, as a server whose arg caps them is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xarray as xr
from click.testing import CliRunner
from sglang_support import attached_stub, free_port, running, stub_campaign

from dvfs.campaign import load_campaign
from dvfs.cli import cli
from dvfs.clock import MonotonicClock
from dvfs.engines.sglang import SglangEngine
from dvfs.engines.sglang_client import running_cap_of
from dvfs.errors import EngineError
from dvfs.measure.journal import read_records


def test_the_cap_is_the_schedulers_summed_over_its_dp_ranks() -> None:
    def info(*caps: object) -> dict[str, object]:
        return {"internal_states": [{"effective_max_running_requests_per_dp": c} for c in caps]}

    assert running_cap_of(info(6)) == 6
    assert running_cap_of(info(3, 3)) == 6
    # Not reported by every rank (0.5.9 reports none), or not a number: unknown.
    assert running_cap_of({"internal_states": [{"last_gen_throughput": 1.0}]}) is None
    assert running_cap_of(info(3, None)) is None
    assert running_cap_of(info("x")) is None and running_cap_of(info(True)) is None
    assert running_cap_of({}) is None and running_cap_of({"internal_states": None}) is None
    # An answer that is not a list of ranks' states, or a rank that is no state: unknown, not
    # a traceback nor the other ranks' cap alone (a false refusal).
    for states in (5, 2.5, "x", {"effective_max_running_requests_per_dp": 8}):
        assert running_cap_of({"internal_states": states}) is None, states
    assert (
        running_cap_of({"internal_states": [{"effective_max_running_requests_per_dp": 4}, None]})
        is None
    )
    assert running_cap_of(info(6.0)) == 6 and running_cap_of(info(6.5)) is None
    assert running_cap_of(info(float("inf"))) is None and running_cap_of(info(float("nan"))) is None


def test_a_server_whose_scheduler_runs_fewer_than_the_largest_batch_is_refused(
    tmp_path: Path,
) -> None:
    path, marker = stub_campaign(
        tmp_path,
        stub={"running_cap": 2},
        batch="[1, 4]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        retries=0,
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code != 0, result.output
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert cells and {c["status"] for c in cells} == {"failed"}, cells
    for cell in cells:
        assert "runs at most 2 requests at once" in cell["error"], cell["error"]
        assert "below the largest batch 4" in cell["error"], cell["error"]
    assert running(marker) == []


def test_a_server_whose_scheduler_runs_the_largest_batch_measures(tmp_path: Path) -> None:
    path, _ = stub_campaign(
        tmp_path,
        stub={"running_cap": 4},
        batch="[1, 4]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    # What each arm's scheduler really ran is recorded with its server, journal and cube.
    servers = [r for r in read_records(out / "journal.jsonl") if r["type"] == "server"]
    assert servers and all(s["running_caps"] == [4] for s in servers), servers
    with xr.open_dataset(out / "cube.nc") as ds:
        recorded = json.loads(ds.attrs["server_args"])
    assert recorded and all(s["running_caps"] == [4] for s in recorded.values()), recorded


def test_a_cap_split_over_attention_dp_ranks_is_named_as_such(tmp_path: Path) -> None:
    """0.5.23 gives each attention DP rank max(1, max_running_requests // attn_dp_size)
    (kv_cache_configurator.py `resolve_max_num_reqs`): the largest batch 9 over 2 ranks runs
    8 at most, which no memory raises, so the refusal says what does; a rank's share lowered
    further is the KV pool's."""
    path, marker = stub_campaign(tmp_path, batch="[1, 9]", knobs="sm_clock = [1980]")
    campaign = load_campaign(path)
    engine = SglangEngine(campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs")
    drafter = campaign.drafters[0]

    def refusal(*caps: int) -> str:
        info = {
            "model_path": campaign.engine.model,
            "speculative_algorithm": None,
            "max_running_requests": 9,
            "attn_dp_size": len(caps),
            "attention_backend": "fa3",
            "internal_states": [{"effective_max_running_requests_per_dp": c} for c in caps],
        }
        with pytest.raises(EngineError) as refused:
            engine._check_resolved(drafter, info)
        return str(refused.value)

    split = refusal(4, 4)
    assert "runs at most 8 requests at once, below the largest batch 9" in split, split
    assert "over its 2 attention DP ranks, 4 each" in split, split
    assert "--max-running-requests 10 or more" in split and "KV pool" not in split, split
    assert "KV pool" in refusal(4, 3) and "KV pool" in refusal(5)
    assert running(marker) == []


def _attached_sweep(tmp_path: Path, *argv: str) -> tuple[int, str]:
    """A sweep of batches [1, 4] attached to a stub started by hand with launch flags `argv`:
    its exit code and what it printed and journalled as errors."""
    tmp_path.mkdir(exist_ok=True)
    port = free_port()
    path, model = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        batch="[1, 4]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        sglang_extra=f'url = "http://127.0.0.1:{port}"',
        retries=0,
    )
    server = attached_stub(tmp_path, model, port, *argv, startup_s=0.0, tpot_s=0.002)
    try:
        out = tmp_path / "out"
        result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
        said = result.output
        if (out / "journal.jsonl").exists():
            said += "".join(
                str(r.get("error"))
                for r in read_records(out / "journal.jsonl")
                if r["type"] == "cell"
            )
        return result.exit_code, said
    finally:
        server.kill()
        server.wait()


@pytest.mark.slow
def test_plain_data_parallelism_runs_the_arg_in_each_replica(tmp_path: Path) -> None:
    """0.5.23's plain DP (--dp-size 2, no attention DP) gives each replica's scheduler the
    whole --max-running-requests (only attn_dp_size splits it, kv_cache_configurator.py
    `resolve_max_num_reqs`), and the DP controller deals requests out in turn: 2 x 2 runs the
    largest batch 4, and is not refused for its arg below it."""
    code, said = _attached_sweep(tmp_path, "--dp-size", "2", "--max-running-requests", "2")
    assert code == 0, said


@pytest.mark.slow
def test_plain_data_parallelism_below_the_largest_batch_is_refused(tmp_path: Path) -> None:
    code, said = _attached_sweep(tmp_path, "--dp-size", "2", "--max-running-requests", "1")
    assert code != 0, said
    assert "caps running requests at 1 in each of its 2 DP replicas" in said, said
    assert "below the largest batch 4" in said, said


def test_only_plain_dp_replicas_multiply_the_arg() -> None:
    from dvfs.engines.sglang import dp_replicas

    assert dp_replicas({}) == 1 and dp_replicas({"dp_size": None}) == 1
    assert dp_replicas({"dp_size": 2, "attn_dp_size": 1}) == 2  # 0.5.23 plain DP
    # 0.5.23 attention DP (its deprecated spelling resolves to dp_size 1)
    assert dp_replicas({"dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True}) == 1
    # 0.5.9: dp_size counts attention DP ranks where enable_dp_attention is set
    assert dp_replicas({"dp_size": 2, "enable_dp_attention": True}) == 1
    assert dp_replicas({"dp_size": 2, "enable_dp_attention": False}) == 2
    assert dp_replicas({"dp_size": "2"}) == 1 and dp_replicas({"dp_size": True}) == 1


@pytest.mark.slow
def test_attention_dp_splits_the_arg_over_its_ranks(tmp_path: Path) -> None:
    """Attention DP splits --max-running-requests over its ranks instead: 4 over 2 runs the
    largest batch 4; 4 over 3 runs 3 (1 each), refused as a split."""
    flags = ("--max-running-requests", "4", "--attn-dp-size")
    code, said = _attached_sweep(tmp_path / "two", *flags, "2")
    assert code == 0, said
    code, said = _attached_sweep(tmp_path / "three", *flags, "3")
    assert code != 0, said
    assert "runs at most 3 requests at once, below the largest batch 4" in said, said
    assert "over its 3 attention DP ranks, 1 each" in said, said


def _check(tmp_path: Path, batch: int, caps: list[int], **args: object) -> str | None:
    """What `_check_resolved` says of a server whose DP ranks report `caps`, with resolved
    `args` over a plain one's, for the largest batch `batch` (None: it passes)."""
    states: list[dict[str, object]] = [{"effective_max_running_requests_per_dp": c} for c in caps]
    return _pipeline_check(tmp_path, batch, states, **args)


def test_uneven_rank_caps_are_held_to_the_dp_controllers_turns(tmp_path: Path) -> None:
    """The DP controller deals requests to its ranks in turn whatever each rank's cap
    (data_parallel_controller.py `round_robin_scheduler`): a batch of 6 over ranks that run
    [4, 2] hands 3 to each, and rank 1 queues one, though the caps sum to 6."""
    said = _check(tmp_path / "a", 6, [4, 2], dp_size=2)
    assert said is not None
    assert "up to 3 to each, more than 1 of its ranks runs (2)" in said, said
    assert "KV pool" in said, said
    # Even caps that hold each rank's turn pass, as an odd batch does over ranks of 3 and 3
    # (the rank dealt the third runs 3).
    assert _check(tmp_path / "b", 6, [3, 3], dp_size=2) is None
    assert _check(tmp_path / "c", 5, [3, 3], dp_size=2) is None
    # Uneven caps below the batch too are said by the rank that queues, not by their sum
    # (which [4, 1] runs no batch of 5 at once).
    said = str(_check(tmp_path / "e", 6, [4, 1], dp_size=2))
    assert "more than 1 of its ranks runs (1)" in said and "at most 5" not in said, said
    # 5 over [3, 2]: the turn may start at rank 1, which is then dealt 3.
    assert "more than 1 of its ranks runs (2)" in str(_check(tmp_path / "d", 5, [3, 2], dp_size=2))


def test_a_rank_that_queues_is_not_named_by_its_place_in_the_answer(tmp_path: Path) -> None:
    """/server_info lists the ranks' states in the order their replies reached the tokenizer
    manager (managers/communicator.py `FanOutCommunicator.handle_recv` appends each), not by
    DP rank, and no state says its rank (scheduler_components/internal_state.py): the
    refusal must not send the user to "rank 1" where the answer came first from another
    rank. Two answers listing the same caps in another order are refused alike."""
    first = _check(tmp_path / "a", 9, [4, 2, 2], dp_size=3)
    again = _check(tmp_path / "b", 9, [2, 4, 2], dp_size=3)
    assert first is not None and first == again, (first, again)
    assert "rank 1" not in first and "rank 0" not in first, first
    assert "more than 2 of its ranks run (2)" in first, first


def test_a_partial_list_of_ranks_refuses_nothing(tmp_path: Path) -> None:
    """With elastic EP the ranks change while the server runs and, once it scales,
    /server_info asks one rank of each attention DP group (tokenizer_control_mixin.py
    `update_control_communicator_fan_out`): a list of fewer ranks than run is no count of
    what the server runs, so nothing is refused from it."""
    elastic = {"elastic_ep_backend": "mooncake", "tp_size": 4, "attn_dp_size": 4}
    assert _check(tmp_path / "a", 8, [2], **elastic) is None
    assert _check(tmp_path / "b", 8, [2, 2, 2, 2], elastic_ep_backend="nixl") is None
    assert _check(tmp_path / "c", 8, [4], attn_dp_size=2) is None
    # A whole list without elastic EP is still held to the largest batch.
    assert "runs at most 4 requests" in str(_check(tmp_path / "d", 8, [2, 2], attn_dp_size=2))
    assert "runs at most 2 requests" in str(_check(tmp_path / "e", 8, [2], elastic_ep_backend=None))


@pytest.mark.slow
def test_the_deprecated_dp_attention_spelling_splits_the_arg_too(tmp_path: Path) -> None:
    """0.5.23 turns `--dp-size 2 --enable-dp-attention` into attn_dp_size 2, dp_size 1
    (parallel_hook.py `_handle_deprecated_dp_attention`): one replica, whose arg 3 is below
    the largest batch 4, not two replicas of 3 each."""
    flags = ("--dp-size", "2", "--enable-dp-attention", "--max-running-requests", "3")
    code, said = _attached_sweep(tmp_path, *flags)
    assert code != 0, said
    assert "caps running requests at 3, below the largest batch 4" in said, said


@pytest.mark.parametrize(
    "extra",
    ['"--attn-dp-size", "2"', '"--attention-d=2"', '"--dp-size", "2", "--enable-dp-attention"'],
)
def test_dvfs_gives_each_attention_dp_rank_its_turn_of_an_odd_batch(
    tmp_path: Path, extra: str
) -> None:
    """0.5.23 gives each of 2 attention DP ranks --max-running-requests // 2, and the DP
    controller deals a batch of 5 to them in turn, 3 to one: the largest batch itself (2 a
    rank) was refused by dvfs's own check of the server dvfs had started. dvfs gives 2 x 3."""
    from sglang_support import load_stub

    from dvfs.engines.sglang import running_cap_refusal
    from dvfs.engines.sglang_args import launch_argv

    stub = load_stub()
    path, _ = stub_campaign(
        tmp_path, batch="[1, 5]", sglang_extra=f"extra_args = [{extra}]", knobs="sm_clock = [1980]"
    )
    campaign = load_campaign(path)
    argv = launch_argv(campaign, campaign.drafters[0], port=31000, version="0.5.23")
    assert argv[argv.index("--max-running-requests") + 1] == "6", argv
    start = argv.index("--model-path")
    args, _ = stub.parse_launch_argv(argv[start:], stub.StubConfig(version="0.5.23"), None)
    attn = int(args["attn_dp_size"])
    assert attn == 2, args
    caps = [max(1, int(args["max_running_requests"]) // attn)] * attn
    assert running_cap_refusal(caps, 5, args) is None, caps


def test_the_attention_dp_ranks_are_read_as_each_releases_argparse_reads_them() -> None:
    from dvfs.engines.sglang_args import attention_dp_ranks

    # Plain DP, a value that is no number, or a flag the release lacks: no split.
    assert attention_dp_ranks(["--dp-size", "2"], legacy=False) == 1
    assert attention_dp_ranks(["--attn-dp-size", "x"], legacy=False) == 1
    assert attention_dp_ranks(["--attn-dp-size", "4"], legacy=True) == 1  # no such 0.5.9 flag
    assert attention_dp_ranks(["--dp-size", "2", "--enable-dp-a"], legacy=True) == 2


def _pipeline_check(
    tmp_path: Path, batch: int, states: list[dict[str, object]], **args: object
) -> str | None:
    """What `_check_resolved` says of a server with /server_info `states` and resolved `args`
    over a plain one's, for the largest batch `batch` (None: it passes)."""
    tmp_path.mkdir(exist_ok=True)
    path, _ = stub_campaign(tmp_path, batch=f"[1, {batch}]", knobs="sm_clock = [1980]")
    campaign = load_campaign(path)
    engine = SglangEngine(campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs")
    info = {
        "model_path": campaign.engine.model,
        "speculative_algorithm": None,
        "max_running_requests": batch,
        "attention_backend": "fa3",
        **args,
        "internal_states": states,
    }
    try:
        engine._check_resolved(campaign.drafters[0], info)
    except EngineError as refused:
        return str(refused)
    return None


def test_pipeline_micro_batches_that_cannot_hold_the_batch_are_refused(tmp_path: Path) -> None:
    """0.5.23's scheduler admits a request only while its running batch holds fewer than
    pp_max_micro_batch_size (scheduler.py `get_num_allocatable_reqs`), which left unset is
    max(1, max_running_requests // pp_size): 5 over 2 stages runs two micro-batches of 2, and
    the fifth request of a batch of 5 queues, though the rank's cap (5) says it runs."""
    cap = "effective_max_running_requests_per_dp"
    two = {"pp_size": 2, "pp_async_batch_depth": 0}
    said = _pipeline_check(tmp_path / "a", 5, [{cap: 5, "pp_max_micro_batch_size": 2}], **two)
    assert said is not None and "runs at most 4 requests at once" in said, said
    assert "--pp-max-micro-batch-size 3 or more" in said, said
    # Worked out from the cap where the state does not say (the scheduler's default).
    assert "at most 4" in str(_pipeline_check(tmp_path / "b", 5, [{cap: 5}], **two))
    # A micro-batch per stage that holds its share passes, as an async depth's extra one does.
    assert (
        _pipeline_check(tmp_path / "c", 6, [{cap: 6, "pp_max_micro_batch_size": 3}], **two) is None
    )
    deep = {"pp_size": 2, "pp_async_batch_depth": 1}
    assert (
        _pipeline_check(tmp_path / "d", 5, [{cap: 5, "pp_max_micro_batch_size": 2}], **deep) is None
    )
    # Without pipeline parallelism the one running batch is capped by a given value too.
    said = _pipeline_check(
        tmp_path / "e", 4, [{cap: 4, "pp_max_micro_batch_size": 2}], pp_max_micro_batch_size=2
    )
    assert said is not None and "a batch of at most 2" in said, said
    assert _pipeline_check(tmp_path / "f", 4, [{cap: 4}]) is None


def test_dvfs_gives_each_pipeline_micro_batch_its_share_of_an_odd_batch(tmp_path: Path) -> None:
    from dvfs.engines.sglang_args import launch_argv

    for extra, want in (('"--pp-size", "2"', "6"), ('"--pi=3"', "6"), ('"--pp-size", "1"', "5")):
        path, _ = stub_campaign(
            tmp_path,
            batch="[1, 5]",
            sglang_extra=f"extra_args = [{extra}]",
            knobs="sm_clock = [1980]",
        )
        campaign = load_campaign(path)
        argv = launch_argv(campaign, campaign.drafters[0], port=31000, version="0.5.23")
        assert argv[argv.index("--max-running-requests") + 1] == want, (extra, argv)


def test_a_server_dealing_its_dp_ranks_requests_by_load_is_refused(tmp_path: Path) -> None:
    """0.5.23's "total_requests" and "total_tokens" deal each request to the rank whose load
    snapshot, read at most every 20 ms (data_parallel_controller.py `refresh_load_budget`),
    looks least: which rank runs which request hangs on each arm's timing, and a rank may be
    dealt more than its turn. Only round_robin ("auto" outside a PD prefill server) deals
    alike; one rank deals nothing."""
    for method in ("total_requests", "total_tokens", "follow_bootstrap_room"):
        said = _check(tmp_path / method, 4, [2, 2], dp_size=2, load_balance_method=method)
        assert said is not None and f"--load-balance-method {method}, not in turn" in said, said
        assert "remove --load-balance-method from the extra_args" in said, said
    for method in ("round_robin", "auto"):
        assert _check(tmp_path / method, 4, [2, 2], dp_size=2, load_balance_method=method) is None
    assert _check(tmp_path / "one", 4, [4], load_balance_method="total_requests") is None
    prefill = {"load_balance_method": "auto", "disaggregation_mode": "prefill"}
    assert "by --load-balance-method auto" in str(
        _check(tmp_path / "pd", 4, [2, 2], dp_size=2, **prefill)
    )


def test_dvfs_gives_a_server_of_several_dp_ranks_round_robin(tmp_path: Path) -> None:
    from sglang_support import load_stub

    from dvfs.engines.sglang_args import launch_argv

    stub = load_stub()
    for extra, given in (
        ('"--dp-size", "2"', True),
        ('"--attn-dp-size", "2"', True),
        ('"--dp-size", "2", "--enable-dp-attention"', True),
        ('"--dp-size", "1"', False),
        ("", False),
    ):
        path, _ = stub_campaign(
            tmp_path,
            batch="[1, 4]",
            sglang_extra=f"extra_args = [{extra}]",
            knobs="sm_clock = [1980]",
        )
        campaign = load_campaign(path)
        argv = launch_argv(campaign, campaign.drafters[0], port=31000, version="0.5.23")
        assert ("--load-balance-method" in argv) is given, (extra, argv)
        if given:
            assert argv[argv.index("--load-balance-method") + 1] == "round_robin", argv
            start = argv.index("--model-path")
            stub.parse_launch_argv(argv[start:], stub.StubConfig(version="0.5.23"), None)


def test_a_closed_loop_over_several_dp_ranks_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A closed loop's replacement request goes to the DP controller's next rank in turn,
    not to the rank whose request finished: each rank's share drifts, and one may queue."""
    path, _ = stub_campaign(
        tmp_path,
        batch="[1, 4]",
        knobs="sm_clock = [1980]",
        workload_extra='mode = "closed-loop"\nignore_eos = true\npool_size = 40',
    )
    campaign = load_campaign(path)
    engine = SglangEngine(campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs")

    def info(**args: object) -> dict[str, object]:
        caps = [4] * (2 if args.get("dp_size") == 2 else 1)
        return {
            "model_path": campaign.engine.model,
            "speculative_algorithm": None,
            "max_running_requests": 4,
            "attention_backend": "fa3",
            **args,
            "internal_states": [{"effective_max_running_requests_per_dp": c} for c in caps],
        }

    with caplog.at_level("WARNING"):
        engine._check_resolved(campaign.drafters[0], info(dp_size=1))
    assert "closed loop" not in caplog.text
    with caplog.at_level("WARNING"):
        engine._check_resolved(campaign.drafters[0], info(dp_size=2))
    said = [r.getMessage() for r in caplog.records if "closed loop" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "runs 2 DP ranks" in said[0] and "next rank in turn" in said[0], said


def test_an_attention_dp_split_is_told_the_arg_that_holds_each_turn(tmp_path: Path) -> None:
    """--max-running-requests 4 over 3 attention DP ranks runs 1 a rank; a batch of 4 deals
    up to 2 to one. A largest batch that is a multiple of 3 (6) would still queue: the arg
    that holds every turn is 3 x 2."""
    said = str(_check(tmp_path, 4, [1, 1, 1], max_running_requests=4, attn_dp_size=3))
    assert "over its 3 attention DP ranks, 1 each" in said, said
    assert "give it --max-running-requests 6 or more" in said and "multiple" not in said, said
