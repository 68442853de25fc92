"""`dvfs sweep --shard i/n` and `dvfs cube merge` of the shards: the whole campaign, dealt out
in whole comparison groups so that the arms of a comparison share a shard's GPU."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner, Result
from conftest import (
    MIXED_FLEET,
    TINY,
    TINY_EXACT,
    copy_sweep,
    folder_files,
    made_once,
    replace_block,
    write,
)
from fleet_rerun_support import ADAPTIVE
from fleet_support import assert_same_cells, fleet_campaign
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.campaign import load_campaign
from dvfs.cli import cli
from dvfs.cube import STATUS_MISSING, STATUS_OK, merge_cubes, open_cube, write_cube
from dvfs.errors import CampaignError
from dvfs.fleet.queue import group_of
from dvfs.fleet.shard import Shard, planned_cells, server_starts
from dvfs.measure.journal import read_records
from dvfs.measure.plan import Cell, plan_cells
from dvfs.out_folder import LOCK_NAME

#: The fleet campaign on two clocks and one power limit (48 cells, 8 comparison groups of 6):
#: interleaved repeats, three drafters for the server starts; the whole is swept seven times
#: over below. The groups, not their size, are what is dealt.
CAMPAIGN = replace_block(
    replace_block(
        fleet_campaign("shardy", repeats=2),
        "sm_clock = [1980, 1410, 1005]",
        "sm_clock = [1980, 1005]",
    ),
    "power_limit = [700, 350]",
    "power_limit = [700]",
)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The campaign whole, and as three shards, each in its own folder: made once per session
    (`made_once`: the xdist workers share it), read-only (a test that reruns into one of the
    folders works on `copy_sweep` of it)."""
    return made_once(tmp_path_factory, "shards-runs", _make_runs)


def _make_runs(root: Path) -> None:
    """`runs`' folders: the campaign as `shardy.toml`, swept whole and as three shards."""
    campaign = write(root / "shardy.toml", CAMPAIGN)
    assert (
        invoke("sweep", str(campaign), "--out", str(root / "whole"), "--no-progress").exit_code == 0
    )
    for i in range(3):
        out = root / f"s{i}"
        result = invoke(
            "sweep", str(campaign), "--shard", f"{i}/3", "--out", str(out), "--no-progress"
        )
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize("older", [0, 1])
def test_shards_with_one_of_an_older_dvfs_say_no_session_count(
    older: int, runs: Path, tmp_path: Path
) -> None:
    """Shards of which one an older dvfs wrote, with no `sessions`: merged, the count said the
    other shards' (2 of the 3 runs, as if the older one ran none) where that shard came
    second, and 'not recorded' where it came first. Either way it is not recorded."""
    paths = []
    for i in range(3):
        ds = open_cube(runs / f"s{i}" / "cube.nc").load()
        if i == older:
            del ds.attrs["sessions"]
        paths.append(write_cube(ds, tmp_path / f"s{i}.nc"))
    merged = tmp_path / "merged.nc"
    result = invoke("cube", "merge", *map(str, paths), "-o", str(merged))
    assert result.exit_code == 0, result.output
    info = invoke("cube", "info", str(merged), "--json")
    assert json.loads(info.stdout)["sessions"] is None, info.stdout


@pytest.mark.parametrize(
    ("key", "values", "said"),
    [
        ("ecc_mode", ("on", "off"), "ecc_mode: 'on' -> 'off'"),
        ("vbios_version", ("96.00.99.00.01", "96.00.AA.00.02"), "vbios_version: '96.00.99.00.01'"),
        ("engine_version", ("0.5.9", "0.5.23"), "engine_version: '0.5.9' -> '0.5.23'"),
    ],
)
def test_shards_that_differ_where_the_first_shard_records_nothing_do_not_merge(
    key: str, values: tuple[str, str], said: str, runs: Path, tmp_path: Path
) -> None:
    """The first shard written by an earlier dvfs, which recorded no ECC mode (VBIOS, engine
    version): the later shards were each compared with it alone, so two of them that differ
    in it merged silently. Each is compared among every shard that records it."""
    paths = []
    for i in range(3):
        ds = open_cube(runs / f"s{i}" / "cube.nc").load()
        if i == 0:
            ds.attrs.pop(key, None)
        else:
            ds.attrs[key] = values[i - 1]
        paths.append(write_cube(ds, tmp_path / f"s{i}.nc"))
    merged = tmp_path / "merged.nc"
    result = invoke("cube", "merge", *map(str, paths), "-o", str(merged))
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert f"the shards {paths[1]} and {paths[2]} were not run alike" in line, line
    assert said in line, line
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not merged.exists()
    # alike where known: merged, keeping the known value
    paths[2] = write_cube(
        open_cube(paths[2]).load().assign_attrs({key: values[0]}), tmp_path / "s2b.nc"
    )
    result = invoke("cube", "merge", *map(str, paths), "-o", str(merged))
    assert result.exit_code == 0, result.output
    assert open_cube(merged).attrs[key] == values[0]


def test_shards_merged_equal_the_whole_campaign(runs: Path, tmp_path: Path) -> None:
    whole = open_cube(runs / "whole" / "cube.nc")
    shards = [open_cube(runs / f"s{i}" / "cube.nc") for i in range(3)]
    # Each shard measured its share only (8 groups of 6 cells: 3, 3 and 2 of them), and the
    # shares cover the grid once.
    measured = [int((s["cell_status"].values == STATUS_OK).sum()) for s in shards]
    assert sum(measured) == whole["cell_status"].size and measured == [18, 18, 12]
    assert [s.attrs["shard"] for s in shards] == ["0/3", "1/3", "2/3"]
    # Shard folders (their journals) in any order, through the CLI.
    merged = tmp_path / "merged.nc"
    result = invoke(
        "cube", "merge", str(runs / "s2"), str(runs / "s0"), str(runs / "s1"), "-o", str(merged)
    )
    assert result.exit_code == 0, result.output
    combined = open_cube(merged)
    assert "shard" not in combined.attrs and "gpu" not in combined.dims
    assert (combined["cell_status"].values == STATUS_OK).all()
    assert_same_cells(combined, whole)
    assert combined.attrs["campaign_hash"] == whole.attrs["campaign_hash"]
    assert combined.attrs["sessions"] == 3
    assert combined.attrs["arms_on_one_gpu"] == whole.attrs["arms_on_one_gpu"] == 1
    assert combined.attrs["groups_across_gpus"] == 0
    # Shards run on other GPUs (a job array: --gpus per task) merge the same: the shared
    # shard 0/3 (GPU 0) with 1/3 and 2/3 swept again on GPUs 1 and 2.
    spread = sweep_and_merge_shards(runs, tmp_path, "g", [None, "1", "2"])
    assert_same_cells(spread, whole)
    assert len(spread.attrs["gpu_uuids"].split(",")) == 3
    # and counts them as a fleet's cube counts its workers' GPUs: `cube info` said "x1" (the
    # first shard's count) beside the three UUIDs
    assert int(spread.attrs["gpu_count"]) == 3
    said = " ".join(invoke("cube", "info", str(tmp_path / "g.nc")).stdout.split())
    assert f"{spread.attrs['gpu_name']} x3" in said, said
    # Every comparison group ran whole on one shard's GPU, and the merged cube says so.
    assert _gpus_per_group(spread) == {1} and len(set(spread["measured_on"].values.flat)) == 3
    assert spread.attrs["arms_on_one_gpu"] == 1 and spread.attrs["groups_across_gpus"] == 0
    # The shards' cube files merge the same way as their journals.
    again = tmp_path / "again.nc"
    cube_files = [str(runs / f"s{i}" / "cube.nc") for i in range(3)]
    assert invoke("cube", "merge", *cube_files, "-o", str(again)).exit_code == 0
    assert_same_cells(open_cube(again), combined)


def sweep_and_merge_shards(runs: Path, into: Path, name: str, gpus: list[str | None]) -> xr.Dataset:
    """The campaign in `runs` as len(gpus) shards, shard i on `--gpus gpus[i]` in folder
    `into/<name>i`, each run through the CLI, then merged through the CLI: the merged cube.
    A shard whose `gpus[i]` is None is `runs`' own (of three, on GPU 0), not swept again."""
    folders: dict[int, Path] = {}
    for i, spec in enumerate(gpus):
        if spec is None:
            assert len(gpus) == 3, "runs holds shards of three"
            folders[i] = runs / f"s{i}"
            continue
        folders[i] = into / f"{name}{i}"
        result = invoke(
            "sweep",
            str(runs / "shardy.toml"),
            *("--shard", f"{i}/{len(gpus)}", "--gpus", spec),
            *("--out", str(folders[i]), "--no-progress"),
        )
        assert result.exit_code == 0, result.output
    merged = into / f"{name}.nc"
    shards = [str(folders[i]) for i in range(len(gpus))]
    assert invoke("cube", "merge", *shards, "-o", str(merged)).exit_code == 0
    return open_cube(merged)


def _gpus_per_group(cube: xr.Dataset) -> set[int]:
    """How many GPU groups measured the cells of each comparison group (batch, corpus,
    repeat), as a set over the groups."""
    on = cube["measured_on"].transpose("batch", "corpus", "repeat", ...).values
    ok = cube["cell_status"].transpose("batch", "corpus", "repeat", ...).values == STATUS_OK
    return {len({str(g) for g in on[i][ok[i]]}) for i in np.ndindex(on.shape[:3])}


def test_each_shard_starts_one_server_per_drafter_and_records_its_groups(runs: Path) -> None:
    campaign = load_campaign(runs / "shardy.toml")
    for i in range(3):
        records = read_records(runs / f"s{i}" / "journal.jsonl")
        assert records[1] == {"type": "shard", "index": i, "count": 3, "deal": "groups"}
        servers = [r for r in records if r["type"] == "server"]
        mine = planned_cells(campaign, Shard(i, 3))
        # Whole groups hold every drafter: one server each, not one per slice of a drafter.
        assert len(servers) == server_starts(mine) == len(campaign.drafters)
        measured = {group_of(Cell.from_dict(r["cell"])) for r in records if r["type"] == "cell"}
        assert measured == {group_of(c) for c in mine}


def test_merging_refuses_what_is_not_one_runs_shards(runs: Path, tmp_path: Path) -> None:
    def merge(*paths: Path) -> Result:
        return invoke("cube", "merge", *map(str, paths), "-o", str(tmp_path / "x.nc"))

    s0, s1, s2 = (runs / f"s{i}" for i in range(3))
    missing = merge(s0, s2)
    assert missing.exit_code == 2 and "shard(s) 1/3 missing" in missing.output
    twice = merge(s0, s0, s1, s2)
    assert twice.exit_code == 2 and "shard 0/3 is given twice" in twice.output
    mixed = merge(s0, runs / "whole")
    assert mixed.exit_code == 2 and "is a shard but" in mixed.output
    # A shard of an edited campaign: the reason names the setting that changed.
    edited = write(
        tmp_path / "edited.toml",
        replace_block(CAMPAIGN, "output_tokens = 48", "output_tokens = 40"),
    )
    other = tmp_path / "other"
    assert (
        invoke(
            "sweep", str(edited), "--shard", "1/3", "--out", str(other), "--no-progress"
        ).exit_code
        == 0
    )
    different = merge(s0, other, s2)
    assert different.exit_code == 2
    assert (
        "different campaigns" in different.output
        and "workload.output_tokens: 48 -> 40" in different.output
    )
    # Shards of another count.
    recount = tmp_path / "recount"
    assert (
        invoke(
            "sweep",
            str(runs / "shardy.toml"),
            "--shard",
            "1/2",
            "--out",
            str(recount),
            "--no-progress",
        ).exit_code
        == 0
    )
    counts = merge(s0, recount)
    assert counts.exit_code == 2 and "share their count" in counts.output
    # Overlapping cells: the whole cube passed off as shard 1/2 next to shard 0/2.
    fake = open_cube(runs / "whole" / "cube.nc").copy()
    fake.attrs.update(shard="0/2", shard_deal="groups")
    write_cube(fake, tmp_path / "fake.nc")
    overlap = merge(tmp_path / "fake.nc", recount)
    assert overlap.exit_code == 2 and "is in both" in overlap.output
    for result in (missing, twice, mixed, different, counts, overlap):
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_shard_stopped_before_it_measured_is_named_by_the_merge(
    runs: Path, tmp_path: Path
) -> None:
    """A shard killed before its first session (its GPU checks, its first server's start)
    left a journal of its header and shard record: the merge's refusal named no journal
    ('the journal has no measurement session yet') among the shards given."""
    s1 = copy_sweep(runs / "s1", tmp_path / "s1")
    journal = s1 / "journal.jsonl"
    kept = [r for r in read_records(journal) if r["type"] in ("header", "shard")]
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    (s1 / "cube.nc").unlink()
    result = CliRunner().invoke(
        cli,
        [
            "cube",
            "merge",
            str(runs / "s0"),
            str(s1),
            str(runs / "s2"),
            "-o",
            str(tmp_path / "x.nc"),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    [line] = result.output.strip().splitlines()
    assert str(journal) in line and "no measurement session" in line
    assert "dvfs sweep" in line


def test_a_folder_keeps_its_shard(runs: Path, tmp_path: Path) -> None:
    """A folder holding another shard, or the whole campaign, is the wrong --out: refused before
    anything is measured, exit 2 (invalid input, as a shard dealt otherwise), in one line, by
    the sweep and its dry run alike; the refused sweep leaves the folder as it found it (one
    gathered from a node without its `sweep.lock` once kept the refused run's)."""
    from test_journal import assert_one_line_error

    campaign = str(runs / "shardy.toml")
    # Copies: the last run below rewrites its folder's cube (the shared runs stay as they are).
    s0, whole_run = (
        copy_sweep(runs / "s0", tmp_path / "s0"),
        copy_sweep(runs / "whole", tmp_path / "whole"),
    )
    (s0 / LOCK_NAME).unlink()  # copied back from its node without the lock
    found = {out: folder_files(out) for out in (s0, whole_run)}
    other = invoke("sweep", campaign, "--shard", "2/3", "--out", str(s0), "--no-progress")
    assert_one_line_error(
        other, 2, "holds shard 0/3 of this campaign, but this run is shard 2/3", "its own --out"
    )
    whole = invoke("sweep", campaign, "--out", str(s0), "--no-progress")
    assert_one_line_error(whole, 2, "no --shard")
    sharded = invoke("sweep", campaign, "--shard", "0/3", "--out", str(whole_run), "--no-progress")
    assert_one_line_error(sharded, 2, "holds the whole campaign")
    assert {out: folder_files(out) for out in (s0, whole_run)} == found
    for shard, out, says in (
        ("2/3", s0, "holds shard 0/3 of this campaign"),
        ("0/3", whole_run, "holds the whole campaign"),
    ):
        dry = invoke("sweep", campaign, "--shard", shard, "--out", str(out), "--dry-run", "--json")
        doc = json.loads(dry.output)
        assert dry.exit_code == 2 and any(says in p for p in doc["problems"])
        # The folder's cells are not this run's to skip (the whole campaign holds all of
        # shard 0/3's): none is counted as done or to run.
        assert (doc["already_done"], doc["remaining"], doc["out_refused"]) == (None, None, True)
    into_whole = ("--shard", "0/3", "--out", str(whole_run), "--no-estimate")
    text = invoke("sweep", campaign, *into_whole, "--dry-run")
    assert text.exit_code == 2 and "already done" not in text.output
    assert "none counted as done or to run: the sweep would refuse this --out folder" in " ".join(
        text.output.split()
    )
    # Rerunning a finished shard skips its cells.
    again = invoke("sweep", campaign, "--shard", "0/3", "--out", str(s0), "--no-progress")
    assert again.exit_code == 0 and "0 cell(s) measured" in again.output


def test_shard_dry_run_counts_the_slice_and_bad_specs_are_usage_errors(runs: Path) -> None:
    campaign = str(runs / "shardy.toml")

    def dry(*args: str) -> dict:  # type: ignore[type-arg]
        nowhere = str(runs / "nowhere")
        return json.loads(
            invoke("sweep", campaign, "--dry-run", "--json", *args, "--out", nowhere).output
        )

    # The twin estimate (a sweep of the stand-in) for the last shard only: its cells alone.
    whole = dry("--no-estimate")
    parts = [dry("--shard", f"{i}/3", *(("--no-estimate",) if i < 2 else ())) for i in range(3)]
    assert parts[2]["estimate"]["from"] == "twin"
    assert parts[2]["estimate"]["cells_measured"] == parts[2]["cells"] == 12
    assert sum(p["cells"] for p in parts) == whole["cells"]
    assert sum(p["comparison_groups"] for p in parts) == whole["comparison_groups"] == 8
    assert [p["server_starts"] for p in parts] == [3, 3, 3] and whole["server_starts"] == 3
    assert [p["shard"] for p in parts] == ["0/3", "1/3", "2/3"] and "shard" not in whole
    text = invoke(
        "sweep", campaign, "--dry-run", "--no-estimate", "--shard", "2/3", "--out", "nowhere"
    ).output
    assert "shard 2/3: only its 2 comparison group(s) are counted, each whole" in " ".join(
        text.split()
    )
    for bad in ("3/3", "1/0", "x", "-1/2", "1/2/3"):
        result = CliRunner().invoke(cli, ["sweep", campaign, "--shard", bad, "--dry-run"])
        assert result.exit_code == 2, (bad, result.output)
        assert "--shard" in result.output


@st.composite
def grids(draw: st.DrawFn) -> list[Cell]:
    """Cells in measuring order (drafters, repeats, knob settings, corpora, batches) of a random
    grid; sometimes with cells left out, so groups differ in size."""
    drafters = [f"d{i}" for i in range(draw(st.integers(1, 4)))]
    settings = [(1980 - 100 * i, None) for i in range(draw(st.integers(1, 4)))]
    corpora = ["code", "conversation", "math"][: draw(st.integers(1, 3))]
    batches = [1, 8, 32, 64][: draw(st.integers(1, 4))]
    repeats = draw(st.integers(1, 4))
    cells = [
        Cell(d, r, clock, limit, b, c)
        for d in drafters
        for r in range(repeats)
        for clock, limit in (settings if r % 2 == 0 else settings[::-1])
        for c in corpora
        for b in batches
    ]
    if draw(st.booleans()):
        kept = draw(st.lists(st.booleans(), min_size=len(cells), max_size=len(cells)))
        cells = [c for c, k in zip(cells, kept, strict=True) if k] or cells[:1]
    return cells


@settings(max_examples=300, deadline=None)
@given(grids(), st.booleans(), st.data())
def test_shards_deal_whole_groups_balanced_and_in_measuring_order(
    cells: list[Cell], repeats_together: bool, data: st.DataObject
) -> None:
    def unit(cell: Cell) -> tuple:
        return group_of(cell)[:2] if repeats_together else group_of(cell)

    sizes: dict[tuple, int] = {}
    for cell in cells:
        sizes[unit(cell)] = sizes.get(unit(cell), 0) + 1
    n = data.draw(st.integers(1, len(sizes) + 2), label="n")
    if n > len(sizes):  # some shard would be empty: every index is refused, naming the limit
        index = data.draw(st.integers(0, n - 1), label="index")
        with pytest.raises(CampaignError, match=f"has {len(sizes)} .* at most {len(sizes)} "):
            Shard(index, n).select(cells, repeats_together=repeats_together)
        return
    slices = [Shard(i, n).select(cells, repeats_together=repeats_together) for i in range(n)]
    # A partition: every cell in exactly one shard.
    assert sorted(c for s in slices for c in s) == sorted(cells)
    # No comparison group (nor, with repeats together, batch and corpus) in two shards.
    owner: dict[tuple, int] = {}
    for i, part in enumerate(slices):
        for cell in part:
            assert owner.setdefault(group_of(cell), i) == i, f"{group_of(cell)} split"
            assert owner.setdefault(unit(cell), i) == i, f"{unit(cell)} split"
    # Balanced within one dealt unit's cells; none empty.
    counts = [len(s) for s in slices]
    assert min(counts) > 0 and max(counts) - min(counts) <= max(sizes.values())
    # Measuring order within each shard (so drafter-major: one server per drafter it holds).
    rank = {c: i for i, c in enumerate(cells)}
    for part in slices:
        assert [rank[c] for c in part] == sorted(rank[c] for c in part)
        assert server_starts(part) == len({c.drafter for c in part})
    # Deterministic: the same cells deal the same way.
    assert Shard(n - 1, n).select(list(cells), repeats_together=repeats_together) == slices[-1]
    assert all(Shard.parse(f" {i} / {n} ") == Shard(i, n) for i in range(n))


def test_more_shards_than_comparison_groups_is_refused_before_a_journal_is_made(
    tmp_path: Path,
) -> None:
    """A shard with no group could never be merged with the others (its journal would hold no
    session): `--shard i/n` with n above the comparison groups is refused, whatever i, dry run
    included, naming the group count and the largest n."""
    from test_journal import assert_one_line_error

    campaign = write(tmp_path / "tiny.toml", TINY)
    loaded = load_campaign(campaign)
    assert loaded.measurement.max_repeats == loaded.measurement.repeats
    groups = len({group_of(c) for c in plan_cells(loaded)})
    assert groups < len(plan_cells(loaded))  # the limit is the groups, not the cells
    for i in (0, groups):
        for extra in (("--out", str(tmp_path / "out"), "--no-progress"), ("--dry-run",)):
            result = invoke("sweep", str(campaign), "--shard", f"{i}/{groups + 1}", *extra)
            assert_one_line_error(
                result, 2, f"has {groups} comparison groups", f"at most {groups} shards"
            )
    assert not (tmp_path / "out").exists()  # nor the folder (it once kept its sweep.lock)
    # `dvfs doctor` of that shard fails it as the sweep refuses it, exit 2 (it once passed)
    for n, code in ((groups + 1, 2), (groups, 0)):
        doctor = invoke("doctor", str(campaign), "--shard", f"0/{n}", "--json")
        assert doctor.exit_code == code, doctor.output
        failed = [c["detail"] for c in json.loads(doctor.output) if c["status"] == "fail"]
        if code:
            assert len(failed) == 1 and f"at most {groups} shards" in failed[0], failed
        else:
            assert failed == [], failed
    # (no estimate: a sweep of the twin stand-in, which this check does not read)
    last = invoke(
        "sweep", str(campaign), "--shard", f"{groups - 1}/{groups}", "--dry-run", "--no-estimate"
    )
    assert last.exit_code == 0, last.output


def test_a_refused_shard_leaves_no_folder_in_the_way_of_the_merge(
    runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's recipe merges `out/C/shard-*`: a shard run refused before it measured
    (here one of more shards than comparison groups, into its default folder) once left that
    folder, holding only its `sweep.lock`, and the merge of the shards then failed on it (no
    cube there)."""
    monkeypatch.chdir(tmp_path)
    shards = Path("out") / "shardy"
    for i in range(3):
        copy_sweep(runs / f"s{i}", shards / f"shard-{i}-of-3")
    campaign = runs / "shardy.toml"
    groups = len({group_of(c) for c in plan_cells(load_campaign(campaign))})
    refused = invoke("sweep", str(campaign), "--shard", f"0/{groups + 1}", "--no-progress")
    assert refused.exit_code == 2 and "comparison groups" in refused.output, refused.output
    assert sorted(p.name for p in shards.iterdir()) == [f"shard-{i}-of-3" for i in range(3)]
    folders = [str(p) for p in sorted(shards.glob("shard-*"))]
    merged = invoke("cube", "merge", *folders, "-o", "merged.nc")
    assert merged.exit_code == 0, merged.output
    assert_same_cells(open_cube(Path("merged.nc")), open_cube(runs / "whole" / "cube.nc"))


def test_adaptive_repeats_stay_in_the_shard_of_their_batch_and_corpus(
    shared_run, tmp_path: Path
) -> None:
    """With max_repeats, a shard decides further repeats from its own journal, so every repeat
    of a batch and corpus is dealt to one shard: the merged shards equal the whole campaign,
    further repeats included (four shards of contiguous cells lost most of them; two do
    too, and each shard more costs a sweep's cube and the merge a read of it)."""
    campaign = write(tmp_path / "adaptive.toml", ADAPTIVE)
    whole = shared_run(ADAPTIVE, "one")  # the whole campaign, shared with test_fleet_modes.py
    for i in range(2):
        out = str(tmp_path / f"s{i}")
        result = invoke("sweep", str(campaign), "--shard", f"{i}/2", "--out", out, "--no-progress")
        assert result.exit_code == 0, result.output
    merged = tmp_path / "merged.nc"
    shards = [str(tmp_path / f"s{i}") for i in range(2)]
    result = invoke("cube", "merge", *shards, "-o", str(merged))
    assert result.exit_code == 0, result.output
    full, combined = open_cube(whole / "cube.nc"), open_cube(merged)
    added = int((full["cell_status"].sel(repeat=slice(2, None)).values == STATUS_OK).sum())
    assert added > 0, "the whole campaign added repeats"
    assert_same_cells(combined, full)
    assert combined.attrs["arms_on_one_gpu"] == 1
    # Rerunning a shard adds nothing: its repeats were decided from its own journal.
    again = invoke("sweep", str(campaign), "--shard", "1/2", "--out", shards[1], "--no-progress")
    assert again.exit_code == 0 and "0 cell(s) measured" in again.output


def test_merged_shards_that_split_a_group_do_not_claim_paired_arms(runs: Path) -> None:
    """Shards cut through the comparison groups (as dvfs cut them before it dealt whole
    groups), on two GPUs: the merged cube says the arms were not kept on one GPU, and counts
    every group whose arms span the two."""
    whole = open_cube(runs / "whole" / "cube.nc").load()
    none = whole["drafter"] == "none"
    first, second = whole.copy(deep=True), whole.copy(deep=True)
    first["cell_status"] = first["cell_status"].where(none, STATUS_MISSING)
    second["cell_status"] = second["cell_status"].where(~none, STATUS_MISSING)
    second = second.assign_coords(
        measured_on=second["measured_on"].copy(
            data=np.full(second["measured_on"].shape, "GPU-elsewhere", dtype=object)
        )
    )
    for k, ds in enumerate((first, second)):
        ds.attrs["shard"] = f"{k}/2"
        assert ds.attrs["arms_on_one_gpu"] == 1
    merged = merge_cubes([first, second], ["first", "second"])
    assert merged.attrs["arms_on_one_gpu"] == 0
    groups = len({group_of(c) for c in plan_cells(load_campaign(runs / "shardy.toml"))})
    assert merged.attrs["groups_across_gpus"] == groups == 8


def test_shards_each_on_a_fleet_of_two_gpus_merge_to_the_whole(runs: Path, tmp_path: Path) -> None:
    """A job array whose tasks each hold two GPUs: every shard's fleet keeps each of its
    groups on one of its GPUs, so the merged shards equal the whole campaign and say the arms
    were paired."""
    cube = sweep_and_merge_shards(runs, tmp_path, "fleet", ["0-1", "2-3"])
    assert_same_cells(cube, open_cube(runs / "whole" / "cube.nc"))
    assert len(set(cube["measured_on"].values.flat)) == 4  # both shards used both their GPUs
    assert _gpus_per_group(cube) == {1}
    assert cube.attrs["arms_on_one_gpu"] == 1 and cube.attrs["groups_across_gpus"] == 0


def test_shards_each_on_a_fleet_mixing_gpu_models_merge_per_model(
    tiny_exact_run, tmp_path: Path
) -> None:
    """Shards each run on an H100 and an H200 (`--gpus 0,h200-sxm:0`) hold a `gpu` axis, one
    entry per model, each model's comparisons apart: merged, they equal the unsharded fleet's
    cube, every group measured on one GPU of each model (a group on two models is not split),
    and nothing else is printed (no numpy warning). Shards on other GPUs of the same models
    (another node) line up by model; shards on other models are refused in one line."""
    campaign = write(tmp_path / "tiny.toml", TINY_EXACT)

    def sweep(out: str, *args: str) -> Path:
        folder = tmp_path / out
        result = invoke("sweep", str(campaign), *args, "--out", str(folder), "--no-progress")
        assert result.exit_code == 0, result.output
        return folder

    # The whole fleet's run and the shards' (also those of tests/test_dry_run_folder.py).
    whole, s0, s1 = (tiny_exact_run(name) for name in ("mixed", "mixed-s0", "mixed-s1"))
    merged = tmp_path / "merged.nc"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning raised in the merge fails it
        result = invoke("cube", "merge", str(s1), str(s0), "-o", str(merged))
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines() == [f"cube: {merged} (2 shards, 2 GPUs)"]
    cube, full = open_cube(merged), open_cube(whole / "cube.nc")
    assert cube.sizes["gpu"] == 2 and "shard" not in cube.attrs
    assert_same_cells(cube, full)
    assert cube.attrs["gpu_names"] == full.attrs["gpu_names"]
    sources, full_sources = (
        json.loads(cube.attrs["merged_from"]),
        json.loads(full.attrs["merged_from"]),
    )
    assert {k: s["gpu_name"] for k, s in sources.items()} == {
        k: s["gpu_name"] for k, s in full_sources.items()
    }
    assert (cube["cell_status"].values == STATUS_OK).all()
    assert cube.attrs["arms_on_one_gpu"] == full.attrs["arms_on_one_gpu"] == 1
    assert cube.attrs["groups_across_gpus"] == full.attrs["groups_across_gpus"] == 0
    for gpu in cube["gpu"].values:
        assert _gpus_per_group(cube.sel(gpu=gpu)) == {1}
    # Shard 1 on another node's GPUs of the same models: each model's entry names both
    # shards' GPUs, and keeps its stock setting (merged_from, keyed by the entry).
    far = sweep("far", "--shard", "1/2", "--gpus", "1,h200-sxm:1")
    spread_path = tmp_path / "spread.nc"
    assert invoke("cube", "merge", str(s0), str(far), "-o", str(spread_path)).exit_code == 0
    spread = open_cube(spread_path)
    labels = [str(g) for g in spread["gpu"].values]
    assert [len(label.split(",")) for label in labels] == [2, 2]
    assert [label.split(",")[0] for label in labels] == [str(g) for g in full["gpu"].values]
    assert sorted(json.loads(spread.attrs["merged_from"])) == sorted(labels)
    assert_same_cells(spread.assign_coords(gpu=full["gpu"].values), full)
    assert spread.attrs["arms_on_one_gpu"] == 1 and spread.attrs["groups_across_gpus"] == 0
    # A shard on one of the models only.
    h100 = tiny_exact_run("s1")
    refused = invoke("cube", "merge", str(s0), str(h100), "-o", str(tmp_path / "x.nc"))
    assert refused.exit_code == 2 and "ran on different GPU models" in refused.output
    assert len(refused.output.strip().splitlines()) == 1, refused.output


def test_a_shard_whose_gpu_model_measured_nothing_yet_is_to_be_resumed_not_rerun(
    tiny_exact_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards run on an H100 and an H200 (`--gpus 0,h200-sxm:0`), shard 1's H200 worker lost
    at its first cell: its folder's cube is the H100's alone (the H200's journal holds no
    session), and `dvfs cube merge` of the shards said they "ran on different GPU models" and
    to run every shard on the same models or the campaign once per model, where they did run
    on the same models and shard 1 is only to be resumed. It says so in one line, and once
    shard 1 is resumed the merge is the whole fleet's."""
    from test_journal import assert_one_line_error

    from dvfs.fleet.worker import Worker

    campaign = str(write(tmp_path / "tiny.toml", TINY_EXACT))
    s0, s1 = tiny_exact_run("mixed-s0"), tmp_path / "s1"
    run = Worker.run

    def lost_at_once(self: Worker, cell: object) -> object:
        if "h200" in self.label:
            raise RuntimeError("the GPU fell off the bus")
        return run(self, cell)

    monkeypatch.setattr(Worker, "run", lost_at_once)
    args = ("sweep", campaign, "--shard", "1/2", *MIXED_FLEET, "--out", str(s1), "--no-progress")
    assert CliRunner().invoke(cli, list(args)).exit_code == 1
    monkeypatch.setattr(Worker, "run", run)
    assert invoke("cube", "build", str(s1)).exit_code == 0
    [h200] = (p for p in s1.glob("gpu-*h200*/journal.jsonl"))
    merged = str(tmp_path / "merged.nc")
    assert_one_line_error(
        invoke("cube", "merge", str(s0), str(s1), "-o", merged),
        2,
        f"cannot merge yet: shard 1/2 ({s1}) has measured nothing on NVIDIA H200 (twin), which "
        f"the other shards measured on ({h200} holds no session yet, so its cube leaves that "
        "model out): resume it with its `dvfs sweep CAMPAIGN --shard 1/2 --out "
        f"{s1}` command again without --fresh, on GPUs of every model, then merge again",
    )
    assert invoke(*args).exit_code == 0
    assert invoke("cube", "merge", str(s0), str(s1), "-o", merged).exit_code == 0
    assert_same_cells(open_cube(merged), open_cube(tiny_exact_run("mixed") / "cube.nc"))


def _mixed_shard_1_h200_left(
    tiny_exact_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, Path, tuple[str, ...]]:
    """Shard 0 of TINY_EXACT on an H100 and an H200 (`mixed-s0`), and shard 1 (in
    tmp_path/s1) whose H200 worker was lost after its first cell, then rerun on the H100 alone
    (`--gpus 0`): its H200 cells left. The two folders and shard 1's sweep arguments (without
    --gpus)."""
    from dvfs.fleet.worker import Worker

    campaign = str(write(tmp_path / "tiny.toml", TINY_EXACT))
    s0, s1 = tiny_exact_run("mixed-s0"), tmp_path / "s1"
    run = Worker.run
    calls = {"n": 0}

    def lost_after_one(self: Worker, cell: object) -> object:
        if "h200" in self.label:
            calls["n"] += 1
            if calls["n"] > 1:
                raise RuntimeError("the GPU fell off the bus")
        return run(self, cell)

    monkeypatch.setattr(Worker, "run", lost_after_one)
    args = ("sweep", campaign, "--shard", "1/2", "--out", str(s1), "--no-progress")
    assert CliRunner().invoke(cli, [*args, *MIXED_FLEET]).exit_code == 1
    monkeypatch.setattr(Worker, "run", run)
    assert invoke(*args, "--gpus", "0").exit_code == 0
    return s0, s1, args


def test_a_mixed_shard_rerun_on_some_models_names_the_models_left_and_its_merge_too(
    tiny_exact_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards run on an H100 and an H200 (`--gpus 0,h200-sxm:0`), shard 1's H200 worker lost
    after its first cell, shard 1 then rerun on the H100 alone (`--gpus 0`): shard 1's cube,
    its H200's own, `dvfs cube merge` of the shards and the merged cube all said to run the
    shard's `dvfs sweep --shard` command again, which (on the H100 alone) measures none of
    the H200's cells left. Each names the model whose GPUs the command's --gpus must name
    (the other shard's cells, missing from shard 1's cube, do not count); the H100's own cube
    of shard 1, whole, names none. Followed, the merge is the whole fleet's."""
    s0, s1, args = _mixed_shard_1_h200_left(tiny_exact_run, tmp_path, monkeypatch)
    named = "its --gpus naming GPUs of NVIDIA H200 (twin): the cells left are on that model"
    h200 = s1 / "gpu-nvidia-h200-twin" / "cube.nc"
    for cube in (s1 / "cube.nc", h200):
        said = " ".join(invoke("headroom", str(cube)).output.split())
        assert f"--shard 1/2` command measures when run again without --fresh, {named}" in said
        info = json.loads(invoke("cube", "info", str(cube), "--json").output)
        assert info.get("models_left") == ["NVIDIA H200 (twin)"], info.get("models_left")
    shown = " ".join(invoke("cube", "info", str(s1)).output.split())
    assert f"without --fresh, {named}" in shown, shown  # its shard row
    h100 = json.loads(
        invoke("cube", "info", str(s1 / "gpu-nvidia-h100-80gb-hbm3-twin"), "--json").output
    )
    assert "models_left" not in h100, h100  # shard 1's H100 cells are all in
    merged = tmp_path / "merged.nc"
    made = invoke("cube", "merge", str(s0), str(s1), "-o", str(merged))
    assert made.exit_code == 0, made.output
    assert f"without --fresh (which starts over), {named}" in " ".join(made.output.split())
    for command in ("headroom", "compare"):
        said = " ".join(invoke(command, str(merged)).output.split())
        assert f"--out {s1}), {named}" in said, said
    info = json.loads(invoke("cube", "info", str(merged), "--json").output)
    assert named in info["resume"] and info.get("models_left") == ["NVIDIA H200 (twin)"], info
    assert invoke(*args, *MIXED_FLEET).exit_code == 0
    whole = invoke("cube", "merge", str(s0), str(s1), "-o", str(merged))
    assert whole.exit_code == 0 and "Note" not in whole.output, whole.output
    assert_same_cells(open_cube(merged), open_cube(tiny_exact_run("mixed") / "cube.nc"))


def test_a_merge_of_the_shards_model_folders_names_the_model_left_as_of_their_cubes(
    tiny_exact_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards of a fleet mixing GPU models, shard 1's H200 cells left after a rerun on the
    H100 alone: `dvfs cube merge` of the shards' H200 folders (gpu-nvidia-h200-twin/, each
    read from its journal) said to run the shards' commands again without naming the H200's
    --gpus (the command then runs on the campaign's GPUs, the H100, refused in that folder),
    where the merge of the same folders' cube files named it. Both name it, in the merge's
    note and the merged cube's advice; the H100's folders, whole, name none."""
    s0, s1, _ = _mixed_shard_1_h200_left(tiny_exact_run, tmp_path, monkeypatch)
    named = "its --gpus naming GPUs of NVIDIA H200 (twin): the cells left are on that model"
    for tail in ("", "cube.nc"):
        parts = [str(s / "gpu-nvidia-h200-twin" / tail).rstrip("/") for s in (s0, s1)]
        merged = tmp_path / "h200.nc"
        made = invoke("cube", "merge", *parts, "-o", str(merged))
        assert made.exit_code == 0, made.output
        assert f"(which starts over), {named}" in " ".join(made.output.split()), made.output
        info = json.loads(invoke("cube", "info", str(merged), "--json").output)
        assert info.get("models_left") == ["NVIDIA H200 (twin)"], (tail, info.get("models_left"))
        assert named in info["resume"], info["resume"]
        h100 = [str(s / "gpu-nvidia-h100-80gb-hbm3-twin" / tail).rstrip("/") for s in (s0, s1)]
        made = invoke("cube", "merge", *h100, "-o", str(tmp_path / "h100.nc"))
        assert made.exit_code == 0 and "Note" not in made.output, made.output


def test_a_shards_model_folder_moved_elsewhere_still_names_the_model_left(
    tiny_exact_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shards' H200 folders of a fleet mixing GPU models moved out of their shard folders
    under other names (to merge that model's shards): `dvfs cube merge` of them, read from
    their journals, said to run the shards' commands again without the H200's --gpus (a
    journal was a model's by its folder's name alone), and `dvfs cube build` of one wrote a
    cube that named none either. The cube the sweep wrote beside the journal says whose it
    is: both name the model, as in place."""
    import shutil

    s0, s1, _ = _mixed_shard_1_h200_left(tiny_exact_run, tmp_path, monkeypatch)
    named = "its --gpus naming GPUs of NVIDIA H200 (twin): the cells left are on that model"
    moved = []
    for i, shard in enumerate((s0, s1)):
        moved.append(tmp_path / f"h200-shard-{i}")
        shutil.copytree(shard / "gpu-nvidia-h200-twin", moved[-1])
    shutil.rmtree(s1 / "gpu-nvidia-h200-twin")
    merged = tmp_path / "h200.nc"
    made = invoke("cube", "merge", *map(str, moved), "-o", str(merged))
    assert made.exit_code == 0, made.output
    assert f"(which starts over), {named}" in " ".join(made.output.split()), made.output
    info = json.loads(invoke("cube", "info", str(merged), "--json").output)
    assert info.get("models_left") == ["NVIDIA H200 (twin)"] and named in info["resume"], info
    assert invoke("cube", "build", str(moved[1])).exit_code == 0
    info = json.loads(invoke("cube", "info", str(moved[1]), "--json").output)
    assert info.get("models_left") == ["NVIDIA H200 (twin)"], info.get("models_left")


def _begun_by_an_earlier_dvfs(folder: Path, *, cells: int | None = None) -> Path:
    """`folder` as a dvfs before the shard record named its dealing left it: the shard record
    without `deal` (that dvfs cut contiguous slices), and only the first `cells` cell records
    when given (a shard interrupted). Returns its journal."""
    journal = folder / "journal.jsonl"
    kept, seen = [], 0
    for line in journal.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["type"] == "cell":
            seen += 1
            if cells is not None and seen > cells:
                continue
        if record["type"] == "shard":
            record.pop("deal", None)
            line = json.dumps(record, separators=(",", ":"))
        kept.append(line)
    journal.write_text("\n".join(kept) + "\n", encoding="utf-8")
    (folder / "cube.nc").unlink()  # that dvfs's cube: built again from the journal below
    return journal


def test_a_shard_folder_begun_by_an_earlier_dvfs_is_refused_before_anything_is_measured(
    runs: Path, tmp_path: Path
) -> None:
    """A shard folder whose shard record names no dealing was begun by a dvfs that cut
    contiguous slices: this dvfs's share of the same i/n differs, so resuming it (one GPU or a
    fleet, any index) is refused, exit 2, in one line saying why and what to do, the journal
    untouched; --fresh starts the shard over, dealt as whole groups."""
    from test_journal import assert_one_line_error

    folder = copy_sweep(runs / "s0", tmp_path / "old")
    journal = _begun_by_an_earlier_dvfs(folder, cells=5)
    before = journal.read_bytes()
    campaign = str(runs / "shardy.toml")
    for shard, extra in (("0/3", ()), ("0/3", ("--gpus", "0-1")), ("1/3", ())):
        result = invoke(
            "sweep", campaign, "--shard", shard, "--out", str(folder), "--no-progress", *extra
        )
        assert_one_line_error(
            result,
            2,
            f"{folder} holds shard 0/3 begun by an earlier dvfs that cut contiguous slices",
            "finish that folder with the dvfs that began it",
            "rerun every shard of the array with --fresh",
        )
        assert journal.read_bytes() == before
    assert not (folder / "cube.nc").exists()
    # Its dry run says so too, rather than counting the old share's cells as done; and one
    # of another shard's folder names the folder's shard.
    args = ("sweep", campaign, "--shard", "0/3", "--dry-run", "--no-estimate", "--json")
    doc = json.loads(invoke(*args, "--out", str(folder)).output)
    assert any("begun by an earlier dvfs" in p for p in doc["problems"]), doc["problems"]
    assert (doc["already_done"], doc["remaining"], doc["out_refused"]) == (None, None, True)
    dry = invoke(*args[:-1], "--out", str(folder))
    assert dry.exit_code == 2 and "begun by an earlier dvfs" in " ".join(dry.output.split())
    other = ("sweep", campaign, "--shard", "2/3", "--dry-run", "--no-estimate", "--json")
    doc = json.loads(invoke(*other, "--out", str(runs / "s0")).output)
    assert any("holds shard 0/3 of this campaign" in p for p in doc["problems"])
    fresh = invoke(
        "sweep", campaign, "--shard", "0/3", "--out", str(folder), "--no-progress", "--fresh"
    )
    assert fresh.exit_code == 0, fresh.output
    assert read_records(journal)[1] == {"type": "shard", "index": 0, "count": 3, "deal": "groups"}


def test_the_dry_run_refuses_each_gpu_models_folder_as_the_sweep_does(
    tiny_exact_run, tmp_path: Path
) -> None:
    """A shard run on a fleet mixing GPU models journals in `gpu-<model>/`: its dry run looks
    there as the sweep does, so a folder holding another shard (or a whole-campaign run into
    it), one begun by an earlier dvfs, and a damaged shard record are refused by both, with or
    without --gpus, naming the model's folder in the same line and with the same exit code,
    the journals untouched."""
    from test_journal import assert_one_line_error

    campaign = str(write(tmp_path / "tiny.toml", TINY_EXACT))
    fleet = MIXED_FLEET
    s0 = copy_sweep(tiny_exact_run("mixed-s0"), tmp_path / "s0")
    h100, h200 = (p.name for p in sorted(s0.glob("gpu-*")))
    assert not (s0 / "journal.jsonl").exists()
    old = copy_sweep(s0, tmp_path / "old")
    for folder in sorted(old.glob("gpu-*")):
        _begun_by_an_earlier_dvfs(folder)
    damaged = copy_sweep(s0, tmp_path / "damaged") / h200 / "journal.jsonl"
    records = read_records(damaged)
    records[1] = {**records[1], "index": "x"}
    damaged.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    cases = (
        ("1/2", s0, 2, f"{s0 / h100} holds shard 0/2 of this campaign, but this run is shard 1/2"),
        (None, s0, 2, f"{s0 / h100} holds shard 0/2 of this campaign, but this run is the whole"),
        ("0/2", old, 2, f"{old / h100} holds shard 0/2 begun by an earlier dvfs"),
        ("0/2", damaged.parent.parent, 1, f"{damaged} has a damaged shard record"),
    )
    for shard, out, code, says in cases:
        journals = {p: p.read_bytes() for p in out.glob("gpu-*/journal.jsonl")}
        for gpus in ((), fleet):
            args = ("sweep", campaign, *(("--shard", shard) if shard else ()), *gpus)
            args += ("--out", str(out))
            line = assert_one_line_error(invoke(*args, "--no-progress"), code, says)
            dry = invoke(*args, "--dry-run", "--no-estimate", "--json")
            if code == 1:  # not a plan's problem: the one line the sweep prints
                assert assert_one_line_error(dry, 1, says) == line
                continue
            assert dry.exit_code == code, dry.output
            doc = json.loads(dry.output)
            problems = doc["problems"]
            assert any(line.endswith(p) for p in problems), (line, problems)
            assert doc["already_done"] is None and doc["out_refused"]
            assert len(problems) == 2 and str(out / h200) in problems[1]
        assert {p: p.read_bytes() for p in out.glob("gpu-*/journal.jsonl")} == journals
    # The damaged record's refusal names the shard's own command to start over with (it said
    # `dvfs sweep --fresh`, which would sweep the whole campaign into the shard's folder): the
    # run's shard, or I/N where no run names one (`cube build`), and the sweep's folder (the
    # one above the model's journal: without --out, a shard sweeps into its default folder,
    # leaving the damaged journal as it is)
    folder = damaged.parent.parent
    refused = invoke("sweep", campaign, "--shard", "0/2", "--out", str(folder))
    assert_one_line_error(refused, 1, f"`dvfs sweep CAMPAIGN --shard 0/2 --out {folder} --fresh`")
    built = invoke("cube", "build", str(folder))
    assert_one_line_error(built, 1, f"`dvfs sweep CAMPAIGN --shard I/N --out {folder} --fresh`")
    # --fresh, which both refusals of the earlier dvfs's folder and the damaged record advise,
    # moves each model's journal aside (and the merged cube), and starts the shard over.
    for out in (old, damaged.parent.parent):
        journals = {p: p.read_bytes() for p in out.glob("gpu-*/journal.jsonl")}
        cube = (out / "cube.nc").read_bytes()
        args = ("sweep", campaign, "--shard", "0/2", *fleet, "--out", str(out), "--no-progress")
        result = invoke(*args, "--fresh")
        assert result.exit_code == 0, result.output
        assert (out / "cube.nc.1").read_bytes() == cube
        for journal, before in journals.items():
            assert journal.with_name("journal.jsonl.1").read_bytes() == before
            assert read_records(journal)[1] == Shard(0, 2).to_json()


def test_shards_dealt_differently_refuse_to_merge_and_old_sets_still_merge(
    runs: Path, tmp_path: Path
) -> None:
    """Shards of an earlier dvfs (contiguous slices; no dealing on their record or cube) next
    to shards dealt as whole groups are refused, journals and cube files alike, in one line
    naming the two dealings (not another count); a set of the earlier dvfs's shards alone
    merges as it did."""
    old = [copy_sweep(runs / f"s{i}", tmp_path / f"old{i}") for i in range(3)]
    for folder in old:
        _begun_by_an_earlier_dvfs(folder)
    new = [runs / f"s{i}" for i in range(3)]
    assert open_cube(new[0] / "cube.nc").attrs["shard_deal"] == "groups"

    def merge(*paths: Path) -> Result:
        return invoke("cube", "merge", *map(str, paths), "-o", str(tmp_path / "x.nc"))

    journals = merge(old[0], new[1], new[2])
    cube_files = tmp_path / "old0.nc"
    stripped = open_cube(new[0] / "cube.nc").load()
    del stripped.attrs["shard_deal"]  # a cube file of the earlier dvfs: its shard alone
    write_cube(stripped, cube_files)
    files = merge(cube_files, *(s / "cube.nc" for s in new[1:]))
    # Given in another order, they are named in shard order all the same (0/3, then 1/3).
    shuffled = merge(new[2], new[1], old[0])
    shuffled_files = merge(new[2] / "cube.nc", cube_files, new[1] / "cube.nc")
    for result, first, second in (
        (journals, old[0] / "journal.jsonl", new[1] / "journal.jsonl"),
        (files, cube_files, new[1] / "cube.nc"),
        (shuffled, old[0] / "journal.jsonl", new[1] / "journal.jsonl"),
        (shuffled_files, cube_files, new[1] / "cube.nc"),
    ):
        assert result.exit_code == 2
        assert len(result.output.strip().splitlines()) == 1, result.output
        assert (
            f"cannot merge: the shards were dealt differently ({first}: contiguous slices, by "
            f"an earlier dvfs; {second}: whole comparison groups)"
        ) in result.output, result.output
        assert "another count" not in result.output
    # The earlier dvfs's shards on their own merge as before (here: the same cells).
    merged = tmp_path / "old.nc"
    result = invoke("cube", "merge", *map(str, old), "-o", str(merged))
    assert result.exit_code == 0, result.output
    assert_same_cells(open_cube(merged), open_cube(runs / "whole" / "cube.nc"))
    assert "shard_deal" not in open_cube(merged).attrs


#: Cell variables a later dvfs added to the cube (`dvfs.cube.schema`'s history).
LATER_VARIABLES = (
    "window_tokens",
    "energy_split_method",
    "energy_draft_j",
    "time_draft_s",
    "prompt_tokens",
)


@pytest.mark.parametrize("older", [0, 2])
def test_a_shards_cube_of_an_older_dvfs_merges_keeping_the_others_later_variables(
    runs: Path, tmp_path: Path, older: int
) -> None:
    """One shard's cube written by an older dvfs (without the later variables) merges with the
    others' in shard order: as a later shard it was an internal error, as the first the others'
    later variables were dropped (and without its attention backends, an internal error in
    either place). They are kept, the older shard's cells holding none of them (NaN; energy
    split method 0, none)."""
    files = [runs / f"s{i}" / "cube.nc" for i in range(3)]
    stripped = tmp_path / "older.nc"  # nor the drafters' attention backends, recorded since
    write_cube(open_cube(files[older]).drop_vars([*LATER_VARIABLES, "attention_backend"]), stripped)
    files[older] = stripped
    merged = tmp_path / "m.nc"
    result = CliRunner().invoke(cli, ["cube", "merge", *map(str, files), "-o", str(merged)])
    assert result.exit_code == 0, result.output
    cube, whole = open_cube(merged), open_cube(runs / "whole" / "cube.nc")
    assert (cube["cell_status"] == STATUS_OK).all()
    for i in range(3):
        shard = open_cube(runs / f"s{i}" / "cube.nc")
        own = shard["cell_status"] == STATUS_OK
        for name in LATER_VARIABLES:
            assert str(cube[name].attrs) == str(whole[name].attrs), name
            assert cube[name].dtype == whole[name].dtype, name
            if i != older:  # each other shard's cells hold its own values
                np.testing.assert_array_equal(
                    cube[name].where(own).values, shard[name].where(own).values, str((i, name))
                )
        if i == older:
            assert (cube["energy_split_method"].where(own, 0) == 0).all()
            assert cube["window_tokens"].where(own).isnull().all()
    # The twin's servers name no kernels (SGLang's shards naming some would be refused: the
    # older shard's are unknown).
    backends = cube["attention_backend"]
    assert list(backends.values) == list(whole["attention_backend"].values)
    assert str(backends.attrs) == str(whole["attention_backend"].attrs)


def test_a_shards_cube_rebuilt_by_cube_build_keeps_its_shard(runs: Path, tmp_path: Path) -> None:
    """`dvfs cube build` of a shard's folder writes the cube the sweep wrote: marked with its
    shard and dealing, so the rebuilt cube files merge into the whole campaign as the sweep's
    do (unmarked, they would be three cubes of the same GPU's grid)."""
    rebuilt = []
    for i in range(3):
        folder = copy_sweep(runs / f"s{i}", tmp_path / f"s{i}")
        (folder / "cube.nc").unlink()
        result = invoke("cube", "build", str(folder))
        assert result.exit_code == 0, result.output
        cube, swept = open_cube(folder / "cube.nc"), open_cube(runs / f"s{i}" / "cube.nc")
        assert (cube.attrs["shard"], cube.attrs["shard_deal"]) == (
            f"{i}/3",
            "groups",
        )
        assert cube.attrs["shard"] == swept.attrs["shard"]
        rebuilt.append(str(folder / "cube.nc"))
    merged = tmp_path / "merged.nc"
    result = invoke("cube", "merge", *rebuilt, "-o", str(merged))
    assert result.exit_code == 0, result.output
    assert_same_cells(open_cube(merged), open_cube(runs / "whole" / "cube.nc"))


def test_a_run_of_one_shard_merges_alone_and_one_shard_of_several_is_refused(
    runs: Path, tmp_path: Path
) -> None:
    """A job array of one task (`--shard 0/1`): its one cube is all the shards, so `cube merge`
    of it (the README's `cube merge out/C/shard-* -o ...` recipe) gives the whole campaign;
    one shard of three alone is bad usage (exit 2), naming the shard."""
    only = tmp_path / "only"
    result = invoke(
        "sweep", str(runs / "shardy.toml"), "--shard", "0/1", "--out", str(only), "--no-progress"
    )
    assert result.exit_code == 0, result.output
    merged = tmp_path / "merged.nc"
    result = invoke("cube", "merge", str(only / "cube.nc"), "-o", str(merged))
    assert result.exit_code == 0, result.output
    assert_same_cells(open_cube(merged), open_cube(runs / "whole" / "cube.nc"))
    one_of_three = CliRunner().invoke(
        cli, ["cube", "merge", str(runs / "s1" / "cube.nc"), "-o", str(tmp_path / "m.nc")]
    )
    assert one_of_three.exit_code == 2 and "Traceback" not in one_of_three.output
    assert "at least two cubes, or all the shards of a run; got one cube holding shard 1/3" in (
        one_of_three.output
    )


def test_shard_cube_reads_the_shard_as_recorded_shard_does(runs: Path, tmp_path: Path) -> None:
    """`shard_cube` takes the shard record while it builds the cube (one reading of the
    journal): the mark is `recorded_shard`'s, the first shard record's where a journal holds
    two, the cube otherwise `build_cube`'s, and a damaged record refused as before."""
    from dvfs.cube import build_cube
    from dvfs.errors import JournalError
    from dvfs.fleet.shard_journal import recorded_shard, shard_cube

    journal = runs / "s1" / "journal.jsonl"
    cube = shard_cube(journal)
    recorded = recorded_shard(journal)
    assert recorded is not None and recorded.label == "1/3"
    assert (cube.attrs["shard"], cube.attrs["shard_deal"]) == (recorded.label, recorded.deal)
    plain = build_cube(journal)
    assert "shard" not in plain.attrs
    xr.testing.assert_identical(cube.drop_attrs(deep=False), plain.drop_attrs(deep=False))
    assert shard_cube(runs / "whole" / "journal.jsonl").attrs.get("shard") is None

    lines = journal.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if json.loads(line)["type"] == "shard")
    other = json.loads(lines[at]) | {"index": 2}
    twice = write(tmp_path / "twice.jsonl", "".join([*lines, json.dumps(other) + "\n"]))
    assert shard_cube(twice).attrs["shard"] == "1/3" and recorded_shard(twice) == recorded
    damaged = json.loads(lines[at])
    del damaged["index"]
    bad = write(
        tmp_path / "bad.jsonl", "".join([*lines[:at], json.dumps(damaged) + "\n", *lines[at + 1 :]])
    )
    for read in (recorded_shard, shard_cube):
        with pytest.raises(JournalError, match="damaged shard record"):
            read(bad)


def test_a_shards_cube_says_the_other_shards_cells_are_not_its_to_resume(runs: Path) -> None:
    """A finished shard's cube lacks the other shards' cells: `cube info`, headroom and the
    report say it is a shard's cube and to merge the shards, not only "run the same `dvfs
    sweep` command again", which would measure nothing."""
    from dvfs.report.facts import measured_section
    from dvfs.report.model import Paragraph

    folder = runs / "s1"
    info = " ".join(invoke("cube", "info", str(folder)).stdout.split())
    assert "this is shard 1/3's cube: the other shards' cells count as missing here" in info
    assert "dvfs cube merge" in info
    # its own cells left: the exact command, its shard named (it said `dvfs sweep --shard`)
    assert "its `dvfs sweep CAMPAIGN --shard 1/3` command measures when run again" in info
    assert json.loads(invoke("cube", "info", str(folder), "--json").stdout)["shard"] == "1/3"
    said = " ".join(invoke("headroom", str(folder)).stdout.split())
    partial = said[said.index("partial cube:") :]
    assert "this is shard 1/3's cube" in partial, said
    assert "run the same `dvfs sweep` command again" not in partial
    warnings = [
        b.text for b in measured_section(open_cube(folder)).blocks if isinstance(b, Paragraph)
    ]
    assert any(w.startswith("This is shard 1/3's cube") for w in warnings), warnings
    whole = " ".join(invoke("cube", "info", str(runs / "whole")).stdout.split())
    assert "shard " not in whole and "shard's cube" not in whole


def test_compare_on_one_shard_says_its_cells_left_are_not_measured_here(runs: Path) -> None:
    """A finished shard's cube lacks the other shards' cells: `dvfs compare`'s partial-cube
    line said they were "not measured yet" (as of an interrupted sweep), where headroom and
    the report say "not measured here" (another shard's). It says "here" too, with the
    shard's note; the whole campaign's cube has no partial line."""
    said = " ".join(invoke("compare", str(runs / "s1")).output.split())
    partial = said[said.index("partial cube:") :]
    assert re.match(r"partial cube: \d+ of \d+ cells not measured here \(", partial), partial
    assert "this is shard 1/3's cube" in partial, partial
    headroom = " ".join(invoke("headroom", str(runs / "s1")).output.split())
    count = re.search(r"partial cube: (\d+ of \d+ cells not measured here)", headroom)
    assert count and count[1] in partial, (headroom, partial)
    assert "partial cube:" not in " ".join(invoke("compare", str(runs / "whole")).output.split())


def test_headroom_on_one_shard_says_to_merge_not_to_resume(runs: Path) -> None:
    """One shard's cube lacks the other shards' cells: `dvfs headroom` on it says to merge the
    shards, not to run the same `dvfs sweep` command again (which measures nothing more for a
    finished shard); the whole campaign's cube says nothing of shards."""
    text = " ".join(invoke("headroom", str(runs / "s0"), "--slack", "5%").output.split())
    assert "this is shard 0/3's cube" in text and "dvfs cube merge" in text
    assert "run the same `dvfs sweep` command again" not in text
    doc = json.loads(invoke("headroom", str(runs / "s0"), "--json").stdout)
    assert doc["shard"] == "0/3"
    whole = json.loads(invoke("headroom", str(runs / "whole"), "--json").stdout)
    assert "shard" not in whole


@pytest.mark.usefixtures("unsaved_figures")
def test_no_answer_advice_on_shard_cubes_names_the_shard_commands(
    runs: Path, tmp_path: Path
) -> None:
    """A row without a reference in one shard's cube (the reference is another shard's), or in
    a cube merged from shards one of which is unfinished: the report's findings and caps and
    `dvfs cap plan` said "resume the sweep: run the same `dvfs sweep` command again", which
    measures nothing there (the shard's own command cannot measure another shard's cells; a
    resumed shard does not change the merged cube); they name `dvfs sweep --shard` and `dvfs
    cube merge` (with each shard's folder for a merged cube)."""
    from dvfs.report.reasons import no_answer

    old = "resume the sweep: run the same `dvfs sweep` command again"

    def advice(cube: Path) -> tuple[str, str, list[dict]]:
        """The report's text, `cap plan`'s refusals, and the headroom rows without answer."""
        report = invoke("report", str(cube), "-o", str(tmp_path / "r.md"))
        assert report.exit_code == 0, report.output
        doc = json.loads(invoke("headroom", str(cube), "--json").stdout)
        write(tmp_path / "h.json", json.dumps(doc))
        resumable = ("not measured yet", "none feasible so far")
        missing = [
            r
            for r in doc["rows"]
            if not r["feasible"] and (r["target_ms"] is None or no_answer(r) in resumable)
        ]
        refusals = [
            invoke(
                "cap",
                "plan",
                str(tmp_path / "h.json"),
                "--batch",
                str(r["batch"]),
                "--drafter",
                r["drafter"],
            ).output
            for r in missing[:1]
        ]
        text = " ".join((tmp_path / "r.md").read_text().replace("\\", "").split())
        return text, " ".join(" ".join(refusals).split()), missing

    text, refused, missing = advice(runs / "s0")
    assert missing, "shard 0/3's cube has rows whose reference another shard holds"
    assert "No valid reference cell (not measured yet)" in text
    for said in (text, refused):
        assert old not in said, said
        assert "`dvfs sweep CAMPAIGN --shard I/3` (shard 0/3's again" in said, said
        assert "dvfs cube merge" in said

    # Shard 1/3 interrupted before its first cell was in: the merged cube lacks its cells.
    folders = [copy_sweep(runs / f"s{i}", tmp_path / f"s{i}") for i in range(3)]
    lines = (folders[1] / "journal.jsonl").read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line).get("type") != "cell"]
    (folders[1] / "journal.jsonl").write_text("".join(kept))
    assert invoke("cube", "build", str(folders[1])).exit_code == 0
    merged = tmp_path / "merged.nc"
    assert invoke("cube", "merge", *map(str, folders), "-o", str(merged)).exit_code == 0
    text, refused, missing = advice(merged)
    assert missing and "not measured yet" in text
    # `cube info` gives the advice `dvfs headroom` gives (it said only "6 missing")
    said = " ".join(invoke("cube", "info", str(merged)).stdout.split())
    assert "resume this cube is merged from 3 shards" in said, said
    assert "then `dvfs cube merge` them again" in said, said
    resume = json.loads(invoke("cube", "info", str(merged), "--json").stdout)["resume"]
    assert f"--shard 1/3 --out {folders[1]}" in resume, resume
    for said in (text, refused):
        assert old not in said, said
        assert f"--shard 1/3 --out {folders[1]}" in said, said
        assert "then `dvfs cube merge` them again" in said
