"""`dvfs report` (being built)."""

import click


@click.command()
def report() -> None:
    """Not built yet."""
    raise click.ClickException("dvfs report is not built yet")
