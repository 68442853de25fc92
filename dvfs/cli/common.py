"""Shared CLI pieces: lazy command loading, error translation, rendering helpers."""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from dvfs.errors import MAX_MESSAGE_CHARS

if TYPE_CHECKING:
    from dvfs.errors import GpuError

F = TypeVar("F", bound=Callable[..., Any])


#: What `dvfs sweep` and `dvfs doctor` say of `--gpus` with `--executor ray` on real GPUs.
RAY_PLACES_GPUS = (
    "with --executor ray, Ray places the workers on the cluster's GPUs: leave out --gpus"
)


def option_given(ctx: click.Context, name: str) -> bool:
    """Whether the user set the option `name` (on the command line, through the environment
    or at a prompt) rather than left it to its default: a default may stand where a value the
    user chose conflicts."""
    from click.core import ParameterSource

    return ctx.get_parameter_source(name) in (
        ParameterSource.COMMANDLINE,
        ParameterSource.ENVIRONMENT,
        ParameterSource.PROMPT,
    )


def dry_run_reads_gpus(command: str, reads: str, *, refused: str = "") -> Callable[[F], F]:
    """A command whose --dry-run still reads the GPUs here through NVML (`reads`: what of
    them), and has no --twin: where NVML is missing or its driver not loaded, its dry run's
    one line says so and to run it on the GPUs' host, not the hint of the commands that take
    --twin; begun with `refused` (the words its other dry-run refusals begin with). Its run
    itself says what `has_no_twin` says."""

    def on_dry_run(text: str) -> str:
        # NVML missing: not the GPUs' host, most likely; its driver installed but not
        # loaded: their host, where the module is to be loaded first
        where = (
            "load the module, then run it again" if _not_loaded(text) else "run it on their host"
        )
        return f"{refused}{text}; {command} reads {reads} through it (it has no --twin): {where}"

    def decorate(func: F) -> F:
        return _without_the_twins_hint(func, on_dry_run)

    return decorate


def wait_for_driver_option(what: str) -> Callable[[F], F]:
    """`--wait-for-driver SECONDS` of a command a systemd unit runs at boot (`what`: "before
    failing", or what the command does instead)."""
    return click.option(
        "--wait-for-driver",
        "wait_for_driver_s",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        metavar="SECONDS",
        help="While NVML says the NVIDIA kernel module is not loaded (at boot, before the driver "
        f"is up), try again every few seconds for up to SECONDS {what}.",
    )


def wait_for_the_driver(
    wait_s: int, *, dry_run: bool = False, nothing: str = "no cap applied"
) -> None:
    """`--wait-for-driver`: return once NVML starts, or at once where it fails for any other
    reason (the command then says that failure itself); while the NVIDIA kernel module is not
    loaded, say so once and try again (`dvfs.gpu.nvml.wait_for_driver`), raising the failure
    that says how long it waited where the wait runs out. A signal meanwhile (the unit stopped,
    the host shut down at boot) ends it in one line saying nothing was changed (`nothing`:
    what the command did not do), not silently (exit 143 and no word in the journal)."""
    if not wait_s:
        return
    from dvfs.gpu.nvml import DRIVER_POLL_S, wait_for_driver, wait_span
    from dvfs.signals import Interrupted, interrupted_while, signals_raise

    # (a wait no longer than one poll tries again once, at its end: not "every 5 s" of 1 s)
    again = f"every {DRIVER_POLL_S:g} s" if wait_s > DRIVER_POLL_S else f"once, in {wait_s} s"
    try:
        with signals_raise():
            spent = wait_for_driver(
                wait_s,
                lambda: click.echo(
                    f"the NVIDIA kernel module is not loaded yet (NVML says so): waiting "
                    f"{wait_span(wait_s)} for it, trying again {again}",
                    err=True,
                ),
                dry_run=dry_run,
            )
    except (KeyboardInterrupt, Interrupted) as exc:
        raise interrupted_while(
            exc,
            "while waiting for the NVIDIA kernel module to load: nothing changed, "
            f"{nothing}; start it again once the driver is loaded",
        ) from None
    if spent is not None:  # the wait ran out: its line says so
        raise spent


def has_no_twin(func: F) -> F:
    """A command that reads or changes the GPUs here through NVML only (no --twin, no
    campaign: `cap apply`, `cap show`, `cap reset`, `gpu reset`, `monitor`, `govern`, the caps
    and governor units' commands): where NVML is missing or its driver not loaded, its one line
    says how to get the driver going, not to run on the digital twin, which it cannot."""

    return _without_the_twins_hint(func, None)


def _without_the_twins_hint(func: F, on_dry_run: Callable[[str], str] | None) -> F:
    """`func`, its failure to reach NVML (`GpuUnavailableError`) said without the hint to run
    on the twin (`_without_twin_hint`); in a dry run (`dry_run=True`), as `on_dry_run` words
    it, where given."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from dvfs.errors import GpuUnavailableError

        try:
            return func(*args, **kwargs)
        except GpuUnavailableError as exc:
            text = _without_twin_hint(exc)
            if text is None:
                raise
            if on_dry_run is not None and kwargs.get("dry_run"):
                text = on_dry_run(text)
            raise type(exc)(text) from exc

    return wrapper  # type: ignore[return-value]


def _not_loaded(text: str) -> bool:
    """Whether `text` (`_without_twin_hint`'s) says NVML's driver is installed here but its
    kernel module not loaded: this is the GPUs' host, not one without them. (Its words after
    "not loaded", which a dry run's note of the wait it would make comes before.)"""
    from dvfs.gpu.nvml_errors import NOT_LOADED_HINT, TWIN_HINT

    hint = NOT_LOADED_HINT.removesuffix(f", or {TWIN_HINT}")
    return text.endswith(hint.partition(" not loaded")[2]) and " not loaded" in text


def _without_twin_hint(exc: Exception) -> str | None:
    """The message of an NVML-missing or driver-not-loaded error without its closing hint to
    run on the twin (`TWIN_HINT`); None where it has none."""
    from dvfs.gpu.nvml_errors import TWIN_HINT

    text, twin = str(exc), f", or {TWIN_HINT}"
    return text.removesuffix(twin) if text.endswith(twin) else None


class LazyGroup(click.Group):
    """A group whose subcommands are imported only when used, keeping `--help` fast."""

    def __init__(
        self,
        *args: Any,
        lazy_commands: dict[str, tuple[str, str, str]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands or {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands:
            module, attr, _ = self.lazy_commands[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context) -> None:
        """Run the command line; a failure outside any command's own handler (an optional
        dependency that does not import, say) is still one line, never a traceback. What the
        command returns is dropped, as click's standalone mode drops it: `run_main` takes
        what click returns for an exit code."""
        guard(super().invoke, ctx)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List lazy commands with their one-line help without importing them."""
        rows = []
        for name in self.list_commands(ctx):
            if name in self.lazy_commands:
                rows.append((name, self.lazy_commands[name][2]))
            else:
                cmd = super().get_command(ctx, name)
                if cmd is not None and not cmd.hidden:
                    rows.append((name, cmd.get_short_help_str()))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def handle_errors(func: F) -> F:
    """Turn every failure into one line on stderr and a documented exit code.

    dvfs's own errors carry their message and code; interruptions exit 130/143; a file system
    fault (`OSError`), undecodable text, exhausted memory or too-deep nesting becomes a plain
    sentence naming the path; anything else is an internal error (one line, the traceback
    with -vv). Click's usage errors pass through to click.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return guard(_run_checked, func, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _run_checked(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    refuse_output_over_inputs()
    return func(*args, **kwargs)


#: Commands that read a sweep folder's journal but not its cube (they write the cube).
_WRITES_THE_CUBE = {"cube build"}


def refuse_output_over_inputs() -> None:
    """An output file (`-o`/`--out`) must not be a file the command reads: the input file
    itself, or a sweep folder's journal or cube (each GPU model's too, in `gpu-*/`, where a
    fleet mixing models writes them; `cube build` writes those cubes itself). Writing over
    it would lose the measurements the output is made from (exit 2, before anything is read
    or written)."""
    ctx = click.get_current_context(silent=True)
    params = _path_params()
    if ctx is None or not any(output and not value.is_dir() for _, value, output in params):
        return
    from dvfs.cube.schema import CUBE_NAME
    from dvfs.measure.journal import JOURNAL_NAME

    command = " ".join(ctx.command_path.split()[1:])
    names = [JOURNAL_NAME] if command in _WRITES_THE_CUBE else [JOURNAL_NAME, CUBE_NAME]
    read: dict[Path, str] = {}
    for name, value, output in params:
        if output:
            continue
        if value.is_dir():
            for file in names:
                read.setdefault(_resolved(value / file), f"{name} {value}'s {file}")
            for file in (JOURNAL_NAME, CUBE_NAME):  # each GPU model's, in a mixed fleet
                for path in sorted(value.glob(f"gpu-*/{file}")):
                    model_file = f"{name} {value}'s {path.parent.name}/{file}"
                    read.setdefault(_resolved(path), model_file)
        else:
            read.setdefault(_resolved(value), f"{name} {value}")
    for name, value, output in params:
        if not output or value.is_dir():
            continue
        what = read.get(_resolved(value))
        if what is not None:
            fail(
                f"{name} {value} is {what}, which this command reads: writing there would "
                "lose it; choose another output path",
                2,
            )


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: compare as given
        return path.absolute()


def guard(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `func`, translating any exception as `handle_errors` documents."""
    from dvfs.errors import DvfsError
    from dvfs.signals import Interrupted

    try:
        return func(*args, **kwargs)
    except (click.ClickException, click.exceptions.Exit, click.Abort):
        raise
    except DvfsError as exc:
        fail(str(exc), exc.exit_code)
    except Interrupted as exc:
        click.echo(one_line(f"Interrupted ({exc})."), err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    except BrokenPipeError as exc:
        if _stdout_reader_gone():  # `dvfs ... | head`: stop quietly, as a SIGPIPE would
            _silence_stdout()
            sys.exit(1)  # as rich does for its own output
        fail(describe_os_error(exc), _failure_code(exc))
    except OSError as exc:
        text = describe_os_error(exc)
        if _stdout_failed(exc):  # what it holds would fail again as the interpreter exits
            _silence_stdout()
        fail(text, _failure_code(exc))
    except UnicodeError as exc:
        fail(describe_unicode_error(exc), _failure_code(exc))
    except MemoryError as exc:
        fail(
            f"out of memory working on {_inputs_text()}: the input is too large for this "
            "machine; use a smaller input or a machine with more memory",
            _failure_code(exc),
        )
    except RecursionError as exc:
        if not _path_params(files_only=True):
            _internal_error(exc)
        fail(
            f"{_inputs_text()} is nested too deeply to read (a damaged file?); check the file",
            _failure_code(exc),
        )
    except ImportError as exc:
        missing = exc.name or "a module"
        fail(
            f"cannot import {missing} ({exc}): install the package that provides it in this "
            "environment, or reinstall dvfs",
            _failure_code(exc),
        )
    except Exception as exc:
        _internal_error(exc)


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reading end was closed."""
    import select

    try:
        fd = sys.__stdout__.fileno() if sys.__stdout__ is not None else 1
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ is not None else 1)
    except (OSError, ValueError, AttributeError):
        pass


def fail(message: str, code: int = 1) -> NoReturn:
    _to_stderr(lambda: click.echo(f"Error: {one_line(message)}", err=True))
    sys.exit(code)


def _to_stderr(write: Callable[[], None]) -> None:
    """`write` a message to standard error; where that cannot be written (`2> /dev/full`, a
    closed pipe), nothing: the exit code that follows is all that still tells."""
    with contextlib.suppress(OSError):
        write()


def _say_then_exit(say: Callable[[], None], code: int) -> NoReturn:
    """`say` on standard error (`_to_stderr`), then exit `code`. As click's standalone main
    holds it, an interrupt that arrives while the message is written (Ctrl-C as a usage error
    is shown) loses the message, not the exit code: it was a traceback, and death by SIGINT."""
    with contextlib.suppress(KeyboardInterrupt, EOFError):
        _to_stderr(say)
    sys.exit(code)


class _BestEffortStderr:
    """Standard error, whose writes that fail (`2> /dev/full`, a pipe whose reader is gone) are
    dropped: what dvfs says there (progress, notes, warnings, its one line of error) is for
    the user to read, none of the work; a sweep died of its first progress note there, exit 1,
    having measured nothing. The exit code still tells how the command ended."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped

    def write(self, text: Any) -> int:
        try:
            return int(self.wrapped.write(text))
        except OSError:
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self.wrapped.flush()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.wrapped, attr)


def run_main(group: click.Group, prog_name: str) -> NoReturn:
    """`group` as click's standalone main runs it, less its ends in a traceback or in a
    failure of its own: click's own output (--help, --version) into a standard output that
    cannot be written (`> /dev/full`) is one line on stderr, exit 1; a standard error that
    cannot be written (`2> /dev/full`) loses what is said there, not the work
    (`_BestEffortStderr`), and a usage error still exits with its code (2), not 1."""
    if sys.stderr is not None and not isinstance(sys.stderr, _BestEffortStderr):
        sys.stderr = _BestEffortStderr(sys.stderr)
    try:
        code = group.main(prog_name=prog_name, standalone_mode=False)
    except click.ClickException as exc:
        _say_then_exit(exc.show, exc.exit_code)
    except click.Abort:
        _say_then_exit(lambda: click.echo("Aborted!", err=True), 1)
    except OSError as exc:  # (EPIPE is click's: it exits 1, quietly)
        text = describe_os_error(exc)
        if _stdout_failed(exc):
            _silence_stdout()
        fail(text)
    # an Exit's code (--help's 0); a command's return value is none (`LazyGroup.invoke`)
    sys.exit(code if isinstance(code, int) else 0)


#: Characters str.splitlines() breaks on, besides the ordinary line ends.
_BREAKS = {"\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"}


def one_line(text: str) -> str:
    """`text` as one printable line: line breaks joined, control characters escaped, bounded."""
    parts = [part.strip() for part in text.replace("\r", "\n").split("\n")]
    joined = " ".join(part for part in parts if part)
    cleaned = "".join(
        ch
        if ch == "\t" or (ch >= " " and ch != "\x7f" and ch not in _BREAKS)
        else ch.encode("unicode_escape").decode("ascii")
        for ch in joined
    )
    if len(cleaned) > MAX_MESSAGE_CHARS:
        cleaned = cleaned[: MAX_MESSAGE_CHARS - 3] + "..."
    return cleaned


# errno -> (verb, what happened in plain words, what to do)
_OS_ERRORS: dict[int, tuple[str, str, str]] = {
    errno.EROFS: ("write", "read-only file system", "choose another {opt}"),
    errno.ENOSPC: ("write", "no space left on the device", "free space or choose another {opt}"),
    errno.EDQUOT: ("write", "disk quota exceeded", "free space or choose another {opt}"),
    errno.EFBIG: ("write", "file too large for the file system", "choose another {opt}"),
    errno.EACCES: ("use", "permission denied", "check permissions or choose another {opt}"),
    errno.EPERM: ("use", "operation not permitted", "check permissions or choose another {opt}"),
    errno.ENOENT: ("open", "no such file or folder", "check the path (does its folder exist?)"),
    errno.ENOTDIR: (
        "use",
        "a part of the path is a file, not a folder",
        "choose a path inside a folder for {opt}",
    ),
    errno.EISDIR: ("use", "it is a folder, not a file", "give a file's path for {opt}"),
    errno.EEXIST: ("create", "something is in the way", "remove it or choose another {opt}"),
    errno.ENAMETOOLONG: ("use", "the name is too long", "use a shorter path"),
    errno.ELOOP: ("use", "too many levels of symbolic links", "check the links in the path"),
    errno.EMFILE: ("open", "too many open files", "raise the limit (ulimit -n) and rerun"),
    errno.ENFILE: ("open", "too many open files in the system", "close some programs and rerun"),
    errno.EIO: ("use", "input/output error", "check the disk or network file system"),
    errno.EBUSY: ("use", "device or resource busy", "retry when it is free"),
    errno.EPIPE: ("write", "the reader closed the pipe", "keep the reading end open"),
    errno.ENXIO: ("open", "no such device", "check the path"),
}


def os_error_words(exc: OSError) -> str:
    """What happened, in the plain words `describe_os_error` says it (no path, no advice)."""
    code = exc.errno if isinstance(exc.errno, int) else 0
    reason = (exc.strerror or str(exc) or type(exc).__name__).rstrip(".")
    return _OS_ERRORS.get(code, ("use", reason[:1].lower() + reason[1:], ""))[1]


class OutputWriteError(OSError):
    """A file-system fault met writing a command's output, whatever its errno (a folder or an
    immutable file where the output goes): worded as a write, whose way round is the
    command's output option, also where the output goes into an input's folder by default (a
    cube beside its journal), not that input."""


def describe_os_error(exc: OSError) -> str:
    """One sentence for a file system fault: the path, what happened in plain words, what to do.

    When the error does not carry its path (a failed write to an open file), the command's
    one output path stands in for it.
    """
    path = exc.filename if exc.filename not in (None, "") else None
    code = exc.errno if isinstance(exc.errno, int) else 0
    reason = (exc.strerror or str(exc) or type(exc).__name__).rstrip(".")
    verb, words, advice = _OS_ERRORS.get(code, ("use", reason[:1].lower() + reason[1:], ""))
    if path is None and _stdout_failed(exc):
        # `dvfs cube info CUBE > /dev/full`: no path, and no option names where it goes
        full = code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        advice = "free space where it is redirected, or " if full else ""
        return f"cannot write to standard output: {words}; {advice}redirect it elsewhere"
    writing = verb == "write" or isinstance(exc, OutputWriteError)
    param = _param_for(path, writing=writing) if path is not None else _single_output_param()
    if param is None and path is not None and code in (errno.EISDIR, errno.EEXIST, errno.ENOTDIR):
        # something in the way of a path the command made beside its output (report.md's
        # figures folder): that output's option is the way round it, not "path"
        param = _param_for(path, writing=True)
    if path is None and param is not None:
        path = param[1]
    opt = param[0] if param is not None else "path"
    if code == errno.EEXIST and path is not None and _is_device(path):
        # /dev/null given for a folder: not to be removed
        words, advice = "a device is there, no folder", "choose another {opt}"
    broken = _broken_link(path) if code == errno.EEXIST and path is not None else None
    if broken is not None:  # not "something is in the way": a link to nothing, or a loop
        words, advice = broken
    if (
        code == errno.EISDIR
        and param is not None
        and (_derived(path, param[1]) or _option_unset(param[0]))
    ):
        # a folder where the command puts a file of its own (a figure in --out, in report.md's
        # figures folder, `cube build`'s SWEEP_DIR/cube.nc without --out): the option names no
        # file to correct, the folder is to move aside
        advice = "move that folder aside, or choose another {opt}"
    kernel = _kernel_output(path, param, code, writing=writing)
    if kernel is not None:  # not "check the path (does its folder exist?)", of /proc
        words, advice = kernel, "choose a folder on a disk for {opt}"
    advice = advice.format(opt=opt)
    where = f" {os.fsdecode(path)}" if path is not None else ""
    return f"cannot {verb}{where}: {words}" + (f"; {advice}" if advice else "")


#: What a write on the kernel's file systems (/proc, /sys) fails with: no such file (/proc
#: makes none), permission denied or not permitted (of root too), invalid argument.
_KERNEL_REFUSALS = (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EINVAL, errno.EROFS)


def _kernel_output(
    path: Any, param: tuple[str, Path] | None, code: int, *, writing: bool
) -> str | None:
    """What an output path on one of the kernel's file systems is (`kernel_file_system`),
    where writing it failed as writes fail there; None for any other fault or path, and for
    an input's."""
    if path is None or code not in _KERNEL_REFUSALS:
        return None
    output = param is not None and any(name == param[0] and out for name, _, out in _path_params())
    if not (writing or output):
        return None
    from dvfs.outputs import kernel_file_system

    try:
        found = kernel_file_system(os.fsdecode(path))
    except (TypeError, ValueError):
        return None
    if found is None:
        return None
    return f"{found[0]} is the kernel's {found[1]} file system, where no output can go"


def _broken_link(path: Any) -> tuple[str, str] | None:
    """What a symbolic link `path` that leads to nothing (or round in a loop) is, and what to
    do, for a folder that could not be made there (EEXIST), or None where it is no such link."""
    import shlex

    try:
        if not os.path.islink(path):
            return None
        os.stat(path)
    except FileNotFoundError:
        target = os.path.realpath(path)
        said = shlex.quote(target).replace("{", "{{").replace("}", "}}")  # for its {opt}
        return (
            f"it is a symbolic link to {target}, which does not exist",
            f"make that folder (mkdir -p {said}), or remove the link, or choose another {{opt}}",
        )
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            return None
        return (
            "it is a symbolic link that leads back to itself (a loop)",
            "remove it or point it at a folder, or choose another {opt}",
        )
    except (TypeError, ValueError):
        return None
    return None


def _is_device(path: Any) -> bool:
    """Whether `path` is a character or block device (/dev/null), which no advice may say to
    remove."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except (OSError, TypeError, ValueError):
        return False
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)


def _option_unset(name: str) -> bool:
    """Whether the command's option `name` (its longest spelling) was not given: a failed
    write to where the command writes by default (`cube build`'s SWEEP_DIR/cube.nc) named it
    as the way round, its path the default one."""
    ctx = click.get_current_context(silent=True)
    for param in ctx.command.params if ctx is not None else []:
        if isinstance(param, click.Option) and max(param.opts, key=len) == name:
            return ctx is not None and ctx.params.get(param.name or "") is None
    return False


def _derived(path: Any, given: Path) -> bool:
    """Whether `path` is not the option's value `given` itself but a path the command made from
    it (a file in an output folder, or beside an output file)."""
    try:
        return Path(os.fsdecode(path)).absolute() != given.absolute()
    except (TypeError, ValueError):
        return False


def _stdout_failed(exc: OSError) -> bool:
    """Whether `exc` was raised writing standard output: the innermost frame of its traceback
    writes it (`click.echo`'s `file`, a rich console's `self.file`)."""
    import traceback

    frames = list(traceback.walk_tb(exc.__traceback__))
    if not frames:
        return False
    out = sys.stdout
    streams = (out, getattr(out, "buffer", None), sys.__stdout__)
    ours = {id(stream) for stream in streams if stream is not None}
    for value in frames[-1][0].f_locals.values():
        try:
            written = getattr(value, "file", None)
        except Exception:  # a property that fails: not a console writing standard output
            written = None
        if id(value) in ours or (written is not None and id(written) in ours):
            return True
    return False


def describe_unicode_error(exc: UnicodeError) -> str:
    if isinstance(exc, UnicodeDecodeError):
        obj = exc.object
        byte = f"byte 0x{obj[exc.start]:02x}" if exc.start < len(obj) else "a cut-off character"
        line = bytes(obj[: exc.start]).count(b"\n") + 1
        return (
            f"{_inputs_text()} is not UTF-8 text ({byte} on line {line}): is it the right "
            "file? Save text files as UTF-8"
        )
    if isinstance(exc, UnicodeEncodeError):
        bad = exc.object[exc.start : exc.end]
        if bad and all(0xDC80 <= ord(c) <= 0xDCFF for c in bad):
            # bytes Python could not decode (an argument or a file name), carried as
            # surrogates: no output encoding writes them, so PYTHONIOENCODING cannot help
            raw = " ".join(f"0x{ord(c) - 0xDC00:02x}" for c in bad)
            return (
                f"an argument or a file name holds bytes that are not UTF-8 ({raw}), which "
                "dvfs cannot write into text: give it in UTF-8 (rename such a file)"
            )
        return (
            f"cannot write {exc.object[exc.start : exc.end]!r} in the {exc.encoding} encoding: "
            "set PYTHONIOENCODING=utf-8 (or a UTF-8 locale) and rerun"
        )
    return f"cannot handle text in {_inputs_text()}: {exc}"


def make_parent(path: Path) -> None:
    """The folder of an output file, made if missing, as every command that writes a file
    makes it (`dvfs plot --out` its folder, `dvfs cube build -o` the cube's); a failure names
    the output path, as `describe_os_error` then words it. A link to a file in a folder that
    does not exist is refused (`check_link_target`): that folder is not made through it.

    The folders made are removed again, where still empty, once the command is over: one
    that failed after (a damaged cube, an unknown `--base`) left them behind, empty. A
    relative path whose first folder, missing, is a '~' no shell expanded (`-o '~/r.json'`,
    `--out=~/r.json`) is refused, not made as a folder named '~' here (`_unexpanded_home`)."""
    from dvfs.outputs import check_link_target

    check_link_target(path)
    make_folder(path.parent, path)


def make_folder(folder: Path, path: Path | None = None) -> None:
    """`folder`, made if missing, for the output `path` in it (or, None, the folder itself:
    `dvfs plot --out`), as `make_parent` makes an output file's: the folders made are removed
    again, where still empty, once the command is over (one whose first figure found the disk
    full left its --out folder behind, empty); a failure names `path`."""
    path = folder if path is None else path
    missing: list[Path] = []  # deepest first
    above = folder
    while above != above.parent and not os.path.lexists(above):
        missing.append(above)
        above = above.parent
    if missing:
        _unexpanded_home(path, missing[-1])
        ctx = click.get_current_context(silent=True)
        if ctx is not None:
            ctx.call_on_close(functools.partial(_remove_empty, missing))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:  # a file where a folder of the path should be
        # or a link to nothing, or in a loop: not "a part of the path is a file"
        for linked in (folder, *folder.parents):
            if os.path.islink(linked) and _broken_link(linked) is not None:
                raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(linked)) from exc
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path)) from exc
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def _remove_empty(folders: list[Path]) -> None:
    """Remove `folders` (deepest first) that are empty: those `make_parent` made for a file
    the command did not write."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:  # holding the output (or anything else), or never made
            return


def _unexpanded_home(path: Path, first: Path) -> None:
    """Refuse (`OutputRefusedError`) a relative output `path` whose missing first folder
    `first` is a '~' or '~user' no shell expanded: made, it was a folder of that name in the
    current one, the file written there, not in the home folder."""
    if path.is_absolute() or first.parent != Path("."):
        return
    problem = unexpanded_home_problem(path)
    if problem is not None:
        from dvfs.errors import OutputRefusedError

        raise OutputRefusedError(problem)


def _here_explicitly(value: Any) -> bool:
    """Whether an option's `value` as given starts with './': `./~/x` names a folder '~' here
    (no shell expands that '~'), though pathlib drops the './' and reads it as `~/x`."""
    text = os.fsdecode(value) if isinstance(value, str | bytes) else ""
    return text.startswith(("./", "." + os.sep))


def unexpanded_home_problem(path: Path) -> str | None:
    """What is wrong with a relative output `path` whose first part is a '~' or '~user' no
    shell expanded and no folder here is named (quoted, or joined to its option:
    `--out=~/runs`): written, it would go to a folder of that name made here, not to the home
    folder; None for any other path."""
    if path.is_absolute() or not path.parts:
        return None
    first = path.parts[0]
    if not first.startswith("~") or os.path.lexists(first):
        return None
    home = os.path.expanduser(first)
    full = f" (e.g. {Path(home) / path.relative_to(first)})" if home != first else ""
    return (
        f"{path}: no shell expanded its {first!r} (it was quoted, or joined to its option), "
        f"and a folder named {first!r} would be made here: write the path in full{full}"
    )


#: The options that name what a command writes.
OUTPUT_OPTIONS = ("--out", "--output")


def _path_params(*, files_only: bool = False) -> list[tuple[str, Path, bool]]:
    """(option or argument name, path, is an output) for each path given to the command;
    with `files_only`, not the options that name folders."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return []
    found = []
    for param in ctx.command.params:
        values = ctx.params.get(param.name or "")
        for value in values if isinstance(values, tuple | list) else [values]:
            if not isinstance(value, Path):
                continue
            if files_only and isinstance(param.type, click.Path) and not param.type.file_okay:
                continue
            if isinstance(param, click.Option):
                name = max(param.opts, key=len)
                output = name in OUTPUT_OPTIONS
            else:
                name = param.human_readable_name or "PATH"
                output = False
            found.append((name, value, output))
    return found


def _param_for(path: Any, *, writing: bool = False) -> tuple[str, Path] | None:
    """The command's path option that `path` is, lies under, or is a folder of: the one it
    is, else an output's (a write beside an output file too: report.md's figures), else an
    input's. A failed write under an input's folder (a cube
    written beside its journal by default) names the command's output option instead, even
    unset: another input is no way round a read-only or full disk."""
    try:
        failed = Path(os.fsdecode(path)).absolute()
    except (TypeError, ValueError):
        return None
    related = []
    for name, value, output in _path_params():
        given = value.absolute()
        if failed == given:
            return name, value
        if given in failed.parents or failed in given.parents:
            related.append((name, value, output))
    for name, value, output in related:
        if output:
            return name, value
    if writing:
        # written beside an output file (report.md's figures, in report_figures/ beside it);
        # not an output folder's (a sweep's --out), whose parent holds a state folder too
        for name, value, output in _path_params(files_only=True):
            if output and value.absolute().parent in failed.parents:
                return name, value
    if writing and related:
        ctx = click.get_current_context(silent=True)
        for param in ctx.command.params if ctx is not None else []:
            if isinstance(param, click.Option) and max(param.opts, key=len) in OUTPUT_OPTIONS:
                return max(param.opts, key=len), Path(failed)
    return (related[0][0], related[0][1]) if related else None


def _single_output_param() -> tuple[str, Path] | None:
    outputs = [(name, value) for name, value, output in _path_params() if output]
    return outputs[0] if len(outputs) == 1 else None


def _inputs_text() -> str:
    inputs = [str(value) for _, value, output in _path_params(files_only=True) if not output]
    if len(inputs) == 1:
        return inputs[0]
    if inputs:
        return "one of " + ", ".join(inputs)
    return "an input file"


def _internal_error(exc: BaseException) -> NoReturn:
    ctx = click.get_current_context(silent=True)
    verbose = 0
    if ctx is not None:
        verbose = int(ctx.find_root().params.get("verbose") or 0)
    if verbose >= 2:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
        hint = "please report it with the traceback above"
    else:
        # -vv is dvfs's own option, not the command's: after the command it is refused
        hint = "please report it; rerun as `dvfs -vv COMMAND ...` for the traceback"
    detail = str(exc).strip().splitlines()
    first = detail[0] if detail else ""
    if first.endswith(".") and not first.endswith(".."):
        # a sentence's own full stop before "; please report it" (a restore bug's line ends
        # "... retries from the state file.": it read "file.; please")
        first = first[:-1]
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    fail(f"internal error: {text}; {hint}", _failure_code(exc))


def _failure_code(exc: BaseException) -> int:
    """The exit code of a failure that is not a dvfs error's (an internal error, an OSError):
    1, but 4 where GPUs were left changed for root to put back (README's exit codes): a bug
    in a restore beside one NVML refused for want of root, or a fleet's failure beside GPUs
    a refused restore left changed (`needs_root`, `dvfs.cli.sweep._needs_root`); a 1 hid it."""
    return 4 if getattr(exc, "needs_root", False) is True else 1


def console(stderr: bool = False) -> Any:
    """A rich console: a terminal's own width, at least 120 columns when writing to a pipe or
    file. (A terminal narrower than 120 columns was written 120 wide too: every table line
    longer than the terminal broke in two, its borders scattered.)"""
    import shutil

    from rich.console import Console

    out = Console(stderr=stderr, highlight=False)
    if not on_terminal(out):
        out.width = max(120, shutil.get_terminal_size((120, 24)).columns)
    return out


def on_terminal(out: Any) -> bool:
    """Whether the rich console `out` writes to a terminal, as its file says: not rich's
    `is_terminal`, which FORCE_COLOR or TTY_COMPATIBLE make true of a pipe or file too (which
    drew a pipe's tables 80 columns wide, rich's guess for a terminal it cannot measure)."""
    isatty = getattr(out.file, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except ValueError:  # a closed file
        return False


def echo_json(data: Any) -> None:
    """Print strict JSON (NaN and infinities become null)."""
    from dvfs.report import json_safe

    click.echo(json.dumps(json_safe(data), indent=2, default=str, allow_nan=False))


def show_beside_lost(
    rows: Sequence[dict[str, Any]],
    lost: Sequence[GpuError],
    *,
    as_json: bool,
    show: Callable[[Sequence[dict[str, Any]]], None],
) -> None:
    """The rows of the GPUs that opened, printed by `show` or as JSON where each GPU of `lost`
    (fallen off the bus, failing NVML) has a row of its index and error, as in `gpu list
    --json`; then the lost ones named, exit 1: one such GPU hides none of the others."""
    from dvfs.backends import lost_gpus, with_lost_rows

    if as_json:
        echo_json(with_lost_rows(rows, lost))
    else:
        show(rows)
    if lost:
        raise lost_gpus(lost)


def _refuse_empty(
    path_type: click.Path,
    value: Any,
    param: click.Parameter | None,
    ctx: click.Context | None,
    instead: str,
) -> None:
    """An empty path (`-o ''`, `-o "$UNSET"`) is click's usage error before any work: pathlib
    reads '' as '.', so a command wrote into the current folder, or failed after its work
    with "cannot use ." naming another option. `instead`: what to give."""
    if isinstance(value, str | bytes) and not value:
        path_type.fail(f"the path is empty: {instead}", param, ctx)


class ExistingPath(click.Path):
    """click.Path(exists=True, ...) for a path a command reads, that says a symbolic link in a
    loop (`ln -s x x`, or one on the way to it) is that, in one usage error: click's own check
    said "Path 'x' does not exist", of a link that is there, whose advice (make the file)
    cannot be followed there, as the cube paths say it (`open_cube`); `link_loop_problem`.
    A path through a file (`afile/x`) names the file, as a campaign file's read does."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(exists=True, path_type=Path, **kwargs)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from dvfs.inputs import file_in_the_way, link_loop_problem

        path = value if isinstance(value, str | bytes | os.PathLike) else None
        loop = link_loop_problem(path) if path is not None else None
        if loop:
            self.fail(loop, param, ctx)
        try:
            if path is not None:
                os.stat(path)
        except NotADirectoryError:
            # `afile/x`: click said "Path 'afile/x' does not exist", not which part is a file
            named = Path(os.fsdecode(value))
            self.fail(
                f"{named} does not exist: {file_in_the_way(named)} is a file, not a folder; "
                "check the path",
                param,
                ctx,
            )
        except (OSError, TypeError, ValueError):
            pass  # said by click's own check
        return super().convert(value, param, ctx)


class OutputFile(click.Path):
    """An option naming the file a command writes. A path ending in '/' or '/.' (`"$DIR/."`)
    is refused (click's usage error) before any work: pathlib drops the slash and the '.', so
    the folder the user meant would silently become the file's name; one ending in '..' names
    a folder too, and an empty one the current folder. `example` is the file name the error
    suggests in it; a netCDF one (".nc") also refuses a path netCDF cannot write
    (`dvfs.outputs.netcdf_path_problem`), before the work whose result it would lose. '-',
    standard output to many tools, is refused too: it was written as a file named '-'; so is a
    relative path under a '~' no shell expanded (`unexpanded_home_problem`)."""

    def __init__(self, example: str) -> None:
        super().__init__(dir_okay=False, path_type=Path)
        self.example = example

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        _refuse_empty(self, value, param, ctx, f"give a file's path, e.g. {self.example!r}")
        text = os.fsdecode(value) if isinstance(value, str | bytes) else ""
        if text == "-":
            self.fail(
                "'-' is not read as standard output (it would be a file named '-'): give "
                "/dev/stdout for standard output, or ./- for a file of that name",
                param,
                ctx,
            )
        home_problem = unexpanded_home_problem(Path(text)) if text else None
        if home_problem is not None and not _here_explicitly(text):
            self.fail(home_problem, param, ctx)  # before the work, not when its file is written
        # Its trailing separators and '.' parts: what pathlib drops ("x/./", "x/.": "x").
        end = re.search(f"(?:[{re.escape('/' + os.sep)}]\\.?)+\\Z", text)
        if end:
            folder = text[: end.start()]
            self.fail(
                f"{text!r} ends in {text[-2:] if text.endswith('.') else '/'!r}, a folder: "
                f"give a file's path, e.g. {folder + '/' + self.example!r}",
                param,
                ctx,
            )
        if text == ".." or text.endswith(("/..", os.sep + "..")):
            # a folder's parent (`new/..` is `new`'s), which click's check passes where the
            # folder is not made yet: the work ran, then the write failed on a folder
            self.fail(
                f"{text!r} ends in '..', a folder: give a file's path, e.g. "
                f"{text + '/' + self.example!r}",
                param,
                ctx,
            )
        from dvfs.inputs import link_loop_problem

        # A link in a loop, at the file or on the way to it: refused before the work (a twin
        # fit's minute), not when its file is written ("too many levels of symbolic links").
        loop = link_loop_problem(text) if text else None
        if loop:
            self.fail(loop, param, ctx)
        path = super().convert(value, param, ctx)
        if home_problem is not None and isinstance(path, Path):  # './~/x': '~' here, as written
            path = Path.cwd() / path
        if self.example.endswith(".nc"):
            _refuse_for_netcdf(self, path, param, ctx)
        return path


def _refuse_for_netcdf(
    path_type: click.Path, path: Any, param: click.Parameter | None, ctx: click.Context | None
) -> None:
    from dvfs.outputs import netcdf_path_problem

    problem = isinstance(path, Path) and netcdf_path_problem(path, writing=True)
    if problem:
        path_type.fail(problem, param, ctx)


class OutputFolder(click.Path):
    """An option naming the folder a command writes into (or keeps its state in). An empty
    path is refused (see `_refuse_empty`), not read as the current folder. `cube`: the
    command writes its cube.nc there, so a folder netCDF cannot write in is refused too
    (`dvfs.outputs.netcdf_path_problem`), before a sweep measures for hours. '-', standard
    output to many tools, is refused as `OutputFile` refuses it: it made a folder named '-'; so
    is a relative path under a '~' no shell expanded (`unexpanded_home_problem`)."""

    def __init__(self, *, cube: bool = False) -> None:
        super().__init__(file_okay=False, path_type=Path)
        self.cube = cube

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        optional = param is not None and not param.required
        _refuse_empty(
            self,
            value,
            param,
            ctx,
            "give a folder's path ('.' for the current one)"
            + (", or leave the option out" if optional else ""),
        )
        if isinstance(value, str | bytes) and os.fsdecode(value) == "-":
            self.fail(
                "'-' is not read as standard output (it would be a folder named '-'): give "
                "./- for a folder of that name",
                param,
                ctx,
            )
        path = super().convert(value, param, ctx)
        home_problem = unexpanded_home_problem(path) if isinstance(path, Path) else None
        if home_problem is not None and not _here_explicitly(value):
            self.fail(home_problem, param, ctx)  # else a folder named '~' made here, output in it
        if home_problem is not None and isinstance(path, Path):  # './~/x': '~' here, as written
            path = Path.cwd() / path
        if self.cube and isinstance(path, Path):
            from dvfs.cube.schema import CUBE_NAME

            _refuse_for_netcdf(self, path / CUBE_NAME, param, ctx)
        return path


def campaign_argument(func: F) -> F:
    return click.argument("campaign_file", type=click.Path(dir_okay=False, path_type=Path))(func)


def out_dir_option(help_text: str) -> Callable[[F], F]:
    return click.option("-o", "--out", "out_dir", type=OutputFolder(cube=True), help=help_text)


def escape(text: str) -> str:
    """Text shown through rich, with its square brackets kept literal (not read as markup)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def restore_status(
    left: Sequence[str], state_dir: Path | None, *, why: str = "", root: bool = False
) -> str:
    """The line (markup) an interrupted command that changed GPUs ends with: restored, or the
    GPUs `left` changed with the `dvfs gpu reset` that reads their state files in `state_dir`
    (None: the default folder's, which a plain `dvfs gpu reset` reads); `why`: what their
    restores raised (markup), `root`: whether one was refused for want of root (the reset is
    to run as root)."""
    if not left:
        return "GPU settings restored."
    from dvfs.gpu.safety import reset_command

    if state_dir is None:
        reset, where = "`dvfs gpu reset`", ""
    else:
        reset, where = escape(reset_command(state_dir)), f" (state in {escape(str(state_dir))})"
    because = f"{why}; " if why else ""
    return (
        f"[red]GPU settings NOT fully restored[/red] for {', '.join(left)}: {because}run "
        f"{reset}{' as root' if root else ''}{where}."
    )


def parse_shard(value: str | None) -> Any:
    """A `--shard I/N` option's value as a `Shard` (None when not given); a bad one is click's
    usage error."""
    if value is None:
        return None
    from dvfs.fleet.shard import Shard

    try:
        return Shard.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def gpus_option(help_text: str) -> Callable[[F], F]:
    """`--gpus LIST`, as `dvfs sweep` and `dvfs doctor` take it; `sweep_groups` reads it."""
    return click.option("--gpus", "gpus_spec", metavar="LIST", help=help_text)


def sweep_groups(campaign: Any, gpus_spec: str | None) -> list[Any]:
    """The GPU groups (one worker and server each) `dvfs sweep --gpus LIST` runs `campaign`
    on: LIST parsed (`dvfs.fleet.devices.parse_gpus`) and cut into `engine.tp_size` groups,
    else the campaign's gpu.devices groups. An empty LIST is click's usage error; a bad one
    the parser's one line."""
    from dvfs.fleet.devices import parse_gpus, worker_groups

    if gpus_spec is not None and not gpus_spec.strip():
        raise click.UsageError(
            "--gpus is empty: name GPUs (e.g. --gpus 0-1), or leave out --gpus for the "
            "campaign's gpu.devices"
        )
    return worker_groups(campaign, parse_gpus(gpus_spec) if gpus_spec else None)
