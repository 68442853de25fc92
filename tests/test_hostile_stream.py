"""Hostile /generate (and /flush_cache) answers, fed through the stub (its `patch_route`) to
dvfs's client: each count dvfs reads from a stream's final meta_info (completion_tokens,
prompt_tokens, spec_verify_ct, the draft counters, retractions) given a wrong type, a negative,
NaN or infinite, or huge value, or one no server can report; a body that is no stream (an HTML
page with 200, a chunk cut short, bytes that are not UTF-8) or an HTML error page. Each is
refused in one line naming the field, never a traceback and never a number the cube would
record wrongly."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from sglang_support import one_line_refusal, patch_stub, patchable_stub

from dvfs.engines.base import ABORTED
from dvfs.engines.sglang_client import EngineConnectionError, SamplingParams, SglangClient
from dvfs.errors import EngineError

NEW_TOKENS = 6
HUGE = 10**30


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangClient]:
    """One stub serving every case in turn (each sets its patch first)."""
    with patchable_stub(tmp_path_factory.mktemp("hostile-stream")) as client:
        yield client


def generate(client: SglangClient) -> Any:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return client.run_batch(["one two three"], params, "hostile")[0]


# meta_info fields of a stream's final chunk: a hostile value is refused, naming the field.
REFUSED_META = [
    ("completion_tokens", -1),
    ("completion_tokens", "6"),
    ("completion_tokens", True),
    ("completion_tokens", 6.5),
    ("completion_tokens", HUGE),
    ("completion_tokens", [6]),
    ("prompt_tokens", -4),
    ("prompt_tokens", True),
    ("prompt_tokens", HUGE),
    ("prompt_tokens", float("inf")),
    ("prompt_tokens", float("nan")),
    ("spec_verify_ct", -1),
    ("spec_verify_ct", HUGE),
    ("spec_verify_ct", NEW_TOKENS + 1),
    ("spec_num_correct_drafts", -2),
    ("spec_num_proposed_drafts", HUGE),
    ("num_retractions", -1),
    ("num_retractions", HUGE),
]


@pytest.mark.parametrize(("key", "value"), REFUSED_META, ids=repr)
def test_a_hostile_final_meta_field_is_refused(client: SglangClient, key: str, value: Any) -> None:
    patch_stub(client, final_meta={key: value})
    with pytest.raises(EngineError) as caught:
        generate(client)
    assert key in one_line_refusal(caught.value)


def test_more_drafts_accepted_than_proposed_are_read_as_an_adaptive_server_counts_them(
    client: SglangClient,
) -> None:
    """SGLang 0.5.23 with --speculative-adaptive reports them: its TokenizerManager
    (_calculate_spec_decoding_metrics) counts the drafts proposed as spec_verify_ct times its
    own static speculative_num_draft_tokens - 1 (4 - 1 here), while the scheduler, its
    steps raised at run time (adaptive_spec_params.py, candidate steps up to 7), sums each
    verify pass's accepted drafts (batch_result_processor.py _resolve_spec_v2_tokens), a last
    run past max_new_tokens whole: one pass accepting 5 drafts ends a 6-token request."""
    patch_stub(
        client,
        final_meta={
            "spec_verify_ct": 1,
            "spec_num_correct_drafts": 5,
            "spec_num_proposed_drafts": 3,
        },
    )
    trace = generate(client)
    assert (trace.completion_tokens, trace.spec_verify_ct) == (NEW_TOKENS, 1)
    assert (trace.spec_accepted_drafts, trace.spec_proposed_drafts) == (5, 3)


def test_sound_final_meta_fields_are_read(client: SglangClient) -> None:
    patch_stub(
        client,
        final_meta={
            "spec_verify_ct": 3,
            "spec_num_correct_drafts": 2,
            "spec_num_proposed_drafts": 9,
        },
    )
    trace = generate(client)
    assert (trace.completion_tokens, trace.spec_verify_ct) == (NEW_TOKENS, 3)
    assert (trace.spec_accepted_drafts, trace.spec_proposed_drafts) == (2, 9)
    assert trace.prompt_tokens > 0 and trace.retractions == 0
    assert not math.isnan(trace.prompt_tokens)


def test_the_stub_patches_nothing_once_cleared(client: SglangClient) -> None:
    patch_stub(client)
    trace = generate(client)
    assert trace.completion_tokens == NEW_TOKENS and trace.spec_verify_ct is None
    assert client.server_info()["version"] == "0.5.23"


HTML_PAGE = "<html>\n<head><title>503</title></head>\n<body>\n\x1b[1mBusy\n</body>\n</html>\n" * 200


def test_an_html_error_page_on_generate_is_refused_in_one_line(client: SglangClient) -> None:
    patch_stub(client, raw={"/generate": {"status": 503, "body": HTML_PAGE}})
    with pytest.raises(EngineError) as caught:
        generate(client)
    message = one_line_refusal(caught.value)
    assert "/generate answered HTTP 503: <html> <head>" in message and "\\x1b" in message
    assert len(message) < 400


def test_an_html_error_page_on_flush_cache_is_refused_in_one_line(client: SglangClient) -> None:
    patch_stub(client, raw={"/flush_cache": {"status": 502, "body": HTML_PAGE}})
    with pytest.raises(EngineError) as caught:
        client.flush_cache(timeout_s=5.0)
    message = one_line_refusal(caught.value)
    assert message.startswith(f"{client.shown_url}/flush_cache answered 502: <html> <head>")


@pytest.mark.parametrize(
    "body",
    [
        "<html><body>Welcome to nginx!</body></html>",  # a page with 200, no stream
        'data: {"text": " a", "meta_info": {"completion_tokens": 1, "fin',  # cut mid-chunk
        'data: {"text": "\xff\xfe", "meta_info": {"finish_reason": null}}\n\n',  # not UTF-8
        "data: [DONE]\n\n",  # no chunk at all
        "data: [1, 2]\n\ndata: [DONE]\n\n",
        'data: {"error": null}\n\n',
        'data: {"output_ids": 5, "meta_info": {"finish_reason": {"type": "length"}}}\n\n',
    ],
    ids=repr,
)
def test_a_generate_answer_that_is_no_sound_stream_is_refused(
    client: SglangClient, body: str
) -> None:
    patch_stub(client, raw={"/generate": {"body": body}})
    with pytest.raises(EngineError) as caught:
        generate(client)
    one_line_refusal(caught.value)


def test_a_stream_cut_mid_chunk_is_a_broken_connection(client: SglangClient) -> None:
    first = '{"text": " a", "meta_info": {"completion_tokens": 1, "finish_reason": null}}'
    patch_stub(client, raw={"/generate": {"cut": True, "body": f"data: {first}\n\ndata: {{"}})
    with pytest.raises(EngineConnectionError) as caught:
        generate(client)
    assert "connection to the server broke" in one_line_refusal(caught.value)


def test_an_aborted_request_past_its_max_new_tokens_is_read(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """SGLang 0.5.23 aborts a running request by its `to_finish` (scheduler.py abort_request),
    which its next step reads before the length cap (schedule_batch.py
    Req.update_finish_state): a speculative step appends its whole verified run first
    (batch_result_processor.py process_batch_result_decode), and the final chunk's
    completion_tokens is then every token (output_streamer.py: finished_len =
    len(output_ids)), past max_new_tokens by up to a run less one. A round ended at its first
    finish aborts such requests itself: they are read as reported, not refused."""
    with patchable_stub(tmp_path_factory.mktemp("abort-past"), hold_unfinished=True) as client:
        patch_stub(client, abort_meta={"completion_tokens": NEW_TOKENS + 3})
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        traces = client.run_batch(["one two", "three four"], params, "past", end_at_window=True)
    kinds = sorted(t.finish_reason for t in traces)
    assert kinds == sorted(["length", ABORTED])
    aborted = next(t for t in traces if t.finish_reason == ABORTED)
    assert aborted.completion_tokens == NEW_TOKENS + 3


@pytest.mark.parametrize(
    "finish",
    [["abort"], {"type": ["abort"]}, {"type": None}, 7, [{"type": "x" * 100_000}]],
    ids=["list", "type-list", "type-null", "number", "list-huge"],
)
def test_a_finish_reason_no_sglang_sends_is_refused_in_one_line(
    client: SglangClient, finish: Any
) -> None:
    """SGLang's final chunk says why a request finished as {"type": "length" | "stop" |
    "abort", ...}: any other value (a list that says abort, a null type) was read as its
    string, a finish like any other, so a request a broken server or a proxy cut short
    passed as measured. Refused in one short line, the value clipped."""
    patch_stub(client, final_meta={"finish_reason": finish})
    with pytest.raises(EngineError) as caught:
        generate(client)
    message = one_line_refusal(caught.value)
    assert "finish_reason" in message and "no SGLang sends" in message, message
    assert len(message) < 400, message


def test_a_finish_reason_type_is_kept_as_one_short_line(client: SglangClient) -> None:
    """A string type SGLang does not send is read as such (a later release may add one),
    clipped to one short printable line."""
    patch_stub(client, final_meta={"finish_reason": {"type": "odd\n" + "x" * 100_000}})
    kind = generate(client).finish_reason
    assert kind.startswith("odd x") and len(kind) <= 40 and kind.isprintable(), kind
