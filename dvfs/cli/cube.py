"""`dvfs cube`: rebuild a cube from its journal, and summarise a cube."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click

from dvfs.cli.common import (
    OutputFile,
    OutputWriteError,
    console,
    echo_json,
    escape,
    handle_errors,
)


@click.group()
def cube() -> None:
    """Build, inspect and merge cubes."""


@cube.command("build")
@click.argument("sweep_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "-o",
    "--out",
    "out_path",
    type=OutputFile("cube.nc"),
    help="Where to write the cube [default: SWEEP_DIR/cube.nc].",
)
@handle_errors
def build(sweep_dir: Path, out_path: Path | None) -> None:
    """Rebuild SWEEP_DIR's cube from its journal (safe to run while a sweep is going).

    For a fleet that mixed GPU models (a journal in each SWEEP_DIR/gpu-*/), each model's cube
    beside its journal, and the merged one (at --out).
    """
    from dvfs.errors import DvfsError
    from dvfs.measure.journal import fresh_is_the_sweeps

    try:
        _build(sweep_dir, out_path)
    except DvfsError as exc:
        # A refusal whose advice is the sweep's --fresh ("rerun with --fresh"): `cube build`
        # has none, so the sweep's command is named (added here, it is refused).
        text = fresh_is_the_sweeps(str(exc), sweep_dir)
        if text == str(exc):
            raise
        exc.args = (text,)
        raise


def _build(sweep_dir: Path, out_path: Path | None) -> None:
    """`dvfs cube build`'s work: the cube (or a fleet's cubes) from SWEEP_DIR's journals."""
    from dvfs.cube import CUBE_NAME
    from dvfs.errors import CubeError
    from dvfs.fleet.cubes import (
        cube_journals,
        model_marked,
        unmeasured_journals,
        write_cubes,
    )
    from dvfs.fleet.shard_journal import shard_cube
    from dvfs.inputs import link_loop_problem
    from dvfs.measure.journal import JOURNAL_NAME
    from dvfs.outputs import check_link_target, is_stream
    from dvfs.report.headroom import holds_no_session

    # the folder a link in a loop: "no journal at ..." said nothing of the link that is there
    loop = link_loop_problem(sweep_dir, "folder")
    if loop:
        raise CubeError(f"sweep folder: {loop}")
    check_link_target(out_path or sweep_dir / CUBE_NAME)  # before the journals are read
    # into a pipe (`-o /dev/stdout | ...`) the cube alone: its line after it would be in it
    err = out_path is not None and is_stream(out_path)
    journals = cube_journals(sweep_dir)
    unmeasured = unmeasured_journals(sweep_dir)
    if not journals and unmeasured:
        raise CubeError(
            f"{', '.join(map(holds_no_session, unmeasured))}: nothing measured yet, nothing "
            "to put in a cube; run its `dvfs sweep` command to measure it"
        )
    if not journals:
        raise CubeError(
            f"no journal at {sweep_dir / JOURNAL_NAME}, nor a GPU model's of a fleet at "
            f"{sweep_dir / 'gpu-*' / JOURNAL_NAME}: is {sweep_dir} the --out folder of a "
            "`dvfs sweep`?"
        )
    if journals == [sweep_dir / JOURNAL_NAME]:
        # marked with the shard the journal holds, if any, as the sweep's own cube is; a
        # fleet's GPU model's folder (`gpu-<model>/`) as that model's, as the fleet marks it
        cube = model_marked(shard_cube(journals[0]), journals[0])
        path = _write(cube, out_path or sweep_dir / CUBE_NAME)
        click.echo(f"cube: {path}", err=err)
        return
    for journal in unmeasured:
        # left out of the cube: said, or a model the fleet never measured went unnoticed
        click.echo(
            f"{holds_no_session(journal)} (nothing measured on that GPU model): left out "
            "of the cube",
            err=True,
        )
    merged = out_path or sweep_dir / CUBE_NAME

    def write(ds: Any, path: Path) -> Path:
        if path == merged:
            return _write(ds, path)
        try:
            return _write(ds, path)
        except OSError as exc:  # a model's cube, beside its journal: --out is no way round
            raise CubeError(_model_cube_unwritable(exc, path, sweep_dir)) from exc

    path = write_cubes(sweep_dir, journals, merged_path=out_path, write=write)
    parts = ", ".join(str(j.parent / CUBE_NAME) for j in journals)
    click.echo(
        f"cube: {path} (merged from {parts})" if len(journals) > 1 else f"cube: {path}", err=err
    )


@cube.command("info")
@click.argument("cube_path", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def info(cube_path: Path, as_json: bool) -> None:
    """Summarise a cube: dimensions, coverage, quality and provenance.

    CUBE_PATH may be a cube file or a sweep folder holding cube.nc.
    """
    from dvfs.cube import CUBE_NAME, info_text, open_cube
    from dvfs.fleet.cubes import left_out_of

    if cube_path.is_dir():
        cube_path = cube_path / CUBE_NAME
    ds = open_cube(cube_path)
    summary = info_text(ds)
    # A sweep folder's cube that leaves out a GPU model which measured nothing yet (a fleet
    # mixing models, that model's worker lost or stopped before its first cell): said, as
    # `dvfs cube build` says it, or the cube reads as the whole campaign.
    summary["left_out"] = [str(j) for j in left_out_of(cube_path, ds)]
    if as_json:
        echo_json(summary)
        return
    _render(summary)


def _render(summary: dict[str, Any]) -> None:
    from rich.table import Table

    from dvfs.cube.cells_left import shard_note
    from dvfs.cube.idle import idle_caveat, idle_power_text
    from dvfs.cube.info import (
        failed_cell_label,
        invariant_rows,
        mode_text,
        precision_text,
        sessions_text,
    )
    from dvfs.cube.quality import invalidates
    from dvfs.report.headroom import left_out_note

    out = console()
    campaign = (
        "(campaign name not recorded)" if summary["campaign"] is None else summary["campaign"]
    )
    out.print(
        f"[bold]{escape(str(campaign))}[/bold] (cube schema {summary['schema']}, "
        f"created {_recorded(summary['created'])})"
    )
    table = Table(show_header=False, box=None)
    for row in ("GPU", "driver", "engine", "model"):
        table.add_row(row, _recorded(summary[row.lower()]))
    table.add_row("sessions", escape(sessions_text(summary["sessions"], summary["gpu_uuids"])))
    table.add_row("reference", str(summary["stock"]))
    table.add_row(
        "idle power",
        escape(idle_power_text(summary))
        or "-" + escape(idle_caveat(summary["idle_foreign_processes"])),
    )
    for dim, size in summary["dims"].items():
        values = [str(v) for v in summary["coords"][dim]]
        shown = ", ".join(values) if len(values) <= 8 else f"{values[0]} ... {values[-1]}"
        # A knob the campaign never set: the stock its cells are filed under, not a setting.
        table.add_row(dim, f"{size}: {escape(summary['knobs_not_set'].get(dim, shown))}")
    lo, hi = summary["energy_per_token_j"]
    table.add_row(
        "cells",
        f"{summary['cells']} = {summary['measured']} measured + "
        f"{summary['failed']} failed + {summary['missing']} missing"
        + (
            f" + {summary['not_needed']} adaptive repeat(s) not needed"
            if summary["not_needed"]
            else ""
        )
        + f" ({summary['invalid']} measured but invalid)",
    )
    table.add_row("precision", escape(precision_text(summary["precision_missed"])))
    if summary["shard"] is not None:
        table.add_row("shard", escape(str(shard_note(summary["shard"], summary))))
    if summary["resume"] is not None:
        table.add_row("resume", escape(summary["resume"]))
    if str(summary["measurement_mode"]).startswith("in-flight"):
        table.add_row("mode", escape(str(mode_text(summary["measurement_mode"]))))
    if summary["repeats"] != str(summary["dims"].get("repeat", 1)):
        table.add_row("repeats", summary["repeats"])
    for drafter, outcome in summary["gpu_pinning"].items():
        table.add_row(f"GPU pinning ({drafter})", escape(outcome))
    for row, text in invariant_rows(summary["invariants"]):
        table.add_row(row, escape(text))
    table.add_row(
        "energy/token",
        "no valid cell" if math.isnan(lo) else f"{lo:.4g} - {hi:.4g} J (valid cells)",
    )
    out.print(table)
    for journal in summary["left_out"]:  # a line of its own: a long path is never cut short
        out.print(escape(left_out_note(journal)), soft_wrap=True, highlight=False)
    flags = summary["quality_flags"]
    if flags:
        out.print(
            "quality flags: "
            + ", ".join(
                f"{k} x{v}" + (" (invalid)" if invalidates(k) else "") for k, v in flags.items()
            )
            + (
                "; (invalid): the cells are never chosen by an analysis, the others are warnings"
                if any(invalidates(k) for k in flags)
                else " (warnings: the cells stay valid)"
            )
        )
    for name, note in summary["flag_notes"].items():
        out.print(f"{name}: {escape(note)}")
    failed = summary["failed_cells"]
    for item in failed[:5]:
        out.print(
            f"[yellow]failed[/yellow] {escape(failed_cell_label(item['cell'], item.get('gpu')))}: "
            f"{escape(item['error'])}"
        )
    # the cube's failed cells, not its list of them, which keeps the first FAILED_CELLS_CAP
    more = max(int(summary["failed"]), len(failed)) - len(failed[:5])
    if more > 0:
        out.print(f"... and {more} more failed cells")


def _recorded(value: Any) -> str:
    """A cube attribute as `cube info` shows it: "not recorded" where the cube has none (a
    hand-built cube), never the text "None"."""
    return "not recorded" if value is None else escape(str(value))


@cube.command("merge")
@click.argument("cubes", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "-o",
    "--out",
    "out_path",
    type=OutputFile("cube.nc"),
    required=True,
    help="Where to write the merged cube.",
)
@handle_errors
def merge(cubes: tuple[Path, ...], out_path: Path) -> None:
    """Merge cubes measured on different GPUs into one with a `gpu` dimension, or the shards
    of one run (`dvfs sweep --shard I/N`) into its whole cube.

    CUBES are cube files, sweep folders, or shard journals (journal.jsonl). Refuses cubes of
    different models, engines, tensor-parallel sizes or measurement methods; shards of
    different campaigns, counts or GPU models, a shard given twice or missing, and cells
    measured twice.
    """
    import json

    from dvfs.cube import CUBE_NAME, merge_cubes
    from dvfs.cube.cells_left import MERGED_CUBES_ATTR, merged_cubes, merged_shards
    from dvfs.fleet.shard import cube_shard
    from dvfs.measure.journal import JOURNAL_NAME
    from dvfs.outputs import check_link_target, is_stream

    check_link_target(out_path)  # before the cubes are read
    loaded = [_load_for_merge(p) for p in cubes]
    if len(loaded) == 1:
        # One cube is all the shards only of a run of one shard (`--shard 0/1`: an array of
        # one task), whose merge is its whole cube.
        try:
            alone = cube_shard(loaded[0][0])
        except ValueError:
            alone = None
        if alone is None or alone.count != 1:
            raise click.UsageError(
                "merging needs at least two cubes, or all the shards of a run; got one cube"
                + ("" if alone is None else f" holding shard {alone.index}/{alone.count}")
            )
    waiting = _shard_model_not_begun(loaded)
    if waiting:
        from dvfs.errors import MergeRefusedError

        raise MergeRefusedError(waiting)
    merged = merge_cubes([ds for ds, _ in loaded], [name for _, name in loaded])
    if "combined_from" not in merged.attrs:
        # Cubes swept apart: resuming one rebuilds its own cube, not this one, so the advice
        # on cells not measured yet says to merge again too (`resume_advice`).
        # Every cube that went in, flattened: a cube `dvfs cube merge` made (a run's shards,
        # merged) stands for the cubes it was merged from, which are what a resume reruns.
        went_in: dict[str, None] = {}
        for ds, name in loaded:
            parts = merged_cubes(ds) or list(merged_shards(ds)) or [name]
            for part in parts:
                went_in[part.removesuffix(f"/{CUBE_NAME}").removesuffix(f"/{JOURNAL_NAME}")] = None
        merged.attrs[MERGED_CUBES_ATTR] = json.dumps(list(went_in))
    parts = [f"{len(cubes)} shards"] if "combined_from" in merged.attrs else []
    if "gpu" in merged.dims:  # GPUs merged, or shards each run on a fleet mixing models
        parts.append(f"{merged.sizes['gpu']} GPUs")
    # into a pipe (`-o /dev/stdout | ...`) the cube alone: its line after it would be in it
    click.echo(f"cube: {_write(merged, out_path)} ({', '.join(parts)})", err=is_stream(out_path))
    note = unfinished_note(merged, shards="combined_from" in merged.attrs)
    if note:
        console(stderr=True).print(f"[yellow]Note: {escape(note)}[/yellow]")


def unfinished_note(merged: Any, *, shards: bool) -> str | None:
    """One line when the merged cube has cells not measured yet (an interrupted shard or
    sweep, or failed cells): its answers may change, and resuming the parts measures them."""
    from dvfs.analysis.headroom import coverage

    cov = coverage(merged)
    waiting = cov["missing"] + cov["failed"]
    if not waiting:
        return None
    from dvfs.cube.cells_left import models_left, models_left_advice, unfit_advice, unfit_left

    parts = "shards" if shards else "cubes' sweeps"
    command = "its `dvfs sweep --shard I/N` command" if shards else "its `dvfs sweep` command"
    # shards of a fleet mixing GPU models whose cells left are on some models only: their
    # commands again on the others' GPUs (after a rerun on those) measure none of them
    gpus = models_left_advice(models_left(merged)) if shards else ""
    said = (
        f"{waiting} of {cov['cells']} cells are not measured yet ({cov['missing']} never run, "
        f"{cov['failed']} failed)"
    )
    resume = (
        f"the {parts} are unfinished; resume each with {command} again without --fresh (which "
        f"starts over){gpus}, then merge again"
    )
    # failed cells SGLang would not start the server of: the same commands fail them again
    unfit = unfit_left(merged)
    if not unfit:
        return f"{said}: {resume}"
    # ends with merging again; every shard (or sweep) swept again, as a changed campaign is
    change = unfit_advice({**unfit, ("merged_shards" if shards else "merged_cubes"): [parts]})
    others = int(unfit["unfit"]["others"])
    return f"{said}: {change}" + (
        f"; for the other {others} cell(s) left: {resume}" if others else ""
    )


def _write(ds: Any, path: Path) -> Path:
    """`write_cube`, with a file-system fault handed to the CLI's one-line form (the path and
    the option to change, as every command's output says); a file where a folder of the path
    should be is that, not "file exists"."""
    import errno
    import os

    from dvfs.cube import write_cube
    from dvfs.errors import CubeError

    try:
        return write_cube(ds, path)
    except CubeError as exc:
        cause = exc.__cause__
        if not isinstance(cause, OSError) or cause.errno is None:
            raise
        code = cause.errno
        if code == errno.EEXIST and any(p.exists() and not p.is_dir() for p in path.parents):
            code = errno.ENOTDIR
        raise OutputWriteError(code, os.strerror(code), str(path)) from exc


def _model_cube_unwritable(exc: OSError, path: Path, sweep_dir: Path) -> str:
    """The line for a fleet GPU model's cube that cannot be written beside its journal (a
    read-only, full or unwritable sweep folder): the cube goes there whatever --out names, so
    "choose another --out", the advice of the merged cube's, would not get round it. A folder
    in the cube's place, or a link there to nowhere, is moved aside or mended: a copy of the
    sweep folder would hold it too."""
    import errno
    import os

    from dvfs.cli.common import os_error_words

    head = (
        f"cannot write {path}: {os_error_words(exc)}; each GPU model's cube of a fleet is "
        "written beside its journal, whatever --out names: "
    )
    if exc.errno == errno.EISDIR:
        return head + "move that folder aside and run again"
    if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
        return head + (
            f"it is a symbolic link to {os.readlink(path)}, which cannot be written through: "
            "remove the link and run again"
        )
    return head + (
        f"make room or write access in {path.parent}, or copy {sweep_dir} to a folder that "
        "can be written and build the cube there"
    )


def _shard_model_not_begun(loaded: list[tuple[Any, str]]) -> str | None:
    """The line refusing to merge shards of a fleet mixing GPU models one of which measured
    nothing yet on a model the others measured on (its journal there holds no session, so its
    folder's cube is of the other models alone), which the merge would refuse as shards run
    on different GPU models: that shard is to be resumed, then merged again. None where none
    is."""
    import json

    from dvfs.cube import CUBE_NAME
    from dvfs.fleet.cubes import unmeasured_journals
    from dvfs.fleet.folders import model_folder
    from dvfs.fleet.shard import cube_shard
    from dvfs.measure.journal import JOURNAL_NAME
    from dvfs.report.headroom import holds_no_session

    def models(ds: Any) -> list[str]:
        if "gpu" not in ds.dims:
            return [str(ds.attrs.get("gpu_name"))]
        try:
            return [str(m) for m in json.loads(str(ds.attrs.get("gpu_names", "")))]
        except (TypeError, ValueError):
            return []

    for ds, name in loaded:
        try:
            shard = cube_shard(ds)
        except ValueError:
            return None  # the merge says what is wrong with the mark
        if shard is None:
            return None
        path = Path(name)
        folder = path.parent if path.name in (CUBE_NAME, JOURNAL_NAME) else path
        others = {m for other, _ in loaded if other is not ds for m in models(other)}
        for journal in unmeasured_journals(folder):
            model = next(
                (m for m in sorted(others) if model_folder(m) == journal.parent.name), None
            )
            if model is not None and model not in models(ds):
                return (
                    f"cannot merge yet: shard {shard.label} ({folder}) has measured nothing on "
                    f"{model}, which the other shards measured on ({holds_no_session(journal)}"
                    ", so its cube leaves that model out): resume it with its `dvfs sweep "
                    f"CAMPAIGN --shard {shard.label} --out {folder}` command again without "
                    "--fresh, on GPUs of every model, then merge again"
                )
    return None


def _load_for_merge(path: Path) -> tuple[Any, str]:
    """A cube to merge: a shard's from its journal (the journal names the shard; a fleet's GPU
    model's, in its `gpu-<model>/` folder, marked as that model's, as its cube file is), else
    the cube file (a folder's cube.nc)."""
    from dvfs.cube import CUBE_NAME, open_cube
    from dvfs.fleet.cubes import model_marked
    from dvfs.fleet.shard_journal import recorded_shard, shard_cube
    from dvfs.measure.journal import JOURNAL_NAME

    journal = path / JOURNAL_NAME if path.is_dir() else path
    is_journal = journal.suffix == ".jsonl" and journal.is_file()
    if is_journal and (not path.is_dir() or recorded_shard(journal) is not None):
        return model_marked(shard_cube(journal), journal), str(journal)
    cube_path = path / CUBE_NAME if path.is_dir() else path
    return open_cube(cube_path), str(cube_path)
