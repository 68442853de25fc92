"""Loaders for the user's own corpora: JSON Lines (or a JSON file of one array of objects), CSV,
Parquet, Hugging Face datasets, and data shipped inside an installed Python package.

A `[corpus.NAME]` table names exactly one source (`path`, `dataset` or `package` +
`resource`) and one of `field` (text: one user message) or `messages` (a chat: OpenAI-style
role/content dicts, or ShareGPT-style from/value). Errors name the file and the line.
"""

from __future__ import annotations

import codecs
import csv
import difflib
import hashlib
import io
import itertools
import json
import re
import stat
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path
from typing import IO, Any

from dvfs.corpora.model import BUILTIN_CORPORA, Corpus, Message, Prompt, TokenCounter
from dvfs.errors import CorpusError, CorpusUnavailableError

FORMATS = ("jsonl", "csv", "parquet")
#: Corpus files above this size are refused before reading: sample them into a smaller file.
MAX_CORPUS_BYTES = 1 << 30
#: The longest record read (a line of JSON Lines or CSV) and the most text one prompt holds: some
#: 4 million tokens, past any model's context, and a sweep trims a prompt to the campaign's
#: workload.input_tokens anyway. A longer line is refused having held no more than this of it
#: (a 240 MB one-prompt file took 3.4 GB to list), a longer prompt before its tokens are counted.
MAX_PROMPT_BYTES = 16 << 20
#: The longest CSV cell read (csv's default of 128 KiB is shorter than a long-context prompt).
MAX_CSV_FIELD_CHARS = 64 << 20
SPEC_KEYS = {
    "path",
    "format",
    "dataset",
    "config",
    "split",
    "package",
    "resource",
    "field",
    "messages",
    "limit",
    "acceptance_like",
    "description",
}
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}


def check_spec(spec: dict[str, Any]) -> None:
    """Validate a `[corpus.NAME]` table's keys without reading any data."""
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        named = []
        for key in unknown:
            hint = difflib.get_close_matches(key, sorted(SPEC_KEYS), n=1)
            named.append(f"{key} (did you mean {hint[0]!r}?)" if hint else key)
        raise CorpusError(
            f"unknown key(s) {', '.join(named)}; allowed: {', '.join(sorted(SPEC_KEYS))}"
        )
    sources = [k for k in ("path", "dataset", "package") if k in spec]
    if len(sources) != 1:
        raise CorpusError(
            "name exactly one source: path (a file), dataset (Hugging Face) or "
            "package (data in an installed package, with resource)"
        )
    if "package" in spec and "resource" not in spec:
        raise CorpusError("package needs resource (the file's path inside the package)")
    if ("field" in spec) == ("messages" in spec):
        raise CorpusError("give exactly one of field (a text field) or messages (a chat field)")
    for key in sorted(SPEC_KEYS - {"format", "limit"}):
        if key in spec and not isinstance(spec[key], str):
            raise CorpusError(f"{key} must be a string")
    if "format" in spec and spec["format"] not in FORMATS:
        raise CorpusError(f"format {spec['format']!r} is not one of {', '.join(FORMATS)}")
    limit = spec.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise CorpusError(f"limit must be a positive integer, got {limit!r}")
    like = spec.get("acceptance_like")
    if like is not None and like not in BUILTIN_CORPORA:
        raise CorpusError(
            f"acceptance_like must name a built-in corpus "
            f"({', '.join(BUILTIN_CORPORA)}), got {like!r}"
        )


def _format_of(spec: dict[str, Any], name: str) -> str:
    if "format" in spec:
        return str(spec["format"])
    suffix = Path(name).suffix.lower().lstrip(".")
    guessed = {
        "jsonl": "jsonl",
        "ndjson": "jsonl",
        "json": "jsonl",
        "csv": "csv",
        "parquet": "parquet",
        "pq": "parquet",
    }.get(suffix)
    if guessed is None:
        raise CorpusError(
            f"{name}: cannot tell the format from the extension; set format to "
            f"one of {', '.join(FORMATS)}"
        )
    return guessed


#: The most of a line read at once (bytes): a longer line is read in pieces this long.
_PIECE = 1 << 20


class _Lines:
    """A corpus file's bytes read one line ("\\n"-ended) at a time, decoded, and hashed as read,
    so that a valid file is held once (as its prompts), not also as its bytes and its text
    (some 3.5 GB at the 1 GiB limit). Refused as the check of the whole file read at once
    refused it: the first NUL anywhere before the first line that is not UTF-8, either before
    a record's error found earlier (`refuse`), and a file of only whitespace as empty."""

    def __init__(
        self, stream: IO[bytes], where: str, unreadable: str, *, packaged: bool = False
    ) -> None:
        self.stream, self.where, self.unreadable = stream, where, unreadable
        self.packaged = packaged  # a package's resource: said so where it is empty
        #: What the file was read as where not its reader's family (`READERS`): "json" for a
        #: .json file's array, which `corpus show` labelled "jsonl"
        self.read_as: str | None = None
        self.digest = hashlib.sha256()
        self.lineno = 0
        self.blank = True  # only whitespace so far
        self.binary: CorpusError | None = None  # the first line holding a NUL
        self.not_utf8: CorpusError | None = None  # the first line that is not UTF-8
        self.too_long: CorpusError | None = None  # the first line over MAX_PROMPT_BYTES
        self.longest_held = 0  # the most bytes of one line held at once

    def _raw(self, *, bounded: bool = True, refuse_long: bool = True) -> Iterator[bytes]:
        """Each line's bytes; a line holding a NUL only up to the piece that holds it (read no
        further: the file is refused there), so that a disk image with no line end in it is
        not read whole into one line (twice its size, as `readline` joins it). `bounded`: a
        line longer than `MAX_PROMPT_BYTES` is not held but skipped (`_skip_long`), refused
        where `refuse_long`."""
        bound = MAX_PROMPT_BYTES if bounded else None
        try:
            while piece := self.stream.readline(_PIECE):
                pieces = [piece]
                size = len(piece)
                while not piece.endswith(b"\n") and b"\x00" not in piece:
                    if bound is not None and size > bound:
                        break
                    piece = self.stream.readline(_PIECE)
                    if not piece:
                        break
                    pieces.append(piece)
                    size += len(piece)
                self.longest_held = max(self.longest_held, size)
                if bound is not None and size > bound and b"\x00" not in pieces[-1]:
                    self._skip_long(pieces, refuse_long)
                    continue
                raw = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                del pieces
                self.digest.update(raw)
                self.lineno += 1
                if self.blank and raw.strip():
                    self.blank = False
                yield raw
        except OSError as exc:
            raise CorpusError(f"{self.unreadable}: {exc.strerror}") from exc

    def _skip_long(self, pieces: list[bytes], refuse: bool) -> None:
        """Read the rest of a line longer than `MAX_PROMPT_BYTES` a piece at a time, holding
        none: hashed, and checked for a NUL and UTF-8 as any line (`finish` refuses the file
        for either first); then, where `refuse`, refused (`too_long`). `pieces`: the line's
        start, read so far."""
        self.lineno += 1
        self.blank = False  # refused as too long, not as an empty file
        decoder = codecs.getincrementaldecoder("utf-8-sig" if self.lineno == 1 else "utf-8")()
        pending = list(pieces)
        pieces.clear()
        while piece := (pending.pop(0) if pending else self.stream.readline(_PIECE)):
            self.digest.update(piece)
            if b"\x00" in piece:
                self._decoded(piece)  # refused: a binary file
            if self.not_utf8 is None:
                try:
                    decoder.decode(piece)
                except UnicodeDecodeError as exc:
                    self.not_utf8 = CorpusError(
                        f"{self.where}, line {self.lineno}: not UTF-8 text (byte "
                        f"0x{exc.object[exc.start]:02x}): save the file as UTF-8"
                    )
            if piece.endswith(b"\n"):
                break
        if self.too_long is None:
            self.too_long = CorpusError(
                f"{self.where}, line {self.lineno}: a record longer than dvfs's limit of "
                f"{_bound()} (some 4 million tokens, past any "
                "model's context), not read: cut its prompt to the campaign's "
                "workload.input_tokens (longer ones are trimmed to it), or give each record "
                "a line of its own"
            )
        if refuse:
            raise self.too_long

    def _decoded(self, raw: bytes) -> str | None:
        """`raw` as text; None (the refusal kept in `not_utf8`) where it is no UTF-8. A NUL
        is refused at once: no later line's fault comes before it."""
        if b"\x00" in raw:
            self.binary = CorpusError(
                f"{self.where}, line {self.lineno}: a binary file, not text (a NUL byte; "
                "UTF-16?): give a UTF-8 text file, or set format if it is Parquet"
            )
            raise self.binary
        if self.lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a byte-order mark, as "utf-8-sig" drops it
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if self.not_utf8 is None:
                self.not_utf8 = CorpusError(
                    f"{self.where}, line {self.lineno}: not UTF-8 text (byte "
                    f"0x{raw[exc.start]:02x}): save the file as UTF-8"
                )
            return None

    def lines(self, *, bounded: bool = True) -> Iterator[str]:
        """Each line as text, its "\\n" kept; a line that is no UTF-8 ends them, refused
        once the rest of the file holds no NUL (`finish`); `bounded`: one longer than
        `MAX_PROMPT_BYTES` too (`_raw`)."""
        for raw in self._raw(bounded=bounded):
            text = self._decoded(raw)
            if text is None:
                self.finish()
            else:
                yield text

    def only_whitespace(self) -> bool:
        """Whether the file holds only whitespace (read until it holds more)."""
        for _ in self._raw(refuse_long=False):
            if not self.blank:
                break
        return self.blank

    def read_all(self) -> bytes:
        """The rest of the file's bytes at once (Parquet's, which are no lines of text)."""
        try:
            data = self.stream.read()
        except OSError as exc:
            raise CorpusError(f"{self.unreadable}: {exc.strerror}") from exc
        self.digest.update(data)
        if self.blank and data and not data.isspace():
            self.blank = False
        return data

    def whole(self, read: list[str]) -> str:
        """The text of the file: the lines `read` so far and the rest (a JSON document, which
        is parsed whole, its records' prompts bounded once read: `_prompt`). Gathered as bytes,
        each line checked as `lines` checks it, and decoded once: not kept as a string per line
        as well (some 50 bytes more each, a GB for a pretty-printed ShareGPT export)."""
        data = bytearray("".join(read).encode())
        for raw in self._raw(bounded=False):
            text = self._decoded(raw)
            if text is None:
                self.finish()  # refused: no UTF-8 (or a NUL further on)
            elif self.lineno == 1:  # its byte-order mark dropped
                data += text.encode()
            else:
                data += raw
            del text
        return data.decode("utf-8")

    def finish(self) -> None:
        """Read the rest of the file: its hash whole, and the refusal the whole file's check
        made first (a NUL, then the first line that is no UTF-8), if any."""
        if self.binary is not None:
            raise self.binary
        for raw in self._raw(refuse_long=False):
            if self.not_utf8 is None:
                self._decoded(raw)
            elif b"\x00" in raw:
                self._decoded(raw)  # the NUL's refusal, before the line that is no UTF-8
        if self.not_utf8 is not None:
            raise self.not_utf8

    def refuse(self, exc: CorpusError) -> CorpusError:
        """What to raise for `exc`, a record's refusal: the whole file's own (a NUL, a line
        that is no UTF-8, only whitespace), as it was checked before any record was read."""
        try:
            self.finish()
        except CorpusError as whole:
            return whole
        return _empty_file(self.where, packaged=self.packaged) if self.blank else exc


def _bound() -> str:
    """`MAX_PROMPT_BYTES` in words."""
    if MAX_PROMPT_BYTES % (1 << 20) == 0:
        return f"{MAX_PROMPT_BYTES >> 20} MiB"
    return f"{MAX_PROMPT_BYTES:,} bytes"


def _empty_file(where: str, *, packaged: bool = False) -> CorpusError:
    """A corpus file with no record in it (nothing, or only whitespace), with the way on: for
    a package's resource (`packaged`), the package and resource the campaign names, not its
    path (it has none), nor a file to write into inside an installed package."""
    if packaged:
        return CorpusError(
            f"{where} is empty (or only whitespace): point the campaign's package and resource "
            "for this corpus at the data file that holds the records (or reinstall the package "
            "if that file should hold them)"
        )
    return CorpusError(
        f"{where} is empty (or only whitespace): write the corpus's records into it, or point "
        "the campaign's path for this corpus at the file that holds them"
    )


class _KeyTwice(Exception):  # noqa: N818  (not an error the user sees: a CorpusError is)
    """A JSON object names a key twice (`_unique_keys`)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _Twice(dict[str, Any]):
    """A JSON object that named `twice` more than once (`_marking_keys`)."""

    twice: str = ""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads`'s object_pairs_hook: an object, refusing a key named twice, whose earlier
    value json would drop silently (two "prompt" keys: which one is the prompt?)."""
    record = dict(pairs)
    if len(record) < len(pairs):
        raise _KeyTwice(_first_twice(pairs))
    return record


def _marking_keys(pairs: list[tuple[str, Any]], marked: list[str]) -> dict[str, Any]:
    """As `_unique_keys`, but an object naming a key twice is kept and marked (`_Twice`; the
    key added to `marked`), for a JSON array whose records are named by their place once it is
    read (`_key_twice`)."""
    record = dict(pairs)
    if len(record) == len(pairs):
        return record
    twice = _Twice(pairs)
    twice.twice = _first_twice(pairs)
    marked.append(twice.twice)
    return twice


def _first_twice(pairs: list[tuple[str, Any]]) -> str:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    return ""


def _key_twice(value: Any) -> str | None:
    """The first key some object in `value` names twice (`_marking_keys`), else None. Walked
    without recursion: Python 3.12 and later read JSON nested deeper than the interpreter's
    recursion limit (their json has a limit of its own), which a recursive walk then failed
    on (a RecursionError, not the file's line)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Twice):
            return item.twice
        if isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))
    return None


def _refuse_key_twice(key: str, at: str) -> CorpusError:
    return CorpusError(
        f"{at}: an object names the key {key!r} twice, so which value holds is unclear "
        "(JSON readers keep the last silently): keep one"
    )


#: JSON's whitespace, as `json` skips it between an array's values.
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _past_space(text: str, pos: int) -> int:
    """Where the JSON whitespace from `pos` on ends."""
    match = _JSON_SPACE.match(text, pos)
    return match.end() if match else pos


def _array_values(text: str, decoder: json.JSONDecoder) -> Iterator[Any]:
    """The values of the JSON array `text` (which starts with "[" after whitespace) one at a
    time, as `decoder.decode(text)` would list them, with its errors (`JSONDecodeError` at
    the same place in `text`): one value held at a time, not the whole array's."""
    pos = _past_space(text, 0)
    if not text.startswith("[", pos):  # other whitespace first (`str.lstrip`'s, not JSON's)
        raise json.JSONDecodeError("Expecting value", text, pos)
    pos = _past_space(text, pos + 1)
    if text.startswith("]", pos):
        pos += 1
    else:
        while True:
            value, pos = decoder.raw_decode(text, pos)
            yield value
            pos = _past_space(text, pos)
            if text.startswith(",", pos):
                pos = _past_space(text, pos + 1)
                continue
            if text.startswith("]", pos):
                pos += 1
                break
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
    pos = _past_space(text, pos)
    if pos != len(text):
        raise json.JSONDecodeError("Extra data", text, pos)


def _records_json_array(text: str, where: str) -> Iterator[tuple[str, Any]] | None:
    """A `.json` file holding one JSON array of objects (as ShareGPT's exports and many
    datasets ship, pretty-printed or on one line): its records, each named by its place in
    the array (one that is no object refused as that record); None where the text is no
    array, or the file is named as JSON Lines
    (`.jsonl`, `.ndjson`: read line by line, an array there refused at its line). An array
    broken by a syntax error is a `CorpusError` naming the line, unless its first line reads
    alone as JSON (JSON Lines whose first record is a list: the line reader says so).

    Read twice, a record at a time: checked whole first (a syntax error, a key named twice),
    then its records made one by one as they are used, so that a table's `limit` holds that
    many, not every record of the file (a 243 MB array with limit = 1000 peaked at 1.6 GB)."""
    if Path(where).suffix.lower() != ".json" or not text.lstrip().startswith("["):
        return None
    marked: list[str] = []  # the keys objects name twice (`_marking_keys`)
    checking = json.JSONDecoder(object_pairs_hook=lambda p: _marking_keys(p, marked))
    twice: tuple[str, str] | None = None  # the first record naming a key twice, and the key
    try:
        for i, record in enumerate(_array_values(text, checking), start=1):
            if marked and twice is None and (key := _key_twice(record)) is not None:
                twice = (f"{where}, record {i} of the array", key)
            del record
    except RecursionError:  # the line reader names the line
        return None
    except json.JSONDecodeError as exc:
        first = next(line for line in _lines(text) if line.strip())
        try:
            json.loads(first)
        except (ValueError, RecursionError):
            raise CorpusError(
                f"{where}, line {exc.lineno}: not valid JSON ({exc.msg}); a JSON file holds "
                "one array of objects, JSON Lines one complete object per line"
            ) from exc
        return None
    except ValueError:  # e.g. an integer beyond Python's digit limit: the line reader names it
        return None
    # A record that is no object (null, text, a list) is refused by its place in the array
    # (`_prompt`), not at a line of a file that is valid JSON; so is one naming a key twice.
    if twice is not None:
        raise _refuse_key_twice(twice[1], twice[0])
    values = _array_values(text, json.JSONDecoder())
    return ((f"{where}, record {i} of the array", r) for i, r in enumerate(values, start=1))


def _refuse_json_object(text: str, where: str) -> None:
    """Refuse a `.json` file holding one JSON object over several lines (a dataset's
    `{"data": [...]}`), which the line reader took for broken JSON Lines ("line 1: not valid
    JSON" of a valid file); one object on one line is JSON Lines of one record, read as such."""
    if Path(where).suffix.lower() != ".json" or not text.lstrip().startswith("{"):
        return
    first = next(line for line in _lines(text) if line.strip())
    try:
        json.loads(first)
        return  # JSON Lines: the line reader reads it
    except (ValueError, RecursionError):
        pass
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):  # broken: the line reader names the line
        return
    if isinstance(document, dict):
        keys = ", ".join(sorted(map(str, document))[:10])
        raise CorpusError(
            f"{where} holds one JSON object (keys: {keys}), not records: a corpus file holds "
            "a JSON array of objects or JSON Lines (one object per line); extract the records "
            "into such a file"
        )


def _lines(text: str) -> Iterator[str]:
    """`text.split("\\n")`, one line at a time: a large file that is no JSON Lines (a log named
    by mistake) is refused at its first line without a copy of every line held at once. Only
    "\\n" ends a line: JSON strings may hold U+2028 and other characters that str.splitlines()
    would break on."""
    start = 0
    while (end := text.find("\n", start)) >= 0:
        yield text[start:end]
        start = end + 1
    yield text[start:]


def _records_jsonl(source: _Lines, where: str) -> Iterator[tuple[str, Any]]:
    lines = source.lines()
    read: list[str] = []
    if Path(where).suffix.lower() == ".json":
        # One JSON document over several lines (an array, an object) is parsed whole; JSON
        # Lines named .json are read a line at a time, as any.
        for line in lines:
            read.append(line)
            if line.strip():
                break
        first = read[-1].strip() if read else ""
        if first.startswith("[") or (first.startswith("{") and not _reads_alone(first)):
            text = source.whole(read)
            _refuse_json_object(text, where)
            array = _records_json_array(text, where)
            if array is not None:
                source.read_as = "json"  # an array, not JSON Lines
                yield from array
                return
            yield from _records_jsonl_lines(enumerate(_lines(text), start=1), where)
            return
    # each line without its "\n", as `_lines` splits them (json's words for a string cut
    # short differ where the line ends in one)
    ended = (line.removesuffix("\n") for line in itertools.chain(read, lines))
    yield from _records_jsonl_lines(enumerate(ended, start=1), where)


def _reads_alone(line: str) -> bool:
    """Whether one line reads as JSON by itself (JSON Lines' first record)."""
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return False
    return True


#: What an array read as JSON Lines (a file not named .json) is told: ShareGPT's export is one.
_ARRAY_NAMED_JSON = (
    "a JSON array of records is read from a file named .json: name it so (JSON Lines hold one "
    "object per line)"
)


def _records_jsonl_lines(
    numbered: Iterator[tuple[int, str]], where: str
) -> Iterator[tuple[str, Any]]:
    # a file whose first record opens an array (not named .json, so read as JSON Lines): its
    # first line is refused, as a list or as JSON cut short, saying to name it .json
    array: bool | None = None
    for lineno, line in numbered:
        if not line.strip():
            continue
        at = f"{where}, line {lineno}"
        if array is None:
            array = line.lstrip().startswith("[") and Path(where).suffix.lower() != ".json"
        try:
            record = json.loads(line, object_pairs_hook=_unique_keys)
        except _KeyTwice as exc:
            raise _refuse_key_twice(exc.key, at) from None
        except json.JSONDecodeError as exc:
            if array:
                raise CorpusError(f"{at}: not valid JSON ({exc.msg}); {_ARRAY_NAMED_JSON}") from exc
            raise CorpusError(
                f"{at}: not valid JSON ({exc.msg}); JSON Lines hold one complete object per line"
            ) from exc
        except RecursionError as exc:
            raise CorpusError(f"{at}: JSON nested too deeply to read") from exc
        except ValueError as exc:  # e.g. an integer beyond Python's digit limit
            reason = str(exc).split(";")[0]
            raise CorpusError(f"{at}: not usable JSON ({reason})") from exc
        if array and isinstance(record, list):
            raise CorpusError(
                f"{at}: expected an object with fields, got a list; {_ARRAY_NAMED_JSON}"
            )
        yield at, record


#: A line as `io.StringIO(text, newline="")` reads it, its ending ("\r\n", "\r" or "\n") kept.
_CSV_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


def _csv_lines(lines: Iterable[str]) -> Iterator[str]:
    """The file's lines for the CSV reader, one at a time, each "\\n"-ended line split where
    `io.StringIO(text, newline="")` splits it ("\\r" too): which holds a copy of the whole
    text at four bytes a character (a 200 MB file named by mistake peaked at 1.26 GB to be
    refused at its second line)."""
    return (match.group() for line in lines for match in _CSV_LINE.finditer(line))


def _records_csv(source: _Lines, where: str, key: str = "") -> Iterator[tuple[str, Any]]:
    """The rows of a CSV file; `key`, the column the prompts are read from, named twice in the
    header is refused (a row would hold only the last such column's cell, taken silently)."""
    reader = csv.DictReader(_csv_lines(source.lines()), strict=True)
    previous = csv.field_size_limit(MAX_CSV_FIELD_CHARS)
    try:
        # Line numbers count the header as line 1, as an editor shows them.
        try:
            header = reader.fieldnames or []
            if key and header.count(key) > 1:
                raise CorpusError(
                    f"{where}, line 1: the header names column {key!r} {header.count(key)} "
                    "times, so which holds the prompts is unclear: rename the others"
                )
            for row in reader:
                at = f"{where}, line {reader.line_num}"
                if None in row:
                    raise CorpusError(
                        f"{at}: {len(header) + len(row[None])} value(s), but the header names "
                        f"{len(header)} columns"
                    )
                missing = [k for k, v in row.items() if v is None]
                if missing:
                    raise CorpusError(
                        f"{at}: {len(header) - len(missing)} value(s), but the header names "
                        f"{len(header)} columns (no value for {', '.join(missing[:3])})"
                    )
                yield at, row
        except csv.Error as exc:
            # The inner reader counts the line it failed on; DictReader only finished rows.
            line = max(reader.reader.line_num, 1)
            raise CorpusError(f"{where}, line {line}: not valid CSV ({exc})") from exc
    finally:
        csv.field_size_limit(previous)


#: Parquet rows made Python records at once: a file's rows are read a batch at a time, so that
#: a table's `limit` of a large file holds no more than that many (all of a 194 MB file's rows
#: took 1.6 GB for 10 prompts).
_PARQUET_ROWS = 1024


def _records_parquet(source: _Lines, where: str) -> Iterator[tuple[str, Any]]:
    data = source.read_all()  # a columnar file: read whole (its hash too)
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise CorpusUnavailableError(
            f"{where}: reading Parquet needs pyarrow: pip install 'dvfs[parquet]'"
        ) from exc

    def unreadable(exc: Exception) -> CorpusError:
        detail = " ".join(str(exc).split())
        return CorpusError(f"{where}: not a readable Parquet file ({detail})")

    try:
        batches = pq.ParquetFile(io.BytesIO(data)).iter_batches(batch_size=_PARQUET_ROWS)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise unreadable(exc) from exc
    i = 0
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # a damaged row group
            raise unreadable(exc) from exc
        if batch is None:
            return
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:  # a text column holding other bytes: Parquet checks none
            rows = []
            for k in range(batch.num_rows):
                try:
                    rows.append(batch.slice(k, 1).to_pylist()[0])
                except UnicodeDecodeError as exc:
                    raise CorpusError(
                        f"{where}, row {i + k + 1}: not UTF-8 text (byte "
                        f"0x{exc.object[exc.start]:02x}): save the file's text as UTF-8"
                    ) from exc
        for row in rows:
            i += 1
            yield f"{where}, row {i}", row


READERS = {"jsonl": _records_jsonl, "csv": _records_csv, "parquet": _records_parquet}


def _refuse_lone_surrogate(text: str, where: str, what: str) -> None:
    """Refuse text no UTF-8 can hold: a lone UTF-16 surrogate, which JSON may escape (`\\ud83d`,
    half of an emoji cut in two by a truncating export) though no file's bytes decode to one.
    Read, it failed every later step (its hash, the journal, the terminal) with a misleading
    "cannot write ... in the utf-8 encoding"."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise CorpusError(
            f"{where}: {what} holds a lone UTF-16 surrogate (\\u{code:04x}, half of a character "
            f"cut in two?) at character {exc.start}, which no UTF-8 text can: fix the record or "
            "drop it"
        ) from exc


def chat_messages(raw: Any, where: str, field: str = "messages") -> tuple[Message, ...]:
    """Chat messages from OpenAI-style or ShareGPT-style turns, ending on the user's turn."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw, object_pairs_hook=_unique_keys)  # a CSV cell's chat: JSON text
        except _KeyTwice as exc:
            raise _refuse_key_twice(exc.key, f"{where}: the messages field {field!r}") from None
        except (ValueError, RecursionError) as exc:
            raise CorpusError(
                f"{where}: the messages field {field!r} is text, not a list of turns"
            ) from exc
    if not isinstance(raw, list) or not raw:
        got = "an empty list" if isinstance(raw, list) else _kind(raw)
        raise CorpusError(
            f"{where}: the messages field {field!r} must be a non-empty list of turns, got {got}"
        )
    messages = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise CorpusError(f"{where}: turn {i} is a {type(turn).__name__}, not a table")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise CorpusError(f"{where}: turn {i} needs role/content (or from/value) strings")
        _refuse_lone_surrogate(content, where, f"turn {i}")
        mapped = ROLE_ALIASES.get(role.lower())
        if mapped is None:
            raise CorpusError(
                f"{where}: turn {i} has unknown role {role!r}; roles are "
                f"{', '.join(sorted(set(ROLE_ALIASES)))}"
            )
        messages.append(Message(mapped, content))
    while messages and messages[-1].role != "user":
        messages.pop()  # the model answers the last user turn; later answers are dropped
    if not messages:
        raise CorpusError(f"{where}: the chat has no user turn")
    if not messages[-1].content.strip():  # as an empty `field` is refused
        raise CorpusError(
            f"{where}: turn {len(messages) - 1}, the user turn the model answers, is empty"
        )
    return tuple(messages)


def _prompt(
    record: Any, spec: dict[str, Any], where: str, index: int, name: str, count_tokens: TokenCounter
) -> Prompt:
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected an object with fields, got {_kind(record)}")
    key = spec.get("field") or spec["messages"]
    if key not in record:
        available = ", ".join(sorted(map(str, record))[:10])
        # One object wrapping the records on one line (`{"data": [{"text": ...}, ...]}`, as
        # json.dump writes it) is a record of JSON Lines, read as one: say where they are.
        wrapped = next(
            (
                (name, len(value))
                for name, value in record.items()
                if isinstance(value, list) and any(isinstance(r, dict) and key in r for r in value)
            ),
            None,
        )
        hint = (
            f"; its {wrapped[0]!r} holds {wrapped[1]} records with {key!r}, so this is an "
            "object wrapping records, not one: extract them into a JSON array of objects or "
            "JSON Lines (one object per line)"
            if wrapped
            else ""
        )
        raise CorpusError(f"{where}: no field {key!r} (fields here: {available}){hint}")
    value = record[key]
    if "field" in spec:
        if not isinstance(value, str):
            raise CorpusError(f"{where}: field {key!r} holds {_kind(value)}, not text")
        if not value.strip():
            raise CorpusError(f"{where}: field {key!r} is empty")
        _refuse_lone_surrogate(value, where, f"field {key!r}")
        messages: tuple[Message, ...] = (Message("user", value),)
    else:
        messages = chat_messages(value, where, key)
    chars = sum(len(m.content) for m in messages)
    if chars > MAX_PROMPT_BYTES:  # a JSON array's, a Parquet file's: no line bounded it
        raise CorpusError(
            f"{where}: a prompt of {chars:,} characters, over dvfs's limit of "
            f"{_bound()} of text (some 4 million tokens, past any "
            "model's context): cut it to the campaign's workload.input_tokens (longer prompts "
            "are trimmed to it)"
        )
    ident = str(record.get("id") or record.get("task_id") or f"{name}-{index:05d}")
    _refuse_lone_surrogate(ident, where, "its id")
    try:
        tokens = count_tokens(messages)
    except CorpusUnavailableError:  # a template this environment cannot run: no line's fault
        raise
    except CorpusError as exc:  # a chat the model's template refuses (`token_counter`)
        raise CorpusError(f"{where}: {exc}") from exc
    return Prompt(ident, messages, tokens)


def _kind(value: Any) -> str:
    """A JSON value's kind in words, as a user reading the file would name it."""
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "text",
        list: "a list",
        dict: "an object",
    }.get(type(value), f"a {type(value).__name__}")


def _open_source(spec: dict[str, Any], base_dir: str) -> tuple[IO[bytes], str, str, str]:
    """A file or package resource opened to read: (its stream, where for messages, source
    description, the words for a read that fails: its strerror follows)."""
    if "path" in spec:
        path = Path(spec["path"]).expanduser()
        if not path.is_absolute():
            path = Path(base_dir) / path
        if "\0" in str(path):  # no file's name holds one: the OS refuses it (a ValueError)
            raise CorpusError(
                f"corpus path {str(path)!r} holds a NUL byte, which no file name does: name "
                "the data file"
            )
        try:
            info = path.stat()
            if stat.S_ISDIR(info.st_mode):
                raise CorpusError(
                    f"corpus path {path} is a folder, not a file: name the file in it"
                )
            if not stat.S_ISREG(info.st_mode):
                raise CorpusError(f"corpus path {path} is not a regular file: name a data file")
            if info.st_size > MAX_CORPUS_BYTES:
                raise CorpusError(
                    f"corpus file {path} holds {info.st_size:,} bytes, above dvfs's limit of "
                    f"{MAX_CORPUS_BYTES / (1 << 30):g} GiB: sample it into a smaller file"
                )
            stream: IO[bytes] = open(path, "rb")  # noqa: SIM115 (the caller's `with` closes it)
        except FileNotFoundError as exc:
            if path.is_symlink():  # a link that is there, to no file: not "does not exist"
                raise CorpusError(
                    f"corpus file {path} is a symbolic link to {path.readlink()}, which does "
                    "not exist: point it at the data file, or give the file's own path"
                ) from exc
            raise CorpusError(f"corpus file {path} does not exist") from exc
        except NotADirectoryError as exc:  # was "cannot read corpus file ...: Not a directory"
            from dvfs.inputs import file_in_the_way

            raise CorpusError(
                f"corpus file {path} does not exist: {file_in_the_way(path)} is a file, not a "
                "folder; check the corpus's path"
            ) from exc
        except OSError as exc:
            from dvfs.inputs import link_loop_problem

            # a link in a loop: said so, with what to do (it was "Too many levels of symbolic
            # links"), as the campaign file's is
            loop = link_loop_problem(path)
            if loop is not None:
                raise CorpusError(f"corpus path: {loop}") from exc
            # as a campaign file that cannot be read: the campaign's input, exit 2
            raise CorpusError(f"cannot read corpus file {path}: {exc.strerror}") from exc
        return stream, str(path), f"file {path}", f"cannot read corpus file {path}"
    package, resource = spec["package"], spec["resource"]
    if "\0" in f"{package}{resource}":
        raise CorpusError(
            f"package {package!r}, resource {resource!r}: a NUL byte, which no package or "
            "file name holds: name the package and the data file in it"
        )
    unreadable = f"cannot read resource {resource!r} of package {package!r}"
    try:
        target = resources.files(package).joinpath(resource)
        if isinstance(target, Path):  # a package in a folder (not a zip): checked as a path is
            _refuse_resource_file(target, package, resource)
        stream = target.open("rb")
    except ModuleNotFoundError as exc:
        raise CorpusUnavailableError(
            f"package {package!r} is not installed in this environment"
        ) from exc
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        raise CorpusError(f"package {package!r} has no resource {resource!r}") from exc
    except OSError as exc:
        raise CorpusError(f"{unreadable}: {exc.strerror}") from exc
    return stream, f"{package}:{resource}", f"package {package}, resource {resource}", unreadable


def _refuse_resource_file(target: Path, package: str, resource: str) -> None:
    """A package resource that is no regular file, or too large, refused as a `path` is: a
    named pipe was opened and waited on for ever, no program writing to it. One that cannot be
    read is left to the open, which says it in its own words."""
    try:
        info = target.stat()
    except OSError:
        return
    if stat.S_ISDIR(info.st_mode):
        return  # "has no resource", as the open says
    if not stat.S_ISREG(info.st_mode):
        raise CorpusError(
            f"resource {resource!r} of package {package!r} ({target}) is not a regular file: "
            "name a data file"
        )
    if info.st_size > MAX_CORPUS_BYTES:
        raise CorpusError(
            f"resource {resource!r} of package {package!r} holds {info.st_size:,} bytes, above "
            f"dvfs's limit of {MAX_CORPUS_BYTES / (1 << 30):g} GiB: sample it into a smaller file"
        )


def _hf_records(spec: dict[str, Any]) -> tuple[Iterator[tuple[str, Any]], str]:
    try:
        import datasets
    except ImportError as exc:
        raise CorpusUnavailableError(
            f"corpus dataset {spec['dataset']!r} needs the Hugging Face datasets library: "
            "pip install 'dvfs[datasets]' (or download it and use path = ...)"
        ) from exc
    split = spec.get("split", "train")
    try:
        data = datasets.load_dataset(spec["dataset"], spec.get("config"), split=split)
    except Exception as exc:  # offline, unknown dataset, gated: one clear message
        raise CorpusUnavailableError(
            f"cannot load Hugging Face dataset {spec['dataset']!r} (config {spec.get('config')}, "
            f"split {split}): {exc}. Is the hub reachable? Offline, export it to a file "
            "(ds.to_json('corpus.jsonl')) and use path = ..."
        ) from exc
    where = f"dataset {spec['dataset']} [{split}]"
    return ((f"{where}, row {i}", row) for i, row in enumerate(data, start=1)), where


def campaign_dir_of(corpus_tables: object, sources: object) -> str | None:
    """The folder a campaign file lay in, read back from where its sweep read its corpora:
    `corpus_tables` is the campaign's `[corpus.*]` tables, `sources` each corpus's recorded
    source (a cube's `corpora` attribute: {name: {"source": ...}}), which for a file names the
    path `_read_source` read, that folder joined with the table's relative `path`. None where no
    corpus names a relative path whose source records it. A cube lies elsewhere than its
    campaign file (out/<name>/ against sweeps/), so this, not the cube's folder, is where the
    relative paths start when its prompts are read again (`dvfs twin fit CUBE`) from a cube of
    an earlier dvfs, which does not record that folder (`campaign_dir`)."""
    if not isinstance(corpus_tables, dict) or not isinstance(sources, dict):
        return None
    for name, spec in corpus_tables.items():
        entry = sources.get(name)
        if not isinstance(spec, dict) or not isinstance(entry, dict):
            continue
        if not isinstance(spec.get("path"), str) or not isinstance(entry.get("source"), str):
            continue
        relative = Path(spec["path"]).expanduser()
        if relative.is_absolute():
            continue
        source, tail = entry["source"], f"/{relative.as_posix()} ("
        if source.startswith("file ") and tail in source:
            return source[len("file ") : source.rindex(tail)] or "/"
    return None


def _prompts(
    records: Iterable[tuple[str, Any]],
    name: str,
    spec: dict[str, Any],
    count_tokens: TokenCounter,
) -> list[Prompt]:
    """The prompts of `records`, up to the table's `limit`."""
    limit = spec.get("limit")
    prompts = []
    # No record past the limit is read as one (a line past it too long to read is no refusal)
    for index, (at, record) in enumerate(itertools.islice(records, limit)):
        prompts.append(_prompt(record, spec, at, index, name, count_tokens))
    return prompts


def _file_prompts(
    lines: _Lines,
    fmt: str,
    name: str,
    spec: dict[str, Any],
    where: str,
    count_tokens: TokenCounter,
) -> list[Prompt]:
    """The prompts of a file read a line at a time (`_Lines`), then the rest of it, past the
    table's `limit` too: its hash is of the whole file, and a NUL or a line that is no UTF-8
    anywhere in it refuses it, as reading it whole did."""
    if fmt == "csv":
        records = _records_csv(lines, where, spec.get("field") or spec["messages"])
    else:
        records = READERS[fmt](lines, where)
    prompts = _prompts(records, name, spec, count_tokens)
    lines.finish()
    if lines.blank:
        raise _empty_file(where, packaged=lines.packaged)
    if not prompts:
        raise CorpusError(f"{where} holds no records")
    return prompts


def load_user_corpus(
    name: str, spec: dict[str, Any], *, base_dir: str, count_tokens: TokenCounter
) -> Corpus:
    """Read a user corpus described by its campaign table."""
    check_spec(spec)
    if "dataset" in spec:
        records, where = _hf_records(spec)
        source = (
            f"Hugging Face dataset {spec['dataset']}"
            f"{'/' + spec['config'] if spec.get('config') else ''} split "
            f"{spec.get('split', 'train')}"
        )
    else:
        stream, where, source, unreadable = _open_source(spec, base_dir)
        with stream:
            lines = _Lines(stream, where, unreadable, packaged="package" in spec)
            try:
                fmt = _format_of(spec, where)
            except CorpusError:
                if lines.only_whitespace():  # said first, as of any empty file
                    raise _empty_file(where, packaged=lines.packaged) from None
                raise
            try:
                prompts = _file_prompts(lines, fmt, name, spec, where, count_tokens)
            except CorpusError as exc:
                refusal = lines.refuse(exc)
                if refusal is exc:
                    raise
                raise refusal from exc
            except MemoryError as exc:
                raise CorpusUnavailableError(
                    f"corpus {where} does not fit in memory: sample it into a smaller file"
                ) from exc
        digest = lines.digest.hexdigest()[:16]
        read_as = lines.read_as or fmt
        return Corpus(name, tuple(prompts), f"{source} ({read_as}, sha256 {digest})")
    prompts = _prompts(records, name, spec, count_tokens)
    if not prompts:
        raise CorpusError(f"{where} holds no records")
    return Corpus(name, tuple(prompts), source)
