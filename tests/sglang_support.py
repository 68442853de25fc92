"""Helpers for tests that run dvfs's real SGLang engine against the stub server on loopback."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: The stub server's source, which tests/test_sglang_stub.py starts as a script.
STUB_SOURCE = REPO / "tests" / "fakes" / "sglang_stub.py"
#: The stub server as the tests start it: `python STUB ARGV` runs STUB_SOURCE alike, from its
#: cached bytecode (a script run by path is compiled again at every start).
STUB = REPO / "tests" / "fakes" / "sglang_stub_main.py"


def load_stub() -> ModuleType:
    """The stub module (for its argv parser), imported from its file."""
    spec = importlib.util.spec_from_file_location("sglang_stub", STUB_SOURCE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_stub"] = module
    spec.loader.exec_module(module)
    return module


#: The stub's EAGLE-3 drafter, as a campaign's table.
EAGLE3_DRAFTER = """
[drafters.eagle3]
algorithm = "EAGLE3"
draft_model = "draft/eagle3"
num_steps = 3
eagle_topk = 1
num_draft_tokens = 4
"""


def stub_campaign(
    tmp: Path,
    *,
    version: str = "0.5.23",
    stub: dict | None = None,
    drafters: str | None = None,
    batch: str = "[1, 4]",
    knobs: str | None = None,
    workload_extra: str = "",
    measurement_extra: str = "",
    sglang_extra: str = "",
    output_tokens: int = 32,
    warmup_tokens: int = 4,
    stall_timeout_s: float = 10.0,
    request_timeout_s: float = 30.0,
    startup_timeout_s: float = 30.0,
    retries: int = 1,
    gpu: str = 'backend = "twin"\nprofile = "h100-sxm"',
    wrapper: tuple[str, ...] = (),
    idle_per_setting: bool = False,
) -> tuple[Path, str]:
    """A campaign whose engine is the stub (launched by dvfs as its "server command", behind
    `wrapper`, say `env NAME=VALUE`, when given).

    Returns the campaign path and a marker unique to this campaign's server processes.
    """
    marker = f"stub-model-{uuid.uuid4().hex[:12]}"
    config = tmp / "stub.json"
    # Quick steps and starts unless a test times them: every stub campaign runs in real time.
    fast = {"startup_s": 0.02, "ttft_s": 0.01, "tpot_s": 0.002}
    config.write_text(
        json.dumps({"version": version, "max_lifetime_s": 120, **fast, **(stub or {})})
    )
    drafters = drafters or '\n[drafters.none]\nalgorithm = "none"\n' + EAGLE3_DRAFTER
    knobs = knobs or "sm_clock = [1980, 1500]\nsettle_s = 0.0"
    text = f"""
[campaign]
name = "stub"

[gpu]
{gpu}

[knobs]
{knobs}

[engine]
backend = "sglang"
model = "{marker}"

[engine.sglang]
server_command = {json.dumps([*wrapper, sys.executable, str(STUB)])}
startup_timeout_s = {startup_timeout_s}
request_timeout_s = {request_timeout_s}
stall_timeout_s = {stall_timeout_s}
env = {{ SGLANG_STUB_CONFIG = {json.dumps(str(config))} }}
{sglang_extra}
{drafters}

[workload]
batch = {batch}
corpora = ["code"]
input_tokens = [16, 2048]
output_tokens = {output_tokens}
{workload_extra}

[measurement]
warmup_tokens = {warmup_tokens}
min_window_s = 0.05
max_rounds = 1
sample_period_s = 0.01
idle_s = 0.0
retries = {retries}
# real time: the protocol's minute-long steps off (tests/test_protocol.py covers them)
thermal_max_s = 0
settle = 0
idle_per_setting = {str(idle_per_setting).lower()}
{measurement_extra}
"""
    path = tmp / "stub-campaign.toml"
    path.write_text(text)
    return path, marker


def running(marker: str) -> list[str]:
    """Command lines of live processes carrying `marker` (servers dvfs may have left behind)."""
    result = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True)
    return [line for line in result.stdout.splitlines() if "pgrep" not in line]


def free_port() -> int:
    """A loopback port free now (for a stub a campaign attaches to by engine.sglang.url)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def attached_stub(
    tmp: Path, model: str, port: int, *argv: str, **config: object
) -> subprocess.Popen[bytes]:
    """The stub started by hand on `port` serving `model` (its launch flags `argv`, its config
    `config`), as a server a campaign attaches to; the caller stops it."""
    path = tmp / "attach.json"
    path.write_text(json.dumps({"version": "0.5.23", "max_lifetime_s": 60, **config}))
    return subprocess.Popen(
        [sys.executable, str(STUB), "--model-path", model, "--port", str(port), *argv],
        env={**os.environ, "SGLANG_STUB_CONFIG": str(path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@contextlib.contextmanager
def patchable_stub(tmp: Path, **config: object) -> Iterator[Any]:
    """A client of one stub (0.5.23, no speculation, instant tokens, its other `config`)
    whose answers a test patches (`patch_stub`): one server for a whole table of hostile
    answers."""
    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang_client import SglangClient

    port = free_port()
    stub = attached_stub(
        tmp,
        "Qwen/Qwen2.5-7B-Instruct",
        port,
        patch_route=True,
        startup_s=0.0,
        ttft_s=0.0,
        tpot_s=0.0,
        max_lifetime_s=300,
        **config,
    )
    try:
        client = SglangClient(f"http://127.0.0.1:{port}", clock=MonotonicClock())
        client.wait_healthy(120.0, alive=lambda: stub.poll() is None)
        yield client
    finally:
        stub.kill()
        stub.wait()


def patch_stub(client: Any, **patches: Any) -> None:
    """Set what the stub behind `client` answers from now on (its `patch_route`); JSON as
    Python writes it: NaN and Infinity as a broken server might."""
    import httpx

    answer = httpx.post(
        client.base_url + "/_stub/patch",
        content=json.dumps(patches),
        headers={"Content-Type": "application/json"},
        trust_env=False,
        timeout=30.0,
    )
    assert answer.status_code == 200


def one_line_refusal(exc: Exception) -> str:
    """`exc`'s message, checked to be one line and no traceback."""
    message = str(exc)
    assert message and "\n" not in message and "Traceback" not in message, message
    return message
