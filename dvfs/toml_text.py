"""TOML values as text, for the files dvfs writes (caps, plans, fitted twin profiles): Python's
`tomllib` reads TOML but does not write it, and a value written wrong (a string holding a
newline or a quote) would make the whole file unreadable at boot."""

from __future__ import annotations

import json
import numbers
from typing import Any

from dvfs.errors import DvfsError

#: TOML's integers are 64-bit: a reader "must throw" on one beyond them (Python's `tomllib`
#: reads any, so such a file read back here, and failed on the next reader).
TOML_INT_MIN, TOML_INT_MAX = -(2**63), 2**63 - 1


class TomlValueError(DvfsError):
    """A value TOML cannot hold (an integer beyond 64 bits): refused, nothing written."""


def toml_value(value: Any) -> str:
    """`value` as a TOML value that `tomllib` reads back equal: booleans, numbers (nan and inf
    included), lists and tuples as arrays, dicts as inline tables, anything else as a string.
    An integer beyond TOML's 64 bits is refused (`TomlValueError`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        if not TOML_INT_MIN <= int(value) <= TOML_INT_MAX:
            raise TomlValueError(
                f"{int(value)} is beyond TOML's 64-bit integers ({TOML_INT_MIN} to "
                f"{TOML_INT_MAX}), which readers other than Python's refuse"
            )
        return str(int(value))
    if isinstance(value, numbers.Real):  # numpy's floats too, whose repr is not TOML
        return repr(float(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    # JSON's escapes are TOML's, save DEL, which TOML wants escaped and JSON leaves as it is
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_key(key: Any) -> str:
    """A table key: bare where TOML allows it, else quoted."""
    text = str(key)
    bare = text and all(c.isascii() and (c.isalnum() or c in "-_") for c in text)
    return text if bare else toml_value(text)


def toml_line(key: str, value: Any) -> str:
    """`key = value` (`toml_value`), a value TOML cannot hold refused naming the key and what
    to do: the file is not written."""
    try:
        return f"{key} = {toml_value(value)}"
    except TomlValueError as exc:
        raise TomlValueError(
            f"cannot write {key} into a TOML file: {exc}; correct the value in the input it "
            "came from"
        ) from None


def beyond_64_bits(data: Any, where: str = "") -> str | None:
    """The dotted key (with [i] for an array's item) of the first integer in parsed TOML `data`
    beyond TOML's 64 bits, None where there is none: `tomllib` reads any integer, which the
    spec calls invalid TOML, and a value such as batch = 10**400 fails later, as no float."""
    if isinstance(data, bool):
        return None
    if isinstance(data, int):
        return None if TOML_INT_MIN <= data <= TOML_INT_MAX else where
    items: Any = ()
    if isinstance(data, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in data.items())
    elif isinstance(data, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(data))
    for key, value in items:
        found = beyond_64_bits(value, key)
        if found is not None:
            return found
    return None


def refuse_beyond_64_bits(data: Any, where: str, error: type[DvfsError]) -> None:
    """Raise `error` naming `where` (the file) and the key where parsed TOML `data` holds an
    integer beyond TOML's 64 bits (`beyond_64_bits`): one line, before any value is used."""
    huge = beyond_64_bits(data)
    if huge is not None:
        raise error(
            f"{where}: not valid TOML: {huge} is an integer beyond TOML's 64 bits "
            f"({TOML_INT_MIN} to {TOML_INT_MAX}); set a smaller one"
        )
