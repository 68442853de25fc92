"""Tests of the SGLang stand-in in tests/fakes/sglang_stub.py.

Why: dvfs's engine tests trust this stub to parse argv and speak HTTP the way
SGLang 0.5.9 / 0.5.23 do; these tests pin that contract.  They start the stub
as a subprocess on a free loopback port and talk to it with http.client only.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

STUB_PATH = Path(__file__).parent / "fakes" / "sglang_stub.py"
VERSIONS = ("0.5.9", "0.5.23")
HTTP_TIMEOUT_S = 5.0
# Bounds a stub that never starts (a hang), not how fast it starts: importing torch for
# `torch_load_device` takes seconds of CPU, many more beside a sweep on two busy cores.
START_TIMEOUT_S = 90.0

BASE_META = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"}
BASE_META |= {"weight_version"}
METRICS_META_0523 = {"request_received_ts", "first_token_latency", "queue_time"}
FINAL_ONLY_META = {
    "0.5.23": {"e2e_latency", "request_finished_ts", "decode_throughput"},
    "0.5.9": {"e2e_latency"},
}
RUNNING_META = {
    "0.5.23": BASE_META | {"num_retractions"} | METRICS_META_0523,
    "0.5.9": BASE_META | {"total_retractions"},
}
SPEC_META = {
    "0.5.23": {
        "spec_verify_ct",
        "spec_accept_length",
        "spec_accept_rate",
        "spec_num_correct_drafts",
        "spec_num_proposed_drafts",
        "spec_correct_drafts_histogram",
    },
    "0.5.9": {
        "spec_verify_ct",
        "spec_accept_length",
        "spec_accept_rate",
        "spec_accept_token_num",
        "spec_draft_token_num",
        "spec_accept_histogram",
    },
}
DRAFT_NAMES = {
    "0.5.23": (
        "spec_num_correct_drafts",
        "spec_num_proposed_drafts",
        "spec_correct_drafts_histogram",
    ),
    "0.5.9": ("spec_accept_token_num", "spec_draft_token_num", "spec_accept_histogram"),
}


# --------------------------------------------------------------------------- helpers


def load_stub_module() -> ModuleType:
    """Import the stub by path (tests/ is not a package on sys.path)."""
    spec = importlib.util.spec_from_file_location("sglang_stub_under_test", STUB_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stub_module() -> ModuleType:
    """The stub imported once for the in-process argv tests."""
    return load_stub_module()


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_config(directory: Path, **config: Any) -> Path:
    """Write a SGLANG_STUB_CONFIG file; a short max_lifetime_s guards against orphans."""
    config.setdefault("max_lifetime_s", 60)
    path = directory / f"stub-config-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def stub_env(config_path: Path) -> dict[str, str]:
    """A minimal environment for the stub process."""
    return {"SGLANG_STUB_CONFIG": str(config_path), "PATH": "/usr/bin:/bin"}


def run_stub_to_exit(
    tmp_path: Path, argv: list[str], **config: Any
) -> subprocess.CompletedProcess[str]:
    """Run the stub expecting it to exit during argv checks (bounded)."""
    config.setdefault("max_lifetime_s", 2)
    return subprocess.run(
        [sys.executable, str(STUB_PATH), *argv],
        env=stub_env(write_config(tmp_path, **config)),
        capture_output=True,
        text=True,
        timeout=15,
        check=False,
    )


@dataclass
class RunningStub:
    """A stub subprocess and the means to talk to it."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def log_tail(self) -> str:
        """Last lines of the stub's log, for assertion messages."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])

    def connect(self) -> http.client.HTTPConnection:
        """A fresh connection with a bounded timeout."""
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT_S)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """One request on its own connection; returns (status, body)."""
        conn = self.connect()
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """Like request(), decoding a JSON body."""
        status, raw = self.request(method, path, body)
        return status, json.loads(raw)

    def open_stream(self, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, Any]:
        """Start a streaming /generate; returns (connection, response)."""
        conn = self.connect()
        payload = json.dumps({**body, "stream": True}).encode()
        conn.request(
            "POST", "/generate", body=payload, headers={"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200, self.log_tail()
        return conn, response

    def stream(self, body: dict[str, Any]) -> list[str]:
        """A whole streaming /generate, as the payloads of its data: lines."""
        conn, response = self.open_stream(body)
        try:
            return read_events(response)
        finally:
            conn.close()


def read_events(response: Any, limit: int | None = None) -> list[str]:
    """Payloads of ``data:`` lines, until EOF or ``limit`` lines."""
    events: list[str] = []
    while limit is None or len(events) < limit:
        line = response.readline()
        if not line:
            break
        text = line.decode().rstrip("\r\n")
        if text.startswith("data: "):
            events.append(text[len("data: ") :])
    return events


def wait_for_health(stub: RunningStub, deadline_s: float = START_TIMEOUT_S) -> list[int]:
    """Poll /health until 200; returns every status seen (connection refusals skipped)."""
    seen: list[int] = []
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if stub.proc.poll() is not None:
            pytest.fail(f"stub exited with {stub.proc.returncode}:\n{stub.log_tail()}")
        try:
            status, _ = stub.request("GET", "/health")
        except OSError:
            time.sleep(0.01)
            continue
        seen.append(status)
        if status == 200:
            return seen
        time.sleep(0.02)
    pytest.fail(f"stub not healthy within {deadline_s}s:\n{stub.log_tail()}")


Launcher = Callable[..., RunningStub]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launcher]:
    """Start stubs (``launch(version, argv, wait=True, **config)``); all killed at teardown."""
    started: list[RunningStub] = []

    def start(
        version: str, argv: tuple[str, ...] = (), *, wait: bool = True, **config: Any
    ) -> RunningStub:
        config.setdefault("startup_s", 0.05)
        port = free_port()
        log_path = tmp_path / f"stub-{port}.log"
        argv_full = ["--model-path", "Qwen/Qwen2.5-7B-Instruct", "--port", str(port), *argv]
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(
                [sys.executable, str(STUB_PATH), *argv_full],
                env=stub_env(write_config(tmp_path, version=version, **config)),
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        stub = RunningStub(proc, port, log_path)
        started.append(stub)
        if wait:
            wait_for_health(stub)
        return stub

    yield start
    for stub in started:
        if stub.proc.poll() is None:
            stub.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            stub.proc.wait(timeout=5)


def generate_body(max_new_tokens: int, **params: Any) -> dict[str, Any]:
    """A one-prompt /generate body."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, **params}
    return {"text": "The quick brown fox", "sampling_params": sampling}


def final_meta(events: list[str]) -> dict[str, Any]:
    """meta_info of the last JSON chunk of a stream that ended with [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    return json.loads(events[-2])["meta_info"]


# --------------------------------------------------------------------------- lifecycle


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_health_is_503_while_starting_then_200(launch: Launcher, version: str) -> None:
    """dvfs waits on /health; the stub must say 503 first, like a loading SGLang."""
    started = time.monotonic()
    stub = launch(version, wait=False, startup_s=0.5)
    seen = wait_for_health(stub)
    assert seen[0] == 503 and seen[-1] == 200, seen
    assert time.monotonic() - started >= 0.5
    status, body = stub.json("POST", "/generate", generate_body(2))
    assert status == 200 and body["meta_info"]["completion_tokens"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_stream_is_cumulative_with_the_version_meta_names(launch: Launcher, version: str) -> None:
    """Chunks are cumulative, finish_reason appears once, meta_info names follow the version."""
    stub = launch(version, ("--enable-metrics",))
    events = stub.stream(generate_body(8, ignore_eos=True))
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and len(chunks) == 8
    previous_text, previous_ids = "", []
    for number, chunk in enumerate(chunks, start=1):
        meta = chunk["meta_info"]
        assert chunk["text"].startswith(previous_text) and len(chunk["text"]) > len(previous_text)
        assert chunk["output_ids"][: len(previous_ids)] == previous_ids
        assert meta["completion_tokens"] == len(chunk["output_ids"]) == number
        assert "index" not in chunk
        last = number == len(chunks)
        expected = RUNNING_META[version] | (FINAL_ONLY_META[version] if last else set())
        assert set(meta) == expected, (number, sorted(meta))
        assert (meta["finish_reason"] is None) != last
        previous_text, previous_ids = chunk["text"], chunk["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}

    status, info = stub.json("GET", "/server_info")
    assert status == 200 and info["version"] == version
    assert info["model_path"] == "Qwen/Qwen2.5-7B-Instruct" and info["tp_size"] == 1
    assert info["speculative_algorithm"] is None and info["enable_metrics"] is True
    assert "avg_spec_accept_length" not in info["internal_states"][0]
    assert stub.request("GET", "/get_server_info")[0] == 200  # the deprecated name, both
    status, metrics = stub.request("GET", "/metrics")
    assert status == 200 and b"sglang:generation_tokens_total" in metrics
    assert b"sglang:spec_verify_calls_total" not in metrics

    # 0.5.23 refuses an unknown sampling key; 0.5.9 ignores it.
    status, _ = stub.request("POST", "/generate", generate_body(2, not_a_param=1))
    assert status == (400 if version == "0.5.23" else 200)
    # A batch answers a list, one result per prompt, each exactly max_new_tokens long.
    batch = {"text": ["a b", "c"], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    status, results = stub.json("POST", "/generate", batch)
    assert status == 200 and [r["meta_info"]["completion_tokens"] for r in results] == [3, 3]
    streamed = [json.loads(e) for e in stub.stream(batch)[:-1]]
    assert {c["index"] for c in streamed} == {0, 1}

    stub.proc.send_signal(signal.SIGTERM)
    assert stub.proc.wait(timeout=60) == 0


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_speculative_fields_only_on_the_final_chunk(launch: Launcher, version: str) -> None:
    """With an algorithm: resolved defaults, exact length, per-version draft names, averages."""
    argv = ("--speculative-algorithm", "EAGLE", "--decode-log-interval", "4")
    stub = launch(version, argv, accept_length=2.5, tpot_s=0.002)
    events = stub.stream(generate_body(40, ignore_eos=True))
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks[:-1]:
        assert not set(chunk["meta_info"]) & SPEC_META[version]
    meta = final_meta(events)
    assert SPEC_META[version] <= set(meta)
    assert meta["completion_tokens"] == 40 and len(chunks[-1]["output_ids"]) == 40
    assert len(chunks) < 40  # several tokens per decode step
    correct_key, proposed_key, histogram_key = DRAFT_NAMES[version]
    verify = meta["spec_verify_ct"]
    assert meta["spec_accept_length"] == pytest.approx(40 / verify)
    assert sum(meta[histogram_key]) == verify
    assert meta[proposed_key] == verify * (4 - 1)
    assert meta["spec_accept_rate"] == pytest.approx(meta[correct_key] / meta[proposed_key])

    _, info = stub.json("GET", "/server_info")
    steps_topk_drafts = (
        info["speculative_num_steps"],
        info["speculative_eagle_topk"],
        info["speculative_num_draft_tokens"],
    )
    assert steps_topk_drafts == (3, 1, 4) and info["max_running_requests"] == 48
    average = info["internal_states"][0]["avg_spec_accept_length"]
    assert 2.0 <= average <= 3.0  # over the whole blocks of 4 iterations
    assert stub.request("POST", "/flush_cache")[0] == 200
    _, info = stub.json("GET", "/server_info")
    # Scheduler.flush_cache resets the metrics in 0.5.9 and 0.5.23 alike: no average yet
    assert "avg_spec_accept_length" not in info["internal_states"][0]


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_a_request_without_a_verify_pass_has_no_speculative_fields(
    launch: Launcher, version: str
) -> None:
    """SGLang adds the speculative keys (spec_verify_ct too) only once a request had a verify
    pass: one that ends at its prefill token has none, not spec_verify_ct 0."""
    stub = launch(version, ("--speculative-algorithm", "EAGLE"), accept_length=2.5)
    meta = final_meta(stub.stream(generate_body(1, ignore_eos=True)))
    assert meta["completion_tokens"] == 1
    assert not set(meta) & SPEC_META[version], sorted(meta)
    meta = final_meta(stub.stream(generate_body(2, ignore_eos=True)))
    assert meta["spec_verify_ct"] == 1 and SPEC_META[version] <= set(meta)


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_no_server_accept_length_before_a_whole_block_of_decode_iterations(
    launch: Launcher, version: str
) -> None:
    """SGLang adds to /server_info's average only every --decode-log-interval (40) decode
    iterations: a request of fewer iterations leaves it unset."""
    stub = launch(version, ("--speculative-algorithm", "EAGLE"), accept_length=2.5, tpot_s=0.001)
    meta = final_meta(stub.stream(generate_body(40, ignore_eos=True)))
    assert 0 < meta["spec_verify_ct"] < 40
    _, info = stub.json("GET", "/server_info")
    assert info["decode_log_interval"] == 40
    assert "avg_spec_accept_length" not in info["internal_states"][0]


def test_server_accept_length_covers_the_whole_blocks_only(stub_module: ModuleType) -> None:
    """In process, step by step: the average pools request steps of the iterations up to
    the last multiple of decode_log_interval, weighted per request step as SGLang's
    (accepted tokens + batch size) / batch size sums are; the next block joins once it
    is complete, and a flush starts over."""
    cfg = stub_module.StubConfig(version="0.5.23")
    args, spec = stub_module.parse_launch_argv(
        ["--model-path", "m", "--speculative-algorithm", "EAGLE", "--decode-log-interval", "3"],
        cfg,
    )
    assert args["decode_log_interval"] == 3
    stub = stub_module.Stub(cfg, args, stub_module.spec_settings(args, cfg))
    # two requests decoded together: the prefill token, then tokens per iteration
    steps = [[1, 4, 4, 4, 1, 1], [1, 2, 2, 2, 1, 1]]
    subs = [
        stub_module.SubRequest(i, f"r{i}", [1], 12, {}, s, list(range(20)), 1, histogram=[0] * 4)
        for i, s in enumerate(steps)
    ]

    def info() -> dict[str, Any]:
        return dict(stub.server_info()["internal_states"][0])

    for j in range(3):
        for sub in subs:
            stub._apply(sub, j)
    assert "avg_spec_accept_length" not in info()  # two iterations: no block yet
    for sub in subs:
        stub._apply(sub, 3)
    assert info()["avg_spec_accept_length"] == (4 * 3 + 2 * 3) / 6
    for j in (4, 5):
        for sub in subs:
            stub._apply(sub, j)
    assert info()["avg_spec_accept_length"] == (4 * 3 + 2 * 3) / 6  # iteration 5 of 6
    stub.flush()
    assert "avg_spec_accept_length" not in info()


def test_dp_attention_resolves_and_splits_the_cap_as_0523_does(stub_module: ModuleType) -> None:
    """0.5.23 turns the deprecated `--dp-size N --enable-dp-attention` into attn_dp_size N,
    dp_size 1 (arg_groups/parallel_hook.py `_handle_deprecated_dp_attention`), reports
    enable_dp_attention as attn_dp_size > 1 (server_args.py `resolved_dict`), and each
    rank's cap is the arg split over the attention DP ranks, lowered to what its KV pool
    holds (`running_cap`), never raised by it (kv_cache_configurator.py
    `resolve_max_num_reqs`); with no arg, the pool's estimate, not split."""

    def served(*argv: str, version: str = "0.5.23", **cfg: Any) -> dict[str, Any]:
        config = stub_module.StubConfig(version=version, **cfg)
        args, spec = stub_module.parse_launch_argv(["--model-path", "m", *argv], config)
        return dict(stub_module.Stub(config, args, spec).server_info())

    def caps(info: dict[str, Any]) -> list[Any]:
        return [s.get("effective_max_running_requests_per_dp") for s in info["internal_states"]]

    old = served("--dp-size", "2", "--enable-dp-attention", "--max-running-requests", "4")
    assert (old["dp_size"], old["attn_dp_size"], old["enable_dp_attention"]) == (1, 2, True)
    assert caps(old) == [2, 2]
    new = served("--attn-dp-size", "2", "--max-running-requests", "4")
    assert (new["dp_size"], new["attn_dp_size"], new["enable_dp_attention"]) == (1, 2, True)
    plain = served("--dp-size", "2", "--max-running-requests", "4")
    assert (plain["dp_size"], plain["attn_dp_size"], plain["enable_dp_attention"]) == (2, 1, False)
    assert caps(plain) == [4, 4]
    # The KV pool lowers a rank's share, never raises it.
    assert caps(served("--attn-dp-size", "2", "--max-running-requests", "4", running_cap=8)) == [
        2, 2,
    ]  # fmt: skip
    assert caps(served("--attn-dp-size", "2", "--max-running-requests", "8", running_cap=3)) == [
        3, 3,
    ]  # fmt: skip
    assert caps(served("--attn-dp-size", "2")) == [2048, 2048]
    # 0.5.9 keeps the old spelling as given (dp_size counts the attention DP ranks) and
    # reports no cap.
    older = served("--dp-size", "2", "--enable-dp-attention", version="0.5.9")
    assert (older["dp_size"], older["enable_dp_attention"]) == (2, True)
    assert caps(older) == [None, None]


def test_dp_replicas_of_attention_dp_ranks_do_not_start_as_0523(stub_module: ModuleType) -> None:
    """0.5.23 refuses `--dp-size` replicas beside `--attn-dp-size` ranks at start
    (arg_groups/parallel_hook.py `handle_data_parallelism`: "data-parallel replicas combined with
    attention data parallelism are not supported"); the stub started them, four ranks of a
    layout no real server runs. The deprecated spelling beside --attn-dp-size is refused
    alike (its handler then leaves dp_size as given)."""

    def launch(*argv: str, version: str = "0.5.23") -> dict[str, Any]:
        config = stub_module.StubConfig(version=version)
        args, _ = stub_module.parse_launch_argv(["--model-path", "m", *argv], config)
        return dict(args)

    for argv in (
        ("--dp-size", "2", "--attn-dp-size", "2"),
        ("--dp-size", "2", "--attn-dp-size", "2", "--enable-dp-attention"),
    ):
        with pytest.raises(stub_module.LaunchError, match="not supported") as caught:
            launch(*argv)
        assert caught.value.kind == "ValueError"
    # Either alone starts, as does 0.5.9's old spelling.
    assert launch("--dp-size", "2")["dp_size"] == 2
    assert launch("--attn-dp-size", "2")["attn_dp_size"] == 2
    assert launch("--dp-size", "2", "--enable-dp-attention", version="0.5.9")["dp_size"] == 2


# --------------------------------------------------------------------------- argv


@pytest.mark.slow
def test_cuda_graph_max_bs_is_ambiguous_on_0523(tmp_path: Path) -> None:
    """0.5.23 only has --cuda-graph-max-bs-{decode,prefill}: argparse exits 2."""
    argv = ["--model-path", "m", "--port", str(free_port()), "--cuda-graph-max-bs", "8"]
    result = run_stub_to_exit(tmp_path, argv, version="0.5.23")
    assert result.returncode == 2
    assert "ambiguous option: --cuda-graph-max-bs" in result.stderr


@pytest.mark.slow
def test_cuda_graph_max_bs_is_accepted_on_059(launch: Launcher) -> None:
    """0.5.9 has the flag; the stub serves and reports it."""
    stub = launch("0.5.9", ("--cuda-graph-max-bs", "8"))
    _, info = stub.json("GET", "/server_info")
    assert info["cuda_graph_max_bs"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_partial_speculative_triple_exits_non_zero(tmp_path: Path, version: str) -> None:
    """SGLang asserts on a partial (steps, topk, draft tokens) set."""
    argv = ["--model-path", "m", "--speculative-algorithm", "EAGLE"]
    argv += ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
    result = run_stub_to_exit(tmp_path, argv, version=version)
    assert result.returncode == 1
    assert "AssertionError" in result.stderr


@pytest.mark.slow
def test_dflash_is_an_invalid_choice_on_059(tmp_path: Path) -> None:
    """0.5.9's --speculative-algorithm choices lack DFLASH."""
    argv = ["--model-path", "m", "--speculative-algorithm", "DFLASH"]
    result = run_stub_to_exit(tmp_path, argv, version="0.5.9")
    assert result.returncode == 2 and "invalid choice: 'DFLASH'" in result.stderr


@pytest.mark.slow
def test_non_loopback_host_is_refused(tmp_path: Path) -> None:
    """The stub never listens beyond loopback."""
    result = run_stub_to_exit(tmp_path, ["--model-path", "m", "--host", "0.0.0.0"])
    assert result.returncode != 0 and "loopback" in result.stderr


def _resolve(stub_module: ModuleType, version: str, *argv: str) -> dict[str, Any]:
    cfg = stub_module.StubConfig(version=version)
    args, _spec = stub_module.parse_launch_argv(["--model-path", "m", *argv], cfg)
    return args


def _triple(args: dict[str, Any]) -> tuple[Any, Any, Any]:
    names = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    return tuple(args[name] for name in names)  # type: ignore[return-value]


@pytest.mark.parametrize("version", VERSIONS)
def test_speculative_defaults_follow_sglang(stub_module: ModuleType, version: str) -> None:
    """Auto (3,1,4) / (5,4,8) for Llama, topk=1 forcing, NGRAM 12, NEXTN -> EAGLE."""
    plain = _resolve(stub_module, version, "--speculative-algorithm", "EAGLE3")
    assert _triple(plain) == (3, 1, 4) and plain["max_running_requests"] == 48
    cfg = stub_module.StubConfig(version=version)
    llama, _ = stub_module.parse_launch_argv(
        ["--model", "/models/Meta-LLaMA-3-8B", "--speculative-algorithm", "EAGLE"], cfg
    )
    assert _triple(llama) == (5, 4, 8)
    forced = _resolve(
        stub_module, version, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "4",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "9",
        "--max-running-requests", "64",
    )  # fmt: skip
    assert _triple(forced) == (4, 1, 5) and forced["max_running_requests"] == 64
    ngram = _resolve(stub_module, version, "--speculative-algorithm", "NGRAM")
    assert ngram["speculative_num_draft_tokens"] == 12
    assert ngram["speculative_ngram_max_bfs_breadth"] == 10
    assert (
        _resolve(stub_module, version, "--speculative-algorithm", "NEXTN")["speculative_algorithm"]
        == "EAGLE"
    )
    none = _resolve(stub_module, version, "--tp", "2")
    assert none["tp_size"] == 2 and none["max_running_requests"] is None


#: SGLang's default --mem-fraction-static on an H100 SXM (81559 MiB), tp 1, chunked prefill 8192,
#: decode graphs up to 256: 0.5.9 reserves 512 + 8192 x 1.5 + 128 + 256 x 2 = 13440 MiB (0.835),
#: 2 GiB more for an EAGLE drafter (0.810), 6 GiB for a STANDALONE one (0.760), none for NGRAM;
#: 0.5.23 reserves 8 MiB more per prefill graph size (58 up to 8192) and nothing per drafter:
#: 13904 MiB (0.830). On an H200 (143771 MiB) 0.5.23's is 0.903.
DEFAULT_FRACTIONS = {
    "0.5.9": {None: 0.835, "EAGLE3": 0.81, "STANDALONE": 0.76, "NGRAM": 0.835},
    "0.5.23": {None: 0.83, "EAGLE3": 0.83, "STANDALONE": 0.83, "NGRAM": 0.83},
}


@pytest.mark.parametrize("version", VERSIONS)
def test_an_unset_static_memory_fraction_is_reported_as_sglang_resolves_it(
    stub_module: ModuleType, version: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang resolves an unset --mem-fraction-static from the GPU's memory, less what it
    reserves for activations, CUDA graphs and (0.5.9) a draft model, and /server_info reports
    the number; a given one as given. Before, the stub reported null unless given, so dvfs's
    reading of the server's memory claim (engines/server_memory.py) was only ever exercised
    with its 0.7 fallback, and a wrapper's --mem-fraction-static read "None -> 0.6"."""
    for algorithm, fraction in DEFAULT_FRACTIONS[version].items():
        argv = ["--speculative-algorithm", algorithm] if algorithm else []
        if algorithm == "STANDALONE":
            argv += ["--speculative-draft-model-path", "d"]
        assert _resolve(stub_module, version, *argv)["mem_fraction_static"] == fraction, algorithm
    assert (
        _resolve(stub_module, version, "--mem-fraction-static", "0.6")["mem_fraction_static"] == 0.6
    )
    # The smallest GPU SGLang sees, as the fake NVML lists them (a new state file of each).
    cfg = stub_module.StubConfig(version=version)
    h200 = 0.907 if version == "0.5.9" else 0.903  # 13440 or 13904 MiB of 143771
    for devices, fraction in (
        ("h200-sxm", h200),
        ("h200-sxm,h100-sxm", DEFAULT_FRACTIONS[version][None]),
    ):
        monkeypatch.setenv("DVFS_FAKE_NVML_STATE", str(tmp_path / f"{devices}.json"))
        monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", devices)
        args, _ = stub_module.parse_launch_argv(["--model-path", "m"], cfg, os.environ)
        assert args["mem_fraction_static"] == fraction, devices


@pytest.mark.parametrize("version", VERSIONS)
def test_the_static_fraction_reserves_what_sglang_reserves_for_each_flag(
    stub_module: ModuleType, version: str
) -> None:
    """SGLang's reserve on an H100 (81559 MiB) as the launch's flags change it: without
    chunked prefill (--chunked-prefill-size -1) the activations of a --max-prefill-tokens
    prefill (16384: 512 + 24576 + 128 + 512, 0.685; 0.5.23's prefill graphs hold no token
    size); 0.5.9 keeps its decode graphs' share with --disable-cuda-graph (0.835) and adds 8
    MiB per piecewise graph token size with --enable-piecewise-cuda-graph (58: 0.830). Before,
    the stub reserved 2048 tokens' activations without chunked prefill (0.874), and for 0.5.9
    dropped the decode share with graphs off (0.841) and had no piecewise share (0.835)."""
    no_chunk = _resolve(stub_module, version, "--chunked-prefill-size", "-1")
    assert no_chunk["mem_fraction_static"] == 0.685
    small = _resolve(
        stub_module, version, "--chunked-prefill-size", "-1", "--max-prefill-tokens", "4096"
    )
    assert small["mem_fraction_static"] == 0.874  # the 10 GiB floor
    if version != "0.5.9":
        return
    assert _resolve(stub_module, version, "--disable-cuda-graph")["mem_fraction_static"] == 0.835
    piecewise = _resolve(stub_module, version, "--enable-piecewise-cuda-graph")
    assert piecewise["mem_fraction_static"] == 0.83


def test_0523_prefill_graphs_hold_no_more_tokens_than_the_kv_pool(stub_module: ModuleType) -> None:
    """0.5.23 caps its prefill CUDA graphs' largest token size (the chunked prefill size unless
    --cuda-graph-max-bs-prefill is given) at a given --max-total-tokens, and at 4096 for a
    Llama 2, before it sizes the static fraction by them: with --max-total-tokens 1024 it
    captures 38 token sizes (a 13744 MiB reserve on an H100: 0.831). Before, the stub reported
    8192 and reserved for 58 sizes (0.830)."""
    capped = _resolve(stub_module, "0.5.23", "--max-total-tokens", "1024")
    assert capped["cuda_graph_config"]["prefill"]["max_bs"] == 1024
    assert capped["mem_fraction_static"] == 0.831
    cfg = stub_module.StubConfig(version="0.5.23")
    llama2, _ = stub_module.parse_launch_argv(["--model-path", "meta-llama/Llama-2-7b-hf"], cfg)
    assert llama2["cuda_graph_config"]["prefill"]["max_bs"] == 4096
    given = _resolve(
        stub_module, "0.5.23", "--max-total-tokens", "1024", "--cuda-graph-max-bs-prefill", "2048"
    )
    assert given["cuda_graph_config"]["prefill"]["max_bs"] == 2048


def test_dflash_defaults_on_0523(stub_module: ModuleType) -> None:
    """DFLASH forces one step, topk 1, and a 16-token block unless told otherwise."""
    args = _resolve(stub_module, "0.5.23", "--speculative-algorithm", "DFLASH")
    assert _triple(args) == (1, 1, 16)
    sized = _resolve(
        stub_module, "0.5.23", "--speculative-algorithm", "DFLASH",
        "--speculative-dflash-block-size", "8",
    )  # fmt: skip
    assert _triple(sized) == (1, 1, 8)


# --------------------------------------------------------------------------- faults


@pytest.mark.slow
def test_flush_cache_is_refused_while_a_request_runs(launch: Launcher) -> None:
    """/flush_cache says 400 during a generate, 200 once it is gone; requests run concurrently."""
    stub = launch("0.5.23", tpot_s=0.02)
    conn, response = stub.open_stream(generate_body(200, ignore_eos=True))  # ~4 s
    try:
        assert read_events(response, limit=1)
        assert stub.request("POST", "/flush_cache")[0] == 400
        assert stub.request("GET", "/flush_cache")[0] == 400
        status, body = stub.json("POST", "/generate", generate_body(3, ignore_eos=True))
        assert status == 200 and body["meta_info"]["completion_tokens"] == 3
        # Not queued behind the running stream: that one is still going after this one ended.
        [event] = read_events(response, limit=1)
        assert json.loads(event)["meta_info"]["finish_reason"] is None
    finally:
        conn.close()  # the stub aborts the request at its next write
    deadline = time.monotonic() + 60.0  # a guard against hanging, not a latency bound
    while stub.request("POST", "/flush_cache")[0] != 200:
        assert time.monotonic() < deadline, stub.log_tail()
        time.sleep(0.02)


@pytest.mark.slow
def test_die_after_requests_kills_the_process(launch: Launcher) -> None:
    """The N-th /generate makes the process vanish (exit 1) without an answer."""
    stub = launch("0.5.23", die_after_requests=2)
    assert stub.request("POST", "/generate", generate_body(2))[0] == 200
    with pytest.raises((http.client.HTTPException, OSError)):
        stub.request("POST", "/generate", generate_body(2))
    assert stub.proc.wait(timeout=60) == 1


@pytest.mark.slow
def test_fail_after_requests_answers_5xx(launch: Launcher) -> None:
    """Requests N, N+1, ... get fail_status with an SGLang-style error body."""
    stub = launch("0.5.9", fail_after_requests=2, fail_status=503)
    assert stub.request("POST", "/generate", generate_body(2))[0] == 200
    for _ in range(2):
        status, body = stub.json("POST", "/generate", generate_body(2))
        assert status == 503 and "message" in body["error"]
    assert stub.request("GET", "/health")[0] == 200


@pytest.mark.slow
def test_malformed_chunk_and_stall(launch: Launcher) -> None:
    """A non-JSON data line at chunk k; a stream that goes quiet and drops unfinished."""
    broken = launch("0.5.23", malformed_chunk_at=1)
    events = broken.stream(generate_body(4, ignore_eos=True))
    json.loads(events[0])
    with pytest.raises(ValueError):
        json.loads(events[1])
    assert events[-1] == "[DONE]"

    stalling = launch("0.5.23", stall_after_chunks=1, stall_s=0.5)
    conn, response = stalling.open_stream(generate_body(4, ignore_eos=True))
    started = time.monotonic()
    try:
        events = read_events(response)
    except http.client.HTTPException:
        events = ["<incomplete>"]
    finally:
        conn.close()
    assert "[DONE]" not in events
    assert time.monotonic() - started >= 0.4  # quiet for stall_s (a lower bound only)


@pytest.mark.slow
def test_natural_stop_ends_early_unless_ignore_eos(launch: Launcher) -> None:
    """natural_stop: seeded early stops with matched EOS; ignore_eos still runs to the end."""
    stub = launch("0.5.9", natural_stop=True, tpot_s=0.0005, seed=7)
    reasons = []
    for _ in range(4):
        _, body = stub.json("POST", "/generate", generate_body(40))
        meta = body["meta_info"]
        assert 1 <= meta["completion_tokens"] <= 40
        reasons.append(meta["finish_reason"])
    assert {"type": "stop", "matched": 2} in reasons
    _, body = stub.json("POST", "/generate", generate_body(40, ignore_eos=True))
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 40}


@pytest.mark.slow
def test_flush_cache_is_accepted_once_the_final_chunk_arrived(launch: Launcher) -> None:
    """A request stops counting as running at its last step, before its final chunk is sent
    (SGLang's scheduler frees it first): a flush sent on reading that chunk is never refused,
    whatever the stub's thread is doing then (it used to be, now and then)."""
    stub = launch("0.5.23", tpot_s=0.0, ttft_s=0.0)
    for _ in range(50):
        conn, response = stub.open_stream(generate_body(3, ignore_eos=True))
        try:
            events = read_events(response, limit=3)  # the last one carries finish_reason
            assert json.loads(events[-1])["meta_info"]["finish_reason"] is not None
            assert stub.request("POST", "/flush_cache")[0] == 200, stub.log_tail()
        finally:
            conn.close()


def _wait_for_log(stub: RunningStub, text: str) -> None:
    deadline = time.monotonic() + 60.0  # a guard against hanging, not a latency bound
    while text not in stub.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, stub.log_tail()
        time.sleep(0.01)


def _abort_held(stub: RunningStub, tokens: int, rid: str) -> dict:
    """Stream a request of `tokens` tokens as `rid`, wait until the stub holds it before its
    last step, abort it by /abort_request, and return its final meta_info."""
    conn, response = stub.open_stream({**generate_body(tokens, ignore_eos=True), "rid": rid})
    try:
        _wait_for_log(stub, f"holding rid={rid} before its last step")
        assert stub.request("POST", "/abort_request", {"rid": rid})[0] == 200
        return final_meta(read_events(response))
    finally:
        conn.close()


@pytest.mark.slow
def test_hold_unfinished_keeps_requests_before_their_last_step_until_aborted(
    launch: Launcher,
) -> None:
    """hold_unfinished: after a finish, other requests wait before their last step until
    /abort_request (or a disconnect) stops them, however slow the machine; a flush ends
    the hold (dvfs flushes at each round's start)."""
    stub = launch("0.5.23", hold_unfinished=True)
    first = stub.stream(generate_body(4, ignore_eos=True))
    assert final_meta(first)["finish_reason"] == {"type": "length", "length": 4}
    meta = _abort_held(stub, 6, "held")
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 5
    conn, response = stub.open_stream({**generate_body(6, ignore_eos=True), "rid": "gone"})
    try:
        _wait_for_log(stub, "holding rid=gone before its last step")
    finally:
        conn.close()
    _wait_for_log(stub, "client went away during POST /generate")
    assert stub.request("POST", "/flush_cache")[0] == 200  # nothing is left running
    again = stub.stream(generate_body(4, ignore_eos=True))
    assert final_meta(again)["finish_reason"] == {"type": "length", "length": 4}


@pytest.mark.slow
def test_hold_after_requests_starts_the_hold_once_that_many_arrived(launch: Launcher) -> None:
    """hold_after_requests = 2: the first request finishes unheld and arms nothing; the
    second arrival's finish starts the hold; the third request is held until aborted."""
    stub = launch("0.5.9", hold_unfinished=True, hold_after_requests=2)
    for _ in range(2):
        done = stub.stream(generate_body(3, ignore_eos=True))
        assert final_meta(done)["finish_reason"] == {"type": "length", "length": 3}
    meta = _abort_held(stub, 3, "third")
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 2
    assert stub.log_path.read_text().count("holding rid=") == 1


@pytest.mark.slow
def test_a_client_resetting_an_idle_connection_is_one_log_line(launch: Launcher) -> None:
    """A client that resets an idle keep-alive connection (seen from dvfs's pooled client under
    load) is one line in the stub's log, not a traceback in the server log dvfs shows."""
    stub = launch("0.5.23")
    conn = stub.connect()
    # A route with a body: the client has it all only once the stub's last write returned,
    # so the reset finds the stub idle, waiting for the next request (an empty body's
    # write can still be under way, and meet the reset inside the route).
    conn.request("GET", "/server_info")
    assert json.loads(conn.getresponse().read())
    assert conn.sock is not None
    # SO_LINGER on, 0 s: close() sends RST, so the stub's next read of the idle connection
    # fails with ConnectionResetError.
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()
    _wait_for_log(stub, "closed the connection (ConnectionResetError)")
    assert stub.request("GET", "/health")[0] == 200  # the server goes on
    assert "Traceback" not in stub.log_path.read_text(errors="replace")


def test_an_abort_stops_every_request_whose_rid_starts_with_it(stub_module: ModuleType) -> None:
    """As SGLang's scheduler (``req.rid.startswith(recv_req.rid)``): aborting "t-1" stops
    "t-1" and "t-10" that had arrived, not "t-2", nor a "t-11" arriving afterwards; a rid
    not arrived yet is still aborted when it comes."""
    cfg = stub_module.StubConfig(version="0.5.23")
    args, _ = stub_module.parse_launch_argv(["--model-path", "m"], cfg)
    stub = stub_module.Stub(cfg, args, None)

    def plan(rid: str) -> tuple[Any, Any]:
        sub = stub_module.SubRequest(0, rid, [1], 4, {}, [1, 1], [5, 6], 1)
        return stub_module.Plan(0, True, False, [sub], time.monotonic(), time.time()), sub

    running = {rid: plan(rid) for rid in ("t-1", "t-10", "t-2")}
    stub.request_abort("t-1", False)
    stub.request_abort("t-3", False)
    due = {rid: stub._abort_due(p, sub) for rid, (p, sub) in running.items()}
    assert due == {"t-1": True, "t-10": True, "t-2": False}
    time.sleep(0.002)  # (monotonic time moves on)
    assert not stub._abort_due(*plan("t-11"))
    assert stub._abort_due(*plan("t-3"))


@pytest.mark.slow
def test_a_torch_load_runs_while_requests_run(launch: Launcher) -> None:
    """``torch_load_device`` (tests/bench/real_gpu_check.sh puts it on a real GPU): its
    matrix-vector products run while a request decodes."""
    pytest.importorskip("torch")
    stub = launch("0.5.23", torch_load_device="cpu", torch_load_mib=2.0, tpot_s=0.01)
    assert stub.request("POST", "/generate", generate_body(20))[0] == 200
    stub.proc.send_signal(signal.SIGTERM)
    assert stub.proc.wait(timeout=30) == 0
    log_text = stub.log_path.read_text()
    assert "torch load: 128x4096 torch.float32 on cpu" in log_text
    launches = int(log_text.split("torch load: ")[2].split(" matrix-vector")[0])
    assert launches > 0


def _stub_on_a_fake_clock(
    stub_module: ModuleType, monkeypatch: pytest.MonkeyPatch, tpot: float
) -> tuple[Any, list[float]]:
    """A stub (no prefill time, `tpot` a step) whose clock is the list it returns: its waits
    move that clock on by what they wait, and a test moves it on to play a starved process."""
    cfg = stub_module.StubConfig(version="0.5.23", ttft_s=0.0, tpot_s=tpot)
    args, spec = stub_module.parse_launch_argv(["--model-path", "m"], cfg)
    stub = stub_module.Stub(cfg, args, spec)
    now = [1000.0]

    class FakeTime:
        @staticmethod
        def monotonic() -> float:
            return now[0]

        @staticmethod
        def time() -> float:
            return now[0]

    def wait(timeout: float | None = None) -> bool:  # the stop event's wait: time passes
        now[0] += timeout or 0.0
        return False

    monkeypatch.setattr(stub_module, "time", FakeTime)
    monkeypatch.setattr(stub.stop, "wait", wait)
    return stub, now


def test_a_step_emitted_late_delays_the_later_ones_rather_than_bunching_them(
    stub_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process, on a fake clock: the server falls 0.5 s behind after its third step (a
    loaded machine starving it). The steps after it keep tpot_s apart, as a server that fell
    behind still takes each step's time; caught up in a burst, they came out together, and a
    request's measured TPOT fell below the stub's (a test bounding it from below then failed
    on a loaded machine)."""
    tpot = 0.01
    stub, now = _stub_on_a_fake_clock(stub_module, monkeypatch, tpot)
    body = {"text": "a b c", "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
    plan = stub.plan(body, 1)
    emitted = []
    for _sub, j in stub.run(plan):
        emitted.append(now[0])
        if j == 2:
            now[0] += 0.5  # starved
    assert len(emitted) == 12
    gaps = [b - a for a, b in zip(emitted, emitted[1:], strict=False)]
    assert min(gaps) >= tpot - 1e-9, gaps
    assert emitted[-1] - emitted[0] >= 10 * tpot + 0.5 - 1e-9  # steps 0-2, starved, 3-11


def test_the_moments_spent_emitting_a_batchs_steps_do_not_stretch_its_schedule(
    stub_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process, on a fake clock: two requests decoded together, each emission taking 0.1 ms.
    The step due beside another is that much late every time; taken for lateness, it moved
    every later step back, and the batch drifted off its tpot_s schedule step by step."""
    tpot = 0.01
    stub, now = _stub_on_a_fake_clock(stub_module, monkeypatch, tpot)
    body = {"text": ["a b", "c d"], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    plan = stub.plan(body, 1)
    last = 0.0
    for _sub, _j in stub.run(plan):
        last = now[0]
        now[0] += 0.0001  # emitting the step
    assert last - 1000.0 <= 39 * tpot + 2 * 0.0001 + 1e-9


LAUNCHER_PATH = STUB_PATH.parent / "sglang_stub_main.py"


@pytest.mark.parametrize(
    ("argv", "config"),
    [
        (["--help"], {}),
        (["--model-path", "m", "--port", "1", "--no-such-flag"], {}),  # argparse: exit 2
        (["--model-path", "m", "--host", "0.0.0.0"], {}),  # the stub refuses it: exit 1
        (["--model-path", "m"], {"no_such_key": 1}),  # the stub's own config: exit 3
    ],
)
def test_the_launcher_the_suite_starts_runs_the_stub_as_its_script_does(
    tmp_path: Path, argv: list[str], config: dict[str, Any]
) -> None:
    """The suite starts the stub as `python sglang_stub_main.py` (the stub imported, so read
    from its cached bytecode, not compiled again at every start): it answers each argv as
    `python sglang_stub.py` does, word for word and exit code alike."""
    env = stub_env(write_config(tmp_path, max_lifetime_s=2, **config))

    def run(path: Path) -> tuple[int, str, str]:
        done = subprocess.run(
            [sys.executable, str(path), *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
        # each log line's [hh:mm:ss] stamp is the second it was written: two runs straddling
        # a second's turn differ there only
        return (
            done.returncode,
            done.stdout,
            re.sub(r"^\[\d\d:\d\d:\d\d\] ", "", done.stderr, flags=re.M),
        )

    script = run(STUB_PATH)
    assert script[0] != 0 or argv == ["--help"], script
    assert run(LAUNCHER_PATH) == script
