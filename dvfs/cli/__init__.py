"""The `dvfs` command line. Command bodies are short: parse, build, call the library, render.

Exit codes: 0 success; 1 error; 2 bad usage or an invalid campaign/caps file; 3 a GPU holds
unrestored changes or is in use by another dvfs, or another sweep is writing to the same --out
folder; 4 permission denied (needs root); 5 a sweep finished with failed cells (the cube is
written; rerun to retry them, or, where SGLang would not start a drafter's server for the
campaign as it is, change the campaign and sweep with --fresh); 130/143 interrupted by
SIGINT/SIGTERM (GPU settings restored, rerun to resume).
"""

from __future__ import annotations

import click

from dvfs import __version__
from dvfs.cli.common import LazyGroup

COMMANDS = {
    "demo": (
        "dvfs.cli.demo",
        "demo",
        "The whole pipeline on the twin: sweep, headroom table, figures.",
    ),
    "sweep": (
        "dvfs.cli.sweep",
        "sweep",
        "Run a campaign: sweep knobs x batch x drafter x corpus into a cube.",
    ),
    "cube": ("dvfs.cli.cube", "cube", "Build, inspect and merge cubes."),
    "headroom": (
        "dvfs.cli.analysis",
        "headroom",
        "Lowest clock / power cap keeping latency within a target, and its saving.",
    ),
    "compare": (
        "dvfs.cli.analysis",
        "compare",
        "Speculation vs none: equal clock, equal latency, break-even batch, roofline.",
    ),
    "plot": ("dvfs.cli.analysis", "plot", "Draw the figures from a cube."),
    "gpu": ("dvfs.cli.gpu", "gpu", "List and inspect GPUs; restore settings after a crash."),
    "cap": ("dvfs.cli.cap", "cap", "Production caps: plan from headroom, apply, show, reset."),
    "doctor": ("dvfs.cli.doctor", "doctor", "Preflight a campaign (read-only)."),
    "corpus": ("dvfs.cli.corpus", "corpus", "The prompt corpora: built-in and your own."),
    "report": ("dvfs.cli.report", "report", "A self-contained HTML or Markdown report of a cube."),
    "govern": (
        "dvfs.cli.govern",
        "govern",
        "Load-following caps for a running SGLang server, from a per-batch plan.",
    ),
    "monitor": (
        "dvfs.cli.govern",
        "monitor",
        "Export live power, clocks and energy per token in Prometheus format.",
    ),
    "twin": ("dvfs.cli.twin", "twin", "The digital twin: fit it to measurements, predict."),
}


@click.group(
    cls=LazyGroup, lazy_commands=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(__version__, prog_name="dvfs")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """How much energy GPU clocks, power caps and speculative decoding really save.

    Runs anywhere on the digital twin; on NVIDIA GPUs through NVML and SGLang.
    Start with:  dvfs demo   (the whole pipeline on the twin, anywhere)
    """
    import logging

    level = logging.WARNING - 10 * verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s"
    )


def main() -> None:
    from dvfs.cli.common import run_main

    run_main(cli, "dvfs")
