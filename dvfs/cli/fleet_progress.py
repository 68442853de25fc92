"""Progress of a campaign on many workers: the whole campaign, and a line per worker (cells
done, the cell it is on, its ETA); implements `dvfs.fleet.driver.FleetProgress`."""

from __future__ import annotations

from typing import Any

from dvfs.cli.common import escape, on_terminal
from dvfs.fleet.driver import WorkerStats
from dvfs.measure.plan import Cell


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class RichFleetProgress:
    """One bar for the campaign (ETA from its pace) and one line per worker, on stderr."""

    def __init__(self, description: str, *, enabled: bool = True) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = Console(stderr=True, highlight=False)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]} failed"),
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[eta]}"),
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
        self._workers: dict[str, Any] = {}
        self.failed = 0
        self._total = self._done = self._resumed = 0

    def __enter__(self) -> RichFleetProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.__exit__(*exc)

    def start(self, total: int, done: int) -> None:
        import time

        self._clock = time.monotonic
        self._started = self._clock()
        self._total, self._done, self._resumed = total, done, done
        self._task = self._progress.add_task(
            self._description, total=total, completed=done, failed=0, current="", eta=_clock(None)
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
        self._done += 1
        ran = self._done - self._resumed
        eta = (self._clock() - self._started) / ran * (self._total - self._done)
        self._progress.update(self._task, advance=1, failed=self.failed, eta=_clock(eta))

    def worker(self, stats: WorkerStats, eta_s: float | None) -> None:
        task = self._workers.get(stats.label)
        if task is None:
            task = self._progress.add_task(
                f"  {stats.label}", total=None, completed=0, failed=0, current="", eta=""
            )
            self._workers[stats.label] = task
        state = escape(stats.current) or "idle"
        if stats.lost:
            state = f"[red]{stats.gone}[/red]: {escape(stats.lost)}"
        self._progress.update(
            task, completed=stats.done, failed=stats.failed, current=state, eta=_clock(eta_s)
        )

    def note(self, message: str) -> None:
        self.console.print(f"[dim]{escape(message)}[/dim]")
