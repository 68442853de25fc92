"""`dvfs sweep`: run a campaign into a journal and a cube (resumable)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from dvfs.cli.common import (
    campaign_argument,
    console,
    echo_json,
    escape,
    handle_errors,
    out_dir_option,
)


def _observe_only(campaign: Any) -> Any:
    """The campaign with knobs at stock and actuation off."""
    knobs = dataclasses.replace(campaign.knobs, sm_clocks_mhz=None, power_limits_w=None)
    gpu = dataclasses.replace(campaign.gpu, actuation=False)
    return dataclasses.replace(campaign, knobs=knobs, gpu=gpu)


def dry_run_report(campaign: Any, out_dir: Path) -> dict[str, Any]:
    """What a sweep would do, without touching a GPU or starting a server."""
    from dvfs.journal import JOURNAL_NAME, journal_differences, read_records
    from dvfs.plan import plan_cells, summarise_plan

    cells = plan_cells(campaign)
    done: set[str] = set()
    journal = out_dir / JOURNAL_NAME
    if journal.is_file():
        records = read_records(journal)
        if records and not journal_differences(records[0], campaign):
            done = {
                r["key"] for r in records if r.get("type") == "cell" and r.get("status") == "ok"
            }
    summary = summarise_plan(campaign, cells, done)
    knobs = campaign.knobs
    report: dict[str, Any] = {
        "campaign": campaign.name,
        "hash": campaign.hash,
        "gpu": {
            "backend": campaign.gpu.backend,
            "profile": campaign.gpu.profile,
            "devices": list(campaign.gpu.devices),
            "actuation": "on" if campaign.gpu.actuation else "off (observe-only)",
        },
        "grid": {
            "sm_clock_mhz": list(knobs.sm_clocks_mhz) if knobs.sm_clocks_mhz else "stock",
            "power_limit_w": list(knobs.power_limits_w) if knobs.power_limits_w else "stock",
            "batch": list(campaign.workload.batch_sizes),
            "drafter": [d.name for d in campaign.drafters],
            "corpus": list(campaign.workload.corpus_names),
            "repeat": campaign.measurement.repeats,
        },
        "cells": summary.cells,
        "already_done": summary.cells - summary.remaining,
        "remaining": summary.remaining,
        "server_starts": summary.server_starts,
        "knob_changes": summary.knob_changes,
        "estimated_hours_on_hardware": round(summary.estimated_s / 3600, 2),
        "servers": _server_plans(campaign),
        "problems": _corpus_problems(campaign),
    }
    return report


def _corpus_problems(campaign: Any) -> list[str]:
    from dvfs.errors import CorpusError
    from dvfs.sweep import corpus_shortfalls, load_corpora

    try:
        return corpus_shortfalls(campaign, load_corpora(campaign))
    except CorpusError as exc:
        return [str(exc)]


def _server_plans(campaign: Any) -> list[dict[str, Any]]:
    """Per drafter: the launch argv (SGLang) or the twin's resolved drafting plan."""
    plans = []
    if campaign.engine.backend == "sglang":
        from dvfs.engines.sglang_args import launch_argv, probe_help, server_command, server_env

        help_text = (
            None
            if campaign.engine.sglang.version
            else probe_help(server_command(campaign), env=server_env(campaign))
        )
        source = (
            "engine.sglang.version"
            if campaign.engine.sglang.version
            else "launch_server --help"
            if help_text
            else "assumed SGLang >= 0.5.23 (launch_server --help could not run here; "
            "set engine.sglang.version)"
        )
        for drafter in campaign.drafters:
            argv = launch_argv(campaign, drafter, port=30000, help_text=help_text)
            plans.append({"drafter": drafter.name, "argv": argv, "flags_from": source})
        return plans
    from dvfs.engines.twin import plan_drafter
    from dvfs.twin.profiles import model_profile

    model = model_profile(campaign.engine.twin_model or campaign.engine.model)
    for drafter in campaign.drafters:
        plan = plan_drafter(drafter, model)
        entry: dict[str, Any] = {"drafter": drafter.name, "algorithm": drafter.algorithm or "none"}
        if plan is not None:
            entry.update(
                num_steps=plan.num_steps,
                topk=plan.topk,
                verify_tokens=plan.verify_tokens,
                expected_accept_length={
                    c: round(plan.expected_accept_length(c, campaign.workload.temperature), 2)
                    for c in campaign.workload.corpus_names
                },
            )
        plans.append(entry)
    return plans


def _render_dry_run(report: dict[str, Any]) -> None:
    from rich.table import Table

    out = console()
    out.print(f"[bold]Campaign[/bold] {report['campaign']} (hash {report['hash']})")
    grid = Table(show_header=False, box=None, pad_edge=False)
    for key, value in report["grid"].items():
        text = value if isinstance(value, str | int) else ", ".join(map(str, value))
        grid.add_row(f"  {key}", str(text))
    out.print(grid)
    out.print(
        f"[bold]{report['cells']}[/bold] cells ({report['already_done']} already done, "
        f"{report['remaining']} to run), {report['server_starts']} server start(s), "
        f"{report['knob_changes']} knob change(s); roughly "
        f"{report['estimated_hours_on_hardware']} h on real hardware"
    )
    for problem in report["problems"]:
        out.print(f"[red]problem:[/red] {escape(problem)}", highlight=False)
    if report["servers"] and "flags_from" in report["servers"][0]:
        out.print(
            f"launch flags from: {report['servers'][0]['flags_from']}; the port is chosen "
            "when each server starts"
        )
    for server in report["servers"]:
        if "argv" in server:
            out.print(
                f"[bold]{server['drafter']}[/bold]: " + " ".join(server["argv"]), soft_wrap=True
            )
        else:
            detail = ""
            if "verify_tokens" in server:
                detail = (
                    f" steps={server['num_steps']} topk={server['topk']} "
                    f"verify={server['verify_tokens']} expected accept length "
                    + ", ".join(f"{c} {v}" for c, v in server["expected_accept_length"].items())
                )
            out.print(f"[bold]{server['drafter']}[/bold] ({server['algorithm']}){detail}")


@click.command()
@campaign_argument
@out_dir_option("Folder for the journal, cube and server logs [default: out/<campaign name>].")
@click.option(
    "--dry-run", is_flag=True, help="Print the plan (cells, server starts, time) and exit."
)
@click.option("--fresh", is_flag=True, help="Move an existing journal aside and start over.")
@click.option(
    "--observe-only",
    is_flag=True,
    help="Never change GPU settings: knobs stay stock and are recorded as observed.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (with --dry-run).")
@click.option("--no-progress", is_flag=True, help="No progress bar (for logs and CI).")
@handle_errors
def sweep(
    campaign_file: Path,
    out_dir: Path | None,
    dry_run: bool,
    fresh: bool,
    observe_only: bool,
    as_json: bool,
    no_progress: bool,
) -> None:
    """Run CAMPAIGN_FILE: every (knob, batch, drafter, corpus, repeat) cell into a cube.

    Resumes from the journal in --out by default: finished cells are skipped. Ctrl-C stops
    after restoring the GPU; run the same command again to continue.
    """
    from dvfs.campaign import load_campaign

    campaign = load_campaign(campaign_file)
    if observe_only:
        campaign = _observe_only(campaign)
    out_dir = out_dir or Path("out") / campaign.name
    if dry_run:
        report = dry_run_report(campaign, out_dir)
        if as_json:
            echo_json(report)
        else:
            _render_dry_run(report)
        if report["problems"]:
            raise SystemExit(2)
        return
    outcome = run(campaign, out_dir, fresh=fresh, progress=not no_progress)
    if outcome.summary.failed:
        raise SystemExit(5)


def _restore_status(campaign: Any) -> str:
    """Say "restored" only when no state file of this process is left behind."""
    if campaign.gpu.backend != "nvml":
        return "GPU settings restored."
    import os

    from dvfs.gpu.safety import StateStore

    store = StateStore()
    left = [p for p in store.pending() if p.pid == os.getpid()]
    if not left:
        return "GPU settings restored."
    return (
        "[red]GPU settings NOT fully restored[/red] for "
        + ", ".join(p.original.uuid for p in left)
        + f": run `dvfs gpu reset` (state in {store.directory})."
    )


def run(campaign: Any, out_dir: Path, *, fresh: bool, progress: bool) -> Any:
    """Run the sweep and report; returns the `SweepOutcome` (the caller picks the exit code:
    5 when cells failed)."""
    from dvfs.cli.progress import RichProgress
    from dvfs.cube import CUBE_NAME, build_cube, write_cube
    from dvfs.errors import GpuPermissionError
    from dvfs.journal import JOURNAL_NAME
    from dvfs.signals import Interrupted, signals_raise
    from dvfs.sweep import run_sweep

    err = console(stderr=True)
    bar = RichProgress(f"{campaign.name}", enabled=progress)
    try:
        with signals_raise(), bar:
            outcome = run_sweep(campaign, out_dir, fresh=fresh, progress=bar)
    except GpuPermissionError as exc:
        if not campaign.gpu.actuation or "--observe-only" in str(exc):
            raise
        raise GpuPermissionError(
            f"{exc}. To measure without changing any GPU setting (no root needed), rerun with "
            "--observe-only"
        ) from exc
    except (KeyboardInterrupt, Interrupted):
        journal = out_dir / JOURNAL_NAME
        if journal.exists():
            try:
                write_cube(build_cube(journal), out_dir / CUBE_NAME)
                err.print(f"partial cube written to {out_dir / CUBE_NAME}")
            except Exception as exc:  # the interruption matters more than the partial cube
                err.print(f"(no partial cube: {escape(str(exc))})")
        err.print(f"{_restore_status(campaign)} Run the same command again to resume.")
        raise
    s = outcome.summary
    err.print(
        f"{s.measured} cell(s) measured, {s.failed} failed, {s.skipped} already done; "
        f"journal {outcome.journal_path}"
    )
    click.echo(f"cube: {outcome.cube_path}")
    if s.failed:
        shown = ", ".join(s.failed_cells[:3]) + (" ..." if len(s.failed_cells) > 3 else "")
        err.print(
            f"[yellow]Finished with {s.failed} failed cell(s) ({escape(shown)}): the cube is "
            "written without them; rerun the same command to retry them (errors are in the "
            "journal and in `dvfs cube info`).[/yellow]",
            soft_wrap=True,
        )
    return outcome
