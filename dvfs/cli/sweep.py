"""`dvfs sweep`: run a campaign into a journal and a cube (resumable)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
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
    one_line,
    out_dir_option,
    parse_shard,
    restore_status,
    sweep_groups,
)


def _render_dry_run(report: dict[str, Any]) -> None:
    """The plan as text; `report` is `DryRunPlan.as_dict()`, the same data --json prints."""
    from rich.table import Table

    out = console()
    out.print(f"[bold]Campaign[/bold] {report['campaign']} (hash {report['hash']})")
    grid = Table(show_header=False, box=None, pad_edge=False)
    for key, value in report["grid"].items():
        text = value if isinstance(value, str | int) else ", ".join(map(str, value))
        grid.add_row(f"  {key}", str(text))
    out.print(grid)
    refused = report["out_refused"]
    per_model = report.get("done_per_model", {})
    each = f" on each of {len(per_model)} GPU models" if len(per_model) > 1 else ""
    done = "".join(f", {folder}/ {n} done" for folder, n in per_model.items())
    adaptive = report.get("adaptive_repeats")
    extra = (
        f"; {adaptive['extra_done']} extra repeat(s) already done, "
        f"{adaptive['extra_to_run_now']} to run now"
        if adaptive and not refused and (adaptive["extra_done"] or adaptive["extra_to_run_now"])
        else ""
    )
    counts = (
        f"[bold]{report['cells']}[/bold] cells{each}"
        + (
            ""
            if refused
            else f" ({report['already_done']} already done, {report['remaining']} to run"
            + (f": {done[2:]}" if done else "")
            + extra
            + ")"
        )
        + f", {report['server_starts']} "
        + (
            "attach(es) to the running server"
            if report["servers"] and "attached_to" in report["servers"][0]
            else "server start(s)"
        )
        + f", {report['knob_changes']} knob change(s)"
        + (
            f" across the fleet's {report['busy_workers']} busy worker(s) (each starts the "
            "servers of its drafters and steps its own knobs)"
            if report.get("busy_workers")
            else ""
            if "busy_workers" in report
            else " on the model with the most left"
            if each
            else ""
        )
    )
    # the folder's other GPU models, none of whose GPUs run here: the sweep's note
    others = [
        f"{folder}: {n} cell(s) left for GPUs of that model (none in this run); rerun with "
        "them to finish"
        for folder, n in report.get("left_for_other_models", {}).items()
    ]
    if refused:  # the journal there is another share's: its cells are neither done nor to do
        counts += (
            "; none counted as done or to run: the sweep would refuse this --out folder "
            "before measuring anything (see below)"
        )
    estimate = report["estimate"]
    if estimate["from"] != "twin":
        whole = " for all of them" if refused else ""
        out.print(
            f"{counts}; roughly {estimate['gpu_hours']} h on real hardware{whole} (closed form)"
        )
        for line in others:
            out.print(escape(line), highlight=False)
        if estimate.get("twin_skipped"):
            out.print(f"note: {estimate['twin_skipped']}", highlight=False)
    else:
        out.print(counts)
        for line in others:
            out.print(escape(line), highlight=False)
        on = (
            "the twin"
            if report["gpu"]["backend"] == "twin"
            and report["gpu"]["profile"] == estimate["profile"]
            else f"the twin stand-in {estimate['profile']} ({estimate['profile_from']}; this "
            "campaign with its GPU and engine switched to the twin)"
        )
        ratio = estimate["dvfs_over_naive"]
        share = estimate["window_share"]
        left = report["cells"] - estimate["cells_already_done"]
        which = (
            f"all {report['cells']} cells"
            if not estimate["cells_already_done"]
            else f"the {left} of {report['cells']} cells left"
            if left
            else "no planned cell (the folder holds them all)"
        )
        if each:  # each model runs the campaign: the twin sweeps one model's share
            which += " of one GPU model (the one with the most left)"
        if adaptive and estimate["cells_already_done"]:
            which += " and the extra repeats asked for"
        out.print(
            f"{on} spends {report['twin_gpu_s'] / 3600:.2f} GPU-hours of virtual time on "
            f"{which} (swept into a temporary folder), "
            + (f"{share:.0%} of it inside measurement windows" if share is not None else ""),
            highlight=False,
        )
        out.print(
            f"the naive protocol ({estimate['naive_protocol']}) would spend "
            f"{estimate['naive_gpu_hours']:.2f} GPU-hours"
            + (f": dvfs needs {ratio:.3f} of it" if ratio is not None else ""),
            highlight=False,
        )
    if adaptive:
        out.print(
            f"adaptive repeats: after the planned cells the sweep adds the next repeat of each "
            f"group whose interval across repeats misses ±{adaptive['precision']:.1%}, up to "
            f"{adaptive['max_repeats']} repeats"
            + (
                ""
                if refused or not adaptive["extra_to_run_now"]
                else f": the journal asks for {adaptive['extra_to_run_now']} now (counted in "
                "the server starts, knob changes and time above), more may follow"
            ),
            highlight=False,
        )
    if report.get("shard"):
        out.print(
            f"shard {report['shard']}: only its {report['comparison_groups']} comparison "
            "group(s) are counted, each whole (every drafter and knob setting of a batch, "
            "corpus and repeat, on this shard's GPU); it starts one server per drafter",
            highlight=False,
        )
    if report.get("workers"):
        # the workers the estimate counts busy: of the groups left, not of the campaign's
        busy = report["busy_workers"]
        idle = (
            " (none busy: no cell is left to run)"
            if not busy
            else f" (only {busy} busy: each of the comparison groups left runs whole on one worker)"
            if busy < report["workers"]
            else ""
        )
        models = report.get("gpu_models", 1)
        mixed = (
            f", {models} GPU models (the campaign runs whole on each: "
            f"{report['cells_all_models']} cells in all)"
            if models > 1
            else ""
        )
        out.print(
            f"{report['workers']} workers in parallel{mixed}{idle}: roughly "
            f"{report['estimated_makespan_hours']} h from start to end",
            highlight=False,
        )
    moves = report.get("fresh_moves_aside")
    if moves is not None:
        where = (
            "--fresh would move aside "
            + ", ".join(f"{m['path']} (to {Path(m['to']).name})" for m in moves)
            + "; nothing in them counts as done (this dry run moves nothing)"
            if moves
            else "--fresh: no journal to move aside (this dry run moves nothing)"
        )
        out.print(escape(where), highlight=False, soft_wrap=True)
    for problem in report["problems"]:
        out.print(f"[red]problem:[/red] {escape(problem)}", highlight=False)
    if report["servers"] and "flags_from" in report["servers"][0]:
        out.print(
            f"launch flags from: {escape(report['servers'][0]['flags_from'])}; the port is "
            "chosen when each server starts"
        )
    for server in report["servers"]:
        if "attached_to" in server:
            out.print(
                f"[bold]{server['drafter']}[/bold]: attaches to the SGLang server at "
                f"{escape(server['attached_to'])} "
                "(dvfs starts no server there; once it answers, the sweep checks that it serves "
                "engine.model with this drafter's algorithm, room for the largest batch and the "
                "attention backend; `dvfs doctor` checks it now)",
                soft_wrap=True,
                highlight=False,
            )
        elif "argv" in server:
            out.print(
                f"[bold]{server['drafter']}[/bold]: " + escape(" ".join(server["argv"])),
                soft_wrap=True,
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
@click.option(
    "--no-estimate",
    is_flag=True,
    help="With --dry-run: skip the GPU-time estimate (sweeping the twin stand-in takes "
    "minutes on a large grid); print the closed-form figure instead.",
)
@click.option(
    "--twin",
    "twin_profile",
    metavar="PROFILE",
    help="With --dry-run: the twin GPU profile that stands in for the campaign's GPU in the "
    "estimate [default: gpu.profile, else the profile named in the campaign's name or "
    "description, e.g. h100-sxm].",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Move the journals in --out aside and start over (with --dry-run: say what it "
    "would move, moving nothing).",
)
@click.option(
    "--observe-only",
    is_flag=True,
    help="Never change GPU settings: knobs stay stock and are recorded as observed.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (with --dry-run).")
@click.option("--no-progress", is_flag=True, help="No progress bar (for logs and CI).")
@click.option(
    "--shard",
    "shard_spec",
    metavar="I/N",
    callback=lambda _ctx, _param, value: parse_shard(value),
    help="Run only shard I of N (0-based; a Slurm job array: --shard $SLURM_ARRAY_TASK_ID/N): "
    "a share of whole comparison groups (batch, corpus, repeat; with max_repeats above "
    "repeats, batch-and-corpus pairs with all their repeats), into its own folder "
    "[default: out/<campaign name>/shard-I-of-N]; `dvfs cube merge` joins the shards.",
)
@gpus_option(
    "Run one worker per GPU (or per engine.tp_size GPUs) in parallel: indices, ranges or "
    "UUIDs, e.g. 0-7 or 0,2,4-5; on the twin PROFILE:INDEX adds GPUs of another model "
    "(h200-sxm:0-3) [default: gpu.devices; groups there run in parallel too].",
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where the workers run: threads of this process, or Ray actors (one per GPU group, "
    "on any node; `pip install 'dvfs[ray]'`).",
)
@click.option(
    "--address",
    metavar="auto|HOST:PORT",
    help="The Ray cluster to join (with --executor ray) [default: start one on this machine, "
    "on 127.0.0.1, and stop it at the end].",
)
@handle_errors
def sweep(
    campaign_file: Path,
    out_dir: Path | None,
    dry_run: bool,
    no_estimate: bool,
    twin_profile: str | None,
    fresh: bool,
    observe_only: bool,
    as_json: bool,
    no_progress: bool,
    shard_spec: Any,
    gpus_spec: str | None,
    executor: str,
    address: str | None,
) -> None:
    """Run CAMPAIGN_FILE: every (knob, batch, drafter, corpus, repeat) cell into a cube.

    Resumes from the journal in --out by default: finished cells are skipped. Ctrl-C stops
    after restoring the GPU; run the same command again (without --fresh) to continue.
    """
    from dvfs.backends import check_gpus_named_once, check_job_gpus
    from dvfs.campaign import load_campaign
    from dvfs.dry_run import plan_dry_run
    from dvfs.sweep import observe_only as observing
    from dvfs.sweep import observe_only_note

    campaign = load_campaign(campaign_file)
    if observe_only:
        unstepped = observe_only_note(campaign)
        if unstepped:
            console(stderr=True).print(
                f"note: {escape(unstepped)}", highlight=False, soft_wrap=True
            )
        campaign = observing(campaign)
    shard = shard_spec
    default_out = Path("out") / campaign.name
    if shard is not None:
        default_out = default_out / f"shard-{shard.index}-of-{shard.count}"
    out_dir = out_dir or default_out
    from dvfs.fleet.devices import workers_per_model

    if address and executor != "ray":
        raise click.UsageError("--address joins a Ray cluster: use it with --executor ray")
    if gpus_spec and executor == "ray" and campaign.gpu.backend == "nvml":
        raise click.UsageError(RAY_PLACES_GPUS)
    if (no_estimate or twin_profile or as_json) and not dry_run:
        raise click.UsageError("--no-estimate, --twin and --json go with --dry-run")
    groups = sweep_groups(campaign, gpus_spec)
    if executor != "ray":  # before any GPU is touched; Ray's actors get the GPUs Ray gives them
        devices = [d for g in groups for d in g]
        check_job_gpus(campaign, devices)
        check_gpus_named_once(campaign, devices, option="--gpus" if gpus_spec else "gpu.devices")
    from dvfs.fleet.folders import fleet_journal

    # --fresh moves the folder's journals aside unread: a damaged one must not stop it.
    as_fleet = len(groups) > 1 or executor == "ray" or (not fresh and fleet_journal(out_dir))
    if gpus_spec and not as_fleet:
        from dvfs.fleet.devices import for_group

        # One group of --gpus, not a fleet: the campaign runs on it (its devices, a twin
        # group's profile), and the dry run plans that campaign, as the sweep then runs it.
        campaign = for_group(campaign, groups[0])
    if dry_run:
        import sys

        from dvfs.backends import real_gpus
        from dvfs.cli.progress import EstimateNotice, RichProgress
        from dvfs.measure.journal import JOURNAL_NAME
        from dvfs.preflight import read_group_models

        # Real GPUs opened as the sweep opens them and their models read (nothing changed): a
        # GPU not here or lost, or a clock or power limit one does not take, is a note that the
        # sweep would stop on this machine (which may be planning for another); a server on
        # two models is refused as the sweep refuses it, and a fleet mixing them counts each
        # model's cells; where NVML does not answer, the note says what went unchecked. Not
        # Ray's: its GPUs are those Ray places the actors on, on any node, not this machine's.
        group_models, unread = (
            read_group_models(
                campaign,
                groups,
                fleet=as_fleet,
                check=True,
                # the journal one server's sweep resumes, its stock compared as the sweep does
                journal=None if fresh or as_fleet else out_dir / JOURNAL_NAME,
                # the journals a fleet resumes, their stock compared as the fleet does
                fleet_dir=out_dir if as_fleet and not fresh else None,
            )
            if executor != "ray"
            else (None, None)
        )
        per_model = workers_per_model(campaign, groups, group_models)
        if unread:
            console(stderr=True).print(f"note: {escape(unread)}", highlight=False, soft_wrap=True)
        if executor == "ray":
            from dvfs.fleet.ray_executor import RayExecutor

            # Ray placing several workers on one attached server: refused as the sweep does.
            RayExecutor(out_dir, address=address).check_attached(campaign, groups)
        busy = folder_busy(campaign, out_dir, shard, fresh=fresh)
        if busy:
            console(stderr=True).print(f"note: {escape(busy)}", highlight=False, soft_wrap=True)
        show = not no_progress and not no_estimate and sys.stderr.isatty()
        bar = RichProgress("estimating on the twin", enabled=show)
        with bar:
            plan = plan_dry_run(
                campaign,
                out_dir,
                shard=shard,
                estimate=not no_estimate,
                twin=twin_profile,
                progress=bar if show else EstimateNotice(),
                models=list(per_model),
                fresh=fresh,
                fleet=as_fleet,
                servers_here=executor != "ray",  # Ray's start on its workers' nodes
            )
        report = plan.as_dict()
        if executor == "ray" and real_gpus(campaign) and not fresh and not plan.remaining:
            # The run asks the GPUs Ray places it on for their models; the dry run starts no Ray.
            console(stderr=True).print(
                "note: with Ray the dry run reads no GPU, so the folder is done for the GPU "
                "models it measured; on a cluster that now holds another model, the sweep "
                "measures that model's cells",
                highlight=False,
                soft_wrap=True,
            )
        if len(groups) > 1:
            # A fleet runs each comparison group (batch, corpus, repeat) whole on one worker,
            # each worker a session of its own that starts its drafters' servers, steps its
            # own GPU's knobs and takes its own idle baselines: `dvfs.estimate.fleet_time`
            # counts them as the fleet's queue hands the cells out. GPU models mixed: each
            # runs the whole campaign on its own workers, so the model whose busiest worker
            # spends the most finishes last (not always the one with the fewest workers: each
            # worker starts its own servers; every model's GPU estimated as the campaign's).
            import dataclasses

            from dvfs.estimate import RunCosts, fleet_time

            report["workers"] = len(groups)
            # Real GPUs' models not read: those of the journals resumed.
            report["gpu_models"] = max(len(per_model), plan.runs)
            report["cells_all_models"] = plan.cells * report["gpu_models"]
            # Each model's workers run the cells the model with the most left has left (as
            # estimated), or nothing where its own folder has none left (its workers idle).
            folders = {model: _model_folder(campaign, model) for model in per_model}
            # (A worker with nothing to run still opens its session.)
            idle = RunCosts({}, session_s=plan.costs.session_s)
            fleets = {
                model: (
                    fleet_time((), idle, n)
                    if _none_left(plan, folders[model])
                    else fleet_time(plan.cells_left, plan.costs, n)
                )
                for model, n in per_model.items()
            }
            report["busy_workers"] = sum(f.busy_workers for f in fleets.values())
            report["server_starts"] = sum(f.server_starts for f in fleets.values())
            report["knob_changes"] = sum(f.knob_changes for f in fleets.values())
            report["estimated_makespan_hours"] = round(
                max(f.makespan_s for f in fleets.values()) / 3600, 2
            )
            # The twin's line is of one model's cells (the one with the most left); the closed
            # form's, as the counts, of every model's, each estimated as that one's.
            spent_s = (
                fleets[_most_left_model(per_model, folders, plan)].gpu_s
                if plan.estimate is not None
                else sum(f.gpu_s for f in fleets.values())
            )
            counted = (
                dataclasses.replace(
                    plan, estimate=dataclasses.replace(plan.estimate, dvfs_gpu_s=spent_s)
                )
                if plan.estimate is not None
                else dataclasses.replace(plan, estimated_s=spent_s)
            ).as_dict()
            for key in ("estimated_hours_on_hardware", "estimate", "twin_gpu_s"):
                if key in counted:
                    report[key] = counted[key]
        if as_json:
            echo_json(report)
        else:
            _render_dry_run(report)
        if report["problems"]:
            raise SystemExit(plan.exit_code)
        return
    if as_fleet:
        outcome = run_fleet(
            campaign,
            out_dir,
            groups,
            fresh=fresh,
            progress=not no_progress,
            shard=shard,
            executor=executor,
            address=address,
        )
    else:
        outcome = run(campaign, out_dir, fresh=fresh, progress=not no_progress, shard=shard)
    if outcome.summary.failed:
        raise SystemExit(5)


def folder_busy(
    campaign: Any, out_dir: Path, shard: Any = None, *, fresh: bool = False
) -> str | None:
    """That the sweep would stop on this machine because it cannot use `out_dir` (a file in
    the way, a read-only file system, no permission to write there) or another dvfs sweep
    holds it (its `sweep.lock`), in the sweep's words (`check_out_usable`, read-only), or None.
    The folder's journals' refusals are the plan's to say."""
    from dvfs.errors import DvfsError
    from dvfs.out_folder import check_out_usable

    try:
        check_out_usable(out_dir, fresh=fresh)
    except DvfsError as exc:
        return f"on this machine the sweep would stop: {exc}"
    return None


def _model_folder(campaign: Any, model: str | None) -> str | None:
    """The folder (`gpu-<model>`) a fleet's workers of GPU model `model` journal in; None
    where the names do not tell."""
    from dvfs.fleet.folders import model_folder
    from dvfs.preflight import model_names

    names = model_names(campaign, [model])
    return model_folder(names[0]) if names else None


def _none_left(plan: Any, folder: str | None) -> bool:
    """Whether the GPU model journalling in `folder` has no cell left to run."""
    return folder is not None and plan.left_per_model.get(folder) == 0


def _most_left_model(
    per_model: dict[str | None, int], folders: dict[str | None, str | None], plan: Any
) -> str | None:
    """The GPU model with the most left (`plan.most_left_folder`), whose cells left the dry
    run's figures are of (one model: that one; a model the names do not tell: the one with
    the fewest workers)."""
    if len(per_model) == 1:
        return next(iter(per_model))
    for model in per_model:
        if folders[model] is not None and folders[model] == plan.most_left_folder:
            return model
    return min(per_model, key=lambda model: per_model[model])


def run(campaign: Any, out_dir: Path, *, fresh: bool, progress: bool, shard: Any = None) -> Any:
    """Run the sweep and report; returns the `SweepOutcome` (the caller picks the exit code:
    5 when cells failed)."""
    from dvfs.cli.progress import RichProgress
    from dvfs.errors import ServerReplacedError
    from dvfs.signals import Interrupted, signals_raise
    from dvfs.sweep import SweepRestoreError, run_sweep

    err = console(stderr=True)
    bar = RichProgress(f"{campaign.name}", enabled=progress)
    unrestored: SweepRestoreError | None = None
    try:
        with signals_raise(), bar:
            outcome = run_sweep(campaign, out_dir, fresh=fresh, progress=bar, shard=shard)
    except (KeyboardInterrupt, Interrupted) as exc:
        status = _after_interruption_told(err, campaign, out_dir, shard)
        err.print(f"{status} {_resume_advice(fresh)}", soft_wrap=True)
        restore_error = getattr(exc, "restore_error", None)
        if restore_error is not None:  # the restore the signal unwound to failed: why
            click.echo(f"Error: {one_line(str(restore_error))}", err=True)
        raise
    except ServerReplacedError:
        # Stopped as an interrupted sweep is: the cells measured so far in a partial cube,
        # the GPUs' settings said; its own line (the error) says what to restart and how to
        # resume.
        err.print(_after_interruption_told(err, campaign, out_dir, shard), soft_wrap=True)
        raise
    except SweepRestoreError as exc:
        if exc.outcome is None:
            from dvfs.sweep import interruption_of

            interruption = interruption_of(exc.error)
            if interruption is not None:  # a signal the failed restore held: interrupted
                click.echo(f"Error: {one_line(str(exc))}", err=True)
                raise interruption from None
            raise
        # The cube is written: reported as any sweep's, then the restore's failure (its code).
        outcome, unrestored = exc.outcome, exc
    s = outcome.summary
    invalid = invalid_cells(outcome.cube_path, outcome.cube)
    err.print(
        f"{s.measured} cell(s) measured, {s.failed} failed, {s.skipped} already done"
        + (f", {invalid[0]} invalid in the cube" if invalid else "")
        + f"; journal {escape(str(outcome.journal_path))}",
        soft_wrap=True,
    )
    click.echo(f"cube: {outcome.cube_path}")
    if s.failed:
        shown = ", ".join(s.failed_cells[:3]) + (" ..." if len(s.failed_cells) > 3 else "")
        err.print(
            f"[yellow]Finished with {s.failed} failed cell(s) ({escape(shown)}): the cube is "
            f"written without them; {escape(_failed_advice(s, fresh, shard=shard))} (errors "
            "are in the journal and in `dvfs cube info`).[/yellow]",
            soft_wrap=True,
        )
    if invalid:
        err.print(f"[yellow]{escape(invalid[1])}[/yellow]", soft_wrap=True)
    if unrestored is not None:
        from dvfs.sweep import interruption_of

        interruption = interruption_of(unrestored.error)
        if interruption is not None:  # a signal the failed restore held: interrupted
            click.echo(f"Error: {one_line(str(unrestored))}", err=True)
            raise interruption
        raise unrestored
    return outcome


def invalid_cells(cube_path: Path | None, cube: Any = None) -> tuple[int, str] | None:
    """The cube's invalid cells (count, and one line on the commonest reasons and what to
    change); None when it has none or cannot be read (the sweep's own report came first).
    `cube`: the cube written to `cube_path`, in memory (else it is read back: tens of ms)."""
    if cube_path is None:
        return None
    from dvfs.cube import open_cube
    from dvfs.cube.quality import invalid_reasons, invalid_summary

    try:
        ds = open_cube(cube_path) if cube is None else cube
    except Exception:  # the summary must not fail a finished sweep
        return None
    line = invalid_summary(ds)
    return (invalid_reasons(ds)[0], line) if line else None


def run_fleet(
    campaign: Any,
    out_dir: Path,
    groups: Any,
    *,
    fresh: bool,
    progress: bool,
    shard: Any = None,
    executor: str = "local",
    address: str | None = None,
) -> Any:
    """Run the sweep on one worker per GPU group and report each worker; returns the
    `FleetOutcome`."""
    from dvfs.cli.fleet_progress import RichFleetProgress
    from dvfs.errors import ServerReplacedError
    from dvfs.fleet.driver import run_fleet as drive
    from dvfs.fleet.local import LocalExecutor
    from dvfs.preflight import fleet_models
    from dvfs.signals import Interrupted, signals_raise

    err = console(stderr=True)
    run_on: Any = LocalExecutor(out_dir)
    where = f"{len(groups)} workers"
    if executor == "ray":
        from dvfs.fleet.ray_executor import RayExecutor, import_ray

        import_ray(local=not address)  # one line now if Ray is missing, before anything opens
        run_on = RayExecutor(out_dir, address=address)
        where = "Ray"
    bar = RichFleetProgress(f"{campaign.name} on {where}", enabled=progress)
    try:
        with signals_raise(), bar:
            outcome = drive(
                campaign,
                out_dir,
                groups,
                run_on,
                fresh=fresh,
                progress=bar,
                shard=shard,
                # Ray places its workers on any node's GPUs: their models are not this host's,
                # but those the cluster's GPUs name (a twin's are its profiles', wherever it
                # runs).
                models=(
                    (lambda: run_on.models(campaign, groups, bar.note))
                    if executor == "ray"
                    else lambda: fleet_models(campaign, groups)
                ),
            )
    except (KeyboardInterrupt, Interrupted, ServerReplacedError) as exc:
        # A local worker's restore that failed as it closed (NVML refusing it for want of
        # root): its error and the reset as root said, as a Ray fleet's line says them.
        closed = list(run_on.close_errors.values()) if executor == "local" else []
        status = _after_interruption_told(err, campaign, out_dir, shard, closed)
        if executor == "ray" and run_on.unrestored:
            # With what the closes' restores raised (NVML refusing one for want of root): not
            # "a worker lost its GPU ... once the GPU answers again", which waits for nothing.
            status = _ray_unrestored(run_on.unrestored, run_on.close_errors, run_on.resets)
        if isinstance(exc, ServerReplacedError):  # its own line says how to resume
            err.print(status, soft_wrap=True)
        else:
            err.print(f"{status} {_resume_advice(fresh)}", soft_wrap=True)
        raise
    except Exception as exc:
        # The run failed in its own line (a worker that died as it started, a refusal, a bug
        # in a worker's open whose own close's restore failed), and the other actors' closes,
        # after it, left GPUs changed that the line cannot name.
        if executor == "ray":
            left = run_on.unsaid()
            if left:
                # (the errors of GPUs the run's line named are not said again, as others')
                said = _ray_unrestored(left, run_on.unsaid_errors(), run_on.resets)
                err.print(said, soft_wrap=True)
            # A restore that needs root: exit 4, as the local fleet's (`_restore_exit_code`)
            if run_on.unrestored and _restore_exit_code(run_on.close_errors) == 4:
                _needs_root(exc)
        else:  # the same where a local worker's refusal, or one that could not open, ends it
            kept, state_dir = run_on.unsaid(campaign)
            errors = list(run_on.close_errors.values())
            # A GPU the run's own line names is said there: a worker's close whose restore
            # NVML refused for want of root, that refusal ending the run (its line was said
            # twice, first in the line naming the GPUs left changed)
            kept = [uuid for uuid in kept if uuid not in str(exc)]
            if kept:
                others = [e for e in errors if e is not exc]
                opening = bool(getattr(run_on, "left_opening", ()))
                err.print(
                    _local_unrestored(kept, state_dir, others, opening=opening), soft_wrap=True
                )
                # A restore that needs root: exit 4, as a finished fleet's or one GPU's
                # sweep; the refusal's 2 or 3 hid that root must put the GPUs back. The
                # refusal's own line is still the last.
                if _restore_exit_code(errors) == 4:
                    _needs_root(exc)
        raise
    report_fleet(outcome, fresh=fresh, shard=shard)
    if executor == "ray" and run_on.unrestored:  # every cell may be in: not a success
        from dvfs.gpu.knobs import RestoreBugError

        left, errors = dict(run_on.unrestored), list(run_on.close_errors)
        # A bug in a worker's restore is the run's internal error, as the local fleet's: the
        # GPUs its line names are said there, with its node.
        bug = next((e for e in errors if isinstance(e, RestoreBugError)), None)
        if bug is not None:
            hosts = [h for h, gpus in left.items() if any(g in str(bug) for g in gpus)]
            left = {h: [g for g in gpus if g not in str(bug)] for h, gpus in left.items()}
            left = {h: gpus for h, gpus in left.items() if gpus}
            errors = [e for e in errors if e is not bug]
        if left:
            err.print(_ray_unrestored(left, errors, run_on.resets), soft_wrap=True)
        if bug is not None:
            where = f"on {', '.join(hosts)}: " if hosts else ""
            raised = RestoreBugError(f"{where}{bug}")
            # another worker's restore needs root: exit 4 (`_internal_error`), not 1
            raised.needs_root = bug.needs_root or _restore_exit_code(errors) == 4
            raise raised from bug
        raise SystemExit(_restore_exit_code(errors))
    if executor == "local":  # a Ray worker's GPUs are on its own node, restored there
        from dvfs.gpu.knobs import RestoreBugError
        from dvfs.sweep import unrestored_gpus

        kept, state_dir = unrestored_gpus(campaign)
        if kept:  # every cell may be in, but a GPU keeps the sweep's settings: not a success
            errors = list(run_on.close_errors.values())
            # A bug in a worker's restore (no GPU's error) is the run's internal error, as one
            # GPU's sweep says it, its traceback with -vv: it was "a worker lost its GPU",
            # the bug said in a note alone. The GPUs its line names are said there.
            bug = next((e for e in errors if isinstance(e, RestoreBugError)), None)
            if bug is not None:
                kept = tuple(uuid for uuid in kept if uuid not in str(bug))
                errors = [e for e in errors if e is not bug]
            if kept:
                err.print(_local_unrestored(kept, state_dir, errors), soft_wrap=True)
            if bug is not None:
                # Another worker's restore needs root: the internal error exits 4
                # (`_internal_error`), as without the bug; a 1 hid that root must put it back.
                bug.needs_root = bug.needs_root or _restore_exit_code(errors) == 4
                raise bug
            raise SystemExit(_restore_exit_code(errors))
    return outcome


def _needs_root(exc: Exception) -> None:
    """Make the line `exc` ends the run in exit 4: GPUs are left for root to put back
    (README's exit codes). A dvfs error's code; another's (an internal error, an OSError
    the run failed in: `needs_root`, read by `dvfs.cli.common._failure_code`), which exited 1."""
    from dvfs.errors import DvfsError

    if isinstance(exc, DvfsError):
        exc.exit_code = 4
    else:
        with contextlib.suppress(AttributeError):  # one that takes no attribute keeps its 1
            exc.needs_root = True  # type: ignore[attr-defined]


def _local_unrestored(
    kept: Sequence[str],
    state_dir: Path | None,
    errors: Sequence[BaseException],
    *,
    opening: bool = False,
) -> str:
    """The line naming the GPUs a local fleet left changed (`kept`), why (the restores' own
    errors, else a GPU lost) and the `dvfs gpu reset` to run (as root where NVML refused a
    restore for want of root), as markup: a refused restore's in Ray's words
    (`_not_restored`), less the node. `opening`: the run failed with workers still inside
    `open` (their wait given up), whose GPUs answer: their reset is for now, as Ray's."""
    state = f" (state in {escape(str(state_dir))})"
    failed = _restores_failed(errors)
    if not failed and opening:
        from dvfs.fleet.ray_executor import KILLED_OPENING_RESET

        return (
            f"[red]GPU settings NOT restored[/red] for {', '.join(kept)}: a worker was still "
            "opening its GPUs as the run stopped waiting for it, which may have set their "
            f"clocks or not yet; run {_reset(state_dir)} now ({KILLED_OPENING_RESET}){state}."
        )
    if not failed:
        return (
            f"[red]GPU settings NOT restored[/red] for {', '.join(kept)}: a worker lost its GPU "
            f"before it could put them back; run {_reset(state_dir)} once the GPU answers "
            f"again{state}."
        )
    from dvfs.errors import GpuError
    from dvfs.gpu.knobs import RestoreBugError, restore_error_parts

    resets: list[str] = []
    for error in errors:  # the resets the restores' own lines named, each once
        if isinstance(error, GpuError | RestoreBugError):
            command = restore_error_parts(str(error))[1]
            if command and command not in resets:
                resets.append(command)
    run = escape(" or ".join(resets)) if resets else _reset(state_dir)
    root = " as root" if _root_refused(errors) else ""
    return _not_restored(", ".join(kept), failed, f"{run}{root}", state)


def _not_restored(where: str, failed: str, run: str, tail: str = "") -> str:
    """The line (markup) naming the GPUs `where` whose restores failed, what they said
    (`failed`), and the `dvfs gpu reset` to run (`run`: with " as root" where NVML refused one
    for want of root): the local fleet's and Ray's alike (Ray's `where` and `run` name each
    node)."""
    return f"[red]GPU settings NOT restored[/red] for {where}: {failed}; run {run}{tail}."


def _reset(state_dir: Path | None) -> str:
    """The `dvfs gpu reset` that reads the sweep's state files in `state_dir` (with its
    --state-dir where $DVFS_STATE_DIR chose it, which `sudo` drops), as markup."""
    from dvfs.gpu.safety import reset_command

    return "`dvfs gpu reset`" if state_dir is None else escape(reset_command(state_dir))


def _restores_failed(errors: Sequence[BaseException]) -> str:
    """What the workers' restores that failed said (NVML refusing a reset, a GPU lost, a bug), as
    one GPU's sweep says it, without the `dvfs gpu reset` each names (the fleet's line names each
    node's); "" where none did (a worker's process died)."""
    from dvfs.errors import GpuError
    from dvfs.gpu.knobs import RestoreBugError, restore_error_parts

    said: list[str] = []
    for error in errors:
        # (a bug in a restore too: its line names the GPU and the bug, not a GPU lost)
        if isinstance(error, GpuError | RestoreBugError):
            text, _command = restore_error_parts(str(error))
            said.append(text.rstrip("."))
    return escape("; ".join(said)) if said else ""


def _restore_exit_code(errors: Sequence[BaseException]) -> int:
    """A fleet's exit code where GPUs were left changed: 4 where a restore needs root, as one
    GPU's sweep, else 1."""
    from dvfs.errors import GpuPermissionError

    return 4 if any(isinstance(e, GpuPermissionError) for e in errors) else 1


def _resume_advice(fresh: bool) -> str:
    """How an interrupted sweep resumes: its command again, less --fresh (which would move
    the journal it began aside, unread, and start over)."""
    if fresh:
        return "Run the same command again without --fresh to resume (with it, it starts over)."
    return "Run the same command again to resume."


def _retry_advice(fresh: bool) -> str:
    """How a sweep's failed cells are retried: its command again, less --fresh (which would
    move the journal aside and measure every cell again, not the failed ones)."""
    if fresh:
        return (
            "rerun the same command without --fresh to retry them (with it, every cell is "
            "measured again)"
        )
    return "rerun the same command to retry them"


def _failed_advice(summary: Any, fresh: bool, *, several: bool = False, shard: Any = None) -> str:
    """How a sweep's failed cells are retried. Those SGLang would not start the server of for
    the campaign as it is (`unfit`: weights too large for the GPUs, a --context-length above
    the model's) fail again on a rerun: the campaign must change as their refusal says, and a
    changed campaign cannot resume the journal, so it runs with --fresh or into another --out.
    The others (`_refused_advice`, `_retry_advice`) are retried by the same command.
    `several`: the sweep keeps several journals (a fleet mixing GPU models: one per model);
    `shard`: a shard's sweep, whose changed campaign every shard must sweep again alike."""
    these = "these journals" if several else "this journal"
    unfit = getattr(summary, "unfit", 0)
    others = summary.failed - unfit
    retry = f"{_refused_advice(summary, others)}{_retry_advice(fresh)}"
    if not unfit:
        return retry
    which = "they" if not others else f"{unfit} of them"
    drafters = ", ".join(repr(d) for d in summary.unfit_drafters)
    one = len(summary.unfit_drafters) == 1
    advice = (
        f"{which} failed as SGLang would not start the server of drafter{'' if one else 's'} "
        f"{drafters} for the campaign as it is, which the same command meets again: change the "
        f"campaign ({'; '.join(summary.unfit_fixes)}), then run it "
        f"{'again ' if fresh else ''}with --fresh (which moves {these} aside and measures "
        "every cell again) or with another --out folder, as a changed campaign cannot resume "
        f"{these}"
    )
    if shard is not None:  # `dvfs cube merge` merges the shards of one campaign alone
        advice += (
            "; run every shard so (with --fresh or another --out folder), not only this one: "
            "`dvfs cube merge` merges the shards of one campaign alone"
        )
    if any("engine.sglang.env" in fix for fix in summary.unfit_fixes):
        # the server's environment may change between runs (`check_resumable`): resumed
        advice += (
            f"; a change to engine.sglang.env alone resumes {'them' if several else 'it'}: "
            "then rerun the same command"
        )
    if not others:
        return advice
    return f"{advice}; the other {others}: {retry}"


def _refused_advice(summary: Any, failed: int | None = None) -> str:
    """What to do before a rerun retries the failed cells whose server was refused (another
    SGLang or other flags than the journal's): its refusal's fix, then the rerun; "" where no
    server was refused (a rerun alone retries them). `failed`: of how many failed cells (None:
    all the summary's)."""
    if not summary.refused:
        return ""
    failed = summary.failed if failed is None else failed
    which = "they" if summary.refused == failed else f"{summary.refused} of them"
    return f"{which} failed as their server was refused: {'; '.join(summary.refused_fixes)}, then "


def _after_interruption_told(
    err: Any,
    campaign: Any,
    out_dir: Path,
    shard: Any = None,
    errors: Sequence[BaseException] = (),
) -> str:
    """After an interrupted sweep: say where its partial cube is (or why there is none; or
    that it is whole, a finished folder stopped before anything was left to measure) and
    return the line on the GPUs' settings, to which the caller adds how to resume; with what
    the restores of the GPUs it names raised (`errors`: a local fleet's workers' closes)."""
    from dvfs.report.headroom import holds_no_session
    from dvfs.sweep import after_interruption

    left = after_interruption(campaign, out_dir, shard)
    if left.cube_path is not None and left.whole:
        err.print(
            f"cube written to {escape(str(left.cube_path))} (whole: the folder already held "
            "every cell)",
            soft_wrap=True,
        )
    elif left.cube_path is not None:
        err.print(f"partial cube written to {escape(str(left.cube_path))}", soft_wrap=True)
    for journal in left.left_out:  # as `dvfs cube build` says it: else the model goes unnoticed
        err.print(
            f"{escape(holds_no_session(journal))} (nothing measured on that GPU model): "
            "left out of the cube",
            soft_wrap=True,
            highlight=False,
        )
    if left.cube_error is not None:
        cube = "cube" if left.whole else "partial cube"
        err.print(f"(no {cube}: {escape(left.cube_error)})", soft_wrap=True)
    from dvfs.errors import GpuPermissionError

    errors = [e for e in errors if any(uuid in str(e) for uuid in left.unrestored)]
    root = any(isinstance(e, GpuPermissionError) or getattr(e, "needs_root", False) for e in errors)
    why = _restores_failed(errors)  # the reset said after it, once
    return restore_status(left.unrestored, left.state_dir, why=why, root=root)


def _ray_unrestored(
    left: dict[str, list[str]],
    errors: Sequence[BaseException] = (),
    resets: dict[str, str] | None = None,
) -> str:
    """The line for the GPUs Ray workers did not put back, each node's with `dvfs gpu reset`
    there (the state files are on that node; `resets`: each node's command, as its actors
    told it, with the --state-dir that reads their state files where needed); why, where a
    worker's restore said it (`errors`: what the actors' closes raised)."""
    where = "; ".join(f"{', '.join(gpus)} on {host}" for host, gpus in left.items())
    # A node where NVML refused a restore of its GPUs for want of root: its reset as root,
    # as the local fleet's line and `reset_first` say it (it said a plain reset there).
    from dvfs.fleet.ray_executor import KILLED_OPENING_RESET, killed_opening

    root = _root_refused(errors)
    failed = _restores_failed(errors)  # `run` names each node's
    by_command: dict[tuple[str, bool, bool], list[str]] = {}
    for host, gpus in left.items():
        command = (resets or {}).get(host, "`dvfs gpu reset`")
        as_root = any(gpu in text for gpu in gpus for text in root)
        # Its actors killed as they opened: their GPUs answer, their reset is for now
        now = all(killed_opening(gpu) for gpu in gpus)
        by_command.setdefault((command, as_root, now), []).append(host)
    killed = any(now for _, _, now in by_command)
    lost = any(not now for _, _, now in by_command)
    when = {True: " now", False: " once the GPU answers again" if killed else ""}
    run = escape(
        ", ".join(
            f"{command} on {', '.join(hosts)}{' as root' if as_root else ''}"
            f"{when[now] if now or not failed else ''}"
            for (command, as_root, now), hosts in by_command.items()
        )
    )
    if failed:
        return _not_restored(escape(where), failed, run)
    if not killed:
        return (
            f"[red]GPU settings NOT restored[/red] for {escape(where)}: a worker lost its GPU, "
            f"or its actor died or was stopped, before it could put them back; run {run} once "
            "the GPU answers again."
        )
    why = "its actor was killed as it opened its GPUs, which may have set their clocks or not yet"
    if lost:
        why = (
            "a worker lost its GPU, or its actor died, was stopped or was killed as it opened "
            "its GPUs (which may have set their clocks or not yet), before it could put them back"
        )
    return (
        f"[red]GPU settings NOT restored[/red] for {escape(where)}: {why}; run {run} "
        f"({KILLED_OPENING_RESET})."
    )


def _root_refused(errors: Sequence[BaseException]) -> list[str]:
    """The lines of the restores of `errors` that NVML refused for want of root (a
    `GpuPermissionError`, or a bug's line naming another GPU's refusal: `needs_root`)."""
    from dvfs.errors import GpuPermissionError

    return [
        str(e)
        for e in errors
        if isinstance(e, GpuPermissionError) or getattr(e, "needs_root", False)
    ]


def _journals_text(path: Path) -> str:
    """Where the journal is: the folder's, or (a fleet mixing GPU models, whose outcome names
    the folder) each model's in its `gpu-*/` folder."""
    from dvfs.measure.journal import JOURNAL_NAME

    return f"journals {path / 'gpu-*' / JOURNAL_NAME}" if path.is_dir() else f"journal {path}"


def report_fleet(outcome: Any, *, fresh: bool = False, shard: Any = None) -> None:
    """Per worker: cells and GPU time; then the whole, as `run` reports a sweep."""
    err = console(stderr=True)
    for w in outcome.workers:
        lost = f" [red]{w.gone}: {escape(w.lost)}[/red]" if w.lost else ""
        err.print(
            f"{w.label}{' on ' + w.host if w.host else ''}: {w.done} cell(s), {w.failed} "
            f"failed, {w.gpu_time_s / 3600:.2f} h of GPU time{lost}"
        )
    s = outcome.summary
    # a fleet mixing GPU models keeps a journal per model, in the folder its outcome names
    several = outcome.journal_path.is_dir()
    invalid = invalid_cells(outcome.cube_path, outcome.cube)
    err.print(
        f"{s.measured} cell(s) measured, {s.failed} failed, {s.skipped} already done"
        + (f", {invalid[0]} invalid in the cube" if invalid else "")
        + f"; makespan {outcome.makespan_gpu_s / 3600:.2f} h of GPU time; "
        + escape(_journals_text(outcome.journal_path)),
        soft_wrap=True,
    )
    click.echo(f"cube: {outcome.cube_path}")
    if s.failed:
        shown = ", ".join(s.failed_cells[:3]) + (" ..." if len(s.failed_cells) > 3 else "")
        err.print(
            f"[yellow]Finished with {s.failed} failed cell(s) ({escape(shown)}): "
            f"{escape(_failed_advice(s, fresh, several=several, shard=shard))}.[/yellow]",
            soft_wrap=True,
        )
    if invalid:
        err.print(f"[yellow]{escape(invalid[1])}[/yellow]", soft_wrap=True)
