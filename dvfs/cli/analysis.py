"""`dvfs headroom`, `dvfs compare`, `dvfs plot`: answers from a cube (no GPU needed)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from dvfs.cli.common import (
    OutputFile,
    OutputFolder,
    console,
    echo_json,
    escape,
    handle_errors,
    make_folder,
    make_parent,
    on_terminal,
    option_given,
)


def slack_value(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """--slack as a fraction; NaN, infinities, negative and unreadable values are refused."""
    from dvfs.analysis.targets import parse_slack
    from dvfs.errors import AnalysisError

    try:
        return parse_slack(value)
    except AnalysisError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from exc


def confidence_value(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not (math.isfinite(value) and 0.5 <= value < 1):
        raise click.BadParameter(
            f"{value} is not a confidence level; give a number from 0.5 up to, not including, "
            "1 (e.g. 0.95)",
            ctx=ctx,
            param=param,
        )
    return value


def confidence_option(help: str) -> Any:
    """`--confidence`: a level from 0.5 up to 1, 0.95 unless given."""
    return click.option(
        "--confidence",
        type=float,
        callback=confidence_value,
        default=0.95,
        show_default=True,
        help=help,
    )


def _stacked(func: Any, *decorators: Callable[[Any], Any]) -> Any:
    """`func` decorated as if `decorators` stood above it in this order (the last applied
    first), so a group of options reads, and lists in --help, as written."""
    for decorate in reversed(decorators):
        func = decorate(func)
    return func


#: --slack's default, one for `dvfs headroom`, `dvfs report` and `dvfs plot`: the figures a
#: plain `dvfs plot` draws mark the settings a plain `dvfs headroom` table and report choose.
DEFAULT_SLACK = "0%"


def slack_option(help: str) -> Any:
    """`--slack`: the latency increase the headroom target allows, `DEFAULT_SLACK` unless
    given; each command says in `help` what it is for."""
    return click.option(
        "--slack",
        default=DEFAULT_SLACK,
        show_default=True,
        callback=slack_value,
        help=help,
    )


def search_options(func: Any) -> Any:
    """`--knob` and `--confidence`, which settings the headroom search may choose and how sure
    it must be of their latency: one definition for `dvfs headroom`, `dvfs report` and
    `dvfs plot`, so the same words mean the same search (and default) in each."""
    return _stacked(
        func,
        click.option(
            "--knob",
            type=click.Choice(["both", "sm_clock", "power_limit"]),
            default="both",
            show_default=True,
            help="Which knobs may move.",
        ),
        confidence_option(
            "One-sided confidence of the latency bound, and two-sided of a saving's interval "
            "(with repeats)."
        ),
    )


def _one_output_format(as_json: bool, markdown: bool) -> None:
    if as_json and markdown:
        raise click.UsageError("choose one of --json and --markdown")


def cube_argument(func: Any) -> Any:
    return click.argument("cube_path", type=click.Path(path_type=Path))(func)


@contextlib.contextmanager
def _filters_checked() -> Iterator[None]:
    """A filter or --baseline value the cube lacks is that option's bad value (exit 2)."""
    from dvfs.analysis.selection import SelectionError

    try:
        yield
    except SelectionError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{exc.option}'") from exc


def latency_options(func: Any) -> Any:
    func = click.option(
        "--metric",
        type=click.Choice(["tpot", "itl", "ttft"]),
        default="tpot",
        show_default=True,
        help="Latency metric the target is about.",
    )(func)
    func = click.option(
        "--quantile",
        type=click.Choice(["p50", "p90", "p99"]),
        default="p50",
        show_default=True,
        help="Latency quantile.",
    )(func)
    return func


def headroom_target_options(func: Any) -> Any:
    """The headroom target's options, the same for `dvfs headroom` and `dvfs report`
    (`headroom_target` reads them): which latency, whose, how much slack, which knobs."""
    return _stacked(
        func,
        click.option(
            "--preserve", is_flag=True, help="Target: each drafter's own stock latency (default)."
        ),
        click.option(
            "--vs-baseline",
            is_flag=True,
            help="Target: the baseline drafter's stock latency (trade speculation's win for "
            "energy).",
        ),
        click.option(
            "--slo",
            metavar="EXPR",
            help="Target: an absolute SLO such as tpot_p90<=50ms or ttft_p99<=1s.",
        ),
        latency_options,
        slack_option("Allowed latency increase (5% or 0.05); not with --slo."),
        click.option(
            "--baseline", default="none", show_default=True, help="Drafter to compare against."
        ),
        search_options,
    )


class OneBatch(click.ParamType):
    """A batch size; a comma-separated list is refused with the way to give several."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value)
        if "," in text:
            sizes = " ".join(f"--batch {v.strip()}" for v in text.split(",") if v.strip())
            self.fail(
                f"{text!r}: one size per --batch; repeat it for several ({sizes})", param, ctx
            )
        try:
            return int(text)
        except ValueError:
            self.fail(f"{text!r} is not a valid integer", param, ctx)


def filter_options(func: Any) -> Any:
    func = click.option(
        "--batch", type=OneBatch(), multiple=True, help="Only this batch size (repeatable)."
    )(func)
    func = click.option("--drafter", multiple=True, help="Only this drafter (repeatable).")(func)
    func = click.option("--corpus", multiple=True, help="Only this corpus (repeatable).")(func)
    return func


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A rich table; into a pipe or file (not a terminal) it keeps its natural width, so no
    column is folded, cropped or dropped whatever COLUMNS says."""
    from rich.table import Table

    table = Table(show_lines=False)
    for name in header:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*row)
    out = console()
    terminal = on_terminal(out)  # (not rich's is_terminal: FORCE_COLOR makes a pipe one)
    if not terminal:
        out.width = 1_000_000  # measure without a limit, then fit the console to the table
        out.width = max(120, out.measure(table).maximum)
    out.print(f"[bold]{escape(title)}[/bold]", soft_wrap=not terminal)
    out.print(table)


def print_line(text: str, *, stderr: bool = False) -> None:
    """A line of prose: wrapped on a terminal, left whole in a pipe."""
    out = console(stderr=stderr)
    out.print(text, soft_wrap=not on_terminal(out))


def _pinning_line(ds: Any) -> None:
    """One line (stderr, so --json stays parseable) when a server's GPU pinning was unverified
    or verified by memory only: its cells were not checked for other tenants' processes."""
    from dvfs.cube.pinning import pinning_note

    note = pinning_note(ds)
    if note:
        print_line(f"[yellow]{escape(note)}[/yellow]", stderr=True)


def headroom_target(
    ctx: click.Context,
    preserve: bool,
    vs_baseline: bool,
    slo: str | None,
    metric: str,
    quantile: str,
    slack: float,
    baseline: str,
) -> Any:
    """The target the flags describe; flags that contradict each other are refused, never
    silently dropped."""
    from dataclasses import replace

    from dvfs.analysis.targets import QUANTILE_NAMES, SLACK_WITH_SLO, Target, parse_slo
    from dvfs.errors import AnalysisError

    if sum([preserve, vs_baseline, slo is not None]) > 1:
        raise click.UsageError("choose one of --preserve, --vs-baseline and --slo")
    if slo is None:
        mode = "vs-baseline" if vs_baseline else "preserve"
        return Target(mode, metric, QUANTILE_NAMES[quantile], slack, None, baseline)
    try:
        target = parse_slo(slo)
    except AnalysisError as exc:
        raise click.BadParameter(str(exc), param_hint="'--slo'") from exc
    if option_given(ctx, "slack"):
        raise click.UsageError(SLACK_WITH_SLO)
    if option_given(ctx, "metric") and metric != target.metric:
        raise click.UsageError(
            f"--metric {metric} contradicts --slo {slo!r}, which is about {target.metric}: "
            "drop --metric"
        )
    if option_given(ctx, "quantile") and QUANTILE_NAMES[quantile] != target.quantile:
        raise click.UsageError(
            f"--quantile {quantile} contradicts --slo {slo!r}, which is about "
            f"{target.quantile_name}: drop --quantile"
        )
    return replace(target, baseline=baseline)


@click.command()
@cube_argument
@headroom_target_options
@filter_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema dvfs.headroom/1).")
@click.option("--markdown", is_flag=True, help="Print a Markdown report.")
@click.option(
    "-o",
    "--output",
    type=OutputFile("headroom.json"),
    help="Also write the JSON document here (input for `dvfs cap plan`).",
)
@click.pass_context
@handle_errors
def headroom(
    ctx: click.Context,
    cube_path: Path,
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
    as_json: bool,
    markdown: bool,
    output: Path | None,
) -> None:
    """Lowest clock / power cap that keeps latency within a target, and the energy it saves.

    For every batch, drafter and corpus: the least-energy setting whose latency meets the
    target (with repeats, its upper confidence bound must) and whose saving is beyond the
    measurement noise (else stock), the headroom below stock, and the saving. CUBE_PATH is a
    cube file or a sweep folder.
    """
    import json

    from dvfs.analysis.headroom import headroom as compute
    from dvfs.analysis.selection import check_drafter, select
    from dvfs.cube import open_analysable
    from dvfs.fleet.cubes import left_out_of
    from dvfs.outputs import write_text
    from dvfs.report import (
        headroom_document,
        headroom_markdown,
        headroom_notes,
        headroom_table_rows,
        reference_text,
    )

    _one_output_format(as_json, markdown)
    target = headroom_target(ctx, preserve, vs_baseline, slo, metric, quantile, slack, baseline)
    ds = open_analysable(cube_path)
    _pinning_line(ds)
    with _filters_checked():
        if vs_baseline or option_given(ctx, "baseline"):
            check_drafter(ds, baseline, "--baseline")
        select(ds, batch, drafter, corpus)  # refuse unknown filter values before computing
    result = select(
        compute(ds, target=target, knob=knob, confidence=confidence), batch, drafter, corpus
    )
    doc = headroom_document(result, ds)
    left_out = left_out_of(cube_path, ds)  # a GPU model the folder's cube leaves out, as cube info
    if left_out:
        doc["left_out"] = [str(j) for j in left_out]
    if output is not None:
        # A file system fault reaches handle_errors, which names the path and the option.
        # Replaced atomically: a failed write leaves the previous file whole. Its folder
        # made where missing, as `dvfs report -o` makes it.
        make_parent(output)
        write_text(output, json.dumps(doc, indent=2) + "\n")
    if as_json:
        echo_json(doc)
    elif markdown:
        click.echo(headroom_markdown(doc))
    else:
        header, rows = headroom_table_rows(doc)
        ref = doc["reference"]
        print_table(f"DVFS headroom - {doc['target']['description']}", header, rows)
        print_line(
            f"reference: {escape(reference_text(ref))}; knob: {doc['knob']}; "
            f"feasibility: {escape(doc['bound'])}; saving: against the drafter's own energy "
            "at the reference"
        )
        for note in headroom_notes(doc):
            print_line(escape(note))
        if output is not None:
            print_line(f"wrote {escape(str(output))}")


@click.command()
@cube_argument
@click.option("--baseline", default="none", show_default=True, help="Drafter to compare against.")
@latency_options
@confidence_option(
    "Confidence of the energy-ratio interval (two-sided) and of the latency bound "
    "(one-sided), with repeats."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema dvfs.compare/4).")
@click.option("--markdown", is_flag=True, help="Print a Markdown report.")
@click.option(
    "--roofline",
    "roofline_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A `dvfs gpu roofline` file: use its measured ridge point instead of the twin's.",
)
@filter_options
@handle_errors
def compare(
    cube_path: Path,
    baseline: str,
    metric: str,
    quantile: str,
    confidence: float,
    as_json: bool,
    markdown: bool,
    batch: tuple[int, ...],
    drafter: tuple[str, ...],
    corpus: tuple[str, ...],
    roofline_path: Path | None,
) -> None:
    """Speculation against no speculation: energy at equal clock and equal latency, the batch
    where each drafter stops saving, acceptance, and where verification turns compute-bound."""
    from dvfs.analysis.compare import compare as compute
    from dvfs.analysis.roofline import rooflines
    from dvfs.analysis.selection import check_drafter, select
    from dvfs.analysis.targets import QUANTILE_NAMES
    from dvfs.cube import open_analysable
    from dvfs.cube.prompts import roofline_context
    from dvfs.errors import AnalysisError
    from dvfs.fleet.cubes import left_out_of
    from dvfs.report import compare_document, compare_markdown, compare_notes, compare_tables
    from dvfs.report.facts import ecc_mode_warnings
    from dvfs.report.headroom import left_out_note

    _one_output_format(as_json, markdown)
    measured = None
    if roofline_path is not None:
        from dvfs.roofline.store import read as read_roofline

        measured = read_roofline(roofline_path)
    ds = open_analysable(cube_path)
    _pinning_line(ds)
    if measured is not None:
        from dvfs.analysis.roofline import check_measured

        check_measured(measured, ds)
    with _filters_checked():
        check_drafter(ds, baseline, "--baseline")
        select(ds, batch, drafter, corpus)  # refuse unknown filter values before computing
    if drafter and set(drafter) <= {baseline}:
        raise click.UsageError(
            f"--drafter names only the baseline {baseline!r}: nothing to compare it with; "
            "name a speculative drafter too, or drop --drafter"
        )
    result = compute(
        ds,
        baseline=baseline,
        metric=metric,
        quantile=QUANTILE_NAMES[quantile],
        confidence=confidence,
    )
    if drafter and baseline not in drafter:
        drafter = (*drafter, baseline)
    result = select(result, batch, drafter, corpus)
    notes: list[str] = []  # a merged cube's GPU models with no roofline, each said
    models: list[str] = []  # those models
    try:
        said: list[str] = []  # of the roofline's context, said where there is a roofline
        context = roofline_context(ds, cube_path, said)
        roof = [
            select(r, batch, drafter)
            for r in rooflines(
                ds, measured=measured, notes=notes, left_out=models, context_tokens=context
            )
        ]
        notes[:0] = said
    except AnalysisError as exc:
        notes.insert(0, f"no roofline: {exc}")
        roof = None
    left_out = left_out_of(cube_path, ds)  # a GPU model the folder's cube leaves out, as cube info
    notes[:0] = [left_out_note(journal) for journal in left_out]
    # a merged cube's GPUs of one model whose ECC modes differ, as the report warns
    notes[:0] = ecc_mode_warnings(dict(ds.attrs))
    for note in notes:
        print_line(f"[yellow]{escape(note)}[/yellow]", stderr=True)
    doc = compare_document(result, roof, ds, roofline_left_out=models)
    if left_out:  # as headroom's --json: present only where a model is left out
        doc["left_out"] = [str(journal) for journal in left_out]
    if as_json:
        echo_json(doc)
    elif markdown:
        click.echo(compare_markdown(doc, notes))
    else:
        for title, header, rows in compare_tables(doc):
            print_table(title, header, rows)
        for note in compare_notes(doc):
            print_line(escape(note))


@click.command()
@cube_argument
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=OutputFolder(),
    default=Path("plots"),
    show_default=True,
    help="Folder for the figures.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["png", "pdf", "svg"]),
    default="png",
    show_default=True,
    help="The figures' file format.",
)
@latency_options
@slack_option(
    "Latency slack for the headroom points marked on the figures (5% or 0.05), as "
    "`dvfs headroom --slack` takes it."
)
@search_options
@handle_errors
def plot(
    cube_path: Path,
    out_dir: Path,
    fmt: str,
    metric: str,
    quantile: str,
    slack: float,
    knob: str,
    confidence: float,
) -> None:
    """Draw the figures: energy vs clock (a grid of one clock: energy and latency vs power
    limit), energy-latency Pareto fronts with the headroom points, acceptance and headroom
    heatmaps, power/clock timelines. The headroom points are the settings `dvfs headroom`
    chooses for the same --slack, --quantile, --metric, --knob and --confidence, whose defaults
    are its own."""
    from dvfs.analysis.targets import QUANTILE_NAMES, Target
    from dvfs.cube import open_analysable
    from dvfs.fleet.cubes import left_out_of
    from dvfs.plots import plot_all
    from dvfs.report.headroom import left_out_note

    ds = open_analysable(cube_path)
    target = Target("preserve", metric, QUANTILE_NAMES[quantile], slack)
    make_folder(out_dir)  # removed again if no figure is written there (a full disk)
    paths = plot_all(ds, out_dir, fmt=fmt, target=target, knob=knob, confidence=confidence)
    for journal in left_out_of(cube_path, ds):  # else the figures read as the whole campaign
        print_line(f"[yellow]{escape(left_out_note(journal))}[/yellow]", stderr=True)
    for path in paths:
        click.echo(str(path))
