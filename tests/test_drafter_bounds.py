"""A drafter's numbers out of bounds are refused in one line naming the key, its value and the
bound, exit 2, by the sweep, its dry run (with the twin's estimate and without) and the doctor
alike, never an internal error: the most tokens a verify pass may place past a request's own in
its server's context (a DFLASH block, the tokens an n-gram, standalone or EAGLE tree verifies),
and the candidates an EAGLE-family draft tree holds (SGLang picks num_draft_tokens - 1 of
them). The bound each line names is then accepted."""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from bad_inputs import TINY, campaign
from click.testing import CliRunner, Result
from conftest import write

from dvfs.cli import cli
from dvfs.measure import baseline, plan

#: The largest integer TOML holds: a block of it overflowed the twin's pass arithmetic ("numpy
#: overflow", then "internal error: ValueError: run_load returned without advancing the clock").
HUGE = 2**63 - 1

#: TINY (the exact twin, Llama-3.1-8B, 131072 tokens of context) with one drafter of each kind
#: whose verify window is a number of the campaign's.
DRAFTERS = {
    **TINY["drafters"],
    "dflash": {
        "algorithm": "DFLASH",
        "draft_model": "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
        "block_size": 16,
    },
    "ngram": {"algorithm": "NGRAM", "num_draft_tokens": 12},
    "standalone": {
        "algorithm": "STANDALONE",
        "draft_model": "meta-llama/Llama-3.2-1B-Instruct",
        "num_steps": 4,
        "eagle_topk": 1,
        "num_draft_tokens": 5,
    },
    "tree": {
        "algorithm": "EAGLE3",
        "draft_model": "eagle3-llama-3.1-8b",
        "num_steps": 5,
        "eagle_topk": 4,
        "num_draft_tokens": 8,
    },
}


def invoke(*args: str) -> Result:
    """The CLI in process; a refusal is an exit code and a line, never an exception."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _campaign(tmp_path: Path, name: str, *edits: tuple[str, object]) -> Path:
    text = campaign(("drafters", copy.deepcopy(DRAFTERS)), *edits)
    return write(tmp_path / f"{name}.toml", text)


def _refused_everywhere(tmp_path: Path, path: Path, said: str) -> str:
    """The dry run without the twin's estimate and with it, the sweep (before it makes a
    journal) and the doctor each refuse `path` with exit 2 in one line holding `said`, no
    traceback; that line. (The quick dry run first: unfixed, the others may run for long.)"""
    out = tmp_path / "out"
    lines = []
    for estimate in (["--no-estimate"], []):
        dry = invoke("sweep", str(path), "--out", str(out), "--dry-run", "--json", *estimate)
        assert dry.exit_code == 2, dry.output
        lines += _said(dry.output, "problems", lambda p: p)
    swept = invoke("sweep", str(path), "--out", str(out), "--no-progress")
    assert swept.exit_code == 2, swept.output
    lines += [line for line in swept.output.splitlines() if line.startswith("Error:")]
    assert "Traceback" not in swept.output and "internal error" not in swept.output
    assert not (out / "journal.jsonl").exists()
    doctor = invoke("doctor", str(path), "--out", str(out), "--json")
    assert doctor.exit_code == 2, doctor.output
    lines += _said(doctor.output, None, lambda c: c["detail"] if c["status"] == "fail" else None)
    assert len(lines) == 4 and len(set(lines)) == 1 and said in lines[0], lines
    return lines[0]


def _said(output: str, key: str | None, pick: Callable[[Any], str | None]) -> list[str]:
    """What a --json command refused with, as "Error: LINE" lines: the campaign's load error
    (one line, no JSON), else what `pick` finds in the JSON document (under `key`)."""
    if output.startswith("Error:"):
        return output.splitlines()
    found = json.loads(output)
    return [f"Error: {p}" for p in map(pick, found[key] if key else found) if p is not None]


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (("drafters.dflash.block_size", HUGE), "drafters.dflash.block_size"),
        (("drafters.ngram.num_draft_tokens", HUGE), "drafters.ngram.num_draft_tokens"),
        (("drafters.standalone.num_steps", 200_000), "drafters.standalone.num_steps"),
        (("drafters.tree.eagle_topk", 200_000), "drafters.tree.eagle_topk x num_steps"),
    ],
)
def test_a_verify_window_past_the_context_is_refused_naming_the_key_and_the_bound(
    tmp_path: Path, edit: tuple[str, int], key: str
) -> None:
    """block_size = 2**63 - 1 ended the dry run's estimate and the sweep in "internal error:
    ValueError: run_load returned without advancing the clock" after a numpy overflow warning;
    an n-gram drafter's num_draft_tokens alike; a standalone drafter of 200000 steps was
    measured as if a verify of 200001 tokens past a prompt fitted Llama-3.1-8B's 131072; an
    EAGLE tree of top 200000 was refused by the corpus line, telling to lower output_tokens "to
    at most -869658". Each is refused naming its key, value and bound; the bound followed is
    accepted, one more refused."""
    name, value = edit
    if name.endswith("num_steps"):  # eagle_topk = 1: num_draft_tokens = num_steps + 1
        path = _campaign(tmp_path, "c", edit, ("drafters.standalone.num_draft_tokens", value + 1))
    else:
        path = _campaign(tmp_path, "c", edit)
    line = _refused_everywhere(tmp_path, path, f"{key} = {value * 5 if 'x' in key else value}")
    found = re.search(r"is above (\d+):.* at most (\d+)$", line)
    assert found and found[1] == found[2], line
    bound = int(found[1])
    assert 0 < bound < 131072, line
    for tokens, code in ((bound, 0), (bound + 1, 2)):
        if name.endswith("num_steps"):
            edits: list[tuple[str, object]] = [
                (name, tokens),
                ("drafters.standalone.num_draft_tokens", tokens + 1),
            ]
        elif name.endswith("eagle_topk"):  # one step: the tree's window is its top-k
            edits = [(name, tokens), ("drafters.tree.num_steps", 1)]
        else:
            edits = [(name, tokens)]
        at = _campaign(tmp_path, f"at-{tokens}", *edits)
        plan = invoke("sweep", str(at), "--out", str(tmp_path / "o"), "--dry-run", "--no-estimate")
        assert plan.exit_code == code, plan.output


def test_verify_windows_past_the_kv_pool_at_the_largest_batch_are_refused(tmp_path: Path) -> None:
    """A DFLASH block of 100000 tokens fits Llama-3.1-8B's context, but at batch 64 each
    request holds a verify pass's 100000 tokens of KV cache at once: 6.4 million tokens, where
    an H100 holds about 400000 (SGLang would retract requests, so the cell would not run at its
    batch), and the dry run's twin estimate of the demo ran for minutes. Refused naming the
    key, its value and the bound, which is then accepted (one more refused)."""
    batch = ("workload.batch", [1, 64])
    path = _campaign(tmp_path, "c", batch, ("drafters.dflash.block_size", 100_000))
    line = _refused_everywhere(tmp_path, path, "drafters.dflash.block_size = 100000 is above")
    assert "at batch 64" in line and "KV cache" in line, line
    found = re.search(r"is above (\d+):.* at most (\d+)$", line)
    assert found and found[1] == found[2], line
    bound = int(found[1])
    for tokens, code in ((bound, 0), (bound + 1, 2)):
        at = _campaign(tmp_path, f"at-{tokens}", batch, ("drafters.dflash.block_size", tokens))
        plan = invoke("sweep", str(at), "--out", str(tmp_path / "o"), "--dry-run", "--no-estimate")
        assert plan.exit_code == code, plan.output


def test_a_batch_whose_prompts_hold_the_kv_pool_with_their_windows_is_not_refused(
    tmp_path: Path,
) -> None:
    """The KV-pool check counted the corpus's longest prompt for every request of the largest
    batch: 64 requests of code's 730-token prompt (its mean is under 200) with 822 new tokens
    and an n-gram drafter's 12 were "100096 tokens, more than the ~100000" of a
    --max-total-tokens 100000 pool, and the campaign refused ("give num_draft_tokens at most
    10"), though the 64 longest prompts a batch can draw (distinct ones) hold the pool with
    room, windows doubled for SGLang's decode reserve included: SGLang serves every cell. Not
    refused; a window no draw's batch holds still is."""
    from dvfs.campaign.validate import load_campaign
    from dvfs.corpora.prepare import counted_corpora
    from dvfs.corpora.sampling import eligible_prompts

    pool, batch, window = 100_000, 64, 12
    drafters = {"none": {"algorithm": "none"}, "ngram": {"algorithm": "NGRAM"}}
    edits: list[tuple[str, object]] = [
        ("drafters", drafters),
        ("drafters.ngram.num_draft_tokens", window),
        ("engine.sglang.extra_args", ["--max-total-tokens", str(pool)]),
        ("workload.batch", [1, batch]),
    ]
    loaded = load_campaign(write(tmp_path / "probe.toml", campaign(*edits)))
    corpus = counted_corpora(loaded)[0]["code"]
    lengths = sorted(p.input_tokens for p in eligible_prompts(corpus, loaded.workload.input_tokens))
    output = pool // batch - lengths[-1] - window + 2  # the longest prompt's window overflows
    assert batch * (lengths[-1] + output + window) > pool  # as the check counted it
    assert sum(lengths[-batch:]) + batch * (output + 2 * window) <= pool  # any draw fits
    path = _campaign(tmp_path, "c", *edits, ("workload.output_tokens", output))
    dry = invoke("sweep", str(path), "--out", str(tmp_path / "o"), "--dry-run", "--no-estimate")
    assert dry.exit_code == 0, dry.output
    huge = pool // batch  # a window no batch of prompts and new tokens leaves room for
    path = _campaign(tmp_path, "h", *edits, ("drafters.ngram.num_draft_tokens", huge))
    line = _refused_everywhere(tmp_path, path, f"num_draft_tokens = {huge} is above")
    assert "at batch 64" in line and "KV cache" in line, line


def test_more_draft_tokens_than_the_eagle_tree_holds_are_refused_at_load(tmp_path: Path) -> None:
    """SGLang verifies num_draft_tokens - 1 drafts picked from the eagle_topk + (num_steps - 1)
    x eagle_topk^2 candidates its tree drafted (`torch.topk` over them, which fails with
    more): 5 steps of top 4 hold 68, so num_draft_tokens = 2**63 - 1 (or 70) was accepted
    and, on SGLang, failed the arm's first decode. It is refused at load naming the key, its
    value and the bound, which is then accepted."""
    path = _campaign(tmp_path, "c", ("drafters.tree.num_draft_tokens", HUGE))
    line = _refused_everywhere(
        tmp_path, path, f"drafters.tree.num_draft_tokens: {HUGE} is above 69"
    )
    assert "at most 69" in line, line
    for tokens, code in ((69, 0), (70, 2)):
        at = _campaign(tmp_path, f"at-{tokens}", ("drafters.tree.num_draft_tokens", tokens))
        plan = invoke("sweep", str(at), "--out", str(tmp_path / "o"), "--dry-run", "--no-estimate")
        assert plan.exit_code == code, plan.output


# -- the other numeric fields, fuzzed alike ---------------------------------------------------


def _refused_at_load(tmp_path: Path, edit: tuple[str, object], said: str) -> None:
    """`edit` refused at load, exit 2, in one line holding `said`: the dry run without the
    estimate first (quick however the campaign runs), then with it, the sweep and the doctor."""
    path = _campaign(tmp_path, "c", edit)
    out = tmp_path / "out"
    for argv in (
        ["sweep", str(path), "--out", str(out), "--dry-run", "--no-estimate"],
        ["sweep", str(path), "--out", str(out), "--dry-run"],
        ["sweep", str(path), "--out", str(out), "--no-progress"],
        ["doctor", str(path), "--out", str(out)],
    ):
        result = invoke(*argv)
        assert result.exit_code == 2, result.output
        lines = result.output.splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error:"), result.output
        assert said in lines[0], result.output
    assert not (out / "journal.jsonl").exists()


@pytest.mark.parametrize("period", [1e-9, 1e-300])
def test_a_sample_period_below_a_millisecond_is_refused(tmp_path: Path, period: float) -> None:
    """measurement.sample_period_s = 1e-9 (or 1e-300) passed (it is above 0 and min_window_s /
    5) and the dry run's twin estimate ran for minutes, sampling every nanosecond of every
    window; NVML's energy counter moves every 20-100 ms and a read takes about a millisecond.
    Refused at load, naming the key, the value and the bound."""
    _refused_at_load(
        tmp_path,
        ("measurement.sample_period_s", period),
        f"measurement.sample_period_s: must be at least 0.001, got {period}",
    )


def test_a_thermal_slope_too_small_to_judge_is_refused(tmp_path: Path) -> None:
    """measurement.thermal_slope_c_per_min = 1e-300 passed (it is above 0) and the dry run's
    estimate and the sweep ended in "internal error: OverflowError: cannot convert float
    infinity to integer": the thermal stabilisation judges a slope over 60 x 1 C / slope
    seconds of NVML's whole-degree readings, an infinite window. Refused at load naming the
    key, the value and the bound (1e-4 C/min: a window of 600000 s, under a week)."""
    _refused_at_load(
        tmp_path,
        ("measurement.thermal_slope_c_per_min", 1e-300),
        "measurement.thermal_slope_c_per_min: must be at least 0.0001, got 1e-300",
    )


def test_a_million_max_repeats_plans_without_a_key_for_every_repeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """measurement.max_repeats = 1048576 (the most a cube holds) ran `dvfs sweep --dry-run
    --no-estimate` for minutes over an empty folder (and the sweep's start alike): the extra
    repeats a journal holds were found by working out the key of every repeat each group may
    take, 2**20 of them a group. They are read off the journal's finished keys: the dry run
    works out a few keys a cell (counted; unfixed, it stops at the limit instead of minutes)."""
    keys = itertools.count()

    def dumps(*args: Any, **kwargs: Any) -> str:
        if next(keys) > 100_000:
            raise AssertionError("a key worked out for every repeat a group may take")
        return json.dumps(*args, **kwargs)

    monkeypatch.setattr(plan, "json", SimpleNamespace(dumps=dumps, loads=json.loads))
    path = _campaign(tmp_path, "c", ("measurement.max_repeats", 1 << 20))
    out = tmp_path / "out"
    dry = invoke("sweep", str(path), "--out", str(out), "--dry-run", "--no-estimate", "--json")
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["cells"] == 12  # 2 clocks x 6 drafters


def test_a_journal_key_whose_repeat_is_true_is_no_extra_repeat(tmp_path: Path) -> None:
    """Extra repeats are read off the journal's finished keys: one whose repeat is JSON `true`
    (a hand-edited journal) passed for repeat 1, as Python's True is an int, and a resumed
    sweep counted a cell no dvfs measured. Only a whole number is a repeat."""
    from dataclasses import replace

    from dvfs.campaign.validate import load_campaign
    from dvfs.measure.runner import journaled_repeats

    campaign = load_campaign(_campaign(tmp_path, "c", ("measurement.max_repeats", 3)))
    cells = plan.plan_cells(campaign)
    measured = replace(cells[0], repeat=1).key
    forged = json.dumps({**json.loads(measured), "repeat": True}, sort_keys=True)
    assert journaled_repeats(campaign.measurement, cells, {measured}) == [
        replace(cells[0], repeat=1)
    ]
    assert journaled_repeats(campaign.measurement, cells, {forged}) == []


def test_a_long_idle_baseline_is_judged_once_its_span_has_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """measurement.idle_s = 3600 ran the dry run's twin estimate of a 20-cell grid for 287 s
    (1000 s: 22 s; a week: minutes without end in sight): each idle baseline judged whether
    its counter windows spanned idle_s every quarter second, reading every sample so far each
    time, quadratic in idle_s. No window spans idle_s before idle_s has passed, so it is judged
    from then on only: the estimate's idle baselines judge a few times each (counted; unfixed,
    it stops at the limit instead of taking minutes)."""
    judged = itertools.count()
    judge = baseline.counter_windows

    def counted(*args: Any, **kwargs: Any) -> Any:
        if next(judged) > 1000:
            raise AssertionError("an idle baseline judged at every step before its span")
        return judge(*args, **kwargs)

    monkeypatch.setattr(baseline, "counter_windows", counted)
    path = _campaign(tmp_path, "c", ("measurement.idle_s", 1000.0))
    dry = invoke("sweep", str(path), "--out", str(tmp_path / "out"), "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output)["estimate"]["from"] == "twin", dry.output


@pytest.mark.parametrize(
    ("stop", "said"),
    [
        (HUGE, f"knobs.sm_clock: stop {HUGE} is not reached from 705 in steps of 15"),
        (
            HUGE - 7,
            f"knobs.sm_clock: 705-{HUGE - 7} MHz in steps of 15 is 614,891,469,123,651,674 "
            "clocks, more than a campaign may step through (1,000,000 at most",
        ),
    ],
)
def test_an_sm_clock_range_of_more_clocks_than_a_campaign_plans_is_refused(
    tmp_path: Path, stop: int, said: str
) -> None:
    """knobs.sm_clock = {start = 705, stop = 2**63 - 1, step = 15} was listed in full at load:
    "out of memory ... the input is too large for this machine", exit 1. Its clocks are counted
    instead: a stop the steps miss is refused as before, and more clocks than a campaign may
    step through (a million, each a cell at least) at load, naming the key, the count and the
    bound."""
    _refused_at_load(tmp_path, ("knobs.sm_clock", {"start": 705, "stop": stop, "step": 15}), said)


def test_a_batch_whose_cuda_graphs_leave_no_memory_names_the_batch_that_fits(
    tmp_path: Path,
) -> None:
    """workload.batch = [50000] on the twin (a corpus of as many prompts): dvfs captures decode
    CUDA graphs up to the largest batch, and SGLang's default static memory fraction reserves
    2 MiB for each, so on an H100 it comes to below 0. The line said the GPU "has -31.1 GiB for
    weights and KV cache" and to use more GPUs or a smaller model. It names the largest batch
    that fits (then accepted; one more refused) and says "nothing"."""
    lines = [json.dumps({"text": f"Prompt {i}: " + "word " * 40}) for i in range(50_000)]
    write(tmp_path / "many.jsonl", "\n".join(lines) + "\n")
    edits: list[tuple[str, object]] = [
        ("drafters", {"none": {"algorithm": "none"}}),
        ("workload.corpora", ["many"]),
        ("corpus", {"many": {"path": "many.jsonl", "field": "text"}}),
    ]
    path = _campaign(tmp_path, "c", *edits, ("workload.batch", [50_000]))
    out = str(tmp_path / "out")
    dry = invoke("sweep", str(path), "--out", out, "--dry-run", "--no-estimate", "--json")
    assert dry.exit_code == 2, dry.output
    (line,) = json.loads(dry.output)["problems"]
    assert "has nothing for weights and KV cache" in line, line
    found = re.search(r"lower the largest batch \(workload.batch\) to at most (\d+)", line)
    assert found, line
    for batch, code in ((int(found[1]), 0), (int(found[1]) + 1, 2)):
        at = _campaign(tmp_path, f"at-{batch}", *edits, ("workload.batch", [batch]))
        plan = invoke("sweep", str(at), "--out", out, "--dry-run", "--no-estimate")
        assert plan.exit_code == code, plan.output
