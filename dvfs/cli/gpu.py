"""`dvfs gpu`: list and inspect GPUs (read-only), and restore settings after a crash."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from dvfs.cli.common import console, echo_json, escape, handle_errors


@contextlib.contextmanager
def open_cli_gpus(
    devices: tuple[str, ...],
    twin: str | None,
    *,
    allow_mig: bool = False,
) -> Iterator[list[Any]]:
    """GPUs named on the command line (all when none are named), from `dvfs.backends`; a UUID
    given to the twin is a usage error."""
    from dvfs.backends import open_gpus, parse_devices

    parsed = parse_devices(devices)
    named = [str(d) for d in parsed if not isinstance(d, int)]
    if twin and named:
        raise click.UsageError(
            f"the twin's GPUs are named by index (0, 1, ...), not by UUID: {named[0]}"
        )
    with open_gpus(parsed, twin=twin, allow_mig=allow_mig) as gpus:
        yield gpus


twin_option = click.option(
    "--twin",
    metavar="PROFILE",
    help="Show the digital twin's GPU (h100-sxm, h200-sxm) instead of NVML.",
)


@click.group()
def gpu() -> None:
    """List and inspect GPUs; restore settings a crashed run left behind."""


@gpu.command("list")
@twin_option
@click.option("--json", "as_json", is_flag=True)
@handle_errors
def list_gpus(twin: str | None, as_json: bool) -> None:
    """GPUs on this machine: index, UUID, name, power limit, SM clock."""
    from dvfs.gpu.describe import gpu_summary

    with open_cli_gpus((), twin, allow_mig=True) as gpus:
        rows = [gpu_summary(g) for g in gpus]
    if as_json:
        echo_json(rows)
        return
    from rich.table import Table

    table = Table()
    for col in ("index", "uuid", "name", "driver", "power limit", "SM clock", "MIG"):
        table.add_column(col, no_wrap=col == "uuid", overflow="fold")
    for r in rows:
        table.add_row(
            str(r["index"]),
            r["uuid"],
            r["name"],
            r["driver"],
            f"{r['power_limit_w']:g} W",
            f"{r['sm_clock_mhz']} MHz",
            "on (refused)" if r["mig"] else "off",
        )
    console().print(table)


@gpu.command("info")
@click.argument("devices", nargs=-1)
@twin_option
@click.option("--json", "as_json", is_flag=True)
@handle_errors
def info(devices: tuple[str, ...], twin: str | None, as_json: bool) -> None:
    """Supported clocks, power-limit range, current and enforced settings, persistence,
    energy-counter support and clock-event reasons of DEVICES (indices or UUIDs; all if none)."""
    from dvfs.gpu.describe import gpu_details

    with open_cli_gpus(devices, twin, allow_mig=True) as gpus:
        infos = [gpu_details(g) for g in gpus]
    if as_json:
        echo_json(infos)
        return
    out = console()
    for i in infos:
        c, p = i["supported_sm_clocks_mhz"], i["power_limit_w"]
        out.print(f"[bold]GPU {i['index']}[/bold] {i['name']} ({i['uuid']}), driver {i['driver']}")
        out.print(
            f"  SM clocks: {c['count']} supported, {c['min']}-{c['max']} MHz; "
            f"now {i['sm_clock_mhz']} MHz;"
            f" memory clock {i['memory_clock_mhz']} MHz"
        )
        out.print(
            f"  power limit: {p['current']:g} W (enforced {p['enforced']:g} W, default "
            f"{p['default']:g} W, allowed {p['min']:g}-{p['max']:g} W)"
        )
        persistence = {
            None: "unknown",
            True: "on",
            False: "off (a power limit resets when the driver unloads)",
        }[i["persistence_mode"]]
        out.print(
            f"  persistence mode: {persistence}; energy counter: "
            f"{'yes' if i['energy_counter'] else 'no'}; MIG: {'on' if i['mig'] else 'off'}"
        )
        power = "-" if i["power_w"] is None else f"{i['power_w']:.1f} W"
        out.print(
            f"  now: {power}, {i['temperature_c']} C, event reasons: "
            f"{', '.join(i['event_reasons']) or 'none'}"
        )


@gpu.command("reset")
@click.argument("devices", nargs=-1)
@click.option(
    "--defaults",
    is_flag=True,
    help="With no state file, reset to driver defaults (unlock clocks, default power limit).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where dvfs keeps state files [default: /var/lib/dvfs as root, else "
    "$XDG_STATE_HOME/dvfs].",
)
@handle_errors
def reset(devices: tuple[str, ...], defaults: bool, state_dir: Path | None) -> None:
    """Restore GPU settings recorded by a dvfs run that died (SIGKILL, power loss).

    Without DEVICES, every GPU with a state file. Holds each GPU's lock while restoring, so
    it refuses GPUs a running dvfs is using.
    """
    from dvfs.caps import reset_gpus
    from dvfs.gpu.safety import default_state_dir

    out = console()
    with open_cli_gpus(devices, None, allow_mig=True) as gpus:
        acted = reset_gpus(
            gpus,
            state_dir or default_state_dir(),
            defaults=defaults,
            note=lambda line: out.print(escape(line)),
        )
    if not acted:
        out.print(
            "No dvfs state files for these GPUs: nothing to restore "
            "(use --defaults to reset to driver defaults anyway)."
        )
