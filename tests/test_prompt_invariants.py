"""The prompts, the tokenizer and each drafter's server are invariants of a comparison: a resume
that would send other prompts is refused before it measures, a journal whose sessions sent
different ones does not build, and neither the shards of one run nor the cubes of different
GPUs merge when they differ in them (each merged cube keeps its sources' provenance)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import xarray as xr
from click.testing import CliRunner, Result
from conftest import TINY, copy_sweep, made_once, replace_block, write
from test_journal import assert_one_line_error

from dvfs.campaign import load_campaign
from dvfs.campaign.model import DrafterSpec
from dvfs.cli import cli
from dvfs.cube import open_cube, write_cube
from dvfs.engines.base import ServerInfo
from dvfs.errors import JournalError
from dvfs.measure.journal import read_records
from dvfs.sweep import run_sweep

#: TINY on one file corpus ("mine", three prompts per line of `PROMPTS`), which a test edits.
CAMPAIGN = (
    replace_block(TINY, 'corpora = ["code"]', 'corpora = ["mine"]')
    + '\n[corpus.mine]\npath = "prompts.jsonl"\nfield = "text"\nacceptance_like = "english"\n'
)
PROMPTS = [f"prompt {i}: " + "the quick brown fox jumps over the lazy dog " * 4 for i in range(40)]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def _corpus(folder: Path, edit: str = "") -> None:
    lines = [json.dumps({"text": p + (edit if i == 0 else "")}) for i, p in enumerate(PROMPTS)]
    write(folder / "prompts.jsonl", "\n".join(lines) + "\n")


def _setup(folder: Path, edit: str = "") -> Path:
    _corpus(folder, edit)
    return write(folder / "c.toml", CAMPAIGN)


def sweep(campaign: Path, out: Path, *extra: str) -> Result:
    return invoke("sweep", str(campaign), "--out", str(out), "--no-progress", *extra)


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the campaign and its corpus, swept whole (`out`) and as two shards
    (`s0`, `s1`): made once per session (`made_once`: the xdist workers share it), read-only
    (a test that resumes the run works on `copy_sweep` of it)."""

    def make(folder: Path) -> None:
        campaign = _setup(folder)
        for out, extra in (("out", ()), ("s0", ("--shard", "0/2")), ("s1", ("--shard", "1/2"))):
            result = sweep(campaign, folder / out, *extra)
            assert result.exit_code == 0, result.output

    return made_once(tmp_path_factory, "prompt-invariants", make)


def _half_done(swept: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The campaign and its corpus in `tmp_path`, and a copy of the whole run cut back to 8 of
    its 16 cells there, as a crash half way leaves it: (campaign, out)."""
    campaign, out = _setup(tmp_path), copy_sweep(swept / "out", tmp_path / "out")
    _cut(out / "journal.jsonl", 8)
    return campaign, out


def _cut(journal: Path, cells: int) -> None:
    """The journal back to its first `cells` cell records, as if the sweep had been killed."""
    kept, seen = [], 0
    for record in read_records(journal):
        seen += record["type"] == "cell"
        if record["type"] != "cell" or seen <= cells:
            kept.append(record)
    journal.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _edit_sessions(journal: Path, **changes: object) -> None:
    """Each session record with `changes` (None: the key removed, as an older dvfs wrote it)."""
    records = read_records(journal)
    for record in records:
        if record["type"] == "session":
            for key, value in changes.items():
                if value is None:
                    record.pop(key, None)
                else:
                    record[key] = value
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_resume_with_an_edited_corpus_is_refused_before_measuring(
    swept: Path, tmp_path: Path
) -> None:
    campaign, out = _half_done(swept, tmp_path)
    journal = out / "journal.jsonl"
    before = journal.read_text()
    _corpus(tmp_path, edit=" (edited)")  # the corpus file edited before the rerun
    # doctor and the dry run refuse it as the sweep does (they passed it, exit 0), in its
    # words
    checked = invoke("doctor", str(campaign), "--out", str(out))
    planned = invoke("sweep", str(campaign), "--out", str(out), "--dry-run")
    for result in (checked, planned):
        assert result.exit_code == 1, result.output
        said = " ".join(result.output.split())
        assert "the prompts differ" in said and "corpus 'mine' content: " in said, said
    assert "FAIL corpora: the prompts differ" in checked.output
    # the folder's own line says what it holds, not that the refused resume goes ahead
    doctor_said = " ".join(checked.output.split())
    assert "the sweep resumes" not in doctor_said, doctor_said
    assert "output folder: " in doctor_said and "holds a journal to resume" in doctor_said
    refused = sweep(campaign, out)
    line = assert_one_line_error(
        refused,
        1,
        "the prompts differ",
        "corpus 'mine' content: ",
        "restore the corpus",
        "--fresh",
        notes=("resuming",),
    )
    assert "starting" not in refused.output, line  # refused before any server started
    assert journal.read_text() == before  # nothing measured, no session journalled
    # Restored, it resumes and finishes; --fresh starts over on the edited corpus instead.
    _corpus(tmp_path)
    assert invoke("doctor", str(campaign), "--out", str(out)).exit_code == 0
    resumed = sweep(campaign, out)
    assert resumed.exit_code == 0 and "8 cell(s) measured" in resumed.output, resumed.output
    _corpus(tmp_path, edit=" (edited)")
    planned = invoke("sweep", str(campaign), "--out", str(out), "--dry-run", "--fresh")
    assert planned.exit_code == 0, planned.output
    assert sweep(campaign, out, "--fresh").exit_code == 0


@pytest.fixture
def half_done(swept: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The file-corpus campaign's run cut back to 8 of its 16 cells (`_half_done`):
    (campaign, out)."""
    return _half_done(swept, tmp_path)


def test_a_resume_counting_tokens_otherwise_is_refused(
    half_done: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dvfs.sweep

    campaign, out = half_done
    counted = dvfs.sweep.counted_corpora

    def with_a_tokenizer(c, recorded=""):  # type: ignore[no-untyped-def]
        # A dvfs that counted as it found (no longer: the journal's method is reproduced,
        # tests/test_prompt_reproduced.py): the check before measuring still refuses it.
        corpora, _ = counted(c)
        return corpora, "tokenizer of meta-llama/Llama-3.1-8B-Instruct"

    monkeypatch.setattr(dvfs.sweep, "counted_corpora", with_a_tokenizer)
    assert_one_line_error(
        sweep(campaign, out),
        1,
        "token-count method: estimate: characters / 4 + 5 per message -> tokenizer of",
        notes=("resuming",),
    )


class Formatting:
    """The twin engine, said to send prompts in `prompt_format` (as `SglangEngine`'s servers
    say)."""

    def __init__(self, inner: object, prompt_format: str) -> None:
        self.inner, self.prompt_format = inner, prompt_format
        self.name = "twin"

    def start(self, drafter: DrafterSpec) -> ServerInfo:
        info: ServerInfo = getattr(self.inner, "start")(drafter)  # noqa: B009
        return dataclasses.replace(info, prompt_format=self.prompt_format)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def _sweep_formatted(campaign: Path, out: Path, prompt_format: str):  # type: ignore[no-untyped-def]
    from dvfs.backends import open_backends

    c = load_campaign(campaign)
    with open_backends(c, out_dir=out) as b:
        engine = Formatting(b.engine, prompt_format)
        return run_sweep(c, out, backends=dataclasses.replace(b, engine=engine))


def test_a_resume_formatting_prompts_otherwise_is_refused_and_old_journals_resume(
    half_done: tuple[Path, Path], tmp_path: Path
) -> None:
    campaign, out = half_done
    journal = out / "journal.jsonl"
    _edit_sessions(journal, prompt_format="chat_template:0123456789abcdef")
    before = journal.read_text()
    for _ in range(2):  # each refused try left a session that measured nothing behind
        with pytest.raises(
            JournalError, match=r"prompt format: chat_template:0123456789abcdef -> plain"
        ):
            _sweep_formatted(campaign, out, "plain")
        assert journal.read_text() == before
    # A journal of an older dvfs (no prompt format recorded) resumes: unknown is no change.
    _edit_sessions(journal, prompt_format=None, token_count_method=None)
    done = _sweep_formatted(campaign, out, "plain")
    assert done.summary.measured == 8
    records = read_records(journal)
    assert all("prompt_format" not in r for r in records if r["type"] == "session")
    assert {r.get("prompt_format") for r in records if r["type"] == "server"} == {None, "plain"}
    built = invoke("cube", "build", str(out))
    assert built.exit_code == 0, built.output
    assert open_cube(out / "cube.nc").attrs["prompt_format"] == "plain"


def test_a_journal_whose_sessions_sent_different_prompts_does_not_build(
    half_done: tuple[Path, Path],
) -> None:
    campaign, out = half_done
    journal = out / "journal.jsonl"
    assert sweep(campaign, out).exit_code == 0  # the rest, in a second session
    records = read_records(journal)
    second = [r for r in records if r["type"] == "session"][1]
    second["corpora"]["mine"]["content_hash"] = "0000000000000000"  # as if edited in between
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert_one_line_error(
        invoke("cube", "build", str(out)),
        1,
        "sessions sent different prompts",
        "corpus 'mine' content: ",
        "-> 0000000000000000",
    )


def test_sessions_after_an_older_first_one_are_compared_with_each_other(
    half_done: tuple[Path, Path],
) -> None:
    """A key is compared only where both session records hold it; a first session by a dvfs
    that recorded no corpus hashes must not leave the later sessions, which do, unchecked
    against each other."""
    campaign, out = half_done
    journal = out / "journal.jsonl"
    records = read_records(journal)
    cells = [r for r in records if r["type"] == "cell"]
    keep = {r["key"] for r in cells[: len(cells) // 2]}
    journal.write_text(
        "".join(json.dumps(r) + "\n" for r in records if r["type"] != "cell" or r["key"] in keep)
    )
    assert sweep(campaign, out).exit_code == 0  # a second session: the rest
    records = read_records(journal)
    first, second = [r for r in records if r["type"] == "session"]
    third = json.loads(json.dumps(second))
    for corpus in first["corpora"].values():  # as an older dvfs wrote it
        corpus.pop("content_hash")
    third["corpora"]["mine"]["content_hash"] = "0000000000000000"  # edited before a third
    at = records.index(second)
    moved = [r for r in records[at + 1 :] if r["type"] == "cell"][-1:]
    rest = [r for r in records[at + 1 :] if r not in moved]
    journal.write_text(
        "".join(json.dumps(r) + "\n" for r in [*records[: at + 1], *rest, third, *moved])
    )
    assert_one_line_error(
        invoke("cube", "build", str(out)),
        1,
        "sessions sent different prompts",
        "corpus 'mine' content: ",
        "-> 0000000000000000",
    )


def _rewrite(path: Path, into: Path, **attrs: object) -> Path:
    """The cube at `path` with `attrs` changed, written to `into`."""
    ds = open_cube(path).load()
    ds.attrs.update(attrs)
    write_cube(ds, into)
    return into


def _server_args_with(path: Path, **args: object) -> str:
    servers = json.loads(open_cube(path).attrs["server_args"])
    for server in servers.values():
        server["args"].update(args)
    return json.dumps(servers)


def test_shards_that_differ_in_corpus_driver_or_servers_do_not_merge(
    swept: Path, tmp_path: Path
) -> None:
    s0, s1 = (swept / f"s{i}" / "cube.nc" for i in range(2))
    merged = tmp_path / "m.nc"
    # Alike: they merge, and the whole keeps each shard's provenance.
    ok = invoke("cube", "merge", str(s0), str(s1), "-o", str(merged))
    assert ok.exit_code == 0, ok.output
    kept = json.loads(open_cube(merged).attrs["shard_provenance"])
    assert set(kept) == {str(s0), str(s1)}
    assert all("content_hash" in v["corpora"] and v["driver_version"] for v in kept.values())
    # What neither shard records is kept as JSON null, which a plain reader takes for none,
    # not as the text "None".
    bare = [tmp_path / f"bare{i}.nc" for i in range(2)]
    for shard, into in zip((s0, s1), bare, strict=True):
        ds = open_cube(shard).load()
        del ds.attrs["idle_foreign_processes"]
        write_cube(ds, into)
    ok = invoke("cube", "merge", *map(str, bare), "-o", str(merged))
    assert ok.exit_code == 0, ok.output
    with xr.open_dataset(merged) as plain:
        kept = json.loads(plain.attrs["shard_provenance"])
    assert [v["idle_foreign_processes"] for v in kept.values()] == [None, None]
    # Shard 1 measured on an edited corpus: refused, naming both shards and what differs.
    other = tmp_path / "other"
    _setup(other, edit=" (edited)")
    assert sweep(other / "c.toml", other / "s1", "--shard", "1/2").exit_code == 0
    edited = invoke("cube", "merge", str(s0), str(other / "s1"), "-o", str(merged))
    assert_one_line_error(
        edited, 2, "were not run alike", str(s0), str(other / "s1"), "corpus 'mine' content: "
    )
    for attrs, named in (
        ({"driver_version": "560.28"}, "-> '560.28'"),
        ({"engine_version": "sglang 0.5.23"}, "engine_version: "),
        ({"token_count_method": "tokenizer of x"}, "token_count_method: "),
        ({"server_args": _server_args_with(s1, model_path="other")}, "model (model_path): "),
    ):
        odd = _rewrite(s1, tmp_path / "odd.nc", **attrs)
        refused = invoke("cube", "merge", str(s0), str(odd), "-o", str(merged))
        line = assert_one_line_error(refused, 2, "were not run alike", named)
        assert str(odd) in line
    # Shards whose servers started with another tuning variable (edited: the twin starts none).
    env0 = _rewrite(s0, tmp_path / "env0.nc", server_env='{"NCCL_ALGO": "Ring"}')
    odd = _rewrite(s1, tmp_path / "odd.nc", server_env="{}")
    refused = invoke("cube", "merge", str(env0), str(odd), "-o", str(merged))
    assert_one_line_error(
        refused, 2, "were not run alike", "server environment NCCL_ALGO: 'Ring' -> unset"
    )


def test_cubes_of_different_gpus_must_share_engine_prompts_and_servers(
    swept: Path, tmp_path: Path
) -> None:
    h200 = _setup(tmp_path / "h200", edit=" (edited)")
    write(h200, h200.read_text().replace('profile = "h100-sxm"', 'profile = "h200-sxm"'))
    assert sweep(h200, tmp_path / "h200" / "out").exit_code == 0
    a, b = swept / "out" / "cube.nc", tmp_path / "h200" / "out" / "cube.nc"  # H100's: shared
    merged = tmp_path / "m.nc"
    edited = invoke("cube", "merge", str(a), str(b), "-o", str(merged))
    assert_one_line_error(edited, 2, "were not measured alike", "corpus 'mine' content: ")
    # The same corpus (and, as SGLang's would, a prompt format each): they merge, each GPU's
    # provenance kept in merged_from.
    a = _rewrite(a, tmp_path / "a.nc", prompt_format="plain")
    same = _rewrite(
        b, tmp_path / "same.nc", corpora=open_cube(a).attrs["corpora"], prompt_format="plain"
    )
    ok = invoke("cube", "merge", str(a), str(same), "-o", str(merged))
    assert ok.exit_code == 0, ok.output
    cube = open_cube(merged)
    sources = json.loads(cube.attrs["merged_from"])
    assert len(sources) == 2
    for source in sources.values():
        assert "content_hash" in source["corpora"]
        assert source["token_count_method"].startswith("estimate")
        assert {"gpu_pinning", "actuation", "server_args", "idle_power_w"} <= set(source)
    assert cube.attrs["token_count_method"].startswith("estimate")
    assert cube.attrs["prompt_format"] == "plain"
    assert "content_hash" in cube.attrs["corpora"]
    for attrs, named in (
        ({"engine_version": "sglang 0.5.23"}, "engine_version: "),
        ({"token_count_method": "tokenizer of x"}, "token_count_method: "),
        ({"prompt_format": "chat_template:abc"}, "prompt_format: 'plain' -> 'chat_template:abc'"),
        ({"server_args": _server_args_with(same, speculative_num_steps=2)}, "num_steps: 3 -> 2"),
    ):
        odd = _rewrite(same, tmp_path / "odd.nc", **attrs)
        refused = invoke("cube", "merge", str(a), str(odd), "-o", str(merged))
        assert_one_line_error(refused, 2, "were not measured alike", named)
    # The servers' environment: compared where both cubes record it (the twin's do not).
    env = _rewrite(a, tmp_path / "env.nc", server_env='{"NCCL_ALGO": "Ring"}')
    odd = _rewrite(same, tmp_path / "odd.nc", server_env='{"NCCL_ALGO": "Tree"}')
    refused = invoke("cube", "merge", str(env), str(odd), "-o", str(merged))
    assert_one_line_error(
        refused, 2, "were not measured alike", "NCCL_ALGO: 'Ring' -> 'Tree'", "server environment"
    )
    assert invoke("cube", "merge", str(env), str(same), "-o", str(merged)).exit_code == 0
    assert open_cube(merged).attrs["server_env"] == '{"NCCL_ALGO": "Ring"}'
    # Older cubes, without a prompt format or token-count method, still merge.
    old = _rewrite(same, tmp_path / "old.nc", prompt_format="", token_count_method="")
    assert invoke("cube", "merge", str(a), str(old), "-o", str(merged)).exit_code == 0


def test_the_chat_formatter_names_its_template_or_plain_text() -> None:
    from dvfs.engines.sglang import ChatFormatter

    class Tokenizer:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    one = ChatFormatter("m", tokenizer=Tokenizer()).describe()
    assert one.startswith("chat_template:") and len(one) == len("chat_template:") + 16
    Tokenizer.chat_template = "{{ messages[0].content }}"
    assert ChatFormatter("m", tokenizer=Tokenizer()).describe() not in (one, "plain")
    Tokenizer.chat_template = ""
    assert ChatFormatter("m", tokenizer=Tokenizer()).describe() == "plain"


def test_shards_on_gpus_of_another_power_limit_or_clock_range_do_not_merge(
    swept: Path, tmp_path: Path
) -> None:
    """A journal's sessions must share their GPUs' power-limit range and top SM clock
    (`SESSION_INVARIANTS`, `GPU_INVARIANTS`): the shards of one run, a journal split, must too.
    They merged whatever their ranges, the whole cube keeping the first shard's."""
    s0, s1 = (swept / f"s{i}" / "cube.nc" for i in range(2))
    merged = tmp_path / "m.nc"
    first = open_cube(s0).attrs
    low, high = first["sm_clock_range_mhz"]
    for attrs, named in (
        ({"power_limit_range_w": [200.0, 600.0, 600.0]}, "power_limit_range_w: "),
        ({"sm_clock_range_mhz": [low, high - 15]}, "sm_clock_range_mhz: "),
    ):
        odd = _rewrite(s1, tmp_path / "odd.nc", **attrs)
        refused = invoke("cube", "merge", str(s0), str(odd), "-o", str(merged))
        line = assert_one_line_error(refused, 2, "were not run alike", named)
        assert str(odd) in line
    # Their GPUs' ECC mode and VBIOS too (`GPU_INVARIANTS`), where both shards read them.
    on = _rewrite(s0, tmp_path / "on.nc", ecc_mode="on", vbios_version="96.00.99.00.01")
    for attrs, named in (
        ({"ecc_mode": "off", "vbios_version": "96.00.99.00.01"}, "ecc_mode: 'on' -> 'off'"),
        ({"ecc_mode": "on", "vbios_version": "96.00.AA.00.02"}, "vbios_version: "),
    ):
        odd = _rewrite(s1, tmp_path / "odd.nc", **attrs)
        refused = invoke("cube", "merge", str(on), str(odd), "-o", str(merged))
        assert_one_line_error(refused, 2, "were not run alike", named)
    # A shard of an earlier dvfs, which did not record its SM clock range, still merges, as
    # does one on a GPU whose power limit NVML does not support (its range not known).
    older = _rewrite(
        s1,
        tmp_path / "older.nc",
        sm_clock_range_mhz=[math.nan, math.nan],
        power_limit_range_w=[math.nan] * 3,
    )
    ok = invoke("cube", "merge", str(s0), str(older), "-o", str(merged))
    assert ok.exit_code == 0, ok.output
