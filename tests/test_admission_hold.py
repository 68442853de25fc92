"""SGLang 0.5.23's prefill admission hold: a DFLASH or DSPARK server whose
`--min-free-slots-delay` is unset waits for up to 4 free running-request slots before it
admits new requests' prefills (managers/min_free_slots_delayer.py `resolve_min_free_slots`,
used by scheduler.py `_get_new_batch_prefill_raw`), where a plain server admits each as a slot
frees. Both report `min_free_slots_delay` None, so the arms' args alone look alike: dvfs turns
the hold off for every arm (`admission_hold_args`), names it (`admission_hold`), compares it at
each server start and in the cube (`arm_changes`) and records it as pinned (`arms_pinned`).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from click.testing import CliRunner
from sglang_support import load_stub, stub_campaign

from dvfs.campaign import load_campaign
from dvfs.cli import cli
from dvfs.engines.sglang_args import launch_argv
from dvfs.measure.journal import read_records
from dvfs.records import ARMS_PINNED, admission_hold, arm_changes, begun_unpinned

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
DFLASH = ("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "d")
DSPARK = ("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", "d")
TWO = (
    '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.dflash]\nalgorithm = "DFLASH"\n'
    'draft_model = "draft/dflash"\n'
)
HELD = "prefill admission hold (free slots awaited): "


@pytest.fixture(scope="module")
def stub() -> ModuleType:
    return load_stub()


def resolve(stub: ModuleType, version: str, *argv: str) -> dict[str, Any]:
    args, _ = stub.parse_launch_argv(
        ["--model-path", LLAMA, *argv], stub.StubConfig(version=version), None
    )
    return dict(args)


def record(args: dict[str, Any]) -> dict[str, Any]:
    return {"engine": "sglang", "version": "0.5.23", "attention_backend": "fa3", "args": args}


def campaign_file(tmp_path: Path, drafters: str, batch: str, engine_extra: str = "") -> Path:
    path = tmp_path / "c.toml"
    path.write_text(
        f'[gpu]\nbackend = "twin"\nprofile = "h100-sxm"\n\n[engine]\nbackend = "sglang"\n'
        f'model = "{LLAMA}"\n\n[engine.sglang]\n{engine_extra}\n{drafters}\n'
        f'[workload]\nbatch = {batch}\ncorpora = ["code"]\n'
    )
    return path


def test_the_hold_follows_sglangs_rule() -> None:
    def hold(algorithm: str | None, running: int, given: int | None = None) -> Any:
        return admission_hold(
            {
                "speculative_algorithm": algorithm,
                "max_running_requests": running,
                "min_free_slots_delay": given,
            }
        )

    assert [hold("DFLASH", n) for n in (7, 8, 12, 13, 19, 20, 256)] == [
        "off", 2, 2, 3, 4, 4, 4,
    ]  # fmt: skip
    assert hold("DSPARK", 32) == 4 and hold("dflash", 32) == 4
    assert {hold(a, 32) for a in (None, "EAGLE", "EAGLE3", "STANDALONE", "NGRAM", "UNO")} == {"off"}
    # A given value wins for every algorithm, capped by the running requests; 1 or less: off.
    assert [hold(None, 32, 3), hold("DFLASH", 32, 1), hold("DFLASH", 32, 0)] == [3, "off", "off"]
    assert hold(None, 2, 6) == 2 and hold(None, 1, 6) == "off"
    # A release without the arg (0.5.9), or args that do not say: unknown, not compared.
    assert admission_hold({"max_running_requests": 32}) is None
    assert admission_hold({"min_free_slots_delay": None}) is None


def test_the_hold_is_known_without_a_running_cap_and_is_each_dp_ranks(stub: ModuleType) -> None:
    """A plain server started without --max-running-requests (dvfs always gives it) reports None
    (0.5.23 resolves it in the scheduler), a DFLASH one 48 (speculative_hook.py): the plain one
    holds nothing whatever it is, so the DFLASH arm's hold is still seen. With attention DP
    the scheduler holds by each rank's share of the arg (kv_cache_configurator.py
    `resolve_max_num_reqs`)."""
    plain = resolve(stub, "0.5.23", "--random-seed", "1")
    dflash = resolve(stub, "0.5.23", "--random-seed", "1", *DFLASH)
    assert plain["max_running_requests"] is None and dflash["max_running_requests"] == 48
    assert admission_hold(plain) == "off"
    assert arm_changes(record(plain), record(dflash), [8]) == [f"{HELD}off -> 4 slots"]
    assert admission_hold({**plain, "min_free_slots_delay": 1}) == "off"
    assert admission_hold({**plain, "min_free_slots_delay": 6}) is None  # min(6, unknown)

    def held(running: int, ranks: int, given: int | None = None) -> Any:
        return admission_hold(
            {
                "speculative_algorithm": "DFLASH",
                "max_running_requests": running,
                "attn_dp_size": ranks,
                "min_free_slots_delay": given,
            }
        )

    assert [held(12, 1), held(12, 2), held(32, 2), held(64, 2), held(8, 2, 6)] == [
        2, "off", 3, 4, 4,
    ]  # fmt: skip


def test_sglang_0_5_23_holds_a_dflash_arm_alone_unless_dvfs_says_otherwise(
    stub: ModuleType, tmp_path: Path
) -> None:
    """Through the real 0.5.23 option table: left to SGLang, a DFLASH (or DSPARK) arm holds
    prefills back where the plain arm does not, and its args do not show it; with the argv
    dvfs builds, every arm admits alike."""
    given = ("--max-running-requests", "32", "--random-seed", "1")
    plain = resolve(stub, "0.5.23", *given)
    for drafter in (DFLASH, DSPARK):
        held = resolve(stub, "0.5.23", *given, *drafter)
        assert plain["min_free_slots_delay"] is None and held["min_free_slots_delay"] is None
        assert arm_changes(record(plain), record(held), [32]) == [f"{HELD}off -> 4 slots"]
    campaign = load_campaign(campaign_file(tmp_path, TWO, "[4, 32]"))
    resolved = {}
    for drafter in campaign.drafters:
        argv = launch_argv(campaign, drafter, port=31000, version="0.5.23")
        at = argv.index("--min-free-slots-delay")
        assert argv[at + 1] == "1", argv
        resolved[drafter.name] = record(resolve(stub, "0.5.23", *argv[5:]))
        assert admission_hold(resolved[drafter.name]["args"]) == "off"
    assert arm_changes(resolved["none"], resolved["dflash"], [4, 32]) == []


def test_only_a_campaign_with_a_held_drafter_on_0_5_23_gets_the_flag(tmp_path: Path) -> None:
    eagle = '\n[drafters.none]\nalgorithm = "none"\n\n[drafters.ngram]\nalgorithm = "NGRAM"\n'
    campaign = load_campaign(campaign_file(tmp_path, eagle, "[32]"))
    for drafter in campaign.drafters:
        argv = launch_argv(campaign, drafter, port=31000, version="0.5.23")
        assert not [a for a in argv if a.startswith("--min-free")], argv
    held = load_campaign(campaign_file(tmp_path, TWO, "[32]"))
    help_without = "usage: launch_server [--model-path MODEL_PATH] [--port PORT]"
    argv = launch_argv(held, held.drafters[0], port=31000, help_text=help_without)
    assert "--min-free-slots-delay" not in argv  # a release without the hold: nothing to turn off
    with_flag = help_without + " [--min-free-slots-delay MIN_FREE_SLOTS_DELAY]"
    argv = launch_argv(held, held.drafters[0], port=31000, help_text=with_flag)
    assert argv[argv.index("--min-free-slots-delay") + 1] == "1"
    # 0.5.23 refuses the flag with pipeline parallelism (and DFLASH with it): not passed, so
    # the plain arm still starts.
    for given in ('"--pp-size", "2"', '"--pipeline-parallel-size=2"'):
        piped = load_campaign(campaign_file(tmp_path, TWO, "[32]", f"extra_args = [{given}]"))
        argv = launch_argv(piped, piped.drafters[0], port=31000, version="0.5.23")
        assert "--min-free-slots-delay" not in argv, argv
    one = load_campaign(campaign_file(tmp_path, TWO, "[32]", 'extra_args = ["--pp-size", "1"]'))
    assert "--min-free-slots-delay" in launch_argv(one, one.drafters[0], port=1, version="0.5.23")


def test_pipeline_parallelism_abbreviated_gets_no_flag_either(
    stub: ModuleType, tmp_path: Path
) -> None:
    """0.5.23's argparse reads an abbreviation of --pp-size or --pipeline-parallel-size as
    the flag itself (its option table, through the stub's parser), and then refuses
    --min-free-slots-delay (validation_hook.py `check_pipeline_parallel_compat`): every arm
    would fail to start."""
    parser = stub.build_parser("0.5.23")
    for given in (("--pp-s", "2"), ("--pp-siz=2",), ("--pi", "2"), ("--pipeline=2",)):
        assert parser.parse_args(["--model-path", LLAMA, *given]).pp_size == 2, given
        listed = ", ".join(f'"{t}"' for t in given)
        piped = load_campaign(campaign_file(tmp_path, TWO, "[32]", f"extra_args = [{listed}]"))
        argv = launch_argv(piped, piped.drafters[0], port=31000, version="0.5.23")
        assert "--min-free-slots-delay" not in argv, argv
    # The last one given wins, as in argparse.
    last = 'extra_args = ["--pi", "2", "--pp-size", "1"]'
    one = load_campaign(campaign_file(tmp_path, TWO, "[32]", last))
    assert "--min-free-slots-delay" in launch_argv(one, one.drafters[0], port=1, version="0.5.23")


def test_a_journal_begun_without_the_pin_names_it() -> None:
    change = f"{HELD}off -> 4 slots"
    pinned = [k for k in ARMS_PINNED if k != "admission_hold"]
    said = "begun by an earlier dvfs, which did not give every drafter the same "
    assert begun_unpinned(pinned, [change]) == said + "prefill admission hold"
    assert begun_unpinned(tuple(ARMS_PINNED), [change]) is None
    # A journal that pinned nothing, whose arms differ in their decode graphs alone, is told
    # what it was always told.
    graphs = "decode CUDA graph at batch 6: eager -> 6"
    assert begun_unpinned((), [graphs]) == said + "decode CUDA graphs and overlap scheduler"


@pytest.mark.slow
def test_a_sweep_holds_every_arm_alike_and_refuses_a_server_that_holds_otherwise(
    tmp_path: Path,
) -> None:
    """End to end on the stub (0.5.23): the journal's servers both report the hold turned
    off, the header and cube record it as pinned; a resume of a journal whose DFLASH server
    held prefills back (an earlier dvfs's) is refused at that server's start, and its cube
    is not built, each saying why in one line."""
    path, _ = stub_campaign(
        tmp_path, drafters=TWO, batch="[8]", knobs="sm_clock = [1980]\nsettle_s = 0.0"
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    journal = out / "journal.jsonl"
    records = read_records(journal)
    servers = {r["drafter"]: r["args"] for r in records if r["type"] == "server"}
    assert {d: a["min_free_slots_delay"] for d, a in servers.items()} == {"none": 1, "dflash": 1}
    [header] = [r for r in records if r["type"] == "header"]
    assert "admission_hold" in header["arms_pinned"]
    import xarray as xr

    with xr.open_dataset(out / "cube.nc") as cube:
        assert "admission_hold" in str(cube.attrs["arms_pinned"]).split(",")
    # As an earlier dvfs left it: the DFLASH server held 2 slots (batch 8), nothing pinned.
    for r in records:
        if r["type"] == "header":
            r["arms_pinned"] = [k for k in r["arms_pinned"] if k != "admission_hold"]
        if r["type"] == "server" and r["drafter"] == "dflash":
            r["args"]["min_free_slots_delay"] = None
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "cube.nc").unlink()
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 1, built.output
    [line] = built.output.strip().splitlines()
    assert f"{HELD}off -> 2 slots" in line, line
    assert "which did not give every drafter the same prefill admission hold" in line, line
    kept = [r for r in records if r["type"] != "cell" or r["cell"]["drafter"] != "dflash"]
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    resumed = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert resumed.exit_code == 1, resumed.output
    last = resumed.output.strip().splitlines()[-1]
    assert f"{HELD}2 slots -> off" in last, last
    assert "which did not give every drafter the same prefill admission hold" in last, last


def test_an_earlier_dvfss_unset_delay_compares_with_this_ones_1_where_neither_holds() -> None:
    """An earlier dvfs left `--min-free-slots-delay` unset, this one gives every arm 1: for a
    server that does not hold (a plain or EAGLE arm) both are off, its one effect in 0.5.23
    (the scheduler's `resolve_min_free_slots` is its only reader), so they compare; a DFLASH
    server that held is told apart by its hold alone."""

    def server(algorithm: str | None, given: int | None) -> dict[str, Any]:
        return record(
            {
                "speculative_algorithm": algorithm,
                "max_running_requests": 32,
                "min_free_slots_delay": given,
            }
        )

    for algorithm in (None, "EAGLE3", "DFLASH"):
        assert arm_changes(server(None, None), server(algorithm, 1), [32]) == [], algorithm
    assert arm_changes(server("DFLASH", None), server("DFLASH", 1), [32]) == [
        f"{HELD}4 slots -> off"
    ]
    # A delay that holds differs as the hold it makes.
    assert arm_changes(server(None, 1), server(None, 6), [32]) == [f"{HELD}off -> 6 slots"]


@pytest.mark.slow
def test_a_journal_an_earlier_dvfs_began_on_its_plain_arm_resumes(tmp_path: Path) -> None:
    """An earlier dvfs's journal (no pin, no flag) whose plain arm alone was measured: this
    dvfs's DFLASH server (1: off) admits as that plain server did (unset: off), so the resume
    measures it rather than refusing it for a flag that changes nothing."""
    path, _ = stub_campaign(
        tmp_path, drafters=TWO, batch="[8]", knobs="sm_clock = [1980]\nsettle_s = 0.0"
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    journal = out / "journal.jsonl"
    kept = []
    for r in read_records(journal):
        if r["type"] == "header":
            r["arms_pinned"] = [k for k in r["arms_pinned"] if k != "admission_hold"]
        if r["type"] == "server":
            r["args"]["min_free_slots_delay"] = None
        drafter = r["cell"]["drafter"] if r["type"] == "cell" else r.get("drafter")
        if drafter == "dflash":  # its arm not begun
            continue
        kept.append(r)
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))
    resumed = CliRunner().invoke(cli, ["sweep", str(path), "--out", str(out), "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
    cells = [r for r in read_records(journal) if r["type"] == "cell"]
    assert {c["cell"]["drafter"]: c["status"] for c in cells} == {"none": "ok", "dflash": "ok"}
