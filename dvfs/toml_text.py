"""TOML values as text, for the files dvfs writes (caps, plans, fitted twin profiles): Python's
`tomllib` reads TOML but does not write it, and a value written wrong (a string holding a
newline or a quote) would make the whole file unreadable at boot."""

from __future__ import annotations

import json
import numbers
from typing import Any


def toml_value(value: Any) -> str:
    """`value` as a TOML value that `tomllib` reads back equal: booleans, numbers (nan and inf
    included), lists and tuples as arrays, dicts as inline tables, anything else as a string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
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
