"""`dvfs report`: one file a team can mail around (HTML with figures inside, or Markdown)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click

from dvfs.cli.analysis import (
    cube_argument,
    filter_options,
    headroom_target,
    headroom_target_options,
)
from dvfs.cli.common import OutputFile, handle_errors, make_parent

if TYPE_CHECKING:
    from dvfs.report.document import ReportOptions

MARKDOWN_SUFFIXES = (".md", ".markdown")


def check_output(path: Path) -> None:
    """Refuse an output path that cannot be written before the work, not after: a probe file
    is created and removed beside it (permissions alone miss read-only file systems). As root,
    a path through another user's link is refused here too (`check_links`)."""
    from dvfs.outputs import check_link_target, check_links, temp_prefix

    check_links(path)
    check_link_target(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if path.exists() and not path.is_file():
        return  # a device such as /dev/null: written in place, no folder to probe
    real = Path(os.path.realpath(path))  # a symlink's target is what gets replaced
    try:
        fd, probe = tempfile.mkstemp(
            prefix=temp_prefix(real.name), suffix=".probe", dir=real.parent
        )
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def write_atomically(path: Path, data: bytes) -> None:
    """A temp file beside `path`, renamed over it: a failed write leaves no half report. A
    failure names `path`, never the temp file; a device (/dev/null) is written, not replaced."""
    from dvfs.outputs import write_bytes

    write_bytes(path, data)


def figures_folder(output: Path) -> str:
    """The folder a Markdown page's figures go in, beside it: report.md's in report_figures/,
    a page of another name's in NAME_figures/ (report.html_figures/ for `-o report.html
    --format md`): named by the stem alone, report.md's and report.html's figures shared one
    folder, and the later page's overwrote the earlier's, which still linked to them."""
    return f"{output.stem if output.suffix == '.md' else output.name}_figures"


def check_figures_name(output: Path) -> None:
    """Refuse (`OSError` ENAMETOOLONG, as the write would fail) a Markdown page whose figures
    folder's name is longer than its file system allows (a page of 248 bytes or more before
    `.md`), before the work: the figures folder was refused only once the report was made."""
    folder = output.parent / figures_folder(output)
    try:
        limit = os.pathconf(output.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if len(os.fsencode(folder.name)) > limit:
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), str(folder))


def refuse_shared_figures(output: Path) -> None:
    """Refuse (`OutputRefusedError`) a Markdown page whose figures folder is another page's
    beside it: `r.md`'s is r_figures/, and so is `r`'s (`-o r --format md`), so the later
    page's figures replaced the earlier's, which still linked to them (and showed figures of
    another report). The other page is one that links into that folder."""
    from urllib.parse import quote

    from dvfs.errors import OutputRefusedError

    folder = figures_folder(output)
    other = output.with_suffix("") if output.suffix == ".md" else Path(f"{output}.md")
    try:
        # not waited on: a named pipe there (`r` beside `-o r.md`) hung the report for ever
        fd = os.open(other, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:  # none there (or none this user may read): nothing shares the folder
        return
    with os.fdopen(fd, "rb") as handle:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return  # a FIFO, a device, a folder: no page
            text = handle.read(1 << 24)
        except OSError:
            return
    if f"]({quote(folder)}/".encode() not in text:
        return  # not a page of figures in that folder (an HTML report, another file)
    name = f"{output.stem}-2.md" if output.suffix == ".md" else f"{output.name}-2"
    raise OutputRefusedError(
        f"the figures of {output} would go in {output.parent / folder}, where the Markdown page "
        f"{other} has its own, which they would replace: give this page another name (e.g. "
        f"{output.parent / name}), or move {other} and its figures aside"
    )


def write_markdown(output: Path, text: str, files: dict[str, bytes]) -> None:
    """A Markdown page and its figures (`files`: paths relative to the page's folder). Each
    figure is written first to a hidden file in its own folder (made where missing), the page
    next, and only then is each figure renamed to its name: a page that cannot be written (a
    full disk, an immutable file) leaves no figures' folder behind, nor any file in one, and a
    figure that cannot be written (its folder a file, or read-only, or a link to another disk)
    no page linking to it. A failure names the file the user would get."""
    from dvfs.outputs import check_links, new_file_mode, temp_prefix

    made: list[Path] = []  # folders made for the figures, removed where no page is written
    staged: list[tuple[Path, Path, Path]] = []  # (hidden file, its name, as the user sees it)
    written = False
    try:
        for name, data in files.items():
            final = output.parent / name
            check_links(final)  # as root, no figure through another user's link
            _make_folder(final.parent, made)  # a file in the way: named, as the folder
            try:
                real = Path(os.path.realpath(final))  # a linked folder: the rename within it
                if real.is_dir():
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
                mode = stat.S_IMODE(real.stat().st_mode) if real.is_file() else new_file_mode()
                fd, temp = tempfile.mkstemp(
                    prefix=temp_prefix(real.name), suffix=".tmp", dir=real.parent
                )
                staged.append((Path(temp), real, final))
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.chmod(temp, mode)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(final)) from exc
        write_atomically(output, text.encode("utf-8"))
        written = True
        for hidden, real, final in staged:
            try:
                os.replace(hidden, real)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(final)) from exc
    finally:
        for hidden, _, _ in staged:
            hidden.unlink(missing_ok=True)
        for folder in reversed(made if not written else []):
            with contextlib.suppress(OSError):
                folder.rmdir()


def _make_folder(folder: Path, made: list[Path]) -> None:
    """`folder` and any folder above it that is missing, each appended to `made` once made."""
    if folder.is_dir():
        return
    _make_folder(folder.parent, made)
    folder.mkdir()  # a file (or a dangling link) in the way: FileExistsError
    made.append(folder)


def _figures(cube: object, options: ReportOptions) -> list[tuple[str, bytes]]:
    """Every figure `dvfs plot` draws, as (name relative to its folder, PNG bytes), their
    chosen settings those of the report's headroom table (its target, knob and confidence)."""
    from dvfs.errors import DvfsError
    from dvfs.plots import plot_all

    with tempfile.TemporaryDirectory(prefix="dvfs-report-") as tmp:
        try:
            paths = plot_all(
                cube,  # type: ignore[arg-type]
                tmp,
                fmt="png",
                target=options.target,
                knob=options.knob,
                confidence=options.confidence,
                drafters=options.drafter,
            )
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # not the report's path: --output is no way round it
            raise DvfsError(
                f"cannot draw the report's figures in the temporary folder "
                f"{tempfile.gettempdir()}: "
                f"{exc.strerror}; free space there, or set TMPDIR to a folder with room"
            ) from exc
        return [(p.relative_to(tmp).as_posix(), p.read_bytes()) for p in paths]


@click.command()
@cube_argument
@click.option(
    "-o",
    "--output",
    type=OutputFile("report.html"),
    required=True,
    help="The report file (report.html, or report.md with its figures in report_figures/; "
    "a Markdown page of another name, NAME, has them in NAME_figures/).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["html", "md"]),
    help="html (one self-contained file) or md  [default: md for a .md output, else html]",
)
@headroom_target_options
@filter_options
@click.pass_context
@handle_errors
def report(
    ctx: click.Context,
    cube_path: Path,
    output: Path,
    fmt: str | None,
    preserve: bool,
    vs_baseline: bool,
    slo: str | None,
    metric: str,
    quantile: str,
    slack: float,
    baseline: str,
    knob: str,
    confidence: float,
    batch: tuple[int, ...],
    drafter: tuple[str, ...],
    corpus: tuple[str, ...],
) -> None:
    """A report of a cube to share: what was measured, the headroom for a target with its
    confidence, speculation against none, the findings with their figures, and the caps it
    recommends. The target options are `dvfs headroom`'s. CUBE_PATH is a cube file or a
    sweep folder."""
    from datetime import UTC, datetime

    from dvfs.analysis.selection import SelectionError, check_drafter, select
    from dvfs.cube import open_analysable
    from dvfs.cube.prompts import roofline_context
    from dvfs.fleet.cubes import left_out_of
    from dvfs.outputs import is_stream
    from dvfs.plots import split_parts
    from dvfs.plots.style import ALL_DRAFTERS
    from dvfs.report.document import ReportOptions, build_document
    from dvfs.report.html import render_html
    from dvfs.report.markdown import render_markdown
    from dvfs.version import __version__

    fmt = fmt or ("md" if output.suffix.lower() in MARKDOWN_SUFFIXES else "html")
    target = headroom_target(ctx, preserve, vs_baseline, slo, metric, quantile, slack, baseline)
    make_parent(output)
    check_output(output)
    stream = is_stream(output)  # a pipe, device, or /dev/stdout even redirected to a file
    if stream and fmt == "md":
        # its figures' folder would be made beside the pipe or device (/dev/stdout_figures),
        # not beside the file /dev/stdout is redirected to: its links would lead nowhere
        raise click.BadParameter(
            f"{output} is not a file: a Markdown report writes its figures to a folder beside "
            "it; give a file's path, or --format html (one file, figures embedded)",
            param_hint="'-o' / '--output'",
        )
    if fmt == "md":
        check_figures_name(output)
        refuse_shared_figures(output)
    ds = open_analysable(cube_path)
    try:
        if (
            vs_baseline
            or ctx.get_parameter_source("baseline") != click.core.ParameterSource.DEFAULT
        ):
            check_drafter(ds, baseline, "--baseline")
        known = {str(d) for d in ds["drafter"].values}
        keep = (*drafter, *([baseline] if baseline in known else [])) if drafter else ()
        shown = select(ds, batch, keep, corpus)
    except SelectionError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{exc.option}'") from exc
    # each drafter in the colour `dvfs plot` gives it, whichever drafters --drafter keeps
    shown = shown.assign_attrs({ALL_DRAFTERS: json.dumps([str(d) for d in ds["drafter"].values])})
    options = ReportOptions(target, knob, confidence, batch, drafter, corpus)
    generated = f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC by dvfs {__version__}"
    context_notes: list[str] = []  # the roofline's context, where the cube does not record it
    figures = _figures(shown, options)
    # the parts each energy-split figure draws, which its caption names (where there is one)
    drawn_parts = split_parts(shown) if any("energy_split_" in n for n, _ in figures) else {}
    document = build_document(
        ds,
        options,
        figures,
        generated=generated,
        context_tokens=roofline_context(ds, cube_path, context_notes),
        context_notes=context_notes,
        split_parts=drawn_parts,
        left_out=[str(j) for j in left_out_of(cube_path, ds)],
    )
    if fmt == "html":
        write_atomically(output, render_html(document).encode("utf-8"))
    else:
        text, files = render_markdown(document, figures_folder(output))
        write_markdown(output, text, files)
    click.echo(f"wrote {output}", err=stream)  # not after the page in the same stream
