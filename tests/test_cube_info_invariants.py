"""`dvfs cube info` shows what the arms of the cube's comparisons were held alike in, as the
sweep and the cube build checked it: the GPU of each comparison group (and how many groups a
resume on other GPUs left across two), the engine and its flags, the kernels and what dvfs
pinned for every drafter, and the prompts (each corpus's content, the token count)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from conftest import replace_block, write

from dvfs.cli import cli
from dvfs.cube import open_cube
from dvfs.measure.journal import read_records

#: The demo campaign cut to 16 cells (two clocks, two drafters, two batches, two corpora): valid
#: cells, which the count of groups across GPUs takes alone.
DEMO = (Path(__file__).resolve().parent.parent / "dvfs" / "campaigns" / "demo.toml").read_text()
CUT = DEMO[: DEMO.index("[drafters.standalone]")] + DEMO[DEMO.index("[workload]") :]
for old, new in [
    ("sm_clock = { start = 705, stop = 1980, step = 75 }", "sm_clock = [1200, 1980]"),
    ("power_limit = [700, 400]", "power_limit = [700]"),
    ("batch = [1, 4, 16, 32, 64]", "batch = [1, 16]"),
    (
        'corpora = ["code", "conversation", "english", "math", "romansh"]',
        'corpora = ["code", "math"]',
    ),
    ("input_tokens = [16, 2048]", "input_tokens = [16, 512]"),
]:
    CUT = replace_block(CUT, old, new)


def run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_cube_info_shows_the_invariants_and_the_groups_a_resume_left_across_gpus(
    tmp_path: Path,
) -> None:
    """A sweep on one GPU (drafter after drafter) cut halfway and resumed on a fleet of other
    twin GPUs of the model: the groups it had begun end on two GPUs. The cube counts them
    (`groups_across_gpus`) and `cube info` says so, with the rest of what the arms shared;
    its --json holds the same."""
    campaign = write(tmp_path / "cut.toml", CUT)
    out = tmp_path / "out"
    run("sweep", str(campaign), "--out", str(out), "--no-progress")
    journal = out / "journal.jsonl"
    records = read_records(journal)
    cells = [i for i, r in enumerate(records) if r["type"] == "cell"]
    kept = records[: cells[len(cells) // 2]]
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    (out / "cube.nc").unlink()
    run("sweep", str(campaign), "--gpus", "1-2", "--out", str(out), "--no-progress")
    cube = open_cube(out / "cube.nc")
    across = int(cube.attrs["groups_across_gpus"])
    assert across > 0
    hashes = json.loads(cube.attrs["corpora"])

    shown = " ".join(run("cube", "info", str(out)).split())
    assert f"arms {across} comparison group(s) measured on more than one GPU" in shown, shown
    assert "alike but the drafter: engine version and flags, decode CUDA graphs" in shown
    assert f"prompts alike: code {hashes['code']['content_hash']}" in shown
    assert f"tokens counted by {cube.attrs['token_count_method']}" in shown

    # which runs and GPUs the cells came from: the first run's and the resume's
    uuids = cube.attrs["gpu_uuids"].split(",")
    assert f"sessions 2 run(s) of dvfs sweep, on {len(uuids)} GPU(s): {uuids[0]}" in shown, shown
    held = json.loads(run("cube", "info", "--json", str(out)))["invariants"]
    assert held["arms_on_one_gpu"] is True
    assert held["groups_across_gpus"] == across
    assert held["corpora"] == {name: c["content_hash"] for name, c in hashes.items()}
    assert held["arms_pinned"] == [
        "decode CUDA graphs",
        "overlap scheduler",
        "random seed",
        "prefill admission hold",
    ]


def test_cube_info_says_each_group_ran_on_one_gpu(tiny_sweep: Path) -> None:
    shown = " ".join(run("cube", "info", str(tiny_sweep)).split())
    assert "arms each comparison group on one GPU; alike but the drafter" in shown, shown


def test_cube_info_does_not_call_arms_served_differently_alike(
    tiny_sweep: Path, tmp_path: Path
) -> None:
    """A cube whose drafters' servers ran other attention kernels (one an earlier dvfs built,
    or edited) is refused by every analysis; `cube info` said its arms were "alike but the
    drafter: ... attention kernels fa3, triton". It names the difference instead, as the
    analyses' refusal does, and its --json lists it (`arms_differ`); a cube whose arms are
    alike lists none."""
    import numpy as np
    import xarray as xr

    with xr.open_dataset(tiny_sweep / "cube.nc") as raw:
        ds = raw.load()
    drafters = ds.sizes["drafter"]
    assert drafters >= 2
    kernels = np.array(["fa3"] + ["triton"] * (drafters - 1), dtype=object)
    ds["attention_backend"] = (("drafter",), kernels, ds["attention_backend"].attrs)
    edited = tmp_path / "cube.nc"
    ds.to_netcdf(edited)

    shown = " ".join(run("cube", "info", str(edited)).split())
    assert "alike but the drafter" not in shown, shown
    assert "served differently beyond the drafter:" in shown, shown
    assert "attention kernels: triton -> fa3" in shown, shown
    held = json.loads(run("cube", "info", "--json", str(edited)))["invariants"]
    assert held["arms_differ"] and "attention kernels" in held["arms_differ"][0]
    assert (
        json.loads(run("cube", "info", "--json", str(tiny_sweep)))["invariants"]["arms_differ"]
        == []
    )


def test_cube_info_names_the_sessions_and_gpus_the_cube_came_from(tiny_sweep: Path) -> None:
    """The cube keeps how many runs of the sweep measured it and on which GPUs (`sessions`,
    `gpu_uuids`); `cube info` showed neither, so a user could not tell from it where a cube
    came from. It shows them in one row, and --json gives them."""
    cube = open_cube(tiny_sweep / "cube.nc")
    [uuid] = cube.attrs["gpu_uuids"].split(",")
    shown = " ".join(run("cube", "info", str(tiny_sweep)).split())
    assert f"sessions 1 run(s) of dvfs sweep, on 1 GPU(s): {uuid}" in shown, shown
    summary = json.loads(run("cube", "info", "--json", str(tiny_sweep)))
    assert summary["sessions"] == 1 and summary["gpu_uuids"] == [uuid]
