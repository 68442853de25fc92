"""A rich progress bar for the runner (implements `dvfs.measure.runner.Progress`)."""

from __future__ import annotations

from typing import Any

from dvfs.cli.common import escape, on_terminal
from dvfs.measure.plan import Cell
from dvfs.measure.runner import NullProgress


class RichProgress:
    """Progress bar with ETA on stderr; notes are printed above it."""

    def __init__(self, description: str, *, enabled: bool = True) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = Console(stderr=True, highlight=False)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]} failed"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[current]}"),
            console=self.console,
            # Off a terminal the bar would only be drawn once, at the end, cut to 80 columns
            # ("1080/…"): a log gets the notes and the summary lines instead. (Not rich's
            # is_terminal, which FORCE_COLOR or TTY_COMPATIBLE make true of a file.)
            disable=not enabled or not on_terminal(self.console),
            transient=False,
        )
        self._description = description
        self._task: Any = None
        self._total = 0
        self.failed = 0

    def __enter__(self) -> RichProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)

    def start(self, total: int, done: int) -> None:
        self._total = total
        self._task = self._progress.add_task(
            self._description, total=total, completed=done, failed=0, current=""
        )
        if done:
            self.note(f"resuming: {done} of {total} cells already in the journal")

    def more(self, cells: int) -> None:
        """The campaign grew (further repeats): the bar's total and ETA count them."""
        self._total += cells
        if self._task is not None:
            self._progress.update(self._task, total=self._total)

    def advance(self, cell: Cell, status: str) -> None:
        if status != "ok":
            self.failed += 1
        from dvfs.measure.plan import cell_label

        self._progress.update(self._task, advance=1, failed=self.failed, current=cell_label(cell))

    def note(self, message: str) -> None:
        self.console.print(f"[dim]{escape(message)}[/dim]")


#: Cells from which the dry run's estimate, with no bar drawn, says before it starts that it
#: sweeps the twin (a few seconds' work here; a grid of tens of thousands takes minutes).
LARGE_ESTIMATE_CELLS = 1000


class EstimateNotice(NullProgress):
    """The dry run's twin estimate where no bar is drawn (off a terminal, or --no-progress):
    one line on stderr before a large one (`LARGE_ESTIMATE_CELLS`) starts, saying what the
    wait is and how to skip it, where the dry run said nothing for minutes; the stand-in's
    notes (its twin servers) go to the log, as with no progress at all."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False, soft_wrap=True)

    def start(self, total: int, done: int) -> None:
        if total - done >= LARGE_ESTIMATE_CELLS:
            self.console.print(
                f"note: estimating the GPU time by sweeping the twin over {total - done} cells "
                "first, which takes a while on a grid this large; pass --no-estimate to skip "
                "it (the closed-form figure instead)",
                markup=False,
            )
