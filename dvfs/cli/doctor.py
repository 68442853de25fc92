"""`dvfs doctor`: preflight a campaign without changing anything."""

from __future__ import annotations

from pathlib import Path

import click

from dvfs.cli.common import (
    campaign_argument,
    console,
    echo_json,
    escape,
    handle_errors,
    out_dir_option,
)


@click.command()
@campaign_argument
@out_dir_option(
    "The sweep's output folder (checked as the sweep would use it) [default: out/<name>]."
)
@click.option("--json", "as_json", is_flag=True)
@handle_errors
def doctor(campaign_file: Path, out_dir: Path | None, as_json: bool) -> None:
    """Check a campaign before sweeping: driver, permissions, persistence mode, clocks and
    limits in range, unrestored state, GPUs held by another dvfs, the server's GPUs, engine,
    corpora, and the output folder (usable by the sweep, free disk).

    Exits 0 when nothing failed (warnings allowed), 1 when a check failed, 2 when the
    campaign file is missing or invalid (nothing else is checked then) or a check failed that
    `dvfs sweep` refuses as an invalid campaign (exit 2 there too): the 'arms' check (SGLang
    would serve the drafters differently), clocks or limits the GPUs do not support, corpora
    that cannot fill the batches, GPUs outside the job's CUDA_VISIBLE_DEVICES."""
    import sys

    from dvfs.campaign import load_campaign
    from dvfs.doctor import FAIL, WARN, check_campaign

    campaign = load_campaign(campaign_file)
    checks = check_campaign(campaign, out_dir or Path("out") / campaign.name)
    if as_json:
        echo_json([c.__dict__ for c in checks])
    else:
        out = console()
        marks = {
            "ok": "[green]ok  [/green]",
            WARN: "[yellow]warn[/yellow]",
            FAIL: "[red]FAIL[/red]",
        }
        for c in checks:
            out.print(f"{marks[c.status]} {escape(c.name)}: {escape(c.detail)}")
    if any(c.status == FAIL and c.invalid for c in checks):
        sys.exit(2)
    if any(c.status == FAIL for c in checks):
        sys.exit(1)
