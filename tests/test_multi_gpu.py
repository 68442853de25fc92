"""One node, many GPUs: `dvfs sweep --gpus` and `gpu.devices` groups on the twin."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner, Result
from conftest import PYTHON, copy_sweep, replace_block, write
from fleet_support import FLEET, lose_worker_on_its_third_cell, refuse_servers_on, signalled_at
from fleet_support import assert_same_cells as _assert_same_cells

from dvfs.backends import open_backends
from dvfs.campaign import load_campaign
from dvfs.cli import cli
from dvfs.cube import STATUS_OK, open_cube
from dvfs.errors import CampaignError
from dvfs.fleet.devices import for_group, parse_gpus, worker_groups
from dvfs.fleet.worker import ShippingJournal
from dvfs.gpu.knobs import KnobController
from dvfs.measure.journal import read_records
from dvfs.measure.plan import plan_cells
from dvfs.measure.runner import Runner
from dvfs.twin.profiles import gpu_profile

CAMPAIGN = FLEET


def sweep(*args: str) -> Result:
    return CliRunner().invoke(cli, ["sweep", *args, "--no-progress"], catch_exceptions=False)


def assert_same_cells(a, b) -> None:
    """`fleet_support.assert_same_cells`, above-idle energy at 3e-4: warm-ups follow each
    worker's history, and the subtraction doubles the counter's relative step."""
    _assert_same_cells(a, b, above_idle_rtol=3e-4)


@pytest.fixture
def runs(shared_run) -> Path:
    """The campaign on one GPU (the plain sweep, `one`) and on four twin GPUs (`four`), shared
    with the other fleet tests: read-only."""
    shared_run(CAMPAIGN, "one")
    return shared_run(CAMPAIGN, "four", "--gpus", "0-3").parent


def test_four_gpus_equal_one_cell_for_cell(runs: Path) -> None:
    one, four = open_cube(runs / "one" / "cube.nc"), open_cube(runs / "four" / "cube.nc")
    assert (four["cell_status"].values == STATUS_OK).all()
    assert_same_cells(four, one)
    assert len(four.attrs["gpu_uuids"].split(",")) == 4
    # Per-GPU session facts line up with the four GPUs (each worker detected its own).
    assert len(np.atleast_1d(four.attrs["counter_update_period_s"])) == 4


def test_the_drivers_journal_holds_every_worker(runs: Path) -> None:
    records = read_records(runs / "four" / "journal.jsonl")
    sessions = [r for r in records if r["type"] == "session"]
    assert len(sessions) == 1
    assert [w["worker"] for w in sessions[0]["workers"]] == ["gpu0", "gpu1", "gpu2", "gpu3"]
    assert len(sessions[0]["gpus"]) == 4
    assert "groups" in sessions[0]["journal_sync"]  # the driver's journal, grouped on the twin
    cells = [r for r in records if r["type"] == "cell"]
    by_worker: dict[str, int] = {}
    for record in cells:
        by_worker[record["worker"]] = by_worker.get(record["worker"], 0) + 1
    # Every worker measured, each cell once; a worker keeps its server: few starts in all.
    assert set(by_worker) == {"gpu0", "gpu1", "gpu2", "gpu3"}
    assert len({r["key"] for r in cells}) == len(cells) == 72
    servers = [r for r in records if r["type"] == "server"]
    assert len(servers) < len(cells) / 3
    # Progress reported every worker.
    out = (runs / "four.txt").read_text()
    for label in by_worker:
        assert f"{label} on " in out and "makespan" in out


def test_the_drivers_journal_alone_resumes(runs: Path, tmp_path: Path) -> None:
    """A driver killed mid-campaign: its journal keeps what it had; the rerun finishes."""
    campaign = str(runs / "campaign.toml")
    out = tmp_path / "resumed"
    out.mkdir()
    lines = (runs / "four" / "journal.jsonl").read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if '"type":"cell"' in line][14]
    (out / "journal.jsonl").write_text("".join(lines[:cut]))
    again = sweep(campaign, "--gpus", "0-3", "--out", str(out))
    assert again.exit_code == 0, again.output
    assert "58 cell(s) measured" in again.output and "14 already done" in again.output
    assert_same_cells(open_cube(out / "cube.nc"), open_cube(runs / "one" / "cube.nc"))
    # Each group the killed run began resumes on the worker of the GPU that began it, whole:
    # no comparison's arms span two GPUs (the queue dealt the groups anew, blind to the
    # journal, and the begun groups' other drafters ran on other GPUs).
    resumed = open_cube(out / "cube.nc")
    on = resumed["measured_on"].transpose("batch", "corpus", "repeat", ...).values
    groups = on.reshape(on.shape[0] * on.shape[1] * on.shape[2], -1)  # a row per group
    spans = [set(g) for g in groups if len(set(g)) > 1]
    assert not spans, spans
    assert resumed.attrs["groups_across_gpus"] == 0
    # Other settings, or another shard, are refused before any worker opens its GPUs.
    edited = write(
        tmp_path / "edited.toml",
        replace_block(CAMPAIGN, "output_tokens = 48", "output_tokens = 40"),
    )
    changed = sweep(str(edited), "--gpus", "0-3", "--out", str(out))
    assert changed.exit_code == 1 and "workload.output_tokens: 48 -> 40" in changed.output
    sharded = sweep(campaign, "--gpus", "0-3", "--shard", "0/2", "--out", str(out))
    assert sharded.exit_code == 2 and "holds the whole campaign" in sharded.output
    # Another GPU set of the same model resumes it: tests/test_fleet_rerun.py.


def test_a_lost_worker_loses_no_cell(runs: Path, tmp_path: Path, monkeypatch) -> None:
    lose_worker_on_its_third_cell(monkeypatch, "gpu2")
    out = tmp_path / "lost"
    result = sweep(str(runs / "campaign.toml"), "--gpus", "0-3", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert (
        "gpu2" in result.output and "lost: RuntimeError: the GPU fell off the bus" in result.output
    )
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == 72 and sum(r["worker"] == "gpu2" for r in cells) == 2
    assert_same_cells(open_cube(out / "cube.nc"), open_cube(runs / "one" / "cube.nc"))


def test_tensor_parallel_groups(runs: Path, tmp_path: Path) -> None:
    """Groups of two (tp_size 2) in the campaign run in parallel and equal one group alone."""
    tp = replace_block(CAMPAIGN, 'model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\ntp_size = 2')
    tp = replace_block(tp, "sm_clock = [1980, 1410, 1005]", "sm_clock = [1980, 1005]")  # 48 cells
    grouped = write(
        tmp_path / "grouped.toml", replace_block(tp, "devices = [0]", "devices = [[0, 1], [2, 3]]")
    )
    single = write(tmp_path / "single.toml", replace_block(tp, "devices = [0]", "devices = [0, 1]"))
    assert sweep(str(grouped), "--out", str(tmp_path / "g")).exit_code == 0
    assert sweep(str(single), "--out", str(tmp_path / "s")).exit_code == 0
    g, s = open_cube(tmp_path / "g" / "cube.nc"), open_cube(tmp_path / "s" / "cube.nc")
    assert_same_cells(g, s)
    assert g.attrs["tp_size"] == 2
    session = next(
        r for r in read_records(tmp_path / "g" / "journal.jsonl") if r["type"] == "session"
    )
    assert [len(w["gpus"]) for w in session["workers"]] == [2, 2]
    # --gpus cuts into groups of tp_size.
    cut = sweep(str(single), "--gpus", "0-3", "--out", str(tmp_path / "c"))
    assert cut.exit_code == 0, cut.output
    assert_same_cells(open_cube(tmp_path / "c" / "cube.nc"), s)


def test_a_groups_energy_is_the_sum_of_its_gpus(tmp_path: Path) -> None:
    """The same cell metered on both GPUs of a tensor-parallel group and on one of them: the
    group's energy and power are twice one GPU's (the twin's GPUs run in lock-step)."""
    tp = replace_block(CAMPAIGN, 'model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\ntp_size = 2')
    campaign = load_campaign(
        write(tmp_path / "tp.toml", replace_block(tp, "devices = [0]", "devices = [0, 1]"))
    )
    cell = next(c for c in plan_cells(campaign) if c.batch == 8 and c.drafter == "eagle3")
    from dvfs.corpora.prepare import counted_corpora

    corpora, method = counted_corpora(campaign)

    def metered(which: slice) -> dict:
        with (
            open_backends(campaign, out_dir=tmp_path) as b,
            KnobController(b.gpus, actuation=True) as knobs,
        ):
            journal = ShippingJournal(tmp_path / "j.jsonl")
            runner = Runner(
                campaign,
                gpus=b.gpus[which],
                engine=b.engine,
                clock=b.clock,
                journal=journal,
                knobs=knobs,
                corpora=corpora,
                token_count_method=method,
            )
            record = runner.run_cell(cell)
            assert record.ok
            return journal.drain()[-1]["measurement"]

    both, first = metered(slice(0, 2)), metered(slice(0, 1))
    assert both["energy_j"] == pytest.approx(2 * first["energy_j"], rel=1e-4)
    assert both["power_mean_w"] == pytest.approx(2 * first["power_mean_w"], rel=1e-4)
    assert both["decode_time_s"] == first["decode_time_s"]


def test_gpu_lists() -> None:
    assert parse_gpus("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_gpus("GPU-a1,GPU-b2") == ["GPU-a1", "GPU-b2"]
    # pasted upper-cased (NVML's are lower-case hex): the same GPUs, so named twice is caught
    assert parse_gpus("GPU-A1,gpu-b2") == ["GPU-a1", "GPU-b2"]
    with pytest.raises(CampaignError, match="names a GPU twice"):
        parse_gpus("GPU-a1,GPU-A1")


def test_campaign_gpu_uuids_are_read_case_aside(tmp_path: Path) -> None:
    """gpu.devices with a UUID pasted upper-cased names the GPU NVML names in lower case (it
    was opened by the raw string and not found, and the same UUID in two cases was two GPUs);
    a server env's CUDA_VISIBLE_DEVICES is compared with the metered GPUs case aside too."""
    from nvml_support import NVML_CAMPAIGN

    from dvfs.engines.server_gpus import check_visible_devices

    text = replace_block(
        NVML_CAMPAIGN.format(output_tokens=16, repeats=1),
        "devices = [0]",
        'devices = ["GPU-AB12-CD", "GPU-ef34"]',
    )
    campaign = load_campaign(write(tmp_path / "c.toml", text))
    assert campaign.gpu.devices == ("GPU-ab12-cd", "GPU-ef34")
    twice = text.replace('"GPU-ef34"', '"GPU-ab12-cd"')
    with pytest.raises(CampaignError, match="lists a GPU twice"):
        load_campaign(write(tmp_path / "t.toml", twice))
    served = replace_block(text, 'backend = "twin"\nmodel', 'backend = "sglang"\nmodel')
    served = served.replace(', "GPU-ef34"', "")
    served += '[engine.sglang]\nenv = { CUDA_VISIBLE_DEVICES = "GPU-ab12-cd" }\n'
    load_campaign(write(tmp_path / "s.toml", served))  # not 'contradicts gpu.devices'
    check_visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-AB12-CD"}, ["GPU-ab12-cd"])


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("3-1", "runs backwards"),
        ("0,0", "names a GPU twice"),
        ("0,,1", "an empty entry"),
        ("zero", "neither a GPU index"),
        ("0-2", "do not split into servers of engine.tp_size = 2"),
        ("0,h200-sxm:0", "one GPU model per group"),
        ("1,h100-sxm:1", "1 and h100-sxm:1 are both the campaign's h100-sxm:none GPU 1"),
        ("h200-sxm:0,h200-sxm:none:0", "h200-sxm:0 and h200-sxm:none:0 are both twin GPU h200"),
        ("nope:0-1", "unknown twin profile 'nope'"),
    ],
)
def test_bad_gpu_lists_are_one_line(spec: str, why: str, tmp_path: Path) -> None:
    tp = replace_block(CAMPAIGN, 'model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\ntp_size = 2')
    campaign = write(tmp_path / "c.toml", replace_block(tp, "devices = [0]", "devices = [0, 1]"))
    result = sweep(str(campaign), "--gpus", spec, "--out", str(tmp_path / "o"))
    assert result.exit_code == 2, result.output
    assert why in result.output and len(result.output.strip().splitlines()) == 1
    # `dvfs doctor --gpus` reads the list as the sweep does: the same one line, exit 2.
    checked = CliRunner().invoke(cli, ["doctor", str(campaign), "--gpus", spec])
    assert checked.exit_code == 2, checked.output
    assert checked.output.strip().splitlines()[-1] == result.output.strip(), checked.output


def test_the_campaigns_own_profile_named_is_its_plain_index(tmp_path: Path) -> None:
    """On an h100-sxm twin campaign, `h100-sxm:1` is its GPU 1: grouped with a plain `0` it is
    one model (it was refused as two)."""
    tp = replace_block(CAMPAIGN, 'model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\ntp_size = 2')
    path = write(tmp_path / "c.toml", replace_block(tp, "devices = [0]", "devices = [0, 1]"))
    campaign = load_campaign(path)
    assert worker_groups(campaign, parse_gpus("0,h100-sxm:1")) == [(0, 1)]
    assert worker_groups(campaign, parse_gpus("h200-sxm:0-1")) == [
        ("h200-sxm:none:0", "h200-sxm:none:1")
    ]
    planned = sweep(str(path), "--gpus", "0,h100-sxm:1", "--dry-run", "--out", str(tmp_path / "o"))
    assert planned.exit_code == 0, planned.output


@pytest.mark.parametrize(
    ("devices", "why"),
    [
        ("[[0, 1], [2]]", "groups of different sizes"),
        ("[[0, 1], 2]", "mixes GPUs and groups"),
        ("[[0, 1], [1, 2]]", "lists a GPU twice"),
    ],
)
def test_bad_groups_are_refused(devices: str, why: str, tmp_path: Path) -> None:
    campaign = write(
        tmp_path / "c.toml", replace_block(CAMPAIGN, "devices = [0]", f"devices = {devices}")
    )
    result = sweep(str(campaign), "--dry-run")
    assert result.exit_code == 2 and why in result.output, result.output


def test_the_workers_campaign_is_its_group(tmp_path: Path) -> None:
    campaign = load_campaign(
        write(tmp_path / "c.toml", replace_block(CAMPAIGN, "devices = [0]", "devices = [[0], [1]]"))
    )
    assert campaign.gpu.devices == (0, 1) and campaign.gpu.groups == ((0,), (1,))
    mine = for_group(campaign, (1,))
    assert mine.gpu.devices == (1,) and mine.gpu.groups == ()
    # A campaign without groups hashes as before groups existed.
    plain = load_campaign(write(tmp_path / "p.toml", CAMPAIGN))
    assert "groups" not in json.dumps(plain.semantic_dict())


def test_a_fleet_mixing_gpu_models_gives_a_gpu_dimension(runs: Path, tmp_path: Path) -> None:
    """Two twin H100s and two twin H200s: the campaign runs once per model, each model's
    workers share its cells, and the cube merges the two along `gpu`."""
    out = tmp_path / "mixed"
    result = sweep(str(runs / "campaign.toml"), "--gpus", "0-1,h200-sxm:0-1", "--out", str(out))
    assert result.exit_code == 0, result.output
    # the closing line names where the journals are, not the folder as if it were one
    assert f"journals {out / 'gpu-*' / 'journal.jsonl'}" in " ".join(result.output.split())
    journals = sorted(out.glob("gpu-*/journal.jsonl"))
    assert [j.parent.name for j in journals] == [
        "gpu-nvidia-h100-80gb-hbm3-twin",
        "gpu-nvidia-h200-twin",
    ]
    for journal in journals:
        cells = [r for r in read_records(journal) if r["type"] == "cell"]
        assert len(cells) == 72 and len({r["worker"] for r in cells}) == 2
    merged = open_cube(out / "cube.nc")
    assert merged.sizes["gpu"] == 2
    h100 = merged.isel(gpu=0).drop_vars("gpu")
    one = open_cube(runs / "one" / "cube.nc")
    np.testing.assert_array_equal(h100["tpot_ms"].values, one["tpot_ms"].values)
    # The H200 reads weights faster: lower latency at every setting.
    assert (merged["tpot_ms"].isel(gpu=1) < merged["tpot_ms"].isel(gpu=0)).all()
    # Each model's cube names the twin profile its GPUs ran (the journals hold the campaign's
    # gpu.profile, h100-sxm, for both), so `dvfs twin fit` of the H200's starts from the H200.
    for journal, key in zip(journals, ("h100-sxm:none", "h200-sxm:none"), strict=True):
        assert open_cube(journal.parent / "cube.nc").attrs["twin_profile"] == key
        fit = CliRunner().invoke(
            cli, ["twin", "fit", str(journal.parent), "-o", str(tmp_path / f"{key}.toml")]
        )
        said = " ".join(fit.output.split())
        assert fit.exit_code == 0 and f"(base {key.split(':')[0]}" in said, fit.output
    # The journals alone resume: nothing left to run.
    again = sweep(str(runs / "campaign.toml"), "--gpus", "0-1,h200-sxm:0-1", "--out", str(out))
    assert again.exit_code == 0 and "144 already done" in again.output
    # `cube build --out` onto a model's journal or its cube (which the build writes itself) is
    # refused before anything is written: the H200's measurements stay.
    from test_journal import assert_one_line_error

    for target in (journals[1], journals[1].parent / "cube.nc"):
        before = target.read_bytes()
        refused = CliRunner().invoke(cli, ["cube", "build", str(out), "--out", str(target)])
        assert_one_line_error(refused, 2, "which this command reads", "another output path")
        assert target.read_bytes() == before
    # A folder of one model's run refuses a fleet that mixes models, finished or not: a
    # finished one holds no H200 cell (it was taken for done: "0 cell(s) measured", exit 0,
    # an H100-only cube for a fleet whose campaign runs once per model).
    four = copy_sweep(runs / "four", tmp_path / "four")  # the shared run stays as it was
    half = tmp_path / "half"
    half.mkdir()
    lines = (runs / "four" / "journal.jsonl").read_text().splitlines(keepends=True)
    (half / "journal.jsonl").write_text("".join(lines[:12]))
    # `dvfs doctor --gpus` checks the folder as that fleet uses it: fails each in the sweep's
    # words (it passed the half-done one, checking the campaign's one GPU, and the done one).
    for folder in (four, half):
        doctor = CliRunner().invoke(
            cli,
            ["doctor", str(runs / "campaign.toml"), "--gpus", "0,h200-sxm:0"]
            + ["--out", str(folder), "--json"],
        )
        checks = {c["name"]: c for c in json.loads(doctor.output)}
        assert doctor.exit_code == 1, doctor.output
        assert "2 workers" in checks["gpu"]["detail"]
        before = (folder / "journal.jsonl").read_bytes()
        mixed = sweep(str(runs / "campaign.toml"), "--gpus", "0,h200-sxm:0", "--out", str(folder))
        assert mixed.exit_code == 1, mixed.output
        assert "holds a run on one GPU model" in mixed.output.strip().splitlines()[-1]
        refused = checks["output folder"]
        assert refused["status"] == "fail" and refused["detail"] in mixed.output, refused
        assert (folder / "journal.jsonl").read_bytes() == before
        assert not list(folder.glob("gpu-*"))
    # The done folder on another model alone is refused as other GPUs, as an unfinished one
    # is; on its own model (a GPU of it, after a node loss) nothing is left to run.
    other = sweep(str(runs / "campaign.toml"), "--gpus", "h200-sxm:0-1", "--out", str(four))
    assert other.exit_code == 1, other.output
    assert "measured on other GPUs than this run's" in other.output, other.output
    assert "NVIDIA H100 80GB HBM3 (twin) -> NVIDIA H200 (twin)" in other.output, other.output
    same = sweep(str(runs / "campaign.toml"), "--gpus", "1", "--out", str(four))
    assert same.exit_code == 0 and "0 cell(s) measured" in same.output, same.output


def test_twin_gpus_named_by_profile_keep_the_campaigns_traps(tmp_path: Path) -> None:
    """`gpu.profile = "h200-sxm:none"` swept on `--gpus h200-sxm:0-1`: the fleet's twins are
    trap-free as the campaign asked (not given every NVML trap back), so its cube is the
    one-GPU cube; naming other traps in --gpus is refused in one line."""
    text = replace_block(CAMPAIGN, 'profile = "h100-sxm:none"', 'profile = "h200-sxm:none"')
    campaign = write(tmp_path / "c.toml", text)
    assert sweep(str(campaign), "--out", str(tmp_path / "one")).exit_code == 0
    result = sweep(str(campaign), "--gpus", "h200-sxm:0-1", "--out", str(tmp_path / "two"))
    assert result.exit_code == 0, result.output
    one, two = open_cube(tmp_path / "one" / "cube.nc"), open_cube(tmp_path / "two" / "cube.nc")
    assert two.attrs["twin_profile"] == one.attrs["twin_profile"] == "h200-sxm:none"
    assert two.attrs["campaign_hash"] == one.attrs["campaign_hash"]
    header = read_records(tmp_path / "two" / "journal.jsonl")[0]
    assert header["campaign"]["gpu"]["profile"] == "h200-sxm:none"
    # The energy-counter trap is off: the workers detect a counter far finer than its 100 ms.
    trapped = gpu_profile("h200-sxm").energy_counter_period_s
    assert (np.atleast_1d(two.attrs["counter_update_period_s"]) < trapped / 10).all()
    assert_same_cells(two, one)
    refused = sweep(
        str(campaign), "--gpus", "h200-sxm:energy_steps:0-1", "--out", str(tmp_path / "o")
    )
    assert refused.exit_code == 2, refused.output
    line = refused.output.strip()
    assert len(line.splitlines()) == 1 and "other NVML traps than the campaign's" in line
    assert "write h200-sxm:0 to keep the campaign's traps" in line
    assert not (tmp_path / "o").exists()


def test_a_profile_in_gpus_takes_the_campaigns_trap_list(tmp_path: Path) -> None:
    """PROFILE:INDEX without traps takes the campaign's trap list, and may repeat it; another
    set of traps is refused."""
    exact = load_campaign(write(tmp_path / "e.toml", CAMPAIGN))  # h100-sxm:none
    assert worker_groups(exact, parse_gpus("h200-sxm:0,h200-sxm:none:1,2")) == [
        ("h200-sxm:none:0",),
        ("h200-sxm:none:1",),
        (2,),
    ]
    every = replace_block(CAMPAIGN, 'profile = "h100-sxm:none"', 'profile = "h100-sxm"')
    trapped = load_campaign(write(tmp_path / "t.toml", every))
    assert worker_groups(trapped, parse_gpus("h200-sxm:0")) == [("h200-sxm:0",)]
    some = replace_block(CAMPAIGN, 'profile = "h100-sxm:none"', 'profile = "h100-sxm:-settle"')
    assert worker_groups(
        load_campaign(write(tmp_path / "s.toml", some)), parse_gpus("h200-sxm:0")
    ) == [("h200-sxm:-settle:0",)]
    with pytest.raises(CampaignError, match="other NVML traps"):
        worker_groups(trapped, parse_gpus("h100-sxm:none:0"))
    with pytest.raises(CampaignError, match="other NVML traps"):
        worker_groups(exact, parse_gpus("h100-sxm:leakage:0"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_worker_and_the_rerun_finishes(runs: Path, tmp_path: Path) -> None:
    """SIGINT mid-campaign: the workers stop after their cell and restore their GPUs, the
    driver journals what they finished, exit 130; the same command then finishes the rest."""
    bigger = replace_block(
        CAMPAIGN,
        "sm_clock = [1980, 1410, 1005]",
        "sm_clock = { start = 705, stop = 1980, step = 255 }",  # 288 cells
    )
    campaign = write(tmp_path / "big.toml", bigger)
    out = tmp_path / "out"
    argv = [PYTHON, "-m", "dvfs", "sweep", str(campaign), "--gpus", "0-3", "--out", str(out)]
    journal = out / "journal.jsonl"
    code, output = signalled_at([*argv, "--no-progress"], journal, 30, signal.SIGINT)
    total = 6 * 2 * 2 * 3 * 2
    assert code == 130, output
    assert "GPU settings restored" in output
    done = [r for r in read_records(journal) if r["type"] == "cell"]
    assert 30 <= len(done) < total, "the interruption must land mid-campaign"
    # The same command again, in this process (its workers are processes all the same).
    again = sweep(str(campaign), "--gpus", "0-3", "--out", str(out))
    assert again.exit_code == 0, again.output
    assert f"{len(done)} already done" in again.stderr
    keys = [r["key"] for r in read_records(journal) if r["type"] == "cell"]
    assert len(keys) == len(set(keys)) == total


@pytest.fixture
def dispositions() -> Iterator[None]:
    """SIGINT and SIGTERM ignored, as a shell gives them to a background job (set, not
    inherited: dvfs must handle them itself); put back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, signal.SIG_IGN)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def signal_once_each_worker_ran(monkeypatch: pytest.MonkeyPatch, signum: int, units: int) -> None:
    """Send `signum` to this process once each of the fleet's two workers has run `units`
    units of work (`Worker.run_unit` patched): the interruption lands mid-campaign on both,
    however the threads are scheduled. The worker first there waits for the other."""
    from dvfs.fleet.worker import Worker

    ready = threading.Barrier(2)
    counts: dict[str, int] = {}
    run_unit = Worker.run_unit

    def counting(self: Worker, unit):
        shipment = run_unit(self, unit)
        counts[self.label] = counts.get(self.label, 0) + 1
        if counts[self.label] == units and ready.wait() == 0:
            os.kill(os.getpid(), signum)
        return shipment

    monkeypatch.setattr(Worker, "run_unit", counting)


def ok_cells(journal: Path) -> set[str]:
    records = [r for r in read_records(journal) if r["type"] == "cell"]
    assert all(r["status"] == "ok" for r in records)
    return {r["key"] for r in records}


def assert_cubes_hold_the_journals(out: Path, journals: list[Path]) -> list[xr.Dataset]:
    """Each model's cube beside its journal holds that journal's cells, and the merged cube
    in `out` holds each along `gpu`, in the journals' order. Returns the three cubes."""
    merged = open_cube(out / "cube.nc")
    assert merged.sizes["gpu"] == len(journals)
    cubes = [merged]
    for i, journal in enumerate(journals):
        ds = open_cube(journal.parent / "cube.nc")
        assert int((ds["cell_status"].values == STATUS_OK).sum()) == len(ok_cells(journal))
        part = merged.isel(gpu=i)
        assert str(merged["gpu"].values[i]) == ds.attrs["gpu_uuids"]
        np.testing.assert_array_equal(part["cell_status"].values, ds["cell_status"].values)
        np.testing.assert_array_equal(
            part["energy_per_token_j"].values, ds["energy_per_token_j"].values
        )
        cubes.append(ds)
    return cubes


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.timeout(300)
def test_an_interrupted_fleet_mixing_models_writes_its_partial_cubes(
    runs: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dispositions: None,
    signum: int,
    code: int,
) -> None:
    """Interrupted, a fleet of an H100 and an H200 writes each model's partial cube and the
    merged one, as a finished one does; `dvfs cube build` on its folder writes them again,
    also once they are deleted (checked after SIGINT alone: the build reads only the folder,
    whichever signal left it, and costs six cube writes)."""
    signal_once_each_worker_ran(monkeypatch, signum, units=2)
    out = tmp_path / "mixed"
    result = sweep(str(runs / "campaign.toml"), "--gpus", "0,h200-sxm:0", "--out", str(out))
    assert result.exit_code == code, result.output
    assert f"partial cube written to {out / 'cube.nc'}" in result.stderr
    assert "GPU settings restored" in result.stderr
    journals = sorted(out.glob("gpu-*/journal.jsonl"))
    assert [j.parent.name for j in journals] == [
        "gpu-nvidia-h100-80gb-hbm3-twin",
        "gpu-nvidia-h200-twin",
    ]
    for journal in journals:
        assert 2 <= len(ok_cells(journal)) < 72, "the interruption must land mid-campaign"
    written = assert_cubes_hold_the_journals(out, journals)
    if signum != signal.SIGINT:
        return

    def build() -> list[xr.Dataset]:
        built = CliRunner().invoke(cli, ["cube", "build", str(out)], catch_exceptions=False)
        assert built.exit_code == 0, built.output
        assert built.stdout.startswith(f"cube: {out / 'cube.nc'} (merged from ")
        return assert_cubes_hold_the_journals(out, journals)

    for again, before in zip(build(), written, strict=True):  # over the cubes there
        np.testing.assert_array_equal(again["cell_status"].values, before["cell_status"].values)
    for cube in [out / "cube.nc", *(j.parent / "cube.nc" for j in journals)]:
        cube.unlink()
    for again, before in zip(build(), written, strict=True):
        np.testing.assert_array_equal(again["cell_status"].values, before["cell_status"].values)


def test_cube_build_without_a_journal_names_where_it_looked(tmp_path: Path) -> None:
    from test_journal import assert_one_line_error

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "gpu-x").mkdir()  # a model's folder without a journal is no fleet's
    result = CliRunner().invoke(cli, ["cube", "build", str(empty)])
    line = assert_one_line_error(
        result, 1, str(empty / "journal.jsonl"), str(empty / "gpu-*" / "journal.jsonl")
    )
    assert "run `dvfs sweep` first" not in line


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The fake pynvml with two GPUs (as root), its state in tmp_path."""
    from nvml_support import fake_env, load_fake

    environment = fake_env(tmp_path)
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_STATE_DIR"):
        monkeypatch.setenv(key, environment[key])
    monkeypatch.setenv("DVFS_FAKE_NVML_ROOT", "1")

    def load(devices: str = "h100-sxm,h100-sxm"):
        monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", devices)
        module = load_fake()
        module.fake_reset_state()
        for i in range(2):  # not the default: restoring must put back what was there
            module.fake_update_device(i, power_limit_mw=650_000)
        return module

    return load


def test_real_gpus_each_worker_restores_its_own(fake_nvml, tmp_path: Path) -> None:
    """Two NVML GPUs (the fake), one worker each: each locks and restores its own GPU, and no
    state file is left; the one journal holds both."""
    from nvml_support import NVML_CAMPAIGN

    from dvfs.fleet.driver import run_fleet
    from dvfs.fleet.local import LocalExecutor

    nvml = fake_nvml()
    campaign = load_campaign(
        write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    )
    state = tmp_path / "dvfs-state"
    out = tmp_path / "out"
    outcome = run_fleet(campaign, out, [(0,), (1,)], LocalExecutor(out, state_dir=state, nvml=nvml))
    assert outcome.summary.measured == 8 and {w.label for w in outcome.workers} == {"gpu0", "gpu1"}
    locks = nvml.fake_calls("nvmlDeviceSetGpuLockedClocks")
    assert {c["index"] for c in locks} == {0, 1}  # each worker applied its own GPU's knobs
    for i in range(2):
        device = nvml.fake_device_state(i)
        assert device["locked_clocks"] is None and device["power_limit_mw"] == 650_000
    assert not list(state.glob("GPU-*.json")), "a state file was left behind"
    session = next(r for r in read_records(out / "journal.jsonl") if r["type"] == "session")
    assert len(session["gpus"]) == 2 and session["gpu_backend"] == "nvml"
    assert open_cube(outcome.cube_path)["cell_status"].values.all()


def test_a_fleet_worker_says_what_takes_a_while_before_it_not_after(
    fake_nvml, tmp_path: Path
) -> None:
    """On real GPUs each worker's lines for its counters' probe ("timing the GPUs' energy
    counter updates") and its thermal stabilisation say what is about to take a while; in a
    fleet they went back with the worker's next finished cell, so they came after the probe,
    the idle baseline, the server start, the stabilisation and the cell itself. Each comes
    as it is made: when it is said, none of that worker's cells is journalled yet."""
    from nvml_support import NVML_CAMPAIGN

    from dvfs.fleet.driver import run_fleet
    from dvfs.fleet.local import LocalExecutor

    nvml = fake_nvml()
    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=1)
    campaign = load_campaign(
        write(tmp_path / "nvml.toml", text.replace("thermal_max_s = 0\n", "thermal_max_s = 0.05\n"))
    )
    out = tmp_path / "out"
    said: list[tuple[str, int]] = []  # each worker's note, and its cells journalled by then

    class Said:
        def start(self, total: int, done: int) -> None:
            pass

        def more(self, cells: int) -> None:
            pass

        def advance(self, cell, status: str) -> None:  # type: ignore[no-untyped-def]
            pass

        def note(self, message: str) -> None:
            journal = out / "journal.jsonl"
            records = read_records(journal) if journal.exists() else []
            worker = message.split(":", 1)[0]
            cells = sum(r["type"] == "cell" and r.get("worker") == worker for r in records)
            said.append((message, cells))

    executor = LocalExecutor(out, state_dir=tmp_path / "dvfs-state", nvml=nvml)
    outcome = run_fleet(campaign, out, [(0,), (1,)], executor, progress=Said())
    assert outcome.summary.measured == 4
    probes = [(m, n) for m, n in said if "timing the GPUs' energy counter updates" in m]
    assert sorted(m.split(":")[0] for m, _ in probes) == ["gpu0", "gpu1"], said
    stabilising = [(m, n) for m, n in said if "stabilising the GPU temperature" in m]
    assert stabilising, said
    for message, cells in probes + stabilising:
        assert cells == 0, (message, said)


def test_real_gpus_of_two_models_give_a_gpu_dimension(fake_nvml, tmp_path: Path) -> None:
    from nvml_support import NVML_CAMPAIGN

    from dvfs.fleet.driver import run_fleet
    from dvfs.fleet.local import LocalExecutor

    nvml = fake_nvml("h100-sxm,h200-sxm")
    campaign = load_campaign(
        write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    )
    out = tmp_path / "out"
    executor = LocalExecutor(out, state_dir=tmp_path / "dvfs-state", nvml=nvml)
    outcome = run_fleet(campaign, out, [(0,), (1,)], executor)
    assert outcome.summary.measured == 8  # the campaign once per model
    assert sorted(p.parent.name for p in out.glob("gpu-*/journal.jsonl")) == [
        "gpu-nvidia-h100-80gb-hbm3",
        "gpu-nvidia-h200",
    ]
    merged = open_cube(out / "cube.nc")
    assert merged.sizes["gpu"] == 2
    assert json.loads(merged.attrs["gpu_names"]) == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]


def _fake_gpu1_lost_on_its_second_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The fake NVML's two GPUs, dvfs run as root, and fleet worker gpu1's GPU falling off
    the bus at its second cell (its settings then left unrestored): the environment for
    `dvfs_in_process` and the fake NVML."""
    from nvml_support import fake_env, load_fake

    from dvfs.fleet.worker import Worker

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    calls = {"n": 0}
    run = Worker.run

    def losing(self: Worker, cell):  # type: ignore[no-untyped-def]
        if self.label == "gpu1":
            calls["n"] += 1
            if calls["n"] == 2:
                nvml.fake_update_device(1, lost=True)
                raise RuntimeError("the GPU fell off the bus")
        return run(self, cell)

    monkeypatch.setattr(Worker, "run", losing)
    return env, nvml


def test_a_worker_that_cannot_restore_its_lost_gpu_fails_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet worker whose GPU falls off the bus mid-sweep hands its cells to the other, but
    cannot put its GPU's settings back: every cell is in, yet the sweep ends with exit 1 naming
    the GPU and `dvfs gpu reset` (it ended 0, the GPU left locked), as one GPU's sweep does."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process

    env, _ = _fake_gpu1_lost_on_its_second_cell(tmp_path, monkeypatch)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    out = tmp_path / "out"
    result = dvfs_in_process("sweep", str(campaign), "--gpus", "0-1", "--out", str(out), env=env)
    assert result.returncode == 1, result.stderr
    [state] = (tmp_path / "dvfs-state").glob("GPU-*.json")
    last = result.stderr.strip().splitlines()[-1]
    assert "NOT restored" in last and "dvfs gpu reset" in last, result.stderr
    assert state.stem in last, (state.stem, last)
    assert "Traceback" not in result.stderr
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == 8 and (out / "cube.nc").is_file()


def test_a_fleet_that_lost_two_gpus_names_the_reset_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two of three fleet workers lose their GPUs (off the bus) mid-sweep, the third finishes
    the cells: the last line named `dvfs gpu reset --state-dir DIR` twice, once in each lost
    GPU's restore error ("... `dvfs gpu reset ...` retries from the state file; could not
    restore ..."). It names both GPUs' errors and the reset once, at the end."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    from dvfs.fleet.worker import Worker

    devices = "h100-sxm,h100-sxm,h100-sxm"
    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1", DVFS_FAKE_NVML_DEVICES=devices)
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    calls = {"gpu1": 0, "gpu2": 0}
    run = Worker.run

    def losing(self: Worker, cell):  # type: ignore[no-untyped-def]
        if self.label in calls:
            calls[self.label] += 1
            if calls[self.label] == 2:
                nvml.fake_update_device(int(self.label[3:]), lost=True)
                raise RuntimeError("the GPU fell off the bus")
        return run(self, cell)

    monkeypatch.setattr(Worker, "run", losing)
    out = tmp_path / "out"
    result = dvfs_in_process("sweep", str(campaign), "--gpus", "0-2", "--out", str(out), env=env)
    assert result.returncode == 1, result.stderr
    states = sorted(p.stem for p in (tmp_path / "dvfs-state").glob("GPU-*.json"))
    assert len(states) == 2, states
    last = result.stderr.strip().splitlines()[-1]
    assert "NOT restored" in last and all(uuid in last for uuid in states), last
    assert last.count("GPU 1 (") == last.count("GPU 2 (") == 1, last
    assert last.count("dvfs gpu reset") == 1, last
    assert f"`dvfs gpu reset --state-dir {tmp_path / 'dvfs-state'}`" in last, last
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == 8 and (out / "cube.nc").is_file()


@pytest.mark.parametrize(("nvml_error", "code"), [(4, 4), (999, 1)])
def test_a_fleet_whose_restore_nvml_refuses_says_why_as_one_gpus_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nvml_error: int, code: int
) -> None:
    """Every cell measured, then NVML refused each worker's reset of its GPU's clocks: the
    fleet's last line said "a worker lost its GPU ... once the GPU answers again", exit 1
    even where the reset needed root. It says the restore's own error (as one GPU's sweep
    does), exit 4 where it needs root, else 1; the cube is written all the same."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    for i in range(2):
        nvml.fake_update_device(i, errors={"nvmlDeviceResetGpuLockedClocks": nvml_error})
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    out = tmp_path / "out"
    result = dvfs_in_process("sweep", str(campaign), "--gpus", "0-1", "--out", str(out), env=env)
    assert result.returncode == code, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "NOT restored" in last and "cannot reset locked SM clocks" in last, result.stderr
    assert "dvfs gpu reset" in last and "lost its GPU" not in last, last
    for state in (tmp_path / "dvfs-state").glob("GPU-*.json"):
        assert state.stem in last, (state.stem, last)
    assert "Traceback" not in result.stderr
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == 8 and (out / "cube.nc").is_file()


@pytest.mark.parametrize("gpus", [2, 4])
def test_a_fleet_that_loses_every_gpu_says_so_and_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int
) -> None:
    """A --fresh fleet whose every GPU falls off the bus mid-sweep ended with one worker's
    error ('GPU 1: cannot read the power limit: the GPU has fallen off the bus ...') and no
    word of the cells left or of resuming, where a Ray fleet says both. It says, in one line,
    that every worker was lost, with the cells left and to rerun without --fresh (which
    starts over); followed once the GPUs answer and are reset, it measures only those.
    Each worker is named by what lost it (its GPU off the bus), not by the restore that
    failed after it ('... retries from the state file.;'), three of them and how many more;
    the restores' failure is its own clause: the GPUs left changed and the reset to run
    (with the state folder), run as the line says."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    from dvfs.fleet.worker import Worker

    env = fake_env(
        tmp_path, DVFS_FAKE_NVML_ROOT="1", DVFS_FAKE_NVML_DEVICES=",".join(["h100-sxm"] * gpus)
    )
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=gpus))
    total = 4 * gpus  # four knob settings (two clocks, two power limits), each repeated
    calls: dict[str, int] = {}
    run = Worker.run

    def losing(self: Worker, cell):  # type: ignore[no-untyped-def]
        calls[self.label] = calls.get(self.label, 0) + 1
        if calls[self.label] == 2:  # each worker's GPU falls off the bus on its second cell
            nvml.fake_update_device(int(self.label.removeprefix("gpu")), lost=True)
        return run(self, cell)

    monkeypatch.setattr(Worker, "run", losing)
    out = tmp_path / "out"
    argv = ["sweep", str(campaign), "--gpus", f"0-{gpus - 1}", "--out", str(out), "--no-progress"]
    result = dvfs_in_process(*argv, "--fresh", env=env)
    assert result.returncode == 1, result.stderr
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    assert last.startswith("Error: every worker was lost with "), result.stderr
    kept = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert 0 < len(kept) < total
    assert last.startswith(f"Error: every worker was lost with {total - len(kept)} cell(s) left (")
    named = last.split(" cell(s) left (", 1)[1].split("): the journal keeps", 1)[0]
    workers = [f"gpu{i}: GpuUnavailableError: GPU {i}: " for i in range(gpus)]
    assert all((w in named) is (i < 3) for i, w in enumerate(workers)), named
    assert named.count("fallen off the bus") == min(gpus, 3), named
    assert named.endswith("; and 1 more" if gpus == 4 else "before it can be used"), named
    assert "could not restore" not in named and ".;" not in last, last
    reset = f"`dvfs gpu reset --state-dir {tmp_path / 'dvfs-state'}`"
    assert last.endswith(
        f"the journal keeps every finished cell; the settings of {gpus} GPUs could not be "
        f"restored: once they answer again, run {reset}, then rerun the same "
        "command without --fresh to resume (with it, it starts over)"
    ), last
    assert "Traceback" not in result.stderr
    # followed: the GPUs answer again, are reset as the line says, and the command less
    # --fresh resumes
    monkeypatch.setattr(Worker, "run", run)
    for i in range(gpus):
        nvml.fake_update_device(i, lost=False)
    command = shlex.split(last.split(", run `", 1)[1].split("`", 1)[0])
    assert dvfs_in_process(*command[1:], env=env).returncode == 0
    resumed = dvfs_in_process(*argv, env=env)
    assert resumed.returncode == 0, resumed.stderr
    cells = [r for r in read_records(out / "journal.jsonl") if r["type"] == "cell"]
    assert len(cells) == total and cells[: len(kept)] == kept and (out / "cube.nc").is_file()


def test_a_fleet_whose_worker_was_retired_and_the_other_lost_its_gpu_names_the_reset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GPUs (the fake NVML's two): gpu0 retired (its server refused), gpu1's GPU off the
    bus, its settings left unrestored. The last line was the refusal alone: nothing said the
    GPU was left at a locked clock and power limit, nor to run `dvfs gpu reset` before the
    remedy. It ends in the reset to run first (with the state folder), which puts it back."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process

    env, nvml = _fake_gpu1_lost_on_its_second_cell(tmp_path, monkeypatch)
    why = "the server of drafter 'none' on gpu0 differs (test): rerun with --fresh"
    refuse_servers_on(monkeypatch, "gpu0", why)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    out = tmp_path / "out"
    argv = ["sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    result = dvfs_in_process(*argv, env=env)
    assert result.returncode == 1, result.stderr
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    uuid = nvml.fake_device_state(1)["uuid"]
    assert nvml.fake_device_state(1)["locked_clocks"] is not None  # what the line is about
    reset = f"`dvfs gpu reset --state-dir {tmp_path / 'dvfs-state'}`"
    assert last == (
        f"Error: {why}; and the settings of {uuid} could not be restored: once it answers "
        f"again, run {reset} first"
    ), result.stderr
    assert "Traceback" not in result.stderr
    # followed: the GPU answers again and the reset the line names puts it back
    nvml.fake_update_device(1, lost=False)
    command = shlex.split(last.split(", run `", 1)[1].split("`", 1)[0])
    assert dvfs_in_process(*command[1:], env=env).returncode == 0
    assert nvml.fake_device_state(1)["locked_clocks"] is None


def test_a_refusal_with_a_reset_after_it_keeps_both_within_the_line(tmp_path: Path) -> None:
    """A refusal naming many changes fills an error line (the changes give way to its remedy);
    with the reset of GPUs left changed after it, the line ran past the bound and the reset,
    at its end, was cut. The changes give way to both."""
    import types

    from dvfs.cli.common import MAX_MESSAGE_CHARS, one_line
    from dvfs.fleet.driver import Driver
    from dvfs.fleet.refusal import server_refusal

    campaign = load_campaign(write(tmp_path / "campaign.toml", CAMPAIGN))
    keys = [f"speculative_option_{i:02d}" for i in range(60)]
    before = {"type": "server", "drafter": "none", "args": dict.fromkeys(keys, 1)}
    now = {**before, "args": dict.fromkeys(keys, 2)}
    path = tmp_path / "journal.jsonl"

    def refusal(room: int = MAX_MESSAGE_CHARS) -> str | None:
        return server_refusal(campaign, path, {"none": before}, now, (), "gpu0", room)

    refused = refusal()
    assert refused is not None and len(refused) > MAX_MESSAGE_CHARS - 100, refused
    remedy = refused.rsplit("; ", 1)[1]
    reset = (
        "the settings of GPU-e3afe299-fa76-52c2-a541-55d88e573909 could not be restored: once "
        "it answers again, run `dvfs gpu reset --state-dir /var/tmp/a/long/state/folder`"
    )
    driver = types.SimpleNamespace(refused=refused, _refused_in=refusal)
    line = Driver._refusal_line(driver, reset)  # type: ignore[arg-type]
    assert len(line) <= MAX_MESSAGE_CHARS and one_line(line) == line, line
    assert line.endswith(f"; {remedy}; and {reset} first"), line
    assert "speculative_option_00: 1 -> 2" in line and " more)" in line, line


def _gpu0_refused_gpu1_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], error: Exception
) -> subprocess.CompletedProcess[str]:
    """A two-GPU fleet sweep on the fake NVML whose worker gpu0 raises `error` on every cell
    and whose gpu1 measures a cell, then its server dies on the next (both before any
    restore): what the tests of a refusal ending a fleet beside a left-changed GPU share."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process

    from dvfs.fleet.worker import Worker

    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    calls = {"gpu1": 0}
    run = Worker.run

    def refused_and_lost(self: Worker, cell):  # type: ignore[no-untyped-def]
        if self.label == "gpu0":
            raise error
        calls["gpu1"] += 1
        if calls["gpu1"] == 2:
            raise RuntimeError("the server died")
        return run(self, cell)

    monkeypatch.setattr(Worker, "run", refused_and_lost)
    out = tmp_path / "out"
    argv = ["sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    return dvfs_in_process(*argv, env=env)


@pytest.mark.parametrize("nvml_error", [999, 4])  # NVML Unknown, NoPermission
def test_a_refusal_that_ends_a_fleet_names_the_gpus_the_others_closes_left_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nvml_error: int
) -> None:
    """Real GPUs (the fake NVML's two): worker gpu0 is refused its cells (no root: a refusal
    that ends the run in its own line, exit 4), gpu1 measures a cell, dies on its next, and
    NVML refuses the restore of its GPU as it closes, left at the cell's clock and power
    limit. The sweep said the refusal alone (the restore only in a note above it): nothing
    near the end named the GPU left changed nor `dvfs gpu reset`. It is named beside the
    refusal, with the restore's own error and the reset, as a finished fleet says it; the
    exit code stays the refusal's."""
    from nvml_support import fake_env, load_fake

    from dvfs.errors import GpuPermissionError

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    nvml.fake_update_device(1, errors={"nvmlDeviceResetGpuLockedClocks": nvml_error})
    why = "GPU 0: permission denied (test): run as root, or use `dvfs sweep --observe-only`"
    result = _gpu0_refused_gpu1_lost(tmp_path, monkeypatch, env, GpuPermissionError(why))
    assert result.returncode == 4, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == f"Error: {why}", result.stderr
    uuid = nvml.fake_device_state(1)["uuid"]
    assert nvml.fake_device_state(1)["locked_clocks"] is not None  # what the line is about
    named = lines[-2]
    assert named.startswith(f"GPU settings NOT restored for {uuid}: "), result.stderr
    assert "cannot reset locked SM clocks" in named, named
    assert f"`dvfs gpu reset --state-dir {tmp_path / 'dvfs-state'}`" in named, named
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("refusal", ["a GPU held (3)", "a campaign refused (2)"])
def test_a_refusal_that_ends_a_fleet_exits_4_where_a_restore_left_changed_needs_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """As above, gpu0 refused its cells (a GPU held: exit 3; a campaign refused: exit 2) and
    gpu1's restore refused for want of root (NVML NoPermission), its GPU left changed. The
    sweep exited with the refusal's code: a 4 (needs root), which a finished fleet or one
    GPU's sweep gives a restore that needs root, was hidden, and a wrapper reading the code
    never learnt that GPUs were left for root to put back. Now exit 4; both lines still
    said, the refusal's last."""
    from nvml_support import fake_env, load_fake

    from dvfs.errors import CampaignError, GpuStateError

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    refused = {"nvmlDeviceResetGpuLockedClocks": nvml.NVML_ERROR_NO_PERMISSION}
    nvml.fake_update_device(1, errors=refused)
    error = (
        GpuStateError("GPU 0 is held (test): stop that dvfs, then run the sweep again")
        if refusal.startswith("a GPU held")
        else CampaignError("the campaign is refused (test): fix it, then run the sweep again")
    )
    assert error.exit_code == int(refusal[-2])
    result = _gpu0_refused_gpu1_lost(tmp_path, monkeypatch, env, error)
    assert result.returncode == 4, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == f"Error: {error}", result.stderr
    uuid = nvml.fake_device_state(1)["uuid"]
    assert nvml.fake_device_state(1)["locked_clocks"] is not None  # what the code is about
    assert lines[-2].startswith(f"GPU settings NOT restored for {uuid}: "), result.stderr
    assert "Traceback" not in result.stderr


def test_a_restore_refused_for_root_that_ends_a_fleet_is_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both workers lost (their servers die on their second cell), NVML refusing gpu1's
    restore for want of root, its GPU left changed: that refusal ends the run in its own line,
    exit 4. The output ended in the same restore error twice: a "GPU settings NOT restored"
    line, then the Error line. Now the Error line alone (the worker's note above, as ever)."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    from dvfs.fleet.worker import Worker

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    refused = {"nvmlDeviceResetGpuLockedClocks": nvml.NVML_ERROR_NO_PERMISSION}
    nvml.fake_update_device(1, errors=refused)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    calls = {"gpu0": 0, "gpu1": 0}
    run = Worker.run

    def dying(self: Worker, cell):  # type: ignore[no-untyped-def]
        calls[self.label] += 1
        if calls[self.label] == 2:
            raise RuntimeError("the server died")
        return run(self, cell)

    monkeypatch.setattr(Worker, "run", dying)
    out = tmp_path / "out"
    argv = ["sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    result = dvfs_in_process(*argv, env=env)
    assert result.returncode == 4, result.stderr
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    uuid = nvml.fake_device_state(1)["uuid"]
    assert last.startswith(f"Error: could not restore GPU settings: GPU 1 ({uuid}): "), last
    assert nvml.fake_device_state(1)["locked_clocks"] is not None  # what the line is about
    assert "GPU settings NOT restored" not in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("verbose", [[], ["-vv"]])
def test_a_bug_in_a_workers_restore_is_an_internal_error_with_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verbose: list[str]
) -> None:
    """A fleet whose gpu1 measures every cell (gpu0's server dies at once) and whose restore
    of GPU 1 hits a bug in dvfs (a RuntimeError, no NVML error), the GPU left changed. The
    sweep ended "a worker lost its GPU before it could put them back; run `dvfs gpu reset`
    once the GPU answers again": a GPU that never stopped answering, the bug said nowhere
    but a note, no internal error and no traceback with -vv. Now the bug is the run's
    internal-error line (its restore's own words and the reset), with its traceback under
    -vv, as one GPU's sweep says it; exit 1."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    from dvfs.fleet.worker import Worker
    from dvfs.gpu.nvml import NvmlGpu

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    reset = NvmlGpu.reset_sm_clock
    run = Worker.run

    def buggy_reset_of_gpu_1(self: NvmlGpu) -> None:
        if self.index == 1:
            raise RuntimeError("a bug")
        reset(self)

    def gpu0_dies(self: Worker, cell):  # type: ignore[no-untyped-def]
        if self.label == "gpu0":
            raise RuntimeError("the server died")
        return run(self, cell)

    monkeypatch.setattr(NvmlGpu, "reset_sm_clock", buggy_reset_of_gpu_1)
    monkeypatch.setattr(Worker, "run", gpu0_dies)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    out = tmp_path / "out"
    argv = ["sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    result = dvfs_in_process(*verbose, *argv, env=env)
    assert result.returncode == 1, result.stderr
    assert nvml.fake_device_state(1)["locked_clocks"] is not None  # what the line is about
    uuid = nvml.fake_device_state(1)["uuid"]
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    assert last.startswith(
        f"Error: internal error: RestoreBugError: could not restore GPU settings: GPU 1 ({uuid}): "
        "its restore stopped on a bug in dvfs (RuntimeError: a bug)"
    ), result.stderr
    assert f"`dvfs gpu reset --state-dir {tmp_path / 'dvfs-state'}`" in last, last
    # one sentence's end before the hint, not "... retries from the state file.; please"
    assert "retries from the state file; please report it" in last, last
    assert "lost its GPU" not in result.stderr and "answers again" not in result.stderr
    assert ("in buggy_reset_of_gpu_1" in result.stderr) is bool(verbose), result.stderr


def test_a_refusal_that_ends_a_fleet_says_a_bug_in_another_workers_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu0 refused its cells (a GPU held: exit 3), gpu1 measuring a cell, then losing its
    server, its restore hitting a bug in dvfs (a RuntimeError), its GPU left changed. The line
    naming that GPU said "a worker lost its GPU before it could put them back; run `dvfs gpu
    reset` once the GPU answers again": a GPU that never stopped answering, the bug unsaid.
    Now it says the restore's own words (a bug in dvfs) and the reset; the refusal's line and
    exit code stay."""
    from nvml_support import fake_env, load_fake

    from dvfs.errors import GpuStateError
    from dvfs.gpu.nvml import NvmlGpu

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    reset = NvmlGpu.reset_sm_clock
    error = GpuStateError("GPU 0 is held (test): stop that dvfs, then run the sweep again")

    def buggy_reset_of_gpu_1(self: NvmlGpu) -> None:
        if self.index == 1:
            raise RuntimeError("a bug")
        reset(self)

    monkeypatch.setattr(NvmlGpu, "reset_sm_clock", buggy_reset_of_gpu_1)
    result = _gpu0_refused_gpu1_lost(tmp_path, monkeypatch, env, error)
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == f"Error: {error}", result.stderr
    uuid = nvml.fake_device_state(1)["uuid"]
    assert nvml.fake_device_state(1)["locked_clocks"] is not None  # what the line is about
    named = lines[-2]
    assert named.startswith(f"GPU settings NOT restored for {uuid}: "), result.stderr
    assert "its restore stopped on a bug in dvfs (RuntimeError: a bug)" in named, named
    assert f"`dvfs gpu reset --state-dir {tmp_path / 'dvfs-state'}`" in named, named
    assert "lost its GPU" not in named and "answers again" not in named, named


def test_a_fleet_without_root_keeps_the_permission_refusal_not_every_worker_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet run without root: every worker is refused its first knob change. That is no
    lost fleet to resume by its command again: the refusal's own line, with what to do
    (root, or --observe-only), exit 4, as one GPU's sweep says it."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="0")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    load_fake().fake_reset_state()
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    out = tmp_path / "out"
    argv = ["sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    result = dvfs_in_process(*argv, env=env)
    assert result.returncode == 4, result.stderr
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    assert last.startswith("Error: GPU ") and "permission denied by the driver" in last, last
    assert "--observe-only" in last and "every worker was lost" not in last, last


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_cube_build_refuses_a_models_journal_that_is_no_file_not_leaving_the_model_out(
    tmp_path: Path, kind: str
) -> None:
    """A fleet's folder where one GPU model's journal is a folder or a FIFO: `dvfs cube build`
    wrote the cube of the other model alone, exit 0, a cube looking whole without that
    model's cells; the journal is now refused in one line, naming it."""
    from conftest import TINY_EXACT

    one = tmp_path / "one"
    ran = CliRunner().invoke(
        cli, ["sweep", str(write(tmp_path / "c.toml", TINY_EXACT)), "-o", str(one), "--no-progress"]
    )
    assert ran.exit_code == 0, ran.output
    fleet = tmp_path / "fleet"
    kept = write(fleet / "gpu-a" / "journal.jsonl", (one / "journal.jsonl").read_text())
    damaged = fleet / "gpu-b" / "journal.jsonl"
    damaged.parent.mkdir()
    damaged.mkdir() if kind == "folder" else os.mkfifo(damaged)
    built = CliRunner().invoke(cli, ["cube", "build", str(fleet)])
    assert built.exit_code == 1, built.output
    [line] = built.stderr.splitlines()
    assert line.startswith("Error: ") and str(damaged) in line, line
    assert kept.exists() and not (fleet / "cube.nc").exists()


@pytest.mark.parametrize("kind", ["folder", "dangling link", "link loop"])
def test_cube_build_says_what_to_do_with_a_models_journal_that_is_no_file(
    tmp_path: Path, kind: str
) -> None:
    """A fleet's model's journal kept for its reader to refuse (not left out of the cube): a
    folder said only 'cannot read the journal (...): Is a directory', and a link to no file or
    in a loop 'no journal at ...: run `dvfs sweep` first (every measured cell is in ...)', a
    sweep mending neither. Each now says what it is, and to move it aside."""
    from conftest import TINY_EXACT

    one = tmp_path / "one"
    ran = CliRunner().invoke(
        cli, ["sweep", str(write(tmp_path / "c.toml", TINY_EXACT)), "-o", str(one), "--no-progress"]
    )
    assert ran.exit_code == 0, ran.output
    fleet = tmp_path / "fleet"
    write(fleet / "gpu-a" / "journal.jsonl", (one / "journal.jsonl").read_text())
    damaged = fleet / "gpu-b" / "journal.jsonl"
    damaged.parent.mkdir()
    if kind == "folder":
        damaged.mkdir()
    else:
        damaged.symlink_to("elsewhere.jsonl" if kind == "dangling link" else damaged.name)
    built = CliRunner().invoke(cli, ["cube", "build", str(fleet)])
    assert built.exit_code == 1, built.output
    [line] = built.stderr.splitlines()
    assert "run `dvfs sweep` first" not in line, line
    if kind == "folder":
        assert line.startswith(f"Error: {damaged} is a folder, so no dvfs journal: "), line
        assert "move it aside" in line, line
        return
    what = {
        "dangling link": "a symbolic link to elsewhere.jsonl, which does not exist",
        "link loop": "a symbolic link in a loop (it leads back to itself), not a journal",
    }[kind]
    assert line.startswith(f"Error: {damaged} is {what}: "), line
    assert "point it at the sweep's journal.jsonl, or remove it" in line, line


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")])
def test_a_sweep_whose_cube_goes_to_a_named_pipe_is_refused_before_it_measures(
    tmp_path: Path, gpus: tuple[str, ...]
) -> None:
    """A FIFO as the sweep folder's cube.nc was found only once every cell was measured (hours
    on real GPUs), then waited on 30 s for a reader and refused, exit 2. A pipe there is
    refused before anything is measured, in one line, still exit 2 (a reader is not tried for:
    opening the pipe to try would end a waiting reader's stream); the folder is left as found,
    the pipe in place, and the dry run and `dvfs doctor` say it too."""
    import stat

    from conftest import TINY_EXACT

    out = tmp_path / "out"
    out.mkdir()
    fifo = out / "cube.nc"
    os.mkfifo(fifo)
    campaign = write(tmp_path / "c.toml", FLEET if gpus else TINY_EXACT)
    result = sweep(str(campaign), *gpus, "--out", str(out))
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: {fifo} is a named pipe, where the cube is written"), line
    assert "remove it" in line and f"`dvfs cube build {out} -o PIPE`" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["cube.nc"]  # nothing measured
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    dry = sweep(str(campaign), *gpus, "--out", str(out), "--dry-run", "--no-estimate")
    doctor = CliRunner().invoke(cli, ["doctor", str(campaign), *gpus, "--out", str(out)])
    for said in (dry, doctor):  # (wrapped to the console's width, a long path mid-word too)
        assert f"{fifo}isanamedpipe" in "".join(said.output.split()), said.output


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")])
def test_a_cube_linked_into_a_missing_folder_is_refused_before_the_sweep_measures(
    tmp_path: Path, gpus: tuple[str, ...]
) -> None:
    """cube.nc a link to a file in a folder that does not exist: every cell was measured
    (hours on real GPUs), then the cube's write failed, "No such file or directory". It is
    refused before anything is measured, exit 2, the folder left as found; the dry run and
    `dvfs doctor` say it."""
    from conftest import TINY_EXACT

    out = tmp_path / "out"
    out.mkdir()
    link = out / "cube.nc"
    link.symlink_to(tmp_path / "gone" / "cube.nc")
    campaign = write(tmp_path / "c.toml", FLEET if gpus else TINY_EXACT)
    result = sweep(str(campaign), *gpus, "--out", str(out))
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: {link} is a link to {tmp_path / 'gone' / 'cube.nc'}"), line
    assert "make that folder, or remove the link" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["cube.nc"]  # nothing measured
    dry = sweep(str(campaign), *gpus, "--out", str(out), "--dry-run", "--no-estimate")
    doctor = CliRunner().invoke(cli, ["doctor", str(campaign), *gpus, "--out", str(out)])
    for said in (dry, doctor):  # (wrapped to the console's width, a long path mid-word too)
        assert f"{link}isalinkto" in "".join(said.output.split()), said.output


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")])
def test_fresh_moves_a_named_pipe_cube_aside_with_its_journal_not_refused(
    tmp_path: Path, gpus: tuple[str, ...]
) -> None:
    """--fresh moves the folder's journal aside with its cube, a named pipe there too; yet the
    check refusing a pipe as cube.nc ran before --fresh moved anything, so `sweep --fresh`
    (and its dry run's note) refused the pipe it was about to set aside, told to remove it."""
    import stat

    from conftest import TINY_EXACT

    out = tmp_path / "out"
    campaign = write(tmp_path / "c.toml", FLEET if gpus else TINY_EXACT)
    first = sweep(str(campaign), *gpus, "--out", str(out))
    assert first.exit_code == 0, first.output
    (out / "cube.nc").unlink()
    os.mkfifo(out / "cube.nc")
    dry = sweep(str(campaign), *gpus, "--out", str(out), "--fresh", "--dry-run", "--no-estimate")
    assert dry.exit_code == 0, dry.output
    assert "named pipe" not in dry.output, dry.output
    again = sweep(str(campaign), *gpus, "--out", str(out), "--fresh")
    assert again.exit_code == 0, again.output
    assert stat.S_ISFIFO((out / "cube.nc.1").lstat().st_mode)
    assert (out / "cube.nc").is_file()


@pytest.mark.parametrize("where", ["fleet", "single"])
def test_cube_build_says_a_journal_linked_in_a_loop_is_one_not_that_there_is_none(
    tmp_path: Path, where: str
) -> None:
    """A journal that is a symbolic link in a loop (`ln -s journal.jsonl journal.jsonl`), a
    fleet GPU model's or a single sweep's: `dvfs cube build` said "no journal at X: run `dvfs
    sweep` first (every measured cell is in X...)", contradicting itself, or that the folder was
    no sweep's; it now says the link is in a loop and what to do, naming it."""
    from conftest import TINY_EXACT

    folder = tmp_path / "out"
    if where == "fleet":
        one = tmp_path / "one"
        ran = CliRunner().invoke(
            cli,
            ["sweep", str(write(tmp_path / "c.toml", TINY_EXACT)), "-o", str(one), "--no-progress"],
        )
        assert ran.exit_code == 0, ran.output
        write(folder / "gpu-a" / "journal.jsonl", (one / "journal.jsonl").read_text())
        looped = folder / "gpu-b" / "journal.jsonl"
    else:
        looped = folder / "journal.jsonl"
    looped.parent.mkdir(parents=True)
    looped.symlink_to(looped.name)
    built = CliRunner().invoke(cli, ["cube", "build", str(folder)])
    assert built.exit_code == 1, built.output
    [line] = built.stderr.splitlines()
    assert line.startswith(f"Error: {looped} is a symbolic link in a loop"), line
    assert "no journal" not in line and "every measured cell" not in line, line
    assert "remove it" in line and not (folder / "cube.nc").exists()


@pytest.mark.parametrize("interruption", [KeyboardInterrupt(), "sigterm"])
def test_a_signal_landing_as_the_drivers_queue_takes_its_lock_back_is_the_interruption(
    interruption: BaseException | str,
) -> None:
    """A clean-clone CI run saw a fleet interrupted by SIGINT exit 1 with "internal error:
    RuntimeError: release unlocked lock": the signal's exception landed in the driver's
    `events.get` as the queue took its lock back after waiting, so the lock stayed unheld
    and the queue's own `with` failed releasing it. The driver's read raises the
    interruption instead (exit 130/143 as any interrupted fleet). The landing is made here
    where the race put it: in the queue's condition taking the lock back."""
    import queue

    from dvfs.fleet.local import next_event
    from dvfs.signals import Interrupted

    raised = Interrupted(signal.SIGTERM) if interruption == "sigterm" else interruption
    assert isinstance(raised, BaseException)
    events: queue.Queue[tuple[str, ...]] = queue.Queue()

    def signal_lands(_state: object) -> None:
        raise raised

    events.not_empty._acquire_restore = signal_lands  # type: ignore[attr-defined]
    with pytest.raises(type(raised)) as caught:
        next_event(events)
    assert caught.value is raised
    del events.not_empty._acquire_restore  # the queue as it was: it works on
    events.put(("exit", "gpu0"))
    assert next_event(events) == ("exit", "gpu0")


@pytest.mark.parametrize("case", ["bug", "root", "lost"])
def test_every_worker_lost_says_why_a_restore_left_gpus_changed_not_once_they_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Two workers of two GPUs each (engine.tp_size = 2), both servers dying on their second
    cell; gpu0+1's restore stops on a bug in dvfs for GPU 0 and ("root") NVML refuses GPU 1's
    for want of root, or ("lost") GPU 2 falls off the bus. The every-worker-lost line said
    "could not be restored: once they answer again, run `dvfs gpu reset`": GPUs that never
    stopped answering, and no word that the reset needs root. Now it says why (root, a bug
    said above) and the reset, as root where a restore needed it, once they answer again
    where a GPU was lost."""
    root = case == "root"
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    from dvfs.fleet.worker import Worker
    from dvfs.gpu.nvml import NvmlGpu

    four = ",".join(["h100-sxm"] * 4)
    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1", DVFS_FAKE_NVML_DEVICES=four)
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    reset = NvmlGpu.reset_sm_clock
    run = Worker.run
    calls = {"gpu0+1": 0, "gpu2+3": 0}

    def buggy_reset_of_gpu_0(self: NvmlGpu) -> None:
        if self.index == 0:
            raise RuntimeError("a bug")
        reset(self)

    def dying(self: Worker, cell):  # type: ignore[no-untyped-def]
        calls[self.label] += 1
        if calls[self.label] == 2:
            if case == "lost" and self.label == "gpu2+3":
                nvml.fake_update_device(2, lost=True)
            raise RuntimeError("the server died")
        return run(self, cell)

    monkeypatch.setattr(NvmlGpu, "reset_sm_clock", buggy_reset_of_gpu_0)
    monkeypatch.setattr(Worker, "run", dying)
    if root:
        refused = {"nvmlDeviceResetGpuLockedClocks": nvml.NVML_ERROR_NO_PERMISSION}
        nvml.fake_update_device(1, errors=refused)
    text = NVML_CAMPAIGN.format(output_tokens=16, repeats=2).replace("[0]", "[0, 1]")
    tp = replace_block(text, 'model = "llama-3.1-8b"', 'model = "llama-3.1-8b"\ntp_size = 2')
    campaign = write(tmp_path / "nvml.toml", tp)
    out = tmp_path / "out"
    argv = ["sweep", str(campaign), "--gpus", "0-3", "--out", str(out), "--no-progress"]
    result = dvfs_in_process(*argv, env=env)
    assert result.returncode == 1, result.stderr
    last = " ".join(result.stderr.strip().splitlines()[-1].split())
    assert last.startswith("Error: every worker was lost with "), result.stderr
    assert nvml.fake_device_state(0)["locked_clocks"] is not None  # what the line is about
    assert ("answer" in last) is (case == "lost"), last
    command = f"`dvfs gpu reset --state-dir {tmp_path / 'dvfs-state'}`"
    why = "(for want of root; " if root else "("
    assert f"could not be restored {why}a bug in dvfs stopped the restore, said above" in last
    when = "once they answer again, " if case == "lost" else ""
    assert f"{when}run {command}{' as root' if root else ''}, then rerun the same" in last, last
    assert "Traceback" not in result.stderr


def test_an_interrupted_fleet_says_why_a_restore_was_refused_and_to_reset_as_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C on a local fleet of two fake GPUs after its first cell, and NVML refusing, for
    want of root, to unlock GPU 0's clocks as its worker closes. The interrupted sweep's line
    said "GPU settings NOT fully restored for GPU-...: run `dvfs gpu reset`": neither the
    restore's error nor that the reset needs root, which a Ray fleet's says. It says both."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake
    from test_durability import _signal_after_first_cell_written

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    nvml.fake_update_device(0, errors={"nvmlDeviceResetGpuLockedClocks": 4})
    _signal_after_first_cell_written(monkeypatch)  # Ctrl-C there
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=2))
    out = tmp_path / "out"
    result = dvfs_in_process(
        "sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress", env=env
    )
    assert result.returncode == 130, result.stderr
    said = " ".join(result.stderr.split())
    assert "GPU settings NOT fully restored for GPU-" in said, said
    assert "permission denied" in said.split("NOT fully restored", 1)[1], said
    assert " as root (state in " in said, said
    assert "Run the same command again to resume" in said, said
    assert "Traceback" not in said, said


def test_a_finished_fleet_with_a_restore_bug_and_a_root_refusal_exits_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet that measures every cell (the worker that runs the first cell loses its server
    on its next: the other measures the rest, so both GPUs are set); NVML refuses the first
    one's restore for want of root, and the other's restore hits a bug in dvfs. The bug's
    internal error exited 1, hiding the 4 that tells the operator root must put a GPU back
    (README: 4 is also a sweep whose GPUs a restore that needs root left changed). The
    refused GPU's line says why; the bug is still the last line, exit 4."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    from dvfs.errors import GpuPermissionError
    from dvfs.fleet.worker import Worker
    from dvfs.gpu.nvml import NvmlGpu

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    reset = NvmlGpu.reset_sm_clock
    run = Worker.run
    ran: list[str] = []

    def refused_first_buggy_other(self: NvmlGpu) -> None:
        if ran and self.index == int(ran[0][-1]):
            raise GpuPermissionError(
                f"GPU {self.index}: cannot reset locked SM clocks: permission denied"
            )
        if ran:
            raise RuntimeError("a bug")
        reset(self)

    def first_dies_on_its_second(self: Worker, cell):  # type: ignore[no-untyped-def]
        if ran and self.label == ran[0] and "died" not in ran:
            ran.append("died")
            raise RuntimeError("the server died")
        ran.append(self.label)
        return run(self, cell)

    monkeypatch.setattr(NvmlGpu, "reset_sm_clock", refused_first_buggy_other)
    monkeypatch.setattr(Worker, "run", first_dies_on_its_second)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    out = tmp_path / "out"
    argv = ["sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    result = dvfs_in_process(*argv, env=env)
    assert result.returncode == 4, result.stderr
    lines = [" ".join(x.split()) for x in result.stderr.strip().splitlines()]
    assert lines[-1].startswith("Error: internal error: RestoreBugError: "), result.stderr
    refused = nvml.fake_device_state(int(ran[0][-1]))["uuid"]
    named = next(x for x in lines if x.startswith(f"GPU settings NOT restored for {refused}"))
    assert "permission denied" in named, named
    assert "Traceback" not in result.stderr


def test_a_local_worker_whose_open_and_close_fail_keeps_the_closes_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A local worker's open failed and the close it ran then failed (NVML refusing the
    restore for want of root): the run stops in the open's error, and the close's is kept
    in `close_errors` (the line naming the GPU left changed says it, exit 4), not lost."""
    import types

    from dvfs import backends
    from dvfs.errors import GpuPermissionError
    from dvfs.fleet import local

    opened = RuntimeError("the server would not start")
    refused = GpuPermissionError("could not restore GPU settings: GPU 0 (GPU-a): refused")

    class Worker:
        def __init__(self, campaign: object, group: tuple[int, ...], **kw: object) -> None:
            self.label = f"gpu{group[0]}"
            self.open_close_error: BaseException | None = None

        def notes_live(self, sink: object) -> None:
            pass

        def open(self) -> None:
            self.open_close_error = refused  # its own close, as the open failed
            raise opened

        def close(self) -> None:
            pass

    monkeypatch.setattr(local, "Worker", Worker)
    monkeypatch.setattr(backends, "virtual_time", lambda campaign: False)
    fleet = types.SimpleNamespace(campaign=None, corpora=None)
    executor = local.LocalExecutor(tmp_path)
    with pytest.raises(RuntimeError) as raised:
        executor(fleet, [(0,)])  # type: ignore[arg-type]
    assert raised.value is opened
    assert executor.close_errors == {"gpu0": refused}


def _gpu1_open_fails_its_restore_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> tuple[Any, list[str], list[str]]:
    """A local fleet of GPUs 0-1 whose gpu1 open locks its SM clock, then raises `error`, the
    close its open runs refused (NVML: no root): the sweep's result, its stderr's lines
    (spaces folded) and those naming gpu1's UUID."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    from dvfs.errors import GpuPermissionError
    from dvfs.gpu.knobs import KnobSetting
    from dvfs.gpu.nvml import NvmlGpu
    from dvfs.measure.runner import Runner

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    opened = Runner.open_session

    def failing_open(self: Runner) -> None:
        opened(self)
        if self.gpus[0].identity.index == 1:
            self.knobs.apply(KnobSetting(1500, None))
            raise error

    def refused(self: NvmlGpu) -> None:
        raise GpuPermissionError(
            f"GPU {self.index}: cannot reset locked SM clocks: permission denied"
        )

    monkeypatch.setattr(Runner, "open_session", failing_open)
    monkeypatch.setattr(NvmlGpu, "reset_sm_clock", refused)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    out = tmp_path / "out"
    argv = ["sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    result = dvfs_in_process(*argv, env=env)
    lines = [" ".join(x.split()) for x in result.stderr.strip().splitlines()]
    uuid = nvml.fake_device_state(1)["uuid"]
    return result, lines, [x for x in lines if uuid in x]


def test_a_fleet_whose_open_hits_a_bug_names_the_gpu_its_refused_restore_left_exit_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local fleet: gpu1's open locks its SM clock and then hits a bug in dvfs; the close
    its open runs is refused (NVML: no root), leaving the clock locked. The open's error is
    raised (the close's kept): an internal error, exit 1, and the GPU left changed was named
    nowhere (before, the close's refusal was the line: GPU named, exit 4). The line names
    it with the refusal and the reset, the bug's line is the last, exit 4."""
    result, lines, named = _gpu1_open_fails_its_restore_refused(
        tmp_path, monkeypatch, RuntimeError("a bug in the open")
    )
    assert len(named) == 1 and "permission denied" in named[0], result.stderr
    assert lines[-1].startswith("Error: internal error: RuntimeError: a bug in the open"), lines
    assert result.returncode == 4, result.stderr
    assert "Traceback" not in result.stderr


def test_a_fleet_whose_open_fails_in_an_oserror_with_a_refused_restore_exits_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local fleet: gpu1's open locks its SM clock and then fails in an OSError (a file it
    could not read); the close its open runs is refused (NVML: no root), leaving the clock
    locked. The GPU was named with the refusal, but the run ended in the OSError's line,
    exit 1 (README: 4, GPUs left for root to put back). It exits 4, the OSError's line the
    last."""
    result, lines, named = _gpu1_open_fails_its_restore_refused(
        tmp_path, monkeypatch, OSError(5, "Input/output error", "/tmp/a-file-the-open-read")
    )
    assert len(named) == 1 and "permission denied" in named[0], result.stderr
    assert f"reset --state-dir {tmp_path / 'dvfs-state'}` as root (state in " in named[0], named
    assert lines[-1].startswith("Error: cannot use /tmp/a-file-the-open-read"), lines
    assert result.returncode == 4, result.stderr
    assert "Traceback" not in result.stderr


def test_a_refused_restore_is_said_alike_by_the_local_fleet_and_ray() -> None:
    """NVML refused a worker's restore for want of root. Ray's line named the refusal and
    the reset to run "as root"; the local fleet's named the refusal and the reset ("...
    retries from the state file") but not that it needs root. One wording for both."""
    from dvfs.cli.sweep import _local_unrestored, _ray_unrestored
    from dvfs.errors import GpuPermissionError

    reset = "`dvfs gpu reset --state-dir /s`"
    refusal = GpuPermissionError(
        "could not restore GPU settings: GPU 1 (GPU-x): GPU 1: cannot reset locked SM clocks: "
        f"permission denied. {reset} retries from the state file."
    )
    why = "could not restore GPU settings: GPU 1 (GPU-x): GPU 1: cannot reset locked SM clocks: "
    why += "permission denied"
    local = _local_unrestored(["GPU-x"], Path("/s"), [refusal])
    assert local == (
        f"[red]GPU settings NOT restored[/red] for GPU-x: {why}; run {reset} as root (state in /s)."
    ), local
    ray = _ray_unrestored({"n1": ["GPU-x"]}, [refusal], {"n1": reset})
    assert ray == (
        f"[red]GPU settings NOT restored[/red] for GPU-x on n1: {why}; run {reset} on n1 as root."
    ), ray


def _one_refused_one_opening(
    monkeypatch: pytest.MonkeyPatch, fail_at: float, poll: Callable[[int], None]
) -> tuple[Any, Any, threading.Event, list[str]]:
    """A local fleet of two fake workers in virtual time: gpu0's open is refused (a GPU held)
    at `fail_at` s, while gpu1's stays inside `open` until released (its event), or until the
    driver has polled its event queue 40 times (then it notes "released by the polls"); each
    poll once the refusal is in advances the virtual clock 600 s and calls `poll` with its
    count. Returns the executor, the fleet (its notes in `fleet.said`), gpu1's release and
    the log."""
    from dvfs import backends
    from dvfs.errors import GpuStateError
    from dvfs.fleet import local

    now = [0.0]
    polls = [0]
    release = threading.Event()
    log: list[str] = []

    class Worker:
        def __init__(self, campaign: object, group: tuple[int, ...], **kw: object) -> None:
            self.label = f"gpu{group[0]}"
            self.open_close_error: BaseException | None = None

        def notes_live(self, sink: object) -> None:
            pass

        def open(self) -> None:
            if self.label == "gpu0":
                now[0] = fail_at
                raise GpuStateError("GPU 0 is held (test)")
            while not release.wait(0.05):
                if polls[0] >= 40:
                    log.append("released by the polls")
                    break
            log.append("gpu1 opened")

        def close(self) -> None:
            log.append(f"{self.label} closed")

    real_next = local.next_event

    def next_event(events: Any) -> Any:
        polls[0] += 1
        if "refused" in log:  # the driver now waits for gpu1
            now[0] += 600.0
            poll(polls[0])
        event = real_next(events)
        if event is not None and event[0] == "error":
            log.append("refused")
        return event

    monkeypatch.setattr(local, "Worker", Worker)
    monkeypatch.setattr(local, "next_event", next_event)
    monkeypatch.setattr(backends, "virtual_time", lambda campaign: False)
    said: list[str] = []
    fleet = types.SimpleNamespace(campaign=None, corpora=None, note=said.append, said=said)
    executor = local.LocalExecutor(Path("out"))
    executor.clock = lambda: now[0]
    return executor, fleet, release, log


@pytest.mark.parametrize(("fail_at", "bound"), [(0.0, 1800.0), (1900.0, 60.0)])
def test_workers_still_opening_as_a_local_fleet_fails_get_ray_s_said_bounded_wait(
    monkeypatch: pytest.MonkeyPatch, fail_at: float, bound: float
) -> None:
    """A local fleet: gpu0's open is refused while gpu1 is still inside `open`. The driver
    waited for gpu1 to finish opening with no bound and no word (Ray's driver waits within
    the opens' half hour, a minute past it at least, said in one note). It says the wait in
    Ray's note and bounds it alike (virtual time): past the bound, the run fails in the
    refusal's line with gpu1 still opening."""
    from dvfs.errors import GpuStateError

    executor, fleet, release, log = _one_refused_one_opening(monkeypatch, fail_at, lambda n: None)
    try:
        with pytest.raises(GpuStateError, match="GPU 0 is held"):
            executor(fleet, [(0,), (1,)])  # type: ignore[arg-type]
        assert "released by the polls" not in log and "gpu1 opened" not in log, log
        from dvfs.fleet.local import opening_wait_note

        assert fleet.said == [opening_wait_note("workers", bound, 1)], fleet.said
        assert f"waiting up to {bound:g} s for the 1 still opening" in fleet.said[0]
        assert executor.left_opening == ["gpu1"], executor.left_opening
    finally:
        release.set()


def test_ctrl_c_while_a_local_fleet_waits_for_workers_still_opening_ends_in_the_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As Ray's: Ctrl-C while the driver waits for gpu1 still opening (gpu0's open refused)
    stops the wait, and the run ends in the signal (130, the GPUs left changed named by the
    sweep's interruption line), not in the refusal's line and code."""

    def ctrl_c(n: int) -> None:
        raise KeyboardInterrupt  # once the refusal is in: the driver is waiting for gpu1

    executor, fleet, release, log = _one_refused_one_opening(monkeypatch, 0.0, ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            executor(fleet, [(0,), (1,)])  # type: ignore[arg-type]
        assert "gpu1 opened" not in log and "released by the polls" not in log, log
    finally:
        release.set()


def test_ctrl_c_while_a_local_fleet_waits_for_a_worker_opening_names_its_gpu_exit_130(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep of the wait above (fake NVML): gpu0's open is refused (a GPU held) while
    gpu1's open has locked its SM clock and is still inside `open`; Ctrl-C as the driver
    waits for it ends the run in 130, the interruption's line naming gpu1's GPU left changed
    with the reset to run, not in the refusal's line and exit 3."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    from dvfs.errors import GpuStateError
    from dvfs.fleet import local
    from dvfs.gpu.knobs import KnobSetting

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    nvml = load_fake()
    nvml.fake_reset_state()
    opened = Runner.open_session
    locked = threading.Event()
    release = threading.Event()

    def open_session(self: Runner) -> None:
        if self.gpus[0].identity.index == 0:
            locked.wait()  # refused once gpu1 has changed its GPU
            raise GpuStateError("GPU 0 is held by another dvfs (test)")
        opened(self)
        self.knobs.apply(KnobSetting(1500, None))
        locked.set()
        release.wait()

    real_next = local.next_event

    def next_event(events: Any) -> Any:
        if "refused" in said:
            raise KeyboardInterrupt  # Ctrl-C as the driver waits for gpu1
        event = real_next(events)
        if event is not None and event[0] == "error":
            said.append("refused")
        return event

    said: list[str] = []
    monkeypatch.setattr(Runner, "open_session", open_session)
    monkeypatch.setattr(local, "next_event", next_event)
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    out = tmp_path / "out"
    argv = ["sweep", str(campaign), "--gpus", "0-1", "--out", str(out), "--no-progress"]
    try:
        result = dvfs_in_process(*argv, env=env)
    finally:
        release.set()
    lines = [" ".join(x.split()) for x in result.stderr.strip().splitlines()]
    uuid = nvml.fake_device_state(1)["uuid"]
    named = [x for x in lines if uuid in x]
    assert len(named) == 1 and "NOT fully restored" in named[0], result.stderr
    assert "dvfs gpu reset" in named[0], named
    assert "held by another dvfs" not in result.stderr, result.stderr
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr


def test_gpus_of_a_local_worker_left_opening_are_named_for_a_reset_now() -> None:
    """The run failed, and the wait for a worker still opening was given up: its GPUs, kept
    in their state files, were named as "a worker lost its GPU ...: run the reset once the
    GPU answers again", which waits for nothing (it answers; its open may have set its
    clocks). As Ray's line for an actor killed as it opened: the reset is for now."""
    from dvfs.cli.sweep import _local_unrestored
    from dvfs.fleet.ray_executor import KILLED_OPENING_RESET
    from dvfs.gpu.safety import reset_command

    line = _local_unrestored(["GPU-x"], Path("/s"), [], opening=True)
    assert f"run {reset_command(Path('/s'))} now ({KILLED_OPENING_RESET})" in line, line
    assert "answers again" not in line and "lost its GPU" not in line, line
