"""Hostile /server_info answers, fed through the stub (its `patch_route`) to dvfs's client:
each field dvfs reads from it (internal_states' accept length and running cap, the context and
log-interval args) given a wrong type, a negative, NaN or infinite, or huge value, and a body
that is no JSON object or an error status. Each is read as unknown (None) or refused in one
line naming the server, never a traceback and never a number the cube would record wrongly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_support import one_line_refusal, patch_stub, patchable_stub, stub_campaign
from sglang_support import running as running_processes

from dvfs.campaign import load_campaign
from dvfs.clock import MonotonicClock
from dvfs.engines.sglang import ContextRoom, SglangEngine, log_interval
from dvfs.engines.sglang_client import SglangClient, running_cap_of
from dvfs.errors import EngineError


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangClient]:
    """One stub serving every case in turn (each sets its patch first)."""
    with patchable_stub(tmp_path_factory.mktemp("hostile-info")) as client:
        yield client


HUGE = 10**30


def states(value: Any) -> dict[str, Any]:
    return {"internal_states": [{"avg_spec_accept_length": value}]}


# /server_info fields whose hostile values must read as unknown (None), not a number.
ACCEPT_LENGTH_UNKNOWN = [
    {"internal_states": 5},
    {"internal_states": "x"},
    {"internal_states": {"avg_spec_accept_length": 2.5}},
    {"internal_states": [5, {"avg_spec_accept_length": 2.5}]},
    states("2.5"),
    states([2.5]),
    states({"v": 2.5}),
    states(True),
    states(float("nan")),
    states(float("inf")),
    states(-2.5),
    states(HUGE * 1e300),  # 1e330: infinite once read
]


@pytest.mark.parametrize("info", ACCEPT_LENGTH_UNKNOWN, ids=repr)
def test_a_hostile_accept_length_is_unknown(client: SglangClient, info: dict[str, Any]) -> None:
    patch_stub(client, server_info=info)
    assert client.accept_length() is None


def test_an_accept_length_the_server_reports_is_read(client: SglangClient) -> None:
    patch_stub(client, server_info={"internal_states": [{"avg_spec_accept_length": 2.5}]})
    assert client.accept_length() == 2.5


@pytest.mark.parametrize(
    "cap", [-3, 0, "7", True, 1.5, float("inf"), float("nan"), [4], None], ids=repr
)
def test_a_hostile_running_cap_is_unknown(client: SglangClient, cap: Any) -> None:
    patch_stub(
        client, server_info={"internal_states": [{"effective_max_running_requests_per_dp": cap}]}
    )
    assert running_cap_of(client.server_info()) is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_req_input_len", float("inf")),
        ("max_req_input_len", True),
        ("max_req_input_len", 1000.5),
        ("max_req_input_len", -5),
        ("max_req_input_len", "4096"),
        ("speculative_num_draft_tokens", float("inf")),
        ("decode_log_interval", float("inf")),
        ("decode_log_interval", -40),
        ("decode_log_interval", "x"),
    ],
    ids=repr,
)
def test_hostile_server_args_are_unknown_or_refused(
    client: SglangClient, key: str, value: Any
) -> None:
    info = {"speculative_algorithm": "EAGLE", key: value}
    if key != "max_req_input_len":
        info["max_req_input_len"] = 4096
    patch_stub(client, server_info=info)
    got = client.server_info()
    room = ContextRoom.of(got)
    if key == "max_req_input_len":
        assert room is None
    else:
        assert room is not None and room.reserved >= 0
    assert log_interval(got) >= 1


@pytest.mark.parametrize(
    "body",
    [
        "5",
        "null",
        "[1, 2]",
        '[["version", "0.5.23"]]',
        '{"version": "0.5.23", ',
        "\xff\xfe{}",
        "<html><body>502 Bad Gateway</body></html>",
        "",
    ],
    ids=repr,
)
def test_a_server_info_that_is_no_json_object_is_refused(client: SglangClient, body: str) -> None:
    patch_stub(client, raw={"/server_info": {"body": body}, "/get_server_info": {"body": body}})
    with pytest.raises(EngineError) as caught:
        client.server_info()
    assert "/server_info" in one_line_refusal(caught.value)


def test_a_server_info_answering_503_is_refused_by_its_status(client: SglangClient) -> None:
    patch_stub(client, raw={"/server_info": {"status": 503}, "/get_server_info": {"status": 503}})
    with pytest.raises(EngineError) as caught:
        client.server_info()
    message = one_line_refusal(caught.value)
    assert "answered 503 to /server_info and 503 to /get_server_info" in message
    # a 503 on one route, the other answering: read from the other
    patch_stub(
        client,
        raw={"/server_info": {"status": 503, "body": "<html>\n<body>\nBusy\n</body>\n</html>"}},
    )
    assert client.server_info()["version"] == "0.5.23"


@pytest.mark.parametrize(
    "running", ["abc", "2", float("inf"), float("nan"), True, 2.5, [2], {"n": 2}], ids=repr
)
def test_a_hostile_max_running_requests_is_unknown_not_a_traceback(
    tmp_path: Path, running: Any
) -> None:
    """The resolved --max-running-requests is checked against the largest batch: one that is
    not a whole number is unknown there (the check is skipped), as the scheduler's own cap."""
    path, marker = stub_campaign(tmp_path, batch="[1, 4]", knobs="sm_clock = [1980]")
    campaign = load_campaign(path)
    engine = SglangEngine(campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs")
    info = {
        "model_path": campaign.engine.model,
        "speculative_algorithm": None,
        "max_running_requests": running,
        "attention_backend": "fa3",
        "internal_states": [{"effective_max_running_requests_per_dp": 2}],
    }
    with pytest.raises(EngineError) as refused:  # refused for the scheduler's cap alone
        engine._check_resolved(campaign.drafters[0], info)
    assert "runs at most 2 requests at once" in one_line_refusal(refused.value)
    info["internal_states"] = [{"effective_max_running_requests_per_dp": 4}]
    engine._check_resolved(campaign.drafters[0], info)
    assert running_processes(marker) == []
