"""`dvfs govern` and `dvfs monitor` (being built)."""

import click


@click.command()
def govern() -> None:
    """Not built yet."""
    raise click.ClickException("dvfs govern is not built yet")


@click.command()
def monitor() -> None:
    """Not built yet."""
    raise click.ClickException("dvfs monitor is not built yet")
