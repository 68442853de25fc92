"""The real SGLang engine against the stub server (a separate process on 127.0.0.1)."""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner, Result
from sglang_support import STUB, attached_stub, free_port, load_stub, running, stub_campaign

import dvfs
from dvfs.campaign import load_campaign
from dvfs.cli import cli
from dvfs.engines.sglang_args import (
    NEW_CUDA_GRAPH_FLAG,
    OLD_CUDA_GRAPH_FLAG,
    cuda_graph_flag,
    launch_argv,
    probe_help,
)
from dvfs.errors import EngineError

REPO = Path(__file__).resolve().parent.parent
VERSIONS = ("0.5.9", "0.5.23")


# -- launch argv ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_real_campaign_argv_parses_like_sglang(version: str) -> None:
    """Every drafter's argv of the real-hardware campaign, through SGLang's own option table."""
    stub = load_stub()
    campaign = load_campaign(REPO / "sweeps" / "h100-llama8b.toml")
    config = stub.StubConfig(version=version)
    largest = max(campaign.workload.batch_sizes)
    checked = 0
    for drafter in campaign.drafters:
        if version == "0.5.9" and drafter.algorithm == "DFLASH":
            with pytest.raises(EngineError, match="need SGLang 0.5.23 or newer"):
                launch_argv(campaign, drafter, port=31000, version=version)
            continue
        argv = launch_argv(campaign, drafter, port=31000, version=version)
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        args, spec = stub.parse_launch_argv(argv[3:], config)  # exits on any rejected flag
        assert args["max_running_requests"] == largest  # not SGLang's silent 48
        graph = "cuda_graph_max_bs" if version == "0.5.9" else "cuda_graph_max_bs_decode"
        assert args[graph] == largest
        assert args["enable_metrics"] is True
        assert args["model_path"] == "meta-llama/Llama-3.1-8B-Instruct"
        if drafter.algorithm is None:
            assert spec is None
        else:
            assert args["speculative_algorithm"] == drafter.algorithm
            assert args["speculative_num_draft_tokens"] == drafter.num_draft_tokens
            if drafter.algorithm in ("EAGLE3", "STANDALONE"):
                assert (args["speculative_num_steps"], args["speculative_eagle_topk"]) == (
                    drafter.num_steps,
                    drafter.eagle_topk,
                )
        checked += 1
    assert checked == (4 if version == "0.5.9" else 5)


@pytest.mark.parametrize("version", VERSIONS)
def test_cuda_graph_flag_comes_from_launch_server_help(version: str, tmp_path: Path) -> None:
    config = tmp_path / "stub.json"
    config.write_text(json.dumps({"version": version}))
    import os

    env = {**os.environ, "SGLANG_STUB_CONFIG": str(config)}
    result = subprocess.run(
        [sys.executable, str(STUB), "--help"], capture_output=True, text=True, timeout=60, env=env
    )
    help_text = result.stdout
    expected = OLD_CUDA_GRAPH_FLAG if version == "0.5.9" else NEW_CUDA_GRAPH_FLAG
    assert cuda_graph_flag(help_text, None) == expected
    # The old flag on 0.5.23 is an ambiguous prefix: argparse refuses it (the reason we look).
    stub = load_stub()
    if version == "0.5.23":
        with pytest.raises(SystemExit):
            stub.parse_launch_argv(
                ["--model-path", "m", OLD_CUDA_GRAPH_FLAG, "8"], stub.StubConfig(version=version)
            )
    assert probe_help(["/nonexistent/python"]) is None


def test_help_that_is_not_utf8_is_read_with_the_bytes_replaced() -> None:
    """A server command (or its wrapper) that prints bytes that are not UTF-8 beside the
    options, such as a message in another locale's encoding, stopped the probe with a
    UnicodeDecodeError; the options are read, the odd bytes replaced."""
    printer = "import sys; sys.stdout.buffer.write(b'\\xe9t\\xe9 --model-path MODEL\\n')"
    text = probe_help([sys.executable, "-c", printer])
    assert text is not None and "--model-path MODEL" in text and "\ufffd" in text


def test_launch_help_is_probed_once_per_process_for_one_sglang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each SglangEngine built ran `launch_server --help` (SGLang's slow import) again: a
    local fleet's workers, one engine each in one process, imported SGLang once each. Read
    once for this Python's own sglang and the server's environment but its GPUs; again where
    sglang changed, or could not run; every time for a wrapper (whose sglang is not told)."""
    from collections.abc import Sequence

    import dvfs.engines.sglang_args as sglang_args
    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang import SglangEngine

    probed: list[tuple[list[str], str | None]] = []
    answers: list[str | None] = []

    def probe(command: Sequence[str], timeout_s: float = 0.0, env: Any = None) -> str | None:
        probed.append((list(command), (env or {}).get("CUDA_VISIBLE_DEVICES")))
        return answers.pop(0) if answers else "--model-path MODEL"

    identity: list[object] = ["/site/sglang/__init__.py", 1, 1, "0.5.23", "/here"]
    monkeypatch.setattr(sglang_args, "probe_help", probe)
    # (raising=False: a dvfs without the cache fails by its count, not by these)
    monkeypatch.setattr(sglang_args, "sglang_identity", lambda: tuple(identity), raising=False)
    monkeypatch.setattr(sglang_args, "_HELP_CACHE", {}, raising=False)
    path, _ = stub_campaign(tmp_path, batch="[1, 2]", knobs="sm_clock = [1980]")
    text = path.read_text()
    start = text.index("server_command")
    path.write_text(text[:start] + text[text.index("\n", start) + 1 :])  # the default command
    campaign = load_campaign(path)

    def build(*uuids: str) -> str | None:
        engine = SglangEngine(
            campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs", gpu_uuids=uuids
        )
        return engine.launch_help()

    assert build() == build() == "--model-path MODEL"
    assert len(probed) == 1
    assert probed[0][0] == [sys.executable, "-m", "sglang.launch_server"]
    assert build("GPU-a") == build("GPU-b") == "--model-path MODEL"  # other GPUs: the same
    assert len(probed) == 1
    identity[2] = 2  # sglang reinstalled in place
    build()
    assert len(probed) == 2
    identity[2] = 3
    answers.append(None)  # could not run: not kept
    assert build() is None and build() == "--model-path MODEL"
    assert len(probed) == 4
    # A wrapper's (or another Python's) sglang is not this one's: probed at each build.
    for _ in range(2):
        assert sglang_args.cached_help(["env", "A=1", sys.executable, "-m", "x"]) is not None
    assert len(probed) == 6


def test_dry_run_shows_each_drafter_argv() -> None:
    result = CliRunner().invoke(
        cli,
        [
            "sweep",
            str(REPO / "sweeps" / "h100-llama8b.toml"),
            "--dry-run",
            "--json",
            "--no-estimate",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    argvs = {s["drafter"]: s["argv"] for s in plan["servers"]}
    assert set(argvs) == {"none", "eagle3", "standalone", "ngram", "dflash"}
    assert "--speculative-algorithm" not in argvs["none"]
    eagle = argvs["eagle3"]
    assert eagle[eagle.index("--speculative-draft-model-path") + 1] == (
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    )
    assert "--speculative-num-steps" not in argvs["ngram"]
    assert plan["servers"][0]["flags_from"]


# -- sweeps against the stub --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_sweep_measures_what_the_stub_produces(version: str, tmp_path: Path) -> None:
    stub = {"ttft_s": 0.02, "tpot_s": 0.003, "accept_length": 2.5, "seed": 1}
    # One clock and one batch (four requests, for the averages): the stub's timing depends on
    # neither, and every cell streams in real time. Batch 1 runs in the fault tests below.
    campaign, marker = stub_campaign(
        tmp_path,
        version=version,
        stub=stub,
        batch="[4]",
        output_tokens=80,
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    ds = dvfs.open_cube(str(out / "cube.nc"))
    assert (ds["cell_status"] == 1).all()
    tpot = ds["tpot_ms"].sel(quantile=0.5)
    ttft = ds["ttft_ms"].sel(quantile=0.5)
    # No speculation: one token per 3 ms step. EAGLE-3: 2.5 tokens per step, so 3 / 2.5 ms.
    # Bounded from below only, at half a step: the stub never emits two steps closer than
    # tpot_s (a late one delays the rest), but a loaded client may read the first chunk late.
    assert np.all(tpot.sel(drafter="none") >= 0.5 * 3.0)
    assert np.all(tpot.sel(drafter="eagle3") >= 0.5 * 3.0 / 2.5)
    # Bounded from below only: the stub waits ttft_s = 20 ms before the first token, and a
    # loaded machine can only add to that.
    assert np.all(ttft >= 20)
    accept = ds["accept_length"]
    assert np.isnan(accept.sel(drafter="none")).all()
    # The stub emits 2 or 3 tokens per step at random (mean 2.5) over ~32 steps per request;
    # completion / verify passes also counts the prefill token (+1/32).
    assert np.allclose(accept.sel(drafter="eagle3"), 2.5, atol=0.25)
    # Both versions' flush resets the server's average, which then adds whole blocks of 40
    # decode iterations only: rounds of ~32 iterations leave it unset (on a loaded machine the
    # four requests may arrive far enough apart for one block: then it is the stub's mean).
    server = ds["server_accept_length"].sel(drafter="eagle3").values
    assert np.all(np.isnan(server) | np.isclose(server, 2.5, atol=0.3)), server
    assert not (ds["quality"].sel(drafter="eagle3").astype(int) & 32).any()  # no mismatch
    assert np.allclose(ds["accept_rate"].sel(drafter="eagle3"), 1.5 / 3, atol=0.1)
    servers = json.loads(ds.attrs["server_args"])
    assert servers["eagle3"]["version"] == version
    assert servers["eagle3"]["args"]["speculative_num_draft_tokens"] == 4
    logs = sorted(p.name for p in (out / "logs").glob("*.log"))
    assert logs == ["server-eagle3-2.log", "server-none-1.log"]
    assert "Uvicorn running" in (out / "logs" / "server-none-1.log").read_text()
    assert running(marker) == []  # every server was stopped


def test_the_server_accept_length_counts_blocks_of_the_servers_log_interval(
    tmp_path: Path,
) -> None:
    """A server started with --decode-log-interval 8 (engine.sglang.extra_args) has its
    figure after 8 iterations: the ~32-iteration rounds get one, near the stub's 2.5; it
    leaves up to 7 of them out, too many for the cross-check, which does not flag."""
    stub = {"accept_length": 2.5, "seed": 1}
    _, ds = _sweep_cells(
        tmp_path,
        stub=stub,
        batch="[4]",
        output_tokens=80,
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        sglang_extra='extra_args = ["--decode-log-interval", "8"]',
    )
    server = ds["server_accept_length"].sel(drafter="eagle3")
    assert np.allclose(server, 2.5, atol=0.25)
    assert np.isnan(ds["server_accept_length"].sel(drafter="none")).all()
    assert not (ds["quality"].sel(drafter="eagle3").astype(int) & 32).any()


def _sweep_cells(tmp_path: Path, **kwargs) -> tuple[list[dict], xr.Dataset]:
    cells, ds, _ = _sweep(tmp_path, **kwargs)
    return cells, ds


def _sweep(tmp_path: Path, **kwargs) -> tuple[list[dict], xr.Dataset, str]:
    """The sweep's journaled cells, its cube, and what it wrote on the terminal (as one line:
    the terminal wraps it)."""
    campaign, marker = stub_campaign(tmp_path, **kwargs)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"], catch_exceptions=False
    )
    cells = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    cells = [c for c in cells if c["type"] == "cell"]
    failed = any(c["status"] != "ok" for c in cells)
    # `dvfs sweep` exits 5 when cells failed (the cube is still written), else 0.
    assert result.exit_code in ((0, 5) if failed else (0,)), result.output
    assert running(marker) == []
    return cells, dvfs.open_cube(str(out / "cube.nc")), " ".join(result.output.split())


ONE_DRAFTER = '\n[drafters.none]\nalgorithm = "none"\n'


def _dying_server_sweep(tmp_path: Path, retries: int) -> tuple[list[dict], xr.Dataset]:
    """Three cells of two requests each; every server dies on its third request."""
    return _sweep_cells(
        tmp_path,
        stub={"die_after_requests": 3},
        drafters=ONE_DRAFTER,
        batch="[2]",
        knobs="sm_clock = [1980, 1500, 1005]\nsettle_s = 0.0",
        warmup_tokens=0,
        retries=retries,
    )


@pytest.mark.slow
def test_a_server_that_dies_mid_cell_is_restarted_and_the_cell_retried(tmp_path: Path) -> None:
    # Each server survives one cell's two requests and dies on the next one.
    cells, ds = _dying_server_sweep(tmp_path, retries=1)
    assert all(c["status"] == "ok" for c in cells)
    retried = [c for c in cells if c["attempts"] == 2]
    assert retried, "some cell must have met a dead server"
    assert any("died" in e for c in retried for e in c["errors"])
    assert (ds["cell_status"] == 1).all()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["environment", "wrapper", "health without the scheduler"])
def test_a_server_that_stops_answering_is_restarted_and_the_cell_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A wedged server (alive, answering nothing, /health included) is stopped and a fresh one
    started, as for a dead one: kept, it failed every later cell of the campaign on a flush
    that timed out. Each server hangs at its third request, so only the third cell meets it.
    /health is given the servers' own health-check timeout (1 s here, in dvfs's environment or
    set by a server_command wrapper, `env SGLANG_HEALTH_CHECK_TIMEOUT=1 python ...`) and a
    margin (HUNG_MARGIN_S, 0.5 s here: the wedged server never answers, so the probe waits it
    all out, 1.5 s). The stall timeout leaves a loaded machine's pauses (150 ms seen) to a healthy
    stream: one taken for a stall would retry a cell the hang did not reach. With
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION false, SGLang's /health answers 200 at once from
    its HTTP server, its scheduler unasked, wedged or not (0.5.9 and 0.5.23): dvfs asks
    /health_generate, which always runs its one-token generate, so the wedged server is still
    stopped, not kept to fail every later cell."""
    monkeypatch.setattr("dvfs.engines.sglang_client.HUNG_MARGIN_S", 0.5)
    wrapper: tuple[str, ...] = ()
    if where == "wrapper":
        wrapper = ("env", "SGLANG_HEALTH_CHECK_TIMEOUT=1")
    else:
        monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    if where == "health without the scheduler":
        monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    cells, ds, output = _sweep(
        tmp_path,
        wrapper=wrapper,
        stub={"hang_after_requests": 3},
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs="sm_clock = [1980, 1500, 1005]\nsettle_s = 0.0",
        warmup_tokens=0,
        stall_timeout_s=2.0,
    )
    assert [c["status"] for c in cells] == ["ok"] * 3
    [retried] = [c for c in cells if c["attempts"] == 2]
    [error] = retried["errors"]
    assert "the SGLang server stopped answering" in error
    assert "no answer from /health_generate within 1.5 s" in error and "dvfs stopped it" in error
    assert (ds["cell_status"] == 1).all()
    # The terminal says so too: not a crash, a server stopped and restarted to retry the cell.
    assert "server stopped answering during" in output and "restarts it to retry" in output
    assert "crashed" not in output


@pytest.mark.slow
def test_a_server_that_keeps_dying_fails_its_cells_and_the_campaign_goes_on(tmp_path: Path) -> None:
    cells, ds = _sweep_cells(
        tmp_path, stub={"die_after_requests": 1}, drafters=ONE_DRAFTER, batch="[1]"
    )
    assert {c["status"] for c in cells} == {"failed"}
    assert len(cells) == 2  # both clocks were attempted
    assert all(c["attempts"] == 2 for c in cells)  # first try + one retry (retries = 1)
    assert "died" in cells[0]["error"]
    assert (ds["cell_status"] == 2).all() and np.isnan(ds["tpot_ms"]).all()
    assert "died" in ds.attrs["failed_cells"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stub", "message", "stall_timeout_s"),
    [
        # These fail without a pause: a stall timeout a loaded machine's pause cannot reach.
        ({"fail_after_requests": 1, "fail_status": 503}, "HTTP 503", 5.0),
        ({"malformed_chunk_at": 2}, "malformed stream chunk", 5.0),
        # Every request stalls here (3x the timeout), so a short timeout cannot change the
        # outcome; the stalled request holds the server (its flush is refused) until it ends.
        ({"stall_after_chunks": 2, "stall_s": 0.6}, "stream stalled", 0.2),
    ],
)
def test_protocol_faults_are_journaled_per_cell(
    stub: dict, message: str, stall_timeout_s: float, tmp_path: Path
) -> None:
    cells, _ = _sweep_cells(
        tmp_path,
        stub=stub,
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        stall_timeout_s=stall_timeout_s,
    )
    assert cells and all(c["status"] == "failed" for c in cells)
    assert message in cells[0]["error"]


@pytest.mark.slow
def test_a_5xx_from_a_server_whose_health_check_takes_seconds_is_not_restarted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's /health runs a one-token generate and answers once the scheduler outputs
    anything: never under 1 s, and up to its 20 s health-check timeout on a busy server. A
    round failed on such a server (here a 5xx, its /health answering 200 after 1.5 s) is failed
    on that server, not taken for a hung one that is stopped and started again (dvfs gave
    /health HEALTH_PROBE_S, 5 s, 0.5 s here: each such failure cost a server restart, a model
    load on a real GPU)."""
    monkeypatch.setattr("dvfs.engines.sglang_client.HEALTH_PROBE_S", 0.5)
    cells, _ = _sweep_cells(
        tmp_path,
        stub={"fail_after_requests": 1, "busy_health_s": 1.5},
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        warmup_tokens=0,
        stall_timeout_s=5.0,  # the 500 comes at once: no pause may read as a stall
        retries=0,
    )
    [cell] = cells
    assert cell["status"] == "failed"
    assert "/generate answered HTTP 500" in cell["error"]
    assert "stopped answering" not in cell["error"]
    assert [p.name for p in (tmp_path / "out" / "logs").glob("server-*.log")] == [
        "server-none-1.log"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fixed", "closed-loop"])
def test_a_request_failing_beside_others_fails_its_cell_in_one_line(
    mode: str, tmp_path: Path
) -> None:
    """One request of a batch answered 500 while the others stream: the cell fails with that
    error, and the others are ended with it, not left to break as the client closes (asyncio
    printed each one's traceback as it shut down)."""
    campaign, marker = stub_campaign(
        tmp_path,
        stub={"fail_after_requests": 2, "tpot_s": 0.004},
        drafters=ONE_DRAFTER,
        batch="[4]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        output_tokens=96,
        retries=0,
        workload_extra=f'mode = "{mode}"',
    )
    done = subprocess.run(
        [sys.executable, "-m", "dvfs", "sweep", str(campaign), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 5, said
    assert "failed: /generate answered HTTP 500" in " ".join(said.split()), said
    assert "Traceback" not in said and "unhandled exception" not in said, said
    assert running(marker) == []


@pytest.mark.slow
def test_a_server_that_cannot_start_shows_its_log(tmp_path: Path) -> None:
    cells, _ = _sweep_cells(
        tmp_path,
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        # A flag this release knows, with a value it rejects: a flag it does not know is
        # refused before any server starts (test_sglang_correctness).
        sglang_extra='extra_args = ["--mem-fraction-static", "lots"]',
    )
    assert cells[0]["status"] == "failed"
    assert "failed to start" in cells[0]["error"]
    assert "--mem-fraction-static: invalid float value: 'lots'" in cells[0]["error"]


@pytest.mark.slow
def test_a_server_slower_to_start_than_its_timeout_says_which_setting_gives_it_longer(
    tmp_path: Path,
) -> None:
    """A server still loading (its port not open yet) when startup_timeout_s runs out: its
    cells fail naming the setting to raise, and the slow server is not left running."""
    cells, _ = _sweep_cells(
        tmp_path,
        stub={"listen_delay_s": 5.0},
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        startup_timeout_s=0.3,
    )
    [cell] = cells
    assert cell["status"] == "failed"
    first = cell["error"].splitlines()[0]
    assert "was not ready within 0.3 s (nothing listening)" in first
    assert "engine.sglang.startup_timeout_s" in first


@pytest.mark.slow
def test_closed_loop_mode(tmp_path: Path) -> None:
    cells, ds = _sweep_cells(
        tmp_path,
        stub={"natural_stop": True, "tpot_s": 0.004, "seed": 3},
        drafters=ONE_DRAFTER,
        batch="[2]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        workload_extra='mode = "closed-loop"\npool_size = 8',
        output_tokens=48,
    )
    [cell] = cells
    assert cell["status"] == "ok", cell
    measurement = cell["measurement"]
    assert measurement["requests"] == 8 and measurement["output_tokens"] > 0
    # TPOT is measured from the client's chunk times: a loaded client that reads a request's
    # first chunk late shortens it, so neither a lower nor an upper bound here is load-free.
    tpot = measurement["tpot_ms"]
    assert all(math.isfinite(q) and q > 0 for q in tpot) and list(tpot) == sorted(tpot), tpot


@pytest.mark.slow
def test_attach_to_a_running_server(tmp_path: Path) -> None:
    port = free_port()
    drafters = '\n[drafters.ngram]\nalgorithm = "NGRAM"\n'
    campaign, model = stub_campaign(
        tmp_path,
        drafters=drafters,
        batch="[2]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        sglang_extra=f'url = "http://127.0.0.1:{port}"',
    )
    # engine.model is the model dvfs measures
    server = attached_stub(tmp_path, model, port, "--speculative-algorithm", "NGRAM", tpot_s=0.004)
    try:
        out = tmp_path / "out"
        result = CliRunner().invoke(
            cli,
            ["sweep", str(campaign), "--out", str(out), "--no-progress"],
            catch_exceptions=False,
        )
        assert result.exit_code == 0, result.output
        ds = dvfs.open_cube(str(out / "cube.nc"))
        assert (ds["cell_status"] == 1).all()
        assert json.loads(ds.attrs["server_args"])["ngram"]["args"]["speculative_algorithm"] == (
            "NGRAM"
        )
        assert server.poll() is None  # an attached server is left running
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.slow
def test_no_orphan_server_when_dvfs_is_killed(tmp_path: Path) -> None:
    from conftest import subprocess_env

    campaign, marker = stub_campaign(
        tmp_path, stub={"tpot_s": 0.05}, drafters=ONE_DRAFTER, batch="[1]", output_tokens=400
    )
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvfs", "sweep", str(campaign), "--out", str(out), "--no-progress"],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not running(marker):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 60  # a guard against hanging, not a latency bound
        while running(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert running(marker) == [], "the server outlived a SIGKILLed dvfs"
    finally:
        if proc.poll() is None:
            proc.kill()
        for line in running(marker):
            subprocess.run(["kill", "-9", line.split()[0]], check=False)


def test_acceptance_is_nan_without_speculation_not_one_or_zero(tmp_path: Path) -> None:
    from dvfs.measure.meter import acceptance

    assert math.isnan(acceptance([]).accept_length)


@pytest.mark.slow
def test_after_a_crash_without_retries_the_next_cell_gets_a_fresh_server(tmp_path: Path) -> None:
    # retries = 0: the cell that meets the dying server fails; the next one must not.
    cells, _ = _dying_server_sweep(tmp_path, retries=0)
    assert [c["status"] for c in cells] == ["ok", "failed", "ok"]
    assert len(list((tmp_path / "out" / "logs").glob("server-none-*.log"))) == 2


# -- credentials ------------------------------------------------------------------------------


def _holding(folder: Path, secrets: list[str]) -> list[str]:
    """Files under `folder` (journal, cube, server logs) that hold any of `secrets`."""
    return [
        str(path)
        for path in folder.rglob("*")
        if path.is_file() and any(s.encode() in path.read_bytes() for s in secrets)
    ]


@pytest.mark.slow
def test_credentials_reach_the_server_but_no_record_preview_or_check(tmp_path: Path) -> None:
    """A token a wrapper passes (`env HF_TOKEN=...`) and API keys in extra_args start the
    server as written, but the journal, the cube, the server's log, the dry run and `dvfs
    doctor` hold each as "(not recorded)", everything around it kept."""
    import tomllib

    from dvfs.measure.journal import read_records

    token, key, admin = (f"{w}-{time.monotonic_ns()}" for w in ("hf", "key", "admin"))
    path, _ = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        wrapper=("env", f"HF_TOKEN={token}"),
        sglang_extra=f'extra_args = ["--api-key", "{key}", "--admin-api-key={admin}"]',
    )
    secrets = [token, key, admin]
    campaign = load_campaign(path)
    argv = launch_argv(campaign, campaign.drafters[0], port=31000, version="0.5.23")
    assert f"HF_TOKEN={token}" in argv and argv[argv.index("--api-key") + 1] == key
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    dry = runner.invoke(
        cli, ["sweep", str(path), "--out", str(tmp_path / "dry"), "--dry-run", "--no-estimate"]
    )
    assert "HF_TOKEN=(not recorded) " in dry.output  # the command shown, as it would run
    assert "--api-key (not recorded) --admin-api-key=(not recorded)" in dry.output
    checked = runner.invoke(cli, ["doctor", str(path), "--out", str(tmp_path / "checked")])
    assert "server command env HF_TOKEN=(not recorded) " in checked.output
    for shown in (result, dry, checked):
        assert not any(s in shown.output for s in secrets), shown.output
    assert _holding(tmp_path, secrets) == [str(path)]  # the campaign file alone
    records = read_records(out / "journal.jsonl")
    [header] = [r for r in records if r["type"] == "header"]
    hidden = ["--api-key", "(not recorded)", "--admin-api-key=(not recorded)"]
    assert header["campaign"]["engine"]["sglang"]["extra_args"] == hidden
    [session] = [r for r in records if r["type"] == "session"]
    assert session["settings"]["engine.sglang.server_command"] == [
        "env",
        "HF_TOKEN=(not recorded)",
        *campaign.engine.sglang.server_command[2:],
    ]
    [server] = [r for r in records if r["type"] == "server"]
    assert server["args"]["api_key"] == server["args"]["admin_api_key"] == "(not recorded)"
    assert server["args"]["model_path"] == campaign.engine.model  # the rest as resolved
    with xr.open_dataset(out / "cube.nc") as cube:
        attrs = dict(cube.attrs)
    source = tomllib.loads(attrs["campaign_source"])
    assert source["engine"]["sglang"]["extra_args"] == hidden
    assert json.loads(attrs["server_args"])["none"]["args"]["api_key"] == "(not recorded)"
    log = next((out / "logs").glob("server-none-*.log")).read_text()
    assert "--api-key (not recorded) --admin-api-key=(not recorded)" in log


@pytest.mark.slow
def test_credentials_in_a_kept_env_value_reach_the_server_but_no_record(tmp_path: Path) -> None:
    """engine.sglang.env keeps the values of the variables a session compares (SGLANG_...,
    TORCH...), but one may hold a credential: a URL's user and password or a secret query
    parameter, `--api-key KEY`. They were recorded as written (the session's settings and
    server_env, the campaign file's text in the journal and cube); each is hidden now, as in
    url and extra_args, and the server still gets the value as written."""
    import tomllib

    from dvfs.engines.sglang_args import server_env
    from dvfs.measure.journal import read_records

    pw, token, key = (f"{w}-{time.monotonic_ns()}" for w in ("pw", "tok", "key"))
    mirror = f"https://alice:{pw}@hub.example/m?token={token}"
    path, _ = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
    )
    text = path.read_text().replace(
        "env = { ", f'env = {{ SGLANG_MIRROR = "{mirror}", TORCH_ARGS = "--api-key {key}", '
    )
    path.write_text(text)
    secrets = [pw, token, key]
    campaign = load_campaign(path)
    assert server_env(campaign)["SGLANG_MIRROR"] == mirror  # the server gets it as written
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert _holding(tmp_path, secrets) == [str(path)]  # the campaign file alone
    hidden = {
        "SGLANG_MIRROR": "https://(not recorded)@hub.example/m?token=(not recorded)",
        "TORCH_ARGS": "--api-key (not recorded)",
    }
    [session] = [r for r in read_records(out / "journal.jsonl") if r["type"] == "session"]
    for env in (session["server_env"], session["settings"]["engine.sglang.env"]):
        assert {k: env[k] for k in hidden} == hidden
    with xr.open_dataset(out / "cube.nc") as cube:
        source = tomllib.loads(cube.attrs["campaign_source"])
    assert {k: source["engine"]["sglang"]["env"][k] for k in hidden} == hidden
    # the same campaign resumes: its servers' environment reads as the journal recorded it
    again = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert again.exit_code == 0 and "0 cell(s) measured" in again.output, again.output


@pytest.mark.slow
def test_a_quoted_key_after_a_secret_flag_is_recorded_nowhere(tmp_path: Path) -> None:
    """A key quoted after its flag, as a shell line writes it (`--api-key 'KEY'`, `--flag="KEY"`)
    in a kept engine.sglang.env value (or a `sh -c` server command), was recorded as written in
    the session's settings and server_env and in the campaign text the journal and cube keep:
    only a bare value was hidden. A quoted one is hidden too, its quotes kept, and the server
    still gets it as written."""
    from dvfs.engines.sglang_args import server_env
    from dvfs.measure.journal import read_records
    from dvfs.redact import redact_argv

    k1, k2, k3 = (f"{w}-{time.monotonic_ns()}" for w in ("one", "two", "three"))
    path, _ = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
    )
    kept = f"""TORCH_ARGS = "--api-key '{k1}'", SGLANG_ARGS = "--admin-api-key=\\"{k2}\\"", """
    kept += f"""SGLANG_WRAP = "sh -c 'serve --api-key {k3}'", """
    path.write_text(path.read_text().replace("env = { ", f"env = {{ {kept}"))
    campaign = load_campaign(path)
    assert server_env(campaign)["TORCH_ARGS"] == f"--api-key '{k1}'"  # as written
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert _holding(tmp_path, [k1, k2, k3]) == [str(path)]  # the campaign file alone
    [session] = [r for r in read_records(out / "journal.jsonl") if r["type"] == "session"]
    for env in (session["server_env"], session["settings"]["engine.sglang.env"]):
        assert env["TORCH_ARGS"] == "--api-key '(not recorded)'"
        assert env["SGLANG_ARGS"] == '--admin-api-key="(not recorded)"'
        assert env["SGLANG_WRAP"] == "sh -c 'serve --api-key (not recorded)'"
    line = f"exec python -m sglang.launch_server --api-key '{k1}'"
    assert redact_argv(["sh", "-c", line]) == [
        "sh",
        "-c",
        "exec python -m sglang.launch_server --api-key '(not recorded)'",
    ]


@pytest.mark.slow
def test_a_kept_env_value_hidden_once_reads_the_same_wherever_it_is_read_back(
    tmp_path: Path,
) -> None:
    """A URL in a kept engine.sglang.env value with a secret query parameter and no user
    (`SGLANG_MIRROR = "https://hub.example/m?token=..."`) was hidden as recorded, then hidden
    again wherever it was read back: the cube's server_env and campaign text said
    '...token=(not recorded) recorded)', a value no campaign had, and a journal of an earlier
    dvfs, which recorded it as written, was refused on resume as another environment. Hidden
    twice, a value reads as hidden once: the cube says what the journal says, and the earlier
    journal resumes."""
    import tomllib

    from dvfs.measure.journal import read_records

    token = f"tok-{time.monotonic_ns()}"
    mirror = f"https://hub.example/m?token={token}"
    hidden = "https://hub.example/m?token=(not recorded)"
    path, _ = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
    )
    path.write_text(path.read_text().replace("env = { ", f'env = {{ SGLANG_MIRROR = "{mirror}", '))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    [session] = [r for r in read_records(out / "journal.jsonl") if r["type"] == "session"]
    assert session["server_env"]["SGLANG_MIRROR"] == hidden
    with xr.open_dataset(out / "cube.nc") as cube:
        assert json.loads(cube.attrs["server_env"])["SGLANG_MIRROR"] == hidden
        source = tomllib.loads(cube.attrs["campaign_source"])
    assert source["engine"]["sglang"]["env"]["SGLANG_MIRROR"] == hidden
    # the journal as a dvfs before the hiding wrote it: the value as written
    journal = out / "journal.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    for record in records:
        if record["type"] == "session":
            record["server_env"]["SGLANG_MIRROR"] = mirror
            record["settings"]["engine.sglang.env"]["SGLANG_MIRROR"] = mirror
        elif record["type"] == "header":
            record["campaign_source"] = path.read_text()
    journal.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    again = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert again.exit_code == 0 and "0 cell(s) measured" in again.output, again.output


@pytest.mark.slow
def test_api_keys_given_by_an_abbreviation_sglang_takes_are_sent_and_not_recorded(
    tmp_path: Path,
) -> None:
    """SGLang's argparse takes `--api KEY` as `--api-key KEY` (and `--admin=KEY` as
    --admin-api-key): dvfs sends the key (the server answers 401 without it) and no journal,
    cube, server log or dry run holds it."""
    key, admin = (f"{w}-{time.monotonic_ns()}" for w in ("key", "admin"))
    path, _ = _one_cell_stub(
        tmp_path, retries=0, sglang_extra=f'extra_args = ["--api", "{key}", "--admin={admin}"]'
    )
    _keys_sent_and_not_recorded(
        tmp_path, path, (key, admin), "--api (not recorded) --admin=(not recorded)"
    )


@pytest.mark.slow
def test_api_keys_a_server_command_passes_are_sent_and_not_recorded(tmp_path: Path) -> None:
    """A server_command wrapper that passes `--ap KEY` (SGLang's --api-key) and
    `--admin-api-key=KEY` on starts a server that answers 401 without them: dvfs sends them as
    it does extra_args' keys, and no journal, cube, server log or dry run holds them."""
    key, admin = (f"{w}-{time.monotonic_ns()}" for w in ("key", "admin"))
    path, _ = _one_cell_stub(tmp_path, retries=0)
    command = load_campaign(path).engine.sglang.server_command
    keyed = [*command, "--ap", key, f"--admin-api-key={admin}"]
    text = path.read_text().replace(
        f"server_command = {json.dumps(list(command))}", f"server_command = {json.dumps(keyed)}"
    )
    assert key in text
    path.write_text(text)
    _keys_sent_and_not_recorded(
        tmp_path, path, (key, admin), "--ap (not recorded) --admin-api-key=(not recorded)"
    )


def _keys_sent_and_not_recorded(
    tmp_path: Path, path: Path, keys: tuple[str, str], dry_shows: str
) -> None:
    """The campaign at `path`, whose server answers 401 without `keys`, measures its cell (dvfs
    sent them), its dry run shows `dry_shows`, and no output but the campaign file holds them."""
    runner = CliRunner()
    result = runner.invoke(
        cli, ["sweep", str(path), "--out", str(tmp_path / "out"), "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert "1 cell(s) measured, 0 failed" in result.output
    dry = runner.invoke(
        cli, ["sweep", str(path), "--out", str(tmp_path / "dry"), "--dry-run", "--no-estimate"]
    )
    assert dry_shows in dry.output
    for shown in (result, dry):
        assert not any(k in shown.output for k in keys)
    assert _holding(tmp_path, list(keys)) == [str(path)]  # the campaign file alone


@pytest.mark.slow
def test_a_urls_credentials_are_sent_but_not_recorded(tmp_path: Path) -> None:
    """engine.sglang.url = http://user:password@host:port attaches (httpx sends them as basic
    auth) and is recorded, and named in checks and errors, without them."""
    from dvfs.measure.journal import read_records

    password = f"pw-{time.monotonic_ns()}"
    port = free_port()
    campaign, model = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        sglang_extra=f'url = "http://alice:{password}@127.0.0.1:{port}"',
    )
    shown = f"http://(not recorded)@127.0.0.1:{port}"
    server = attached_stub(tmp_path, model, port)
    runner = CliRunner()
    try:
        out = tmp_path / "out"
        result = runner.invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        # dvfs starts no server here: it says which one it attaches to.
        said = " ".join(result.output.split())  # as one line: the terminal wraps it
        assert f"attaching to the SGLang server at {shown} with drafter 'none'" in said
        assert "starting sglang server" not in said
        checked = runner.invoke(cli, ["doctor", str(campaign), "--out", str(tmp_path / "c")])
        assert f"at {shown}, model {model}" in checked.output
    finally:
        server.terminate()
        server.wait(timeout=10)
    down = runner.invoke(cli, ["doctor", str(campaign), "--out", str(tmp_path / "c")])
    assert f"no healthy server at {shown}" in down.output
    assert not any(password in r.output for r in (result, checked, down))
    assert _holding(tmp_path, [password]) == [str(campaign)]
    [session] = [r for r in read_records(out / "journal.jsonl") if r["type"] == "session"]
    assert session["settings"]["engine.sglang.url"] == shown


@pytest.mark.slow
def test_a_server_with_an_api_key_is_measured_with_it_and_said_without_it(tmp_path: Path) -> None:
    """A server started with --api-key answers 401 to requests without the key (the stub
    checks as SGLang does): dvfs sends the key its extra_args give, and without one says how
    to give it, in one line, never recording it."""
    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang_client import SglangClient

    key = f"key-{time.monotonic_ns()}"
    port = free_port()
    common = {
        "drafters": '\n[drafters.none]\nalgorithm = "none"\n',
        "batch": "[1]",
        "knobs": "sm_clock = [1980]\nsettle_s = 0.0",
        "retries": 0,
    }
    url = f'url = "http://127.0.0.1:{port}"'
    keyless, model = stub_campaign(tmp_path, **common, sglang_extra=url)
    text = keyless.read_text().replace(url, f'{url}\nextra_args = ["--api-key", "{key}"]')
    keyed = tmp_path / "keyed.toml"
    keyed.write_text(text)
    server = attached_stub(tmp_path, model, port, "--api-key", key)
    runner = CliRunner()
    try:
        SglangClient(f"http://127.0.0.1:{port}", clock=MonotonicClock()).wait_healthy(30)
        refused = runner.invoke(cli, ["doctor", str(keyless), "--out", str(tmp_path / "c")])
        said = " ".join(refused.output.split())
        assert f"FAIL engine: http://127.0.0.1:{port} answered 401 to /server_info" in said
        assert "give dvfs the server's --api-key" in said and "engine.sglang.extra_args" in said
        failed = runner.invoke(cli, ["sweep", str(keyless), "--out", str(tmp_path / "no")])
        assert failed.exit_code != 0 and "answered 401" in failed.output
        assert "Traceback" not in failed.output
        checked = runner.invoke(cli, ["doctor", str(keyed), "--out", str(tmp_path / "c")])
        assert f"model {model}" in checked.output
        out = tmp_path / "out"
        result = runner.invoke(cli, ["sweep", str(keyed), "--out", str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        assert "1 cell(s) measured, 0 failed" in result.output
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert _holding(tmp_path, [key]) == [str(keyed)]


def test_a_server_logs_tail_in_an_error_hides_the_keys_sglang_prints(tmp_path: Path) -> None:
    """SGLang logs its ServerArgs at start, api_key included; a failed start quotes the log's
    tail in its error, which the journal and the cube keep: without the keys."""
    from dvfs.engines.sglang import tail

    log = tmp_path / "server.log"
    log.write_text(
        "$ python -m sglang.launch_server --api-key (not recorded)\n"
        "server_args=ServerArgs(model_path='m', tokenizer_path='m', api_key='k-1', "
        'admin_api_key=None, ssl_keyfile_password="k-2", max_total_tokens=None)\n'
        "RuntimeError: CUDA out of memory\n"
    )
    shown = tail(log)
    assert "k-1" not in shown and "k-2" not in shown
    assert "api_key='(not recorded)'" in shown and "tokenizer_path='m'" in shown
    assert "admin_api_key=None" in shown and shown.endswith("RuntimeError: CUDA out of memory")


def test_a_server_logs_tail_in_an_error_is_shown_without_the_terminals_escapes(
    tmp_path: Path,
) -> None:
    """A log written in colour (FORCE_COLOR, Python 3.13's coloured tracebacks) or holding a
    NUL or a bell: its tail, pasted into the error a user's terminal shows, left the colour on
    for the rest of the terminal; a colour code inside a ServerArgs line kept its key from
    being hidden."""
    from dvfs.engines.sglang import tail

    log = tmp_path / "server.log"
    log.write_bytes(
        b"server_args=ServerArgs(model_path='m', api_key=\x1b[1m'k-1'\x1b[0m)\n"
        b"\x1b[31mRuntimeError: CUDA out of memory\x1b[0m\x07\x00\tend\n"
    )
    shown = tail(log)
    assert "\x1b" not in shown and "k-1" not in shown, repr(shown)
    assert shown.splitlines()[-1] == "RuntimeError: CUDA out of memory?? end", repr(shown)


def test_a_huge_log_is_read_from_its_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's log after a long sweep may be gigabytes: its tail is read from the end, never
    the whole file (reading it whole fails here), whole lines only, bytes that are not UTF-8
    replaced."""
    from dvfs.engines import sglang

    log = tmp_path / "server.log"
    log.write_bytes(b"\n".join(b"decode batch %d \xff" % i for i in range(100_000)) + b"\n")

    def whole(*_: object, **__: object) -> None:
        raise AssertionError("the whole log was read")

    monkeypatch.setattr(Path, "read_text", whole)
    monkeypatch.setattr(Path, "read_bytes", whole)
    shown = sglang.tail(log).splitlines()
    assert len(shown) == sglang.LOG_TAIL_LINES
    assert shown[-1] == "decode batch 99999 \ufffd"
    assert shown[0] == f"decode batch {100_000 - sglang.LOG_TAIL_LINES} \ufffd"
    log.write_bytes(b"x" * (2 * sglang.LOG_TAIL_BYTES))  # one line longer than what is read
    assert sglang.tail(log) == "x" * sglang.LOG_TAIL_BYTES


# -- doctor's engine check, as the sweep starts the server --------------------------------------


def _one_cell_stub(tmp_path: Path, **options: Any) -> tuple[Path, str]:
    """A stub campaign of one cell (no drafter, batch 1, one clock); `options` go to
    `stub_campaign` as they are."""
    return stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        **options,
    )


@pytest.mark.slow
def test_doctor_fails_a_server_command_the_sweep_cannot_start(tmp_path: Path) -> None:
    """A server_command naming a file that exists but is not executable: the sweep fails every
    cell on it, so doctor fails its engine check (exit 1) and both say why in the same words,
    not 'not found' for a file that is there."""
    campaign, _ = _one_cell_stub(tmp_path)
    script = tmp_path / "launch.py"
    script.write_text(STUB.read_text())
    script.chmod(0o644)
    text = campaign.read_text()
    text = text.replace(
        text[text.index("server_command") : text.index("\n", text.index("server_command"))],
        f'server_command = ["{script}"]',
    )
    campaign.write_text(text)
    runner = CliRunner()
    checked = runner.invoke(cli, ["doctor", str(campaign), "--out", str(tmp_path / "c")])
    swept = runner.invoke(
        cli, ["sweep", str(campaign), "--out", str(tmp_path / "out"), "--no-progress"]
    )
    assert checked.exit_code == 1, checked.output
    assert swept.exit_code != 0
    # Compared without whitespace: the terminal wraps a long path inside the word.
    said = "".join(f"{script} is not executable".split())
    assert said in "".join(checked.output.split())
    assert said in "".join(swept.output.split())


@pytest.mark.slow
def test_doctor_finds_the_server_command_on_the_campaigns_path(tmp_path: Path) -> None:
    """engine.sglang.env's PATH is the one the sweep starts the server command with: a command
    found only there is found by doctor too (exit 0), as the sweep starts it."""
    campaign, _ = _one_cell_stub(tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    launcher = bindir / "launch-stub-server"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STUB}" "$@"\n')
    launcher.chmod(0o755)
    text = campaign.read_text()
    start = text.index("server_command")
    text = text.replace(
        text[start : text.index("\n", start)], 'server_command = ["launch-stub-server"]'
    )
    text = text.replace("env = { ", f'env = {{ PATH = "{bindir}{os.pathsep}{os.environ["PATH"]}", ')
    campaign.write_text(text)
    runner = CliRunner()
    checked = runner.invoke(cli, ["doctor", str(campaign), "--out", str(tmp_path / "c")])
    assert checked.exit_code == 0, checked.output
    assert "server command launch-stub-server" in checked.output
    swept = runner.invoke(
        cli, ["sweep", str(campaign), "--out", str(tmp_path / "out"), "--no-progress"]
    )
    assert swept.exit_code == 0, swept.output


def test_doctor_names_a_model_path_that_is_not_there(tmp_path: Path) -> None:
    """A drafter's (or the target's) model named by a local path that does not exist: every
    server of that drafter would fail to start, after the other drafters' cells had run, while
    doctor passed the campaign. Doctor fails it where dvfs starts SGLang here, and warns where
    the server command may start it elsewhere (a container); a path that is there passes."""
    campaign, _ = stub_campaign(tmp_path)  # the stub's EAGLE-3 drafter: draft/eagle3
    text = campaign.read_text()

    def models_check(source: str) -> tuple[int, dict[str, str]]:
        campaign.write_text(source)
        done = CliRunner().invoke(
            cli, ["doctor", str(campaign), "--out", str(tmp_path / "c"), "--json"]
        )
        [check] = [c for c in json.loads(done.stdout) if c["name"] == "models"]
        return done.exit_code, check

    missing = text.replace('draft_model = "draft/eagle3"', 'draft_model = "./no/such/draft"')
    code, check = models_check(missing)
    assert check["status"] == "warn" and code == 0, check
    assert "drafters.eagle3.draft_model './no/such/draft'" in check["detail"], check
    start = missing.index("server_command")
    own_server = missing.replace(missing[start : missing.index("\n", start)], "")
    code, check = models_check(own_server)
    assert check["status"] == "fail" and code == 1, check
    assert "./no/such/draft" in check["detail"], check
    # a home no user has (`~models/` for `~/models/`), a path longer than any: named as not
    # there, where doctor stopped at "internal error: RuntimeError: Could not determine home
    # directory" (or OSError: File name too long), exit 1, every other check unsaid
    for bad in ("~no-such-user-of-dvfs/draft", "/" + "x" * 5000):
        code, check = models_check(own_server.replace("./no/such/draft", bad))
        assert check["status"] == "fail" and code == 1, check
        assert f"drafters.eagle3.draft_model {bad!r}" in check["detail"], check
    (tmp_path / "draft").mkdir()
    there = own_server.replace("./no/such/draft", str(tmp_path / "draft"))
    assert models_check(there)[1]["status"] == "ok"
    assert models_check(text)[1]["status"] == "ok"  # a repo id: no path to look for


def test_doctor_fails_a_model_path_whose_home_no_shell_expands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`draft_model = "~/draft"`, there in the home: doctor said "every model path is here",
    but dvfs starts SGLang with the path as written, in an argv no shell reads, so SGLang
    looks for a folder named '~' (then asks the hub for it as a repo id) and every server of
    that drafter fails to start, after the other drafters' cells. Doctor fails it, naming the
    path in full; with a server command (which may run a shell) it stays the command's."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "draft").mkdir()
    campaign, _ = stub_campaign(tmp_path)
    text = campaign.read_text().replace('draft_model = "draft/eagle3"', 'draft_model = "~/draft"')
    start = text.index("server_command")
    own_server = text.replace(text[start : text.index("\n", start)], "")

    def doctor(source: str) -> tuple[Result, dict[str, str]]:
        campaign.write_text(source)
        done = CliRunner().invoke(
            cli, ["doctor", str(campaign), "--out", str(tmp_path / "c"), "--json"]
        )
        [check] = [c for c in json.loads(done.stdout) if c["name"] == "models"]
        return done, check

    done, check = doctor(own_server)
    assert check["status"] == "fail" and done.exit_code == 1, check
    assert (
        f"drafters.eagle3.draft_model '~/draft', in full '{tmp_path / 'draft'}'"
        in (check["detail"])
    ), check
    # as the sweep would start it: the '~' as written
    dry = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--out", str(tmp_path / "c"), "--dry-run", "--no-estimate"]
    )
    assert "--speculative-draft-model-path ~/draft " in dry.output, dry.output
    assert doctor(text)[1]["status"] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("served", "said"),
    [
        (["--model-path", "other/model"], "serves model 'other/model', not"),
        (["--speculative-algorithm", "NGRAM"], "runs speculative algorithm 'NGRAM', not None"),
    ],
)
def test_doctor_fails_an_attached_server_the_sweep_refuses(
    tmp_path: Path, served: list[str], said: str
) -> None:
    """An attached server (engine.sglang.url) serving another model, or another algorithm than
    the drafter's: the sweep fails every cell on it, so doctor fails its engine check (exit 1)
    in the same words, where it said ok."""
    port = free_port()
    campaign, model = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        sglang_extra=f'url = "http://127.0.0.1:{port}"',
    )
    server = attached_stub(tmp_path, model, port, *served)
    runner = CliRunner()
    try:
        out = tmp_path / "out"
        swept = runner.invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
        checked = runner.invoke(cli, ["doctor", str(campaign), "--out", str(tmp_path / "c")])
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert swept.exit_code == 5, swept.output
    assert said in " ".join(swept.output.split())
    assert checked.exit_code == 1, checked.output
    [failed] = [line for line in checked.output.splitlines() if line.startswith("FAIL")]
    assert failed.startswith("FAIL engine:")
    assert said in " ".join(checked.output.split())


@pytest.mark.slow
def test_an_attached_server_with_adaptive_speculation_is_refused(tmp_path: Path) -> None:
    """An attached EAGLE3 server started with --speculative-adaptive (SGLang 0.5.23), which
    its /server_info reports on: its drafter's steps change at run time, within a cell and
    differently at each clock, so the sweep refuses it in one line (exit 5) and doctor fails
    its engine check in the same words."""
    port = free_port()
    campaign, model = stub_campaign(
        tmp_path,
        drafters='\n[drafters.e]\nalgorithm = "EAGLE3"\ndraft_model = "d"\n',
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        sglang_extra=f'url = "http://127.0.0.1:{port}"',
    )
    served = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d"]
    server = attached_stub(tmp_path, model, port, *served, "--speculative-adaptive")
    runner = CliRunner()
    try:
        out = tmp_path / "out"
        swept = runner.invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
        checked = runner.invoke(cli, ["doctor", str(campaign), "--out", str(tmp_path / "c")])
    finally:
        server.terminate()
        server.wait(timeout=10)
    said = "runs with --speculative-adaptive (its /server_info says so)"
    assert swept.exit_code == 5, swept.output
    assert said in " ".join(swept.output.split()) and "Traceback" not in swept.output
    assert "within a cell and between clocks" in " ".join(swept.output.split())
    assert checked.exit_code == 1, checked.output
    [failed] = [line for line in checked.output.splitlines() if line.startswith("FAIL")]
    assert failed.startswith("FAIL engine:")
    assert said in " ".join(checked.output.split())


# -- another program on the started server's port ----------------------------------------------


def _answering(port: int) -> None:
    """Until the stub on `port` answers /health 200 (bounded: the client's own wait)."""
    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang_client import SglangClient

    SglangClient(f"http://127.0.0.1:{port}", clock=MonotonicClock()).wait_healthy(30)


@pytest.mark.parametrize("served", ["another model", "the same model"])
def test_another_program_on_the_servers_port_is_not_taken_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, served: str
) -> None:
    """Another program listens on the port dvfs starts a server on (here the stub, serving
    another model or the campaign's own), running before the server: SGLang listens only once
    its weights are loaded (the stub after `listen_delay_s`), so the other program answered
    /health and /server_info in its place, and dvfs measured it until a later check failed
    (the server, unable to listen, died) or never (the sweep was over first). The start now
    refuses it in one line naming the port, and stops the server it started."""
    import dvfs.engines.sglang as sglang
    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang import SglangEngine

    path, marker = stub_campaign(tmp_path, drafters=ONE_DRAFTER, stub={"listen_delay_s": 1.0})
    campaign = load_campaign(path)
    port = free_port()
    other = attached_stub(
        tmp_path, "someone-elses-model" if served == "another model" else marker, port
    )
    monkeypatch.setattr(sglang, "free_port", lambda host="127.0.0.1": port)
    try:
        _answering(port)
        engine = SglangEngine(campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs")
        with engine, pytest.raises(EngineError) as refused:
            engine.start(campaign.drafters[0])
        assert other.poll() is None  # the other program is left alone
    finally:
        other.terminate()
        other.wait(timeout=10)
    said = str(refused.value)
    assert "\n" not in said and f"the 'none' server's port {port}" in said, said
    if served == "another model":
        assert f"reports model_path 'someone-elses-model', not {marker!r}" in said, said
    else:
        assert f"another program (pid {other.pid}, " in said and "was running before" in said
    assert running(marker) == []


@pytest.mark.parametrize("when", ["while it starts", "after its start"])
def test_a_server_that_exits_while_another_program_answers_on_its_port_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Another program (the stub, serving the campaign's model) starts listening on the port
    while the server dvfs started still loads, and the server, unable to listen, exits: gone
    by the time its start is checked, the start says so in one line; gone only after (nothing
    at the start told them apart), a round its port still answers is said to be that
    program's, not 'the SGLang server died'."""
    import dvfs.engines.sglang as sglang
    from dvfs.clock import MonotonicClock
    from dvfs.corpora import sample_prompts
    from dvfs.corpora.prepare import load_corpora
    from dvfs.engines.base import Workload
    from dvfs.engines.sglang import SglangEngine
    from dvfs.engines.sglang_client import SglangClient
    from dvfs.errors import EngineCrashedError

    path, marker = stub_campaign(
        tmp_path, drafters=ONE_DRAFTER, batch="[1]", stub={"listen_delay_s": 1.0}
    )
    campaign = load_campaign(path)
    port = free_port()
    monkeypatch.setattr(sglang, "free_port", lambda host="127.0.0.1": port)
    others: list[subprocess.Popen[bytes]] = []
    real_wait = SglangClient.wait_healthy
    engine = SglangEngine(campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs")

    def exited() -> None:
        assert engine._process is not None
        engine._process.wait(timeout=30)  # it could not listen

    def another_program_meanwhile(client: SglangClient, *args: object, **kwargs: object) -> None:
        # The started server is held (SIGSTOP) before its 1 s listen delay is over, until the
        # other program answers and dvfs has seen the server alive: on a loaded machine the
        # other program's own start could outlast that delay, and the server exit before the
        # health check it is meant to outlive.
        assert engine._process is not None
        os.kill(engine._process.pid, signal.SIGSTOP)
        try:
            others.append(attached_stub(tmp_path, marker, port))  # after the server started
            real_wait(SglangClient(client.base_url, clock=MonotonicClock()), 30)  # it answers
            real_wait(client, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            os.kill(engine._process.pid, signal.SIGCONT)
        if when == "while it starts":
            exited()

    monkeypatch.setattr(SglangClient, "wait_healthy", another_program_meanwhile)
    prompts = sample_prompts(load_corpora(campaign)["code"], 1, input_tokens=(16, 2048), seed=0)
    try:
        with engine:
            if when == "while it starts":
                with pytest.raises(EngineError) as refused:
                    engine.start(campaign.drafters[0])
                said = str(refused.value)
            else:
                engine.start(campaign.drafters[0])
                exited()
                with pytest.raises(EngineCrashedError) as crashed:
                    engine.run(Workload(1, prompts, "code", 8, 0.0, True))
                said = str(crashed.value).splitlines()[0]
    finally:
        for other in others:
            other.terminate()
            other.wait(timeout=10)
    if when == "while it starts":
        assert "\n" not in said and said.startswith(
            f"the 'none' server exited (exit code 1) while another program answered on its "
            f"port {port} "
        ), said
    else:
        assert said.startswith("the SGLang server dvfs started exited (exit code 1), yet its port")
        assert f"127.0.0.1:{port}" in said and "another program listens there" in said
    assert running(marker) == []


@pytest.mark.parametrize(
    ("named", "served"),
    [
        ("{m}/Llama-GGUF:Q4_K_M", None),
        ("{m}/Llama-GGUF/sub/llama-Q8_0.gguf", None),
        ("{m}/Llama-GGUF:Q4_K_M", "{m}/Llama-GGUF:Q8_0"),
        ("{m}/Llama-GGUF:Q4_K_M", "{m}/Other-GGUF:Q4_K_M"),
    ],
)
def test_a_gguf_named_on_the_hub_is_the_servers_own_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, named: str, served: str | None
) -> None:
    """SGLang 0.5.23 serves a .gguf named on the Hugging Face Hub (`owner/repo:QUANT`,
    `owner/repo/FILE.gguf`) from the file it downloads it to, and /server_info reports that
    local path as model_path: dvfs refused the server it started as "another program" on its
    port, and an attached one as serving another model. Both run now; a server on another
    quantization or repo is still refused (started: another program; attached: another
    model)."""
    import dvfs.engines.sglang as sglang
    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang import SglangEngine

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    path, marker = stub_campaign(tmp_path, drafters=ONE_DRAFTER)
    model = named.format(m=marker)
    path.write_text(path.read_text().replace(f'model = "{marker}"', f'model = "{model}"'))
    port = free_port()
    attached = path.with_name("attached.toml")
    attached.write_text(
        path.read_text().replace(
            "[engine.sglang]\n", f'[engine.sglang]\nurl = "http://127.0.0.1:{port}"\n'
        )
    )
    engine = SglangEngine(load_campaign(path), clock=MonotonicClock(), log_dir=tmp_path / "logs")
    if served is not None:  # another program's server: refused once the port answers
        monkeypatch.setattr(sglang, "free_port", lambda host="127.0.0.1": port)
    server = attached_stub(tmp_path, (served or named).format(m=marker), port)
    try:
        _answering(port)
        on_server = SglangEngine(
            load_campaign(attached), clock=MonotonicClock(), log_dir=tmp_path / "a"
        )
        if served is None:
            with engine:
                info = engine.start(load_campaign(path).drafters[0])
            with on_server:
                on_server.start(load_campaign(attached).drafters[0])
            assert str(info.args["model_path"]).endswith(".gguf")
            assert str(info.args["model_path"]).startswith(str(tmp_path / "hf" / "hub"))
        else:
            with engine, pytest.raises(EngineError, match="another program answer"):
                engine.start(load_campaign(path).drafters[0])
            with on_server, pytest.raises(EngineError, match="serves model"):
                on_server.start(load_campaign(attached).drafters[0])
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert running(marker) == []


def test_a_server_that_dies_just_after_answering_is_not_said_to_be_another_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server dvfs started answers /health and /server_info, then dies (a crash, nothing
    else on its port): its start said "another program answered on its port in its place".
    It says the server exited just after it answered, with its log's last lines, and nothing
    of another program."""
    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang import SglangEngine
    from dvfs.engines.sglang_client import SglangClient

    path, marker = stub_campaign(tmp_path, drafters=ONE_DRAFTER)
    campaign = load_campaign(path)
    engine = SglangEngine(campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs")
    real_info = SglangClient.server_info

    def answered_then_died(client: SglangClient) -> dict:
        info = real_info(client)
        assert engine._process is not None
        engine._process.kill()  # it crashes right after its answer
        engine._process.wait(timeout=30)
        return info

    monkeypatch.setattr(SglangClient, "server_info", answered_then_died)
    with engine, pytest.raises(EngineError) as refused:
        engine.start(campaign.drafters[0])
    first = str(refused.value).splitlines()[0]
    assert "another program" not in str(refused.value), first
    assert first.startswith("the 'none' server exited (exit code -9) just after it answered")
    assert "--- last lines of " in str(refused.value)
    assert running(marker) == []


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_a_server_on_an_ipv6_host_starts_and_its_block_is_free(tmp_path: Path) -> None:
    """engine.sglang.host = "::1" (SGLang's --host takes IPv6 addresses): the sweep stopped
    with "cannot use OUT: address family for hostname not supported" (its free port was looked
    for over IPv4, blaming the output folder), its URL lacked the brackets, and a fleet found
    every block of ports taken. The server starts there and the sweep measures; a free block
    on that host is free, a held one held."""
    from dvfs.fleet.ports import taken

    path, marker = stub_campaign(
        tmp_path, drafters=ONE_DRAFTER, batch="[1]", sglang_extra='host = "::1"'
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert (dvfs.open_cube(str(out / "cube.nc"))["cell_status"] == 1).all()
    assert running(marker) == []
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert taken("::1", [port]) == f"port {port}: Address already in use"
    assert taken("::1", [port]) is None


@pytest.mark.parametrize("flag", ["true", "yes", "Y"])
def test_a_model_downloaded_from_modelscope_is_the_servers_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    """With SGLANG_USE_MODELSCOPE true, SGLang downloads the model from ModelScope and reports
    the folder it landed in as model_path, which dvfs does not compare; SGLang 0.5.23 also
    takes "yes" and "y" (any case) for true, which dvfs did not: it refused the server it
    started as another program on its port."""
    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang import SglangEngine

    monkeypatch.setenv("SGLANG_USE_MODELSCOPE", flag)
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "modelscope"))
    path, marker = stub_campaign(tmp_path, drafters=ONE_DRAFTER)
    campaign = load_campaign(path)
    with SglangEngine(campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs") as engine:
        info = engine.start(campaign.drafters[0])
    assert info.args["model_path"] == str(tmp_path / "modelscope" / marker)
    assert running(marker) == []


def _swept_on_a_wrong_host(path: Path, out: Path, gpus: tuple[str, ...], wrong: str) -> str:
    """The sweep's output (one line's words) on a host no server can listen on: it names the
    host (`wrong`), not the output folder, nor ports held by other programs."""
    result = CliRunner().invoke(
        cli, ["sweep", str(path), "--out", str(out), "--no-progress", *gpus]
    )
    said = " ".join(result.output.split())
    assert "cannot use" not in said and "Traceback" not in said, said
    assert "held by other programs" not in said and wrong in said, said
    return said


def test_a_host_no_server_can_listen_on_fails_its_cells_naming_it(tmp_path: Path) -> None:
    """engine.sglang.host an address of another machine (here TEST-NET-1's 192.0.2.1): the
    sweep stopped with "cannot use OUT: cannot assign requested address", blaming the output
    folder, and a fleet found every block of ports "held by other programs". Each cell's
    server start fails instead, and the fleet stops, in one line naming engine.sglang.host;
    doctor fails its ports check, for a single server too (which it passed)."""
    path, marker = stub_campaign(
        tmp_path, drafters=ONE_DRAFTER, batch="[1]", sglang_extra='host = "192.0.2.1"'
    )
    wrong = "a server cannot listen on engine.sglang.host '192.0.2.1' here ("
    for gpus in ((), ("--gpus", "0,1")):
        out = tmp_path / f"out{len(gpus)}"
        said = _swept_on_a_wrong_host(path, out, gpus, wrong)
        assert "name an address of this machine, such as 127.0.0.1" in said
        # doctor, which passed a single server's campaign that every cell of would fail
        checked = CliRunner().invoke(cli, ["doctor", str(path), "--out", str(out), *gpus])
        assert checked.exit_code == 1, checked.output
        assert f"FAIL ports: {wrong}" in " ".join(checked.output.split()), checked.output
    assert running(marker) == []


class _KernelWithoutIpv6(socket.socket):
    """A socket as a kernel booted without IPv6 (ipv6.disable=1) makes them: none of IPv6."""

    def __init__(self, family: int = socket.AF_INET, *args: Any, **kwargs: Any) -> None:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
        super().__init__(family, *args, **kwargs)


@pytest.mark.parametrize("case", ["no IPv6 in the kernel", "link-local without interface"])
def test_an_ipv6_host_no_server_can_listen_on_is_named_not_the_output_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """engine.sglang.host "::1" where the kernel has no IPv6 (its socket refused,
    EAFNOSUPPORT), or a link-local "fe80::1" without its interface (its bind refused,
    EINVAL): a fleet's sweep and doctor stopped with "cannot use OUT: address family not
    supported by protocol", blaming the output folder, or found every block of ports "held by
    other programs", and a single server's start said "no free port" without what to do. Each
    says instead, in one line, that no server can listen on engine.sglang.host here."""
    from dvfs.engines.sglang import free_port as port_on
    from dvfs.fleet.ports import taken

    if case == "no IPv6 in the kernel":
        host = "::1"
        monkeypatch.setattr(socket, "socket", _KernelWithoutIpv6)
    elif _ipv6_loopback():
        host = "fe80::1"
    else:
        pytest.skip("no IPv6 here")
    path, marker = stub_campaign(
        tmp_path, drafters=ONE_DRAFTER, batch="[1]", sglang_extra=f'host = "{host}"'
    )
    wrong = f"a server cannot listen on engine.sglang.host {host!r} here ("
    fix = "name an address of this machine, such as 127.0.0.1"
    for probe in (lambda: port_on(host), lambda: taken(host, [30000])):
        with pytest.raises(EngineError) as refused:
            probe()
        assert str(refused.value).startswith(wrong) and fix in str(refused.value)
    for gpus in ((), ("--gpus", "0,1")):
        said = _swept_on_a_wrong_host(path, tmp_path / f"out{len(gpus)}", gpus, wrong)
        assert fix in said, said
    checked = CliRunner().invoke(
        cli, ["doctor", str(path), "--gpus", "0,1", "--out", str(tmp_path / "c")]
    )
    assert f"FAIL ports: {wrong}" in " ".join(checked.output.split()), checked.output
    assert running(marker) == []


def _answering_generate(chunks: list[dict[str, Any]]) -> tuple[Any, int]:
    """A loopback server whose every streamed /generate answer is `chunks` (then [DONE])."""
    import http.server
    import threading

    body = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"

    class Generate(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Generate)
    # (a shutdown is seen at the loop's next look: every 10 ms, not the default 0.5 s)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    return server, server.server_address[1]


_FINAL = {"completion_tokens": 2, "finish_reason": {"type": "length", "length": 2}}


@pytest.mark.parametrize(
    "chunk",
    [
        {"text": "a", "meta_info": "running"},
        {"text": "a", "meta_info": [1, 2]},
        {"text": "a", "meta_info": {"completion_tokens": "two"}},
        {"text": "a", "meta_info": {"completion_tokens": [2]}},
        {"text": "a", "meta_info": {"completion_tokens": 1e400}},
        {"text": "a", "output_ids": 7, "meta_info": {}},
        {"text": "a", "meta_info": {"completion_tokens": 2, "prompt_tokens": "many"}},
        {"text": "a", "meta_info": {**_FINAL, "spec_verify_ct": "x"}},
        {"text": "a", "meta_info": {**_FINAL, "spec_accept_token_num": {}}},
        {"text": "a", "meta_info": {**_FINAL, "spec_draft_token_num": "x"}},
        {"text": "a", "meta_info": {**_FINAL, "num_retractions": "x"}},
    ],
    ids=lambda chunk: json.dumps(chunk)[:70],
)
def test_a_generate_answer_with_malformed_meta_info_fails_the_request_in_one_line(
    chunk: dict[str, Any],
) -> None:
    """A /generate answer whose meta_info is not an object, or whose token counts, speculative
    counters or retractions are not numbers, is a malformed answer like a chunk that is not
    JSON: an EngineError of one line naming it (the cell's error), not a ValueError or
    AttributeError escaping as a traceback."""
    from dvfs.clock import MonotonicClock
    from dvfs.engines.sglang_client import SamplingParams, SglangClient
    from dvfs.errors import EngineError

    server, port = _answering_generate([chunk])
    try:
        client = SglangClient(f"http://127.0.0.1:{port}", clock=MonotonicClock())
        with pytest.raises(EngineError) as caught:
            client.run_batch(["hi"], SamplingParams(2, 0.0, True), "t")
    finally:
        server.shutdown()
        server.server_close()
    message = str(caught.value)
    assert type(caught.value) is EngineError
    assert "\n" not in message and "malformed" in message, message


def test_hung_probe_follows_the_servers_health_check_timeout() -> None:
    """SGLang's /health may take its SGLANG_HEALTH_CHECK_TIMEOUT (20 s unless set) to answer a
    busy server: the hung probe waits that long and a margin, whatever the variable holds."""
    from dvfs.engines.sglang_client import HUNG_MARGIN_S, hung_probe_s

    assert hung_probe_s({}) == 20.0 + HUNG_MARGIN_S
    assert hung_probe_s({"SGLANG_HEALTH_CHECK_TIMEOUT": "60"}) == 60.0 + HUNG_MARGIN_S
    for junk in ("soon", "nan", "-3", "inf"):
        assert hung_probe_s({"SGLANG_HEALTH_CHECK_TIMEOUT": junk}) == 20.0 + HUNG_MARGIN_S


@pytest.mark.skipif(os.geteuid() != 0, reason="the link check applies to root only")
def test_as_root_no_server_log_is_written_through_a_users_link(tmp_path: Path) -> None:
    """`sudo dvfs sweep` writes each server's log in `--out`/logs, a folder of the user's
    checkout by default: a link the user put there as the next log (`server-none-1.log`) had
    root append the server's argv and output to its target, any root file. As root it is
    refused in one line, exit 2, the target untouched, and no server started."""
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    campaign, marker = stub_campaign(
        tmp_path,
        stub={"ttft_s": 0.0, "tpot_s": 0.0, "seed": 1},
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
    )
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o700)
    keys = etc / "authorized_keys"
    keys.write_text("root's\n")
    out = tmp_path / "out"
    logs = out / "logs"
    logs.mkdir(parents=True)
    link = logs / "server-none-1.log"
    link.symlink_to(keys)
    for folder in (out, logs):
        os.chown(folder, nobody, nobody)
    result = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    assert result.exit_code == 2, result.output
    [error] = [x for x in result.stderr.splitlines() if x.startswith("Error:")]
    assert error.startswith(
        f"Error: {link} goes through the symbolic link {link}, in {logs}, which its owner "
        "nobody may write"
    ), error
    assert keys.read_text() == "root's\n"
    assert running(marker) == []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    "limits", [("4096", "300"), ("300", "4096")], ids=["kv-pool-bound", "context-bound"]
)
def test_the_room_a_server_reports_is_decoded_whole(
    version: str, limits: tuple[str, str], tmp_path: Path
) -> None:
    """`new_tokens_room` is what the running server's /server_info (max_req_input_len, its
    speculative args) leaves a request: asked for, it is decoded whole, neither refused nor
    cut, with an EAGLE-family drafter's reserved draft slots and without; where the KV pool
    or where the context bounds it. Past it by the reserved slots and one token, SGLang cuts
    or refuses the request."""
    from dvfs.clock import MonotonicClock
    from dvfs.corpora import Prompt
    from dvfs.corpora.model import Message
    from dvfs.engines.base import Workload
    from dvfs.engines.sglang import SglangEngine

    context, pool = limits
    path, _ = stub_campaign(
        tmp_path,
        version=version,
        stub={"tpot_s": 0.0},  # hundreds of tokens each, timed by nothing here
        sglang_extra=(
            f'extra_args = ["--context-length", "{context}", "--max-total-tokens", "{pool}"]'
        ),
    )
    campaign = load_campaign(path)
    words = 40
    # the stub counts a BOS and one token per word, as dvfs is told here
    prompt = Prompt("p", (Message("user", " ".join(["w"] * words)),), words + 1)
    with SglangEngine(campaign, clock=MonotonicClock(), log_dir=tmp_path / "logs") as engine:
        for drafter in campaign.drafters:
            engine.start(drafter)
            asked = Workload(1, (prompt,), "code", 0, 0.0, True)
            room = engine.new_tokens_room(asked)
            assert room is not None
            reserved = 4 if drafter.algorithm == "EAGLE3" else 0  # its num_draft_tokens
            assert room == min(int(context), int(pool)) - 2 - (words + 1) - reserved
            whole = engine.run(Workload(1, (prompt,), "code", room, 0.0, True))
            assert [r.completion_tokens for r in whole.requests] == [room]
            past = room + reserved + 1
            try:
                cut = engine.run(Workload(1, (prompt,), "code", past, 0.0, True))
            except EngineError as exc:  # refused, or cut short (dvfs tells a cut decode)
                assert "context length" in str(exc) or f"of {past} tokens" in str(exc)
            else:
                assert cut.requests[0].completion_tokens < past


def test_a_server_info_far_larger_than_sglangs_is_not_read_whole(tmp_path: Path) -> None:
    """An engine.sglang.url answering /server_info with a page far larger than SGLang's (a
    wrong URL, a broken server; one without end took 6 GB and 26 s before its JSON failed)
    was read whole into memory. Past 16 MiB the read stops: `dvfs doctor` and the sweep say
    so in one line naming the page, the cell failed as for any answer that is no SGLang's."""
    import contextlib
    import http.server
    import threading

    from dvfs.measure.journal import read_records

    page = json.dumps({"padding": "x" * (17 << 20)}).encode()

    class Huge(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "0" if self.path == "/health" else str(len(page)))
            self.end_headers()
            if self.path != "/health":
                with contextlib.suppress(OSError):  # the reader gave up: it hung up
                    self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Huge)
    server.handle_error = lambda *args: None  # type: ignore[method-assign]
    # (a shutdown is seen at the loop's next look: every 10 ms, not the default 0.5 s)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        path, _ = stub_campaign(
            tmp_path,
            drafters='\n[drafters.none]\nalgorithm = "none"\n',
            sglang_extra=f'url = "{url}"',
            batch="[1]",
            knobs="sm_clock = [1980]\nsettle_s = 0.0",
        )
        said = f"{url}/server_info answered more than 16 MiB, far more than SGLang's"
        doctor = CliRunner().invoke(cli, ["doctor", str(path), "--out", str(tmp_path / "o")])
        assert said in " ".join(doctor.output.split()), doctor.output
        out = tmp_path / "out"
        swept = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
        assert swept.exit_code == 5, swept.output
        [cell] = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
        assert said in cell["error"], cell["error"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_sweep_of_the_default_server_command_without_sglang_refuses_as_doctor_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No server_command (this Python's `-m sglang.launch_server`) where sglang is not installed:
    every server start would fail, so the sweep refuses before it measures (exit 1, no journal)
    in doctor's words, not with every cell failed and 'rerun the same command to retry them'.
    A server_command (a wrapper, another venv's python) is not judged."""
    import dvfs.engines.sglang_args as sglang_args

    campaign, _ = _one_cell_stub(tmp_path)
    text = campaign.read_text()
    start = text.index("server_command")
    campaign.write_text(text[:start] + text[text.index("\n", start) + 1 :])
    monkeypatch.setattr(sglang_args, "sglang_importable", lambda: False)
    runner = CliRunner()
    checked = runner.invoke(cli, ["doctor", str(campaign), "--out", str(tmp_path / "c")])
    out = tmp_path / "out"
    swept = runner.invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    said = "sglang is not installed in this environment: pip install 'dvfs[sglang]'"
    assert checked.exit_code == 1, checked.output
    assert said in " ".join(checked.output.split())
    assert swept.exit_code == 1, swept.output
    assert said in " ".join(swept.output.split())
    assert "retry" not in swept.output
    assert not (out / "journal.jsonl").exists()
    # A fleet's workers (threads of this process) start theirs from this Python too.
    fleet = runner.invoke(
        cli, ["sweep", str(campaign), "--out", str(out), "--gpus", "0-1", "--no-progress"]
    )
    assert fleet.exit_code == 1, fleet.output
    assert said in " ".join(fleet.output.split()) and "retry" not in fleet.output
    assert not (out / "journal.jsonl").exists()
    (tmp_path / "wrapped").mkdir()
    wrapped, _ = _one_cell_stub(tmp_path / "wrapped")
    assert sglang_args.not_installed(load_campaign(wrapped)) is None
    demo = Path(dvfs.__file__).parent.parent / "sweeps" / "demo.toml"  # the twin's engine
    assert sglang_args.not_installed(load_campaign(demo)) is None


def _ray_driver_campaign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A campaign of the default server command on NVML GPU 0 for a driver where sglang is
    not installed (as a Ray driver may be)."""
    import dvfs.engines.sglang_args as sglang_args

    monkeypatch.setattr(sglang_args, "sglang_importable", lambda: False)
    campaign, _ = stub_campaign(
        tmp_path,
        gpu='backend = "nvml"\ndevices = [0]',
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
    )
    text = campaign.read_text()
    start = text.index("server_command")
    campaign.write_text(text[:start] + text[text.index("\n", start) + 1 :])
    return campaign


def test_doctor_on_a_ray_driver_leaves_sglang_and_the_gpus_to_the_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs sweep --executor ray` starts no server on its driver (the Ray actors start them,
    from their nodes' Python) and opens no real GPU there, so the driver needs neither sglang
    nor NVML; yet doctor, run there, failed "sglang is not installed in this environment" and
    had no way to be told the run was Ray's. `--executor ray` checks it as that sweep runs it:
    the servers and GPUs said to be the nodes', for `dvfs doctor` on a node."""
    campaign = _ray_driver_campaign(tmp_path, monkeypatch)
    out = str(tmp_path / "out")
    ray = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", out, "--executor", "ray"])
    said = " ".join(ray.output.split())
    assert ray.exit_code == 0, said
    assert "sglang is not installed" not in said and "FAIL" not in said, said
    assert "engine: the SGLang servers start on the Ray workers' nodes" in said, said
    assert "gpu: the Ray workers' nodes' GPUs" in said, said
    local = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", out])
    assert local.exit_code == 1 and "sglang is not installed" in local.output, local.output


def test_doctor_on_a_ray_driver_leaves_the_model_path_to_the_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs sweep --executor ray` starts its servers on the Ray workers' nodes, which read
    the model's path there (a shared disk the driver need not mount); `dvfs doctor --executor
    ray` on the driver failed it, exit 1: "no such path: engine.model '/shared/...': SGLang
    would fail to start on it". It is a warning naming the nodes; without Ray, still a
    failure."""
    campaign = _ray_driver_campaign(tmp_path, monkeypatch)
    text = campaign.read_text()
    model = str(tmp_path / "shared" / "models" / "target")  # not on this host
    start = text.index("\nmodel = ") + 1
    campaign.write_text(f"{text[:start]}model = {model!r}{text[text.index(chr(10), start) :]}")
    out = str(tmp_path / "out")
    ray = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", out, "--executor", "ray"])
    said = " ".join(ray.output.split())
    assert ray.exit_code == 0 and "FAIL" not in said, said
    # doctor wraps to the console's width, the model's long path mid-word too (a temporary
    # folder's, longer under xdist): compared without spaces
    assert "".join(
        (
            f"warn models: no such path on this driver: engine.model {model!r}; fine if the Ray "
            "workers' nodes have it (`dvfs doctor` on a node checks it), else correct the path"
        ).split()
    ) in "".join(said.split()), said
    local = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", out])
    assert local.exit_code == 1, local.output
    assert "".join(f"FAIL models: no such path: engine.model {model!r}".split()) in "".join(
        local.output.split()
    ), local.output


def test_doctor_on_a_ray_driver_refuses_gpus_as_the_sweep_does(tmp_path: Path) -> None:
    """`dvfs sweep --executor ray --gpus 0` is refused, exit 2 (Ray places the workers on
    the cluster's GPUs); `dvfs doctor --executor ray --gpus 0` passed it, exit 0, so the
    preflight passed a command line the sweep then refused. Doctor refuses it in the same
    line."""
    campaign, _ = stub_campaign(
        tmp_path,
        gpu='backend = "nvml"\ndevices = [0]',
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
    )
    out = str(tmp_path / "out")
    said = "with --executor ray, Ray places the workers on the cluster's GPUs: leave out --gpus"
    runner = CliRunner()
    for command in ("sweep", "doctor"):
        args = [command, str(campaign), "--out", out, "--executor", "ray", "--gpus", "0"]
        refused = runner.invoke(cli, args)
        assert refused.exit_code == 2, refused.output
        assert said in " ".join(refused.output.split()), refused.output
    assert not (tmp_path / "out").exists()


def test_doctor_on_a_ray_driver_without_ray_fails_as_the_sweep_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs sweep --executor ray` on a driver without Ray is refused, exit 2 ("--executor ray
    needs Ray, which is not installed"); `dvfs doctor --executor ray` there passed, exit 0,
    checking the run as that sweep runs it. It fails in the sweep's line, exit 2, and says
    the Ray it finds."""
    campaign, _ = stub_campaign(
        tmp_path,
        gpu='backend = "nvml"\ndevices = [0]',
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
    )
    out = str(tmp_path / "out")
    runner = CliRunner()
    if importlib.util.find_spec("ray") is not None:
        found = runner.invoke(cli, ["doctor", str(campaign), "--out", out, "--executor", "ray"])
        assert "ok ray: Ray " in " ".join(found.output.split()), found.output
    monkeypatch.setitem(sys.modules, "ray", None)  # not installed: its import fails
    said = (
        "--executor ray needs Ray, which is not installed: pip install 'dvfs[ray]' (on every "
        "node of the cluster)"
    )
    for command in ("sweep", "doctor"):
        refused = runner.invoke(cli, [command, str(campaign), "--out", out, "--executor", "ray"])
        assert refused.exit_code == 2, refused.output
        assert said in " ".join(refused.output.split()), refused.output
    assert f"FAIL ray: {said}" in " ".join(refused.output.split())


def test_sglang_found_in_the_folder_the_server_starts_in_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m sglang.launch_server` finds sglang in the folder it starts in (`-m` puts it
    first on its path: a source checkout's `python/` folder), where the dvfs command (a
    console script) does not look: the sweep started the server there and measured, yet it
    and doctor refused it as not installed; unless PYTHONSAFEPATH keeps the folder off."""
    import dvfs.engines.sglang_args as sglang_args

    campaign, _ = _one_cell_stub(tmp_path)
    text = campaign.read_text()
    start = text.index("server_command")
    campaign.write_text(text[:start] + text[text.index("\n", start) + 1 :])
    checkout = tmp_path / "checkout"
    (checkout / "sglang").mkdir(parents=True)
    (checkout / "sglang" / "__init__.py").write_text("")
    # As a console script's path: neither this folder nor '' (which follows chdir) on it.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(checkout))])
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    monkeypatch.chdir(tmp_path)
    assert sglang_args.not_installed(load_campaign(campaign)) is not None
    monkeypatch.chdir(checkout)
    assert sglang_args.not_installed(load_campaign(campaign)) is None
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    assert sglang_args.not_installed(load_campaign(campaign)) is not None


def _default_server_campaign(tmp_path: Path, env: dict[str, str]) -> Path:
    """`_one_cell_stub` without its server_command (this Python's `-m sglang.launch_server`),
    engine.sglang.env adding `env`."""
    campaign, _ = _one_cell_stub(tmp_path)
    text = campaign.read_text()
    start = text.index("server_command")
    text = text[:start] + text[text.index("\n", start) + 1 :]
    extra = "".join(f", {name} = {json.dumps(value)}" for name, value in env.items())
    start = text.index("env = { SGLANG_STUB_CONFIG")
    end = text.index("}", start)
    campaign.write_text(text[:end] + extra + " " + text[end:])
    return campaign


def test_sglang_is_looked_for_where_the_servers_python_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine.sglang.env's PYTHONSAFEPATH keeps the folder the server starts in off its path,
    yet sglang found there passed (only dvfs's own PYTHONSAFEPATH counted) and every server
    start failed; its PYTHONUSERBASE points the server's user site elsewhere, yet sglang
    installed there was refused as not installed. The server's Python is asked, in its
    environment."""
    import importlib.util
    import sysconfig

    import dvfs.engines.sglang_args as sglang_args

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    checkout = tmp_path / "checkout"
    (checkout / "sglang").mkdir(parents=True)
    (checkout / "sglang" / "__init__.py").write_text("")
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    monkeypatch.chdir(checkout)
    (tmp_path / "safe").mkdir()
    safe = load_campaign(_default_server_campaign(tmp_path / "safe", {"PYTHONSAFEPATH": "1"}))
    said = sglang_args.not_installed(safe)
    assert said is not None and "engine.sglang.env sets PYTHONSAFEPATH" in said, said
    # A user site: where the server's Python has one (not a venv's), in PYTHONUSERBASE's.
    base = getattr(sys, "_base_executable", sys.executable)
    probe = "import site; print(site.ENABLE_USER_SITE)"
    enabled = subprocess.run([base, "-c", probe], capture_output=True, text=True, check=False)
    if enabled.stdout.strip() != "True":
        pytest.skip("no Python here with a user site")
    monkeypatch.setattr(sys, "executable", base)
    monkeypatch.chdir(tmp_path)
    userbase = tmp_path / "userbase"
    site_dir = Path(
        sysconfig.get_path("purelib", f"{os.name}_user", vars={"userbase": str(userbase)})
    )
    (site_dir / "sglang").mkdir(parents=True)
    (site_dir / "sglang" / "__init__.py").write_text("")
    (tmp_path / "user").mkdir()
    user = load_campaign(
        _default_server_campaign(tmp_path / "user", {"PYTHONUSERBASE": str(userbase)})
    )
    assert sglang_args.not_installed(user) is None
    (site_dir / "sglang" / "__init__.py").unlink()
    (site_dir / "sglang").rmdir()
    assert sglang_args.not_installed(user) is not None


def _default_server_without_sglang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A one-cell campaign of the default server command where sglang is not installed and
    launch_server --help cannot run."""
    import dvfs.engines.sglang_args as sglang_args

    campaign, _ = _one_cell_stub(tmp_path)
    text = campaign.read_text()
    start = text.index("server_command")
    campaign.write_text(text[:start] + text[text.index("\n", start) + 1 :])
    monkeypatch.setattr(sglang_args, "sglang_importable", lambda: False)
    monkeypatch.setattr(sglang_args, "probe_help", lambda *_a, **_k: None)
    return campaign


def test_dry_run_of_the_default_server_command_without_sglang_says_the_sweep_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where sglang is not installed the dry run said only to set engine.sglang.version (its
    --help could not run), after which it was quiet and the sweep still refused: it names the
    refusal and its remedy, the plan still printed (it may be for another machine)."""
    campaign = _default_server_without_sglang(tmp_path, monkeypatch)
    planned = CliRunner().invoke(
        cli,
        [
            "sweep",
            str(campaign),
            "--out",
            str(tmp_path / "o"),
            "--dry-run",
            "--json",
            "--no-estimate",
        ],
    )
    assert planned.exit_code == 0, planned.output
    said = json.loads(planned.output)["servers"][0]["flags_from"]
    assert "pip install 'dvfs[sglang]'" in said and "engine.sglang.version" in said


def test_the_dry_runs_text_keeps_the_sglang_extra_in_its_pip_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The text dry run printed the flag source as rich markup, which took `[sglang]` for a
    tag and dropped it: "sglang is not installed in this environment: pip install 'dvfs'",
    an install without SGLang. It prints `pip install 'dvfs[sglang]'`, as --json says."""
    campaign = _default_server_without_sglang(tmp_path, monkeypatch)
    args = ["sweep", str(campaign), "--out", str(tmp_path / "o"), "--dry-run", "--no-estimate"]
    planned = CliRunner().invoke(cli, args)
    assert planned.exit_code == 0, planned.output
    said = " ".join(planned.output.split())
    assert "sglang is not installed in this environment: pip install 'dvfs[sglang]'" in said, said


def test_a_ray_dry_run_does_not_say_the_sweep_refuses_without_sglang_on_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs sweep --executor ray` starts its servers on the Ray workers' nodes and does not
    refuse a driver without sglang; its dry run there said "sglang is not installed in this
    environment: pip install 'dvfs[sglang]', as the sweep here refuses without it". It says
    only that launch_server --help could not run here; the local dry run still names the
    refusal."""
    campaign = _default_server_without_sglang(tmp_path, monkeypatch)
    args = ["sweep", str(campaign), "--out", str(tmp_path / "o"), "--dry-run", "--json"]
    said = {}
    for executor in ("ray", "local"):
        planned = CliRunner().invoke(cli, [*args, "--no-estimate", "--executor", executor])
        assert planned.exit_code == 0, planned.output
        said[executor] = json.loads(planned.output)["servers"][0]["flags_from"]
    assert said["ray"] == (
        "assumed SGLang >= 0.5.23 (launch_server --help could not run here; set "
        "engine.sglang.version)"
    )
    assert "as the sweep here refuses without it" in said["local"]
