"""What SGLang sets for a speculative algorithm besides its speculative_* args, and how dvfs keeps
the arms alike anyway: one list of decode CUDA graphs for every arm, the overlap scheduler off
for every arm on 0.5.9, the resolved scheduling args compared at every server start and in the
cube, and a refusal before any server starts where SGLang would set one differently for some
drafters whatever dvfs passes. The facts come from SGLang 0.5.9's srt/server_args.py and
0.5.23's srt/arg_groups/ as the stub plays them (its docstring, "Scheduling")."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from click.testing import CliRunner, Result
from conftest import replace_block
from hypothesis import given
from hypothesis import strategies as st
from sglang_support import EAGLE3_DRAFTER, REPO, STUB, load_stub, running, stub_campaign

from dvfs.campaign import load_campaign
from dvfs.cli import cli
from dvfs.clock import MonotonicClock
from dvfs.engines.sglang import SglangEngine
from dvfs.engines.sglang_args import (
    SHORTEST_PREFIXES,
    arm_mismatches,
    graph_batch_sizes,
    launch_argv,
    names_flag,
)
from dvfs.errors import ArmMismatchError, CampaignError
from dvfs.measure.journal import read_records
from dvfs.records import ARMS_PINNED, Header, arm_changes, begun_unpinned, decode_graph

ONE_SETTING = {"knobs": "sm_clock = [1980]\nsettle_s = 0.0"}
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
EAGLE3 = ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d")
STANDALONE = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "d")
NGRAM = ("--speculative-algorithm", "NGRAM")
DFLASH = ("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "d")
TABLES = REPO / "tests" / "data" / "sglang-args"


@pytest.fixture(scope="module")
def stub() -> ModuleType:
    return load_stub()


def resolve(
    stub: ModuleType, version: str, *argv: str, environ: dict[str, str] | None = None
) -> dict[str, Any]:
    args, _ = stub.parse_launch_argv(
        ["--model-path", LLAMA, *argv], stub.StubConfig(version=version), environ
    )
    return dict(args)


def record(args: dict[str, Any]) -> dict[str, Any]:
    """A server record as the journal keeps it."""
    return {"engine": "sglang", "version": "x", "attention_backend": "fa3", "args": args}


def campaign_text(drafters: str, batch: str, engine_extra: str = "") -> str:
    return f"""
[gpu]
backend = "twin"
profile = "h100-sxm"

[engine]
backend = "sglang"
model = "{LLAMA}"

[engine.sglang]
{engine_extra}
{drafters}

[workload]
batch = {batch}
corpora = ["code"]
"""


DRAFTERS = """
[drafters.none]
algorithm = "none"

[drafters.eagle3]
algorithm = "EAGLE3"
draft_model = "draft/eagle3"
num_steps = 5
eagle_topk = 4
num_draft_tokens = 8

[drafters.standalone]
algorithm = "STANDALONE"
draft_model = "draft/small"

[drafters.ngram]
algorithm = "NGRAM"
"""
DFLASH_DRAFTER = '\n[drafters.dflash]\nalgorithm = "DFLASH"\ndraft_model = "draft/dflash"\n'


def load(tmp_path: Path, text: str) -> Any:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load_campaign(path)


def sweep(path: Path, out: Path, *extra: str) -> Result:
    return CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress", *extra])


def servers(out: Path) -> dict[str, dict[str, Any]]:
    return {
        r["drafter"]: r["args"]
        for r in read_records(out / "journal.jsonl")
        if r["type"] == "server"
    }


# -- what SGLang does, as the stub plays it ---------------------------------------------------


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_the_stub_plays_what_sglang_sets_per_algorithm(stub: ModuleType, version: str) -> None:
    """Left to itself (no flag from dvfs), SGLang schedules the arms differently."""
    mixed = ("--enable-mixed-chunk",)
    arms = {"none": (), "eagle3": EAGLE3, "standalone": STANDALONE, "ngram": NGRAM}
    if version == "0.5.23":
        arms["dflash"] = DFLASH
    resolved = {name: resolve(stub, version, *argv, *mixed) for name, argv in arms.items()}
    overlap_off = {name: a["disable_overlap_schedule"] for name, a in resolved.items()}
    mixed_on = {name: a["enable_mixed_chunk"] for name, a in resolved.items()}
    if version == "0.5.9":
        # Every algorithm turns both off (server_args.py `_handle_speculative_decoding`).
        assert overlap_off == {"none": False, "eagle3": True, "standalone": True, "ngram": True}
        assert mixed_on == {"none": True, "eagle3": False, "standalone": False, "ngram": False}
        v2 = {"SGLANG_ENABLE_SPEC_V2": "true"}
        with_v2 = {n: resolve(stub, version, *a, environ=v2) for n, a in arms.items()}
        assert {n: a["disable_overlap_schedule"] for n, a in with_v2.items()} == {
            "none": False,
            "eagle3": False,
            "standalone": False,
            "ngram": True,
        }
    else:
        # The overlap scheduler stays on; mixed chunks only where `supports_mixed_chunk`.
        assert set(overlap_off.values()) == {False}
        assert mixed_on == {
            "none": True,
            "eagle3": True,
            "standalone": False,
            "ngram": False,
            "dflash": True,
        }
    # A finer CUDA-graph ladder when speculating: a batch of 6 pads to 8 only in the plain arm.
    assert {n: decode_graph(a, 6) for n, a in resolved.items()} == {
        n: 8 if n == "none" else 6 for n in arms
    }
    assert {decode_graph(a, 8) for a in resolved.values()} == {8}
    legacy = [
        "overlap scheduler disabled (disable_overlap_schedule): False -> True",
        "mixed chunked prefill (enable_mixed_chunk): True -> False",
    ]
    # and each server draws its own random seed (1 in 2**30 that two draws agree)
    seeds = resolved["none"]["random_seed"], resolved["eagle3"]["random_seed"]
    assert arm_changes(record(resolved["none"]), record(resolved["eagle3"]), [6, 8]) == [
        *(legacy if version == "0.5.9" else []),
        f"random seed (random_seed): {seeds[0]!r} -> {seeds[1]!r}",
        "decode CUDA graph at batch 6: 8 -> 6",
    ]
    # STANDALONE's automatic triple is (3, 1, 4) even for a Llama target; EAGLE's (5, 4, 8).
    trio = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
    assert tuple(resolved["standalone"][k] for k in trio) == (3, 1, 4)
    assert tuple(resolved["eagle3"][k] for k in trio) == (5, 4, 8)
    assert resolved["ngram"]["speculative_eagle_topk"] == 10  # its breadth


def test_decode_graph_reads_either_release() -> None:
    new = {"cuda_graph_config": {"decode": {"backend": "full", "bs": [1, 2, 4, 8], "max_bs": 8}}}
    old = {"cuda_graph_bs": [1, 2, 4, 8], "cuda_graph_max_bs": 8, "disable_cuda_graph": False}
    for args in (new, old):
        assert [decode_graph(args, b) for b in (1, 3, 8, 9)] == [1, 4, 8, "eager"]
    off_new = {"cuda_graph_config": {"decode": {"backend": "disabled", "bs": [1, 2]}}}
    assert decode_graph(off_new, 1) == "eager"
    assert decode_graph({**old, "disable_cuda_graph": True}, 1) == "eager"
    for unknown in ({}, {"cuda_graph_bs": None}, {"cuda_graph_bs": ["x"]}, {"cuda_graph_bs": []}):
        assert decode_graph(unknown, 1) is None
    # Not reported by either server (the twin): nothing to compare. By one of two servers of
    # one release: unknown, named, never taken as alike.
    assert arm_changes(record({}), record({}), [3]) == []
    assert arm_changes(record(new), record({}), [3]) == [
        "decode CUDA graph at batch 3: 4 -> not reported"
    ]


@given(st.lists(st.integers(1, 600), min_size=1, max_size=6))
def test_graph_sizes_hold_every_batch_and_pad_less_than_twice(batches: list[int]) -> None:
    sizes = graph_batch_sizes(batches)
    assert sizes == sorted(set(sizes)) and max(sizes) == max(batches)
    assert set(batches) <= set(sizes)
    for b in range(1, max(batches) + 1):
        assert min(s for s in sizes if s >= b) < 2 * b


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_the_stub_reports_the_arm_args_by_sglangs_names_and_types(
    stub: ModuleType, version: str
) -> None:
    """SGLang stores --fp8-gemm-backend / --fp4-gemm-backend as fp8_gemm_runner_backend /
    fp4_gemm_runner_backend (0.5.9 server_args.py `dest=`, 0.5.23 arg_groups/fields/exec_.py
    `cli_name=`) and types its numbers: the stub reported the flags' own names, and numbers
    as strings, so the arm checks never saw the real names."""
    args = resolve(
        stub,
        version,
        *("--fp8-gemm-backend", "cutlass", "--fp4-gemm-backend", "flashinfer_cudnn"),
        *("--num-continuous-decode-steps", "4", "--cpu-offload-gb", "8"),
        *("--tbo-token-distribution-threshold", "0.3"),
    )
    assert args["fp8_gemm_runner_backend"] == "cutlass"
    assert args["fp4_gemm_runner_backend"] == "flashinfer_cudnn"
    assert "fp8_gemm_backend" not in args and "fp4_gemm_backend" not in args
    assert args["num_continuous_decode_steps"] == 4 and args["cpu_offload_gb"] == 8
    assert args["tbo_token_distribution_threshold"] == 0.3


# -- what dvfs passes -------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_dvfs_launches_every_arm_alike(stub: ModuleType, version: str, tmp_path: Path) -> None:
    """Through the real option tables: every pair of arms resolves the same scheduling args and
    decode graphs at the campaign's batch sizes; without dvfs's flags they would not."""
    drafters = DRAFTERS + (DFLASH_DRAFTER if version == "0.5.23" else "")
    campaign = load(tmp_path, campaign_text(drafters, "[1, 6, 20]"))
    batches = campaign.workload.batch_sizes
    graph_flag = "--cuda-graph-bs-decode" if version == "0.5.23" else "--cuda-graph-bs"
    resolved, stripped = {}, {}
    for drafter in campaign.drafters:
        argv = launch_argv(campaign, drafter, port=31000, version=version)[3:]
        at = argv.index(graph_flag)
        assert argv[at + 1 : at + 8] == ["1", "2", "4", "6", "8", "16", "20"]
        assert ("--disable-overlap-schedule" in argv) == (version == "0.5.9")
        resolved[drafter.name] = record(resolve(stub, version, *argv[2:]))
        plain = [a for a in argv[:at] + argv[at + 8 :] if a != "--disable-overlap-schedule"]
        stripped[drafter.name] = record(resolve(stub, version, *plain[2:]))
    for name, server in resolved.items():
        assert arm_changes(resolved["none"], server, batches) == [], name
    differences = arm_changes(stripped["none"], stripped["eagle3"], batches)
    assert "decode CUDA graph at batch 6: 8 -> 6" in differences
    # 20 is on the speculative ladder, not the plain one: 0.5.9 runs the plain arm's batch of 20
    # without a graph; 0.5.23 captures the limit itself (cuda_graph_hook.py line 528).
    at_20 = "decode CUDA graph at batch 20: eager -> 20"
    assert (at_20 in differences) == (version == "0.5.9")
    overlap = "overlap scheduler disabled (disable_overlap_schedule): False -> True"
    assert (overlap in differences) == (version == "0.5.9")
    # No speculative drafter on 0.5.9: the overlap scheduler is left on.
    plain_only = load(tmp_path, campaign_text('[drafters.none]\nalgorithm = "none"\n', "[1]"))
    argv = launch_argv(plain_only, plain_only.drafters[0], port=31000, version="0.5.9")
    assert "--disable-overlap-schedule" not in argv


def test_a_campaign_may_not_set_the_graph_sizes_itself(tmp_path: Path) -> None:
    # 0.5.23's --cuda-graph-config (a JSON of graph settings) overrides the sizes dvfs sets.
    for flag in ("--cuda-graph-bs-decode", "--cuda-graph-bs", "--cuda-graph-config"):
        text = campaign_text(DRAFTERS, "[1]", f'extra_args = ["{flag}", "1", "2"]')
        with pytest.raises(CampaignError, match=rf"{flag}.*workload\.batch"):
            load(tmp_path, text)


# -- what no flag can make alike: refused before any server starts ---------------------------


@pytest.mark.parametrize(
    ("legacy", "drafters", "refused"),
    [
        (False, ["none", "ngram"], (["ngram"], ["none"])),
        (False, ["none", "standalone", "eagle3"], (["standalone"], ["none", "eagle3"])),
        (False, ["none", "eagle3"], None),  # both keep mixed chunks
        (False, ["ngram", "standalone"], None),  # neither does
        (True, ["none", "eagle3"], (["eagle3"], ["none"])),
        (True, ["eagle3", "ngram"], None),
    ],
)
def test_mixed_chunks_for_some_drafters_only_are_refused(
    tmp_path: Path, legacy: bool, drafters: list[str], refused: Any
) -> None:
    blocks = DRAFTERS.split("\n[drafters.")
    text = "\n".join("[drafters." + b for b in blocks[1:] if b.split("]")[0] in drafters)
    campaign = load(tmp_path, campaign_text(text, "[1]", 'extra_args = ["--enable-mixed-chunk"]'))
    problems = arm_mismatches(campaign, legacy=legacy, env={})
    if refused is None:
        assert problems == []
        return
    off, kept = refused
    [line] = problems
    rules = "SGLang 0.5.9" if legacy else "SGLang 0.5.23"
    assert line.startswith(f"--enable-mixed-chunk in engine.sglang.extra_args: {rules} turns")
    names = ", ".join(repr(n) for n in off), ", ".join(repr(n) for n in kept)
    assert f"off for drafters {names[0]} but not for {names[1]} (enable_mixed_chunk)" in line
    # An abbreviation argparse would take counts too; without the flag nothing is refused.
    short = load(tmp_path, campaign_text(text, "[1]", 'extra_args = ["--enable-mixed"]'))
    [abbreviated] = arm_mismatches(short, legacy=legacy, env={})  # quoted as written
    assert abbreviated == line.replace("--enable-mixed-chunk", "--enable-mixed", 1).replace(
        "(enable_mixed_chunk)", "(enable_mixed_chunk, which --enable-mixed abbreviates)"
    )
    assert arm_mismatches(load(tmp_path, campaign_text(text, "[1]")), legacy=legacy, env={}) == []


def test_mixed_chunks_with_a_gemma4_assistant_draft_are_refused_before_any_server(
    tmp_path: Path,
) -> None:
    """0.5.23 serves EAGLE or NEXTN with a Gemma4 assistant draft as FROZEN_KV_MTP, without
    mixed chunked prefill (speculative_hook.py `_handle_frozen_kv_mtp`): with
    --enable-mixed-chunk such a campaign was refused only after its servers started. It is
    refused before, in the words of the other algorithms, the draft found as a local folder
    or in the Hub cache; another EAGLE draft keeps mixed chunks."""
    local = tmp_path / "gemma4-assistant"
    local.mkdir()
    local.joinpath("config.json").write_text('{"architectures": ["Gemma4AssistantForCausalLM"]}')
    hub = tmp_path / "hub"
    snapshot = hub / "models--google--g4-assistant" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    snapshot.joinpath("config.json").write_text(
        '{"architectures": ["Gemma4UnifiedAssistantForCausalLM"]}'
    )
    (hub / "models--google--g4-assistant" / "refs").mkdir()
    (hub / "models--google--g4-assistant" / "refs" / "main").write_text("a" * 40)
    plain = tmp_path / "eagle-draft"
    plain.mkdir()
    plain.joinpath("config.json").write_text('{"architectures": ["LlamaForCausalLMEagle"]}')
    flag = 'extra_args = ["--enable-mixed-chunk"]'
    for algorithm, draft in (("EAGLE", local), ("NEXTN", "google/g4-assistant")):
        drafters = (
            '[drafters.none]\nalgorithm = "none"\n\n[drafters.mtp]\n'
            f'algorithm = "{algorithm}"\ndraft_model = "{draft}"\n'
        )
        campaign = load(tmp_path, campaign_text(drafters, "[1]", flag))
        [line] = arm_mismatches(campaign, legacy=False, env={"HF_HUB_CACHE": str(hub)})
        assert line == (
            "--enable-mixed-chunk in engine.sglang.extra_args: SGLang 0.5.23 turns mixed "
            "chunked prefill off for drafters 'mtp' but not for 'none' (enable_mixed_chunk), "
            "so the arms would schedule prefills differently; remove the flag"
        )
    drafters = (
        '[drafters.none]\nalgorithm = "none"\n\n[drafters.eagle]\n'
        f'algorithm = "EAGLE"\ndraft_model = "{plain}"\n'
    )
    campaign = load(tmp_path, campaign_text(drafters, "[1]", flag))
    assert arm_mismatches(campaign, legacy=False, env={"HF_HUB_CACHE": str(hub)}) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["fifo", "hub-ref-fifo", "deep"])
def test_a_draft_config_that_is_no_small_json_file_is_ignored(tmp_path: Path, case: str) -> None:
    """The draft's config.json (or the Hub cache's refs/main) read for its architectures: a
    FIFO was waited on for ever (the sweep's dry run hung), and JSON nested too deeply escaped
    as a RecursionError (blamed on the campaign file: "c.toml is nested too deeply to read").
    Each is ignored, as a config.json that is not there: the campaign is not refused for it."""
    import os

    hub = tmp_path / "hub"
    draft: object = tmp_path / "draft"
    if case == "hub-ref-fifo":
        draft = "google/g4-assistant"
        (hub / "models--google--g4-assistant" / "refs").mkdir(parents=True)
        os.mkfifo(hub / "models--google--g4-assistant" / "refs" / "main")  # no writer
    else:
        (tmp_path / "draft").mkdir()
        config = tmp_path / "draft" / "config.json"
        if case == "fifo":
            os.mkfifo(config)  # no writer: a reader that opens it waits for ever
        else:
            config.write_text("[" * 100_000 + "]" * 100_000)
    drafters = (
        '[drafters.none]\nalgorithm = "none"\n\n[drafters.mtp]\n'
        f'algorithm = "EAGLE"\ndraft_model = "{draft}"\n'
    )
    campaign = load(
        tmp_path, campaign_text(drafters, "[1]", 'extra_args = ["--enable-mixed-chunk"]')
    )
    assert arm_mismatches(campaign, legacy=False, env={"HF_HUB_CACHE": str(hub)}) == []


def shortest_prefix(flags: list[str], flag: str) -> str:
    """The shortest abbreviation of `flag` no other of `flags` starts with (argparse's rule)."""
    others = [f for f in flags if f != flag]
    return next(
        flag[:n] for n in range(3, len(flag) + 1) if not any(o.startswith(flag[:n]) for o in others)
    )


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_the_flags_dvfs_looks_for_are_known_by_their_shortest_prefixes(version: str) -> None:
    """`SHORTEST_PREFIXES` agree with the release's option table, and what argparse reads as
    the flag (the shortest prefix) counts, what it reads as another flag or not at all does
    not."""
    table = json.loads((TABLES / f"{version}.json").read_text())
    flags = [f for option in table["options"] for f in option["flags"] if f.startswith("--")]
    release = tuple(int(p) for p in version.split("."))
    known = SHORTEST_PREFIXES[release]
    assert known == {flag: shortest_prefix(flags, flag) for flag in known}
    legacy = version == "0.5.9"
    for flag, shortest in known.items():
        assert names_flag([shortest], flag, legacy=legacy)
        assert names_flag(["x", f"{flag}=1"], flag, legacy=legacy)
        assert not names_flag([shortest[:-1], "16"], flag, legacy=legacy)
    # 0.5.9's argparse reads --enable-mi as --enable-mixed-chunk; 0.5.23's as ambiguous
    # (--enable-mis), an error, not the flag.
    assert names_flag(["--enable-mi"], "--enable-mixed-chunk", legacy=legacy) == legacy


def test_an_abbreviation_argparse_takes_is_refused_like_the_flag(tmp_path: Path) -> None:
    """`--enable-mi` is --enable-mixed-chunk to SGLang 0.5.9, `--disable-ov` is
    --disable-overlap-schedule to both releases."""
    pair = "\n".join("[drafters." + b for b in DRAFTERS.split("\n[drafters.")[1:3])
    mixed = load(tmp_path, campaign_text(pair, "[1]", 'extra_args = ["--enable-mi"]'))
    [line] = arm_mismatches(mixed, legacy=True, env={})
    assert "turns mixed chunked prefill off for drafters 'eagle3' but not for 'none'" in line
    # The refusal quotes what the campaign wrote, and says what it abbreviates.
    assert line.startswith("--enable-mi in engine.sglang.extra_args")
    assert "(enable_mixed_chunk, which --enable-mi abbreviates)" in line
    overlap = load(tmp_path, campaign_text(pair, "[1]", 'extra_args = ["--disable-ov"]'))
    [line] = arm_mismatches(overlap, legacy=True, env={"SGLANG_ENABLE_SPEC_V2": "1"})
    assert "turns it off for 'none'" in line


def test_spec_v2_on_0_5_9_refuses_only_arms_it_would_split(tmp_path: Path) -> None:
    """With SGLANG_ENABLE_SPEC_V2, 0.5.9 runs the EAGLE family with the overlap scheduler and
    NGRAM without it whatever the flags say: that pair cannot match; none and EAGLE can (dvfs
    then leaves the scheduler on for both)."""
    v2 = {"SGLANG_ENABLE_SPEC_V2": "1"}
    both = load(tmp_path, campaign_text(DRAFTERS, "[1]"))
    [line] = arm_mismatches(both, legacy=True, env=v2)
    # SGLang decides for the EAGLE family and NGRAM; dvfs turns it off for 'none' (to match
    # NGRAM), and the message says so.
    assert line.startswith(
        "SGLang 0.5.9 with SGLANG_ENABLE_SPEC_V2 keeps the overlap scheduler on for drafters "
        "'eagle3', 'standalone' and turns it off for 'ngram' whatever the flags say "
        "(disable_overlap_schedule), and the --disable-overlap-schedule dvfs gives every "
        "drafter to match 'ngram' turns it off for 'none', so the arms would schedule "
        "differently; unset SGLANG_ENABLE_SPEC_V2 (engine.sglang.env, engine.sglang.server_command "
        "or dvfs's environment), or "
        "sweep 'ngram' in one campaign and 'eagle3', 'standalone' in another"
    ), line
    assert "whatever dvfs passes" not in line and "extra_args" not in line
    assert arm_mismatches(both, legacy=True, env={}) == []
    assert arm_mismatches(both, legacy=False, env=v2) == []
    blocks = DRAFTERS.split("\n[drafters.")
    pair = "\n".join("[drafters." + b for b in blocks[1:3])  # none, eagle3
    text = campaign_text(pair, "[1]", 'env = { SGLANG_ENABLE_SPEC_V2 = "yes" }')
    campaign = load(tmp_path, text)
    assert [d.name for d in campaign.drafters] == ["none", "eagle3"]
    assert arm_mismatches(campaign, legacy=True, env=v2) == []
    for drafter in campaign.drafters:
        argv = launch_argv(campaign, drafter, port=31000, version="0.5.9")
        assert "--disable-overlap-schedule" not in argv
    # ... unless the campaign turns it off itself: then eagle3 would differ.
    given_off = campaign_text(pair, "[1]", 'extra_args = ["--disable-overlap-schedule"]')
    [line] = arm_mismatches(load(tmp_path, given_off), legacy=True, env=v2)
    assert "keeps the overlap scheduler on for drafters 'eagle3' whatever the flags say" in line
    assert (
        "and the --disable-overlap-schedule in engine.sglang.extra_args turns it off for 'none'"
    ) in line
    assert line.endswith("or remove --disable-overlap-schedule from engine.sglang.extra_args"), line
    assert "dvfs gives" not in line
    # The flag and NGRAM together: removing the flag alone would not do.
    with_ngram = campaign_text(DRAFTERS, "[1]", 'extra_args = ["--disable-overlap-schedule"]')
    [line] = arm_mismatches(load(tmp_path, with_ngram), legacy=True, env=v2)
    assert (
        "dvfs gives every drafter to match 'ngram' and the --disable-overlap-schedule in " in line
    )
    assert line.endswith(
        "or sweep 'ngram' in one campaign and 'eagle3', 'standalone' in another and remove "
        "--disable-overlap-schedule from engine.sglang.extra_args"
    ), line


@pytest.mark.parametrize(
    "wrapper",
    [
        ("env", "SGLANG_ENABLE_SPEC_V2=1"),
        ("sh", "-c", 'SGLANG_ENABLE_SPEC_V2=1 exec "$@"', "sh"),
        ("sh", "-c", "--", 'SGLANG_ENABLE_SPEC_V2=1 exec "$@"', "sh"),
        ("env", "-S", "SGLANG_ENABLE_SPEC_V2=1 env"),
        ("env", "--split-string=SGLANG_ENABLE_SPEC_V2=1 env"),
    ],
)
def test_spec_v2_set_by_a_server_command_wrapper_is_seen(
    tmp_path: Path, wrapper: tuple[str, ...]
) -> None:
    """server_command `env SGLANG_ENABLE_SPEC_V2=1 python ...` on 0.5.9: dvfs read the switch
    only in its own and the campaign's environment, so it gave 'none' --disable-overlap-schedule
    to match an EAGLE arm that SGLang then ran with the overlap scheduler on: the EAGLE server
    was refused at every start, its cells failed at each rerun. The wrapper's NAME=VALUE is
    read too: both arms keep the scheduler on; with NGRAM besides, the campaign is refused
    before any server starts, as with the switch in engine.sglang.env. A shell line's
    `SGLANG_ENABLE_SPEC_V2=1 exec ...` sets it to 1, not to the rest of the line, as does env's
    `-S 'SGLANG_ENABLE_SPEC_V2=1 env'`, which splits its line too (read as one value, '1 env',
    the EAGLE server was refused at every start again, exit 5), and a shell's `-c --` line, and
    env's `--split-string=LINE` (read as no NAME=VALUE at all: refused at every start too)."""
    path, marker = stub_campaign(
        tmp_path, version="0.5.9", wrapper=wrapper, batch="[1]", **ONE_SETTING
    )
    out = tmp_path / "out"
    swept = CliRunner().invoke(
        cli, ["sweep", str(path), "--out", str(out), "--no-progress"], catch_exceptions=False
    )
    assert swept.exit_code == 0, swept.output
    servers = [r for r in read_records(out / "journal.jsonl") if r["type"] == "server"]
    overlap = {s["drafter"]: s["args"]["disable_overlap_schedule"] for s in servers}
    assert overlap == {"none": False, "eagle3": False}
    assert running(marker) == []
    three = '\n[drafters.none]\nalgorithm = "none"\n' + EAGLE3_DRAFTER
    three += '\n[drafters.ngram]\nalgorithm = "NGRAM"\n'
    (tmp_path / "ngram").mkdir()
    path, marker = stub_campaign(
        tmp_path / "ngram", version="0.5.9", wrapper=wrapper, drafters=three, **ONE_SETTING
    )
    out = tmp_path / "ngram" / "out"
    refused = CliRunner().invoke(
        cli, ["sweep", str(path), "--out", str(out), "--no-progress"], catch_exceptions=False
    )
    assert refused.exit_code == 2, refused.output
    said = " ".join(refused.output.split())
    assert "SGLANG_ENABLE_SPEC_V2 keeps the overlap scheduler on for drafters 'eagle3'" in said
    assert not (out / "journal.jsonl").exists()
    assert running(marker) == []


def _refused_at_construction(tmp_path: Path, drafters: str, match: str) -> None:
    """A stub campaign of `drafters` with --enable-mixed-chunk refused as SglangEngine is
    made (`match` in its ArmMismatchError): no server started, no log folder made."""
    path, marker = stub_campaign(
        tmp_path, drafters=drafters, sglang_extra='extra_args = ["--enable-mixed-chunk"]'
    )
    with pytest.raises(ArmMismatchError, match=match):
        SglangEngine(load_campaign(path), clock=MonotonicClock(), log_dir=tmp_path / "logs")
    assert running(marker) == []
    assert not (tmp_path / "logs").exists()


def test_the_engine_refuses_before_any_server_starts(tmp_path: Path) -> None:
    """SglangEngine checks at construction, by the release `launch_server --help` shows."""
    two = '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.ngram]\nalgorithm = "NGRAM"\n'
    _refused_at_construction(tmp_path, two, r"SGLang 0\.5\.23 turns mixed chunked prefill")


def test_the_engine_refuses_a_gemma4_assistant_draft_with_mixed_chunks_before_it_starts(
    tmp_path: Path,
) -> None:
    """As for NGRAM: EAGLE with a Gemma4 assistant draft (FROZEN_KV_MTP to 0.5.23) and
    --enable-mixed-chunk is refused at construction, no server started."""
    draft = tmp_path / "gemma4-assistant"
    draft.mkdir()
    draft.joinpath("config.json").write_text('{"architectures": ["Gemma4AssistantForCausalLM"]}')
    two = (
        '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.mtp]\nalgorithm = "EAGLE"\n'
        f'draft_model = "{draft}"\n'
    )
    _refused_at_construction(tmp_path, two, r"off for drafters 'mtp' but not for 'none'")


def test_run_sweep_with_a_callers_backends_checks_the_engine_too(tmp_path: Path) -> None:
    """`run_sweep` from Python with backends of its caller's (here the twin's GPU and engine,
    no server) skipped the engine's check of the campaign, which the CLI's path makes: it
    refuses arms SGLang would split as the CLI does, before the journal is made."""
    from dvfs.backends import Backends, twin_gpus
    from dvfs.engines.twin import TwinEngine
    from dvfs.sweep import run_sweep
    from dvfs.twin.device import FreeRunningNode
    from dvfs.twin.profiles import gpu_profile, model_profile

    two = '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.ngram]\nalgorithm = "NGRAM"\n'
    path, marker = stub_campaign(
        tmp_path, drafters=two, sglang_extra='extra_args = ["--enable-mixed-chunk"]'
    )
    clock = MonotonicClock()
    engine = TwinEngine(
        FreeRunningNode(gpu_profile("h100-sxm"), clock), model_profile("llama-3.1-8b")
    )
    backends = Backends(clock, twin_gpus("h100-sxm", [0], clock), engine)
    out = tmp_path / "out"
    with pytest.raises(ArmMismatchError, match=r"SGLang 0\.5\.23 turns mixed chunked prefill"):
        run_sweep(load_campaign(path), out, backends=backends)
    assert not out.exists() and running(marker) == []


@pytest.mark.slow
def test_a_sweep_with_arms_sglang_would_split_stops_in_one_line(tmp_path: Path) -> None:
    """End to end: `dvfs sweep` (alone, as a shard, as a fleet) and its dry run say so in one
    line (a usage error) before any server starts and before the journal is made, so the
    corrected campaign then runs into the same folder."""
    two = '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.ngram]\nalgorithm = "NGRAM"\n'
    flag = 'extra_args = ["--enable-mixed-chunk"]'
    path, marker = stub_campaign(
        tmp_path, drafters=two, batch="[1]", sglang_extra=flag, **ONE_SETTING
    )
    flagged = path.read_text()
    corrected = flagged.replace(flag, "")
    runs = [("--dry-run", "--no-estimate"), ("--gpus", "0-1"), (), ("--shard", "0/1")]
    for n, extra in enumerate(runs):
        out = tmp_path / f"out{n}"
        path.write_text(flagged)
        result = sweep(path, out, *extra)
        assert result.exit_code == 2, result.output
        [line] = result.output.strip().splitlines()
        assert line.startswith("Error: --enable-mixed-chunk in engine.sglang.extra_args: ")
        assert "'ngram' but not for 'none' (enable_mixed_chunk)" in line
        assert not (out / "journal.jsonl").exists(), extra
        assert running(marker) == []
        if "--dry-run" not in extra:
            path.write_text(corrected)
            again = sweep(path, out, *extra)
            assert again.exit_code == 0, again.output
            assert set(servers(out)) == {"none", "ngram"}


@pytest.mark.slow
def test_doctor_fails_arms_sglang_would_split_as_the_sweep_does(tmp_path: Path) -> None:
    """`dvfs doctor` fails the campaign `dvfs sweep` refuses (its 'arms' check, exit 2: an
    invalid campaign) with the sweep's words, and passes it once corrected."""
    two = '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.ngram]\nalgorithm = "NGRAM"\n'
    flag = 'extra_args = ["--enable-mixed-chunk"]'
    path, marker = stub_campaign(tmp_path, drafters=two, batch="[1]", sglang_extra=flag)
    out = ["--out", str(tmp_path / "out")]
    doctor = CliRunner().invoke(cli, ["doctor", str(path), *out, "--json"])
    assert doctor.exit_code == 2, doctor.output
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    failed = [name for name, c in checks.items() if c["status"] == "fail"]
    assert failed == ["arms"] and checks["arms"]["invalid"]
    detail = checks["arms"]["detail"]
    assert "\n" not in detail
    assert detail.startswith("--enable-mixed-chunk in engine.sglang.extra_args: SGLang 0.5.23")
    text = CliRunner().invoke(cli, ["doctor", str(path), *out])
    assert text.exit_code == 2 and "FAIL arms: --enable-mixed-chunk" in text.output
    swept = sweep(path, tmp_path / "out", "--dry-run", "--no-estimate")
    assert swept.exit_code == 2 and detail in " ".join(swept.output.split())
    assert running(marker) == [] and not (tmp_path / "out").exists()
    path.write_text(path.read_text().replace(flag, ""))
    doctor = CliRunner().invoke(cli, ["doctor", str(path), *out, "--json"])
    assert doctor.exit_code == 0, doctor.output
    arms = next(c for c in json.loads(doctor.stdout) if c["name"] == "arms")
    assert arms["status"] == "ok" and "SGLang 0.5.23's rules" in arms["detail"]


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_a_sweep_serves_every_arm_with_the_same_scheduling(tmp_path: Path, version: str) -> None:
    """End to end on each release (told apart by `launch_server --help`): the journal's servers
    agree on the overlap scheduler and the decode graphs, even for batches SGLang's plain
    ladder pads (3 to 4 in both releases; 6 beyond 0.5.9's largest plain graph: eager)."""
    path, _ = stub_campaign(
        tmp_path,
        version=version,
        drafters=DRAFTERS.replace("num_steps = 5\neagle_topk = 4\nnum_draft_tokens = 8", ""),
        batch="[3, 6]",
        **ONE_SETTING,
    )
    out = tmp_path / "out"
    result = sweep(path, out)
    assert result.exit_code == 0, result.output
    args = servers(out)
    assert set(args) == {"none", "eagle3", "standalone", "ngram"}
    assert {a["disable_overlap_schedule"] for a in args.values()} == {version == "0.5.9"}
    assert {decode_graph(a, 3) for a in args.values()} == {3}
    assert {decode_graph(a, 6) for a in args.values()} == {6}
    assert {a["page_size"] for a in args.values()} == {1}


def drafter_of(record: dict[str, Any]) -> str:
    """The drafter of a server or cell record."""
    return str(record["drafter"] if record["type"] == "server" else record["cell"]["drafter"])


@pytest.mark.slow
def test_a_server_scheduling_otherwise_is_refused_at_start_and_in_the_cube(
    tmp_path: Path,
) -> None:
    """The scheduling args are compared at every server start (a rerun whose server command
    turns the overlap scheduler off serves the second drafter differently: refused), and in
    the cube (a journal whose servers replay other decode graphs gives no cube)."""
    two = '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.ngram]\nalgorithm = "NGRAM"\n'
    path, marker = stub_campaign(tmp_path, drafters=two, batch="[4]", **ONE_SETTING)
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    records = read_records(journal)
    # the none drafter's server and cells (by their drafter: the ngram server's args hold
    # "none" too, e.g. moe_a2a_backend)
    kept = [r for r in records if r["type"] not in ("server", "cell") or drafter_of(r) == "none"]
    first = [r for r in kept if r["type"] == "server"]
    assert [r["drafter"] for r in first] == ["none"], "the test expects none to start first"
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    command = f"server_command = [{json.dumps(sys.executable)}, {json.dumps(str(STUB))}"
    path.write_text(
        replace_block(path.read_text(), command, command + ', "--disable-overlap-schedule"')
    )
    again = sweep(path, out)
    assert again.exit_code == 5, again.output
    [failed] = [
        r for r in read_records(journal) if r["type"] == "cell" and r["cell"]["drafter"] == "ngram"
    ]
    assert "overlap scheduler disabled (disable_overlap_schedule): False -> True" in failed["error"]
    assert running(marker) == []
    # A journal (edited) whose servers replay other graphs at its batch (4): no cube.
    server = next(r for r in records if r["type"] == "server" and r["drafter"] == "none")
    graphs = server["args"]["cuda_graph_config"]
    other = {**graphs, "decode": {**graphs["decode"], "bs": [1, 2, 8]}}
    with journal.open("a") as f:
        edited = {
            **server,
            "drafter": "ngram",
            "args": {**server["args"], "cuda_graph_config": other},
        }
        f.write(json.dumps(edited) + "\n")
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code != 0
    assert "decode CUDA graph at batch 4: 4 -> 8" in built.output.strip().splitlines()[-1]


# -- journals begun by an earlier dvfs, which gave each drafter SGLang's own graphs -----------


def test_only_a_difference_an_earlier_dvfs_left_is_blamed_on_it(tmp_path: Path) -> None:
    graphs = "decode CUDA graph at batch 6: eager -> 6"
    overlap = "overlap scheduler disabled (disable_overlap_schedule): False -> True"
    said = "begun by an earlier dvfs, which did not give every drafter the same decode CUDA "
    assert begun_unpinned((), [graphs]) == said + "graphs and overlap scheduler"
    assert begun_unpinned([], ["dtype (dtype): None -> 'float16'", overlap]) is not None
    assert begun_unpinned(tuple(ARMS_PINNED), [graphs, overlap]) is None
    assert begun_unpinned((), ["dtype (dtype): None -> 'float16'"]) is None
    assert begun_unpinned((), []) is None
    # A header of this dvfs names what it pins; one of an earlier dvfs (or damaged) names none.
    campaign = load(tmp_path, campaign_text(DRAFTERS, "[1]"))
    assert Header.for_campaign(campaign).to_json()["arms_pinned"] == list(ARMS_PINNED)
    for stored in ({}, {"arms_pinned": None}, {"arms_pinned": "x"}):
        assert Header.from_json({"type": "header", **stored}).arms_pinned == ()


def as_begun_by_earlier_dvfs(
    stub: ModuleType, path: Path, journal: Path, *, header: bool = True
) -> list[dict[str, Any]]:
    """Rewrite a 0.5.9 journal as an earlier dvfs would have left it: each server's args as
    SGLang resolves its argv without dvfs's decode graph list and --disable-overlap-schedule,
    and (with `header`) a header that names nothing pinned. Returns the records."""
    campaign = load_campaign(path)
    records = read_records(journal)
    for record in records:
        if record["type"] == "header" and header:
            record.pop("arms_pinned")
        if record["type"] != "server":
            continue
        drafter = next(d for d in campaign.drafters if d.name == record["drafter"])
        argv = launch_argv(campaign, drafter, port=31000, version="0.5.9")[2:]
        at = argv.index("--cuda-graph-bs")
        rest = argv[at + 1 :]
        count = next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))
        earlier = [a for a in argv[:at] + rest[count:] if a != "--disable-overlap-schedule"]
        args, _ = stub.parse_launch_argv(earlier, stub.StubConfig(version="0.5.9"))
        for key in ("cuda_graph_bs", "disable_overlap_schedule"):
            record["args"][key] = args[key]
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


@pytest.mark.slow
def test_a_drafters_own_server_in_a_journal_begun_by_an_earlier_dvfs_is_refused_alike(
    stub: ModuleType, tmp_path: Path
) -> None:
    """A journal of one drafter begun by an earlier dvfs (its server's own decode graphs),
    resumed: its drafter's server differs from the one that measured its cells. One GPU's
    sweep said its cells would compare more than the knob settings; a fleet's driver said
    the arms would compare more than their drafters, with no other drafter. Both say it
    alike, but for where the server ran."""
    one = '\n[drafters.none]\nalgorithm = "none"\n'
    path, _ = stub_campaign(
        tmp_path,
        version="0.5.9",
        drafters=one,
        batch="[6]",
        knobs="sm_clock = [1980, 1500]\nsettle_s = 0.0",
    )
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    records = as_begun_by_earlier_dvfs(stub, path, journal)
    kept = records[: [i for i, r in enumerate(records) if r["type"] == "cell"][1]]
    lines = []
    for gpus in ((), ("--gpus", "0-1")):
        journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
        result = sweep(path, out, *gpus)
        assert result.exit_code == 1, result.output
        lines.append(result.output.strip().splitlines()[-1])
    alone, fleet = lines
    assert alone.startswith("Error: the 'none' server differs from the one that measured")
    assert fleet.startswith("Error: the server of drafter 'none' on gpu"), fleet
    tail = (
        f" differs from the one that measured its cells in {journal} (decode CUDA graph at "
        "batch 6: eager -> 6): its cells would compare more than the knob settings; "
        f"{journal} was begun by an earlier dvfs, which did not give every drafter the same "
        "decode CUDA graphs and overlap scheduler, so this dvfs cannot resume it: rerun with "
        "--fresh (or into another --out folder)"
    )
    assert alone.endswith(tail) and fleet.endswith(tail), lines


@pytest.mark.slow
def test_a_journal_begun_by_an_earlier_dvfs_says_so(stub: ModuleType, tmp_path: Path) -> None:
    """A journal whose servers an earlier dvfs started (SGLang's own decode graphs and overlap
    scheduler per drafter) cannot be resumed or built into a cube, and both say why in one
    line: what differs, that an earlier dvfs began it, and to start over with --fresh; not
    that anything could be fixed. A journal of this dvfs is refused in neutral words."""
    two = '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.ngram]\nalgorithm = "NGRAM"\n'
    path, marker = stub_campaign(
        tmp_path, version="0.5.9", drafters=two, batch="[6]", **ONE_SETTING
    )
    out = tmp_path / "out"
    assert sweep(path, out).exit_code == 0
    journal = out / "journal.jsonl"
    pristine = journal.read_text()
    records = as_begun_by_earlier_dvfs(stub, path, journal)
    served = {r["drafter"]: r["args"] for r in records if r["type"] == "server"}
    assert [decode_graph(a, 6) for a in served.values()] == ["eager", 6]
    differs = (
        "overlap scheduler disabled (disable_overlap_schedule): False -> True; "
        "decode CUDA graph at batch 6: eager -> 6"
    )
    earlier = (
        "begun by an earlier dvfs, which did not give every drafter the same decode CUDA "
        "graphs and overlap scheduler"
    )
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 1
    [line] = built.output.strip().splitlines()
    assert line == (
        f"Error: the journal's drafters 'none' and 'ngram' were served differently ({differs}): "
        f"the arms would compare more than their drafters; the journal was {earlier}, so it "
        "cannot be resumed or compared: rerun with --fresh (or into another --out folder) "
        # (`cube build` has no --fresh: the sweep's command named)
        f"(--fresh is the sweep's: `dvfs sweep CAMPAIGN --out {shlex.quote(str(out))} --fresh`, "
        "with the --shard and --gpus it runs with)"
    )
    # Resumed: the ngram server is refused at its start and the whole sweep stops there, as
    # a fleet's does (nothing a rerun of the same command could change), with nothing said
    # to be fixable or retryable and no cell failed for it.
    kept = [r for r in records if r["type"] != "cell" or r["cell"]["drafter"] == "none"]
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    resumed = sweep(path, out)
    assert resumed.exit_code == 1, resumed.output
    last = resumed.output.strip().splitlines()[-1]
    assert last == (
        f"Error: the 'ngram' server differs from the 'none' server of {journal} ({differs}): "
        f"the arms would compare more than their drafters; {journal} was {earlier}, so this "
        "dvfs cannot resume it: rerun with --fresh (or into another --out folder)"
    ), last
    assert "fixed" not in resumed.output and "retry" not in resumed.output
    assert [r for r in read_records(journal) if r["type"] == "cell" and r["status"] != "ok"] == []
    assert running(marker) == []
    # A fleet's driver refuses the workers' servers in the same words.
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    fleet = sweep(path, out, "--gpus", "0-1")
    assert fleet.exit_code == 1, fleet.output
    last = fleet.output.strip().splitlines()[-1]
    assert last.startswith("Error: the server of drafter 'ngram' on gpu") and last.endswith(
        f"({differs}): the arms would compare more than their drafters; {journal} was "
        f"{earlier}, so this dvfs cannot resume it: rerun with --fresh (or into another --out "
        "folder)"
    ), last
    assert running(marker) == []
    # The same servers in a journal this dvfs began: no earlier dvfs to blame.
    journal.write_text(pristine)
    as_begun_by_earlier_dvfs(stub, path, journal, header=False)
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    [line] = built.output.strip().splitlines()
    assert "earlier dvfs" not in line and f"({differs})" in line
    assert line.endswith(
        "with every drafter on one engine version and one set of engine flags (--fresh is the "
        f"sweep's: `dvfs sweep CAMPAIGN --out {shlex.quote(str(out))} --fresh`, with the --shard "
        "and --gpus it runs with)"
    )
    # What the messages say to do works.
    assert sweep(path, out, "--fresh").exit_code == 0
