"""`dvfs headroom`, `dvfs compare`, `dvfs plot`: answers from a cube (no GPU needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dvfs.cli.common import console, echo_json, escape, handle_errors


def cube_argument(func: Any) -> Any:
    return click.argument("cube_path", type=click.Path(path_type=Path))(func)


def _open(cube_path: Path) -> Any:
    from dvfs.cube import CUBE_NAME, open_cube

    return open_cube(cube_path / CUBE_NAME if cube_path.is_dir() else cube_path)


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


def _select(
    ds: Any, batch: tuple[int, ...], drafter: tuple[str, ...], corpus: tuple[str, ...]
) -> Any:
    from dvfs.errors import AnalysisError

    sel: dict[str, list[Any]] = {}
    for dim, values in (
        ("batch", list(batch)),
        ("drafter", list(drafter)),
        ("corpus", list(corpus)),
    ):
        if values:
            known = [v.item() if hasattr(v, "item") else v for v in ds[dim].values]
            missing = [v for v in values if v not in known]
            if missing:
                raise AnalysisError(f"{dim} {missing} not in the cube; it has {known}")
            sel[dim] = values
    return ds.sel(sel) if sel else ds


def filter_options(func: Any) -> Any:
    func = click.option("--batch", type=int, multiple=True, help="Only these batch sizes.")(func)
    func = click.option("--drafter", multiple=True, help="Only these drafters.")(func)
    func = click.option("--corpus", multiple=True, help="Only these corpora.")(func)
    return func


def _print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    from rich.table import Table

    console().print(f"[bold]{escape(title)}[/bold]")
    table = Table(show_lines=False)
    for name in header:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console().print(table)


def headroom_target(
    preserve: bool,
    vs_baseline: bool,
    slo: str | None,
    metric: str,
    quantile: str,
    slack: str,
    baseline: str,
) -> Any:
    from dvfs.analysis.targets import QUANTILE_NAMES, Target, parse_slack, parse_slo

    if sum([preserve, vs_baseline, slo is not None]) > 1:
        raise click.UsageError("choose one of --preserve, --vs-baseline and --slo")
    if slo is not None:
        return parse_slo(slo)
    mode = "vs-baseline" if vs_baseline else "preserve"
    return Target(mode, metric, QUANTILE_NAMES[quantile], parse_slack(slack), None, baseline)


@click.command()
@cube_argument
@click.option(
    "--preserve", is_flag=True, help="Target: each drafter's own stock latency (default)."
)
@click.option(
    "--vs-baseline",
    is_flag=True,
    help="Target: the baseline drafter's stock latency (trade speculation's win for energy).",
)
@click.option(
    "--slo", metavar="EXPR", help="Target: an absolute SLO such as tpot_p90<=50ms or ttft_p99<=1s."
)
@latency_options
@click.option(
    "--slack", default="0%", show_default=True, help="Allowed latency increase (5% or 0.05)."
)
@click.option("--baseline", default="none", show_default=True, help="Drafter to compare against.")
@click.option(
    "--knob",
    type=click.Choice(["both", "sm_clock", "power_limit"]),
    default="both",
    show_default=True,
    help="Which knobs may move.",
)
@click.option(
    "--confidence",
    type=float,
    default=0.95,
    show_default=True,
    help="One-sided confidence of the latency bound (with repeats).",
)
@filter_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema dvfs.headroom/1).")
@click.option("--markdown", is_flag=True, help="Print a Markdown report.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the JSON document here (input for `dvfs cap plan`).",
)
@handle_errors
def headroom(
    cube_path: Path,
    preserve: bool,
    vs_baseline: bool,
    slo: str | None,
    metric: str,
    quantile: str,
    slack: str,
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
    target (with repeats, its upper confidence bound must), the headroom below stock, and the
    saving. CUBE_PATH is a cube file or a sweep folder.
    """
    import json

    from dvfs.analysis.headroom import headroom as compute
    from dvfs.report import headroom_document, headroom_markdown, headroom_table_rows

    target = headroom_target(preserve, vs_baseline, slo, metric, quantile, slack, baseline)
    ds = _open(cube_path)
    result = compute(ds, target=target, knob=knob, confidence=confidence)
    result = _select(result, batch, drafter, corpus)
    doc = headroom_document(result, ds)
    if output is not None:
        output.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    if as_json:
        echo_json(doc)
    elif markdown:
        click.echo(headroom_markdown(doc))
    else:
        header, rows = headroom_table_rows(doc)
        ref = doc["reference"]
        _print_table(f"DVFS headroom - {doc['target']['description']}", header, rows)
        out = console()
        out.print(
            f"reference: {ref['sm_clock_mhz']} MHz / {ref['power_limit_w']:g} W"
            + ("" if ref["is_stock"] else " (not the stock setting: top of the grid)")
            + f"; knob: {doc['knob']}; feasibility: {doc['bound']}"
        )
        if output is not None:
            out.print(f"wrote {output}")


@click.command()
@cube_argument
@click.option("--baseline", default="none", show_default=True, help="Drafter to compare against.")
@latency_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (schema dvfs.compare/1).")
@click.option("--markdown", is_flag=True, help="Print a Markdown report.")
@filter_options
@handle_errors
def compare(
    cube_path: Path,
    baseline: str,
    metric: str,
    quantile: str,
    as_json: bool,
    markdown: bool,
    batch: tuple[int, ...],
    drafter: tuple[str, ...],
    corpus: tuple[str, ...],
) -> None:
    """Speculation against no speculation: energy at equal clock and equal latency, the batch
    where each drafter stops saving, acceptance, and where verification turns compute-bound."""
    from dvfs.analysis.compare import compare as compute
    from dvfs.analysis.roofline import roofline
    from dvfs.analysis.targets import QUANTILE_NAMES
    from dvfs.errors import AnalysisError
    from dvfs.report import compare_document, compare_markdown, compare_tables

    ds = _open(cube_path)
    result = compute(ds, baseline=baseline, metric=metric, quantile=QUANTILE_NAMES[quantile])
    if drafter and baseline not in drafter:
        drafter = (*drafter, baseline)
    result = _select(result, batch, drafter, corpus)
    try:
        roof = _select(roofline(ds), batch, drafter, ())
    except AnalysisError as exc:
        console(stderr=True).print(f"[yellow]no roofline: {escape(str(exc))}[/yellow]")
        roof = None
    doc = compare_document(result, roof, ds)
    if as_json:
        echo_json(doc)
    elif markdown:
        click.echo(compare_markdown(doc))
    else:
        for title, header, rows in compare_tables(doc):
            _print_table(title, header, rows)


@click.command()
@cube_argument
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("plots"),
    show_default=True,
    help="Folder for the figures.",
)
@click.option(
    "--format", "fmt", type=click.Choice(["png", "pdf", "svg"]), default="png", show_default=True
)
@latency_options
@click.option(
    "--slack",
    default="5%",
    show_default=True,
    help="Latency slack for the headroom points marked on the figures.",
)
@handle_errors
def plot(cube_path: Path, out_dir: Path, fmt: str, metric: str, quantile: str, slack: str) -> None:
    """Draw the figures: energy vs clock, energy-latency Pareto fronts with the headroom
    points, acceptance and headroom heatmaps, power/clock timelines."""
    from dvfs.analysis.targets import QUANTILE_NAMES, Target, parse_slack
    from dvfs.plots import plot_all

    ds = _open(cube_path)
    target = Target("preserve", metric, QUANTILE_NAMES[quantile], parse_slack(slack))
    paths = plot_all(ds, out_dir, fmt=fmt, target=target)
    for path in paths:
        click.echo(str(path))
