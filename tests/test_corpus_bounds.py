"""Huge corpus files: a record (a line) or a prompt over `MAX_PROMPT_BYTES` is refused in one
line naming the file, the line and the limit, having held no more than the limit (and one read
piece) of it, and before any of its tokens are counted. The limit is made small here, so the
files stay small; memory is asserted through the bytes of one line held, never through time."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import TINY, replace_block, write

from dvfs.cli import cli
from dvfs.corpora import load_corpus, loaders
from dvfs.corpora.model import Message, estimate_tokens
from dvfs.errors import CorpusError

BOUND = 4096
PIECE = 512


@pytest.fixture
def small_bound(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """MAX_PROMPT_BYTES and the read piece made small; the `_Lines` readers made, to ask how
    much of one line each held at once."""
    monkeypatch.setattr(loaders, "MAX_PROMPT_BYTES", BOUND, raising=False)
    monkeypatch.setattr(loaders, "_PIECE", PIECE)
    made: list[Any] = []
    init = loaders._Lines.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(loaders._Lines, "__init__", spy)
    return made


def _held(made: list[Any]) -> int:
    """The most bytes of one line a reader held (what the line reader joined at once)."""
    return max(getattr(lines, "longest_held", 1 << 62) for lines in made)


def _counting() -> tuple[list[int], Any]:
    seen: list[int] = []

    def count(messages: tuple[Message, ...]) -> int:
        seen.append(sum(len(m.content) for m in messages))
        return estimate_tokens(messages)

    return seen, count


def _load(tmp_path: Path, file: str, count: Any = estimate_tokens, **spec: Any) -> Any:
    return load_corpus(
        "big", {"path": file, "field": "text", **spec}, base_dir=str(tmp_path), count_tokens=count
    )


def test_a_line_over_the_bound_is_refused_holding_at_most_the_bound(
    tmp_path: Path, small_bound: list[Any]
) -> None:
    long = "lorem ipsum " * 20_000  # 240 kB: some 60 times the bound
    lines = [{"text": "a short prompt"}, {"text": long}, {"text": "another"}]
    write(tmp_path / "big.jsonl", "".join(json.dumps(r) + "\n" for r in lines))
    seen, count = _counting()
    with pytest.raises(CorpusError) as caught:
        _load(tmp_path, "big.jsonl", count)
    said = str(caught.value)
    assert str(tmp_path / "big.jsonl") in said and "line 2" in said, said
    assert f"limit of {BOUND:,} bytes" in said and "input_tokens" in said, said
    assert "\n" not in said
    assert _held(small_bound) <= BOUND + PIECE
    assert max(seen) < BOUND  # the long prompt's tokens were never counted


def test_one_line_with_no_end_is_refused_as_too_long_not_read_whole(
    tmp_path: Path, small_bound: list[Any]
) -> None:
    (tmp_path / "big.jsonl").write_bytes(b"x" * 200_000)
    with pytest.raises(CorpusError, match=r"line 1: a record longer than"):
        _load(tmp_path, "big.jsonl")
    assert _held(small_bound) <= BOUND + PIECE


def test_a_line_at_the_bound_is_read(tmp_path: Path, small_bound: list[Any]) -> None:
    text = "y" * (BOUND - len(json.dumps({"text": ""}) + "\n"))
    line = json.dumps({"text": text}) + "\n"
    assert len(line) == BOUND
    write(tmp_path / "big.jsonl", line)
    corpus = _load(tmp_path, "big.jsonl")
    assert corpus.prompts[0].messages[0].content == text


@pytest.mark.parametrize("where", ["in the long line", "after it"])
def test_a_nul_still_refuses_the_file_as_binary(
    tmp_path: Path, small_bound: list[Any], where: str
) -> None:
    """A NUL anywhere refuses the file first, as it did before a line was bounded."""
    long = b'{"text": "' + b"z" * 50_000
    data = (
        b'{"text": "ok"}\n' + long + b"\x00" + b'"}\n'
        if where == "in the long line"
        else b'{"text": "ok"}\n' + long + b'"}\n' + b'{"text": "ok"}\n\x00\n'
    )
    (tmp_path / "big.jsonl").write_bytes(data)
    with pytest.raises(CorpusError, match="a binary file, not text"):
        _load(tmp_path, "big.jsonl")
    assert _held(small_bound) <= BOUND + PIECE


def test_a_line_that_is_no_utf8_before_the_long_line_is_said_first(
    tmp_path: Path, small_bound: list[Any]
) -> None:
    data = b'{"text": "caf\xe9"}\n' + json.dumps({"text": "w" * 50_000}).encode() + b"\n"
    (tmp_path / "big.jsonl").write_bytes(data)
    with pytest.raises(CorpusError, match="line 1: not UTF-8 text"):
        _load(tmp_path, "big.jsonl")


def test_the_corpus_hash_still_covers_a_file_read_past_its_limit(
    tmp_path: Path, small_bound: list[Any]
) -> None:
    """A long line after the table's `limit` is hashed, not held, and not refused."""
    rows = [{"text": f"prompt {i}"} for i in range(3)] + [{"text": "v" * 50_000}]
    write(tmp_path / "big.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    corpus = _load(tmp_path, "big.jsonl", limit=3)
    assert len(corpus.prompts) == 3
    assert _held(small_bound) <= BOUND + PIECE


def test_a_long_prompt_in_a_json_array_is_refused_before_its_tokens_are_counted(
    tmp_path: Path, small_bound: list[Any]
) -> None:
    """A JSON array (parsed whole, on one line or many) and CSV (a cell may span lines) are
    bounded by the prompt's text."""
    records = [{"text": "short"}, {"text": "q" * 50_000}]
    write(tmp_path / "big.json", json.dumps(records, indent=1))
    seen, count = _counting()
    with pytest.raises(CorpusError, match=r"record 2 of the array: a prompt of 50,000 characters"):
        _load(tmp_path, "big.json", count)
    assert max(seen) < BOUND


def test_a_long_csv_cell_over_many_lines_is_refused(tmp_path: Path, small_bound: list[Any]) -> None:
    buffer = io.StringIO()
    out = csv.writer(buffer)
    out.writerow(["id", "text"])
    out.writerow(["p1", "short"])
    out.writerow(["p2", "a line of a long prompt\n" * 2000])
    write(tmp_path / "big.csv", buffer.getvalue())
    seen, count = _counting()
    with pytest.raises(CorpusError, match=r"big.csv, line \d+: a prompt of 48,000 characters"):
        _load(tmp_path, "big.csv", count)
    assert max(seen) < BOUND


def test_corpus_list_refuses_a_huge_record_in_one_line(
    tmp_path: Path, small_bound: list[Any]
) -> None:
    write(
        tmp_path / "big.jsonl",
        json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "h" * 100_000}) + "\n",
    )
    text = replace_block(TINY, 'corpora = ["code"]', 'corpora = ["big"]')
    campaign = write(
        tmp_path / "c.toml", text + '\n[corpus.big]\npath = "big.jsonl"\nfield = "text"\n'
    )
    result = CliRunner().invoke(cli, ["corpus", "list", "--campaign", str(campaign)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    said = [line for line in result.output.splitlines() if line.strip()]
    assert len(said) == 1 and "big.jsonl, line 2: a record longer than" in said[0], said


def test_a_parquet_files_limit_makes_no_more_rows_python_records_than_a_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parquet is read a batch of rows at a time: a table's `limit` of a large file holds that
    many prompts, not every row as a Python record (Python's own allocations are counted,
    deterministically: the file's bytes, read whole for its hash, are some 0.3 MB)."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(loaders, "_PARQUET_ROWS", 100, raising=False)
    rows = 20_000
    texts = [f"prompt {i} about the weather in town {i % 977}" for i in range(rows)]
    pq.write_table(
        pa.table({"id": [f"p{i}" for i in range(rows)], "text": texts}), tmp_path / "big.parquet"
    )
    tracemalloc.start()
    try:
        corpus = _load(tmp_path, "big.parquet", limit=3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [p.id for p in corpus.prompts] == ["p0", "p1", "p2"]
    size = (tmp_path / "big.parquet").stat().st_size
    assert peak < size + (1 << 20), (peak, size)  # every row as a record: some 6 MB more


def test_parquet_rows_are_numbered_across_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(loaders, "_PARQUET_ROWS", 4, raising=False)
    texts = [f"prompt {i}" for i in range(9)] + [""]
    pq.write_table(pa.table({"text": texts}), tmp_path / "p.parquet")
    with pytest.raises(CorpusError, match=r"p.parquet, row 10: field 'text' is empty"):
        _load(tmp_path, "p.parquet")
    corpus = _load(tmp_path, "p.parquet", limit=9)
    assert [p.messages[0].content for p in corpus.prompts] == texts[:9]


def _array_peak(tmp_path: Path, records: list[Any], **spec: Any) -> tuple[Any, int, int]:
    import tracemalloc

    write(tmp_path / "big.json", json.dumps(records, indent=1))
    tracemalloc.start()
    try:
        corpus = _load(tmp_path, "big.json", **spec)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return corpus, peak, (tmp_path / "big.json").stat().st_size


def test_a_json_arrays_limit_makes_no_more_records_than_it_reads(tmp_path: Path) -> None:
    """A `.json` array is parsed a record at a time: with a table's `limit`, the records past
    it are checked, not all held at once (Python's own allocations, counted
    deterministically: the text and its lines are a few times the file's 0.5 MB; every
    record held at once some 8 MB)."""
    records = [{"id": f"p{i}", "text": f"prompt {i} on town {i % 977}"} for i in range(20_000)]
    corpus, peak, size = _array_peak(tmp_path, records, limit=3)
    assert [p.id for p in corpus.prompts] == ["p0", "p1", "p2"]
    assert peak < 4 * size + (1 << 20), (peak, size)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[{"text": "a"}, {"text": "b"}] x', "line 1: not valid JSON (Extra data)"),
        ('[{"text": "a"} {"text": "b"}]', "line 1: not valid JSON (Expecting ',' delimiter)"),
        ('[{"text": "a"},\n]', "line 2: not valid JSON (Expecting value)"),
        ('\u00a0[{"text": "a"}]', "line 1: not valid JSON (Expecting value)"),
        ('[{"text": "a"}, {"text": "b", "text": "c"}]', "record 2 of the array: an object names"),
        ('[{"text": "a"}, 3]', "record 2 of the array: expected an object"),
    ],
)
def test_a_json_array_read_a_record_at_a_time_is_refused_as_when_read_whole(
    tmp_path: Path, text: str, says: str
) -> None:
    write(tmp_path / "a.json", text)
    with pytest.raises(CorpusError, match=re.escape(says)):
        _load(tmp_path, "a.json")


def test_a_json_array_read_a_record_at_a_time_reads_as_whole(tmp_path: Path) -> None:
    records = [{"text": f"prompt {i}", "meta": [{"x": [1, {"y": "]"}]}]} for i in range(5)]
    for dumped in (
        json.dumps(records),
        json.dumps(records, indent=2),
        " [ ] ".replace("[ ]", "[]"),
    ):
        write(tmp_path / "a.json", dumped)
        if dumped.strip() == "[]":
            with pytest.raises(CorpusError, match="holds no records"):
                _load(tmp_path, "a.json")
            continue
        corpus = _load(tmp_path, "a.json")
        assert [p.messages[0].content for p in corpus.prompts] == [r["text"] for r in records]


def test_a_corpus_of_many_short_prompts_holds_each_in_few_bytes(tmp_path: Path) -> None:
    """A prompt of one short message is held without a dict of attributes per object (Python's
    own allocations, counted deterministically: some 300 bytes a prompt here, 377 unslotted)."""
    import tracemalloc

    rows = 20_000
    write(
        tmp_path / "many.jsonl",
        "".join(json.dumps({"text": f"prompt {i} on the weather"}) + "\n" for i in range(rows)),
    )
    tracemalloc.start()
    try:
        corpus = _load(tmp_path, "many.jsonl")
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(corpus.prompts) == rows
    assert held / rows < 340, held / rows
