"""Corpora: the built-ins, every loader, bad input, deterministic sampling, and a user corpus
end to end on the twin."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import SMALL_CAMPAIGN, TINY, replace_block, write
from hypothesis import given, settings
from hypothesis import strategies as st

from dvfs.campaign import load_campaign
from dvfs.cli import cli
from dvfs.corpora import BUILTIN_CORPORA, load_corpus, sample_prompts
from dvfs.corpora.model import Message, Prompt, estimate_tokens
from dvfs.corpora.sampling import fit_to_range
from dvfs.errors import CampaignError, CorpusError

CHATS = [
    [{"role": "user", "content": "Plan a two-day trip to Lisbon."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a fact."},
    ],
]


def load(tmp_path: Path, name: str, spec: dict) -> object:
    return load_corpus(name, spec, base_dir=str(tmp_path))


def test_builtin_corpora() -> None:
    for name in BUILTIN_CORPORA:
        corpus = load_corpus(name)
        assert len(corpus.prompts) >= 64, name
        assert len({p.id for p in corpus.prompts}) == len(corpus.prompts)
        for p in corpus.prompts:
            assert p.messages[-1].role == "user" and p.messages[-1].content.strip()
        lengths = sorted(p.input_tokens for p in corpus.prompts)
        assert lengths[-1] > 4 * lengths[len(lengths) // 2] / 2  # varied lengths
    conversation = load_corpus("conversation")
    assert sum(len(p.messages) > 1 for p in conversation.prompts) >= 32
    words = " ".join(p.messages[-1].content for p in load_corpus("romansh").prompts).lower().split()
    assert words.count("the") / len(words) < 0.002  # not English
    assert words.count("che") + words.count("da") > 50  # Romansh function words


def test_jsonl_field_and_messages(tmp_path: Path) -> None:
    write(
        tmp_path / "p.jsonl",
        "\n".join(json.dumps({"id": f"q{i}", "text": f"Question {i}?"}) for i in range(5)),
    )
    corpus = load(tmp_path, "mine", {"path": "p.jsonl", "field": "text"})
    assert [p.id for p in corpus.prompts] == ["q0", "q1", "q2", "q3", "q4"]
    assert corpus.prompts[0].messages == (Message("user", "Question 0?"),)
    write(tmp_path / "c.jsonl", "\n".join(json.dumps({"conv": c}) for c in CHATS))
    chats = load(tmp_path, "chats", {"path": "c.jsonl", "messages": "conv"})
    assert [m.role for m in chats.prompts[1].messages] == ["system", "user", "assistant", "user"]
    assert "sha256" in chats.source


def test_sharegpt_turns_end_on_the_user(tmp_path: Path) -> None:
    record = {
        "conversations": [
            {"from": "human", "value": "Write a haiku."},
            {"from": "gpt", "value": "Leaves fall..."},
            {"from": "human", "value": "Another one."},
            {"from": "gpt", "value": "Snow melts..."},
        ]
    }
    write(tmp_path / "s.jsonl", json.dumps(record))
    corpus = load(tmp_path, "sharegpt", {"path": "s.jsonl", "messages": "conversations"})
    assert [m.role for m in corpus.prompts[0].messages] == ["user", "assistant", "user"]
    assert corpus.prompts[0].messages[-1].content == "Another one."


def test_a_json_file_holding_one_array_is_read_as_its_records(tmp_path: Path) -> None:
    """A `.json` file of one JSON array of objects (ShareGPT's export, pretty-printed or on one
    line) is read as its records, as their JSON Lines would be; it was read line by line and
    refused ("line 1: not valid JSON" or "expected an object with fields, got a list"). Its
    errors name the record, or the line a syntax error is on; JSON Lines whose records are
    lists are still refused at their line, as is an array in a file named as JSON Lines
    (`tests/bad_inputs.py`)."""
    records = [{"id": f"c{i}", "conversations": chat} for i, chat in enumerate(CHATS)]
    spec = {"messages": "conversations"}
    write(tmp_path / "lines.jsonl", "\n".join(json.dumps(r) for r in records))
    expected = load(tmp_path, "chats", {"path": "lines.jsonl", **spec}).prompts
    for indent in (2, None):
        write(tmp_path / "chats.json", json.dumps(records, indent=indent))
        corpus = load(tmp_path, "chats", {"path": "chats.json", **spec})
        assert corpus.prompts == expected, indent
    write(tmp_path / "wrong.json", json.dumps([{"text": "a"}, {"prompt": "b"}], indent=2))
    with pytest.raises(CorpusError, match=r"wrong\.json, record 2 of the array: no field 'text'"):
        load(tmp_path, "wrong", {"path": "wrong.json", "field": "text"})
    write(tmp_path / "cut.json", '[\n  {"text": "a"},\n  {"text": "b",}\n]\n')
    with pytest.raises(CorpusError, match=r"cut\.json, line 3: not valid JSON"):
        load(tmp_path, "cut", {"path": "cut.json", "field": "text"})
    # An array holding a record that is no object (a null, text) is valid JSON: refused at
    # that record, not as "line 1: not valid JSON" (it was, pretty-printed).
    for indent in (2, None):
        write(tmp_path / "holes.json", json.dumps([{"text": "a"}, None], indent=indent))
        with pytest.raises(
            CorpusError, match=r"holes\.json, record 2 of the array: expected an object .* null"
        ):
            load(tmp_path, "holes", {"path": "holes.json", "field": "text"})
        write(tmp_path / "texts.json", json.dumps(["a", "b"], indent=indent))
        with pytest.raises(CorpusError, match=r"texts\.json, record 1 of the array: .* got text"):
            load(tmp_path, "texts", {"path": "texts.json", "field": "text"})
    # One object over several lines (a dataset's {"data": [...]}) is valid JSON but holds no
    # records: said so, not "line 1: not valid JSON"; one object on one line is JSON Lines.
    write(tmp_path / "wrapped.json", json.dumps({"data": [{"text": "a"}]}, indent=2))
    with pytest.raises(CorpusError, match=r"wrapped\.json holds one JSON object \(keys: data\)"):
        load(tmp_path, "wrapped", {"path": "wrapped.json", "field": "text"})
    # The same object on one line (json.dump's default) is read as one record of JSON Lines:
    # its refusal said only "no field 'text' (fields here: data)", though README says such a
    # file is refused with "extract its records"; it now says where the records are.
    for suffix in ("json", "jsonl"):
        write(tmp_path / f"flat.{suffix}", json.dumps({"data": [{"text": "a"}, {"text": "b"}]}))
        with pytest.raises(
            CorpusError,
            match=rf"flat\.{suffix}, line 1: no field 'text' \(fields here: data\); its 'data' "
            r"holds 2 records with 'text', .* extract them into a JSON array",
        ):
            load(tmp_path, "flat", {"path": f"flat.{suffix}", "field": "text"})
    write(tmp_path / "other.jsonl", json.dumps({"data": [{"prompt": "a"}]}))
    with pytest.raises(CorpusError, match=r"no field 'text' \(fields here: data\)$"):
        load(tmp_path, "other", {"path": "other.jsonl", "field": "text"})
    write(tmp_path / "one.json", json.dumps({"text": "a"}))
    assert len(load(tmp_path, "one", {"path": "one.json", "field": "text"}).prompts) == 1
    write(tmp_path / "lists.json", '["a"]\n["b"]\n')
    with pytest.raises(CorpusError, match=r"lists\.json, line 1: expected an object"):
        load(tmp_path, "lists", {"path": "lists.json", "field": "text"})


def test_csv_with_text_and_chat_columns(tmp_path: Path) -> None:
    import csv

    with open(tmp_path / "p.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["prompt", "chat"])
        for c in CHATS:
            writer.writerow([c[-1]["content"], json.dumps(c)])
    text = load(tmp_path, "t", {"path": "p.csv", "field": "prompt"})
    assert text.prompts[1].messages == (Message("user", "Tell me a fact."),)
    chat = load(tmp_path, "c", {"path": "p.csv", "messages": "chat"})
    assert len(chat.prompts[1].messages) == 4


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "question": [f"What is {i} + {i}?" for i in range(4)],
            "messages": [json.dumps(CHATS[0])] * 4,
        }
    )
    pq.write_table(table, tmp_path / "q.parquet")
    corpus = load(tmp_path, "gsm", {"path": "q.parquet", "field": "question", "limit": 3})
    assert [p.messages[0].content for p in corpus.prompts] == [
        "What is 0 + 0?",
        "What is 1 + 1?",
        "What is 2 + 2?",
    ]
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(CorpusError, match="broken.parquet: not a readable Parquet file"):
        load(tmp_path, "x", {"path": "broken.parquet", "field": "question"})


def test_data_shipped_in_a_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "site" / "acme_prompts"
    write(package / "__init__.py", "")
    write(package / "data" / "prompts.jsonl", json.dumps({"text": "Summarise the report."}))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    corpus = load(
        tmp_path,
        "acme",
        {"package": "acme_prompts", "resource": "data/prompts.jsonl", "field": "text"},
    )
    assert corpus.prompts[0].messages[0].content == "Summarise the report."
    assert corpus.source.startswith("package acme_prompts")
    with pytest.raises(CorpusError, match="package 'no_such_pkg' is not installed"):
        load(tmp_path, "x", {"package": "no_such_pkg", "resource": "a.jsonl", "field": "text"})


def test_hugging_face_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    spec = {"dataset": "openai/gsm8k", "config": "main", "split": "test", "field": "question"}
    with pytest.raises(CorpusError, match=r"pip install 'dvfs\[datasets\]'"):
        load(tmp_path, "gsm8k", spec)
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return [{"question": "Tom has 3 apples..."}, {"question": "A train leaves..."}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    corpus = load(tmp_path, "gsm8k", spec)
    assert calls == [("openai/gsm8k", "main", "test")] and len(corpus.prompts) == 2
    assert corpus.source == "Hugging Face dataset openai/gsm8k/main split test"

    def offline(name, config, split):
        raise ConnectionError("hub unreachable")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(CorpusError, match="hub reachable.*path = "):
        load(tmp_path, "gsm8k", spec)


@pytest.mark.parametrize(
    ("content", "spec", "message"),
    [
        (
            '{"text": "ok"}\n{"prompt": "no text field"}\n',
            {"field": "text"},
            r"p\.jsonl, line 2: no field 'text' \(fields here: prompt\)",
        ),
        (
            '{"text": "ok"}\n{"text": 42}\n',
            {"field": "text"},
            r"p\.jsonl, line 2: field 'text' holds a number, not text",
        ),
        ('{"text": "ok"}\n{"text": "cut\n', {"field": "text"}, r"p\.jsonl, line 2: not valid JSON"),
        ("\n\n", {"field": "text"}, r"p\.jsonl is empty"),
        ('{"chat": "hello"}\n', {"messages": "chat"}, r"line 1: the messages field 'chat' is text"),
        (
            '{"chat": [{"role": "assistant", "content": "hi"}]}\n',
            {"messages": "chat"},
            r"line 1: the chat has no user turn",
        ),
        ('["a", "b"]\n', {"field": "text"}, r"line 1: expected an object with fields, got a list"),
        (  # ShareGPT exports hold some conversations with no turns
            '{"chat": [{"from": "human", "value": "hi"}]}\n{"chat": []}\n',
            {"messages": "chat"},
            r"line 2: the messages field 'chat' must be a non-empty list of turns, got an empty "
            r"list$",
        ),
        (  # a lone surrogate in a chat's turn (a field's: test_an_unreadable_corpus_file...)
            '{"chat": [{"role": "user", "content": "ok"}]}\n'
            '{"chat": [{"role": "user", "content": "\\udc00 cut"}]}\n',
            {"messages": "chat"},
            r"line 2: turn 0 holds a lone UTF-16 surrogate \(\\udc00, .* at character 0",
        ),
        (  # as an empty field is refused, not sent as an empty prompt
            '{"chat": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "?"},'
            ' {"role": "user", "content": " \\n"}, {"role": "assistant", "content": "?"}]}\n',
            {"messages": "chat"},
            r"line 1: turn 2, the user turn the model answers, is empty",
        ),
    ],
)
def test_bad_input_names_file_and_line(
    tmp_path: Path, content: str, spec: dict, message: str
) -> None:
    write(tmp_path / "p.jsonl", content)
    with pytest.raises(CorpusError, match=message):
        load(tmp_path, "bad", {"path": "p.jsonl", **spec})


def test_csv_missing_column_names_the_line(tmp_path: Path) -> None:
    write(tmp_path / "p.csv", "title,body\nA,first\nB,second\n")
    with pytest.raises(CorpusError, match=r"p\.csv, line 2: no field 'prompt'"):
        load(tmp_path, "bad", {"path": "p.csv", "field": "prompt"})


def test_a_csv_header_naming_the_prompt_column_twice_is_refused(tmp_path: Path) -> None:
    """A header naming the prompt column twice (`text,text`: two exports pasted side by side)
    gave every prompt the second column's cell, silently; the other columns may repeat (an
    export's unnamed trailing columns) without harm."""
    rows = "".join(f"question {i},answer {i},\n" for i in range(4))
    write(tmp_path / "p.csv", "text,text,\n" + rows)
    with pytest.raises(CorpusError, match=r"p\.csv, line 1: the header names column 'text' 2"):
        load(tmp_path, "twice", {"path": "p.csv", "field": "text"})
    write(tmp_path / "q.csv", "text,,\n" + rows)
    corpus = load(tmp_path, "once", {"path": "q.csv", "field": "text"})
    assert [p.messages[0].content for p in corpus.prompts] == [f"question {i}" for i in range(4)]


def test_a_json_record_naming_a_key_twice_is_refused(tmp_path: Path) -> None:
    """A JSON Lines or JSON array record naming a key twice (two "prompt" keys, two roles in a
    turn) kept the last value silently, as json reads it; it is refused in one line naming
    the file and the line (an array's record by its place), as a CSV header naming the prompt
    column twice is. Records naming each key once read as before."""
    good = [json.dumps({"prompt": f"Describe the Rhine, part {i}."}) for i in range(3)]
    twice = '{"prompt": "Describe the Rhine.", "prompt": "the other"}'
    write(tmp_path / "p.jsonl", "\n".join([good[0], twice, *good[1:]]) + "\n")
    with pytest.raises(CorpusError, match=r"p\.jsonl, line 2: an object names the key 'prompt'"):
        load(tmp_path, "twice", {"path": "p.jsonl", "field": "prompt"})
    write(tmp_path / "a.json", "[\n" + ",\n".join([*good, twice]) + "\n]\n")
    with pytest.raises(CorpusError, match=r"a\.json, record 4 of the array: .* key 'prompt'"):
        load(tmp_path, "array", {"path": "a.json", "field": "prompt"})
    turns = '[{"role": "system", "role": "user", "content": "Explain canal locks."}]'
    write(tmp_path / "m.jsonl", '{"messages": ' + turns + "}\n")
    with pytest.raises(CorpusError, match=r"m\.jsonl, line 1: an object names the key 'role'"):
        load(tmp_path, "chat", {"path": "m.jsonl", "messages": "messages"})
    write(tmp_path / "ok.jsonl", "\n".join(good) + "\n")
    corpus = load(tmp_path, "once", {"path": "ok.jsonl", "field": "prompt"})
    assert [p.messages[0].content for p in corpus.prompts] == [
        f"Describe the Rhine, part {i}." for i in range(3)
    ]
    # the CLI says it in one line, exit 2, as a corpus file it cannot use
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["twice"]')
    campaign = write(
        tmp_path / "c.toml", text + '\n[corpus.twice]\npath = "p.jsonl"\nfield = "prompt"\n'
    )
    shown = CliRunner().invoke(cli, ["corpus", "show", "twice", "--campaign", str(campaign)])
    assert shown.exit_code == 2, shown.output
    assert "p.jsonl, line 2: an object names the key 'prompt' twice" in " ".join(
        shown.output.split()
    )


def test_a_deep_json_array_record_naming_a_key_twice_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.12 and later read JSON nested deeper than the interpreter's recursion limit
    (their json keeps a limit of its own): a `.json` array whose record nests a few thousand
    levels deep, naming a key twice in there, crashed the walk looking for that key with a
    RecursionError (an internal error), where the file's record is due. json is given that
    room here as 3.12 has it (on 3.11 it shares the interpreter's limit)."""
    import dvfs.corpora.loaders as loaders

    def roomy(*args: Any, **kwargs: Any) -> Any:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit * 10)
        try:
            return json.loads(*args, **kwargs)
        finally:
            sys.setrecursionlimit(limit)

    class Roomy(json.JSONDecoder):  # an array is read a record at a time: the same room
        def raw_decode(self, *args: Any, **kwargs: Any) -> Any:
            limit = sys.getrecursionlimit()
            sys.setrecursionlimit(limit * 10)
            try:
                return super().raw_decode(*args, **kwargs)
            finally:
                sys.setrecursionlimit(limit)

    monkeypatch.setattr(
        loaders,
        "json",
        types.SimpleNamespace(loads=roomy, JSONDecoder=Roomy, JSONDecodeError=json.JSONDecodeError),
    )
    depth = 3 * sys.getrecursionlimit()
    deep = "[" * depth + '{"a": 1, "a": 2}' + "]" * depth
    write(tmp_path / "deep.json", '[{"prompt": "Describe the Rhine.", "meta": ' + deep + "}]\n")
    with pytest.raises(CorpusError, match=r"deep\.json, record 1 of the array: .* key 'a'"):
        load(tmp_path, "deep", {"path": "deep.json", "field": "prompt"})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"path": "a.jsonl", "dataset": "x", "field": "t"}, "exactly one source"),
        ({"path": "a.jsonl"}, "exactly one of field"),
        ({"path": "a.jsonl", "field": "t", "colour": "red"}, "unknown key"),
        ({"path": "a.jsonl", "field": "t", "acceptance_like": "poetry"}, "must name a built-in"),
        ({"path": "a.jsonl", "field": "t", "format": "xml"}, "format 'xml'"),
    ],
)
def test_campaign_validates_corpus_tables(tmp_path: Path, spec: dict, message: str) -> None:
    table = "\n".join(f"{k} = {json.dumps(v)}" for k, v in spec.items())
    text = (
        replace_block(
            SMALL_CAMPAIGN, 'corpora = ["code", "conversation"]', 'corpora = ["code", "mine"]'
        )
        + f"\n[corpus.mine]\n{table}\n"
    )
    with pytest.raises(CampaignError, match=rf"\[corpus\.mine\].*{message}"):
        load_campaign(write(tmp_path / "c.toml", text))


def test_sampling_is_deterministic_and_refuses_too_few() -> None:
    corpus = load_corpus("math")
    a = sample_prompts(corpus, 8, input_tokens=(16, 2048), seed=7, key=(8, 0, 0))
    b = sample_prompts(corpus, 8, input_tokens=(16, 2048), seed=7, key=(8, 0, 0))
    c = sample_prompts(corpus, 8, input_tokens=(16, 2048), seed=7, key=(8, 0, 1))
    assert [p.id for p in a] == [p.id for p in b] != [p.id for p in c]
    assert len({p.id for p in a}) == 8
    with pytest.raises(
        CorpusError, match="has .* prompts within 16-2048 input tokens but the workload needs 500"
    ):
        sample_prompts(corpus, 500, input_tokens=(16, 2048), seed=0)


def test_a_prompt_given_twice_is_never_sampled_twice_into_one_batch(tmp_path: Path) -> None:
    """A file holding each text twice has half as many prompts to sample: a batch of four from
    two texts would repeat prompts, which prefix caching flatters (README, Corpora). Two
    prompts trimmed to the same text count once too."""
    texts = ["Describe the Rhine in winter.", "Explain how a lock keeps a canal level."]
    lines = [json.dumps({"text": t}) for t in texts * 2]
    write(tmp_path / "d.jsonl", "\n".join(lines) + "\n")
    corpus = load_corpus("dup", {"path": "d.jsonl", "field": "text"}, base_dir=str(tmp_path))
    assert len(corpus.prompts) == 4
    with pytest.raises(CorpusError, match="has 2 distinct prompts within 1-2048"):
        sample_prompts(corpus, 4, input_tokens=(1, 2048), seed=0)
    pair = sample_prompts(corpus, 2, input_tokens=(1, 2048), seed=0)
    assert {p.messages[0].content for p in pair} == set(texts)
    # `dvfs corpus list` and `show` say how many of the prompts are distinct (they counted
    # 4 prompts, and the sweep then found 2 to sample); a corpus without repeats as before.
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["dup"]')
    campaign = write(
        tmp_path / "c.toml", text + '\n[corpus.dup]\npath = "d.jsonl"\nfield = "text"\n'
    )
    listed = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(campaign), "--json"])
    rows = {r["name"]: r for r in json.loads(listed.output)["corpora"]}
    assert (rows["dup"]["prompts"], rows["dup"]["distinct"]) == (4, 2)
    assert rows["code"]["distinct"] == rows["code"]["prompts"]
    table = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(campaign)])
    assert "4 (2 distinct)" in table.output, table.output
    shown = CliRunner().invoke(cli, ["corpus", "show", "dup", "--campaign", str(campaign)])
    assert "dup: 4 prompts (2 distinct, 0 multi-turn)" in " ".join(shown.output.split())
    plain = CliRunner().invoke(cli, ["corpus", "show", "code", "--campaign", str(campaign)])
    assert "prompts (0 multi-turn)" in plain.output and "distinct" not in plain.output

    same_start = "word " * 200
    write(
        tmp_path / "t.jsonl",
        "\n".join(json.dumps({"text": same_start + end}) for end in ("one", "two")) + "\n",
    )
    trimmed = load_corpus("trim", {"path": "t.jsonl", "field": "text"}, base_dir=str(tmp_path))
    with pytest.raises(CorpusError, match="has 1 distinct prompts within 1-50"):
        sample_prompts(trimmed, 2, input_tokens=(1, 50), seed=0)


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(min_size=1, max_size=3000).filter(str.strip),
    lo=st.integers(1, 200),
    span=st.integers(0, 800),
)
def test_fitting_to_the_input_range(text: str, lo: int, span: int) -> None:
    hi = lo + span
    messages = (Message("user", text),)
    prompt = Prompt("p", messages, estimate_tokens(messages))
    fitted = fit_to_range(prompt, lo, hi)
    if prompt.input_tokens < lo:
        assert fitted is None
    elif fitted is not None:
        assert lo <= fitted.input_tokens <= hi
        assert fitted.messages[-1].content == text[: len(fitted.messages[-1].content)]


@pytest.mark.parametrize("chars_per_token", [2.5, 6.0])
def test_a_long_prompt_counted_by_a_tokenizer_is_trimmed_to_the_range(
    chars_per_token: float,
) -> None:
    """A tokenizer denser (or sparser) than characters / 4: a prompt far above the range is cut
    to about max_tokens by its own count, never dropped nor cut far short of it."""

    def count(messages: tuple[Message, ...]) -> int:
        return math.ceil(sum(len(m.content) for m in messages) / chars_per_token) + 3

    for chars in (16_000, 40_000, 90_000):
        messages = (Message("user", "Rumantsch text. " * (chars // 16)),)
        prompt = Prompt("p", messages, count(messages))
        assert prompt.input_tokens > 2048
        fitted = fit_to_range(prompt, 16, 2048)
        assert fitted is not None and fitted.input_tokens == 2048
        assert 0.98 * 2048 <= count(fitted.messages) <= 2048


def test_corpus_list_and_show_print_brackets_in_user_text_as_text(tmp_path: Path) -> None:
    """Ids and descriptions come from the user's files: "[/x]" in one is text, not rich markup
    (it was an internal error), and "[red]" is shown, not applied."""
    rows = [{"id": "[/x]", "text": "Sum the first ten primes."}, {"id": "[red]r", "text": "Hi."}]
    write(tmp_path / "ids.jsonl", "\n".join(json.dumps(r) for r in rows))
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["code", "mine"]')
    text += '\n[corpus.mine]\npath = "ids.jsonl"\nfield = "text"\ndescription = "[/in] house"\n'
    campaign = write(tmp_path / "c.toml", text)
    listed = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(campaign)])
    assert listed.exit_code == 0, listed.output
    assert "[/in] house" in listed.output
    shown = CliRunner().invoke(
        cli, ["corpus", "show", "mine", "-n", "2", "--campaign", str(campaign)]
    )
    assert shown.exit_code == 0, shown.output
    assert "[/x] (" in shown.output and "[red]r (" in shown.output


def test_corpus_list_with_a_campaign_adds_its_own_to_the_built_ins(tmp_path: Path) -> None:
    """`--campaign FILE` adds the campaign's own corpora to the built-in ones (as the README and
    the option's help say), not in their place: a campaign naming one corpus of its own listed
    only that, and `corpus show code --campaign FILE` was "no corpus 'code'"."""
    from dvfs.corpora import BUILTIN_CORPORA

    rows = [{"task": f"Write a function that returns the {i}-th prime."} for i in range(6)]
    write(tmp_path / "tasks.jsonl", "\n".join(json.dumps(r) for r in rows))
    table = '\n[corpus.tasks]\npath = "tasks.jsonl"\nfield = "task"\n'
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["tasks"]')
    campaign = write(tmp_path / "c.toml", text + table)
    listed = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(campaign), "--json"])
    assert listed.exit_code == 0, listed.output
    names = [c["name"] for c in json.loads(listed.output)["corpora"]]
    assert names == [*BUILTIN_CORPORA, "tasks"]
    for name in ("code", "tasks"):
        shown = CliRunner().invoke(cli, ["corpus", "show", name, "--campaign", str(campaign)])
        assert shown.exit_code == 0, shown.output
    # a corpus the campaign defines but does not sweep yet (being tried out) is listed too
    trial = write(tmp_path / "t.toml", TINY + table)  # it sweeps code only
    listed = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(trial), "--json"])
    assert listed.exit_code == 0, listed.output
    assert [c["name"] for c in json.loads(listed.output)["corpora"]] == [*BUILTIN_CORPORA, "tasks"]
    shown = CliRunner().invoke(cli, ["corpus", "show", "tasks", "--campaign", str(trial)])
    assert shown.exit_code == 0 and "prime" in shown.output, shown.output
    # a table named as a built-in is the campaign's corpus: listed with its own description (none
    # here), not the built-in's, which described these 6 prompts as the built-in code corpus
    from dvfs.corpora.registry import BUILTIN_DESCRIPTIONS

    for swept in ('corpora = ["code"]', 'corpora = ["math"]'):  # swept, or not yet
        shadow = write(
            tmp_path / "s.toml",
            replace_block(TINY, 'corpora = ["code"]', swept)
            + table.replace("[corpus.tasks]", "[corpus.code]"),
        )
        listed = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(shadow), "--json"])
        assert listed.exit_code == 0, listed.output
        by_name = {c["name"]: c for c in json.loads(listed.output)["corpora"]}
        assert by_name["code"]["prompts"] == len(rows)  # the campaign's, not the built-in
        assert by_name["code"]["description"] != BUILTIN_DESCRIPTIONS["code"]
        assert by_name["math"]["description"] == BUILTIN_DESCRIPTIONS["math"]


def test_a_user_corpus_end_to_end_on_the_twin(tmp_path: Path) -> None:
    rows = [
        {"task": f"Write a function that returns the {i}-th prime number, with tests."}
        for i in range(12)
    ]
    write(tmp_path / "data" / "tasks.jsonl", "\n".join(json.dumps(r) for r in rows))
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["code", "tasks"]')  # 32 cells
    text += (
        '\n[corpus.tasks]\npath = "data/tasks.jsonl"\nfield = "task"\n'
        'acceptance_like = "code"\ndescription = "prime-number tasks"\n'
    )
    campaign = write(tmp_path / "user.toml", text)
    listed = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(campaign), "--json"])
    assert listed.exit_code == 0, listed.output
    names = {c["name"]: c for c in json.loads(listed.output)["corpora"]}
    assert names["tasks"]["prompts"] == 12 and names["tasks"]["description"] == "prime-number tasks"
    shown = CliRunner().invoke(cli, ["corpus", "show", "tasks", "--campaign", str(campaign)])
    assert shown.exit_code == 0 and "prime number" in shown.output
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    import dvfs

    ds = dvfs.open_cube(str(out / "cube.nc"))
    assert list(ds["corpus"].values) == ["code", "tasks"]
    assert (ds["cell_status"] == 1).all()
    provenance = json.loads(ds.attrs["corpora"])
    assert provenance["tasks"]["prompts"] == 12 and len(provenance["tasks"]["content_hash"]) == 16
    assert "tasks.jsonl" in provenance["tasks"]["source"]
    assert (ds["accept_length"].sel(drafter="eagle3") > 1.5).all()


def test_the_twin_takes_acceptance_from_the_text_it_is_given() -> None:
    """Acceptance follows the corpus's text profile (the sweep's, with acceptance_like applied);
    an engine given none reads the round's own prompts, whatever the corpus is called."""
    from dvfs.campaign import DrafterSpec
    from dvfs.engines.base import Workload
    from dvfs.engines.twin import TwinEngine
    from dvfs.twin.drafting import plan_drafter
    from dvfs.twin.profiles import model_profile
    from dvfs.twin.textprior import builtin_profile, profile_prompts

    romansh = builtin_profile("romansh")
    engine = TwinEngine(node=None, model=model_profile("llama-3.1-8b"), texts={"tasks": romansh})
    plan = plan_drafter(DrafterSpec("e", "EAGLE3", "eagle3-llama-3.1-8b", 5, 4, 8), engine.model)
    assert plan is not None
    engine._plan = plan
    prompt = load_corpus("code").prompts[0]

    def alpha(corpus: str) -> float:
        return engine._acceptance(Workload(1, (prompt,), corpus, 8, 0.0, True))[0]

    assert alpha("tasks") == plan.alpha(romansh, 0.0) < alpha("romansh")
    assert alpha("romansh") == alpha("anything") == plan.alpha(profile_prompts((prompt,)), 0.0)


#: A user corpus file the campaign names that is missing, damaged or cannot be read (as a
#: campaign file would be): the input's fault, an invalid campaign (exit 2). A missing library
#: or package is this environment's (exit 1: tests/test_bad_inputs.py).
UNREADABLE = [
    pytest.param("missing.jsonl", None, 2, "does not exist", id="missing"),
    pytest.param("bad.jsonl", '{"text": "a"}\n{bad json\n', 2, "not valid JSON", id="bad-json"),
    # "cannot read corpus file PATH: Not a directory" said neither which part nor what to do
    pytest.param(
        "plain.jsonl/x.jsonl",
        None,
        2,
        "plain.jsonl is a file, not a folder; check the corpus's path",
        id="under-a-file",
    ),
    # JSON's escape of half an emoji: read, it failed the sweep (exit 1) with "cannot write
    # '\\ud83d' in the utf-8 encoding: set PYTHONIOENCODING=utf-8", while doctor passed it
    pytest.param(
        "cut.jsonl",
        '{"text": "a"}\n{"text": "an emoji cut \\ud83d in two"}\n',
        2,
        "line 2: field 'text' holds a lone UTF-16 surrogate (\\ud83d",
        id="lone-surrogate",
    ),
]


@pytest.mark.parametrize(("path", "content", "code", "says"), UNREADABLE)
def test_an_unreadable_corpus_file_has_one_exit_code_everywhere(
    tmp_path: Path, path: str, content: str | None, code: int, says: str
) -> None:
    """`sweep --dry-run`, `sweep` and `doctor` refuse the same campaign alike: the dry run
    uses the sweep's exit code, and doctor's invalid-campaign failures are the sweep's."""
    if content is not None:
        write(tmp_path / path, content)
    write(tmp_path / "plain.jsonl", '{"text": "a"}\n')
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["code", "mine"]')
    text += f'\n[corpus.mine]\npath = "{path}"\nfield = "text"\n'
    campaign = str(write(tmp_path / "c.toml", text))
    out = str(tmp_path / "out")
    for args in (
        ["sweep", campaign, "--dry-run", "--out", out],
        ["sweep", campaign, "--out", out, "--no-progress"],
        ["doctor", campaign, "--out", out],
    ):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == code, (args, result.output)
        assert says in " ".join(result.output.split()), (args, result.output)
        assert "Traceback" not in result.output
    assert not (tmp_path / "out" / "journal.jsonl").exists()


def test_doctor_says_which_prompts_the_sweep_samples_from(tmp_path: Path) -> None:
    """A corpus's prompts outside workload.input_tokens are skipped (too short, or too long to
    trim: the earlier turns alone exceed it) or trimmed, and a text given twice counts once
    (README, Corpora): `dvfs doctor` says so, rather than the file's count alone, which would
    pass a corpus of mostly short prompts as if the sweep measured them all."""

    def chat(*turns: str) -> dict:
        return {"chat": [{"role": "user", "content": t} for t in turns]}

    normal = [chat(f"prompt {i}: " + "word " * 12) for i in range(10)]  # 22 tokens each
    records = [*normal, normal[0]]
    records += [chat(f"hi {i}") for i in range(3)]  # 6 tokens by the estimate
    records += [chat("word " * 2000)]  # 2505 tokens: trimmed to 2048
    records += [chat("word " * 2000, "and now?")]  # the first turn alone is over 2048
    for name, rows in (("mine", records), ("plain", normal)):
        write(tmp_path / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["code", "mine", "plain"]')
    text = replace_block(text, "batch = [1, 8]", "batch = [1]")
    for name in ("mine", "plain"):
        text += f'\n[corpus.{name}]\npath = "{name}.jsonl"\nmessages = "chat"\n'
    campaign = write(tmp_path / "c.toml", text)
    out = str(tmp_path / "out")
    done = CliRunner().invoke(cli, ["doctor", str(campaign), "--out", out, "--json"])
    assert done.exit_code == 0, done.output
    [check] = [c for c in json.loads(done.stdout) if c["name"] == "corpora"]
    assert f"plain ({len(normal)} prompts)" in check["detail"], check  # all used as written
    assert (
        f"mine ({len(records)} prompts, 11 to sample: 3 under 16 tokens skipped, 1 over 2048 "
        "trimmed, 1 over 2048 skipped (too long to trim), 1 repeat)"
    ) in check["detail"], check


def _counts_of_four_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: object
) -> list[int]:
    """The tokens `corpus show --json` counts, with `tokenizer` as the model's, for four
    prompts of 20 to 23 words (one token a word)."""
    import dvfs.corpora.tokens

    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: tokenizer)
    rows = [{"text": " ".join(["word"] * (20 + i))} for i in range(4)]
    write(tmp_path / "p.jsonl", "\n".join(json.dumps(r) for r in rows))
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["mine"]')
    campaign = write(
        tmp_path / "c.toml", text + '\n[corpus.mine]\npath = "p.jsonl"\nfield = "text"\n'
    )
    shown = CliRunner().invoke(
        cli, ["corpus", "show", "mine", "--campaign", str(campaign), "-n", "4", "--json"]
    )
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.output)
    assert report["token_count_method"].startswith("tokenizer of ")
    return [p["input_tokens"] for p in report["sample"]]


def test_a_tokenizer_returning_its_encoding_counts_the_prompts_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5's apply_chat_template returns a BatchEncoding (input_ids and
    attention_mask) unless told return_dict=False: its len() of 2 was taken for every prompt's
    token count, so a campaign counting with its model's tokenizer listed every prompt at 2
    tokens, skipped them all as shorter than input_tokens and never trimmed a long one."""

    class V5Tokenizer:
        chat_template = "{{ messages }}"

        def apply_chat_template(
            self, chat: list[dict[str, str]], *, tokenize: bool, return_dict: bool = True, **_: Any
        ) -> Any:
            ids = " ".join(m["content"] for m in chat).split()
            if not tokenize:
                return " ".join(ids)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    assert _counts_of_four_prompts(tmp_path, monkeypatch, V5Tokenizer()) == [20, 21, 22, 23]


def test_corpus_list_gives_the_acceptance_class_a_campaign_sets(tmp_path: Path) -> None:
    """`corpus list --campaign --json` gave a corpus with `acceptance_like = "code"` the class
    its text reads as (English prose here), where the twin, and the cube's `corpora`
    attribute, take the campaign's: the list now says the class the sweep uses, and that the
    campaign set it."""
    rows = [{"text": f"Summarise the history of the town, chapter {i}."} for i in range(6)]
    write(tmp_path / "p.jsonl", "\n".join(json.dumps(r) for r in rows))
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["mine"]')
    table = '\n[corpus.mine]\npath = "p.jsonl"\nfield = "text"\nacceptance_like = "code"\n'
    for swept in (text, TINY):  # swept, or a table not swept yet
        campaign = write(tmp_path / "c.toml", swept + table)
        listed = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(campaign), "--json"])
        assert listed.exit_code == 0, listed.output
        by_name = {c["name"]: c["text"] for c in json.loads(listed.output)["corpora"]}
        assert by_name["mine"]["acceptance_class"] == "code"
        assert by_name["mine"]["acceptance_like"] == "code"
        assert by_name["english"]["acceptance_like"] is None


def test_corpus_list_table_says_the_class_each_corpus_is_accepted_as(tmp_path: Path) -> None:
    """`corpus list --campaign`'s table gave only how a corpus reads ("prose, english"), not
    the class the twin's trained drafters accept it as, so a campaign's `acceptance_like` (and
    the Romansh row any non-English text takes) showed nowhere but in --json: the table says
    both, and that the campaign set the class."""
    rows = [{"text": f"Summarise the history of the town, chapter {i}."} for i in range(6)]
    write(tmp_path / "p.jsonl", "\n".join(json.dumps(r) for r in rows))
    table = '\n[corpus.mine]\npath = "p.jsonl"\nfield = "text"\nacceptance_like = "code"\n'
    campaign = write(tmp_path / "c.toml", TINY + table)
    listed = CliRunner().invoke(
        cli, ["corpus", "list", "--campaign", str(campaign)], env={"COLUMNS": "400"}
    )
    assert listed.exit_code == 0, listed.output
    cells = {
        line.split("│")[1].strip(): line.split("│")[5].strip()
        for line in listed.output.splitlines()
        if line.startswith("│")
    }
    # (its text reads as English math, for the chapters' digits)
    assert cells["mine"] == "math, english; accepts like code (acceptance_like)", cells
    assert cells["romansh"] == "prose, romansh; accepts like romansh", cells
    assert cells["code"] == "code, english; accepts like code", cells


def test_a_chat_the_models_template_refuses_is_named_by_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat template that refuses a chat (Gemma's raises "System role not supported" for a
    system turn, as transformers runs it: a jinja2 TemplateError) broke off counting the
    corpus's tokens with an internal error that named no corpus, file or line; it is the
    corpus's error now (exit 2), naming the line and the template's reason."""
    import jinja2

    import dvfs.corpora.tokens

    class NoSystemTokenizer:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, chat: list[dict[str, str]], **_: Any) -> Any:
            if chat[0]["role"] == "system":
                raise jinja2.exceptions.TemplateError("System role not supported")
            return " ".join(m["content"] for m in chat).split()

    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: NoSystemTokenizer())
    chats = [
        [{"role": "user", "content": "Plan a trip to Chur."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    ]
    write(tmp_path / "p.jsonl", "\n".join(json.dumps({"messages": c}) for c in chats))
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["mine"]')
    table = '\n[corpus.mine]\npath = "p.jsonl"\nmessages = "messages"\n'
    campaign = write(tmp_path / "c.toml", text + table)
    shown = CliRunner().invoke(cli, ["corpus", "show", "mine", "--campaign", str(campaign)])
    assert shown.exit_code == 2, shown.output
    assert "internal error" not in shown.output
    assert "p.jsonl, line 2" in shown.output and "System role not supported" in shown.output


def test_a_tokenizer_whose_chat_template_takes_no_return_dict_still_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers before return_dict was an argument of apply_chat_template (4.34's, which
    introduced chat templates) hands every further keyword to encode(), whose fast tokenizer
    refuses one it does not know with a TypeError: asking for return_dict=False there made
    every prompt of every corpus "refused by the chat template" (exit 2), where the ids it
    returns by default were counted before. It is asked for only where it is an argument."""

    class Pre437Tokenizer:
        chat_template = "{{ messages }}"

        def encode(self, text: str, *, add_special_tokens: bool, **kwargs: Any) -> list[str]:
            if kwargs:  # PreTrainedTokenizerFast._batch_encode_plus takes no **kwargs
                name = next(iter(kwargs))
                raise TypeError(f"_batch_encode_plus() got an unexpected keyword argument {name!r}")
            return text.split()

        def apply_chat_template(
            self,
            conversation: list[dict[str, str]],
            chat_template: str | None = None,
            add_generation_prompt: bool = False,
            tokenize: bool = True,
            **tokenizer_kwargs: Any,
        ) -> Any:
            rendered = " ".join(m["content"] for m in conversation)
            if not tokenize:
                return rendered
            return self.encode(rendered, add_special_tokens=False, **tokenizer_kwargs)

    assert _counts_of_four_prompts(tmp_path, monkeypatch, Pre437Tokenizer()) == [20, 21, 22, 23]


def test_a_chat_template_this_environment_cannot_run_is_not_called_a_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers runs chat templates with jinja2, which it does not itself depend on: in an
    environment without it (dvfs's own, given `pip install transformers` alone) every chat
    raised its ImportError, and the corpus's first line was said to be "refused by the chat
    template: drop or merge the turns it refuses" (exit 2, as bad input). It is this
    environment's error (exit 1), naming what to install, and no line of the corpus."""
    import dvfs.corpora.tokens

    class NoJinjaTokenizer:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, chat: list[dict[str, str]], **_: Any) -> Any:
            raise ImportError("apply_chat_template requires jinja2 to be installed.")

    monkeypatch.setattr(dvfs.corpora.tokens, "load_tokenizer", lambda model: NoJinjaTokenizer())
    write(tmp_path / "p.jsonl", json.dumps({"text": "Plan a trip to Chur."}))
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["mine"]')
    campaign = write(
        tmp_path / "c.toml", text + '\n[corpus.mine]\npath = "p.jsonl"\nfield = "text"\n'
    )
    shown = CliRunner().invoke(cli, ["corpus", "show", "mine", "--campaign", str(campaign)])
    assert shown.exit_code == 1, shown.output
    assert "internal error" not in shown.output
    assert "refuses" not in shown.output and "line 1" not in shown.output, shown.output
    assert "requires jinja2" in shown.output and "pip install" in shown.output, shown.output


def test_a_corpus_cut_short_by_its_limit_says_to_raise_it(tmp_path: Path) -> None:
    # A `[corpus.NAME]` table whose `limit` keeps fewer prompts than the largest batch was
    # refused with "add prompts" alone, though its file held plenty: the limit is the setting
    # to change. A file that is itself short still says only that.
    records = "".join(
        json.dumps({"text": f"Prompt {i}: explain in detail why the sky is blue at noon."}) + "\n"
        for i in range(20)
    )
    write(tmp_path / "p.jsonl", records)
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["mine"]')
    limited = text + '\n[corpus.mine]\npath = "p.jsonl"\nfield = "text"\nlimit = 2\n'
    campaign = write(tmp_path / "c.toml", limited)
    for command in ("sweep", "doctor"):
        result = CliRunner().invoke(cli, [command, str(campaign), "--out", str(tmp_path / "o")])
        said = " ".join(result.output.split())
        assert result.exit_code == 2, said
        assert "has 2 distinct prompts" in said and "raise [corpus.mine] limit" in said, said
    write(tmp_path / "p.jsonl", records.split("\n", 18)[-1])  # two records, below the limit
    write(tmp_path / "c.toml", limited.replace("limit = 2", "limit = 5"))
    result = CliRunner().invoke(cli, ["sweep", str(campaign), "--out", str(tmp_path / "o")])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "has 2 distinct prompts" in said, said
    assert "limit" not in said


@pytest.mark.parametrize(
    ("fmt", "refusal"), [("jsonl", "line 1: not valid JSON"), ("csv", "line 2: no field 'text'")]
)
def test_a_large_file_that_is_no_corpus_is_refused_without_a_copy_of_every_line(
    tmp_path: Path, fmt: str, refusal: str
) -> None:
    """A log named as a corpus is refused at its first lines, but only after a copy of all of
    it was made: JSON Lines split every line into a list held at once (713 MB of memory for a
    200 MB file), CSV handed the text to `io.StringIO`, four bytes a character (1.26 GB); some
    3.5 and 6.5 GB at the 1 GiB limit. Lines are now read one at a time: the file's bytes and
    its text, about twice its size."""
    import tracemalloc

    from dvfs.corpora.loaders import load_user_corpus

    log = tmp_path / f"corpus.{fmt}"
    line = "2026-12-06 12:00:00 INFO a log line, not JSON " * 4 + "\n"
    log.write_text(line * ((8 << 20) // len(line)))
    spec = {"path": str(log), "format": fmt, "field": "text"}
    tracemalloc.start()
    try:
        with pytest.raises(CorpusError, match=refusal):
            load_user_corpus("mine", spec, base_dir=str(tmp_path), count_tokens=lambda m: 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * log.stat().st_size, peak / log.stat().st_size


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_valid_corpus_file_is_held_once_as_its_prompts(tmp_path: Path, fmt: str) -> None:
    """A valid corpus was held three times over while read: the file's bytes, its text and
    the prompts (3.2 times its size; some 3.5 GB at the 1 GiB limit). It is read a line at a
    time, hashed as read: its prompts and one line at a time, the same prompts and hash."""
    import hashlib
    import tracemalloc

    from dvfs.corpora.loaders import load_user_corpus

    corpus = tmp_path / f"corpus.{fmt}"
    words = "energy per token at a lower clock " * 60
    if fmt == "jsonl":
        rows = [json.dumps({"id": f"p{i}", "text": f"{i} {words}"}) + "\n" for i in range(4000)]
    else:
        rows = ["id,text\n", *(f"p{i},{i} {words}\n" for i in range(4000))]
    corpus.write_text("".join(rows))
    del rows
    spec = {"path": str(corpus), "field": "text"}
    tracemalloc.start()
    try:
        read = load_user_corpus("mine", spec, base_dir=str(tmp_path), count_tokens=lambda m: 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = corpus.stat().st_size
    assert peak < 1.5 * size, peak / size
    assert [p.messages[0].content for p in read.prompts] == [f"{i} {words}" for i in range(4000)]
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()[:16]
    assert read.source == f"file {corpus} ({fmt}, sha256 {digest})"


def test_a_disk_image_named_as_a_corpus_is_refused_at_its_first_nul(tmp_path: Path) -> None:
    """A file of NULs with no line end (a disk image, `truncate -s` output) named as a corpus
    was read whole before its first NUL refused it: 1 GB held for a 1000 MB file (2 GB once
    lines were read one at a time: `readline` joins a line's pieces). It is refused at the
    piece holding its first NUL."""
    import tracemalloc

    from dvfs.corpora.loaders import load_user_corpus

    image = tmp_path / "corpus.jsonl"
    with open(image, "wb") as f:
        f.truncate(64 << 20)  # sparse: no disk is written
    spec = {"path": str(image), "field": "text"}
    tracemalloc.start()
    try:
        with pytest.raises(CorpusError, match="line 1: a binary file, not text"):
            load_user_corpus("mine", spec, base_dir=str(tmp_path), count_tokens=lambda m: 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (8 << 20), peak


@pytest.mark.parametrize("content", ["", "  \n\n \t\n"], ids=["empty", "whitespace"])
def test_an_empty_corpus_file_says_what_to_do(tmp_path: Path, content: str) -> None:
    """A corpus file that is empty, or holds only whitespace, was refused with "X is empty"
    and no way on; the line says to write the corpus's records into it, or to point the
    campaign's path at the file that holds them."""
    write(tmp_path / "mine.jsonl", content)
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["code", "mine"]')
    text += '\n[corpus.mine]\npath = "mine.jsonl"\nfield = "text"\n'
    campaign = str(write(tmp_path / "c.toml", text))
    out = str(tmp_path / "out")
    for args in (["sweep", campaign, "--dry-run", "--out", out], ["doctor", campaign]):
        result = CliRunner().invoke(cli, args)
        said = " ".join(result.output.split())
        assert result.exit_code == 2, (args, result.output)
        assert f"{tmp_path / 'mine.jsonl'} is empty (or only whitespace): write the" in said, said
        assert "or point the campaign's path for this corpus at the file" in said, said


def test_the_readme_names_every_key_of_a_corpus_table() -> None:
    """A `[corpus.NAME]` table takes `format` (a file whose extension names no format) and
    `description` (shown by `dvfs corpus list`) too, which the README's Corpora section never
    named: a `.txt` file was refused with "set format to one of ...", a key it did not show."""
    from dvfs.corpora.loaders import SPEC_KEYS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Corpora\n", 1)[1].split("\n## ", 1)[0]
    for key in sorted(SPEC_KEYS):
        assert f"\n{key} = " in section or f"`{key} = " in section or f"`{key}`" in section, key


@pytest.mark.parametrize("indent", [None, 2], ids=["one-line", "pretty-printed"])
@pytest.mark.parametrize("name", ["p.jsonl", "p.txt"])
def test_a_json_array_in_a_file_not_named_json_is_refused_saying_to_name_it_so(
    tmp_path: Path, name: str, indent: int | None
) -> None:
    """A JSON array of records (ShareGPT's export) saved as .jsonl, or read with
    `format = "jsonl"`, is read as JSON Lines, one object a line: it was refused with "line 1:
    expected an object with fields, got a list" or "line 1: not valid JSON", neither saying
    that the same file named .json is read as its records (README, Corpora)."""
    records = [{"text": "first prompt"}, {"text": "second prompt"}]
    write(tmp_path / name, json.dumps(records, indent=indent) + "\n")
    spec = {"path": name, "field": "text", "format": "jsonl"}
    with pytest.raises(CorpusError) as refused:
        load(tmp_path, "mine", spec)
    said = str(refused.value)
    assert f"{name}, line 1: " in said, said
    assert "a JSON array of records is read from a file named .json" in said, said
    write(tmp_path / "p.json", json.dumps(records, indent=indent) + "\n")
    assert len(load(tmp_path, "mine", {**spec, "path": "p.json"}).prompts) == 2


def test_corpus_show_labels_a_json_array_json_and_json_lines_jsonl(tmp_path: Path) -> None:
    """`corpus show` labelled a .json file's array "jsonl" (its reader's family name), though
    it is no JSON Lines; it says what the file was read as: "json" for an array, "jsonl" for
    JSON Lines (named .json or not)."""
    records = [{"text": "write a function that adds two numbers"}, {"text": "explain recursion"}]
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["mine"]')
    for name, body, label in (
        ("a.json", json.dumps(records, indent=1), "json"),
        ("l.json", "\n".join(json.dumps(r) for r in records), "jsonl"),
        ("l.jsonl", "\n".join(json.dumps(r) for r in records), "jsonl"),
    ):
        write(tmp_path / name, body)
        table = f'\n[corpus.mine]\npath = "{name}"\nfield = "text"\n'
        campaign = write(tmp_path / f"{name}.toml", text + table)
        args = ["corpus", "show", "mine", "--campaign", str(campaign), "--json"]
        shown = CliRunner().invoke(cli, args)
        assert shown.exit_code == 0, shown.output
        source = json.loads(shown.output)["source"]
        assert source.startswith(f"file {tmp_path / name} ({label}, sha256 "), source


@pytest.mark.parametrize("link", ["loop", "loop-on-the-way", "to-no-file"])
def test_a_corpus_path_that_is_a_broken_link_is_named_with_what_to_do(
    tmp_path: Path, link: str
) -> None:
    """A corpus path that is a symbolic link in a loop (or one on the way to it) was "cannot
    read corpus file X: Too many levels of symbolic links", naming no way out, and one to no
    file "corpus file X does not exist", of a link that is there: each is named as the link
    it is, with what to do (`link_loop_problem` for a loop)."""
    (tmp_path / "l").symlink_to(tmp_path / "l")
    (tmp_path / "gone.jsonl").symlink_to(tmp_path / "nowhere" / "p.jsonl")
    path, said = {
        "loop": ("l", "l is a symbolic link in a loop"),
        "loop-on-the-way": ("l/p.jsonl", "a symbolic link on the way to"),
        "to-no-file": ("gone.jsonl", f"a symbolic link to {tmp_path / 'nowhere' / 'p.jsonl'}"),
    }[link]
    with pytest.raises(CorpusError) as refused:
        load(tmp_path, "x", {"path": path, "format": "jsonl", "field": "text"})
    message = str(refused.value)
    assert said in message and "point it at the" in message, message
    assert not message.endswith(f"{tmp_path / path} does not exist"), message
