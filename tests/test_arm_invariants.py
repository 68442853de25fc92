"""Two arms of a comparison differ only in their drafters: a drafter's extra_args take only
speculative flags; every drafter's server of one journal runs the same SGLang version, kernels
and resolved engine args (those SGLang does not adjust for speculation); an attached server
must serve the campaign's model and the drafter's algorithm. End to end through the CLI
against the stub server on loopback."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import copy_sweep, replace_block
from sglang_support import REPO, STUB, load_stub, running, stub_campaign

from dvfs.campaign.sglang_flags import non_drafter_flag
from dvfs.cli import cli
from dvfs.cube import STATUS_OK, open_cube, write_cube
from dvfs.cube.merge import AUTO_KERNEL_ARGS, GPU_DERIVED_ARGS
from dvfs.errors import MAX_MESSAGE_CHARS
from dvfs.measure.journal import read_records
from dvfs.records import (
    ARM_ARGS,
    ARMS_PINNED,
    SERVER_ENV_PREFIXES,
    arm_changes,
    begun_unpinned,
    server_changes,
    server_env_of,
)
from dvfs.records.session import DRAFTER_ARGS, SERVER_INVARIANTS
from dvfs.records.uncompared import NOT_COMPARED

TABLES = REPO / "tests" / "data" / "sglang-args"
ONE_SETTING = {"batch": "[1]", "knobs": "sm_clock = [1980]\nsettle_s = 0.0"}
TWO_DRAFTERS = """
[drafters.none]
algorithm = "none"

[drafters.ngram]
algorithm = "NGRAM"
"""


def sweep(path: Path, out: Path) -> Result:
    return CliRunner().invoke(
        cli, ["sweep", str(path), "--out", str(out), "--no-progress"], catch_exceptions=False
    )


def last_line(result: Result) -> str:
    return result.output.strip().splitlines()[-1]


#: This process's sweeps of the two-drafter stub campaign at ONE_SETTING, by `--gpus`:
#: (its campaign, the marker of its servers, its folder). Made once, read-only.
_SWEPT: dict[tuple[str, ...], tuple[Path, str, Path]] = {}


def swept_two_drafters(
    tmp_path: Path, factory: pytest.TempPathFactory, *gpus: str
) -> tuple[Path, str, Path]:
    """`stub_campaign(drafters=TWO_DRAFTERS, **ONE_SETTING)` swept whole (on `--gpus GPUS`
    when given), as this test's own copy: (its campaign in `tmp_path`, the marker of its
    servers, its folder `tmp_path/out`). The sweep (two server starts) runs once per process,
    the first test that asks; the others get a copy of its campaign and folder. Its stub
    config stays where it was made (no test here changes it), and its servers' marker is this
    process's: the tests of one process run one after another, so `running(marker)` still
    sees only the servers of the test that checks."""
    if gpus not in _SWEPT:
        base = factory.mktemp("arm-swept")
        path, marker = stub_campaign(base, drafters=TWO_DRAFTERS, **ONE_SETTING)
        out = base / "out"
        args = ["sweep", str(path), *gpus, "--out", str(out), "--no-progress"]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert running(marker) == []
        _SWEPT[gpus] = (path, marker, out)
    path, marker, out = _SWEPT[gpus]
    campaign = tmp_path / path.name
    shutil.copyfile(path, campaign)
    return campaign, marker, Path(shutil.copytree(out, tmp_path / "out"))


# -- a drafter's extra_args --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--mem-fraction-static", "0.5"),
        ("--disable-cuda-graph", None),
        ("--chunked-prefill-size", "512"),
        ("--dtype", "float16"),
        ("--quantization", "fp8"),
        ("--page-size", "16"),
        ("--page-size=16", None),
    ],
)
def test_a_drafter_flag_that_is_not_speculative_is_refused_at_load(
    tmp_path: Path, flag: str, value: str | None
) -> None:
    args = [flag] if value is None else [flag, value]
    drafters = (
        TWO_DRAFTERS + f"extra_args = {json.dumps(['--speculative-ngram-capacity', '9', *args])}"
    )
    path, marker = stub_campaign(tmp_path, drafters=drafters, **ONE_SETTING)
    result = sweep(path, tmp_path / "out")
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    name = flag.split("=")[0]
    assert line.startswith("Error: ") and "drafters.ngram.extra_args" in line
    assert f"sets {name}" in line and "'ngram'" in line
    assert f"put {name} in engine.sglang.extra_args" in line
    assert not (tmp_path / "out" / "journal.jsonl").exists()
    assert running(marker) == []


def test_the_same_flags_in_the_engine_extra_args_reach_every_server(tmp_path: Path) -> None:
    """Where the refusal points: engine.sglang.extra_args, shared by both arms (measured)."""
    path, _ = stub_campaign(
        tmp_path,
        drafters=TWO_DRAFTERS,
        sglang_extra='extra_args = ["--dtype", "float16", "--chunked-prefill-size", "512"]',
        **ONE_SETTING,
    )
    result = sweep(path, tmp_path / "out")
    assert result.exit_code == 0, result.output
    servers = [r for r in read_records(tmp_path / "out" / "journal.jsonl") if r["type"] == "server"]
    assert {s["drafter"] for s in servers} == {"none", "ngram"}
    assert {s["args"]["dtype"] for s in servers} == {"float16"}


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_every_speculative_option_of_sglang_is_a_drafter_flag(version: str) -> None:
    """Against SGLang's option tables: every --speculative-* option passes; of the options
    that mention neither speculation nor drafts, none does."""
    table = json.loads((TABLES / f"{version}.json").read_text())
    flags = [f for option in table["options"] for f in option["flags"] if f.startswith("--")]
    for flag in flags:
        if flag.startswith("--speculative-"):
            assert non_drafter_flag(flag) is None, flag
            assert non_drafter_flag(flag + "=1") is None, flag
        elif not any(word in flag for word in ("spec", "draft", "eagle")):
            assert non_drafter_flag(flag) == flag
    for value in ("16", "-1", "-0.5", "fp8"):
        assert non_drafter_flag(value) is None


def unclassified(table: Path) -> list[str]:
    """The options of an SGLang option table (as the stub, like SGLang, names each resolved
    arg) that are in none of: compared (`ARM_ARGS`, `SERVER_INVARIANTS`), the drafter's own
    (`DRAFTER_ARGS`, `speculative_*`), derived from the GPU (`GPU_DERIVED_ARGS`,
    `AUTO_KERNEL_ARGS`), or deliberately not compared (`NOT_COMPARED`); and those in more
    than one, named "name: group, group"."""
    stub = load_stub()
    groups = {
        "compared": {*ARM_ARGS, *SERVER_INVARIANTS},
        "drafter": set(DRAFTER_ARGS),
        "not compared": {name for _, names in NOT_COMPARED.values() for name in names},
    }
    gpu = {*GPU_DERIVED_ARGS, *AUTO_KERNEL_ARGS}
    found = []
    for option in json.loads(table.read_text())["options"]:
        dest = stub._dest_of(option["flags"])
        name = stub.FIELD_ALIASES.get(dest, dest)
        where = [g for g, names in groups.items() if name in names]
        if name.startswith("speculative_") and "drafter" not in where:
            where.append("drafter")
        if not where and name in gpu:  # derived from the GPU, compared on one GPU model
            where = ["GPU-derived"]
        if len(where) != 1:
            found.append(f"{name}: {', '.join(where) or 'none'}")
    return found


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_every_option_of_sglang_is_compared_or_not_with_a_reason(version: str) -> None:
    """Every launch_server option of both releases is in exactly one of: the args the arms
    are compared in, the drafter's own, those SGLang derives from the GPU, or those
    deliberately not compared, each with its reason (`NOT_COMPARED`): a new option that
    changes kernels cannot slip through unclassified."""
    assert unclassified(TABLES / f"{version}.json") == []


def test_a_new_option_of_sglang_is_found_unclassified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table holding an option no group names (a new release's kernel flag) fails the check
    above, naming it; one named twice (compared and not compared) too."""
    table = json.loads((TABLES / "0.5.23.json").read_text())
    new = {"flags": ["--enable-fake-kernel"], "action": "_StoreTrueAction", "nargs": 0}
    table["options"].append({**new, "choices": None})
    path = tmp_path / "next.json"
    path.write_text(json.dumps(table))
    assert unclassified(path) == ["enable_fake_kernel: none"]
    reason, names = NOT_COMPARED["unverified"]
    monkeypatch.setitem(NOT_COMPARED, "unverified", (reason, (*names, "enable_hisparse")))
    assert unclassified(TABLES / "0.5.23.json") == ["enable_hisparse: compared, not compared"]


def test_every_arg_not_compared_is_an_option_of_sglang_and_has_a_reason() -> None:
    """No stale or misspelt name in `NOT_COMPARED` (it would hide nothing), none twice, and
    every group says why."""
    stub = load_stub()
    names = set()
    for version in ("0.5.9", "0.5.23"):
        for option in json.loads((TABLES / f"{version}.json").read_text())["options"]:
            dest = stub._dest_of(option["flags"])
            names.add(stub.FIELD_ALIASES.get(dest, dest))
    listed = [name for _, group in NOT_COMPARED.values() for name in group]
    assert sorted(set(listed) - names) == []
    assert len(listed) == len(set(listed))
    assert not set(ARM_ARGS) - names
    assert all(len(reason) > 40 for reason, _ in NOT_COMPARED.values())


# -- every drafter's server of one journal --------------------------------------------------


def keep_first_drafter(journal: Path) -> str:
    """Cut a finished journal back to its first-started drafter's records (as if the run had
    stopped before the second server); returns the other drafter's name."""
    records = read_records(journal)
    first = next(r["drafter"] for r in records if r["type"] == "server")
    kept = [
        r
        for r in records
        if r["type"] not in ("server", "cell")
        or (r.get("drafter") or r.get("cell", {}).get("drafter")) == first
    ]
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    others = {r["drafter"] for r in records if r["type"] == "server"} - {first}
    [other] = others
    return other


def test_another_engine_version_for_the_next_drafter_is_refused(tmp_path: Path) -> None:
    """One drafter measured on 0.5.9, the run cut; rerun where the servers report 0.5.23:
    the other drafter's server is refused at start (its cells fail, nothing of it journalled),
    and a journal that mixes them anyway gives no cube."""
    path, marker = stub_campaign(tmp_path, version="0.5.9", drafters=TWO_DRAFTERS, **ONE_SETTING)
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    other = keep_first_drafter(journal)
    config = tmp_path / "stub.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "version": "0.5.23"}))
    again = sweep(path, out)
    assert again.exit_code == 5, again.output
    records = read_records(journal)
    assert {r["version"] for r in records if r["type"] == "server"} == {"0.5.9"}
    [failed] = [r for r in records if r["type"] == "cell" and r["cell"]["drafter"] == other]
    assert failed["status"] == "failed"
    assert f"the {other!r} server differs from the" in failed["error"]
    assert "engine version: 0.5.9 -> 0.5.23" in failed["error"] and "--fresh" in failed["error"]
    assert running(marker) == []  # the refused server was stopped
    # A journal mixing them (edited): no cube, in one line.
    server = next(r for r in records if r["type"] == "server")
    with journal.open("a") as f:
        f.write(json.dumps({**server, "drafter": other, "version": "0.5.23"}) + "\n")
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code != 0
    assert "were served differently (engine version: 0.5.9 -> 0.5.23)" in last_line(built)


#: Server flags that make SGLang resolve an engine arg the arms must share otherwise, and the
#: change each one is refused with: `test_a_server_resolving_other_engine_args_is_refused`.
ENGINE_ARG_CHANGES: list[tuple[list[str], str]] = [
    (["--dtype", "float16"], "dtype (dtype): 'auto' -> 'float16'"),
    (
        ["--sampling-backend", "pytorch"],
        "sampling kernels (sampling_backend): 'flashinfer' -> 'pytorch'",
    ),
    (["--enable-torch-compile"], "torch.compile (enable_torch_compile): False -> True"),
    (
        ["--enable-deterministic-inference"],
        "deterministic inference (enable_deterministic_inference): False -> True",
    ),
    (["--stream-interval", "4"], "stream interval (stream_interval): 1 -> 4"),
    (["--schedule-policy", "lpm"], "schedule policy (schedule_policy): 'fcfs' -> 'lpm'"),
    (
        ["--sampling-defaults", "openai"],
        "sampling defaults (sampling_defaults): 'model' -> 'openai'",
    ),
    (["--enable-tf32-matmul"], "TF32 matmuls (enable_tf32_matmul): False -> True"),
    (["--enable-fp32-lm-head"], "FP32 logits (enable_fp32_lm_head): False -> True"),
    (
        ["--model-impl", "transformers"],
        "model implementation (model_impl): 'auto' -> 'transformers'",
    ),
    (
        ["--max-prefill-tokens", "4096"],
        "prefill token budget (max_prefill_tokens): 16384 -> 4096",
    ),
    (
        ["--num-continuous-decode-steps", "4"],
        "continuous decode steps (num_continuous_decode_steps): 1 -> 4",
    ),
    (["--cpu-offload-gb", "8"], "CPU-offloaded weights (cpu_offload_gb): 0 -> 8"),
    (
        ["--fp8-gemm-backend", "cutlass"],
        "FP8 GEMM kernels (fp8_gemm_runner_backend): 'auto' -> 'cutlass'",
    ),
    (
        ["--fp4-gemm-backend", "flashinfer_cudnn"],
        "FP4 GEMM kernels (fp4_gemm_runner_backend): 'auto' -> 'flashinfer_cudnn'",
    ),
    (
        ["--tbo-token-distribution-threshold", "0.3"],
        "two-batch overlap threshold (tbo_token_distribution_threshold): 0.48 -> 0.3",
    ),
    (
        ["--disable-cuda-graph-padding"],
        "CUDA graph padding disabled (disable_cuda_graph_padding): False -> True",
    ),
    (["--moe-runner-backend", "triton"], "MoE kernels (moe_runner_backend): 'auto' -> 'triton'"),
    (
        ["--json-model-override-args", '{"rope_theta": 1}'],
        """model config overrides (json_model_override_args): '{}' -> '{"rope_theta": 1}'""",
    ),
    (
        ["--enable-hicache"],
        "hierarchical KV cache (enable_hierarchical_cache): False -> True",
    ),
    (["--enable-hisparse"], "hierarchical sparse attention (enable_hisparse): False -> True"),
    (["--attn-cp-size", "2"], "attention context parallelism (attn_cp_size): 1 -> 2"),
    (
        ["--enable-page-major-kv-layout"],
        "page-major KV layout (enable_page_major_kv_layout): False -> True",
    ),
    (["--swa-full-tokens-ratio", "0.5"], "SWA KV token ratio (swa_full_tokens_ratio): 0.8 -> 0.5"),
    (["--enable-lean-attention"], "Lean attention (enable_lean_attention): None -> True"),
    (
        ["--enable-priority-scheduling"],
        "priority scheduling (enable_priority_scheduling): False -> True",
    ),
    (["--tokenizer-mode", "slow"], "tokenizer mode (tokenizer_mode): 'auto' -> 'slow'"),
]


def _resumed_with_every_engine_arg_flag(tmp_path: Path, factory: pytest.TempPathFactory) -> str:
    """`swept_two_drafters` cut after its first drafter and resumed with every flag of
    `ENGINE_ARG_CHANGES` added to its server command: the other drafter's server is refused,
    its cell failed (exit 5), nothing of it journalled, no server left running. Returns the
    failed cell's error."""
    path, marker, out = swept_two_drafters(tmp_path, factory)
    other = keep_first_drafter(out / "journal.jsonl")
    command = f"server_command = [{json.dumps(sys.executable)}, {json.dumps(str(STUB))}"
    flags = [flag for case, _ in ENGINE_ARG_CHANGES for flag in case]
    added = "".join(f", {json.dumps(flag)}" for flag in flags)
    path.write_text(replace_block(path.read_text(), command, command + added))
    again = sweep(path, out)
    assert again.exit_code == 5, again.output
    records = read_records(out / "journal.jsonl")
    [failed] = [r for r in records if r["type"] == "cell" and r["cell"]["drafter"] == other]
    assert [r["drafter"] for r in records if r["type"] == "server"] != [other]
    assert running(marker) == []
    return str(failed["error"])


def test_a_server_resolving_other_engine_args_is_refused(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server command is operational (it may change between runs): one that adds
    --dtype float16 serves the second drafter with another dtype than the first's, one that
    adds --sampling-backend pytorch with other sampling kernels, --enable-torch-compile with
    compiled kernels, --max-prefill-tokens or --num-continuous-decode-steps with another
    schedule, --cpu-offload-gb with weights streamed from the host, --json-model-override-args
    with another model config: refused.

    Every flag of `ENGINE_ARG_CHANGES` is added to one server command, which one resume starts:
    the refusal names every arg that differs (`arm_changes` compares each one on its own), so
    each change is checked in the one refusal, where a case per flag paid a server start and
    a resume for each (the same path twenty times). The line's bound is raised so that it
    names them all (at the bound it counts the rest: the test below)."""
    monkeypatch.setattr("dvfs.measure.runner.MAX_MESSAGE_CHARS", 100_000)
    error = _resumed_with_every_engine_arg_flag(tmp_path, tmp_path_factory)
    missing = [change for _, change in ENGINE_ARG_CHANGES if change not in error]
    assert missing == [], error


def test_a_server_refused_for_many_engine_args_names_what_fits_and_ends_in_its_remedy(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The resume above, at the bound of an error line: the refused drafter's cell's error
    (journalled, and said as the sweep goes) named every change, unbounded (1,456
    characters). It names as many as fit, counts the rest, and ends whole in its remedy,
    within MAX_MESSAGE_CHARS."""
    error = _resumed_with_every_engine_arg_flag(tmp_path, tmp_path_factory)
    assert len(error) <= MAX_MESSAGE_CHARS, error
    assert error.startswith("server start failed: the "), error
    assert " server differs from the " in error, error
    assert ENGINE_ARG_CHANGES[0][1] in error, error
    assert re.search(r"; and \d+ more\): the arms would compare more than their drafters", error)
    assert error.endswith("or start over with --fresh (or another --out)"), error


def test_a_wrapper_adding_flags_after_dvfss_own_is_named_not_another_program(
    tmp_path: Path,
) -> None:
    """A server_command wrapper that appends launch_server flags after dvfs's own (`exec "$@"
    --tp-size 2`) serves with them: the server dvfs started reports another TP size than dvfs
    set, so it is refused, in words that say so, not as "another program answers on its port"
    (none does: the listener is the server's own process)."""
    wrapper = tmp_path / "wrap.sh"
    wrapper.write_text('#!/bin/sh\nexec "$@" --tp-size 2\n')
    wrapper.chmod(0o755)
    path, marker = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        wrapper=(str(wrapper),),
        **ONE_SETTING,
    )
    result = sweep(path, tmp_path / "out")
    assert result.exit_code == 5, result.output
    [cell] = [r for r in read_records(tmp_path / "out" / "journal.jsonl") if r["type"] == "cell"]
    error = cell["error"]
    assert "another program" not in error, error
    assert "the 'none' server dvfs started reports tp_size 2, not 1 as dvfs set it" in error
    assert "engine.sglang.server_command passes launch_server flags of its own" in error
    assert running(marker) == []


def test_every_drafters_server_gets_the_campaigns_random_seed(tmp_path: Path) -> None:
    """SGLang draws a random seed at every start unless given one: dvfs gives every drafter's
    server measurement.seed, and a server with another is refused like any other arm arg;
    a journal mixing them gives no cube."""
    path, marker = stub_campaign(
        tmp_path, drafters=TWO_DRAFTERS, measurement_extra="seed = 11", **ONE_SETTING
    )
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    servers = [r for r in read_records(journal) if r["type"] == "server"]
    assert [s["args"]["random_seed"] for s in servers] == [11, 11]
    [header] = [r for r in read_records(journal) if r["type"] == "header"]
    assert "random_seed" in header["arms_pinned"]
    # The first drafter's server (edited) ran with another seed: the next one is refused.
    other = keep_first_drafter(journal)
    records = read_records(journal)
    for r in records:
        if r["type"] == "server":
            r["args"]["random_seed"] = 7
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    again = sweep(path, out)
    assert again.exit_code == 5, again.output
    records = read_records(journal)
    [failed] = [r for r in records if r["type"] == "cell" and r["cell"]["drafter"] == other]
    assert "random seed (random_seed): 7 -> 11" in failed["error"]
    assert "earlier dvfs" not in failed["error"]
    assert running(marker) == []
    server = next(r for r in records if r["type"] == "server")
    with journal.open("a") as f:
        f.write(
            json.dumps({**server, "drafter": other, "args": {**server["args"], "random_seed": 11}})
            + "\n"
        )
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code != 0
    assert "(random seed (random_seed): 7 -> 11)" in last_line(built)


def test_a_journal_whose_servers_drew_their_own_seeds_still_resumes(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A journal an earlier dvfs began (its header's arms_pinned lacks random_seed) has
    servers that each drew a seed: they are not compared in it, so the journal resumes (the
    new server with the pinned seed) and builds, with nothing said about an earlier dvfs."""
    path, marker, out = swept_two_drafters(tmp_path, tmp_path_factory)
    journal = out / "journal.jsonl"
    other = keep_first_drafter(journal)
    records = read_records(journal)
    for r in records:
        if r["type"] == "header":
            r["arms_pinned"] = [k for k in r["arms_pinned"] if k != "random_seed"]
        if r["type"] == "server":
            r["args"]["random_seed"] = 123456789
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    again = sweep(path, out)
    assert again.exit_code == 0, again.output
    servers = [r for r in read_records(journal) if r["type"] == "server"]
    assert sorted(s["args"]["random_seed"] for s in servers) == [0, 123456789]
    assert {s["drafter"] for s in servers} == {"none", "ngram"} and other
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 0, built.output
    assert running(marker) == []


def test_the_random_seed_is_compared_where_the_journal_pinned_it() -> None:
    base = {"engine": "sglang", "version": "0.5.23", "attention_backend": "fa3"}
    a = {**base, "args": {"random_seed": 1}}
    b = {**base, "args": {"random_seed": 2}}
    change = ["random seed (random_seed): 1 -> 2"]
    assert arm_changes(a, b) == change
    assert arm_changes(a, b, pinned=list(ARMS_PINNED)) == change
    assert arm_changes(a, b, pinned=["decode_cuda_graphs", "overlap_schedule"]) == []
    assert arm_changes(a, b, pinned=()) == []
    # (so an earlier dvfs is never blamed for it)
    assert begun_unpinned((), change) is None


def test_args_sglang_sets_for_speculation_are_recorded_not_compared() -> None:
    """max_running_requests, the memory fraction, the graph limit and the speculative_* args
    may differ between arms (SGLang sets them for a draft: the cube keeps each drafter's), and
    so may what SGLang sets for some algorithms or their options (multi-layer EAGLE, UNO's
    LoRA loading, the linear-attention verify kernels, the replay-SSM state dtype); the dtype,
    the page size, the schedulers, chunked prefill, and every other arg that changes the
    target's kernels, schedule or numerics may not (SGLang leaves those alone, or dvfs makes
    them alike: `ARM_ARGS`)."""
    base = {"engine": "sglang", "version": "0.5.23", "attention_backend": "fa3"}
    per_algorithm = {
        "enable_multi_layer_eagle": (False, True),
        "enable_lora_overlap_loading": (None, False),
        "lora_strict_loading": (None, True),
        "linear_attn_verify_backend": (None, "flashinfer"),
        "mamba_ssm_dtype": (None, "float32"),
    }
    none = {
        **base,
        "args": {
            "dtype": "auto",
            "max_running_requests": None,
            "page_size": 1,
            **{k: a for k, (a, _) in per_algorithm.items()},
        },
    }
    spec = {
        **base,
        "args": {
            "dtype": "auto",
            "max_running_requests": 48,
            "mem_fraction_static": 0.7,
            "cuda_graph_max_bs": 8,
            "page_size": 1,
            "speculative_algorithm": "EAGLE",
            "speculative_eagle_topk": 4,
            **{k: b for k, (_, b) in per_algorithm.items()},
        },
    }
    assert arm_changes(none, spec) == []
    assert not set(spec["args"]) & set(ARM_ARGS) - {"dtype", "page_size"}
    for key, label, a, b in [
        ("dtype", "dtype", "auto", "float16"),
        ("page_size", "KV page size", 1, 16),
        ("disable_overlap_schedule", "overlap scheduler disabled", False, True),
        ("enable_mixed_chunk", "mixed chunked prefill", True, False),
        ("chunked_prefill_size", "chunked prefill size", 8192, 4096),
        ("disable_radix_cache", "radix cache disabled", False, True),
        ("sampling_backend", "sampling kernels", "flashinfer", "pytorch"),
        ("enable_torch_compile", "torch.compile", False, True),
        ("enable_deterministic_inference", "deterministic inference", False, True),
        ("stream_interval", "stream interval", 1, 8),
        ("schedule_policy", "schedule policy", "fcfs", "lpm"),
        ("schedule_conservativeness", "schedule conservativeness", 1.0, 0.3),
        ("sampling_defaults", "sampling defaults", "model", "openai"),
        ("preferred_sampling_params", "preferred sampling params", None, '{"top_p": 0.5}'),
        ("disable_custom_all_reduce", "custom all-reduce disabled", False, True),
        ("enable_dp_attention", "DP attention", False, True),
        ("model_impl", "model implementation", "sglang", "transformers"),
        ("enable_fp32_lm_head", "FP32 logits", False, True),
        ("enable_tf32_matmul", "TF32 matmuls", False, True),
        ("max_prefill_tokens", "prefill token budget", 16384, 4096),
        ("max_total_tokens", "KV pool token cap", None, 100000),
        ("num_continuous_decode_steps", "continuous decode steps", 1, 4),
        ("enable_piecewise_cuda_graph", "piecewise CUDA graphs", False, True),
        ("disable_prefill_cuda_graph", "prefill CUDA graphs disabled", False, True),
        ("fp8_gemm_runner_backend", "FP8 GEMM kernels", "auto", "cutlass"),
        ("triton_attention_num_kv_splits", "Triton attention KV splits", 8, 16),
        ("enable_nan_detection", "NaN detection", False, True),
        ("enable_lora", "LoRA layers", None, True),
    ]:
        before = {**none, "args": {**none["args"], key: a}}
        after = {**spec, "args": {**spec["args"], key: b}}
        assert arm_changes(before, after) == [f"{label} ({key}): {a!r} -> {b!r}"]
        if key not in none["args"]:  # a record that does not report it: unknown, named
            assert arm_changes(none, after) == [f"{label} ({key}): not reported -> {b!r}"]


def test_two_arms_differing_in_any_compared_arg_are_refused() -> None:
    """Every arg of `ARM_ARGS` (the sparse attention, KV layouts, context parallelism and
    kernels SGLang never sets per algorithm among them) is compared on its own, in its words."""
    base = {"engine": "sglang", "version": "0.5.23", "attention_backend": "fa3"}
    for key, label in ARM_ARGS.items():
        before = {**base, "args": {"dtype": "auto", key: 1}}
        after = {**base, "args": {"dtype": "auto", key: 2}}
        assert arm_changes(before, after) == [f"{label} ({key}): 1 -> 2"]
        assert arm_changes(before, before) == []


def test_an_arg_one_arm_reports_and_the_other_not_is_named_not_alike() -> None:
    """One SGLang reports every arg it has: where two servers name one engine and version, an
    arm arg (or a decode CUDA graph) one reports and the other not is unknown, named as a
    change, never taken as alike. Across versions the version's change says it."""
    base = {"engine": "sglang", "version": "0.5.23", "attention_backend": "fa3"}
    told = {**base, "args": {"dtype": "float16", "cuda_graph_bs": [1, 8]}}
    silent = {**base, "args": {}}
    assert arm_changes(told, silent, [4]) == [
        "dtype (dtype): 'float16' -> not reported",
        "decode CUDA graph at batch 4: 8 -> not reported",
    ]
    assert arm_changes(silent, told) == ["dtype (dtype): not reported -> 'float16'"]
    # A seed an earlier dvfs left each server to draw is not compared, reported or not.
    assert arm_changes({**base, "args": {"random_seed": 1}}, silent, pinned=()) == []
    # Another release: its own args; the version is the change.
    older = {**silent, "version": "0.5.9"}
    assert arm_changes(told, older) == ["engine version: 0.5.23 -> 0.5.9"]


def test_a_drafter_arg_one_of_its_servers_reports_and_the_other_not_is_named() -> None:
    """One drafter's servers (a resume's) are compared in its own speculative args alike: one
    reported by one server and not by the other of the same SGLang is unknown, named."""
    base = {"engine": "sglang", "version": "0.5.23", "attention_backend": "fa3"}
    told = {**base, "args": {"speculative_num_steps": 3}}
    silent = {**base, "args": {}}
    assert server_changes(told, silent) == ["speculative_num_steps: 3 -> not reported"]
    assert server_changes(silent, told) == ["speculative_num_steps: not reported -> 3"]
    assert server_changes(told, told) == []
    older = {**silent, "version": "0.5.9"}  # another release: the version is the change
    assert server_changes(older, told) == ["engine version: 0.5.9 -> 0.5.23"]


def test_a_journal_whose_drafters_servers_report_other_args_gives_no_cube(
    tiny_sweep: Path, tmp_path: Path
) -> None:
    """A journal with a second server of one drafter (a resume's) that does not report a
    speculative arg the first reported (edited in): `dvfs cube build` refuses it, naming it."""
    out = copy_sweep(tiny_sweep, tmp_path / "out")
    journal = out / "journal.jsonl"
    records = read_records(journal)
    server = next(
        r for r in records if r["type"] == "server" and "speculative_num_steps" in r["args"]
    )
    steps = server["args"]["speculative_num_steps"]
    again = json.loads(json.dumps(server))
    del again["args"]["speculative_num_steps"]
    journal.write_text("".join(json.dumps(r) + "\n" for r in [*records, again]))
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code != 0
    assert (
        f"the journal's cells of drafter {server['drafter']!r} were served by different "
        f"engines or flags (speculative_num_steps: {steps!r} -> not reported)"
    ) in last_line(built)
    assert "Traceback" not in built.output


def test_a_journal_whose_arms_report_other_args_gives_no_cube(
    tiny_sweep: Path, tmp_path: Path
) -> None:
    """A journal whose one drafter's server reports an arm arg the other's does not (edited
    in): `dvfs cube build` refuses it, naming the arg, as it refuses arms that differ in it."""
    out = copy_sweep(tiny_sweep, tmp_path / "out")
    journal = out / "journal.jsonl"
    records = read_records(journal)
    servers = [r for r in records if r["type"] == "server"]
    first, second = servers[0]["drafter"], servers[1]["drafter"]
    servers[1]["args"]["dtype"] = "float16"
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code != 0
    assert (
        f"the journal's drafters {first!r} and {second!r} were served differently (dtype "
        "(dtype): not reported -> 'float16')" in last_line(built)
    )
    assert "Traceback" not in built.output


@pytest.mark.parametrize(
    ("version", "defaults"),
    [
        (
            "0.5.9",
            {
                "attn_cp_size": 1,
                "swa_full_tokens_ratio": 0.8,
                "tokenizer_mode": "auto",
                "kt_method": "AMXINT4",
            },
        ),
        (
            "0.5.23",
            {
                "attn_cp_size": 1,
                "dcp_size": 1,
                "swa_full_tokens_ratio": 0.8,
                "tokenizer_mode": "auto",
                "tokenizer_backend": "huggingface",
                "kt_method": "AMXINT4",
                "enable_hisparse": False,
                "enable_page_major_kv_layout": False,
            },
        ),
    ],
)
def test_the_stub_reports_the_compared_args_as_sglang_does(
    version: str, defaults: dict[str, object]
) -> None:
    """The stub's /server_info gives the compared args SGLang's defaults (0.5.9
    server_args.py, 0.5.23 arg_groups/fields/) and types, so that a flag giving the default
    is no change and a number is compared as a number."""
    stub = load_stub()
    config = stub.StubConfig(version=version)
    plain, _ = stub.parse_launch_argv(["--model-path", "m"], config)
    assert {key: plain[key] for key in defaults} == defaults
    argv = ["--model-path", "m", "--attn-cp-size", "2", "--swa-full-tokens-ratio", "0.5"]
    given, _ = stub.parse_launch_argv([*argv, "--attn-cp-size", "1"], config)
    assert given["attn_cp_size"] == 1 and given["swa_full_tokens_ratio"] == 0.5
    given, _ = stub.parse_launch_argv(argv, config)
    assert type(given["attn_cp_size"]) is int and type(given["swa_full_tokens_ratio"]) is float


#: Compared args whose default the stub reported otherwise than SGLang's /server_info, each
#: with the flag's text and SGLang's value: 0.5.23's fallback for an unset ratio
#: (arg_groups/fields/schedule.py `swa_full_tokens_ratio`, `fallback=0.8`, which overrides.py
#: `resolution_result` applies and server_args.py `resolved_dict` reports), a Literal[1, 2]
#: option's int default (fields/exec_.py `fuseep_mode`; arg_utils.py
#: `add_cli_args_from_dataclass`: type int) and an int option with choices
#: (`dsa_triton_union`: choices [0, 2, 4], type int); 0.5.9's argparse defaults for
#: KTransformers, which `from_cli_args` keeps over the dataclass's None (server_args.py
#: `--kt-method` default "AMXINT4", `--kt-threadpool-count` default 2). Then every other
#: compared arg SGLang reports as other than None for an MHA model on Hopper: its default
#: (0.5.9 server_args.py `ServerArgs`, 0.5.23 arg_groups/fields/*.py, `enable_tf32_matmul`'s
#: `fallback=False`), the sampling kernels both resolve to FlashInfer (a dependency of both
#: wheels: 0.5.9 `_handle_sampling_backend`, 0.5.23 overrides.py `_sampling_backend_default`)
#: and 0.5.9's piecewise CUDA graph limit, the chunked prefill size (`_handle_gpu_memory_settings`,
#: 8192 on Hopper). A flag of None: `--no-<flag>` (a BooleanOptionalAction giving False).
_BOTH_DEFAULTS = {
    "dtype": ("auto", "auto"),
    "kv_cache_dtype": ("auto", "auto"),
    "load_format": ("auto", "auto"),
    "model_impl": ("auto", "auto"),
    "json_model_override_args": ("{}", "{}"),
    "sampling_defaults": ("model", "model"),
    "sampling_backend": ("flashinfer", "flashinfer"),
    "schedule_policy": ("fcfs", "fcfs"),
    "schedule_conservativeness": ("1.0", 1.0),
    "max_prefill_tokens": ("16384", 16384),
    "num_reserved_decode_tokens": ("512", 512),
    "num_continuous_decode_steps": ("1", 1),
    "scheduler_recv_interval": ("1", 1),
    "radix_eviction_policy": ("lru", "lru"),
    "prefill_delayer_max_delay_passes": ("30", 30),
    "hicache_write_policy": ("write_through", "write_through"),
    "hicache_io_backend": ("kernel", "kernel"),
    "cpu_offload_gb": ("0", 0),
    "offload_group_size": ("-1", -1),
    "offload_num_in_group": ("1", 1),
    "offload_prefetch_step": ("1", 1),
    "offload_mode": ("cpu", "cpu"),
    "torch_compile_max_bs": ("32", 32),
    "triton_attention_num_kv_splits": ("8", 8),
    "fp8_gemm_runner_backend": ("auto", "auto"),
    "moe_runner_backend": ("auto", "auto"),
    "moe_a2a_backend": ("none", "none"),
    "flashinfer_mxfp4_moe_precision": ("default", "default"),
    "deepep_mode": ("auto", "auto"),
    "ep_num_redundant_experts": ("0", 0),
    "init_expert_location": ("trivial", "trivial"),
    "tbo_token_distribution_threshold": ("0.48", 0.48),
    "mamba_backend": ("triton", "triton"),
    "tp_size": ("1", 1),
    "pp_size": ("1", 1),
    "dp_size": ("1", 1),
    "ep_size": ("1", 1),
    "attn_cp_size": ("1", 1),
    "stream_interval": ("1", 1),
    "eplb_rebalance_num_iterations": ("1000", 1000),
    "eplb_min_rebalancing_utilization_threshold": ("1.0", 1.0),
    "pp_async_batch_depth": ("0", 0),
    "tokenizer_mode": ("auto", "auto"),
}
STUB_DEFAULTS = {
    "0.5.23": {
        "swa_full_tokens_ratio": ("0.8", 0.8),
        "fuseep_mode": ("2", 2),
        "dsa_triton_union": ("0", 0),
        "kt_method": ("AMXINT4", "AMXINT4"),
        "kt_threadpool_count": ("2", 2),
        **_BOTH_DEFAULTS,
        "hicache_mem_layout": ("page_first", "page_first"),
        "fp4_gemm_runner_backend": ("auto", "auto"),
        "bf16_gemm_backend": ("auto", "auto"),
        "enable_tf32_matmul": (None, False),
        "retraction_policy": ("length", "length"),
        "prefill_decode_interval_min_bs": ("0", 0),
        "dsa_topk_backend": ("sgl-kernel", "sgl-kernel"),
        "dsa_paged_mqa_logits_backend": ("auto", "auto"),
        "dsv4_attn_backend": ("auto", "auto"),
        "dsv4_prefill_backend": ("auto", "auto"),
        "linear_attn_backend": ("triton", "triton"),
        "lora_strict_loading": (None, False),
        "dcp_size": ("1", 1),
        "deepep_dispatcher_output_dtype": ("auto", "auto"),
        "qsa_indexer_dtype": ("auto", "auto"),
        "c128_page_size": ("16", 16),
        "linear_replayssm_cache_len": ("16", 16),
        "mamba_cache_philox_rounds": ("0", 0),
        "mamba_max_states_per_path": ("-1", -1),
        "tokenizer_backend": ("huggingface", "huggingface"),
    },
    "0.5.9": {
        "swa_full_tokens_ratio": ("0.8", 0.8),
        "kt_method": ("AMXINT4", "AMXINT4"),
        "kt_threadpool_count": ("2", 2),
        **_BOTH_DEFAULTS,
        "hicache_mem_layout": ("layer_first", "layer_first"),
        "fp4_gemm_runner_backend": ("flashinfer_cutlass", "flashinfer_cutlass"),
        "piecewise_cuda_graph_compiler": ("eager", "eager"),
        "piecewise_cuda_graph_max_tokens": ("8192", 8192),
        "torchao_config": ("", ""),
        "ds_heavy_channel_num": ("32", 32),
        "ds_heavy_channel_type": ("qk", "qk"),
        "ds_heavy_token_num": ("256", 256),
        "ds_sparse_decode_threshold": ("4096", 4096),
        "nsa_prefill_cp_mode": ("round-robin-split", "round-robin-split"),
    },
}
#: The flags SGLang names otherwise than their field (0.5.23 fields/exec_.py `cli_name=`,
#: 0.5.9 server_args.py `dest=`).
_FLAG_OF = {
    "fp8_gemm_runner_backend": "--fp8-gemm-backend",
    "fp4_gemm_runner_backend": "--fp4-gemm-backend",
}
#: Compared args SGLang reports as None unless given or resolved (Optional[bool] = None, not
#: False: 0.5.23 fields/lora.py, fields/exec_.py; 0.5.9 server_args.py `ServerArgs`).
STUB_UNSET = {
    "0.5.23": ("enable_lean_attention", "enable_lora", "enable_lora_overlap_loading"),
    "0.5.9": ("enable_lora", "enable_lora_overlap_loading"),
}


@pytest.mark.parametrize("version", sorted(STUB_DEFAULTS))
def test_a_flag_giving_sglangs_default_is_no_change_for_the_stub_either(version: str) -> None:
    """A resume whose server_command added --swa-full-tokens-ratio 0.8, --fuseep-mode 2 or
    --dsa-triton-union 0 (SGLang 0.5.23's defaults, reported alike with or without the flag)
    was refused against the stub ("SWA KV token ratio (swa_full_tokens_ratio): None -> 0.8",
    "(dsa_triton_union): 0 -> '0'"), which reported None for the unset ratio and mode and a
    string for a number with choices; and it reported False for an unset
    --enable-lean-attention, which SGLang reports as None. Against 0.5.9, likewise
    --kt-method AMXINT4 or --kt-threadpool-count 2 (its argparse defaults: "None ->
    'AMXINT4'"). And so for every compared arg with a default: --dtype auto was refused
    ("dtype (dtype): None -> 'auto'"), as were --schedule-policy fcfs, --max-prefill-tokens
    16384, 0.5.9's --ds-heavy-channel-num 32... (the stub reported None), and --enable-lora
    was False unset (SGLang: None). Every compared arg the stub reports other than None or
    False is one of these, so that none is left to the stub's own default."""
    stub = load_stub()
    config = stub.StubConfig(version=version)
    plain, _ = stub.parse_launch_argv(["--model-path", "m", "--random-seed", "1"], config)
    for key in STUB_UNSET[version]:
        assert plain[key] is None, key
    base = {"engine": "sglang", "version": version, "attention_backend": "fa3"}
    for key, (flag_value, value) in STUB_DEFAULTS[version].items():
        assert plain[key] == value and type(plain[key]) is type(value), key
        flag = _FLAG_OF.get(key) or "--" + key.replace("_", "-")
        given_flag = [flag, flag_value] if flag_value is not None else ["--no-" + flag[2:]]
        argv = ["--model-path", "m", "--random-seed", "1", *given_flag]
        given, _ = stub.parse_launch_argv(argv, config)
        assert type(given[key]) is type(value), key
        assert arm_changes({**base, "args": plain}, {**base, "args": given}) == [], key
    # Every compared arg the stub reports set is SGLang's value listed here, or one the argv or
    # the GPU sets (the model's path, the random seed, Hopper's KV page, prefill chunk and
    # static memory fraction).
    listed = {*STUB_DEFAULTS[version], "model_path", "tokenizer_path", "random_seed"}
    listed |= {"page_size", "chunked_prefill_size", "mem_fraction_static"}
    compared = {*ARM_ARGS, *DRAFTER_ARGS} & plain.keys()
    unlisted = {k: plain[k] for k in compared - listed if plain[k] not in (None, False)}
    assert unlisted == {}
    # What SGLang resolves from other flags: --lora-paths turns LoRA on and its overlap loading
    # off; deterministic inference samples with PyTorch's kernels, whichever were asked for.
    argv = ["--model-path", "m", "--lora-paths", "a=/a", "--enable-deterministic-inference"]
    other, _ = stub.parse_launch_argv([*argv, "--sampling-backend", "flashinfer"], config)
    assert other["enable_lora"] is True and other["enable_lora_overlap_loading"] is False
    assert other["sampling_backend"] == "pytorch"


def test_the_deprecated_monokernel_flag_is_the_amd_monokernel_for_the_stub_too() -> None:
    """0.5.23's --monokernel-backend amd stores True in enable_amd_monokernel (server_args.py:
    DeprecatedStoreConstAction, dest="enable_amd_monokernel", const_value=True) and SGLang has
    no monokernel_backend field, but the stub reported "monokernel_backend": "amd" beside an
    enable_amd_monokernel left False, so a resume spelling the flag the new way was refused
    ("AMD monokernel (enable_amd_monokernel): False -> True") where SGLang reports no change."""
    stub = load_stub()
    config = stub.StubConfig(version="0.5.23")
    base = {"engine": "sglang", "version": "0.5.23", "attention_backend": "fa3"}
    argv = ["--model-path", "m", "--random-seed", "1"]
    old, _ = stub.parse_launch_argv([*argv, "--monokernel-backend", "amd"], config)
    new, _ = stub.parse_launch_argv([*argv, "--enable-amd-monokernel"], config)
    plain, _ = stub.parse_launch_argv(argv, config)
    assert "monokernel_backend" not in old and old["enable_amd_monokernel"] is True
    assert plain["enable_amd_monokernel"] is False
    assert arm_changes({**base, "args": old}, {**base, "args": new}) == []
    assert arm_changes({**base, "args": plain}, {**base, "args": old}) == [
        "AMD monokernel (enable_amd_monokernel): False -> True"
    ]


def test_one_drafters_servers_share_what_sglang_may_set_for_speculation(tmp_path: Path) -> None:
    """The args the arms may differ in (`DRAFTER_ARGS`: the memory fraction, max running
    requests...) are one drafter's own: a resume whose `server_command` wrapper adds
    `--mem-fraction-static` serves that drafter otherwise, so its server is refused rather
    than its cells joining the earlier ones in one cube keeping the newest server's args alone
    (said as its own earlier server, with what to restore: not "the arms would compare more
    than their drafters; run every drafter on the same SGLang and flags"); a journal holding
    both (edited) gives no cube, and shards run so do not merge."""
    wrapper = tmp_path / "wrap.sh"
    wrapper.write_text('#!/bin/sh\nexec "$@"\n')
    wrapper.chmod(0o755)
    path, marker = stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        wrapper=(str(wrapper),),
        batch="[1, 4]",
        knobs=ONE_SETTING["knobs"],
    )
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    records = read_records(journal)
    [server] = [r for r in records if r["type"] == "server"]
    cells = [r for r in records if r["type"] == "cell"]
    assert len(cells) == 2
    # SGLang's default on the stub's H100 (decode graphs up to the largest batch), as reported
    resolved = server["args"]["mem_fraction_static"]
    assert resolved == 0.836, resolved
    journal.write_text("".join(json.dumps(r) + "\n" for r in records if r is not cells[-1]))
    (out / "cube.nc").unlink()
    wrapper.write_text('#!/bin/sh\nexec "$@" --mem-fraction-static 0.6\n')
    again = sweep(path, out)
    assert again.exit_code == 5, again.output
    [failed] = [r for r in read_records(journal) if r["type"] == "cell" and r["status"] != "ok"]
    assert f"(mem_fraction_static: {resolved} -> 0.6)" in failed["error"], failed["error"]
    # said as its own earlier server, not another arm's, with what to restore
    assert "server differs from the one that measured its cells in" in failed["error"]
    assert "start it as it was (the same SGLang, and the same flags" in failed["error"]
    assert "arms" not in failed["error"] and "every drafter" not in failed["error"]
    # and why the memory fraction may differ though no flag did (SGLang sizes it by the host)
    assert "by the host's smallest GPU, whatever CUDA_VISIBLE_DEVICES" in failed["error"]
    # The closing line says the refusal's fix, not a rerun alone (which is refused again).
    [closing] = [line for line in again.output.splitlines() if line.startswith("Finished with")]
    assert "they failed as their server was refused: start it as it was (the same" in closing
    assert closing.index("start it as it was") < closing.index("rerun the same command")
    assert running(marker) == []
    # Appended by hand, the other server gives no cube.
    with journal.open("a") as f:
        changed = {**server["args"], "mem_fraction_static": 0.6}
        f.write(json.dumps({**server, "args": changed}) + "\n" + json.dumps(cells[-1]) + "\n")
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code != 0
    assert "drafter 'none' were served by different engines or flags" in last_line(built)
    assert f"(mem_fraction_static: {resolved} -> 0.6)" in last_line(built)
    # a flag, not software, differs
    assert "would compare engine flags, not settings" in last_line(built)
    # Each of them, one drafter's servers compared (as shards' are when merged).
    from dvfs.records.session import (
        DRAFTER_ARGS,
        restart_as_it_was,
        server_changes,
        what_differs,
    )

    base = {"engine": "sglang", "version": "0.5.23", "attention_backend": "fa3"}
    for key in DRAFTER_ARGS:
        a, b = {**base, "args": {key: 1}}, {**base, "args": {key: 2}}
        assert server_changes(a, b) == [f"{key}: 1 -> 2"]
        assert arm_changes(a, b) == []
        assert what_differs(server_changes(a, b)) == "engine flags"
        said = "smallest GPU" in restart_as_it_was(server_changes(a, b))
        assert said == (key == "mem_fraction_static"), key
    older = {**base, "args": {"mem_fraction_static": 1}}
    newer = {**base, "version": "0.5.24", "args": {"mem_fraction_static": 2}}
    assert what_differs(server_changes(older, newer)) == "software and engine flags"
    assert what_differs(server_changes(older, {**newer, "args": older["args"]})) == "software"


# -- an attached server -----------------------------------------------------------------------


@pytest.fixture
def attached(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A free port, and where to start a stub server on it (`serve`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "attach.json"
    config.write_text(json.dumps({"version": "0.5.23", "max_lifetime_s": 60, "tpot_s": 0.004}))
    yield port, config


def serve(port: int, config: Path, *argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(STUB), "--port", str(port), *argv],
        env={**os.environ, "SGLANG_STUB_CONFIG": str(config)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def attached_campaign(tmp_path: Path, port: int, **fields: str) -> tuple[Path, str]:
    """The stub campaign of drafter 'none' alone, attached to the server at `port`
    (engine.sglang.url), with `fields` as `stub_campaign` takes them."""
    return stub_campaign(
        tmp_path,
        drafters='\n[drafters.none]\nalgorithm = "none"\n',
        sglang_extra=f'url = "http://127.0.0.1:{port}"',
        **fields,
    )


def sweep_replacing_the_server(  # type: ignore[no-untyped-def]
    monkeypatch, path: Path, out: Path, attached: tuple[int, Path], argv, replacement
):
    """Sweep `path` into `out` attached to a stub started on `attached`'s port with `argv`,
    which is replaced as the first cell is journalled, in the sweep's own thread (so the swap
    lands between the first cell and the second, however fast or loaded the machine): stopped,
    and another started on its port with `argv` and `replacement(info)` (`info`: the first
    server's /server_info), answering before the sweep goes on. The result and the servers."""
    import time
    import urllib.request

    from dvfs.measure.journal import Journal

    port, config = attached
    info_url = f"http://127.0.0.1:{port}/server_info"
    servers = [serve(port, config, *argv)]
    append_all = Journal.append_all

    def replace_after_the_first_cell(self: Journal, records) -> None:  # type: ignore[no-untyped-def]
        append_all(self, records)
        if len(servers) > 1 or not any(r.get("type") == "cell" for r in records):
            return
        with urllib.request.urlopen(info_url, timeout=5) as answer:
            info = json.load(answer)
        servers[0].terminate()
        servers[0].wait(timeout=10)
        servers.append(serve(port, config, *argv, *replacement(info)))
        while True:  # no deadline of its own: the test's timeout ends a hang
            try:
                with urllib.request.urlopen(info_url, timeout=5):
                    return
            except OSError:
                assert servers[-1].poll() is None, "the replacement server exited"
                time.sleep(0.05)

    monkeypatch.setattr(Journal, "append_all", replace_after_the_first_cell)
    try:
        return sweep(path, out), servers
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=10)


@pytest.mark.parametrize(
    ("model", "algorithm", "refusal"),
    [
        ("some-other-model", None, "serves model 'some-other-model', not "),
        (None, "NGRAM", "runs speculative algorithm 'NGRAM', not None as drafter 'none' asks"),
    ],
)
def test_an_attached_server_must_serve_the_campaigns_model_and_drafter(
    tmp_path: Path, attached: tuple[int, Path], model: str | None, algorithm: str | None, refusal
) -> None:
    port, config = attached
    path, marker = attached_campaign(
        tmp_path,
        port,
        **ONE_SETTING,
    )
    argv = ["--model-path", model or marker]
    if algorithm:
        argv += ["--speculative-algorithm", algorithm]
    server = serve(port, config, *argv)
    try:
        result = sweep(path, tmp_path / "out")
        assert result.exit_code == 5, result.output
        records = read_records(tmp_path / "out" / "journal.jsonl")
        cells = [r for r in records if r["type"] == "cell"]
        assert [c["status"] for c in cells] == ["failed"]
        [error] = cells[0]["error"].splitlines()
        assert refusal in error and f"the server at http://127.0.0.1:{port}" in error
        assert not [
            r for r in read_records(tmp_path / "out" / "journal.jsonl") if r["type"] == "server"
        ]
        assert server.poll() is None  # not dvfs's to stop
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_an_attached_server_replaced_mid_sweep_stops_the_sweep(
    tmp_path: Path, attached: tuple[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server at engine.sglang.url replaced between two cells (stopped, and another
    started on its port with --dtype float16) would serve every later cell: each round reads
    its /server_info anyway (the accept length), so the sweep stops at once, in one line
    naming the change and what to do (exit 1), rather than measuring and failing each later
    cell alike, or journalling them under the first server's record as if only the clock had
    changed. The journal keeps the cell measured before, written to a partial cube with the
    GPUs' settings restored and said so, as a Ctrl-C's stop says it (it wrote neither), and
    with the original server restarted the same command resumes it."""

    port, config = attached
    path, marker = attached_campaign(
        tmp_path,
        port,
        batch="[1]",
        knobs="sm_clock = [1980, 1500]\nsettle_s = 0.0",
        measurement_extra="repeats = 2",
    )
    argv = ("--model-path", marker, "--random-seed", "0")
    journal = tmp_path / "out" / "journal.jsonl"
    result, servers = sweep_replacing_the_server(
        monkeypatch, path, tmp_path / "out", attached, argv, lambda _: ("--dtype", "float16")
    )
    assert len(servers) == 2, result.output
    assert result.exit_code == 1, result.output
    records = read_records(journal)
    [server] = [r for r in records if r["type"] == "server"]
    assert server["args"]["dtype"] == "auto"
    assert [c["status"] for c in records if c["type"] == "cell"] == ["ok"]
    error = last_line(result)
    assert error.startswith(
        f"Error: the server at http://127.0.0.1:{port} is not the one dvfs attached to"
    )
    assert "dtype (dtype): 'auto' -> 'float16'" in error and "so the sweep stopped" in error
    assert "restart it as it was and rerun the same command to resume" in error
    assert "--fresh" in error
    assert result.output.count("is not the one dvfs attached to") == 1
    cube = tmp_path / "out" / "cube.nc"
    assert f"partial cube written to {cube}" in result.output
    assert "GPU settings restored." in result.output.splitlines()
    assert int((open_cube(cube)["cell_status"].values == STATUS_OK).sum()) == 1

    monkeypatch.undo()
    original = serve(port, config, *argv)
    try:
        resumed = sweep(path, tmp_path / "out")
    finally:
        original.terminate()
        original.wait(timeout=10)
    assert resumed.exit_code == 0, resumed.output
    cells = [r for r in read_records(journal) if r["type"] == "cell"]
    assert [c["status"] for c in cells] == ["ok"] * 4
    assert len({(c["cell"]["sm_clock_mhz"], c["cell"]["repeat"]) for c in cells}) == 4


def test_doctor_on_a_sweep_stopped_by_a_replaced_attached_server_says_what_its_resume_finds(
    tmp_path: Path, attached: tuple[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep stopped as its attached server was replaced (another started on its port with
    --dtype float16): doctor, the replacement answering, said "ok engine" (it serves the
    campaign's model and drafter), yet the resume refused it as unlike the server that
    measured the journal's cells and failed every cell left (exit 5). Doctor now fails the
    engine check in the resume's own words (the change, and to restart the server as it was),
    exit 1; with the original server back it passes, and the resume measures the rest."""
    from test_sglang_engine import _answering

    port, config = attached
    path, marker = attached_campaign(
        tmp_path, port, batch="[1]", knobs="sm_clock = [1980, 1500]\nsettle_s = 0.0"
    )
    argv = ("--model-path", marker, "--random-seed", "0")
    out = tmp_path / "out"
    replaced = ("--dtype", "float16")
    stopped, _ = sweep_replacing_the_server(
        monkeypatch, path, out, attached, argv, lambda _: replaced
    )
    assert stopped.exit_code == 1, stopped.output
    monkeypatch.undo()

    def doctor_then_resume(*extra: str) -> tuple[Result, dict[str, str], Result]:
        server = serve(port, config, *argv, *extra)
        try:
            _answering(port)
            checked = CliRunner().invoke(cli, ["doctor", str(path), "--out", str(out), "--json"])
            [engine] = [c for c in json.loads(checked.stdout) if c["name"] == "engine"]
            return checked, engine, sweep(path, out)
        finally:
            server.terminate()
            server.wait(timeout=10)

    checked, engine, resumed = doctor_then_resume(*replaced)
    assert resumed.exit_code == 5, resumed.output
    failed = [c for c in read_records(out / "journal.jsonl") if c["type"] == "cell"][-1]
    refusal = failed["error"].removeprefix("server start failed: ")
    assert "dtype (dtype): 'auto' -> 'float16'" in refusal, refusal
    assert checked.exit_code == 1, checked.output
    assert engine["status"] == "fail", engine
    assert engine["detail"].startswith(refusal), engine
    assert "restart the server at engine.sglang.url as it was" in engine["detail"]

    checked, engine, resumed = doctor_then_resume()
    assert checked.exit_code == 0, checked.output
    assert engine["status"] == "ok", engine
    assert resumed.exit_code == 0, resumed.output


@pytest.mark.parametrize("advised", [False, True])
def test_an_attached_server_restarted_without_its_seed_is_told_the_seed_to_restart_with(
    tmp_path: Path, attached: tuple[int, Path], monkeypatch: pytest.MonkeyPatch, advised: bool
) -> None:
    """SGLang (0.5.9 and 0.5.23) draws a random seed at every start without --random-seed, so
    the attached server restarted mid-sweep with its own command is another seed: the sweep
    stops, and the refusal names the seed to restart it with, not only "restart it as it was"
    (which draws another); restarted with that seed, the sweep goes on (exit 0)."""

    port, config = attached
    path, marker = attached_campaign(
        tmp_path,
        port,
        batch="[1]",
        knobs="sm_clock = [1980, 1500]\nsettle_s = 0.0",
    )
    argv = ("--model-path", marker)
    seeds: list[int] = []

    def restarted(info: dict) -> tuple[str, ...]:  # type: ignore[type-arg]
        seeds.append(info["random_seed"])
        return ("--random-seed", str(seeds[0])) if advised else ()

    result, servers = sweep_replacing_the_server(
        monkeypatch, path, tmp_path / "out", attached, argv, restarted
    )
    assert len(servers) == 2, result.output
    cells = [r for r in read_records(tmp_path / "out" / "journal.jsonl") if r["type"] == "cell"]
    if advised:
        assert result.exit_code == 0, result.output
        assert [c["status"] for c in cells] == ["ok", "ok"]
        return
    assert result.exit_code == 1, result.output
    assert [c["status"] for c in cells] == ["ok"]
    error = last_line(result)
    assert f"random seed (random_seed): {seeds[0]} -> " in error
    assert f"restart it as it was, with --random-seed {seeds[0]} (" in error


def test_an_attached_server_replaced_by_one_capping_the_batch_stops_the_sweep(
    tmp_path: Path, attached: tuple[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An attached SGLang 0.5.9 server replaced mid-sweep by one started with
    --max-running-requests 2, below the largest batch (4), queues half of each batch: refused
    at attach, and now at each round too (0.5.9 leaves its decode CUDA graphs as they were,
    so no arm arg differs), stopping the sweep, rather than measured as a batch of 4 (exit
    0); the cap named once (it was named twice, as a server flag changed and as below the
    largest batch)."""

    port, config = attached
    config.write_text(json.dumps({"version": "0.5.9", "max_lifetime_s": 60, "tpot_s": 0.004}))
    path, marker = attached_campaign(
        tmp_path,
        port,
        batch="[1, 4]",
        knobs="sm_clock = [1980]\nsettle_s = 0.0",
        measurement_extra="repeats = 2",
    )
    argv = ("--model-path", marker, "--random-seed", "0")
    result, servers = sweep_replacing_the_server(
        monkeypatch,
        path,
        tmp_path / "out",
        attached,
        argv,
        lambda _: ("--max-running-requests", "2"),
    )
    assert len(servers) == 2, result.output
    assert result.exit_code == 1, result.output
    cells = [r for r in read_records(tmp_path / "out" / "journal.jsonl") if r["type"] == "cell"]
    assert [c["status"] for c in cells] == ["ok"]
    error = last_line(result)
    assert f"the server at http://127.0.0.1:{port} is not the one dvfs attached to" in error
    assert "max_running_requests: None -> 2, below the largest batch 4" in error
    assert error.count("max_running_requests") == 1, "the cap is named once"


def test_a_fleet_attached_to_one_server_is_refused(tmp_path: Path) -> None:
    """Two workers (--gpus 0-1, or two gpu.devices groups) attached at one engine.sglang.url
    would each meter its own GPU while both sent their requests to that one server: refused
    by the sweep, its dry run and doctor alike (exit 2), before any request; one worker is not."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))  # held: nothing answers there, and nothing must be asked
    url = f"http://127.0.0.1:{port.getsockname()[1]}"
    try:
        path, _ = stub_campaign(
            tmp_path,
            drafters='\n[drafters.none]\nalgorithm = "none"\n',
            sglang_extra=f'url = "{url}"',
            **ONE_SETTING,
        )
        out = str(tmp_path / "out")
        for args in (
            ["sweep", str(path), "--gpus", "0-1", "--out", out, "--no-progress"],
            ["sweep", str(path), "--gpus", "0-1", "--out", out, "--dry-run"],
            ["doctor", str(path), "--gpus", "0-1"],
        ):
            result = CliRunner().invoke(cli, args)
            assert result.exit_code == 2, (args, result.output)
            assert last_line(result) == (
                f"Error: --gpus makes 2 workers, but engine.sglang.url attaches every one to "
                f"the one server at {url}: each would meter its own GPUs while all their "
                "requests ran on that server; give one GPU group (the one the server runs "
                "on), or drop engine.sglang.url so that dvfs starts a server per worker"
            )
        assert not (tmp_path / "out" / "journal.jsonl").exists()
        grouped = path.with_name("grouped.toml")
        grouped.write_text(path.read_text().replace("[gpu]\n", "[gpu]\ndevices = [[0], [1]]\n"))
        result = CliRunner().invoke(cli, ["sweep", str(grouped), "--out", out, "--dry-run"])
        assert result.exit_code == 2, result.output
        assert last_line(result).startswith("Error: gpu.devices makes 2 workers, but ")
        result = CliRunner().invoke(
            cli, ["sweep", str(path), "--gpus", "1", "--out", out, "--dry-run", "--no-estimate"]
        )
        assert result.exit_code == 0, result.output
    finally:
        port.close()


def test_a_fleet_rerun_serving_the_next_drafter_on_another_version_is_refused(
    tmp_path: Path,
) -> None:
    """The same on two GPUs: the driver retires the worker whose server differs from the other
    drafter's in the journal, journals nothing of it, and stops in one line."""
    path, marker = stub_campaign(tmp_path, version="0.5.9", drafters=TWO_DRAFTERS, **ONE_SETTING)
    out = tmp_path / "out"
    args = ["sweep", str(path), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    assert CliRunner().invoke(cli, args, catch_exceptions=False).exit_code == 0
    journal = out / "journal.jsonl"
    other = keep_first_drafter(journal)
    before = journal.read_text()
    config = tmp_path / "stub.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "version": "0.5.23"}))
    refused = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert refused.exit_code == 1, refused.output
    line = last_line(refused)
    assert line.startswith(f"Error: the server of drafter {other!r} on ")
    assert "engine version: 0.5.9 -> 0.5.23" in line and "--fresh" in line
    kept = [r for r in read_records(journal) if r["type"] in ("server", "cell")]
    assert kept == [
        json.loads(x)
        for x in before.splitlines()
        if '"type": "server"' in x or '"type": "cell"' in x
    ]
    assert running(marker) == []


def test_a_drafter_resolved_otherwise_on_resume_is_refused_on_the_twin(tmp_path: Path) -> None:
    """A standalone drafter with its numbers unset, journalled as an earlier twin resolved it
    (a Llama target's (5, 4, 8)), then resumed where it resolves to SGLang's (3, 1, 4): the
    same engine version, but another configuration of one drafter, so its server is refused
    at start and its cells fail, rather than one cube mixing both; a journal holding both
    (edited) gives no cube."""
    from conftest import TINY

    standalone = (
        '[drafters.standalone]\nalgorithm = "STANDALONE"\n'
        'draft_model = "meta-llama/Llama-3.2-1B-Instruct"\n'
    )
    text = TINY[: TINY.index("[drafters.eagle3]")] + standalone + TINY[TINY.index("\n[workload]") :]
    campaign = tmp_path / "standalone.toml"
    campaign.write_text(text)
    out = tmp_path / "out"
    assert sweep(campaign, out).exit_code == 0
    journal = out / "journal.jsonl"
    earlier = {"speculative_num_steps": 5, "speculative_eagle_topk": 4}
    kept, cut = [], False
    for line in journal.read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "server" and record["drafter"] == "standalone":
            assert record["args"]["speculative_num_steps"] == 3  # SGLang's choice today
            record["args"].update(earlier, speculative_num_draft_tokens=8)
        if record["type"] == "cell" and record["cell"]["drafter"] == "standalone":
            if cut:
                continue  # the run was cut after the drafter's first cell
            cut = True
        kept.append(json.dumps(record))
    journal.write_text("\n".join(kept) + "\n")
    (out / "cube.nc").unlink()
    again = sweep(campaign, out)
    assert again.exit_code == 5, again.output
    failed = [r for r in read_records(journal) if r["type"] == "cell" and r["status"] == "failed"]
    assert failed and all("speculative_num_steps: 5 -> 3" in r["error"] for r in failed)
    servers = [r for r in read_records(journal) if r["type"] == "server"]
    assert sum(r["drafter"] == "standalone" for r in servers) == 1  # the refused one not kept
    # Appended by hand, the other configuration gives no cube.
    server = next(r for r in servers if r["drafter"] == "standalone")
    resolved = {**server["args"], "speculative_num_steps": 3, "speculative_eagle_topk": 1}
    with journal.open("a") as f:
        f.write(json.dumps({**server, "args": resolved}) + "\n")
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code != 0 and "speculative_num_steps: 5 -> 3" in last_line(built)


# -- the servers' environment -------------------------------------------------------------------


def with_env(path: Path, **env: str) -> None:
    """The stub campaign at `path` with `env` in engine.sglang.env besides the stub's config."""
    text = re.sub(
        r"env = \{ (?:\w+ = \"[^\"]*\", )*SGLANG_STUB_CONFIG",
        "env = { SGLANG_STUB_CONFIG",
        path.read_text(),
    )
    given = "".join(f"{k} = {json.dumps(v)}, " for k, v in env.items())
    path.write_text(
        text.replace("env = { SGLANG_STUB_CONFIG", f"env = {{ {given}SGLANG_STUB_CONFIG")
    )


def sessions_of(journal: Path) -> list[dict]:
    return [r for r in read_records(journal) if r["type"] == "session"]


@pytest.mark.parametrize(
    ("gpus", "where"), [((), "campaign"), (("--gpus", "0-1"), "dvfs"), ((), "dvfs")]
)
def test_a_resume_whose_servers_get_another_tuning_variable_is_refused(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    gpus: tuple[str, ...],
    where: str,
) -> None:
    """A sweep cut after its first drafter, resumed with CUDA_LAUNCH_BLOCKING=1 (in the
    campaign's engine.sglang.env, or in the environment dvfs runs in, which its servers
    inherit) on one GPU or a fleet of two: refused before any server starts, in one line
    naming the variable, both values and what to do; nothing journalled. A journal whose
    sessions differ in it anyway (edited) gives no cube."""
    path, marker, out = swept_two_drafters(tmp_path, tmp_path_factory, *gpus)
    args = ["sweep", str(path), *gpus, "--out", str(out), "--no-progress"]
    journal = out / "journal.jsonl"
    [session] = sessions_of(journal)
    assert "CUDA_LAUNCH_BLOCKING" not in session["server_env"]
    keep_first_drafter(journal)
    before = journal.read_text()
    if where == "campaign":
        with_env(path, CUDA_LAUNCH_BLOCKING="1")
    else:
        monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    # doctor and the dry run refuse it as the sweep does, in its words (they passed it)
    for check in (
        ["doctor", str(path), *gpus, "--out", str(out)],
        [*args, "--dry-run", "--no-estimate"],
    ):
        checked = CliRunner().invoke(cli, check, catch_exceptions=False)
        assert checked.exit_code == 1, checked.output
        said = " ".join(checked.output.split())
        assert "SGLang servers would start with another environment" in said, said
        assert "(server environment CUDA_LAUNCH_BLOCKING: unset -> '1')" in said, said
    refused = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert refused.exit_code == 1, refused.output
    [line] = refused.output.strip().splitlines()
    assert line.startswith("Error: this run's SGLang servers would start with another environment")
    assert "(server environment CUDA_LAUNCH_BLOCKING: unset -> '1')" in line
    assert "put each back as the journal's servers had it" in line and "--fresh" in line
    assert journal.read_text() == before, "nothing of the refused run was journalled"
    assert running(marker) == []
    # Set back, it resumes.
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    with_env(path)
    assert CliRunner().invoke(cli, args, catch_exceptions=False).exit_code == 0
    # A journal whose sessions differ in it (edited): no cube, in one line.
    changed = {**session, "server_env": {**session["server_env"], "CUDA_LAUNCH_BLOCKING": "1"}}
    with journal.open("a") as f:
        f.write(json.dumps(changed) + "\n")
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code != 0
    assert last_line(built).startswith("Error: the journal's sessions started their SGLang")
    assert "CUDA_LAUNCH_BLOCKING: unset -> '1'" in last_line(built)


def test_a_resume_whose_server_command_sets_another_tuning_variable_is_refused(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """server_command may change between runs: one resumed as `env CUDA_LAUNCH_BLOCKING=1
    python ...` starts the next drafter's server with it whatever dvfs's environment and the
    campaign's env say. It was recorded nowhere, so that drafter was measured with it, unseen,
    and the cube built; it is refused before any server starts, in one line naming it and
    where it is set, as one in engine.sglang.env is."""
    path, marker, out = swept_two_drafters(tmp_path, tmp_path_factory)
    journal = out / "journal.jsonl"
    keep_first_drafter(journal)
    before = journal.read_text()
    command = f"server_command = [{json.dumps(sys.executable)}"
    wrapped = f'server_command = ["env", "CUDA_LAUNCH_BLOCKING=1", {json.dumps(sys.executable)}'
    path.write_text(replace_block(path.read_text(), command, wrapped))
    refused = sweep(path, out)
    assert refused.exit_code == 1, refused.output
    [line] = refused.output.strip().splitlines()
    assert "(server environment CUDA_LAUNCH_BLOCKING: unset -> '1')" in line
    assert "a NAME=VALUE of engine.sglang.server_command" in line
    assert journal.read_text() == before, "nothing of the refused run was journalled"
    assert running(marker) == []


def test_a_journal_whose_server_command_set_a_tuning_variable_resumes_with_it(
    tmp_path: Path,
) -> None:
    """A journal begun with `env NVIDIA_TF32_OVERRIDE=0 python ...` by a dvfs that recorded
    only its own and the campaign's environment (its sessions' server_env without it) resumes
    with the same command: its sessions' server commands say it. The cube keeps it; another
    value is refused."""
    path, marker = stub_campaign(
        tmp_path, drafters=TWO_DRAFTERS, wrapper=("env", "NVIDIA_TF32_OVERRIDE=0"), **ONE_SETTING
    )
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    [session] = sessions_of(journal)
    assert session["server_env"]["NVIDIA_TF32_OVERRIDE"] == "0"
    keep_first_drafter(journal)
    records = read_records(journal)
    for r in records:
        if r["type"] == "session":
            del r["server_env"]["NVIDIA_TF32_OVERRIDE"]
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    again = sweep(path, out)
    assert again.exit_code == 0, again.output
    assert json.loads(open_cube(out / "cube.nc").attrs["server_env"])["NVIDIA_TF32_OVERRIDE"] == "0"
    keep_first_drafter(journal)
    path.write_text(path.read_text().replace("NVIDIA_TF32_OVERRIDE=0", "NVIDIA_TF32_OVERRIDE=1"))
    refused = sweep(path, out)
    assert refused.exit_code == 1, refused.output
    assert "NVIDIA_TF32_OVERRIDE: '0' -> '1'" in last_line(refused)
    assert running(marker) == []


def test_a_url_credential_a_server_command_wrapper_sets_is_recorded_nowhere_and_resumes(
    tmp_path: Path,
) -> None:
    """`env SGLANG_X=http://user:password@host python ...`: the session's settings keep the
    server command with the URL's user and password hidden; its server_env held them whole,
    and a resume with the same command read the hidden value back from the settings and was
    refused, the password in its message. Hidden in both, it resumes and builds."""
    secret = "hunter2-wrapped"
    url = f"http://alice:{secret}@127.0.0.1:9/x"
    path, marker = stub_campaign(
        tmp_path, drafters=TWO_DRAFTERS, wrapper=("env", f"SGLANG_X_ENDPOINT={url}"), **ONE_SETTING
    )
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    [session] = sessions_of(journal)
    assert session["server_env"]["SGLANG_X_ENDPOINT"] == "http://(not recorded)@127.0.0.1:9/x"
    keep_first_drafter(journal)
    again = sweep(path, out)
    assert again.exit_code == 0, again.output
    assert secret not in again.output
    assert secret not in journal.read_text()
    attrs = open_cube(out / "cube.nc").attrs
    assert secret not in json.dumps({k: str(v) for k, v in attrs.items()})
    assert running(marker) == []


def test_a_shell_line_wrapper_records_the_value_the_shell_sets(tmp_path: Path) -> None:
    """`sh -c 'CUDA_LAUNCH_BLOCKING=1 exec /venv/bin/python "$@"'`: the shell sets the variable
    to 1. It was recorded as the rest of the line, so a resume whose line only named another
    Python was refused as a change of CUDA_LAUNCH_BLOCKING; it resumes, and another value of
    the variable in the line is refused."""
    pythons = []
    for name in ("venv-a", "venv-b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "python").symlink_to(sys.executable)
        pythons.append(tmp_path / name / "python")
    path, marker = stub_campaign(tmp_path, drafters=TWO_DRAFTERS, **ONE_SETTING)

    def serve_with(python: Path, value: str) -> None:
        line = f'CUDA_LAUNCH_BLOCKING={value} exec {python} "$@"'
        command = json.dumps(["sh", "-c", line, "sh", str(STUB)])
        path.write_text(
            re.sub(
                r"^server_command = .*$",
                lambda _: f"server_command = {command}",
                path.read_text(),
                flags=re.M,
            )
        )

    serve_with(pythons[0], "1")
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    [session] = sessions_of(journal)
    assert session["server_env"]["CUDA_LAUNCH_BLOCKING"] == "1"
    keep_first_drafter(journal)
    serve_with(pythons[1], "1")
    again = sweep(path, out)
    assert again.exit_code == 0, again.output
    keep_first_drafter(journal)
    serve_with(pythons[1], "0")
    refused = sweep(path, out)
    assert refused.exit_code == 1, refused.output
    assert "(server environment CUDA_LAUNCH_BLOCKING: '1' -> '0')" in last_line(refused)
    assert running(marker) == []


def test_a_wrapper_setting_a_value_with_spaces_records_it_whole(tmp_path: Path) -> None:
    """`env "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, garbage_collection_threshold:0.6"
    python ...` (the wrapper's line as a shell splits it, shlex): env sets the whole value,
    spaces and all (PyTorch's allocator skips them). It was recorded cut at its first space,
    as if a shell line ('expandable_segments:True,'), so a resume whose wrapper set another
    threshold went on unrefused (exit 0). It is recorded whole, and that resume refused."""
    value = "expandable_segments:True, garbage_collection_threshold:0.6"
    wrapper = shlex.split(f'env "PYTORCH_CUDA_ALLOC_CONF={value}"')
    path, marker = stub_campaign(
        tmp_path, drafters=TWO_DRAFTERS, wrapper=tuple(wrapper), **ONE_SETTING
    )
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    [session] = sessions_of(journal)
    assert session["server_env"]["PYTORCH_CUDA_ALLOC_CONF"] == value
    keep_first_drafter(journal)
    path.write_text(path.read_text().replace("threshold:0.6", "threshold:0.9"))
    refused = sweep(path, out)
    assert refused.exit_code == 1, refused.output
    changed = value.replace("0.6", "0.9")
    said = f"(server environment PYTORCH_CUDA_ALLOC_CONF: {value!r} -> {changed!r})"
    assert said in last_line(refused), refused.output
    assert running(marker) == []


@pytest.mark.parametrize(
    ("wrapper", "expected"),
    [
        # sudo's -S reads the password from stdin: sudo sets NAME to its whole argument.
        (["sudo", "-S", "SGLANG_A=1 SGLANG_B=2"], {"SGLANG_A": "1 SGLANG_B=2"}),
        (["sudo", "-S", "PYTORCH_CUDA_ALLOC_CONF=a, b"], {"PYTORCH_CUDA_ALLOC_CONF": "a, b"}),
        # env's --split-string is -S, its line attached or not, after env's other options.
        (["env", "--split-string=SGLANG_A=1 SGLANG_B=2"], {"SGLANG_A": "1", "SGLANG_B": "2"}),
        (["env", "--split-string", "SGLANG_A=1 SGLANG_B=2"], {"SGLANG_A": "1", "SGLANG_B": "2"}),
        (["env", "-SSGLANG_A=1 SGLANG_B=2"], {"SGLANG_A": "1", "SGLANG_B": "2"}),
        (["/usr/bin/env", "-u", "X", "-iS", "SGLANG_A=1 env"], {"SGLANG_A": "1"}),
        (["sudo", "-S", "env", "-S", "SGLANG_A=1 SGLANG_B=2"], {"SGLANG_A": "1", "SGLANG_B": "2"}),
    ],
)
def test_only_envs_split_string_option_splits_a_line(
    wrapper: list[str], expected: dict[str, str]
) -> None:
    """What a wrapper sets on its command line (`command_env`): `sudo -S 'NAME=a b' python`
    (sudo's -S reads the password) sets NAME to 'a b', but was read as env's -S, its argument
    split as a line (NAME 'a', or another variable the argument only names); env's own
    `--split-string="A=1 B=2"` set nothing, read as no NAME=VALUE at all."""
    from dvfs.records.session import command_env

    assert command_env([*wrapper, sys.executable, "-m", "sglang.launch_server"]) == expected


def test_an_unrelated_variable_may_change_and_is_recorded_nowhere(tmp_path: Path) -> None:
    """HF_HOME and HF_TOKEN change between the runs of one sweep: the resume goes on, and
    neither value reaches the journal or the cube; the variables that change kernels
    (NCCL_ALGO) are recorded in each session and the cube's `server_env`."""
    path, marker = stub_campaign(tmp_path, drafters=TWO_DRAFTERS, **ONE_SETTING)
    with_env(path, HF_HOME="/private/hf-first", HF_TOKEN="hf_first_secret", NCCL_ALGO="Ring")
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    keep_first_drafter(out / "journal.jsonl")
    with_env(path, HF_HOME="/private/hf-second", HF_TOKEN="hf_second_secret", NCCL_ALGO="Ring")
    again = sweep(path, out)
    assert again.exit_code == 0, again.output
    sessions = sessions_of(out / "journal.jsonl")
    assert len(sessions) == 2
    assert [s["server_env"]["NCCL_ALGO"] for s in sessions] == ["Ring", "Ring"]
    assert not any("HF_" in k for s in sessions for k in s["server_env"])
    cube = open_cube(out / "cube.nc")
    assert json.loads(cube.attrs["server_env"]) == sessions[0]["server_env"]
    kept = (out / "journal.jsonl").read_text() + json.dumps(
        {k: str(v) for k, v in cube.attrs.items()}
    )
    for secret in ("hf-first", "hf-second", "hf_first_secret", "hf_second_secret"):
        assert secret not in kept, secret
    assert running(marker) == []


def test_a_journal_that_did_not_record_the_environment_resumes_and_builds(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A journal of an earlier dvfs (its session without `server_env`) resumes with any
    environment and builds: not recorded is unknown, not a change. The sessions after it are
    compared with each other."""
    path, marker, out = swept_two_drafters(tmp_path, tmp_path_factory)
    journal = out / "journal.jsonl"
    keep_first_drafter(journal)
    records = read_records(journal)
    for r in records:
        r.pop("server_env", None)
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    with_env(path, TRITON_ALWAYS_COMPILE="1")
    again = sweep(path, out)
    assert again.exit_code == 0, again.output
    assert open_cube(out / "cube.nc").attrs["server_env"]
    with_env(path, TRITON_ALWAYS_COMPILE="0")
    refused = sweep(path, out)
    assert refused.exit_code == 1
    assert "TRITON_ALWAYS_COMPILE: '1' -> '0'" in last_line(refused)
    assert running(marker) == []


def test_the_recorded_variables_are_those_that_change_kernels() -> None:
    """Each prefix is recorded; the GPU pinning dvfs sets, logging, paths and secrets are not."""
    recorded = [p + "X" if p.endswith("_") else p for p in SERVER_ENV_PREFIXES]
    recorded += ["TORCHINDUCTOR_MAX_AUTOTUNE", "PYTORCH_CUDA_ALLOC_CONF", "SGL_ENABLE_JIT_DEEPGEMM"]
    left_out = ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_DEBUG", "HF_HOME", "HF_TOKEN"]
    left_out += ["TRITON_CACHE_DIR", "TORCH_HOME", "CUDA_HOME", "SGLANG_API_KEY", "PATH", "HOME"]
    left_out += ["FLASHINFER_WORKSPACE_BASE", "NCCL_TOPO_FILE", "TORCHINDUCTOR_CACHE_DIR"]
    # Set per launch by torchrun, and per worker by Ray (OMP_NUM_THREADS): a rerun on another
    # executor must not be refused for them.
    left_out += ["TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS"]
    env = {name: "v" for name in recorded + left_out}
    assert server_env_of(env) == {name: "v" for name in sorted(recorded)}


# -- a cube an earlier dvfs built -------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["compare"], ["headroom"], ["report", "-o", "{out}/report.md"]],
)
def test_an_analysis_refuses_a_cube_whose_drafters_were_served_differently(
    small_sweep: Path, tmp_path: Path, command: list[str]
) -> None:
    """`dvfs cube build` refuses a journal whose drafters' servers differ in an arm arg; a
    cube an earlier dvfs built from one (one drafter with other sampling kernels, here
    edited in) is refused by every analysis, naming the difference, not compared."""
    ds = open_cube(small_sweep)
    servers = json.loads(ds.attrs["server_args"])
    first, second = list(servers)
    servers[first]["args"]["sampling_backend"] = "flashinfer"
    servers[second]["args"]["sampling_backend"] = "pytorch"
    ds.attrs["server_args"] = json.dumps(servers)
    path = tmp_path / "cube.nc"
    write_cube(ds, path)
    assert CliRunner().invoke(cli, ["compare", str(small_sweep)]).exit_code == 0
    argv = [command[0], str(path), *(a.format(out=tmp_path) for a in command[1:])]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code != 0
    assert (
        f"{first!r} and {second!r}: sampling kernels (sampling_backend): 'flashinfer' -> "
        "'pytorch'" in last_line(result)
    )
    assert "Traceback" not in result.output


def test_a_cube_whose_arms_report_other_args_is_named_in_cube_info_and_refused(
    small_sweep: Path, tmp_path: Path
) -> None:
    """A cube (an earlier dvfs built it, or one edited) whose one drafter's server reports an
    arm arg the other's does not: `dvfs cube info` names it where it said "alike", and an
    analysis refuses the cube."""
    ds = open_cube(small_sweep)
    servers = json.loads(ds.attrs["server_args"])
    first, second = list(servers)
    servers[first]["args"]["sampling_backend"] = "flashinfer"
    servers[second]["args"].pop("sampling_backend", None)
    ds.attrs["server_args"] = json.dumps(servers)
    path = tmp_path / "cube.nc"
    write_cube(ds, path)
    change = f"{first!r} and {second!r}: sampling kernels (sampling_backend): 'flashinfer' -> "
    info = CliRunner().invoke(cli, ["cube", "info", str(path), "--json"])
    assert info.exit_code == 0, info.output
    assert json.loads(info.output)["invariants"]["arms_differ"] == [f"{change}not reported"]
    result = CliRunner().invoke(cli, ["compare", str(path)])
    assert result.exit_code != 0
    assert f"{change}not reported" in last_line(result)
    assert "Traceback" not in result.output


# -- the model's Hub commit -------------------------------------------------------------------


def test_a_resume_whose_server_loads_another_commit_of_the_model_is_refused(
    tmp_path: Path,
) -> None:
    """An unpinned model (no --revision) is whatever commit the server's Hub cache names for
    main when it starts: each server record keeps it, and a resume whose cache moved to
    another commit (new weights, generation config or template upstream) is refused at the
    next drafter's start, as another engine version is; a journal mixing them builds no cube."""
    path, marker = stub_campaign(tmp_path, drafters=TWO_DRAFTERS, **ONE_SETTING)
    home = tmp_path / "hf"
    text = path.read_text().replace(f'model = "{marker}"', f'model = "org/{marker}"')
    text = text.replace("env = { ", f"env = {{ HF_HOME = {json.dumps(str(home))}, ")
    path.write_text(text)
    ref = home / "hub" / f"models--org--{marker}" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    before, after = "a1" * 20, "b2" * 20
    ref.write_text(before)
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    servers = [r for r in read_records(journal) if r["type"] == "server"]
    assert [s["model_commit"] for s in servers] == [before, before]
    other = keep_first_drafter(journal)
    ref.write_text(after)
    again = sweep(path, out)
    assert again.exit_code == 5, again.output
    records = read_records(journal)
    [failed] = [r for r in records if r["type"] == "cell" and r["cell"]["drafter"] == other]
    assert f"model commit: {before} -> {after}" in failed["error"]
    assert running(marker) == []
    server = next(r for r in records if r["type"] == "server")
    with journal.open("a") as f:
        f.write(json.dumps({**server, "drafter": other, "model_commit": after}) + "\n")
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code != 0
    assert f"model commit: {before} -> {after}" in last_line(built)


def _snapshot(repo: Path, commit: str, files: dict[str, str]) -> None:
    """A Hub cache snapshot of `commit` as huggingface_hub lays it out: each file a link to
    its blob, named by the file's content id (`files`: name to blob id)."""
    for name, blob in files.items():
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        (repo / "blobs" / blob).write_text(blob)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / blob, link.parent))


def test_a_resume_whose_model_commit_changed_only_what_no_server_loads_resumes(
    tmp_path: Path,
) -> None:
    """A commit upstream that edits the model card alone (README.md) moves the cache's main to
    another commit whose weights, config, tokenizer and generation config are the blobs the
    earlier commit's were: the servers load the same files, so the resume is not refused (it
    was, 'model commit: A -> B', for every unpinned model whose card changed since), and the
    cube builds; the card itself, a licence or an image no server reads, even where both
    snapshots hold it. A commit that changes a file both servers loaded still is (below)."""
    path, marker = stub_campaign(tmp_path, drafters=TWO_DRAFTERS, **ONE_SETTING)
    home = tmp_path / "hf"
    text = path.read_text().replace(f'model = "{marker}"', f'model = "org/{marker}"')
    text = text.replace("env = { ", f"env = {{ HF_HOME = {json.dumps(str(home))}, ")
    path.write_text(text)
    repo = home / "hub" / f"models--org--{marker}"
    served = {"config.json": "c0" * 20, "model.safetensors": "5a" * 32}
    before, after, changed = "a1" * 20, "b2" * 20, "c3" * 20
    _snapshot(repo, before, {**served, "README.md": "d1" * 20, "LICENSE": "f0" * 20})
    # a server fetches no model card, but a whole repo's download (huggingface-cli) does
    _snapshot(repo, after, {**served, "README.md": "d2" * 20, "figures/a.png": "a0" * 20})
    _snapshot(repo, changed, {**served, "config.json": "e4" * 20})
    ref = repo / "refs" / "main"
    ref.parent.mkdir()
    ref.write_text(before)
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    other = keep_first_drafter(journal)
    ref.write_text(after)
    again = sweep(path, out)
    assert again.exit_code == 0, again.output
    servers = [r for r in read_records(journal) if r["type"] == "server"]
    assert [s["model_commit"] for s in servers] == [before, after]
    assert CliRunner().invoke(cli, ["cube", "build", str(out)]).exit_code == 0
    keep_first_drafter(journal)
    ref.write_text(changed)
    refused = sweep(path, out)
    assert refused.exit_code == 5, refused.output
    failed = _the_failed_cell(journal, other)
    assert f"model commit: {before} -> {changed} (config.json)" in failed["error"]


def _the_failed_cell(journal: Path, drafter: str) -> dict:
    """The one cell record of `drafter` in `journal` that failed (a refused resume's)."""
    [failed] = [
        r
        for r in read_records(journal)
        if r["type"] == "cell" and r["cell"]["drafter"] == drafter and r.get("error")
    ]
    return failed


def test_the_model_commit_is_read_from_the_servers_hub_cache(tmp_path: Path) -> None:
    from dvfs.engines.sglang import model_commit

    commit = "c3" * 20
    ref = tmp_path / "cache" / "models--org--m" / "refs" / "v2"
    ref.parent.mkdir(parents=True)
    ref.write_text(commit + "\n")
    env = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "elsewhere")}
    assert model_commit("org/m", "v2", env) == commit
    assert model_commit("org/m", None, env) == ""  # no refs/main in that cache
    assert model_commit("org/m", "d4" * 20, {}) == "d4" * 20  # pinned to a commit
    assert model_commit(str(tmp_path), None, env) == ""  # a local folder
    assert model_commit("org/m", "v2", {"HF_HOME": str(tmp_path / "elsewhere")}) == ""
    ref.write_text("not a commit")
    assert model_commit("org/m", "v2", env) == ""
    # A ref that is no regular file (a FIFO: its read waited for a writer for ever) tells
    # nothing, as one that cannot be read.
    ref.unlink()
    os.mkfifo(ref)
    assert model_commit("org/m", "v2", env) == ""


def _download_dir_campaign(tmp_path: Path) -> tuple[Path, Path, Path, str]:
    """A stub campaign of two drafters on model org/<marker>, its server given --download-dir
    (`dl`) and HF_HOME (`home`): (dl, home, campaign file, marker)."""
    dl, home = tmp_path / "weights", tmp_path / "hf"
    path, marker = stub_campaign(
        tmp_path,
        drafters=TWO_DRAFTERS,
        **ONE_SETTING,
        sglang_extra=f"extra_args = {json.dumps(['--download-dir', str(dl)])}",
    )
    text = path.read_text().replace(f'model = "{marker}"', f'model = "org/{marker}"')
    text = text.replace("env = { ", f"env = {{ HF_HOME = {json.dumps(str(home))}, ")
    path.write_text(text)
    return dl, home, path, marker


def test_the_model_commit_of_a_server_given_a_download_dir_is_read_there(tmp_path: Path) -> None:
    """SGLang's --download-dir is the Hub cache its weights load from (0.5.9 and 0.5.23
    model_loader/weight_utils.py `download_weights_from_hf`, cache_dir: its refs looked up
    first): the commit is read there, not from HF_HOME's cache, which may hold an older copy
    (dvfs recorded that copy's commit for the weights served)."""
    dl, home, path, marker = _download_dir_campaign(tmp_path)
    served, stale = "c3" * 20, "d4" * 20
    for cache, commit in ((dl, served), (home / "hub", stale)):
        repo = cache / f"models--org--{marker}"
        _snapshot(repo, commit, {"model.safetensors": commit})
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    servers = [r for r in read_records(out / "journal.jsonl") if r["type"] == "server"]
    assert [s["model_commit"] for s in servers] == [served, served]
    assert [s["model_files"] for s in servers] == [{"model.safetensors": served}] * 2


def test_a_resume_whose_download_dir_commit_changed_the_config_alone_is_refused(
    tmp_path: Path,
) -> None:
    """A server given --download-dir fetches its weights there (`download_weights_from_hf`'s
    cache_dir), but its config and tokenizer through transformers, from the Hub cache: the
    --download-dir snapshot of a commit holds the weights alone. A commit upstream that edits
    config.json alone (not the weights) was taken for the same model, every file both
    snapshots there hold being the same blobs, though the resumed server loads another
    config. The files of the commit's snapshot in the Hub cache are compared too."""
    dl, home, path, marker = _download_dir_campaign(tmp_path)
    before, after = "a1" * 20, "b2" * 20
    weights = {"model.safetensors": "5a" * 32}
    refs = []
    for cache, files in (
        (dl, {before: weights, after: weights}),
        (home / "hub", {before: {"config.json": "c0" * 20}, after: {"config.json": "e4" * 20}}),
    ):
        repo = cache / f"models--org--{marker}"
        for commit, held in files.items():
            _snapshot(repo, commit, held)
        (repo / "refs").mkdir()
        refs.append(repo / "refs" / "main")
        refs[-1].write_text(before)
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    other = keep_first_drafter(journal)
    for ref in refs:
        ref.write_text(after)
    refused = sweep(path, out)
    assert refused.exit_code == 5, refused.output
    failed = _the_failed_cell(journal, other)
    assert f"model commit: {before} -> {after} (config.json)" in failed["error"]


def test_a_commit_that_resharded_the_weights_is_another_model() -> None:
    """A commit upstream that uploads the weights anew in other files (one model.safetensors
    becomes shards with their index), the config and tokenizer left as they were: the two
    snapshots share no weight file, and every file both hold is the same blob, so it was
    taken for the same model though the server loads other weights. A server fetches every
    `*.safetensors` of its commit (`download_weights_from_hf`), as a whole repo's download
    does: the names differing is a change. The same names, or one side with no safetensors,
    leave the comparison to the files both hold."""
    from dvfs.records.session import server_changes

    before, after = "a1" * 20, "b2" * 20
    same = {"config.json": "c0" * 20, "tokenizer.json": "d0" * 20}
    one = {**same, "model.safetensors": "5a" * 32}
    shards = {
        **same,
        "model-00001-of-00002.safetensors": "6b" * 32,
        "model-00002-of-00002.safetensors": "7c" * 32,
        "model.safetensors.index.json": "8d" * 20,
    }
    server = {"engine": "sglang", "version": "0.5.9", "args": {}}
    a = {**server, "model_commit": before, "model_files": one}
    b = {**server, "model_commit": after, "model_files": shards}
    [change] = server_changes(a, b)
    assert change.startswith(f"model commit: {before} -> {after} (model"), change
    assert "model.safetensors" in change and "model-00001-of-00002.safetensors" in change
    card = {**one, "README.md": "e0" * 20}
    assert server_changes(a, {**b, "model_files": card}) == []
    # a .bin-only side: what each fetched is left to the files both hold (config, tokenizer)
    bins = {**same, "pytorch_model.bin": "9e" * 32}
    assert server_changes({**a, "model_files": bins}, b) == []


def test_a_consolidated_file_beside_the_indexed_shards_is_no_other_model() -> None:
    """A repo shipping both shards with their index and one `consolidated.safetensors` (Mistral's
    layout): a server loads the shards the index names, the consolidated file dropped as their
    duplicate (`filter_duplicate_safetensors_files`). A snapshot fetched without it (`hf
    download --exclude 'consolidated*'`, read offline as it is) and one of the next commit
    fetched whole hold the same weights the server loads: a commit upstream that edited the
    card alone is the same model. Other shards, or another index, stay a change."""
    from dvfs.records.session import server_changes

    before, after = "a1" * 20, "b2" * 20
    shards = {
        "config.json": "c0" * 20,
        "model-00001-of-00002.safetensors": "6b" * 32,
        "model-00002-of-00002.safetensors": "7c" * 32,
        "model.safetensors.index.json": "8d" * 20,
    }
    whole = {**shards, "consolidated.safetensors": "5a" * 32, "README.md": "e0" * 20}
    server = {"engine": "sglang", "version": "0.5.9", "args": {}}
    a = {**server, "model_commit": before, "model_files": shards}
    b = {**server, "model_commit": after, "model_files": whole}
    assert server_changes(a, b) == []
    assert server_changes(b, a) == []
    # the index naming other shards: another model, named by the index that changed
    other = {k: v for k, v in whole.items() if k != "model-00002-of-00002.safetensors"}
    resharded = {**other, "model.safetensors.index.json": "9f" * 20}
    [change] = server_changes(a, {**b, "model_files": resharded})
    assert "model.safetensors.index.json" in change, change


def test_the_model_commit_is_read_where_huggingface_hub_looks(tmp_path: Path) -> None:
    """The server's huggingface_hub finds its cache as its constants say: HF_HUB_CACHE, else
    the legacy HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, each with '~' and $VARS expanded.
    dvfs read HF_HOME's cache (or ~/.cache's) under HUGGINGFACE_HUB_CACHE, recording a stale
    copy's commit for the one served, and no cache at all for HF_HOME = "~/hf" (a campaign's
    env is no shell: the value reaches the server as written, and huggingface_hub expands it)."""
    from dvfs.engines.sglang import model_commit

    served, stale, xdg = "c3" * 20, "d4" * 20, "e5" * 20
    for cache, commit in (
        (tmp_path / "served", served),
        (tmp_path / "home" / "hub", stale),
        (tmp_path / "x" / "huggingface" / "hub", xdg),
    ):
        ref = cache / "models--org--m" / "refs" / "main"
        ref.parent.mkdir(parents=True)
        ref.write_text(commit)
    legacy = {"HUGGINGFACE_HUB_CACHE": str(tmp_path / "served"), "HF_HOME": str(tmp_path / "home")}
    assert model_commit("org/m", None, legacy) == served
    newer = {**legacy, "HF_HUB_CACHE": str(tmp_path / "home" / "hub")}
    assert model_commit("org/m", None, newer) == stale
    home = {"HOME": str(tmp_path), "ROOT": str(tmp_path)}
    assert model_commit("org/m", None, {**home, "HF_HOME": "~/home"}) == stale
    assert model_commit("org/m", None, {**home, "HF_HUB_CACHE": "$ROOT/served"}) == served
    assert model_commit("org/m", None, {**home, "XDG_CACHE_HOME": "${ROOT}/x"}) == xdg


def test_a_resume_whose_servers_get_another_cublas_workspace_is_refused(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """CUBLAS_WORKSPACE_CONFIG bounds which GEMM algorithms cuBLAS may pick: a resume whose
    servers get another is refused naming it. A journal an earlier dvfs began, whose session
    did not record such names (no `server_env_prefixes`), is not compared in them (unknown,
    not unset): it resumes, and its cube builds."""
    path, marker, out = swept_two_drafters(tmp_path, tmp_path_factory)
    journal = out / "journal.jsonl"
    [session] = sessions_of(journal)
    assert "CUBLAS_WORKSPACE_CONFIG" in session["server_env_prefixes"]
    keep_first_drafter(journal)
    with_env(path, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    refused = sweep(path, out)
    assert refused.exit_code == 1, refused.output
    assert "(server environment CUBLAS_WORKSPACE_CONFIG: unset -> ':4096:8')" in last_line(refused)
    assert running(marker) == []
    # Begun by an earlier dvfs: its session says nothing of cuBLAS, so nothing is compared.
    records = read_records(journal)
    for r in records:
        r.pop("server_env_prefixes", None)
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    again = sweep(path, out)
    assert again.exit_code == 0, again.output
    later = sessions_of(journal)[-1]
    assert later["server_env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert CliRunner().invoke(cli, ["cube", "build", str(out)]).exit_code == 0


def test_cubes_compare_the_environment_under_the_prefixes_both_recorded() -> None:
    from dvfs.records import env_changes

    old = {"server_env": {"NCCL_ALGO": "Ring"}}  # an earlier dvfs's: no prefixes said
    new = {
        "server_env": {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
        "server_env_prefixes": "SGLANG_,NCCL_,CUBLAS_WORKSPACE_CONFIG",  # a cube's attribute
    }
    assert env_changes(old, new) == []
    unset = {"server_env": {"NCCL_ALGO": "Ring"}, "server_env_prefixes": new["server_env_prefixes"]}
    assert env_changes(unset, new) == [
        "server environment CUBLAS_WORKSPACE_CONFIG: unset -> ':4096:8'"
    ]
    assert env_changes({"server_env": {"NCCL_ALGO": "Tree"}}, new) == [
        "server environment NCCL_ALGO: 'Tree' -> 'Ring'"
    ]


def test_an_attached_server_replaced_by_one_of_many_other_flags_ends_in_its_remedy(
    tmp_path: Path, attached: tuple[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server at engine.sglang.url replaced by one started with many other flags: the
    sweep's line (cut at MAX_MESSAGE_CHARS) ended inside the changes it named, its remedy
    (restart it as it was) lost. It names as many as fit, counts the rest, and ends whole."""
    port, _ = attached
    path, marker = attached_campaign(
        tmp_path,
        port,
        batch="[1]",
        knobs="sm_clock = [1980, 1500]\nsettle_s = 0.0",
    )
    argv = ("--model-path", marker, "--random-seed", "0")
    many = [
        "--dtype",
        "float16",
        "--chunked-prefill-size",
        "4096",
        "--max-prefill-tokens",
        "4096",
        "--schedule-policy",
        "lpm",
        "--schedule-conservativeness",
        "0.5",
        "--stream-interval",
        "2",
        "--max-total-tokens",
        "100000",
        "--num-continuous-decode-steps",
        "2",
        "--sampling-backend",
        "pytorch",
        "--context-length",
        "4096",
        "--enable-torch-compile",
        "--page-size",
        "16",
        "--num-reserved-decode-tokens",
        "256",
        "--sleep-on-idle",
        "--enable-tf32-matmul",
        "--enable-fp32-lm-head",
    ]
    result, servers = sweep_replacing_the_server(
        monkeypatch, path, tmp_path / "out", attached, argv, lambda _: tuple(many)
    )
    assert len(servers) == 2, result.output
    assert result.exit_code == 1, result.output
    error = last_line(result)
    assert error.startswith(
        f"Error: the server at http://127.0.0.1:{port} is not the one dvfs attached to"
    )
    assert " more): it was replaced mid-sweep" in error, error
    assert error.endswith("rerun with --fresh (or into another --out folder)"), error
    assert "restart it as it was and rerun the same command to resume" in error


def test_a_resume_refused_on_its_attached_server_says_to_restart_that_server(
    tmp_path: Path, attached: tuple[int, Path]
) -> None:
    """A resume attached to a server (engine.sglang.url) started again with
    --mem-fraction-static: its cells fail as the server differs from the journal's. The advice,
    in each cell's error and in the closing line, said to start it with "the same flags from
    engine.sglang.server_command and env", which dvfs does not use for a server it attaches
    to. It says to restart the server at engine.sglang.url as it was."""
    port, config = attached
    path, marker = attached_campaign(
        tmp_path,
        port,
        batch="[1]",
        knobs="sm_clock = [1980, 1500]\nsettle_s = 0.0",
    )
    argv = ("--model-path", marker, "--random-seed", "0")
    journal = tmp_path / "out" / "journal.jsonl"
    for extra in ((), ("--mem-fraction-static", "0.6")):
        server = serve(port, config, *argv, *extra)
        try:
            result = sweep(path, tmp_path / "out")
        finally:
            server.terminate()
            server.wait(timeout=10)
        if not extra:  # the journal cut after its first cell: the second is resumed
            assert result.exit_code == 0, result.output
            lines = journal.read_text().splitlines(keepends=True)
            cut = [i for i, line in enumerate(lines) if '"type":"cell"' in line][1]
            journal.write_text("".join(lines[:cut]))
    assert result.exit_code == 5, result.output
    [failed] = [r for r in read_records(journal) if r.get("status") == "failed"]
    [closing] = [line for line in result.output.splitlines() if line.startswith("Finished with")]
    for said in (failed["error"], closing):
        assert "restart the server at engine.sglang.url as it was" in said, said
        assert "engine.sglang.server_command" not in said, said
        assert "by the host's smallest GPU" in said, said


def test_a_fleets_folder_resumed_on_its_attached_server_restarted_otherwise_says_to_restart_it(
    tmp_path: Path, attached: tuple[int, Path]
) -> None:
    """A fleet's folder (`--gpus 0-1`, its servers started by dvfs) resumed by a fleet of one
    (`--gpus 0`) attached to a server (engine.sglang.url) started by hand with --dtype
    float16: refused, as its drafter's server differs from the one that measured its cells.
    The line said it differed from "drafter 'none''s" server, that the arms would compare more
    than their drafters, and to run every drafter on the same flags (engine.sglang.extra_args),
    which reach no attached server. It says, as one GPU's sweep does, to restart the server at
    engine.sglang.url as it was; restarted so, the resume finishes. `dvfs doctor --gpus 0`
    said "ok engine" before that refused resume (it compared no fleet's journal): it fails
    in the fleet's own line, exit 1, and passes once the server is restarted as it was. The
    refusal also said "worker gpu0 lost (...); its unfinished cells go to the others", with
    no other worker: it says the worker was retired, its server refused, with none left."""
    port, config = attached
    path, marker = attached_campaign(
        tmp_path, port, batch="[1]", knobs="sm_clock = [1980, 1500]\nsettle_s = 0.0"
    )
    from test_sglang_engine import _answering

    url = f'url = "http://127.0.0.1:{port}"'
    path.write_text(path.read_text().replace(url, ""))  # the fleet's servers: dvfs's own
    out = tmp_path / "out"
    args = ["sweep", str(path), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    assert CliRunner().invoke(cli, args, catch_exceptions=False).exit_code == 0
    journal = out / "journal.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if '"type":"cell"' in line][1]
    journal.write_text("".join(lines[:cut]))
    path.write_text(path.read_text().replace("[engine.sglang]\n", f"[engine.sglang]\n{url}\n"))
    # As dvfs started the journal's servers: the campaign's seed, running requests capped
    argv = ("--model-path", marker, "--random-seed", "0", "--max-running-requests", "1")
    args[3] = "0"
    for extra in (("--dtype", "float16"), ()):
        server = serve(port, config, *argv, *extra)
        try:
            _answering(port)
            doctor = ["doctor", str(path), "--gpus", "0", "--out", str(out), "--json"]
            checked = CliRunner().invoke(cli, doctor)
            result = CliRunner().invoke(cli, args, catch_exceptions=False)
        finally:
            server.terminate()
            server.wait(timeout=10)
        [engine] = [c for c in json.loads(checked.stdout) if c["name"] == "engine"]
        if not extra:
            assert (checked.exit_code, engine["status"]) == (0, "ok"), checked.output
        if extra:
            assert result.exit_code == 1, result.output
            assert (checked.exit_code, engine["status"]) == (1, "fail"), checked.output
            assert engine["detail"].startswith(last_line(result).removeprefix("Error: "))
            line = last_line(result)
            assert "differs from the one that measured its cells" in line, line
            assert "dtype (dtype): 'auto' -> 'float16'" in line, line
            assert "restart the server at engine.sglang.url as it was" in line, line
            assert "extra_args" not in line and "drafter 'none''s" not in line, line
            # not "lost", its cells going to "the others": it is refused, and alone
            told = " ".join(result.output.split())
            assert "worker gpu0 retired, its server refused: no other worker is left" in told
            assert "lost" not in told and "the others" not in told, told
    assert result.exit_code == 0, result.output
    assert running(marker) == []
