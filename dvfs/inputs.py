"""Reading a small input file (a campaign, caps file, plan, profile or headroom document) with a
bound, so that a wrong path (/dev/zero, a multi-gigabyte log, a disk image) is refused in one
line instead of being read until memory runs out. Pipes stay readable (`<(generate)`)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from dvfs.errors import DvfsError

#: Checks an opened file (its path and `os.fstat`) before a byte is read; raises to refuse it.
OpenedCheck = Callable[[Path, os.stat_result], None]

#: Why a file nested deeper than the parser's recursion allows (`[[[[...]]]]` 100k deep) is
#: refused: as invalid as any other damage to it, named by its reader (exit 2), not a fault of
#: this machine's.
TOO_DEEP = "nested too deeply to read"

#: The most bytes of a settings file (campaign, caps file, plan, profile) read.
MAX_SETTINGS_BYTES = 16 << 20
#: The most bytes of a `dvfs headroom --json` document read: a row (~1.5 KB) per batch, drafter,
#: corpus and GPU, so tens of thousands of rows fit.
MAX_DOCUMENT_BYTES = 64 << 20


def file_in_the_way(path: Path) -> Path:
    """The file where a folder of `path` should be, for a read of `path` that failed ENOTDIR
    (`afile/c.toml`): the nearest of its folders that exists (a file), else its parent."""
    return next((p for p in path.parents if p.exists()), path.parent)


def link_loop_problem(path: str | bytes | os.PathLike[str], what: str = "file") -> str | None:
    """What is wrong with `path` where it is, or leads through, a symbolic link in a loop
    (`ln -s x x`), which no open gets through, and what to do; None otherwise. The reads that
    ask `exists()` first said "does not exist" of it, of a link that is there. `what` the path
    should be: "file", or "folder" for one that names a folder."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            return None
    except (TypeError, ValueError):  # a NUL in it: said where it is opened
        return None
    else:
        return None
    text = os.fsdecode(path)
    if os.path.islink(path):
        said = f"{text} is a symbolic link in a loop (it never reaches a {what})"
    else:
        said = f"a symbolic link on the way to {text} is in a loop"
    return f"{said}: point it at the {what}, or give the {what}'s own path"


def read_limited(
    path: Path, limit: int, error: type[DvfsError], what: str, check: OpenedCheck | None = None
) -> bytes:
    """`path`'s bytes, at most `limit` of them: more raises `error` naming the file. `check`
    sees the file opened, before it is read: the file read is the file checked, whatever
    replaces the path meanwhile."""
    # Opened without blocking: a named pipe no program writes to would be waited on for ever.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if check is not None:
            check(path, info)
        head = b""
        if stat.S_ISFIFO(info.st_mode):
            try:  # b"": no writer (EOF); BlockingIOError: a writer, nothing written yet
                head = os.read(fd, limit + 1)
            except BlockingIOError:
                pass
            else:
                if not head:
                    raise error(f"{path} is a pipe no program writes to: give the {what} itself")
        os.set_blocking(fd, True)
        data = head + f.read(limit + 1 - len(head)) if len(head) <= limit else head
    if len(data) > limit:
        raise error(
            f"{path} holds more than {limit >> 20} MiB, far more than any {what}: is it the "
            "right file?"
        )
    return data


def read_text_limited(
    path: Path, limit: int, error: type[DvfsError], what: str, check: OpenedCheck | None = None
) -> str:
    """`read_limited` as UTF-8 text with universal newlines, as `Path.read_text` reads it, less
    a leading UTF-8 byte-order mark (Windows editors save one; TOML and JSON parsers read it as
    a stray character, "invalid statement at line 1, column 1" of a valid file). Bytes that are
    not UTF-8 raise `error` in one wording for every file read so (`not_utf8`), not Python's
    codec message ("'utf-8' codec can't decode byte 0xff in position 2")."""
    data = read_limited(path, limit, error, what, check)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(not_utf8(path, exc, what)) from exc
    return text.replace("\r\n", "\n").replace("\r", "\n")


def not_utf8(path: Path, exc: UnicodeDecodeError, what: str) -> str:
    """What is wrong with the file `path` (`what`: "campaign file") whose bytes `exc` could not
    decode, and what to do: the byte and its line."""
    line = bytes(exc.object[: exc.start]).count(b"\n") + 1
    byte = f"0x{exc.object[exc.start]:02x}"
    return (
        f"{path} is not UTF-8 text (byte {byte} on line {line}): is it the {what}? Save it as UTF-8"
    )
