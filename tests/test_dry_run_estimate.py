"""`dvfs sweep --dry-run`: the GPU time it prints is what the twin then spends (exactly on a twin
campaign; on a hardware campaign, from its twin stand-in), beside the naive protocol's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import SMALL_CAMPAIGN, replace_block, write

from dvfs.cli import cli
from dvfs.cube import open_cube
from dvfs.dry_run import NAIVE_REPEATS, NAIVE_WINDOW_S
from dvfs.measure.journal import read_records


def spent_s(out: Path) -> float:
    """Cells' gpu_time_total_s plus the sessions' overhead, read from the sweep's own output."""
    with open_cube(out / "cube.nc") as ds:
        cells = float(ds["gpu_time_total_s"].fillna(0.0).sum())
    sessions = [r for r in read_records(out / "journal.jsonl") if r.get("type") == "session"]
    assert sessions and all(s["gpu_time_s"]["total"] > 0 for s in sessions)
    return cells + sum(s["gpu_time_s"]["total"] for s in sessions)


#: SMALL_CAMPAIGN (every trap on) on two clocks and one corpus: 64 cells, still both drafters,
#: both power limits and two repeats; each dry run sweeps the twin, so the smaller the better.
SMALLER = replace_block(
    replace_block(SMALL_CAMPAIGN, "sm_clock = [1980, 1500, 1005]", "sm_clock = [1980, 1005]"),
    'corpora = ["code", "conversation"]',
    'corpora = ["code"]',
)


def test_dry_run_prints_the_gpu_time_the_twin_then_spends(shared_run, tmp_path: Path) -> None:
    campaign = write(tmp_path / "small.toml", SMALLER)  # every trap on
    out = tmp_path / "out"
    dry = CliRunner().invoke(
        cli, ["sweep", str(campaign), "--out", str(out), "--dry-run", "--json"]
    )
    assert dry.exit_code == 0, dry.output
    predicted = json.loads(dry.output)["twin_gpu_s"]
    assert not out.exists()  # the dry run swept into a temporary folder, not --out

    text = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--dry-run"])
    assert text.exit_code == 0, text.output
    assert f"the twin spends {predicted / 3600:.2f} GPU-hours" in text.output

    # The campaign swept for real (once, shared with the hardware test below).
    actual = spent_s(shared_run(SMALLER, "run"))
    assert actual > 0
    assert abs(predicted - actual) <= 1e-3 + 1e-6 * actual, (predicted, actual)


def test_the_estimate_is_of_the_cells_the_folder_has_left(shared_run, tmp_path: Path) -> None:
    """A folder holding some cells: the twin's estimate is what the resumed sweep then spends
    on the cells left (not the whole campaign's); a folder holding every cell has nothing to
    estimate (no twin sweep, 0 h)."""
    from conftest import copy_sweep
    from test_dry_run_folder import _interrupted

    campaign = write(tmp_path / "small.toml", SMALLER)
    done = shared_run(SMALLER, "run")
    finished = dry_json(campaign, "--out", str(done))
    assert (finished["already_done"], finished["remaining"]) == (32, 0), finished
    assert finished["estimate"]["from"] == "closed form" and "twin_gpu_s" not in finished
    assert finished["estimated_hours_on_hardware"] == 0

    begun = copy_sweep(done, tmp_path / "begun")
    _interrupted(begun / "journal.jsonl", 12)
    plan = dry_json(campaign, "--out", str(begun))
    assert (plan["already_done"], plan["remaining"]) == (12, 20), plan
    assert plan["estimate"]["cells_already_done"] == 12
    predicted = plan["twin_gpu_s"]
    text = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(begun), "--dry-run"])
    assert "the 20 of 32 cells left" in " ".join(text.output.split()), text.output

    cells, actual = resumed_spend(campaign, begun)
    assert cells == 20
    assert abs(predicted - actual) <= 1e-3 + 1e-6 * actual, (predicted, actual)


def resumed_spend(campaign: Path, out: Path) -> tuple[int, float]:
    """Resume the sweep of `campaign` in `out`: the cells it measured, and the GPU time it
    spent (its session's overhead and those cells'), read from the journal."""
    resumed = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out)])
    assert resumed.exit_code == 0, resumed.output
    records = read_records(out / "journal.jsonl")
    last = max(i for i, r in enumerate(records) if r.get("type") == "session")
    cells = [r for r in records[last:] if r.get("type") == "cell"]
    spent = records[last]["gpu_time_s"]["total"] + sum(sum(r["gpu_time_s"].values()) for r in cells)
    return len(cells), spent


#: SMALLER with adaptive repeats: groups whose two repeats miss ±5% get a third and a fourth.
ADAPTIVE = replace_block(
    SMALLER, "repeats = 2\n", "repeats = 2\nmax_repeats = 4\nprecision = 0.05\n"
)


def _without_repeats_from(journal: Path, repeat: int) -> None:
    """`journal` without the cell records of repeat `repeat` and later (the extra ones)."""
    kept = [
        line
        for line in journal.read_text(encoding="utf-8").splitlines(keepends=True)
        if json.loads(line)["type"] != "cell" or json.loads(line)["cell"]["repeat"] < repeat
    ]
    journal.write_text("".join(kept), encoding="utf-8")


def test_the_estimate_of_what_is_left_counts_the_extra_repeats_it_asks_for(
    shared_run, tmp_path: Path
) -> None:
    """With max_repeats above repeats, what is left includes the extra repeats of the groups
    whose planned repeats the folder already holds: the estimate is what the resumed sweep then
    spends, extra repeats and all; a folder holding every planned cell but not the extra
    repeats they ask for has those left (not an error about a temporary folder)."""
    from conftest import copy_sweep
    from test_dry_run_folder import _interrupted

    campaign = write(tmp_path / "adaptive.toml", ADAPTIVE)
    done = shared_run(ADAPTIVE, "run")
    extra = [r for r in read_records(done / "journal.jsonl") if r.get("type") == "cell"]
    assert any(r["cell"]["repeat"] >= 2 for r in extra)  # the campaign does ask for them

    begun = copy_sweep(done, tmp_path / "begun")
    _interrupted(begun / "journal.jsonl", 20)
    plan = dry_json(campaign, "--out", str(begun))
    assert (plan["already_done"], plan["remaining"]) == (20, 12), plan
    cells, actual = resumed_spend(campaign, begun)
    assert cells > 12  # extra repeats among them
    assert abs(plan["twin_gpu_s"] - actual) <= 1e-3 + 1e-6 * actual, (plan["twin_gpu_s"], actual)

    planned = copy_sweep(done, tmp_path / "planned")
    _without_repeats_from(planned / "journal.jsonl", 2)
    plan = dry_json(campaign, "--out", str(planned))
    assert (plan["already_done"], plan["remaining"]) == (32, 0), plan
    assert plan["adaptive_repeats"]["extra_to_run_now"] > 0
    text = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(planned), "--dry-run"])
    assert text.exit_code == 0, text.output
    assert "no planned cell (the folder holds them all) and the extra repeats asked for" in (
        " ".join(text.output.split())
    ), text.output
    cells, actual = resumed_spend(campaign, planned)
    assert cells > 0
    assert abs(plan["twin_gpu_s"] - actual) <= 1e-3 + 1e-6 * actual, (plan["twin_gpu_s"], actual)


#: SMALLER as it would be written for real hardware: NVML and SGLang, the GPU named only in
#: the description.
HARDWARE = replace_block(
    replace_block(
        replace_block(
            SMALLER,
            'name = "small"\n',
            'name = "small"\ndescription = "One H100 SXM, Llama-3.1-8B, two drafters"\n',
        ),
        'backend = "twin"\nprofile = "h100-sxm"\n',
        'backend = "nvml"\n',
    ),
    '[engine]\nbackend = "twin"\n',
    '[engine]\nbackend = "sglang"\n',
)


def dry_json(campaign: Path, *args: str) -> dict:
    result = CliRunner().invoke(cli, ["sweep", str(campaign), "--dry-run", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_hardware_dry_run_estimates_what_its_twin_stand_in_then_spends(
    shared_run, tmp_path: Path
) -> None:
    hardware = write(tmp_path / "hw.toml", HARDWARE)
    plan = dry_json(hardware, "--out", str(tmp_path / "nowhere"))
    estimate = plan["estimate"]
    assert estimate["from"] == "twin" and estimate["profile"] == "h100-sxm"
    assert "description" in estimate["profile_from"]
    predicted = plan["twin_gpu_s"]
    assert plan["estimated_hours_on_hardware"] == round(predicted / 3600, 2)
    text = CliRunner().invoke(cli, ["sweep", str(hardware), "--dry-run"])
    assert text.exit_code == 0, text.output
    assert "twin stand-in h100-sxm" in text.output and "closed form" not in text.output

    # The campaign as its twin (SMALLER: the same file with the backends switched by hand),
    # swept for real once and shared with the test above.
    actual = spent_s(shared_run(SMALLER, "run"))
    assert abs(predicted - actual) <= 0.10 * actual, (predicted, actual)


def test_the_naive_protocol_costs_at_least_its_fixed_parts(tmp_path: Path) -> None:
    """Naive: per cell, 3 times a server start (60 s on the twin), the fixed settle and a 5 s
    window, plus warm-up and prefill; dvfs's protocol starts a server once per drafter."""
    campaign = write(tmp_path / "small.toml", SMALL_CAMPAIGN)
    estimate = dry_json(campaign, "--out", str(tmp_path / "nowhere"))["estimate"]
    cells = 3 * 2 * 2 * 2 * 2  # clocks x limits x drafters x batches x corpora (repeats apart)
    fixed = NAIVE_REPEATS * cells * (60.0 + 1.0 + NAIVE_WINDOW_S)
    naive = estimate["naive_gpu_hours"] * 3600
    assert fixed <= naive <= fixed * 1.2
    assert estimate["dvfs_over_naive"] == pytest.approx(estimate["gpu_hours"] * 3600 / naive, 1e-2)
    assert 0 < estimate["window_share"] < 1


def test_twin_names_the_stand_in_and_an_unmatched_gpu_is_one_line(tmp_path: Path) -> None:
    anonymous = write(tmp_path / "anon.toml", HARDWARE.replace("One H100 SXM", "One unnamed GPU"))
    result = CliRunner().invoke(cli, ["sweep", str(anonymous), "--dry-run"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--twin PROFILE" in lines[0] and "h200-sxm" in lines[0]
    assert "Traceback" not in result.output

    plan = dry_json(anonymous, "--twin", "h200-sxm", "--out", str(tmp_path / "nowhere"))
    assert (plan["estimate"]["profile"], plan["estimate"]["profile_from"]) == ("h200-sxm", "--twin")

    closed = dry_json(anonymous, "--no-estimate")
    assert closed["estimate"]["from"] == "closed form" and "twin_gpu_s" not in closed
    assert closed["estimated_hours_on_hardware"] == closed["estimate"]["gpu_hours"] > 0

    bad = CliRunner().invoke(cli, ["sweep", str(anonymous), "--twin", "h100-sxm"])
    assert bad.exit_code == 2 and "--dry-run" in bad.output


def test_a_model_the_twin_does_not_know_says_how_to_estimate_or_not(tmp_path: Path) -> None:
    """A real model with no twin profile: the estimate cannot run, and the one line says the
    two ways on (a stand-in model, or the closed form); each works."""
    text = HARDWARE.replace('model = "llama-3.1-8b"', 'model = "Qwen/Qwen2.5-7B-Instruct"', 1)
    assert text != HARDWARE
    unknown = write(tmp_path / "qwen.toml", text)
    result = CliRunner().invoke(cli, ["sweep", str(unknown), "--dry-run"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output
    assert "engine.twin_model" in lines[0] and "--no-estimate" in lines[0]
    assert dry_json(unknown, "--no-estimate")["estimate"]["from"] == "closed form"
    stand_in = text.replace("[engine]\n", '[engine]\ntwin_model = "llama-3.1-8b"\n', 1)
    named = write(tmp_path / "qwen-as-llama.toml", stand_in)
    assert dry_json(named, "--out", str(tmp_path / "nowhere"))["estimate"]["from"] == "twin"


def test_the_estimate_reads_the_cube_in_memory_as_the_file_gives_it(tmp_path: Path) -> None:
    """`twin_estimate` reads the sweep's cube as the sweep holds it, not the file back: every
    number it takes from the cube is the same, to the bit, from the file the sweep wrote."""
    from conftest import TINY

    from dvfs.campaign import load_campaign
    from dvfs.dry_run import naive_gpu_s, spent_gpu_s, twin_estimate
    from dvfs.sweep import run_sweep

    campaign = load_campaign(write(tmp_path / "tiny.toml", TINY))
    out = tmp_path / "out"
    held = run_sweep(campaign, out).cube
    assert held is not None
    on_disk = open_cube(out / "cube.nc")
    for name in ("gpu_time_total_s", "gpu_time_window_s"):
        assert float(held[name].fillna(0.0).sum()) == float(on_disk[name].fillna(0.0).sum())
    assert int(held["gpu_time_total_s"].notnull().sum()) > 0
    assert spent_gpu_s(out, held) == spent_gpu_s(out) == spent_s(out)
    assert naive_gpu_s(held, campaign) == naive_gpu_s(on_disk, campaign) > 0
    # The twin in virtual time sweeps alike each time: the estimate is the folder's numbers.
    estimate = twin_estimate(campaign)
    assert estimate.dvfs_gpu_s == spent_gpu_s(out)
    assert estimate.naive_gpu_s == naive_gpu_s(on_disk, campaign)
    assert estimate.cells == int(on_disk["gpu_time_total_s"].notnull().sum())
    assert estimate.window_s == float(on_disk["gpu_time_window_s"].fillna(0.0).sum())


def test_a_fleet_mixing_models_estimates_the_model_with_the_most_left(
    tiny_exact_run, tmp_path: Path
) -> None:
    """A fleet mixing GPU models, begun: each model's journal has its own cells left, and the
    estimate is of the model with the most left, as its line says (the counts say 19 to run
    in all); its resumed sweep then spends that."""
    from conftest import MIXED_FLEET, TINY_EXACT, copy_sweep
    from test_dry_run_folder import _interrupted

    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)
    begun = copy_sweep(tiny_exact_run("mixed"), tmp_path / "begun")
    first, second = sorted(begun.glob("gpu-*/journal.jsonl"))
    _interrupted(first, 3)
    _interrupted(second, 10)
    args = ("sweep", str(campaign), *MIXED_FLEET, "--out", str(begun), "--dry-run")
    plan = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)
    assert (plan["already_done"], plan["remaining"]) == (13, 19), plan
    text = CliRunner().invoke(cli, list(args))
    assert text.exit_code == 0, text.output
    said = " ".join(text.output.split())
    assert "on the 13 of 16 cells left of one GPU model (the one with the most left)" in said, said
    resumed = CliRunner().invoke(cli, list(args[:-1]))
    assert resumed.exit_code == 0, resumed.output
    records = read_records(first)
    last = max(i for i, r in enumerate(records) if r.get("type") == "session")
    cells = [r for r in records[last:] if r.get("type") == "cell"]
    assert len(cells) == 13
    actual = records[last]["gpu_time_s"]["total"] + sum(
        sum(r["gpu_time_s"].values()) for r in cells
    )
    assert abs(plan["twin_gpu_s"] - actual) <= 1e-3 + 1e-6 * actual, (plan["twin_gpu_s"], actual)


def test_a_large_estimate_off_a_terminal_says_first_what_it_does_and_how_to_skip_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no bar is drawn (stderr not a terminal, as here), a dry run whose estimate sweeps
    the twin over many cells said nothing for minutes: it says so in one line on stderr before
    it starts, with --no-estimate; a small one, or --no-estimate, says nothing of it. (The
    threshold is lowered to this campaign's size: the twin sweep of a real large grid is
    slow.)"""
    import dvfs.cli.progress

    campaign = write(tmp_path / "small.toml", SMALLER)
    args = ["sweep", str(campaign), "--out", str(tmp_path / "nowhere"), "--dry-run", "--json"]
    cells = json.loads(CliRunner().invoke(cli, [*args, "--no-estimate"]).stdout)["cells"]

    def run(at: int, *extra: str) -> tuple[str, str]:
        monkeypatch.setattr(dvfs.cli.progress, "LARGE_ESTIMATE_CELLS", at, raising=False)
        result = CliRunner().invoke(cli, [*args, *extra])
        assert result.exit_code == 0, result.output
        json.loads(result.stdout)  # the JSON on stdout stays whole
        return " ".join(result.stderr.split()), result.stdout

    said, _ = run(cells)
    assert f"estimating the GPU time by sweeping the twin over {cells} cells" in said, said
    assert "pass --no-estimate to skip it" in said
    assert "--no-estimate" not in run(cells + 1)[0]
    assert "--no-estimate" not in run(cells, "--no-estimate")[0]


def test_a_campaign_of_server_groups_is_estimated_on_one_group_s_server(tmp_path: Path) -> None:
    """`gpu.devices = [[0, 1], [2, 3]]` is two servers of two GPUs, each cell on one of them:
    the estimate swept every cell on one server of all four GPUs (tensor parallel 4), whose
    windows are shorter than the sweep's (here a window share of 3.2% for 4.7%)."""
    tp2 = replace_block(
        replace_block(SMALLER, 'profile = "h100-sxm"', 'profile = "h100-sxm:none"'),
        'model = "llama-3.1-8b"',
        'model = "llama-3.1-8b"\ntp_size = 2',
    )
    estimates = []
    for name, devices in (("one", "[0, 1]"), ("two", "[[0, 1], [2, 3]]")):
        campaign = write(
            tmp_path / f"{name}.toml", replace_block(tp2, "devices = [0]", f"devices = {devices}")
        )
        dry = CliRunner().invoke(
            cli, ["sweep", str(campaign), "--out", str(tmp_path / name), "--dry-run", "--json"]
        )
        assert dry.exit_code == 0, dry.output
        estimates.append(json.loads(dry.output)["estimate"])
    one, two = estimates
    # The same windows, of one group's server (rounded figures: within 1%, where a server of
    # all four GPUs gave about 30% less); two's GPU time counts each group's own server
    # starts on top (`test_fleet_pairing`), so its share of windows is smaller.
    windows = [e["window_share"] * e["gpu_hours"] for e in (one, two)]
    assert windows[1] == pytest.approx(windows[0], rel=0.01)
    assert two["gpu_hours"] > one["gpu_hours"]
    assert two["naive_gpu_hours"] == one["naive_gpu_hours"]


def _never_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Listing the campaign's cells fails the test: a refusal must come from counting them."""
    import dvfs.fleet.shard

    def listed(campaign):  # type: ignore[no-untyped-def]
        raise AssertionError("the cells were listed one by one")

    monkeypatch.setattr(dvfs.fleet.shard, "plan_cells", listed)


def test_a_dry_run_of_the_most_repeats_a_campaign_may_ask_is_refused_uncounted_cell_by_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A campaign of 1,048,576 repeats (the validator's most) passes validation, and `dvfs
    sweep --dry-run` listed every one of its millions of cells (then swept the twin over
    them): minutes, then out of memory. The dry run counts them first and is refused in one
    line (exit 2) naming the count and what to change, with or without the estimate, as is
    `dvfs doctor`'s shard and (a fleet's) output folder check a warning, nothing listed."""
    from dvfs.campaign.validate import MOST_REPEATS

    small = write(tmp_path / "small.toml", SMALLER)  # 2 repeats, listed
    listed = ["sweep", str(small), "--out", str(tmp_path / "out"), "--dry-run", "--no-estimate"]
    per = json.loads(CliRunner().invoke(cli, [*listed, "--json"]).stdout)["cells"] // 2
    text = replace_block(SMALLER, "repeats = 2", f"repeats = {MOST_REPEATS}")
    campaign = write(tmp_path / "huge.toml", text)
    _never_listed(monkeypatch)
    out = str(tmp_path / "out")
    for extra in ([], ["--no-estimate"], ["--no-estimate", "--json"], ["--shard", "1/2"]):
        result = CliRunner().invoke(
            cli, ["sweep", str(campaign), "--out", out, "--dry-run", *extra]
        )
        assert result.exit_code == 2, (extra, result.output)
        [line] = result.stderr.splitlines()
        assert f"plans {per * MOST_REPEATS:,} cells ({MOST_REPEATS:,} repeats of {per}): " in line
        assert "more than a dry run lists (" in line and " at most); plan " in line, line
        assert "fewer measurement.repeats" in line and "Traceback" not in result.output, line
    doctor = CliRunner().invoke(cli, ["doctor", str(campaign), "--shard", "1/2", "--json"])
    assert doctor.exit_code == 0, doctor.output
    said = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert said["shard"]["status"] == "warn", said["shard"]
    assert "more than doctor lists" in said["shard"]["detail"], said["shard"]


def test_an_estimate_over_more_cells_than_it_sweeps_promptly_gives_the_closed_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The twin estimate sweeps each planned cell in turn: tens of thousands took minutes and
    GiBs. Above `MOST_ESTIMATED_CELLS` (lowered here to this campaign's size) the dry run
    plans it with the closed form's figure, as --no-estimate does, saying why (it was refused,
    a user asking for a plan told to ask again); at the bound the twin estimates it."""
    import dvfs.measure.plan

    campaign = write(tmp_path / "small.toml", SMALLER)
    args = ["sweep", str(campaign), "--out", str(tmp_path / "nowhere"), "--dry-run"]
    rough = json.loads(CliRunner().invoke(cli, [*args, "--json", "--no-estimate"]).stdout)
    cells = rough["cells"]
    monkeypatch.setattr(dvfs.measure.plan, "MOST_ESTIMATED_CELLS", cells - 1, raising=False)
    planned = CliRunner().invoke(cli, [*args, "--json"])
    assert planned.exit_code == 0, planned.output
    estimate = json.loads(planned.stdout)["estimate"]
    assert (
        estimate["from"] == "closed form"
        and estimate["gpu_hours"] == rough["estimate"]["gpu_hours"]
    )
    assert f"{cells:,} cells are more than it sweeps promptly" in estimate["twin_skipped"]
    said = CliRunner().invoke(cli, args)
    text = " ".join(said.stdout.split())
    assert said.exit_code == 0 and "(closed form)" in text, said.output
    assert "note: the twin estimate sweeps each planned cell in turn" in text, text
    monkeypatch.setattr(dvfs.measure.plan, "MOST_ESTIMATED_CELLS", cells, raising=False)
    estimate = json.loads(CliRunner().invoke(cli, [*args, "--json"]).stdout)["estimate"]
    assert estimate["from"] == "twin" and "twin_skipped" not in estimate
