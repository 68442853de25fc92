"""`dvfs twin` (being built)."""

import click


@click.group()
def twin() -> None:
    """Not built yet."""
