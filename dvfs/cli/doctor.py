"""`dvfs doctor`: preflight a campaign without changing anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from dvfs.cli.common import (
    RAY_PLACES_GPUS,
    campaign_argument,
    console,
    echo_json,
    escape,
    gpus_option,
    handle_errors,
    out_dir_option,
    parse_shard,
    sweep_groups,
)


@click.command()
@campaign_argument
@out_dir_option(
    "The sweep's output folder (checked as the sweep would use it) [default: out/<name>]."
)
@click.option(
    "--shard",
    "shard_spec",
    metavar="I/N",
    callback=lambda _ctx, _param, value: parse_shard(value),
    help="Check the output folder as `dvfs sweep --shard I/N` would use it "
    "[default --out: out/<campaign name>/shard-I-of-N].",
)
@gpus_option(
    "Check the GPUs as `dvfs sweep --gpus LIST` runs the campaign on them (the same LIST: "
    "indices, ranges or UUIDs; PROFILE:INDEX on the twin): each group's GPUs, one server "
    "each, a block of SGLang ports per server, and the output folder as that fleet uses it "
    "[default: gpu.devices].",
)
@click.option(
    "--observe-only",
    is_flag=True,
    help="Check the campaign as `dvfs sweep --observe-only` runs it: knobs stock, no setter "
    "called, no root needed.",
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Check the campaign as `dvfs sweep --executor` runs it: with ray, this is the driver, "
    "and the real GPUs and the SGLang servers are the Ray workers' nodes' (`dvfs doctor` on a "
    "node checks them).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print JSON: a list of one object per check (name, status, detail, invalid).",
)
@handle_errors
def doctor(
    campaign_file: Path,
    out_dir: Path | None,
    shard_spec: Any,
    gpus_spec: str | None,
    observe_only: bool,
    executor: str,
    as_json: bool,
) -> None:
    """Check a campaign before sweeping: driver, permissions, persistence mode, clocks and
    limits in range, unrestored state, GPUs held by another dvfs, the stock power limits of a
    server's GPUs (or a fleet's of one model), the server's GPUs, engine,
    model paths, tokenizer, corpora, and the output folder (usable by the sweep, free disk).

    Exits 0 when nothing failed (warnings allowed), 1 when a check failed, 2 when the
    campaign file is missing or invalid (nothing else is checked then) or a check failed that
    `dvfs sweep` refuses with exit 2 too: the 'arms' check (SGLang would serve the drafters
    differently), clocks or limits the GPUs do not support, a server's GPUs of two models,
    GPUs outside the job's CUDA_VISIBLE_DEVICES, a GPU model the twin engine has no profile
    of, a corpus file missing or damaged, corpora that cannot fill the batches, an output
    folder holding another shard (or the whole campaign), more shards than comparison
    groups."""
    import sys

    from dvfs.campaign import load_campaign
    from dvfs.doctor import FAIL, WARN, check_campaign

    campaign = load_campaign(campaign_file)
    if gpus_spec and executor == "ray" and campaign.gpu.backend == "nvml":  # as sweep refuses it
        raise click.UsageError(RAY_PLACES_GPUS)
    if observe_only:
        from dvfs.sweep import observe_only as observing

        campaign = observing(campaign)
    default_out = Path("out") / campaign.name
    if shard_spec is not None:
        default_out = default_out / f"shard-{shard_spec.index}-of-{shard_spec.count}"
    groups = sweep_groups(campaign, gpus_spec) if gpus_spec is not None else None
    checks = check_campaign(
        campaign, out_dir or default_out, shard=shard_spec, groups=groups, executor=executor
    )
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
