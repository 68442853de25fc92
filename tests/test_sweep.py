"""The sweep pipeline end to end on the twin, through the CLI: campaign -> journal -> cube."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from conftest import (
    PYTHON,
    SMALL_CAMPAIGN,
    TINY,
    TINY_EXACT,
    default_dispositions,
    replace_block,
    subprocess_env,
    write,
)

from dvfs.cli import cli
from dvfs.cube import CELL_DIMS, STATUS_FAILED, STATUS_MISSING, STATUS_OK, build_cube, open_cube
from dvfs.measure.journal import read_records


def sweep(args: list[str]) -> Result:
    result = CliRunner().invoke(cli, ["sweep", *args, "--no-progress"], catch_exceptions=False)
    return result


def assert_cubes_equal(a, b, *, energy_rtol: float = 0.0, ignore: tuple[str, ...] = ()) -> None:
    """Same coords and values; energy may differ by the counter's 1 mJ quantisation (an
    interval's relative half-width, from the difference of close energies, by fifty times that,
    absolute); variables starting with an `ignore` prefix are not compared."""
    assert set(a.data_vars) == set(b.data_vars)
    for dim in a.dims:
        np.testing.assert_array_equal(a[dim].values, b[dim].values)
    for name in a.data_vars:
        if ignore and str(name).startswith(ignore):
            continue
        if a[name].dtype.kind in "OUS":  # labels such as the attention backend
            np.testing.assert_array_equal(a[name].values, b[name].values, err_msg=name)
            continue
        # the highest power may be a round's mean from the energy counter (summarise)
        counted = "energy" in name or "power_mean" in name or "power_max" in name
        rtol = energy_rtol if counted else 1e-12
        if str(name).endswith("_rel_ci") and energy_rtol:
            # two rounds' t (12.7) times their difference: absolute, as the width may be ~0
            np.testing.assert_allclose(
                a[name].values, b[name].values, atol=50 * energy_rtol, equal_nan=True
            )
            continue
        np.testing.assert_allclose(
            a[name].values, b[name].values, rtol=rtol, equal_nan=True, err_msg=name
        )


def copy_of(sweep_out: Path, tmp_path: Path) -> Path:
    """A private copy of the session's finished sweep, for a test that adds to it."""
    return Path(shutil.copytree(sweep_out, tmp_path / "out"))


def test_sweep_writes_a_complete_cube(small_sweep: Path) -> None:
    # small_sweep is `dvfs sweep SMALL_CAMPAIGN` (exit 0), run once per session.
    ds = open_cube(small_sweep / "cube.nc")
    assert {d: ds.sizes[d] for d in CELL_DIMS} == {
        "sm_clock": 3,
        "power_limit": 2,
        "batch": 2,
        "drafter": 2,
        "corpus": 2,
        "repeat": 2,
    }
    assert (ds["cell_status"].values == STATUS_OK).all()
    # Every variable and coordinate says its unit and what it is.
    for name in [*ds.data_vars, *ds.coords]:
        attrs = ds[name].attrs
        assert attrs.get("units") is not None and attrs.get("long_name"), name
    assert int(ds.attrs["dvfs_schema"]) == 1
    assert ds.attrs["gpu_backend"] == "twin" and "H100" in ds.attrs["gpu_name"]
    assert json.loads(ds.attrs["campaign"])["workload"]["output_tokens"] == 64
    epj = ds["energy_per_token_j"]
    assert (epj > 0).all()
    # Batching amortises the weight reads: energy per token falls with batch.
    assert (epj.sel(batch=8) < epj.sel(batch=1)).all()
    # No speculation has no acceptance (NaN, not 1 or 0); EAGLE-3 accepts > 1 token per verify.
    assert np.isnan(ds["accept_length"].sel(drafter="none")).all()
    assert (ds["accept_length"].sel(drafter="eagle3") > 1.5).all()
    # Locked clocks are read back in the cube.
    observed = ds["sm_clock_observed_mhz"].sel(power_limit=700.0, batch=1, drafter="none")
    np.testing.assert_allclose(observed.mean(["corpus", "repeat"]).values, [1005, 1500, 1980])
    # Latency quantiles are ordered.
    tpot = ds["tpot_ms"]
    assert (tpot.sel(quantile=0.5) <= tpot.sel(quantile=0.99)).all()


def test_resume_skips_finished_cells_and_cube_build_matches(
    small_campaign: Path, small_sweep: Path, tmp_path: Path
) -> None:
    out = copy_of(small_sweep, tmp_path)
    first = open_cube(out / "cube.nc")
    cells_before = sum(1 for r in read_records(out / "journal.jsonl") if r["type"] == "cell")
    again = sweep([str(small_campaign), "--out", str(out)])
    assert again.exit_code == 0
    assert "0 cell(s) measured" in again.output
    cells_after = sum(1 for r in read_records(out / "journal.jsonl") if r["type"] == "cell")
    assert cells_after == cells_before == 96
    rebuilt = CliRunner().invoke(cli, ["cube", "build", str(out), "--out", str(tmp_path / "re.nc")])
    assert rebuilt.exit_code == 0, rebuilt.output
    assert_cubes_equal(first, open_cube(tmp_path / "re.nc"))


def test_a_changed_campaign_refuses_the_old_journal(small_sweep: Path, tmp_path: Path) -> None:
    out = copy_of(small_sweep, tmp_path)
    changed = write(
        tmp_path / "changed.toml",
        replace_block(SMALL_CAMPAIGN, "output_tokens = 64", "output_tokens = 32"),
    )
    result = CliRunner().invoke(cli, ["sweep", str(changed), "--out", str(out), "--no-progress"])
    assert result.exit_code == 1
    assert "belongs to campaign" in result.output and "--fresh" in result.output
    fresh = CliRunner().invoke(
        cli, ["sweep", str(changed), "--out", str(out), "--no-progress", "--fresh"]
    )
    assert fresh.exit_code == 0, fresh.output
    assert (out / "journal.jsonl.1").exists()


def test_missing_and_failed_cells_are_nan(small_sweep: Path, tmp_path: Path) -> None:
    records = read_records(small_sweep / "journal.jsonl")
    header_and_sessions = [r for r in records if r["type"] != "cell"]
    cells = [r for r in records if r["type"] == "cell"]
    kept, failed = cells[:10], dict(cells[10], status="failed", error="boom")
    failed.pop("measurement")
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(json.dumps(r) + "\n" for r in [*header_and_sessions, *kept, failed]))
    ds = build_cube(partial)
    status = ds["cell_status"].values
    assert (status == STATUS_OK).sum() == 10
    assert (status == STATUS_FAILED).sum() == 1
    assert (status == STATUS_MISSING).sum() == status.size - 11
    measured = status == STATUS_OK
    for name in ("energy_per_token_j", "output_tokens", "valid", "quality", "decode_time_s"):
        values = ds[name].values
        assert np.isnan(values[~measured]).all(), name
        assert not np.isnan(values[measured]).any(), name
    assert np.isnan(ds["ttft_ms"].values[~measured]).all()
    # Round trip through netCDF keeps NaN for missing integer-valued cells.
    from dvfs.cube import write_cube

    reread = open_cube(write_cube(ds, tmp_path / "partial.nc"))
    assert np.isnan(reread["output_tokens"].values[~measured]).all()
    np.testing.assert_array_equal(
        reread["output_tokens"].values[measured], ds["output_tokens"].values[measured]
    )
    assert "boom" in reread.attrs["failed_cells"]


def test_dry_run_prints_the_plan_and_touches_nothing(small_campaign: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["sweep", str(small_campaign), "--out", str(out), "--dry-run", "--json"]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["cells"] == 3 * 2 * 2 * 2 * 2 * 2
    assert plan["server_starts"] == 2
    # 6 settings per (drafter, repeat); the serpentine order reuses the setting at each turn:
    # drafter 1: 6 + 5, drafter 2 starts where drafter 1 ended: 5 + 5.
    assert plan["knob_changes"] == 21
    assert plan["estimated_hours_on_hardware"] > 0
    assert plan["servers"][1]["expected_accept_length"]["code"] > 1
    assert not out.exists()


def test_observe_only_keeps_stock_settings(small_campaign: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = sweep([str(small_campaign), "--out", str(out), "--observe-only"])
    assert result.exit_code == 0, result.output
    ds = open_cube(out / "cube.nc")
    assert ds["sm_clock"].values.tolist() == [1980]
    assert ds["power_limit"].values.tolist() == [700.0]
    assert ds.attrs["actuation"] == 0
    # the campaign's clock and power-limit lists are not stepped: said, not shrunk silently
    said = " ".join(result.stderr.split())
    assert (
        "note: --observe-only does not step the campaign's 3 SM clocks (1005-1980 MHz) and 2 "
        "power limits (300-700 W): every cell is measured at the GPU's stock setting" in said
    ), said


def _count_cells(journal: Path) -> int:
    if not journal.exists():
        return 0
    return journal.read_text().count('"type":"cell"')


#: 288 cells (six clocks, three repeats): enough that a kill after 40 lands mid-sweep.
BIG = replace_block(
    replace_block(
        replace_block(
            SMALL_CAMPAIGN,
            "sm_clock = [1980, 1500, 1005]",
            "sm_clock = { start = 1005, stop = 1980, step = 195 }",
        ),
        "repeats = 2",
        "repeats = 3",
    ),
    # The exact twin: a resumed run starts on a cool GPU whose energy counter steps at other
    # instants, so only NVML's traps off make it equal an uninterrupted run cell for cell.
    'profile = "h100-sxm"',
    'profile = "h100-sxm:none"',
)


def _start(campaign: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [PYTHON, "-m", "dvfs", "sweep", str(campaign), "--out", str(out), "--no-progress"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=default_dispositions,
    )


def _wait_for_cells(
    proc: subprocess.Popen, journal: Path, count: int, timeout_s: float = 60
) -> None:
    deadline = time.monotonic() + timeout_s
    while _count_cells(journal) < count:
        assert proc.poll() is None, f"sweep ended early: {proc.communicate()[0]}"
        assert time.monotonic() < deadline, "sweep did not progress"
        time.sleep(0.02)


@pytest.mark.slow
def test_sigkill_then_rerun_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    """Also: the lock names the running sweep (a second sweep into its folder is refused) and
    dies with it (the rerun after the kill starts at once)."""
    from test_journal import assert_one_line_error

    campaign = write(tmp_path / "big.toml", BIG)
    killed = tmp_path / "killed"
    proc = _start(campaign, killed)
    try:
        _wait_for_cells(proc, killed / "journal.jsonl", 40)
        # Stopped, it still holds the lock and cannot finish while the second sweep starts
        # (in this process: the lock is the other process's whichever process asks).
        os.kill(proc.pid, signal.SIGSTOP)
        second = sweep([str(campaign), "--out", str(killed)])
        assert_one_line_error(second, 3, "in use by another dvfs sweep", f"pid {proc.pid}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    interrupted_at = _count_cells(killed / "journal.jsonl")
    total = 6 * 2 * 2 * 2 * 2 * 3
    assert 40 <= interrupted_at < total, "the kill must land mid-sweep"
    # The rerun and the reference run need no signal: in this process (no interpreter start).
    resumed = sweep([str(campaign), "--out", str(killed)])
    assert resumed.exit_code == 0, resumed.output
    assert f"{total - interrupted_at} cell(s) measured" in resumed.stderr
    clean = sweep([str(campaign), "--out", str(tmp_path / "clean")])
    assert clean.exit_code == 0, clean.output
    # the first cell after the resume pays its own overheads (a server start, its settle)
    assert_cubes_equal(
        open_cube(killed / "cube.nc"),
        open_cube(tmp_path / "clean" / "cube.nc"),
        energy_rtol=1e-4,
        ignore=("gpu_time_",),
    )


@pytest.mark.slow
def test_sigint_stops_cleanly_with_a_partial_cube(tmp_path: Path) -> None:
    campaign = write(tmp_path / "big.toml", BIG)
    out = tmp_path / "out"
    proc = _start(campaign, out)
    try:
        _wait_for_cells(proc, out / "journal.jsonl", 20)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "GPU settings restored" in output and "resume" in output
    ds = open_cube(out / "cube.nc")
    done = int((ds["cell_status"].values == STATUS_OK).sum())
    assert done == _count_cells(out / "journal.jsonl") >= 20
    assert np.isnan(
        ds["energy_per_token_j"].values[ds["cell_status"].values == STATUS_MISSING]
    ).all()


def test_merge_cubes_from_two_gpus(tiny_exact_run, tmp_path: Path) -> None:
    # TINY_EXACT: the merge reads a grid of any size, and a small one sweeps and writes fast;
    # exact, so its cells are valid for the headroom below.
    h200 = write(
        tmp_path / "h200.toml",
        replace_block(TINY_EXACT, 'profile = "h100-sxm:none"', 'profile = "h200-sxm:none"'),
    )
    copy_of(tiny_exact_run("one"), tmp_path).rename(tmp_path / "a")  # the H100 sweep
    assert sweep([str(h200), "--out", str(tmp_path / "b")]).exit_code == 0
    merged_path = tmp_path / "merged.nc"
    result = CliRunner().invoke(
        cli, ["cube", "merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(merged_path)]
    )
    assert result.exit_code == 0, result.output
    merged = open_cube(merged_path)
    assert merged.sizes["gpu"] == 2
    a, b = open_cube(tmp_path / "a" / "cube.nc"), open_cube(tmp_path / "b" / "cube.nc")
    np.testing.assert_array_equal(merged["tpot_ms"].isel(gpu=0).values, a["tpot_ms"].values)
    np.testing.assert_array_equal(merged["tpot_ms"].isel(gpu=1).values, b["tpot_ms"].values)
    # H200 reads the weights faster: lower latency at the same settings.
    assert (merged["tpot_ms"].isel(gpu=1) < merged["tpot_ms"].isel(gpu=0)).all()
    # Each GPU kept its own arms together, so the merged cube says so (it used to drop both).
    assert a.attrs["arms_on_one_gpu"] == b.attrs["arms_on_one_gpu"] == 1
    assert merged.attrs["arms_on_one_gpu"] == 1 and merged.attrs["groups_across_gpus"] == 0
    doc = json.loads(CliRunner().invoke(cli, ["headroom", str(merged_path), "--json"]).output)
    assert {r["gpu"] for r in doc["rows"]} == set(merged["gpu"].values)
    # Refusals: the same GPU twice; a different model.
    twice = CliRunner().invoke(
        cli,
        [
            "cube",
            "merge",
            str(tmp_path / "a"),
            str(tmp_path / "a"),
            "--out",
            str(tmp_path / "x.nc"),
        ],
    )
    assert twice.exit_code == 2 and "same GPU" in twice.output
    # Another model is refused before the grids are compared: a small grid (TINY) will do.
    other = write(
        tmp_path / "other.toml",
        replace_block(
            replace_block(TINY, 'model = "llama-3.1-8b"', 'model = "llama-3.2-1b"'),
            'profile = "h100-sxm"',
            'profile = "h200-sxm"',
        ),
    )
    assert sweep([str(other), "--out", str(tmp_path / "c")]).exit_code == 0
    mixed = CliRunner().invoke(
        cli,
        [
            "cube",
            "merge",
            str(tmp_path / "a"),
            str(tmp_path / "c"),
            "--out",
            str(tmp_path / "y.nc"),
        ],
    )
    assert mixed.exit_code == 2 and "model differs" in mixed.output


def test_the_twin_holds_the_power_limit_in_the_measured_window(small_sweep: Path) -> None:
    ds = open_cube(small_sweep / "cube.nc")
    for limit in ds["power_limit"].values:
        power = ds["power_mean_w"].sel(power_limit=limit)
        assert float(power.max()) <= limit * 1.01, f"window power above the {limit} W limit"


def test_a_campaign_name_cannot_write_outside_out(tmp_path: Path, monkeypatch) -> None:
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    campaign = write(
        work / "evil.toml", replace_block(SMALL_CAMPAIGN, 'name = "small"', 'name = "../../../x"')
    )
    for command in (["sweep", str(campaign), "--no-progress"], ["doctor", str(campaign)]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        assert result.stderr.count("\n") == 1 and "campaign.name" in result.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "evil.toml"]


def test_a_sweep_without_root_points_to_observe_only(tmp_path: Path) -> None:
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env

    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=16, repeats=1))
    refused = dvfs_in_process(
        *("sweep", str(campaign), "--out", str(tmp_path / "o"), "--no-progress"),
        env=fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="0"),
    )
    assert refused.returncode == 4, refused.stderr
    assert "Traceback" not in refused.stderr
    error = [line for line in refused.stderr.splitlines() if line.startswith("Error")]
    assert len(error) == 1 and "root" in error[0] and "--observe-only" in error[0]


def test_a_campaign_its_corpora_fall_short_of_leaves_no_journal(tmp_path: Path) -> None:
    """A corpus refusal (exit 2) comes before the journal is made: the corrected campaign (its
    hash changed) then runs into the same folder without --fresh."""
    tiny = replace_block(
        replace_block(TINY, "sm_clock = [1980, 1005]", "sm_clock = [1980]"),
        "batch = [1, 8]",
        "batch = [1]",
    )
    campaign = write(tmp_path / "c.toml", replace_block(tiny, "batch = [1]", "batch = [5000]"))
    out = tmp_path / "out"
    refused = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    assert refused.exit_code == 2, refused.output
    assert "corpus 'code'" in refused.output
    assert not (out / "journal.jsonl").exists()
    write(campaign, tiny)
    again = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    assert again.exit_code == 0, again.output


def test_a_dry_run_on_stock_knobs_counts_no_knob_change(
    small_campaign: Path, tmp_path: Path
) -> None:
    """--observe-only never changes the GPU: the plan must not count its first setting, and it
    says the campaign's clock and power-limit lists are not stepped (on stderr, beside the JSON)."""
    result = CliRunner().invoke(
        cli,
        [
            "sweep",
            str(small_campaign),
            "--out",
            str(tmp_path / "out"),
            "--dry-run",
            "--no-estimate",
            "--json",
            "--observe-only",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)  # the note goes to stderr: the JSON stays whole
    assert plan["knob_changes"] == 0
    assert plan["grid"]["sm_clock_mhz"] == plan["grid"]["power_limit_w"] == "stock"
    assert "--observe-only does not step the campaign's 3 SM clocks" in result.stderr
    # a campaign whose knobs are stock already has nothing to say
    text = small_campaign.read_text()
    text = replace_block(text, "sm_clock = [1980, 1500, 1005]", 'sm_clock = "stock"')
    text = replace_block(text, "power_limit = [700, 300]", 'power_limit = "stock"')
    stock = write(tmp_path / "stock.toml", text)
    args = ["sweep", str(stock), "--out", str(tmp_path / "out"), "--dry-run", "--no-estimate"]
    result = CliRunner().invoke(cli, [*args, "--observe-only"])
    assert result.exit_code == 0, result.output
    assert "does not step" not in result.output


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")])
def test_progress_off_a_terminal_leaves_no_cut_bar_in_the_log(
    gpus: tuple[str, ...], tmp_path: Path
) -> None:
    """A sweep logging to a file or a pipe (nohup, Slurm, `2>log`) drew its bar once, at the
    end, cut to 80 columns ("1080/…", "ETA 0:00:…"): the log gets the notes and summary only."""
    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)
    args = ["sweep", str(campaign), *gpus, "--out", str(tmp_path / "out")]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "cell(s) measured" in result.stderr and "starting twin server" in result.stderr
    assert "━" not in result.stderr and "…" not in result.stderr, result.stderr


def test_an_interruption_before_the_first_cell_says_nothing_was_measured(
    tmp_path: Path, monkeypatch
) -> None:
    """Stopped after the journal's header, before its first session (opening the GPUs, the
    engine): no partial cube, and nothing for `dvfs cube build` to fix, as it once said."""
    import dvfs.sweep

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(dvfs.sweep, "check_same_server_env", interrupted)
    out = tmp_path / "out"
    result = sweep([str(write(tmp_path / "tiny.toml", TINY)), "--out", str(out)])
    assert result.exit_code == 130, result.output
    assert (out / "journal.jsonl").is_file() and not (out / "cube.nc").exists()
    assert "(no partial cube: no cell measured yet)" in result.stderr, result.stderr
    assert "cube build" not in result.stderr and "fixed" not in result.stderr
    assert result.stderr.rstrip().endswith("Interrupted.")


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")], ids=["one-gpu", "fleet"])
def test_an_interrupted_fresh_sweep_says_to_resume_without_fresh(
    gpus: tuple[str, ...], tmp_path: Path, monkeypatch
) -> None:
    """A `--fresh` sweep stopped after its first cell said "Run the same command again to
    resume" (and `--help` "run the same command again"): that command, --fresh and all, moves
    the journal it began aside and starts over. Both say to rerun without --fresh, which
    resumes it (its cells counted done)."""
    from typing import Any

    from dvfs.measure.journal import Journal

    campaign = str(write(tmp_path / "tiny.toml", TINY))
    out = tmp_path / "out"
    assert sweep([campaign, *gpus, "--out", str(out)]).exit_code == 0
    note = Journal._note
    seen = {"cells": 0}

    def noted(self: Journal, record: dict[str, Any]) -> None:  # Ctrl-C after the first cell
        note(self, record)
        if record.get("type") == "cell":
            seen["cells"] += 1
            if seen["cells"] == 1:
                raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(Journal, "_note", noted)
        stopped = sweep([campaign, *gpus, "--out", str(out), "--fresh"])
    assert stopped.exit_code == 130, stopped.output
    said = " ".join(stopped.stderr.split())
    assert "Run the same command again without --fresh to resume" in said, said
    resumed = sweep([campaign, *gpus, "--out", str(out)])
    assert resumed.exit_code == 0, resumed.output
    assert "0 already done" not in resumed.stderr, resumed.stderr
    helped = CliRunner().invoke(cli, ["sweep", "--help"])
    assert "run the same command again (without --fresh)" in " ".join(helped.output.split())


@pytest.mark.parametrize("gpus", [(), ("--gpus", "0-1")])
def test_an_interruption_of_a_finished_folder_does_not_call_its_cube_partial(
    gpus: tuple[str, ...], tmp_path: Path, monkeypatch
) -> None:
    """A finished folder rerun (one GPU: as it writes its cube; a fleet: as it reads its GPUs'
    models) and stopped before anything was left to measure: its cube holds every cell, and
    the sweep says so (it said "partial cube written", as of a sweep stopped midway)."""
    import dvfs.preflight
    import dvfs.sweep

    campaign = str(write(tmp_path / "tiny.toml", TINY))
    out = tmp_path / "out"
    assert sweep([campaign, *gpus, "--out", str(out)]).exit_code == 0
    journal = (out / "journal.jsonl").read_text()

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt  # Ctrl-C, once the folder is found finished

    owner = dvfs.preflight if gpus else dvfs.sweep
    monkeypatch.setattr(owner, "fleet_models" if gpus else "shard_cube", interrupted)
    result = sweep([campaign, *gpus, "--out", str(out)])
    assert result.exit_code == 130, result.output
    assert "partial" not in result.stderr, result.stderr
    said = " ".join(result.stderr.split())
    assert f"cube written to {out / 'cube.nc'} (whole: the folder already held" in said, said
    assert (out / "journal.jsonl").read_text() == journal
    assert (open_cube(out / "cube.nc")["cell_status"].values == STATUS_OK).all()


@pytest.mark.skipif(os.geteuid() != 0, reason="the link check applies to root only")
def test_as_root_a_sweep_into_a_users_folder_writes_through_none_of_their_links(
    tmp_path: Path,
) -> None:
    """`sudo dvfs sweep C.toml` (as the README runs it) writes its lock file and journal in
    `--out`, by default `out/NAME` of the user's checkout: a link the user put there as
    `sweep.lock` had root truncate its target (any root file) to the sweep's pid, and one as
    `journal.jsonl` had root create or append to its target. As root both are refused in one
    line, exit 2, the target untouched; a user's folder without links is swept as before."""
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    campaign = write(tmp_path / "tiny.toml", TINY)
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o700)
    secret = etc / "shadow"
    secret.write_text("root's\n")
    for name, target in (("sweep.lock", secret), ("journal.jsonl", etc / "cron-job")):
        out = tmp_path / name / "out"
        out.mkdir(parents=True)
        (out / name).symlink_to(target)
        os.chown(out, nobody, nobody)
        result = sweep([str(campaign), "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == (
            f"Error: {out / name} goes through the symbolic link {out / name}, in {out}, which "
            "its owner nobody may write: it may be pointed at any file; as root dvfs refuses "
            "to write through it (name the file itself, or write in a folder only root can "
            "write)"
        )
        assert secret.read_text() == "root's\n" and sorted(etc.iterdir()) == [secret]
        # and `dvfs doctor` fails the folder as the sweep refuses it, rather than "usable"
        doctor = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", str(out)])
        assert doctor.exit_code != 0, doctor.output
        shown = " ".join(doctor.output.split())
        assert f"{out / name} goes through the symbolic link {out / name}" in shown, shown
        assert f"{out}: usable" not in shown
    out = tmp_path / "home" / "out"
    out.mkdir(parents=True)
    os.chown(out, nobody, nobody)
    result = sweep([str(campaign), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "cube.nc").is_file()
