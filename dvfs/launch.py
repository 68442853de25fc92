"""The `dvfs` console script and `python -m dvfs`: the command line imported inside a guard,
so that a Ctrl-C while Python is still importing it (click, the commands' table: a few tenths
of a second) ends as any interrupted dvfs does, one line and exit 130, not a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from dvfs.cli import main as run
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted.\n")
        raise SystemExit(130) from None
    run()
