"""`dvfs sweep --shard i/n` and `dvfs cube merge` of the shards: the whole campaign, sliced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from conftest import replace_block, write
from fleet_support import assert_same_cells, fleet_campaign
from hypothesis import given
from hypothesis import strategies as st

from dvfs.campaign import load_campaign
from dvfs.cli import cli
from dvfs.cube import STATUS_OK, open_cube, write_cube
from dvfs.errors import CampaignError
from dvfs.fleet.shard import Shard, server_starts
from dvfs.measure.journal import read_records
from dvfs.measure.plan import Cell, plan_cells

#: The fleet campaign on two clocks (96 cells): interleaved repeats for the slices to cut
#: between, three drafters for the server starts; the whole is swept seven times over below.
CAMPAIGN = replace_block(
    fleet_campaign("shardy", repeats=2), "sm_clock = [1980, 1410, 1005]", "sm_clock = [1980, 1005]"
)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The campaign whole, and as three shards, each in its own folder."""
    root = tmp_path_factory.mktemp("shards")
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
    return root


def test_shards_merged_equal_the_whole_campaign(runs: Path) -> None:
    whole = open_cube(runs / "whole" / "cube.nc")
    shards = [open_cube(runs / f"s{i}" / "cube.nc") for i in range(3)]
    # Each shard measured its slice only, and the slices cover the grid once.
    measured = [int((s["cell_status"].values == STATUS_OK).sum()) for s in shards]
    assert sum(measured) == whole["cell_status"].size and min(measured) > 0
    assert [s.attrs["shard"] for s in shards] == ["0/3", "1/3", "2/3"]
    # Shard folders (their journals) in any order, through the CLI.
    merged = runs / "merged.nc"
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
    # Shards run on other GPUs (a job array: --gpus per task) merge the same.
    for i in range(3):
        moved = invoke(
            "sweep",
            str(runs / "shardy.toml"),
            "--shard",
            f"{i}/3",
            "--gpus",
            str(i + 1),
            "--out",
            str(runs / f"g{i}"),
            "--no-progress",
        )
        assert moved.exit_code == 0, moved.output
    elsewhere = runs / "elsewhere.nc"
    on_gpus = [str(runs / f"g{i}") for i in range(3)]
    assert invoke("cube", "merge", *on_gpus, "-o", str(elsewhere)).exit_code == 0
    spread = open_cube(elsewhere)
    assert_same_cells(spread, whole)
    assert len(spread.attrs["gpu_uuids"].split(",")) == 3
    # The shards' cube files merge the same way as their journals.
    again = runs / "again.nc"
    cube_files = [str(runs / f"s{i}" / "cube.nc") for i in range(3)]
    assert invoke("cube", "merge", *cube_files, "-o", str(again)).exit_code == 0
    assert_same_cells(open_cube(again), combined)


def test_each_shard_starts_few_servers_and_records_its_slice(runs: Path) -> None:
    campaign = load_campaign(runs / "shardy.toml")
    cells = plan_cells(campaign)
    started = 0
    for i in range(3):
        records = read_records(runs / f"s{i}" / "journal.jsonl")
        assert records[1] == {"type": "shard", "index": i, "count": 3}
        servers = [r for r in records if r["type"] == "server"]
        assert len(servers) == server_starts(Shard(i, 3).select(cells))
        started += len(servers)
    assert started <= len(campaign.drafters) + 3 - 1


def test_merging_refuses_what_is_not_one_runs_shards(runs: Path, tmp_path: Path) -> None:
    def merge(*paths: Path) -> Result:
        return invoke("cube", "merge", *map(str, paths), "-o", str(tmp_path / "x.nc"))

    s0, s1, s2 = (runs / f"s{i}" for i in range(3))
    missing = merge(s0, s2)
    assert missing.exit_code == 1 and "shard(s) 1/3 missing" in missing.output
    twice = merge(s0, s0, s1, s2)
    assert twice.exit_code == 1 and "shard 0/3 is given twice" in twice.output
    mixed = merge(s0, runs / "whole")
    assert mixed.exit_code == 1 and "is a shard but" in mixed.output
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
    assert different.exit_code == 1
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
    assert counts.exit_code == 1 and "share their count" in counts.output
    # Overlapping cells: the whole cube passed off as shard 1/2 next to shard 0/2.
    fake = open_cube(runs / "whole" / "cube.nc").copy()
    fake.attrs["shard"] = "0/2"
    write_cube(fake, tmp_path / "fake.nc")
    overlap = merge(tmp_path / "fake.nc", recount)
    assert overlap.exit_code == 1 and "is in both" in overlap.output
    for result in (missing, twice, mixed, different, counts, overlap):
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_folder_keeps_its_shard(runs: Path, tmp_path: Path) -> None:
    campaign = str(runs / "shardy.toml")
    other = invoke("sweep", campaign, "--shard", "2/3", "--out", str(runs / "s0"), "--no-progress")
    assert other.exit_code == 1
    assert "holds shard 0/3 of this campaign, but this run is shard 2/3" in other.output
    whole = invoke("sweep", campaign, "--out", str(runs / "s0"), "--no-progress")
    assert whole.exit_code == 1 and "no --shard" in whole.output
    sharded = invoke(
        "sweep", campaign, "--shard", "0/3", "--out", str(runs / "whole"), "--no-progress"
    )
    assert sharded.exit_code == 1 and "holds the whole campaign" in sharded.output
    # Rerunning a finished shard skips its cells.
    again = invoke("sweep", campaign, "--shard", "0/3", "--out", str(runs / "s0"), "--no-progress")
    assert again.exit_code == 0 and "0 cell(s) measured" in again.output


def test_shard_dry_run_counts_the_slice_and_bad_specs_are_usage_errors(runs: Path) -> None:
    campaign = str(runs / "shardy.toml")
    whole = json.loads(
        invoke("sweep", campaign, "--dry-run", "--json", "--out", str(runs / "nowhere")).output
    )
    parts = [
        json.loads(
            invoke(
                "sweep",
                campaign,
                "--dry-run",
                "--json",
                "--shard",
                f"{i}/3",
                "--out",
                str(runs / "nowhere"),
            ).output
        )
        for i in range(3)
    ]
    assert sum(p["cells"] for p in parts) == whole["cells"]
    assert [p["shard"] for p in parts] == ["0/3", "1/3", "2/3"] and "shard" not in whole
    for bad in ("3/3", "1/0", "x", "-1/2", "1/2/3"):
        result = CliRunner().invoke(cli, ["sweep", campaign, "--shard", bad, "--dry-run"])
        assert result.exit_code == 2, (bad, result.output)
        assert "--shard" in result.output


def _cells(drafters: int, per: int) -> list[Cell]:
    return [Cell(f"d{d}", 0, None, None, b, "code") for d in range(drafters) for b in range(per)]


@given(st.integers(1, 6), st.integers(1, 40), st.integers(1, 12))
def test_shards_partition_the_cells_in_order_and_balanced(drafters: int, per: int, n: int) -> None:
    cells = _cells(drafters, per)
    if n > len(cells):  # some shard would be empty: every shard of n is refused or not
        empty = [
            i
            for i in range(n)
            if Shard(i, n).bounds(len(cells))[0] == Shard(i, n).bounds(len(cells))[1]
        ]
        assert empty
        with pytest.raises(CampaignError, match="has no cells"):
            Shard(empty[0], n).select(cells)
        return
    slices = [Shard(i, n).select(cells) for i in range(n)]
    assert [c for s in slices for c in s] == cells  # every cell once, in measuring order
    assert max(map(len, slices)) - min(map(len, slices)) <= 1
    # Contiguous slices: each cut adds at most one server start to the whole campaign's.
    assert sum(server_starts(s) for s in slices) <= drafters + n - 1
    assert all(Shard.parse(f" {i} / {n} ") == Shard(i, n) for i in range(n))


def test_more_shards_than_cells_is_refused_before_a_journal_is_made(tmp_path: Path) -> None:
    """A shard with no cells could never be merged with the others (its journal would hold no
    session): `--shard i/n` with n above the cell count is a usage error, dry run included."""
    from conftest import TINY
    from test_journal import assert_one_line_error

    campaign = write(tmp_path / "tiny.toml", TINY)
    cells = len(plan_cells(load_campaign(campaign)))
    for extra in (("--out", str(tmp_path / "out"), "--no-progress"), ("--dry-run",)):
        result = invoke("sweep", str(campaign), "--shard", f"0/{cells + 1}", *extra)
        assert_one_line_error(result, 2, "has no cells", f"at most {cells} shards")
    assert not (tmp_path / "out" / "journal.jsonl").exists()
    last = invoke("sweep", str(campaign), "--shard", f"{cells - 1}/{cells}", "--dry-run")
    assert last.exit_code == 0, last.output
