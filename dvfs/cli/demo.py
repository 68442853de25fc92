"""`dvfs demo`: the whole pipeline on the embedded demo campaign (the twin), in about a minute."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from dvfs.cli.common import OutputFolder, console, handle_errors


@click.command()
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=OutputFolder(cube=True),
    default=Path("out/demo"),
    show_default=True,
    help="Folder for the journal, cube and figures.",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Move an existing journal (and cube) in OUT aside and start over, as `dvfs sweep "
    "--fresh` does.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@handle_errors
def demo(out_dir: Path, fresh: bool, no_progress: bool) -> None:
    """Sweep the demo campaign on the digital twin (H100 SXM, Llama-3.1-8B, five drafters, five
    corpora), then print two headroom tables (latency-preserving, and speculation's latency
    win traded for energy) and write the figures to OUT/plots."""
    from importlib import resources

    from rich.markup import escape

    from dvfs.analysis.headroom import headroom
    from dvfs.analysis.targets import Target
    from dvfs.campaign import load_campaign
    from dvfs.cli.analysis import print_line, print_table
    from dvfs.cli.sweep import run
    from dvfs.cube import CUBE_NAME, open_cube
    from dvfs.errors import JournalError
    from dvfs.measure.journal import FRESH
    from dvfs.plots import plot_all
    from dvfs.report import headroom_document, headroom_notes, headroom_table_rows

    _refuse_a_device_cube(out_dir / CUBE_NAME, fresh=fresh)
    with resources.as_file(resources.files("dvfs.campaigns").joinpath("demo.toml")) as path:
        campaign = load_campaign(path)
    try:
        outcome = run(campaign, out_dir, fresh=fresh, progress=not no_progress)
    except JournalError as exc:
        # A damaged journal's refusal says to start over with the sweep's command, which the
        # demo's user never typed (no campaign file of theirs, nor that --out): the demo's own.
        text = str(exc)
        if FRESH not in text:
            raise
        again = f"`dvfs demo --out {shlex.quote(str(out_dir))} --fresh`"
        raise type(exc)(text.replace(FRESH, again)) from exc
    ds = open_cube(out_dir / CUBE_NAME)
    out = console()
    own = f"`dvfs demo --out {shlex.quote(str(out_dir))}`"
    for title, target, corpus in (
        (
            "Latency-preserving headroom (each drafter's own TPOT p50 + 5%), corpus code",
            Target("preserve", slack=0.05),
            "code",
        ),
        (
            "Trading speculation's latency win for energy (TPOT p50 <= no speculation at stock), "
            "corpus conversation",
            Target("vs-baseline"),
            "conversation",
        ),
    ):
        result = headroom(ds, target=target).sel(corpus=[corpus])
        doc = headroom_document(result, ds)
        header, rows = headroom_table_rows(doc, omit=("corpus",))
        print_table(title, header, rows)
        for note in headroom_notes(doc):  # what a `≥` or `?` in the table means, as headroom's
            # (resuming: the demo's own command, not a `dvfs sweep` its user never typed)
            print_line(escape(note.replace("the same `dvfs sweep` command", own)))
    with out.status("drawing figures"):
        paths = plot_all(ds, out_dir / "plots", target=Target("preserve", slack=0.05))
    # whole in a pipe or a log (its commands not broken across lines), the folder as named
    print_line(
        escape(
            f"{len(paths)} figures in {out_dir / 'plots'}; next: "
            f"dvfs headroom {out_dir} --help, dvfs compare {out_dir}, dvfs cube info {out_dir}"
        )
    )
    if outcome.summary.failed:
        raise SystemExit(5)


def _refuse_a_device_cube(cube: Path, *, fresh: bool) -> None:
    """Refuse a device or socket as the demo's cube.nc (a link to /dev/null), before it sweeps:
    the sweep writes its cube into one in place, but the demo reads the cube back as a file,
    which failed only once every cell was measured, saying to give "the cube.nc a sweep
    wrote". One --fresh moves aside with its journal is none of the demo's; a named pipe is
    the sweep's to refuse (`check_cube_files`)."""
    import os
    import stat

    from dvfs.errors import OutputRefusedError
    from dvfs.out_folder import fresh_moves

    try:
        mode = os.stat(cube).st_mode
    except OSError:
        return  # none yet (or one the sweep refuses in its own words)
    if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode)):
        return
    if fresh and cube in {src for src, _ in fresh_moves(cube.parent)}:
        return
    raise OutputRefusedError(
        f"{cube} is a device or socket, where the demo writes its cube and reads it back as a "
        "file: remove it (or move it aside) and run again"
    )
