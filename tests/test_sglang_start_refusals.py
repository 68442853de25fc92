"""A real SGLang server that refuses to start for the campaign as it is (the weights leave the
KV cache nothing, CUDA out of memory as it loads or captures its graphs, a --context-length
above the model's, a pool too small for a request) fails its cells as one SGLang would not
start (`ServerUnfitError`), as the twin's do: the sweep's closing line and `dvfs cube info`
say what to change in the campaign and to sweep with --fresh, not to rerun the same command,
which meets the same refusal. A server that crashes as it starts for another reason is still
told to rerun. Through the CLI, the real engine and the stub server started as SGLang is
(tests/fakes/sglang_stub.py's `start_failure`, printing SGLang's own lines and exiting as it
does)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hypothesis import given
from hypothesis import strategies as st
from nvml_support import dvfs_in_process, fake_env, fresh_fake
from sglang_support import EAGLE3_DRAFTER, running, stub_campaign

from dvfs.campaign.model import DrafterSpec
from dvfs.cli import cli
from dvfs.engines import sglang as sglang_engine
from dvfs.engines.sglang_refusals import _rank_of, start_refusal
from dvfs.errors import START_UNFIT

ONE_DRAFTER = '\n[drafters.none]\nalgorithm = "none"\n'
EAGLE3_ONLY = EAGLE3_DRAFTER
RERUN = "rerun the same command to retry them"
#: What a changed campaign is told to run with.
FRESH = "then run it with --fresh"
SMALLER = (
    "use more GPUs per server (gpu.devices, and engine.tp_size where given) or a smaller model"
)
SMALLER_DRAFT = (
    "use a smaller draft model than draft/eagle3, more GPUs per server (gpu.devices, and "
    "engine.tp_size where given) or a smaller model"
)
GRAPHS = (
    "(more memory outside its static pool), or a smaller largest batch in workload.batch (dvfs "
    "sets --cuda-graph-max-bs-decode to it)"
)

#: id: (the stub's start_failure, engine.sglang.extra_args, drafters, the fix the line names)
CASES: dict[str, tuple[str | None, list[str], str, str]] = {
    "kv-cache": (
        "kv_cache",
        [],
        ONE_DRAFTER,
        "give a --mem-fraction-static above SGLang's default in engine.sglang.extra_args, or "
        + SMALLER,
    ),
    "kv-cache-fraction-given": (
        "kv_cache",
        ["--mem-fraction-static", "0.5"],
        ONE_DRAFTER,
        f"raise --mem-fraction-static above 0.5 in engine.sglang.extra_args, or {SMALLER}",
    ),
    "weights-oom": ("weights_oom", [], ONE_DRAFTER, SMALLER),
    # The target's KV cache took the static memory before the draft model loaded: a lower
    # fraction leaves the draft room, the first way out.
    "draft-oom": (
        "draft_oom",
        [],
        EAGLE3_ONLY,
        "give a --mem-fraction-static below SGLang's default in engine.sglang.extra_args (room "
        f"outside its static pool for the draft model), or {SMALLER_DRAFT}",
    ),
    "draft-oom-fraction-given": (
        "draft_oom",
        ["--mem-fraction-static", "0.9"],
        EAGLE3_ONLY,
        "lower --mem-fraction-static below 0.9 in engine.sglang.extra_args (room outside its "
        f"static pool for the draft model), or {SMALLER_DRAFT}",
    ),
    "graph-oom": (
        "graph_oom",
        ["--mem-fraction-static", "0.9"],
        ONE_DRAFTER,
        f"lower --mem-fraction-static below 0.9 in engine.sglang.extra_args {GRAPHS}",
    ),
    "context-length": (
        None,
        ["--context-length", "200000"],
        ONE_DRAFTER,
        "give --context-length at most 131072 in engine.sglang.extra_args, or set "
        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 in engine.sglang.env",
    ),
    # The least SGLang starts with, not the number given: 6 fails as 5 does.
    "pool-too-small": (
        None,
        ["--max-total-tokens", "5"],
        ONE_DRAFTER,
        "give a --max-total-tokens above 6 in engine.sglang.extra_args",
    ),
    # As argparse reads it: an abbreviation is the flag.
    "pool-too-small-abbreviated": (
        None,
        ["--max-total-tok", "5"],
        ONE_DRAFTER,
        "give a --max-total-tokens above 6 in engine.sglang.extra_args",
    ),
    "pool-and-context-too-small": (
        None,
        ["--context-length", "4", "--max-total-tokens", "6"],
        ONE_DRAFTER,
        "give a --context-length above 6 in engine.sglang.extra_args and a --max-total-tokens "
        "above 6 in engine.sglang.extra_args",
    ),
}


def _campaign(
    tmp_path: Path,
    failure: str | None,
    extra: list[str],
    drafters: str = ONE_DRAFTER,
    version: str = "0.5.23",
) -> tuple[Path, str]:
    """One cell (one batch, one clock) of the stub, failing its start as `failure` says."""
    return stub_campaign(
        tmp_path,
        version=version,
        stub={"start_failure": failure} if failure else None,
        drafters=drafters,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        sglang_extra=f"extra_args = {json.dumps(extra)}" if extra else "",
        retries=0,
    )


def _sweep(campaign: Path, out: Path) -> tuple[Result, str]:
    result = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"], catch_exceptions=False
    )
    return result, " ".join(result.output.split())


def _errors(out: Path) -> list[str]:
    records = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    return [r["error"] for r in records if r.get("type") == "cell" and r["status"] != "ok"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_server_sglang_refuses_to_start_says_to_change_the_campaign_not_to_rerun(
    tmp_path: Path, case: str
) -> None:
    """The stub fails its start as SGLang does for the campaign as it is: the cell's error is
    one line saying SGLang would not start it, why, in SGLang's own words, and what to
    change; the closing line and `dvfs cube info` (text and --json) tell to change the
    campaign so and sweep with --fresh, not to rerun the same command. Before, the start was a
    plain EngineError, whose advice was to rerun, which fails it again."""
    failure, extra, drafters, fix = CASES[case]
    campaign, marker = _campaign(tmp_path, failure, extra, drafters)
    out = tmp_path / "out"
    result, said = _sweep(campaign, out)
    assert result.exit_code == 5, result.output
    assert running(marker) == []
    [error] = _errors(out)
    assert error.startswith(START_UNFIT), error
    assert "\n" not in error and "Traceback" not in error, error
    assert error.endswith(f": {fix}"), error
    assert "0 cell(s) measured, 1 failed" in said, said
    drafter = "eagle3" if drafters is EAGLE3_ONLY else "none"
    assert f"they failed as SGLang would not start the server of drafter '{drafter}'" in said
    assert f"change the campaign ({fix})" in said and FRESH in said, said
    assert RERUN not in said, said
    info = json.loads(CliRunner().invoke(cli, ["cube", "info", str(out), "--json"]).output)
    assert fix in info["resume"] and "--fresh" in info["resume"], info["resume"]
    assert "run the same `dvfs sweep` command again" not in info["resume"], info["resume"]
    text = " ".join(CliRunner().invoke(cli, ["cube", "info", str(out)]).output.split())
    assert f"change the campaign ({fix})" in text, text


#: id: (SGLang's version, the stub's start_failure, engine.sglang.extra_args, SGLang's own hint
#: in the server's log, what the error says happened, the fix it names)
GRAPH_CASES: dict[str, tuple[str, str, list[str], str, str, str]] = {
    # 0.5.23 has no --cuda-graph-max-bs (an ambiguous prefix there): its hint names -decode.
    "decode-0.5.23": (
        "0.5.23",
        "graph_oom",
        [],
        "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)",
        "capturing its CUDA graphs",
        "or a smaller largest batch in workload.batch (dvfs sets --cuda-graph-max-bs-decode to it)",
    ),
    "decode-0.5.9": (
        "0.5.9",
        "graph_oom",
        [],
        "2. set --cuda-graph-max-bs to a smaller value (e.g., 16)",
        "capturing its CUDA graphs",
        "or a smaller largest batch in workload.batch (dvfs sets --cuda-graph-max-bs to it)",
    ),
    # The prefill graph (on by default in 0.5.23) is sized in tokens, by a flag dvfs leaves to
    # the campaign, and its failure ends in torch's own line, no "Capture cuda graph failed".
    "prefill-0.5.23": (
        "0.5.23",
        "prefill_graph_oom",
        [],
        "set --cuda-graph-max-bs-prefill to a smaller value (e.g., 2048)",
        "capturing its prefill CUDA graphs",
        "or give a --cuda-graph-max-bs-prefill below 8192 in engine.sglang.extra_args (the most "
        "tokens its prefill CUDA graphs hold), or --cuda-graph-backend-prefill disabled there",
    ),
    "piecewise-0.5.9": (
        "0.5.9",
        "prefill_graph_oom",
        ["--enable-piecewise-cuda-graph"],
        "2. set --piecewise-cuda-graph-max-tokens to a smaller value (e.g., 512)",
        "capturing its prefill CUDA graphs",
        "or give a --piecewise-cuda-graph-max-tokens in engine.sglang.extra_args (the most "
        "tokens its piecewise CUDA graphs hold), or leave out --enable-piecewise-cuda-graph",
    ),
}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_a_cuda_graph_that_ran_out_of_memory_names_the_flag_of_the_running_release(
    tmp_path: Path, case: str
) -> None:
    """A CUDA graph capture that ran out of GPU memory, as each release words it (the stub
    prints the hint of the release it plays: 0.5.23's decode hint names
    --cuda-graph-max-bs-decode, the only decode flag it has): the fix names the flag that sizes
    that graph in the release the campaign runs, dvfs's own for the decode graph (the largest
    batch), the campaign's to give for the prefill graph (tokens, not the batch). Before, the
    stub's 0.5.23 hint named --cuda-graph-max-bs, the fix named no flag, and a prefill graph's
    (0.5.23's, on by default) was "after loading the weights", to shrink workload.batch, which
    does not size it; 0.5.9's piecewise one was told the same."""
    version, failure, extra, hint, what, fix = GRAPH_CASES[case]
    campaign, marker = _campaign(tmp_path, failure, extra, version=version)
    out = tmp_path / "out"
    result, said = _sweep(campaign, out)
    assert result.exit_code == 5, result.output
    assert running(marker) == []
    log = (out / "logs" / "server-none-1.log").read_text()
    assert hint in log, log
    if version == "0.5.23":
        assert "--cuda-graph-max-bs to" not in log, log
    [error] = _errors(out)
    assert error.startswith(START_UNFIT), error
    assert "\n" not in error and "Traceback" not in error, error
    assert f"the GPUs ran out of memory {what}, outside its static memory" in error, error
    assert error.endswith(
        "give a --mem-fraction-static below SGLang's default in engine.sglang.extra_args (more "
        f"memory outside its static pool), {fix}"
    ), error
    assert FRESH in said and RERUN not in said, said


def test_a_server_that_crashes_as_it_starts_is_still_told_to_rerun(tmp_path: Path) -> None:
    """A start that fails for no reason of the campaign's (an NCCL error, printed as SGLang's
    scheduler does, the process killed as SGLang's launcher kills it) stays a plain start
    failure with the log's last lines: the closing line and `dvfs cube info` say to rerun the
    same command, nothing of --fresh. Neither does a refusal an earlier run of the same start
    number wrote into the same log (appended to): only the failed server's own output counts."""
    campaign, _ = _campaign(tmp_path, "kv_cache", [])
    out = tmp_path / "out"
    _, said = _sweep(campaign, out)
    assert RERUN not in said and FRESH in said, said
    config = tmp_path / "stub.json"  # the same campaign, its server failing otherwise now
    config.write_text(json.dumps({**json.loads(config.read_text()), "start_failure": "crash"}))
    result, said = _sweep(campaign, out)
    assert result.exit_code == 5, result.output
    assert "Not enough memory" in (out / "logs" / "server-none-1.log").read_text()
    [error] = _errors(out)[-1:]
    assert error.startswith("server start failed: the 'none' server failed to start"), error
    assert "RuntimeError: NCCL error: unhandled system error" in error, error
    assert f"the cube is written without them; {RERUN} (errors are in" in said, said
    assert "--fresh" not in said and "change the campaign" not in said, said
    info = json.loads(CliRunner().invoke(cli, ["cube", "info", str(out), "--json"]).output)
    assert "change the campaign" not in info["resume"], info["resume"]


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_a_scheduler_killed_outright_as_it_starts_is_named_before_the_start_times_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """A scheduler rank killed outright as the server starts (SIGKILL, the OS's out-of-memory
    killer: no traceback, no SIGQUIT to its launcher) beside a rank waiting for it: SGLang
    0.5.9's launcher waits on the waiting rank's pipe and never notices, so the server neither
    answers nor exits. dvfs sees the dead process lie unreaped in the server's tree and fails
    the start naming it, a plain failure (rerun), long before engine.sglang.startup_timeout_s.
    Before, it waited the whole timeout and then said to give a longer one, which waits as long
    again. 0.5.23's launcher notices itself and exits, its own words in the error."""
    monkeypatch.setattr(sglang_engine, "DEAD_MEMBER_GRACE_S", 0.5, raising=False)
    monkeypatch.setattr(sglang_engine, "DEAD_MEMBER_POLL_S", 0.05, raising=False)
    campaign, marker = stub_campaign(
        tmp_path,
        version=version,
        stub={"start_failure": "scheduler_killed"},
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        startup_timeout_s=60.0,
        retries=0,
    )
    out = tmp_path / "out"
    result, said = _sweep(campaign, out)
    assert result.exit_code == 5, result.output
    assert running(marker) == []
    [error] = _errors(out)
    first = error.partition("\n")[0]
    assert first.startswith("server start failed: the 'none' server failed to start: "), error
    assert "startup_timeout_s" not in first and "not ready within" not in first, error
    if version == "0.5.9":
        assert re.search(
            r"its process \d+ \(\S+\) was killed \(SIGKILL; the OS's out-of-memory killer, most "
            r"likely: dmesg -T \| grep -i oom tells\) as the server started, and the server has "
            r"waited on it for 0.5 s without noticing ",
            first,
        ), error
        assert first.endswith("more start-up time would not help"), error
    else:
        assert "the server process exited while starting" in first, error
        assert "RuntimeError: Rank 1 scheduler died during initialization (exit code: -9)" in error
    assert f"the cube is written without them; {RERUN} (errors are in" in said, said
    assert "--fresh" not in said, said


def test_a_failed_starts_error_shows_only_that_servers_own_log_lines(tmp_path: Path) -> None:
    """A resumed sweep's server of the same start number appends to the same log: the error
    of a start that failed for no reason of the campaign's shows the last lines of that
    server's own output, not an earlier run's (here SGLang's refusal, which the campaign has
    changed since). Before, it showed the last 40 lines of the whole file, the earlier run's
    refusal and traceback among them."""
    campaign, _ = _campaign(tmp_path, "kv_cache", [])
    out = tmp_path / "out"
    _sweep(campaign, out)
    config = tmp_path / "stub.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "start_failure": "crash"}))
    result, _ = _sweep(campaign, out)
    assert result.exit_code == 5, result.output
    log = (out / "logs" / "server-none-1.log").read_text()
    assert log.count("Not enough memory") == 1 and log.count("$ ") == 2, log
    [error] = _errors(out)[-1:]
    first, _, shown = error.partition("\n--- last lines of ")
    assert first.startswith("server start failed: the 'none' server failed to start"), error
    assert "RuntimeError: NCCL error: unhandled system error" in shown, error
    assert "Received sigquit from a child process" in shown, error
    assert "Not enough memory" not in shown, error
    assert shown.count("Load weight begin") == 1, error


def test_a_crash_after_the_start_shows_only_that_servers_own_log_lines(tmp_path: Path) -> None:
    """So does a server that died once started (its first request, the warm-up): the crash's
    error on a resume shows the last lines of that server's own output, not the earlier run's
    server's, which wrote to the same log (both the stub's, each one "Uvicorn running on"
    line). Before, the last 40 lines of the whole file: both runs' servers."""
    campaign, _ = stub_campaign(
        tmp_path,
        stub={"die_after_requests": 1},
        drafters=ONE_DRAFTER,
        batch="[1]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        retries=0,
    )
    out = tmp_path / "out"
    for _ in range(2):
        result, _ = _sweep(campaign, out)
        assert result.exit_code == 5, result.output
    assert (out / "logs" / "server-none-1.log").read_text().count("Uvicorn running on") == 2
    [error] = _errors(out)[-1:]
    first, _, shown = error.partition("\n--- last lines of ")
    assert "the SGLang server died (exit code 1)" in first, error
    assert shown.count("Uvicorn running on") == 1, error
    assert shown.rstrip().endswith("die_after_requests=1 reached at #1: os._exit(1)"), error


#: id: (the stub's start_failure, engine.sglang.extra_args, the fake GPU the other process is
#: on: 1 is the server's, 0 another; whether the start is then the campaign's to change)
BESIDE: dict[str, tuple[str | None, list[str], int, bool]] = {
    "kv-cache": ("kv_cache", [], 1, False),
    "weights-oom": ("weights_oom", [], 1, False),
    "graph-oom": ("graph_oom", [], 1, False),
    "kv-cache-other-gpu": ("kv_cache", [], 0, True),
    "context-length": (None, ["--context-length", "200000"], 1, True),
}


@pytest.mark.parametrize("case", list(BESIDE))
def test_out_of_memory_beside_another_process_on_its_gpu_is_not_the_campaigns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A server that ran out of GPU memory as it started, while a process not its own held
    memory on its GPU (another tenant's job, as NVML lists it), may well fit once that one is
    gone: its cells fail as a plain start failure, naming that process, and the closing line
    says to rerun, not to change the campaign. A process on a GPU dvfs does not run the
    server on changes nothing, nor does one beside a refusal that is not of memory (a
    --context-length above the model's). Before, every such start was the campaign's to
    change, sweeping with --fresh."""
    failure, extra, gpu, unfit = BESIDE[case]
    nv = fresh_fake(tmp_path, monkeypatch, "h100-sxm,h100-sxm")
    other = subprocess.Popen(["sleep", "120"])
    try:
        nv.fake_add_process(gpu, other.pid)
        campaign, marker = stub_campaign(
            tmp_path,
            stub={"start_failure": failure} if failure else None,
            drafters=ONE_DRAFTER,
            batch="[1]",
            knobs="sm_clock = [1980]\nsettle_s = 0.0",
            sglang_extra=f"extra_args = {json.dumps(extra)}" if extra else "",
            gpu='backend = "nvml"\ndevices = [1]',
            retries=0,
        )
        out = tmp_path / "out"
        env = fake_env(tmp_path)
        result = dvfs_in_process(
            "sweep", str(campaign), "--out", str(out), "--no-progress", env=env
        )
    finally:
        other.kill()
        other.wait()
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 5, said
    assert running(marker) == []
    [error] = _errors(out)
    assert "\n" not in error and "Traceback" not in error, error
    named = f"GPU 1: process {other.pid} (sleep)"
    if unfit:
        assert error.startswith(START_UNFIT), error
        assert named not in error, error
        assert FRESH in said and RERUN not in said, said
        return
    assert error.startswith("server start failed: the 'none' server failed to start: "), error
    assert "ran out of memory" in error or "static GPU memory nothing" in error, error
    assert f"while other processes held memory on its GPUs ({named}): " in error, error
    assert error.endswith("stop them or wait until they end, then rerun the same command"), error
    assert f"the cube is written without them; {RERUN} (errors are in" in said, said
    assert "--fresh" not in said and "change the campaign" not in said, said
    info = json.loads(dvfs_in_process("cube", "info", str(out), "--json", env=env).stdout)
    assert "change the campaign" not in info["resume"], info["resume"]


DRAFTER = DrafterSpec("none")


def test_what_only_looks_like_a_refusal_is_none() -> None:
    """SGLang's warning of a longer context it was allowed to serve, and a CUDA graph capture
    that failed for another reason than memory (newer releases say "This is not an
    out-of-memory error"), are no refusal: their start failed otherwise, a rerun may pass. Nor
    is a warning that quotes an out-of-memory error it survived (FlashInfer's autotuner skipping
    a tactic): only an exception's line, as a traceback ends, says the start ran out of memory;
    before, any line naming one did. Nor is running out before any weights began to load."""
    warned = (
        "[2026-02-14 02:07:50] Warning: User-specified context_length (200000) is greater than "
        "the derived context_length (131072). This may lead to incorrect model outputs or CUDA "
        "errors. Note that the derived context_length may differ from max_position_embeddings "
        "in the model's config.\nRuntimeError: NCCL error: unhandled system error"
    )
    assert start_refusal(warned, DRAFTER, [], 1) is None
    graph = (
        "Exception: Capture cuda graph failed: Ninja build failed.\nThis is not an out-of-memory "
        "error, so lowering --mem-fraction-static or --cuda-graph-max-bs-decode will not help."
    )
    assert start_refusal(graph, DRAFTER, [], 1) is None
    # A warning quoting an out-of-memory error it survived, then a start failed otherwise.
    survived = (
        "[2026-02-14 02:07:50 TP0] [Autotuner]: Skipping tactic 3, due to failure while "
        "profiling: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
        "[2026-02-14 02:07:51 TP0] Scheduler hit an exception: Traceback (most recent call "
        "last):\nRuntimeError: NCCL error: unhandled system error"
    )
    assert start_refusal(survived, DRAFTER, [], 1) is None
    # Out of memory before any weights began to load (its CUDA context, NCCL's buffers): the
    # GPU was full already, which nothing in the campaign leaves it; before, that was "after
    # loading the weights", to lower --mem-fraction-static.
    early = (
        "[2026-02-14 02:07:48 TP0] Init torch distributed begin.\n"
        "RuntimeError: CUDA error: out of memory\n"
        "CUDA kernel errors might be asynchronously reported at some other API call"
    )
    assert start_refusal(early, DRAFTER, [], 1) is None
    # The same error as the start's own end, its weights loaded, is one.
    ended = (
        "[2026-02-14 02:07:40 TP0] Load weight begin. avail mem=78.50 GB\n"
        "[2026-02-14 02:07:45 TP0] Load weight end. avail mem=63.40 GB\n"
        + survived
        + "\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1 GiB."
    )
    refusal = start_refusal(ended, DRAFTER, [], 1)
    assert refusal is not None and refusal.said.startswith(
        "CUDA out of memory. Tried to allocate 1"
    )
    # So it is where the log's tail, read, lost the "begin" line but not the "end" one.
    refusal = start_refusal(ended.partition("\n")[2], DRAFTER, [], 1)
    assert refusal is not None and "after loading the weights" in refusal.why, refusal


def test_a_log_in_colour_or_with_bytes_that_do_not_print_is_read_and_quoted_on_one_line() -> None:
    """A server log written in colour (FORCE_COLOR, Python 3.13's coloured tracebacks) holds
    ANSI escapes before an exception's name, which hid its out-of-memory line (no refusal: a
    rerun met it again); and escapes or bytes that do not print (a NUL, a bell, the replaced
    bytes of a binary log) went into the refusal's quote, its one line."""
    esc = "\x1b"
    loaded = (
        "[2026-02-14 02:07:40 TP0] Load weight begin. avail mem=78.50 GB\n"
        "[2026-02-14 02:07:45 TP0] Load weight end. avail mem=63.40 GB\n"
    )
    coloured = (
        loaded + f"{esc}[1;35mtorch.OutOfMemoryError{esc}[0m: {esc}[35mCUDA out of memory. "
        f"Tried to allocate 1 GiB.{esc}[0m\n"
    )
    refusal = start_refusal(coloured, DRAFTER, [], 1)
    assert refusal is not None and refusal.said == "CUDA out of memory. Tried to allocate 1 GiB."
    binary = (
        "\x00\ufffd\x07"
        * 100
        + f"\n{esc}[31m[2026-02-14 02:07:50 TP0] RuntimeError: Not enough memory. Please try to "
        f"increase --mem-fraction-static.{esc}[0m\x00\x07\ttail\n\ufffd\x00"
    )
    refusal = start_refusal(binary, DRAFTER, [], 1)
    assert refusal is not None
    said = refusal.message("d", "log")
    assert all(c.isprintable() for c in said), said
    assert "increase --mem-fraction-static.??" in said, said
    # Cut short mid-line (the log's tail read from within a line, or the server killed as it
    # wrote): no refusal read off half of one.
    assert (
        start_refusal("RuntimeError: Not enough memory. Please try to increa", DRAFTER, [], 1)
        is None
    )


def test_sglangs_own_static_fraction_is_named_where_its_log_says_it() -> None:
    """Where the campaign leaves --mem-fraction-static to SGLang, the fix names the fraction
    the server resolved, as its log says it (its server_args line as it starts; 0.5.23's
    "Not enough memory" line), so that the operator knows what to go above or below. Before,
    only "SGLang's default", which differs by GPU, TP and drafter and is nowhere else."""
    args = (
        "[2026-02-14 02:07:40] server_args=ServerArgs(model_path='m', tp_size=1, "
        "mem_fraction_static=0.836, max_running_requests=64, chunked_prefill_size=8192)\n"
    )
    kv = "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."
    refusal = start_refusal(args + kv, DRAFTER, [], 1)
    assert refusal is not None
    assert refusal.fix.startswith(
        "give a --mem-fraction-static above SGLang's default (0.836 here) in "
        "engine.sglang.extra_args, or "
    ), refusal.fix
    current = kv + " Current value: mem_fraction_static=0.81"
    refusal = start_refusal(current, DRAFTER, [], 1)
    assert refusal is not None and "above SGLang's default (0.81 here) in " in refusal.fix
    graph = "Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 2 GiB"
    refusal = start_refusal(args + graph, DRAFTER, [], 1)
    assert refusal is not None
    assert refusal.fix.startswith(
        "give a --mem-fraction-static below SGLang's default (0.836 here) in "
    ), refusal.fix
    assert ": " not in refusal.fix  # the closing line reads the fix after the last ": "


def test_a_pool_too_small_under_a_large_max_total_tokens_is_short_of_memory() -> None:
    """--max-total-tokens only caps the KV pool SGLang sizes from the memory left: a pool too
    small for one request under a cap of 100000 was short of memory, and raising the cap
    changes nothing. Before, the fix said to give a --max-total-tokens above 100000."""
    log = "AssertionError: Memory pool size is too small"
    launch = ["--max-total-tokens", "100000", "--mem-fraction-static", "0.5"]
    refusal = start_refusal(log, DRAFTER, launch, 1)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.fix.startswith("raise --mem-fraction-static above 0.5 in "), refusal.fix
    assert "--max-total-tokens" not in refusal.fix, refusal.fix


NCCL_AT_TP_START = (
    "[2026-02-14 02:07:48 TP1] Init torch distributed begin.\n"
    "h100:4711:4790 [1] include/alloc.h:124 NCCL WARN Cuda failure 'out of memory'\n"
    "[2026-02-14 02:07:49 TP1] Scheduler hit an exception: Traceback (most recent call last):\n"
    "RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)"
)
LOADED_TP2 = (
    "[2026-02-14 02:07:40 TP0] Load weight begin. avail mem=78.50 GB\n"
    "[2026-02-14 02:07:40 TP1] Load weight begin. avail mem=78.50 GB\n"
    "[2026-02-14 02:07:45 TP0] Load weight end. avail mem=63.40 GB\n"
    "[2026-02-14 02:07:45 TP1] Load weight end. avail mem=63.40 GB\n"
)


def test_nccl_out_of_memory_is_read_as_sglangs_own_by_when_it_came() -> None:
    """NCCL words a failed CUDA allocation its own way ("Cuda failure 'out of memory'", the
    driver's "Cuda failure 2 'out of memory'"), the start ending in its "unhandled cuda error"
    (SGLang's pynccl: "NCCL error: ..."; torch's ProcessGroupNCCL: "NCCL error in: ...", NCCL's
    warning after "Last error:"). As the tensor-parallel communicators are set up, before any
    weights, the GPU was full already: no refusal, a rerun may pass. Once the weights loaded
    (NCCL allocating at a later first collective, a graph capture), the static pool left too
    little outside it: the campaign's to change, as torch's out of memory there. Before, it was
    never read as out of memory: a plain failure, to rerun, which meets it again."""
    assert start_refusal(NCCL_AT_TP_START, DRAFTER, [], 2) is None
    capture = (
        LOADED_TP2
        + "[2026-02-14 02:07:50 TP1] Capture cuda graph begin. This can take up to several "
        "minutes. avail mem=1.10 GB\n"
        "h100:4711:4790 [1] transport/p2p.cc:275 NCCL WARN Cuda failure 2 'out of memory'\n"
        + NCCL_AT_TP_START.partition("\n")[2].partition("\n")[2]
    )
    refusal = start_refusal(capture, DRAFTER, ["--cuda-graph-max-bs", "8"], 2)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why == (
        "NCCL ran out of GPU memory capturing its CUDA graphs, outside its static memory"
    )
    assert refusal.said == "Cuda failure 2 'out of memory'"
    assert refusal.fix.endswith("(dvfs sets --cuda-graph-max-bs to it)"), refusal.fix
    torch_pg = (
        LOADED_TP2 + "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/"
        "distributed/c10d/NCCLUtils.cpp:77, unhandled cuda error (run with NCCL_DEBUG=INFO for "
        "details), NCCL version 2.27.3\nncclUnhandledCudaError: Call to CUDA function failed.\n"
        "Last error:\nCuda failure 'out of memory'"
    )
    refusal = start_refusal(torch_pg, DRAFTER, ["--mem-fraction-static", "0.9"], 2)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why.startswith("NCCL ran out of GPU memory after loading the weights"), refusal
    assert refusal.fix.startswith("lower --mem-fraction-static below 0.9 in "), refusal.fix
    # NCCL's warning alone, its call then retried or passed over, ended no start.
    survived = LOADED_TP2 + NCCL_AT_TP_START.replace("unhandled cuda error", "internal error")
    assert start_refusal(survived, DRAFTER, [], 2) is None


def test_a_prefill_graph_out_of_memory_is_read_at_a_raised_log_level() -> None:
    """With a --log-level above info in extra_args, SGLang logs no "Load weight begin/end" and
    no "Capture ... CUDA graph begin" lines. 0.5.23's prefill graph (breakable, on by default)
    that ran out of memory still logs its error with "Fail when using backend: breakable for
    prefill runner." and the hint naming --cuda-graph-max-bs-prefill, its traceback ending in
    torch's own line: a refusal, its prefill graph's flag named. Before, with no weights seen
    loading, it was read as out of memory before any weights (the GPU full already): no
    refusal, a plain failure to rerun, which meets it again."""
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB."
    log = "\n".join(
        [
            f"[2026-02-14 02:07:50 TP0] {oom}",
            "Fail when using backend: breakable for prefill runner.",
            "Possible suggestions:",
            "1. disable the prefill CUDA graph by --cuda-graph-backend-prefill=disabled",
            "2. if it is an OOM problem, set --mem-fraction-static to a smaller value (e.g., 0.8 "
            "or 0.7) or set --cuda-graph-max-bs-prefill to a smaller value (e.g., 2048)",
            "[2026-02-14 02:07:50 TP0] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            '  File "sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py", in capture',
            "torch." + oom,
            "[2026-02-14 02:07:51] Received sigquit from a child process. It usually means the "
            "child failed.",
        ]
    )
    launch = ["--cuda-graph-max-bs-decode", "64", "--log-level", "warning"]
    refusal = start_refusal(log, DRAFTER, launch, 1)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why == (
        "the GPUs ran out of memory capturing its prefill CUDA graphs, outside its static memory"
    )
    assert refusal.said == "CUDA out of memory. Tried to allocate 1.96 GiB."
    assert refusal.fix.endswith(
        "or give a --cuda-graph-max-bs-prefill in engine.sglang.extra_args (the most tokens its "
        "prefill CUDA graphs hold), or --cuda-graph-backend-prefill disabled there"
    ), refusal.fix
    # The same out of memory without those words, as the first thing a start hit: still none.
    early = f"[2026-02-14 02:07:50 TP0] {oom}\ntorch.{oom}"
    assert start_refusal(early, DRAFTER, launch, 1) is None


def _chained(runner: str, hint: list[str]) -> str:
    """A graph capture's out of memory as SGLang's scheduler logs it: its runner raises
    Exception("Capture cuda graph failed: {e}\\n{hint}") inside `except RuntimeError as e`,
    with no `from`, so traceback.format_exception shows torch's error first, then "During
    handling of the above exception, another exception occurred", then SGLang's."""
    oom = "CUDA out of memory. Tried to allocate 1.96 GiB."
    return "\n".join(
        [
            "[2026-02-14 02:07:50 TP0] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            f'  File "/sglang/srt/model_executor/{runner}", line 370, in __init__',
            "    self.capture()",
            f"torch.OutOfMemoryError: {oom}",
            "",
            "During handling of the above exception, another exception occurred:",
            "",
            "Traceback (most recent call last):",
            '  File "/sglang/srt/managers/scheduler.py", line 2900, in run_scheduler_process',
            f'  File "/sglang/srt/model_executor/{runner}", line 372, in __init__',
            f"Exception: Capture cuda graph failed: {oom}",
            "Possible solutions:",
            "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)",
            *hint,
            "",
            "[2026-02-14 02:07:51] Received sigquit from a child process. It usually means the "
            "child failed.",
        ]
    )


def test_a_graph_out_of_memory_is_read_through_sglangs_chained_traceback() -> None:
    """SGLang's "Capture cuda graph failed" comes after torch's own out-of-memory line in the
    scheduler's traceback (it is raised while handling that one). With a --log-level above info
    (no "Capture ... begin" and no "Load weight" lines) it alone says the graphs ran out: a
    refusal naming the decode graph's flag (0.5.9's decode runner, 0.5.23's the same words),
    the prefill-side one's for 0.5.9's piecewise runner. Before, only the lines up to torch's
    were read for it: out of memory before any weights, no refusal, a plain failure to rerun
    (which meets it again), where before this reading it had been a refusal."""
    warn = ["--log-level", "warning"]
    decode = _chained("cuda_graph_runner.py", ["2. set --cuda-graph-max-bs to a smaller value"])
    refusal = start_refusal(decode, DRAFTER, ["--cuda-graph-max-bs", "64", *warn], 1)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why == (
        "the GPUs ran out of memory capturing its CUDA graphs, outside its static memory"
    )
    assert refusal.said == "CUDA out of memory. Tried to allocate 1.96 GiB."
    assert refusal.fix.endswith("(dvfs sets --cuda-graph-max-bs to it)"), refusal.fix
    decode_23 = _chained(
        "runner/decode_cuda_graph_runner.py",
        ["2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)"],
    )
    refusal = start_refusal(decode_23, DRAFTER, ["--cuda-graph-max-bs-decode", "64", *warn], 1)
    assert refusal is not None and refusal.fix.endswith(
        "(dvfs sets --cuda-graph-max-bs-decode to it)"
    ), refusal
    piecewise = _chained(
        "piecewise_cuda_graph_runner.py",
        ["2. set --piecewise-cuda-graph-max-tokens to a smaller value (e.g., 512)"],
    )
    refusal = start_refusal(piecewise, DRAFTER, ["--cuda-graph-max-bs", "64", *warn], 1)
    assert refusal is not None and "its prefill CUDA graphs" in refusal.why, refusal
    assert "--piecewise-cuda-graph-max-tokens in engine.sglang.extra_args" in refusal.fix


PREFILL_TOKENS = "num_tokens=[4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]"


def test_each_tensor_parallel_rank_is_read_by_its_own_capture_lines() -> None:
    """Each tensor-parallel rank logs its own "Capture ... begin/end" lines, and one rank may
    run ahead of another: 0.5.23's TP0 had captured its prefill graphs and begun its decode
    ones when TP1 ran out of memory still capturing its prefill graphs; 0.5.9's TP0 had begun
    its piecewise graph when TP1 ran out in its decode graph. The graph named, and the flag
    its fix names, is the failing rank's. Before, the last capture begun by any rank was taken
    for it: TP1's prefill graph told to shrink the batch (the decode graph's), TP1's decode
    graph told --piecewise-cuda-graph-max-tokens."""
    oom = "CUDA out of memory. Tried to allocate 1.96 GiB."
    log_23 = "\n".join(
        [
            LOADED_TP2.rstrip("\n"),
            f"[2026-02-14 02:07:46 TP0] Capture target prefill CUDA graph begin. backend="
            f"breakable, {PREFILL_TOKENS}, avail mem=5.10 GB",
            f"[2026-02-14 02:07:46 TP1] Capture target prefill CUDA graph begin. backend="
            f"breakable, {PREFILL_TOKENS}, avail mem=5.10 GB",
            "[2026-02-14 02:07:55 TP0] Capture target prefill CUDA graph end. elapsed=9.71 s, "
            "mem usage=0.62 GB, avail mem=4.48 GB.",
            "[2026-02-14 02:07:55 TP0] Capture target decode CUDA graph begin. backend=full, "
            "num_tokens_per_req=1, bs=[1, 2, 4, 8], avail mem=4.48 GB",
            f"[2026-02-14 02:07:56 TP1] OutOfMemoryError: {oom}",
            "Fail when using backend: breakable for prefill runner.",
            "[2026-02-14 02:07:56 TP1] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            '  File "/sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py", line 90, '
            "in capture",
            f"torch.OutOfMemoryError: {oom}",
        ]
    )
    launch = ["--cuda-graph-max-bs-decode", "8"]
    refusal = start_refusal(log_23, DRAFTER, launch, 2)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why == (
        "the GPUs ran out of memory capturing its prefill CUDA graphs, outside its static memory"
    ), refusal
    assert "give a --cuda-graph-max-bs-prefill below 8192 in " in refusal.fix, refusal.fix
    assert "workload.batch" not in refusal.fix, refusal.fix
    log_9 = "\n".join(
        [
            LOADED_TP2.rstrip("\n"),
            "[2026-02-14 02:07:46 TP0] Capture cuda graph begin. This can take up to several "
            "minutes. avail mem=5.10 GB",
            "[2026-02-14 02:07:46 TP1] Capture cuda graph begin. This can take up to several "
            "minutes. avail mem=5.10 GB",
            "[2026-02-14 02:07:54 TP0] Capture cuda graph end. Time elapsed: 8.12 s. mem "
            "usage=0.61 GB. avail mem=4.49 GB.",
            "[2026-02-14 02:07:54 TP0] Capture piecewise CUDA graph begin. avail mem=4.49 GB",
            _chained(
                "cuda_graph_runner.py", ["2. set --cuda-graph-max-bs to a smaller value"]
            ).replace(" TP0]", " TP1]"),
        ]
    )
    launch = ["--cuda-graph-max-bs", "8", "--enable-piecewise-cuda-graph"]
    refusal = start_refusal(log_9, DRAFTER, launch, 2)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why == (
        "the GPUs ran out of memory capturing its CUDA graphs, outside its static memory"
    ), refusal
    assert refusal.fix.endswith("(dvfs sets --cuda-graph-max-bs to it)"), refusal.fix


def test_a_0523_prefill_graph_is_told_its_own_flags_whatever_its_log_says() -> None:
    """0.5.23 has no piecewise CUDA graph flags (its option table): where its log, at a
    --log-level above info, has no capture line, its prefill graph's failure is told
    --cuda-graph-max-bs-prefill even where a line holds the word "piecewise" (here a model
    path's). Before, any such line made it 0.5.9's advice: --piecewise-cuda-graph-max-tokens
    and --enable-piecewise-cuda-graph, which 0.5.23 refuses as unknown."""
    oom = "CUDA out of memory. Tried to allocate 1.96 GiB."
    log = "\n".join(
        [
            "[2026-02-14 02:07:40 TP0] WARNING: Using the chat template of /models/piecewise "
            "linear/llama: no generation_config.json found",
            f"[2026-02-14 02:07:50 TP0] OutOfMemoryError: {oom}",
            "Fail when using backend: breakable for prefill runner.",
            "[2026-02-14 02:07:50 TP0] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            f"torch.OutOfMemoryError: {oom}",
        ]
    )
    launch = ["--cuda-graph-max-bs-decode", "64", "--log-level", "warning"]
    refusal = start_refusal(log, DRAFTER, launch, 1)
    assert refusal is not None and "its prefill CUDA graphs" in refusal.why, refusal
    assert refusal.fix.endswith(
        "or give a --cuda-graph-max-bs-prefill in engine.sglang.extra_args (the most tokens its "
        "prefill CUDA graphs hold), or --cuda-graph-backend-prefill disabled there"
    ), refusal.fix
    assert "piecewise" not in refusal.fix, refusal.fix
    # 0.5.9 (its decode graph flag in the launch) is still told its piecewise graph's flags.
    legacy = ["--cuda-graph-max-bs", "64", "--log-level", "warning"]
    refusal = start_refusal(log, DRAFTER, legacy, 1)
    assert refusal is not None and "--piecewise-cuda-graph-max-tokens" in refusal.fix, refusal


#: A kernel warm-up's out of memory as the scheduler's traceback shows it (0.5.23: the eager
#: runner's warm-up, FlashInfer's autotune, before any graph is captured).
WARMUP_FRAMES = [
    '  File "/sglang/srt/managers/scheduler.py", line 2900, in run_scheduler_process',
    '  File "/sglang/srt/model_executor/model_runner.py", line 420, in initialize',
    '  File "/sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py", line 380, '
    "in capture_cuda_graphs",
    '  File "/sglang/srt/model_executor/runner/eager_runner.py", line 150, in __init__',
    '  File "/sglang/srt/model_executor/runner/base_runner.py", line 240, in warmup',
    '  File "/sglang/srt/model_executor/runner/flashinfer_autotune.py", line 300, in '
    "run_flashinfer_autotune_forward",
    '  File "/sglang/srt/layers/moe/fused_moe.py", line 80, in forward',
]
WARMUP_FIX = (
    "give --disable-flashinfer-autotune in engine.sglang.extra_args, or a smaller largest batch "
    "in workload.batch (the autotune runs a batch of --max-running-requests, which dvfs sets to "
    "it)"
)


def test_a_kernel_warmup_out_of_memory_names_the_flag_that_skips_it() -> None:
    """SGLang warms its kernels up (FlashInfer's autotune: one forward of
    --max-running-requests requests) after the weights and KV cache, before any CUDA graph is
    captured, its "Running FlashInfer autotune" line begun and no "FlashInfer autotune
    completed." after it: out of memory there is told --disable-flashinfer-autotune (both
    releases' option tables have it) and what sizes its batch. Before, it was "after loading
    the weights", a smaller batch said to be the decode CUDA graph's (which was never begun)."""
    oom = "CUDA out of memory. Tried to allocate 3.50 GiB."
    log = "\n".join(
        [
            LOADED_TP2.rstrip("\n"),
            "[2026-02-14 02:07:46 TP0] Running FlashInfer autotune with cache: /root/.cache/"
            "sglang/flashinfer/autotune/0.6.1/sm90/3f1c/rank_tp0_pp0_dp0.json",
            "[2026-02-14 02:07:46 TP1] Running FlashInfer autotune with cache: /root/.cache/"
            "sglang/flashinfer/autotune/0.6.1/sm90/3f1c/rank_tp1_pp0_dp0.json",
            "[2026-02-14 02:07:50 TP0] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            *WARMUP_FRAMES,
            f"torch.OutOfMemoryError: {oom}",
        ]
    )
    launch = ["--max-running-requests", "64", "--cuda-graph-max-bs-decode", "64"]
    refusal = start_refusal(log, DRAFTER, [*launch, "--mem-fraction-static", "0.9"], 2)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why == (
        "the GPUs ran out of memory warming up its kernels (FlashInfer autotune), outside its "
        "static memory"
    ), refusal
    assert refusal.fix == (
        "lower --mem-fraction-static below 0.9 in engine.sglang.extra_args (more memory outside "
        f"its static pool), {WARMUP_FIX}"
    ), refusal.fix
    assert ": " not in refusal.fix
    # Its autotune completed, the same out of memory came after it: no warm-up's.
    done = log.replace(
        "[2026-02-14 02:07:50 TP0] Scheduler",
        "[2026-02-14 02:07:49 TP0] FlashInfer autotune completed.\n"
        "[2026-02-14 02:07:50 TP0] Scheduler",
    )
    refusal = start_refusal(done, DRAFTER, launch, 2)
    assert refusal is not None and "after loading the weights" in refusal.why, refusal


def test_an_nccl_out_of_memory_at_a_raised_log_level_is_timed_by_its_traceback() -> None:
    """With a --log-level above info SGLang logs no "Load weight" line, so their absence does
    not say the start ran out before any weights: the scheduler's traceback does, by the
    frame it failed in. NCCL out of memory at its first collective in the kernel warm-up (after
    the weights) is a refusal, told as the warm-up's; in `init_torch_distributed`, as its
    communicators were set up, it stays none (the GPU was full already), as does one whose
    traceback names no such frame. Before, every one was read as before any weights: a plain
    failure to rerun, which meets it again."""
    warn = "h100:4711:4790 [1] transport/p2p.cc:275 NCCL WARN Cuda failure 2 'out of memory'"
    header = (
        "[2026-02-14 02:07:50 TP1] Scheduler hit an exception: Traceback (most recent call last):"
    )
    fatal = "RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)"
    nccl = (
        '  File "/sglang/srt/distributed/device_communicators/pynccl.py", line 150, in all_reduce'
    )
    launch = ["--cuda-graph-max-bs-decode", "64", "--log-level", "warning"]
    log = "\n".join([warn, header, *WARMUP_FRAMES, nccl, fatal])
    refusal = start_refusal(log, DRAFTER, launch, 2)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why == (
        "NCCL ran out of GPU memory warming up its kernels (FlashInfer autotune), outside its "
        "static memory"
    ), refusal
    assert refusal.said == "Cuda failure 2 'out of memory'"
    assert refusal.fix.endswith(WARMUP_FIX), refusal.fix
    setup = [
        '  File "/sglang/srt/model_executor/model_runner.py", line 330, in __init__',
        '  File "/sglang/srt/model_executor/model_runner.py", line 380, in init_torch_distributed',
        '  File "/sglang/srt/distributed/parallel_state.py", line 1400, in '
        "initialize_model_parallel",
        nccl.replace("all_reduce", "__init__"),
    ]
    assert start_refusal("\n".join([warn, header, *setup, fatal]), DRAFTER, launch, 2) is None
    assert start_refusal("\n".join([warn, header, fatal]), DRAFTER, launch, 2) is None
    # torch's own out of memory as the KV cache is sized, at the same log level, likewise.
    pool = [
        '  File "/sglang/srt/model_executor/model_runner.py", line 330, in __init__',
        '  File "/sglang/srt/model_executor/model_runner.py", line 700, in init_memory_pool',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB.",
    ]
    refusal = start_refusal("\n".join([header, *pool]), DRAFTER, launch, 2)
    assert refusal is not None and "after loading the weights" in refusal.why, refusal
    # Out of memory as weights load: the target's, or (through the speculative worker) the
    # draft model's.
    loading = [
        '  File "/sglang/srt/speculative/eagle_worker.py", line 120, in __init__',
        '  File "/sglang/srt/model_executor/model_runner.py", line 500, in load_model',
        '  File "/sglang/srt/model_loader/loader.py", line 380, in load_model',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.",
    ]
    refusal = start_refusal("\n".join([header, *loading[1:]]), DRAFTER, launch, 2)
    assert refusal is not None and refusal.why.endswith("loading the weights"), refusal
    eagle = DrafterSpec("eagle3", algorithm="EAGLE3", draft_model="draft/eagle3")
    refusal = start_refusal("\n".join([header, *loading]), eagle, launch, 2)
    assert refusal is not None and "loading the draft model draft/eagle3" in refusal.why, refusal


def test_cublas_failing_to_allocate_is_out_of_memory() -> None:
    """cuBLAS words its own failed allocation (its workspace, as the first matmul creates its
    handle, in a graph capture or the warm-up after the weights): "CUDA error:
    CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", which SGLang's graph
    runners too take for out of memory (their hint says to lower --mem-fraction-static). It is
    read as out of memory, timed as any other. Before, it was no refusal: a plain failure to
    rerun, which meets it again."""
    failed = "CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    log = "\n".join(
        [
            LOADED_TP2.rstrip("\n"),
            "[2026-02-14 02:07:46 TP0] Capture cuda graph begin. This can take up to several "
            "minutes. avail mem=0.40 GB",
            "[2026-02-14 02:07:50 TP0] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            f"Exception: Capture cuda graph failed: CUDA error: {failed}",
            "Possible solutions:",
            "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)",
        ]
    )
    refusal = start_refusal(log, DRAFTER, ["--cuda-graph-max-bs", "8"], 2)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why == (
        "the GPUs ran out of memory capturing its CUDA graphs, outside its static memory"
    ), refusal
    assert refusal.said == failed, refusal
    # Its other statuses (a library or driver that does not match) are no refusal.
    other = log.replace("CUBLAS_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ARCH_MISMATCH")
    assert start_refusal(other, DRAFTER, ["--cuda-graph-max-bs", "8"], 2) is None


def test_a_warm_up_frame_without_the_autotune_is_no_autotune_out_of_memory() -> None:
    """0.5.23's runner `warmup` (base_runner.py, run once by the eager runner as its CUDA graph
    setup begins) also sets up FlashInfer's allreduce workspaces and the model's resources, for
    a dense model with no autotune at all: out of memory there, at a --log-level above info (no
    log line says how far it came), is its CUDA graph setup's, not the autotune's. Before, the
    frame's name `warmup` alone told --disable-flashinfer-autotune, which changes nothing
    there."""
    oom = "CUDA out of memory. Tried to allocate 2.00 GiB."
    frames = [
        '  File "/sglang/srt/managers/scheduler.py", line 2900, in run_scheduler_process',
        '  File "/sglang/srt/model_executor/model_runner.py", line 1192, in init_cuda_graphs',
        '  File "/sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py", '
        "line 416, in capture_cuda_graphs",
        '  File "/sglang/srt/model_executor/runner/eager_runner.py", line 153, in __init__',
        '  File "/sglang/srt/model_executor/runner/base_runner.py", line 255, in warmup',
        '  File "/sglang/srt/model_executor/runner/base_runner.py", line 267, in _warmup',
        '  File "/sglang/srt/model_executor/runner/base_runner.py", line 330, in '
        "_pre_initialize_flashinfer_allreduce_workspace",
        '  File "/sglang/srt/layers/flashinfer_comm_fusion.py", line 120, in '
        "pre_initialize_workspaces",
    ]
    log = "\n".join(
        [
            "[2026-02-14 02:07:50 TP0] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            *frames,
            f"torch.OutOfMemoryError: {oom}",
        ]
    )
    launch = ["--cuda-graph-max-bs-decode", "64", "--log-level", "warning"]
    refusal = start_refusal(log, DRAFTER, launch, 2)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why == (
        "the GPUs ran out of memory capturing its CUDA graphs, outside its static memory"
    ), refusal
    assert "autotune" not in refusal.fix, refusal.fix
    assert refusal.fix.endswith("(dvfs sets --cuda-graph-max-bs-decode to it)"), refusal.fix
    # The autotune's own frame below the warm-up's still tells it.
    tuned = log.replace("_pre_initialize_flashinfer_allreduce_workspace", "_flashinfer_autotune")
    refusal = start_refusal(tuned, DRAFTER, launch, 2)
    assert refusal is not None and "--disable-flashinfer-autotune" in refusal.fix, refusal


def test_a_draft_named_in_the_install_path_is_no_draft_model_loading() -> None:
    """Where no log line says how far a start came (a --log-level above info), the traceback's
    frames tell whose weights were loading by SGLang's own modules (its speculative workers),
    not by the folders SGLang is installed under: a virtual environment in
    /home/me/draft-study/ running out of memory loading the target's weights of an EAGLE3
    server is the target's, told more GPUs or a smaller model. Before, the word "draft" in
    every frame's path made it the draft model's, told to lower --mem-fraction-static."""
    root = "/home/me/draft-study/.venv/lib/python3.11/site-packages"
    log = "\n".join(
        [
            "[2026-02-14 02:07:50 TP0] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            f'  File "{root}/sglang/srt/managers/scheduler.py", line 2900, in '
            "run_scheduler_process",
            f'  File "{root}/sglang/srt/model_executor/model_runner.py", line 500, in load_model',
            f'  File "{root}/sglang/srt/model_loader/loader.py", line 380, in load_model',
            f'  File "{root}/torch/nn/modules/module.py", line 1340, in to',
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.",
        ]
    )
    eagle = DrafterSpec("eagle3", algorithm="EAGLE3", draft_model="draft/eagle3")
    launch = ["--cuda-graph-max-bs-decode", "8", "--log-level", "warning"]
    refusal = start_refusal(log, eagle, launch, 2)
    assert refusal is not None and refusal.memory, refusal
    assert refusal.why == "the GPUs ran out of memory loading the weights", refusal
    # Through SGLang's own speculative worker, the draft model's as before.
    drafting = log.replace(
        'model_runner.py", line 500',
        'speculative/eagle_worker_v2.py", line 120, in __init__\n'
        f'  File "{root}/sglang/srt/model_executor/model_runner.py", line 500',
    )
    refusal = start_refusal(drafting, eagle, launch, 2)
    assert refusal is not None and "loading the draft model draft/eagle3" in refusal.why, refusal


def test_a_function_named_capture_outside_the_graph_runners_is_no_graph_capture() -> None:
    """`capture` names more than the graph runners' capture in SGLang 0.5.23: an EAGLE3
    target's forward captures its auxiliary hidden states (layers/aux_hidden_states.py, a
    clone each), also in the kernel warm-up's autotune forward. Out of memory there, at a
    --log-level above info, is the autotune's (told --disable-flashinfer-autotune). Before,
    the innermost `capture` frame made it a CUDA graph capture's, told its decode graph flag."""
    eagle = DrafterSpec("eagle3", algorithm="EAGLE3", draft_model="draft/eagle3")
    frames = [
        '  File "/sglang/srt/managers/scheduler.py", line 2900, in run_scheduler_process',
        '  File "/sglang/srt/model_executor/model_runner.py", line 1192, in init_cuda_graphs',
        '  File "/sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py", '
        "line 416, in capture_cuda_graphs",
        '  File "/sglang/srt/model_executor/runner/eager_runner.py", line 153, in __init__',
        '  File "/sglang/srt/model_executor/runner/base_runner.py", line 255, in warmup',
        '  File "/sglang/srt/model_executor/runner/base_runner.py", line 281, in _warmup',
        '  File "/sglang/srt/model_executor/runner/base_runner.py", line 340, in '
        "_flashinfer_autotune",
        '  File "/sglang/srt/model_executor/runner/flashinfer_autotune.py", line 380, in '
        "run_flashinfer_autotune_forward",
        '  File "/sglang/srt/model_executor/runner/base_runner.py", line 520, in _dummy_run',
        '  File "/sglang/srt/models/qwen3_moe.py", line 900, in forward',
        '  File "/sglang/srt/layers/aux_hidden_states.py", line 26, in capture',
    ]
    log = "\n".join(
        [
            "[2026-02-14 02:07:50 TP0] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            *frames,
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 640.00 MiB.",
        ]
    )
    launch = ["--max-running-requests", "64", "--cuda-graph-max-bs-decode", "64"]
    refusal = start_refusal(log, eagle, [*launch, "--log-level", "warning"], 2)
    assert refusal is not None and refusal.memory, refusal
    assert "warming up its kernels (FlashInfer autotune)" in refusal.why, refusal
    assert "--disable-flashinfer-autotune" in refusal.fix, refusal.fix


#: The rank prefix's reading as a regular expression (before it was read in one pass): the
#: reference the one-pass reading must agree with.
_RANK_AS_REGEX = re.compile(r"\s*\[[^\]]*?((?:\s(?:DP|PP|TP|EP|CP)\d+)+)\]")


#: A rank-like word of a log line's prefix: a separator (one whitespace character, more, or
#: none), a kind (SGLang's, or not) and digits (none, ASCII, or another script's).
_RANK_LIKE = st.tuples(
    st.sampled_from([" ", "\t", "  ", "", "a", "]"]),
    st.sampled_from(["TP", "DP", "EP", "PP", "CP", "XP", "T", ""]),
    st.sampled_from(["", "1", "12", "٣"]),
).map("".join)


@given(
    st.tuples(
        st.sampled_from(["", " ", "x"]),
        st.sampled_from(["[", "", "]"]),
        st.sampled_from(["", "2026-02-14 02:07:50", "TP1", " "]),
        st.lists(_RANK_LIKE, max_size=5).map("".join),
        st.sampled_from(["]", "", "] x", "]]"]),
    ).map("".join)
)
def test_a_lines_rank_is_read_as_the_regular_expression_read_it(line: str) -> None:
    """`_rank_of` reads a log line's rank in one pass over its prefix, as the regular
    expression it replaced did (which backtracked over every word of a long unclosed bracket)."""
    found = _RANK_AS_REGEX.match(line)
    expected = " ".join(found.group(1).split()) if found is not None else None
    assert _rank_of(line) == expected, line


def test_a_prefix_of_many_rank_words_reads_them_all() -> None:
    line = "[2026-02-14 02:07:50" + " TP1" * 5000 + " DP0] Capture cuda graph begin."
    assert _rank_of(line) == " ".join(["TP1"] * 5000 + ["DP0"])
    assert _rank_of("[" + " TP1" * 5000) is None  # never closed: no prefix
