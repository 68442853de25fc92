"""`dvfs sweep --dry-run` on a folder a sweep has begun: the cells it counts as done are
those the resumed sweep then skips (each GPU model's journal of a fleet mixing models), and
with --fresh it plans the sweep that starts over, moving nothing."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import MIXED_FLEET, TINY_EXACT, copy_sweep, folder_files, replace_block, write

from dvfs.cli import cli
from dvfs.fleet.shard import Shard
from dvfs.measure.journal import read_records

#: TINY (16 cells) on the exact twin, so that twins of two models measure it alike; its runs
#: (`tiny_exact_run`) are shared with other tests, so each test resumes or edits a copy.
MIXED = TINY_EXACT
FLEET = MIXED_FLEET


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _interrupted(journal: Path, cells: int) -> None:
    """`journal` as a sweep stopped after its first `cells` cell records left it."""
    kept, seen = [], 0
    for line in journal.read_text(encoding="utf-8").splitlines(keepends=True):
        if json.loads(line)["type"] == "cell":
            seen += 1
            if seen > cells:
                continue
        kept.append(line)
    journal.write_text("".join(kept), encoding="utf-8")


def _measured(result: Result) -> tuple[int, int]:
    """(measured, already done) from a sweep's closing line."""
    found = re.search(r"(\d+) cell\(s\) measured, \d+ failed, (\d+) already done", result.output)
    assert found, result.output
    return int(found[1]), int(found[2])


def _dry(campaign: Path, out: Path, *args: str) -> tuple[dict, Result]:
    base = ("sweep", str(campaign), "--out", str(out), *args, "--dry-run", "--no-estimate")
    doc = invoke(*base, "--json")
    assert doc.exit_code == 0, doc.output
    return json.loads(doc.output), invoke(*base)


def test_the_dry_run_counts_each_gpu_models_journal_as_the_resumed_sweep(
    tiny_exact_run, tmp_path: Path
) -> None:
    """A fleet mixing GPU models, interrupted (a whole campaign, and a shard): its dry run
    counts as done, per model, the cells of each model's `gpu-*/` journal that the sweep then
    skips, and as to run those it then measures, with the fleet's GPUs or only the campaign's
    (one model's journal), in --json and in the text; finished, all are done. A folder of one
    model's run, finished or not: the fleet's refusal, for both."""
    campaign = write(tmp_path / "tiny.toml", MIXED)
    for shard, cells, run in ((), 16, "mixed"), (("--shard", "1/2"), 8, "mixed-s1"):
        begun = copy_sweep(tiny_exact_run(run), tmp_path / f"begun{len(shard)}")
        sweep = ("sweep", str(campaign), *shard, "--no-progress")
        h100, h200 = sorted(begun.glob("gpu-*/journal.jsonl"))
        _interrupted(h100, 3)
        _interrupted(h200, 5)
        per_model = {h100.parent.name: 3, h200.parent.name: 5}
        for gpus, models in ((FLEET, per_model), ((), {h100.parent.name: 3})):
            out = copy_sweep(begun, tmp_path / f"out{len(shard)}{len(gpus)}")
            doc, text = _dry(campaign, out, *shard, *gpus)
            done = sum(models.values())
            left = cells * len(models) - done
            assert (doc["cells"], doc["already_done"], doc["remaining"]) == (cells, done, left)
            assert doc["done_per_model"] == models and not doc["out_refused"]
            said = " ".join(text.output.split())
            assert f"({done} already done, {left} to run" in said, said
            for folder, n in models.items():
                assert f"{folder}/ {n} done" in said, said
            resumed = invoke(*sweep, *gpus, "--out", str(out))
            assert resumed.exit_code == 0, resumed.output
            assert _measured(resumed) == (left, done)
            doc, _ = _dry(campaign, out, *shard, *gpus)
            assert (doc["already_done"], doc["remaining"]) == (cells * len(models), 0)
    # A run on one model, finished or begun only: the fleet mixing models refuses it, and the
    # dry run in the same line (finished, both took it for done, the other model unmeasured).
    from test_journal import assert_one_line_error

    one = copy_sweep(tiny_exact_run("one"), tmp_path / "one")
    args = ("sweep", str(campaign), *FLEET, "--out", str(one))
    for _ in ("finished", "begun"):
        line = assert_one_line_error(invoke(*args, "--no-progress"), 1, "holds a run on one GPU")
        assert assert_one_line_error(invoke(*args, "--dry-run", "--no-estimate"), 1) == line
        _interrupted(one / "journal.jsonl", 4)


def test_the_dry_run_with_fresh_plans_the_sweep_that_starts_over(
    tiny_exact_run, tmp_path: Path
) -> None:
    """With --fresh, the folders the sweep would refuse (another shard's, one begun by an
    earlier dvfs, a damaged shard record; one model's journals or each model's) are no
    problem: nothing counts as done, the dry run names the journals and cubes --fresh would
    move aside and where, moves nothing (every byte of the folder as it was), and the fresh
    sweep then moves just those and measures every cell it counted. An invalid campaign is
    still refused, exit 2; a fresh sweep refused after its moves (corpora too small for a
    batch) puts them back, so a rerun without --fresh still resumes them (they once stayed
    aside, and that rerun measured every cell again)."""
    from test_journal import assert_one_line_error

    campaign = write(tmp_path / "tiny.toml", MIXED)
    run = ("sweep", str(campaign), "--no-progress")
    short = write(
        tmp_path / "short.toml", replace_block(MIXED, "batch = [1, 8]", "batch = [1, 8, 100000]")
    )
    # Each case works on a copy of these; the dry run of the invalid campaign reads s0.
    s0, one = tiny_exact_run("mixed-s0"), tiny_exact_run("s0")
    damaged = copy_sweep(one, tmp_path / "damaged")
    records = read_records(damaged / "journal.jsonl")
    records[1] = {**records[1], "index": "x"}
    (damaged / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cases = (
        (s0, ("--shard", "1/2", *FLEET), 16, 2),  # each model's folder holds another shard
        (s0, (), 16, 2),  # the whole campaign on one model, into a mixed fleet's folder
        (one, ("--shard", "1/2"), 8, 1),
        (damaged, ("--shard", "0/2"), 8, 1),
    )
    for folder, args, cells, moved in cases:
        out = copy_sweep(folder, tmp_path / f"out-{folder.name}-{len(args)}")
        before = folder_files(out)
        plain = invoke(*run, *args, "--out", str(out), "--dry-run", "--no-estimate", "--json")
        assert plain.exit_code in (1, 2), plain.output  # refused without --fresh
        doc, text = _dry(campaign, out, *args, "--fresh")
        assert doc["problems"] == [] and not doc["out_refused"]
        assert (doc["already_done"], doc["remaining"]) == (0, cells)
        journals = sorted(
            str(p) for p in (out / "journal.jsonl", *out.glob("gpu-*/journal.jsonl")) if p.exists()
        )
        aside = {m["path"]: m["to"] for m in doc["fresh_moves_aside"]}
        assert sorted(p for p in aside if p.endswith("journal.jsonl")) == journals
        assert all(to == f"{path}.1" for path, to in aside.items())
        said = " ".join(text.output.split())
        assert text.exit_code == 0 and "problem" not in said, said
        assert "--fresh would move aside" in said and "moves nothing" in said, said
        assert all(path in said for path in journals)
        assert folder_files(out) == before  # the dry runs changed nothing
        refused = invoke("sweep", str(short), "--no-progress", *args, "--out", str(out), "--fresh")
        assert refused.exit_code == 2 and "batch 100000 needs" in refused.stderr, refused.output
        assert "moved the previous journal back" in " ".join(refused.stderr.split())
        assert folder_files(out) == before
        fresh = invoke(*run, *args, "--out", str(out), "--fresh")
        assert fresh.exit_code == 0, fresh.output
        assert _measured(fresh) == (cells, 0)
        for path, to in aside.items():
            assert Path(to).read_bytes() == before[str(Path(path).relative_to(out))]
        assert len([p for p in aside if p.endswith("journal.jsonl")]) == moved
        shard = Shard.parse(args[1]) if args[:1] == ("--shard",) else None
        for journal in (out / "journal.jsonl", *out.glob("gpu-*/journal.jsonl")):
            if journal.exists():  # the fresh sweep's: this run's shard, or none
                second = read_records(journal)[1]
                assert second == shard.to_json() if shard else second["type"] != "shard"
    broken = write(tmp_path / "broken.toml", MIXED.replace("repeats = 2", "repeats = 0"))
    result = invoke("sweep", str(broken), "--out", str(s0), "--dry-run", "--fresh")
    assert_one_line_error(result, 2, "repeats")


def test_the_dry_run_refuses_a_journal_of_other_settings_as_the_sweep(
    tiny_exact_run, tmp_path: Path
) -> None:
    """A folder whose journal was measured with other settings (more GPUs, so another
    tp_size; another knob list), the folder's own or each GPU model's of a fleet mixing
    models: the sweep refuses it in one line, exit 1, and its dry run reports that line as a
    problem, exit 1, with --json too, counting nothing as done or to run; with --fresh (which
    moves the journals aside) it is no problem."""
    from test_journal import assert_one_line_error

    one, mixed = tiny_exact_run("one"), tiny_exact_run("mixed")  # each case works on a copy
    two_gpus = write(
        tmp_path / "two.toml", replace_block(MIXED, "devices = [0]", "devices = [0, 1]")
    )
    clocks = write(
        tmp_path / "clocks.toml",
        replace_block(MIXED, "sm_clock = [1980, 1005]", "sm_clock = [1980, 1500, 1005]"),
    )
    cases = (
        (two_gpus, one, (), "engine.tp_size: 1 -> 2", 1),
        (clocks, one, (), "knobs.sm_clock: [1980, 1005] -> [1980, 1500, 1005]", 1),
        (clocks, mixed, FLEET, "knobs.sm_clock: [1980, 1005] -> [1980, 1500, 1005]", 2),
    )
    for changed, folder, gpus, change, journals in cases:
        out = copy_sweep(folder, tmp_path / f"out-{changed.stem}-{folder.name}")
        before = folder_files(out)
        args = ("sweep", str(changed), *gpus, "--out", str(out))
        line = assert_one_line_error(invoke(*args, "--no-progress"), 1, change, "--fresh")
        dry = (*args, "--dry-run", "--no-estimate")
        doc = invoke(*dry, "--json")
        assert doc.exit_code == 1, doc.output
        report = json.loads(doc.output)
        assert report["out_refused"] and report["already_done"] is None
        assert report["remaining"] is None and not report.get("done_per_model")
        problems = report["problems"]
        assert len(problems) == journals and line.endswith(problems[0]), (line, problems)
        assert all(change in p and "measured with other settings" in p for p in problems)
        text = invoke(*dry)
        said = " ".join(text.output.split())
        assert text.exit_code == 1 and "none counted as done or to run" in said, said
        squeezed = "".join(said.split())  # the terminal's width wraps long paths anywhere
        assert all("".join(f"problem: {p}".split()) in squeezed for p in problems), said
        fresh, _ = _dry(changed, out, *gpus, "--fresh")
        assert fresh["problems"] == [] and not fresh["out_refused"]
        assert (fresh["already_done"], fresh["remaining"]) == (0, fresh["cells"] * journals)
        # `dvfs doctor` finds it too, in each GPU model's journal as in the folder's own
        doctor = invoke("doctor", str(changed), "--out", str(out))
        assert doctor.exit_code != 0 and change in " ".join(doctor.output.split()), doctor.output
        assert (
            folder_files(out) == before
        )  # neither the refused sweep, the dry runs nor doctor wrote


def test_the_dry_run_with_one_gpu_group_plans_the_campaign_the_sweep_runs_on_it(
    tiny_exact_run, tmp_path: Path
) -> None:
    """`--gpus` naming one group (not a fleet) runs the campaign on that group: its devices,
    and on the twin a `PROFILE:INDEX` group's profile. On a folder the campaign's own GPU
    began, the sweep on another model's GPU refuses the journal in one line, exit 1, naming
    what changed; its dry run reports that line as a problem, exit 1, counting nothing as
    done (it once planned the campaign's own GPU: every cell done, exit 0); another GPU of
    the model resumes it (tested below). Into a new folder the dry run plans the campaign,
    by its hash, that the sweep then journals."""
    from test_journal import assert_one_line_error

    campaign = write(tmp_path / "tiny.toml", MIXED)
    one = tiny_exact_run("one")
    for gpus, change in (("h200-sxm:0", "gpu.profile: "),):
        out = copy_sweep(one, tmp_path / f"out-{gpus.replace(':', '-')}")
        before = folder_files(out)
        args = ("sweep", str(campaign), "--gpus", gpus, "--out", str(out))
        line = assert_one_line_error(invoke(*args, "--no-progress"), 1, change, "--fresh")
        doc = invoke(*args, "--dry-run", "--no-estimate", "--json")
        assert doc.exit_code == 1, doc.output
        report = json.loads(doc.output)
        assert report["out_refused"] and report["already_done"] is None, report
        assert report["problems"] and line.endswith(report["problems"][0]), (line, report)
        assert folder_files(out) == before
    new = tmp_path / "new"
    report, _ = _dry(campaign, new, "--gpus", "h200-sxm:0")
    assert report["gpu"]["profile"].startswith("h200-sxm"), report["gpu"]
    swept = invoke(
        "sweep", str(campaign), "--gpus", "h200-sxm:0", "--out", str(new), "--no-progress"
    )
    assert swept.exit_code == 0, swept.output
    assert read_records(new / "journal.jsonl")[0]["campaign_hash"] == report["hash"]


def test_a_fleet_on_another_gpu_model_is_refused_by_its_dry_run_and_doctor_as_the_sweep(
    tiny_exact_run, tmp_path: Path
) -> None:
    """A folder of the campaign swept on twin H100s, finished or begun only, resumed by a fleet
    of twin H200s: the sweep refuses it (its cells would not compare with the H200s'), exit 1.
    Its dry run said "16 already done" (begun: the H100s' cells done, the rest to run) and
    `dvfs doctor` passed the folder, exit 0; both refuse it now in the sweep's line, exit 1,
    writing nothing. A fleet of the folder's own model still finds its cells done."""
    from test_journal import assert_one_line_error

    campaign = write(tmp_path / "tiny.toml", MIXED)
    out = copy_sweep(tiny_exact_run("one"), tmp_path / "one")
    other = ("--gpus", "h200-sxm:0-1", "--out", str(out))
    for state in ("finished", "begun"):
        if state == "begun":
            _interrupted(out / "journal.jsonl", 5)
            (out / "cube.nc").unlink()
        before = folder_files(out)
        line = assert_one_line_error(
            invoke("sweep", str(campaign), *other, "--no-progress"),
            1,
            "measured on other GPUs than this run's",
            "GPU model: NVIDIA H100 80GB HBM3 (twin) -> NVIDIA H200 (twin)",
        )
        dry = ("sweep", str(campaign), *other, "--dry-run", "--no-estimate")
        assert assert_one_line_error(invoke(*dry), 1) == line, state
        assert assert_one_line_error(invoke(*dry, "--json"), 1) == line, state
        doctor = invoke("doctor", str(campaign), *other, "--json")
        checks = {c["name"]: c for c in json.loads(doctor.output)}
        assert doctor.exit_code == 1, doctor.output
        refused = checks["output folder"]
        said = refused["detail"].split(" (--fresh is the sweep's: ")[0]  # (the doctor's note)
        assert refused["status"] == "fail" and line.endswith(said), (line, refused)
        assert folder_files(out) == before, state
        own, _ = _dry(campaign, out, "--gpus", "0-1")
        assert own["already_done"] == (16 if state == "finished" else 5), (state, own)
        own_doctor = invoke("doctor", str(campaign), "--gpus", "0-1", "--out", str(out), "--json")
        assert own_doctor.exit_code == 0, own_doctor.output


def _refused_alike(campaign: Path, out: Path, invoke_: Callable[..., Result]) -> str:
    """The sweep of `campaign` into `out` refused, exit 1, and its dry run (text, --json) and
    `dvfs doctor`'s "output folder" check in the very same line, exit 1, nothing written."""
    from test_journal import assert_one_line_error

    before = folder_files(out)
    sweep = ("sweep", str(campaign), "--out", str(out))
    line = assert_one_line_error(invoke_(*sweep, "--no-progress"), 1, "measured on GPUs that")
    dry = (*sweep, "--dry-run", "--no-estimate")
    assert assert_one_line_error(invoke_(*dry), 1) == line
    assert assert_one_line_error(invoke_(*dry, "--json"), 1) == line
    doctor = invoke_("doctor", str(campaign), "--out", str(out), "--json")
    assert doctor.exit_code == 1, doctor.output
    refused = {c["name"]: c for c in json.loads(doctor.output)}["output folder"]
    # (the doctor adds that --fresh is the sweep's, which it names)
    said = refused["detail"].split(" (--fresh is the sweep's: ")[0]
    assert refused["status"] == "fail" and line.endswith(said), (line, refused)
    assert folder_files(out) == before
    return line


def test_one_gpus_sweep_on_other_gpus_is_refused_by_its_dry_run_and_doctor_as_the_sweep(
    tiny_exact_run, tmp_path: Path
) -> None:
    """A folder measured on twin GPUs that differ from this run's in what makes cells compare
    (another twin: its digest, the driver version; finished or begun), resumed by a sweep on
    one GPU (no fleet): the sweep refuses it, exit 1, yet its dry run said "16 already done"
    (begun: "5 already done, 11 to run") and `dvfs doctor` passed the folder, exit 0. Both
    refuse it now in the sweep's line. The folder's own GPUs still find its cells done."""
    from dvfs.twin.identity import TWIN_CHANGED

    campaign = write(tmp_path / "tiny.toml", MIXED)
    out = copy_sweep(tiny_exact_run("one"), tmp_path / "one")
    journal = out / "journal.jsonl"
    own = journal.read_text(encoding="utf-8")
    records = [json.loads(line) for line in own.splitlines()]
    for record in records:
        for gpu in record.get("gpus", ()) if record["type"] == "session" else ():
            gpu["driver_version"] = "twin+000000000000"  # another twin's
    journal.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    for state in ("finished", "begun"):
        if state == "begun":
            _interrupted(journal, 5)
            (out / "cube.nc").unlink()
        line = _refused_alike(campaign, out, invoke)
        assert "driver version: twin+000000000000 -> twin+" in line and TWIN_CHANGED in line
    journal.write_text(own, encoding="utf-8")
    doc, _ = _dry(campaign, out)
    assert doc["already_done"] == 16, doc


def test_one_gpus_sweep_resumes_on_another_gpu_of_the_model_as_a_fleet_does(
    tiny_exact_run, tmp_path: Path
) -> None:
    """A journal begun without a fleet (no --gpus: gpu.devices [0]) resumed on another twin
    GPU of the model: `--gpus 1-2` resumed it, `--gpus 1` was refused ("gpu.devices: [0] ->
    [1] ... use --fresh"), its dry run and `dvfs doctor` too. It resumes now, the dry run and
    the doctor saying so; each cell names the GPU that measured it; and the journal, begun
    on GPU 1, resumes without --gpus (on GPU 0) too. The campaign's hash is kept."""
    campaign = write(tmp_path / "tiny.toml", MIXED)
    out = copy_sweep(tiny_exact_run("one"), tmp_path / "one")
    journal = out / "journal.jsonl"
    header = read_records(journal)[0]
    _interrupted(journal, 5)
    (out / "cube.nc").unlink()
    doc, _ = _dry(campaign, out, "--gpus", "1")
    assert doc["already_done"] == 5, doc
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--gpus", "1", "--json")
    checks = {c["name"]: c for c in json.loads(doctor.output)}
    assert checks["output folder"]["status"] == "ok", checks["output folder"]
    resumed = invoke("sweep", str(campaign), "--out", str(out), "--gpus", "1", "--no-progress")
    assert resumed.exit_code == 0, resumed.output
    assert _measured(resumed) == (11, 5)
    records = read_records(journal)
    assert records[0] == header, "the journal's header (its campaign and hash) is kept"
    sessions = [r for r in records if r["type"] == "session"]
    uuids = [g["uuid"] for s in sessions for g in s["gpus"]]
    assert len(uuids) == len(set(uuids)) == 2
    from dvfs.cube import open_cube

    assert set(open_cube(out / "cube.nc")["measured_on"].values.ravel()) == set(uuids)
    # the other way: begun on GPU 1 alone, finished on the campaign's own GPU 0
    other = tmp_path / "other"
    begun = invoke("sweep", str(campaign), "--out", str(other), "--gpus", "1", "--no-progress")
    assert begun.exit_code == 0, begun.output
    _interrupted(other / "journal.jsonl", 5)
    again = invoke("sweep", str(campaign), "--out", str(other), "--no-progress")
    assert again.exit_code == 0, again.output
    assert _measured(again) == (11, 5)


def _as_result(done: subprocess.CompletedProcess) -> Result:
    """A `dvfs_in_process` run as click's `Result`, for helpers that take one."""
    return Result(
        runner=CliRunner(),
        stdout_bytes=done.stdout.encode(),
        stderr_bytes=done.stderr.encode(),
        output_bytes=(done.stdout + done.stderr).encode(),
        return_value=None,
        exit_code=done.returncode,
        exception=None,
    )


def _finished_nvml_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, str], Path, Path]:
    """The fake NVML's two H100s (as root) for this process and the dvfs runs of a test, and
    NVML_CAMPAIGN swept on them into a folder: (environment, campaign, folder)."""
    from nvml_support import NVML_CAMPAIGN, dvfs_in_process, fake_env, load_fake

    env = fake_env(tmp_path, DVFS_FAKE_NVML_ROOT="1")
    for key in ("DVFS_FAKE_NVML_STATE", "DVFS_FAKE_NVML_DEVICES", "DVFS_FAKE_NVML_ROOT"):
        monkeypatch.setenv(key, env[key])
    load_fake().fake_reset_state()
    campaign = write(tmp_path / "nvml.toml", NVML_CAMPAIGN.format(output_tokens=4, repeats=1))
    out = tmp_path / "out"
    swept = dvfs_in_process("sweep", str(campaign), "--out", str(out), "--no-progress", env=env)
    assert swept.returncode == 0, swept.stderr
    return env, campaign, out


def test_one_real_gpus_sweep_on_another_model_is_refused_by_its_dry_run_and_doctor(
    tmp_path: Path, monkeypatch
) -> None:
    """A folder swept on a (fake NVML) H100, resumed on an H200 by a sweep on one GPU: the
    sweep refuses it, exit 1, yet its dry run, which reads no GPU of a plain sweep, said "4
    already done, 0 to run" and `dvfs doctor` passed the folder. Both refuse it now in the
    sweep's line (GPU model, memory clock). On the H100 again, its cells are done."""
    from nvml_support import dvfs_in_process, load_fake

    env, campaign, out = _finished_nvml_folder(tmp_path, monkeypatch)

    def on(devices: str) -> Callable[..., Result]:
        def run(*args: str) -> Result:
            monkeypatch.setenv("DVFS_FAKE_NVML_DEVICES", devices)
            load_fake().fake_reset_state()
            return _as_result(
                dvfs_in_process(*args, env={**env, "DVFS_FAKE_NVML_DEVICES": devices})
            )

        return run

    line = _refused_alike(campaign, out, on("h200-sxm,h200-sxm"))
    assert "GPU model: NVIDIA H100 80GB HBM3 -> NVIDIA H200" in line, line
    dry = ("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate", "--json")
    own = on("h100-sxm,h100-sxm")(*dry)
    assert own.exit_code == 0, own.output
    assert json.loads(own.stdout)["already_done"] == 4, own.stdout


def test_a_real_gpus_finished_folder_is_planned_without_a_twin_to_estimate_on(
    tmp_path: Path, monkeypatch
) -> None:
    """A hardware campaign whose GPU no twin profile stands in for (none named in it): its dry
    run on a folder holding every cell exited 2 asking for --twin or --no-estimate, though with
    nothing to run nothing needs estimating. It plans (0 to run, the closed form's hours) and
    exits 0; with cells left, or with --fresh (all of them to run again), it still asks."""
    from nvml_support import dvfs_in_process
    from test_journal import assert_one_line_error

    env, campaign, out = _finished_nvml_folder(tmp_path, monkeypatch)

    def run(*args: str) -> Result:
        return _as_result(dvfs_in_process(*args, env=env))

    dry = ("sweep", str(campaign), "--dry-run")
    doc = run(*dry, "--out", str(out), "--json")
    assert doc.exit_code == 0, doc.output
    plan = json.loads(doc.stdout)
    assert (plan["cells"], plan["already_done"], plan["remaining"]) == (4, 4, 0), plan
    assert plan["estimate"]["from"] == "closed form" and not plan["problems"], plan
    text = run(*dry, "--out", str(out))
    assert text.exit_code == 0, text.output
    assert "(4 already done, 0 to run)" in " ".join(text.output.split()), text.output
    # something to run: the estimate needs its stand-in, as before
    _interrupted(copy_sweep(out, tmp_path / "begun") / "journal.jsonl", 3)
    for args in (("--out", str(tmp_path / "begun")), ("--out", str(out), "--fresh")):
        assert_one_line_error(
            run(*dry, *args), 2, "names no twin GPU", "--twin PROFILE", "--no-estimate"
        )


def test_doctor_checks_the_folder_as_the_sweep_of_its_shard_does(
    tiny_exact_run, tmp_path: Path
) -> None:
    """A folder holding shard 0/2: the sweep of the whole campaign or of shard 1/2 into it is
    refused (exit 2), and so is its dry run, in one line; `dvfs doctor` (which said the folder
    holds a journal to resume) fails its output folder check in that line, exit 2, and with
    `--shard 0/2` passes it as the sweep of that shard resumes it. Nothing is written."""
    campaign = write(tmp_path / "tiny.toml", MIXED)
    out = copy_sweep(tiny_exact_run("s0"), tmp_path / "s0")
    before = folder_files(out)
    for args, code in (((), 2), (("--shard", "1/2"), 2), (("--shard", "0/2"), 0)):
        dry = ("sweep", str(campaign), "--out", str(out), *args, "--dry-run", "--no-estimate")
        plan = invoke(*dry, "--json")
        doctor = invoke("doctor", str(campaign), "--out", str(out), *args, "--json")
        checks = {c["name"]: c for c in json.loads(doctor.output)}
        assert plan.exit_code == doctor.exit_code == code, (args, plan.output, doctor.output)
        folder = checks["output folder"]
        if code:
            assert folder["status"] == "fail"
            assert json.loads(plan.output)["problems"] == [folder["detail"]]
            assert "holds shard 0/2 of this campaign" in folder["detail"]
        else:
            assert folder["status"] == "ok" and "a journal to resume" in folder["detail"]
            assert checks["shard"]["status"] == "ok", checks["shard"]
    # More shards than the campaign has comparison groups: the sweep refuses it, exit 2, and
    # doctor fails its shard check in that line (it passed it, exit 0).
    many = ("--shard", "0/500")
    refused = invoke("sweep", str(campaign), "--out", str(tmp_path / "many"), *many)
    assert refused.exit_code == 2, refused.output
    doctor = invoke("doctor", str(campaign), "--out", str(tmp_path / "many"), *many, "--json")
    assert doctor.exit_code == 2, doctor.output
    shard = {c["name"]: c for c in json.loads(doctor.output)}["shard"]
    assert shard["status"] == "fail" and shard["detail"] in refused.output, shard
    assert folder_files(out) == before and not (tmp_path / "many").exists()


def _read_only_mount(mount: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mount` as statvfs(2) and access(2) report a read-only mount, even to root."""
    import os
    from typing import Any

    real_statvfs, real_access = os.statvfs, os.access

    def under(path: Any) -> bool:
        where = Path(path).absolute()
        return where == mount or mount in where.parents

    def statvfs(path: Any) -> os.statvfs_result:
        got = real_statvfs(path)
        if not under(path):
            return got
        fields = list(got)
        fields[8] |= os.ST_RDONLY  # f_flag
        return os.statvfs_result(fields)

    def access(path: Any, mode: int, **kwargs: Any) -> bool:
        return not (mode & os.W_OK and under(path)) and real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(os, "access", access)


def test_the_dry_run_says_the_sweep_cannot_write_its_output_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An --out folder under a regular file, or on a read-only mount: the sweep fails at once
    ('cannot use ... as the output folder'), `dvfs doctor` fails its output folder check, and
    the dry run planned it as if all were well. It now says, in one note line (no traceback),
    that the sweep would stop, in the sweep's words; and plans all the same (exit 0)."""
    from bad_inputs import failing_writes

    campaign = write(tmp_path / "tiny.toml", MIXED)
    (tmp_path / "afile").write_text("")
    mount = tmp_path / "mnt"
    mount.mkdir()
    for out, said in (
        (tmp_path / "afile" / "out", "part of that path is a file"),
        (mount / "out", "read-only"),
    ):
        with failing_writes(mount):
            if out.is_relative_to(mount):
                _read_only_mount(mount, monkeypatch)
            swept = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out)])
            assert swept.exit_code == 1 and said in swept.output, swept.output
            doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
            checked = {c["name"]: c for c in json.loads(doctor.output)}
            assert checked["output folder"]["status"] == "fail", checked
            assert said in checked["output folder"]["detail"], checked
            base = ("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate")
            doc, dry = json.loads(invoke(*base, "--json").stdout), invoke(*base)
            assert dry.exit_code == 0, dry.output
            notes = [" ".join(n.split()) for n in dry.output.splitlines() if n.startswith("note:")]
            stops = [n for n in notes if "sweep would stop" in n]
            assert len(stops) == 1, dry.output
            assert f"cannot use {out} as the output folder" in stops[0] and said in stops[0]
            assert "Traceback" not in dry.output
            assert doc["cells"] == 16, doc
        monkeypatch.undo()
    assert not (mount / "out").exists() and (tmp_path / "afile").read_text() == ""


def test_doctor_and_the_dry_run_say_a_full_file_system_stops_the_sweep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An --out folder on a file system with not one block free: the sweep fails at once
    ("cannot write OUT/sweep.lock: No space left on device"), yet `dvfs doctor` passed the
    output folder ("usable", and a warning of 0.0 GiB free, exit 0) and the dry run planned it
    as if all were well. Doctor fails the check in the sweep's words, and the dry run says in
    its note that the sweep would stop."""
    import errno
    import os
    from typing import Any

    from bad_inputs import failing_writes

    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)
    mount = tmp_path / "full"
    mount.mkdir()
    out = mount / "out"
    real_statvfs = os.statvfs

    def statvfs(path: Any) -> os.statvfs_result:
        got = real_statvfs(path)
        where = Path(path).absolute()
        if where != mount and mount not in where.parents:
            return got
        fields = list(got)
        fields[3] = fields[4] = 0  # f_bfree, f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)
    with failing_writes(mount, errno.ENOSPC):
        swept = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
        assert swept.exit_code == 1 and "No space left on device" in swept.output, swept.output
        doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
        checked = {c["name"]: c for c in json.loads(doctor.output)}
        assert doctor.exit_code == 1, doctor.output
        assert checked["output folder"]["status"] == "fail", checked
        detail = checked["output folder"]["detail"]
        assert f"cannot use {out} as the output folder" in detail, detail
        assert "No space left on device; free some space" in detail, detail
        dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate")
        assert dry.exit_code == 0, dry.output
        notes = [" ".join(n.split()) for n in dry.output.splitlines() if n.startswith("note:")]
        [stop] = [n for n in notes if "sweep would stop" in n]
        assert f"cannot use {out} as the output folder" in stop, stop
        assert "No space left on device" in " ".join(dry.output.split()), dry.output
    assert list(mount.iterdir()) == []


@pytest.mark.parametrize("link", ["to-nothing", "loop"])
def test_an_out_folder_linked_to_nothing_is_said_as_that_by_doctor_dry_run_and_sweep(
    tmp_path: Path, link: str
) -> None:
    """--out naming a symbolic link to nothing (or in a loop): `dvfs doctor` said "usable" and
    the dry run planned it, then the sweep failed "cannot use OUT as the output folder (OUT):
    File exists; a file is in the way of that folder", of no file. Each says what it is, once;
    the `mkdir -p` said for a link to nothing, run as said, lets the sweep write through it."""
    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)
    out = tmp_path / "out"
    target = tmp_path / "gone" / "run"
    out.symlink_to(target if link == "to-nothing" else out)
    words = "which does not exist" if link == "to-nothing" else "leads back to itself"
    swept = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    assert swept.exit_code == 1, swept.output
    [line] = swept.stderr.splitlines()
    assert line.startswith(f"Error: cannot use {out} as the output folder: it is a symbolic "), line
    assert words in line and "in the way" not in line and f"({out})" not in line, line
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    checked = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert doctor.exit_code == 1 and checked["output folder"]["status"] == "fail", checked
    assert checked["output folder"]["detail"] == line.removeprefix("Error: ")
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate")
    assert dry.exit_code == 0, dry.output
    assert "sweep would stop" in dry.output and words in " ".join(dry.output.split())
    assert not (tmp_path / "gone").exists() and os.path.islink(out)
    if link == "to-nothing":
        said = line.split("(mkdir -p ", 1)[1].split("), or remove", 1)[0]
        subprocess.run(["mkdir", "-p", *shlex.split(said)], check=True)
        swept = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
        assert swept.exit_code == 0, swept.output
        assert (target / "cube.nc").is_file() and os.path.islink(out)


@pytest.mark.parametrize("where", ["on-the-way", "lock"])
def test_an_out_folder_behind_a_link_loop_is_refused_by_doctor_dry_run_and_sweep_alike(
    tmp_path: Path, where: str
) -> None:
    """--out LOOP/run (a symbolic link in a loop on the way to it), or a folder whose
    sweep.lock is a link in a loop: `exists()` is False there, so the folder above was probed,
    doctor said "usable" and the dry run nothing, while the sweep refused it. Each says the
    sweep's line (a loop on the way: "point it at the folder", not at a file)."""
    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    if where == "on-the-way":
        out, words = loop / "run", f"a symbolic link on the way to {loop / 'run'} is in a loop"
    else:
        out, words = tmp_path / "out", "leads back to itself"
        out.mkdir()
        (out / "sweep.lock").symlink_to(out / "sweep.lock")
    swept = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
    assert swept.exit_code == 1, swept.output
    [line] = swept.stderr.splitlines()
    assert line.startswith(f"Error: cannot use {out} as the output folder"), line
    assert words in line, line
    if where == "on-the-way":
        assert "point it at the folder" in line and "Too many levels" not in line, line
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    checked = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert doctor.exit_code == 1 and checked["output folder"]["status"] == "fail", checked
    assert checked["output folder"]["detail"] == line.removeprefix("Error: ")
    dry = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--no-estimate")
    assert dry.exit_code == 0, dry.output
    notes = [" ".join(n.split()) for n in dry.output.splitlines() if n.startswith("note:")]
    [stop] = [n for n in notes if "sweep would stop" in n]
    assert line.removeprefix("Error: ") in stop, stop


def test_an_out_folder_on_a_read_only_mount_is_said_read_only_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An --out folder on a read-only file system: the sweep said "Read-only file system; the
    filesystem is read-only: choose another folder with --out", and an --out that is itself
    the folder failing named it twice ("cannot use OUT as the output folder (OUT)")."""
    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)
    mount = tmp_path / "mnt"
    mount.mkdir()
    from bad_inputs import failing_writes

    _read_only_mount(mount, monkeypatch)
    for out in (mount / "out", mount):
        with failing_writes(mount):
            swept = invoke("sweep", str(campaign), "--out", str(out), "--no-progress")
        assert swept.exit_code == 1, swept.output
        [line] = swept.stderr.splitlines()
        assert line.lower().count("read-only") == 1 and "choose another" in line, line
        assert line.count(f"{out} ") + line.count(f"{out})") == 1, line
    assert list(mount.iterdir()) == []


def test_doctors_fresh_advice_names_the_sweep_that_takes_it(tmp_path: Path) -> None:
    """`dvfs doctor` on a folder holding another campaign's journal said "use --fresh to move
    the old journal aside": the doctor has no --fresh (its command with it: "No such option").
    It names the sweep's command that does, which run as said moves the journal aside."""
    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)
    out = tmp_path / "my out"
    out.mkdir()
    foreign = '{"type":"header","campaign_name":"other"}\n'
    (out / "journal.jsonl").write_text(foreign)
    doctor = invoke("doctor", str(campaign), "--out", str(out), "--json")
    [check] = [c for c in json.loads(doctor.stdout) if c["name"] == "output folder"]
    assert check["status"] == "fail" and "use --fresh" in check["detail"], check
    assert "`dvfs sweep " in check["detail"], check["detail"]  # the doctor's own: refused
    said = check["detail"].split("`dvfs sweep ", 1)[1].split("`", 1)[0]
    argv = ["sweep", *(str(campaign) if a == "CAMPAIGN" else a for a in shlex.split(said))]
    swept = invoke(*argv, "--no-progress")
    assert swept.exit_code == 0, swept.output
    assert (out / "journal.jsonl.1").read_text() == foreign  # moved aside, as the advice said


@pytest.mark.parametrize("out", ["/sys/kernel", "/sys/dvfs-test-out", "/proc/dvfs-test-out"])
def test_an_out_folder_on_the_kernels_file_systems_is_refused_up_front(
    tmp_path: Path, out: str
) -> None:
    """--out under /sys or /proc: as root, `dvfs doctor` said "usable" (root passes every
    permission check there, and no block is short where there are none) and the sweep failed
    later, at its lock ("Permission denied", of root) or making the folder ("No such file or
    directory" under /proc, with no advice). Doctor fails its output folder check, the dry run
    says the sweep would stop, and the sweep refuses, each in the one line that says what
    the place is, making nothing there."""
    if not Path(out).parent.is_dir():
        pytest.skip(f"no {Path(out).parent} here")
    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)
    words = f"cannot use {out} as the output folder: {out[:5].rstrip('/')} is the kernel's"
    doctor = invoke("doctor", str(campaign), "--out", out, "--json")
    checked = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert doctor.exit_code == 1 and checked["output folder"]["status"] == "fail", checked
    detail = checked["output folder"]["detail"]
    assert detail.startswith(words) and detail.endswith("with --out"), detail
    dry = invoke("sweep", str(campaign), "--out", out, "--dry-run", "--no-estimate")
    assert dry.exit_code == 0, dry.output
    assert f"sweep would stop: {detail}" in " ".join(dry.output.split()), dry.output
    swept = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", out, "--no-progress"])
    assert swept.exit_code == 1, swept.output
    [line] = swept.stderr.splitlines()
    assert line == f"Error: {detail}", line
    assert Path(out).exists() == (out == "/sys/kernel")
