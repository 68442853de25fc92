"""Helpers for the bad-input matrix (tests/test_bad_inputs.py): a tiny valid campaign as data,
a TOML writer to mutate it key by key, generators of damaged files, and filesystem faults
injected at the write layer (the tests run as root, so chmod cannot make a folder read-only).

Every damaged file is generated in the test's tmp_path; nothing binary is committed.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import errno
import io
import json
import math
import os
import random
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: Sentinel: remove the key instead of setting it.
DELETE = object()

#: The smallest useful twin campaign: 2 clocks x 1 limit x batch 1 x 2 drafters x 1 corpus.
TINY: dict[str, Any] = {
    "campaign": {"name": "tiny"},
    "gpu": {"backend": "twin", "profile": "h100-sxm:none", "devices": [0]},  # exact twin
    "knobs": {"sm_clock": [1980, 1500], "power_limit": [700], "settle_s": 0.0},
    "engine": {"backend": "twin", "model": "llama-3.1-8b"},
    "drafters": {
        "none": {"algorithm": "none"},
        "eagle3": {
            "algorithm": "EAGLE3",
            "draft_model": "eagle3-llama-3.1-8b",
            "num_steps": 3,
            "eagle_topk": 1,
            "num_draft_tokens": 4,
        },
    },
    "workload": {
        "batch": [1],
        "corpora": ["code"],
        "input_tokens": [16, 2048],
        "output_tokens": 16,
    },
    "measurement": {
        "warmup_tokens": 0,
        "min_window_s": 0.05,
        "max_rounds": 1,
        "repeats": 1,
        "sample_period_s": 0.01,
        "idle_s": 0.05,
    },
}

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(name: str) -> str:
    return name if _BARE_KEY.match(name) else json.dumps(name)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string (JSON escapes are valid TOML escapes)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")


def toml_text(data: dict[str, Any]) -> str:
    """TOML for a campaign-shaped document: scalars first, then one [table] per nested dict.

    A dict value is written as a sub-table unless it sits in a list; `{"__inline__": ...}`
    keeps one inline (sm_clock ranges read the same either way).
    """
    lines: list[str] = []

    def table(path: list[str], body: dict[str, Any]) -> None:
        scalars = {k: v for k, v in body.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in body.items() if isinstance(v, dict)}
        if path and (scalars or not tables):
            lines.append(f"\n[{'.'.join(_key(p) for p in path)}]")
        for k, v in scalars.items():
            lines.append(f"{_key(k)} = {toml_value(v)}")
        for k, v in tables.items():
            table([*path, k], v)

    table([], data)
    return "\n".join(lines).lstrip("\n") + "\n"


def campaign(*edits: tuple[str, Any], base: dict[str, Any] | None = None) -> str:
    """TINY with edits applied: ("workload.batch", []) sets, ("knobs.settle_s", DELETE) removes.

    A dotted path's segments are split on ".", so keys holding dots are not reachable (none
    of the campaign's are).
    """
    doc = copy.deepcopy(TINY if base is None else base)
    for path, value in edits:
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node.setdefault(p, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return toml_text(doc)


def user_corpus_campaign(spec: dict[str, Any], name: str = "mine") -> str:
    """TINY serving one user corpus `name` described by `spec`."""
    return campaign(("workload.corpora", [name]), (f"corpus.{name}", spec))


# -- damaged bytes ---------------------------------------------------------------------------


def binary_bytes(n: int = 4096, seed: int = 9) -> bytes:
    """Random bytes with NULs and invalid UTF-8, like an image or a compiled file."""
    rng = random.Random(seed)
    return b"\x89PNG\r\n\x1a\n\x00\x00" + bytes(rng.randrange(256) for _ in range(n))


def latin1(text: str) -> bytes:
    """Text saved in Latin-1: accented letters are not UTF-8."""
    return text.encode("latin-1")


def truncated(data: bytes | str, fraction: float = 0.5) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return raw[: max(1, int(len(raw) * fraction))]


def torn_middle_line(data: bytes) -> bytes:
    """Cut one line in the middle of a JSONL file in half (the rest stays)."""
    lines = data.split(b"\n")
    mid = len(lines) // 2
    lines[mid] = lines[mid][: len(lines[mid]) // 2]
    return b"\n".join(lines)


def sparse_file(path: Path, size: int) -> Path:
    """A file of `size` bytes that costs no disk and no time (its bytes are NULs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def jsonl(records: list[Any]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def prompts(n: int = 4, field: str = "text") -> list[dict[str, Any]]:
    return [
        {"id": f"p{i}", field: f"Prompt number {i}: explain why the sky is blue."} for i in range(n)
    ]


# -- filesystem faults -----------------------------------------------------------------------

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


@contextlib.contextmanager
def failing_writes(under: Path, code: int = errno.EROFS) -> Iterator[None]:
    """Every attempt to create, write, rename or remove under `under` fails with `code`, as on a
    read-only file system (EROFS), a full disk (ENOSPC) or a folder without write permission
    (EACCES). Reads still work."""
    root = os.path.abspath(under)

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return False
        try:
            p = os.path.abspath(os.fspath(path))
        except TypeError:
            return False
        return p == root or p.startswith(root + os.sep)

    def fail(path: Any) -> OSError:
        return OSError(code, os.strerror(code), os.fspath(path))

    real_open, real_os_open = builtins.open, os.open
    real_mkdir, real_replace, real_rename = os.mkdir, os.replace, os.rename
    real_unlink, real_mkstemp = os.unlink, tempfile.mkstemp

    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if inside(file) and any(c in mode for c in "wax+"):
            raise fail(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if inside(path) and flags & _WRITE_FLAGS:
            raise fail(path)
        return real_os_open(path, flags, *args, **kwargs)

    def fake_mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if inside(path) and not os.path.isdir(path):
            raise fail(path)
        real_mkdir(path, *args, **kwargs)

    def fake_two(real: Any) -> Any:
        def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if inside(src) or inside(dst):
                raise fail(dst)
            real(src, dst, *args, **kwargs)

        return move

    def fake_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if inside(path):
            raise fail(path)
        real_unlink(path, *args, **kwargs)

    def fake_mkstemp(*args: Any, dir: Any = None, **kwargs: Any) -> Any:  # noqa: A002
        if dir is not None and inside(dir):
            raise fail(dir)
        return real_mkstemp(*args, dir=dir, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "open", fake_open)
        mp.setattr(io, "open", fake_open)
        mp.setattr(os, "open", fake_os_open)
        mp.setattr(os, "mkdir", fake_mkdir)
        mp.setattr(os, "replace", fake_two(real_replace))
        mp.setattr(os, "rename", fake_two(real_rename))
        mp.setattr(os, "unlink", fake_unlink)
        mp.setattr(tempfile, "mkstemp", fake_mkstemp)
        yield
