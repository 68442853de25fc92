"""Shared CLI pieces: lazy command loading, error translation, rendering helpers."""

from __future__ import annotations

import functools
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


class LazyGroup(click.Group):
    """A group whose subcommands are imported only when used, keeping `--help` fast."""

    def __init__(
        self,
        *args: Any,
        lazy_commands: dict[str, tuple[str, str, str]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands or {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_commands:
            module, attr, _ = self.lazy_commands[name]
            return getattr(importlib.import_module(module), attr)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """List lazy commands with their one-line help without importing them."""
        rows = []
        for name in self.list_commands(ctx):
            if name in self.lazy_commands:
                rows.append((name, self.lazy_commands[name][2]))
            else:
                cmd = super().get_command(ctx, name)
                if cmd is not None and not cmd.hidden:
                    rows.append((name, cmd.get_short_help_str()))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def handle_errors(func: F) -> F:
    """Turn library errors into clean messages and documented exit codes."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from dvfs.errors import DvfsError
        from dvfs.signals import Interrupted

        try:
            return func(*args, **kwargs)
        except DvfsError as exc:
            click.echo(f"Error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except Interrupted as exc:
            click.echo(f"Interrupted ({exc}).", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


def console(stderr: bool = False) -> Any:
    """A rich console; at least 120 columns wide when writing to a pipe or file."""
    import shutil

    from rich.console import Console

    width = max(120, shutil.get_terminal_size((120, 24)).columns)
    return Console(stderr=stderr, highlight=False, width=width)


def echo_json(data: Any) -> None:
    """Print strict JSON (NaN and infinities become null)."""
    click.echo(json.dumps(_nan_to_none(data), indent=2, default=str, allow_nan=False))


def _nan_to_none(data: Any) -> Any:
    if isinstance(data, float) and (data != data or data in (float("inf"), float("-inf"))):
        return None
    if isinstance(data, dict):
        return {k: _nan_to_none(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_nan_to_none(v) for v in data]
    return data


def campaign_argument(func: F) -> F:
    return click.argument("campaign_file", type=click.Path(dir_okay=False, path_type=Path))(func)


def out_dir_option(help_text: str) -> Callable[[F], F]:
    return click.option(
        "-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), help=help_text
    )


def escape(text: str) -> str:
    """Text shown through rich, with its square brackets kept literal (not read as markup)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)
