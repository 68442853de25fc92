"""A window shorter than the energy counter's update period sees no update: the cell is flagged
`counter_stalled`, and the advice the sweep gives for it must be the one that clears it (longer
outputs), not only a driver check that finds nothing wrong; end to end through the CLI on the
twin, whose counter updates every 100 ms as NVML's does."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner
from conftest import SMALL_CAMPAIGN, replace_block, write

from dvfs.cli import cli
from dvfs.cube.quality import invalidates

#: SMALL_CAMPAIGN cut to two cells whose two-token outputs leave a window of one decode step
#: (a few ms), far shorter than the twin counter's 100 ms update period.
TWO_TOKENS = replace_block(
    replace_block(
        replace_block(
            replace_block(
                SMALL_CAMPAIGN,
                "sm_clock = [1980, 1500, 1005]\npower_limit = [700, 300]",
                "sm_clock = [1980]",
            ),
            "batch = [1, 8]",
            "batch = [1]",
        ),
        'corpora = ["code", "conversation"]',
        'corpora = ["code"]',
    ),
    "output_tokens = 64",
    "output_tokens = 2",
)


def test_a_counter_stalled_by_a_short_window_says_to_lengthen_it(tmp_path: Path) -> None:
    campaign = write(tmp_path / "short.toml", TWO_TOKENS)
    result = CliRunner().invoke(
        cli,
        ["sweep", str(campaign), "--out", str(tmp_path / "out"), "--no-progress"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    # the invalid cells' flags, each with its advice: "(flag xN: advice; flag xN: advice ...)"
    notes = dict(
        re.findall(r"([a-z_]+) x\d+: (.*?)(?=; [a-z_]+ x\d+: |; \d+ more flag|\)\;)", text)
    )
    assert "workload.output_tokens" in notes["counter_stalled"], notes


def test_cube_info_gives_the_advice_for_every_flag_the_sweep_leaves_to_it(
    tmp_path: Path,
) -> None:
    """The sweep's closing line gives the advice for the two commonest invalidating flags and
    says "N more flag(s) in `dvfs cube info`", but `dvfs cube info` named those flags with no
    advice at all (its notes held the warnings' alone): it now gives every flag's, in its text
    and its --json `flag_notes`."""
    campaign = write(tmp_path / "short.toml", TWO_TOKENS)
    out = tmp_path / "out"
    runner = CliRunner()
    swept = runner.invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    assert swept.exit_code == 0, swept.output
    assert "more flag(s) in `dvfs cube info`" in " ".join(swept.output.split())
    doc = json.loads(runner.invoke(cli, ["cube", "info", str(out), "--json"]).output)
    invalidating = [name for name in doc["quality_flags"] if invalidates(name)]
    assert len(invalidating) > 2, doc["quality_flags"]  # more than the sweep's line shows
    for name in invalidating:
        assert doc["flag_notes"].get(name), (name, doc["flag_notes"])
    text = " ".join(runner.invoke(cli, ["cube", "info", str(out)]).output.split())
    for name in invalidating:
        assert f"{name}: {' '.join(doc['flag_notes'][name].split())}" in text, name


def test_a_cube_of_only_invalid_cells_says_to_sweep_again_with_fresh(tmp_path: Path) -> None:
    """Every analysis refused a cube whose cells were all measured and flagged invalid with
    "... then rerun `dvfs sweep`", which measures none of them again (0 cells measured, every
    one already done): the refusal now says to change the campaign as `dvfs cube info`
    advises and sweep again with --fresh (or into another folder)."""
    campaign = write(tmp_path / "short.toml", TWO_TOKENS)
    out = tmp_path / "out"
    runner = CliRunner()
    sweep = ["sweep", str(campaign), "--out", str(out), "--no-progress"]
    assert runner.invoke(cli, sweep).exit_code == 0
    rerun = runner.invoke(cli, sweep)
    assert rerun.exit_code == 0 and "0 cell(s) measured" in rerun.output, rerun.output
    for command in (["headroom"], ["compare"], ["plot", "--out", str(tmp_path / "plots")]):
        refused = runner.invoke(cli, [*command, str(out)])
        assert refused.exit_code == 1, refused.output
        said = " ".join(refused.output.split())
        assert "every cell was measured and flagged invalid" in said, said
        assert "run `dvfs sweep` again with --fresh" in said, said
        assert "rerun `dvfs sweep`" not in said, said


def test_few_samples_advice_clears_the_flag_when_followed(tmp_path: Path) -> None:
    """`few_samples` said "lower measurement.sample_period_s or raise measurement.min_window_s",
    and `dvfs cube info` now shows it for every such cube; but a round's window cannot outlast
    its decode, so with two-token outputs a --fresh sweep at min_window_s = 1 s flags every
    cell few_samples again. The advice says to raise workload.output_tokens with it, which
    clears the flag."""
    runner = CliRunner()

    def flags(text: str, name: str) -> dict[str, int]:
        campaign = write(tmp_path / f"{name}.toml", text)
        out = tmp_path / name
        swept = runner.invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
        assert swept.exit_code == 0, swept.output
        info = runner.invoke(cli, ["cube", "info", str(out), "--json"])
        doc = json.loads(info.stdout)
        if doc["quality_flags"].get("few_samples"):
            advice = " ".join(doc["flag_notes"]["few_samples"].split())
            assert "raise measurement.min_window_s with workload.output_tokens" in advice, advice
        return dict(doc["quality_flags"])

    assert flags(TWO_TOKENS, "short").get("few_samples") == 4
    longer_window = replace_block(TWO_TOKENS, "min_window_s = 0.2", "min_window_s = 1.0")
    assert flags(longer_window, "window").get("few_samples") == 4  # the window alone: no help
    both = replace_block(longer_window, "output_tokens = 2", "output_tokens = 64")
    assert "few_samples" not in flags(both, "both")


def test_a_shards_cube_of_only_invalid_cells_says_to_sweep_each_shard_again_and_merge(
    tmp_path: Path,
) -> None:
    """A shard's cube whose own cells were all measured and flagged was refused with the
    generic "... then rerun `dvfs sweep`" (its other shards' cells count as missing there),
    which measures none of them again; and the cube merged from the shards, with every cell
    flagged, was told to sweep again with --fresh but not to merge again. Each now says to
    sweep every shard again with --fresh and merge them again."""
    campaign = write(tmp_path / "short.toml", TWO_TOKENS)
    runner = CliRunner()
    shards = []
    for label in ("0/2", "1/2"):
        out = tmp_path / f"s{label[0]}"
        sweep = ["sweep", str(campaign), "--shard", label, "--out", str(out), "--no-progress"]
        assert runner.invoke(cli, sweep).exit_code == 0
        shards.append(str(out))
    merged = tmp_path / "merged.nc"
    assert runner.invoke(cli, ["cube", "merge", *shards, "-o", str(merged)]).exit_code == 0

    refused = runner.invoke(cli, ["headroom", shards[0]])
    assert refused.exit_code == 1, refused.output
    said = " ".join(refused.output.split())
    assert "every one of shard 0/2's own cells was measured and flagged invalid" in said, said
    assert "`dvfs sweep CAMPAIGN --shard I/2` again with --fresh" in said, said
    assert "`dvfs cube merge SHARD_DIRS -o cube.nc`" in said and "rerun" not in said, said

    refused = runner.invoke(cli, ["compare", str(merged)])
    assert refused.exit_code == 1, refused.output
    said = " ".join(refused.output.split())
    assert "every cell was measured and flagged invalid" in said, said
    assert f"--shard 0/2 --out {shards[0]}, --shard 1/2 --out {shards[1]}" in said, said
    assert "again with --fresh" in said and "`dvfs cube merge` them again" in said, said
