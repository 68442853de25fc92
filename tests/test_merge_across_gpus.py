"""Merging cubes of different GPU models: their servers are compared in what the campaign and
dvfs set for every arm, not in what SGLang derives from the GPU it starts on (the shards of one
run, on one GPU model, are compared in everything); a merged cube still names each GPU's
unverified server pinning; and its engine version, token-count method and prompt format are
the sources' known ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import xarray as xr
from click.testing import CliRunner, Result
from conftest import (
    MIXED_FLEET,
    TINY_EXACT,
    copy_sweep,
    figures_drawn_only,
    replace_block,
    unsaved_figure,
)
from test_journal import assert_one_line_error

from dvfs.cli import cli
from dvfs.cube import merge_cubes, open_cube, write_cube
from dvfs.cube.pinning import gpu_pinning, pinning_note
from dvfs.measure.journal import read_records

#: What SGLang picks for `chunked_prefill_size` on a GPU of that many GB when not told (0.5.9
#: and 0.5.23 alike); the twin's servers report none, so the tests write it into their args.
#: The twins are an H100 (80 GB) and an H200 (141 GB), both 8192: the second stands for a
#: larger GPU (a 180 GB B200 gets 16384).
CHUNKED = {"h100": 8192, "h200": 16384}
#: TINY on the exact twin (its cells valid, for headroom and compare).
EXACT = TINY_EXACT
CONTAINER = "unverified: NVML lists none of the server's processes (a container)"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


#: EXACT on a twin H200.
H200 = replace_block(EXACT, '"h100-sxm:none"', '"h200-sxm:none"')


@pytest.fixture(scope="module")
def runs(tiny_exact_run, shared_run) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """EXACT swept on a twin H100 (`h100`), on a twin H200 (`h200`) and as two shards on the
    H100 (`s0`, `s1`): the folders of `shared_run`s, once per session; read-only."""
    return {
        "h100": tiny_exact_run("one"),
        "h200": shared_run(H200, "one"),
        **{f"s{i}": tiny_exact_run(f"s{i}") for i in range(2)},
    }


def _cube(
    path: Path,
    into: Path,
    *,
    args: dict[str, Any] | None = None,
    backends: str | None = None,
    kernels: str | None = None,
    **attrs: Any,
) -> Path:
    """The cube at `path` written to `into` with `args` in every drafter's server args,
    `backends` as each drafter's attention backend, `kernels` as the campaign's
    engine.sglang.attention_backend and `attrs` changed."""
    ds = open_cube(path).load()
    if args:
        servers = json.loads(ds.attrs["server_args"])
        for server in servers.values():
            server["args"].update(args)
        ds.attrs["server_args"] = json.dumps(servers)
    if backends is not None:
        ds["attention_backend"] = ds["attention_backend"].copy(
            data=[backends] * ds.sizes["drafter"]
        )
    if kernels is not None:
        campaign = json.loads(ds.attrs["campaign"])
        campaign["engine"]["sglang"]["attention_backend"] = kernels
        ds.attrs["campaign"] = json.dumps(campaign)
    ds.attrs.update(attrs)
    write_cube(ds, into)
    return into


def test_cubes_of_two_gpu_models_merge_whatever_sglang_derives_from_the_gpu(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    a = _cube(
        runs["h100"] / "cube.nc",
        tmp_path / "a.nc",
        args={"chunked_prefill_size": CHUNKED["h100"], "mem_fraction_static": 0.85},
    )
    b = _cube(
        runs["h200"] / "cube.nc",
        tmp_path / "b.nc",
        args={"chunked_prefill_size": CHUNKED["h200"], "mem_fraction_static": 0.88},
    )
    merged = merge_cubes([open_cube(a), open_cube(b)], ["a", "b"])
    assert merged.sizes["gpu"] == 2
    kept = json.loads(merged.attrs["merged_from"])
    assert sorted(
        json.loads(s["server_args"])["none"]["args"]["chunked_prefill_size"] for s in kept.values()
    ) == [8192, 16384]
    # Kernels left to SGLang ("auto"): fa3 on one GPU, flashinfer and its page size on the
    # other, as SGLang picks them by architecture.
    auto_a = _cube(a, tmp_path / "auto_a.nc", kernels="auto", backends="fa3", args={"page_size": 1})
    auto_b = _cube(
        b, tmp_path / "auto_b.nc", kernels="auto", backends="flashinfer", args={"page_size": 64}
    )
    out = tmp_path / "m.nc"
    ok = invoke("cube", "merge", str(auto_a), str(auto_b), "-o", str(out))
    assert ok.exit_code == 0, ok.output
    assert open_cube(out).sizes["gpu"] == 2
    # GPT-OSS on 0.5.9, kernels left to SGLang: fa3 on Hopper, trtllm_mha on Blackwell, which
    # turns the hybrid SWA pool off (server_args.py lines 1333-1361): was refused, "hybrid SWA
    # memory disabled (disable_hybrid_swa_memory): False -> True"
    gpt_a = _cube(
        a, tmp_path / "gpt_a.nc", kernels="auto", backends="fa3",
        args={"disable_hybrid_swa_memory": False},
    )  # fmt: skip
    gpt_b = _cube(
        b, tmp_path / "gpt_b.nc", kernels="auto", backends="trtllm_mha",
        args={"disable_hybrid_swa_memory": True},
    )  # fmt: skip
    ok = invoke("cube", "merge", str(gpt_a), str(gpt_b), "-o", str(tmp_path / "gpt.nc"))
    assert ok.exit_code == 0, ok.output


def _piecewise(max_tokens: int) -> dict[str, Any]:
    """0.5.9's piecewise prefill graphs as it resolves them unset on a GPU whose chunked
    prefill size is `max_tokens` (server_args.py lines 1006-1018 and
    `_generate_piecewise_cuda_graph_tokens`)."""
    steps = [(4, 33, 4), (48, 257, 16), (288, 513, 32), (576, 1025, 64), (1280, 4097, 256)]
    tokens = [t for lo, hi, step in steps for t in range(lo, hi, step)]
    tokens += list(range(4608, max_tokens + 1, 512))
    return {
        "chunked_prefill_size": max_tokens,
        "piecewise_cuda_graph_max_tokens": max_tokens,
        "piecewise_cuda_graph_tokens": [t for t in tokens if t <= max_tokens],
    }


#: What SGLang resolves from the GPU it starts on, as one GPU's server and another's report it
#: (`test_cubes_of_two_gpu_models_merge_whatever_sglang_derives_for_each_gpu`).
DERIVED_PER_GPU: list[tuple[dict[str, Any], dict[str, Any]]] = [
    # 0.5.9 on an H100 and a B200: the piecewise graphs' limit follows the chunked size
    (_piecewise(CHUNKED["h100"]), _piecewise(CHUNKED["h200"])),
    # a DeepSeek-V3 FP8 checkpoint on Blackwell (0.5.9 server_args.py line 1307)
    (
        {"moe_runner_backend": "auto", "disable_shared_experts_fusion": False},
        {"moe_runner_backend": "flashinfer_trtllm", "disable_shared_experts_fusion": True},
    ),
    # an MoE model on Hopper, not on an A100 or H20 (0.5.9 line 1697)
    (
        {"enable_flashinfer_allreduce_fusion": False},
        {"enable_flashinfer_allreduce_fusion": True},
    ),
    # a hybrid model's GDN decode on SM100 (0.5.23 arg_groups/attention_hook.py line 299)
    ({"linear_attn_decode_backend": None}, {"linear_attn_decode_backend": "flashinfer"}),
    # GLM-5-Next's speculative verify kernels on SM100 (0.5.23 arg_groups/glm5_next_hook.py):
    # compared between one drafter's servers (`DRAFTER_ARGS`), but not across GPU models
    ({"linear_attn_verify_backend": None}, {"linear_attn_verify_backend": "nv_cutedsl"}),
    # DeepSeek-V3.2's sparse attention's KV cache, "auto": FP8 on SM100, bf16 on Hopper
    # (0.5.9 server_args.py line 1143, 0.5.23 arg_groups/overrides.py line 534)
    (
        {"kv_cache_dtype": "bfloat16", "nsa_decode_backend": "fa3"},
        {"kv_cache_dtype": "fp8_e4m3", "nsa_decode_backend": "flashmla_kv"},
    ),
    # ROCm (0.5.9 line 2061, 0.5.23 platform_hook.py line 54)
    ({"triton_attention_num_kv_splits": 8}, {"triton_attention_num_kv_splits": 16}),
    # Qwen3-VL's serving defaults on a large Hopper GPU (0.5.23 model_overrides/qwen3_vl.py)
    (
        {"radix_eviction_policy": "lru", "prefill_decode_interval": 0},
        {"radix_eviction_policy": "priority", "prefill_decode_interval": 22},
    ),
]


def test_cubes_of_two_gpu_models_merge_whatever_sglang_derives_for_each_gpu(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """What SGLang resolves from the GPU it starts on when the campaign leaves it unset (from
    its memory, through the chunked prefill size, or its architecture) differs between GPU
    models of one campaign: the cubes merge (a merge, and a fleet mixing models, were refused:
    "cannot merge: ... were not measured alike (drafter 'eagle3' piecewise CUDA graph tokens
    limit (piecewise_cuda_graph_max_tokens): 8192 -> 16384 ...)"); each GPU's value is kept.

    Every case of `DERIVED_PER_GPU` is in one pair of cubes, merged once: the merge compares
    each arg on its own (`arm_changes`, one refusal naming every arg it would not leave out),
    so one arg it compared refuses the pair as it refused a pair differing in that one alone,
    where a pair per case wrote and merged two cubes each (the same path seven times)."""
    first = {k: v for case, _ in DERIVED_PER_GPU for k, v in case.items()}
    second = {k: v for _, case in DERIVED_PER_GPU for k, v in case.items()}
    a = _cube(runs["h100"] / "cube.nc", tmp_path / "a.nc", args=first)
    b = _cube(runs["h200"] / "cube.nc", tmp_path / "b.nc", args=second)
    out = tmp_path / "m.nc"
    merged = invoke("cube", "merge", str(a), str(b), "-o", str(out))
    assert merged.exit_code == 0, merged.output
    kept = json.loads(open_cube(out).attrs["merged_from"])
    for key in second:
        assert sorted(
            json.dumps(json.loads(s["server_args"])["none"]["args"][key]) for s in kept.values()
        ) == sorted(json.dumps(v) for v in (first[key], second[key])), key


@pytest.mark.parametrize(
    ("first", "second", "named"),
    [
        (
            {"kv_cache_dtype": "bfloat16"},
            {"kv_cache_dtype": "fp8_e4m3"},
            "(kv_cache_dtype): 'bfloat16' -> 'fp8_e4m3'",
        ),
        (
            _piecewise(4096),
            _piecewise(8192),
            "(piecewise_cuda_graph_max_tokens): 4096 -> 8192",
        ),
    ],
    ids=["kv-cache-dtype", "piecewise"],
)
def test_cubes_of_one_gpu_model_differing_in_what_sglang_derives_from_the_gpu_are_refused(
    runs: dict[str, Path], tmp_path: Path, first: dict[str, Any], second: dict[str, Any], named: str
) -> None:
    """Two runs on two H100s merged along `gpu` were compared as two GPU models are: without
    what SGLang derives from the GPU, so a KV cache dtype or piecewise CUDA graphs that
    differ between the two runs merged unseen (exit 0). One GPU model derives the same: a
    difference there is the runs' own, refused as the shards of one run refuse it."""
    a = _cube(runs["h100"] / "cube.nc", tmp_path / "a.nc", args=first)
    b = _cube(runs["h100"] / "cube.nc", tmp_path / "b.nc", args=second, gpu_uuids="GPU-twin-b")
    refused = invoke("cube", "merge", str(a), str(b), "-o", str(tmp_path / "m.nc"))
    assert_one_line_error(refused, 2, "were not measured alike", named)
    alike = _cube(runs["h100"] / "cube.nc", tmp_path / "c.nc", args=first, gpu_uuids="GPU-twin-c")
    merged = invoke("cube", "merge", str(a), str(alike), "-o", str(tmp_path / "m.nc"))
    assert merged.exit_code == 0, merged.output
    assert open_cube(tmp_path / "m.nc").sizes["gpu"] == 2


def test_two_cubes_of_one_gpu_model_merged_after_another_models_are_compared_alike(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Each cube was compared with the first alone: an H200's cube first, two H100s' cubes
    after it were each compared with it as across GPU models, and never with each other, so
    their KV cache dtypes that differ merged unseen (exit 0)."""
    h200 = _cube(runs["h200"] / "cube.nc", tmp_path / "h200.nc", args={"kv_cache_dtype": "auto"})
    a = _cube(runs["h100"] / "cube.nc", tmp_path / "a.nc", args={"kv_cache_dtype": "bfloat16"})
    b = _cube(
        runs["h100"] / "cube.nc",
        tmp_path / "b.nc",
        args={"kv_cache_dtype": "fp8_e4m3"},
        gpu_uuids="GPU-twin-b",
    )
    refused = invoke("cube", "merge", str(h200), str(a), str(b), "-o", str(tmp_path / "m.nc"))
    assert_one_line_error(refused, 2, "were not measured alike", "'bfloat16' -> 'fp8_e4m3'")
    alike = _cube(a, tmp_path / "c.nc", gpu_uuids="GPU-twin-c")
    merged = invoke("cube", "merge", str(h200), str(a), str(alike), "-o", str(tmp_path / "m.nc"))
    assert merged.exit_code == 0, merged.output
    assert open_cube(tmp_path / "m.nc").sizes["gpu"] == 3


@pytest.mark.parametrize(
    ("first", "second", "named"),
    [
        ({"random_seed": 1}, {"random_seed": 2}, "random seed (random_seed): 1 -> 2"),
        ({"dtype": "bfloat16"}, {"dtype": "float16"}, "dtype (dtype): 'bfloat16' -> 'float16'"),
        ({"speculative_num_steps": 3}, {"speculative_num_steps": 2}, "num_steps: 3 -> 2"),
        (
            {"cuda_graph_bs": [1, 8]},
            {"cuda_graph_bs": [1, 16]},
            "decode CUDA graph at batch 8: 8 -> 16",
        ),
    ],
)
def test_cubes_of_two_gpu_models_differing_in_what_dvfs_pins_are_refused(
    runs: dict[str, Path], tmp_path: Path, first: dict[str, Any], second: dict[str, Any], named: str
) -> None:
    a = _cube(runs["h100"] / "cube.nc", tmp_path / "a.nc", args=first)
    b = _cube(runs["h200"] / "cube.nc", tmp_path / "b.nc", args=second)
    refused = invoke("cube", "merge", str(a), str(b), "-o", str(tmp_path / "m.nc"))
    assert_one_line_error(refused, 2, "were not measured alike", named)


def test_pinned_kernels_that_differ_across_gpus_are_refused(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The campaign pins fa3: a cube whose servers ran other kernels is refused, as are
    kernels that differ where the campaign left them to SGLang but the sources disagree on
    that (their campaigns then differ)."""
    a = _cube(runs["h100"] / "cube.nc", tmp_path / "a.nc", backends="fa3")
    b = _cube(runs["h200"] / "cube.nc", tmp_path / "b.nc", backends="flashinfer")
    refused = invoke("cube", "merge", str(a), str(b), "-o", str(tmp_path / "m.nc"))
    assert_one_line_error(refused, 2, "were not measured alike", "attention kernels: fa3 ->")
    auto = _cube(b, tmp_path / "auto.nc", kernels="auto")
    refused = invoke("cube", "merge", str(a), str(auto), "-o", str(tmp_path / "m.nc"))
    assert_one_line_error(refused, 2, "the campaign differs", "attention")


def test_twin_cubes_simulating_different_nvml_traps_are_refused(
    runs: dict[str, Path], tiny_sweep: Path, tmp_path: Path
) -> None:
    """A twin H100 with every NVML trap (TINY, `h100-sxm`) and a trap-free twin H200
    (`h200-sxm:none`) were merged (exit 0): their campaigns differ only in gpu.profile, which
    names the GPU but also the traps, so the merged cube compared the twin's simulated flaws
    as if they were the GPUs'. A fleet refuses that mix (`--gpus h200-sxm:leakage:0`); the merge
    now does too, naming both profiles and their traps. One trap list on both merges."""
    merged = tmp_path / "m.nc"
    refused = invoke("cube", "merge", str(tiny_sweep), str(runs["h200"]), "-o", str(merged))
    line = assert_one_line_error(refused, 2, "simulate different NVML traps", "'h200-sxm:none'")
    assert "'h100-sxm': energy_steps" in line and "'h200-sxm:none': none" in line, line
    assert not merged.exists()
    alike = invoke("cube", "merge", str(runs["h100"]), str(runs["h200"]), "-o", str(merged))
    assert alike.exit_code == 0, alike.output


def test_shards_of_one_run_still_compare_what_sglang_derives_from_the_gpu(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    s0, s1 = (runs[f"s{i}"] / "cube.nc" for i in range(2))
    odd = _cube(s1, tmp_path / "odd.nc", args={"chunked_prefill_size": 16384})
    even = _cube(s0, tmp_path / "even.nc", args={"chunked_prefill_size": 8192})
    refused = invoke("cube", "merge", str(even), str(odd), "-o", str(tmp_path / "m.nc"))
    assert_one_line_error(
        refused, 2, "were not run alike", "chunked prefill size (chunked_prefill_size)"
    )


def _edit_servers(journal: Path, **changes: Any) -> None:
    """Each server record of `journal` with `changes` (`args`: merged into its args)."""
    args = changes.pop("args", {})
    records = read_records(journal)
    for record in records:
        if record["type"] == "server":
            record["args"].update(args)
            record.update(changes)
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_fleet_mixing_gpu_models_ends_with_a_merged_cube(tiny_exact_run, tmp_path: Path) -> None:
    """An H100 and an H200 in one fleet, each model's servers set up by SGLang for its GPU
    (written into the journals, the twin reports none) and their pinning unverified: the
    folder's cube is still the merged one, which names each GPU's unverified pinning."""
    out = copy_sweep(tiny_exact_run("mixed"), tmp_path / "out")  # --gpus 0,h200-sxm:0
    journals = sorted(out.glob("gpu-*/journal.jsonl"))
    assert len(journals) == 2
    for journal, chunked in zip(journals, (CHUNKED["h100"], CHUNKED["h200"]), strict=True):
        _edit_servers(journal, args={"chunked_prefill_size": chunked}, gpu_pinning=CONTAINER)
    (out / "cube.nc").unlink()
    built = invoke("cube", "build", str(out))
    assert built.exit_code == 0, built.output
    cube = open_cube(out / "cube.nc")
    assert cube.sizes["gpu"] == 2
    sources = json.loads(cube.attrs["merged_from"])
    assert sorted(
        json.loads(s["server_args"])["eagle3"]["args"]["chunked_prefill_size"]
        for s in sources.values()
    ) == [8192, 16384]
    pinning = gpu_pinning(cube)
    assert len(pinning) == 4 and set(pinning.values()) == {CONTAINER}
    assert {k.split(" on ", 1)[1] for k in pinning} == set(json.loads(cube.attrs["gpu_names"]))


@pytest.mark.parametrize("link", ["gpu-a-link", "gpu-z-link"])
def test_a_gpu_folder_linked_under_another_name_is_one_model(
    tiny_exact_run, tmp_path: Path, link: str
) -> None:
    """A `gpu-*` link to a GPU model's folder of a fleet mixing models (`gpu-x ->
    gpu-nvidia-h100-...`) was taken for a third model: `dvfs cube build` merged that model's
    cube with itself ("the same GPU twice"), and the sweep's resume refused alike after its
    dry run counted 3 GPU models and 48 cells. The folder is that model's, counted once
    under its own name, whichever name sorts first."""
    run = tiny_exact_run("mixed")  # --gpus 0,h200-sxm:0
    out = copy_sweep(run, tmp_path / "out")
    [h100] = out.glob("gpu-*h100*")
    (out / link).symlink_to(h100.name)
    (out / "cube.nc").unlink()
    built = invoke("cube", "build", str(out))
    assert built.exit_code == 0, built.output
    assert link not in built.output and f"{h100 / 'cube.nc'}" in built.output, built.output
    assert open_cube(out / "cube.nc").sizes["gpu"] == 2
    argv = ["sweep", str(run.parent / "campaign.toml"), "--out", str(out), *MIXED_FLEET]
    dry = invoke(*argv, "--dry-run", "--no-estimate")
    assert dry.exit_code == 0, dry.output
    said = " ".join(dry.output.split())
    assert "2 GPU models" in said and "32 cells in all" in said and link not in said, said
    resumed = invoke(*argv, "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    assert "0 cell(s) measured, 0 failed, 32 already done" in resumed.output, resumed.output


def test_a_merged_cube_names_each_gpus_unverified_pinning(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    unverified = json.dumps({"none": CONTAINER, "eagle3": CONTAINER})
    a = _cube(runs["h100"] / "cube.nc", tmp_path / "a.nc", gpu_pinning=unverified)
    b = _cube(runs["h200"] / "cube.nc", tmp_path / "b.nc", gpu_pinning=unverified)
    merged = tmp_path / "m.nc"
    assert invoke("cube", "merge", str(a), str(b), "-o", str(merged)).exit_code == 0
    cube = open_cube(merged)
    names = json.loads(cube.attrs["gpu_names"])
    assert gpu_pinning(cube) == {
        f"{drafter} on {name}": CONTAINER for drafter in ("none", "eagle3") for name in names
    }
    note = pinning_note(cube)
    assert note is not None and all(name in note for name in names)
    info = invoke("cube", "info", str(merged), "--json")
    assert info.exit_code == 0, info.output
    assert len(json.loads(info.stdout)["gpu_pinning"]) == 4
    text = " ".join(invoke("cube", "info", str(merged)).stdout.split())
    assert f"GPU pinning (eagle3 on {names[1]}) {CONTAINER}" in text, text
    for command in ("headroom", "compare"):
        done = invoke(command, str(merged), "--json")
        assert done.exit_code == 0, done.output
        json.loads(done.stdout)
        line = " ".join(done.stderr.split())
        assert line.startswith("GPU pinning unverified for 4 drafter server(s)"), line
        assert names[0] in line and names[1] in line
    # Verified on one GPU, unverified on the other: only the other is named.
    fine = _cube(
        runs["h100"] / "cube.nc",
        tmp_path / "fine.nc",
        gpu_pinning=json.dumps({"none": "verified: GPU 0", "eagle3": "verified: GPU 0"}),
    )
    assert invoke("cube", "merge", str(fine), str(b), "-o", str(merged)).exit_code == 0
    note = pinning_note(open_cube(merged))
    assert note is not None and names[1] in note and names[0] not in note.replace(names[1], "")


def test_a_merged_cube_takes_its_sources_known_engine_and_prompt_provenance(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A source that does not record an engine version, token-count method or prompt format
    (an older dvfs's cube, an engine that does not say) leaves the other's."""
    known = open_cube(runs["h200"] / "cube.nc").attrs
    a = _cube(
        runs["h100"] / "cube.nc",
        tmp_path / "a.nc",
        engine_version="",
        token_count_method="",
        prompt_format="",
    )
    b = _cube(runs["h200"] / "cube.nc", tmp_path / "b.nc", prompt_format="plain")
    merged = merge_cubes([open_cube(a), open_cube(b)], ["a", "b"])
    assert merged.attrs["engine_version"] == known["engine_version"]
    assert merged.attrs["token_count_method"] == known["token_count_method"] != ""
    assert merged.attrs["prompt_format"] == "plain"
    # Shards: one without an engine version leaves the other's, not ", X".
    s0, s1 = (runs[f"s{i}"] / "cube.nc" for i in range(2))
    blank = _cube(s0, tmp_path / "blank.nc", engine_version="", prompt_format="")
    told = _cube(s1, tmp_path / "told.nc", prompt_format="plain")
    whole = merge_cubes([open_cube(blank), open_cube(told)], ["s0", "s1"])
    assert whole.attrs["engine_version"] == known["engine_version"]
    assert whole.attrs["prompt_format"] == "plain"


def test_a_merged_cube_counts_its_sources_sessions(runs: dict[str, Path], tmp_path: Path) -> None:
    """`cube info` on a cube merged across GPUs said "sessions not recorded", though each
    source's count is kept (`merged_from`): it now sums them, as a merge of shards does."""
    a = _cube(runs["h100"] / "cube.nc", tmp_path / "a.nc", sessions=2)
    b = _cube(runs["h200"] / "cube.nc", tmp_path / "b.nc", sessions=1)
    merged = tmp_path / "m.nc"
    assert invoke("cube", "merge", str(a), str(b), "-o", str(merged)).exit_code == 0
    info = invoke("cube", "info", str(merged), "--json")
    assert info.exit_code == 0, info.output
    assert json.loads(info.stdout)["sessions"] == 3
    text = " ".join(invoke("cube", "info", str(merged)).stdout.split())
    assert "sessions 3 run(s) of dvfs sweep, on 2 GPU(s)" in text, text


def test_a_merged_cube_says_each_gpus_idle_power(runs: dict[str, Path], tmp_path: Path) -> None:
    """Each GPU idles at its own power: the merged cube keeps each source's (`merged_from`),
    and `cube info` and the report say them per GPU, not "not recorded"."""
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Facts

    a = _cube(runs["h100"] / "cube.nc", tmp_path / "a.nc", idle_power_w=61.5)
    b = _cube(runs["h200"] / "cube.nc", tmp_path / "b.nc", idle_power_w=83.25)
    merged = tmp_path / "m.nc"
    assert invoke("cube", "merge", str(a), str(b), "-o", str(merged)).exit_code == 0
    cube = open_cube(merged)
    labels = [str(g) for g in cube["gpu"].values]
    info = invoke("cube", "info", str(merged), "--json")
    assert info.exit_code == 0, info.output
    assert json.loads(info.stdout)["idle_power_per_gpu"] == dict(
        zip(labels, (61.5, 83.25), strict=True)
    )
    text = " ".join(invoke("cube", "info", str(merged)).stdout.split())
    said = f"idle power {labels[0][:12]} 61.5 W, {labels[1][:12]} 83.2 W"
    assert said in text, text
    facts = dict(next(b for b in measured_section(cube).blocks if isinstance(b, Facts)).pairs)
    assert facts["Idle power"] == f"{labels[0][:12]} 61.5 W, {labels[1][:12]} 83.25 W"
    # Another tenant around the first GPU's idle measurement: said of that GPU's idle power
    # alone (the GPU index it names is its own cube's).
    tenant = {"gpu": 0, "pid": 42, "name": "python", "at": "start"}
    _cube(a, a, idle_foreign_processes=json.dumps([tenant]))
    _cube(b, b, idle_foreign_processes="[]")
    assert invoke("cube", "merge", str(a), str(b), "-o", str(merged)).exit_code == 0
    facts = dict(
        next(b for b in measured_section(open_cube(merged)).blocks if isinstance(b, Facts)).pairs
    )
    assert facts["Idle power"] == (
        f"{labels[0][:12]} 61.5 W (not idle: another tenant's process 42 (python) on GPU 0 ran "
        f"during it), {labels[1][:12]} 83.25 W"
    )


def test_a_merged_cube_keeps_each_gpus_counter_period_and_limits(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A merged cube has no top-level `counter_update_period_s`, power-limit range or campaign
    folder (they are each GPU's): `merged_from` keeps each source's, the numbers as JSON lists
    a plain reader parses (one GPU's period too, which netCDF gives back as a number)."""
    a = _cube(
        runs["h100"] / "cube.nc",
        tmp_path / "a.nc",
        counter_update_period_s=0.1,
        campaign_dir="/campaigns/h100",
    )
    b = _cube(
        runs["h200"] / "cube.nc",
        tmp_path / "b.nc",
        counter_update_period_s=0.025,
        power_limit_range_w=[250.0, 650.0, 600.0],
        campaign_dir="/campaigns/h200",
    )
    merged = tmp_path / "m.nc"
    assert invoke("cube", "merge", str(a), str(b), "-o", str(merged)).exit_code == 0
    with xr.open_dataset(merged) as plain:  # as a reader without dvfs
        sources = json.loads(plain.attrs["merged_from"])
    kept = [
        {k: json.loads(s[k]) for k in ("counter_update_period_s", "power_limit_range_w")}
        for s in sources.values()
    ]
    source_a = open_cube(a).attrs
    assert kept == [
        {
            "counter_update_period_s": [0.1],
            "power_limit_range_w": [float(w) for w in source_a["power_limit_range_w"]],
        },
        {"counter_update_period_s": [0.025], "power_limit_range_w": [250.0, 650.0, 600.0]},
    ]
    assert [int(s["gpu_count"]) for s in sources.values()] == [1, 1]
    # and the folder each campaign's corpora paths start from
    assert [s["campaign_dir"] for s in sources.values()] == ["/campaigns/h100", "/campaigns/h200"]
    # Two campaign files in one folder: the folder alone names no campaign file at the top
    # (the README: the campaign file the sources were all swept from, none where they differ)
    a = _cube(a, a, campaign_dir="/campaigns", campaign_source="# h100\n")
    b = _cube(b, b, campaign_dir="/campaigns", campaign_source="# h200\n")
    assert invoke("cube", "merge", str(a), str(b), "-o", str(merged)).exit_code == 0
    with xr.open_dataset(merged) as plain:
        top = dict(plain.attrs)
    assert "campaign_source" not in top and "campaign_dir" not in top, top.get("campaign_dir")
    # the same file in the same folder: both kept
    b = _cube(b, b, campaign_source="# h100\n")
    assert invoke("cube", "merge", str(a), str(b), "-o", str(merged)).exit_code == 0
    with xr.open_dataset(merged) as plain:
        top = dict(plain.attrs)
    assert (top["campaign_source"], top["campaign_dir"]) == ("# h100\n", "/campaigns")


#: Variables a later dvfs added to the cube (`dvfs.cube.schema`'s history): an older dvfs's
#: cube has none of them.
LATER_VARIABLES = (
    "window_tokens",
    "temperature_start_c",
    "prompt_tokens",
    "energy_split_method",
    *(
        f"{part}_{phase}_{unit}"
        for part, unit in (("energy", "j"), ("time", "s"))
        for phase in ("prefill", "draft", "verify", "overhead")
    ),
)


@pytest.mark.parametrize("older_first", [True, False])
def test_a_cube_of_an_older_dvfs_merges_in_either_order(
    runs: dict[str, Path], tmp_path: Path, older_first: bool
) -> None:
    """A cube an older dvfs wrote lacks the later variables: merged before a newer one it was
    an internal error (the merged variables took their attributes from the first cube); each
    keeps its attributes, and the older cube's cells have energy split method 0 (none), an
    int8 flag as in every cube, not NaN in a float."""
    older = tmp_path / "older.nc"
    write_cube(open_cube(runs["h200"] / "cube.nc").drop_vars(list(LATER_VARIABLES)), older)
    newer = runs["h100"] / "cube.nc"
    merged = tmp_path / "m.nc"
    order = [older, newer] if older_first else [newer, older]
    result = invoke("cube", "merge", *map(str, order), "-o", str(merged))
    assert result.exit_code == 0, result.output
    cube, source = open_cube(merged), open_cube(newer)
    for name in LATER_VARIABLES:
        assert cube[name].attrs.keys() == source[name].attrs.keys(), name
    method = cube["energy_split_method"]
    assert method.dtype == source["energy_split_method"].dtype
    older_gpu = str(open_cube(older).attrs["gpu_uuids"])
    assert (method.sel(gpu=older_gpu) == 0).all()
    newer_gpu = str(source.attrs["gpu_uuids"])
    assert (method.sel(gpu=newer_gpu) == source["energy_split_method"]).all()


def test_a_model_that_records_its_prompts_keeps_its_context_beside_an_older_cubes(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """An H100 cube of an earlier dvfs (no `prompt_tokens`) merged with a newer H200 one: the
    H100's roofline takes the context read again (or the input range's middle), and the
    H200's stays at what its own cells recorded (one context had stood in for both)."""
    from dvfs.analysis.roofline import roofline
    from dvfs.cube import write_cube

    older = open_cube(runs["h100"] / "cube.nc").drop_vars("prompt_tokens")
    write_cube(older, tmp_path / "older.nc")
    h200 = runs["h200"] / "cube.nc"
    merged = tmp_path / "m.nc"
    assert (
        invoke("cube", "merge", str(tmp_path / "older.nc"), str(h200), "-o", str(merged)).exit_code
        == 0
    )
    done = invoke("compare", str(merged), "--json")
    assert done.exit_code == 0, done.output
    each = {r["gpu_profile"]: r for r in json.loads(done.stdout)["roofline_per_gpu_model"]}
    own = roofline(open_cube(h200)).attrs["context_tokens"]
    assert each["h200-sxm"]["context_tokens"] == pytest.approx(own)
    assert each["h100-sxm"]["context_tokens"] != pytest.approx(own)


def test_a_merged_cube_of_two_gpu_models_gets_each_ones_roofline(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """An H200 reads memory faster than an H100 that computes as fast: its ridge point is
    lower. `dvfs compare` and the report on a merged cube of the two show each GPU's roofline,
    the one of its own cube, not the first GPU's for both."""
    from dvfs.analysis.roofline import roofline
    from dvfs.analysis.targets import Target
    from dvfs.report.document import ReportOptions, build_document
    from dvfs.report.model import Table

    merged = tmp_path / "m.nc"
    h100, h200 = runs["h100"] / "cube.nc", runs["h200"] / "cube.nc"
    assert invoke("cube", "merge", str(h100), str(h200), "-o", str(merged)).exit_code == 0
    done = invoke("compare", str(merged), "--json")
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    each = {r["gpu_profile"]: r for r in doc["roofline_per_gpu_model"]}
    assert set(each) == {"h100-sxm", "h200-sxm"} and "roofline_left_out" not in doc
    for key, path in (("h100-sxm", h100), ("h200-sxm", h200)):
        own = roofline(open_cube(path))
        assert list(each[key]["ridge_point"].values()) == pytest.approx(
            own["ridge_point"].values.tolist()
        )
        # at the context its own cells' prompts recorded, which the merge keeps per GPU
        assert each[key]["context_tokens"] == pytest.approx(own.attrs["context_tokens"])
    assert doc["roofline"] == each["h100-sxm"]  # the first GPU's, as before
    # the document names every GPU model it compares on, not the first one's alone
    assert doc["gpu"] == ", ".join(json.loads(open_cube(merged).attrs["gpu_names"]))
    # and headroom's gives the campaigns' hashes (they differ in the GPU profile), which the
    # merged cube keeps per source, as the report does
    room = json.loads(invoke("headroom", str(merged), "--json").stdout)
    hashes = sorted({open_cube(c).attrs["campaign_hash"] for c in (h100, h200)})
    assert room["campaign_hash"] == ", ".join(hashes)
    text = " ".join(invoke("compare", str(merged)).stdout.split())
    assert "on h100-sxm; ridge" in text and "on h200-sxm; ridge" in text
    report = build_document(
        open_cube(merged), ReportOptions(Target("preserve")), [], generated="now"
    )
    titles = [b.title for s in report.sections for b in s.blocks if isinstance(b, Table)]
    assert sum(t.startswith("Verify pass vs ridge point") for t in titles) == 2, titles


def test_a_merged_cube_keeps_the_rooflines_of_the_gpus_the_twin_knows(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A merged cube of an H100 and a GPU the twin has no profile of (an A100) lost its H100's
    roofline too, and said to pass a measured one with --roofline, which a merged cube of two
    models refuses. The H100's is kept, the A100 left out in one line saying to pass its
    roofline with its own cube; the report says it in its notes, the JSON in
    `roofline_left_out` (it had only `roofline`, the H100's, as a one-model cube has)."""
    from dvfs.analysis.targets import Target
    from dvfs.report.document import ReportOptions, build_document
    from dvfs.report.model import Paragraph, Table

    h100 = runs["h100"] / "cube.nc"
    a100 = _cube(
        runs["h200"] / "cube.nc",
        tmp_path / "a100.nc",
        gpu_name="NVIDIA A100-SXM4-80GB",
        gpu_backend="nvml",
        twin_profile="",
    )
    merged = tmp_path / "m.nc"
    assert invoke("cube", "merge", str(h100), str(a100), "-o", str(merged)).exit_code == 0
    done = invoke("compare", str(merged), "--json")
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    assert doc["roofline"]["gpu_profile"] == "h100-sxm" and "roofline_per_gpu_model" not in doc
    # the JSON says whose roofline is missing: its `roofline` (the H100's) is not the A100's
    assert doc["roofline_left_out"] == ["NVIDIA A100-SXM4-80GB"], doc.get("roofline_left_out")
    # the roofline's context is what each cube recorded its cells sent: nothing to say of it
    said = " ".join(done.stderr.split())
    assert "roofline context" not in said
    # cubes of an earlier dvfs record none: their campaign files, which differ and the merged
    # cube does not keep, cannot be read again, and the middle of input_tokens stands in,
    # said in its own line
    older = [tmp_path / "h100-older.nc", tmp_path / "a100-older.nc"]
    for cube, path in zip((h100, a100), older, strict=True):
        write_cube(open_cube(cube).drop_vars("prompt_tokens"), path)
    merged_older = tmp_path / "m-older.nc"
    assert invoke("cube", "merge", *map(str, older), "-o", str(merged_older)).exit_code == 0
    done_older = invoke("compare", str(merged_older), "--json")
    assert done_older.exit_code == 0, done_older.output
    context, said_older = done_older.stderr.strip().split("\n", 1)
    assert (
        context.startswith("roofline context:")
        and "only where all its cubes record the same one" in context
    )
    assert " ".join(said_older.split()) == said
    assert "no roofline of NVIDIA A100-SXM4-80GB: the twin has no profile of it" in said, said
    assert "with that GPU's own cube" in said and "roofline context" not in said
    # --markdown, a file kept without the terminal's stderr, says it too (it showed only the
    # H100's roofline, under a heading naming both GPUs)
    shown = invoke("compare", str(merged), "--markdown")
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.stdout.split())
    assert f"- {said}" in text, text
    # a cube of that GPU alone has no roofline at all: said on stderr, and in the Markdown
    alone = invoke("compare", str(a100), "--markdown")
    assert alone.exit_code == 0, alone.output
    line = " ".join(alone.stderr.split())
    assert line.startswith("no roofline: the twin has no profile of the cube's GPU (NVIDIA A100")
    assert f"- {line}" in " ".join(alone.stdout.split()), alone.stdout
    report = build_document(
        open_cube(merged), ReportOptions(Target("preserve")), [], generated="now"
    )
    blocks = [b for s in report.sections for b in s.blocks]
    titles = [b.title for b in blocks if isinstance(b, Table)]
    assert sum(t.startswith("Verify pass vs ridge point") for t in titles) == 1, titles
    notes = [b.text for b in blocks if isinstance(b, Paragraph)]
    assert any(n.startswith("No roofline of NVIDIA A100-SXM4-80GB: ") for n in notes), notes


def test_a_merged_cube_lists_each_gpus_failed_cells(runs: dict[str, Path], tmp_path: Path) -> None:
    """A cell failed on one GPU: `cube info` and the merged cube's report list it with its
    error and the GPU it failed on (the merge dropped each cube's list)."""
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Table

    cell = {"drafter": "none", "repeat": 0, "sm_clock_mhz": None, "power_limit_w": None}
    cell |= {"batch": 1, "corpus": "code"}
    failed = json.dumps([{"cell": cell, "error": "HTTP 500"}])
    a = _cube(runs["h100"] / "cube.nc", tmp_path / "a.nc", failed_cells=failed)
    b = _cube(runs["h200"] / "cube.nc", tmp_path / "b.nc")
    merged = tmp_path / "m.nc"
    assert invoke("cube", "merge", str(a), str(b), "-o", str(merged)).exit_code == 0
    label = str(open_cube(merged)["gpu"].values[0])
    info = json.loads(invoke("cube", "info", str(merged), "--json").stdout)
    assert info["failed_cells"] == [{"cell": cell, "error": "HTTP 500", "gpu": label}]
    said = " ".join(invoke("cube", "info", str(merged)).stdout.split())
    named = f"none/code/b1/r0 @ stock clock, stock limit on {label[:12]}"
    assert f"failed {named}: HTTP 500" in said, said
    [table] = [
        b
        for b in measured_section(open_cube(merged)).blocks
        if isinstance(b, Table) and b.title.startswith("Failed")
    ]
    assert table.rows == ((named, "HTTP 500"),)


def test_a_merged_cube_keeps_a_sources_unrecorded_attributes_as_json_null(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A source cube that records no idle power, counter period, campaign hash... (an older or
    hand-built cube) is kept in `merged_from` with null there, which a plain JSON reader takes
    for "none", not the text "None"; dvfs reads such a cube, and one an older dvfs merged
    (holding "None"), alike."""
    from dvfs.analysis.headroom import single_gpu
    from dvfs.cube.idle import idle_foreign_per_gpu, idle_power_per_gpu
    from dvfs.report.common import campaign_hash
    from dvfs.report.facts import measured_section

    absent = ("idle_power_w", "counter_update_period_s", "idle_foreign_processes", "twin_profile")
    ds = open_cube(runs["h200"] / "cube.nc").load()
    for key in absent:
        ds.attrs.pop(key, None)
    write_cube(ds, tmp_path / "b.nc")
    merged = tmp_path / "m.nc"
    result = invoke(
        "cube", "merge", str(runs["h100"] / "cube.nc"), str(tmp_path / "b.nc"), "-o", str(merged)
    )
    assert result.exit_code == 0, result.output
    with xr.open_dataset(merged) as plain:  # as a reader without dvfs
        sources = json.loads(plain.attrs["merged_from"])
    [_, kept] = sources.values()
    assert all(kept[key] is None for key in absent), kept
    assert "None" not in kept.values()
    # An older dvfs's merge held the text "None" there: every reader takes both for none.
    cube = open_cube(merged).load()
    older = cube.copy()
    older.attrs["merged_from"] = json.dumps(
        {
            label: {k: "None" if v is None else v for k, v in s.items()}
            for label, s in sources.items()
        }
    )
    gpu = str(cube["gpu"].values[1])
    for each in (cube, older):
        assert idle_power_per_gpu(each)[gpu] != idle_power_per_gpu(each)[gpu]  # NaN: none
        assert gpu not in idle_foreign_per_gpu(each)
        assert campaign_hash(each.attrs) == campaign_hash(cube.attrs)
        assert single_gpu(each, gpu).attrs["stock_sm_clock_mhz"] == float(
            kept["stock_sm_clock_mhz"]
        )
        assert measured_section(each).blocks == measured_section(cube).blocks
    older_path = tmp_path / "older.nc"
    write_cube(older, older_path)
    for path in (merged, older_path):
        shown = invoke("cube", "info", str(path), "--json")
        assert shown.exit_code == 0, shown.output
        assert "None" not in json.dumps(json.loads(shown.stdout)["idle_power_per_gpu"])


def test_a_gpu_whose_sweep_has_not_reached_a_listed_clock_is_partial_in_the_merge(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The H100's sweep stopped before its 1005 MHz cells; merged with the finished H200 cube,
    those were taken for settings outside the H100's grid: the merge said nothing of cells not
    measured yet, and headroom told to extend knobs.sm_clock downward (`>=0`) where resuming
    the sweep measures them, as it tells of the H100's own cube. A clock the campaign lists is
    every GPU's grid."""
    out = copy_sweep(runs["h100"], tmp_path / "h100")
    journal = out / "journal.jsonl"
    kept = [
        r for r in read_records(journal) if r["type"] != "cell" or r["cell"]["sm_clock_mhz"] != 1005
    ]
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert invoke("cube", "build", str(out)).exit_code == 0
    merged = tmp_path / "m.nc"
    result = invoke("cube", "merge", str(out), str(runs["h200"]), "-o", str(merged))
    assert result.exit_code == 0, result.output
    assert "8 of 32 cells are not measured yet (8 never run" in result.stderr
    text = invoke("headroom", str(merged)).output
    assert "partial cube: 8 of 32 cells not measured yet" in text
    assert "extend knobs.sm_clock" not in text
    rows = json.loads(invoke("headroom", str(merged), "--json").output)["rows"]
    label = str(open_cube(merged)["gpu"].values[0])
    mine = [r for r in rows if r["gpu"] == label and r["feasible"]]
    assert mine and all(r["chosen_unmeasured_below"] for r in mine)
    assert not any(r["chosen_at_grid_edge"] for r in rows)


def without_clock(out: Path, mhz: int) -> None:
    """A sweep folder's journals as its sweep left them had it stopped before `mhz`'s cells."""
    for journal in [out / "journal.jsonl", *out.glob("gpu-*/journal.jsonl")]:
        if journal.is_file():
            kept = [
                r
                for r in read_records(journal)
                if r["type"] != "cell" or r["cell"]["sm_clock_mhz"] != mhz
            ]
            journal.write_text("".join(json.dumps(r) + "\n" for r in kept))


def test_a_merge_of_unfinished_sweeps_says_to_merge_again_after_resuming(
    runs: dict[str, Path], tiny_exact_run, tmp_path: Path
) -> None:
    """Two sweeps run apart, both stopped before their 1005 MHz cells, then `dvfs cube merge`d:
    `cube info`'s resume line, headroom's partial-cube note (the report's warning) and compare's
    said to run the same `dvfs sweep` command again, which rebuilds each sweep's own cube, not
    the merged one. They now name the sweeps and the merge to run again. A fleet's merged cube,
    which its sweep rebuilds, still asks for the sweep alone."""
    parts = []
    for gpu in ("h100", "h200"):
        out = copy_sweep(runs[gpu], tmp_path / gpu)
        without_clock(out, 1005)
        assert invoke("cube", "build", str(out)).exit_code == 0
        parts.append(str(out))
    merged = tmp_path / "m.nc"
    assert invoke("cube", "merge", *parts, "-o", str(merged)).exit_code == 0
    resume = json.loads(invoke("cube", "info", str(merged), "--json").stdout)["resume"]
    assert "then `dvfs cube merge` them again" in resume, resume
    assert all(part in resume for part in parts) and "run the same" not in resume
    for command in (("headroom", str(merged), "--slack", "10%"), ("compare", str(merged))):
        said = " ".join(invoke(*command).output.split())
        assert "partial cube:" in said and "run the same `dvfs sweep`" not in said, said
        assert "then `dvfs cube merge` them again" in said, said
    from dvfs.report.reasons import no_answer_advice

    failed = {"target_ms": None, "reference_problem": "failed"}
    advice = no_answer_advice(failed, doc={"merged_cubes": parts})
    assert "`dvfs cube merge` them again" in advice, advice
    fleet = copy_sweep(tiny_exact_run("mixed"), tmp_path / "fleet")  # --gpus 0,h200-sxm:0
    without_clock(fleet, 1005)
    assert invoke("cube", "build", str(fleet)).exit_code == 0
    resume = json.loads(invoke("cube", "info", str(fleet), "--json").stdout)["resume"]
    assert resume == (
        "run the same `dvfs sweep` command again without --fresh (which starts over) to resume it"
    )


def at_stock_limit(path: Path, into: Path, watts: float) -> Path:
    """The cube at `path` as its campaign would have made it with the power limit left at
    stock, `watts` on that GPU, written to `into`."""
    ds = open_cube(path).load()
    campaign = json.loads(ds.attrs["campaign"])
    campaign["knobs"]["power_limits_w"] = None
    attrs = dict(ds["power_limit"].attrs)
    ds = ds.assign_coords(power_limit=[watts])
    ds["power_limit"].attrs = attrs
    ds.attrs.update(campaign=json.dumps(campaign), stock_power_limit_w=watts)
    write_cube(ds, into)
    return into


def test_a_merged_cube_of_gpus_of_other_stock_limits_is_whole_in_cube_info(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A campaign that leaves the power limit at stock, on GPUs whose stock limits differ
    (700 and 600 W): the merged axis holds both, each GPU measuring at its own. `cube info`
    counted the other GPU's stock cells as missing ('64 = 32 measured + 32 missing') and told
    to resume a finished sweep; the report warned of them. Headroom never counted them."""

    a = at_stock_limit(runs["h100"] / "cube.nc", tmp_path / "a.nc", 700.0)
    b = at_stock_limit(runs["h200"] / "cube.nc", tmp_path / "b.nc", 600.0)
    merged = tmp_path / "m.nc"
    result = invoke("cube", "merge", str(a), str(b), "-o", str(merged))
    assert result.exit_code == 0, result.output
    assert "not measured yet" not in result.output
    info = json.loads(invoke("cube", "info", str(merged), "--json").stdout)
    assert info["coords"]["power_limit"] == [600.0, 700.0]
    assert (info["cells"], info["measured"], info["missing"]) == (32, 32, 0)
    assert info["resume"] is None
    said = " ".join(invoke("cube", "info", str(merged)).stdout.split())
    assert "cells 32 = 32 measured + 0 failed + 0 missing" in said, said
    assert "resume" not in said


@pytest.mark.parametrize("watts", [700.0, 600.0])
def test_a_gpu_that_measured_nothing_yet_at_its_stock_limit_is_partial_in_the_merge(
    runs: dict[str, Path], tmp_path: Path, watts: float
) -> None:
    """A campaign that leaves the power limit at stock; the H200's sweep stopped before its
    first cell (killed while its first server started: a session, no cell), as a fleet mixing
    models leaves a model whose workers had not measured yet. Its stock setting held no
    measured cell, so all its cells were taken for outside its grid: `cube info` said
    '16 = 16 measured + 0 missing' with no resume line and the merge said nothing of cells not
    measured yet, where the H200's own cube counts 16 missing. Each GPU's stock setting is
    the one its cube recorded (`merged_from`)."""
    out = copy_sweep(runs["h200"], tmp_path / "h200")
    journal = out / "journal.jsonl"
    kept = [r for r in read_records(journal) if r["type"] != "cell"]
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert invoke("cube", "build", str(out)).exit_code == 0
    a = at_stock_limit(runs["h100"] / "cube.nc", tmp_path / "a.nc", 700.0)
    b = at_stock_limit(out / "cube.nc", tmp_path / "b.nc", watts)
    own = json.loads(invoke("cube", "info", str(b), "--json").stdout)
    assert (own["cells"], own["missing"]) == (16, 16)
    merged = tmp_path / "m.nc"
    result = invoke("cube", "merge", str(a), str(b), "-o", str(merged))
    assert result.exit_code == 0, result.output
    assert "16 of 32 cells are not measured yet (16 never run" in result.stderr
    info = json.loads(invoke("cube", "info", str(merged), "--json").stdout)
    assert (info["cells"], info["measured"], info["missing"]) == (32, 16, 16)
    assert info["resume"] is not None
    text = invoke("headroom", str(merged)).output
    assert "partial cube: 16 of 32 cells not measured yet" in text


def test_the_report_figures_of_gpus_of_other_stock_limits_say_what_its_table_says(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A campaign that leaves the power limit at stock, on GPUs whose stock limits differ (700
    and 600 W), and a target no setting meets: the report's table (as `dvfs headroom`) says
    'none feasible', but each GPU's headroom map, whose answers were worked out as for a cube
    of that GPU alone, took the other GPU's stock limit for a setting not measured yet and
    said 'none feasible so far', which resuming a finished sweep never changes."""
    import dvfs.plots

    a = at_stock_limit(runs["h100"] / "cube.nc", tmp_path / "a.nc", 700.0)
    b = at_stock_limit(runs["h200"] / "cube.nc", tmp_path / "b.nc", 600.0)
    merged = tmp_path / "m.nc"
    assert invoke("cube", "merge", str(a), str(b), "-o", str(merged)).exit_code == 0
    maps: dict[str, list[str]] = {}

    def keep(fig: Any, out_dir: Path, name: str, fmt: str) -> Path:
        if name == "headroom":
            maps[out_dir.name] = [
                " ".join(t.get_text().split())
                for t in fig.findobj(match=lambda x: hasattr(x, "get_text"))
            ]
        return unsaved_figure(fig, out_dir, name, fmt)  # what it drew, not its pixels

    monkeypatch.setattr(dvfs.plots, "save", keep)
    figures_drawn_only(monkeypatch, "draw_headroom")  # the maps alone are read
    report = tmp_path / "r.md"
    slo = ("--slo", "tpot_p50<=1ms")
    result = invoke("report", str(merged), *slo, "-o", str(report))
    assert result.exit_code == 0, result.output
    table = invoke("headroom", str(merged), *slo, "--json")
    rows = json.loads(table.stdout)["rows"]
    assert len(rows) == 8 and not any(r["feasible"] or r["unmeasured_settings"] for r in rows)
    assert "none feasible so far" not in report.read_text()
    assert len(maps) == 2
    for texts in maps.values():
        assert "none feasible" in texts
        assert not any("so far" in t for t in texts), texts


@pytest.mark.parametrize("older_first", [True, False])
def test_a_merged_cube_says_every_quality_bit_its_cells_may_carry(
    runs: dict[str, Path], tmp_path: Path, older_first: bool
) -> None:
    """A cube an older dvfs wrote, before quality bit 15 (`idle_from_power_readings`), lists
    no such bit in its quality's flag_masks / flag_meanings: merged first, its attributes were
    the merged cube's, though the newer cube's cells may carry bit 15 (a CF reader then decodes
    it as no flag). The merged quality lists every bit dvfs knows, in either order."""
    from dvfs.measure.meter import QUALITY_FLAGS

    ds = open_cube(runs["h200"] / "cube.nc").load()
    masks = [int(m) for m in ds["quality"].attrs["flag_masks"]]
    meanings = str(ds["quality"].attrs["flag_meanings"]).split()
    keep = [i for i, m in enumerate(masks) if m != 1 << 15]
    ds["quality"].attrs["flag_masks"] = ds["quality"].attrs["flag_masks"][keep]
    ds["quality"].attrs["flag_meanings"] = " ".join(meanings[i] for i in keep)
    older = tmp_path / "older.nc"
    write_cube(ds, older)
    newer = runs["h100"] / "cube.nc"
    merged = tmp_path / "m.nc"
    order = [older, newer] if older_first else [newer, older]
    result = invoke("cube", "merge", *map(str, order), "-o", str(merged))
    assert result.exit_code == 0, result.output
    quality = open_cube(merged)["quality"].attrs
    said = dict(
        zip(
            [int(m) for m in quality["flag_masks"]],
            str(quality["flag_meanings"]).split(),
            strict=True,
        )
    )
    assert said == QUALITY_FLAGS


def test_a_merged_cube_says_which_gpus_idle_power_is_from_power_readings(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A GPU's opening idle measured from the instant power readings (its cube's
    `idle_from_power_readings`): the merged cube keeps each source's, and `cube info` says
    it of that GPU's idle power alone; a shard merge keeps it too."""
    a = _cube(runs["h100"] / "cube.nc", tmp_path / "a.nc", idle_power_w=61.5)
    _cube(a, a, idle_from_power_readings=1)
    b = _cube(runs["h200"] / "cube.nc", tmp_path / "b.nc", idle_power_w=83.25)
    merged = tmp_path / "m.nc"
    assert invoke("cube", "merge", str(a), str(b), "-o", str(merged)).exit_code == 0
    cube = open_cube(merged)
    labels = [str(g) for g in cube["gpu"].values]
    text = " ".join(invoke("cube", "info", str(merged)).stdout.split())
    said = (
        f"idle power {labels[0][:12]} 61.5 W (the mean of the instant power readings: an energy "
        f"counter updated less than twice while it was measured, or measurement.idle_s = 0 "
        f"read the power once; less exact), "
        f"{labels[1][:12]} 83.2 W"
    )
    assert said in text, text
    assert int(cube.attrs["idle_from_power_readings"]) == 1
    s0 = _cube(runs["s0"] / "cube.nc", tmp_path / "s0.nc", idle_from_power_readings=1)
    whole = tmp_path / "whole.nc"
    done = invoke("cube", "merge", str(s0), str(runs["s1"] / "cube.nc"), "-o", str(whole))
    assert done.exit_code == 0, done.output
    assert int(open_cube(whole).attrs["idle_from_power_readings"]) == 1


def _merged_and_told(paths: list[Path], tmp_path: Path) -> tuple[Any, str]:
    """`cube merge` of `paths` into tmp_path/m.nc (which must succeed): the merged cube, and
    what `cube info` says of it, on one line."""
    merged = tmp_path / "m.nc"
    result = invoke("cube", "merge", *map(str, paths), "-o", str(merged))
    assert result.exit_code == 0, result.output
    return open_cube(merged), " ".join(invoke("cube", "info", str(merged)).stdout.split())


def test_shards_of_a_fleet_mixing_models_keep_any_shards_idle_from_power_readings(
    tiny_exact_run, tmp_path: Path
) -> None:
    """Shards each run on a fleet mixing GPU models: the H100's opening idle came from the
    instant power readings in shard 1 alone. Their merged cube's `idle_from_power_readings`
    was 1, but each model's `merged_from` was the first shard's, so `cube info` said no
    caveat at all. The H100's idle power is said to be from the readings, the H200's not."""
    paths = []
    for i, flag in enumerate((0, 1)):
        ds = open_cube(tiny_exact_run(f"mixed-s{i}") / "cube.nc").load()
        sources = json.loads(ds.attrs["merged_from"])
        for n, source in enumerate(sources.values()):
            source["idle_from_power_readings"] = str(flag if n == 0 else 0)
        ds.attrs["merged_from"] = json.dumps(sources)
        ds.attrs["idle_from_power_readings"] = flag
        write_cube(ds, tmp_path / f"s{i}.nc")
        paths.append(tmp_path / f"s{i}.nc")
    cube, text = _merged_and_told(paths, tmp_path)
    assert int(cube.attrs["idle_from_power_readings"]) == 1
    h100, h200 = (str(g)[:12] for g in cube["gpu"].values)
    caveat = "(the mean of the instant power readings"
    assert f"idle power {h100} 75.0 W {caveat}" in text, text
    assert f"{h200} 75.0 W {caveat}" not in text, text


def test_shards_of_a_fleet_mixing_models_keep_each_shards_idle_power_per_model(
    tiny_exact_run, tmp_path: Path
) -> None:
    """Shards each run on a fleet mixing GPU models, the H100's opening idle 75 W in shard 0
    and 95 W in shard 1, where another tenant's process was seen around it: each model's
    `merged_from` was the first shard's, so `cube info` said the H100 idled at 75 W and said
    no tenant at all, though shard 1 measured 95 W with that tenant's work in it. Each
    model's idle power is now its shards' mean (as the shards of one model combine), its
    tenants every shard's, and the H200's stays its own."""
    tenant = {"gpu": 0, "pid": 4242, "name": "other-job", "when": "start"}
    paths = []
    for i, idle in enumerate((75.0, 95.0)):
        ds = open_cube(tiny_exact_run(f"mixed-s{i}") / "cube.nc").load()
        sources = json.loads(ds.attrs["merged_from"])
        h100 = next(iter(sources.values()))
        h100["idle_power_w"] = str(idle)
        if i == 1:
            h100["idle_foreign_processes"] = json.dumps([tenant])
            ds.attrs["idle_foreign_processes"] = json.dumps([tenant])
        ds.attrs["merged_from"] = json.dumps(sources)
        write_cube(ds, tmp_path / f"s{i}.nc")
        paths.append(tmp_path / f"s{i}.nc")
    cube, text = _merged_and_told(paths, tmp_path)
    h100, h200 = (str(g)[:12] for g in cube["gpu"].values)
    assert f"idle power {h100} 85.0 W (not idle: another tenant's process 4242" in text, text
    assert f"{h200} 75.0 W gpu" in text, text  # no tenant, the H200's own


def test_shards_of_a_fleet_mixing_models_count_every_shards_sessions(
    tiny_exact_run, tmp_path: Path
) -> None:
    """Shards each run on a fleet mixing GPU models: each model's `merged_from` came from the
    first shard, so `cube info` counted shard 0's sessions alone (each model's sessions in
    shard 1 lost). The count is every shard's sessions of every model."""
    paths, counts = [], []
    for i in range(2):
        ds = open_cube(tiny_exact_run(f"mixed-s{i}") / "cube.nc").load()
        sources = json.loads(ds.attrs["merged_from"])
        for n, source in enumerate(sources.values()):
            source["sessions"] = str(1 + n + 2 * i)  # 1 and 2 in shard 0, 3 and 4 in shard 1
            counts.append(1 + n + 2 * i)
        ds.attrs["merged_from"] = json.dumps(sources)
        write_cube(ds, tmp_path / f"s{i}.nc")
        paths.append(tmp_path / f"s{i}.nc")
    cube, text = _merged_and_told(paths, tmp_path)
    info = invoke("cube", "info", str(tmp_path / "m.nc"), "--json")
    assert json.loads(info.stdout)["sessions"] == sum(counts), info.stdout
    assert f"sessions {sum(counts)} run(s) of dvfs sweep" in text, text


def test_a_merge_of_a_merged_cube_names_every_cube_that_went_in(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """`dvfs cube merge` of a cube `dvfs cube merge` made (an H100 run's two shards, merged)
    and an H200's cube: its `merged_cubes` named the shards' merged file and the H200's
    folder, losing the shards that went into that file, so the advice on cells not measured
    yet (`cube info`'s resume line, the analyses' notes) sent the user to rerun the sweep of a
    merged file, which has none. It now names every cube that went in, flattened."""
    from dvfs.cube.cells_left import merged_cubes

    parts = {}
    for name in ("s0", "s1", "h200"):  # each stopped before its 1005 MHz cells
        parts[name] = copy_sweep(runs[name], tmp_path / name)
        without_clock(parts[name], 1005)
        assert invoke("cube", "build", str(parts[name])).exit_code == 0
    whole = tmp_path / "whole.nc"
    result = invoke("cube", "merge", str(parts["s0"]), str(parts["s1"]), "-o", str(whole))
    assert result.exit_code == 0, result.output
    final = tmp_path / "final.nc"
    result = invoke("cube", "merge", str(whole), str(parts["h200"]), "-o", str(final))
    assert result.exit_code == 0, result.output
    went_in = [str(parts[name]) for name in ("s0", "s1", "h200")]
    assert merged_cubes(open_cube(final)) == went_in
    resume = json.loads(invoke("cube", "info", str(final), "--json").stdout)["resume"]
    assert f"merged from 3 sweeps' cubes ({', '.join(went_in)})" in resume, resume
    assert str(whole) not in resume, resume


@pytest.mark.parametrize("pair", [("h200", "h100"), ("s0", "s1")])
def test_a_cube_that_does_not_record_its_pairing_merges_as_not_recorded(
    runs: dict[str, Path], tmp_path: Path, pair: tuple[str, str]
) -> None:
    """A cube of a dvfs before `arms_on_one_gpu` merged with one that records it: whether each
    comparison group ran on one GPU is not recorded in the merge, not said to be "not kept to
    one GPU (an earlier dvfs's fleet)" (the missing attribute read as 0)."""
    older = open_cube(runs[pair[0]] / "cube.nc").load()
    del older.attrs["arms_on_one_gpu"]
    write_cube(older, tmp_path / "older.nc")
    merged = tmp_path / "m.nc"
    newer = runs[pair[1]] / "cube.nc"
    result = invoke("cube", "merge", str(tmp_path / "older.nc"), str(newer), "-o", str(merged))
    assert result.exit_code == 0, result.output
    assert "arms_on_one_gpu" not in open_cube(merged).attrs
    info = invoke("cube", "info", str(merged))
    assert info.exit_code == 0, info.output
    assert "whether each comparison group ran on one GPU not recorded" in info.output
    assert "not kept to one GPU" not in info.output


def test_a_merge_with_a_cube_not_recording_its_pairing_still_counts_groups_across_gpus(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A cube of a dvfs before `arms_on_one_gpu` merged with one whose comparison groups' cells
    span GPUs (`groups_across_gpus`): `cube info` on the merge says how many, which is known,
    not only that the pairing is not recorded."""
    older = open_cube(runs["h200"] / "cube.nc").load()
    del older.attrs["arms_on_one_gpu"]
    write_cube(older, tmp_path / "older.nc")
    newer = open_cube(runs["h100"] / "cube.nc").load()
    newer.attrs["groups_across_gpus"] = 2
    write_cube(newer, tmp_path / "newer.nc")
    merged = tmp_path / "m.nc"
    files = [str(tmp_path / "older.nc"), str(tmp_path / "newer.nc")]
    result = invoke("cube", "merge", *files, "-o", str(merged))
    assert result.exit_code == 0, result.output
    assert int(open_cube(merged).attrs["groups_across_gpus"]) == 2
    info = invoke("cube", "info", str(merged))
    assert info.exit_code == 0, info.output
    assert "2 comparison group(s) measured on more than one GPU" in info.output, info.output


def _unmeasured(journal: Path, how: str) -> str:
    """Leave a GPU model's `journal` unmeasured `how` (empty, or missing from its folder) and
    return what dvfs says it is."""
    if how == "missing":
        journal.unlink()
        return f"{journal} is missing"
    journal.write_bytes(b"")
    return f"{journal} holds no session yet"


@pytest.mark.parametrize("how", ["empty", "missing"])
def test_a_gpu_models_journal_holding_no_session_is_said_left_out(
    tiny_exact_run, tmp_path: Path, how: str
) -> None:
    """A fleet folder mixing models, one model's journal empty (its sweep stopped before that
    model's first session) or missing (moved or deleted): `dvfs cube build` left it out of the
    cube silently, the cube then one model's, read as the whole campaign (a missing one even
    by `cube info`). It says so in one line; with every model's journal empty, the refusal
    named no journal ("no journal at ..., nor a GPU model's") though there are: it names
    them (every one missing: that refusal)."""
    out = copy_sweep(tiny_exact_run("mixed"), tmp_path / "out")
    measured, empty = sorted(out.glob("gpu-*/journal.jsonl"))
    what = _unmeasured(empty, how)
    (out / "cube.nc").unlink()
    built = invoke("cube", "build", str(out))
    assert built.exit_code == 0, built.output
    said = built.stderr.strip().splitlines()
    assert said == [f"{what} (nothing measured on that GPU model): left out of the cube"], (
        built.output
    )
    assert "gpu" not in open_cube(out / "cube.nc").sizes  # the one model's cube
    info = invoke("cube", "info", str(out))
    assert f"left out: {what} (nothing measured on that GPU model)" in info.output, info.output
    both = f"{_unmeasured(measured, how)}, {what}: nothing measured yet"
    refused = invoke("cube", "build", str(out))
    # every model's journal gone: no journal to name, the folder's own nor a model's
    assert_one_line_error(refused, 1, both if how == "empty" else "no journal at")


@pytest.mark.parametrize("how", ["empty", "missing"])
def test_a_rerun_on_one_model_counts_the_cells_of_a_model_whose_journal_is_gone(
    tiny_exact_run, tmp_path: Path, how: str
) -> None:
    """A fleet folder mixing models, rerun on one model's GPUs, the other's journal empty or
    missing from its folder: the missing one was passed over, the folder read as finished
    (nothing said of the other model, its dry run counting nothing left for it). Both say that
    model's cells are left for its GPUs, as for an empty journal, and a rerun on every model
    measures them."""
    run = tiny_exact_run("mixed")
    out = copy_sweep(run, tmp_path / "out")
    campaign = str(run.parent / "campaign.toml")
    h100, h200 = sorted(out.glob("gpu-*/journal.jsonl"))
    assert "h200" in h200.parent.name
    _unmeasured(h200, how)
    cells = len([r for r in read_records(h100) if r.get("type") == "cell"])
    left = f"{h200.parent.name}: {cells} cell(s) left for GPUs of that model (none in this run)"
    planned = invoke("sweep", campaign, "--gpus", "0", "--out", str(out), "--dry-run", "--json")
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.stdout)["left_for_other_models"] == {h200.parent.name: cells}
    rerun = invoke("sweep", campaign, "--gpus", "0", "--out", str(out), "--no-progress")
    assert rerun.exit_code == 0, rerun.output
    assert left in " ".join(rerun.output.split()), rerun.output
    whole = invoke("sweep", campaign, *MIXED_FLEET, "--out", str(out), "--no-progress")
    assert whole.exit_code == 0, whole.output
    assert f"{cells} cell(s) measured, 0 failed, {cells} already done" in whole.output
    assert open_cube(out / "cube.nc").sizes["gpu"] == 2


@pytest.mark.parametrize("how", ["empty", "missing"])
def test_a_cube_holding_a_model_whose_journal_went_since_does_not_say_it_left_out(
    tiny_exact_run, tmp_path: Path, how: str
) -> None:
    """A finished fleet folder mixing models whose H200 journal was moved away (compressed,
    archived) or emptied after its cube was written: `cube info`, `headroom`, `compare`,
    `plot` and `report` of the folder said 'the cube leaves that model out; run the sweep
    again, its --gpus naming GPUs of that model', of a cube that holds every H200 cell
    (followed, a rerun measures them all again). Only a model the cube lacks is left out."""
    out = copy_sweep(tiny_exact_run("mixed"), tmp_path / "out")
    h200 = next(out.glob("gpu-nvidia-h200*/journal.jsonl"))
    _unmeasured(h200, how)
    assert open_cube(out / "cube.nc").sizes["gpu"] == 2  # the cube holds both models
    info = json.loads(invoke("cube", "info", str(out), "--json").output)
    assert info["left_out"] == [], info["left_out"]
    for command in ("headroom", "compare"):
        said = invoke(command, str(out))
        assert said.exit_code == 0 and "left out" not in said.output, said.output
        doc = json.loads(invoke(command, str(out), "--json").stdout)
        assert "left_out" not in doc, doc["left_out"]
    # the model's own cube holds it too: analysed alone it has no model folder beneath it
    alone = json.loads(invoke("cube", "info", str(h200.parent), "--json").output)
    assert alone["left_out"] == [], alone["left_out"]
    # rebuilt from the journals left, the cube is the H100's alone, and says the H200 is out
    built = invoke("cube", "build", str(out))
    assert built.exit_code == 0 and "left out of the cube" in built.output, built.output
    info = json.loads(invoke("cube", "info", str(out), "--json").output)
    assert info["left_out"] == [str(h200)], info["left_out"]


def test_a_gpu_folder_of_the_users_own_in_a_mixed_fleets_folder_is_no_model_left(
    tiny_exact_run, tmp_path: Path
) -> None:
    """A finished fleet folder mixing models holding a `gpu-*` folder of the user's own (empty,
    or their notes): it read as a GPU model whose journal is missing, every cell left: `cube
    info` said the cube leaves it out and to run the sweep with GPUs of 'that model' (there is
    none), the dry run counted its cells in left_for_other_models and a rerun said them left,
    the folder never done. It is none of dvfs's; a model folder whose journal went, its cube
    or a journal --fresh moved aside still there, is still a model with every cell left."""
    run = tiny_exact_run("mixed")
    out = copy_sweep(run, tmp_path / "out")
    campaign = str(run.parent / "campaign.toml")
    (out / "gpu-empty").mkdir()
    (out / "gpu-notes").mkdir()
    (out / "gpu-notes" / "notes.txt").write_text("H100 and H200 runs\n")
    info = json.loads(invoke("cube", "info", str(out), "--json").output)
    assert info["left_out"] == [], info["left_out"]
    planned = invoke("sweep", campaign, "--gpus", "0", "--out", str(out), "--dry-run", "--json")
    assert planned.exit_code == 0, planned.output
    assert not json.loads(planned.stdout).get("left_for_other_models"), planned.stdout
    rerun = invoke("sweep", campaign, *MIXED_FLEET, "--out", str(out), "--no-progress")
    assert rerun.exit_code == 0 and "left for GPUs" not in rerun.output, rerun.output
    # the H200's folder, its journal moved aside as --fresh moves it and its cube gone: a model
    h200 = next(out.glob("gpu-nvidia-h200*/journal.jsonl"))
    h200.rename(h200.with_name("journal.jsonl.1"))
    (h200.parent / "cube.nc").unlink()
    planned = invoke("sweep", campaign, "--gpus", "0", "--out", str(out), "--dry-run", "--json")
    left = json.loads(planned.stdout)["left_for_other_models"]
    assert left == {h200.parent.name: 16}, left


def test_compare_on_a_merged_cube_warns_where_one_models_gpus_differ_in_ecc_mode(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Two H100s, one with ECC off, merged: the report warns that their cells differ in it;
    `dvfs compare` said nothing. It says the report's warning (stderr, and in its Markdown)."""
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Paragraph

    on = _cube(runs["h100"] / "cube.nc", tmp_path / "on.nc", ecc_mode="on")
    ds = open_cube(on).load()
    uuids = str(ds.attrs["gpu_uuids"])
    off = _cube(on, tmp_path / "off.nc", ecc_mode="off", gpu_uuids=f"{uuids}-other")
    merged = tmp_path / "m.nc"
    done = invoke("cube", "merge", str(on), str(off), "-o", str(merged))
    assert done.exit_code == 0, done.output
    blocks = measured_section(open_cube(merged)).blocks
    [warned] = [b.text for b in blocks if isinstance(b, Paragraph) and "ECC modes" in b.text]
    assert "ECC off: " in warned and "ECC on: " in warned, warned
    for extra in ([], ["--markdown"], ["--json"]):
        compared = invoke("compare", str(merged), *extra)
        assert compared.exit_code == 0, compared.output
        said = " ".join(compared.stderr.split())
        assert warned in said, said
        if extra == ["--markdown"]:
            assert f"- {warned}" in compared.stdout, compared.stdout
        if extra == ["--json"]:
            json.loads(compared.stdout)
    # GPUs of one ECC mode: not warned for
    alike = _cube(on, tmp_path / "alike.nc", gpu_uuids=f"{uuids}-other")
    assert invoke("cube", "merge", str(on), str(alike), "-o", str(merged)).exit_code == 0
    compared = invoke("compare", str(merged))
    assert compared.exit_code == 0, compared.output
    assert "ECC modes" not in compared.stderr + compared.stdout


def test_cubes_that_differ_where_the_first_cube_records_nothing_do_not_merge(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The first cube an earlier dvfs wrote, with no engine version: each later cube was
    compared with it (and with the first of its own model) alone, so an H200's on SGLang 0.5.9
    and a second H100's on 0.5.23 merged silently. Each is compared with every earlier cube."""
    ds = open_cube(runs["h100"] / "cube.nc").load()
    del ds.attrs["engine_version"]
    older = write_cube(ds, tmp_path / "older.nc")
    h200 = _cube(runs["h200"] / "cube.nc", tmp_path / "h200.nc", engine_version="0.5.9")
    other = str(ds.attrs["gpu_uuids"]) + "-other"
    h100 = _cube(
        runs["h100"] / "cube.nc", tmp_path / "h100.nc", engine_version="0.5.23", gpu_uuids=other
    )
    merged = tmp_path / "m.nc"
    done = invoke("cube", "merge", str(older), str(h200), str(h100), "-o", str(merged))
    assert_one_line_error(
        done,
        2,
        f"{h200} and {h100} were not measured alike",
        "engine_version: '0.5.9' -> '0.5.23'",
    )
    assert not merged.exists()
    # alike where known: merged, keeping the known version
    h100 = _cube(h100, tmp_path / "h100b.nc", engine_version="0.5.9")
    done = invoke("cube", "merge", str(older), str(h200), str(h100), "-o", str(merged))
    assert done.exit_code == 0, done.output
    assert open_cube(merged).attrs["engine_version"] == "0.5.9"
