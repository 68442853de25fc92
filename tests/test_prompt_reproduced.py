"""A resume reproduces how its journal chose and sent prompts, whatever this machine has now.

Why: on a fresh machine no tokenizer is cached when the first session starts (the first server
fetches the model), so that session chooses its prompts by the estimate; a resume that then
counted with the tokenizer would choose other prompts, and one that sent plain text where the
journal's servers got the chat template would send other prompts too. A fake tokenizer loader
stands in for transformers' (`dvfs.corpora.tokens.load_tokenizer`): nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from conftest import TINY, replace_block, write
from sglang_support import stub_campaign
from test_journal import assert_one_line_error
from test_prompt_invariants import _cut, _setup, sweep

import dvfs.corpora.tokens
from dvfs.cli import cli
from dvfs.measure.journal import read_records

ONE_DRAFTER = '[drafters.none]\nalgorithm = "none"\n'


class WordTokenizer:
    """A tokenizer with a chat template: one token per three words (so other prompts fit the
    input lengths than by the estimate), the template marks its text with "<T>"."""

    chat_template = "<T>{{ messages }}"
    bos_token = bos_token_id = None
    step = 3

    def apply_chat_template(self, chat: list[dict[str, str]], *, tokenize: bool, **_: Any) -> Any:
        text = "<T>" + "\n".join(m["content"] for m in chat)
        return text.split()[:: self.step] if tokenize else text

    def __call__(self, text: str) -> dict[str, list[str]]:
        return {"input_ids": text.split()[:: self.step]}

    def encode(self, text: str) -> list[str]:
        return text.split()


class EveryWord(WordTokenizer):
    step = 1


class EveryOtherWord(WordTokenizer):
    """EveryWord's model at another revision: the same chat template, other counts."""

    step = 2


def _cached_once_a_server_ran(monkeypatch: pytest.MonkeyPatch, out: Path) -> None:
    """The loader of a fresh machine: no tokenizer until a server (its log in `out`) has run
    and fetched the model."""

    def load(model: str) -> Any:
        return WordTokenizer() if any(out.rglob("server-*.log")) else None

    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", load)


def _sent(log: Path) -> list[str]:
    texts = [json.loads(line)["text"] for line in log.read_text().splitlines()]
    return [t for batch in texts for t in (batch if isinstance(batch, list) else [batch])]


def _invoke(campaign: Path, out: Path) -> Result:
    return CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])


def test_a_fresh_machines_campaign_sends_the_template_and_resumes_on_the_same_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log, out = tmp_path / "requests.jsonl", tmp_path / "out"
    campaign, _ = stub_campaign(
        tmp_path, stub={"requests_log": str(log)}, drafters=ONE_DRAFTER, batch="[1, 2]"
    )
    _cached_once_a_server_ran(monkeypatch, out)
    first = _invoke(campaign, out)
    assert first.exit_code == 0, first.output
    assert "estimated (characters / 4) for this whole campaign" in first.output
    assert "huggingface-cli download" in first.output
    sent = _sent(log)
    # The first server fetched the model: every prompt went out with its chat template.
    assert sent and all(t.startswith("<T>") for t in sent), sent[:2]
    records = read_records(out / "journal.jsonl")
    (session,) = [r for r in records if r["type"] == "session"]
    assert session["token_count_method"].startswith("estimate")
    servers = [r for r in records if r["type"] == "server"]
    assert all(s["prompt_format"].startswith("chat_template:") for s in servers)
    # Killed half way, resumed now that the tokenizer is cached: the same prompts, counted
    # and formatted as the journal's first session chose them.
    _cut(out / "journal.jsonl", 2)
    log.unlink()
    resumed = _invoke(campaign, out)
    assert resumed.exit_code == 0, resumed.output
    again = _sent(log)
    assert again and set(again) <= set(sent)
    assert "for this whole campaign" not in resumed.output
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    assert built.exit_code == 0, built.output


def test_a_journal_of_plain_prompts_resumes_plain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log, out = tmp_path / "requests.jsonl", tmp_path / "out"
    campaign, _ = stub_campaign(
        tmp_path, stub={"requests_log": str(log)}, drafters=ONE_DRAFTER, batch="[1, 2]"
    )
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: None)
    assert _invoke(campaign, out).exit_code == 0
    assert not any(t.startswith("<T>") for t in _sent(log))
    _cut(out / "journal.jsonl", 2)
    log.unlink()
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: WordTokenizer())
    resumed = _invoke(campaign, out)
    assert resumed.exit_code == 0, resumed.output
    assert _sent(log) and not any(t.startswith("<T>") for t in _sent(log))


def test_a_journal_counted_by_a_tokenizer_now_missing_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    campaign, out = _setup(tmp_path), tmp_path / "out"
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: EveryWord())
    assert sweep(campaign, out).exit_code == 0
    _cut(out / "journal.jsonl", 8)
    before = (out / "journal.jsonl").read_text()
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: None)
    assert_one_line_error(
        sweep(campaign, out),
        1,
        "chose its prompts by the tokenizer of ",
        "huggingface-cli download ",
        "--fresh",
    )
    assert (out / "journal.jsonl").read_text() == before


def _keep_cells(journal: Path, keep: Any) -> None:
    """The journal with only the cell records `keep(record)` accepts."""
    records = [r for r in read_records(journal) if r["type"] != "cell" or keep(r)]
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))


def _group(record: dict[str, Any]) -> tuple[Any, ...]:
    cell = record["cell"]
    return (cell["batch"], cell["corpus"], cell["repeat"])


@pytest.mark.parametrize(("mixed", "other_driver"), [(False, False), (True, False), (False, True)])
def test_an_older_journal_counted_two_ways_builds_where_each_group_used_one(
    tmp_path: Path, mixed: bool, other_driver: bool
) -> None:
    """Sessions that counted prompt tokens two ways build where each comparison group used
    one way; their other invariants are still compared (a second session on another driver
    is refused, as it would be had both counted alike)."""
    campaign, out = _setup(tmp_path), tmp_path / "out"
    journal = out / "journal.jsonl"
    assert sweep(campaign, out).exit_code == 0
    cells = [r for r in read_records(journal) if r["type"] == "cell"]
    first = _group(cells[0])
    of_first = [r["key"] for r in cells if _group(r) == first]
    kept = set(of_first[:1] if mixed else of_first)
    _keep_cells(journal, lambda r: r["key"] in kept)  # the rest measured by a second session
    assert sweep(campaign, out).exit_code == 0
    records = read_records(journal)
    # As an older dvfs wrote it: the second session counted with a tokenizer found since.
    second = [r for r in records if r["type"] == "session"][1]
    second["token_count_method"] = "tokenizer of x"
    if other_driver:
        for gpu in second["gpus"]:
            gpu["driver_version"] = "0.0.1"
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    built = CliRunner().invoke(cli, ["cube", "build", str(out)])
    if other_driver:
        assert_one_line_error(built, 1, "GPUs that do not compare", "driver version: ", "0.0.1")
        assert "token-count" not in built.output  # told apart from what the groups allow
        return
    if not mixed:
        assert built.exit_code == 0, built.output
        return
    assert_one_line_error(
        built,
        1,
        "counted prompt tokens differently",
        "-> tokenizer of x",
        f"batch {first[0]} corpus {first[1]!r} repeat {first[2]}",
        "--fresh",
    )


def test_doctor_says_how_the_sweep_will_count_prompt_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dvfs doctor`'s tokenizer check is the sweep's rule: a warning where a new campaign would
    estimate throughout, the cached tokenizer otherwise, and a failure where a resume would be
    refused for a tokenizer its journal used and this machine lacks."""
    campaign, _ = stub_campaign(tmp_path, drafters=ONE_DRAFTER, batch="[1, 2]")
    out = tmp_path / "out"

    def tokenizer_check() -> dict[str, str]:
        done = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", str(out), "--json"])
        [check] = [c for c in json.loads(done.stdout) if c["name"] == "tokenizer"]
        return check

    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: None)
    check = tokenizer_check()
    assert check["status"] == "warn" and "huggingface-cli download" in check["detail"], check
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: EveryWord())
    check = tokenizer_check()
    assert check["status"] == "ok" and "tokenizer of" in check["detail"], check
    assert _invoke(campaign, out).exit_code == 0  # a journal counted by that tokenizer
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: None)
    check = tokenizer_check()
    assert check["status"] == "fail" and "huggingface-cli download" in check["detail"], check
    # The journal in a GPU model's folder (`gpu-*/`, as a fleet mixing models keeps it), which
    # the sweep resumes just as well: the same failure, in the sweep's words (doctor read only
    # the folder's own journal, and warned that a new campaign would estimate).
    model = out / "gpu-nvidia-h100-80gb-hbm3-twin"
    model.mkdir()
    (out / "journal.jsonl").rename(model / "journal.jsonl")
    check = tokenizer_check()
    refused = _invoke(campaign, out)
    assert refused.exit_code != 0 and check["status"] == "fail", (check, refused.output)
    # (the doctor adds that --fresh is the sweep's, which it names)
    said = check["detail"].split(" (--fresh is the sweep's: ")[0]
    assert said in " ".join(refused.output.split()), (check, refused.output)


def test_the_groups_measured_under_two_methods_are_named_in_order() -> None:
    """Each comparison group's cells (across clocks, limits and drafters) under one recorded
    method, or one and an unrecorded one (""), build; two recorded methods are a mixed group,
    named by its values, in order."""
    import numpy as np

    from dvfs.cube.build import Counted, _mixed_groups

    grid = {
        "sm_clock": [1980, 705],
        "power_limit": [700],
        "batch": [4, 1],
        "drafter": ["none", "eagle3"],
        "corpus": ["chat"],
        "repeat": [0, 1],
    }
    method = np.zeros((2, 1, 2, 2, 1, 2), dtype=np.int16)
    method[0, 0, 0, 0, 0, 0] = 1  # batch 4, repeat 0: methods 1 and 2
    method[1, 0, 0, 1, 0, 0] = 2
    method[0, 0, 1, 0, 0, 0] = 2  # batch 1, repeat 0: method 2 twice
    method[1, 0, 1, 1, 0, 0] = 2
    method[0, 0, 1, 0, 0, 1] = 1  # batch 1, repeat 1: method 1 and unrecorded
    method[1, 0, 1, 0, 0, 1] = 0
    method[:, 0, 0, :, 0, 1] = [[2, 1], [1, 1]]  # batch 4, repeat 1: 1 and 2
    counted = Counted(grid, method, ["", "estimate", "tokenizer of x"])
    assert _mixed_groups(counted) == [(4, "chat", 0), (4, "chat", 1)]
    method[1, 0, 0, 1, 0, 0] = 1
    method[0, 0, 0, 0, 0, 1] = 1
    assert _mixed_groups(counted) == []


@pytest.mark.parametrize("fleet", [(), ("--gpus", "0,1")], ids=["one-gpu", "fleet"])
def test_a_journal_counted_by_another_revision_of_its_tokenizer_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fleet: tuple[str, ...]
) -> None:
    """The same model's tokenizer, but another revision (the cache updated between the runs,
    its chat template unchanged): the counts change, so other prompts fit the input lengths and
    the resumed arms would be sent other prompts than the journal's, under the same method
    name ("tokenizer of MODEL"). Refused, naming the corpora whose counts changed; a fleet's
    in the same words (it said the journal was measured on other GPUs, and to run these GPUs
    into another folder and merge the cubes, which would compare other prompts)."""
    campaign, out = _setup(tmp_path), tmp_path / "out"
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: EveryWord())
    assert sweep(campaign, out, *fleet).exit_code == 0
    (session,) = [r for r in read_records(out / "journal.jsonl") if r["type"] == "session"]
    assert all(c["pool_hash"] for c in session["corpora"].values())
    _cut(out / "journal.jsonl", 8)
    before = (out / "journal.jsonl").read_text()
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: EveryOtherWord())
    refused = sweep(campaign, out, *fleet)
    assert_one_line_error(
        refused, 1, "the prompts differ", "corpus 'mine' token counts: ", "the tokenizer", "--fresh"
    )
    assert "other GPUs" not in refused.output
    assert (out / "journal.jsonl").read_text() == before
    # the same revision again resumes
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: EveryWord())
    resumed = sweep(campaign, out, *fleet)
    assert resumed.exit_code == 0, resumed.output


@pytest.mark.parametrize(
    ("model", "read"),
    [
        ("owner/Llama-GGUF:Q4_K_M", ("owner/Llama-GGUF", "Llama-GGUF-Q4_K_M.gguf")),
        ("owner/Llama-GGUF/sub/llama-Q8_0.gguf", ("owner/Llama-GGUF", "sub/llama-Q8_0.gguf")),
        ("owner/Llama-GGUF:Q2_K", None),  # that quantization is not in the cache
        ("owner/Llama", ("owner/Llama", None)),
    ],
)
def test_a_gguf_named_on_the_hub_is_tokenized_from_its_cached_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str, read: tuple | None
) -> None:
    """A .gguf named on the Hub (`owner/repo:QUANT`, `owner/repo/FILE.gguf`, as SGLang serves
    one) is no repo id: its tokenizer was asked of transformers by that name, which never
    loads, so such a campaign always estimated. It is read from the cached file, as SGLang
    reads it (fake transformers and Hugging Face cache: nothing is downloaded)."""
    import sys
    import types

    snapshot = tmp_path / "snapshot"
    for name in ("Llama-GGUF-Q4_K_M.gguf", "Llama-GGUF-Q8_0.gguf", "sub/llama-Q8_0.gguf"):
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(b"GGUF")
    asked: list[tuple[str, dict[str, Any]]] = []

    def snapshot_download(repo: str, *, allow_patterns: list[str], local_files_only: bool) -> str:
        assert local_files_only and repo == "owner/Llama-GGUF"
        return str(snapshot)

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(name: str, **kwargs: Any) -> EveryWord:
            asked.append((name, kwargs))
            if ":" in name or name.endswith(".gguf"):
                raise OSError(f"{name} is not a valid repo id")  # as the Hub says
            return EveryWord()

    hub = types.ModuleType("huggingface_hub")
    hub.snapshot_download = snapshot_download  # type: ignore[attr-defined]
    transformers = types.ModuleType("transformers")
    transformers.AutoTokenizer = AutoTokenizer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    tokenizer = dvfs.corpora.tokens.load_tokenizer(model)
    if read is None:
        assert tokenizer is None and asked == []
        return
    repo, file = read
    assert isinstance(tokenizer, EveryWord)
    wanted: dict[str, Any] = {"local_files_only": True}
    if file is not None:
        wanted["gguf_file"] = file
    assert asked == [(repo, wanted)]


def test_the_download_hint_of_a_gguf_named_on_the_hub_names_its_repo_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`huggingface-cli download owner/repo:QUANT` is refused (no repo id): the hint names the
    repo and the quantization's file alone (not every quantization the repo holds)."""
    campaign, marker = stub_campaign(tmp_path, drafters=ONE_DRAFTER, batch="[1, 2]")
    # transformers installed (where it is not, every hint starts with installing it: below)
    monkeypatch.setattr(dvfs.corpora.tokens, "transformers_missing", lambda: False)
    model = f"{marker}/Llama-GGUF:Q4_K_M"
    campaign.write_text(campaign.read_text().replace(f'model = "{marker}"', f'model = "{model}"'))
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: None)
    done = CliRunner().invoke(
        cli, ["doctor", str(campaign), "--out", str(tmp_path / "out"), "--json"]
    )
    [check] = [c for c in json.loads(done.stdout) if c["name"] == "tokenizer"]
    assert check["status"] == "warn", check
    assert (
        f"`huggingface-cli download {marker}/Llama-GGUF --include '*-Q4_K_M.gguf'`"
        in check["detail"]
    ), check
    assert f"download {model}" not in check["detail"]
    assert dvfs.corpora.tokens.download_hint(f"{marker}/Llama-GGUF/sub/llama-Q8_0.gguf") == (
        f"`huggingface-cli download {marker}/Llama-GGUF --include 'sub/llama-Q8_0.gguf'` "
        "and `pip install gguf`"
    )
    # a name no file could have (too long to look up as a local path) is still a hint
    long = f"{marker}/{'x' * 5000}/llama.gguf"
    assert dvfs.corpora.tokens.download_hint(long).startswith(
        f"`huggingface-cli download {marker}/{'x' * 5000} --include 'llama.gguf'`"
    )


def test_doctor_and_the_dry_run_count_a_resumes_prompts_as_its_sweep_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal that chose its prompts by the estimate resumes by it, though the tokenizer was
    cached since (a fresh machine's first server fetched the model); `dvfs doctor` and
    `sweep --dry-run` count the corpora that way too, so they pass the resume the sweep runs:
    counted by the tokenizer instead, no prompt of this corpus fits the input lengths (each is
    20 words: 21 tokens by the tokenizer, 30 by the estimate), and both refused it, exit 2.
    A new sweep (another folder, or --fresh) counts by the tokenizer, and all three refuse it."""
    write(
        tmp_path / "p.jsonl",
        "".join(json.dumps({"text": f"w{i} " + "word " * 19}) + "\n" for i in range(10)),
    )
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["mine"]')
    text = replace_block(text, "input_tokens = [16, 2048]", "input_tokens = [25, 2048]")
    campaign = write(
        tmp_path / "c.toml", text + '\n[corpus.mine]\npath = "p.jsonl"\nfield = "text"\n'
    )
    out = tmp_path / "out"
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: None)
    assert _invoke(campaign, out).exit_code == 0
    _cut(out / "journal.jsonl", 4)
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: EveryWord())

    def runs(*extra: str) -> list[Result]:
        return [
            CliRunner().invoke(cli, ["doctor", str(campaign), "--out", str(out), *extra]),
            CliRunner().invoke(
                cli, ["sweep", str(campaign), "--out", str(out), "--dry-run", *extra]
            ),
        ]

    for result in runs():
        assert result.exit_code == 0, result.output
        assert "distinct prompts" not in result.output
    assert "already done" in runs()[1].output
    out = tmp_path / "new"
    for result in [*runs(), _invoke(campaign, out)]:
        assert result.exit_code == 2, result.output
        assert "'mine' has 0 distinct prompts within 25-2048" in " ".join(result.output.split())
    resumed = _invoke(campaign, tmp_path / "out")
    assert resumed.exit_code == 0, resumed.output


def test_without_transformers_the_hint_installs_it_before_any_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dvfs reads every tokenizer with transformers, which its environment may lack (the
    server runs in a container, or is attached by url): then a download changes nothing, and
    prompts go out plain. Doctor's note said only "no tokenizer of MODEL in the local cache:
    `huggingface-cli download MODEL`", which a user would follow and see the same note again."""
    campaign, marker = stub_campaign(tmp_path, drafters=ONE_DRAFTER, batch="[1, 2]")
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: None)

    def tokenizer_check() -> str:
        done = CliRunner().invoke(
            cli, ["doctor", str(campaign), "--out", str(tmp_path / "out"), "--json"]
        )
        [check] = [c for c in json.loads(done.stdout) if c["name"] == "tokenizer"]
        assert check["status"] == "warn", check
        return check["detail"]

    # (raising=False: the test reads the same before dvfs had this function)
    monkeypatch.setattr(dvfs.corpora.tokens, "transformers_missing", lambda: True, raising=False)
    detail = tokenizer_check()
    assert "transformers is not installed in dvfs's environment" in detail, detail
    assert "without the model's chat template" in detail, detail
    # jinja2 too: transformers renders chat templates with it without depending on it, so
    # `pip install transformers` alone failed every sweep of a chat model once downloaded
    assert f"`pip install transformers jinja2` and `huggingface-cli download {marker}`" in detail
    monkeypatch.setattr(dvfs.corpora.tokens, "transformers_missing", lambda: False)
    detail = tokenizer_check()
    assert f"no tokenizer of {marker} in the local cache" in detail, detail
    assert "pip install" not in detail and f"`huggingface-cli download {marker}`" in detail


def test_the_dry_run_estimates_a_resume_counted_by_a_tokenizer_the_twin_does_not_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dry run's estimate sweeps the campaign's twin stand-in, whose model is the twin's
    profile (`engine.twin_model`), its tokenizer that profile's Hugging Face name: a journal
    counted by the tokenizer of the campaign's own model (a local path, this stub's name) was
    handed to it as the method to reproduce, and the dry run refused the resume, exit 1, "the
    journal chose its prompts by the tokenizer of MODEL, which is not in the local cache:
    download it (... huggingface-cli download meta-llama/...)", which the sweep then ran."""
    campaign, marker = stub_campaign(tmp_path, drafters=ONE_DRAFTER, batch="[1, 2]")
    text = campaign.read_text()
    campaign.write_text(
        text.replace(f'model = "{marker}"', f'model = "{marker}"\ntwin_model = "llama-3.1-8b"')
    )
    # the campaign's model's tokenizer is here; the twin profile's repo id is not cached
    monkeypatch.setattr(
        dvfs.corpora.tokens, "load_tokenizer", lambda m: EveryWord() if m == marker else None
    )
    out = tmp_path / "out"
    assert _invoke(campaign, out).exit_code == 0
    _cut(out / "journal.jsonl", 2)
    dry = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    said = " ".join(dry.output.split())
    assert "2 already done, 2 to run" in said and "the twin spends" in said, dry.output
    resumed = _invoke(campaign, out)
    assert resumed.exit_code == 0, resumed.output


def test_doctor_names_a_damaged_journal_once_in_the_output_folder_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer and corpora checks read the folder's journals for the method a resume
    keeps; a damaged journal failed them too ("FAIL tokenizer: ... is not a dvfs journal"),
    the folder's damage said under the tokenizer's name, which is not where it is. They count
    as a sweep starting over would, and the output folder check names the damage."""
    campaign, _ = stub_campaign(tmp_path, drafters=ONE_DRAFTER, batch="[1, 2]")
    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: EveryWord())
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.jsonl").write_text("garbage\n")
    done = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", str(out), "--json"])
    assert done.exit_code == 1, done.output
    checks = {c["name"]: c for c in json.loads(done.stdout)}
    failed = [name for name, c in checks.items() if c["status"] == "fail"]
    assert failed == ["output folder"], checks
    assert "not a dvfs journal" in checks["output folder"]["detail"], checks
    assert "prompt tokens counted by: tokenizer of" in checks["tokenizer"]["detail"], checks


class NoSystemTokenizer(WordTokenizer):
    """A template that refuses a system turn, as Gemma's does (transformers runs the
    template's raise_exception as a jinja2 TemplateError)."""

    def apply_chat_template(self, chat: list[dict[str, str]], *, tokenize: bool, **_: Any) -> Any:
        import jinja2

        if chat[0]["role"] == "system":
            raise jinja2.exceptions.TemplateError("System role not supported")
        return super().apply_chat_template(chat, tokenize=tokenize)


def test_a_chat_the_template_fetched_by_the_first_server_refuses_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts chosen by the estimate (no tokenizer cached when the sweep began) go out with
    the chat template the first server fetched: one that refuses a chat (Gemma's, a system
    turn) stopped the sweep with an internal error naming no prompt; it is the corpus's error
    (exit 2), naming the prompt and the template's reason."""
    log, out = tmp_path / "requests.jsonl", tmp_path / "out"
    campaign, _ = stub_campaign(
        tmp_path, stub={"requests_log": str(log)}, drafters=ONE_DRAFTER, batch="[1, 2]"
    )
    chats = [
        [
            {"role": "system", "content": "Answer in one paragraph."},
            {"role": "user", "content": f"Describe the history of town number {i} in detail."},
        ]
        for i in range(4)
    ]
    write(
        tmp_path / "chats.jsonl",
        "\n".join(json.dumps({"id": f"c{i}", "m": c}) for i, c in enumerate(chats)),
    )
    text = campaign.read_text().replace('corpora = ["code"]', 'corpora = ["chats"]')
    write(campaign, text + '\n[corpus.chats]\npath = "chats.jsonl"\nmessages = "m"\n')

    def load(model: str) -> Any:
        return NoSystemTokenizer() if any(out.rglob("server-*.log")) else None

    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", load)
    result = _invoke(campaign, out)
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.output
    assert "System role not supported" in result.output
    assert "'chats'" in result.output and "prompt c" in result.output


class NoJinjaTokenizer(WordTokenizer):
    """A tokenizer in an environment without jinja2, which transformers runs templates with
    (and does not itself depend on)."""

    def apply_chat_template(self, chat: list[dict[str, str]], *, tokenize: bool, **_: Any) -> Any:
        raise ImportError("apply_chat_template requires jinja2 to be installed.")


def test_a_chat_template_this_environment_cannot_run_is_not_the_corpus_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts chosen by the estimate go out with the chat template the first server fetched:
    where dvfs's environment lacks jinja2 (transformers runs templates with it, without
    depending on it) every prompt raised its ImportError, said to be the template refusing the
    prompt ("drop or merge the turns it refuses"), a corpus error (exit 2). It is this
    environment's error (exit 1), naming what to install."""
    log, out = tmp_path / "requests.jsonl", tmp_path / "out"
    campaign, _ = stub_campaign(
        tmp_path, stub={"requests_log": str(log)}, drafters=ONE_DRAFTER, batch="[1, 2]"
    )

    def load(model: str) -> Any:
        return NoJinjaTokenizer() if any(out.rglob("server-*.log")) else None

    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", load)
    result = _invoke(campaign, out)
    assert result.exit_code == 1, result.output
    assert "internal error" not in result.output
    assert "refuses" not in result.output, result.output
    assert "requires jinja2" in result.output and "pip install" in result.output, result.output
