"""A rich progress bar for the runner (implements `dvfs.measure.runner.Progress`)."""

from __future__ import annotations

from typing import Any

from dvfs.cli.common import escape
from dvfs.measure.plan import Cell


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
            # ("1080/…"): a log gets the notes and the summary lines instead.
            disable=not enabled or not self.console.is_terminal,
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
