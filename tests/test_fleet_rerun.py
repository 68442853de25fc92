"""A campaign finished on other GPUs than it started on (issue 12): after a node loss the
driver's journal alone resumes it on the GPUs left, of the same model and driver; GPUs that
differ in what makes cells compare are refused in one line."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result
from conftest import PYTHON, copy_sweep, replace_block, write
from fleet_support import FLEET, assert_same_cells, fleet_campaign, signalled_at
from sglang_support import running, stub_campaign

from dvfs.cli import cli
from dvfs.cube import STATUS_OK, build_cube, open_cube
from dvfs.errors import MAX_MESSAGE_CHARS, CubeError, JournalError
from dvfs.fleet.driver import combine_sessions
from dvfs.measure.journal import iter_records, read_records
from dvfs.records import GPU_INVARIANTS, SESSION_INVARIANTS, incomparable

#: Six clocks (144 cells): long enough on four twin GPUs for both kills to land mid-campaign
#: (after 30 cells, then 40 more: 74 to spare), and no longer, since the test sweeps the
#: whole campaign twice (the reference and the journal finished).
CAMPAIGN = replace_block(
    fleet_campaign("rerun"),
    "sm_clock = [1980, 1410, 1005]",
    "sm_clock = { start = 705, stop = 1905, step = 240 }",
)
TOTAL = 6 * 2 * 2 * 3 * 2


def sweep(*args: str) -> Result:
    return CliRunner().invoke(cli, ["sweep", *args, "--no-progress"], catch_exceptions=False)


def cell_keys(journal: Path) -> list[str]:
    return [r["key"] for r in iter_records(journal) if r.get("type") == "cell"]


def killed_at(argv: list[str], journal: Path, cells: int) -> list[str]:
    """Run `argv` and SIGKILL it (a node lost: no exit path runs) once `journal` holds at
    least `cells` cells; the keys it had finished."""
    signalled_at(argv, journal, cells)
    done = cell_keys(journal)
    assert cells <= len(done) < TOTAL, "the kill must land mid-campaign"
    return done


@pytest.mark.timeout(400)
def test_a_rerun_on_fewer_gpus_finishes_the_campaign(tmp_path: Path) -> None:
    """`--gpus 0-3` killed mid-campaign, then `--gpus 0-1` killed too, then one GPU: the
    journal finishes, no finished cell is measured again, and the cube equals the campaign
    run on one GPU cell for cell; each cell names the GPU that measured it."""
    campaign = write(tmp_path / "rerun.toml", CAMPAIGN)
    one = sweep(str(campaign), "--out", str(tmp_path / "one"))
    assert one.exit_code == 0, one.output
    out = tmp_path / "out"
    journal = out / "journal.jsonl"
    argv = [PYTHON, "-m", "dvfs", "sweep", str(campaign), "--no-progress", "--out", str(out)]
    first = killed_at([*argv, "--gpus", "0-3"], journal, 30)
    second = killed_at([*argv, "--gpus", "0-1"], journal, len(first) + 40)
    assert second[: len(first)] == first
    # The rest on one GPU (the plain sweep path; in this process: no kill to come), then the
    # whole on 0-1 again: nothing to do.
    last = sweep(str(campaign), "--gpus", "3", "--out", str(out))
    assert last.exit_code == 0, last.output
    assert f"{len(second)} already done" in last.stderr
    assert "resuming a 2-GPU run on 1 GPU(s) of the same model and driver" in last.stderr
    keys = cell_keys(journal)
    assert len(keys) == len(set(keys)) == TOTAL, "a finished cell was measured again"
    again = sweep(str(campaign), "--gpus", "0-1", "--out", str(out))
    assert again.exit_code == 0 and f"{TOTAL} already done" in again.output, again.output

    cube, reference = open_cube(out / "cube.nc"), open_cube(tmp_path / "one" / "cube.nc")
    assert (cube["cell_status"].values == STATUS_OK).all()
    assert_same_cells(cube, reference)
    # Three runs, three GPU sets, one journal: each session names its GPUs, each cell its own.
    sessions = [r for r in read_records(journal) if r["type"] == "session"]
    assert [len(s["gpus"]) for s in sessions] == [4, 2, 1]
    uuids = [[g["uuid"] for g in s["gpus"]] for s in sessions]
    assert uuids[1] == uuids[0][:2] and uuids[2] == uuids[0][3:]
    on = cube["measured_on"].values.ravel()
    assert set(on) == set(uuids[0]), "every GPU that measured is named, and only those"
    cells = [r for r in read_records(journal) if r["type"] == "cell"]
    for record in cells:
        c = record["cell"]
        at = cube["measured_on"].sel(
            sm_clock=c["sm_clock_mhz"],
            power_limit=c["power_limit_w"],
            batch=c["batch"],
            drafter=c["drafter"],
            corpus=c["corpus"],
            repeat=c["repeat"],
        )
        assert str(at.values) == ",".join(record.get("gpus") or uuids[2])
    assert cube.attrs["gpu_uuids"].split(",") == uuids[0]
    assert len(np.atleast_1d(cube.attrs["counter_update_period_s"])) == 4
    assert (
        reference["measured_on"].values.ravel().tolist()
        == [
            ",".join(g["uuid"] for g in read_records(tmp_path / "one" / "journal.jsonl")[1]["gpus"])
        ]
        * TOTAL
    )


@pytest.fixture
def on_two(shared_run) -> Path:
    """The fleet campaign swept on two twin H100s (`--gpus 0-1`), shared by the tests below:
    read-only (a test that changes it works on `copy_sweep` of it)."""
    return shared_run(FLEET, "two", "--gpus", "0-1")


def test_another_gpu_model_is_refused_in_one_line(on_two: Path, tmp_path: Path) -> None:
    """A journal started on twin H100s refuses twin H200s (local pool), and says what to do."""
    campaign = on_two.parent / "campaign.toml"
    full = on_two
    half = tmp_path / "half"
    half.mkdir()
    lines = (full / "journal.jsonl").read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if '"type":"cell"' in line][20]
    (half / "journal.jsonl").write_text("".join(lines[:cut]))
    refused = sweep(str(campaign), "--gpus", "h200-sxm:0-1", "--out", str(half))
    assert refused.exit_code == 1, refused.output
    line = refused.output.strip().splitlines()[-1]
    assert line.startswith("Error: ") and len(refused.output.strip().splitlines()) == 1
    assert "GPU model: NVIDIA H100 80GB HBM3 (twin) -> NVIDIA H200 (twin)" in line
    assert "another --out folder" in line and "--fresh" in line
    # Nothing was journalled by the refused run: the journal is as it was.
    assert (half / "journal.jsonl").read_text() == "".join(lines[:cut])
    # One GPU of the other model (a fleet of one: the journal is a fleet's) is refused too.
    plain = sweep(str(campaign), "--gpus", "h200-sxm:0", "--out", str(half))
    assert plain.exit_code == 1 and "GPU model:" in plain.output.strip().splitlines()[-1]


def test_a_resume_whose_every_worker_was_retired_leaves_the_journal_as_it_was(
    on_two: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet's resume on two other GPUs whose workers' servers the driver refused (every
    worker retired: exit 1, nothing of theirs journalled) appended its session all the same,
    each try another: the journal grew with sessions that measured nothing, and the cube
    counted their GPUs ("x4" in `dvfs cube info`, though two GPUs measured every cell). A
    refused try journals nothing; the cube names the two GPUs that measured."""
    from fleet_support import refuse_servers_on

    campaign = on_two.parent / "campaign.toml"
    half = tmp_path / "half"
    half.mkdir()
    lines = (on_two / "journal.jsonl").read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if '"type":"cell"' in line][20]
    (half / "journal.jsonl").write_text("".join(lines[:cut]))
    for label in ("gpu2", "gpu3"):
        refuse_servers_on(monkeypatch, label, f"the server on {label} differs (test)")
    for _ in range(2):
        refused = sweep(str(campaign), "--gpus", "2-3", "--out", str(half))
        assert refused.exit_code == 1, refused.output
        last = refused.output.strip().splitlines()[-1]
        assert last.startswith("Error: the server on gpu") and "differs (test)" in last, last
        assert (half / "journal.jsonl").read_text() == "".join(lines[:cut])
    built = CliRunner().invoke(cli, ["cube", "build", str(half)])
    assert built.exit_code == 0, built.output
    info = CliRunner().invoke(cli, ["cube", "info", str(half / "cube.nc")])
    assert "NVIDIA H100 80GB HBM3 (twin) x2" in info.output, info.output
    measured = {g["uuid"] for g in read_records(on_two / "journal.jsonl")[1]["gpus"]}
    assert set(open_cube(half / "cube.nc").attrs["gpu_uuids"].split(",")) == measured


def _session(name: str = "NVIDIA H100", driver: str = "550.54", worker: str = "gpu0") -> dict:
    return {
        "type": "session",
        "worker": worker,
        "host": "node-a",
        "gpu_backend": "nvml",
        "engine_backend": "sglang",
        "actuation": True,
        "clock": "monotonic",
        "power_limit_range_w": [200.0, 700.0, 700.0],
        "measurement_method": "m",
        "stock": {"sm_clock_mhz": 1980, "power_limit_w": 700.0},
        "idle_power_w": 70.0,
        "gpus": [
            {
                "index": 0,
                "uuid": f"GPU-{worker}",
                "name": name,
                "driver_version": driver,
                "backend": "nvml",
                "memory_clock_mhz": 2619,
                "max_sm_clock_mhz": 1980,
                "ecc_mode": "on",
                "vbios_version": "96.00.99.00.01",
            }
        ],
    }


def test_the_invariants_are_named_and_each_one_refuses() -> None:
    """Each named invariant, changed alone, keeps two sessions apart; other GPUs of the model
    (another UUID, index, host) do not."""
    base = _session()
    other_gpu = json.loads(json.dumps(_session(worker="gpu5")))
    other_gpu["host"] = "node-b"
    assert incomparable(base, other_gpu) == []
    for key, label in GPU_INVARIANTS.items():
        changed = json.loads(json.dumps(base))
        changed["gpus"][0][key] = "something else"
        assert [c.split(":")[0] for c in incomparable(base, changed)] == [label]
    for key, label in SESSION_INVARIANTS.items():
        changed = json.loads(json.dumps(base))
        changed[key] = [1.0, 2.0, 3.0] if key == "power_limit_range_w" else "something else"
        assert [c.split(":")[0] for c in incomparable(base, changed)] == [label]
    # A fleet's workers on nodes with different drivers cannot share one journal.
    with pytest.raises(JournalError, match=r"driver version: 550\.54 -> 560\.28.*leave one"):
        combine_sessions([base, _session(driver="560.28", worker="gpu1")])
    assert len(combine_sessions([base, other_gpu])["workers"]) == 2


def test_workers_whose_servers_get_another_environment_cannot_share_a_journal() -> None:
    """A worker whose node runs dvfs with NCCL_ALGO set where the other's does not: refused in
    one line naming the variable; a session without `server_env` (an earlier dvfs, the twin)
    is compared in nothing of it."""
    base = {**_session(), "server_env": {}}
    other = {**_session(worker="gpu1"), "server_env": {"NCCL_ALGO": "Tree"}}
    assert incomparable(base, other) == ["server environment NCCL_ALGO: unset -> 'Tree'"]
    with pytest.raises(JournalError, match=r"NCCL_ALGO: unset -> 'Tree'.*give every worker"):
        combine_sessions([base, other])
    assert incomparable(_session(), other) == []


def test_the_cube_refuses_a_journal_mixing_models(on_two: Path, tmp_path: Path) -> None:
    """An edited journal whose second session is another model: the cube says why."""
    journal = copy_sweep(on_two, tmp_path / "o") / "journal.jsonl"  # the shared run stays
    records = read_records(journal)
    session = next(r for r in records if r["type"] == "session")
    other = json.loads(json.dumps(session))
    for gpu in other["gpus"]:
        gpu["name"] = "NVIDIA H200"
    with journal.open("a") as f:
        f.write(json.dumps(other) + "\n")
    with pytest.raises(CubeError, match=r"GPU model: .*H100.* -> NVIDIA H200.*own --out folder"):
        build_cube(journal)


def test_a_merged_cube_keeps_which_gpu_measured_each_cell(shared_run) -> None:
    """A fleet of two models: the merged cube's measured_on runs along `gpu`, each model's
    cells named by its own GPUs."""
    out = shared_run(FLEET, "mixed", "--gpus", "0,h200-sxm:0")
    merged = open_cube(out / "cube.nc")
    assert merged["measured_on"].dims[0] == "gpu"
    for i, journal in enumerate(sorted(out.glob("gpu-*/journal.jsonl"))):
        session = next(r for r in read_records(journal) if r["type"] == "session")
        names = set(merged["measured_on"].isel(gpu=i).values.ravel())
        assert names == {session["gpus"][0]["uuid"]}


@pytest.mark.timeout(300)
def test_a_rerun_on_another_engine_version_is_refused(tmp_path: Path) -> None:
    """The campaign started on SGLang 0.5.23 (the stub); rerun where the servers report 0.5.9:
    the workers are retired at their first server, nothing of theirs is journalled, and the
    run stops in one line; the cube of a journal mixing them is refused too."""
    path, marker = stub_campaign(tmp_path, batch="[1]")  # 8 cells: 3 kept, 5 to rerun
    full = tmp_path / "full"
    first = sweep(str(path), "--gpus", "0-1", "--out", str(full))
    assert first.exit_code == 0, first.output
    lines = (full / "journal.jsonl").read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if '"type":"cell"' in line][3]
    half = tmp_path / "half"
    half.mkdir()
    (half / "journal.jsonl").write_text("".join(lines[:cut]))
    config = tmp_path / "stub.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "version": "0.5.9"}))
    refused = sweep(str(path), "--gpus", "0-1", "--out", str(half))
    assert refused.exit_code == 1, refused.output
    line = refused.output.strip().splitlines()[-1]
    assert (
        line.startswith("Error: the server of drafter ")
        and "engine version: 0.5.23 -> 0.5.9" in line
    )
    assert "--fresh" in line
    kept = [r for r in read_records(half / "journal.jsonl") if r["type"] in ("cell", "server")]
    before = [json.loads(x) for x in lines[:cut] if '"type":"cell"' in x or '"type":"server"' in x]
    assert kept == before, "nothing measured on the other engine was journalled"
    assert not running(marker)
    # A journal that mixes them anyway (edited) gives no cube.
    server = next(r for r in before if r["type"] == "server")
    with (half / "journal.jsonl").open("a") as f:
        f.write(json.dumps({**server, "version": "0.5.9"}) + "\n")
    with pytest.raises(
        CubeError, match=r"different engines or flags \(engine version: 0\.5\.23 -> 0\.5\.9"
    ):
        build_cube(half / "journal.jsonl")


def _fleet_rerun_rewrapped(
    tmp_path: Path, wrapped: str, cut_before: Callable[[str], bool], nth: int = 0
) -> tuple[str, str]:
    """A fleet's sweep of the stub campaign through a pass-through wrapper, its journal cut
    before the `nth` line `cut_before` picks, rerun where the wrapper's line is `wrapped`,
    refused (exit 1): the last line, and the stub's marker."""
    wrapper = tmp_path / "wrap.sh"
    wrapper.write_text('#!/bin/sh\nexec "$@"\n')
    wrapper.chmod(0o755)
    path, marker = stub_campaign(tmp_path, batch="[1]", wrapper=(str(wrapper),))
    full = tmp_path / "full"
    assert sweep(str(path), "--gpus", "0-1", "--out", str(full)).exit_code == 0
    lines = (full / "journal.jsonl").read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if cut_before(line)][nth]
    half = tmp_path / "half"
    half.mkdir()
    (half / "journal.jsonl").write_text("".join(lines[:cut]))
    wrapper.write_text(f"#!/bin/sh\n{wrapped}\n")
    refused = sweep(str(path), "--gpus", "0-1", "--out", str(half))
    assert refused.exit_code == 1, refused.output
    return refused.output.strip().splitlines()[-1], marker


def _rerun_with_flags_on_the_speculative_drafter(tmp_path: Path, flags: str) -> tuple[str, str]:
    """As `_fleet_rerun_rewrapped`, the journal cut before drafter 'eagle3''s server and the
    wrapper adding `flags` to the speculative drafter's server only."""
    return _fleet_rerun_rewrapped(
        tmp_path,
        f'case "$*" in *speculative*) exec "$@" {flags};; *) exec "$@";; esac',
        lambda line: '"type":"server"' in line and "eagle3" in line,
    )


@pytest.mark.timeout(300)
def test_a_fleet_rerun_whose_wrapper_adds_a_flag_says_to_start_the_server_as_it_was(
    tmp_path: Path,
) -> None:
    """The campaign's fleet rerun where the `server_command` wrapper now adds
    --mem-fraction-static: the workers are retired at their first server, in one line naming
    the arg, which said "its cells would compare software, not settings; run the earlier
    engine" (no engine changed). It says to start the server as it was, its flags too."""
    line, marker = _fleet_rerun_rewrapped(
        tmp_path, 'exec "$@" --mem-fraction-static 0.6', lambda line: '"type":"cell"' in line, 3
    )
    # from the fraction SGLang resolved, as it reports it
    assert re.search(r"\(mem_fraction_static: 0\.\d+ -> 0\.6\)", line), line
    assert "start it as it was (the same SGLang, and the same flags" in line, line
    assert "compare software" not in line and "run the earlier engine" not in line, line
    assert "sizes an unset mem_fraction_static by the host's smallest GPU" in line, line
    assert line.endswith("or start over with --fresh (or another --out)"), line
    assert not running(marker)


def test_a_fleets_models_whose_cubes_do_not_merge_is_an_error_not_bad_usage(
    shared_run, tmp_path: Path
) -> None:
    """A fleet's per-model cubes that cannot be merged (one model's journal written by another
    twin) fail `dvfs cube build` of the folder as an error (exit 1), naming the folder's
    journals: the user gave one folder, not a set of cubes `cube merge` refuses (exit 2)."""
    full = shared_run(FLEET, "mixed", "--gpus", "0,h200-sxm:0")  # shared with the tests near
    out = copy_sweep(full, tmp_path / "mixed")
    h200 = next(out.glob("gpu-nvidia-h200*/journal.jsonl"))
    records = read_records(h200)
    for record in records:
        if record["type"] == "session":
            for gpu in record["gpus"]:
                gpu["driver_version"] = "twin+0123456789ab"
        if record["type"] == "server":
            record["version"] = "dvfs-twin 0.1.0+0123456789ab"
    h200.write_text("".join(json.dumps(r) + "\n" for r in records))
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 1, built.output
    said = " ".join(built.output.split())
    assert "cannot merge cubes of two twins" in said and str(out) in said, said


def test_a_mixed_fleets_cube_build_advice_rebuilds_the_merged_cube(
    shared_run, tmp_path: Path
) -> None:
    """A fleet of two models whose one journal gives no cube (an edited line): the error said
    `dvfs cube build FOLDER/gpu-<model>` writes the cube once that is fixed, which rebuilt that
    model's cube alone and left the folder without its merged one; it names the fleet's
    folder, whose build writes both."""
    full = shared_run(FLEET, "mixed", "--gpus", "0,h200-sxm:0")  # shared with the tests near
    campaign = full.parent / "campaign.toml"
    out = copy_sweep(full, tmp_path / "mixed")
    (out / "cube.nc").unlink()
    h200 = next(out.glob("gpu-nvidia-h200*/journal.jsonl"))
    text = h200.read_text()
    lines = text.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if '"type":"cell"' in line)
    record = json.loads(lines[at])
    record["cell"]["sm_clock_mhz"] = 1234  # not in the grid
    lines[at] = json.dumps(record) + "\n"
    h200.write_text("".join(lines))
    again = sweep(str(campaign), "--gpus", "0,h200-sxm:0", "--out", str(out))
    assert again.exit_code == 1, again.output
    said = " ".join(again.output.split())
    advice = re.search(r"`(dvfs cube build [^`]+)` writes the cube once that is fixed", said)
    assert advice, said
    h200.write_text(text)  # fixed
    built = CliRunner().invoke(cli, shlex.split(advice.group(1))[1:], catch_exceptions=False)
    assert built.exit_code == 0, built.output
    merged = open_cube(out / "cube.nc")
    assert merged.sizes["gpu"] == 2


def test_a_mixed_fleet_rerun_on_one_model_keeps_the_other(shared_run, tmp_path: Path) -> None:
    """Two models' journals, the H100s' cut short; a rerun on H100s only (the H200 node lost)
    finishes their journal and the merged cube still holds the H200s' cells."""
    full = shared_run(FLEET, "mixed", "--gpus", "0,h200-sxm:0")  # shared with the test above
    campaign = full.parent / "campaign.toml"
    out = copy_sweep(full, tmp_path / "mixed")
    h100 = next(out.glob("gpu-nvidia-h100*/journal.jsonl"))
    h200 = next(out.glob("gpu-nvidia-h200*/journal.jsonl"))
    lines = h100.read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if '"type":"cell"' in line][30]
    h100.write_text("".join(lines[:cut]))
    lines = h200.read_text().splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if '"type":"cell"' in line][50]
    h200.write_text("".join(lines[:cut]))
    again = sweep(str(campaign), "--gpus", "2-3", "--out", str(out))
    assert again.exit_code == 0, again.output
    assert "42 cell(s) measured" in again.output
    assert "gpu-nvidia-h200-twin: 22 cell(s) left for GPUs of that model" in again.output
    merged = open_cube(out / "cube.nc")
    assert merged.sizes["gpu"] == 2
    cells = [d for d in merged["cell_status"].dims if d != "gpu"]
    ok = (merged["cell_status"] == STATUS_OK).sum(cells)
    assert ok.values.tolist() == [72, 50]


@pytest.mark.timeout(300)
def test_a_fleet_rerun_whose_drafter_runs_on_other_flags_says_to_run_them_on_the_same(
    tmp_path: Path,
) -> None:
    """A fleet's rerun of a folder that holds drafter 'none''s server and cells, whose
    `server_command` wrapper now adds --dtype float16 to the speculative drafter's server
    only: the worker is retired at that server, which differs from the other drafter's, in a
    line that said "its cells would compare software, not settings; run the earlier engine"
    (no engine changed). It says, as one GPU's sweep does, that the arms would compare more
    than their drafters and to run every drafter on the same SGLang and flags."""
    line, marker = _rerun_with_flags_on_the_speculative_drafter(tmp_path, "--dtype float16")
    assert "drafter 'none''s" in line and "dtype" in line, line
    assert "the arms would compare more than their drafters" in line, line
    assert "run every drafter on the same SGLang and flags (engine.sglang.extra_args)" in line
    assert "compare software" not in line and "run the earlier engine" not in line, line
    assert not running(marker)


#: Flags every arm shares, enough that the changes named would fill an error line's bound.
MANY_FLAGS = (
    "--chunked-prefill-size 4096 --max-prefill-tokens 4096 --schedule-policy lpm "
    "--schedule-conservativeness 0.5 --stream-interval 2 --max-total-tokens 100000 "
    "--num-continuous-decode-steps 2 --random-seed 7 --sampling-backend pytorch "
    "--context-length 4096 --enable-torch-compile --page-size 16 "
    "--num-reserved-decode-tokens 256 --sleep-on-idle --enable-tf32-matmul "
    "--enable-fp32-lm-head"
)


@pytest.mark.timeout(300)
def test_a_fleet_rerun_whose_drafter_runs_on_many_other_flags_ends_in_its_remedy(
    tmp_path: Path,
) -> None:
    """As above, the wrapper adding many flags every arm shares: the line (cut at
    MAX_MESSAGE_CHARS) ended inside the changes it named ("...: the arms would compare more
    than their dra..."), its remedy lost. It names as many as fit, counts the rest, and ends
    whole in its remedy."""
    line, marker = _rerun_with_flags_on_the_speculative_drafter(tmp_path, MANY_FLAGS)
    assert "drafter 'none''s" in line and "(chunked_prefill_size): 8192 -> 4096" in line, line
    assert " more): the arms would compare more than their drafters" in line, line
    assert line.endswith(
        "run every drafter on the same SGLang and flags (engine.sglang.extra_args), or start "
        "over with --fresh (or another --out)"
    ), line
    assert len(line) <= len("Error: ") + MAX_MESSAGE_CHARS
    assert not running(marker)
